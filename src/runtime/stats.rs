//! Counters the runtime keeps per model, shared with the handle (tests, bench, metrics).

use super::batcher::ReleaseReason;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// Most recent step intervals kept per model.
const STEP_LOG_CAPACITY: usize = 4096;

#[derive(Debug, Clone, Copy)]
pub struct StepInterval {
    pub start: Instant,
    pub end: Instant,
    pub batch: usize,
}

impl StepInterval {
    /// `(batch, milliseconds)`: a sample for fitting L(b).
    pub fn latency_sample(&self) -> (usize, f64) {
        (self.batch, (self.end - self.start).as_secs_f64() * 1e3)
    }
}

pub struct ModelStats {
    pub steps: AtomicU64,
    /// Sum of batch sizes over steps (mean batch = rows_stepped / steps).
    pub rows_stepped: AtomicU64,
    /// Tokens fed through the forward pass (prompt, catch-up and decode).
    pub tokens_processed: AtomicU64,
    /// KV sequences created (a new request, or every return in `standard` mode).
    pub kv_allocations: AtomicU64,
    /// Prefix-cache lookups (`standard` mode returns).
    pub prefix_lookups: AtomicU64,
    pub restarts: AtomicU64,
    /// Pending requests whose KV was taken for others (they re-prefill on return).
    pub preemptions: AtomicU64,
    pub kv_tokens_used: AtomicUsize,
    pub pending: AtomicUsize,
    pub releases: Mutex<[u64; ReleaseReason::COUNT]>,
    /// Waits of arrivals in this model's batcher: longest, total, count (microseconds).
    pub max_admission_delay_us: AtomicU64,
    pub admission_delay_us_total: AtomicU64,
    pub admissions: AtomicU64,
    /// The batcher's threshold B in force.
    pub threshold: AtomicUsize,
    /// Per target model j: request steps here followed by a step on j, and the tokens those
    /// steps committed (the online estimate of the routing matrix reads these).
    pub routed_to: Vec<AtomicU64>,
    pub committed_to: Vec<AtomicU64>,
    steps_log: Mutex<Vec<StepInterval>>,
}

impl ModelStats {
    fn new(models: usize, threshold: usize) -> Self {
        let counters = || (0..models).map(|_| AtomicU64::new(0)).collect();
        Self {
            steps: AtomicU64::new(0),
            rows_stepped: AtomicU64::new(0),
            tokens_processed: AtomicU64::new(0),
            kv_allocations: AtomicU64::new(0),
            prefix_lookups: AtomicU64::new(0),
            restarts: AtomicU64::new(0),
            preemptions: AtomicU64::new(0),
            kv_tokens_used: AtomicUsize::new(0),
            pending: AtomicUsize::new(0),
            releases: Mutex::new([0; ReleaseReason::COUNT]),
            max_admission_delay_us: AtomicU64::new(0),
            admission_delay_us_total: AtomicU64::new(0),
            admissions: AtomicU64::new(0),
            threshold: AtomicUsize::new(threshold),
            routed_to: counters(),
            committed_to: counters(),
            steps_log: Mutex::new(Vec::new()),
        }
    }

    /// One request step here followed by a step on `to`, committing `tokens`.
    pub fn record_route(&self, to: usize, tokens: u64) {
        self.routed_to[to].fetch_add(1, Ordering::Relaxed);
        self.committed_to[to].fetch_add(tokens, Ordering::Relaxed);
    }

    pub fn record_admission_delay(&self, delay: std::time::Duration) {
        let us = delay.as_micros() as u64;
        self.max_admission_delay_us.fetch_max(us, Ordering::Relaxed);
        self.admission_delay_us_total
            .fetch_add(us, Ordering::Relaxed);
        self.admissions.fetch_add(1, Ordering::Relaxed);
    }
    pub fn record_step(&self, interval: StepInterval, tokens: usize) {
        self.steps.fetch_add(1, Ordering::Relaxed);
        self.rows_stepped
            .fetch_add(interval.batch as u64, Ordering::Relaxed);
        self.tokens_processed
            .fetch_add(tokens as u64, Ordering::Relaxed);
        let mut log = self.steps_log.lock().expect("stats lock");
        if log.len() == STEP_LOG_CAPACITY {
            log.remove(0);
        }
        log.push(interval);
    }

    pub fn record_release(&self, reason: ReleaseReason) {
        self.releases.lock().expect("stats lock")[reason as usize] += 1;
    }

    pub fn step_log(&self) -> Vec<StepInterval> {
        self.steps_log.lock().expect("stats lock").clone()
    }

    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

pub struct RuntimeStats {
    pub models: Vec<ModelStats>,
}

impl RuntimeStats {
    /// Cumulative route decisions `[i][j]` (steps on i followed by one on j) and the tokens
    /// they committed.
    pub fn routing_counts(&self) -> (Vec<Vec<u64>>, Vec<Vec<u64>>) {
        let matrix = |pick: fn(&ModelStats) -> &Vec<AtomicU64>| {
            self.models
                .iter()
                .map(|m| pick(m).iter().map(|c| c.load(Ordering::Relaxed)).collect())
                .collect()
        };
        (matrix(|m| &m.routed_to), matrix(|m| &m.committed_to))
    }

    /// `thresholds[i]`: model i's initial batching threshold.
    pub fn new(thresholds: &[usize]) -> Self {
        let models = thresholds.len();
        Self {
            models: thresholds
                .iter()
                .map(|&b| ModelStats::new(models, b))
                .collect(),
        }
    }
}

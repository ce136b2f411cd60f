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

#[derive(Default)]
pub struct ModelStats {
    pub steps: AtomicU64,
    /// Tokens fed through the forward pass (prompt, catch-up and decode).
    pub tokens_processed: AtomicU64,
    /// KV sequences created (a new request, or every return in `standard` mode).
    pub kv_allocations: AtomicU64,
    /// Prefix-cache lookups (`standard` mode returns).
    pub prefix_lookups: AtomicU64,
    pub restarts: AtomicU64,
    pub kv_tokens_used: AtomicUsize,
    pub pending: AtomicUsize,
    pub releases: Mutex<[u64; ReleaseReason::COUNT]>,
    steps_log: Mutex<Vec<StepInterval>>,
}

impl ModelStats {
    pub fn record_step(&self, interval: StepInterval, tokens: usize) {
        self.steps.fetch_add(1, Ordering::Relaxed);
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
    pub fn new(models: usize) -> Self {
        Self {
            models: (0..models).map(|_| ModelStats::default()).collect(),
        }
    }
}

//! What each model did, recorded once per event: a `ModelRecorder` call updates the
//! plain-data record the runtime's typed snapshot reads and the Prometheus facade alike.

use super::core::{ReleaseReason, SchedulerCounters};
use crate::engine::{KvUsage, PrefixCounters};
use crate::telemetry::{BatcherMetrics, ModelMetrics};
use crate::tuning::controller::ArmComparison;
use serde::Serialize;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Most recent step intervals kept per model.
const STEP_LOG_CAPACITY: usize = 4096;

#[derive(Debug, Clone, Copy)]
pub struct StepInterval {
    pub start: Instant,
    pub end: Instant,
    /// Rows (requests) in the step.
    pub batch: usize,
    /// Tokens the rows appended.
    pub tokens: usize,
    /// The model actor's own time around the step: scheduling it, then applying its results
    /// (policies, commits, handoffs); unknown for a step another process ran.
    pub host: Option<Duration>,
}

impl StepInterval {
    /// `(batch, milliseconds)`: a sample for fitting L(b).
    pub fn latency_sample(&self) -> (usize, f64) {
        (self.batch, (self.end - self.start).as_secs_f64() * 1e3)
    }

    /// `(rows, tokens, milliseconds)`: a sample for `fit_request_latency`.
    pub fn request_sample(&self) -> (usize, usize, f64) {
        let (batch, ms) = self.latency_sample();
        (batch, self.tokens, ms)
    }
}

/// Batches a model's batcher released, by reason.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Releases {
    pub ready: u64,
    pub threshold: u64,
    pub timeout: u64,
    pub all_here: u64,
}

impl Releases {
    fn count(&mut self, reason: ReleaseReason) {
        *match reason {
            ReleaseReason::Ready => &mut self.ready,
            ReleaseReason::Threshold => &mut self.threshold,
            ReleaseReason::Timeout => &mut self.timeout,
            ReleaseReason::AllHere => &mut self.all_here,
        } += 1;
    }
}

/// One model's figures at one moment.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ModelSnapshot {
    pub name: String,
    pub steps: u64,
    /// Sum of batch sizes over steps (mean batch = rows_stepped / steps).
    pub rows_stepped: u64,
    /// Tokens fed through the forward pass (prompt, catch-up and decode).
    pub tokens_processed: u64,
    /// KV sequences created (a new request, a return in `standard` mode, a re-prefill).
    pub kv_allocations: u64,
    /// Requests whose KV was taken for others (they re-prefill, from the prefix cache
    /// where their blocks survive).
    pub preemptions: u64,
    /// Rows that appended a chunk of their unseen tokens (the step token budget).
    pub chunked_rows: u64,
    /// Row-steps a request waited for another row computing the same prefix.
    pub prefix_waits: u64,
    pub prefix_cache: PrefixCounters,
    pub restarts: u64,
    /// KV blocks referenced by requests, in tokens.
    pub kv_tokens_used: usize,
    /// KV blocks only the prefix cache holds (evictable), in tokens.
    pub kv_tokens_cached: usize,
    /// Requests that left this model and keep their KV here.
    pub pending: usize,
    /// Arrivals held by this model's batcher.
    pub waiting: usize,
    pub releases: Releases,
    /// Waits of arrivals in this model's batcher.
    pub admissions: u64,
    pub admission_delay_total: Duration,
    pub admission_delay_max: Duration,
    /// The batcher's threshold B in force.
    pub threshold: usize,
    /// Per target model j: request steps here followed by a step on j, and the tokens those
    /// steps committed (the online estimate of the routing matrix reads these).
    pub routed_to: Vec<u64>,
    pub committed_to: Vec<u64>,
    /// The most recent steps, oldest first.
    #[serde(skip)]
    pub recent_steps: Vec<StepInterval>,
}

impl ModelSnapshot {
    pub fn mean_batch(&self) -> f64 {
        self.rows_stepped as f64 / self.steps.max(1) as f64
    }
}

struct ModelRecord {
    figures: ModelSnapshot,
    steps: VecDeque<StepInterval>,
}

impl ModelRecord {
    /// Counts a step and keeps it in the log (the oldest goes when the log is full).
    fn log_step(&mut self, interval: StepInterval) {
        self.figures.steps += 1;
        self.figures.rows_stepped += interval.batch as u64;
        self.figures.tokens_processed += interval.tokens as u64;
        if self.steps.len() == STEP_LOG_CAPACITY {
            self.steps.pop_front();
        }
        self.steps.push_back(interval);
    }
}

/// The single recording point of one model's events (its model actor and its batcher
/// share it).
#[derive(Clone)]
pub(crate) struct ModelRecorder {
    record: Arc<Mutex<ModelRecord>>,
    model_metrics: Arc<ModelMetrics>,
    batcher_metrics: Arc<BatcherMetrics>,
}

impl ModelRecorder {
    pub fn new(name: &str, models: usize, threshold: usize) -> Self {
        let batcher_metrics =
            BatcherMetrics::new(name, &ReleaseReason::ALL.map(ReleaseReason::as_str));
        batcher_metrics.threshold(threshold);
        Self {
            record: Arc::new(Mutex::new(ModelRecord {
                figures: ModelSnapshot {
                    name: name.to_string(),
                    threshold,
                    routed_to: vec![0; models],
                    committed_to: vec![0; models],
                    ..ModelSnapshot::default()
                },
                steps: VecDeque::with_capacity(STEP_LOG_CAPACITY),
            })),
            model_metrics: Arc::new(ModelMetrics::new(name)),
            batcher_metrics: Arc::new(batcher_metrics),
        }
    }

    fn with<R>(&self, f: impl FnOnce(&mut ModelRecord) -> R) -> R {
        f(&mut self.record.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// One figure, read in place (a snapshot also copies the step log).
    pub fn read<R>(&self, figure: impl FnOnce(&ModelSnapshot) -> R) -> R {
        self.with(|r| figure(&r.figures))
    }

    pub fn snapshot(&self) -> ModelSnapshot {
        self.with(|r| ModelSnapshot {
            recent_steps: r.steps.iter().copied().collect(),
            ..r.figures.clone()
        })
    }

    /// The last `n` step intervals, oldest first.
    pub fn recent_steps(&self, n: usize) -> Vec<StepInterval> {
        self.with(|r| {
            r.steps
                .iter()
                .skip(r.steps.len().saturating_sub(n))
                .copied()
                .collect()
        })
    }

    /// Steps recorded after the first `seen` (at most the log's), and how many there have
    /// been in all.
    pub fn steps_after(&self, seen: u64) -> (Vec<StepInterval>, u64) {
        self.with(|r| {
            let total = r.figures.steps;
            let new = (total.saturating_sub(seen) as usize).min(r.steps.len());
            let steps = r.steps.iter().skip(r.steps.len() - new).copied().collect();
            (steps, total)
        })
    }

    /// Takes what another process recorded of this model: its steps (rows, tokens,
    /// duration; logged as ending now) and route decisions since the last digest. Only the
    /// record moves, not this process's metrics: the host exports its own.
    pub fn absorb_remote(
        &self,
        steps: &[(usize, usize, Duration)],
        routed_to: &[u64],
        committed_to: &[u64],
    ) {
        let end = Instant::now();
        self.with(|r| {
            for &(batch, tokens, took) in steps {
                r.log_step(StepInterval {
                    start: end.checked_sub(took).unwrap_or(end),
                    end,
                    batch,
                    tokens,
                    host: None,
                });
            }
            let f = &mut r.figures;
            for (total, add) in f.routed_to.iter_mut().zip(routed_to) {
                *total += add;
            }
            for (total, add) in f.committed_to.iter_mut().zip(committed_to) {
                *total += add;
            }
        });
    }

    pub fn step(&self, interval: StepInterval) {
        let seconds = (interval.end - interval.start).as_secs_f64();
        self.model_metrics.step(seconds, interval.batch);
        self.with(|r| r.log_step(interval));
    }

    /// One request step here followed by a step on `to`; `committed`: its token was kept.
    pub fn routed(&self, to: usize, committed: bool) {
        self.with(|r| {
            r.figures.routed_to[to] += 1;
            r.figures.committed_to[to] += committed as u64;
        });
    }

    pub fn committed(&self, policy: &str) {
        self.model_metrics.committed(policy, 1);
    }

    pub fn handoff(&self, to_model: &str, policy: &str) {
        self.model_metrics.handoff(to_model, policy);
    }

    /// The model's KV in use and its scheduler's state after a change.
    pub fn usage(
        &self,
        kv: KvUsage,
        prefix: PrefixCounters,
        pending: usize,
        counters: SchedulerCounters,
    ) {
        self.model_metrics.usage(&kv, &prefix, pending);
        self.with(|r| {
            r.figures.kv_tokens_used = kv.used_tokens;
            r.figures.kv_tokens_cached = kv.cached_tokens;
            r.figures.prefix_cache = prefix;
            r.figures.pending = pending;
            r.figures.kv_allocations = counters.kv_allocations;
            r.figures.preemptions = counters.preemptions;
            r.figures.chunked_rows = counters.chunked_rows;
            r.figures.prefix_waits = counters.prefix_waits;
        });
    }

    pub fn restarted(&self) {
        self.model_metrics.restarted();
        self.with(|r| r.figures.restarts += 1);
    }

    /// A batch released for `reason`, with each arrival's wait in the batcher.
    pub fn released(&self, reason: ReleaseReason, delays: &[Duration]) {
        self.batcher_metrics.released(reason as usize);
        for delay in delays {
            self.batcher_metrics.admitted(delay.as_secs_f64());
        }
        self.batcher_metrics.waiting(0);
        self.with(|r| {
            let f = &mut r.figures;
            f.releases.count(reason);
            f.waiting = 0;
            for &delay in delays {
                f.admissions += 1;
                f.admission_delay_total += delay;
                f.admission_delay_max = f.admission_delay_max.max(delay);
            }
        });
    }

    pub fn waiting(&self, n: usize) {
        self.batcher_metrics.waiting(n);
        self.with(|r| r.figures.waiting = n);
    }

    pub fn threshold(&self, b: usize) {
        self.batcher_metrics.threshold(b);
        self.with(|r| r.figures.threshold = b);
    }
}

/// The whole runtime at one moment.
#[derive(Debug, Clone, Serialize)]
pub struct RuntimeSnapshot {
    pub mode: crate::config::ExecutionMode,
    /// Requests that have not ended yet.
    pub live_requests: usize,
    pub models: Vec<ModelSnapshot>,
    /// `tokenrouter` mode with re-tuning: the tuned thresholds against eager launch.
    pub controller: Option<ArmComparison>,
}

impl RuntimeSnapshot {
    /// Cumulative route decisions `[i][j]` (steps on i followed by one on j) and the tokens
    /// they committed.
    pub fn routing_counts(&self) -> (Vec<Vec<u64>>, Vec<Vec<u64>>) {
        (
            self.models.iter().map(|m| m.routed_to.clone()).collect(),
            self.models.iter().map(|m| m.committed_to.clone()).collect(),
        )
    }
}

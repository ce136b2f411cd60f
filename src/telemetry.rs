//! Every metric the server exports: name, description, labels and histogram buckets in one
//! place. Recording goes through the `metrics` facade, so the CLI and the bench,
//! which install no recorder, pay nothing.

use crate::engine::{KvUsage, PrefixCounters};
use crate::tuning::controller::{Arm, ArmComparison};
use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram};
use metrics::{Counter, Gauge, Histogram, Unit};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use std::sync::OnceLock;

pub const HANDOFFS_TOTAL: &str = "tokenrouter_handoffs_total";
pub const TOKENS_TOTAL: &str = "tokenrouter_tokens_total";
pub const STEP_SECONDS: &str = "tokenrouter_step_seconds";
pub const BATCH_SIZE: &str = "tokenrouter_batch_size";
pub const BATCH_RELEASE_TOTAL: &str = "tokenrouter_batch_release_total";
pub const ADMISSION_DELAY_SECONDS: &str = "tokenrouter_admission_delay_seconds";
pub const PENDING_REQUESTS: &str = "tokenrouter_pending_requests";
pub const WAITING_REQUESTS: &str = "tokenrouter_waiting_requests";
pub const KV_TOKENS_USED: &str = "tokenrouter_kv_tokens_used";
pub const CONTROLLER_TOKENS_PER_SECOND: &str = "tokenrouter_controller_tokens_per_second";
pub const CONTROLLER_EAGER_CHOSEN: &str = "tokenrouter_controller_eager_chosen";
pub const KV_TOKENS_CACHED: &str = "tokenrouter_kv_tokens_cached";
pub const KV_TOKENS_CAPACITY: &str = "tokenrouter_kv_tokens_capacity";
pub const PREFIX_CACHE_HITS_TOTAL: &str = "tokenrouter_prefix_cache_hits_total";
pub const PREFIX_CACHE_HIT_TOKENS_TOTAL: &str = "tokenrouter_prefix_cache_hit_tokens_total";
pub const PREFIX_CACHE_LOOKUPS_TOTAL: &str = "tokenrouter_prefix_cache_lookups_total";
pub const PREFIX_CACHE_EVICTIONS_TOTAL: &str = "tokenrouter_prefix_cache_evictions_total";
pub const THRESHOLD: &str = "tokenrouter_threshold";
pub const REQUESTS_TOTAL: &str = "tokenrouter_requests_total";
pub const TIME_TO_FIRST_TOKEN_SECONDS: &str = "tokenrouter_time_to_first_token_seconds";
pub const INTER_TOKEN_LATENCY_SECONDS: &str = "tokenrouter_inter_token_latency_seconds";
pub const REQUEST_DURATION_SECONDS: &str = "tokenrouter_request_duration_seconds";
pub const POLICY_SWAPS_TOTAL: &str = "tokenrouter_policy_swaps_total";
pub const MODEL_RESTARTS_TOTAL: &str = "tokenrouter_model_restarts_total";
pub const CLUSTER_REPLICA_UP: &str = "tokenrouter_cluster_replica_up";
pub const CLUSTER_REPLICA_LOAD: &str = "tokenrouter_cluster_replica_load";
pub const CLUSTER_PLACEMENTS_TOTAL: &str = "tokenrouter_cluster_placements_total";
pub const CLUSTER_BUS_RTT_SECONDS: &str = "tokenrouter_cluster_bus_rtt_seconds";
pub const CLUSTER_HANDOFF_TRANSIT_SECONDS: &str = "tokenrouter_cluster_handoff_transit_seconds";
pub const LIVE_REQUESTS: &str = "tokenrouter_live_requests";

/// Step and delay buckets: CPU steps take 5–200 ms, GPU steps well under 5 ms.
const LATENCY_BUCKETS: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12,
];
const REQUEST_BUCKETS: [f64; 12] = [
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0,
];
const BATCH_BUCKETS: [f64; 9] = [1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0, 64.0];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the process-wide Prometheus recorder (the `metrics` facade has exactly one) and
/// describes every metric; later calls return the same handle.
pub fn install() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let builder = [
                (STEP_SECONDS, &LATENCY_BUCKETS[..]),
                (ADMISSION_DELAY_SECONDS, &LATENCY_BUCKETS[..]),
                (INTER_TOKEN_LATENCY_SECONDS, &LATENCY_BUCKETS[..]),
                (TIME_TO_FIRST_TOKEN_SECONDS, &REQUEST_BUCKETS[..]),
                (REQUEST_DURATION_SECONDS, &REQUEST_BUCKETS[..]),
                (BATCH_SIZE, &BATCH_BUCKETS[..]),
                (CLUSTER_BUS_RTT_SECONDS, &LATENCY_BUCKETS[..]),
                (CLUSTER_HANDOFF_TRANSIT_SECONDS, &LATENCY_BUCKETS[..]),
            ]
            .into_iter()
            .fold(PrometheusBuilder::new(), |b, (name, buckets)| {
                b.set_buckets_for_metric(Matcher::Full(name.into()), buckets)
                    .expect("bucket lists are non-empty")
            });
            let handle = builder
                .install_recorder()
                .expect("no other metrics recorder is installed in this process");
            describe();
            counter!(POLICY_SWAPS_TOTAL).absolute(0);
            handle
        })
        .clone()
}

fn describe() {
    describe_counter!(
        HANDOFFS_TOTAL,
        "Requests handed from one model to another, by policy"
    );
    describe_counter!(
        TOKENS_TOTAL,
        "Generated tokens committed, by writing model and policy"
    );
    describe_histogram!(
        STEP_SECONDS,
        Unit::Seconds,
        "Duration of one batched forward step"
    );
    describe_histogram!(BATCH_SIZE, "Requests in one forward step");
    describe_counter!(
        BATCH_RELEASE_TOTAL,
        "Batches released by a model's batcher, by reason (ready, threshold, timeout, all_here)"
    );
    describe_histogram!(
        ADMISSION_DELAY_SECONDS,
        Unit::Seconds,
        "Time an arrival waited in a batcher before its step"
    );
    describe_gauge!(
        PENDING_REQUESTS,
        "Requests that left this model and keep their KV here"
    );
    describe_gauge!(WAITING_REQUESTS, "Arrivals held by this model's batcher");
    describe_gauge!(
        LIVE_REQUESTS,
        "Requests not yet ended, in the whole deployment as this process counts them (what \
         its batchers release by and its tuner tunes for)"
    );
    describe_gauge!(
        KV_TOKENS_USED,
        "KV cache tokens in blocks that requests of this model reference"
    );
    describe_gauge!(
        KV_TOKENS_CACHED,
        "KV cache tokens only the prefix cache holds (evictable)"
    );
    describe_gauge!(
        KV_TOKENS_CAPACITY,
        "This model's KV budget in tokens (requests and prefix cache)"
    );
    describe_gauge!(
        CONTROLLER_TOKENS_PER_SECOND,
        "Committed tokens/s of the tuned thresholds and of eager launch (the eager check)"
    );
    describe_gauge!(
        CONTROLLER_EAGER_CHOSEN,
        "1 while eager launch measured faster than the tuned thresholds"
    );
    describe_counter!(
        PREFIX_CACHE_LOOKUPS_TOTAL,
        "New KV sequences looked up in the prefix cache"
    );
    describe_counter!(
        PREFIX_CACHE_HITS_TOTAL,
        "Prefix-cache lookups that matched at least one token"
    );
    describe_counter!(
        PREFIX_CACHE_HIT_TOKENS_TOTAL,
        "Positions taken from the prefix cache instead of computed"
    );
    describe_counter!(
        PREFIX_CACHE_EVICTIONS_TOTAL,
        "Cached KV blocks evicted to make room"
    );
    describe_gauge!(THRESHOLD, "This model's delayed-batching threshold B");
    describe_counter!(
        REQUESTS_TOTAL,
        "Finished requests, by policy and status (completed, failed, cancelled, deadline)"
    );
    describe_histogram!(
        TIME_TO_FIRST_TOKEN_SECONDS,
        Unit::Seconds,
        "Submission to first committed token"
    );
    describe_histogram!(
        INTER_TOKEN_LATENCY_SECONDS,
        Unit::Seconds,
        "Time between consecutive committed tokens of a request"
    );
    describe_histogram!(
        REQUEST_DURATION_SECONDS,
        Unit::Seconds,
        "Submission to the end of a completed request"
    );
    describe_counter!(
        POLICY_SWAPS_TOTAL,
        "Successful policy registry swaps (admin API or SIGHUP)"
    );
    describe_counter!(MODEL_RESTARTS_TOTAL, "Model actor restarts after a crash");
    describe_gauge!(
        CLUSTER_REPLICA_UP,
        "1 while a remote model's replica (host) sends heartbeats, 0 after three missed"
    );
    describe_gauge!(
        CLUSTER_REPLICA_LOAD,
        "Live requests on a remote model's replica, as its last heartbeat said"
    );
    describe_counter!(
        CLUSTER_PLACEMENTS_TOTAL,
        "Requests this process placed on a remote model's replica"
    );
    describe_histogram!(
        CLUSTER_BUS_RTT_SECONDS,
        Unit::Seconds,
        "Round trip of a ping to a remote model's replica over the bus"
    );
    describe_histogram!(
        CLUSTER_HANDOFF_TRANSIT_SECONDS,
        Unit::Seconds,
        "One-way time of a handoff to a model hosted here, from its sender queueing it to \
         its arrival (by the two hosts' wall clocks)"
    );
}

/// A ping to a remote replica came back after `rtt`.
pub fn bus_round_trip(model: &str, host: &str, rtt: std::time::Duration) {
    let labels = [("model", model.to_string()), ("host", host.to_string())];
    histogram!(CLUSTER_BUS_RTT_SECONDS, &labels).record(rtt.as_secs_f64());
}

/// A handoff to `model`, hosted here, came over the bus in `transit`.
pub fn handoff_transit(model: &str, transit: std::time::Duration) {
    histogram!(CLUSTER_HANDOFF_TRANSIT_SECONDS, "model" => model.to_string())
        .record(transit.as_secs_f64());
}

/// The gauge of requests not yet ended.
pub fn live_requests() -> Gauge {
    gauge!(LIVE_REQUESTS)
}

/// A remote replica's liveness and reported load.
pub fn replica_seen(model: &str, host: &str, up: bool, load: usize) {
    let labels = [("model", model.to_string()), ("host", host.to_string())];
    gauge!(CLUSTER_REPLICA_UP, &labels).set(f64::from(u8::from(up)));
    gauge!(CLUSTER_REPLICA_LOAD, &labels).set(load as f64);
}

/// This process placed a request on a remote model's replica.
pub fn replica_placed(model: &str, host: &str) {
    let labels = [("model", model.to_string()), ("host", host.to_string())];
    counter!(CLUSTER_PLACEMENTS_TOTAL, &labels).increment(1);
}

/// A model actor's metrics, registered once with its `model` label.
pub struct ModelMetrics {
    model: String,
    step_seconds: Histogram,
    batch_size: Histogram,
    kv_tokens_used: Gauge,
    kv_tokens_cached: Gauge,
    kv_tokens_capacity: Gauge,
    prefix_lookups: Counter,
    prefix_hits: Counter,
    prefix_hit_tokens: Counter,
    prefix_evictions: Counter,
    pending: Gauge,
    restarts: Counter,
}

impl ModelMetrics {
    pub fn new(model: &str) -> Self {
        let label = || [("model", model.to_string())];
        let restarts = counter!(MODEL_RESTARTS_TOTAL, &label());
        restarts.increment(0);
        Self {
            model: model.to_string(),
            step_seconds: histogram!(STEP_SECONDS, &label()),
            batch_size: histogram!(BATCH_SIZE, &label()),
            kv_tokens_used: gauge!(KV_TOKENS_USED, &label()),
            kv_tokens_cached: gauge!(KV_TOKENS_CACHED, &label()),
            kv_tokens_capacity: gauge!(KV_TOKENS_CAPACITY, &label()),
            prefix_lookups: counter!(PREFIX_CACHE_LOOKUPS_TOTAL, &label()),
            prefix_hits: counter!(PREFIX_CACHE_HITS_TOTAL, &label()),
            prefix_hit_tokens: counter!(PREFIX_CACHE_HIT_TOKENS_TOTAL, &label()),
            prefix_evictions: counter!(PREFIX_CACHE_EVICTIONS_TOTAL, &label()),
            pending: gauge!(PENDING_REQUESTS, &label()),
            restarts,
        }
    }

    pub fn step(&self, seconds: f64, batch: usize) {
        self.step_seconds.record(seconds);
        self.batch_size.record(batch as f64);
    }

    pub fn usage(&self, kv: &KvUsage, prefix: &PrefixCounters, pending: usize) {
        self.kv_tokens_used.set(kv.used_tokens as f64);
        self.kv_tokens_cached.set(kv.cached_tokens as f64);
        self.kv_tokens_capacity.set(kv.capacity_tokens as f64);
        self.prefix_lookups.absolute(prefix.lookups);
        self.prefix_hits.absolute(prefix.hits);
        self.prefix_hit_tokens.absolute(prefix.hit_tokens);
        self.prefix_evictions.absolute(prefix.evictions);
        self.pending.set(pending as f64);
    }

    pub fn restarted(&self) {
        self.restarts.increment(1);
    }

    pub fn committed(&self, policy: &str, tokens: u64) {
        let labels = [
            ("model", self.model.clone()),
            ("policy", policy.to_string()),
        ];
        counter!(TOKENS_TOTAL, &labels).increment(tokens);
    }

    pub fn handoff(&self, to_model: &str, policy: &str) {
        let labels = [
            ("from_model", self.model.clone()),
            ("to_model", to_model.to_string()),
            ("policy", policy.to_string()),
        ];
        counter!(HANDOFFS_TOTAL, &labels).increment(1);
    }
}

/// The eager check's figures (`tokenrouter` mode with re-tuning).
pub struct ControllerMetrics {
    tuned: Gauge,
    eager: Gauge,
    eager_chosen: Gauge,
}

impl ControllerMetrics {
    /// Every gauge starts at 0 (exported before the first comparison).
    pub fn new() -> Self {
        let metrics = Self {
            tuned: gauge!(CONTROLLER_TOKENS_PER_SECOND, "arm" => "tuned"),
            eager: gauge!(CONTROLLER_TOKENS_PER_SECOND, "arm" => "eager"),
            eager_chosen: gauge!(CONTROLLER_EAGER_CHOSEN),
        };
        for gauge in [&metrics.tuned, &metrics.eager, &metrics.eager_chosen] {
            gauge.set(0.0);
        }
        metrics
    }

    pub fn compared(&self, comparison: &ArmComparison) {
        if let Some(v) = comparison.tuned_tokens_per_s {
            self.tuned.set(v);
        }
        if let Some(v) = comparison.eager_tokens_per_s {
            self.eager.set(v);
        }
        self.eager_chosen
            .set(f64::from(u8::from(comparison.choice == Arm::Eager)));
    }
}

/// A batcher's metrics, registered once with its model's label.
pub struct BatcherMetrics {
    admission_delay: Histogram,
    waiting: Gauge,
    threshold: Gauge,
    releases: Vec<Counter>,
}

impl BatcherMetrics {
    /// `reasons`: every release reason's label, in the order `released` indexes them.
    pub fn new(model: &str, reasons: &[&'static str]) -> Self {
        let label = || [("model", model.to_string())];
        Self {
            admission_delay: histogram!(ADMISSION_DELAY_SECONDS, &label()),
            waiting: gauge!(WAITING_REQUESTS, &label()),
            threshold: gauge!(THRESHOLD, &label()),
            releases: reasons
                .iter()
                .map(|&reason| {
                    let labels = [("model", model.to_string()), ("reason", reason.to_string())];
                    counter!(BATCH_RELEASE_TOTAL, &labels)
                })
                .collect(),
        }
    }

    pub fn released(&self, reason: usize) {
        self.releases[reason].increment(1);
    }

    /// One arrival's wait in the batcher, recorded when its batch is released.
    pub fn admitted(&self, delay_seconds: f64) {
        self.admission_delay.record(delay_seconds);
    }

    pub fn waiting(&self, n: usize) {
        self.waiting.set(n as f64);
    }

    pub fn threshold(&self, b: usize) {
        self.threshold.set(b as f64);
    }
}

/// How a request ended, for `tokenrouter_requests_total{status}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestStatus {
    Completed,
    Failed,
    Cancelled,
    Deadline,
}

impl RequestStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            RequestStatus::Completed => "completed",
            RequestStatus::Failed => "failed",
            RequestStatus::Cancelled => "cancelled",
            RequestStatus::Deadline => "deadline",
        }
    }
}

/// A request's metrics, labelled with the policy it runs under.
pub struct RequestMetrics {
    policy: String,
    time_to_first_token: Histogram,
    inter_token_latency: Histogram,
}

impl RequestMetrics {
    pub fn new(policy: &str) -> Self {
        let label = || [("policy", policy.to_string())];
        Self {
            policy: policy.to_string(),
            time_to_first_token: histogram!(TIME_TO_FIRST_TOKEN_SECONDS, &label()),
            inter_token_latency: histogram!(INTER_TOKEN_LATENCY_SECONDS, &label()),
        }
    }

    pub fn first_token(&self, seconds: f64) {
        self.time_to_first_token.record(seconds);
    }

    pub fn inter_token(&self, seconds: f64) {
        self.inter_token_latency.record(seconds);
    }

    pub fn ended(&self, status: RequestStatus, seconds: f64) {
        let labels = [
            ("policy", self.policy.clone()),
            ("status", status.as_str().to_string()),
        ];
        counter!(REQUESTS_TOTAL, &labels).increment(1);
        if status == RequestStatus::Completed {
            histogram!(REQUEST_DURATION_SECONDS, "policy" => self.policy.clone()).record(seconds);
        }
    }
}

pub fn policy_swapped() {
    counter!(POLICY_SWAPS_TOTAL).increment(1);
}

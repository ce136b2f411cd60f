//! `BatcherActor`: the delayed-batching gate in front of one model. It holds arrivals (new
//! requests and returning handoffs) while the model steps, and releases them when the model
//! is idle and either enough requests are ready (threshold B), the oldest has waited W, or no
//! other live request could still arrive. Outside `tokenrouter` mode B is 1.

use super::messages::{Admit, InFlight, ModelIdle, Release, SetThreshold, Withdraw};
use super::model::ModelActor;
use super::stats::RuntimeStats;
use crate::config::ExecutionMode;
use crate::policy::ModelIdx;
use crate::telemetry::BatcherMetrics;
use actix::prelude::*;
use dashmap::DashMap;
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Why a batch was released; counted per model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReleaseReason {
    /// Anything ready launches (modes without delayed batching).
    Ready = 0,
    /// Ready requests reached the threshold.
    Threshold = 1,
    /// The oldest ready request waited the configured timeout.
    Timeout = 2,
    /// Every live request is already here: waiting longer cannot grow the batch.
    AllHere = 3,
}

impl ReleaseReason {
    pub const COUNT: usize = 4;
    pub const ALL: [ReleaseReason; Self::COUNT] = [
        ReleaseReason::Ready,
        ReleaseReason::Threshold,
        ReleaseReason::Timeout,
        ReleaseReason::AllHere,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ReleaseReason::Ready => "ready",
            ReleaseReason::Threshold => "threshold",
            ReleaseReason::Timeout => "timeout",
            ReleaseReason::AllHere => "all_here",
        }
    }
}

pub struct BatcherActor {
    model_idx: ModelIdx,
    mode: ExecutionMode,
    threshold: usize,
    timeout: Duration,
    model: Option<Addr<ModelActor>>,
    waiting: VecDeque<InFlight>,
    model_idle: bool,
    resident_ready: usize,
    /// When the model last went idle with resident requests ready to step.
    resident_ready_since: Option<Instant>,
    timer: Option<SpawnHandle>,
    live: Arc<DashMap<u64, ()>>,
    stats: Arc<RuntimeStats>,
    metrics: BatcherMetrics,
}

/// Connects the batcher to its model once both actors exist.
#[derive(Message)]
#[rtype(result = "()")]
pub struct AttachModel(pub Addr<ModelActor>);

impl BatcherActor {
    pub fn new(
        model_idx: ModelIdx,
        model_name: &str,
        mode: ExecutionMode,
        threshold: usize,
        timeout: Duration,
        live: Arc<DashMap<u64, ()>>,
        stats: Arc<RuntimeStats>,
    ) -> Self {
        let metrics =
            BatcherMetrics::new(model_name, &ReleaseReason::ALL.map(ReleaseReason::as_str));
        metrics.threshold(threshold);
        Self {
            model_idx,
            metrics,
            mode,
            threshold,
            timeout,
            model: None,
            waiting: VecDeque::new(),
            model_idle: false,
            resident_ready: 0,
            resident_ready_since: None,
            timer: None,
            live,
            stats,
        }
    }

    fn release_reason(&self, ready: usize, oldest: Instant) -> Option<ReleaseReason> {
        if self.mode != ExecutionMode::Tokenrouter {
            return Some(ReleaseReason::Ready);
        }
        if ready >= self.threshold {
            Some(ReleaseReason::Threshold)
        } else if ready >= self.live.len() {
            Some(ReleaseReason::AllHere)
        } else if oldest.elapsed() >= self.timeout {
            Some(ReleaseReason::Timeout)
        } else {
            None
        }
    }

    fn try_release(&mut self, ctx: &mut Context<Self>) {
        let Some(model) = &self.model else { return };
        if !self.model_idle {
            return;
        }
        self.waiting
            .retain(|w| self.live.contains_key(&w.state.rid));
        let ready = self.resident_ready + self.waiting.len();
        if ready == 0 {
            return;
        }
        let oldest = [
            self.waiting.front().map(|w| w.arrived),
            self.resident_ready_since,
        ]
        .into_iter()
        .flatten()
        .min()
        .unwrap_or_else(Instant::now);
        match self.release_reason(ready, oldest) {
            Some(reason) => {
                if let Some(timer) = self.timer.take() {
                    ctx.cancel_future(timer);
                }
                self.stats.models[self.model_idx].record_release(reason);
                let now = Instant::now();
                let stats = &self.stats.models[self.model_idx];
                for w in &self.waiting {
                    let delay = now - w.arrived;
                    stats.record_admission_delay(delay);
                    self.metrics.admitted(delay.as_secs_f64());
                }
                self.metrics.released(reason as usize);
                self.metrics.waiting(0);
                self.model_idle = false;
                self.resident_ready_since = None;
                model.do_send(Release {
                    arrivals: self.waiting.drain(..).collect(),
                    reason,
                });
            }
            None if self.timer.is_none() => {
                let wait = self.timeout.saturating_sub(oldest.elapsed());
                self.timer = Some(ctx.run_later(wait, |act, ctx| {
                    act.timer = None;
                    act.try_release(ctx);
                }));
            }
            None => {}
        }
    }
}

impl Actor for BatcherActor {
    type Context = Context<Self>;
}

impl Handler<AttachModel> for BatcherActor {
    type Result = ();

    fn handle(&mut self, msg: AttachModel, ctx: &mut Context<Self>) {
        self.model = Some(msg.0);
        self.try_release(ctx);
    }
}

impl Handler<Admit> for BatcherActor {
    type Result = ();

    fn handle(&mut self, msg: Admit, ctx: &mut Context<Self>) {
        self.waiting.extend(msg.0);
        self.metrics.waiting(self.waiting.len());
        self.try_release(ctx);
    }
}

impl Handler<ModelIdle> for BatcherActor {
    type Result = ();

    fn handle(&mut self, msg: ModelIdle, ctx: &mut Context<Self>) {
        self.model_idle = true;
        self.resident_ready = msg.resident_ready;
        self.resident_ready_since = (msg.resident_ready > 0).then(Instant::now);
        self.try_release(ctx);
    }
}

impl Handler<SetThreshold> for BatcherActor {
    type Result = ();

    fn handle(&mut self, msg: SetThreshold, ctx: &mut Context<Self>) {
        self.threshold = msg.0.max(1);
        self.metrics.threshold(self.threshold);
        self.stats.models[self.model_idx]
            .threshold
            .store(self.threshold, Ordering::Relaxed);
        self.try_release(ctx);
    }
}

impl Handler<Withdraw> for BatcherActor {
    type Result = ();

    fn handle(&mut self, msg: Withdraw, _ctx: &mut Context<Self>) {
        self.waiting.retain(|w| w.state.rid != msg.rid);
        self.metrics.waiting(self.waiting.len());
    }
}

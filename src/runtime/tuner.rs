//! `TunerActor` (`tokenrouter` mode): re-estimates the routing matrix and each model's L(b)
//! from the runtime's counters, solves the Markov model for the live request count N, and
//! publishes the best thresholds B*(N) to the batchers. The batcher timeout still bounds
//! every wait, so a poor estimate costs throughput, never liveness.

use super::batcher::BatcherActor;
use super::live::LiveRequests;
use super::messages::SetThreshold;
use super::record::ModelRecorder;
use crate::tuning::online::{fit_latency, RoutingEstimate};
use crate::tuning::{search, AffineLatency, DtmcModel};
use actix::prelude::*;
use std::time::Duration;

/// Weight of the newest tuning period in the routing EWMA.
const ROUTING_ALPHA: f64 = 0.3;
/// Recent steps per model the latency fit uses.
const LATENCY_SAMPLES: usize = 512;
/// Time grid of the online model: coarser than the paper's 0.1 ms keeps the state space
/// (and the solve) small; thresholds are integers, so the grid barely moves them.
const ONLINE_DELTA_MS: f64 = 0.5;

pub(crate) struct TunerSettings {
    pub interval: Duration,
    /// Largest N solved for; more live requests use B*(max).
    pub max_requests: usize,
    pub timeout_ms: f64,
    /// Configured L(b) per model (`[tuning] latency_ms`), the fit's fallback.
    pub latency_prior: Vec<Option<AffineLatency>>,
}

pub(crate) struct TunerActor {
    settings: TunerSettings,
    recorders: Vec<ModelRecorder>,
    live: LiveRequests,
    batchers: Vec<Addr<BatcherActor>>,
    routing: RoutingEstimate,
}

impl TunerActor {
    pub fn new(
        settings: TunerSettings,
        recorders: Vec<ModelRecorder>,
        live: LiveRequests,
        batchers: Vec<Addr<BatcherActor>>,
    ) -> Self {
        let models = batchers.len();
        Self {
            settings,
            recorders,
            live,
            batchers,
            routing: RoutingEstimate::new(models, ROUTING_ALPHA),
        }
    }

    /// The model as currently estimated, once every model has been observed.
    fn estimate(&mut self) -> Option<DtmcModel> {
        let (routed, committed): (Vec<_>, Vec<_>) = self
            .recorders
            .iter()
            .map(|r| r.read(|m| (m.routed_to.clone(), m.committed_to.clone())))
            .unzip();
        self.routing.update(&routed, &committed);
        if !self.routing.ready() {
            return None;
        }
        let latency = self
            .recorders
            .iter()
            .zip(&self.settings.latency_prior)
            .map(|(m, prior)| {
                let samples: Vec<(usize, f64)> = m
                    .recent_steps(LATENCY_SAMPLES)
                    .iter()
                    .map(|s| s.latency_sample())
                    .collect();
                fit_latency(&samples, *prior)
            })
            .collect::<Option<Vec<_>>>()?;
        let models = latency.len();
        Some(DtmcModel {
            routing: self.routing.routing().to_vec(),
            commits: self.routing.commits().to_vec(),
            latency,
            delta_ms: ONLINE_DELTA_MS,
            timeout_ms: vec![Some(self.settings.timeout_ms); models],
        })
    }

    fn retune(&mut self) {
        let Some(model) = self.estimate() else { return };
        let n = self.live.len().min(self.settings.max_requests);
        if n == 0 {
            return;
        }
        match search(&model, n) {
            Ok(results) => {
                let Some((best, _)) = results.first() else {
                    return;
                };
                for (batcher, &b) in self.batchers.iter().zip(best) {
                    batcher.do_send(SetThreshold(b));
                }
            }
            Err(e) => tracing::warn!("online tuning skipped a period: {e}"),
        }
    }
}

impl Actor for TunerActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.run_interval(self.settings.interval, |act, _| act.retune());
    }
}

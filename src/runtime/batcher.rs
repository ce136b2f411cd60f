//! `BatcherActor`: carries out one model's `BatchGate` (the delayed-batching gate, see
//! `core::gate`). It lives on its own thread so arrivals are taken while the model steps,
//! and owns the one timer the timeout bound needs.

use super::core::{BatchGate, GateDecision};
use super::live::LiveRequests;
use super::messages::{
    Admit, FreeRequest, ModelIdle, Recount, Release, Request, SetThreshold, Withdraw,
};
use super::model::ModelActor;
use super::record::ModelRecorder;
use actix::prelude::*;
use std::time::Instant;

pub(crate) struct BatcherActor {
    gate: BatchGate<Request>,
    model: Option<Addr<ModelActor>>,
    timer: Option<SpawnHandle>,
    live: LiveRequests,
    recorder: ModelRecorder,
}

/// Connects the batcher to its model once both actors exist.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct AttachModel(pub Addr<ModelActor>);

impl BatcherActor {
    pub fn new(gate: BatchGate<Request>, live: LiveRequests, recorder: ModelRecorder) -> Self {
        Self {
            gate,
            model: None,
            timer: None,
            live,
            recorder,
        }
    }

    fn try_release(&mut self, ctx: &mut Context<Self>) {
        let Some(model) = &self.model else { return };
        let now = Instant::now();
        let live = &self.live;
        match self.gate.poll(now, live.len(), |rid| live.contains(rid)) {
            GateDecision::Release {
                arrivals,
                reason,
                delays,
            } => {
                if let Some(timer) = self.timer.take() {
                    ctx.cancel_future(timer);
                }
                tracing::trace!(
                    reason = reason.as_str(),
                    arrivals = arrivals.len(),
                    "release"
                );
                self.recorder.released(reason, &delays);
                model.do_send(Release { arrivals });
            }
            GateDecision::WaitUntil(at) if self.timer.is_none() => {
                self.timer = Some(
                    ctx.run_later(at.saturating_duration_since(now), |act, ctx| {
                        act.timer = None;
                        act.try_release(ctx);
                    }),
                );
            }
            GateDecision::WaitUntil(_) | GateDecision::Hold => {}
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
        self.gate.arrive(msg.0);
        self.recorder.waiting(self.gate.waiting());
        self.try_release(ctx);
    }
}

impl Handler<ModelIdle> for BatcherActor {
    type Result = ();

    fn handle(&mut self, msg: ModelIdle, ctx: &mut Context<Self>) {
        self.gate.model_idle(msg.resident_ready, Instant::now());
        self.try_release(ctx);
    }
}

impl Handler<SetThreshold> for BatcherActor {
    type Result = ();

    fn handle(&mut self, msg: SetThreshold, ctx: &mut Context<Self>) {
        self.gate.set_threshold(msg.0);
        self.recorder.threshold(self.gate.threshold());
        self.try_release(ctx);
    }
}

impl Handler<Withdraw> for BatcherActor {
    type Result = ();

    /// A request ended: fewer live requests may mean every one left is here now.
    fn handle(&mut self, msg: Withdraw, ctx: &mut Context<Self>) {
        self.gate.withdraw(msg.rid);
        if let Some(model) = &self.model {
            model.do_send(FreeRequest { rid: msg.rid });
        }
        self.recorder.waiting(self.gate.waiting());
        self.try_release(ctx);
    }
}

impl Handler<Recount> for BatcherActor {
    type Result = ();

    fn handle(&mut self, _: Recount, ctx: &mut Context<Self>) {
        self.try_release(ctx);
    }
}

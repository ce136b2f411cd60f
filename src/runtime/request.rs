//! `RequestActor`: one generation's lifecycle: it starts routing, forwards committed tokens
//! to the client stream, enforces the deadline, and on finish, cancel or failure makes every
//! model and batcher drop the request.

use super::batcher::BatcherActor;
use super::messages::{
    Admit, Cancel, Committed, Failed, FailureKind, FinishReason, Finished, FreeRequest,
    RoutingStats, Start, Withdraw,
};
use super::model::ModelActor;
use crate::policy::ModelIdx;
use crate::telemetry::{RequestMetrics, RequestStatus};
use actix::prelude::*;
use dashmap::DashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;

/// What a client receives, in order: tokens, then exactly one `Finished` or `Failed`.
#[derive(Debug, Clone, PartialEq)]
pub enum RequestEvent {
    Token {
        id: u32,
        model: ModelIdx,
    },
    Finished {
        reason: FinishReason,
        stats: RoutingStats,
        prompt_tokens: usize,
    },
    Failed {
        message: String,
        kind: FailureKind,
    },
}

pub struct RequestActor {
    rid: u64,
    events: UnboundedSender<RequestEvent>,
    models: Vec<Addr<ModelActor>>,
    batchers: Vec<Addr<BatcherActor>>,
    live: Arc<DashMap<u64, ()>>,
    deadline: Option<Duration>,
    metrics: RequestMetrics,
    submitted: Instant,
    last_token: Option<Instant>,
    /// How it ended; a request stopped by anything but finish, failure or deadline was
    /// cancelled.
    status: RequestStatus,
}

impl RequestActor {
    pub fn new(
        rid: u64,
        policy: &str,
        events: UnboundedSender<RequestEvent>,
        models: Vec<Addr<ModelActor>>,
        batchers: Vec<Addr<BatcherActor>>,
        live: Arc<DashMap<u64, ()>>,
        deadline: Option<Duration>,
    ) -> Self {
        Self {
            rid,
            events,
            models,
            batchers,
            live,
            deadline,
            metrics: RequestMetrics::new(policy),
            submitted: Instant::now(),
            last_token: None,
            status: RequestStatus::Cancelled,
        }
    }

    fn fail(&mut self, kind: FailureKind, message: String, ctx: &mut Context<Self>) {
        self.status = match kind {
            FailureKind::Deadline => RequestStatus::Deadline,
            FailureKind::Fault | FailureKind::Capacity => RequestStatus::Failed,
        };
        let _ = self.events.send(RequestEvent::Failed { message, kind });
        ctx.stop();
    }
}

impl Actor for RequestActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        if let Some(deadline) = self.deadline {
            ctx.run_later(deadline, move |act, ctx| {
                act.fail(
                    FailureKind::Deadline,
                    format!("deadline of {} ms exceeded", deadline.as_millis()),
                    ctx,
                );
            });
        }
    }

    /// Whatever ended the request, every model frees its KV and every batcher forgets it.
    fn stopped(&mut self, _ctx: &mut Context<Self>) {
        self.metrics
            .ended(self.status, self.submitted.elapsed().as_secs_f64());
        self.live.remove(&self.rid);
        for model in &self.models {
            model.do_send(FreeRequest { rid: self.rid });
        }
        for batcher in &self.batchers {
            batcher.do_send(Withdraw { rid: self.rid });
        }
    }
}

impl Handler<Start> for RequestActor {
    type Result = ();

    fn handle(&mut self, msg: Start, _ctx: &mut Context<Self>) {
        let entry = msg.0.state.current;
        self.batchers[entry].do_send(Admit(vec![msg.0]));
    }
}

impl Handler<Committed> for RequestActor {
    type Result = ();

    fn handle(&mut self, msg: Committed, ctx: &mut Context<Self>) {
        let now = Instant::now();
        match self.last_token {
            None => self
                .metrics
                .first_token((now - self.submitted).as_secs_f64()),
            Some(last) => {
                let gap = (now - last).as_secs_f64() / msg.tokens.len().max(1) as f64;
                for _ in &msg.tokens {
                    self.metrics.inter_token(gap);
                }
            }
        }
        self.last_token = Some(now);
        for id in msg.tokens {
            let event = RequestEvent::Token {
                id,
                model: msg.model,
            };
            if self.events.send(event).is_err() {
                // The client is gone: cancel.
                ctx.stop();
                return;
            }
        }
    }
}

impl Handler<Finished> for RequestActor {
    type Result = ();

    fn handle(&mut self, msg: Finished, ctx: &mut Context<Self>) {
        let _ = self.events.send(RequestEvent::Finished {
            reason: msg.reason,
            stats: msg.stats,
            prompt_tokens: msg.prompt_tokens,
        });
        self.status = RequestStatus::Completed;
        ctx.stop();
    }
}

impl Handler<Failed> for RequestActor {
    type Result = ();

    fn handle(&mut self, msg: Failed, ctx: &mut Context<Self>) {
        self.fail(msg.kind, msg.message, ctx);
    }
}

impl Handler<Cancel> for RequestActor {
    type Result = ();

    fn handle(&mut self, _msg: Cancel, ctx: &mut Context<Self>) {
        ctx.stop();
    }
}

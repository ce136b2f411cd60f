//! `RequestActor`: one generation's lifecycle: it starts routing, forwards committed tokens
//! to the client stream, enforces the deadline, and on finish, cancel or failure makes every
//! model and batcher drop the request.

use super::core::{
    EngineTiming, FailureKind, FinishReason, RequestId, RoutingStats, TokenLogprobs,
};
use super::link::{FrontendRequests, ModelLink};
use super::live::LiveRequests;
use super::messages::{Cancel, Committed, Failed, Finished, Placed, Start};
use crate::policy::ModelIdx;
use crate::telemetry::{RequestMetrics, RequestStatus};
use actix::prelude::*;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;

/// What a client receives, in order: tokens, then exactly one `Finished` or `Failed` (also
/// what crosses the cluster bus to a request's front end).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum RequestEvent {
    Token {
        id: u32,
        model: ModelIdx,
        /// When the request asked for log-probabilities.
        logprobs: Option<TokenLogprobs>,
    },
    Finished {
        reason: FinishReason,
        stats: RoutingStats,
        timing: EngineTiming,
        prompt_tokens: usize,
    },
    Failed {
        message: String,
        kind: FailureKind,
    },
}

pub(crate) struct RequestActor {
    rid: RequestId,
    events: UnboundedSender<RequestEvent>,
    /// Every model, by index: where the request starts and who frees it at the end.
    models: Vec<ModelLink>,
    live: LiveRequests,
    /// This process's requests, when a bus carries events for them from other processes.
    frontend: Option<FrontendRequests>,
    /// Open for the request's whole life: `RUST_LOG=debug` shows its events and its close.
    span: tracing::Span,
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
        rid: RequestId,
        policy: &str,
        events: UnboundedSender<RequestEvent>,
        models: Vec<ModelLink>,
        live: LiveRequests,
        frontend: Option<FrontendRequests>,
        deadline: Option<Duration>,
    ) -> Self {
        Self {
            span: tracing::debug_span!("request", %rid, policy),
            rid,
            events,
            models,
            live,
            frontend,
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
            FailureKind::Fault | FailureKind::Capacity | FailureKind::Unavailable => {
                RequestStatus::Failed
            }
        };
        tracing::debug!(parent: &self.span, ?kind, %message, "failed");
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

    /// Whatever ended the request, every model's batcher forgets it and the model frees its KV.
    fn stopped(&mut self, _ctx: &mut Context<Self>) {
        let seconds = self.submitted.elapsed().as_secs_f64();
        tracing::debug!(parent: &self.span, status = self.status.as_str(), seconds, "ended");
        self.metrics.ended(self.status, seconds);
        self.live.remove(self.rid);
        for model in &self.models {
            model.withdraw(self.rid);
        }
        // After the withdrawals: the hosts' live count never falls below what they hold.
        if let Some(frontend) = &self.frontend {
            frontend.remove(self.rid);
        }
    }
}

impl Handler<Start> for RequestActor {
    type Result = ();

    fn handle(&mut self, msg: Start, _ctx: &mut Context<Self>) {
        let entry = msg.0.state.current;
        tracing::debug!(parent: &self.span, prompt_tokens = msg.0.state.prompt_len, entry, "started");
        self.models[entry].admit(vec![msg.0]);
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
            Some(last) => self.metrics.inter_token((now - last).as_secs_f64()),
        }
        self.last_token = Some(now);
        let event = RequestEvent::Token {
            id: msg.token,
            model: msg.model,
            logprobs: msg.logprobs,
        };
        if self.events.send(event).is_err() {
            // The client is gone: cancel.
            ctx.stop();
        }
    }
}

impl Handler<Finished> for RequestActor {
    type Result = ();

    fn handle(&mut self, msg: Finished, ctx: &mut Context<Self>) {
        let _ = self.events.send(RequestEvent::Finished {
            reason: msg.reason,
            stats: msg.stats,
            timing: msg.timing,
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

impl Handler<Placed> for RequestActor {
    type Result = ();

    fn handle(&mut self, msg: Placed, _ctx: &mut Context<Self>) {
        if let Some(frontend) = &self.frontend {
            frontend.place(self.rid, msg.model, msg.host);
        }
    }
}

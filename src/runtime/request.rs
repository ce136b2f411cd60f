//! `RequestActor`: one generation's lifecycle: it starts routing, forwards committed tokens
//! to the client stream, enforces the deadline, and on finish, cancel or failure makes every
//! model and batcher drop the request.

use super::core::{
    EngineTiming, FailureKind, FinishReason, Released, RequestId, RoutingStats, StreamOrder,
    TokenLogprobs,
};
use super::link::{ModelLink, OwnRequests};
use super::live::LiveRequests;
use super::messages::{Cancel, Committed, Failed, Finished, Placed, Start};
use crate::policy::ModelIdx;
use crate::telemetry::{RequestMetrics, RequestStatus};
use actix::prelude::*;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;

/// What a client receives, in order: tokens, then exactly one `Finished` or `Failed` (also
/// what crosses the cluster bus to a request's front end).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum RequestEvent {
    Token {
        id: u32,
        /// Its place in the completion (0 for the first generated token).
        index: usize,
        model: ModelIdx,
        /// When the request asked for log-probabilities.
        logprobs: Option<TokenLogprobs>,
    },
    Finished {
        reason: FinishReason,
        stats: RoutingStats,
        timing: EngineTiming,
        prompt_tokens: usize,
        completion_tokens: usize,
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
    frontend: Option<Arc<dyn OwnRequests>>,
    /// Open for the request's whole life: `RUST_LOG=debug` shows its events and its close.
    span: tracing::Span,
    deadline: Option<Duration>,
    metrics: RequestMetrics,
    submitted: Instant,
    last_token: Option<Instant>,
    /// Tokens and the finish in completion order (across processes they can overtake).
    order: StreamOrder<Committed, Finished>,
    /// How it ended; a request stopped by anything but finish, failure or deadline was
    /// cancelled.
    status: RequestStatus,
}

/// How long a finish waits for tokens that it overtook (they cross the bus in
/// milliseconds; a host that died is detected by its heartbeats, not by this).
const STRAGGLER_WAIT: Duration = Duration::from_secs(5);

impl RequestActor {
    pub fn new(
        rid: RequestId,
        policy: &str,
        events: UnboundedSender<RequestEvent>,
        models: Vec<ModelLink>,
        live: LiveRequests,
        frontend: Option<Arc<dyn OwnRequests>>,
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
            order: StreamOrder::default(),
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

    /// Streams what the ordering lets through; the finish ends the request.
    fn release(&mut self, released: Released<Committed, Finished>, ctx: &mut Context<Self>) {
        for token in released.tokens {
            let now = Instant::now();
            match self.last_token {
                None => self
                    .metrics
                    .first_token((now - self.submitted).as_secs_f64()),
                Some(last) => self.metrics.inter_token((now - last).as_secs_f64()),
            }
            self.last_token = Some(now);
            let event = RequestEvent::Token {
                id: token.token,
                index: token.index,
                model: token.model,
                logprobs: token.logprobs,
            };
            if self.events.send(event).is_err() {
                // The client is gone: cancel.
                return ctx.stop();
            }
        }
        if let Some(end) = released.end {
            let _ = self.events.send(RequestEvent::Finished {
                reason: end.reason,
                stats: end.stats,
                timing: end.timing,
                prompt_tokens: end.prompt_tokens,
                completion_tokens: end.completion_tokens,
            });
            self.status = RequestStatus::Completed;
            ctx.stop();
        }
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
        let released = self.order.token(msg.index, msg);
        self.release(released, ctx);
    }
}

impl Handler<Finished> for RequestActor {
    type Result = ();

    fn handle(&mut self, msg: Finished, ctx: &mut Context<Self>) {
        let released = self.order.end(msg.completion_tokens, msg);
        self.release(released, ctx);
        if self.order.waiting() {
            ctx.run_later(STRAGGLER_WAIT, |act, ctx| {
                if act.order.waiting() {
                    let message = format!(
                        "token {} of the completion never arrived from its model's host",
                        act.order.next()
                    );
                    act.fail(FailureKind::Fault, message, ctx);
                }
            });
        }
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

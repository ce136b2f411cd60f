//! Every message that crosses an actor boundary, in one file.

use super::core::{
    EngineTiming, FailureKind, FinishReason, InFlight, RequestId, RoutingStats, TokenLogprobs,
};
use super::link::Client;
use crate::policy::ModelIdx;
use actix::prelude::*;

/// A request in flight between the actors: its client is its request actor, here or in the
/// front end that owns it.
pub(crate) type Request = InFlight<Client>;

/// Arrivals at a model's batcher: a new request, or every handoff one step sent there. A step's
/// handoffs to one model travel together so the batcher judges its threshold on all of them
/// at once (the paper's "route all completions, then launch").
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Admit(pub Vec<Request>);

/// Batcher → model: run the next step with these arrivals added to the resident set.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Release {
    pub arrivals: Vec<Request>,
}

/// Tuner → batcher: the delayed-batching threshold B to use from now on.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct SetThreshold(pub usize);

/// Model → its batcher: a step finished (or the actor started); `resident_ready` requests
/// are waiting to step again.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct ModelIdle {
    pub resident_ready: usize,
}

/// Model → request: a newly committed token.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Committed {
    pub token: u32,
    /// Its place in the completion (0 for the first generated token).
    pub index: usize,
    pub model: ModelIdx,
    pub logprobs: Option<TokenLogprobs>,
}

/// Model → request: the generation is over.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Finished {
    pub reason: FinishReason,
    pub stats: RoutingStats,
    pub timing: EngineTiming,
    pub prompt_tokens: usize,
    /// Tokens committed in all: the client waits for every one before the end.
    pub completion_tokens: usize,
}

/// Model → request: the generation failed (engine error, crashed model, full KV).
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Failed {
    pub message: String,
    pub kind: FailureKind,
}

/// Batcher → its model: drop this request's KV and residency (finish, cancel, failure).
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct FreeRequest {
    pub rid: RequestId,
}

/// Request → every model's batcher: forget a waiting arrival of this request, and have the
/// model free it.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Withdraw {
    pub rid: RequestId,
}

/// Bus → a hosted model's batcher: the front ends' live count fell, so every live request
/// may be waiting here now.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Recount;

/// Runtime → request: the client gave up.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Cancel;

/// Runtime → request: start routing (sent once, after the actor has its own address).
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Start(pub Request);

/// Model's host → request: it now holds KV on replica `host` of `model` (`[cluster]`).
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Placed {
    pub model: ModelIdx,
    pub host: String,
}

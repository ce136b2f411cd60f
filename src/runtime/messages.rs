//! Every message that crosses an actor boundary, in one file.

use super::batcher::ReleaseReason;
use super::request::RequestActor;
use crate::engine::SamplingParams;
use crate::policy::{Handoff, ModelIdx, RoutingState, SharedPolicy};
use actix::prelude::*;
use serde::Serialize;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Instant;

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-sequence token.
    Stop,
    /// `max_tokens` reached.
    Length,
}

/// Per-request routing statistics, reported with the result.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RoutingStats {
    /// Committed tokens per model index.
    pub tokens_per_model: Vec<usize>,
    pub handoffs: usize,
}

/// What a request asks for, fixed for its lifetime.
#[derive(Clone)]
pub struct RequestParams {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub eos: Arc<BTreeSet<u32>>,
    /// The policy the request started with: later swaps do not affect it.
    pub policy: SharedPolicy,
}

/// A request in flight between actors: routing state plus what travels with it.
pub struct InFlight {
    pub state: RoutingState,
    pub params: RequestParams,
    pub stats: RoutingStats,
    pub client: Addr<RequestActor>,
    /// Set by `send` on the source model; consumed by `receive` on the target.
    pub handoff: Option<Handoff>,
    /// When it reached the current batcher (admission delay).
    pub arrived: Instant,
}

/// Arrivals at a model's batcher: a new request, or every handoff one step sent there. A step's
/// handoffs to one model travel together so the batcher judges its threshold on all of them
/// at once (the paper's "route all completions, then launch").
#[derive(Message)]
#[rtype(result = "()")]
pub struct Admit(pub Vec<InFlight>);

/// Batcher → model: run the next step with these arrivals added to the resident set.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Release {
    pub arrivals: Vec<InFlight>,
    pub reason: ReleaseReason,
}

/// Tuner → batcher: the delayed-batching threshold B to use from now on.
#[derive(Message)]
#[rtype(result = "()")]
pub struct SetThreshold(pub usize);

/// Model → its batcher: a step finished (or the actor started); `resident_ready` requests
/// are waiting to step again.
#[derive(Message)]
#[rtype(result = "()")]
pub struct ModelIdle {
    pub resident_ready: usize,
}

/// Model → request: newly committed tokens, in order.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Committed {
    pub tokens: Vec<u32>,
    pub model: ModelIdx,
}

/// Model → request: the generation is over.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Finished {
    pub reason: FinishReason,
    pub stats: RoutingStats,
    pub prompt_tokens: usize,
}

/// Model → request: the generation failed (engine error, crashed model).
#[derive(Message)]
#[rtype(result = "()")]
pub struct Failed {
    pub message: String,
    pub kind: FailureKind,
}

/// Why a generation failed: the HTTP status and whether a retry can help follow from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// An engine error or a crashed model.
    Fault,
    /// Out of capacity (KV); the same request may succeed later.
    Capacity,
    /// The request's deadline passed.
    Deadline,
}

/// Request → every model: drop this request's KV and residency (finish, cancel, failure).
#[derive(Message)]
#[rtype(result = "()")]
pub struct FreeRequest {
    pub rid: u64,
}

/// Request → every batcher: forget a waiting arrival of this request.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Withdraw {
    pub rid: u64,
}

/// Runtime → request: the client gave up.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Cancel;

/// Runtime → request: start routing (sent once, after the actor has its own address).
#[derive(Message)]
#[rtype(result = "()")]
pub struct Start(pub InFlight);

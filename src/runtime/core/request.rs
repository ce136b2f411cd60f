//! A request as the scheduling core sees it: routing state plus what travels with it.

use crate::engine::SamplingParams;
pub use crate::policy::RequestId;
use crate::policy::{Handoff, RoutingState, SharedPolicy};
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

/// Per-request routing statistics, reported with the result.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RoutingStats {
    /// Committed tokens per model index.
    pub tokens_per_model: Vec<usize>,
    pub handoffs: usize,
}

/// What a request asks for, fixed for its lifetime.
#[derive(Clone)]
pub(crate) struct RequestParams {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub eos: Arc<BTreeSet<u32>>,
    /// The policy the request started with: later swaps do not affect it.
    pub policy: SharedPolicy,
}

/// A request in flight between models. `C` is how its client is reached: the request
/// actor's address in the runtime, anything comparable in the core's tests.
pub(crate) struct InFlight<C> {
    pub state: RoutingState,
    pub params: RequestParams,
    pub stats: RoutingStats,
    pub client: C,
    /// Set when it leaves a model; consumed when the target admits it.
    pub handoff: Option<Handoff>,
    /// When it reached the current model's batcher (admission delay).
    pub arrived: Instant,
}

impl<C> InFlight<C> {
    pub fn rid(&self) -> RequestId {
        self.state.rid
    }
}

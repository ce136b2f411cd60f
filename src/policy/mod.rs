//! Routing policies: pure, synchronous functions of one request's routing state and the step
//! it just took. The runtime calls them per model, per step, over the batch.

pub(crate) mod ensemble;
pub mod learned;
pub(crate) mod one_token;
pub mod r2r;
pub mod registry;
pub(crate) mod rstitch;
pub(crate) mod single;

pub use crate::config::PolicyKind;
use crate::engine::{LogitStats, Needs};
use std::path::PathBuf;
use std::sync::Arc;

/// Why a policy could not be built.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("{0}")]
    Invalid(String),
    #[error("router weights {path}: {message}")]
    RouterWeights { path: PathBuf, message: String },
}

pub type ModelIdx = usize;

/// A request's id, unique within one runtime; ids grow in submission order.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct RequestId(pub u64);

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// What happens to a request after a step on its current model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// Commit the candidate and keep decoding here.
    Stay,
    /// Commit the candidate, continue on another model.
    CommitThenSwitch(ModelIdx),
    /// Drop the candidate; that model writes this position instead.
    RejectAndSwitch(ModelIdx),
}

/// A request's routing state: it travels with the request between model actors (and over
/// the cluster bus).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct RoutingState {
    pub rid: RequestId,
    /// Committed tokens: prompt, then generated.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Per model: how many of `tokens` that model has processed (its KV length).
    pub seen: Vec<usize>,
    pub current: ModelIdx,
    /// Per-request seed for sampling and seeded routing draws.
    pub seed: u64,
}

impl RoutingState {
    pub fn new(rid: RequestId, prompt: Vec<u32>, models: usize, seed: u64) -> Self {
        Self {
            rid,
            prompt_len: prompt.len(),
            tokens: prompt,
            seen: vec![0; models],
            current: 0,
            seed,
        }
    }

    pub fn generated(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    /// Tokens `model` has not processed yet.
    pub fn unseen(&self, model: ModelIdx) -> &[u32] {
        &self.tokens[self.seen[model]..]
    }
}

/// The step a policy judges: the candidate for the next position and its signals.
#[derive(Debug, Clone, Copy)]
pub struct StepView<'a> {
    pub model: ModelIdx,
    pub candidate: u32,
    pub stats: &'a LogitStats,
    pub logits: &'a [f32],
    pub hidden: Option<&'a [f32]>,
    /// Input embedding of the candidate, when the policy asked for it.
    pub embedding: Option<&'a [f32]>,
}

/// What `send` hands to the target model: the tokens it has not seen, from `anchor` on.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Handoff {
    pub from: ModelIdx,
    pub to: ModelIdx,
    pub anchor: usize,
    pub tokens: Vec<u32>,
}

/// What a new request brings to `entry`.
#[derive(Debug, Clone)]
pub struct RequestInfo {
    pub rid: RequestId,
    pub prompt_len: usize,
    pub seed: u64,
}

/// What `/v1/models` and the logs say about a policy: never a silent stand-in.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PolicyInfo {
    pub name: String,
    pub kind: PolicyKind,
    pub models: Vec<ModelIdx>,
    /// True when a learned router decides; false when the training-free rule does.
    pub learned_router: bool,
    pub rule: String,
    pub threshold: Option<f32>,
}

impl PolicyInfo {
    pub fn new<P: RoutingPolicy + ?Sized>(
        policy: &P,
        kind: PolicyKind,
        learned_router: bool,
        rule: String,
        threshold: f32,
    ) -> Self {
        Self {
            name: policy.name().to_string(),
            kind,
            models: policy.models().to_vec(),
            learned_router,
            rule,
            threshold: Some(threshold),
        }
    }
}

pub trait RoutingPolicy: Send + Sync + 'static {
    fn name(&self) -> &str;

    fn describe(&self) -> PolicyInfo;

    /// Signals the policy reads beyond the candidate and its cheap statistics.
    fn needs(&self) -> Needs {
        Needs::default()
    }

    /// Models this policy routes between (an entry in `route` never names another).
    fn models(&self) -> &[ModelIdx];

    fn entry(&self, req: &RequestInfo) -> ModelIdx;

    /// Routes every request of one model's step at once (`reqs[i]` took `steps[i]`): a
    /// learned router scores the whole batch in one matrix product.
    fn route_batch(&self, reqs: &[&RoutingState], steps: &[StepView]) -> Vec<Route>;

    /// One request's step.
    fn route(&self, req: &RoutingState, step: &StepView) -> Route {
        self.route_batch(&[req], std::slice::from_ref(step))
            .remove(0)
    }

    /// Packs the tokens `to` has not seen.
    fn send(&self, req: &RoutingState, to: ModelIdx) -> Handoff {
        Handoff {
            from: req.current,
            to,
            anchor: req.seen[to],
            tokens: req.unseen(to).to_vec(),
        }
    }

    /// Takes a handoff on the target. The default accepts it as is: the committed tokens
    /// already travel in the routing state, so only the current model changes.
    fn receive(&self, req: &mut RoutingState, handoff: &Handoff) {
        debug_assert_eq!(&req.tokens[handoff.anchor..], &handoff.tokens[..]);
        req.current = handoff.to;
    }
}

pub type SharedPolicy = Arc<dyn RoutingPolicy>;

/// The shape R2R, CITER and Co-LLM share: on the large model, commit its one token and hand
/// back; on the small one, drop the candidate and hand over where `hand_over(score)` holds.
/// `scores` holds one entry per small-model step, in order.
pub fn one_token_handoffs(
    steps: &[StepView],
    [small, large]: [ModelIdx; 2],
    scores: Vec<f32>,
    hand_over: impl Fn(f32) -> bool,
) -> Vec<Route> {
    let mut scores = scores.into_iter();
    steps
        .iter()
        .map(|s| {
            if s.model != small {
                return Route::CommitThenSwitch(small);
            }
            match scores.next() {
                Some(score) if hand_over(score) => Route::RejectAndSwitch(large),
                _ => Route::Stay,
            }
        })
        .collect()
}

/// A statistic of each step on `model`, in order (a training-free rule's score).
pub fn slm_stats(
    steps: &[StepView],
    model: ModelIdx,
    stat: impl Fn(&LogitStats) -> f32,
) -> Vec<f32> {
    steps
        .iter()
        .filter(|s| s.model == model)
        .map(|s| stat(s.stats))
        .collect()
}

/// Concatenated hidden states of the steps on `model` (for a learned router's batch).
pub fn hidden_rows(steps: &[StepView], model: ModelIdx) -> Vec<f32> {
    steps
        .iter()
        .filter(|s| s.model == model)
        .flat_map(|s| {
            s.hidden
                .expect("the policy asked for hidden states")
                .iter()
                .copied()
        })
        .collect()
}

/// Hand-built step views for the policies' unit tests.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    pub fn stats(entropy: f32, max_prob: f32) -> LogitStats {
        LogitStats {
            entropy,
            max_prob,
            top_k: vec![],
        }
    }

    pub fn view<'a>(model: ModelIdx, stats: &'a LogitStats, logits: &'a [f32]) -> StepView<'a> {
        StepView {
            model,
            candidate: 7,
            stats,
            logits,
            hidden: None,
            embedding: None,
        }
    }

    pub fn state() -> RoutingState {
        RoutingState::new(RequestId(1), vec![1, 2, 3], 2, 0)
    }
}

//! A request as the scheduling core sees it: routing state plus what travels with it.

use super::cross_vocab::CrossVocab;
use crate::config::PolicyConfig;
use crate::constraint::RequestGrammar;
use crate::engine::{SamplingParams, StepOutput};
pub use crate::policy::RequestId;
use crate::policy::{Handoff, ModelIdx, RoutingState, SharedPolicy};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-sequence token.
    Stop,
    /// `max_tokens` reached.
    Length,
}

/// Why a generation failed: the HTTP status and whether a retry can help follow from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FailureKind {
    /// An engine error or a crashed model.
    Fault,
    /// A model's process stopped answering; the same request may succeed on a retry.
    Unavailable,
    /// Out of capacity (KV); the same request may succeed later.
    Capacity,
    /// The request's deadline passed.
    Deadline,
}

/// Per-request routing statistics, reported with the result.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoutingStats {
    /// Committed tokens per model index.
    pub tokens_per_model: Vec<usize>,
    pub handoffs: usize,
}

/// Where a request's time in the models went, summed over both models: what a
/// per-token breakdown of serving time needs beside the time the client waited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineTiming {
    /// Looking up the longest cached prefix of its tokens.
    pub prefix_match: Duration,
    /// Wall time of the steps that ran one of its rows (a step shared by a batch counts
    /// whole for each of its rows).
    pub compute: Duration,
}

/// The committed token's log-probability, its most likely alternatives' and the entropy of
/// the distribution it came from, all at temperature 1: OpenAI's `logprobs`, and the
/// routing signal an external dispatcher needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprobs {
    pub logprob: f32,
    /// Shannon entropy in nats over the whole vocabulary.
    pub entropy: f32,
    /// `(token, logprob)`, most likely first.
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprobs {
    /// From a step's output for its candidate; `top` alternatives (the step computed at
    /// least that many of its largest logits, and at least one).
    pub fn of(output: &StepOutput, top: usize) -> Self {
        let max_logit = output.stats.top_k.first().map_or(f32::NAN, |&(_, l)| l);
        // log Σ exp(l) = max + log Σ exp(l − max), and max_prob = 1 / Σ exp(l − max).
        let log_sum = max_logit - output.stats.max_prob.ln();
        let logprob = |logit: f32| (logit - log_sum).min(0.0);
        Self {
            logprob: logprob(output.logits[output.candidate as usize]),
            entropy: output.stats.entropy,
            top: output
                .stats
                .top_k
                .iter()
                .take(top)
                .map(|&(token, logit)| (token, logprob(logit)))
                .collect(),
        }
    }
}

/// A completed row's sampled token, with its log-probabilities when the request asked.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Sampled {
    pub token: u32,
    pub logprobs: Option<TokenLogprobs>,
}

impl From<u32> for Sampled {
    fn from(token: u32) -> Self {
        Self {
            token,
            logprobs: None,
        }
    }
}

/// What a request asks for, fixed for its lifetime.
#[derive(Clone)]
pub(crate) struct RequestParams {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Tokens that end it (a request across vocabularies keeps each vocabulary's in `cross`).
    pub eos: Arc<BTreeSet<u32>>,
    /// The policy the request started with: later swaps do not affect it.
    pub policy: SharedPolicy,
    /// The config entry `policy` was built from (`None` for a model alone): a model hosted
    /// in another process builds this very version from it, whatever was swapped since.
    pub policy_spec: Option<Arc<PolicyConfig>>,
    /// Alternatives per token when the request asked for log-probabilities.
    pub logprobs: Option<usize>,
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
    pub timing: EngineTiming,
    /// Per model hosted in other processes, the replica holding its KV there (`[cluster]`):
    /// a request returns to the replica it was placed on.
    pub hosts: Vec<Option<Arc<str>>>,
    /// Its output format's state (structured output): it travels with the request, so the
    /// model it moves to masks by the same grammar.
    pub grammar: Option<Arc<RequestGrammar>>,
    /// Its text in each vocabulary, when its policy routes across vocabularies.
    pub cross: Option<Box<CrossVocab>>,
}

impl<C> InFlight<C> {
    pub fn rid(&self) -> RequestId {
        self.state.rid
    }

    /// Whether `token`, written by `model`, ends the generation.
    pub fn ends(&self, model: ModelIdx, token: u32) -> bool {
        match &self.cross {
            Some(cross) => cross.ends(model, token),
            None => self.params.eos.contains(&token),
        }
    }

    /// Committed tokens, each counted in the vocabulary of the model that wrote it.
    pub fn completion_tokens(&self) -> usize {
        self.stats.tokens_per_model.iter().sum()
    }

    /// The prompt's tokens in the vocabulary of the model the request entered at.
    pub fn prompt_tokens(&self) -> usize {
        self.cross
            .as_ref()
            .map_or(self.state.prompt_len, |cross| cross.prompt_tokens())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{sampling::logit_stats, SeqId};

    #[test]
    fn token_logprobs_are_the_log_softmax_of_the_logits() {
        let logits = vec![1.0f32, 3.0, -2.0, 0.5, 3.0];
        let log_sum = logits.iter().map(|l| l.exp()).sum::<f32>().ln();
        let output = StepOutput {
            seq: SeqId(0),
            position: 0,
            candidate: 3,
            stats: logit_stats(&logits, 3),
            logits: logits.clone(),
            hidden: None,
            candidate_embedding: None,
        };
        let got = TokenLogprobs::of(&output, 2);
        assert!((got.logprob - (0.5 - log_sum)).abs() < 1e-5, "{got:?}");
        // Ties go to the lower id; only the two asked for.
        assert_eq!(got.top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 4]);
        assert!((got.top[0].1 - (3.0 - log_sum)).abs() < 1e-5, "{got:?}");
        let p: Vec<f32> = logits.iter().map(|l| (l - log_sum).exp()).collect();
        let entropy: f32 = -p.iter().map(|p| p * p.ln()).sum::<f32>();
        assert!((got.entropy - entropy).abs() < 1e-4, "{got:?}");
    }
}

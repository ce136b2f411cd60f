//! R2R ("Roads to Rome"): the SLM writes; a router flags path-divergent SLM tokens, which are
//! dropped and written by the LLM (exactly one token), then control returns to the SLM.
//! Learned router: p = MLP(SLM hidden, candidate embedding, top-100 logits), LLM iff p ≥ θ.
//! Without weights: the R2R repo's own training-free rule, SLM entropy ≥ θ nats (0.45).

use super::learned::{padded_top_logits, R2rRouter, R2R_TOP_K};
use super::{
    hidden_rows, one_token_handoffs, slm_stats, ModelIdx, PolicyInfo, PolicyKind, RequestInfo,
    Route, RoutingPolicy, RoutingState, StepView,
};
use crate::engine::Needs;

pub const DEFAULT_LEARNED_THRESHOLD: f32 = 0.5;
pub const DEFAULT_ENTROPY_THRESHOLD: f32 = 0.45;

pub struct R2r {
    name: String,
    models: [ModelIdx; 2],
    threshold: f32,
    router: Option<R2rRouter>,
}

impl R2r {
    pub fn new(
        name: &str,
        slm: ModelIdx,
        llm: ModelIdx,
        threshold: Option<f32>,
        router: Option<R2rRouter>,
    ) -> Self {
        let threshold = threshold.unwrap_or(match &router {
            Some(r) => r.threshold.unwrap_or(DEFAULT_LEARNED_THRESHOLD),
            None => DEFAULT_ENTROPY_THRESHOLD,
        });
        Self {
            name: name.into(),
            models: [slm, llm],
            threshold,
            router,
        }
    }
}

impl RoutingPolicy for R2r {
    fn name(&self) -> &str {
        &self.name
    }

    fn needs(&self) -> Needs {
        match self.router {
            Some(_) => Needs {
                hidden: true,
                top_k: R2R_TOP_K,
                embedding: true,
            },
            None => Needs::default(),
        }
    }

    fn models(&self) -> &[ModelIdx] {
        &self.models
    }

    fn entry(&self, _req: &RequestInfo) -> ModelIdx {
        self.models[0]
    }

    fn route_batch(&self, _reqs: &[&RoutingState], steps: &[StepView]) -> Vec<Route> {
        let [slm, _] = self.models;
        let scores = match &self.router {
            None => slm_stats(steps, slm, |s| s.entropy),
            Some(router) => {
                let mut embedding = Vec::new();
                let mut top = Vec::new();
                for s in steps.iter().filter(|s| s.model == slm) {
                    embedding.extend_from_slice(s.embedding.expect("R2R asks for the embedding"));
                    padded_top_logits(&s.stats.top_k, &mut top);
                }
                router.score(&hidden_rows(steps, slm), &embedding, &top)
            }
        };
        one_token_handoffs(steps, self.models, scores, |p| p >= self.threshold)
    }

    fn describe(&self) -> PolicyInfo {
        let rule = match self.router {
            Some(_) => format!(
                "learned router: LLM writes the token when P(divergent) >= {}",
                self.threshold
            ),
            None => format!(
                "training-free rule: LLM writes the token when SLM entropy >= {} nats",
                self.threshold
            ),
        };
        PolicyInfo::new(
            self,
            PolicyKind::R2r,
            self.router.is_some(),
            rule,
            self.threshold,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{state, stats, view};

    #[test]
    fn entropy_rule_hands_one_token_to_the_llm_at_the_threshold() {
        let p = R2r::new("r2r", 0, 1, None, None);
        let at = stats(DEFAULT_ENTROPY_THRESHOLD, 0.5);
        let below = stats(DEFAULT_ENTROPY_THRESHOLD - 1e-4, 0.5);
        assert_eq!(
            p.route(&state(), &view(0, &at, &[])),
            Route::RejectAndSwitch(1)
        );
        assert_eq!(p.route(&state(), &view(0, &below, &[])), Route::Stay);
        let uncertain = stats(5.0, 0.1);
        assert_eq!(
            p.route(&state(), &view(1, &uncertain, &[])),
            Route::CommitThenSwitch(0),
            "exactly one LLM token"
        );
        assert!(!p.describe().learned_router);
    }
}

//! CITER: an MLP on the SLM's hidden state predicts whether the SLM token is good enough;
//! when its confidence is below τ the token is dropped and the LLM writes exactly one.
//! Without weights: the SLM's own top-1 probability stands in for the confidence.

use super::learned::CiterRouter;
use super::{
    hidden_rows, one_token_handoffs, slm_stats, ModelIdx, PolicyInfo, RequestInfo, Route,
    RoutingPolicy, RoutingState, StepView,
};
use crate::engine::Needs;

pub const DEFAULT_THRESHOLD: f32 = 0.9;

pub struct Citer {
    name: String,
    models: [ModelIdx; 2],
    threshold: f32,
    router: Option<CiterRouter>,
}

impl Citer {
    pub fn new(
        name: &str,
        slm: ModelIdx,
        llm: ModelIdx,
        threshold: Option<f32>,
        router: Option<CiterRouter>,
    ) -> Self {
        Self {
            name: name.into(),
            models: [slm, llm],
            threshold: threshold.unwrap_or(DEFAULT_THRESHOLD),
            router,
        }
    }
}

impl RoutingPolicy for Citer {
    fn name(&self) -> &str {
        &self.name
    }

    fn needs(&self) -> Needs {
        Needs {
            hidden: self.router.is_some(),
            ..Needs::default()
        }
    }

    fn models(&self) -> &[ModelIdx] {
        &self.models
    }

    fn entry(&self, _req: &RequestInfo) -> ModelIdx {
        self.models[0]
    }

    fn route(&self, req: &RoutingState, step: &StepView) -> Route {
        self.route_batch(&[req], std::slice::from_ref(step))
            .remove(0)
    }

    fn route_batch(&self, _reqs: &[&RoutingState], steps: &[StepView]) -> Vec<Route> {
        let confidences = match &self.router {
            Some(router) => router.score(&hidden_rows(steps, self.models[0])),
            None => slm_stats(steps, self.models[0], |s| s.max_prob),
        };
        one_token_handoffs(steps, self.models, confidences, |c| c < self.threshold)
    }

    fn describe(&self) -> PolicyInfo {
        let rule = match self.router {
            Some(_) => format!(
                "learned router: LLM writes the token when confidence < {}",
                self.threshold
            ),
            None => format!(
                "training-free rule: LLM writes the token when SLM top-1 probability < {}",
                self.threshold
            ),
        };
        PolicyInfo::new(self, "citer", self.router.is_some(), rule, self.threshold)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{state, stats, view};

    #[test]
    fn low_confidence_hands_one_token_to_the_llm() {
        let p = Citer::new("citer", 0, 1, None, None);
        let at = stats(1.0, DEFAULT_THRESHOLD);
        let below = stats(1.0, DEFAULT_THRESHOLD - 1e-4);
        assert_eq!(
            p.route(&state(), &view(0, &at, &[])),
            Route::Stay,
            "confidence == τ keeps the SLM token"
        );
        assert_eq!(
            p.route(&state(), &view(0, &below, &[])),
            Route::RejectAndSwitch(1)
        );
        assert_eq!(
            p.route(&state(), &view(1, &below, &[])),
            Route::CommitThenSwitch(0),
            "exactly one LLM token"
        );
    }
}

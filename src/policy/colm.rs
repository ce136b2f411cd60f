//! Co-LLM: the base model's deferral probability (an extra learned LM-head row) decides when
//! the assistant writes the token (exactly one; the base's candidate is dropped).
//! Without the head: 1 − base max probability stands in for the deferral probability.

use super::learned::DeferralHead;
use super::{
    hidden_rows, one_token_handoffs, slm_stats, ModelIdx, PolicyInfo, RequestInfo, Route,
    RoutingPolicy, RoutingState, StepView,
};
use crate::engine::Needs;

pub const DEFAULT_THRESHOLD: f32 = 0.15;

pub struct CoLlm {
    name: String,
    models: [ModelIdx; 2],
    threshold: f32,
    head: Option<DeferralHead>,
}

impl CoLlm {
    pub fn new(
        name: &str,
        base: ModelIdx,
        assistant: ModelIdx,
        threshold: Option<f32>,
        head: Option<DeferralHead>,
    ) -> Self {
        Self {
            name: name.into(),
            models: [base, assistant],
            threshold: threshold.unwrap_or(DEFAULT_THRESHOLD),
            head,
        }
    }
}

impl RoutingPolicy for CoLlm {
    fn name(&self) -> &str {
        &self.name
    }

    fn needs(&self) -> Needs {
        Needs {
            hidden: self.head.is_some(),
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
        let deferrals = match &self.head {
            Some(head) => head.score(&hidden_rows(steps, self.models[0])),
            None => slm_stats(steps, self.models[0], |s| 1.0 - s.max_prob),
        };
        one_token_handoffs(steps, self.models, deferrals, |d| d > self.threshold)
    }

    fn describe(&self) -> PolicyInfo {
        let rule = match self.head {
            Some(_) => format!("learned deferral head: assistant writes the token when P(defer) > {}", self.threshold),
            None => format!("training-free rule: assistant writes the token when 1 - base top-1 probability > {}", self.threshold),
        };
        PolicyInfo::new(self, "colm", self.head.is_some(), rule, self.threshold)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{state, stats, view};

    #[test]
    fn deferral_above_eta_hands_one_token_to_the_assistant() {
        let p = CoLlm::new("colm", 0, 1, Some(0.25), None);
        let at = stats(1.0, 0.75);
        let above = stats(1.0, 0.75 - 1e-3);
        assert_eq!(
            p.route(&state(), &view(0, &at, &[])),
            Route::Stay,
            "deferral == η does not defer"
        );
        assert_eq!(
            p.route(&state(), &view(0, &above, &[])),
            Route::RejectAndSwitch(1)
        );
        assert_eq!(
            p.route(&state(), &view(1, &above, &[])),
            Route::CommitThenSwitch(0),
            "exactly one token"
        );
    }
}

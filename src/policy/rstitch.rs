//! R-Stitch: entropy of the active model, normalised by ln V. On the SLM, Hn > τ drops the
//! token and hands over to the LLM; the LLM keeps writing while its own Hn > τ, and its first
//! token with Hn ≤ τ is kept before control returns. Training-free.

use super::{
    ModelIdx, PolicyInfo, PolicyKind, RequestInfo, Route, RoutingPolicy, RoutingState, StepView,
};

pub const DEFAULT_THRESHOLD: f32 = 0.03;

pub struct RStitch {
    name: String,
    models: [ModelIdx; 2],
    threshold: f32,
}

impl RStitch {
    pub fn new(name: &str, slm: ModelIdx, llm: ModelIdx, threshold: Option<f32>) -> Self {
        Self {
            name: name.into(),
            models: [slm, llm],
            threshold: threshold.unwrap_or(DEFAULT_THRESHOLD),
        }
    }
}

/// Entropy divided by its maximum, ln V: 0 for a certain model, 1 for a uniform one.
pub fn normalised_entropy(step: &StepView) -> f32 {
    step.stats.entropy / (step.logits.len().max(2) as f32).ln()
}

impl RoutingPolicy for RStitch {
    fn name(&self) -> &str {
        &self.name
    }

    fn models(&self) -> &[ModelIdx] {
        &self.models
    }

    fn entry(&self, _req: &RequestInfo) -> ModelIdx {
        self.models[0]
    }

    fn route_batch(&self, _reqs: &[&RoutingState], steps: &[StepView]) -> Vec<Route> {
        steps
            .iter()
            .map(|step| {
                let uncertain = normalised_entropy(step) > self.threshold;
                match (step.model == self.models[0], uncertain) {
                    (true, true) => Route::RejectAndSwitch(self.models[1]),
                    (true, false) | (false, true) => Route::Stay,
                    (false, false) => Route::CommitThenSwitch(self.models[0]),
                }
            })
            .collect()
    }

    fn describe(&self) -> PolicyInfo {
        let rule = format!(
            "training-free rule: hand over while normalised entropy of the active model > {}",
            self.threshold
        );
        PolicyInfo::new(self, PolicyKind::Rstitch, false, rule, self.threshold)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{state, stats, view};

    #[test]
    fn llm_keeps_writing_while_uncertain_and_hands_back_its_first_confident_token() {
        let p = RStitch::new("rstitch", 0, 1, Some(0.5));
        let logits = vec![0.0; 64];
        let ln_v = 64f32.ln();
        let above = stats(0.5 * ln_v + 1e-3, 0.1);
        let below = stats(0.5 * ln_v - 1e-3, 0.9);
        assert_eq!(
            p.route(&state(), &view(0, &above, &logits)),
            Route::RejectAndSwitch(1)
        );
        assert_eq!(p.route(&state(), &view(0, &below, &logits)), Route::Stay);
        for _ in 0..3 {
            assert_eq!(
                p.route(&state(), &view(1, &above, &logits)),
                Route::Stay,
                "multi-token stay on the LLM"
            );
        }
        assert_eq!(
            p.route(&state(), &view(1, &below, &logits)),
            Route::CommitThenSwitch(0)
        );
        let halfway = stats(0.25 * ln_v, 0.5);
        assert!((normalised_entropy(&view(0, &halfway, &logits)) - 0.25).abs() < 1e-6);
    }
}

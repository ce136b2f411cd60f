//! CITER and Co-LLM: on the small model a score decides whether the large one writes this
//! position (the small model's candidate is dropped); the large model writes exactly one
//! token and hands back. Their training-free rules coincide (both read the small model's top-1
//! probability p): CITER hands over when p < τ, Co-LLM when 1 − p > η. Their learned routers
//! differ: CITER's MLP scores a confidence, Co-LLM's deferral head a probability of deferring.

use super::learned::HiddenScorer;
use super::{
    hidden_rows, one_token_handoffs, slm_stats, ModelIdx, PolicyInfo, PolicyKind, RequestInfo,
    Route, RoutingPolicy, RoutingState, StepView,
};
use crate::engine::{LogitStats, Needs};

/// CITER's published τ.
pub const CITER_DEFAULT_THRESHOLD: f32 = 0.9;
/// Co-LLM's published η.
pub const COLM_DEFAULT_THRESHOLD: f32 = 0.15;

/// Which of the two algorithms, and so which way its score and threshold point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flavor {
    /// Score: confidence that the small model's token is fine; hand over below τ.
    Citer,
    /// Score: probability of deferring to the large model; hand over above η.
    CoLlm,
}

pub struct OneTokenHandoff {
    name: String,
    flavor: Flavor,
    models: [ModelIdx; 2],
    threshold: f32,
    router: Option<Box<dyn HiddenScorer>>,
}

impl OneTokenHandoff {
    fn new(
        name: &str,
        flavor: Flavor,
        models: [ModelIdx; 2],
        threshold: Option<f32>,
        router: Option<Box<dyn HiddenScorer>>,
    ) -> Self {
        let default = match flavor {
            Flavor::Citer => CITER_DEFAULT_THRESHOLD,
            Flavor::CoLlm => COLM_DEFAULT_THRESHOLD,
        };
        Self {
            name: name.into(),
            flavor,
            models,
            threshold: threshold
                .or(router.as_ref().and_then(|r| r.threshold()))
                .unwrap_or(default),
            router,
        }
    }

    /// CITER over `[slm, llm]`; `router`: its learned confidence MLP.
    pub fn citer(
        name: &str,
        models: [ModelIdx; 2],
        threshold: Option<f32>,
        router: Option<Box<dyn HiddenScorer>>,
    ) -> Self {
        Self::new(name, Flavor::Citer, models, threshold, router)
    }

    /// Co-LLM over `[base, assistant]`; `head`: its learned deferral head.
    pub fn colm(
        name: &str,
        models: [ModelIdx; 2],
        threshold: Option<f32>,
        head: Option<Box<dyn HiddenScorer>>,
    ) -> Self {
        Self::new(name, Flavor::CoLlm, models, threshold, head)
    }

    fn training_free_score(&self, stats: &LogitStats) -> f32 {
        match self.flavor {
            Flavor::Citer => stats.max_prob,
            Flavor::CoLlm => 1.0 - stats.max_prob,
        }
    }

    fn hands_over(&self, score: f32) -> bool {
        match self.flavor {
            Flavor::Citer => score < self.threshold,
            Flavor::CoLlm => score > self.threshold,
        }
    }
}

impl RoutingPolicy for OneTokenHandoff {
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

    fn route_batch(&self, _reqs: &[&RoutingState], steps: &[StepView]) -> Vec<Route> {
        let small = self.models[0];
        let scores = match &self.router {
            Some(router) => router.score(&hidden_rows(steps, small)),
            None => slm_stats(steps, small, |s| self.training_free_score(s)),
        };
        one_token_handoffs(steps, self.models, scores, |s| self.hands_over(s))
    }

    fn describe(&self) -> PolicyInfo {
        let t = self.threshold;
        let (kind, rule) = match (self.flavor, self.router.is_some()) {
            (Flavor::Citer, true) => (
                PolicyKind::Citer,
                format!("learned router: LLM writes the token when confidence < {t}"),
            ),
            (Flavor::Citer, false) => (
                PolicyKind::Citer,
                format!("training-free rule: LLM writes the token when SLM top-1 probability < {t}"),
            ),
            (Flavor::CoLlm, true) => (
                PolicyKind::Colm,
                format!("learned deferral head: assistant writes the token when P(defer) > {t}"),
            ),
            (Flavor::CoLlm, false) => (
                PolicyKind::Colm,
                format!("training-free rule: assistant writes the token when 1 - base top-1 probability > {t}"),
            ),
        };
        PolicyInfo::new(self, kind, self.router.is_some(), rule, t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::{state, stats, view};

    #[test]
    fn each_flavor_hands_exactly_one_token_over_past_its_threshold() {
        let flavors = [
            // CITER: confidence == τ keeps the SLM token; just below hands over.
            (
                OneTokenHandoff::citer("citer", [0, 1], None, None),
                CITER_DEFAULT_THRESHOLD,
                CITER_DEFAULT_THRESHOLD - 1e-4,
            ),
            // Co-LLM: deferral 1 − p == η does not defer; just above does.
            (
                OneTokenHandoff::colm("colm", [0, 1], Some(0.25), None),
                0.75,
                0.75 - 1e-3,
            ),
        ];
        for (p, kept, handed_over) in flavors {
            let (at, past) = (stats(1.0, kept), stats(1.0, handed_over));
            let name = p.name().to_string();
            assert_eq!(p.route(&state(), &view(0, &at, &[])), Route::Stay, "{name}");
            assert_eq!(
                p.route(&state(), &view(0, &past, &[])),
                Route::RejectAndSwitch(1),
                "{name}"
            );
            assert_eq!(
                p.route(&state(), &view(1, &past, &[])),
                Route::CommitThenSwitch(0),
                "{name}: exactly one token from the large model"
            );
        }
    }

    #[test]
    fn each_flavor_describes_itself() {
        let citer = OneTokenHandoff::citer("a", [0, 1], None, None).describe();
        let colm = OneTokenHandoff::colm("b", [0, 1], None, None).describe();
        assert_eq!(
            (citer.kind, citer.threshold),
            (PolicyKind::Citer, Some(0.9))
        );
        assert_eq!((colm.kind, colm.threshold), (PolicyKind::Colm, Some(0.15)));
        assert!(citer.rule.contains("top-1 probability <"), "{}", citer.rule);
        assert!(
            colm.rule.contains("1 - base top-1 probability >"),
            "{}",
            colm.rule
        );
    }
}

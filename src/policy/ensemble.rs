//! `me` (mixture-ensemble): after every token the next model is drawn from fixed weights.
//! The draw is seeded by (request seed, position), so it never depends on scheduling.

use super::{
    ModelIdx, PolicyError, PolicyInfo, PolicyKind, RequestInfo, Route, RoutingPolicy, RoutingState,
    StepView,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub struct MixtureEnsemble {
    name: String,
    models: Vec<ModelIdx>,
    /// Cumulative, normalised weights aligned with `models`.
    cumulative: Vec<f64>,
}

impl MixtureEnsemble {
    /// `weights` must be positive and as many as `models` (at least two).
    pub fn new(
        name: impl Into<String>,
        models: Vec<ModelIdx>,
        weights: &[f64],
    ) -> Result<Self, PolicyError> {
        if models.len() < 2 || models.len() != weights.len() {
            return Err(PolicyError::Invalid(
                "`me` needs at least two models and one weight per model".into(),
            ));
        }
        if weights.iter().any(|w| !(w.is_finite() && *w > 0.0)) {
            return Err(PolicyError::Invalid(
                "`me` weights must be positive numbers".into(),
            ));
        }
        let total: f64 = weights.iter().sum();
        let cumulative = weights
            .iter()
            .scan(0.0, |acc, w| {
                *acc += w / total;
                Some(*acc)
            })
            .collect();
        Ok(Self {
            name: name.into(),
            models,
            cumulative,
        })
    }

    /// The model that writes the token at `position` of the request seeded with `seed`.
    fn draw(&self, seed: u64, position: usize) -> ModelIdx {
        let mut rng = StdRng::seed_from_u64(
            seed ^ (position as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x6D65,
        );
        let u: f64 = rng.gen();
        let i = self
            .cumulative
            .iter()
            .position(|&c| u < c)
            .unwrap_or(self.models.len() - 1);
        self.models[i]
    }
}

impl RoutingPolicy for MixtureEnsemble {
    fn name(&self) -> &str {
        &self.name
    }

    fn describe(&self) -> PolicyInfo {
        let mut previous = 0.0;
        let weights: Vec<String> = self
            .cumulative
            .iter()
            .map(|c| {
                let w = c - previous;
                previous = *c;
                format!("{w:.2}")
            })
            .collect();
        PolicyInfo {
            name: self.name.clone(),
            kind: PolicyKind::Me,
            models: self.models.clone(),
            learned_router: false,
            rule: format!(
                "seeded draw after every token, weights [{}]",
                weights.join(", ")
            ),
            threshold: None,
        }
    }

    fn models(&self) -> &[ModelIdx] {
        &self.models
    }

    fn entry(&self, req: &RequestInfo) -> ModelIdx {
        self.draw(req.seed, req.prompt_len)
    }

    fn route_batch(&self, reqs: &[&RoutingState], _steps: &[StepView]) -> Vec<Route> {
        reqs.iter()
            .map(|req| {
                // The candidate is committed at position tokens.len(); the next one follows.
                let next = self.draw(req.seed, req.tokens.len() + 1);
                if next == req.current {
                    Route::Stay
                } else {
                    Route::CommitThenSwitch(next)
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::RequestId;

    #[test]
    fn draws_follow_the_weights_and_are_reproducible() {
        let me = MixtureEnsemble::new("me", vec![0, 1, 2], &[0.5, 0.3, 0.2]).unwrap();
        let mut counts = [0usize; 3];
        for pos in 0..20_000 {
            counts[me.draw(7, pos)] += 1;
        }
        for (c, w) in counts.iter().zip([0.5, 0.3, 0.2]) {
            let share = *c as f64 / 20_000.0;
            assert!((share - w).abs() < 0.02, "{counts:?}");
        }
        assert_eq!(me.draw(7, 123), me.draw(7, 123));
    }

    #[test]
    fn route_switches_exactly_when_the_next_draw_differs() {
        let me = MixtureEnsemble::new("me", vec![0, 1], &[0.5, 0.5]).unwrap();
        let stats = crate::policy::testing::stats(0.0, 1.0);
        let mut state = RoutingState::new(RequestId(1), vec![5, 6, 7], 2, 99);
        let (mut stays, mut switches) = (0, 0);
        for _ in 0..200 {
            state.current = me.draw(99, state.tokens.len());
            let view = crate::policy::testing::view(state.current, &stats, &[]);
            let next = me.draw(99, state.tokens.len() + 1);
            match me.route(&state, &view) {
                Route::Stay => {
                    assert_eq!(next, state.current);
                    stays += 1;
                }
                Route::CommitThenSwitch(to) => {
                    assert_eq!(to, next);
                    assert_ne!(to, state.current);
                    switches += 1;
                }
                Route::RejectAndSwitch(_) => panic!("me never rejects"),
            }
            state.tokens.push(1);
        }
        assert!(stays > 50 && switches > 50, "{stays} {switches}");
    }

    #[test]
    fn rejects_bad_definitions() {
        assert!(MixtureEnsemble::new("me", vec![0], &[1.0]).is_err());
        assert!(MixtureEnsemble::new("me", vec![0, 1], &[1.0, -1.0]).is_err());
        assert!(MixtureEnsemble::new("me", vec![0, 1], &[1.0]).is_err());
    }
}

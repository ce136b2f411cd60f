//! Keeps delayed batching honest while serving, twice over. The Markov model's thresholds
//! are used only where it predicts a real gain over eager launch (`thresholds_to_run`: its
//! error on real models is several percent, so a smaller predicted gain is noise). And the
//! thresholds in force run against eager launch (threshold 1 everywhere, `async`'s
//! behaviour) in alternating trial periods (`EagerCheck`); the arm with the better measured
//! throughput runs until the next trial, so a model error costs at most the trial periods.

use super::dtmc::Prediction;
use serde::Serialize;

/// Smallest gain over eager launch the Markov model must predict before thresholds above 1
/// are used (its error on the real CPU pair is several percent).
pub const MIN_PREDICTED_GAIN: f64 = 0.03;

/// The thresholds to run from a threshold search (best first): the best, where it beats
/// eager launch by `min_gain` (a fraction) in the model's own prediction; else all 1.
pub fn thresholds_to_run(
    results: &[(Vec<usize>, Prediction)],
    min_gain: f64,
) -> Option<Vec<usize>> {
    let (best, prediction) = results.first()?;
    let eager = results
        .iter()
        .find(|(b, _)| b.iter().all(|&t| t == 1))
        .map_or(0.0, |(_, p)| p.throughput);
    Some(if prediction.throughput >= eager * (1.0 + min_gain) {
        best.clone()
    } else {
        vec![1; best.len()]
    })
}

/// The most the periods between two trials grow to, as a multiple of the base.
const MAX_EXPLOIT_FACTOR: usize = 8;

/// Which thresholds a period runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Arm {
    /// The Markov model's B*(N).
    Tuned,
    /// Threshold 1 on every model.
    Eager,
}

/// The comparison so far: each arm's smoothed throughput and the arm in force.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ArmComparison {
    pub tuned_tokens_per_s: Option<f64>,
    pub eager_tokens_per_s: Option<f64>,
    pub choice: Arm,
}

/// Committed tokens and seconds measured under one arm.
#[derive(Debug, Clone, Copy, Default)]
struct Measured {
    tokens: f64,
    seconds: f64,
}

impl Measured {
    fn rate(&self) -> Option<f64> {
        (self.seconds > 0.0).then(|| self.tokens / self.seconds)
    }
}

pub struct EagerCheck {
    /// Periods the winner runs between two trials after a change of winner.
    base_exploit_periods: usize,
    /// Periods the winner runs between the current trials: doubled, up to
    /// `MAX_EXPLOIT_FACTOR` × the base, each cycle the same arm wins again, so an arm that
    /// keeps losing is tried ever more rarely (its trials cost throughput).
    exploit_periods: usize,
    last_winner: Option<Arm>,
    position: usize,
    running: Arm,
    tuned: Measured,
    eager: Measured,
}

impl EagerCheck {
    pub fn new(exploit_periods: usize) -> Self {
        Self {
            base_exploit_periods: exploit_periods,
            exploit_periods,
            last_winner: None,
            position: 0,
            running: Arm::Tuned,
            tuned: Measured::default(),
            eager: Measured::default(),
        }
    }

    /// The arm the current period runs.
    pub fn running(&self) -> Arm {
        self.running
    }

    pub fn comparison(&self) -> ArmComparison {
        ArmComparison {
            tuned_tokens_per_s: self.tuned.rate(),
            eager_tokens_per_s: self.eager.rate(),
            choice: self.best(),
        }
    }

    /// The arm measured faster; the tuned one until both were measured.
    fn best(&self) -> Arm {
        match (self.tuned.rate(), self.eager.rate()) {
            (Some(tuned), Some(eager)) if eager > tuned => Arm::Eager,
            _ => Arm::Tuned,
        }
    }

    /// Records what the period that just ended committed in how long (to the arm it ran;
    /// each arm's rate is its total tokens over its total time) and returns the arm of the
    /// next: a cycle is one tuned trial, one eager trial, then the better arm.
    pub fn period_ended(&mut self, tokens: f64, seconds: f64) -> Arm {
        let measured = match self.running {
            Arm::Tuned => &mut self.tuned,
            Arm::Eager => &mut self.eager,
        };
        measured.tokens += tokens;
        measured.seconds += seconds;
        self.position = (self.position + 1) % (2 + self.exploit_periods);
        if self.position == 2 {
            let winner = self.best();
            self.exploit_periods = match self.last_winner == Some(winner) {
                true => {
                    (self.exploit_periods * 2).min(self.base_exploit_periods * MAX_EXPLOIT_FACTOR)
                }
                false => self.base_exploit_periods,
            };
            self.last_winner = Some(winner);
        }
        self.running = match self.position {
            0 => Arm::Tuned,
            1 => Arm::Eager,
            _ => self.best(),
        };
        self.running
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_faster_arm_runs_between_trials() {
        let mut check = EagerCheck::new(3);
        assert_eq!(check.running(), Arm::Tuned);
        // Tuned trial at 80 tok/s, eager trial at 100: eager runs the next three periods.
        assert_eq!(check.period_ended(80.0, 1.0), Arm::Eager);
        let arms: Vec<Arm> = (0..4).map(|_| check.period_ended(100.0, 1.0)).collect();
        assert_eq!(arms, [Arm::Eager, Arm::Eager, Arm::Eager, Arm::Tuned]);
        // The tuned arm then commits 620 tokens in 2 s: 700 / 3 s beats eager's 100 tok/s.
        assert_eq!(check.period_ended(620.0, 2.0), Arm::Eager);
        assert_eq!(check.period_ended(100.0, 1.0), Arm::Tuned);
        let comparison = check.comparison();
        assert_eq!(comparison.choice, Arm::Tuned);
        assert_eq!(comparison.tuned_tokens_per_s, Some(700.0 / 3.0));
        assert_eq!(comparison.eager_tokens_per_s, Some(100.0));
    }

    /// An arm that keeps losing is tried ever more rarely: 3, 6, 12, then 24 periods (the cap)
    /// between trials; a change of winner goes back to 3.
    #[test]
    fn trials_of_a_losing_arm_grow_rarer() {
        let mut check = EagerCheck::new(3);
        let mut gaps = Vec::new();
        for _ in 0..5 {
            assert_eq!(
                check.period_ended(80.0, 1.0),
                Arm::Eager,
                "after the tuned trial"
            );
            let mut exploit = 0;
            while check.period_ended(100.0, 1.0) == Arm::Eager {
                exploit += 1;
            }
            gaps.push(exploit);
        }
        assert_eq!(gaps, [3, 6, 12, 24, 24]);
        // The tuned arm now wins its trial by far: the winner changed, so the gap is 3 again.
        assert_eq!(check.period_ended(10_000.0, 1.0), Arm::Eager);
        let arms: Vec<Arm> = (0..5).map(|_| check.period_ended(100.0, 1.0)).collect();
        assert_eq!(
            arms,
            [Arm::Tuned, Arm::Tuned, Arm::Tuned, Arm::Tuned, Arm::Eager]
        );
    }

    fn predicted(throughput: f64) -> Prediction {
        Prediction {
            throughput,
            ..Prediction::default()
        }
    }

    #[test]
    fn delayed_batching_runs_only_where_the_model_predicts_a_real_gain() {
        let results = vec![
            (vec![2, 3], predicted(102.0)),
            (vec![1, 1], predicted(100.0)),
            (vec![1, 2], predicted(90.0)),
        ];
        assert_eq!(thresholds_to_run(&results, 0.03), Some(vec![1, 1]));
        assert_eq!(thresholds_to_run(&results, 0.01), Some(vec![2, 3]));
        assert_eq!(thresholds_to_run(&[], 0.03), None);
    }
}

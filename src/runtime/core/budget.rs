//! What one step of a model may take: a budget that prices each row by its tokens and the
//! context they attend over, and the bound on how many steps a ready row may wait.

use crate::engine::context_priced_tokens;

/// A model's step limits, fixed for its lifetime.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct StepLimits {
    /// Most work one step appends, in tokens at context 0 (`None`: unlimited).
    pub budget: Option<f64>,
    /// What one token attending one more context position adds, in tokens at context 0
    /// (from the step profile's two chunk measurements; 0 prices tokens only).
    pub context_cost: f64,
    /// Every resident row runs within this many of the model's steps of becoming ready
    /// (admitted, or its last row ran), whatever the budget says.
    pub max_wait_steps: usize,
}

impl StepLimits {
    /// No budget, tokens only, no wait bound: what the scheduler's tests start from.
    #[cfg(test)]
    pub fn unlimited() -> Self {
        Self {
            budget: None,
            context_cost: 0.0,
            max_wait_steps: usize::MAX,
        }
    }

    /// What appending `tokens` after `context` positions costs.
    pub fn cost(&self, context: usize, tokens: usize) -> f64 {
        context_priced_tokens(context, tokens, self.context_cost)
    }

    /// The most of `wanted` tokens after `context` positions that cost at most `left`.
    pub fn tokens_within(&self, context: usize, wanted: usize, left: f64) -> usize {
        if left <= 0.0 || wanted == 0 {
            return 0;
        }
        if self.cost(context, wanted) <= left {
            return wanted;
        }
        // cost(t) = k/2·t² + (1 + k·c − k/2)·t is increasing: solve cost(t) = left, then
        // step to the exact boundary (the root is off by a rounding at most).
        let k = self.context_cost;
        let b = 1.0 + k * (context as f64 - 0.5);
        let estimate = if k > 0.0 {
            (-b + (b * b + 2.0 * k * left).sqrt()) / k
        } else {
            left / b
        };
        let mut tokens = (estimate.max(0.0) as usize).min(wanted);
        while tokens > 0 && self.cost(context, tokens) > left {
            tokens -= 1;
        }
        while tokens < wanted && self.cost(context, tokens + 1) <= left {
            tokens += 1;
        }
        tokens
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(context_cost: f64) -> StepLimits {
        StepLimits {
            budget: Some(64.0),
            context_cost,
            max_wait_steps: 4,
        }
    }

    #[test]
    fn without_a_context_cost_a_row_costs_its_tokens() {
        let l = limits(0.0);
        assert_eq!(l.cost(1500, 24), 24.0);
        assert_eq!(l.tokens_within(1500, 100, 24.5), 24);
    }

    #[test]
    fn a_late_chunk_costs_more_than_an_early_one_of_the_same_tokens() {
        // 0.4 / 1500: a token at context 1500 costs 1.4 of one at context 0.
        let l = limits(0.4 / 1500.0);
        let early = l.cost(0, 20);
        let late = l.cost(1500, 20);
        assert!((early - 20.0 * (1.0 + 0.4 / 1500.0 * 9.5)).abs() < 1e-9);
        assert!((late / early - 1.4).abs() < 0.01, "{late} / {early}");
        assert!(l.tokens_within(1500, 100, early) < 20);
    }

    #[test]
    fn tokens_within_is_the_largest_count_that_fits() {
        for k in [0.0, 1e-4, 0.4 / 1500.0, 0.01, 1.0] {
            let l = limits(k);
            for context in [0, 1, 17, 500, 1500, 40_000] {
                for left in [0.0, 0.5, 1.0, 3.7, 19.0, 64.0, 1e4] {
                    let t = l.tokens_within(context, 1000, left);
                    assert!(t == 0 || l.cost(context, t) <= left, "k {k} c {context}");
                    assert!(
                        t == 1000 || l.cost(context, t + 1) > left,
                        "k {k} c {context} left {left}: {t} is not the largest"
                    );
                }
            }
        }
    }
}

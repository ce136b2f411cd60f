//! Online inputs of the Markov model, from what the runtime observes: routing probabilities
//! and commits per transition from route decisions (an EWMA over tuning periods), and step
//! latency L(b) = a + c·b from step timings (least squares).

use super::dtmc::AffineLatency;

/// Route decisions a row needs before its first estimate (and between updates).
const MIN_ROW_SAMPLES: u64 = 32;

/// The routing matrix p_ij and commits per transition, smoothed over periods.
pub struct RoutingEstimate {
    alpha: f64,
    last_routed: Vec<Vec<u64>>,
    last_committed: Vec<Vec<u64>>,
    routing: Vec<Vec<f64>>,
    commits: Vec<Vec<f64>>,
    seen: Vec<bool>,
}

impl RoutingEstimate {
    /// `alpha`: weight of the newest period (1 forgets everything older).
    pub fn new(models: usize, alpha: f64) -> Self {
        let square = |v: f64| vec![vec![v; models]; models];
        Self {
            alpha,
            last_routed: vec![vec![0; models]; models],
            last_committed: vec![vec![0; models]; models],
            routing: square(0.0),
            commits: square(0.0),
            seen: vec![false; models],
        }
    }

    /// Takes cumulative counts: `routed[i][j]` request steps on i followed by a step on j,
    /// `committed[i][j]` tokens those steps committed. A row with too few new decisions
    /// keeps accumulating until the next call.
    pub fn update(&mut self, routed: &[Vec<u64>], committed: &[Vec<u64>]) {
        for i in 0..self.routing.len() {
            let delta: Vec<u64> = routed[i]
                .iter()
                .zip(&self.last_routed[i])
                .map(|(now, then)| now - then)
                .collect();
            let total: u64 = delta.iter().sum();
            if total < MIN_ROW_SAMPLES {
                continue;
            }
            let weight = if self.seen[i] { self.alpha } else { 1.0 };
            for j in 0..delta.len() {
                let sample = delta[j] as f64 / total as f64;
                self.routing[i][j] += weight * (sample - self.routing[i][j]);
                if delta[j] > 0 {
                    let tokens = (committed[i][j] - self.last_committed[i][j]) as f64;
                    let per_step = tokens / delta[j] as f64;
                    let old = if self.commits[i][j] > 0.0 {
                        weight
                    } else {
                        1.0
                    };
                    self.commits[i][j] += old * (per_step - self.commits[i][j]);
                }
            }
            self.seen[i] = true;
            self.last_routed[i] = routed[i].clone();
            self.last_committed[i] = committed[i].clone();
        }
    }

    /// Every model has been observed: the matrix describes the whole system.
    pub fn ready(&self) -> bool {
        self.seen.iter().all(|&s| s)
    }

    pub fn routing(&self) -> &[Vec<f64>] {
        &self.routing
    }

    pub fn commits(&self) -> &[Vec<f64>] {
        &self.commits
    }
}

/// Least-squares fit `y = a + c·x` (c = 0 when every x is equal).
pub fn fit_affine(points: &[(f64, f64)]) -> (f64, f64) {
    let n = points.len() as f64;
    let mean_x = points.iter().map(|p| p.0).sum::<f64>() / n;
    let mean_y = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mean_x).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mean_x) * (p.1 - mean_y)).sum();
    let c = if sxx > 0.0 { sxy / sxx } else { 0.0 };
    (mean_y - c * mean_x, c)
}

/// Least-squares a + c·b over `(batch, ms)` samples. With a single batch size the slope is
/// unidentifiable: the prior's slope is kept (through the observed mean), or, without a
/// prior, the pessimistic c = mean / b (batching gains nothing, so nothing waits for it).
pub fn fit_latency(
    samples: &[(usize, f64)],
    prior: Option<AffineLatency>,
) -> Option<AffineLatency> {
    if samples.is_empty() {
        return prior;
    }
    let points: Vec<(f64, f64)> = samples.iter().map(|&(b, t)| (b as f64, t)).collect();
    let n = points.len() as f64;
    let mean_b = points.iter().map(|p| p.0).sum::<f64>() / n;
    let mean_t = points.iter().map(|p| p.1).sum::<f64>() / n;
    let (a, c) = if points.iter().all(|p| p.0 == mean_b) {
        let c = prior.map_or(mean_t / mean_b, |p| p.c_ms);
        (mean_t - c * mean_b, c)
    } else {
        fit_affine(&points)
    };
    Some(match (a >= 0.0, c >= 0.0) {
        (true, true) => AffineLatency { a_ms: a, c_ms: c },
        (_, false) => AffineLatency::constant(mean_t),
        (false, true) => AffineLatency {
            a_ms: 0.0,
            c_ms: mean_t / mean_b,
        },
    })
}

/// L(b) per request-step from `(rows, tokens, ms)` step samples: least squares a + c_t·tokens,
/// then c = c_t × the tokens per request step. A row appends its unseen tokens (a prompt
/// chunk, a handoff's catch-up), not one; a fit over rows alone charges that work to the
/// intercept, which makes waiting for a fuller batch look cheaper than it is. Only rows that
/// append all their unseen tokens yield a candidate (the model's request steps): `completing`
/// is their share of the rows, and every row's tokens are priced on them. The prior (per
/// decode row) is converted the same way.
pub fn fit_request_latency(
    samples: &[(usize, usize, f64)],
    prior: Option<AffineLatency>,
    completing: f64,
) -> Option<AffineLatency> {
    let rows: usize = samples.iter().map(|s| s.0).sum();
    let tokens: usize = samples.iter().map(|s| s.1).sum();
    if rows == 0 {
        return prior;
    }
    let per_step = tokens as f64 / (rows as f64 * completing.clamp(f64::EPSILON, 1.0));
    let prior_per_token = prior.map(|p| AffineLatency {
        a_ms: p.a_ms,
        c_ms: p.c_ms / per_step,
    });
    let by_tokens: Vec<(usize, f64)> = samples.iter().map(|&(_, t, ms)| (t, ms)).collect();
    let fit = fit_latency(&by_tokens, prior_per_token)?;
    Some(AffineLatency {
        a_ms: fit.a_ms,
        c_ms: fit.c_ms * per_step,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_step_is_priced_by_the_tokens_its_rows_append() {
        // L = 5 + 2·tokens; one-row steps that carry prompt chunks, and decode steps.
        let steps = [(1, 1), (1, 20), (2, 2), (4, 4), (1, 30), (8, 8)];
        let samples: Vec<(usize, usize, f64)> = steps
            .iter()
            .map(|&(rows, tokens)| (rows, tokens, 5.0 + 2.0 * tokens as f64))
            .collect();
        let fit = fit_request_latency(&samples, None, 1.0).unwrap();
        let per_row = 65.0 / 17.0;
        assert!((fit.a_ms - 5.0).abs() < 1e-9, "{fit:?}");
        assert!((fit.c_ms - 2.0 * per_row).abs() < 1e-9, "{fit:?}");
        // By rows, the chunks land in the intercept.
        let by_rows: Vec<(usize, f64)> = samples.iter().map(|&(r, _, ms)| (r, ms)).collect();
        assert!(fit_latency(&by_rows, None).unwrap().a_ms > 20.0);
        // Two of the 17 rows appended a chunk and yielded no candidate: the 65 tokens are
        // priced on the 15 request steps, so the model still pays for all of them.
        let fit = fit_request_latency(&samples, None, 15.0 / 17.0).unwrap();
        assert!((fit.c_ms - 2.0 * 65.0 / 15.0).abs() < 1e-9, "{fit:?}");
    }

    #[test]
    fn routing_estimate_waits_for_samples_then_smooths() {
        let mut estimate = RoutingEstimate::new(2, 0.5);
        estimate.update(&[vec![10, 5], vec![3, 0]], &[vec![10, 0], vec![3, 0]]);
        assert!(!estimate.ready(), "too few decisions");
        // Row 0: 65 stay, 35 leave (rejecting, no commit); row 1: always back to 0.
        estimate.update(&[vec![65, 35], vec![40, 0]], &[vec![65, 0], vec![40, 0]]);
        assert!(estimate.ready());
        assert!((estimate.routing()[0][1] - 0.35).abs() < 1e-12);
        assert_eq!(estimate.routing()[1], [1.0, 0.0]);
        assert_eq!(estimate.commits()[0], [1.0, 0.0]);
        // The next period leaves half the time: the EWMA moves halfway.
        estimate.update(&[vec![115, 85], vec![80, 0]], &[vec![115, 0], vec![80, 0]]);
        assert!((estimate.routing()[0][1] - (0.35 + 0.5) / 2.0).abs() < 1e-12);
    }

    #[test]
    fn affine_fit_of_exact_points() {
        let (a, c) = fit_affine(&[(1.0, 5.0), (2.0, 7.0), (4.0, 11.0)]);
        assert!((a - 3.0).abs() < 1e-9 && (c - 2.0).abs() < 1e-9);
    }

    #[test]
    fn latency_fit_recovers_an_affine_law_and_handles_one_batch_size() {
        let samples: Vec<(usize, f64)> = (1..=8).map(|b| (b, 4.0 + 2.5 * b as f64)).collect();
        let fit = fit_latency(&samples, None).unwrap();
        assert!((fit.a_ms - 4.0).abs() < 1e-9 && (fit.c_ms - 2.5).abs() < 1e-9);
        let single = [(2, 10.0), (2, 12.0)];
        let pessimistic = fit_latency(&single, None).unwrap();
        assert!((pessimistic.at(2) - 11.0).abs() < 1e-9 && pessimistic.a_ms == 0.0);
        let prior = AffineLatency {
            a_ms: 1.0,
            c_ms: 3.0,
        };
        let with_prior = fit_latency(&single, Some(prior)).unwrap();
        assert!((with_prior.c_ms - 3.0).abs() < 1e-9 && (with_prior.at(2) - 11.0).abs() < 1e-9);
        // A falling fit (noise) is clamped to a constant.
        let noisy = [(1, 10.0), (4, 9.0)];
        assert_eq!(fit_latency(&noisy, None).unwrap().c_ms, 0.0);
        assert_eq!(fit_latency(&[], Some(prior)), Some(prior));
    }
}

//! Benchmarks: engine step cost per batch size, and the quality/cost of a model pair.
//! Long sweeps live here, not in `cargo test`.

pub mod engine;
pub mod pair;
pub mod prompts;
pub mod routing;

/// Median of a non-empty sample.
pub fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

/// Least-squares fit `y = a + c·x`.
pub fn fit_affine(points: &[(f64, f64)]) -> (f64, f64) {
    let n = points.len() as f64;
    let mean_x = points.iter().map(|p| p.0).sum::<f64>() / n;
    let mean_y = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mean_x).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mean_x) * (p.1 - mean_y)).sum();
    let c = if sxx > 0.0 { sxy / sxx } else { 0.0 };
    (mean_y - c * mean_x, c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_fit() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
        let (a, c) = fit_affine(&[(1.0, 5.0), (2.0, 7.0), (4.0, 11.0)]);
        assert!((a - 3.0).abs() < 1e-9 && (c - 2.0).abs() < 1e-9);
    }
}

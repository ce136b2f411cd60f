//! Small numeric kernels on f32 slices. Each reduces in a fixed order (eight lanes, then the
//! lanes left to right), so results depend only on the inputs, never on batching or threads.

/// Dot product with eight independent accumulators (vectorisable, deterministic).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut lanes = [0f32; 8];
    let (a8, a_tail) = a.split_at(a.len() / 8 * 8);
    let (b8, b_tail) = b.split_at(a8.len());
    for (x, y) in a8.chunks_exact(8).zip(b8.chunks_exact(8)) {
        for i in 0..8 {
            lanes[i] += x[i] * y[i];
        }
    }
    let mut sum = lanes.iter().sum::<f32>();
    for (x, y) in a_tail.iter().zip(b_tail) {
        sum += x * y;
    }
    sum
}

/// `out = x / rms(x) * weight`, row by row (`x` holds whole rows of `weight.len()`).
pub fn rms_norm_rows(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let mut out = x.to_vec();
    rms_norm_rows_in_place(&mut out, weight, eps);
    out
}

pub fn rms_norm_rows_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let n = weight.len();
    for row in x.chunks_mut(n) {
        let mean_square = dot(row, row) / n as f32;
        let scale = 1.0 / (mean_square + eps).sqrt();
        for (v, w) in row.iter_mut().zip(weight) {
            *v = *v * scale * w;
        }
    }
}

pub fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Adds a bias vector to every row.
pub fn add_bias_rows(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_mut(bias.len()) {
        add_in_place(row, bias);
    }
}

/// SwiGLU: `gate <- silu(gate) * up`.
pub fn silu_mul_in_place(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// In-place softmax; returns nothing, leaves probabilities summing to one.
pub fn softmax_in_place(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

/// Index of the largest value; the lowest index wins ties (deterministic greedy decoding).
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_handles_tails_and_matches_naive_sum() {
        let a: Vec<f32> = (0..19).map(|i| i as f32 * 0.5).collect();
        let b: Vec<f32> = (0..19).map(|i| 1.0 - i as f32 * 0.1).collect();
        let naive: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((dot(&a, &b) - naive).abs() < 1e-4);
    }

    #[test]
    fn softmax_and_argmax() {
        let mut x = vec![1.0, 3.0, 3.0, -2.0];
        assert_eq!(argmax(&x), 1);
        softmax_in_place(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert_eq!(x[1], x[2]);
    }

    #[test]
    fn rms_norm_unit_rows() {
        let out = rms_norm_rows(&[3.0, 4.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0], &[1.0; 4], 0.0);
        assert!((out[0] - 1.2).abs() < 1e-6 && (out[1] - 1.6).abs() < 1e-6);
        assert!(out[4..].iter().all(|v| (v - 1.0).abs() < 1e-6));
    }
}

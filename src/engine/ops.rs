//! Small numeric kernels on f32 slices (and the f16 KV cache's rows). Each reduces in a fixed
//! order (eight lanes, then the lanes by `sum_lanes`' tree), so results depend only on the
//! inputs, never on batching or threads.

use half::{f16, slice::HalfFloatSliceExt};

/// Dot product with eight independent fused multiply-add accumulators, reduced by
/// `sum_lanes` (deterministic).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let ((a8, a_tail), (b8, b_tail)) = (a.as_chunks::<8>(), b.as_chunks::<8>());
    let mut sum = dot_lanes(a8, b8);
    for (x, y) in a_tail.iter().zip(b_tail) {
        sum += x * y;
    }
    sum
}

#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    target_feature = "f16c"
))]
use simd::dot_lanes;

#[cfg(not(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    target_feature = "f16c"
)))]
#[inline]
fn dot_lanes(a: &[[f32; 8]], b: &[[f32; 8]]) -> f32 {
    let mut lanes = [0f32; 8];
    for (x, y) in a.iter().zip(b) {
        for i in 0..8 {
            lanes[i] = x[i].mul_add(y[i], lanes[i]);
        }
    }
    sum_lanes(lanes)
}

/// Eight lanes summed as ((0+1)+(2+3)) + ((4+5)+(6+7)), a fixed tree (the order of a
/// `hadd` transpose, so eight sums at once give the same results).
#[inline]
fn sum_lanes(l: [f32; 8]) -> f32 {
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

/// `scores[j] = scale · (query · row_j)` with row j at `matrix[j · stride + offset..]`
/// (attention over the f16 KV cache). Each score is exactly `scale * dot(query, row_j)` with
/// the row widened to f32 (exact).
pub fn scaled_dots(
    query: &[f32],
    matrix: &[f16],
    (stride, offset): (usize, usize),
    scale: f32,
    scores: &mut [f32],
) {
    let len = query.len();
    let row = |j: usize| &matrix[j * stride + offset..j * stride + offset + len];
    let mut done = 0;
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma",
        target_feature = "f16c"
    ))]
    if len.is_multiple_of(8) {
        // Eight rows at once: eight independent chains keep both FMA pipes busy.
        while done + 8 <= scores.len() {
            let rows = std::array::from_fn(|k| row(done + k));
            for (score, dot) in scores[done..].iter_mut().zip(simd::dots8(query, rows)) {
                *score = dot * scale;
            }
            done += 8;
        }
    }
    if done < scores.len() {
        let mut widened = vec![0f32; len];
        for (j, score) in scores.iter_mut().enumerate().skip(done) {
            row(j).convert_to_f32_slice(&mut widened);
            *score = dot(query, &widened) * scale;
        }
    }
}

/// `out += Σ_j weights[j] · row_j` with rows laid out as in `scaled_dots`; each element
/// accumulates over j in order with fused multiply-adds.
pub fn add_weighted_rows(
    weights: &[f32],
    matrix: &[f16],
    (stride, offset): (usize, usize),
    out: &mut [f32],
) {
    let len = out.len();
    let row = |j: usize| &matrix[j * stride + offset..j * stride + offset + len];
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma",
        target_feature = "f16c"
    ))]
    {
        if len.is_multiple_of(64) {
            return simd::add_weighted_rows::<8>(weights, matrix, stride, offset, out);
        }
        if len.is_multiple_of(32) {
            return simd::add_weighted_rows::<4>(weights, matrix, stride, offset, out);
        }
    }
    for (j, &w) in weights.iter().enumerate() {
        for (o, v) in out.iter_mut().zip(row(j)) {
            *o = w.mul_add(v.to_f32(), *o);
        }
    }
}

/// LLVM vectorises the portable loops two lanes wide or through memory; these keep whole
/// 8-lane registers (same operations per element, so the same results).
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    target_feature = "f16c"
))]
mod simd {
    use half::f16;
    use std::arch::x86_64::*;

    /// Eight f16 values from `from`, widened to f32 (exact).
    ///
    /// # Safety
    /// `from..from + 8` is readable.
    #[inline]
    unsafe fn widen8(from: *const f16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(from.cast()))
    }

    pub fn sum_register(v: __m256) -> f32 {
        let mut lanes = [0f32; 8];
        // SAFETY: the build enables AVX (cfg on the module); the store writes 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), v) };
        super::sum_lanes(lanes)
    }

    /// `dot_lanes` for eight rows at once: independent accumulators, reduced together by a
    /// `hadd` transpose in `sum_lanes`' order.
    pub fn dots8(query: &[f32], rows: [&[f16]; 8]) -> [f32; 8] {
        assert!(rows.iter().all(|r| r.len() == query.len()) && query.len().is_multiple_of(8));
        // SAFETY: AVX2 + FMA are enabled at build time; every load reads 8 floats inside
        // `query` or a row (lengths asserted); the store writes 8 floats.
        unsafe {
            let mut acc = [_mm256_setzero_ps(); 8];
            for c in (0..query.len()).step_by(8) {
                let q = _mm256_loadu_ps(query.as_ptr().add(c));
                for (acc, row) in acc.iter_mut().zip(rows) {
                    *acc = _mm256_fmadd_ps(q, widen8(row.as_ptr().add(c)), *acc);
                }
            }
            // Pairs (0+1), (2+3), then quads, per row; then the two 128-bit halves.
            let pairs: [__m256; 4] =
                std::array::from_fn(|k| _mm256_hadd_ps(acc[2 * k], acc[2 * k + 1]));
            let quads = [
                _mm256_hadd_ps(pairs[0], pairs[1]),
                _mm256_hadd_ps(pairs[2], pairs[3]),
            ];
            let sums = _mm256_add_ps(
                _mm256_permute2f128_ps(quads[0], quads[1], 0x20),
                _mm256_permute2f128_ps(quads[0], quads[1], 0x31),
            );
            let mut out = [0f32; 8];
            _mm256_storeu_ps(out.as_mut_ptr(), sums);
            out
        }
    }

    pub fn dot_lanes(a: &[[f32; 8]], b: &[[f32; 8]]) -> f32 {
        // SAFETY: as in `dots8`; loads read whole `[f32; 8]`s.
        unsafe {
            let mut acc = _mm256_setzero_ps();
            for (x, y) in a.iter().zip(b) {
                let (x, y) = (_mm256_loadu_ps(x.as_ptr()), _mm256_loadu_ps(y.as_ptr()));
                acc = _mm256_fmadd_ps(x, y, acc);
            }
            sum_register(acc)
        }
    }

    /// `8 · R` columns at a time in `R` registers, over all rows (`R` chains in flight).
    pub fn add_weighted_rows<const R: usize>(
        weights: &[f32],
        matrix: &[f16],
        stride: usize,
        offset: usize,
        out: &mut [f32],
    ) {
        let len = out.len();
        assert!(len.is_multiple_of(8 * R));
        assert!(weights.is_empty() || (weights.len() - 1) * stride + offset + len <= matrix.len());
        // SAFETY: AVX2 + FMA at build time; rows 0..weights.len() lie inside `matrix`
        // (asserted) and columns stay below `len`.
        unsafe {
            for c in (0..len).step_by(8 * R) {
                let o = out.as_mut_ptr().add(c);
                let mut acc: [__m256; R] = std::array::from_fn(|k| _mm256_loadu_ps(o.add(8 * k)));
                for (j, &w) in weights.iter().enumerate() {
                    let row = matrix.as_ptr().add(j * stride + offset + c);
                    let w = _mm256_set1_ps(w);
                    for (k, acc) in acc.iter_mut().enumerate() {
                        *acc = _mm256_fmadd_ps(w, widen8(row.add(8 * k)), *acc);
                    }
                }
                for (k, acc) in acc.iter().enumerate() {
                    _mm256_storeu_ps(o.add(8 * k), *acc);
                }
            }
        }
    }
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
        *g = *g / (1.0 + exp(-*g)) * u;
    }
}

/// In-place softmax; leaves probabilities summing to one. Branch-free passes over eight
/// lanes, so they vectorise, in a fixed order.
pub fn softmax_in_place(x: &mut [f32]) {
    let max = max(x);
    let mut lanes = [0f32; 8];
    let (x8, tail) = x.split_at_mut(x.len() / 8 * 8);
    for chunk in x8.chunks_exact_mut(8) {
        for (s, v) in lanes.iter_mut().zip(chunk) {
            *v = exp(*v - max);
            *s += *v;
        }
    }
    let mut sum = sum_lanes(lanes);
    for v in tail {
        *v = exp(*v - max);
        sum += *v;
    }
    let inverse = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inverse;
    }
}

/// The largest value (−∞ for none), over eight lanes so it vectorises.
pub fn max(x: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let (x8, tail) = x.split_at(x.len() / 8 * 8);
    for chunk in x8.chunks_exact(8) {
        for (m, &v) in lanes.iter_mut().zip(chunk) {
            *m = m.max(v);
        }
    }
    tail.iter()
        .chain(&lanes)
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v))
}

/// With e_i = exp(x_i − shift): (Σ e_i, Σ e_i · (x_i − shift)), over eight lanes each.
pub fn exp_sums(x: &[f32], shift: f32) -> (f32, f32) {
    let (mut sums, mut weighted) = ([0f32; 8], [0f32; 8]);
    let (x8, tail) = x.split_at(x.len() / 8 * 8);
    for chunk in x8.chunks_exact(8) {
        for i in 0..8 {
            let shifted = chunk[i] - shift;
            let e = exp(shifted);
            sums[i] += e;
            weighted[i] = e.mul_add(shifted, weighted[i]);
        }
    }
    let (mut sum, mut weighted) = (sum_lanes(sums), sum_lanes(weighted));
    for &v in tail {
        let e = exp(v - shift);
        sum += e;
        weighted += e * (v - shift);
    }
    (sum, weighted)
}

/// eˣ to within 2 ulp for x ≤ 88 (flat below −87.3), without branches or calls so loops
/// over it vectorise: 2ⁿ · p(r) with x = n·ln2 + r, |r| ≤ ln2/2, p a degree-6 polynomial.
#[inline]
pub fn exp(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.3, 88.7);
    let n = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, x));
    let p = r
        .mul_add(1.0 / 720.0, 1.0 / 120.0)
        .mul_add(r, 1.0 / 24.0)
        .mul_add(r, 1.0 / 6.0)
        .mul_add(r, 0.5)
        .mul_add(r, 1.0)
        .mul_add(r, 1.0);
    // 2ⁿ for n in −126..=128, as two factors so neither overflows nor goes subnormal. The
    // biased exponent k + 127 is read from the mantissa of k + 127 + 2²³ (an integer float
    // whose ulp is 1): bit operations only, where `as i32` would add saturation checks that
    // keep loops from vectorising.
    let half = (n * 0.5).floor();
    let two_to = |k: f32| f32::from_bits(((k + (127.0 + 8_388_608.0)).to_bits() & 0x7F_FFFF) << 23);
    p * two_to(half) * two_to(n - half)
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

    /// Rows of a KV-like matrix: 19 rows (two blocks of eight and a tail), head sizes on
    /// each SIMD path (64, 32) and off them (12); results equal the one-row definitions
    /// exactly.
    #[test]
    fn attention_helpers_equal_their_definitions() {
        let (stride, rows) = (80, 19);
        let matrix: Vec<f16> = (0..stride * rows)
            .map(|i| f16::from_f32(((i * 31 % 97) as f32 - 48.0) / 17.0))
            .collect();
        for (len, offset) in [(64, 16), (32, 3), (12, 5)] {
            let query: Vec<f32> = (0..len).map(|i| (i as f32 * 0.37).sin()).collect();
            let row =
                |j: usize| matrix[j * stride + offset..j * stride + offset + len].to_f32_vec();
            let mut scores = vec![0f32; rows];
            scaled_dots(&query, &matrix, (stride, offset), 0.125, &mut scores);
            let want: Vec<f32> = (0..rows).map(|j| dot(&query, &row(j)) * 0.125).collect();
            assert_eq!(scores, want, "len {len}");

            let mut out = vec![0.5f32; len];
            add_weighted_rows(&scores, &matrix, (stride, offset), &mut out);
            let mut want = vec![0.5f32; len];
            for (j, &w) in scores.iter().enumerate() {
                for (o, v) in want.iter_mut().zip(row(j)) {
                    *o = w.mul_add(v, *o);
                }
            }
            assert_eq!(out, want, "len {len}");
        }
    }

    #[test]
    fn exp_matches_libm_within_two_ulp() {
        for i in -8700..=8800 {
            let x = i as f32 * 0.01 + 0.003;
            let (got, want) = (exp(x), x.exp());
            assert!(
                (got - want).abs() <= 2.0 * f32::EPSILON * want,
                "exp({x}) = {got}, libm {want}"
            );
        }
        assert_eq!(exp(-1000.0), exp(-87.3));
        assert!(exp(-1000.0) < 1e-37);
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

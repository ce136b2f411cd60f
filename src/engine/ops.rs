//! Small numeric kernels on f32 slices. Each reduces in a fixed order (eight lanes, then the
//! lanes by `sum_lanes`' tree), so results depend only on the inputs, never on batching or
//! threads.

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

/// LLVM vectorises the portable loops two lanes wide or through memory; these keep whole
/// 8-lane registers (same operations per element, so the same results).
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    target_feature = "f16c"
))]
mod simd {
    use std::arch::x86_64::*;

    pub fn sum_register(v: __m256) -> f32 {
        let mut lanes = [0f32; 8];
        // SAFETY: the build enables AVX (cfg on the module); the store writes 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), v) };
        super::sum_lanes(lanes)
    }

    pub fn dot_lanes(a: &[[f32; 8]], b: &[[f32; 8]]) -> f32 {
        // SAFETY: AVX2 + FMA are enabled at build time; loads read whole `[f32; 8]`s.
        unsafe {
            let mut acc = _mm256_setzero_ps();
            for (x, y) in a.iter().zip(b) {
                let (x, y) = (_mm256_loadu_ps(x.as_ptr()), _mm256_loadu_ps(y.as_ptr()));
                acc = _mm256_fmadd_ps(x, y, acc);
            }
            sum_register(acc)
        }
    }

    /// `super::exp` on eight lanes, operation for operation.
    ///
    /// # Safety
    /// None beyond the module's build-time AVX2 + FMA.
    #[inline]
    unsafe fn exp8(x: __m256) -> __m256 {
        use super::{EXP_BIAS, EXP_MAX, EXP_MIN, EXP_TAYLOR, LN2_HI, LN2_LO};
        let x = _mm256_max_ps(
            _mm256_min_ps(x, _mm256_set1_ps(EXP_MAX)),
            _mm256_set1_ps(EXP_MIN),
        );
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x);
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
        let mut p = _mm256_fmadd_ps(
            r,
            _mm256_set1_ps(EXP_TAYLOR[0]),
            _mm256_set1_ps(EXP_TAYLOR[1]),
        );
        for &c in &EXP_TAYLOR[2..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let half = _mm256_floor_ps(_mm256_mul_ps(n, _mm256_set1_ps(0.5)));
        let two_to = |k: __m256| {
            let bits = _mm256_castps_si256(_mm256_add_ps(k, _mm256_set1_ps(EXP_BIAS)));
            let mantissa = _mm256_and_si256(bits, _mm256_set1_epi32(0x7F_FFFF));
            _mm256_castsi256_ps(_mm256_slli_epi32::<23>(mantissa))
        };
        _mm256_mul_ps(
            _mm256_mul_ps(p, two_to(half)),
            two_to(_mm256_sub_ps(n, half)),
        )
    }

    /// `super::softmax_portable` with the lanes in registers.
    pub fn softmax_in_place(x: &mut [f32]) {
        let max = super::max(x);
        let whole = x.len() / 8 * 8;
        // SAFETY: AVX2 + FMA at build time; every load and store covers 8 floats below
        // `whole`.
        let mut sum = unsafe {
            let shift = _mm256_set1_ps(max);
            let mut lanes = _mm256_setzero_ps();
            for c in (0..whole).step_by(8) {
                let at = x.as_mut_ptr().add(c);
                let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(at), shift));
                _mm256_storeu_ps(at, e);
                lanes = _mm256_add_ps(lanes, e);
            }
            sum_register(lanes)
        };
        for v in &mut x[whole..] {
            *v = super::exp(*v - max);
            sum += *v;
        }
        let inverse = 1.0 / sum;
        for v in x.iter_mut() {
            *v *= inverse;
        }
    }
}

/// `x = x / rms(x) * weight`, row by row (`x` holds whole rows of `weight.len()`).
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

/// GeGLU (Gemma): `gate <- gelu(gate) * up`, GELU by its tanh approximation as Gemma was
/// trained (transformers' `gelu_pytorch_tanh`).
pub fn gelu_tanh_mul_in_place(gate: &mut [f32], up: &[f32]) {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    for (g, u) in gate.iter_mut().zip(up) {
        let x = *g;
        let inner = SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x);
        *g = 0.5 * x * (1.0 + inner.tanh()) * u;
    }
}

/// In-place softmax; leaves probabilities summing to one. Branch-free passes over eight
/// lanes in a fixed order; the AVX2 build runs them as whole registers (same results).
pub fn softmax_in_place(x: &mut [f32]) {
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma",
        target_feature = "f16c"
    ))]
    return simd::softmax_in_place(x);
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma",
        target_feature = "f16c"
    )))]
    softmax_portable(x)
}

/// `softmax_in_place` one element at a time (the build without AVX2, and the twin the register
/// version is tested against); LLVM vectorises its exp only four lanes wide with scalar stores.
#[cfg_attr(
    all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma",
        target_feature = "f16c"
    ),
    allow(dead_code)
)]
fn softmax_portable(x: &mut [f32]) {
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

/// `exp`'s range, Cody–Waite split of ln 2 and Taylor coefficients (1/6!, 1/5!, …, 1), shared
/// with the register version so both compute the same values.
const EXP_MIN: f32 = -87.3;
const EXP_MAX: f32 = 88.7;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const EXP_TAYLOR: [f32; 7] = [
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
    1.0,
    1.0,
];
/// 127 + 2²³: `k + EXP_BIAS` holds k's biased exponent in its mantissa bits.
const EXP_BIAS: f32 = 127.0 + 8_388_608.0;

/// eˣ to within 2 ulp for x ≤ 88 (flat below −87.3), without branches or calls so loops
/// over it vectorise: 2ⁿ · p(r) with x = n·ln2 + r, |r| ≤ ln2/2, p a degree-6 polynomial.
#[inline]
pub fn exp(x: f32) -> f32 {
    let x = x.clamp(EXP_MIN, EXP_MAX);
    let n = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, x));
    let p = EXP_TAYLOR[2..]
        .iter()
        .fold(r.mul_add(EXP_TAYLOR[0], EXP_TAYLOR[1]), |p, &c| {
            p.mul_add(r, c)
        });
    // 2ⁿ for n in −126..=128, as two factors so neither overflows nor goes subnormal. The
    // biased exponent k + 127 is read from the mantissa of k + 127 + 2²³ (an integer float
    // whose ulp is 1): bit operations only, where `as i32` would add saturation checks that
    // keep loops from vectorising.
    let half = (n * 0.5).floor();
    let two_to = |k: f32| f32::from_bits(((k + EXP_BIAS).to_bits() & 0x7F_FFFF) << 23);
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

    /// Lengths with and without a tail, values spanning exp's clamp: the register softmax
    /// equals the portable one bit for bit.
    #[test]
    fn softmax_equals_its_portable_twin() {
        for len in [1, 7, 8, 19, 64, 203] {
            let x: Vec<f32> = (0..len)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) * 2.3)
                .collect();
            let (mut fast, mut portable) = (x.clone(), x);
            softmax_in_place(&mut fast);
            softmax_portable(&mut portable);
            assert_eq!(fast, portable, "len {len}");
        }
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
        let mut out = [3.0, 4.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0];
        rms_norm_rows_in_place(&mut out, &[1.0; 4], 0.0);
        assert!((out[0] - 1.2).abs() < 1e-6 && (out[1] - 1.6).abs() < 1e-6);
        assert!(out[4..].iter().all(|v| (v - 1.0).abs() < 1e-6));
    }
}

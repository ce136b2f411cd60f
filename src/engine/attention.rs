//! Causal attention of one KV head's query group over that head's cached rows, as two small
//! matrix products without horizontal sums: keys are widened from the f16 cache once per task
//! into a transposed `[head_dim, positions]` f32 copy, so a block of scores is a register of
//! consecutive positions accumulated over the head dimension; values are widened row by row,
//! so a head's output is a few registers accumulated over positions.
//!
//! Every score is `scale · (q_0·k_0 + q_1·k_1 + …)`, one fused multiply-add per dimension in
//! order, and every output element `w_0·v_0 + w_1·v_1 + …` likewise over positions: no value
//! depends on how lanes, blocks or queries are grouped, so the AVX-512 build of these loops,
//! the AVX2 one and the one-element definitions (`tests`) give the same floats, and a row's
//! result never depends on its batch mates or its prompt's chunking.

use super::ops;
use half::{f16, slice::HalfFloatSliceExt};

/// Positions are padded to a multiple of this (the widest register, 16 f32 lanes).
const POSITION_PAD: usize = 16;
/// Query heads one pass serves (a GQA group is split into passes of at most this many).
const MAX_HEADS_PER_PASS: usize = 4;

/// One KV head's keys (transposed) and values, widened to f32.
pub struct HeadRows {
    head_dim: usize,
    /// Positions held, padded to `POSITION_PAD` (the padding keys are zero).
    padded: usize,
    /// `[head_dim, padded]`.
    keys_t: Vec<f32>,
    /// `[positions, head_dim]`.
    values: Vec<f32>,
}

impl HeadRows {
    /// Widens the first `positions` rows of one KV head from the cache: `blocks` yields each
    /// block's key plane, transposed (`[stride, block rows]`: element c of row j at
    /// `c · block rows + j`), and value plane (`[block rows, stride]`); the head's elements
    /// are `offset..offset + head_dim` of each row.
    pub fn widen<'a>(
        blocks: impl Iterator<Item = (&'a [f16], &'a [f16])>,
        (stride, offset): (usize, usize),
        head_dim: usize,
        positions: usize,
    ) -> Self {
        let padded = positions.div_ceil(POSITION_PAD) * POSITION_PAD;
        let mut keys_t = vec![0f32; head_dim * padded];
        let mut values = vec![0f32; positions * head_dim];
        let mut position = 0;
        let mut blocks = blocks.peekable();
        while let Some((keys, vals)) = blocks.next() {
            let block_rows = keys.len() / stride;
            let rows = block_rows.min(positions - position);
            if rows == 0 {
                break;
            }
            // Blocks lie apart in memory, and the hardware prefetcher starts over at each one;
            // asking for the next block's rows of this head while this one widens took 7 % off
            // a decode step at context 1024 (docs/engine.md). Only a block still needed: a
            // prompt's early row runs stop short of its last blocks.
            if let Some(&(next_keys, next_vals)) =
                blocks.peek().filter(|_| position + rows < positions)
            {
                let next_rows = next_keys.len() / stride;
                prefetch(&next_keys[offset * next_rows..(offset + head_dim) * next_rows]);
                for j in 0..next_rows {
                    prefetch(&next_vals[j * stride + offset..][..head_dim]);
                }
            }
            // The cache keeps keys transposed, so each dimension's run of positions widens
            // straight into its row of `keys_t` (transposing here, one float at a time, was
            // most of attention's cost in a B = 1 decode step).
            for (d, run) in keys_t.chunks_exact_mut(padded).enumerate() {
                keys[(offset + d) * block_rows..][..rows]
                    .convert_to_f32_slice(&mut run[position..position + rows]);
            }
            for j in 0..rows {
                let at = j * stride + offset;
                vals[at..at + head_dim]
                    .convert_to_f32_slice(&mut values[(position + j) * head_dim..][..head_dim]);
            }
            position += rows;
        }
        assert_eq!(position, positions, "the blocks hold fewer rows than asked");
        Self {
            head_dim,
            padded,
            keys_t,
            values,
        }
    }

    /// For each query row `(queries, positions, out)`, each query head g of `queries`
    /// (`[heads, head_dim]`): `out_g += softmax(scale · q_g · Kᵀ) · V` over the first
    /// `positions` rows, on the registers of `vectors`. One score buffer serves every row.
    pub fn attend<'a>(
        &self,
        vectors: Vectors,
        scale: f32,
        rows: impl IntoIterator<Item = (&'a [f32], usize, &'a mut [f32])>,
    ) {
        let mut scores = vec![0f32; MAX_HEADS_PER_PASS * self.padded];
        for (queries, positions, out) in rows {
            assert!(positions * self.head_dim <= self.values.len());
            assert_eq!(queries.len(), out.len());
            for (queries, out) in queries
                .chunks(MAX_HEADS_PER_PASS * self.head_dim)
                .zip(out.chunks_mut(MAX_HEADS_PER_PASS * self.head_dim))
            {
                let pass = Pass {
                    rows: self,
                    queries,
                    positions,
                    scores: &mut scores,
                    out,
                };
                match vectors {
                    // SAFETY: `Vectors::available` lists a set only where the CPU has it.
                    #[cfg(target_arch = "x86_64")]
                    Vectors::Avx512 => unsafe { pass.run_avx512(scale) },
                    #[cfg(target_arch = "x86_64")]
                    Vectors::Avx2 => unsafe { pass.run_avx2(scale) },
                    Vectors::Scalar => unsafe { pass.run::<f32>(scale) },
                }
            }
        }
    }
}

/// Asks for `values`' cache lines (a hint: it reads nothing and faults on nothing).
fn prefetch(values: &[f16]) {
    #[cfg(target_arch = "x86_64")]
    for line in values.chunks(32) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: SSE is part of every x86_64 CPU, and a prefetch never faults.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = values;
}

/// The register sets attention runs on (the same floats on each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Vectors {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Scalar,
}

impl Vectors {
    /// Every set this CPU runs, widest first.
    pub fn available() -> Vec<Self> {
        let mut sets = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                sets.push(Self::Avx512);
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                sets.push(Self::Avx2);
            }
        }
        sets.push(Self::Scalar);
        sets
    }

    pub fn detect() -> Self {
        Self::available()[0]
    }
}

/// One pass: up to `MAX_HEADS_PER_PASS` heads' scores, softmax and weighted values.
struct Pass<'a> {
    rows: &'a HeadRows,
    queries: &'a [f32],
    positions: usize,
    scores: &'a mut [f32],
    out: &'a mut [f32],
}

impl Pass<'_> {
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,avx512f")]
    unsafe fn run_avx512(self, scale: f32) {
        self.run::<__m512>(scale)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run_avx2(self, scale: f32) {
        self.run::<__m256>(scale)
    }

    /// # Safety
    /// The CPU has `V`'s instructions.
    #[inline(always)]
    unsafe fn run<V: Register>(self, scale: f32) {
        let Self {
            rows,
            queries,
            positions,
            scores,
            out,
        } = self;
        let (hd, padded) = (rows.head_dim, rows.padded);
        let heads = queries.len() / hd;
        let scores = &mut scores[..heads * padded];
        let keys = &rows.keys_t;
        // Accumulators per head and register set: `H · B` of them, plus `B` keys and one
        // query, fit 32 registers (AVX-512) or 16 (AVX2, where four per head would spill).
        match (heads, V::LANES >= 16) {
            (1, _) => scores_for::<V, 1, 4>(queries, keys, hd, padded, scores),
            (2, true) => scores_for::<V, 2, 4>(queries, keys, hd, padded, scores),
            (3, true) => scores_for::<V, 3, 4>(queries, keys, hd, padded, scores),
            (4, true) => scores_for::<V, 4, 3>(queries, keys, hd, padded, scores),
            (2, false) => scores_for::<V, 2, 3>(queries, keys, hd, padded, scores),
            (3, false) => scores_for::<V, 3, 2>(queries, keys, hd, padded, scores),
            (4, false) => scores_for::<V, 4, 2>(queries, keys, hd, padded, scores),
            _ => unreachable!("passes hold 1..={MAX_HEADS_PER_PASS} heads"),
        }
        for head in scores.chunks_exact_mut(padded) {
            let head = &mut head[..positions];
            for s in head.iter_mut() {
                *s *= scale;
            }
            ops::softmax_in_place(head);
        }
        let values = &rows.values[..positions * hd];
        // `H · R` accumulators, `R` value registers and one weight, as for the scores.
        match (heads, V::LANES >= 16) {
            (_, true) if hd.is_multiple_of(4 * V::LANES) => match heads {
                1 => weighted_values::<V, 1, 4>(scores, padded, values, out),
                2 => weighted_values::<V, 2, 4>(scores, padded, values, out),
                3 => weighted_values::<V, 3, 4>(scores, padded, values, out),
                _ => weighted_values::<V, 4, 4>(scores, padded, values, out),
            },
            (_, false) if hd.is_multiple_of(2 * V::LANES) => {
                let four = hd.is_multiple_of(4 * V::LANES);
                match (heads, four) {
                    (1, true) => weighted_values::<V, 1, 4>(scores, padded, values, out),
                    (2, true) => weighted_values::<V, 2, 4>(scores, padded, values, out),
                    (1, false) => weighted_values::<V, 1, 2>(scores, padded, values, out),
                    (2, false) => weighted_values::<V, 2, 2>(scores, padded, values, out),
                    (3, _) => weighted_values::<V, 3, 2>(scores, padded, values, out),
                    _ => weighted_values::<V, 4, 2>(scores, padded, values, out),
                }
            }
            _ => weighted_values_any(scores, padded, values, out),
        }
    }
}

/// A register of f32 lanes, each lane its own chain of fused multiply-adds.
trait Register: Copy {
    const LANES: usize;
    /// # Safety
    /// `LANES` floats from `from` are readable and the CPU has the instructions.
    unsafe fn load(from: *const f32) -> Self;
    /// # Safety
    /// As `load`, writable.
    unsafe fn store(self, to: *mut f32);
    /// # Safety
    /// The CPU has the instructions.
    unsafe fn splat(v: f32) -> Self;
    /// `self · b + c` per lane, rounded once.
    ///
    /// # Safety
    /// The CPU has the instructions.
    unsafe fn mul_add(self, b: Self, c: Self) -> Self;
}

impl Register for f32 {
    const LANES: usize = 1;
    unsafe fn load(from: *const f32) -> Self {
        *from
    }
    unsafe fn store(self, to: *mut f32) {
        *to = self
    }
    unsafe fn splat(v: f32) -> Self {
        v
    }
    unsafe fn mul_add(self, b: Self, c: Self) -> Self {
        f32::mul_add(self, b, c)
    }
}

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
impl Register for __m256 {
    const LANES: usize = 8;
    #[inline(always)]
    unsafe fn load(from: *const f32) -> Self {
        _mm256_loadu_ps(from)
    }
    #[inline(always)]
    unsafe fn store(self, to: *mut f32) {
        _mm256_storeu_ps(to, self)
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> Self {
        _mm256_set1_ps(v)
    }
    #[inline(always)]
    unsafe fn mul_add(self, b: Self, c: Self) -> Self {
        _mm256_fmadd_ps(self, b, c)
    }
}

#[cfg(target_arch = "x86_64")]
impl Register for __m512 {
    const LANES: usize = 16;
    #[inline(always)]
    unsafe fn load(from: *const f32) -> Self {
        _mm512_loadu_ps(from)
    }
    #[inline(always)]
    unsafe fn store(self, to: *mut f32) {
        _mm512_storeu_ps(to, self)
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> Self {
        _mm512_set1_ps(v)
    }
    #[inline(always)]
    unsafe fn mul_add(self, b: Self, c: Self) -> Self {
        _mm512_fmadd_ps(self, b, c)
    }
}

/// `scores[h · padded + j] = Σ_d q_h[d] · keys_t[d · padded + j]` for all `padded` positions,
/// `B` registers of positions per pass over the head dimension (`H · B` independent chains
/// hide the FMA latency), single registers at the end.
///
/// # Safety
/// The CPU has `V`'s instructions.
#[inline(always)]
unsafe fn scores_for<V: Register, const H: usize, const B: usize>(
    queries: &[f32],
    keys_t: &[f32],
    hd: usize,
    padded: usize,
    scores: &mut [f32],
) {
    assert!(queries.len() == H * hd && keys_t.len() == hd * padded);
    assert!(scores.len() == H * padded && padded.is_multiple_of(V::LANES));
    let mut first = 0;
    while first < padded {
        if padded - first >= B * V::LANES {
            score_registers::<V, H, B>(queries, keys_t, hd, padded, first, scores);
            first += B * V::LANES;
        } else {
            score_registers::<V, H, 1>(queries, keys_t, hd, padded, first, scores);
            first += V::LANES;
        }
    }
}

/// `B` registers of positions from `first` (inside `padded`, asserted by the caller), for
/// each of the `H` heads.
///
/// # Safety
/// The CPU has `V`'s instructions; `first + B · V::LANES <= padded`.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // constant index loops keep the accumulators in registers
unsafe fn score_registers<V: Register, const H: usize, const B: usize>(
    queries: &[f32],
    keys_t: &[f32],
    hd: usize,
    padded: usize,
    first: usize,
    scores: &mut [f32],
) {
    let mut acc = [[V::splat(0.0); B]; H];
    for d in 0..hd {
        let keys = keys_t.as_ptr().add(d * padded + first);
        let keys: [V; B] = std::array::from_fn(|b| V::load(keys.add(b * V::LANES)));
        for h in 0..H {
            let q = V::splat(queries[h * hd + d]);
            for b in 0..B {
                acc[h][b] = q.mul_add(keys[b], acc[h][b]);
            }
        }
    }
    for h in 0..H {
        let row = scores.as_mut_ptr().add(h * padded + first);
        for b in 0..B {
            acc[h][b].store(row.add(b * V::LANES));
        }
    }
}

/// `out[h · hd + e] += Σ_j weights[h · padded + j] · values[j · hd + e]`, `R` registers of
/// elements of every head per pass (their accumulators stay in registers over all positions).
///
/// # Safety
/// The CPU has `V`'s instructions.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // as in `score_registers`
unsafe fn weighted_values<V: Register, const H: usize, const R: usize>(
    weights: &[f32],
    padded: usize,
    values: &[f32],
    out: &mut [f32],
) {
    let hd = out.len() / H;
    assert!(out.len() == H * hd && hd.is_multiple_of(R * V::LANES));
    assert!(weights.len() == H * padded && values.len() <= padded * hd);
    let positions = values.len() / hd;
    for first in (0..hd).step_by(R * V::LANES) {
        let mut acc: [[V; R]; H] = std::array::from_fn(|h| {
            std::array::from_fn(|r| V::load(out.as_ptr().add(h * hd + first + r * V::LANES)))
        });
        for j in 0..positions {
            let row = values.as_ptr().add(j * hd + first);
            let row: [V; R] = std::array::from_fn(|r| V::load(row.add(r * V::LANES)));
            for h in 0..H {
                let w = V::splat(weights[h * padded + j]);
                for r in 0..R {
                    acc[h][r] = w.mul_add(row[r], acc[h][r]);
                }
            }
        }
        for h in 0..H {
            for r in 0..R {
                acc[h][r].store(out.as_mut_ptr().add(h * hd + first + r * V::LANES));
            }
        }
    }
}

/// `weighted_values` for any head size, one element at a time (same arithmetic).
fn weighted_values_any(weights: &[f32], padded: usize, values: &[f32], out: &mut [f32]) {
    let heads = weights.len() / padded;
    let hd = out.len() / heads;
    for (h, out) in out.chunks_exact_mut(hd).enumerate() {
        for (j, row) in values.chunks_exact(hd).enumerate() {
            let w = weights[h * padded + j];
            for (o, &v) in out.iter_mut().zip(row) {
                *o = w.mul_add(v, *o);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one-element definitions: one FMA chain per score and per output element.
    fn reference(
        keys: &[Vec<f32>],
        values: &[Vec<f32>],
        queries: &[f32],
        positions: usize,
        scale: f32,
    ) -> Vec<f32> {
        let hd = keys[0].len();
        let mut out = vec![0.25f32; queries.len()];
        for (q, out) in queries.chunks(hd).zip(out.chunks_mut(hd)) {
            let mut scores: Vec<f32> = keys[..positions]
                .iter()
                .map(|k| q.iter().zip(k).fold(0f32, |acc, (q, k)| q.mul_add(*k, acc)) * scale)
                .collect();
            ops::softmax_in_place(&mut scores);
            for (w, v) in scores.iter().zip(values) {
                for (o, v) in out.iter_mut().zip(v) {
                    *o = w.mul_add(*v, *o);
                }
            }
        }
        out
    }

    /// KV rows in two cache blocks of 24 rows (stride 80, the head at offset 8), head sizes
    /// on the blocked path (64) and off it (12), 1 to 6 query heads (passes of 4 and a rest),
    /// position counts around the block sizes: the blocked builds equal the definitions bit
    /// for bit.
    #[test]
    fn blocked_attention_equals_the_one_element_definitions() {
        let (stride, offset, block_rows) = (80, 8, 24);
        let value = |i: usize| f16::from_f32(((i * 31 % 97) as f32 - 48.0) / 23.0);
        let planes: Vec<(Vec<f16>, Vec<f16>)> = (0..2)
            .map(|b| {
                let plane = |salt| (0..stride * block_rows).map(|i| value(i + salt)).collect();
                (plane(b * 7919), plane(b * 7919 + 13))
            })
            .collect();
        // Keys are transposed in the plane (element c of row j at `c · block_rows + j`).
        let rows_of = |hd: usize, at: &dyn Fn(usize, usize) -> usize, which: usize| {
            planes
                .iter()
                .flat_map(|p| {
                    let plane = if which == 0 { &p.0 } else { &p.1 };
                    (0..block_rows)
                        .map(|j| (0..hd).map(|d| plane[at(j, offset + d)].to_f32()).collect())
                        .collect::<Vec<Vec<f32>>>()
                })
                .collect::<Vec<Vec<f32>>>()
        };
        for hd in [64, 12] {
            let keys = rows_of(hd, &|j, c| c * block_rows + j, 0);
            let values = rows_of(hd, &|j, c| j * stride + c, 1);
            for positions in [1, 15, 16, 17, 40, 48] {
                let blocks = planes.iter().map(|(k, v)| (&k[..], &v[..]));
                let rows = HeadRows::widen(blocks, (stride, offset), hd, positions);
                for heads in 1..=6 {
                    let queries: Vec<f32> =
                        (0..heads * hd).map(|i| (i as f32 * 0.37).sin()).collect();
                    let want = reference(&keys, &values, &queries, positions, 0.125);
                    for vectors in Vectors::available() {
                        let mut out = vec![0.25f32; queries.len()];
                        rows.attend(vectors, 0.125, [(&queries[..], positions, &mut out[..])]);
                        assert_eq!(
                            out, want,
                            "{vectors:?}: hd {hd}, {positions} positions, {heads} heads"
                        );
                    }
                }
            }
        }
    }
}

//! Causal attention of one KV head's query group over that head's cached rows, as two small
//! matrix products without horizontal sums: the cache keeps keys transposed per block
//! (`[head_dim, block rows]`), so a block of scores is a register of consecutive positions
//! accumulated over the head dimension; values are read row by row, so a head's output is a
//! few registers accumulated over positions.
//!
//! A task of many query rows (a prompt's run) widens its KV head from f16 once into an f32
//! copy (`HeadRows`) that every row reads; a single row (a decode step) reads the f16 blocks
//! in place (`HeadBlocks`), widening in registers: writing and re-reading a copy of the whole
//! context for one query had made attention a fifth of a B = 1 decode step at context ~800.
//!
//! Every score is `scale · (q_0·k_0 + q_1·k_1 + …)`, one fused multiply-add per dimension in
//! order, and every output element `w_0·v_0 + w_1·v_1 + …` likewise over positions: no value
//! depends on how lanes, blocks or queries are grouped, so the AVX-512 build of these loops,
//! the AVX2 one and the one-element definitions (`tests`) give the same floats, and a row's
//! result never depends on its batch mates or its prompt's chunking.

use super::ops;
use half::{f16, slice::HalfFloatSliceExt};
use std::ops::Range;

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
}

/// One KV head's rows as attention reads them: keys as runs of consecutive positions, one run
/// per head element, and values as rows.
///
/// # Safety
/// For every position `p < padded()` that is a multiple of 16: `key_at(p)` and each
/// `key_stride()` step after it, `head_dim() - 1` of them, start 16 readable elements; for
/// every `p < positions()`, `value_at(p)` starts `head_dim()` readable elements.
pub unsafe trait KvRows {
    type Element: Widen;
    fn head_dim(&self) -> usize;
    /// Positions held.
    fn positions(&self) -> usize;
    /// `positions()` rounded up to a multiple of `POSITION_PAD` (keys past `positions()` are
    /// read and their scores never used).
    fn padded(&self) -> usize {
        self.positions().div_ceil(POSITION_PAD) * POSITION_PAD
    }
    /// Distance from a key element's run to the next element's.
    fn key_stride(&self) -> usize;
    /// Element 0 of the keys of positions `p..`.
    fn key_at(&self, p: usize) -> *const Self::Element;
    /// Value row `p`.
    fn value_at(&self, p: usize) -> *const Self::Element;

    /// For each query row `(queries, visible, out)`, each query head g of `queries`
    /// (`[heads, head_dim]`): `out_g += softmax(scale · q_g · Kᵀ) · V` over the rows in
    /// `visible` (a causal row sees `0..=its position`; a sliding window's row a suffix of
    /// that), on the registers of `vectors`. One score buffer serves every row.
    fn attend<'a>(
        &self,
        vectors: Vectors,
        scale: f32,
        rows: impl IntoIterator<Item = (&'a [f32], Range<usize>, &'a mut [f32])>,
    ) where
        Self: Sized,
    {
        let hd = self.head_dim();
        let mut scores = vec![0f32; MAX_HEADS_PER_PASS * self.padded()];
        for (queries, visible, out) in rows {
            assert!(visible.start < visible.end && visible.end <= self.positions());
            assert_eq!(queries.len(), out.len());
            for (queries, out) in queries
                .chunks(MAX_HEADS_PER_PASS * hd)
                .zip(out.chunks_mut(MAX_HEADS_PER_PASS * hd))
            {
                let pass = Pass {
                    rows: self,
                    queries,
                    visible: visible.clone(),
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

// SAFETY: `keys_t` is `[head_dim, padded]` and `values` `[positions, head_dim]`.
unsafe impl KvRows for HeadRows {
    type Element = f32;
    fn head_dim(&self) -> usize {
        self.head_dim
    }
    fn positions(&self) -> usize {
        self.values.len() / self.head_dim
    }
    fn key_stride(&self) -> usize {
        self.padded
    }
    fn key_at(&self, p: usize) -> *const f32 {
        self.keys_t[p..].as_ptr()
    }
    fn value_at(&self, p: usize) -> *const f32 {
        self.values[p * self.head_dim..].as_ptr()
    }
}

/// One KV head's rows read in place from the f16 cache blocks.
pub struct HeadBlocks<'a> {
    /// Per block: its key plane from the head's first element (`[head_dim, block rows]`
    /// onwards) and its value plane from the head's first element of row 0.
    blocks: Vec<(&'a [f16], &'a [f16])>,
    /// log2 of the rows per block.
    shift: u32,
    /// Elements per cached value row.
    stride: usize,
    head_dim: usize,
    positions: usize,
}

impl<'a> HeadBlocks<'a> {
    /// The first `positions` rows of one KV head in `blocks`, laid out as for
    /// `HeadRows::widen`; `None` unless a block's rows are a power of two and a multiple of
    /// `POSITION_PAD` (a register of positions must not cross blocks).
    pub fn new(
        blocks: impl Iterator<Item = (&'a [f16], &'a [f16])>,
        (stride, offset): (usize, usize),
        head_dim: usize,
        positions: usize,
    ) -> Option<Self> {
        let mut blocks = blocks.peekable();
        let block_rows = blocks.peek()?.0.len() / stride;
        if !block_rows.is_power_of_two()
            || !block_rows.is_multiple_of(POSITION_PAD)
            || offset + head_dim > stride
        {
            return None;
        }
        let needed = positions.div_ceil(block_rows);
        let blocks: Vec<(&[f16], &[f16])> = blocks
            .take(needed)
            .map(|(k, v)| {
                (k.len() == stride * block_rows && v.len() == k.len())
                    .then(|| (&k[offset * block_rows..], &v[offset..]))
            })
            .collect::<Option<_>>()?;
        if blocks.len() < needed {
            return None;
        }
        Some(Self {
            blocks,
            shift: block_rows.trailing_zeros(),
            stride,
            head_dim,
            positions,
        })
    }
}

// SAFETY: every block holds `block rows` rows of `stride ≥ offset + head_dim` elements, and
// `padded ≤ blocks · block rows` (block rows are a multiple of the padding), so a run of 16
// from a padded position stays inside its block's plane for every head element.
unsafe impl KvRows for HeadBlocks<'_> {
    type Element = f16;
    fn head_dim(&self) -> usize {
        self.head_dim
    }
    fn positions(&self) -> usize {
        self.positions
    }
    fn key_stride(&self) -> usize {
        1 << self.shift
    }
    fn key_at(&self, p: usize) -> *const f16 {
        let slot = p & ((1 << self.shift) - 1);
        self.blocks[p >> self.shift].0[slot..].as_ptr()
    }
    fn value_at(&self, p: usize) -> *const f16 {
        let slot = p & ((1 << self.shift) - 1);
        self.blocks[p >> self.shift].1[slot * self.stride..].as_ptr()
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
            let avx2 = std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c");
            if avx2 && std::arch::is_x86_feature_detected!("avx512f") {
                sets.push(Self::Avx512);
            }
            if avx2 {
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
struct Pass<'a, S> {
    rows: &'a S,
    queries: &'a [f32],
    visible: Range<usize>,
    scores: &'a mut [f32],
    out: &'a mut [f32],
}

impl<S: KvRows> Pass<'_, S> {
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    unsafe fn run_avx512(self, scale: f32) {
        self.run::<__m512>(scale)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
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
            visible,
            scores,
            out,
        } = self;
        let (hd, padded) = (rows.head_dim(), rows.padded());
        let heads = queries.len() / hd;
        let scores = &mut scores[..heads * padded];
        // Scores from the register run holding the first visible position.
        let from = visible.start / POSITION_PAD * POSITION_PAD;
        // Accumulators per head and register set: `H · B` of them, plus `B` keys and one
        // query, fit 32 registers (AVX-512) or 16 (AVX2, where four per head would spill).
        match (heads, V::LANES >= 16) {
            (1, _) => scores_for::<V, 1, 4, S>(queries, rows, hd, (from, padded), scores),
            (2, true) => scores_for::<V, 2, 4, S>(queries, rows, hd, (from, padded), scores),
            (3, true) => scores_for::<V, 3, 4, S>(queries, rows, hd, (from, padded), scores),
            (4, true) => scores_for::<V, 4, 3, S>(queries, rows, hd, (from, padded), scores),
            (2, false) => scores_for::<V, 2, 3, S>(queries, rows, hd, (from, padded), scores),
            (3, false) => scores_for::<V, 3, 2, S>(queries, rows, hd, (from, padded), scores),
            (4, false) => scores_for::<V, 4, 2, S>(queries, rows, hd, (from, padded), scores),
            _ => unreachable!("passes hold 1..={MAX_HEADS_PER_PASS} heads"),
        }
        for head in scores.chunks_exact_mut(padded) {
            let head = &mut head[visible.clone()];
            for s in head.iter_mut() {
                *s *= scale;
            }
            ops::softmax_in_place(head);
        }
        let values = (rows, visible);
        // `H · R` accumulators, `R` value registers and one weight, as for the scores.
        match (heads, V::LANES >= 16) {
            (_, true) if hd.is_multiple_of(4 * V::LANES) => match heads {
                1 => weighted_values::<V, 1, 4, S>(scores, padded, values, out),
                2 => weighted_values::<V, 2, 4, S>(scores, padded, values, out),
                3 => weighted_values::<V, 3, 4, S>(scores, padded, values, out),
                _ => weighted_values::<V, 4, 4, S>(scores, padded, values, out),
            },
            (_, false) if hd.is_multiple_of(2 * V::LANES) => {
                let four = hd.is_multiple_of(4 * V::LANES);
                match (heads, four) {
                    (1, true) => weighted_values::<V, 1, 4, S>(scores, padded, values, out),
                    (2, true) => weighted_values::<V, 2, 4, S>(scores, padded, values, out),
                    (1, false) => weighted_values::<V, 1, 2, S>(scores, padded, values, out),
                    (2, false) => weighted_values::<V, 2, 2, S>(scores, padded, values, out),
                    (3, _) => weighted_values::<V, 3, 2, S>(scores, padded, values, out),
                    _ => weighted_values::<V, 4, 2, S>(scores, padded, values, out),
                }
            }
            _ => weighted_values_any(scores, padded, values, out),
        }
    }
}

/// A register of f32 lanes, each lane its own chain of fused multiply-adds.
pub trait Register: Copy {
    const LANES: usize;
    /// # Safety
    /// `LANES` floats from `from` are readable and the CPU has the instructions.
    unsafe fn load(from: *const f32) -> Self;
    /// `LANES` halves from `from`, widened (exactly).
    ///
    /// # Safety
    /// As `load`.
    unsafe fn load_f16(from: *const f16) -> Self;
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
    unsafe fn load_f16(from: *const f16) -> Self {
        (*from).to_f32()
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
    unsafe fn load_f16(from: *const f16) -> Self {
        _mm256_cvtph_ps(_mm_loadu_si128(from.cast()))
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
    unsafe fn load_f16(from: *const f16) -> Self {
        _mm512_cvtph_ps(_mm256_loadu_si256(from.cast()))
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

/// An element type the cache rows come in, read into registers as f32.
pub trait Widen: Copy {
    /// # Safety
    /// `V::LANES` elements from `from` are readable and the CPU has `V`'s instructions.
    unsafe fn widen<V: Register>(from: *const Self) -> V;
}

impl Widen for f32 {
    #[inline(always)]
    unsafe fn widen<V: Register>(from: *const f32) -> V {
        V::load(from)
    }
}

impl Widen for f16 {
    #[inline(always)]
    unsafe fn widen<V: Register>(from: *const f16) -> V {
        V::load_f16(from)
    }
}

/// `scores[h · padded + j] = Σ_d q_h[d] · key_d[j]` for the positions `from..padded`,
/// `B` registers of positions per pass over the head dimension (`H · B` independent chains
/// hide the FMA latency), single registers at the end.
///
/// # Safety
/// The CPU has `V`'s instructions.
#[inline(always)]
unsafe fn scores_for<V: Register, const H: usize, const B: usize, S: KvRows>(
    queries: &[f32],
    keys: &S,
    hd: usize,
    (from, padded): (usize, usize),
    scores: &mut [f32],
) {
    assert!(queries.len() == H * hd && keys.head_dim() == hd && keys.padded() == padded);
    assert!(scores.len() == H * padded && padded.is_multiple_of(V::LANES));
    assert!(POSITION_PAD.is_multiple_of(V::LANES) && from.is_multiple_of(POSITION_PAD));
    let mut first = from;
    while first < padded {
        if padded - first >= B * V::LANES {
            score_registers::<V, H, B, S>(queries, keys, hd, padded, first, scores);
            first += B * V::LANES;
        } else {
            score_registers::<V, H, 1, S>(queries, keys, hd, padded, first, scores);
            first += V::LANES;
        }
    }
}

/// `B` registers of positions from `first` (inside `padded`, asserted by the caller), for
/// each of the `H` heads.
///
/// # Safety
/// The CPU has `V`'s instructions; `first + B · V::LANES <= padded`, `first` a multiple of
/// `V::LANES` (so each register's run lies inside one run of `KvRows`' 16).
#[inline(always)]
#[allow(clippy::needless_range_loop)] // constant index loops keep the accumulators in registers
unsafe fn score_registers<V: Register, const H: usize, const B: usize, S: KvRows>(
    queries: &[f32],
    keys: &S,
    hd: usize,
    padded: usize,
    first: usize,
    scores: &mut [f32],
) {
    let stride = keys.key_stride();
    let runs: [*const S::Element; B] = std::array::from_fn(|b| keys.key_at(first + b * V::LANES));
    let mut acc = [[V::splat(0.0); B]; H];
    for d in 0..hd {
        let keys: [V; B] = std::array::from_fn(|b| S::Element::widen(runs[b].add(d * stride)));
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
unsafe fn weighted_values<V: Register, const H: usize, const R: usize, S: KvRows>(
    weights: &[f32],
    padded: usize,
    (values, visible): (&S, Range<usize>),
    out: &mut [f32],
) {
    let hd = out.len() / H;
    assert!(out.len() == H * hd && hd.is_multiple_of(R * V::LANES) && values.head_dim() == hd);
    assert!(weights.len() == H * padded && visible.end <= values.positions());
    for first in (0..hd).step_by(R * V::LANES) {
        let mut acc: [[V; R]; H] = std::array::from_fn(|h| {
            std::array::from_fn(|r| V::load(out.as_ptr().add(h * hd + first + r * V::LANES)))
        });
        for j in visible.clone() {
            let row = values.value_at(j).add(first);
            let row: [V; R] = std::array::from_fn(|r| S::Element::widen(row.add(r * V::LANES)));
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
fn weighted_values_any<S: KvRows>(
    weights: &[f32],
    padded: usize,
    (values, visible): (&S, Range<usize>),
    out: &mut [f32],
) {
    let heads = weights.len() / padded;
    let hd = out.len() / heads;
    assert!(values.head_dim() == hd && visible.end <= values.positions());
    for (h, out) in out.chunks_exact_mut(hd).enumerate() {
        for j in visible.clone() {
            let w = weights[h * padded + j];
            let row = values.value_at(j);
            for (e, o) in out.iter_mut().enumerate() {
                // SAFETY: value rows below `positions()` hold `head_dim` elements (`KvRows`);
                // `f32` is its own register.
                let v: f32 = unsafe { S::Element::widen(row.add(e)) };
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
        visible: Range<usize>,
        scale: f32,
    ) -> Vec<f32> {
        let hd = keys[0].len();
        let mut out = vec![0.25f32; queries.len()];
        for (q, out) in queries.chunks(hd).zip(out.chunks_mut(hd)) {
            let mut scores: Vec<f32> = keys[visible.clone()]
                .iter()
                .map(|k| q.iter().zip(k).fold(0f32, |acc, (q, k)| q.mul_add(*k, acc)) * scale)
                .collect();
            ops::softmax_in_place(&mut scores);
            for (w, v) in scores.iter().zip(&values[visible.start..]) {
                for (o, v) in out.iter_mut().zip(v) {
                    *o = w.mul_add(*v, *o);
                }
            }
        }
        out
    }

    /// KV rows in cache blocks of 24 rows (two; only widened) and of 16 rows (three; widened
    /// and read in place), stride 80 with the head at offset 8, head sizes on the blocked path
    /// (64) and off it (12), 1 to 6 query heads (passes of 4 and a rest), position counts
    /// around the block sizes, causal and sliding-window rows: every build equals the
    /// definitions bit for bit.
    #[test]
    fn blocked_attention_equals_the_one_element_definitions() {
        let (stride, offset) = (80, 8);
        let value = |i: usize| f16::from_f32(((i * 31 % 97) as f32 - 48.0) / 23.0);
        for (block_rows, block_count) in [(24, 2), (16, 3)] {
            let planes: Vec<(Vec<f16>, Vec<f16>)> = (0..block_count)
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
                    let blocks = || planes.iter().map(|(k, v)| (&k[..], &v[..]));
                    let widened = HeadRows::widen(blocks(), (stride, offset), hd, positions);
                    let in_place = HeadBlocks::new(blocks(), (stride, offset), hd, positions);
                    assert_eq!(in_place.is_some(), block_rows == 16, "{block_rows} rows");
                    // Causal rows, and sliding windows starting inside and at a register run.
                    let starts = [0, positions / 2, 16.min(positions - 1)];
                    for (heads, start) in (1..=6).flat_map(|h| starts.map(|s| (h, s))) {
                        let visible = start..positions;
                        let queries: Vec<f32> =
                            (0..heads * hd).map(|i| (i as f32 * 0.37).sin()).collect();
                        let want = reference(&keys, &values, &queries, visible.clone(), 0.125);
                        let case = format!("hd {hd}, positions {visible:?}, {heads} heads");
                        for vectors in Vectors::available() {
                            let attend = |rows: &dyn Fn(&mut [f32])| {
                                let mut out = vec![0.25f32; queries.len()];
                                rows(&mut out);
                                out
                            };
                            let out = attend(&|out| {
                                widened.attend(
                                    vectors,
                                    0.125,
                                    [(&queries[..], visible.clone(), out)],
                                )
                            });
                            assert_eq!(out, want, "{vectors:?} widened: {case}");
                            if let Some(in_place) = &in_place {
                                let out = attend(&|out| {
                                    in_place.attend(
                                        vectors,
                                        0.125,
                                        [(&queries[..], visible.clone(), out)],
                                    )
                                });
                                assert_eq!(out, want, "{vectors:?} in place: {case}");
                            }
                        }
                    }
                }
            }
        }
    }
}

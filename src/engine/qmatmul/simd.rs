//! SIMD tiles: one weight column against `R` activation rows. The column's blocks are decoded
//! once and multiplied into all `R` rows: on AVX2 + FMA with `maddubs` (u8 × i8 pairs → i16)
//! and `madd` (→ i32), then scaled into per-row f32 lanes. Sums are exact in the integer part
//! (|pair| ≤ 2 · 128 · 127 < 2¹⁵), and each row's lanes are reduced in one fixed order.
//! Only the `R` accumulators live in the loop (the Q4 offsets are summed after it), so they
//! stay in registers. CPUs with AVX-512 VNNI use `vpdpbusd` in place of `maddubs` + `madd`
//! (same integer sums), and run Q4 two blocks per 512-bit instruction (same products, summed
//! in another fixed order). Either way a row's result never depends on its tile.

use super::activations::{padded_blocks, QuantBlock, QuantizedRows};
use std::arch::x86_64::*;

/// Lanes 0..8 summed as ((0+4)+(2+6)) + ((1+5)+(3+7)), the same for every row.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn horizontal_sum(v: __m256) -> f32 {
    let halves = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let pairs = _mm_add_ps(halves, _mm_movehl_ps(halves, halves));
    _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)))
}

/// Rows `first_row..first_row + R` of `x` as raw pointers, bounds checked once.
struct RowTile<'a, const R: usize> {
    quants: *const QuantBlock,
    scales: &'a [f32],
    blocks: usize,
}

impl<'a, const R: usize> RowTile<'a, R> {
    fn new(x: &'a QuantizedRows, first_row: usize, blocks: usize) -> Self {
        assert!(first_row + R <= x.rows() && blocks == x.blocks_per_row());
        Self {
            // In bounds: rows first_row..first_row + R exist (asserted).
            quants: x.quants()[first_row * blocks..].as_ptr(),
            scales: &x.scales()[first_row * blocks..(first_row + R) * blocks],
            blocks,
        }
    }

    /// Block `b` of the tile's row `r`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn load(&self, r: usize, b: usize) -> __m256i {
        _mm256_load_si256(self.quants.add(r * self.blocks + b) as *const __m256i)
    }

    /// Block `b` of the tile's row `r` (blocks of a row are contiguous).
    #[inline]
    fn block_ptr(&self, r: usize, b: usize) -> *const QuantBlock {
        debug_assert!(b < self.blocks);
        // In bounds: r < R rows of `blocks` blocks from the tile's first row.
        unsafe { self.quants.add(r * self.blocks + b) }
    }

    /// The scales of blocks `b..` of the tile's row `r`.
    #[inline]
    fn scale_ptr(&self, r: usize, b: usize, blocks: usize) -> *const f32 {
        self.scales[r * blocks + b..].as_ptr()
    }

    /// `block_scale` × the scale of block `b` of the tile's row `r`, in all lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn scale(&self, block_scale: __m256, r: usize, b: usize, blocks: usize) -> __m256 {
        debug_assert!(r * blocks + b < self.scales.len());
        _mm256_mul_ps(
            block_scale,
            _mm256_broadcast_ss(self.scales.get_unchecked(r * blocks + b)),
        )
    }
}

/// `q8_0_tile` for one instruction set: `$dot(unsigned, signed)` is the exact i32 sum of each
/// group of four u8 × i8 products.
macro_rules! q8_0_tile {
    ($features:literal, $dot:ident) => {
        /// `out[i]` = column `w` · row `first_row + i`, for `i < R`.
        #[inline]
        #[target_feature(enable = $features)]
        pub unsafe fn q8_0_tile<const R: usize>(
            quants: &[u8],
            block_scales: &[f32],
            x: &QuantizedRows,
            first_row: usize,
            out: &mut [f32],
        ) {
            let blocks = block_scales.len();
            assert_eq!(quants.len(), blocks * 32);
            let tile = RowTile::<R>::new(x, first_row, blocks);
            let mut acc = [_mm256_setzero_ps(); R];
            for (b, &scale) in block_scales.iter().enumerate() {
                let weights = _mm256_load_si256(quants.as_ptr().add(b * 32) as *const __m256i);
                let magnitudes = _mm256_sign_epi8(weights, weights);
                let scale = _mm256_set1_ps(scale);
                for (r, acc) in acc.iter_mut().enumerate() {
                    let signed = _mm256_sign_epi8(tile.load(r, b), weights);
                    let s = tile.scale(scale, r, b, blocks);
                    let dot = $dot(magnitudes, signed);
                    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, *acc);
                }
            }
            for (slot, acc) in out.iter_mut().zip(acc) {
                *slot = horizontal_sum(acc);
            }
        }
    };
}

/// Block `b`'s 32 nibbles (element j in the low nibble of byte j, element j + 16 in its high
/// nibble) as 32 bytes in element order.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn q4_block(quants: &[u8], b: usize) -> __m256i {
    let low_mask = _mm_set1_epi8(0x0F);
    let packed = _mm_load_si128(quants.as_ptr().add(b * 16) as *const __m128i);
    let low = _mm_and_si128(packed, low_mask);
    let high = _mm_and_si128(_mm_srli_epi16(packed, 4), low_mask);
    _mm256_set_m128i(high, low)
}

/// Adds Q4 blocks `$blocks_range` of a column into the rows' 256-bit accumulators, one block
/// per step, with `$dot` as the integer dot product.
macro_rules! q4_blocks_256 {
    ($dot:ident, $acc:ident, $quants:ident, $block_scales:ident, $tile:ident, $blocks_range:expr) => {
        for b in $blocks_range {
            let nibbles = q4_block($quants, b);
            let scale = _mm256_set1_ps($block_scales[b]);
            for (r, acc) in $acc.iter_mut().enumerate() {
                let s = $tile.scale(scale, r, b, $block_scales.len());
                let dot = $dot(nibbles, $tile.load(r, b));
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, *acc);
            }
        }
    };
}

/// Adds each row's Q4 offset term Σ_b offset_b · scale_x · Σq_x into its accumulator, then
/// reduces the accumulators into `out`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn finish_q4<const R: usize>(
    mut acc: [__m256; R],
    offsets: &[f32],
    x: &QuantizedRows,
    first_row: usize,
    out: &mut [f32],
) {
    for (r, acc) in acc.iter_mut().enumerate() {
        let sums = x.row_scaled_sums(first_row + r);
        for (o, s) in offsets.chunks_exact(8).zip(sums.chunks_exact(8)) {
            let (o, s) = (_mm256_loadu_ps(o.as_ptr()), _mm256_loadu_ps(s.as_ptr()));
            *acc = _mm256_fmadd_ps(o, s, *acc);
        }
    }
    for (slot, acc) in out.iter_mut().zip(acc) {
        *slot = horizontal_sum(acc);
    }
}

/// AVX2 + FMA: `maddubs` + `madd`, one block per step.
pub mod avx2 {
    use super::*;

    q8_0_tile!("avx2,fma", dot_avx2);

    /// `out[i]` = Σ_b scale_b · (nibbles_b · row `first_row + i`) + Σ_b offset_b · scale_x ·
    /// Σq_x, for `i < R` (Q4_0 and Q4_1; `offsets` zero-padded to whole registers, like the
    /// rows' block sums).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn q4_tile<const R: usize>(
        quants: &[u8],
        block_scales: &[f32],
        offsets: &[f32],
        x: &QuantizedRows,
        first_row: usize,
        out: &mut [f32],
    ) {
        let blocks = block_scales.len();
        assert_eq!(quants.len(), blocks * 16);
        assert_eq!(offsets.len(), padded_blocks(blocks));
        let tile = RowTile::<R>::new(x, first_row, blocks);
        let mut acc = [_mm256_setzero_ps(); R];
        q4_blocks_256!(dot_avx2, acc, quants, block_scales, tile, 0..blocks);
        finish_q4(acc, offsets, x, first_row, out)
    }
}

/// AVX-512 VNNI: `vpdpbusd`; Q4 runs two blocks per 512-bit instruction, which halves the
/// instructions per row (the tile is bound by instruction throughput, not loads).
pub mod vnni {
    use super::*;

    q8_0_tile!("avx2,fma,avx512vnni,avx512vl", dot_vnni);

    /// As `avx2::q4_tile`. Block pairs: lanes 0..8 hold block b's four-byte sums, lanes 8..16
    /// block b + 1's, each scaled by its own weight and activation scales; an odd last block
    /// runs on 256 bits.
    #[inline]
    #[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vnni,avx512vl")]
    pub unsafe fn q4_tile<const R: usize>(
        quants: &[u8],
        block_scales: &[f32],
        offsets: &[f32],
        x: &QuantizedRows,
        first_row: usize,
        out: &mut [f32],
    ) {
        let blocks = block_scales.len();
        assert_eq!(quants.len(), blocks * 16);
        assert_eq!(offsets.len(), padded_blocks(blocks));
        let tile = RowTile::<R>::new(x, first_row, blocks);
        let low_mask = _mm256_set1_epi8(0x0F);
        // Lanes 0..8 take element 0 of a two-float vector, lanes 8..16 element 1.
        let pair_lanes = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        let two = |p: *const f32| _mm_castpd_ps(_mm_load_sd(p as *const f64));
        let mut wide = [_mm512_setzero_ps(); R];
        let paired = blocks - blocks % 2;
        for b in (0..paired).step_by(2) {
            let packed = _mm256_loadu_si256(quants.as_ptr().add(b * 16) as *const __m256i);
            let low = _mm256_and_si256(packed, low_mask);
            let high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_mask);
            let nibbles = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_permute2x128_si256(low, high, 0x20)),
                _mm256_permute2x128_si256(low, high, 0x31),
                1,
            );
            let weight_scales = two(block_scales.as_ptr().add(b));
            for (r, acc) in wide.iter_mut().enumerate() {
                let scales = _mm_mul_ps(weight_scales, two(tile.scale_ptr(r, b, blocks)));
                let s = _mm512_permutexvar_ps(pair_lanes, _mm512_castps128_ps512(scales));
                let row = _mm512_loadu_si512(tile.block_ptr(r, b) as *const __m512i);
                let dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), nibbles, row);
                *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, *acc);
            }
        }
        let mut acc = wide.map(|w| {
            let high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(w), 1));
            _mm256_add_ps(_mm512_castps512_ps256(w), high)
        });
        q4_blocks_256!(dot_vnni, acc, quants, block_scales, tile, paired..blocks);
        finish_q4(acc, offsets, x, first_row, out)
    }
}

/// `maddubs` (u8 × i8 pairs → i16; |pair| ≤ 2 · 128 · 127 < 2¹⁵, so never saturating) then
/// `madd` against ones (→ i32).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn dot_avx2(unsigned: __m256i, signed: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(unsigned, signed), _mm256_set1_epi16(1))
}

/// AVX-512 VNNI's `vpdpbusd` on 256-bit registers: the same sums in one instruction.
#[inline]
#[target_feature(enable = "avx2,fma,avx512vnni,avx512vl")]
fn dot_vnni(unsigned: __m256i, signed: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(_mm256_setzero_si256(), unsigned, signed)
}

//! SIMD tiles: `C` weight columns against `R` activation rows, over the grouped layout of
//! `layout`. Each vector of a column is loaded (and Q4 unpacked) once and multiplied into
//! all `R` rows, each row's vector once into all `C` columns; a group's integer sums stay in
//! per-column, per-row i32 lanes (exact: a lane sums at most 8 vectors · 4 products of
//! |u8 · i8| ≤ 255 · 128), then per group, column and row one multiply and one multiply-add
//! apply every block's two scales (one block per lane) and one more multiply-add the block
//! offsets (weight = scale · q + offset) against the row's lane sums. Q5 quants are Q4's
//! nibbles with their fifth bits (one 64-bit mask per vector) added after unpacking.
//! CPUs with AVX-512 VNNI use 512-bit `vpdpbusd`; AVX2 + FMA runs each vector as two 256-bit
//! halves with `maddubs` + `madd`. Each row's lanes are reduced in one fixed order, so its
//! result never depends on its tile's shape.
//!
//! Accumulators are `[column][row]` arrays walked by index loops over the constant sizes:
//! the same loops written as iterator zips compiled to 10–15 % slower tiles (B = 8, prefill).

use super::activations::QuantizedRows;
use super::int8::{Column, ColumnHeaders, Int8Format};
use super::layout::Group;
use half::f16;
use std::arch::x86_64::*;

/// Lanes 0..8 summed as ((0+4)+(2+6)) + ((1+5)+(3+7)), the same for every row.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) fn horizontal_sum(v: __m256) -> f32 {
    let halves = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let pairs = _mm_add_ps(halves, _mm_movehl_ps(halves, halves));
    _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)))
}

/// Column `c`'s row `r` into `out[r · stride + c]`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn reduce<const R: usize, const C: usize>(acc: [[__m256; R]; C], out: &mut [f32], stride: usize) {
    for (c, acc) in acc.into_iter().enumerate() {
        for (r, acc) in acc.into_iter().enumerate() {
            out[r * stride + c] = horizontal_sum(acc);
        }
    }
}

/// How a tile applies block offsets.
#[derive(Clone, Copy)]
enum Offsets {
    None,
    /// offset = factor · scale (Q4_0: −8; Q5_0: −16; unsigned Q8_0: −128).
    ScaleTimes(f32),
    /// Stored in the headers (a minimum, or the K-quants' −dmin · m).
    Stored,
}

impl Offsets {
    /// A matrix's offsets; `unsigned_q8` when the kernel reads Q8_0 quants as q + 128.
    fn of(column: &Column, unsigned_q8: bool) -> Self {
        match column.format {
            Int8Format::Q8_0 if unsigned_q8 => Self::ScaleTimes(-128.0),
            Int8Format::Q8_0 | Int8Format::Q6K => Self::None,
            Int8Format::Q4_0 => Self::ScaleTimes(-8.0),
            Int8Format::Q5_0 => Self::ScaleTimes(-16.0),
            Int8Format::Q4_1 | Int8Format::Q5_1 | Int8Format::Q4K | Int8Format::Q5K => Self::Stored,
        }
    }
}

/// Rows `first_row..first_row + R` of `x` as raw pointers, bounds checked once.
struct RowTile<const R: usize> {
    quants: *const u8,
    quant_stride: usize,
    lanes: *const f32,
    lane_stride: usize,
    sums: *const f32,
}

impl<const R: usize> RowTile<R> {
    #[inline(always)]
    fn new(x: &QuantizedRows, first_row: usize) -> Self {
        assert!(first_row + R <= x.rows());
        let lane_stride = x.groups().len() * 16;
        Self {
            quants: x.row_quants(first_row).as_ptr().cast(),
            quant_stride: x.stored_blocks() * 32,
            lanes: x.row_lane_scales(first_row).as_ptr(),
            lane_stride,
            sums: x.row_lane_sums(first_row).as_ptr(),
        }
    }

    /// Row `r`'s quant bytes from `offset` (callers stay inside the row's
    /// `stored_blocks · 32` bytes).
    #[inline(always)]
    unsafe fn quants(&self, r: usize, offset: usize) -> *const u8 {
        self.quants.add(r * self.quant_stride + offset)
    }

    /// Row `r`'s lane scales of group `group` from lane `lane`.
    #[inline(always)]
    unsafe fn lane_scales(&self, r: usize, group: Group, lane: usize) -> *const f32 {
        self.lanes
            .add(r * self.lane_stride + group.index * 16 + lane)
    }

    /// Row `r`'s lane sums of group `group` from lane `lane`.
    #[inline(always)]
    unsafe fn lane_sums(&self, r: usize, group: Group, lane: usize) -> *const f32 {
        self.sums
            .add(r * self.lane_stride + group.index * 16 + lane)
    }
}

/// How far ahead of the vector a tile loads it asks for the quants: columns are contiguous, so
/// this reaches into the next columns' quants, which the hardware prefetcher does not fetch
/// early enough when a column is only a few cache lines long.
const PREFETCH_BYTES: usize = 4096;

/// Asks for the quants `PREFETCH_BYTES` past `offset` in every column.
#[inline(always)]
fn prefetch_each<const C: usize>(quants: [*const u8; C], offset: usize) {
    for q in quants {
        prefetch(q.wrapping_add(offset + PREFETCH_BYTES));
    }
}

/// Asks for the cache line at `at` (any address: a prefetch is a hint and never faults).
#[inline(always)]
pub(super) fn prefetch<T>(at: *const T) {
    // SAFETY: a prefetch is a hint; it never faults, whatever the address.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(at as *const i8) };
}

/// Bytes of group `group`'s vector `vector`, from the row start.
#[inline(always)]
fn vector_offset(group: Group, vector: usize) -> usize {
    group.first_block * 32 + vector * 64
}

/// Each column's quant bytes (checked to cover the row at `bytes` per block).
#[inline(always)]
fn quant_pointers<const C: usize>(
    columns: &[Column; C],
    x: &QuantizedRows,
    bytes: usize,
) -> [*const u8; C] {
    columns.each_ref().map(|c| {
        assert_eq!(c.quants.len(), x.stored_blocks() * bytes);
        c.quants.as_ptr()
    })
}

/// Each column's fifth-bit plane (checked to cover the row when `FIVE`).
#[inline(always)]
fn high_bits<const C: usize, const FIVE: bool>(
    columns: &[Column; C],
    x: &QuantizedRows,
) -> [*const u8; C] {
    columns.each_ref().map(|c| {
        if FIVE {
            assert_eq!(c.high.len(), x.stored_blocks() * 4);
        }
        c.high.as_ptr()
    })
}

/// The fifth bits of `bytes` consecutive positions of group `group`'s vector `vector`, from
/// byte `from` of its eight (callers stay inside the plane `high_bits` checked).
#[inline(always)]
unsafe fn fifth_bits<T: Copy>(high: *const u8, group: Group, vector: usize, from: usize) -> T {
    high.add(group.first_block * 4 + vector * 8 + from)
        .cast::<T>()
        .read_unaligned()
}

/// An instruction set's `tile`: `out[i · stride + c]` = `columns[c]` · row `first_row + i`,
/// for `c < C`, `i < R`, by the module's `q8_0_tile` or `q4_tile` (with fifth bits for Q5;
/// the columns share a format: they come from one matrix).
macro_rules! format_dispatch {
    ($features:literal) => {
        #[inline]
        #[target_feature(enable = $features)]
        pub unsafe fn tile<const R: usize, const C: usize>(
            columns: &[Column; C],
            x: &QuantizedRows,
            first_row: usize,
            out: &mut [f32],
            stride: usize,
        ) {
            match columns[0].format {
                Int8Format::Q8_0 => q8_0_tile::<R, C>(columns, x, first_row, out, stride),
                Int8Format::Q4_0 | Int8Format::Q4_1 => {
                    q4_tile::<R, C, false>(columns, x, first_row, out, stride)
                }
                Int8Format::Q4K => q4_tile::<R, C, false>(columns, x, first_row, out, stride),
                Int8Format::Q6K => q6k_tile::<R, C>(columns, x, first_row, out, stride),
                Int8Format::Q5_0 | Int8Format::Q5_1 | Int8Format::Q5K => {
                    q4_tile::<R, C, true>(columns, x, first_row, out, stride)
                }
            }
        }
    };
}

/// AVX2 + FMA: each 64-byte vector as two 256-bit halves, `maddubs` + `madd`.
pub mod avx2 {
    use super::*;

    /// Per-block values `values` (from the column's first block) for the 8 lanes of half
    /// `half` of group `group`'s vectors.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn lane_values(values: &[f16], group: Group, half: usize) -> __m256 {
        let lanes = group.lanes_per_block();
        let first = group.first_block + 8 * half / lanes;
        assert!(first + 8 <= values.len());
        let blocks = _mm256_srlv_epi32(
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
            _mm256_set1_epi32(lanes.trailing_zeros() as i32),
        );
        let wide = _mm256_cvtph_ps(_mm_loadu_si128(values.as_ptr().add(first).cast()));
        _mm256_permutevar8x32_ps(wide, blocks)
    }

    /// As `lane_values`, for K-quant headers: a block's 6-bit `factors` times its
    /// superblock's f16 value in `supers` (from the column's first superblock).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn super_lane_values<const SIGNED: bool>(
        factors: &[u8],
        supers: &[f16],
        group: Group,
        half: usize,
    ) -> __m256 {
        let lanes = group.lanes_per_block();
        let first = group.first_block + 8 * half / lanes;
        assert!(first + 8 <= factors.len() && first / 8 + 8 <= supers.len());
        let blocks = _mm256_srlv_epi32(
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
            _mm256_set1_epi32(lanes.trailing_zeros() as i32),
        );
        let bytes = _mm_loadl_epi64(factors.as_ptr().add(first).cast());
        let small = _mm256_cvtepi32_ps(match SIGNED {
            true => _mm256_cvtepi8_epi32(bytes),
            false => _mm256_cvtepu8_epi32(bytes),
        });
        let wide = _mm256_cvtph_ps(_mm_loadu_si128(supers.as_ptr().add(first / 8).cast()));
        let of_super = _mm256_srli_epi32(
            _mm256_add_epi32(blocks, _mm256_set1_epi32((first % 8) as i32)),
            3,
        );
        _mm256_mul_ps(
            _mm256_permutevar8x32_ps(small, blocks),
            _mm256_permutevar8x32_ps(wide, of_super),
        )
    }

    /// Block scales for the lanes of half `half` of group `group`'s vectors.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scale_lanes(column: &Column, group: Group, half: usize) -> __m256 {
        match column.headers {
            ColumnHeaders::Half { scales, .. } => lane_values(scales, group, half),
            ColumnHeaders::Super { sc, d, .. } => super_lane_values::<false>(sc, d, group, half),
            ColumnHeaders::Split { .. } => unreachable!("Q6_K scales go by half block"),
        }
    }

    /// Stored block offsets, like `scale_lanes`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn offset_lanes(column: &Column, group: Group, half: usize) -> __m256 {
        match column.headers {
            ColumnHeaders::Half { mins, .. } => lane_values(mins, group, half),
            ColumnHeaders::Super { m, dmin, .. } => _mm256_sub_ps(
                _mm256_setzero_ps(),
                super_lane_values::<false>(m, dmin, group, half),
            ),
            ColumnHeaders::Split { .. } => unreachable!("Q6_K has no offsets"),
        }
    }

    /// Q6_K's scales of block half `part` (elements 16·part..) for the lanes of half `half`
    /// of group `group`'s vectors.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn split_scale_lanes(column: &Column, group: Group, half: usize, part: usize) -> __m256 {
        match column.headers {
            ColumnHeaders::Split { halves, d } => {
                super_lane_values::<true>(halves[part], d, group, half)
            }
            _ => unreachable!("only Q6_K splits its blocks"),
        }
    }

    /// Q6_K: signed bytes as Q8_0's, with a group's vectors summed in two sets, the first
    /// half of its vectors (each block's elements 0..16, in groups of 4 or more blocks) and
    /// the second, each scaled by its own half-block scales.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::needless_range_loop)] // index loops: see the module docs
    unsafe fn q6k_tile<const R: usize, const C: usize>(
        columns: &[Column; C],
        x: &QuantizedRows,
        first_row: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        let quants = quant_pointers(columns, x, 32);
        let tile = RowTile::<R>::new(x, first_row);
        let mut acc = [[_mm256_setzero_ps(); R]; C];
        for &group in x.groups() {
            assert!(group.blocks >= 4, "a Q6_K row holds whole superblocks");
            let split = group.vectors() / 2;
            // One part at a time, so the sums are indexed by constants and stay in registers.
            for half in 0..2 {
                for part in 0..2 {
                    let mut dots = [[_mm256_setzero_si256(); R]; C];
                    for vector in part * split..(part + 1) * split {
                        let offset = vector_offset(group, vector) + 32 * half;
                        if half == 0 {
                            prefetch_each(quants, offset);
                        }
                        let weights = quants.map(|q| _mm256_loadu_si256(q.add(offset).cast()));
                        let magnitudes = weights.map(|w| _mm256_sign_epi8(w, w));
                        for r in 0..R {
                            let row = _mm256_load_si256(tile.quants(r, offset).cast());
                            for c in 0..C {
                                let signed = _mm256_sign_epi8(row, weights[c]);
                                let dot = dot_avx2(magnitudes[c], signed);
                                dots[c][r] = _mm256_add_epi32(dots[c][r], dot);
                            }
                        }
                    }
                    let scales = columns
                        .each_ref()
                        .map(|c| split_scale_lanes(c, group, half, part));
                    for r in 0..R {
                        let row_scales = _mm256_loadu_ps(tile.lane_scales(r, group, 8 * half));
                        for c in 0..C {
                            let row = _mm256_mul_ps(_mm256_cvtepi32_ps(dots[c][r]), row_scales);
                            acc[c][r] = _mm256_fmadd_ps(row, scales[c], acc[c][r]);
                        }
                    }
                }
            }
        }
        reduce(acc, out, stride)
    }

    format_dispatch!("avx2,fma,f16c");

    /// The group loop: `group_dots(group, half, tile, dots)` adds half `half` of the group's
    /// integer lane sums into each column's and row's `dots`; this scales them into the
    /// accumulators.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn groups<const R: usize, const C: usize>(
        columns: &[Column; C],
        x: &QuantizedRows,
        first_row: usize,
        out: &mut [f32],
        stride: usize,
        mut group_dots: impl FnMut(Group, usize, &RowTile<R>, &mut [[__m256i; R]; C]),
    ) {
        let tile = RowTile::<R>::new(x, first_row);
        let offsets = Offsets::of(&columns[0], false);
        let mut acc = [[_mm256_setzero_ps(); R]; C];
        for &group in x.groups() {
            for half in 0..2 {
                let mut dots = [[_mm256_setzero_si256(); R]; C];
                group_dots(group, half, &tile, &mut dots);
                let lane = 8 * half;
                let scales = columns.each_ref().map(|c| scale_lanes(c, group, half));
                let offsets: [Option<__m256>; C] = std::array::from_fn(|c| match offsets {
                    Offsets::None => None,
                    Offsets::ScaleTimes(f) => Some(_mm256_mul_ps(scales[c], _mm256_set1_ps(f))),
                    Offsets::Stored => Some(offset_lanes(&columns[c], group, half)),
                });
                for r in 0..R {
                    let row_scales = _mm256_loadu_ps(tile.lane_scales(r, group, lane));
                    let sums = _mm256_loadu_ps(tile.lane_sums(r, group, lane));
                    for c in 0..C {
                        let row = _mm256_mul_ps(_mm256_cvtepi32_ps(dots[c][r]), row_scales);
                        acc[c][r] = _mm256_fmadd_ps(row, scales[c], acc[c][r]);
                        if let Some(offsets) = offsets[c] {
                            acc[c][r] = _mm256_fmadd_ps(offsets, sums, acc[c][r]);
                        }
                    }
                }
            }
        }
        reduce(acc, out, stride)
    }

    /// Q8_0 (signed quants): `sign` moves each weight's sign onto the activation.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::needless_range_loop)] // index loops: see the module docs
    unsafe fn q8_0_tile<const R: usize, const C: usize>(
        columns: &[Column; C],
        x: &QuantizedRows,
        first_row: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        let quants = quant_pointers(columns, x, 32);
        groups::<R, C>(
            columns,
            x,
            first_row,
            out,
            stride,
            |group, half, tile, dots| {
                for vector in 0..group.vectors() {
                    let offset = vector_offset(group, vector) + 32 * half;
                    if half == 0 {
                        prefetch_each(quants, offset);
                    }
                    let weights = quants.map(|q| _mm256_loadu_si256(q.add(offset).cast()));
                    let magnitudes = weights.map(|w| _mm256_sign_epi8(w, w));
                    for r in 0..R {
                        let row = _mm256_load_si256(tile.quants(r, offset).cast());
                        for c in 0..C {
                            let signed = _mm256_sign_epi8(row, weights[c]);
                            let dot = dot_avx2(magnitudes[c], signed);
                            dots[c][r] = _mm256_add_epi32(dots[c][r], dot);
                        }
                    }
                }
            },
        )
    }

    /// 32 fifth bits as bytes: 16 where bit `i` is set (bit `i % 8` of byte `i / 8`), else 0.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn fifth_bit_bytes(bits: u32) -> __m256i {
        let spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(bits as i32),
            _mm256_setr_epi8(
                0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3,
                3, 3, 3, 3,
            ),
        );
        let select = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
        _mm256_and_si256(set, _mm256_set1_epi8(0x10))
    }

    /// Q4_0 and Q4_1 (and with `FIVE` their fifth bits, Q5_0 and Q5_1): 32 packed bytes
    /// unpack into half of two vectors (both halves of a two-block group's one vector).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::needless_range_loop)] // index loops: see the module docs
    unsafe fn q4_tile<const R: usize, const C: usize, const FIVE: bool>(
        columns: &[Column; C],
        x: &QuantizedRows,
        first_row: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        let quants = quant_pointers(columns, x, 16);
        let high = high_bits::<C, FIVE>(columns, x);
        let low_mask = _mm256_set1_epi8(0x0F);
        groups::<R, C>(
            columns,
            x,
            first_row,
            out,
            stride,
            |group, half, tile, dots| {
                let packed = quants.map(|q| q.add(group.first_block * 16));
                let mut add = |nibbles: [__m256i; C], vector: usize| {
                    let offset = vector_offset(group, vector) + 32 * half;
                    let nibbles: [__m256i; C] = match FIVE {
                        true => std::array::from_fn(|c| {
                            let bits = fifth_bits::<u32>(high[c], group, vector, 4 * half);
                            _mm256_or_si256(nibbles[c], fifth_bit_bytes(bits))
                        }),
                        false => nibbles,
                    };
                    for r in 0..R {
                        let row = _mm256_load_si256(tile.quants(r, offset).cast());
                        for c in 0..C {
                            dots[c][r] = _mm256_add_epi32(dots[c][r], dot_avx2(nibbles[c], row));
                        }
                    }
                };
                if half == 0 {
                    for line in (0..group.blocks * 16).step_by(64) {
                        prefetch_each(packed, line);
                    }
                }
                if group.blocks == 2 {
                    let nibbles = packed.map(|p| {
                        let bytes = _mm256_loadu_si256(p.cast());
                        let shifted = if half == 0 {
                            bytes
                        } else {
                            _mm256_srli_epi16(bytes, 4)
                        };
                        _mm256_and_si256(shifted, low_mask)
                    });
                    add(nibbles, 0);
                } else {
                    for pair in 0..group.vectors() / 2 {
                        let bytes =
                            packed.map(|p| _mm256_loadu_si256(p.add(pair * 64 + half * 32).cast()));
                        add(bytes.map(|b| _mm256_and_si256(b, low_mask)), 2 * pair);
                        let high =
                            bytes.map(|b| _mm256_and_si256(_mm256_srli_epi16(b, 4), low_mask));
                        add(high, 2 * pair + 1);
                    }
                }
            },
        )
    }

    /// `maddubs` (u8 × i8 pairs → i16; |pair| ≤ 2 · 128 · 127 < 2¹⁵, so never saturating)
    /// then `madd` against ones (→ i32).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn dot_avx2(unsigned: __m256i, signed: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(unsigned, signed), _mm256_set1_epi16(1))
    }
}

/// AVX-512 VNNI: whole 64-byte vectors through `vpdpbusd` (u8 × i8, four products per lane).
/// Q8_0 weights are made unsigned (q + 128) and the extra 128 · Σq_x comes off with the
/// offsets, like Q4_0's 8.
pub mod vnni {
    use super::*;

    /// Per-block values `values` (from the column's first block), one per lane of group
    /// `group`'s vectors.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
    unsafe fn lane_values(values: &[f16], group: Group) -> __m512 {
        assert!(group.first_block + 16 <= values.len());
        let blocks = _mm512_srlv_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(group.lanes_per_block().trailing_zeros() as i32),
        );
        let wide = _mm512_cvtph_ps(_mm256_loadu_si256(
            values.as_ptr().add(group.first_block).cast(),
        ));
        _mm512_permutexvar_ps(blocks, wide)
    }

    /// As `lane_values`, for K-quant headers: a block's 6-bit `factors` times its
    /// superblock's f16 value in `supers` (K-quant groups start on a superblock).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
    unsafe fn super_lane_values<const SIGNED: bool>(
        factors: &[u8],
        supers: &[f16],
        group: Group,
    ) -> __m512 {
        let first = group.first_block;
        assert!(
            first.is_multiple_of(8)
                && first + 16 <= factors.len()
                && first / 8 + 16 <= supers.len()
        );
        let blocks = _mm512_srlv_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(group.lanes_per_block().trailing_zeros() as i32),
        );
        let bytes = _mm_loadu_si128(factors.as_ptr().add(first).cast());
        let small = _mm512_cvtepi32_ps(match SIGNED {
            true => _mm512_cvtepi8_epi32(bytes),
            false => _mm512_cvtepu8_epi32(bytes),
        });
        let wide = _mm512_cvtph_ps(_mm256_loadu_si256(supers.as_ptr().add(first / 8).cast()));
        _mm512_mul_ps(
            _mm512_permutexvar_ps(blocks, small),
            _mm512_permutexvar_ps(_mm512_srli_epi32(blocks, 3), wide),
        )
    }

    /// Block scales for the lanes of group `group`'s vectors.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
    unsafe fn scale_lanes(column: &Column, group: Group) -> __m512 {
        match column.headers {
            ColumnHeaders::Half { scales, .. } => lane_values(scales, group),
            ColumnHeaders::Super { sc, d, .. } => super_lane_values::<false>(sc, d, group),
            ColumnHeaders::Split { .. } => unreachable!("Q6_K scales go by half block"),
        }
    }

    /// Stored block offsets, like `scale_lanes`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
    unsafe fn offset_lanes(column: &Column, group: Group) -> __m512 {
        match column.headers {
            ColumnHeaders::Half { mins, .. } => lane_values(mins, group),
            ColumnHeaders::Super { m, dmin, .. } => _mm512_sub_ps(
                _mm512_setzero_ps(),
                super_lane_values::<false>(m, dmin, group),
            ),
            ColumnHeaders::Split { .. } => unreachable!("Q6_K has no offsets"),
        }
    }

    /// Q6_K's scales of block half `part` (elements 16·part..) for group `group`'s lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
    unsafe fn split_scale_lanes(column: &Column, group: Group, part: usize) -> __m512 {
        match column.headers {
            ColumnHeaders::Split { halves, d } => super_lane_values::<true>(halves[part], d, group),
            _ => unreachable!("only Q6_K splits its blocks"),
        }
    }

    /// Q6_K: signed weight bytes against activations made unsigned (x + 128), the extra
    /// 128 · Σw per lane taken off in integers (`vpdpbusd` of ones gives Σw); a group's
    /// vectors summed in two sets (see `avx2::q6k_tile`), each scaled by its half-block
    /// scales.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
    #[allow(clippy::needless_range_loop)] // index loops: see the module docs
    unsafe fn q6k_tile<const R: usize, const C: usize>(
        columns: &[Column; C],
        x: &QuantizedRows,
        first_row: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        let quants = quant_pointers(columns, x, 32);
        let tile = RowTile::<R>::new(x, first_row);
        let (bias, ones) = (_mm512_set1_epi8(i8::MIN), _mm512_set1_epi8(1));
        let mut acc = [[_mm512_setzero_ps(); R]; C];
        for &group in x.groups() {
            assert!(group.blocks >= 4, "a Q6_K row holds whole superblocks");
            let split = group.vectors() / 2;
            // One part at a time, so the sums are indexed by constants and stay in registers.
            for part in 0..2 {
                let mut dots = [[_mm512_setzero_si512(); R]; C];
                let mut weight_sums = [_mm512_setzero_si512(); C];
                for vector in part * split..(part + 1) * split {
                    let offset = vector_offset(group, vector);
                    prefetch_each(quants, offset);
                    let weights = quants.map(|q| _mm512_loadu_si512(q.add(offset).cast()));
                    for c in 0..C {
                        weight_sums[c] = _mm512_dpbusd_epi32(weight_sums[c], ones, weights[c]);
                    }
                    for r in 0..R {
                        let row = _mm512_load_si512(tile.quants(r, offset).cast());
                        let row = _mm512_xor_si512(row, bias);
                        for c in 0..C {
                            dots[c][r] = _mm512_dpbusd_epi32(dots[c][r], row, weights[c]);
                        }
                    }
                }
                let scales = columns
                    .each_ref()
                    .map(|c| split_scale_lanes(c, group, part));
                let excess = weight_sums.map(|s| _mm512_slli_epi32(s, 7));
                for r in 0..R {
                    let row_scales = _mm512_loadu_ps(tile.lane_scales(r, group, 0));
                    for c in 0..C {
                        let exact = _mm512_sub_epi32(dots[c][r], excess[c]);
                        let row = _mm512_mul_ps(_mm512_cvtepi32_ps(exact), row_scales);
                        acc[c][r] = _mm512_fmadd_ps(row, scales[c], acc[c][r]);
                    }
                }
            }
        }
        reduce_wide(acc, out, stride)
    }

    format_dispatch!("avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl");

    /// 16 lanes into 8 (lane i + lane i + 8), then the shared reduction.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
    fn reduce_wide<const R: usize, const C: usize>(
        acc: [[__m512; R]; C],
        out: &mut [f32],
        stride: usize,
    ) {
        let acc = acc.map(|column| {
            column.map(|w| {
                let high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(w), 1));
                _mm256_add_ps(_mm512_castps512_ps256(w), high)
            })
        });
        reduce(acc, out, stride)
    }

    /// As `avx2::groups`, on whole vectors: `group_dots(group, tile, dots)`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
    unsafe fn groups<const R: usize, const C: usize>(
        columns: &[Column; C],
        x: &QuantizedRows,
        first_row: usize,
        out: &mut [f32],
        stride: usize,
        mut group_dots: impl FnMut(Group, &RowTile<R>, &mut [[__m512i; R]; C]),
    ) {
        let tile = RowTile::<R>::new(x, first_row);
        let offsets = Offsets::of(&columns[0], true);
        let mut acc = [[_mm512_setzero_ps(); R]; C];
        for &group in x.groups() {
            let mut dots = [[_mm512_setzero_si512(); R]; C];
            group_dots(group, &tile, &mut dots);
            let scales = columns.each_ref().map(|c| scale_lanes(c, group));
            let offsets: [Option<__m512>; C] = std::array::from_fn(|c| match offsets {
                Offsets::None => None,
                Offsets::ScaleTimes(f) => Some(_mm512_mul_ps(scales[c], _mm512_set1_ps(f))),
                Offsets::Stored => Some(offset_lanes(&columns[c], group)),
            });
            for r in 0..R {
                let row_scales = _mm512_loadu_ps(tile.lane_scales(r, group, 0));
                let sums = _mm512_loadu_ps(tile.lane_sums(r, group, 0));
                for c in 0..C {
                    let row = _mm512_mul_ps(_mm512_cvtepi32_ps(dots[c][r]), row_scales);
                    acc[c][r] = _mm512_fmadd_ps(row, scales[c], acc[c][r]);
                    if let Some(offsets) = offsets[c] {
                        acc[c][r] = _mm512_fmadd_ps(offsets, sums, acc[c][r]);
                    }
                }
            }
        }
        reduce_wide(acc, out, stride)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
    #[allow(clippy::needless_range_loop)] // index loops: see the module docs
    unsafe fn q8_0_tile<const R: usize, const C: usize>(
        columns: &[Column; C],
        x: &QuantizedRows,
        first_row: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        let quants = quant_pointers(columns, x, 32);
        let bias = _mm512_set1_epi8(i8::MIN);
        groups::<R, C>(columns, x, first_row, out, stride, |group, tile, dots| {
            for vector in 0..group.vectors() {
                let offset = vector_offset(group, vector);
                prefetch_each(quants, offset);
                let unsigned = quants
                    .map(|q| _mm512_xor_si512(_mm512_loadu_si512(q.add(offset).cast()), bias));
                for r in 0..R {
                    let row = _mm512_load_si512(tile.quants(r, offset).cast());
                    for c in 0..C {
                        dots[c][r] = _mm512_dpbusd_epi32(dots[c][r], unsigned[c], row);
                    }
                }
            }
        })
    }

    /// Group `group`'s vectors of `C` nibble columns unpacked into bytes, handed to
    /// `add(vectors, index)` one vector index at a time: a 64-byte load unpacks into two
    /// vectors (32 bytes into a two-block group's one); with `FIVE`, a masked add puts 16 onto
    /// the quants whose fifth bit is set.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
    unsafe fn unpack_group<const C: usize, const FIVE: bool>(
        quants: [*const u8; C],
        high: [*const u8; C],
        group: Group,
        mut add: impl FnMut([__m512i; C], usize),
    ) {
        let (low_mask, sixteen) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0x10));
        let packed = quants.map(|q| q.add(group.first_block * 16));
        for line in (0..group.blocks * 16).step_by(64) {
            prefetch_each(packed, line);
        }
        let mut add = |nibbles: [__m512i; C], vector: usize| {
            let nibbles: [__m512i; C] = match FIVE {
                true => std::array::from_fn(|c| {
                    let mask: __mmask64 = fifth_bits(high[c], group, vector, 0);
                    _mm512_mask_add_epi8(nibbles[c], mask, nibbles[c], sixteen)
                }),
                false => nibbles,
            };
            add(nibbles, vector)
        };
        if group.blocks == 2 {
            let mask = _mm512_castsi512_si256(low_mask);
            add(
                packed.map(|p| {
                    let bytes = _mm256_loadu_si256(p.cast());
                    let low = _mm256_and_si256(bytes, mask);
                    let high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
                    _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1)
                }),
                0,
            );
        } else {
            for pair in 0..group.vectors() / 2 {
                let bytes = packed.map(|p| _mm512_loadu_si512(p.add(pair * 64).cast()));
                add(bytes.map(|b| _mm512_and_si512(b, low_mask)), 2 * pair);
                let high = bytes.map(|b| _mm512_and_si512(_mm512_srli_epi16(b, 4), low_mask));
                add(high, 2 * pair + 1);
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
    #[allow(clippy::needless_range_loop)] // index loops: see the module docs
    unsafe fn q4_tile<const R: usize, const C: usize, const FIVE: bool>(
        columns: &[Column; C],
        x: &QuantizedRows,
        first_row: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        let quants = quant_pointers(columns, x, 16);
        let high = high_bits::<C, FIVE>(columns, x);
        groups::<R, C>(columns, x, first_row, out, stride, |group, tile, dots| {
            unpack_group::<C, FIVE>(quants, high, group, |nibbles, vector| {
                let offset = vector_offset(group, vector);
                for r in 0..R {
                    let row = _mm512_load_si512(tile.quants(r, offset).cast());
                    for c in 0..C {
                        dots[c][r] = _mm512_dpbusd_epi32(dots[c][r], nibbles[c], row);
                    }
                }
            })
        })
    }

    /// A nibble column's quants as `q4_tile` unpacks them (one byte each, fifth bits added,
    /// in the rows' vector layout) into `out`, 64-byte aligned and `stored_blocks · 32` long.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
    pub unsafe fn unpack_nibbles(column: &Column, x: &QuantizedRows, out: &mut [u8]) {
        assert!(out.len() == x.stored_blocks() * 32 && out.as_ptr().addr().is_multiple_of(64));
        let columns = std::array::from_ref(column);
        let quants = quant_pointers(columns, x, 16);
        let base = out.as_mut_ptr();
        let store = |nibbles: [__m512i; 1], group: Group, vector: usize| {
            _mm512_store_si512(base.add(vector_offset(group, vector)).cast(), nibbles[0]);
        };
        for &group in x.groups() {
            match column.format.has_high_bits() {
                true => {
                    let high = high_bits::<1, true>(columns, x);
                    unpack_group::<1, true>(quants, high, group, |n, v| store(n, group, v))
                }
                false => {
                    let high = high_bits::<1, false>(columns, x);
                    unpack_group::<1, false>(quants, high, group, |n, v| store(n, group, v))
                }
            }
        }
    }

    /// `q4_tile` over columns unpacked beforehand by `unpack_nibbles` (`unpacked[c]` for
    /// `columns[c]`): the same integer sums and epilogue, so the same results, without
    /// unpacking the columns again for every row tile.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
    #[allow(clippy::needless_range_loop)] // index loops: see the module docs
    pub unsafe fn unpacked_tile<const R: usize, const C: usize>(
        columns: &[Column; C],
        unpacked: [&[u8]; C],
        x: &QuantizedRows,
        first_row: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        let unpacked = unpacked.map(|u| {
            assert!(u.len() == x.stored_blocks() * 32 && u.as_ptr().addr().is_multiple_of(64));
            u.as_ptr()
        });
        groups::<R, C>(columns, x, first_row, out, stride, |group, tile, dots| {
            for vector in 0..group.vectors() {
                let offset = vector_offset(group, vector);
                let weights = unpacked.map(|u| _mm512_load_si512(u.add(offset).cast()));
                for r in 0..R {
                    let row = _mm512_load_si512(tile.quants(r, offset).cast());
                    for c in 0..C {
                        dots[c][r] = _mm512_dpbusd_epi32(dots[c][r], weights[c], row);
                    }
                }
            }
        })
    }
}

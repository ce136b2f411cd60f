//! SIMD tiles: `C` weight columns against `R` activation rows, over the grouped layout of
//! `layout`. Each vector of a column is loaded (and Q4 unpacked) once and multiplied into
//! all `R` rows, each row's vector once into all `C` columns; a group's integer sums stay in
//! per-column, per-row i32 lanes (exact: a lane sums at most 8 vectors · 4 products of
//! |u8 · i8| ≤ 255 · 128), then per group, column and row one multiply and one multiply-add
//! apply every block's two scales (one block per lane) and one more multiply-add the block
//! offsets (weight = scale · q + offset) against the row's lane sums.
//! CPUs with AVX-512 VNNI use 512-bit `vpdpbusd`; AVX2 + FMA runs each vector as two 256-bit
//! halves with `maddubs` + `madd`. Each row's lanes are reduced in one fixed order, so its
//! result never depends on its tile's shape.
//!
//! Accumulators are `[column][row]` arrays walked by index loops over the constant sizes:
//! the same loops written as iterator zips compiled to 10–15 % slower tiles (B = 8, prefill).

use super::activations::QuantizedRows;
use super::int8::{Column, Int8Format};
use super::layout::Group;
use half::f16;
use std::arch::x86_64::*;

/// Lanes 0..8 summed as ((0+4)+(2+6)) + ((1+5)+(3+7)), the same for every row.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn horizontal_sum(v: __m256) -> f32 {
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
    /// offset = factor · scale (Q4_0: −8; unsigned Q8_0: −128).
    ScaleTimes(f32),
    /// Stored per block, read like the scales (Q4_1's `Column::mins`).
    Mins,
}

impl Offsets {
    /// A matrix's offsets; `unsigned_q8` when the kernel reads Q8_0 quants as q + 128.
    fn of(column: &Column, unsigned_q8: bool) -> Self {
        match column.format {
            Int8Format::Q8_0 if unsigned_q8 => Self::ScaleTimes(-128.0),
            Int8Format::Q8_0 => Self::None,
            Int8Format::Q4_0 => Self::ScaleTimes(-8.0),
            Int8Format::Q4_1 => Self::Mins,
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

/// Bytes of group `group`'s vector `vector`, from the row start.
#[inline(always)]
fn vector_offset(group: Group, vector: usize) -> usize {
    group.first_block * 32 + vector * 64
}

/// An instruction set's `tile`: `out[i · stride + c]` = `columns[c]` · row `first_row + i`,
/// for `c < C`, `i < R`, by the module's `q8_0_tile` or `q4_tile` (the columns share a
/// format: they come from one matrix).
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
                    q4_tile::<R, C>(columns, x, first_row, out, stride)
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
                let scales = columns
                    .each_ref()
                    .map(|c| lane_values(c.scales, group, half));
                let offsets: [Option<__m256>; C] = std::array::from_fn(|c| match offsets {
                    Offsets::None => None,
                    Offsets::ScaleTimes(f) => Some(_mm256_mul_ps(scales[c], _mm256_set1_ps(f))),
                    Offsets::Mins => Some(lane_values(columns[c].mins, group, half)),
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
        let quants = columns.each_ref().map(|c| {
            assert_eq!(c.quants.len(), x.stored_blocks() * 32);
            c.quants.as_ptr()
        });
        groups::<R, C>(
            columns,
            x,
            first_row,
            out,
            stride,
            |group, half, tile, dots| {
                for vector in 0..group.vectors() {
                    let offset = vector_offset(group, vector) + 32 * half;
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

    /// Q4_0 and Q4_1: 32 packed bytes unpack into half of two vectors (both halves of a
    /// two-block group's one vector).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::needless_range_loop)] // index loops: see the module docs
    unsafe fn q4_tile<const R: usize, const C: usize>(
        columns: &[Column; C],
        x: &QuantizedRows,
        first_row: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        let quants = columns.each_ref().map(|c| {
            assert_eq!(c.quants.len(), x.stored_blocks() * 16);
            c.quants.as_ptr()
        });
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
                    for r in 0..R {
                        let row = _mm256_load_si256(tile.quants(r, offset).cast());
                        for c in 0..C {
                            dots[c][r] = _mm256_add_epi32(dots[c][r], dot_avx2(nibbles[c], row));
                        }
                    }
                };
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

    format_dispatch!("avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl");

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
            let scales = columns.each_ref().map(|c| lane_values(c.scales, group));
            let offsets: [Option<__m512>; C] = std::array::from_fn(|c| match offsets {
                Offsets::None => None,
                Offsets::ScaleTimes(f) => Some(_mm512_mul_ps(scales[c], _mm512_set1_ps(f))),
                Offsets::Mins => Some(lane_values(columns[c].mins, group)),
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
        // 16 lanes into 8 (lane i + lane i + 8), then the shared reduction.
        let acc = acc.map(|column| {
            column.map(|w| {
                let high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(w), 1));
                _mm256_add_ps(_mm512_castps512_ps256(w), high)
            })
        });
        reduce(acc, out, stride)
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
        let quants = columns.each_ref().map(|c| {
            assert_eq!(c.quants.len(), x.stored_blocks() * 32);
            c.quants.as_ptr()
        });
        let bias = _mm512_set1_epi8(i8::MIN);
        groups::<R, C>(columns, x, first_row, out, stride, |group, tile, dots| {
            for vector in 0..group.vectors() {
                let offset = vector_offset(group, vector);
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

    /// A 64-byte load unpacks into two vectors (32 bytes into a two-block group's one).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
    #[allow(clippy::needless_range_loop)] // index loops: see the module docs
    unsafe fn q4_tile<const R: usize, const C: usize>(
        columns: &[Column; C],
        x: &QuantizedRows,
        first_row: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        let quants = columns.each_ref().map(|c| {
            assert_eq!(c.quants.len(), x.stored_blocks() * 16);
            c.quants.as_ptr()
        });
        let low_mask = _mm512_set1_epi8(0x0F);
        groups::<R, C>(columns, x, first_row, out, stride, |group, tile, dots| {
            let packed = quants.map(|q| q.add(group.first_block * 16));
            let mut add = |nibbles: [__m512i; C], vector: usize| {
                let offset = vector_offset(group, vector);
                for r in 0..R {
                    let row = _mm512_load_si512(tile.quants(r, offset).cast());
                    for c in 0..C {
                        dots[c][r] = _mm512_dpbusd_epi32(dots[c][r], nibbles[c], row);
                    }
                }
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
        })
    }
}

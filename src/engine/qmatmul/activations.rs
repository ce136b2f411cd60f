//! Activation rows quantized to 8 bits for the integer kernels, by the rule ggml and candle
//! pair with each weight format (their `vec_dot_type`): with the same quants and scales our
//! integer sums are theirs exactly, so a GGUF model computes what llama.cpp and candle
//! compute, up to the order of float additions. Each row is quantized on its own: a row's
//! quants never depend on the other rows of the step. Quants are stored in the grouped layout
//! of `layout`, the same as the weights', with each lane's block scale beside them.

use super::layout::{groups, stored_blocks, Group, BLOCK};
use crate::engine::parallel;
use half::f16;

/// Elements per Q8_K superblock.
const SUPERBLOCK: usize = 256;

/// How activations are quantized for a weight format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActivationFormat {
    /// Per block of 32: d = amax / 127 kept as f16, q = round(x / d), half away from zero
    /// (Q8_0, Q4_0 and Q5_0 weights).
    Q8_0,
    /// Q8_0 plus the block's s = d · Σq rounded to f16, which a stored minimum multiplies
    /// (Q4_1 and Q5_1 weights).
    Q8_1,
    /// Per superblock of 256: d = max / −127 in f32, `max` the value of largest magnitude
    /// (the K-quants).
    Q8K,
}

/// 64 quant bytes: every row starts on a cache line and every vector load is aligned.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub struct QuantVector(pub [i8; 64]);

pub struct QuantizedRows {
    rows: usize,
    blocks_per_row: usize,
    groups: Vec<Group>,
    /// `[rows, stored_blocks / 2]` vectors in the grouped layout.
    quants: Vec<QuantVector>,
    /// Per block: x ≈ scale · q, `[rows, stored_blocks]`.
    scales: Vec<f32>,
    /// Per block: what a weight block's offset multiplies (scale · Σq, or Q8_1's s),
    /// `[rows, stored_blocks]`.
    sums: Vec<f32>,
    /// Per group, each of its 16 lanes' block scale: `[rows, groups, 16]`.
    lane_scales: Vec<f32>,
    /// Per group and lane: the lane's share of its block's sum (scale · Σ of the lane's
    /// quants; Q8_1's s in a block's first lane), so an offset's term is one multiply-add
    /// per group: `[rows, groups, 16]`.
    lane_sums: Vec<f32>,
}

impl QuantizedRows {
    /// `x` is `[rows, k]` with `k` a multiple of 32 (of 256 for `Q8K`). Rows are quantized
    /// in parallel inside the model's pool (serial, quantizing was ~5 % of the matmul time
    /// of a 512-token prefill).
    pub fn quantize(x: &[f32], rows: usize, format: ActivationFormat) -> Self {
        let k = x.len().checked_div(rows).unwrap_or(0);
        let unit = match format {
            ActivationFormat::Q8K => SUPERBLOCK,
            ActivationFormat::Q8_0 | ActivationFormat::Q8_1 => BLOCK,
        };
        assert!(
            k.is_multiple_of(unit) && x.len() == rows * k,
            "activation rows must be whole blocks of {unit}"
        );
        let blocks_per_row = k / BLOCK;
        let stored = stored_blocks(blocks_per_row);
        let groups = groups(blocks_per_row);
        let lanes_per_row = groups.len() * 16;
        let mut quants = vec![QuantVector([0; 64]); rows * stored / 2];
        let mut scales = vec![0f32; rows * stored];
        let mut sums = vec![0f32; rows * stored];
        let mut lane_scales = vec![0f32; rows * lanes_per_row];
        let mut lane_sums = vec![0f32; rows * lanes_per_row];
        if rows > 0 && k > 0 {
            let mut outs: Vec<RowOut> = quants
                .chunks_exact_mut(stored / 2)
                .zip(scales.chunks_exact_mut(stored))
                .zip(sums.chunks_exact_mut(stored))
                .zip(lane_scales.chunks_exact_mut(lanes_per_row))
                .zip(lane_sums.chunks_exact_mut(lanes_per_row))
                .zip(x.chunks_exact(k))
                .map(
                    |(((((quants, scales), sums), lane_scales), lane_sums), src)| RowOut {
                        src,
                        quants,
                        scales,
                        sums,
                        lane_scales,
                        lane_sums,
                    },
                )
                .collect();
            parallel::for_each_mut(&mut outs, ROWS_PER_TASK, |out| {
                out.quantize(&groups, format)
            });
        }
        Self {
            rows,
            blocks_per_row,
            groups,
            quants,
            scales,
            sums,
            lane_scales,
            lane_sums,
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn stored_blocks(&self) -> usize {
        stored_blocks(self.blocks_per_row)
    }

    pub fn groups(&self) -> &[Group] {
        &self.groups
    }

    /// Row `row`'s quants in the grouped layout, `stored_blocks · 32` bytes.
    #[inline(always)]
    pub fn row_quants(&self, row: usize) -> &[QuantVector] {
        let vectors = self.stored_blocks() / 2;
        &self.quants[row * vectors..(row + 1) * vectors]
    }

    /// Row `row`'s lane scales, `[groups, 16]`.
    #[inline(always)]
    pub fn row_lane_scales(&self, row: usize) -> &[f32] {
        let len = self.groups.len() * 16;
        &self.lane_scales[row * len..(row + 1) * len]
    }

    /// Row `row`'s lane sums (see `lane_sums`), `[groups, 16]`.
    #[inline(always)]
    pub fn row_lane_sums(&self, row: usize) -> &[f32] {
        let len = self.groups.len() * 16;
        &self.lane_sums[row * len..(row + 1) * len]
    }

    /// Element `element` of block `block` of the group `group` in row `row`.
    #[inline(always)]
    pub fn quant(&self, row: usize, group: Group, block: usize, element: usize) -> i8 {
        let position = group.first_block * BLOCK + group.position(block, element);
        self.row_quants(row)[position / 64].0[position % 64]
    }

    #[inline(always)]
    pub fn scale(&self, row: usize, block: usize) -> f32 {
        self.scales[row * self.stored_blocks() + block]
    }

    /// What a weight block's offset multiplies in block `block` of row `row`.
    #[inline(always)]
    pub fn block_sum(&self, row: usize, block: usize) -> f32 {
        self.sums[row * self.stored_blocks() + block]
    }
}

/// Rows one parallel task quantizes at least (a row of 576 takes well under a µs).
const ROWS_PER_TASK: usize = 16;

/// One row's input and its parts of `QuantizedRows`' arrays.
struct RowOut<'a> {
    src: &'a [f32],
    quants: &'a mut [QuantVector],
    scales: &'a mut [f32],
    sums: &'a mut [f32],
    lane_scales: &'a mut [f32],
    lane_sums: &'a mut [f32],
}

impl RowOut<'_> {
    fn quantize(&mut self, groups: &[Group], format: ActivationFormat) {
        let blocks: Vec<QuantizedBlock> = match format {
            ActivationFormat::Q8K => self
                .src
                .chunks_exact(SUPERBLOCK)
                .flat_map(|s| quantize_superblock(s.try_into().expect("a superblock")))
                .collect(),
            ActivationFormat::Q8_0 | ActivationFormat::Q8_1 => self
                .src
                .chunks_exact(BLOCK)
                .map(|b| quantize_block(b.try_into().expect("a whole block")))
                .collect(),
        };
        // SAFETY: `QuantVector` is `repr(C)` over `[i8; 64]` with no padding.
        let bytes: &mut [i8] = unsafe {
            std::slice::from_raw_parts_mut(self.quants.as_mut_ptr().cast(), self.quants.len() * 64)
        };
        for group in groups {
            let group_bytes = &mut bytes[group.first_block * BLOCK..];
            let lanes_per_block = group.lanes_per_block();
            for j in 0..group.blocks {
                let b = group.first_block + j;
                let Some(block) = blocks.get(b) else {
                    break;
                };
                let first_lane = group.index * 16 + j * lanes_per_block;
                let lanes = first_lane..first_lane + lanes_per_block;
                self.lane_scales[lanes.clone()].fill(block.scale);
                let total: i32 = block.chunk_sums.iter().sum();
                self.sums[b] = match format {
                    ActivationFormat::Q8_1 => {
                        let s = (f16::from_f32(total as f32) * f16::from_f32(block.scale)).to_f32();
                        self.lane_sums[lanes].fill(0.0);
                        self.lane_sums[first_lane] = s;
                        s
                    }
                    ActivationFormat::Q8_0 | ActivationFormat::Q8K => {
                        let mut block_lane_sums = [0i32; BLOCK / 4];
                        for (c, sum) in block.chunk_sums.iter().enumerate() {
                            block_lane_sums[c & (lanes_per_block - 1)] += sum;
                        }
                        for (lane, sum) in self.lane_sums[lanes].iter_mut().zip(block_lane_sums) {
                            *lane = block.scale * sum as f32;
                        }
                        block.scale * total as f32
                    }
                };
                self.scales[b] = block.scale;
                for (c, chunk) in block.quants.chunks_exact(4).enumerate() {
                    let position = group.position(j, 4 * c);
                    group_bytes[position..position + 4].copy_from_slice(chunk);
                }
            }
        }
    }
}

/// One block quantized: x ≈ scale · q.
#[derive(Debug, PartialEq)]
struct QuantizedBlock {
    scale: f32,
    quants: [i8; BLOCK],
    /// Σ of each four consecutive quants (a layout lane's share of the block).
    chunk_sums: [i32; BLOCK / 4],
}

/// Q8_K: one f32 scale for the superblock's eight blocks (`max` keeps its sign, so the
/// largest magnitude maps to −127 exactly and nothing is clamped).
fn quantize_superblock(x: &[f32; SUPERBLOCK]) -> [QuantizedBlock; 8] {
    // The largest magnitude by blocks (vectorised), then its first value in order, as
    // ggml's scan picks it.
    let amax = x
        .chunks_exact(BLOCK)
        .map(|b| block_max(b.try_into().expect("a whole block")))
        .fold(0f32, f32::max);
    let max = match amax > 0.0 {
        true => x.iter().copied().find(|v| v.abs() == amax).unwrap_or(0.0),
        false => 0.0,
    };
    // ggml keeps d = 1 / inverse, which can differ from max / −127 in the last bit.
    let (scale, inverse) = match max != 0.0 {
        true => (1.0 / (-127.0 / max), -127.0 / max),
        false => (0.0, 0.0),
    };
    std::array::from_fn(|b| {
        let block: &[f32; BLOCK] = x[b * BLOCK..(b + 1) * BLOCK].try_into().unwrap();
        quantize_scaled(block, scale, inverse)
    })
}

/// Q8_0 (and Q8_1): scale = f16(amax / 127), with the quants from the unrounded scale's
/// inverse as ggml computes them.
fn quantize_block(block: &[f32; BLOCK]) -> QuantizedBlock {
    let d = block_max(block) / 127.0;
    let inverse = if d != 0.0 { 1.0 / d } else { 0.0 };
    quantize_scaled(block, f16::from_f32(d).to_f32(), inverse)
}

#[cfg(any(test, not(all(target_arch = "x86_64", target_feature = "avx2"))))]
fn block_max_portable(block: &[f32; BLOCK]) -> f32 {
    block.iter().fold(0f32, |m, v| m.max(v.abs()))
}

/// q = round(x · inverse), half away from zero (`f32::round`, ggml's `roundf`).
#[cfg(any(test, not(all(target_arch = "x86_64", target_feature = "avx2"))))]
fn quantize_scaled_portable(block: &[f32; BLOCK], scale: f32, inverse: f32) -> QuantizedBlock {
    let quants = block.map(|v| (v * inverse).round() as i8);
    let chunk_sums =
        std::array::from_fn(|c| quants[4 * c..4 * c + 4].iter().map(|&q| q as i32).sum());
    QuantizedBlock {
        scale,
        quants,
        chunk_sums,
    }
}

#[cfg(not(all(target_arch = "x86_64", target_feature = "avx2")))]
use {block_max_portable as block_max, quantize_scaled_portable as quantize_scaled};

/// `block_max_portable` in eight-lane vectors: quantizing runs before every matmul, and the
/// scalar forms were 5 % of a B = 8 step at 2 threads.
#[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
fn block_max(block: &[f32; BLOCK]) -> f32 {
    use std::arch::x86_64::*;
    // SAFETY: AVX2 is enabled at build time; loads stay inside the array.
    unsafe {
        let x: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(block.as_ptr().add(8 * i)));
        let abs = x.map(|v| _mm256_andnot_ps(_mm256_set1_ps(-0.0), v));
        let max8 = _mm256_max_ps(_mm256_max_ps(abs[0], abs[1]), _mm256_max_ps(abs[2], abs[3]));
        let max4 = _mm_max_ps(_mm256_castps256_ps128(max8), _mm256_extractf128_ps(max8, 1));
        let max2 = _mm_max_ps(max4, _mm_movehl_ps(max4, max4));
        _mm_cvtss_f32(_mm_max_ss(max2, _mm_shuffle_ps(max2, max2, 1)))
    }
}

/// `quantize_scaled_portable` in eight-lane vectors: truncate, then step away from zero where
/// the dropped fraction is at least one half (exact: the fraction is computed without
/// rounding).
#[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
fn quantize_scaled(block: &[f32; BLOCK], scale: f32, inverse: f32) -> QuantizedBlock {
    use std::arch::x86_64::*;
    // SAFETY: AVX2 is enabled at build time; loads and stores stay inside the arrays.
    unsafe {
        let (sign, half, one) = (
            _mm256_set1_ps(-0.0),
            _mm256_set1_ps(0.5),
            _mm256_set1_ps(1.0),
        );
        let inverse = _mm256_set1_ps(inverse);
        let q: [__m256i; 4] = std::array::from_fn(|i| {
            let t = _mm256_mul_ps(_mm256_loadu_ps(block.as_ptr().add(8 * i)), inverse);
            let whole = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(t);
            let fraction = _mm256_andnot_ps(sign, _mm256_sub_ps(t, whole));
            let away = _mm256_or_ps(_mm256_and_ps(t, sign), one);
            let step = _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(fraction, half), away);
            _mm256_cvttps_epi32(_mm256_add_ps(whole, step))
        });
        // Both the pairwise sums and the packs leave 4-element units in the order
        // 0, 2, 4, 6, 1, 3, 5, 7.
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        let pairs = [_mm256_hadd_epi32(q[0], q[1]), _mm256_hadd_epi32(q[2], q[3])];
        let sums = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(pairs[0], pairs[1]), order);
        let words = [
            _mm256_packs_epi32(q[0], q[1]),
            _mm256_packs_epi32(q[2], q[3]),
        ];
        let bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words[0], words[1]), order);
        let mut out = QuantizedBlock {
            scale,
            quants: [0; BLOCK],
            chunk_sums: [0; BLOCK / 4],
        };
        _mm256_storeu_si256(out.quants.as_mut_ptr().cast(), bytes);
        _mm256_storeu_si256(out.chunk_sums.as_mut_ptr().cast(), sums);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three blocks per row: stored as one four-block group with a zero block.
    #[test]
    fn quantization_round_trips_within_half_a_step() {
        let x: Vec<f32> = (0..192)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        for format in [ActivationFormat::Q8_0, ActivationFormat::Q8_1] {
            let q = QuantizedRows::quantize(&x, 2, format);
            assert_eq!((q.rows(), q.stored_blocks()), (2, 4));
            let group = q.groups()[0];
            for row in 0..2 {
                for b in 0..3 {
                    let scale = q.scale(row, b);
                    assert_eq!(scale, f16::from_f32(scale).to_f32(), "an f16 scale");
                    let mut sum = 0i32;
                    for e in 0..BLOCK {
                        let qi = q.quant(row, group, b, e);
                        let v = x[row * 96 + b * 32 + e];
                        // Half a step, plus what rounding the scale to f16 moves 127 steps.
                        let bound = scale * (0.5 + 127.0 * 2f32.powi(-11));
                        assert!((qi as f32 * scale - v).abs() <= bound);
                        sum += qi as i32;
                    }
                    let lanes = b * 4..(b + 1) * 4;
                    let lane_sums = &q.row_lane_sums(row)[lanes.clone()];
                    let want = match format {
                        ActivationFormat::Q8_1 => {
                            let s = (f16::from_f32(sum as f32) * f16::from_f32(scale)).to_f32();
                            assert_eq!(lane_sums[1..], [0.0; 3]);
                            s
                        }
                        _ => sum as f32 * scale,
                    };
                    assert!((lane_sums.iter().sum::<f32>() - want).abs() < 1e-4);
                    assert_eq!(q.block_sum(row, b), want);
                    assert_eq!(q.row_lane_scales(row)[lanes], [scale; 4]);
                }
                assert!((0..BLOCK).all(|e| q.quant(row, group, 3, e) == 0));
                assert_eq!((q.scale(row, 3), q.row_lane_scales(row)[12]), (0.0, 0.0));
            }
        }
    }

    /// The vector form is the portable definition, bit for bit (ties, zeros, ±127), and
    /// rounds halves away from zero as ggml does.
    #[test]
    fn block_quantization_matches_its_definition() {
        let mut blocks: Vec<[f32; BLOCK]> = (0..200)
            .map(|b| {
                std::array::from_fn(|i| ((i * 7919 + b * 104_729) % 2001) as f32 / 97.0 - 10.3)
            })
            .collect();
        blocks.push([0.0; BLOCK]);
        blocks.push(std::array::from_fn(|i| {
            if i == 5 {
                -3.0
            } else {
                0.5 * (i as f32 - 16.0) / 16.0 * 3.0
            }
        }));
        // amax 127: the inverse is 1 and every other value is a tie.
        let ties: [f32; BLOCK] =
            std::array::from_fn(|i| if i == 0 { 127.0 } else { i as f32 - 15.5 });
        blocks.push(ties);
        let portable = |block: &[f32; BLOCK]| {
            let d = block_max_portable(block) / 127.0;
            let inverse = if d != 0.0 { 1.0 / d } else { 0.0 };
            quantize_scaled_portable(block, f16::from_f32(d).to_f32(), inverse)
        };
        for block in &blocks {
            assert_eq!(quantize_block(block), portable(block), "{block:?}");
            // Q8_K's inverses, of either sign (never past ±127, as Q8_K's scale ensures).
            for inverse in [-11.0f32, 3.3]
                .into_iter()
                .filter(|i| block_max_portable(block) * i.abs() <= 127.0)
            {
                assert_eq!(
                    quantize_scaled(block, 1.0, inverse),
                    quantize_scaled_portable(block, 1.0, inverse),
                    "{block:?} at {inverse}"
                );
            }
        }
        let q = quantize_block(&ties).quants;
        assert_eq!((q[1], q[15], q[16], q[31]), (-15, -1, 1, 16));
    }

    /// Q8_K: one scale per 256 from the value of largest magnitude, which lands on −127.
    #[test]
    fn superblocks_share_one_scale_from_the_largest_magnitude() {
        let x: Vec<f32> = (0..512)
            .map(|i| {
                if i == 300 {
                    -9.0
                } else {
                    ((i * 53 % 89) as f32 - 44.0) / 11.0
                }
            })
            .collect();
        let q = QuantizedRows::quantize(&x, 1, ActivationFormat::Q8K);
        let groups = q.groups().to_vec();
        for b in 0..16 {
            let first_max = if b < 8 { 44.0 / -11.0 } else { -9.0 };
            assert_eq!(q.scale(0, b), 1.0 / (-127.0 / first_max), "block {b}");
        }
        let (group, j) = (groups[0], 300 / BLOCK);
        assert_eq!(q.quant(0, group, j, 300 % BLOCK), -127);
    }

    #[test]
    fn zero_blocks_quantize_to_zero() {
        for format in [ActivationFormat::Q8_0, ActivationFormat::Q8K] {
            let q = QuantizedRows::quantize(&[0.0; 256], 1, format);
            assert!(q.row_quants(0).iter().all(|v| v.0 == [0; 64]));
            assert_eq!((q.scale(0, 0), q.row_lane_sums(0)[0]), (0.0, 0.0));
        }
    }
}

//! Activation rows quantized to 8 bits per block of 32 (llama.cpp's `Q8_0` for activations),
//! so the weight kernels can use integer dot products. Each row is quantized on its own: a
//! row's quants never depend on the other rows of the step. Quants are stored in the grouped
//! layout of `layout`, the same as the weights', with each lane's block scale beside them.

use super::layout::{groups, stored_blocks, Group, BLOCK};

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
    /// Per group, each of its 16 lanes' block scale: `[rows, groups, 16]`.
    lane_scales: Vec<f32>,
    /// Per group and lane: the lane's block scale · Σ of the lane's quants (for weight
    /// formats with an offset, whose term is then one multiply-add per group): `[rows,
    /// groups, 16]`.
    lane_sums: Vec<f32>,
}

impl QuantizedRows {
    /// `x` is `[rows, k]` with `k` a multiple of 32.
    pub fn quantize(x: &[f32], rows: usize) -> Self {
        let k = x.len().checked_div(rows).unwrap_or(0);
        assert!(
            k.is_multiple_of(BLOCK) && x.len() == rows * k,
            "activation rows must be whole blocks of {BLOCK}"
        );
        let blocks_per_row = k / BLOCK;
        let stored = stored_blocks(blocks_per_row);
        let groups = groups(blocks_per_row);
        let lanes_per_row = groups.len() * 16;
        let mut quants = vec![QuantVector([0; 64]); rows * stored / 2];
        let mut scales = vec![0f32; rows * stored];
        let mut lane_scales = vec![0f32; rows * lanes_per_row];
        let mut lane_sums = vec![0f32; rows * lanes_per_row];
        for (row, src) in x.chunks_exact(k.max(1)).enumerate() {
            let row_quants = &mut quants[row * stored / 2..(row + 1) * stored / 2];
            // SAFETY: `QuantVector` is `repr(C)` over `[i8; 64]` with no padding.
            let row_quants: &mut [i8] = unsafe {
                std::slice::from_raw_parts_mut(row_quants.as_mut_ptr().cast(), stored * BLOCK)
            };
            let lanes = row * lanes_per_row..(row + 1) * lanes_per_row;
            let (row_lane_scales, row_lane_sums) =
                (&mut lane_scales[lanes.clone()], &mut lane_sums[lanes]);
            for group in &groups {
                let bytes = &mut row_quants[group.first_block * BLOCK..];
                let lanes_per_block = group.lanes_per_block();
                for j in 0..group.blocks {
                    let b = group.first_block + j;
                    let Some(block) = src.get(b * BLOCK..(b + 1) * BLOCK) else {
                        break;
                    };
                    let QuantizedBlock {
                        scale,
                        quants: q,
                        chunk_sums,
                    } = quantize_block(block.try_into().expect("a whole block"));
                    scales[row * stored + b] = scale;
                    let first_lane = group.index * 16 + j * lanes_per_block;
                    let lanes = first_lane..first_lane + lanes_per_block;
                    row_lane_scales[lanes.clone()].fill(scale);
                    let mut block_lane_sums = [0i32; BLOCK / 4];
                    for (c, sum) in chunk_sums.iter().enumerate() {
                        block_lane_sums[c & (lanes_per_block - 1)] += sum;
                    }
                    for (lane, sum) in row_lane_sums[lanes].iter_mut().zip(block_lane_sums) {
                        *lane = scale * sum as f32;
                    }
                    for (c, chunk) in q.chunks_exact(4).enumerate() {
                        let position = group.position(j, 4 * c);
                        bytes[position..position + 4].copy_from_slice(chunk);
                    }
                }
            }
        }
        Self {
            rows,
            blocks_per_row,
            groups,
            quants,
            scales,
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

    /// Row `row`'s lane sums (scale · Σ of the lane's quants), `[groups, 16]`.
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
}

/// One block quantized: x ≈ scale · q.
#[derive(Debug, PartialEq)]
struct QuantizedBlock {
    scale: f32,
    quants: [i8; BLOCK],
    /// Σ of each four consecutive quants (a layout lane's share of the block).
    chunk_sums: [i32; BLOCK / 4],
}

/// scale = max|x| / 127, q = round_ties_even(x / scale).
#[cfg(any(test, not(all(target_arch = "x86_64", target_feature = "avx2"))))]
fn quantize_block_portable(block: &[f32; BLOCK]) -> QuantizedBlock {
    let scale = block.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
    let inverse = if scale > 0.0 { 1.0 / scale } else { 0.0 };
    let quants = block.map(|v| (v * inverse).round_ties_even() as i8);
    let chunk_sums =
        std::array::from_fn(|c| quants[4 * c..4 * c + 4].iter().map(|&q| q as i32).sum());
    QuantizedBlock {
        scale,
        quants,
        chunk_sums,
    }
}

#[cfg(not(all(target_arch = "x86_64", target_feature = "avx2")))]
use quantize_block_portable as quantize_block;

/// `quantize_block_portable` in eight-lane vectors: this runs serially before every matmul,
/// and the scalar form was 5 % of a B = 8 step at 2 threads. `cvtps2dq` rounds to nearest
/// even (the default rounding mode, which Rust never changes).
#[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
fn quantize_block(block: &[f32; BLOCK]) -> QuantizedBlock {
    use std::arch::x86_64::*;
    // SAFETY: AVX2 is enabled at build time; loads and stores stay inside the arrays.
    unsafe {
        let x: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(block.as_ptr().add(8 * i)));
        let abs = x.map(|v| _mm256_andnot_ps(_mm256_set1_ps(-0.0), v));
        let max8 = _mm256_max_ps(_mm256_max_ps(abs[0], abs[1]), _mm256_max_ps(abs[2], abs[3]));
        let max4 = _mm_max_ps(_mm256_castps256_ps128(max8), _mm256_extractf128_ps(max8, 1));
        let max2 = _mm_max_ps(max4, _mm_movehl_ps(max4, max4));
        let max = _mm_cvtss_f32(_mm_max_ss(max2, _mm_shuffle_ps(max2, max2, 1)));
        let scale = max / 127.0;
        let inverse = _mm256_set1_ps(if scale > 0.0 { 1.0 / scale } else { 0.0 });
        let q = x.map(|v| _mm256_cvtps_epi32(_mm256_mul_ps(v, inverse)));
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
        let q = QuantizedRows::quantize(&x, 2);
        assert_eq!((q.rows(), q.stored_blocks()), (2, 4));
        let group = q.groups()[0];
        for row in 0..2 {
            for b in 0..3 {
                let scale = q.scale(row, b);
                let mut sum = 0f32;
                for e in 0..BLOCK {
                    let qi = q.quant(row, group, b, e);
                    let v = x[row * 96 + b * 32 + e];
                    assert!((qi as f32 * scale - v).abs() <= scale / 2.0 + 1e-6);
                    sum += qi as f32;
                }
                let lanes = b * 4..(b + 1) * 4;
                let lane_sum: f32 = q.row_lane_sums(row)[lanes.clone()].iter().sum();
                assert!((lane_sum - sum * scale).abs() < 1e-4);
                assert_eq!(q.row_lane_scales(row)[lanes], [scale; 4]);
            }
            assert!((0..BLOCK).all(|e| q.quant(row, group, 3, e) == 0));
            assert_eq!((q.scale(row, 3), q.row_lane_scales(row)[12]), (0.0, 0.0));
        }
    }

    /// The vector form is the portable definition, bit for bit (ties, zeros, ±127).
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
        blocks.push(std::array::from_fn(|i| (i as f32 - 15.5) * 0.25));
        for block in &blocks {
            assert_eq!(
                quantize_block(block),
                quantize_block_portable(block),
                "{block:?}"
            );
        }
    }

    #[test]
    fn zero_blocks_quantize_to_zero() {
        let q = QuantizedRows::quantize(&[0.0; 32], 1);
        assert!(q.row_quants(0).iter().all(|v| v.0 == [0; 64]));
        assert_eq!((q.scale(0, 0), q.row_lane_sums(0)[0]), (0.0, 0.0));
    }
}

//! Activation rows quantized to 8 bits per block of 32 (llama.cpp's `Q8_0` for activations),
//! so the weight kernels can use integer dot products. Each row is quantized on its own: a
//! row's quants never depend on the other rows of the step.

pub const BLOCK: usize = 32;

/// One block's quants, aligned so that a 32-byte load never straddles two cache lines.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
pub struct QuantBlock(pub [i8; BLOCK]);

pub struct QuantizedRows {
    rows: usize,
    blocks_per_row: usize,
    /// `[rows, blocks_per_row]`.
    quants: Vec<QuantBlock>,
    /// Per block: x ≈ scale · q.
    scales: Vec<f32>,
    /// Per block: scale · Σq, the block's sum (for weight formats with an offset); each row
    /// zero-padded to `padded_blocks(blocks_per_row)` so SIMD reads whole lanes.
    scaled_sums: Vec<f32>,
}

impl QuantizedRows {
    /// `x` is `[rows, k]` with `k` a multiple of 32.
    pub fn quantize(x: &[f32], rows: usize) -> Self {
        let k = x.len().checked_div(rows).unwrap_or(0);
        assert!(
            k.is_multiple_of(BLOCK) && x.len() == rows * k,
            "activation rows must be whole blocks of {BLOCK}"
        );
        let blocks = x.len() / BLOCK;
        let mut quants = vec![QuantBlock([0; BLOCK]); blocks];
        let mut scales = Vec::with_capacity(blocks);
        let blocks_per_row = k / BLOCK;
        let sum_stride = padded_blocks(blocks_per_row);
        let mut scaled_sums = vec![0f32; rows * sum_stride];
        for (i, (src, QuantBlock(dst))) in x.chunks_exact(BLOCK).zip(quants.iter_mut()).enumerate()
        {
            let amax = max_abs(src);
            let scale = amax / 127.0;
            let inverse = if scale > 0.0 { 1.0 / scale } else { 0.0 };
            let mut sum = 0i32;
            for (q, v) in dst.iter_mut().zip(src) {
                *q = (v * inverse).round_ties_even() as i8;
                sum += *q as i32;
            }
            scales.push(scale);
            let (row, block) = (i / blocks_per_row, i % blocks_per_row);
            scaled_sums[row * sum_stride + block] = scale * sum as f32;
        }
        Self {
            rows,
            blocks_per_row,
            quants,
            scales,
            scaled_sums,
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn blocks_per_row(&self) -> usize {
        self.blocks_per_row
    }

    /// All quant blocks, `[rows, blocks_per_row]`.
    pub fn quants(&self) -> &[QuantBlock] {
        &self.quants
    }

    /// All block scales, `[rows, blocks_per_row]`.
    pub fn scales(&self) -> &[f32] {
        &self.scales
    }

    /// Row `row`'s per-block scale · Σq, `[padded_blocks(blocks_per_row)]` (zeros after the
    /// last block).
    #[inline(always)]
    pub fn row_scaled_sums(&self, row: usize) -> &[f32] {
        let stride = padded_blocks(self.blocks_per_row);
        &self.scaled_sums[row * stride..(row + 1) * stride]
    }

    #[inline(always)]
    pub fn block(&self, row: usize, block: usize) -> &[i8; BLOCK] {
        &self.quants[row * self.blocks_per_row + block].0
    }

    #[inline(always)]
    pub fn scale(&self, row: usize, block: usize) -> f32 {
        self.scales[row * self.blocks_per_row + block]
    }
}

/// Blocks rounded up to whole groups of eight (one f32 SIMD register).
pub fn padded_blocks(blocks: usize) -> usize {
    blocks.next_multiple_of(8)
}

/// Largest |v| of a block, in eight lanes (vectorises to `vmaxps`).
fn max_abs(block: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    for chunk in block.chunks_exact(8) {
        for (lane, v) in lanes.iter_mut().zip(chunk) {
            *lane = lane.max(v.abs());
        }
    }
    lanes.iter().fold(0f32, |m, &v| m.max(v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantization_round_trips_within_half_a_step() {
        let x: Vec<f32> = (0..128)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let q = QuantizedRows::quantize(&x, 2);
        assert_eq!((q.rows(), q.blocks_per_row()), (2, 2));
        for row in 0..2 {
            for b in 0..2 {
                let scale = q.scale(row, b);
                let mut sum = 0f32;
                for (i, &qi) in q.block(row, b).iter().enumerate() {
                    let v = x[row * 64 + b * 32 + i];
                    assert!((qi as f32 * scale - v).abs() <= scale / 2.0 + 1e-6);
                    sum += qi as f32;
                }
                assert!((q.row_scaled_sums(row)[b] - sum * scale).abs() < 1e-4);
            }
        }
    }

    #[test]
    fn zero_blocks_quantize_to_zero() {
        let q = QuantizedRows::quantize(&[0.0; 32], 1);
        assert_eq!(q.block(0, 0), &[0i8; 32]);
        assert_eq!((q.scale(0, 0), q.row_scaled_sums(0)[0]), (0.0, 0.0));
    }
}

//! Weight matrices in their stored (often quantized) format and a row-independent batched
//! matmul over them. Every output element is one `vec_dot` of one activation row with one
//! weight row, in a fixed order, so a row's result never depends on its batch-mates: batched
//! and unbatched greedy decoding agree exactly. Work is split over output columns on the
//! calling thread's rayon pool (each model runs its steps inside its own pool).

use crate::config::WeightPrecision;
use crate::error::{EngineError, EngineResult};
use candle_core::quantized::k_quants::{
    BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K,
    BlockQ8_0, GgmlType,
};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;
use rayon::prelude::*;

/// A `[n_out, k_in]` weight matrix, rows stored contiguously in their own block format.
pub struct QWeight {
    n_out: usize,
    k_in: usize,
    blocks: Blocks,
}

enum Blocks {
    F32(Vec<f32>),
    Q4_0(Vec<BlockQ4_0>),
    Q4_1(Vec<BlockQ4_1>),
    Q5_0(Vec<BlockQ5_0>),
    Q5_1(Vec<BlockQ5_1>),
    Q8_0(Vec<BlockQ8_0>),
    Q2K(Vec<BlockQ2K>),
    Q3K(Vec<BlockQ3K>),
    Q4K(Vec<BlockQ4K>),
    Q5K(Vec<BlockQ5K>),
    Q6K(Vec<BlockQ6K>),
}

/// Runs `$body` with `$v` bound to the typed block vector, whatever its format.
macro_rules! with_blocks {
    ($blocks:expr, $v:ident => $body:expr) => {
        match $blocks {
            Blocks::F32($v) => $body,
            Blocks::Q4_0($v) => $body,
            Blocks::Q4_1($v) => $body,
            Blocks::Q5_0($v) => $body,
            Blocks::Q5_1($v) => $body,
            Blocks::Q8_0($v) => $body,
            Blocks::Q2K($v) => $body,
            Blocks::Q3K($v) => $body,
            Blocks::Q4K($v) => $body,
            Blocks::Q5K($v) => $body,
            Blocks::Q6K($v) => $body,
        }
    };
}

impl QWeight {
    /// Takes a 2-D tensor `[n_out, k_in]`; F16/BF16 are widened to F32 (no SIMD dot for them).
    pub fn from_qtensor(name: &str, tensor: &QTensor) -> EngineResult<Self> {
        let (n_out, k_in) = tensor.shape().dims2()?;
        let tensor = match tensor.dtype() {
            GgmlDType::F16 | GgmlDType::BF16 => {
                QTensor::quantize(&tensor.dequantize(&Device::Cpu)?, GgmlDType::F32)?
            }
            _ => clone_qtensor(tensor)?,
        };
        let data = tensor.data()?;
        let blocks = match tensor.dtype() {
            GgmlDType::F32 => Blocks::F32(typed(&data)),
            GgmlDType::Q4_0 => Blocks::Q4_0(typed(&data)),
            GgmlDType::Q4_1 => Blocks::Q4_1(typed(&data)),
            GgmlDType::Q5_0 => Blocks::Q5_0(typed(&data)),
            GgmlDType::Q5_1 => Blocks::Q5_1(typed(&data)),
            GgmlDType::Q8_0 => Blocks::Q8_0(typed(&data)),
            GgmlDType::Q2K => Blocks::Q2K(typed(&data)),
            GgmlDType::Q3K => Blocks::Q3K(typed(&data)),
            GgmlDType::Q4K => Blocks::Q4K(typed(&data)),
            GgmlDType::Q5K => Blocks::Q5K(typed(&data)),
            GgmlDType::Q6K => Blocks::Q6K(typed(&data)),
            other => {
                return Err(EngineError::UnsupportedDType {
                    tensor: name.to_string(),
                    dtype: format!("{other:?}"),
                })
            }
        };
        let weight = Self {
            n_out,
            k_in,
            blocks,
        };
        let expected_blocks = n_out * k_in / weight.block_size();
        if weight.block_count() != expected_blocks || !k_in.is_multiple_of(weight.block_size()) {
            return Err(EngineError::InvalidModel {
                path: name.into(),
                message: format!("tensor `{name}` holds a truncated or misaligned block array"),
            });
        }
        Ok(weight)
    }

    /// Converts to the precision a model variant asks for (`stored` keeps the file's format).
    pub fn requantize(self, name: &str, precision: WeightPrecision) -> EngineResult<Self> {
        let target = match precision {
            WeightPrecision::Stored => return Ok(self),
            WeightPrecision::F32 => GgmlDType::F32,
            WeightPrecision::Q8_0 => GgmlDType::Q8_0,
            WeightPrecision::Q4_0 => GgmlDType::Q4_0,
        };
        if self.dtype() == target || !self.k_in.is_multiple_of(target.block_size()) {
            return Ok(self);
        }
        let dense = candle_core::Tensor::from_vec(
            self.dequantize(),
            (self.n_out, self.k_in),
            &Device::Cpu,
        )?;
        Self::from_qtensor(name, &QTensor::quantize(&dense, target)?)
    }

    pub fn n_out(&self) -> usize {
        self.n_out
    }

    pub fn k_in(&self) -> usize {
        self.k_in
    }

    pub fn dtype(&self) -> GgmlDType {
        with_blocks!(&self.blocks, v => dtype_of(v))
    }

    fn block_size(&self) -> usize {
        self.dtype().block_size()
    }

    fn block_count(&self) -> usize {
        with_blocks!(&self.blocks, v => v.len())
    }

    /// The weights as f32, row-major `[n_out, k_in]`.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.n_out * self.k_in];
        with_blocks!(&self.blocks, v => to_float(v, &mut out));
        out
    }

    /// `x [rows, k_in]` × Wᵀ → `[rows, n_out]`, each row computed independently.
    pub fn matmul(&self, x: &[f32], rows: usize) -> Vec<f32> {
        assert_eq!(
            x.len(),
            rows * self.k_in,
            "matmul input has the wrong length"
        );
        with_blocks!(&self.blocks, v => matmul_rows(v, self.n_out, self.k_in, x, rows))
    }
}

fn dtype_of<T: GgmlType>(_: &[T]) -> GgmlDType {
    T::DTYPE
}

fn to_float<T: GgmlType>(blocks: &[T], out: &mut [f32]) {
    T::to_float(blocks, out)
}

fn clone_qtensor(tensor: &QTensor) -> EngineResult<QTensor> {
    let storage =
        candle_core::quantized::QStorage::from_data(tensor.data()?, &Device::Cpu, tensor.dtype())?;
    Ok(QTensor::new(storage, tensor.shape().clone())?)
}

/// Copies raw little-endian block bytes into a properly aligned typed vector.
fn typed<T: GgmlType>(bytes: &[u8]) -> Vec<T> {
    let size = std::mem::size_of::<T>();
    let count = bytes.len() / size;
    let mut out: Vec<T> = (0..count).map(|_| T::zeros()).collect();
    // SAFETY: block types are `repr(C)` plain data (integers and halfs); any byte pattern is a
    // valid value, and `out` has room for exactly `count * size` bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), out.as_mut_ptr() as *mut u8, count * size);
    }
    out
}

/// Columns handed to one rayon task: enough work to amortise scheduling.
const MIN_COLUMNS_PER_TASK: usize = 16;

fn matmul_rows<T: GgmlType>(
    weight: &[T],
    n_out: usize,
    k_in: usize,
    x: &[f32],
    rows: usize,
) -> Vec<f32> {
    let row_blocks = k_in / T::BLCK_SIZE;
    let mut x_quant: Vec<T::VecDotType> = (0..rows * row_blocks)
        .map(|_| T::VecDotType::zeros())
        .collect();
    for (dst, src) in x_quant.chunks_mut(row_blocks).zip(x.chunks(k_in)) {
        T::VecDotType::from_float(src, dst);
    }
    // Column-major while computing so that each task owns a contiguous slice.
    let mut by_column = vec![0f32; n_out * rows];
    by_column
        .par_chunks_mut(rows)
        .with_min_len(MIN_COLUMNS_PER_TASK)
        .enumerate()
        .for_each(|(col, out)| {
            let w = &weight[col * row_blocks..(col + 1) * row_blocks];
            for (row, slot) in out.iter_mut().enumerate() {
                *slot = T::vec_dot(k_in, w, &x_quant[row * row_blocks..(row + 1) * row_blocks]);
            }
        });
    let mut out = vec![0f32; rows * n_out];
    for (col, column) in by_column.chunks(rows).enumerate() {
        for (row, &value) in column.iter().enumerate() {
            out[row * n_out + col] = value;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Tensor;

    fn random(len: usize, seed: u64) -> Vec<f32> {
        let mut state = seed;
        (0..len)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 33) as f32 / (1u64 << 31) as f32) - 0.5
            })
            .collect()
    }

    fn weight(dtype: GgmlDType, n: usize, k: usize) -> (QWeight, Vec<f32>) {
        let dense = Tensor::from_vec(random(n * k, 7), (n, k), &Device::Cpu).unwrap();
        let q = QWeight::from_qtensor("w", &QTensor::quantize(&dense, dtype).unwrap()).unwrap();
        let reference = q.dequantize();
        (q, reference)
    }

    #[test]
    fn matches_dequantized_reference_per_format() {
        let (n, k, rows) = (37, 64, 5);
        let x = random(rows * k, 3);
        for (dtype, tolerance) in [
            (GgmlDType::F32, 1e-4),
            (GgmlDType::Q8_0, 0.05),
            (GgmlDType::Q4_0, 0.05),
            (GgmlDType::Q4_1, 0.05),
        ] {
            let (w, dense) = weight(dtype, n, k);
            let got = w.matmul(&x, rows);
            for r in 0..rows {
                for c in 0..n {
                    let want: f32 = (0..k).map(|i| x[r * k + i] * dense[c * k + i]).sum();
                    let diff = (got[r * n + c] - want).abs();
                    assert!(
                        diff < tolerance,
                        "{dtype:?} ({r},{c}): {} vs {want}",
                        got[r * n + c]
                    );
                }
            }
        }
    }

    #[test]
    fn rows_do_not_depend_on_batch_mates() {
        let (n, k, rows) = (70, 128, 9);
        let x = random(rows * k, 11);
        for dtype in [GgmlDType::F32, GgmlDType::Q8_0, GgmlDType::Q4_1] {
            let (w, _) = weight(dtype, n, k);
            let batched = w.matmul(&x, rows);
            for r in 0..rows {
                let alone = w.matmul(&x[r * k..(r + 1) * k], 1);
                assert_eq!(
                    &batched[r * n..(r + 1) * n],
                    &alone[..],
                    "{dtype:?} row {r}"
                );
            }
        }
    }

    #[test]
    fn requantize_changes_format_and_stays_close() {
        let (w, dense) = weight(GgmlDType::F32, 8, 64);
        let q = w.requantize("w", WeightPrecision::Q8_0).unwrap();
        assert_eq!(q.dtype(), GgmlDType::Q8_0);
        let back = q.dequantize();
        let max_err = dense
            .iter()
            .zip(&back)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(max_err < 0.01, "max error {max_err}");
    }
}

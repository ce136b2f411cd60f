//! Weight matrices in their stored (often quantized) format and a row-independent batched
//! matmul over them. Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K go through our
//! integer kernels (`int8`) and f32, f16 and bf16 through our dense kernels (`dense`), both of
//! which read each weight once per step for all rows; Q2_K and Q3_K use candle's per-row
//! `vec_dot`.
//! Either way every output element is computed in a fixed order from one activation row and
//! one weight row, so a row's result never depends on its batch-mates: batched and unbatched
//! greedy decoding agree exactly. Work is split over output columns (see `engine::parallel`).

mod activations;
mod dense;
mod int8;
mod layout;
#[cfg(target_arch = "x86_64")]
mod simd;

use super::parallel;
use crate::config::WeightPrecision;
use crate::error::{EngineError, EngineResult};
pub use activations::ActivationFormat;
use activations::QuantizedRows;
use candle_core::quantized::k_quants::{BlockQ2K, BlockQ3K, GgmlType};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;
use dense::DenseMatrix;
pub use int8::{Int8Format, Kernel, PackedInt8};

/// A `[n_out, k_in]` weight matrix, rows stored contiguously in their own block format.
pub struct QWeight {
    n_out: usize,
    k_in: usize,
    storage: Storage,
}

enum Storage {
    /// The `Int8Format`s: repacked for our integer kernels.
    Int8(PackedInt8),
    /// f32, f16 and bf16, as stored.
    Dense(DenseMatrix),
    /// Every other format, as candle's blocks.
    Ggml(Blocks),
}

enum Blocks {
    Q2K(Vec<BlockQ2K>),
    Q3K(Vec<BlockQ3K>),
}

/// Runs `$body` with `$v` bound to the typed block vector, whatever its format.
macro_rules! with_blocks {
    ($blocks:expr, $v:ident => $body:expr) => {
        match $blocks {
            Blocks::Q2K($v) => $body,
            Blocks::Q3K($v) => $body,
        }
    };
}

impl QWeight {
    /// Takes a 2-D tensor `[n_out, k_in]`, keeping its format.
    pub fn from_qtensor(name: &str, tensor: &QTensor) -> EngineResult<Self> {
        let (n_out, k_in) = tensor.shape().dims2()?;
        let data = tensor.data()?;
        let dtype = tensor.dtype();
        let (block_size, type_size) = (dtype.block_size(), dtype.type_size());
        if !k_in.is_multiple_of(block_size) || data.len() != n_out * k_in / block_size * type_size {
            return Err(EngineError::InvalidModel {
                path: name.into(),
                message: format!("tensor `{name}` holds a truncated or misaligned block array"),
            });
        }
        if let Some(format) = Int8Format::of(dtype) {
            let packed = PackedInt8::from_ggml(format, &data, k_in / layout::BLOCK);
            return Ok(Self {
                n_out,
                k_in,
                storage: Storage::Int8(packed),
            });
        }
        let storage = match dtype {
            GgmlDType::F32 => Storage::Dense(DenseMatrix::F32(typed(&data))),
            GgmlDType::F16 => Storage::Dense(DenseMatrix::F16(typed(&data))),
            GgmlDType::BF16 => Storage::Dense(DenseMatrix::Bf16(typed(&data))),
            GgmlDType::Q2K => Storage::Ggml(Blocks::Q2K(typed(&data))),
            GgmlDType::Q3K => Storage::Ggml(Blocks::Q3K(typed(&data))),
            other => {
                return Err(EngineError::UnsupportedDType {
                    tensor: name.to_string(),
                    dtype: format!("{other:?}"),
                })
            }
        };
        Ok(Self {
            n_out,
            k_in,
            storage,
        })
    }

    /// Converts to the precision a model variant asks for (`stored` keeps the file's format).
    /// A K-quant target whose 256-input superblocks do not divide the rows falls back as
    /// llama.cpp's presets do (Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0); other targets that do
    /// not divide them keep the stored format.
    pub fn requantize(self, name: &str, precision: WeightPrecision) -> EngineResult<Self> {
        let target = match precision {
            WeightPrecision::Stored => return Ok(self),
            WeightPrecision::F32 => GgmlDType::F32,
            WeightPrecision::F16 => GgmlDType::F16,
            WeightPrecision::Bf16 => GgmlDType::BF16,
            WeightPrecision::Q8_0 => GgmlDType::Q8_0,
            WeightPrecision::Q4_0 => GgmlDType::Q4_0,
            WeightPrecision::Q4_1 => GgmlDType::Q4_1,
            WeightPrecision::Q5_0 => GgmlDType::Q5_0,
            WeightPrecision::Q5_1 => GgmlDType::Q5_1,
            WeightPrecision::Q4K => GgmlDType::Q4K,
            WeightPrecision::Q5K => GgmlDType::Q5K,
            WeightPrecision::Q6K => GgmlDType::Q6K,
        };
        let target = match target {
            _ if self.k_in.is_multiple_of(target.block_size()) => target,
            GgmlDType::Q4K => GgmlDType::Q5_0,
            GgmlDType::Q5K => GgmlDType::Q5_1,
            GgmlDType::Q6K => GgmlDType::Q8_0,
            _ => return Ok(self),
        };
        if self.dtype() == target {
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

    /// Bytes a matmul reads of this matrix (quants and block headers).
    pub fn stored_bytes(&self) -> usize {
        match &self.storage {
            Storage::Int8(packed) => packed.stored_bytes(),
            Storage::Dense(dense) => dense.stored_bytes(),
            Storage::Ggml(blocks) => with_blocks!(blocks, v => std::mem::size_of_val(v.as_slice())),
        }
    }

    pub fn dtype(&self) -> GgmlDType {
        match &self.storage {
            Storage::Int8(packed) => packed.format().dtype(),
            Storage::Dense(dense) => dense.dtype(),
            Storage::Ggml(blocks) => with_blocks!(blocks, v => dtype_of(v)),
        }
    }

    /// The repacked blocks of the integer-kernel formats; `None` for the other formats.
    pub fn packed_int8(&self) -> Option<&PackedInt8> {
        match &self.storage {
            Storage::Int8(packed) => Some(packed),
            Storage::Dense(_) | Storage::Ggml(_) => None,
        }
    }

    /// A bf16 matrix's values as raw bits, row-major `[n_out, k_in]` (the GPU's bf16 GEMM).
    pub fn is_bf16(&self) -> bool {
        matches!(self.dense(), Some(DenseMatrix::Bf16(_)))
    }

    pub fn bf16_bits(&self) -> Option<Vec<u16>> {
        match self.dense()? {
            DenseMatrix::Bf16(values) => Some(values.iter().map(|v| v.to_bits()).collect()),
            DenseMatrix::F32(_) | DenseMatrix::F16(_) => None,
        }
    }

    fn dense(&self) -> Option<&DenseMatrix> {
        match &self.storage {
            Storage::Dense(dense) => Some(dense),
            Storage::Int8(_) | Storage::Ggml(_) => None,
        }
    }

    /// The weights as f32, row-major `[n_out, k_in]`.
    pub fn dequantize(&self) -> Vec<f32> {
        match &self.storage {
            Storage::Int8(packed) => packed.dequantize(),
            Storage::Dense(dense) => dense.to_f32(),
            Storage::Ggml(blocks) => {
                let mut out = vec![0f32; self.n_out * self.k_in];
                with_blocks!(blocks, v => to_float(v, &mut out));
                out
            }
        }
    }

    /// `x [rows, k_in]` × Wᵀ → `[rows, n_out]`, each row computed independently.
    pub fn matmul(&self, x: &[f32], rows: usize) -> Vec<f32> {
        self.matmul_with(Kernel::detect(), x, rows)
    }

    /// `matmul` on a chosen integer kernel (tests run every kernel the CPU has).
    pub fn matmul_with(&self, kernel: Kernel, x: &[f32], rows: usize) -> Vec<f32> {
        let [out] = Self::matmul_each_with(kernel, [self], x, rows);
        out
    }

    /// `x × Wᵢᵀ` for several weights reading one input (q/k/v; gate/up) on `kernel`: the
    /// input is quantized once per activation format and all their columns run in one
    /// parallel region.
    pub fn matmul_each_with<const N: usize>(
        kernel: Kernel,
        weights: [&Self; N],
        x: &[f32],
        rows: usize,
    ) -> [Vec<f32>; N] {
        let k_in = weights.first().map_or(0, |w| w.k_in);
        assert!(
            weights.iter().all(|w| w.k_in == k_in) && x.len() == rows * k_in,
            "matmul input has the wrong length"
        );
        let mut outs: Vec<Vec<f32>> = weights.iter().map(|w| vec![0f32; rows * w.n_out]).collect();
        let cols_per_task = weights
            .iter()
            .map(|w| w.columns_per_task())
            .max()
            .unwrap_or(1);
        let int8: Option<Vec<&PackedInt8>> = weights.iter().map(|w| w.packed_int8()).collect();
        let dense: Option<Vec<&DenseMatrix>> = weights.iter().map(|w| w.dense()).collect();
        match (int8, dense) {
            (Some(int8), _) => {
                // Once per activation format the weights pair with (a mix, e.g. Q8_0 beside
                // Q5_0 or Q5_1, reads one input two ways).
                let mut quantized: Vec<(ActivationFormat, QuantizedRows)> = Vec::new();
                for w in &int8 {
                    let format = w.format().activation_format();
                    if quantized.iter().all(|(f, _)| *f != format) {
                        quantized.push((format, QuantizedRows::quantize(x, rows, format)));
                    }
                }
                let inputs: Vec<&QuantizedRows> = int8
                    .iter()
                    .map(|w| {
                        let format = w.format().activation_format();
                        &quantized.iter().find(|(f, _)| *f == format).unwrap().1
                    })
                    .collect();
                parallel::fill_columns(
                    &mut outs,
                    rows,
                    split(cols_per_task),
                    |i, rows, columns, out| {
                        int8::columns(kernel, int8[i], inputs[i], rows, columns.start, out)
                    },
                );
            }
            (_, Some(dense)) => {
                parallel::fill_columns(
                    &mut outs,
                    rows,
                    split(cols_per_task),
                    |i, rows, columns, out| {
                        let x = &x[rows.start * k_in..rows.end * k_in];
                        dense::columns(kernel, dense[i], k_in, x, columns.start, out)
                    },
                );
            }
            _ => {
                for (w, out) in weights.iter().zip(&mut outs) {
                    match &w.storage {
                        Storage::Int8(_) | Storage::Dense(_) => {
                            *out = w.matmul_with(kernel, x, rows)
                        }
                        Storage::Ggml(blocks) => {
                            with_blocks!(blocks, v => w.generic_matmul(v, x, rows, out))
                        }
                    }
                }
            }
        }
        outs.try_into().expect("one output per weight")
    }

    /// Candle's `vec_dot` per (row, column), for the formats without an integer kernel.
    fn generic_matmul<T: GgmlType>(
        &self,
        weight: &[T],
        x: &[f32],
        rows: usize,
        out: &mut Vec<f32>,
    ) {
        let row_blocks = self.k_in / T::BLCK_SIZE;
        let mut x_quant: Vec<T::VecDotType> = (0..rows * row_blocks)
            .map(|_| T::VecDotType::zeros())
            .collect();
        for (dst, src) in x_quant.chunks_mut(row_blocks).zip(x.chunks(self.k_in)) {
            T::VecDotType::from_float(src, dst);
        }
        let outs = std::slice::from_mut(out);
        parallel::fill_columns(
            outs,
            rows,
            split(self.columns_per_task()),
            |_, rows, columns, out| {
                let width = columns.len();
                let x_quant = &x_quant[rows.start * row_blocks..rows.end * row_blocks];
                for (c, column) in columns.enumerate() {
                    let w = &weight[column * row_blocks..(column + 1) * row_blocks];
                    for (row, xq) in x_quant.chunks(row_blocks).enumerate() {
                        out[row * width + c] = T::vec_dot(self.k_in, w, xq);
                    }
                }
            },
        );
    }

    fn columns_per_task(&self) -> usize {
        parallel::chunk_len(
            self.n_out,
            parallel::current_threads(),
            MIN_COLUMNS_PER_TASK,
        )
    }
}

fn dtype_of<T: GgmlType>(_: &[T]) -> GgmlDType {
    T::DTYPE
}

fn to_float<T: GgmlType>(blocks: &[T], out: &mut [f32]) {
    T::to_float(blocks, out)
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

/// Columns handed to one task at least: enough work to amortise scheduling.
const MIN_COLUMNS_PER_TASK: usize = 16;

/// Tasks of a long input take the kernels' row chunks; those of a short one `cols_per_task`
/// columns.
fn split(cols_per_task: usize) -> parallel::Split {
    parallel::Split {
        row_run: int8::ROW_CHUNK,
        cols_per_task,
    }
}

#[cfg(test)]
pub(crate) mod tests {
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

    /// Odd shapes: 37 columns (not a multiple of a task's columns), 29 blocks per row (one
    /// group of each size, and a zero block), 3 blocks per row (one group, a zero block), and
    /// row counts that exercise every tile size and the 64-row chunking.
    #[test]
    fn every_kernel_matches_the_dequantized_reference_per_format() {
        for (k, rows) in [
            (928, 1),
            (928, 13),
            (928, 70),
            (96, 3),
            (96, 13),
            (768, 1),
            (768, 13),
        ] {
            let n = 37;
            // Activation rounding error grows like √k.
            let scale = (k as f32 / 96.0).sqrt();
            let x = random(rows * k, 3 + rows as u64);
            for (dtype, tolerance) in [
                (GgmlDType::F32, 1e-4),
                (GgmlDType::F16, 1e-4),
                (GgmlDType::BF16, 1e-4),
                (GgmlDType::Q8_0, 0.03 * scale),
                (GgmlDType::Q4_0, 0.03 * scale),
                (GgmlDType::Q4_1, 0.03 * scale),
                (GgmlDType::Q5_0, 0.03 * scale),
                (GgmlDType::Q5_1, 0.03 * scale),
                (GgmlDType::Q4K, 0.03 * scale),
                (GgmlDType::Q5K, 0.03 * scale),
                (GgmlDType::Q6K, 0.03 * scale),
            ] {
                if !k.is_multiple_of(dtype.block_size()) {
                    continue;
                }
                let (w, dense) = weight(dtype, n, k);
                for kernel in Kernel::available() {
                    let got = w.matmul_with(kernel, &x, rows);
                    for r in 0..rows {
                        for c in 0..n {
                            let want: f32 = (0..k).map(|i| x[r * k + i] * dense[c * k + i]).sum();
                            let diff = (got[r * n + c] - want).abs();
                            assert!(
                                diff < tolerance,
                                "{dtype:?} {kernel:?} rows={rows} ({r},{c}): {} vs {want}",
                                got[r * n + c]
                            );
                        }
                    }
                }
            }
        }
    }

    /// Activations quantized by the rule candle (and ggml) pair with each format make every
    /// kernel's integer sums candle's: outputs agree to float rounding, where one quant off
    /// by one step would move an output by ~1e-3 (the largest gap seen is ~3e-6).
    #[test]
    fn integer_kernels_compute_candles_quantized_matmul() {
        use candle_core::Module;
        for (n, k, rows) in [
            (7, 768, 3),
            (5, 256, 9),
            (4, 1536, 2),
            (3, 64, 5),
            (2, 448, 3),
        ] {
            let x = random(rows * k, 21 + k as u64);
            let input = Tensor::from_vec(x.clone(), (rows, k), &Device::Cpu).unwrap();
            for dtype in INT8_FORMATS {
                if !k.is_multiple_of(dtype.block_size()) {
                    continue;
                }
                let dense = Tensor::from_vec(random(n * k, 23), (n, k), &Device::Cpu).unwrap();
                let quantize = || QTensor::quantize(&dense, dtype).unwrap();
                let candle = candle_core::quantized::QMatMul::from_qtensor(quantize()).unwrap();
                let want: Vec<f32> = candle
                    .forward(&input)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                let w = QWeight::from_qtensor("w", &quantize()).unwrap();
                for kernel in Kernel::available() {
                    let got = w.matmul_with(kernel, &x, rows);
                    let worst = got
                        .iter()
                        .zip(&want)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0f32, f32::max);
                    assert!(worst < 2e-5, "{dtype:?} {kernel:?} k={k}: {worst}");
                }
            }
        }
    }

    /// Matrices that read one input in different activation formats (Q5_1 beside Q8_0, as
    /// llama.cpp's Q5_K_M preset writes q/k/v; a K-quant beside both) each get their own
    /// quantization: the shared call equals each matrix alone.
    #[test]
    fn one_input_read_in_several_activation_formats() {
        let (k, rows) = (512, 5);
        let x = random(rows * k, 29);
        let weights = [GgmlDType::Q5_1, GgmlDType::Q8_0, GgmlDType::Q4K].map(|d| weight(d, 6, k).0);
        for kernel in Kernel::available() {
            let together = QWeight::matmul_each_with(
                kernel,
                [&weights[0], &weights[1], &weights[2]],
                &x,
                rows,
            );
            for (w, got) in weights.iter().zip(&together) {
                assert_eq!(got, &w.matmul_with(kernel, &x, rows), "{:?}", w.dtype());
            }
        }
    }

    /// The SIMD kernels do the portable kernels' integer arithmetic: they differ only in the
    /// order f32 partial sums are added. Row counts 1 to 8 take every one-column row tile
    /// whole, 11 and 13 the two-column tiles with each remainder, 37 the unpacked columns.
    #[test]
    fn simd_and_portable_kernels_agree_closely() {
        let shapes = [
            (19, 160, 11),
            (9, 960, 10),
            (7, 768, 12),
            (4, 256, 13),
            (5, 576, 37),
        ];
        let row_counts = (1..=8).map(|rows| (3, 256, rows));
        for (n, k, rows) in shapes.into_iter().chain(row_counts) {
            let x = random(rows * k, 5);
            for dtype in INT8_FORMATS.into_iter().chain(DENSE_FORMATS) {
                if !k.is_multiple_of(dtype.block_size()) {
                    continue;
                }
                let (w, _) = weight(dtype, n, k);
                let portable = w.matmul_with(Kernel::Portable, &x, rows);
                for kernel in Kernel::available() {
                    let got = w.matmul_with(kernel, &x, rows);
                    for (a, b) in got.iter().zip(&portable) {
                        assert!((a - b).abs() < 1e-5, "{dtype:?} {kernel:?}: {a} vs {b}");
                    }
                }
            }
        }
    }

    pub(crate) const DENSE_FORMATS: [GgmlDType; 3] =
        [GgmlDType::F32, GgmlDType::F16, GgmlDType::BF16];

    /// Widths with a tail past the last full vector (8 and 16 lanes), column counts with a
    /// partial tile, and row counts covering every row tile.
    #[test]
    fn dense_kernels_match_the_reference_at_any_width() {
        for (n, k) in [(7, 101), (5, 16), (9, 3), (6, 40)] {
            for rows in [1, 2, 3, 4, 5, 7, 9] {
                let x = random(rows * k, 17 + rows as u64);
                for dtype in DENSE_FORMATS {
                    let (w, dense) = weight(dtype, n, k);
                    for kernel in Kernel::available() {
                        let got = w.matmul_with(kernel, &x, rows);
                        for r in 0..rows {
                            for c in 0..n {
                                let want: f64 = (0..k)
                                    .map(|i| x[r * k + i] as f64 * dense[c * k + i] as f64)
                                    .sum();
                                let diff = (got[r * n + c] as f64 - want).abs();
                                assert!(
                                    diff < 1e-5,
                                    "{dtype:?} {kernel:?} k={k} rows={rows} ({r},{c}): {} vs {want}",
                                    got[r * n + c]
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// 16-bit targets round each weight once (to nearest) and keep them 16-bit.
    #[test]
    fn sixteen_bit_targets_round_to_the_nearest_value_and_halve_the_bytes() {
        let (w, dense) = weight(GgmlDType::F32, 4, 64);
        let f32_bytes = w.stored_bytes();
        for (precision, dtype, step) in [
            (WeightPrecision::F16, GgmlDType::F16, 2f32.powi(-11)),
            (WeightPrecision::Bf16, GgmlDType::BF16, 2f32.powi(-8)),
        ] {
            let (w, _) = weight(GgmlDType::F32, 4, 64);
            let q = w.requantize("w", precision).unwrap();
            assert_eq!(q.dtype(), dtype);
            assert_eq!(q.stored_bytes() * 2, f32_bytes);
            for (a, b) in q.dequantize().iter().zip(&dense) {
                assert!(
                    (a - b).abs() <= b.abs() * step + 1e-7,
                    "{dtype:?}: {a} vs {b}"
                );
            }
        }
    }

    /// Every format with integer kernels.
    pub(crate) const INT8_FORMATS: [GgmlDType; 8] = [
        GgmlDType::Q8_0,
        GgmlDType::Q4_0,
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q5_1,
        GgmlDType::Q4K,
        GgmlDType::Q5K,
        GgmlDType::Q6K,
    ];

    /// The GPU uploads the quants (and fifth bits) in the order of ggml's blocks of 32,
    /// rebuilt from the grouped layout (K-quant files hold superblocks: their unpacking is
    /// checked against candle's dequantization below).
    #[test]
    fn block_quants_are_the_files_quant_bytes() {
        for dtype in INT8_FORMATS.into_iter().filter(|d| d.block_size() == 32) {
            for (n, k) in [(3, 928), (2, 96)] {
                let dense = Tensor::from_vec(random(n * k, 9), (n, k), &Device::Cpu).unwrap();
                let q = QTensor::quantize(&dense, dtype).unwrap();
                let file = q.data().unwrap();
                let format = Int8Format::of(dtype).unwrap();
                let header = format.file_block_bytes() - format.quant_bytes();
                let blocks = file.chunks_exact(format.file_block_bytes());
                let want: Vec<u8> = blocks
                    .clone()
                    .flat_map(|block| block[header..].to_vec())
                    .collect();
                let w = QWeight::from_qtensor("w", &q).unwrap();
                let packed = w.packed_int8().unwrap();
                assert_eq!(packed.block_quants(), want, "{dtype:?} k={k}");
                let want_high: Vec<u32> = match format.has_high_bits() {
                    true => blocks
                        .map(|b| u32::from_le_bytes(b[header - 4..header].try_into().unwrap()))
                        .collect(),
                    false => Vec::new(),
                };
                assert_eq!(packed.block_high_bits(), want_high, "{dtype:?} k={k}");
            }
        }
    }

    /// What the GPU kernels read (`kernels/quant.cu`: block quants, fifth bits, per-block
    /// scales and offsets, Q6_K's per-half scales) rebuilds every weight as the CPU's
    /// dequantization has it, for each integer format, read the way each kernel reads it.
    #[test]
    fn the_gpu_upload_arrays_rebuild_every_weight() {
        for dtype in INT8_FORMATS {
            let (n, k) = (3, 512);
            let dense = Tensor::from_vec(random(n * k, 21), (n, k), &Device::Cpu).unwrap();
            let q = QTensor::quantize(&dense, dtype).unwrap();
            let w = QWeight::from_qtensor("w", &q).unwrap();
            let packed = w.packed_int8().unwrap();
            let format = packed.format();
            let quants = packed.block_quants();
            let high = packed.block_high_bits();
            let per_block: Vec<[f32; 3]> = match format.has_split_scales() {
                true => {
                    let [first, second] = packed.half_block_scales();
                    first
                        .iter()
                        .zip(&second)
                        .map(|(&a, &b)| [a, b, 0.0])
                        .collect()
                }
                false => {
                    let (scales, offsets) = packed.scales_and_offsets();
                    scales
                        .iter()
                        .zip(&offsets)
                        .map(|(&s, &o)| [s, s, o])
                        .collect()
                }
            };
            let rebuilt: Vec<f32> = (0..n * k / 32)
                .flat_map(|b| {
                    let [first, second, offset] = per_block[b];
                    let (quants, high, signed) = (&quants, &high, format.has_signed_bytes());
                    (0..32).map(move |e| {
                        let q = match signed {
                            true => quants[b * 32 + e] as i8 as i32,
                            false => {
                                let byte = quants[b * 16 + e % 16];
                                let nibble = if e < 16 { byte & 0x0F } else { byte >> 4 };
                                let fifth = high.get(b).map_or(0, |h| (h >> e & 1) << 4);
                                (nibble as u32 | fifth) as i32
                            }
                        };
                        let scale = if e < 16 { first } else { second };
                        scale * q as f32 + offset
                    })
                })
                .collect();
            assert_eq!(rebuilt, w.dequantize(), "{dtype:?}");
        }
    }

    /// The repacking keeps every weight: our dequantization is candle's, up to the rounding
    /// of `scale · q + offset` against candle's `scale · (q − bias)`.
    #[test]
    fn repacked_weights_dequantize_like_candle() {
        for dtype in INT8_FORMATS {
            let (n, k) = (5, 768);
            let dense = Tensor::from_vec(random(n * k, 13), (n, k), &Device::Cpu).unwrap();
            let q = QTensor::quantize(&dense, dtype).unwrap();
            let want: Vec<f32> = q
                .dequantize(&Device::Cpu)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let got = QWeight::from_qtensor("w", &q).unwrap().dequantize();
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-6 * b.abs().max(1.0),
                    "{dtype:?} [{i}]: {a} vs {b}"
                );
            }
        }
    }

    #[test]
    fn rows_do_not_depend_on_batch_mates_or_threads() {
        // 13 rows run the two-column tiles, 37 the unpacked columns (VNNI).
        for rows in [13, 37] {
            rows_alone_and_batched_agree(rows);
        }
    }

    fn rows_alone_and_batched_agree(rows: usize) {
        let n = 70;
        let pool = crate::engine::pool::StepPool::new(2, "test").unwrap();
        for (dtype, k) in [
            (GgmlDType::F32, 128),
            (GgmlDType::F16, 101),
            (GgmlDType::BF16, 576),
            (GgmlDType::Q8_0, 128),
            (GgmlDType::Q8_0, 928),
            (GgmlDType::Q4_0, 128),
            (GgmlDType::Q4_1, 128),
            (GgmlDType::Q4_1, 928),
            (GgmlDType::Q5_0, 928),
            (GgmlDType::Q5_1, 96),
            (GgmlDType::Q4K, 256),
            (GgmlDType::Q5K, 768),
            (GgmlDType::Q6K, 256),
        ] {
            let x = &random(rows * k, 11);
            let (w, _) = weight(dtype, n, k);
            for kernel in Kernel::available() {
                let batched = w.matmul_with(kernel, x, rows);
                let pooled = pool.enter(|| w.matmul_with(kernel, x, rows));
                assert_eq!(
                    batched, pooled,
                    "{dtype:?} {kernel:?}: threads changed results"
                );
                for r in 0..rows {
                    let alone = w.matmul_with(kernel, &x[r * k..(r + 1) * k], 1);
                    assert_eq!(
                        &batched[r * n..(r + 1) * n],
                        &alone[..],
                        "{dtype:?} {kernel:?} row {r}"
                    );
                }
            }
        }
    }

    #[test]
    fn k_quant_targets_fall_back_where_superblocks_do_not_divide_the_rows() {
        for (precision, k, want) in [
            (WeightPrecision::Q4K, 512, GgmlDType::Q4K),
            (WeightPrecision::Q4K, 576, GgmlDType::Q5_0),
            (WeightPrecision::Q5K, 576, GgmlDType::Q5_1),
            (WeightPrecision::Q6K, 576, GgmlDType::Q8_0),
            (WeightPrecision::Q6K, 256, GgmlDType::Q6K),
        ] {
            let (w, _) = weight(GgmlDType::F32, 4, k);
            let q = w.requantize("w", precision).unwrap();
            assert_eq!(q.dtype(), want, "{precision:?} at k = {k}");
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

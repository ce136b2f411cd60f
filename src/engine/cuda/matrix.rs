//! Weight matrices on the GPU. The CPU's integer-kernel formats (Q8_0, Q4_0, Q4_1, Q5_0,
//! Q5_1, Q4_K, Q5_K, Q6_K) stay in blocks of 32 (the CPU path's repacking: quants per output
//! column, f32 scales and offsets beside them; a K-quant block's are d · sc and −dmin · m, a
//! Q6_K block's a d · sc per half)
//! and run through the integer-dot kernels on 8-bit activations quantized by the CPU's rule
//! for each format (`ActivationFormat`); bf16 matrices
//! stay bf16 and run cuBLAS's tensor-core GEMM on activations rounded to bf16 (f32 sums and
//! output); every other format is dequantized to f32 at load and multiplied by cuBLAS sgemm.
//! Matrices that share an input (q/k/v, gate/up) form one `Projection`: stacked into one
//! matrix where they are stored alike, their outputs side by side in each row.

use super::gpu_error;
use super::launch::Gpu;
use crate::engine::qmatmul::{ActivationFormat, Int8Format, QWeight};
use crate::error::{EngineError, EngineResult};
use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t,
};
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{
    CudaSlice, CudaViewMut, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};

const BLOCK: usize = 32;

enum Weights {
    Q8_0 {
        quants: CudaSlice<i8>,
        scales: CudaSlice<f32>,
    },
    /// Signed bytes with a scale per half block of 16.
    Q6K {
        quants: CudaSlice<i8>,
        first: CudaSlice<f32>,
        second: CudaSlice<f32>,
    },
    /// The nibble formats; Q5_0, Q5_1 and Q5_K with their fifth bits (`high`).
    Q4 {
        quants: CudaSlice<u8>,
        high: Option<CudaSlice<u32>>,
        scales: CudaSlice<f32>,
        offsets: CudaSlice<f32>,
    },
    /// Row-major `[n_out, k_in]`.
    Dense(CudaSlice<f32>),
    /// Row-major `[n_out, k_in]` bf16 bits.
    Bf16(CudaSlice<u16>),
}

/// A matrix's input format: its activation quantization, and whether it takes bf16.
type InputKind = (Option<ActivationFormat>, bool);

/// A `[n_out, k_in]` weight matrix on the device.
pub struct DeviceMatrix {
    n_out: usize,
    k_in: usize,
    weights: Weights,
    /// How the integer kernels' activations are quantized; `None` for dense weights.
    activations: Option<ActivationFormat>,
}

/// Activation rows quantized on the device (see `kernels/quant.cu`), `[rows, k / 32]` blocks.
struct QuantizedActivations {
    quants: CudaSlice<i8>,
    scales: CudaSlice<f32>,
    scaled_sums: CudaSlice<f32>,
}

/// A step's scratch for matrix inputs, allocated once per step shape (a captured graph keeps
/// its own): the 8-bit activations in each format the model's integer matrices take, and
/// bf16 activations for its bf16 matrices, each for up to `rows × k_max` inputs.
pub struct ActivationScratch {
    quantized: Vec<(ActivationFormat, QuantizedActivations)>,
    bf16: Option<CudaSlice<u16>>,
}

impl ActivationScratch {
    pub fn new<'m>(
        gpu: &Gpu,
        matrices: impl IntoIterator<Item = &'m DeviceMatrix>,
        rows: usize,
        k_max: usize,
    ) -> EngineResult<Self> {
        let (mut formats, mut bf16) = (Vec::new(), false);
        for m in matrices {
            if let Some(format) = m.activations.filter(|f| !formats.contains(f)) {
                formats.push(format);
            }
            bf16 |= matches!(m.weights, Weights::Bf16(_));
        }
        let inputs = rows * k_max;
        let quantized = formats
            .into_iter()
            .map(|format| {
                let buffers = QuantizedActivations {
                    quants: gpu.zeros::<i8>(inputs)?,
                    scales: gpu.zeros::<f32>(inputs / BLOCK)?,
                    scaled_sums: gpu.zeros::<f32>(inputs / BLOCK)?,
                };
                Ok((format, buffers))
            })
            .collect::<EngineResult<_>>()?;
        let bf16 = bf16.then(|| gpu.zeros::<u16>(inputs)).transpose()?;
        Ok(Self { quantized, bf16 })
    }

    fn quantized(&self, format: Option<ActivationFormat>) -> Option<&QuantizedActivations> {
        self.quantized
            .iter()
            .find(|(f, _)| Some(*f) == format)
            .map(|(_, q)| q)
    }
}

/// A weight matrix's arrays on the host, as its kernel reads them: stacking matrices stored
/// alike appends each array (each output column's data is contiguous in every one).
#[derive(Debug, PartialEq)]
enum HostWeights {
    Q8_0 {
        quants: Vec<i8>,
        scales: Vec<f32>,
    },
    Q6K {
        quants: Vec<i8>,
        first: Vec<f32>,
        second: Vec<f32>,
    },
    Q4 {
        quants: Vec<u8>,
        high: Option<Vec<u32>>,
        scales: Vec<f32>,
        offsets: Vec<f32>,
    },
    Dense(Vec<f32>),
    Bf16(Vec<u16>),
}

/// How a matrix is stored on the device: matrices stored alike stack into one.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Storage {
    Int8(Int8Format),
    Bf16,
    Dense,
}

fn storage(weight: &QWeight) -> Storage {
    match (weight.packed_int8(), weight.is_bf16()) {
        (Some(packed), _) => Storage::Int8(packed.format()),
        (None, true) => Storage::Bf16,
        (None, false) => Storage::Dense,
    }
}

impl HostWeights {
    fn of(weight: &QWeight) -> Self {
        let Some(packed) = weight.packed_int8() else {
            return match weight.bf16_bits() {
                Some(bits) => Self::Bf16(bits),
                None => Self::Dense(weight.dequantize()),
            };
        };
        let signed = || -> Vec<i8> { packed.block_quants().iter().map(|&b| b as i8).collect() };
        match packed.format() {
            Int8Format::Q6K => {
                let [first, second] = packed.half_block_scales();
                Self::Q6K {
                    quants: signed(),
                    first,
                    second,
                }
            }
            Int8Format::Q8_0 => Self::Q8_0 {
                quants: signed(),
                scales: packed.scales_and_offsets().0,
            },
            format => {
                let (scales, offsets) = packed.scales_and_offsets();
                Self::Q4 {
                    quants: packed.block_quants(),
                    high: format.has_high_bits().then(|| packed.block_high_bits()),
                    scales,
                    offsets,
                }
            }
        }
    }

    /// Appends `other`'s output columns (a matrix stored alike).
    fn stack(&mut self, other: Self) {
        match (self, other) {
            (
                Self::Q8_0 { quants, scales },
                Self::Q8_0 {
                    quants: q,
                    scales: s,
                },
            ) => {
                quants.extend(q);
                scales.extend(s);
            }
            (
                Self::Q6K {
                    quants,
                    first,
                    second,
                },
                Self::Q6K {
                    quants: q,
                    first: f,
                    second: s,
                },
            ) => {
                quants.extend(q);
                first.extend(f);
                second.extend(s);
            }
            (
                Self::Q4 {
                    quants,
                    high,
                    scales,
                    offsets,
                },
                Self::Q4 {
                    quants: q,
                    high: h,
                    scales: s,
                    offsets: o,
                },
            ) => {
                quants.extend(q);
                if let (Some(high), Some(h)) = (high.as_mut(), h) {
                    high.extend(h);
                }
                scales.extend(s);
                offsets.extend(o);
            }
            (Self::Dense(w), Self::Dense(o)) => w.extend(o),
            (Self::Bf16(w), Self::Bf16(o)) => w.extend(o),
            _ => unreachable!("only matrices stored alike are stacked"),
        }
    }

    fn upload(self, gpu: &Gpu) -> EngineResult<Weights> {
        Ok(match self {
            Self::Q8_0 { quants, scales } => Weights::Q8_0 {
                quants: gpu.upload(&quants)?,
                scales: gpu.upload(&scales)?,
            },
            Self::Q6K {
                quants,
                first,
                second,
            } => Weights::Q6K {
                quants: gpu.upload(&quants)?,
                first: gpu.upload(&first)?,
                second: gpu.upload(&second)?,
            },
            Self::Q4 {
                quants,
                high,
                scales,
                offsets,
            } => Weights::Q4 {
                quants: gpu.upload(&quants)?,
                high: high.map(|h| gpu.upload(&h)).transpose()?,
                scales: gpu.upload(&scales)?,
                offsets: gpu.upload(&offsets)?,
            },
            Self::Dense(w) => Weights::Dense(gpu.upload(&w)?),
            Self::Bf16(w) => Weights::Bf16(gpu.upload(&w)?),
        })
    }
}

/// One or more weight matrices applied to one input, their outputs side by side in each row
/// of `[rows, n_out]` (q/k/v; gate/up; or a single matrix). Consecutive matrices stored alike
/// are stacked into one, so the projection runs as few matmuls as its storage allows.
pub struct Projection {
    /// Each stacked part and its first output column.
    parts: Vec<(DeviceMatrix, usize)>,
    n_out: usize,
}

impl Projection {
    pub fn upload(gpu: &Gpu, weights: &[&QWeight]) -> EngineResult<Self> {
        let mut groups: Vec<(Storage, Vec<&QWeight>)> = Vec::new();
        for &w in weights {
            match groups.last_mut() {
                Some((kind, group)) if *kind == storage(w) => group.push(w),
                _ => groups.push((storage(w), vec![w])),
            }
        }
        let mut parts = Vec::with_capacity(groups.len());
        let mut n_out = 0;
        for (_, group) in groups {
            let mut host = HostWeights::of(group[0]);
            for w in &group[1..] {
                host.stack(HostWeights::of(w));
            }
            let matrix = DeviceMatrix {
                n_out: group.iter().map(|w| w.n_out()).sum(),
                k_in: group[0].k_in(),
                activations: group[0]
                    .packed_int8()
                    .map(|p| p.format().activation_format()),
                weights: host.upload(gpu)?,
            };
            let width = matrix.n_out;
            parts.push((matrix, n_out));
            n_out += width;
        }
        Ok(Self { parts, n_out })
    }

    pub fn n_out(&self) -> usize {
        self.n_out
    }

    /// Matmuls one application launches.
    pub fn matrices(&self) -> impl Iterator<Item = &DeviceMatrix> {
        self.parts.iter().map(|(m, _)| m)
    }

    /// Multiplied by cuBLAS on unquantized activations.
    pub fn has_dense(&self) -> bool {
        self.matrices().any(DeviceMatrix::is_dense)
    }

    /// `out [rows, n_out] (+)= input [rows, k_in] × Wᵀ`, adding where `accumulate` (an output
    /// projection adding into the residual stream). The input is formed and quantized (or
    /// rounded to bf16) once per format; where every part takes one 8-bit format, by one kernel
    /// that forms and quantizes it.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(
        &self,
        gpu: &Gpu,
        blas: Option<&CudaBlas>,
        mut input: Activations,
        rows: usize,
        scratch: &mut ActivationScratch,
        out: &mut CudaSlice<f32>,
        accumulate: bool,
    ) -> EngineResult<()> {
        let first = &self.parts[0].0;
        let fused = self
            .matrices()
            .all(|m| m.input_kind() == (first.activations, false))
            .then_some(first.activations)
            .flatten();
        let x = match fused {
            Some(format) => {
                scratch.quantize(gpu, &mut input, rows, first.k_in, format)?;
                None
            }
            None => {
                let x = input.materialize(gpu, first.k_in)?;
                let mut prepared: Vec<InputKind> = Vec::new();
                for m in self.matrices() {
                    if !prepared.contains(&m.input_kind()) {
                        prepared.push(m.input_kind());
                        m.prepare(gpu, x, rows, scratch)?;
                    }
                }
                Some(x)
            }
        };
        for (m, first_column) in &self.parts {
            let mut columns = out.slice_mut(*first_column..);
            let target = OutputColumns {
                out: &mut columns,
                stride: self.n_out,
                accumulate,
            };
            m.apply(gpu, blas, x, scratch, rows, target)?;
        }
        Ok(())
    }
}

/// Where a matrix's outputs go: its columns of rows `stride` apart, written or added to.
struct OutputColumns<'a, 'b> {
    out: &'a mut CudaViewMut<'b, f32>,
    stride: usize,
    accumulate: bool,
}

impl DeviceMatrix {
    fn is_dense(&self) -> bool {
        matches!(self.weights, Weights::Dense(_) | Weights::Bf16(_))
    }

    /// What this matrix multiplies: activations quantized in a format, or rounded to bf16, or
    /// f32 as they are.
    fn input_kind(&self) -> InputKind {
        (self.activations, matches!(self.weights, Weights::Bf16(_)))
    }

    /// Quantizes or rounds `x` as this matrix takes it, into `scratch`.
    fn prepare(
        &self,
        gpu: &Gpu,
        x: &CudaSlice<f32>,
        rows: usize,
        scratch: &mut ActivationScratch,
    ) -> EngineResult<()> {
        if let Some(format) = self.activations {
            scratch.quantize(gpu, &mut Activations::Plain(x), rows, self.k_in, format)?;
        }
        if matches!(self.weights, Weights::Bf16(_)) {
            let bf16 = scratch.bf16.as_mut().ok_or_else(missing_scratch)?;
            gpu.to_bf16(x, rows * self.k_in, bf16)?;
        }
        Ok(())
    }

    /// `target (+)= x × Wᵀ` on the inputs left in `scratch` (`x`, the f32 input, for dense
    /// weights).
    fn apply(
        &self,
        gpu: &Gpu,
        blas: Option<&CudaBlas>,
        x: Option<&CudaSlice<f32>>,
        scratch: &ActivationScratch,
        rows: usize,
        target: OutputColumns,
    ) -> EngineResult<()> {
        let (n_out, blocks) = (self.n_out as i32, (self.k_in / BLOCK) as i32);
        let (stride, accumulate) = (target.stride as i32, target.accumulate as i32);
        let out = target.out;
        let config = Gpu::warps(self.n_out, rows);
        let quantized = || {
            scratch
                .quantized(self.activations)
                .ok_or_else(missing_scratch)
        };
        match &self.weights {
            Weights::Q8_0 { quants, scales } => {
                let x = quantized()?;
                let mut launch = gpu.stream.launch_builder(&gpu.kernels.qmatmul_q8_0);
                launch
                    .arg(quants)
                    .arg(scales)
                    .arg(&x.quants)
                    .arg(&x.scales)
                    .arg(&mut *out)
                    .arg(&n_out)
                    .arg(&blocks)
                    .arg(&stride)
                    .arg(&accumulate);
                // SAFETY: quants hold n_out · k_in bytes, x holds rows · k_in quants.
                unsafe { gpu.launch(launch, config) }
            }
            Weights::Q6K {
                quants,
                first,
                second,
            } => {
                let x = quantized()?;
                let mut launch = gpu.stream.launch_builder(&gpu.kernels.qmatmul_q6_k);
                launch
                    .arg(quants)
                    .arg(first)
                    .arg(second)
                    .arg(&x.quants)
                    .arg(&x.scales)
                    .arg(&mut *out)
                    .arg(&n_out)
                    .arg(&blocks)
                    .arg(&stride)
                    .arg(&accumulate);
                // SAFETY: quants hold n_out · k_in bytes and each half's scales one f32 per
                // block, x holds rows · k_in quants.
                unsafe { gpu.launch(launch, config) }
            }
            Weights::Q4 {
                quants,
                high,
                scales,
                offsets,
            } => {
                let x = quantized()?;
                let mut launch = match high {
                    Some(high) => {
                        let mut launch = gpu.stream.launch_builder(&gpu.kernels.qmatmul_q5);
                        launch.arg(quants).arg(high);
                        launch
                    }
                    None => {
                        let mut launch = gpu.stream.launch_builder(&gpu.kernels.qmatmul_q4);
                        launch.arg(quants);
                        launch
                    }
                };
                launch
                    .arg(scales)
                    .arg(offsets)
                    .arg(&x.quants)
                    .arg(&x.scales)
                    .arg(&x.scaled_sums)
                    .arg(&mut *out)
                    .arg(&n_out)
                    .arg(&blocks)
                    .arg(&stride)
                    .arg(&accumulate);
                // SAFETY: quants hold n_out · k_in / 2 bytes (and high one u32 per block), x
                // holds rows · k_in quants.
                unsafe { gpu.launch(launch, config) }
            }
            Weights::Dense(w) => {
                let blas = blas.ok_or_else(|| missing_blas("dense"))?;
                let x = x.ok_or_else(missing_scratch)?;
                // Column-major view: C[n_out, rows] = Wᵀ[n_out, k] · X[k, rows].
                let gemm = GemmConfig {
                    transa: cublasOperation_t::CUBLAS_OP_T,
                    transb: cublasOperation_t::CUBLAS_OP_N,
                    m: self.n_out as i32,
                    n: rows as i32,
                    k: self.k_in as i32,
                    alpha: 1.0f32,
                    lda: self.k_in as i32,
                    ldb: self.k_in as i32,
                    beta: if target.accumulate { 1.0 } else { 0.0 },
                    ldc: target.stride as i32,
                };
                gpu.count_launches(1);
                // SAFETY: the shapes above match the buffers' lengths; the output's rows are
                // `stride` apart, its columns within them.
                unsafe { blas.gemm(gemm, w, x, out) }.map_err(gpu_error)
            }
            Weights::Bf16(w) => {
                let blas = blas.ok_or_else(|| missing_blas("bf16"))?;
                let x16 = scratch.bf16.as_ref().ok_or_else(missing_scratch)?;
                let alpha = 1.0f32;
                let beta = if target.accumulate { 1.0f32 } else { 0.0 };
                let (w_ptr, _w_record) = w.device_ptr(&gpu.stream);
                let (x_ptr, _x_record) = x16.device_ptr(&gpu.stream);
                let (out_ptr, _out_record) = out.device_ptr_mut(&gpu.stream);
                gpu.count_launches(1);
                // The column-major view of the f32 path; bf16 inputs, f32 output and sums.
                // SAFETY: w holds n_out · k_in and x16 at least rows · k_in bf16 values, out
                // rows · n_out floats; alpha and beta outlive the call, which only enqueues work.
                unsafe {
                    cudarc::cublas::result::gemm_ex(
                        *blas.handle(),
                        cublasOperation_t::CUBLAS_OP_T,
                        cublasOperation_t::CUBLAS_OP_N,
                        self.n_out as i32,
                        rows as i32,
                        self.k_in as i32,
                        &alpha as *const f32 as *const _,
                        w_ptr as *const _,
                        cudaDataType_t::CUDA_R_16BF,
                        self.k_in as i32,
                        x_ptr as *const _,
                        cudaDataType_t::CUDA_R_16BF,
                        self.k_in as i32,
                        &beta as *const f32 as *const _,
                        out_ptr as *mut _,
                        cudaDataType_t::CUDA_R_32F,
                        target.stride as i32,
                        cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    )
                }
                .map_err(gpu_error)
            }
        }
    }
}

fn missing_blas(format: &str) -> EngineError {
    EngineError::Gpu(format!(
        "{format} weights need cuBLAS, which was not loaded"
    ))
}

fn missing_scratch() -> EngineError {
    EngineError::Gpu("the step's activation scratch lacks this matrix's input format".into())
}

/// A matrix input as the kernels before the matmul leave it, formed by the kernel that
/// quantizes it where the matrices take 8-bit activations, else materialized in f32 first.
pub enum Activations<'a> {
    Plain(&'a CudaSlice<f32>),
    /// `x` RMS-normed by `weight`, into `normed` where materialized or where `keep`.
    Normed {
        x: &'a CudaSlice<f32>,
        weight: &'a CudaSlice<f32>,
        eps: f32,
        normed: &'a mut CudaSlice<f32>,
        keep: bool,
    },
    /// A gated MLP's `act(gate) · up` from the stacked gate/up rows (SiLU, or Gemma's GELU;
    /// into `out` where materialized).
    Gated {
        gate_up: &'a CudaSlice<f32>,
        gelu: bool,
        out: &'a mut CudaSlice<f32>,
    },
}

impl<'a> Activations<'a> {
    /// The input `[rows, k_in]` in f32, computed by its own kernel where it is not a buffer
    /// yet.
    fn materialize(self, gpu: &Gpu, k_in: usize) -> EngineResult<&'a CudaSlice<f32>> {
        match self {
            Self::Plain(x) => Ok(x),
            Self::Normed {
                x,
                weight,
                eps,
                normed,
                ..
            } => {
                gpu.rms_norm(x, weight, eps, normed)?;
                Ok(normed)
            }
            Self::Gated { gate_up, gelu, out } => {
                gpu.gated(gate_up, k_in, gelu, out)?;
                Ok(out)
            }
        }
    }
}

impl ActivationScratch {
    /// Forms `input [rows, k_in]` and quantizes it in `format` into this scratch's buffers of
    /// that format, in one kernel.
    fn quantize(
        &mut self,
        gpu: &Gpu,
        input: &mut Activations,
        rows: usize,
        k_in: usize,
        format: ActivationFormat,
    ) -> EngineResult<()> {
        let blocks = rows * k_in / BLOCK;
        // The kernel's numbering (`kernels/quant.cu`) and its unit: a block, or a superblock.
        let (format_arg, units) = match format {
            ActivationFormat::Q8_0 => (0i32, blocks),
            ActivationFormat::Q8_1 => (1, blocks),
            ActivationFormat::Q8K => (2, blocks / 8),
        };
        let out = self
            .quantized
            .iter_mut()
            .find(|(f, _)| *f == format)
            .map(|(_, q)| q)
            .ok_or_else(missing_scratch)?;
        // SOURCE_PLAIN, SOURCE_SILU, SOURCE_GELU in `kernels/quant.cu`.
        let (x, source) = match input {
            Activations::Normed {
                x,
                weight,
                eps,
                normed,
                keep,
            } => {
                let (dim, keep) = (k_in as i32, *keep as i32);
                let mut launch = gpu.stream.launch_builder(&gpu.kernels.rms_norm_quantize_q8);
                launch
                    .arg(*x)
                    .arg(*weight)
                    .arg(&*eps)
                    .arg(&dim)
                    .arg(&mut out.quants)
                    .arg(&mut out.scales)
                    .arg(&mut out.scaled_sums)
                    .arg(&format_arg)
                    .arg(&mut **normed)
                    .arg(&keep);
                let config = LaunchConfig {
                    grid_dim: (rows as u32, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: x (and normed) hold rows · k_in floats, weight k_in, the scratch at
                // least as many quants and a scale per block; 256 threads per row, as
                // `rms_norm`'s.
                return unsafe { gpu.launch(launch, config) };
            }
            Activations::Plain(x) => (&**x, 0i32),
            Activations::Gated { gate_up, gelu, .. } => (&**gate_up, 1 + *gelu as i32),
        };
        let (units_arg, dim) = (units as i32, k_in as i32);
        let mut launch = gpu.stream.launch_builder(&gpu.kernels.quantize_q8);
        launch
            .arg(x)
            .arg(&mut out.quants)
            .arg(&mut out.scales)
            .arg(&mut out.scaled_sums)
            .arg(&units_arg)
            .arg(&format_arg)
            .arg(&source)
            .arg(&dim);
        // SAFETY: the activations are `blocks` whole blocks of 32 (K-quant rows are whole
        // superblocks; gated ones read rows of 2 · k_in), the scratch holds at least as many.
        unsafe { gpu.launch(launch, Gpu::warps(units, 1)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::qmatmul::tests::{DENSE_FORMATS, INT8_FORMATS};
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};

    fn weight(rows: &[f32], n: usize, k: usize, dtype: GgmlDType) -> QWeight {
        let dense = Tensor::from_vec(rows.to_vec(), (n, k), &Device::Cpu).unwrap();
        QWeight::from_qtensor("w", &QTensor::quantize(&dense, dtype).unwrap()).unwrap()
    }

    /// Stacking q/k/v (or gate/up) on the host gives the arrays of the matrix their rows make
    /// together: every format quantizes each output column on its own.
    #[test]
    fn stacked_arrays_are_the_arrays_of_the_stacked_matrix() {
        let k = 256;
        let values: Vec<f32> = (0..5 * k)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * (1.0 + (i % 13) as f32))
            .collect();
        let (first, second) = values.split_at(3 * k);
        for dtype in INT8_FORMATS.into_iter().chain(DENSE_FORMATS) {
            let (a, b) = (weight(first, 3, k, dtype), weight(second, 2, k, dtype));
            assert!(storage(&a) == storage(&b), "{dtype:?}");
            let mut stacked = HostWeights::of(&a);
            stacked.stack(HostWeights::of(&b));
            let together = HostWeights::of(&weight(&values, 5, k, dtype));
            assert_eq!(stacked, together, "{dtype:?}");
        }
    }

    #[test]
    fn matrices_stored_differently_are_not_stacked() {
        let k = 64;
        let values = vec![0.5f32; 2 * k];
        let q8 = weight(&values, 2, k, GgmlDType::Q8_0);
        let q4 = weight(&values, 2, k, GgmlDType::Q4_1);
        let f16 = weight(&values, 2, k, GgmlDType::F16);
        assert!(storage(&q8) != storage(&q4));
        assert!(storage(&q8) != storage(&f16));
        assert!(storage(&q4) == storage(&weight(&values, 2, k, GgmlDType::Q4_1)));
    }
}

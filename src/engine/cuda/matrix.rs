//! Weight matrices on the GPU. The CPU's integer-kernel formats (Q8_0, Q4_0, Q4_1, Q5_0,
//! Q5_1, Q4_K, Q5_K, Q6_K) stay in blocks of 32 (the CPU path's repacking: quants per output
//! column, f32 scales and offsets beside them; a K-quant block's are d · sc and −dmin · m, a
//! Q6_K block's a d · sc per half)
//! and run through the integer-dot kernels on 8-bit activations quantized by the CPU's rule
//! for each format (`ActivationFormat`); bf16 matrices
//! stay bf16 and run cuBLAS's tensor-core GEMM on activations rounded to bf16 (f32 sums and
//! output); every other format is dequantized to f32 at load and multiplied by cuBLAS sgemm.

use super::gpu_error;
use super::launch::Gpu;
use crate::engine::qmatmul::{ActivationFormat, Int8Format, QWeight};
use crate::error::{EngineError, EngineResult};
use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t,
};
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

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

impl DeviceMatrix {
    pub fn upload(gpu: &Gpu, weight: &QWeight) -> EngineResult<Self> {
        let integer = weight.packed_int8();
        let activations = integer.map(|p| p.format().activation_format());
        let weights = match integer {
            Some(packed) => {
                let signed =
                    || -> Vec<i8> { packed.block_quants().iter().map(|&b| b as i8).collect() };
                match packed.format() {
                    Int8Format::Q6K => {
                        let [first, second] = packed.half_block_scales();
                        Weights::Q6K {
                            quants: gpu.upload(&signed())?,
                            first: gpu.upload(&first)?,
                            second: gpu.upload(&second)?,
                        }
                    }
                    Int8Format::Q8_0 => Weights::Q8_0 {
                        quants: gpu.upload(&signed())?,
                        scales: gpu.upload(&packed.scales_and_offsets().0)?,
                    },
                    format => {
                        let (scales, offsets) = packed.scales_and_offsets();
                        Weights::Q4 {
                            quants: gpu.upload(&packed.block_quants())?,
                            high: match format.has_high_bits() {
                                true => Some(gpu.upload(&packed.block_high_bits())?),
                                false => None,
                            },
                            scales: gpu.upload(&scales)?,
                            offsets: gpu.upload(&offsets)?,
                        }
                    }
                }
            }
            None => match weight.bf16_bits() {
                Some(bits) => Weights::Bf16(gpu.upload(&bits)?),
                None => Weights::Dense(gpu.upload(&weight.dequantize())?),
            },
        };
        Ok(Self {
            n_out: weight.n_out(),
            k_in: weight.k_in(),
            weights,
            activations,
        })
    }

    /// Multiplied by cuBLAS on unquantized activations.
    pub fn is_dense(&self) -> bool {
        matches!(self.weights, Weights::Dense(_) | Weights::Bf16(_))
    }

    /// `input [rows, k_in]` × Wᵢᵀ into each `outᵢ [rows, n_outᵢ]`, for matrices sharing one
    /// input (q/k/v; gate/up): the input is formed and quantized (or rounded to bf16) once per
    /// format; where every matrix takes one 8-bit format, by one kernel that forms and
    /// quantizes it.
    pub fn matmul_each<const N: usize>(
        gpu: &Gpu,
        blas: Option<&CudaBlas>,
        products: [(&Self, &mut CudaSlice<f32>); N],
        input: Activations,
        rows: usize,
        scratch: &mut ActivationScratch,
    ) -> EngineResult<()> {
        let first = products[0].0;
        let fused = products
            .iter()
            .all(|(m, _)| m.input_kind() == (first.activations, false))
            .then_some(first.activations)
            .flatten();
        let x = match fused {
            Some(format) => {
                scratch.quantize(gpu, &input, rows, first.k_in, format)?;
                None
            }
            None => {
                let x = input.materialize(gpu)?;
                let mut prepared: Vec<InputKind> = Vec::new();
                for (m, _) in &products {
                    if !prepared.contains(&m.input_kind()) {
                        prepared.push(m.input_kind());
                        m.prepare(gpu, x, rows, scratch)?;
                    }
                }
                Some(x)
            }
        };
        for (m, out) in products {
            m.apply(gpu, blas, x, scratch, rows, out, false)?;
        }
        Ok(())
    }

    /// `out += input × Wᵀ`: a projection that ends in the residual stream, the add folded
    /// into the product.
    pub fn matmul_add(
        &self,
        gpu: &Gpu,
        blas: Option<&CudaBlas>,
        input: Activations,
        rows: usize,
        scratch: &mut ActivationScratch,
        out: &mut CudaSlice<f32>,
    ) -> EngineResult<()> {
        let x = match (self.activations, self.input_kind()) {
            (Some(format), (_, false)) => {
                scratch.quantize(gpu, &input, rows, self.k_in, format)?;
                None
            }
            _ => {
                let x = input.materialize(gpu)?;
                self.prepare(gpu, x, rows, scratch)?;
                Some(x)
            }
        };
        self.apply(gpu, blas, x, scratch, rows, out, true)
    }

    /// `out = input × Wᵀ`.
    pub fn matmul(
        &self,
        gpu: &Gpu,
        blas: Option<&CudaBlas>,
        input: Activations,
        rows: usize,
        scratch: &mut ActivationScratch,
        out: &mut CudaSlice<f32>,
    ) -> EngineResult<()> {
        Self::matmul_each(gpu, blas, [(self, out)], input, rows, scratch)
    }

    /// What this matrix multiplies: activations quantized in a format, or rounded to bf16, or
    /// f32 as they are.
    fn input_kind(&self) -> InputKind {
        (self.activations, matches!(self.weights, Weights::Bf16(_)))
    }

    /// Rounds `x` to bf16 where this matrix takes bf16 (8-bit formats are quantized by
    /// `matmul_each` and `matmul_add`), into `scratch`.
    fn prepare(
        &self,
        gpu: &Gpu,
        x: &CudaSlice<f32>,
        rows: usize,
        scratch: &mut ActivationScratch,
    ) -> EngineResult<()> {
        if let Some(format) = self.activations {
            scratch.quantize(gpu, &Activations::Plain(x), rows, self.k_in, format)?;
        }
        if matches!(self.weights, Weights::Bf16(_)) {
            let bf16 = scratch.bf16.as_mut().ok_or_else(missing_scratch)?;
            gpu.to_bf16(x, rows * self.k_in, bf16)?;
        }
        Ok(())
    }

    /// `out (+)= x × Wᵀ` on the inputs left in `scratch` (`x`, the f32 input, for dense
    /// weights).
    #[allow(clippy::too_many_arguments)]
    fn apply(
        &self,
        gpu: &Gpu,
        blas: Option<&CudaBlas>,
        x: Option<&CudaSlice<f32>>,
        scratch: &ActivationScratch,
        rows: usize,
        out: &mut CudaSlice<f32>,
        accumulate: bool,
    ) -> EngineResult<()> {
        let (n_out, blocks) = (self.n_out as i32, (self.k_in / BLOCK) as i32);
        let accumulate_arg = accumulate as i32;
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
                    .arg(out)
                    .arg(&n_out)
                    .arg(&blocks)
                    .arg(&accumulate_arg);
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
                    .arg(out)
                    .arg(&n_out)
                    .arg(&blocks)
                    .arg(&accumulate_arg);
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
                    .arg(out)
                    .arg(&n_out)
                    .arg(&blocks)
                    .arg(&accumulate_arg);
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
                    beta: if accumulate { 1.0 } else { 0.0 },
                    ldc: self.n_out as i32,
                };
                gpu.count_launches(1);
                // SAFETY: the shapes above match the buffers' lengths.
                unsafe { blas.gemm(gemm, w, x, out) }.map_err(gpu_error)
            }
            Weights::Bf16(w) => {
                let blas = blas.ok_or_else(|| missing_blas("bf16"))?;
                let x16 = scratch.bf16.as_ref().ok_or_else(missing_scratch)?;
                let alpha = 1.0f32;
                let beta = if accumulate { 1.0f32 } else { 0.0 };
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
                        self.n_out as i32,
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
    /// `x` RMS-normed by `weight` (into `normed` where materialized).
    Normed {
        x: &'a CudaSlice<f32>,
        weight: &'a CudaSlice<f32>,
        eps: f32,
        normed: &'a mut CudaSlice<f32>,
    },
    /// A gated MLP's `act(gate) · up` (SiLU, or Gemma's GELU; in place in `gate` where
    /// materialized).
    Gated {
        gate: &'a mut CudaSlice<f32>,
        up: &'a CudaSlice<f32>,
        gelu: bool,
    },
}

impl<'a> Activations<'a> {
    /// The input in f32, computed by its own kernel where it is not a buffer yet.
    fn materialize(self, gpu: &Gpu) -> EngineResult<&'a CudaSlice<f32>> {
        match self {
            Self::Plain(x) => Ok(x),
            Self::Normed {
                x,
                weight,
                eps,
                normed,
            } => {
                gpu.rms_norm(x, weight, eps, normed)?;
                Ok(normed)
            }
            Self::Gated { gate, up, gelu } => {
                gpu.gated(gate, up, gelu)?;
                Ok(gate)
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
        input: &Activations,
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
        let (x, up, source) = match input {
            Activations::Normed { x, weight, eps, .. } => {
                let dim = k_in as i32;
                let mut launch = gpu.stream.launch_builder(&gpu.kernels.rms_norm_quantize_q8);
                launch
                    .arg(*x)
                    .arg(*weight)
                    .arg(eps)
                    .arg(&dim)
                    .arg(&mut out.quants)
                    .arg(&mut out.scales)
                    .arg(&mut out.scaled_sums)
                    .arg(&format_arg);
                let config = LaunchConfig {
                    grid_dim: (rows as u32, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: x holds rows · k_in floats, weight k_in, the scratch at least as
                // many quants and a scale per block; 256 threads per row, as `rms_norm`'s.
                return unsafe { gpu.launch(launch, config) };
            }
            Activations::Plain(x) => (&**x, &**x, 0i32),
            Activations::Gated { gate, up, gelu } => (&**gate, &**up, 1 + *gelu as i32),
        };
        let units_arg = units as i32;
        let mut launch = gpu.stream.launch_builder(&gpu.kernels.quantize_q8);
        launch
            .arg(x)
            .arg(up)
            .arg(&mut out.quants)
            .arg(&mut out.scales)
            .arg(&mut out.scaled_sums)
            .arg(&units_arg)
            .arg(&format_arg)
            .arg(&source);
        // SAFETY: x (and up) hold `blocks` whole blocks of 32 (K-quant rows are whole
        // superblocks), the scratch at least as many.
        unsafe { gpu.launch(launch, Gpu::warps(units, 1)) }
    }
}

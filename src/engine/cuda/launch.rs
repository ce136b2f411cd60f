//! One typed method per kernel: shapes in, launch geometry and argument order kept here, so
//! the step reads like the CPU model (`engine::llama`).

use super::gpu_error;
use super::kernels::Kernels;
use crate::error::EngineResult;
use cudarc::driver::{
    CudaSlice, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use std::sync::Arc;

/// Threads per block of the element-wise kernels.
const THREADS: u32 = 256;
/// Warps per block of the warp-per-output kernels (quantize, qmatmul).
const WARPS: u32 = 4;

pub struct Gpu {
    pub stream: Arc<CudaStream>,
    pub kernels: Kernels,
}

fn grid_1d(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n as u32).div_ceil(THREADS).max(1), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn per_row(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Where each row of a step attends: its position and its sequence's block table.
pub struct AttentionRows<'a> {
    pub positions: &'a CudaSlice<i32>,
    pub row_tables: &'a CudaSlice<i32>,
    pub block_table: &'a CudaSlice<i32>,
}

impl Gpu {
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> EngineResult<CudaSlice<T>> {
        self.stream.clone_htod(host).map_err(gpu_error)
    }

    pub fn download<T: DeviceRepr>(&self, device: &CudaSlice<T>) -> EngineResult<Vec<T>> {
        self.stream.clone_dtoh(device).map_err(gpu_error)
    }

    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> EngineResult<CudaSlice<T>> {
        self.stream.alloc_zeros(n).map_err(gpu_error)
    }

    /// `x [rows, dim]` (whole rows of `weight.len()`) normalised row by row into a new buffer.
    pub fn rms_norm(
        &self,
        x: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        eps: f32,
    ) -> EngineResult<CudaSlice<f32>> {
        let rows = x.len() / weight.len();
        let dim = weight.len() as i32;
        let mut out = self.zeros::<f32>(x.len())?;
        let mut launch = self.stream.launch_builder(&self.kernels.rms_norm);
        launch.arg(x).arg(weight).arg(&mut out).arg(&dim).arg(&eps);
        // SAFETY: x and out hold `rows · dim` floats; one block per row.
        unsafe { launch.launch(per_row(rows)) }.map_err(gpu_error)?;
        Ok(out)
    }

    pub fn add_in_place(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>) -> EngineResult<()> {
        let n = x.len() as i64;
        let mut launch = self.stream.launch_builder(&self.kernels.add_in_place);
        launch.arg(x).arg(y).arg(&n);
        // SAFETY: both hold n floats.
        unsafe { launch.launch(grid_1d(n as usize)) }.map_err(gpu_error)?;
        Ok(())
    }

    /// `x` rounded to bf16 (to nearest even), as raw bits.
    pub fn to_bf16(&self, x: &CudaSlice<f32>) -> EngineResult<CudaSlice<u16>> {
        let n = x.len() as i64;
        let mut out = self.zeros::<u16>(x.len())?;
        let mut launch = self.stream.launch_builder(&self.kernels.to_bf16);
        launch.arg(x).arg(&mut out).arg(&n);
        // SAFETY: x and out hold n elements each.
        unsafe { launch.launch(grid_1d(n as usize)) }.map_err(gpu_error)?;
        Ok(out)
    }

    pub fn add_bias_rows(&self, x: &mut CudaSlice<f32>, bias: &CudaSlice<f32>) -> EngineResult<()> {
        let (n, dim) = (x.len() as i64, bias.len() as i32);
        let mut launch = self.stream.launch_builder(&self.kernels.add_bias_rows);
        launch.arg(x).arg(bias).arg(&n).arg(&dim);
        // SAFETY: x holds whole rows of `dim`.
        unsafe { launch.launch(grid_1d(n as usize)) }.map_err(gpu_error)?;
        Ok(())
    }

    /// The MLP's gating in place: `gate <- act(gate) * up`, with SiLU (SwiGLU) or, for
    /// Gemma, tanh-approximated GELU (GeGLU).
    pub fn gated(
        &self,
        gate: &mut CudaSlice<f32>,
        up: &CudaSlice<f32>,
        gelu: bool,
    ) -> EngineResult<()> {
        let n = gate.len() as i64;
        let kernel = match gelu {
            true => &self.kernels.gelu_tanh_mul,
            false => &self.kernels.silu_mul,
        };
        let mut launch = self.stream.launch_builder(kernel);
        launch.arg(gate).arg(up).arg(&n);
        // SAFETY: both hold n floats.
        unsafe { launch.launch(grid_1d(n as usize)) }.map_err(gpu_error)?;
        Ok(())
    }

    /// Rows `rows[i]` of `src [_, dim]` into a new `[rows.len(), dim]`.
    pub fn gather_rows(
        &self,
        src: &CudaSlice<f32>,
        rows: &[i32],
        dim: usize,
    ) -> EngineResult<CudaSlice<f32>> {
        let indices = self.upload(rows)?;
        let mut out = self.zeros::<f32>(rows.len() * dim)?;
        let dim = dim as i32;
        let mut launch = self.stream.launch_builder(&self.kernels.gather_rows);
        launch.arg(src).arg(&indices).arg(&mut out).arg(&dim);
        // SAFETY: every index is a row of src (the caller's segments).
        unsafe { launch.launch(per_row(rows.len())) }.map_err(gpu_error)?;
        Ok(out)
    }

    /// Rotates `x [rows, heads, head_dim]` in place by each row's position.
    pub fn rope(
        &self,
        x: &mut CudaSlice<f32>,
        positions: &CudaSlice<i32>,
        inv_freq: &CudaSlice<f32>,
        heads: usize,
        interleaved: bool,
    ) -> EngineResult<()> {
        let head_dim = inv_freq.len() * 2;
        let rows = positions.len();
        let (rows_arg, heads_arg, dim_arg) = (rows as i32, heads as i32, head_dim as i32);
        let interleaved = interleaved as i32;
        let mut launch = self.stream.launch_builder(&self.kernels.rope);
        launch
            .arg(x)
            .arg(positions)
            .arg(inv_freq)
            .arg(&rows_arg)
            .arg(&heads_arg)
            .arg(&dim_arg)
            .arg(&interleaved);
        // SAFETY: x holds rows · heads · head_dim floats.
        unsafe { launch.launch(grid_1d(rows * heads * head_dim / 2)) }.map_err(gpu_error)?;
        Ok(())
    }

    /// Writes `k`, `v` `[rows, kv_dim]` into the cache slots `slots[row]` at `layer_offset`.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_append(
        &self,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        slots: &CudaSlice<i32>,
        k_cache: &mut CudaSlice<u16>,
        v_cache: &mut CudaSlice<u16>,
        layer_offset: usize,
        kv_dim: usize,
    ) -> EngineResult<()> {
        let rows = slots.len();
        let (offset, rows_arg, dim_arg) = (layer_offset as i64, rows as i32, kv_dim as i32);
        let mut launch = self.stream.launch_builder(&self.kernels.kv_append);
        launch
            .arg(k)
            .arg(v)
            .arg(slots)
            .arg(k_cache)
            .arg(v_cache)
            .arg(&offset)
            .arg(&rows_arg)
            .arg(&dim_arg);
        // SAFETY: every slot was allocated to its row's sequence (`PagedKv::ensure`).
        unsafe { launch.launch(grid_1d(rows * kv_dim)) }.map_err(gpu_error)?;
        Ok(())
    }

    /// Copies cache blocks `from[i]` → `to[i]` in every layer.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_copy_blocks(
        &self,
        k_cache: &mut CudaSlice<u16>,
        v_cache: &mut CudaSlice<u16>,
        from: &[i32],
        to: &[i32],
        layers: usize,
        layer_stride: usize,
        kv_dim: usize,
    ) -> EngineResult<()> {
        let (from_dev, to_dev) = (self.upload(from)?, self.upload(to)?);
        let (pairs, layers_arg) = (from.len() as i32, layers as i32);
        let (stride, dim_arg) = (layer_stride as i64, kv_dim as i32);
        let mut launch = self.stream.launch_builder(&self.kernels.kv_copy_blocks);
        launch
            .arg(k_cache)
            .arg(v_cache)
            .arg(&from_dev)
            .arg(&to_dev)
            .arg(&pairs)
            .arg(&layers_arg)
            .arg(&stride)
            .arg(&dim_arg);
        let elements = from.len() * layers * crate::engine::kv::BLOCK_TOKENS * kv_dim;
        // SAFETY: block ids index the cache's blocks.
        unsafe { launch.launch(grid_1d(elements)) }.map_err(gpu_error)?;
        Ok(())
    }

    /// Causal attention of `q [rows, heads, head_dim]` over each row's sequence in one layer
    /// (over its last `window` positions, for a sliding-window layer).
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention(
        &self,
        q: &CudaSlice<f32>,
        k_cache: &CudaSlice<u16>,
        v_cache: &CudaSlice<u16>,
        layout: &AttentionRows,
        layer_offset: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        window: Option<usize>,
    ) -> EngineResult<CudaSlice<f32>> {
        let rows = layout.positions.len();
        let mut out = self.zeros::<f32>(rows * heads * head_dim)?;
        let offset = layer_offset as i64;
        let (heads_arg, kv_heads_arg, dim_arg) = (heads as i32, kv_heads as i32, head_dim as i32);
        let scale = 1.0 / (head_dim as f32).sqrt();
        let window = window.map_or(0, |w| w.min(i32::MAX as usize) as i32);
        let mut launch = self.stream.launch_builder(&self.kernels.paged_attention);
        launch
            .arg(q)
            .arg(k_cache)
            .arg(v_cache)
            .arg(&mut out)
            .arg(layout.positions)
            .arg(layout.row_tables)
            .arg(layout.block_table)
            .arg(&offset)
            .arg(&heads_arg)
            .arg(&kv_heads_arg)
            .arg(&dim_arg)
            .arg(&scale)
            .arg(&window);
        let config = LaunchConfig {
            grid_dim: (heads as u32, rows as u32, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: each row's table covers its visible positions (`PagedKv::ensure`).
        unsafe { launch.launch(config) }.map_err(gpu_error)?;
        Ok(out)
    }

    /// `[rows, vocab]` logits → per row (max, Z', Σ e·shift) and the first argmax.
    pub fn logit_stats(
        &self,
        logits: &CudaSlice<f32>,
        rows: usize,
    ) -> EngineResult<(Vec<f32>, Vec<i32>)> {
        let vocab = (logits.len() / rows.max(1)) as i32;
        let mut stats = self.zeros::<f32>(rows * 3)?;
        let mut argmax = self.zeros::<i32>(rows)?;
        let mut launch = self.stream.launch_builder(&self.kernels.logit_stats);
        launch
            .arg(logits)
            .arg(&vocab)
            .arg(&mut stats)
            .arg(&mut argmax);
        // SAFETY: logits hold rows · vocab floats.
        unsafe { launch.launch(per_row(rows)) }.map_err(gpu_error)?;
        Ok((self.download(&stats)?, self.download(&argmax)?))
    }

    /// `[rows, vocab]` logits → per row its `k` largest as `(token, logit)`, largest first.
    pub fn top_k(
        &self,
        logits: &CudaSlice<f32>,
        rows: usize,
        k: usize,
    ) -> EngineResult<Vec<Vec<(u32, f32)>>> {
        let vocab = logits.len() / rows.max(1);
        let k = k.min(vocab);
        let mut indices = self.zeros::<i32>(rows * k)?;
        let mut values = self.zeros::<f32>(rows * k)?;
        let (vocab_arg, k_arg) = (vocab as i32, k as i32);
        let mut launch = self.stream.launch_builder(&self.kernels.top_k);
        launch
            .arg(logits)
            .arg(&vocab_arg)
            .arg(&k_arg)
            .arg(&mut indices)
            .arg(&mut values);
        // SAFETY: logits hold rows · vocab floats, the outputs rows · k.
        unsafe { launch.launch(per_row(rows)) }.map_err(gpu_error)?;
        let (indices, values) = (self.download(&indices)?, self.download(&values)?);
        Ok(indices
            .chunks(k)
            .zip(values.chunks(k))
            .map(|(i, v)| i.iter().map(|&t| t as u32).zip(v.iter().copied()).collect())
            .collect())
    }

    /// Launch geometry of the warp-per-output kernels over `n` outputs per row.
    pub fn warps(n: usize, rows: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: ((n as u32).div_ceil(WARPS), rows as u32, 1),
            block_dim: (32 * WARPS, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

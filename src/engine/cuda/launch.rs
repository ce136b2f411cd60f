//! One typed method per kernel: shapes in, launch geometry and argument order kept here, so
//! the step reads like the CPU model (`engine::llama`).

use super::gpu_error;
use super::kernels::Kernels;
use crate::error::EngineResult;
use cudarc::driver::{
    CudaSlice, CudaStream, CudaView, DevicePtr, DeviceRepr, LaunchArgs, LaunchConfig,
    PushKernelArg, ValidAsZeroBits,
};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Threads per block of the element-wise kernels.
const THREADS: u32 = 256;
/// Warps per block of the warp-per-output kernels (quantize, qmatmul).
const WARPS: u32 = 4;

pub struct Gpu {
    pub stream: Arc<CudaStream>,
    pub kernels: Kernels,
    /// Kernels launched (and cuBLAS calls made) so far: what `bench engine` reports per step.
    launches: AtomicUsize,
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

/// A step's new queries, keys and values (the stacked projection's rows), where the rotated
/// queries go, and where each row's rotation and KV slot come from.
pub struct RopeRows<'a> {
    pub qkv: &'a CudaSlice<f32>,
    pub q: &'a mut CudaSlice<f32>,
    pub positions: CudaView<'a, i32>,
    pub slots: CudaView<'a, i32>,
    pub inv_freq: &'a CudaSlice<f32>,
    pub heads: usize,
    pub kv_heads: usize,
    pub interleaved: bool,
}

/// One layer's part of the paged KV cache.
pub struct KvCacheLayer<'a> {
    pub keys: &'a mut CudaSlice<u16>,
    pub values: &'a mut CudaSlice<u16>,
    pub layer_offset: usize,
}

/// Where each row of a step attends: its position and its sequence's block table.
pub struct AttentionRows<'a> {
    pub positions: CudaView<'a, i32>,
    pub row_tables: CudaView<'a, i32>,
    pub block_table: CudaView<'a, i32>,
}

impl Gpu {
    pub fn new(stream: Arc<CudaStream>, kernels: Kernels) -> Self {
        Self {
            stream,
            kernels,
            launches: AtomicUsize::new(0),
        }
    }

    pub fn launches(&self) -> usize {
        self.launches.load(Ordering::Relaxed)
    }

    /// Counts launches made outside `launch` (a cuBLAS call, a graph's kernels).
    pub fn count_launches(&self, n: usize) {
        self.launches.fetch_add(n, Ordering::Relaxed);
    }

    /// Launches a kernel whose arguments are pushed, and counts it.
    ///
    /// # Safety
    /// The arguments must match the kernel's parameters and every buffer must hold what
    /// `config`'s threads index.
    pub unsafe fn launch(
        &self,
        mut launch: LaunchArgs<'_>,
        config: LaunchConfig,
    ) -> EngineResult<()> {
        self.count_launches(1);
        // SAFETY: the caller's contract.
        unsafe { launch.launch(config) }.map_err(gpu_error)?;
        Ok(())
    }

    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> EngineResult<CudaSlice<T>> {
        self.stream.clone_htod(host).map_err(gpu_error)
    }

    /// Copies `host` into the start of `device` (no allocation: a graph's inputs).
    pub fn upload_into<T: DeviceRepr>(
        &self,
        host: &[T],
        device: &mut CudaSlice<T>,
    ) -> EngineResult<()> {
        self.stream.memcpy_htod(host, device).map_err(gpu_error)
    }

    pub fn download<T: DeviceRepr>(&self, device: &impl DevicePtr<T>) -> EngineResult<Vec<T>> {
        self.stream.clone_dtoh(device).map_err(gpu_error)
    }

    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> EngineResult<CudaSlice<T>> {
        self.stream.alloc_zeros(n).map_err(gpu_error)
    }

    /// `x [rows, dim]` (whole rows of `weight.len()`) normalised row by row into `out`.
    pub fn rms_norm(
        &self,
        x: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        eps: f32,
        out: &mut CudaSlice<f32>,
    ) -> EngineResult<()> {
        let rows = x.len() / weight.len();
        let dim = weight.len() as i32;
        let mut launch = self.stream.launch_builder(&self.kernels.rms_norm);
        launch.arg(x).arg(weight).arg(out).arg(&dim).arg(&eps);
        // SAFETY: x and out hold `rows · dim` floats; one block per row.
        unsafe { self.launch(launch, per_row(rows)) }
    }

    /// `rms_norm` in place of `heads` heads (of `weight.len()`) from head `first_head` of
    /// each row of `x` (rows of `row_stride`): QK-norm on the stacked q/k/v projection.
    pub fn rms_norm_heads(
        &self,
        x: &mut CudaSlice<f32>,
        row_stride: usize,
        (first_head, heads): (usize, usize),
        weight: &CudaSlice<f32>,
        eps: f32,
    ) -> EngineResult<()> {
        let rows = x.len() / row_stride;
        let (stride, first, dim) = (row_stride as i64, first_head as i32, weight.len() as i32);
        let mut launch = self.stream.launch_builder(&self.kernels.rms_norm_heads);
        launch
            .arg(x)
            .arg(weight)
            .arg(&stride)
            .arg(&first)
            .arg(&dim)
            .arg(&eps);
        let config = LaunchConfig {
            grid_dim: (heads as u32, rows as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the heads lie within each row of x; 256 threads per head, as `rms_norm`'s.
        unsafe { self.launch(launch, config) }
    }

    /// Rows `ids[r]` of `table [vocab, dim]` times `scale` into `out [ids.len(), dim]`.
    pub fn embed_rows(
        &self,
        table: &CudaSlice<f32>,
        ids: &CudaView<i32>,
        scale: f32,
        out: &mut CudaSlice<f32>,
    ) -> EngineResult<()> {
        let dim = (out.len() / ids.len()) as i32;
        let mut launch = self.stream.launch_builder(&self.kernels.embed_rows);
        launch.arg(table).arg(ids).arg(out).arg(&dim).arg(&scale);
        // SAFETY: every id is a row of the table (`plan_step` checks tokens against the
        // vocabulary; padding rows read row 0).
        unsafe { self.launch(launch, per_row(ids.len())) }
    }

    pub fn add_in_place(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>) -> EngineResult<()> {
        let n = x.len() as i64;
        let mut launch = self.stream.launch_builder(&self.kernels.add_in_place);
        launch.arg(x).arg(y).arg(&n);
        // SAFETY: both hold n floats.
        unsafe { self.launch(launch, grid_1d(n as usize)) }
    }

    /// The first `n` floats of `x` rounded to bf16 (to nearest even), as raw bits, into `out`.
    pub fn to_bf16(
        &self,
        x: &CudaSlice<f32>,
        n: usize,
        out: &mut CudaSlice<u16>,
    ) -> EngineResult<()> {
        let n_arg = n as i64;
        let mut launch = self.stream.launch_builder(&self.kernels.to_bf16);
        launch.arg(x).arg(out).arg(&n_arg);
        // SAFETY: x and out hold at least n elements each.
        unsafe { self.launch(launch, grid_1d(n)) }
    }

    pub fn add_bias_rows(&self, x: &mut CudaSlice<f32>, bias: &CudaSlice<f32>) -> EngineResult<()> {
        let (n, dim) = (x.len() as i64, bias.len() as i32);
        let mut launch = self.stream.launch_builder(&self.kernels.add_bias_rows);
        launch.arg(x).arg(bias).arg(&n).arg(&dim);
        // SAFETY: x holds whole rows of `dim`.
        unsafe { self.launch(launch, grid_1d(n as usize)) }
    }

    /// The MLP's gating: `out [rows, dim] = act(gate) * up` from the stacked gate/up rows
    /// `[rows, 2 · dim]`, with SiLU (SwiGLU) or, for Gemma, tanh-approximated GELU (GeGLU).
    pub fn gated(
        &self,
        gate_up: &CudaSlice<f32>,
        dim: usize,
        gelu: bool,
        out: &mut CudaSlice<f32>,
    ) -> EngineResult<()> {
        let (n, dim) = (out.len() as i64, dim as i32);
        let kernel = match gelu {
            true => &self.kernels.gelu_tanh_mul,
            false => &self.kernels.silu_mul,
        };
        let mut launch = self.stream.launch_builder(kernel);
        launch.arg(gate_up).arg(out).arg(&n).arg(&dim);
        // SAFETY: gate_up holds the rows of out twice as wide.
        unsafe { self.launch(launch, grid_1d(n as usize)) }
    }

    /// Rows `rows[i]` of `src [_, dim]` into `out [rows.len(), dim]`.
    pub fn gather_rows(
        &self,
        src: &CudaSlice<f32>,
        rows: &CudaSlice<i32>,
        out: &mut CudaSlice<f32>,
    ) -> EngineResult<()> {
        let dim = (out.len() / rows.len()) as i32;
        let mut launch = self.stream.launch_builder(&self.kernels.gather_rows);
        launch.arg(src).arg(rows).arg(out).arg(&dim);
        // SAFETY: every index is a row of src (the caller's segments).
        unsafe { self.launch(launch, per_row(rows.len())) }
    }

    /// Rotates the queries and keys of `qkv [rows, (heads + 2 · kv_heads) · head_dim]` by each
    /// row's position: the queries into `q [rows, heads, head_dim]`, the keys with the values
    /// into the cache slots `slots[row]` at `layer_offset` (none for a padding row's negative
    /// slot).
    pub fn rope_kv_append(&self, rows: RopeRows, cache: KvCacheLayer) -> EngineResult<()> {
        let head_dim = rows.inv_freq.len() * 2;
        let count = rows.positions.len();
        let offset = cache.layer_offset as i64;
        let (rows_arg, heads_arg) = (count as i32, rows.heads as i32);
        let (kv_heads_arg, dim_arg) = (rows.kv_heads as i32, head_dim as i32);
        let row_stride = ((rows.heads + 2 * rows.kv_heads) * head_dim) as i32;
        let interleaved = rows.interleaved as i32;
        let mut launch = self.stream.launch_builder(&self.kernels.rope_kv_append);
        launch
            .arg(rows.qkv)
            .arg(rows.q)
            .arg(&rows.positions)
            .arg(&rows.slots)
            .arg(rows.inv_freq)
            .arg(cache.keys)
            .arg(cache.values)
            .arg(&offset)
            .arg(&rows_arg)
            .arg(&row_stride)
            .arg(&heads_arg)
            .arg(&kv_heads_arg)
            .arg(&dim_arg)
            .arg(&interleaved);
        let pairs = count * (rows.heads + rows.kv_heads) * head_dim / 2;
        // SAFETY: qkv and q hold `count` rows of their heads; every non-negative slot was
        // allocated to its row's sequence (`KvStore::reserve`).
        unsafe { self.launch(launch, grid_1d(pairs)) }
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
        unsafe { self.launch(launch, grid_1d(elements)) }
    }

    /// Causal attention of `q [rows, heads, head_dim]` over each row's sequence in one layer
    /// (over its last `window` positions, for a sliding-window layer), into `out`.
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
        out: &mut CudaSlice<f32>,
    ) -> EngineResult<()> {
        let rows = layout.positions.len();
        let offset = layer_offset as i64;
        let (heads_arg, kv_heads_arg, dim_arg) = (heads as i32, kv_heads as i32, head_dim as i32);
        let scale = 1.0 / (head_dim as f32).sqrt();
        let window = window.map_or(0, |w| w.min(i32::MAX as usize) as i32);
        let mut launch = self.stream.launch_builder(&self.kernels.paged_attention);
        launch
            .arg(q)
            .arg(k_cache)
            .arg(v_cache)
            .arg(out)
            .arg(&layout.positions)
            .arg(&layout.row_tables)
            .arg(&layout.block_table)
            .arg(&offset)
            .arg(&heads_arg)
            .arg(&kv_heads_arg)
            .arg(&dim_arg)
            .arg(&scale)
            .arg(&window);
        // A block per KV head and row, a warp per query head of its group.
        let group = (heads / kv_heads) as u32;
        let config = LaunchConfig {
            grid_dim: (kv_heads as u32, rows as u32, 1),
            block_dim: (32 * group, 1, 1),
            shared_mem_bytes: group * head_dim as u32 * 4,
        };
        // SAFETY: each row's table covers its visible positions (`PagedKv::ensure`); the
        // group's queries fit the shared memory asked for.
        unsafe { self.launch(launch, config) }
    }

    /// `[rows, vocab]` logits → per row (max, Z', Σ e·shift) into `stats [rows, 3]` and the
    /// first argmax into `argmax [rows]`.
    pub fn logit_stats(
        &self,
        logits: &CudaSlice<f32>,
        rows: usize,
        stats: &mut CudaSlice<f32>,
        argmax: &mut CudaSlice<i32>,
    ) -> EngineResult<()> {
        let vocab = (logits.len() / rows.max(1)) as i32;
        let mut launch = self.stream.launch_builder(&self.kernels.logit_stats);
        launch.arg(logits).arg(&vocab).arg(stats).arg(argmax);
        // SAFETY: logits hold rows · vocab floats, the outputs a row's each.
        unsafe { self.launch(launch, per_row(rows)) }
    }

    /// The first `rows` rows of `[_, vocab]` logits → per row its `k` largest as
    /// `(token, logit)`, largest first.
    pub fn top_k(
        &self,
        logits: &CudaSlice<f32>,
        rows: usize,
        vocab: usize,
        k: usize,
    ) -> EngineResult<Vec<Vec<(u32, f32)>>> {
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
        // SAFETY: logits hold at least rows · vocab floats, the outputs rows · k.
        unsafe { self.launch(launch, per_row(rows)) }?;
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

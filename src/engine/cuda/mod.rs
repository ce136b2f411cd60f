//! The GPU backend (feature `cuda`): the CPU executor's ragged batched step, run by the CUDA
//! kernels of `kernels/` (compiled by NVRTC at start-up for the GPU found) over weights kept
//! in their quantized formats and a paged KV cache. The driver, NVRTC and cuBLAS are loaded at
//! run time, so the crate builds without a CUDA toolkit; `load` probes for each and fails
//! with an error naming what is missing, never a panic.

pub mod kernels;
mod launch;
mod matrix;
mod paged_kv;

use super::kv::{BlockCopy, KvStore, SeqId};
use super::llama::{embed_tokens, embedding_row, inverse_frequencies, plan_step, Segment};
use super::sampling::{self, LogitStats};
use super::weights::{self, Hyperparams, LayerWeights, ModelWeights};
use super::{SeqWork, StepExecutor, StepOutput};
use crate::config::ModelConfig;
use crate::error::{EngineError, EngineResult};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaSlice};
use launch::{AttentionRows, Gpu};
use matrix::DeviceMatrix;
use paged_kv::PagedKv;

/// Head dimensions the attention kernel holds per warp (8 per lane).
const MAX_HEAD_DIM: usize = 256;

pub(crate) fn gpu_error(e: impl std::fmt::Display) -> EngineError {
    EngineError::Gpu(e.to_string())
}

/// Whether a CUDA driver can be loaded and sees at least one GPU (tests skip otherwise).
pub fn gpu_available() -> bool {
    driver_present() && CudaContext::device_count().is_ok_and(|n| n > 0)
}

fn driver_present() -> bool {
    // SAFETY: only tries to dlopen libcuda under its usual names.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

struct DeviceLayer {
    attn_norm: CudaSlice<f32>,
    wq: DeviceMatrix,
    wk: DeviceMatrix,
    wv: DeviceMatrix,
    wo: DeviceMatrix,
    bq: Option<CudaSlice<f32>>,
    bk: Option<CudaSlice<f32>>,
    bv: Option<CudaSlice<f32>>,
    q_norm: Option<CudaSlice<f32>>,
    k_norm: Option<CudaSlice<f32>>,
    post_attn_norm: Option<CudaSlice<f32>>,
    post_ffn_norm: Option<CudaSlice<f32>>,
    window: Option<usize>,
    ffn_norm: CudaSlice<f32>,
    w_gate: DeviceMatrix,
    w_up: DeviceMatrix,
    w_down: DeviceMatrix,
}

/// The decoder's weights on one GPU, and the handles its step launches with.
struct DeviceModel {
    hp: Hyperparams,
    /// Host copy `[vocab, hidden]`: rows are gathered on the host and uploaded per step.
    embedding: Vec<f32>,
    layers: Vec<DeviceLayer>,
    final_norm: CudaSlice<f32>,
    lm_head: DeviceMatrix,
    inv_freq: CudaSlice<f32>,
    /// The sliding-window layers' own frequencies (Gemma 3's local rope base).
    local_inv_freq: Option<CudaSlice<f32>>,
    gpu: Gpu,
    /// Loaded only when some matrix is dense (formats without integer kernels).
    blas: Option<CudaBlas>,
}

/// One step's row layout on the device.
struct StepLayout {
    rows: usize,
    positions: CudaSlice<i32>,
    /// Per row: the cache slot its key and value go to.
    slots: CudaSlice<i32>,
    /// Per row: where its sequence's blocks start in `block_table`.
    row_tables: CudaSlice<i32>,
    /// The block tables of the step's sequences, one after another.
    block_table: CudaSlice<i32>,
}

impl StepLayout {
    fn attention(&self) -> AttentionRows<'_> {
        AttentionRows {
            positions: &self.positions,
            row_tables: &self.row_tables,
            block_table: &self.block_table,
        }
    }
}

pub struct CudaExecutor {
    name: String,
    model: DeviceModel,
    /// Budget and lengths (the same bookkeeping as every backend; no host KV data).
    kv: KvStore,
    paged: PagedKv,
}

impl CudaExecutor {
    /// Loads `config`'s weights onto GPU `ordinal`.
    pub fn load(config: &ModelConfig, ordinal: usize) -> EngineResult<Self> {
        if !driver_present() {
            return Err(EngineError::Gpu(format!(
                "model `{}` asks for cuda:{ordinal}, but no NVIDIA driver (libcuda.so) can be loaded",
                config.name
            )));
        }
        let count = CudaContext::device_count().map_err(gpu_error)?;
        if ordinal >= count.max(0) as usize {
            return Err(EngineError::Gpu(format!(
                "model `{}` asks for cuda:{ordinal}, but {count} GPU(s) are visible",
                config.name
            )));
        }
        let context = CudaContext::new(ordinal).map_err(gpu_error)?;
        // Each executor on its own non-blocking stream: on the legacy default stream, which
        // every executor of the process shares, one model's download of its results waited
        // for the other model's queued kernels (on an H200, the routed modes ran at half the
        // tokens/s of lockstep, where the models never overlap).
        // SAFETY: everything this executor allocates is used and freed on this one stream,
        // so no cross-stream events are needed.
        unsafe { context.disable_event_tracking() };
        let gpu = Gpu {
            kernels: kernels::Kernels::load(&context)?,
            stream: context.new_stream().map_err(gpu_error)?,
        };
        let weights = weights::load_weights(config)?;
        Self::new(&config.name, weights, gpu, config.kv_tokens)
    }

    fn new(name: &str, weights: ModelWeights, gpu: Gpu, kv_tokens: usize) -> EngineResult<Self> {
        let hp = weights.hp.clone();
        if hp.head_dim > MAX_HEAD_DIM
            || !hp.head_dim.is_multiple_of(2)
            || !hp.heads.is_multiple_of(hp.kv_heads)
        {
            return Err(EngineError::Gpu(format!(
                "model `{name}`: head_dim {} with {} heads over {} KV heads is not supported on \
                 the GPU (head_dim even and at most {MAX_HEAD_DIM}, heads a multiple of KV heads)",
                hp.head_dim, hp.heads, hp.kv_heads
            )));
        }
        let kv_dim = hp.kv_heads * hp.head_dim;
        let layers = weights
            .layers
            .iter()
            .map(|l| DeviceLayer::upload(&gpu, l))
            .collect::<EngineResult<Vec<_>>>()?;
        let lm_head = DeviceMatrix::upload(&gpu, &weights.lm_head)?;
        let needs_blas = lm_head.is_dense() || layers.iter().any(DeviceLayer::has_dense);
        let blas = match needs_blas {
            // SAFETY: only tries to dlopen libcublas under its usual names.
            true if !unsafe { cudarc::cublas::sys::is_culib_present() } => {
                return Err(EngineError::Gpu(format!(
                    "model `{name}` has weights without integer GPU kernels (not Q8_0/Q4_0/Q4_1), \
                     which need cuBLAS, and libcublas cannot be loaded"
                )))
            }
            true => Some(CudaBlas::new(gpu.stream.clone()).map_err(gpu_error)?),
            false => None,
        };
        // The device pool holds whole blocks (`capacity_blocks` of them), so sliding-window
        // layers keep every position here: no local parts evicted apart.
        let kv = KvStore::new(kv_tokens);
        let paged = PagedKv::new(&gpu, layers.len(), kv_dim, kv.capacity_blocks())?;
        let local_inv_freq = hp
            .gemma
            .map(|g| gpu.upload(&inverse_frequencies(&weights, g.local_rope_theta)))
            .transpose()?;
        let model = DeviceModel {
            inv_freq: gpu.upload(&inverse_frequencies(&weights, hp.rope_theta))?,
            local_inv_freq,
            final_norm: gpu.upload(&weights.final_norm)?,
            embedding: weights.embedding,
            hp,
            layers,
            lm_head,
            gpu,
            blas,
        };
        Ok(Self {
            name: name.to_string(),
            kv,
            paged,
            model,
        })
    }

    /// Uploads the step's positions, cache slots and block tables.
    fn layout(&self, batch: &[(SeqId, &[u32])], segments: &[Segment]) -> EngineResult<StepLayout> {
        let (mut positions, mut slots, mut row_tables, mut block_table) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (&(seq, _), s) in batch.iter().zip(segments) {
            let table_start = block_table.len() as i32;
            let table = self.kv.table(seq);
            block_table.extend(table.iter().map(|&b| b as i32));
            for position in s.first_position..s.first_position + s.rows {
                positions.push(position as i32);
                slots.push(PagedKv::slot(table, position));
                row_tables.push(table_start);
            }
        }
        let gpu = &self.model.gpu;
        Ok(StepLayout {
            rows: positions.len(),
            positions: gpu.upload(&positions)?,
            slots: gpu.upload(&slots)?,
            row_tables: gpu.upload(&row_tables)?,
            block_table: gpu.upload(&block_table)?,
        })
    }
}

impl DeviceLayer {
    fn upload(gpu: &Gpu, w: &LayerWeights) -> EngineResult<Self> {
        let vector = |v: &Option<Vec<f32>>| v.as_deref().map(|v| gpu.upload(v)).transpose();
        let matrix = |m| DeviceMatrix::upload(gpu, m);
        Ok(Self {
            attn_norm: gpu.upload(&w.attn_norm)?,
            wq: matrix(&w.wq)?,
            wk: matrix(&w.wk)?,
            wv: matrix(&w.wv)?,
            wo: matrix(&w.wo)?,
            bq: vector(&w.bq)?,
            bk: vector(&w.bk)?,
            bv: vector(&w.bv)?,
            q_norm: vector(&w.q_norm)?,
            k_norm: vector(&w.k_norm)?,
            post_attn_norm: vector(&w.post_attn_norm)?,
            post_ffn_norm: vector(&w.post_ffn_norm)?,
            window: w.window,
            ffn_norm: gpu.upload(&w.ffn_norm)?,
            w_gate: matrix(&w.w_gate)?,
            w_up: matrix(&w.w_up)?,
            w_down: matrix(&w.w_down)?,
        })
    }

    fn has_dense(&self) -> bool {
        [
            &self.wq,
            &self.wk,
            &self.wv,
            &self.wo,
            &self.w_gate,
            &self.w_up,
            &self.w_down,
        ]
        .iter()
        .any(|m| m.is_dense())
    }
}

/// What a step brings back to the host for its sequences' last positions.
struct LastPositions {
    /// `[sequences, vocab]`.
    logits: Vec<f32>,
    /// `[sequences, hidden]`, after the output norm.
    hidden: Vec<f32>,
    /// `[sequences, 3]`: max, Z', Σ e·shift (see `kernels/sampling.cu`).
    sums: Vec<f32>,
    argmax: Vec<i32>,
    /// Per sequence the `top_k` largest logits (as many as the step's largest request).
    top: Vec<Vec<(u32, f32)>>,
}

impl DeviceModel {
    fn forward(
        &self,
        paged: &mut PagedKv,
        tokens: &[u32],
        segments: &[Segment],
        layout: &StepLayout,
        top_k: usize,
    ) -> EngineResult<LastPositions> {
        let hp = &self.hp;
        let gpu = &self.gpu;
        let mut x = gpu.upload(&embed_tokens(&self.embedding, hp, tokens))?;
        for (index, layer) in self.layers.iter().enumerate() {
            self.layer(index, layer, &mut x, layout, paged)?;
        }
        let last_rows: Vec<i32> = segments
            .iter()
            .map(|s| (s.first_row + s.rows - 1) as i32)
            .collect();
        let last = gpu.gather_rows(&x, &last_rows, hp.hidden)?;
        let normed = gpu.rms_norm(&last, &self.final_norm, hp.rms_eps)?;
        let logits = self
            .lm_head
            .matmul(gpu, self.blas.as_ref(), &normed, segments.len())?;
        let (sums, argmax) = gpu.logit_stats(&logits, segments.len())?;
        let top = match top_k {
            0 => vec![Vec::new(); segments.len()],
            k => gpu.top_k(&logits, segments.len(), k)?,
        };
        Ok(LastPositions {
            logits: gpu.download(&logits)?,
            hidden: gpu.download(&normed)?,
            sums,
            argmax,
            top,
        })
    }

    fn layer(
        &self,
        index: usize,
        w: &DeviceLayer,
        x: &mut CudaSlice<f32>,
        layout: &StepLayout,
        paged: &mut PagedKv,
    ) -> EngineResult<()> {
        let (hp, gpu, blas) = (&self.hp, &self.gpu, self.blas.as_ref());
        let rows = layout.rows;
        let h = gpu.rms_norm(x, &w.attn_norm, hp.rms_eps)?;
        let [mut q, mut k, mut v] =
            DeviceMatrix::matmul_each(gpu, blas, [&w.wq, &w.wk, &w.wv], &h, rows)?;
        for (t, bias) in [(&mut q, &w.bq), (&mut k, &w.bk), (&mut v, &w.bv)] {
            if let Some(bias) = bias {
                gpu.add_bias_rows(t, bias)?;
            }
        }
        if let Some(norm) = &w.q_norm {
            q = gpu.rms_norm(&q, norm, hp.rms_eps)?;
        }
        if let Some(norm) = &w.k_norm {
            k = gpu.rms_norm(&k, norm, hp.rms_eps)?;
        }
        let interleaved = hp.rope_interleaved;
        let inv_freq = match (w.window, &self.local_inv_freq) {
            (Some(_), Some(local)) => local,
            _ => &self.inv_freq,
        };
        gpu.rope(&mut q, &layout.positions, inv_freq, hp.heads, interleaved)?;
        gpu.rope(
            &mut k,
            &layout.positions,
            inv_freq,
            hp.kv_heads,
            interleaved,
        )?;

        let kv_dim = hp.kv_heads * hp.head_dim;
        let offset = index * paged.layer_stride();
        gpu.kv_append(
            &k,
            &v,
            &layout.slots,
            &mut paged.keys,
            &mut paged.values,
            offset,
            kv_dim,
        )?;
        let attn = gpu.paged_attention(
            &q,
            &paged.keys,
            &paged.values,
            &layout.attention(),
            offset,
            hp.heads,
            hp.kv_heads,
            hp.head_dim,
            w.window,
        )?;
        let attn = w.wo.matmul(gpu, blas, &attn, rows)?;
        gpu.add_in_place(x, &post_norm(gpu, attn, &w.post_attn_norm, hp.rms_eps)?)?;

        let h = gpu.rms_norm(x, &w.ffn_norm, hp.rms_eps)?;
        let [mut gate, up] = DeviceMatrix::matmul_each(gpu, blas, [&w.w_gate, &w.w_up], &h, rows)?;
        gpu.gated(&mut gate, &up, hp.gemma.is_some())?;
        let down = w.w_down.matmul(gpu, blas, &gate, rows)?;
        gpu.add_in_place(x, &post_norm(gpu, down, &w.post_ffn_norm, hp.rms_eps)?)
    }
}

/// A sublayer's output normed before its residual add where the model has such a norm
/// (Gemma 3), as it is otherwise.
fn post_norm(
    gpu: &Gpu,
    out: CudaSlice<f32>,
    norm: &Option<CudaSlice<f32>>,
    eps: f32,
) -> EngineResult<CudaSlice<f32>> {
    match norm {
        Some(norm) => gpu.rms_norm(&out, norm, eps),
        None => Ok(out),
    }
}

impl StepExecutor for CudaExecutor {
    fn name(&self) -> &str {
        &self.name
    }

    fn vocab_size(&self) -> usize {
        self.model.hp.vocab
    }

    fn hidden_size(&self) -> usize {
        self.model.hp.hidden
    }

    fn context_length(&self) -> usize {
        self.model.hp.context
    }

    fn step(&mut self, work: &[SeqWork]) -> EngineResult<Vec<StepOutput>> {
        if work.is_empty() {
            return Ok(Vec::new());
        }
        let batch: Vec<(SeqId, &[u32])> =
            work.iter().map(|w| (w.seq, w.tokens.as_slice())).collect();
        let segments = plan_step(&self.model.hp, &self.kv, &batch)?;
        let reservations: Vec<(SeqId, usize)> = batch.iter().map(|&(s, t)| (s, t.len())).collect();
        self.kv.reserve(&reservations)?;
        let layout = self.layout(&batch, &segments)?;
        let tokens: Vec<u32> = batch.iter().flat_map(|&(_, t)| t.iter().copied()).collect();
        let top_k = work.iter().map(|w| w.needs.top_k).max().unwrap_or(0);
        // The host computes constrained rows' masks while the device runs the forward pass.
        let (model, paged) = (&self.model, &mut self.paged);
        let (last, masks) = sampling::with_masks(work, || {
            model.forward(paged, &tokens, &segments, &layout, top_k)
        });
        let mut last = last?;
        for &(seq, t) in &batch {
            self.kv.advance(seq, t);
        }
        let (vocab, hidden) = (self.model.hp.vocab, self.model.hp.hidden);
        Ok(work
            .iter()
            .enumerate()
            .map(|(i, w)| {
                let mut logits = last.logits[i * vocab..(i + 1) * vocab].to_vec();
                let position = self.kv.seq_len(w.seq);
                let (candidate, stats) = match masks.get(i).and_then(Option::as_ref) {
                    // A masked row's draw and statistics come from its masked logits.
                    Some(mask) => {
                        mask.apply(&mut logits);
                        (
                            sampling::sample(&logits, &w.sampling, position),
                            sampling::logit_stats(&logits, w.needs.top_k),
                        )
                    }
                    None => {
                        let candidate = if w.sampling.picks_argmax() {
                            last.argmax[i] as u32
                        } else {
                            sampling::sample(&logits, &w.sampling, position)
                        };
                        let mut top = std::mem::take(&mut last.top[i]);
                        top.truncate(w.needs.top_k);
                        let stats =
                            LogitStats::from_sums(last.sums[i * 3 + 1], last.sums[i * 3 + 2], top);
                        (candidate, stats)
                    }
                };
                StepOutput {
                    seq: w.seq,
                    position,
                    candidate,
                    candidate_embedding: w
                        .needs
                        .embedding
                        .then(|| embedding_row(&self.model.embedding, hidden, candidate).to_vec()),
                    stats,
                    hidden: w
                        .needs
                        .hidden
                        .then(|| last.hidden[i * hidden..(i + 1) * hidden].to_vec()),
                    logits,
                }
            })
            .collect())
    }

    fn kv(&self) -> &KvStore {
        &self.kv
    }

    fn kv_mut(&mut self) -> &mut KvStore {
        &mut self.kv
    }

    fn copy_block(&mut self, copy: BlockCopy) -> EngineResult<()> {
        self.paged.copy(&self.model.gpu, copy)
    }
}

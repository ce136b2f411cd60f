//! The GPU backend (feature `cuda`): the CPU executor's ragged batched step, run by the CUDA
//! kernels of `kernels/` (compiled by NVRTC at start-up for the GPU found) over weights kept
//! in their quantized formats and a paged KV cache. The driver, NVRTC and cuBLAS are loaded at
//! run time, so the crate builds without a CUDA toolkit; `load` probes for each and fails
//! with an error naming what is missing, never a panic.

mod buffers;
mod graphs;
pub mod kernels;
mod launch;
mod matrix;
mod paged_kv;

use super::kv::{BlockCopy, KvStore, SeqId};
use super::llama::{embedding_row, embedding_scale, inverse_frequencies, plan_step, Segment};
use super::sampling::{self, LogitStats};
use super::step_inputs::{SequenceRows, StepInputs};
use super::weights::{self, Hyperparams, LayerWeights, ModelWeights};
use super::{SeqWork, StepExecutor, StepOutput};
use crate::config::{ModelConfig, StreamPriority};
use crate::error::{EngineError, EngineResult};
use buffers::{DeviceInputs, HeadBuffers, StepBuffers};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaSlice};
use graphs::DecodeGraphs;
use launch::{Gpu, KvCacheLayer, RopeRows};
use matrix::{ActivationScratch, Activations, DeviceMatrix, Projection};
use paged_kv::PagedKv;

/// Head dimensions the attention kernel holds per warp (8 per lane).
const MAX_HEAD_DIM: usize = 256;
/// Query heads sharing a KV head: the attention kernel's warps per block (32 at most).
const MAX_HEADS_PER_KV_HEAD: usize = 32;

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
    /// q, k and v side by side in each output row.
    qkv: Projection,
    wo: Projection,
    /// The q/k/v biases side by side (zeros for a missing one), where the model has any.
    qkv_bias: Option<CudaSlice<f32>>,
    q_norm: Option<CudaSlice<f32>>,
    k_norm: Option<CudaSlice<f32>>,
    post_attn_norm: Option<CudaSlice<f32>>,
    post_ffn_norm: Option<CudaSlice<f32>>,
    window: Option<usize>,
    ffn_norm: CudaSlice<f32>,
    /// gate and up side by side in each output row.
    gate_up: Projection,
    w_down: Projection,
}

/// The decoder's weights on one GPU, and the handles its step launches with.
struct DeviceModel {
    hp: Hyperparams,
    /// `[vocab, hidden]`: the step's first kernel gathers its rows.
    embedding: CudaSlice<f32>,
    /// The same table on the host, for the candidates' embeddings policies ask for.
    host_embedding: Vec<f32>,
    layers: Vec<DeviceLayer>,
    final_norm: CudaSlice<f32>,
    lm_head: Projection,
    inv_freq: CudaSlice<f32>,
    /// The sliding-window layers' own frequencies (Gemma 3's local rope base).
    local_inv_freq: Option<CudaSlice<f32>>,
    gpu: Gpu,
    /// Loaded only when some matrix is dense (formats without integer kernels).
    blas: Option<CudaBlas>,
}

pub struct CudaExecutor {
    name: String,
    model: DeviceModel,
    /// Budget and lengths (the same bookkeeping as every backend; no host KV data).
    kv: KvStore,
    paged: PagedKv,
    graphs: DecodeGraphs,
    kernels_last_step: usize,
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
        let stream = match config.stream_priority {
            StreamPriority::Normal => context.new_stream(),
            StreamPriority::High => cudarc::driver::result::stream::get_priority_range()
                .and_then(|(_, greatest)| context.new_stream_with_priority(greatest)),
        }
        .map_err(gpu_error)?;
        let gpu = Gpu::new(stream, kernels::Kernels::load(&context)?);
        let weights = weights::load_weights(config)?;
        Self::new(
            &config.name,
            weights,
            gpu,
            config.kv_tokens,
            config.cuda_graphs,
        )
    }

    fn new(
        name: &str,
        weights: ModelWeights,
        gpu: Gpu,
        kv_tokens: usize,
        cuda_graphs: bool,
    ) -> EngineResult<Self> {
        let hp = weights.hp.clone();
        if hp.head_dim > MAX_HEAD_DIM
            || !hp.head_dim.is_multiple_of(2)
            || !hp.heads.is_multiple_of(hp.kv_heads)
            || hp.heads / hp.kv_heads > MAX_HEADS_PER_KV_HEAD
        {
            return Err(EngineError::Gpu(format!(
                "model `{name}`: head_dim {} with {} heads over {} KV heads is not supported on \
                 the GPU (head_dim even and at most {MAX_HEAD_DIM}, heads a multiple of KV heads, \
                 at most {MAX_HEADS_PER_KV_HEAD} per KV head)",
                hp.head_dim, hp.heads, hp.kv_heads
            )));
        }
        let kv_dim = hp.kv_heads * hp.head_dim;
        let layers = weights
            .layers
            .iter()
            .map(|l| DeviceLayer::upload(&gpu, l))
            .collect::<EngineResult<Vec<_>>>()?;
        let lm_head = Projection::upload(&gpu, &[&weights.lm_head])?;
        let needs_blas = layers
            .iter()
            .flat_map(DeviceLayer::projections)
            .chain([&lm_head])
            .any(Projection::has_dense);
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
        let graphs = DecodeGraphs::new(cuda_graphs, &hp, &kv);
        let model = DeviceModel {
            inv_freq: gpu.upload(&inverse_frequencies(&weights, hp.rope_theta))?,
            local_inv_freq,
            final_norm: gpu.upload(&weights.final_norm)?,
            embedding: gpu.upload(&weights.embedding)?,
            host_embedding: weights.embedding,
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
            graphs,
            kernels_last_step: 0,
        })
    }

    /// The decode buckets whose graphs this executor has captured (none with graphs off or
    /// after a failed capture).
    pub fn captured_graph_buckets(&self) -> Vec<usize> {
        self.graphs.captured()
    }
}

impl DeviceLayer {
    fn upload(gpu: &Gpu, w: &LayerWeights) -> EngineResult<Self> {
        let vector = |v: &Option<Vec<f32>>| v.as_deref().map(|v| gpu.upload(v)).transpose();
        let biases = [(&w.bq, &w.wq), (&w.bk, &w.wk), (&w.bv, &w.wv)];
        let qkv_bias = match biases.iter().any(|(b, _)| b.is_some()) {
            true => {
                let side_by_side: Vec<f32> = biases
                    .iter()
                    .flat_map(|&(b, m)| b.clone().unwrap_or_else(|| vec![0.0; m.n_out()]))
                    .collect();
                Some(gpu.upload(&side_by_side)?)
            }
            false => None,
        };
        Ok(Self {
            attn_norm: gpu.upload(&w.attn_norm)?,
            qkv: Projection::upload(gpu, &[&w.wq, &w.wk, &w.wv])?,
            wo: Projection::upload(gpu, &[&w.wo])?,
            qkv_bias,
            q_norm: vector(&w.q_norm)?,
            k_norm: vector(&w.k_norm)?,
            post_attn_norm: vector(&w.post_attn_norm)?,
            post_ffn_norm: vector(&w.post_ffn_norm)?,
            window: w.window,
            ffn_norm: gpu.upload(&w.ffn_norm)?,
            gate_up: Projection::upload(gpu, &[&w.w_gate, &w.w_up])?,
            w_down: Projection::upload(gpu, &[&w.w_down])?,
        })
    }

    fn projections(&self) -> [&Projection; 4] {
        [&self.qkv, &self.wo, &self.gate_up, &self.w_down]
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
    /// Every matrix, for sizing a step's activation scratch.
    fn matrices(&self) -> impl Iterator<Item = &DeviceMatrix> {
        self.layers
            .iter()
            .flat_map(DeviceLayer::projections)
            .chain([&self.lm_head])
            .flat_map(Projection::matrices)
    }

    /// The decoder stack over a step's rows, from the embedding lookup to the last layer's
    /// residual stream in `buf.x`. Launches kernels only (no allocation, copy or sync), so a
    /// stream capture of it replays.
    fn body(
        &self,
        paged: &mut PagedKv,
        inputs: &DeviceInputs,
        buf: &mut StepBuffers,
    ) -> EngineResult<()> {
        let scale = embedding_scale(&self.hp);
        self.gpu
            .embed_rows(&self.embedding, &inputs.tokens(), scale, &mut buf.x)?;
        for (index, layer) in self.layers.iter().enumerate() {
            self.layer(index, layer, inputs, paged, buf)?;
        }
        Ok(())
    }

    /// The output head over `last [seqs, hidden]`: the final norm, the logits and their
    /// statistics, into `head`. Kernels only, as `body`.
    fn head(
        &self,
        last: &CudaSlice<f32>,
        seqs: usize,
        scratch: &mut ActivationScratch,
        head: &mut HeadBuffers,
    ) -> EngineResult<()> {
        let (hp, gpu, blas) = (&self.hp, &self.gpu, self.blas.as_ref());
        // The normed rows are an output too (the policies' hidden states).
        let input = Activations::Normed {
            x: last,
            weight: &self.final_norm,
            eps: hp.rms_eps,
            normed: &mut head.normed,
            keep: true,
        };
        self.lm_head
            .matmul(gpu, blas, input, seqs, scratch, &mut head.logits, false)?;
        gpu.logit_stats(&head.logits, seqs, &mut head.stats, &mut head.argmax)
    }

    /// Brings the first `seqs` sequences' head results to the host, with each one's `top_k`
    /// largest logits.
    fn read_head(
        &self,
        head: &HeadBuffers,
        seqs: usize,
        top_k: usize,
    ) -> EngineResult<LastPositions> {
        let (gpu, vocab, hidden) = (&self.gpu, self.hp.vocab, self.hp.hidden);
        let top = match top_k {
            0 => vec![Vec::new(); seqs],
            k => gpu.top_k(&head.logits, seqs, vocab, k)?,
        };
        Ok(LastPositions {
            logits: gpu.download(&head.logits.slice(..seqs * vocab))?,
            hidden: gpu.download(&head.normed.slice(..seqs * hidden))?,
            sums: gpu.download(&head.stats.slice(..seqs * 3))?,
            argmax: gpu.download(&head.argmax.slice(..seqs))?,
            top,
        })
    }

    /// A step run as it comes: its own buffers, every row through the stack, the
    /// sequences' last rows through the head.
    fn forward_eager(
        &self,
        paged: &mut PagedKv,
        inputs: &StepInputs,
        segments: &[Segment],
        top_k: usize,
    ) -> EngineResult<LastPositions> {
        let gpu = &self.gpu;
        let inputs = DeviceInputs::upload(gpu, inputs)?;
        let mut buf = StepBuffers::new(self, inputs.rows())?;
        self.body(paged, &inputs, &mut buf)?;
        let last_rows: Vec<i32> = segments
            .iter()
            .map(|s| (s.first_row + s.rows - 1) as i32)
            .collect();
        let mut last = gpu.zeros::<f32>(segments.len() * self.hp.hidden)?;
        gpu.gather_rows(&buf.x, &gpu.upload(&last_rows)?, &mut last)?;
        let mut head = HeadBuffers::new(self, segments.len())?;
        self.head(&last, segments.len(), &mut buf.scratch, &mut head)?;
        self.read_head(&head, segments.len(), top_k)
    }

    fn layer(
        &self,
        index: usize,
        w: &DeviceLayer,
        inputs: &DeviceInputs,
        paged: &mut PagedKv,
        buf: &mut StepBuffers,
    ) -> EngineResult<()> {
        let (hp, gpu) = (&self.hp, &self.gpu);
        self.project_normed(&w.attn_norm, &w.qkv, Sublayer::Attention, buf)?;
        if let Some(bias) = &w.qkv_bias {
            gpu.add_bias_rows(&mut buf.qkv, bias)?;
        }
        let stride = w.qkv.n_out();
        if let Some(norm) = &w.q_norm {
            gpu.rms_norm_heads(&mut buf.qkv, stride, (0, hp.heads), norm, hp.rms_eps)?;
        }
        if let Some(norm) = &w.k_norm {
            let keys = (hp.heads, hp.kv_heads);
            gpu.rms_norm_heads(&mut buf.qkv, stride, keys, norm, hp.rms_eps)?;
        }
        let inv_freq = match (w.window, &self.local_inv_freq) {
            (Some(_), Some(local)) => local,
            _ => &self.inv_freq,
        };
        let offset = index * paged.layer_stride();
        gpu.rope_kv_append(
            RopeRows {
                qkv: &buf.qkv,
                q: &mut buf.q,
                positions: inputs.positions(),
                slots: inputs.slots(),
                inv_freq,
                heads: hp.heads,
                kv_heads: hp.kv_heads,
                interleaved: hp.rope_interleaved,
            },
            KvCacheLayer {
                keys: &mut paged.keys,
                values: &mut paged.values,
                layer_offset: offset,
            },
        )?;
        gpu.paged_attention(
            &buf.q,
            &paged.keys,
            &paged.values,
            &inputs.attention(),
            offset,
            hp.heads,
            hp.kv_heads,
            hp.head_dim,
            w.window,
            &mut buf.attn,
        )?;
        self.residual(&w.wo, &w.post_attn_norm, Sublayer::Attention, buf)?;

        self.project_normed(&w.ffn_norm, &w.gate_up, Sublayer::Mlp, buf)?;
        self.residual(&w.w_down, &w.post_ffn_norm, Sublayer::Mlp, buf)
    }

    /// A sublayer's input projection (q/k/v, or gate/up) of the residual stream RMS-normed by
    /// `norm`: the norm fused with the quantization where the projection takes 8-bit
    /// activations.
    fn project_normed(
        &self,
        norm: &CudaSlice<f32>,
        w: &Projection,
        sublayer: Sublayer,
        buf: &mut StepBuffers,
    ) -> EngineResult<()> {
        let out = match sublayer {
            Sublayer::Attention => &mut buf.qkv,
            Sublayer::Mlp => &mut buf.gate_up,
        };
        let input = Activations::Normed {
            x: &buf.x,
            weight: norm,
            eps: self.hp.rms_eps,
            normed: &mut buf.h,
            keep: false,
        };
        let (gpu, blas) = (&self.gpu, self.blas.as_ref());
        w.matmul(gpu, blas, input, buf.rows, &mut buf.scratch, out, false)
    }

    /// `x += out · W` for a sublayer's output projection (of the attention's output, or of
    /// the gated MLP's `act(gate) · up`): added by the product itself, or, where the model
    /// norms the sublayer's output first (Gemma 3), normed and then added.
    fn residual(
        &self,
        w: &Projection,
        post_norm: &Option<CudaSlice<f32>>,
        sublayer: Sublayer,
        buf: &mut StepBuffers,
    ) -> EngineResult<()> {
        let (gpu, blas, rows) = (&self.gpu, self.blas.as_ref(), buf.rows);
        let input = match sublayer {
            Sublayer::Attention => Activations::Plain(&buf.attn),
            Sublayer::Mlp => Activations::Gated {
                gate_up: &buf.gate_up,
                gelu: self.hp.gemma.is_some(),
                out: &mut buf.act,
            },
        };
        match post_norm {
            None => w.matmul(gpu, blas, input, rows, &mut buf.scratch, &mut buf.x, true),
            Some(norm) => {
                w.matmul(
                    gpu,
                    blas,
                    input,
                    rows,
                    &mut buf.scratch,
                    &mut buf.proj,
                    false,
                )?;
                gpu.rms_norm(&buf.proj, norm, self.hp.rms_eps, &mut buf.h)?;
                gpu.add_in_place(&mut buf.x, &buf.h)
            }
        }
    }
}

/// Which sublayer a projection belongs to (where its input or output lies).
#[derive(Clone, Copy)]
enum Sublayer {
    Attention,
    Mlp,
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
        let sequences: Vec<SequenceRows> = batch
            .iter()
            .zip(&segments)
            .map(|(&(seq, tokens), s)| SequenceRows {
                tokens,
                first_position: s.first_position,
                table: self.kv.table(seq),
            })
            .collect();
        let top_k = work.iter().map(|w| w.needs.top_k).max().unwrap_or(0);
        let (model, paged, graphs) = (&self.model, &mut self.paged, &mut self.graphs);
        // A decode step replays its bucket's graph (captured on first use); any other step,
        // or every step once a capture has failed, runs eagerly.
        let graph = graphs.for_step(model, paged, &sequences);
        let before = model.gpu.launches();
        // The host computes constrained rows' masks while the device runs the forward pass.
        let (last, masks) = sampling::with_masks(work, || match graph {
            Some((bucket, inputs)) => graphs.replay(model, bucket, &inputs, segments.len(), top_k),
            None => model.forward_eager(paged, &StepInputs::eager(&sequences), &segments, top_k),
        });
        self.kernels_last_step = model.gpu.launches() - before;
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
                    candidate_embedding: w.needs.embedding.then(|| {
                        embedding_row(&self.model.host_embedding, hidden, candidate).to_vec()
                    }),
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

    fn kernels_last_step(&self) -> Option<usize> {
        Some(self.kernels_last_step)
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

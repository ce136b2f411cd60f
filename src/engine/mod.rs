//! Model math, synchronous and actor-free: an `Executor` owns one model's weights, KV cache and
//! thread pool and runs ragged batched steps.

pub(crate) mod attention;
pub mod chat;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod kv;
pub(crate) mod kv_blocks;
pub(crate) mod llama;
pub mod ops;
pub(crate) mod parallel;
pub(crate) mod pool;
pub(crate) mod qmatmul;
pub mod sampling;
pub mod shared_text;
pub(crate) mod simulated;
pub mod spelling;
pub mod step_inputs;
pub mod tokenizer;
pub mod weights;

use crate::config::{ModelConfig, ModelDevice};
use crate::error::{EngineError, EngineResult};
pub use kv::{BlockCopy, KvUsage, PrefixCounters, SeqId};
use llama::LlamaModel;
pub use qmatmul::Kernel;
pub use sampling::{LogitStats, SamplingParams, TokenFilter, TokenMask};
use std::sync::Arc;
use weights::{Hyperparams, ModelWeights};

/// What a policy wants from a step beyond the candidate and its cheap statistics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Needs {
    /// The final hidden state of the last position.
    pub hidden: bool,
    /// How many of the largest logits to report.
    pub top_k: usize,
    /// The input-embedding row of the sampled candidate (R2R's router reads it).
    pub embedding: bool,
}

/// One sequence's share of a step: the tokens this model has not seen yet (prompt, handoff
/// catch-up or one decode token).
#[derive(Debug, Clone)]
pub struct SeqWork {
    pub seq: SeqId,
    pub tokens: Vec<u32>,
    pub sampling: SamplingParams,
    pub needs: Needs,
    /// The tokens its candidate may be (a structured-output grammar); `None`: any.
    pub filter: Option<Arc<dyn TokenFilter>>,
}

#[derive(Debug, Clone)]
pub struct StepOutput {
    pub seq: SeqId,
    /// Position the candidate would occupy (= tokens the model has now seen).
    pub position: usize,
    pub candidate: u32,
    pub logits: Vec<f32>,
    pub stats: LogitStats,
    pub hidden: Option<Vec<f32>>,
    pub candidate_embedding: Option<Vec<f32>>,
}

/// What the runtime needs from a model backend: ragged steps and per-sequence KV bookkeeping.
/// The CPU executor, the latency-profile simulation and (later) the GPU backend implement it.
pub trait StepExecutor: Send {
    fn name(&self) -> &str;
    fn vocab_size(&self) -> usize;
    fn hidden_size(&self) -> usize;
    /// Longest sequence (prompt + generated) the model can hold.
    fn context_length(&self) -> usize;
    /// One forward pass over all sequences of `work`; on error no sequence has changed.
    fn step(&mut self, work: &[SeqWork]) -> EngineResult<Vec<StepOutput>>;
    /// Bytes of weights one decode step reads from host memory (`bench engine`'s bandwidth
    /// bound); `None` where the weights live elsewhere or are simulated.
    fn weight_bytes_per_step(&self) -> Option<u64> {
        None
    }

    /// Kernels the last step launched (a replayed graph's counted as its own), where the
    /// backend launches kernels: `bench engine` reports it, since on a GPU a small model's
    /// step costs about what its launches do.
    fn kernels_last_step(&self) -> Option<usize> {
        None
    }

    /// The per-sequence KV bookkeeping every backend keeps.
    fn kv(&self) -> &kv::KvStore;
    fn kv_mut(&mut self) -> &mut kv::KvStore;

    fn seq_len(&self, seq: SeqId) -> usize {
        self.kv().seq_len(seq)
    }

    fn contains(&self, seq: SeqId) -> bool {
        self.kv().contains(seq)
    }

    /// Copies positions between blocks of this backend's KV storage, as the block manager
    /// asked; an error leaves the target block unusable (the caller drops it).
    fn copy_block(&mut self, copy: BlockCopy) -> EngineResult<()>;

    /// Starts sequence `seq` on the longest cached prefix of `tokens`; returns the positions
    /// it holds.
    fn attach_prefix(&mut self, seq: SeqId, tokens: &[u32]) -> usize {
        let (matched, copy) = self.kv_mut().attach_prefix(seq, tokens);
        settle_copy(self, seq, matched, copy)
    }

    /// Rolls a sequence back to its first `len` positions (or fewer); returns the positions
    /// it holds.
    fn truncate(&mut self, seq: SeqId, len: usize) -> usize {
        let (kept, copy) = self.kv_mut().truncate(seq, len);
        settle_copy(self, seq, kept, copy)
    }

    /// Releases a sequence's KV; unknown ids are ignored (freeing is idempotent).
    fn free(&mut self, seq: SeqId) {
        self.kv_mut().free(seq)
    }

    /// Forgets every sequence: the KV store a restarted model starts with.
    fn clear_kv(&mut self) {
        self.kv_mut().clear()
    }

    fn kv_usage(&self) -> KvUsage {
        self.kv().usage()
    }
}

/// Carries out the block copy a KV change asked for; where it fails, `seq` gives up the
/// copied block and keeps the positions before it (they are recomputed). Returns its length.
fn settle_copy<E: StepExecutor + ?Sized>(
    executor: &mut E,
    seq: SeqId,
    held: usize,
    copy: Option<BlockCopy>,
) -> usize {
    match copy.map(|c| executor.copy_block(c)) {
        Some(Err(e)) => {
            tracing::warn!("KV block copy failed ({e}); its positions are recomputed");
            let whole_blocks = held / kv::BLOCK_TOKENS * kv::BLOCK_TOKENS;
            executor.kv_mut().truncate(seq, whole_blocks).0
        }
        _ => held,
    }
}

/// What appending `tokens` after `context` positions costs, in tokens at context 0, where one
/// token attending one more position costs `context_cost`: each token attends over the
/// positions before it and itself. The step budget and the simulated executor price work alike.
pub fn context_priced_tokens(context: usize, tokens: usize, context_cost: f64) -> f64 {
    let (c, t) = (context as f64, tokens as f64);
    t * (1.0 + context_cost * (c + (t - 1.0) / 2.0))
}

/// The executor a model entry asks for: on the CPU, or on a CUDA GPU (`device = "cuda:N"`).
pub fn load_executor(config: &ModelConfig) -> EngineResult<Box<dyn StepExecutor>> {
    match config.device {
        ModelDevice::Cpu => Ok(Box::new(Executor::load(config)?)),
        #[cfg(feature = "cuda")]
        ModelDevice::Cuda(ordinal) => Ok(Box::new(cuda::CudaExecutor::load(config, ordinal)?)),
        #[cfg(not(feature = "cuda"))]
        ModelDevice::Cuda(_) => Err(EngineError::Gpu(format!(
            "model `{}` asks for device = \"{}\", but this binary was built without the `cuda` \
             feature (rebuild with `cargo build --release --features cuda`)",
            config.name, config.device
        ))),
    }
}

pub struct Executor {
    name: String,
    model: LlamaModel,
    kv: kv::KvStore,
    data: kv_blocks::KvBlocks,
    /// The model's own threads; `None` for one thread: steps run inline on the caller.
    pool: Option<pool::StepPool>,
}

/// Fails with a clear error where the binary's SIMD baseline is missing on this CPU.
pub fn ensure_cpu_supported() -> EngineResult<()> {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
    {
        if !std::is_x86_feature_detected!("avx2") {
            return Err(EngineError::UnsupportedCpu("AVX2"));
        }
        if !std::is_x86_feature_detected!("fma") {
            return Err(EngineError::UnsupportedCpu("FMA"));
        }
    }
    Ok(())
}

impl Executor {
    pub fn load(config: &ModelConfig) -> EngineResult<Self> {
        ensure_cpu_supported()?;
        let weights = weights::load_weights(config)?;
        Self::new(&config.name, weights, config.threads, config.kv_tokens)
    }

    /// Runs the integer matmuls on `kernel` instead of the fastest this CPU has (`bench
    /// parity` compares two kernels, whose f32 rounding differs, to show that variation).
    pub fn use_kernel(&mut self, kernel: qmatmul::Kernel) -> EngineResult<()> {
        let available = qmatmul::Kernel::available();
        if !available.contains(&kernel) {
            let names: Vec<&str> = available.iter().map(|k| k.name()).collect();
            return Err(EngineError::UnavailableKernel(
                kernel.name(),
                names.join(", "),
            ));
        }
        self.model.kernel = kernel;
        Ok(())
    }

    pub fn new(
        name: &str,
        weights: ModelWeights,
        threads: usize,
        kv_tokens: usize,
    ) -> EngineResult<Self> {
        let pool = (threads > 1)
            .then(|| pool::StepPool::new(threads, name))
            .transpose()
            .map_err(|e| EngineError::InvalidStep(format!("thread pool: {e}")))?;
        let model = LlamaModel::new(weights);
        let kv = kv::KvStore::with_window(kv_tokens, model.sliding_window());
        let data = kv_blocks::KvBlocks::new(&model.local_layers(), model.kv_dim());
        Ok(Self {
            name: name.to_string(),
            model,
            kv,
            data,
            pool,
        })
    }

    pub fn hyperparams(&self) -> &Hyperparams {
        &self.model.weights.hp
    }

    pub fn layer_count(&self) -> usize {
        self.model.layer_count()
    }
}

/// One forward pass, then each sequence's sampling and statistics (in parallel: a vocabulary-
/// wide pass per sequence).
fn step_on(
    model: &LlamaModel,
    kv: &mut kv::KvStore,
    data: &mut kv_blocks::KvBlocks,
    work: &[SeqWork],
) -> EngineResult<Vec<StepOutput>> {
    let batch: Vec<(SeqId, &[u32])> = work.iter().map(|w| (w.seq, w.tokens.as_slice())).collect();
    // Constrained rows' masks are computed while the forward pass runs on the model's threads.
    let (last, masks) = sampling::with_masks(work, || model.forward(kv, data, &batch));
    let mut last = last?;
    for (out, mask) in last.iter_mut().zip(&masks) {
        if let Some(mask) = mask {
            mask.apply(&mut out.logits);
        }
    }
    let positions: Vec<usize> = work.iter().map(|w| kv.seq_len(w.seq)).collect();
    let sampled = parallel::map_indices(work.len(), |i| {
        let w = &work[i];
        let candidate = sampling::sample(&last[i].logits, &w.sampling, positions[i]);
        (
            candidate,
            sampling::logit_stats(&last[i].logits, w.needs.top_k),
        )
    });
    Ok(work
        .iter()
        .zip(last)
        .zip(sampled)
        .zip(positions)
        .map(|(((w, out), (candidate, stats)), position)| StepOutput {
            seq: w.seq,
            position,
            candidate,
            candidate_embedding: w
                .needs
                .embedding
                .then(|| model.embedding_row(candidate).to_vec()),
            stats,
            hidden: w.needs.hidden.then_some(out.hidden),
            logits: out.logits,
        })
        .collect())
}

impl StepExecutor for Executor {
    fn name(&self) -> &str {
        &self.name
    }

    fn vocab_size(&self) -> usize {
        self.model.weights.hp.vocab
    }

    fn hidden_size(&self) -> usize {
        self.model.weights.hp.hidden
    }

    fn context_length(&self) -> usize {
        self.model.weights.hp.context
    }

    /// Runs on this model's own thread pool, or inline with one thread.
    fn step(&mut self, work: &[SeqWork]) -> EngineResult<Vec<StepOutput>> {
        let (model, kv, data) = (&self.model, &mut self.kv, &mut self.data);
        match &self.pool {
            Some(pool) => pool.enter(|| step_on(model, kv, data, work)),
            None => step_on(model, kv, data, work),
        }
    }

    fn copy_block(&mut self, copy: BlockCopy) -> EngineResult<()> {
        self.data.copy(copy);
        Ok(())
    }

    fn weight_bytes_per_step(&self) -> Option<u64> {
        Some(self.model.weights.matrix_bytes())
    }

    fn kv(&self) -> &kv::KvStore {
        &self.kv
    }

    fn kv_mut(&mut self) -> &mut kv::KvStore {
        &mut self.kv
    }
}

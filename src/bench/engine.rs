//! `bench engine`: median decode-step time per batch size on one model, plus prefill rate and,
//! on the CPU, the B = 1 step against its memory-bandwidth bound. Each batch row mixes
//! sequences of different context lengths (a ragged batch).

use super::bandwidth::{self, Bound};
use super::median;
use serde::Serialize;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tokenrouter::config::{Config, StepCost};
use tokenrouter::constraint::{OutputFormat, RequestGrammar, Vocabulary};
use tokenrouter::engine::{
    load_executor, Needs, SamplingParams, SeqId, SeqWork, StepExecutor, TokenFilter,
};
use tokenrouter::error::EngineResult;
use tokenrouter::tuning::online::fit_latency;

#[derive(Debug, Clone, Serialize)]
pub struct EngineBenchRow {
    pub batch: usize,
    pub step_ms_median: f64,
    pub tokens_per_s: f64,
    /// Kernels one step of this batch launches, where the backend launches kernels (GPU).
    pub kernels_per_step: Option<usize>,
}

#[derive(Debug, Clone, Serialize)]
pub struct AffineFit {
    pub a_ms: f64,
    pub c_ms: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct PrefillResult {
    pub tokens: usize,
    pub ms_median: f64,
    pub tokens_per_s: f64,
}

/// One prompt chunk timed at the start of a sequence and after a long context: the runtime's
/// step budget prices a chunk by the context it attends over with `context_cost`.
#[derive(Debug, Clone, Serialize)]
pub struct ChunkResult {
    pub tokens: usize,
    pub context: usize,
    pub early_ms_median: f64,
    pub late_ms_median: f64,
    /// What one token attending one more position costs, in tokens at context 0.
    pub context_cost: f64,
}

impl ChunkResult {
    /// A chunk of t tokens after c positions costs t·(1 + k·(c + (t − 1)/2)) tokens at
    /// context 0; the two timings' ratio r gives k = (r − 1) / (c + h·(1 − r)), h = (t − 1)/2.
    fn new(tokens: usize, context: usize, early_ms_median: f64, late_ms_median: f64) -> Self {
        let r = late_ms_median / early_ms_median;
        let h = (tokens as f64 - 1.0) / 2.0;
        let k = (r - 1.0) / (context as f64 + h * (1.0 - r));
        Self {
            tokens,
            context,
            early_ms_median,
            late_ms_median,
            context_cost: if k.is_finite() { k.max(0.0) } else { 0.0 },
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct EngineBenchReport {
    pub model: String,
    pub threads: usize,
    pub weights: String,
    /// Whether decode steps replay CUDA graphs; `None` off the GPU.
    pub cuda_graphs: Option<bool>,
    pub rows: Vec<EngineBenchRow>,
    pub fit: AffineFit,
    pub prefill: PrefillResult,
    pub chunk: ChunkResult,
    /// With the weights in host memory and a B = 1 row.
    pub bound: Option<Bound>,
    /// The process's peak resident memory once the model was loaded (before any step).
    pub load_peak_rss_mib: Option<f64>,
}

pub struct EngineBenchSettings {
    pub batches: Vec<usize>,
    pub steps: usize,
    pub context: usize,
    pub prefill_tokens: usize,
    /// The chunk timed early and late in a long prompt, and the context before the late one.
    pub chunk_tokens: usize,
    pub chunk_context: usize,
}

impl Default for EngineBenchSettings {
    /// `bench engine`'s defaults, which the shipped step profiles were measured with.
    fn default() -> Self {
        Self {
            batches: vec![1, 2, 4, 8, 16],
            steps: 16,
            context: 64,
            prefill_tokens: 512,
            chunk_tokens: 32,
            chunk_context: 1536,
        }
    }
}

/// Step profiles measured in this process, as `bench engine --json` measures them (without
/// the bandwidth probe): a model's own copy, stepped while nothing else runs.
pub struct Profiler {
    /// By config model index; `None` for a simulated model (its profile is configured).
    executors: Vec<Option<Box<dyn StepExecutor>>>,
}

impl Profiler {
    pub fn load(config: &Config) -> anyhow::Result<Self> {
        let executors = config
            .models
            .iter()
            .map(|model| match model.latency_profile_ms {
                Some(_) => Ok(None),
                None => load_executor(model).map(Some),
            })
            .collect::<EngineResult<_>>()?;
        Ok(Self { executors })
    }

    /// Each model's step cost now, by config model index (`None` for a simulated model).
    pub fn measure(&mut self) -> EngineResult<Vec<Option<StepCost>>> {
        let settings = EngineBenchSettings::default();
        self.executors
            .iter_mut()
            .map(|executor| {
                let Some(executor) = executor else {
                    return Ok(None);
                };
                let (_, fit, prefill) = steps_and_prefill(executor.as_mut(), &settings)?;
                Ok(Some(StepCost {
                    a_ms: fit.a_ms,
                    c_ms: fit.c_ms,
                    prefill_ms_per_token: Some(prefill.ms_median / prefill.tokens as f64),
                }))
            })
            .collect()
    }
}

/// Deterministic filler tokens from the ordinary part of the vocabulary.
fn filler(len: usize, salt: usize, vocab: usize) -> Vec<u32> {
    let span = (vocab - 200).max(1);
    (0..len)
        .map(|i| (200 + (i * 7919 + salt * 104_729) % span) as u32)
        .collect()
}

fn work(seq: u64, tokens: Vec<u32>) -> SeqWork {
    SeqWork {
        seq: SeqId(seq),
        tokens,
        sampling: SamplingParams::greedy(),
        needs: Needs::default(),
        filter: None,
    }
}

/// A ragged decode batch on one executor: sequences `first_seq..first_seq + batch`, row i
/// with a context of `context + 3·i` tokens.
struct DecodeBatch {
    first_seq: u64,
    next: Vec<u32>,
}

impl DecodeBatch {
    fn start(
        executor: &mut dyn StepExecutor,
        first_seq: u64,
        batch: usize,
        context: usize,
    ) -> EngineResult<Self> {
        let vocab = executor.vocab_size();
        let prompts: Vec<SeqWork> = (0..batch)
            .map(|i| work(first_seq + i as u64, filler(context + 3 * i, i, vocab)))
            .collect();
        let next = executor
            .step(&prompts)?
            .iter()
            .map(|o| o.candidate)
            .collect();
        Ok(Self { first_seq, next })
    }

    /// One decode step over every row; its wall time in ms.
    fn step(&mut self, executor: &mut dyn StepExecutor) -> EngineResult<f64> {
        self.step_masked(executor, &[])
    }

    /// One decode step, row i masked by `filters[i]` where given; its wall time in ms.
    fn step_masked(
        &mut self,
        executor: &mut dyn StepExecutor,
        filters: &[Arc<dyn TokenFilter>],
    ) -> EngineResult<f64> {
        let decode: Vec<SeqWork> = self
            .next
            .iter()
            .enumerate()
            .map(|(i, &t)| SeqWork {
                filter: filters.get(i).cloned(),
                ..work(self.first_seq + i as u64, vec![t])
            })
            .collect();
        let start = Instant::now();
        let out = executor.step(&decode)?;
        let elapsed = start.elapsed().as_secs_f64() * 1e3;
        self.next = out.iter().map(|o| o.candidate).collect();
        Ok(elapsed)
    }

    /// Median step time over `steps` timed steps after two warm-up steps.
    fn median_step_ms(
        &mut self,
        executor: &mut dyn StepExecutor,
        steps: usize,
    ) -> EngineResult<f64> {
        let mut times = Vec::with_capacity(steps);
        for step in 0..steps + 2 {
            let elapsed = self.step(executor)?;
            if step >= 2 {
                times.push(elapsed);
            }
        }
        Ok(median(&mut times))
    }

    fn finish(self, executor: &mut dyn StepExecutor) {
        for i in 0..self.next.len() {
            executor.free(SeqId(self.first_seq + i as u64));
        }
    }
}

/// What masking every row by a grammar costs a decode step.
#[derive(Debug, Clone, Serialize)]
pub struct ConstrainedStep {
    pub model: String,
    pub batch: usize,
    pub steps: usize,
    pub unconstrained_ms_median: f64,
    pub constrained_ms_median: f64,
    /// Outputs the masked rows completed (each row starts a fresh one at once).
    pub outputs_completed: usize,
}

/// A decode batch whose rows each generate under `format` (the sampled token committed to
/// the row's grammar, a fresh grammar once an output ends) and the same batch without masks,
/// stepped in turn so drift on this shared machine hits both alike: their median step times.
pub fn constrained_step(
    executor: &mut dyn StepExecutor,
    format: &OutputFormat,
    vocabulary: &Arc<Vocabulary>,
    eos: &std::collections::BTreeSet<u32>,
    batch: usize,
    settings: &EngineBenchSettings,
) -> anyhow::Result<ConstrainedStep> {
    let fresh = || -> anyhow::Result<Arc<RequestGrammar>> {
        Ok(Arc::new(RequestGrammar::new(
            format,
            std::slice::from_ref(vocabulary),
        )?))
    };
    let mut grammars = (0..batch).map(|_| fresh()).collect::<Result<Vec<_>, _>>()?;
    let mut free = DecodeBatch::start(executor, 0, batch, settings.context)?;
    let mut held = DecodeBatch::start(executor, batch as u64, batch, settings.context)?;
    let (mut free_ms, mut held_ms, mut completed) = (Vec::new(), Vec::new(), 0);
    for round in 0..settings.steps + 2 {
        let filters: Vec<Arc<dyn TokenFilter>> = grammars.iter().map(|g| g.filter(0)).collect();
        let (a, b) = (free.step(executor)?, held.step_masked(executor, &filters)?);
        if round >= 2 {
            free_ms.push(a);
            held_ms.push(b);
        }
        for (grammar, &token) in grammars.iter_mut().zip(&held.next) {
            if eos.contains(&token) || grammar.commit(0, token).is_err() {
                completed += 1;
                *grammar = fresh()?;
            }
        }
    }
    free.finish(executor);
    held.finish(executor);
    Ok(ConstrainedStep {
        model: executor.name().to_string(),
        batch,
        steps: settings.steps,
        unconstrained_ms_median: median(&mut free_ms),
        constrained_ms_median: median(&mut held_ms),
        outputs_completed: completed,
    })
}

impl ConstrainedStep {
    pub fn markdown(&self) -> String {
        format!(
            "{}: {} timed decode steps of {} rows, each row generating under the schema \
             ({} outputs completed): {:.2} ms against {:.2} ms unmasked ({:.3}×), medians of \
             steps taken in turn\n",
            self.model,
            self.steps,
            self.batch,
            self.outputs_completed,
            self.constrained_ms_median,
            self.unconstrained_ms_median,
            self.constrained_ms_median / self.unconstrained_ms_median,
        )
    }
}

/// Median step time per batch size, the sizes stepped in turn (one step of each per round,
/// two warm-up rounds), so a burst of load on this shared machine hits every size alike and
/// the ratios between sizes stay measured side by side.
fn interleaved_median_step_ms(
    executor: &mut dyn StepExecutor,
    settings: &EngineBenchSettings,
) -> EngineResult<Vec<(f64, Option<usize>)>> {
    let mut decodes = Vec::with_capacity(settings.batches.len());
    let mut first_seq = 0;
    for &batch in &settings.batches {
        decodes.push(DecodeBatch::start(
            executor,
            first_seq,
            batch,
            settings.context,
        )?);
        first_seq += batch as u64;
    }
    let mut times = vec![Vec::with_capacity(settings.steps); decodes.len()];
    let mut kernels = vec![None; decodes.len()];
    for round in 0..settings.steps + 2 {
        for ((decode, times), kernels) in decodes.iter_mut().zip(&mut times).zip(&mut kernels) {
            let elapsed = decode.step(executor)?;
            if round >= 2 {
                times.push(elapsed);
            }
            *kernels = executor.kernels_last_step();
        }
    }
    for decode in decodes {
        decode.finish(executor);
    }
    Ok(times.iter_mut().map(|t| median(t)).zip(kernels).collect())
}

/// The median step per batch size, its affine fit and the prefill time.
fn steps_and_prefill(
    executor: &mut dyn StepExecutor,
    settings: &EngineBenchSettings,
) -> EngineResult<(Vec<EngineBenchRow>, AffineFit, PrefillResult)> {
    let vocab = executor.vocab_size();
    let step_ms = interleaved_median_step_ms(executor, settings)?;
    let rows: Vec<EngineBenchRow> = settings
        .batches
        .iter()
        .zip(step_ms)
        .map(|(&batch, (step_ms, kernels_per_step))| EngineBenchRow {
            batch,
            step_ms_median: step_ms,
            tokens_per_s: batch as f64 * 1e3 / step_ms,
            kernels_per_step,
        })
        .collect();
    // The tuner's own fit (least squares, clamped to a, c ≥ 0), so the profile it reads back
    // is the law it would have fitted online.
    let samples: Vec<(usize, f64)> = rows.iter().map(|r| (r.batch, r.step_ms_median)).collect();
    let fit = fit_latency(&samples, None).expect("at least one batch size");

    let mut prefill_times = Vec::new();
    for round in 0..3 {
        let seq = 1_000_000 + round;
        let start = Instant::now();
        executor.step(&[work(
            seq,
            filler(settings.prefill_tokens, round as usize, vocab),
        )])?;
        prefill_times.push(start.elapsed().as_secs_f64() * 1e3);
        executor.free(SeqId(seq));
    }
    let prefill_ms = median(&mut prefill_times);
    Ok((
        rows,
        AffineFit {
            a_ms: fit.a_ms,
            c_ms: fit.c_ms,
        },
        PrefillResult {
            tokens: settings.prefill_tokens,
            ms_median: prefill_ms,
            tokens_per_s: settings.prefill_tokens as f64 * 1e3 / prefill_ms,
        },
    ))
}

/// Median times of a chunk at the start of a sequence and after `chunk_context` positions
/// (fewer where the model's context is shorter), alternated over 5 rounds (the late one rolled
/// back after each).
fn chunk_early_and_late(
    executor: &mut dyn StepExecutor,
    settings: &EngineBenchSettings,
) -> EngineResult<ChunkResult> {
    let vocab = executor.vocab_size();
    let room = executor.context_length();
    let tokens = settings.chunk_tokens.min(room / 2).max(1);
    let context = settings.chunk_context.min(room.saturating_sub(tokens));
    let long = 2_000_000;
    for piece in filler(context, 7, vocab).chunks(512) {
        executor.step(&[work(long, piece.to_vec())])?;
    }
    let (mut early, mut late) = (Vec::new(), Vec::new());
    for round in 0..5 {
        let chunk = filler(tokens, 100 + round, vocab);
        let fresh = long + 1 + round as u64;
        let start = Instant::now();
        executor.step(&[work(fresh, chunk.clone())])?;
        early.push(start.elapsed().as_secs_f64() * 1e3);
        executor.free(SeqId(fresh));
        let start = Instant::now();
        executor.step(&[work(long, chunk)])?;
        late.push(start.elapsed().as_secs_f64() * 1e3);
        executor.truncate(SeqId(long), context);
    }
    executor.free(SeqId(long));
    Ok(ChunkResult::new(
        tokens,
        context,
        median(&mut early),
        median(&mut late),
    ))
}

/// Benchmarks a loaded executor; `load_peak_rss_mib` is the process's peak memory measured
/// right after loading (the steps and the bandwidth probe raise it afterwards).
pub fn run(
    executor: &mut dyn StepExecutor,
    threads: usize,
    weights: &str,
    cuda_graphs: Option<bool>,
    load_peak_rss_mib: Option<f64>,
    settings: &EngineBenchSettings,
) -> EngineResult<EngineBenchReport> {
    let (rows, fit, prefill) = steps_and_prefill(executor, settings)?;
    let chunk = chunk_early_and_late(executor, settings)?;
    let b1_ms = rows.iter().find(|r| r.batch == 1).map(|r| r.step_ms_median);
    let bound = match (executor.weight_bytes_per_step(), b1_ms) {
        (Some(bytes), Some(b1_ms)) => {
            let gb_per_s = bandwidth::read_gb_per_s(bandwidth::PROBE_BYTES, threads);
            Some(Bound::new(gb_per_s, threads, bytes, b1_ms))
        }
        _ => None,
    };
    Ok(EngineBenchReport {
        model: executor.name().to_string(),
        threads,
        weights: weights.to_string(),
        cuda_graphs,
        rows,
        fit,
        prefill,
        chunk,
        bound,
        load_peak_rss_mib,
    })
}

impl EngineBenchReport {
    pub fn markdown(&self) -> String {
        let graphs = match self.cuda_graphs {
            Some(true) => ", CUDA graphs on",
            Some(false) => ", CUDA graphs off",
            None => "",
        };
        let mut out = format!(
            "model `{}` ({} weights), {} thread(s){graphs}\n\n| batch | step ms (median) | tokens/s | kernels/step |\n|---:|---:|---:|---:|\n",
            self.model, self.weights, self.threads
        );
        for r in &self.rows {
            let kernels = r
                .kernels_per_step
                .map_or("–".to_string(), |k| k.to_string());
            out += &format!(
                "| {} | {:.2} | {:.1} | {kernels} |\n",
                r.batch, r.step_ms_median, r.tokens_per_s
            );
        }
        out += &format!(
            "\nfit: L(b) = {:.2} + {:.2}·b ms; prefill of {} tokens: {:.1} ms ({:.1} tokens/s)\n",
            self.fit.a_ms,
            self.fit.c_ms,
            self.prefill.tokens,
            self.prefill.ms_median,
            self.prefill.tokens_per_s
        );
        let c = &self.chunk;
        out += &format!(
            "a {}-token chunk: {:.2} ms at context 0, {:.2} ms after {} positions: context \
             cost {:.2e} tokens per position\n",
            c.tokens, c.early_ms_median, c.late_ms_median, c.context, c.context_cost
        );
        if let Some(mib) = self.load_peak_rss_mib {
            out += &format!("loading: peak resident memory {mib:.0} MiB\n");
        }
        if let Some(b) = &self.bound {
            out += &format!(
                "bound: {:.1} MB of weight matrices per step / {:.1} GB/s read bandwidth ({} \
                 thread(s), best of 5 passes over 1 GiB) = {:.2} ms; the B = 1 step runs at \
                 {:.0} % of it\n",
                b.weight_bytes as f64 / 1e6,
                b.read_gb_per_s,
                b.probe_threads,
                b.bound_ms,
                100.0 * b.fraction_of_bound
            );
        }
        out
    }
}

/// One model's decode step time alone, alternating with another model's steps on one thread
/// (as `lockstep` runs them: each step finds the other's weights in the caches), and while
/// the other steps beside it.
#[derive(Debug, Clone, Serialize)]
pub struct ConcurrentRow {
    pub model: String,
    pub threads: usize,
    pub batch: usize,
    pub alone_ms_median: f64,
    pub alternating_ms_median: f64,
    pub together_ms_median: f64,
    /// together / alone.
    pub slowdown: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ConcurrentReport {
    pub rows: Vec<ConcurrentRow>,
}

/// Per batch size: each model's median step alone, then the two models stepping in turn, then
/// both stepping at once on their own threads (each keeps stepping until both have `steps`
/// timed steps, so every timed step overlaps the other model's work).
pub fn concurrent(
    models: [(&mut dyn StepExecutor, usize); 2],
    settings: &EngineBenchSettings,
) -> EngineResult<ConcurrentReport> {
    let [(a, a_threads), (b, b_threads)] = models;
    let mut rows = Vec::new();
    for &batch in &settings.batches {
        let mut alone = [0f64; 2];
        for (slot, executor) in alone.iter_mut().zip([&mut *a, &mut *b]) {
            let mut decode = DecodeBatch::start(executor, 0, batch, settings.context)?;
            *slot = decode.median_step_ms(executor, settings.steps)?;
            decode.finish(executor);
        }
        let alternating = {
            let mut decodes = [
                DecodeBatch::start(&mut *a, 0, batch, settings.context)?,
                DecodeBatch::start(&mut *b, 0, batch, settings.context)?,
            ];
            let mut times = [Vec::new(), Vec::new()];
            for _ in 0..settings.steps {
                times[0].push(decodes[0].step(&mut *a)?);
                times[1].push(decodes[1].step(&mut *b)?);
            }
            let [decode_a, decode_b] = decodes;
            decode_a.finish(&mut *a);
            decode_b.finish(&mut *b);
            times.map(|mut t| median(&mut t))
        };
        let finished = AtomicUsize::new(0);
        let together = std::thread::scope(|scope| {
            let handles = [&mut *a, &mut *b].map(|executor| {
                let finished = &finished;
                scope.spawn(move || -> EngineResult<f64> {
                    let mut decode = DecodeBatch::start(executor, 0, batch, settings.context)?;
                    let mut times = Vec::new();
                    while times.len() < settings.steps || finished.load(Ordering::SeqCst) < 2 {
                        times.push(decode.step(executor)?);
                        if times.len() == settings.steps {
                            finished.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    decode.finish(executor);
                    Ok(median(&mut times))
                })
            });
            handles.map(|h| h.join().expect("a bench thread panicked"))
        });
        let [a_ms, b_ms] = together;
        let together = [a_ms?, b_ms?];
        for (i, (executor, threads)) in [(&*a, a_threads), (&*b, b_threads)].into_iter().enumerate()
        {
            let together_ms = together[i];
            rows.push(ConcurrentRow {
                model: executor.name().to_string(),
                threads,
                batch,
                alone_ms_median: alone[i],
                alternating_ms_median: alternating[i],
                together_ms_median: together_ms,
                slowdown: together_ms / alone[i],
            });
        }
    }
    Ok(ConcurrentReport { rows })
}

impl ConcurrentReport {
    pub fn markdown(&self) -> String {
        let mut out = String::from(
            "| model | threads | batch | step ms alone | alternating with the other | beside the other | slowdown |\n|---|---:|---:|---:|---:|---:|---:|\n",
        );
        for r in &self.rows {
            out += &format!(
                "| {} | {} | {} | {:.2} | {:.2} | {:.2} | {:.2}× |\n",
                r.model,
                r.threads,
                r.batch,
                r.alone_ms_median,
                r.alternating_ms_median,
                r.together_ms_median,
                r.slowdown
            );
        }
        out
    }
}

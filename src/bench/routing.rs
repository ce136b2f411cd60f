//! `bench routing`: closed-loop clients (N workers, each sends its next request when the
//! previous one ends) against the runtime in each execution mode and against the reference
//! model alone, modes interleaved round by round in one run (each round starting one mode
//! later) so their ratios share the machine's conditions. Each cell also reports what the Markov model predicts from the
//! routing measured in that cell, with L(b) fitted to the cell's steps and with L(b) from
//! the models' step profiles; token timings (TTFT, inter-token gaps); the prefix cache's
//! share of positions; with `--long-prompt`, how much one long prompt arriving mid-cell
//! stretches the other requests' inter-token gaps; and with `--json-schema`, each cell again
//! with every request held to a schema, beside it, and what the masks cost a step.

use super::median;
use super::remote;
use super::soak::quantile;
use super::std_serving::{self, Breakdown};
use super::workloads::{self, Workload};
use serde::Serialize;
use std::cell::RefCell;
use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokenrouter::config::{Config, ExecutionMode, PolicyConfig, StepCost};
use tokenrouter::constraint::OutputFormat;
use tokenrouter::engine::SamplingParams;
use tokenrouter::runtime::{
    GenerateRequest, ModelSnapshot, Prompt, RequestEvent, RequestHandle, RoutingStats, Runtime,
    RuntimeError, StepInterval,
};
use tokenrouter::tuning::controller::ArmComparison;
use tokenrouter::tuning::online::fit_request_latency;
use tokenrouter::tuning::{predict, AffineLatency, DtmcModel};

/// Time grid of the per-cell predictions (as the online tuner).
const PREDICTION_DELTA_MS: f64 = 0.5;

/// What a cell runs: the runtime in one execution mode, or the reference model alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BenchMode {
    Runtime(ExecutionMode),
    /// The runtime in that mode with the reference model in a `tokenrouter worker` process,
    /// over a NATS server the bench starts (`<mode>-remote`).
    Remote(ExecutionMode),
    /// The reference model serves every token (`async` runtime, its `single` policy).
    LlmOnly,
    /// Single-model servers and an external per-token dispatcher (`std_serving`).
    StdServing,
}

impl BenchMode {
    pub fn as_str(self) -> &'static str {
        match self {
            BenchMode::Runtime(mode) => mode.as_str(),
            BenchMode::Remote(ExecutionMode::Lockstep) => "lockstep-remote",
            BenchMode::Remote(ExecutionMode::Standard) => "standard-remote",
            BenchMode::Remote(ExecutionMode::Async) => "async-remote",
            BenchMode::Remote(ExecutionMode::Tokenrouter) => "tokenrouter-remote",
            BenchMode::LlmOnly => "llm-only",
            BenchMode::StdServing => "std-serving",
        }
    }

    /// This mode and, for a runtime mode, its `-remote` twin (`--placement remote`).
    pub fn with_remote_twin(self) -> Vec<BenchMode> {
        match self {
            BenchMode::Runtime(mode) => vec![self, BenchMode::Remote(mode)],
            other => vec![other],
        }
    }

    /// The runtime this mode's cells run on; none for `std-serving` (its own servers).
    fn execution_mode(self) -> Option<ExecutionMode> {
        match self {
            BenchMode::Runtime(mode) | BenchMode::Remote(mode) => Some(mode),
            BenchMode::LlmOnly => Some(ExecutionMode::Async),
            BenchMode::StdServing => None,
        }
    }
}

impl std::str::FromStr for BenchMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "llm-only" => Ok(BenchMode::LlmOnly),
            "std-serving" => Ok(BenchMode::StdServing),
            other if other.ends_with("-remote") => other
                .trim_end_matches("-remote")
                .parse()
                .map(BenchMode::Remote)
                .map_err(|e| format!("{e} (before -remote)")),
            other => other
                .parse()
                .map(BenchMode::Runtime)
                .map_err(|e| format!("{e}, llm-only, std-serving or <mode>-remote")),
        }
    }
}

pub struct RoutingBenchSettings {
    /// The config's file: `std-serving` starts its single-model servers from it.
    pub config_path: PathBuf,
    pub policies: Vec<String>,
    /// A threshold sweep: variants `name@value` of one configured policy.
    pub sweep: Option<(String, Vec<f32>)>,
    /// The model whose greedy output, served alone, is the quality reference.
    pub reference: String,
    pub modes: Vec<BenchMode>,
    pub concurrency: Vec<usize>,
    pub requests: usize,
    pub max_tokens: usize,
    pub rounds: usize,
    pub workload: Workload,
    /// Tokens of one extra prompt sent into each cell once its requests decode.
    pub long_prompt: Option<usize>,
    /// Price the profile prediction with step profiles measured in this process just before
    /// and after each cell instead of the configured ones.
    pub profile_steps: bool,
    /// Every cell runs twice, its requests unconstrained and held to this format.
    pub constraint: Option<OutputFormat>,
}

/// A step profile measured around a cell.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct MeasuredProfile {
    pub a_ms: f64,
    pub c_ms: f64,
    pub prefill_ms_per_token: f64,
}

impl MeasuredProfile {
    fn mean(before: StepCost, after: StepCost) -> Self {
        let mid = |x: f64, y: f64| (x + y) / 2.0;
        let per_token = |c: StepCost| c.prefill_ms_per_token.unwrap_or(0.0);
        Self {
            a_ms: mid(before.a_ms, after.a_ms),
            c_ms: mid(before.c_ms, after.c_ms),
            prefill_ms_per_token: mid(per_token(before), per_token(after)),
        }
    }

    fn cost(self) -> StepCost {
        StepCost {
            a_ms: self.a_ms,
            c_ms: self.c_ms,
            prefill_ms_per_token: Some(self.prefill_ms_per_token),
        }
    }
}

/// One model's share of a cell.
#[derive(Debug, Clone, Serialize)]
pub struct ModelCell {
    pub model: String,
    pub steps: u64,
    pub mean_batch: f64,
    /// Tokens the model's steps appended (decode rows, catch-ups, prompt chunks): the work
    /// beside the rows, which modes that share a prefix cache differently spend apart.
    pub tokens_processed: u64,
    pub admission_delay_ms_mean: f64,
    /// Share of the cell's time the model spent stepping.
    pub busy_share: f64,
    pub step_ms_mean: f64,
    /// Median time of the steps that decoded exactly N rows (the cell's concurrency) and
    /// appended nothing else: the step to compare with and without constraints.
    pub full_batch_step_ms: Option<f64>,
    /// The same steps priced by the step costs of the profile prediction (a + c·rows, and
    /// each further token at the prefill rate): how far the model ran from its profile.
    pub profile_step_ms_mean: Option<f64>,
    /// The model actor's own time per step (scheduling it, applying its results), mean;
    /// `None` for a model another process runs.
    pub host_ms_mean: Option<f64>,
    /// Median time from one step's end to the next one's start: the host time, the batcher's
    /// round trip, and any wait for work or for a batch to fill.
    pub step_gap_ms_median: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct RoutingBenchRow {
    /// With `+schema` when the requests were held to the `--json-schema` format.
    pub policy: String,
    pub constrained: bool,
    pub workload: Workload,
    pub mode: &'static str,
    pub concurrency: usize,
    pub round: usize,
    pub completed: usize,
    pub failed: usize,
    pub output_tokens: usize,
    pub seconds: f64,
    pub tokens_per_s: f64,
    /// Committed tokens per second while every client had a request in flight (from the
    /// first submission to the last): the closed system of N requests the Markov model
    /// describes, without the cell's drain, when fewer remain. None when the cell has no
    /// more requests than clients.
    pub all_in_flight_tokens_per_s: Option<f64>,
    /// The Markov model's throughput for this cell's measured routing, with L(b) fitted to
    /// the cell's steps (over the tokens they appended, see `fit_request_latency`), for the
    /// requests decoding on average: N less the share of request time before the first
    /// token (queueing and prefill, which the model does not describe); none for `lockstep`,
    /// which it does not model.
    pub predicted_tokens_per_s: Option<f64>,
    /// The same with L(b) from the models' step profiles (as `tokenrouter tune` uses them),
    /// each prompt or catch-up token beyond a request step's first priced at the profile's
    /// prefill rate.
    pub predicted_from_profiles_tokens_per_s: Option<f64>,
    /// With `--profile-steps`: the profiles that prediction used, by model (the mean of
    /// those measured before and after the cell).
    pub measured_profiles: Option<Vec<(String, MeasuredProfile)>>,
    pub handoffs_per_100_tokens: f64,
    /// Share of output tokens each model wrote, by model name.
    pub token_share: Vec<(String, f64)>,
    /// Position-wise agreement with the reference model serving alone, greedy; none for
    /// simulated models (their tokens mean nothing).
    pub agreement_with_reference: Option<f64>,
    pub ttft_ms_median: f64,
    pub ttft_ms_p99: f64,
    /// Gaps between consecutive tokens of a request.
    pub itl_ms_median: f64,
    pub itl_ms_p99: f64,
    pub latency_ms_median: f64,
    /// Per model: the share of its positions taken from the prefix cache.
    pub prefix_cached_share: Vec<(String, f64)>,
    /// With `--long-prompt`: the largest gap of the other requests while the long prompt
    /// was prefilled, over their median gap.
    pub long_prompt_gap_ratio: Option<f64>,
    /// The same over an equally long stretch after the long prompt's request ended (cut at
    /// the cell's end): the gaps the requests see without it (waits for another model's
    /// step, in the routed modes). The stretch before it would hold the cell's start, where
    /// every request's first catch-up runs.
    pub gap_ratio_after_long_prompt: Option<f64>,
    /// `tokenrouter` mode: the tuner's eager check at the cell's end (each arm's smoothed
    /// tokens/s and the arm in force).
    pub controller: Option<ArmComparison>,
    pub per_model: Vec<ModelCell>,
    /// `std-serving`: where the dispatcher's time per token went.
    pub std_serving_breakdown: Option<Breakdown>,
    /// `<mode>-remote`: the bus's ping round trip to the remote model during the cell,
    /// median and p99 in µs (what a handoff to the other process adds).
    pub bus_round_trip_us: Option<(f64, f64)>,
    /// `<mode>-remote`: one-way transit of the handoffs the remote model sent back to this
    /// process over the bus, median and p99 in µs.
    pub handoff_transit_us: Option<(f64, f64)>,
    /// A hash of every request's output tokens in request order: two cells of one run with
    /// equal digests produced identical tokens.
    pub outputs_digest: String,
}

/// The runtime's cumulative counters at one instant.
struct Snapshot {
    at: Instant,
    steps: Vec<u64>,
    rows: Vec<u64>,
    chunked_rows: Vec<u64>,
    admission_us: Vec<u64>,
    admissions: Vec<u64>,
    routed: Vec<Vec<u64>>,
    committed: Vec<Vec<u64>>,
    tokens_processed: Vec<u64>,
    hit_tokens: Vec<u64>,
}

impl Snapshot {
    fn take(runtime: &Runtime) -> Self {
        let snapshot = runtime.snapshot();
        let each = |f: fn(&ModelSnapshot) -> u64| snapshot.models.iter().map(f).collect();
        let (routed, committed) = snapshot.routing_counts();
        Self {
            at: Instant::now(),
            steps: each(|m| m.steps),
            rows: each(|m| m.rows_stepped),
            chunked_rows: each(|m| m.chunked_rows),
            admission_us: each(|m| m.admission_delay_total.as_micros() as u64),
            admissions: each(|m| m.admissions),
            routed,
            committed,
            tokens_processed: each(|m| m.tokens_processed),
            hit_tokens: each(|m| m.prefix_cache.hit_tokens),
        }
    }
}

/// `model`'s logged steps that started at or after `since` (the log keeps the most recent
/// steps), as (rows, tokens, ms).
fn cell_steps(model: &ModelSnapshot, since: Instant) -> Vec<(usize, usize, f64)> {
    cell_intervals(model, since)
        .map(|s| s.request_sample())
        .collect()
}

fn cell_intervals(model: &ModelSnapshot, since: Instant) -> impl Iterator<Item = &StepInterval> {
    model.recent_steps.iter().filter(move |s| s.start >= since)
}

/// The mean host time per step and the median gap between steps (see `ModelCell`).
fn host_and_gaps(model: &ModelSnapshot, since: Instant) -> (Option<f64>, Option<f64>) {
    let intervals: Vec<&StepInterval> = cell_intervals(model, since).collect();
    let host: Vec<f64> = intervals
        .iter()
        .filter_map(|s| s.host)
        .map(|d| d.as_secs_f64() * 1e3)
        .collect();
    let mut gaps: Vec<f64> = intervals
        .windows(2)
        .map(|w| w[1].start.saturating_duration_since(w[0].end).as_secs_f64() * 1e3)
        .collect();
    let host_mean = (!host.is_empty()).then(|| host.iter().sum::<f64>() / host.len() as f64);
    (host_mean, (!gaps.is_empty()).then(|| median(&mut gaps)))
}

/// Per-model batch sizes, admission delays and step times between two snapshots; `costs`
/// prices the steps as the profile prediction does.
fn model_cells(
    runtime: &Runtime,
    names: &[String],
    (before, after): (&Snapshot, &Snapshot),
    costs: &[Option<StepCost>],
    concurrency: usize,
) -> Vec<ModelCell> {
    let snapshot = runtime.snapshot();
    let seconds = (after.at - before.at).as_secs_f64();
    names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let steps = after.steps[i] - before.steps[i];
            let (host_ms_mean, step_gap_ms_median) = host_and_gaps(&snapshot.models[i], before.at);
            let admissions = (after.admissions[i] - before.admissions[i]).max(1);
            let logged = cell_steps(&snapshot.models[i], before.at);
            let mean = |f: &dyn Fn(&(usize, usize, f64)) -> f64| {
                logged.iter().map(f).fold(0.0, |sum, x| sum + x) / logged.len().max(1) as f64
            };
            let step_ms_mean = mean(&|&(_, _, ms)| ms);
            let mut full_batch: Vec<f64> = logged
                .iter()
                .filter(|&&(rows, tokens, _)| rows == concurrency && tokens == rows)
                .map(|&(_, _, ms)| ms)
                .collect();
            let profile_step_ms_mean = costs.get(i).copied().flatten().map(|cost| {
                mean(&|&(rows, tokens, _)| {
                    cost.a_ms
                        + cost.c_ms * rows as f64
                        + cost.prefill_ms_per_token.unwrap_or(0.0)
                            * tokens.saturating_sub(rows) as f64
                })
            });
            ModelCell {
                model: name.clone(),
                steps,
                mean_batch: (after.rows[i] - before.rows[i]) as f64 / steps.max(1) as f64,
                tokens_processed: after.tokens_processed[i] - before.tokens_processed[i],
                admission_delay_ms_mean: (after.admission_us[i] - before.admission_us[i]) as f64
                    / admissions as f64
                    / 1e3,
                busy_share: step_ms_mean * steps as f64 / 1e3 / seconds.max(1e-9),
                step_ms_mean,
                full_batch_step_ms: (!full_batch.is_empty()).then(|| median(&mut full_batch)),
                profile_step_ms_mean: (steps > 0).then_some(profile_step_ms_mean).flatten(),
                host_ms_mean,
                step_gap_ms_median,
            }
        })
        .collect()
}

/// The cell's routing: the models it visited, their routing matrix and commits per
/// transition, from its route decisions.
struct CellRouting {
    visited: Vec<usize>,
    routing: Vec<Vec<f64>>,
    commits: Vec<Vec<f64>>,
}

fn cell_routing(before: &Snapshot, after: &Snapshot) -> Option<CellRouting> {
    let m = before.routed.len();
    let delta = |a: &[Vec<u64>], b: &[Vec<u64>], i: usize, j: usize| (a[i][j] - b[i][j]) as f64;
    let visited: Vec<usize> = (0..m)
        .filter(|&i| (0..m).any(|j| after.routed[i][j] > before.routed[i][j]))
        .collect();
    if visited.is_empty() {
        return None;
    }
    let mut routing = Vec::new();
    let mut commits = Vec::new();
    for &i in &visited {
        let total: f64 = visited
            .iter()
            .map(|&j| delta(&after.routed, &before.routed, i, j))
            .sum();
        routing.push(
            visited
                .iter()
                .map(|&j| delta(&after.routed, &before.routed, i, j) / total)
                .collect(),
        );
        commits.push(
            visited
                .iter()
                .map(|&j| {
                    let steps = delta(&after.routed, &before.routed, i, j);
                    let tokens = delta(&after.committed, &before.committed, i, j);
                    if steps > 0.0 {
                        tokens / steps
                    } else {
                        0.0
                    }
                })
                .collect(),
        );
    }
    Some(CellRouting {
        visited,
        routing,
        commits,
    })
}

/// Where the cell's L(b) comes from.
enum LatencySource<'a> {
    /// Fitted to the cell's own steps.
    CellSteps,
    /// The models' configured step costs.
    Profiles(&'a [Option<StepCost>]),
}

/// The Markov model's throughput for the cell with `decoding` requests on average (between
/// whole counts, interpolated).
fn predicted(
    runtime: &Runtime,
    mode: BenchMode,
    decoding: f64,
    timeout: Duration,
    (before, after): (&Snapshot, &Snapshot),
    source: LatencySource,
) -> Option<f64> {
    if mode == BenchMode::Runtime(ExecutionMode::Lockstep) {
        return None;
    }
    let CellRouting {
        visited,
        routing,
        commits,
    } = cell_routing(before, after)?;
    // The model's request steps are the rows that yield a candidate; a row that appends only
    // a chunk of its prompt or catch-up is not one, so every row's tokens are priced on them.
    let completing = |i: usize| {
        let rows = after.rows[i] - before.rows[i];
        let chunked = after.chunked_rows[i] - before.chunked_rows[i];
        rows.saturating_sub(chunked).max(1) as f64
    };
    let latency = match source {
        LatencySource::CellSteps => {
            let snapshot = runtime.snapshot();
            visited
                .iter()
                .map(|&i| {
                    let samples = cell_steps(&snapshot.models[i], before.at);
                    let rows = (after.rows[i] - before.rows[i]).max(1) as f64;
                    fit_request_latency(&samples, None, completing(i) / rows)
                })
                .collect::<Option<Vec<_>>>()?
        }
        LatencySource::Profiles(costs) => visited
            .iter()
            .map(|&i| {
                let cost = costs.get(i).copied().flatten()?;
                let steps = completing(i);
                let tokens = (after.tokens_processed[i] - before.tokens_processed[i]) as f64;
                let extra_per_step = (tokens - steps).max(0.0) / steps;
                Some(AffineLatency {
                    a_ms: cost.a_ms,
                    c_ms: cost.c_ms + cost.prefill_ms_per_token.unwrap_or(0.0) * extra_per_step,
                })
            })
            .collect::<Option<Vec<_>>>()?,
    };
    let delayed = mode == BenchMode::Runtime(ExecutionMode::Tokenrouter);
    let all_thresholds = runtime.thresholds();
    let thresholds: Vec<usize> = visited
        .iter()
        .map(|&i| if delayed { all_thresholds[i] } else { 1 })
        .collect();
    let model = DtmcModel {
        routing,
        commits,
        latency,
        delta_ms: PREDICTION_DELTA_MS,
        timeout_ms: vec![delayed.then_some(timeout.as_secs_f64() * 1e3); visited.len()],
    };
    let at = |n: usize| {
        let thresholds: Vec<usize> = thresholds.iter().map(|&t| t.min(n)).collect();
        predict(&model, n, &thresholds).ok().map(|p| p.throughput)
    };
    let below = decoding.floor().max(1.0);
    let fraction = (decoding - below).clamp(0.0, 1.0);
    let low = at(below as usize)?;
    if fraction == 0.0 {
        return Some(low);
    }
    let high = at(below as usize + 1).unwrap_or(low);
    Some(low + (high - low) * fraction)
}

/// A cell's requests as their clients saw them.
#[derive(Default)]
pub(super) struct Tally {
    completed: usize,
    pub failed: usize,
    pub tokens: usize,
    handoffs: usize,
    tokens_per_model: Vec<usize>,
    /// Output tokens by request index.
    outputs: Vec<(usize, Vec<u32>)>,
    ttft_ms: Vec<f64>,
    latency_ms: Vec<f64>,
    /// Every inter-token gap: when it ended, and its length in ms.
    gaps: Vec<(Instant, f64)>,
    /// When each request was submitted, and when each token arrived.
    submitted: Vec<Instant>,
    token_times: Vec<Instant>,
    /// When the long prompt was sent and when its request ended.
    long_prompt_window: Option<(Instant, Instant)>,
    /// The long prompt's request ended (finished or failed).
    long_prompt_done: bool,
}

impl Tally {
    /// Request `i`, sent at `sent` and ended at `ended`, completed with `f`.
    pub fn record(&mut self, i: usize, sent: Instant, ended: Instant, f: Followed) {
        self.completed += 1;
        self.submitted.push(sent);
        self.token_times.extend_from_slice(&f.times);
        self.tokens += f.tokens.len();
        self.handoffs += f.routing.handoffs;
        let models = f.routing.tokens_per_model.len();
        if self.tokens_per_model.len() < models {
            self.tokens_per_model.resize(models, 0);
        }
        for (sum, n) in self
            .tokens_per_model
            .iter_mut()
            .zip(&f.routing.tokens_per_model)
        {
            *sum += n;
        }
        let first = f.times.first().copied().unwrap_or(ended);
        self.ttft_ms.push((first - sent).as_secs_f64() * 1e3);
        self.latency_ms.push((ended - sent).as_secs_f64() * 1e3);
        for pair in f.times.windows(2) {
            self.gaps
                .push((pair[1], (pair[1] - pair[0]).as_secs_f64() * 1e3));
        }
        self.outputs.push((i, f.tokens));
    }

    /// The share of its requests' time spent after their first token: before it a request
    /// queues and prefills, which the Markov model (every request decoding) does not
    /// describe. 1 without any request.
    fn decoding_share(&self) -> f64 {
        let total: f64 = self.latency_ms.iter().sum();
        let before_first: f64 = self.ttft_ms.iter().sum();
        if total > 0.0 {
            (1.0 - before_first / total).clamp(0.0, 1.0)
        } else {
            1.0
        }
    }

    /// Request sent at `sent` failed.
    pub fn fail(&mut self, sent: Instant) {
        self.failed += 1;
        self.submitted.push(sent);
    }

    /// Tokens per second between the first submission and the last (see
    /// `RoutingBenchRow::all_in_flight_tokens_per_s`).
    fn all_in_flight_tokens_per_s(&self) -> Option<f64> {
        let first = self.submitted.iter().min()?;
        let last = self.submitted.iter().max()?;
        let tokens = self
            .token_times
            .iter()
            .filter(|&&at| at >= *first && at <= *last)
            .count();
        let seconds = (*last - *first).as_secs_f64();
        (tokens > 0 && seconds > 0.0).then(|| tokens as f64 / seconds)
    }
}

/// One request's tokens with their arrival times.
#[derive(Clone, Default)]
pub(super) struct Followed {
    pub tokens: Vec<u32>,
    /// The model that wrote each token.
    pub writers: Vec<usize>,
    pub routing: RoutingStats,
    pub times: Vec<Instant>,
}

/// Reads a request's events to its end, timing each token.
pub(super) async fn follow(mut handle: RequestHandle) -> Result<Followed, RuntimeError> {
    let (mut tokens, mut writers, mut times) = (Vec::new(), Vec::new(), Vec::new());
    while let Some(event) = handle.events.recv().await {
        match event {
            RequestEvent::Token { id, model, .. } => {
                tokens.push(id);
                writers.push(model);
                times.push(Instant::now());
            }
            RequestEvent::Finished { stats, .. } => {
                return Ok(Followed {
                    tokens,
                    writers,
                    routing: stats,
                    times,
                })
            }
            RequestEvent::Failed { message, kind } => {
                return Err(RuntimeError::failed(kind, message))
            }
        }
    }
    Err(RuntimeError::Disconnected)
}

/// A prompt of `tokens` tokens made of the workload's prompts (in the first model's
/// vocabulary), for the long-prompt probe.
fn long_prompt(prompts: &[Prompt], tokens: usize) -> Prompt {
    prompts
        .iter()
        .rev()
        .flat_map(Prompt::tokens)
        .copied()
        .cycle()
        .take(tokens)
        .collect::<Vec<u32>>()
        .into()
}

/// The largest gap ending while the long prompt ran, and the largest ending in an equally
/// long stretch after it, each over the median of all gaps.
fn long_prompt_gap_ratios(tally: &Tally) -> Option<(f64, f64)> {
    let (start, end) = tally.long_prompt_window?;
    let mut all: Vec<f64> = tally.gaps.iter().map(|&(_, ms)| ms).collect();
    if all.is_empty() {
        return None;
    }
    let typical = median(&mut all);
    let largest = |from: Instant, to: Instant| {
        tally
            .gaps
            .iter()
            .filter(|&&(at, _)| at > from && at <= to)
            .map(|&(_, ms)| ms)
            .fold(0.0, f64::max)
            / typical
    };
    Some((largest(start, end), largest(end, end + (end - start))))
}

/// Fraction of the reference's positions where `output` has the same token.
fn agreement(output: &[u32], reference: &[u32]) -> f64 {
    if reference.is_empty() {
        return 1.0;
    }
    let same = output.iter().zip(reference).filter(|(a, b)| a == b).count();
    same as f64 / reference.len() as f64
}

/// Starts `request`, held to `format` when given.
fn start(
    runtime: &Runtime,
    request: GenerateRequest,
    format: Option<&OutputFormat>,
) -> Result<RequestHandle, RuntimeError> {
    let request = runtime.validate(request)?;
    let request = match format {
        Some(format) => runtime.constrain(request, runtime.compile(format)?)?,
        None => request,
    };
    Ok(runtime.launch(request))
}

async fn closed_loop(
    runtime: Rc<Runtime>,
    prompts: Rc<Vec<Prompt>>,
    policy: &str,
    concurrency: usize,
    settings: &RoutingBenchSettings,
    constrained: bool,
) -> Tally {
    let format: Rc<Option<OutputFormat>> =
        Rc::new(settings.constraint.clone().filter(|_| constrained));
    // A grammar ends its output with end-of-sequence.
    let ignore_eos = settings.workload.ignores_eos() && format.is_none();
    let tally = Rc::new(RefCell::new(Tally::default()));
    let request =
        move |prompt: Prompt, policy: &str, max_tokens: usize, seed: u64| GenerateRequest {
            prompt,
            policy: Some(policy.to_string()),
            max_tokens,
            sampling: SamplingParams {
                seed,
                ..SamplingParams::greedy()
            },
            timeout: None,
            ignore_eos,
        };
    // Once every worker's request decodes, one long prompt arrives beside them.
    let long_prompt_worker = settings.long_prompt.map(|length| {
        let (runtime, tally, policy) = (runtime.clone(), tally.clone(), policy.to_string());
        let prompt = long_prompt(&prompts, length);
        actix_rt::spawn(async move {
            while tally.borrow().gaps.len() < 4 * concurrency {
                actix_rt::time::sleep(Duration::from_millis(2)).await;
            }
            let sent = Instant::now();
            if let Ok(handle) = runtime.submit(request(prompt, &policy, 1, 0)) {
                let _ = follow(handle).await;
                tally.borrow_mut().long_prompt_window = Some((sent, Instant::now()));
            }
            tally.borrow_mut().long_prompt_done = true;
        })
    });
    // With a long prompt, requests keep coming until the stretch after it (as long as it
    // ran) has passed, so that stretch sees as many decoding requests as the prompt did.
    let (requests, window_tally) = (settings.requests, tally.clone());
    let with_long_prompt = settings.long_prompt.is_some();
    let more = move |i: usize| {
        let t = window_tally.borrow();
        i < requests
            || with_long_prompt
                && t.long_prompt_window
                    .map_or(!t.long_prompt_done, |(start, end)| {
                        Instant::now() < end + (end - start)
                    })
    };
    let policy: Rc<str> = policy.into();
    let (job_tally, max_tokens) = (tally.clone(), settings.max_tokens);
    super::for_each_closed_loop_while(concurrency, more, move |i| {
        let (runtime, prompts, tally, policy, format) = (
            runtime.clone(),
            prompts.clone(),
            job_tally.clone(),
            policy.clone(),
            format.clone(),
        );
        async move {
            let prompt = prompts[i % prompts.len()].clone();
            let sent = Instant::now();
            let request = request(prompt, &policy, max_tokens, i as u64);
            let result = match start(&runtime, request, format.as_ref().as_ref()) {
                Ok(handle) => follow(handle).await,
                Err(e) => Err(e),
            };
            let ended = Instant::now();
            let mut t = tally.borrow_mut();
            match result {
                Ok(f) => t.record(i, sent, ended, f),
                Err(_) => t.fail(sent),
            }
        }
    })
    .await;
    if let Some(worker) = long_prompt_worker {
        let _ = worker.await;
    }
    Rc::try_unwrap(tally)
        .ok()
        .expect("workers finished")
        .into_inner()
}

/// Adds the sweep's `name@value` variants to a copy of the config.
fn with_sweep(
    config: &Config,
    settings: &RoutingBenchSettings,
) -> Result<(Config, Vec<String>), RuntimeError> {
    let mut config = config.clone();
    let mut policies = settings.policies.clone();
    if let Some(sweep) = &settings.sweep {
        policies.extend(add_threshold_variants(&mut config, sweep)?);
    }
    Ok((config, policies))
}

/// Adds a `name@value` copy of policy `name` per threshold value to `config`; their names.
pub(super) fn add_threshold_variants(
    config: &mut Config,
    (name, values): &(String, Vec<f32>),
) -> Result<Vec<String>, RuntimeError> {
    let base = config
        .policies
        .iter()
        .find(|p| &p.name == name)
        .cloned()
        .ok_or_else(|| RuntimeError::UnknownPolicy(name.clone()))?;
    let mut names = Vec::with_capacity(values.len());
    for v in values {
        let variant = format!("{name}@{v}");
        config.policies.push(PolicyConfig {
            name: variant.clone(),
            threshold: Some(*v),
            ..base.clone()
        });
        names.push(variant);
    }
    Ok(names)
}

/// Runs every (round, policy, concurrency, mode) cell; one runtime per mode (and the
/// single-model servers of `std-serving`), started once.
pub async fn run(
    config: &Config,
    settings: &RoutingBenchSettings,
) -> anyhow::Result<Vec<RoutingBenchRow>> {
    let (config, policies) = with_sweep(config, settings)?;
    let timeout = Duration::from_millis(config.runtime.batch_timeout_ms);
    let costs = config.step_costs()?;
    let mut runtimes = Vec::new();
    let mut bus = None;
    for &mode in &settings.modes {
        let runtime = match mode {
            BenchMode::Remote(execution) => {
                let bus = match &mut bus {
                    Some(bus) => bus,
                    None => bus.insert(remote::Bus::start()?),
                };
                let remote = bus.host(
                    &settings.config_path,
                    &config,
                    &settings.reference,
                    execution,
                )?;
                Runtime::start(&remote, Some(execution))?
            }
            other => match other.execution_mode() {
                Some(execution) => Runtime::start(&config, Some(execution))?,
                None => continue,
            },
        };
        runtimes.push((mode, Rc::new(runtime)));
    }
    // Policies, prompts and the reference come from a runtime of their own: the reference run
    // leaves each round's prompts in its prefix caches, and a measured mode sharing them ran
    // its cells on prefilled prompts (dense pair: that mode 1.09-1.14x the other).
    let first = Rc::new(Runtime::start(&config, Some(ExecutionMode::Async))?);
    let registry = first.policies();
    if let Some(unknown) = policies.iter().find(|p| registry.get(p).is_none()) {
        return Err(RuntimeError::UnknownPolicy(unknown.clone()).into());
    }
    let names: Vec<String> = first.model_names().iter().map(|n| n.to_string()).collect();
    if registry.get(&settings.reference).is_none() {
        return Err(RuntimeError::UnknownPolicy(settings.reference.clone()).into());
    }
    if settings.constraint.is_some() {
        if let Some(mode) = settings
            .modes
            .iter()
            .find(|m| matches!(m, BenchMode::StdServing | BenchMode::Remote(_)))
        {
            anyhow::bail!(
                "--json-schema: mode {} cannot constrain its requests (single-model servers \
                 and models in other processes take no grammar)",
                mode.as_str()
            );
        }
    }
    let servers = if settings.modes.contains(&BenchMode::StdServing) {
        first.tokenizer().map_err(|_| {
            anyhow::anyhow!("std-serving needs models with a tokenizer (real weights)")
        })?;
        for policy in &policies {
            let shared = registry.get(policy).expect("checked above");
            if let Some(why) = std_serving::unsupported(&shared) {
                anyhow::bail!("std-serving: {why}");
            }
        }
        Some(Arc::new(std_serving::Servers::start(
            &settings.config_path,
            &config,
        )?))
    } else {
        None
    };
    let mut profiler = if settings.profile_steps {
        Some(super::engine::Profiler::load(&config)?)
    } else {
        None
    };
    let mut rows = Vec::new();
    for round in 0..settings.rounds {
        // The last profiles measured, while nothing has run since: the next cell's "before".
        let mut fresh_profiles: Option<Vec<Option<StepCost>>> = None;
        let prompts = Rc::new(workloads::prompts(&first, settings.workload, round)?);
        // The reference's greedy outputs for this round's prompts (batched steps give the
        // tokens of unbatched ones, so it runs at the largest concurrency). Agreement is by
        // position and token id: none across vocabularies.
        let mut reference = if first.tokenizer().is_ok() && !first.has_several_vocabularies() {
            let n = settings.concurrency.iter().copied().max().unwrap_or(1);
            closed_loop(
                first.clone(),
                prompts.clone(),
                &settings.reference,
                n,
                settings,
                false,
            )
            .await
            .outputs
        } else {
            Vec::new()
        };
        reference.sort();
        for policy in &policies {
            for &concurrency in &settings.concurrency {
                // Each round starts one cell later, so no cell always follows the same one.
                let variants: &[bool] = match settings.constraint {
                    Some(_) => &[false, true],
                    None => &[false],
                };
                let mut order: Vec<(BenchMode, bool)> = settings
                    .modes
                    .iter()
                    .flat_map(|&mode| variants.iter().map(move |&c| (mode, c)))
                    .collect();
                let cells = order.len();
                order.rotate_left(round % cells);
                for (mode, constrained) in order {
                    let cell = CellId {
                        policy,
                        mode,
                        concurrency,
                        round,
                        constrained,
                    };
                    // The reference wrote unconstrained text: no agreement to measure.
                    let reference: &[(usize, Vec<u32>)] =
                        if constrained { &[] } else { &reference };
                    let row = match (&servers, runtimes.iter().find(|(m, _)| *m == mode)) {
                        (_, Some((_, runtime))) => {
                            let served_by = match mode {
                                BenchMode::LlmOnly => &settings.reference,
                                _ => policy,
                            };
                            let profiles_before = match (&mut profiler, fresh_profiles.take()) {
                                (Some(_), Some(fresh)) => Some(fresh),
                                (Some(profiler), None) => Some(profiler.measure()?),
                                (None, _) => None,
                            };
                            let before = Snapshot::take(runtime);
                            runtime.take_bus_round_trips();
                            runtime.take_handoff_transits();
                            let t = closed_loop(
                                runtime.clone(),
                                prompts.clone(),
                                served_by,
                                concurrency,
                                settings,
                                constrained,
                            )
                            .await;
                            let after = Snapshot::take(runtime);
                            let round_trips = runtime.take_bus_round_trips();
                            let transits = runtime.take_handoff_transits();
                            let seconds = (after.at - before.at).as_secs_f64();
                            let measured_profiles = match (&mut profiler, profiles_before) {
                                (Some(profiler), Some(before)) => {
                                    let after = profiler.measure()?;
                                    let mean: Vec<Option<MeasuredProfile>> = before
                                        .iter()
                                        .zip(&after)
                                        .map(|(b, a)| Some(MeasuredProfile::mean((*b)?, (*a)?)))
                                        .collect();
                                    fresh_profiles = Some(after);
                                    Some(mean)
                                }
                                _ => None,
                            };
                            // A simulated model keeps its configured profile.
                            let profile_costs: Vec<Option<StepCost>> = match &measured_profiles {
                                Some(measured) => measured
                                    .iter()
                                    .zip(&costs)
                                    .map(|(m, c)| m.map(MeasuredProfile::cost).or(*c))
                                    .collect(),
                                None => costs.clone(),
                            };
                            // A remote model's steps are not recorded here.
                            let remote = matches!(mode, BenchMode::Remote(_));
                            let decoding = concurrency as f64 * t.decoding_share();
                            let prediction = |source| {
                                (!remote)
                                    .then(|| {
                                        predicted(
                                            runtime,
                                            mode,
                                            decoding,
                                            timeout,
                                            (&before, &after),
                                            source,
                                        )
                                    })
                                    .flatten()
                            };
                            RoutingBenchRow {
                                predicted_tokens_per_s: prediction(LatencySource::CellSteps),
                                predicted_from_profiles_tokens_per_s: prediction(
                                    LatencySource::Profiles(&profile_costs),
                                ),
                                measured_profiles: measured_profiles.map(|measured| {
                                    names
                                        .iter()
                                        .cloned()
                                        .zip(measured)
                                        .filter_map(|(name, m)| Some((name, m?)))
                                        .collect()
                                }),
                                controller: runtime.snapshot().controller,
                                prefix_cached_share: names
                                    .iter()
                                    .enumerate()
                                    .map(|(i, name)| {
                                        let hits =
                                            (after.hit_tokens[i] - before.hit_tokens[i]) as f64;
                                        let computed = (after.tokens_processed[i]
                                            - before.tokens_processed[i])
                                            as f64;
                                        (name.clone(), hits / (hits + computed).max(1.0))
                                    })
                                    .collect(),
                                per_model: model_cells(
                                    runtime,
                                    &names,
                                    (&before, &after),
                                    &profile_costs,
                                    concurrency,
                                ),
                                bus_round_trip_us: median_and_p99_us(&round_trips),
                                handoff_transit_us: median_and_p99_us(&transits),
                                ..cell.row(t, seconds, &names, reference, settings)
                            }
                        }
                        (Some(servers), None) => {
                            fresh_profiles = None;
                            let std_cell = std_serving::Cell::new(
                                &first,
                                registry.get(policy).expect("checked above"),
                                &prompts,
                                [concurrency, settings.requests, settings.max_tokens],
                                settings.workload.ignores_eos(),
                            )?;
                            let servers = servers.clone();
                            let started = Instant::now();
                            let (t, breakdown) = actix_rt::task::spawn_blocking(move || {
                                std_serving::run_cell(&servers, std_cell)
                            })
                            .await?;
                            let seconds = started.elapsed().as_secs_f64();
                            RoutingBenchRow {
                                std_serving_breakdown: Some(breakdown),
                                ..cell.row(t, seconds, &names, reference, settings)
                            }
                        }
                        (None, None) => unreachable!("every mode has a runtime or the servers"),
                    };
                    rows.push(row);
                }
            }
        }
    }
    for runtime in std::iter::once(first).chain(runtimes.into_iter().map(|(_, r)| r)) {
        if let Ok(runtime) = Rc::try_unwrap(runtime) {
            runtime.shutdown();
        }
    }
    Ok(rows)
}

/// Which cell a row reports.
struct CellId<'a> {
    policy: &'a str,
    mode: BenchMode,
    concurrency: usize,
    round: usize,
    constrained: bool,
}

impl CellId<'_> {
    /// The row of what the clients saw; the runtime's own figures are left empty.
    fn row(
        &self,
        mut t: Tally,
        seconds: f64,
        names: &[String],
        reference: &[(usize, Vec<u32>)],
        settings: &RoutingBenchSettings,
    ) -> RoutingBenchRow {
        let med = |v: &mut Vec<f64>| if v.is_empty() { 0.0 } else { median(v) };
        let gaps: Vec<f64> = t.gaps.iter().map(|&(_, ms)| ms).collect();
        let long_prompt_gaps = long_prompt_gap_ratios(&t);
        // The requests a long prompt's stretch after it added are not the cell's own.
        t.outputs.retain(|(i, _)| *i < settings.requests);
        t.outputs.sort();
        let mut digest = std::collections::hash_map::DefaultHasher::new();
        t.outputs.hash(&mut digest);
        let agreements: Vec<f64> = t
            .outputs
            .iter()
            .filter_map(|(i, out)| {
                reference
                    .iter()
                    .find(|(j, _)| j == i)
                    .map(|(_, r)| agreement(out, r))
            })
            .collect();
        RoutingBenchRow {
            policy: match self.constrained {
                true => format!("{}+schema", self.policy),
                false => self.policy.to_string(),
            },
            constrained: self.constrained,
            workload: settings.workload,
            mode: self.mode.as_str(),
            concurrency: self.concurrency,
            round: self.round,
            completed: t.completed,
            failed: t.failed,
            output_tokens: t.tokens,
            seconds,
            tokens_per_s: t.tokens as f64 / seconds,
            all_in_flight_tokens_per_s: t.all_in_flight_tokens_per_s(),
            predicted_tokens_per_s: None,
            predicted_from_profiles_tokens_per_s: None,
            measured_profiles: None,
            handoffs_per_100_tokens: 100.0 * t.handoffs as f64 / t.tokens.max(1) as f64,
            token_share: names
                .iter()
                .zip(t.tokens_per_model.iter().chain(std::iter::repeat(&0)))
                .map(|(n, &c)| (n.clone(), c as f64 / t.tokens.max(1) as f64))
                .collect(),
            agreement_with_reference: (!agreements.is_empty())
                .then(|| agreements.iter().sum::<f64>() / agreements.len() as f64),
            long_prompt_gap_ratio: long_prompt_gaps.map(|(during, _)| during),
            gap_ratio_after_long_prompt: long_prompt_gaps.map(|(_, after)| after),
            controller: None,
            ttft_ms_median: med(&mut t.ttft_ms),
            ttft_ms_p99: quantile(&t.ttft_ms, 0.99).unwrap_or(0.0),
            itl_ms_median: quantile(&gaps, 0.5).unwrap_or(0.0),
            itl_ms_p99: quantile(&gaps, 0.99).unwrap_or(0.0),
            latency_ms_median: med(&mut t.latency_ms),
            prefix_cached_share: Vec::new(),
            per_model: Vec::new(),
            std_serving_breakdown: None,
            bus_round_trip_us: None,
            handoff_transit_us: None,
            outputs_digest: format!("{:016x}", digest.finish()),
        }
    }
}

/// Median and p99 of durations, in µs; none without any.
fn median_and_p99_us(durations: &[Duration]) -> Option<(f64, f64)> {
    let us: Vec<f64> = durations.iter().map(|d| d.as_secs_f64() * 1e6).collect();
    Some((quantile(&us, 0.5)?, quantile(&us, 0.99)?))
}

/// The long-prompt gap with the one after it: `8.7× (9.1×)`.
fn gap_ratios(during: Option<f64>, after: Option<f64>) -> String {
    match (during, after) {
        (Some(during), Some(after)) => format!("{during:.1}× ({after:.1}×)"),
        (during, _) => optional(during, "×"),
    }
}

fn optional(value: Option<f64>, suffix: &str) -> String {
    value.map_or("–".to_string(), |v| format!("{v:.1}{suffix}"))
}

fn shares(values: &[(String, f64)]) -> String {
    values
        .iter()
        .map(|(name, s)| format!("{name} {:.0}%", s * 100.0))
        .collect::<Vec<_>>()
        .join(", ")
}

pub fn markdown(rows: &[RoutingBenchRow]) -> String {
    let mut out = String::from(
        "| policy | workload | mode | N | round | done | failed | tokens/s | all N in flight | predicted: cell L / profiles | token share | handoffs/100 tok | mean batch | admission ms | busy | step ms (profile's) | host ms/step (gap p50) | cached positions | agreement | TTFT p50 / p99 ms | ITL p50 / p99 ms | long-prompt gap (after it) | latency ms |\n|---|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|---|---|---|---|---|---|---:|---|---|---:|---:|\n",
    );
    for r in rows {
        let per_model = |f: fn(&ModelCell) -> f64, digits: usize| {
            r.per_model
                .iter()
                .map(|m| format!("{:.digits$}", f(m)))
                .collect::<Vec<_>>()
                .join(" / ")
        };
        out += &format!(
            "| {} | {} | {} | {} | {} | {} | {} | {:.1} | {} | {} / {} | {} | {:.1} | {} | {} | {} | {} | {} | {} | {} | {:.0} / {:.0} | {:.1} / {:.1} | {} | {:.0} |\n",
            r.policy,
            serde_json::to_value(r.workload).map_or(String::new(), |v| v.as_str().unwrap_or("").to_string()),
            r.mode,
            r.concurrency,
            r.round,
            r.completed,
            r.failed,
            r.tokens_per_s,
            optional(r.all_in_flight_tokens_per_s, ""),
            optional(r.predicted_tokens_per_s, ""),
            optional(r.predicted_from_profiles_tokens_per_s, ""),
            shares(&r.token_share),
            r.handoffs_per_100_tokens,
            per_model(|m| m.mean_batch, 2),
            per_model(|m| m.admission_delay_ms_mean, 1),
            r.per_model
                .iter()
                .map(|m| match m.steps {
                    0 => "–".to_string(),
                    _ => format!("{:.0}%", 100.0 * m.busy_share),
                })
                .collect::<Vec<_>>()
                .join(" / "),
            r.per_model
                .iter()
                .map(|m| match (m.steps, m.profile_step_ms_mean) {
                    (0, _) => "–".to_string(),
                    (_, Some(profile)) => format!("{:.1} ({profile:.1})", m.step_ms_mean),
                    (_, None) => format!("{:.1}", m.step_ms_mean),
                })
                .collect::<Vec<_>>()
                .join(" / "),
            r.per_model
                .iter()
                .map(|m| match (m.host_ms_mean, m.step_gap_ms_median) {
                    (Some(host), Some(gap)) => format!("{host:.2} ({gap:.2})"),
                    (Some(host), None) => format!("{host:.2}"),
                    _ => "–".to_string(),
                })
                .collect::<Vec<_>>()
                .join(" / "),
            shares(&r.prefix_cached_share),
            optional(r.agreement_with_reference.map(|a| a * 100.0), "%"),
            r.ttft_ms_median,
            r.ttft_ms_p99,
            r.itl_ms_median,
            r.itl_ms_p99,
            gap_ratios(r.long_prompt_gap_ratio, r.gap_ratio_after_long_prompt),
            r.latency_ms_median
        );
    }
    if let Some(first) = rows.first() {
        let models: Vec<&str> = first.per_model.iter().map(|m| m.model.as_str()).collect();
        out += &format!("\nPer-model columns: {}.\n", models.join(" / "));
    }
    out += &summary(rows);
    out += &ratios(rows);
    out += &std_serving_times(rows);
    out += &constraint_costs(rows);
    out
}

/// With `--json-schema`: each constrained cell beside its unconstrained twin (same policy,
/// mode, N and round): throughput, and per model the full-batch step's median time and the
/// ratio of the two, then each ratio's median over rounds.
fn constraint_costs(rows: &[RoutingBenchRow]) -> String {
    let pairs: Vec<(&RoutingBenchRow, &RoutingBenchRow)> = rows
        .iter()
        .filter(|r| r.constrained)
        .filter_map(|c| {
            let base = c.policy.strip_suffix("+schema")?;
            let free = rows.iter().find(|u| {
                !u.constrained
                    && u.policy == base
                    && (u.mode, u.concurrency, u.round) == (c.mode, c.concurrency, c.round)
            })?;
            Some((free, c))
        })
        .collect();
    if pairs.is_empty() {
        return String::new();
    }
    let ratio = |free: &ModelCell, held: &ModelCell| {
        Some(held.full_batch_step_ms? / free.full_batch_step_ms?)
    };
    let mut out = String::from(
        "
Constrained (`--json-schema`) against unconstrained, per model: median time of the steps that decoded exactly N rows (ms), unconstrained → constrained (ratio):

| policy | mode | N | round | tokens/s | full-batch step ms |\n|---|---|---:|---:|---|---|\n",
    );
    for (free, held) in &pairs {
        let steps: Vec<String> = free
            .per_model
            .iter()
            .zip(&held.per_model)
            .map(
                |(f, h)| match (f.full_batch_step_ms, h.full_batch_step_ms) {
                    (Some(a), Some(b)) => format!("{a:.1} → {b:.1} ({:.2}×)", b / a),
                    _ => "–".to_string(),
                },
            )
            .collect();
        out += &format!(
            "| {} | {} | {} | {} | {:.1} → {:.1} | {} |\n",
            free.policy,
            free.mode,
            free.concurrency,
            free.round,
            free.tokens_per_s,
            held.tokens_per_s,
            steps.join(" / "),
        );
    }
    let mut groups: Vec<(&str, &str, usize)> = pairs
        .iter()
        .map(|(f, _)| (f.policy.as_str(), f.mode, f.concurrency))
        .collect();
    groups.sort();
    groups.dedup();
    out +=
        "\n| policy | mode | N | full-batch step ratio, median over rounds |\n|---|---|---:|---|\n";
    for (policy, mode, n) in groups {
        let group: Vec<_> = pairs
            .iter()
            .filter(|(f, _)| (f.policy.as_str(), f.mode, f.concurrency) == (policy, mode, n))
            .collect();
        let models = group[0].0.per_model.len();
        let medians: Vec<String> = (0..models)
            .map(|m| {
                let mut ratios: Vec<f64> = group
                    .iter()
                    .filter_map(|(f, h)| ratio(&f.per_model[m], &h.per_model[m]))
                    .collect();
                match ratios.is_empty() {
                    true => "–".to_string(),
                    false => format!("{:.3}×", median(&mut ratios)),
                }
            })
            .collect();
        out += &format!("| {policy} | {mode} | {n} | {} |\n", medians.join(" / "));
    }
    out
}

/// The `std-serving` cells' time per committed token, split as the servers report it.
fn std_serving_times(rows: &[RoutingBenchRow]) -> String {
    let cells: Vec<(&RoutingBenchRow, &Breakdown)> = rows
        .iter()
        .filter_map(|r| r.std_serving_breakdown.as_ref().map(|b| (r, b)))
        .collect();
    if cells.is_empty() {
        return String::new();
    }
    let mut out = String::from(
        "
std-serving, time per committed token (ms, summed over its calls; a step shared by a batch counts whole as compute):

| policy | N | round | calls/token | HTTP | body parse | tokenization | queueing | prefix matching | compute | dispatcher policy |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for (r, b) in cells {
        out += &format!(
            "| {} | {} | {} | {:.2} | {:.2} | {:.3} | {:.3} | {:.2} | {:.3} | {:.2} | {:.4} |\n",
            r.policy,
            r.concurrency,
            r.round,
            b.calls_per_token,
            b.http_ms,
            b.parse_ms,
            b.tokenize_ms,
            b.queue_ms,
            b.prefix_match_ms,
            b.compute_ms,
            b.policy_ms,
        );
    }
    out
}

/// Medians over rounds per (policy, N, mode), with the rounds' spread, and `tokenrouter`
/// against the other modes (ratios of the medians).
pub fn summary(rows: &[RoutingBenchRow]) -> String {
    let mut out = String::from(
        "\n| policy | N | mode | rounds | tokens/s median (min–max) | all N in flight | predicted: cell L / profiles | TTFT p50 ms | ITL p50 / p99 ms | long-prompt gap (after it) |\n|---|---:|---|---:|---|---:|---|---:|---|---:|\n",
    );
    let mut groups: Vec<(&str, usize)> = rows
        .iter()
        .map(|r| (r.policy.as_str(), r.concurrency))
        .collect();
    groups.sort();
    groups.dedup();
    let med = |mut v: Vec<f64>| (!v.is_empty()).then(|| median(&mut v));
    let mut comparisons = String::new();
    for (policy, n) in groups {
        let mut modes: Vec<&str> = rows
            .iter()
            .filter(|r| r.policy == policy && r.concurrency == n)
            .map(|r| r.mode)
            .collect();
        modes.dedup();
        modes.sort();
        modes.dedup();
        let mut medians = Vec::new();
        for mode in modes {
            let cells: Vec<&RoutingBenchRow> = rows
                .iter()
                .filter(|r| r.policy == policy && r.concurrency == n && r.mode == mode)
                .collect();
            let pick = |f: fn(&RoutingBenchRow) -> Option<f64>| {
                med(cells.iter().filter_map(|r| f(r)).collect())
            };
            let tps: Vec<f64> = cells.iter().map(|r| r.tokens_per_s).collect();
            let (lo, hi) = tps
                .iter()
                .fold((f64::MAX, f64::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
            let median_tps = med(tps.clone()).unwrap_or(0.0);
            medians.push((mode, median_tps));
            out += &format!(
                "| {policy} | {n} | {mode} | {} | {median_tps:.1} ({lo:.1}–{hi:.1}) | {} | {} / {} | {:.0} | {} / {} | {} |\n",
                cells.len(),
                optional(pick(|r| r.all_in_flight_tokens_per_s), ""),
                optional(pick(|r| r.predicted_tokens_per_s), ""),
                optional(pick(|r| r.predicted_from_profiles_tokens_per_s), ""),
                pick(|r| Some(r.ttft_ms_median)).unwrap_or(0.0),
                optional(pick(|r| Some(r.itl_ms_median)), ""),
                optional(pick(|r| Some(r.itl_ms_p99)), ""),
                gap_ratios(
                    pick(|r| r.long_prompt_gap_ratio),
                    pick(|r| r.gap_ratio_after_long_prompt)
                ),
            );
        }
        let bus_figures = |what: &str, figure: fn(&RoutingBenchRow) -> Option<(f64, f64)>| {
            let cells: Vec<String> = rows
                .iter()
                .filter(|r| r.policy == policy && r.concurrency == n)
                .filter_map(|r| figure(r).map(|f| (r, f)))
                .map(|(r, (p50, p99))| {
                    format!("{} round {}: {p50:.0} / {p99:.0} µs", r.mode, r.round)
                })
                .collect();
            if cells.is_empty() {
                String::new()
            } else {
                format!(
                    "\n{policy}, N = {n}: {what} (median / p99): {}\n",
                    cells.join("; ")
                )
            }
        };
        comparisons += &bus_figures("bus round trip to the remote model", |r| {
            r.bus_round_trip_us
        });
        comparisons += &bus_figures(
            "added latency per handoff, its one-way transit over the bus from the remote model",
            |r| r.handoff_transit_us,
        );
        let checks: Vec<String> = rows
            .iter()
            .filter(|r| r.policy == policy && r.concurrency == n)
            .filter(|r| r.mode.starts_with("tokenrouter"))
            .filter_map(|r| Some((r, r.controller?)))
            .map(|(r, c)| {
                format!(
                    "{} round {}: tuned {} / eager {} tok/s → {:?}",
                    r.mode,
                    r.round,
                    optional(c.tuned_tokens_per_s, ""),
                    optional(c.eager_tokens_per_s, ""),
                    c.choice
                )
            })
            .collect();
        if !checks.is_empty() {
            comparisons += &format!(
                "\n{policy}, N = {n}: the tuner's eager check at each round's end: {}\n",
                checks.join("; ")
            );
        }
        let Some(&(_, ours)) = medians.iter().find(|(m, _)| *m == "tokenrouter") else {
            continue;
        };
        let against: Vec<String> = medians
            .iter()
            .filter(|(m, _)| *m != "tokenrouter")
            .map(|(m, v)| format!("{m} {:.2}×", ours / v.max(1e-9)))
            .collect();
        comparisons += &format!(
            "\n{policy}, N = {n}: `tokenrouter` median tokens/s over each mode's: {}\n",
            against.join(", ")
        );
    }
    out + &comparisons
}

/// Each cell's throughput relative to the same (policy, N, round) in `lockstep` (or the
/// first mode run): the ablation, measured side by side.
pub fn ratios(rows: &[RoutingBenchRow]) -> String {
    let mut out = String::new();
    let mut groups: Vec<(&str, usize, usize)> = rows
        .iter()
        .map(|r| (r.policy.as_str(), r.concurrency, r.round))
        .collect();
    groups.dedup();
    for (policy, n, round) in groups {
        let cells: Vec<&RoutingBenchRow> = rows
            .iter()
            .filter(|r| r.policy == policy && r.concurrency == n && r.round == round)
            .collect();
        let base = cells
            .iter()
            .find(|r| r.mode == "lockstep")
            .unwrap_or(&cells[0]);
        let parts: Vec<String> = cells
            .iter()
            .map(|r| {
                format!(
                    "{} {:.2}×",
                    r.mode,
                    r.tokens_per_s / base.tokens_per_s.max(1e-9)
                )
            })
            .collect();
        out += &format!(
            "\n{policy}, N = {n}, round {round}: tokens/s relative to {}: {}\n",
            base.mode,
            parts.join(", ")
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_with_a_remote_twin_and_name_it_back() {
        for name in [
            "tokenrouter",
            "async-remote",
            "tokenrouter-remote",
            "llm-only",
        ] {
            let mode: BenchMode = name.parse().unwrap();
            assert_eq!(mode.as_str(), name);
        }
        assert_eq!(
            "standard-remote".parse::<BenchMode>(),
            Ok(BenchMode::Remote(ExecutionMode::Standard))
        );
        let twins = BenchMode::Runtime(ExecutionMode::Async).with_remote_twin();
        assert_eq!(twins[1].as_str(), "async-remote");
        assert_eq!(BenchMode::LlmOnly.with_remote_twin().len(), 1);
        let err = "fast-remote".parse::<BenchMode>().unwrap_err();
        assert!(err.contains("before -remote"), "{err}");
    }

    fn followed(times: Vec<Instant>) -> Followed {
        Followed {
            tokens: vec![1; times.len()],
            writers: vec![0; times.len()],
            routing: RoutingStats::default(),
            times,
        }
    }

    #[test]
    fn long_prompt_gaps_are_compared_with_an_equally_long_stretch_after_it() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut tally = Tally {
            gaps: [
                (100, 90.0),
                (500, 10.0),
                (600, 30.0),
                (800, 10.0),
                (900, 50.0),
            ]
            .map(|(ms, gap)| (at(ms), gap))
            .to_vec(),
            long_prompt_window: Some((at(400), at(700))),
            ..Tally::default()
        };
        // Median gap 30 ms: 30 ms during the prompt, 50 ms in the 300 ms after it (the
        // start's 90 ms in neither).
        assert_eq!(long_prompt_gap_ratios(&tally), Some((1.0, 50.0 / 30.0)));
        tally.long_prompt_window = None;
        assert_eq!(long_prompt_gap_ratios(&tally), None);
    }

    #[test]
    fn all_in_flight_rate_counts_tokens_between_the_first_and_last_submission() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut tally = Tally::default();
        // Two clients: requests 0 and 1 start together, 2 replaces 0 at 400 ms; after that
        // only the drain remains (tokens at 900 and 1000 ms are not counted).
        tally.record(0, at(0), at(400), followed(vec![at(100), at(200), at(400)]));
        tally.record(
            1,
            at(0),
            at(1000),
            followed(vec![at(150), at(300), at(1000)]),
        );
        tally.record(2, at(400), at(900), followed(vec![at(400), at(900)]));
        let rate = tally.all_in_flight_tokens_per_s().unwrap();
        assert!((rate - 6.0 / 0.4).abs() < 1e-6, "{rate}");
        // 100 + 150 + 0 ms before a first token of 400 + 1000 + 500 ms.
        let decoding = tally.decoding_share();
        assert!(
            (decoding - (1.0 - 250.0 / 1900.0)).abs() < 1e-9,
            "{decoding}"
        );
        assert_eq!(Tally::default().decoding_share(), 1.0);
        assert!(tally.tokens as f64 / 1.0 < rate);

        // As many requests as clients: no window with all of them in flight.
        let mut together = Tally::default();
        together.record(0, at(0), at(400), followed(vec![at(100), at(400)]));
        together.fail(at(0));
        assert_eq!(together.all_in_flight_tokens_per_s(), None);
    }

    #[test]
    fn host_time_and_gaps_come_from_the_cells_own_steps() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let interval = |start, end, host_us: Option<u64>| StepInterval {
            start: at(start),
            end: at(end),
            batch: 1,
            tokens: 1,
            host: host_us.map(Duration::from_micros),
        };
        let model = ModelSnapshot {
            recent_steps: vec![
                // Before the cell: neither its host time nor the gap after it counts.
                interval(0, 10, Some(9_000)),
                interval(20, 30, Some(1_000)),
                interval(31, 40, Some(3_000)),
                interval(45, 50, None),
            ],
            ..Default::default()
        };
        let (host, gap) = host_and_gaps(&model, at(15));
        assert_eq!(host, Some(2.0));
        // Gaps 1 and 5 ms: the median of two is their mean.
        assert_eq!(gap, Some(3.0));
        assert_eq!(host_and_gaps(&model, at(60)), (None, None));
    }
}

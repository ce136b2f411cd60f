//! The runtime against the Markov model in the paper's setting, on the latency-profile
//! executor (a simulation: steps sleep 6.0 / 27.9 ms and R2R's routing signals realise
//! p = 0.35): measured throughput per (N, B_1) next to the prediction
//! (`tokenrouter tune --validate-runtime`).

use serde::Serialize;
use std::cell::Cell;
use std::rc::Rc;
use std::time::Duration;
use tokenrouter::config::{Config, ExecutionMode};
use tokenrouter::engine::SamplingParams;
use tokenrouter::runtime::{GenerateRequest, RequestEvent, RequestHandle, Runtime, RuntimeError};
use tokenrouter::tuning::{paper, predict};

/// Steps before the window opens (the first batches are still forming).
const WARM_UP: Duration = Duration::from_millis(400);

/// The paper's pair with LLM threshold `b1`, batcher timeout and re-tuning period (0: off).
pub fn paper_config(b1: usize, timeout_ms: u64, retune_ms: u64) -> Config {
    Config::parse(&format!(
        r#"
[[models]]
name = "small"
latency_profile_ms = [6.0, 0.0]
[[models]]
name = "large"
latency_profile_ms = [27.9, 0.0]
batch_threshold = {b1}
[runtime]
batch_timeout_ms = {timeout_ms}
retune_interval_ms = {retune_ms}
[[policies]]
name = "r2r"
kind = "r2r"
models = ["small", "large"]
threshold = 0.65
"#
    ))
    .expect("the paper configuration is valid")
}

/// A request as long as the runtime admits: it does not end by itself within a measurement
/// (simulated models have no end-of-sequence).
pub fn endless(runtime: &Runtime, seed: u64) -> Result<RequestHandle, RuntimeError> {
    let prompt = vec![1, 2, 3];
    runtime.submit(GenerateRequest {
        max_tokens: runtime.request_token_limit() - prompt.len(),
        prompt: prompt.into(),
        policy: Some("r2r".into()),
        sampling: SamplingParams {
            seed,
            ..SamplingParams::greedy()
        },
        timeout: None,
        ignore_eos: false,
    })
}

/// What one window measured.
pub struct Measured {
    /// Committed tokens per second.
    pub rate: f64,
    /// The share of those tokens the LLM wrote: R2R's realised routing probability (each LLM
    /// token replaces one SLM token that triggered a send). A window sees one stretch of the
    /// deterministic draws, whose share strays from p by a few points.
    pub llm_share: f64,
}

/// Throughput with `n` endless requests and LLM threshold `b1` (the paper has no timeout: the
/// batcher's is effectively infinite), over `window` after a warm-up.
pub async fn measure(n: usize, b1: usize, window: Duration) -> Result<Measured, RuntimeError> {
    let runtime = Runtime::start(
        &paper_config(b1, 100_000, 0),
        Some(ExecutionMode::Tokenrouter),
    )?;
    // Tokens committed by each model.
    let tokens = Rc::new(Cell::new([0usize; 2]));
    let mut readers = Vec::new();
    for seed in 0..n as u64 {
        let mut handle = endless(&runtime, seed)?;
        let counter = tokens.clone();
        readers.push(actix_rt::spawn(async move {
            while let Some(event) = handle.events.recv().await {
                if let RequestEvent::Token { model, .. } = event {
                    let mut counts = counter.get();
                    counts[model.min(1)] += 1;
                    counter.set(counts);
                }
            }
        }));
    }
    actix_rt::time::sleep(WARM_UP).await;
    let before = tokens.get();
    actix_rt::time::sleep(window).await;
    let after = tokens.get();
    for reader in readers {
        reader.abort();
    }
    runtime.shutdown();
    let [small, large] = [0, 1].map(|m| after[m] - before[m]);
    Ok(Measured {
        rate: (small + large) as f64 / window.as_secs_f64(),
        llm_share: large as f64 / (small + large).max(1) as f64,
    })
}

#[derive(Debug, Clone, Serialize)]
pub struct ValidationRow {
    pub n: usize,
    pub b1: usize,
    /// At the paper's p = 0.35.
    pub predicted: f64,
    pub measured: f64,
    pub llm_share: f64,
    /// At the share the window realised: what the runtime's own scheduling is measured against.
    pub predicted_at_share: f64,
}

/// The row for (N, B_1) from one window.
pub async fn validate(
    n: usize,
    b1: usize,
    window: Duration,
) -> Result<ValidationRow, RuntimeError> {
    let predict_at = |p: f64| {
        predict(&paper::validation_model_at(p), n, &[1, b1])
            .map(|p| p.throughput)
            .map_err(|e| RuntimeError::InvalidRequest(e.to_string()))
    };
    let measured = measure(n, b1, window).await?;
    Ok(ValidationRow {
        n,
        b1,
        predicted: predict_at(paper::VALIDATION_P)?,
        measured: measured.rate,
        llm_share: measured.llm_share,
        predicted_at_share: predict_at(measured.llm_share)?,
    })
}

/// Every (N, B_1) of the paper's grid for N in `ns`.
pub async fn run(ns: &[usize], window: Duration) -> Result<Vec<ValidationRow>, RuntimeError> {
    let mut rows = Vec::new();
    for &n in ns {
        for b1 in 1..=n {
            let row = validate(n, b1, window).await?;
            tracing::info!(
                "N={n} B1={b1}: predicted {:.1} tok/s ({:.1} at the realised LLM share {:.3}), measured {:.1}",
                row.predicted,
                row.predicted_at_share,
                row.llm_share,
                row.measured
            );
            rows.push(row);
        }
    }
    Ok(rows)
}

/// The B_1 with the highest value of `f` at each N: (N, B_1).
pub fn best_per_n(rows: &[ValidationRow], f: fn(&ValidationRow) -> f64) -> Vec<(usize, usize)> {
    let mut ns: Vec<usize> = rows.iter().map(|r| r.n).collect();
    ns.dedup();
    ns.into_iter()
        .map(|n| {
            let best = rows
                .iter()
                .filter(|r| r.n == n)
                .max_by(|a, b| f(a).total_cmp(&f(b)))
                .expect("every N has rows");
            (n, best.b1)
        })
        .collect()
}

pub fn markdown(rows: &[ValidationRow]) -> String {
    let mut out = String::from(
        "| N | B_1 | predicted tok/s (p = 0.35) | realised LLM share | predicted at that share | measured tok/s | measured / predicted at share |\n|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        out += &format!(
            "| {} | {} | {:.1} | {:.3} | {:.1} | {:.1} | {:.3} |\n",
            r.n,
            r.b1,
            r.predicted,
            r.llm_share,
            r.predicted_at_share,
            r.measured,
            r.measured / r.predicted_at_share
        );
    }
    let predicted = best_per_n(rows, |r| r.predicted);
    let measured = best_per_n(rows, |r| r.measured);
    for ((n, p), (_, m)) in predicted.iter().zip(&measured) {
        out += &format!("\nN = {n}: best B_1 predicted {p}, measured {m}");
    }
    out.push('\n');
    out
}

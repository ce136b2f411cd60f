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
        prompt,
        policy: Some("r2r".into()),
        sampling: SamplingParams {
            seed,
            ..SamplingParams::greedy()
        },
        timeout: None,
        ignore_eos: false,
    })
}

/// Committed tokens per second with `n` endless requests and LLM threshold `b1` (the paper
/// has no timeout: the batcher's is effectively infinite), over `window` after a warm-up.
pub async fn measure(n: usize, b1: usize, window: Duration) -> Result<f64, RuntimeError> {
    let runtime = Runtime::start(
        &paper_config(b1, 100_000, 0),
        Some(ExecutionMode::Tokenrouter),
    )?;
    let tokens = Rc::new(Cell::new(0usize));
    let mut readers = Vec::new();
    for seed in 0..n as u64 {
        let mut handle = endless(&runtime, seed)?;
        let counter = tokens.clone();
        readers.push(actix_rt::spawn(async move {
            while let Some(event) = handle.events.recv().await {
                if matches!(event, RequestEvent::Token { .. }) {
                    counter.set(counter.get() + 1);
                }
            }
        }));
    }
    actix_rt::time::sleep(WARM_UP).await;
    let before = tokens.get();
    actix_rt::time::sleep(window).await;
    let rate = (tokens.get() - before) as f64 / window.as_secs_f64();
    for reader in readers {
        reader.abort();
    }
    runtime.shutdown();
    Ok(rate)
}

#[derive(Debug, Clone, Serialize)]
pub struct ValidationRow {
    pub n: usize,
    pub b1: usize,
    pub predicted: f64,
    pub measured: f64,
}

/// Every (N, B_1) of the paper's grid for N in `ns`.
pub async fn run(ns: &[usize], window: Duration) -> Result<Vec<ValidationRow>, RuntimeError> {
    let model = paper::validation_model();
    let mut rows = Vec::new();
    for &n in ns {
        for b1 in 1..=n {
            let predicted = predict(&model, n, &[1, b1])
                .map_err(|e| RuntimeError::InvalidRequest(e.to_string()))?
                .throughput;
            let measured = measure(n, b1, window).await?;
            tracing::info!("N={n} B1={b1}: predicted {predicted:.1} tok/s, measured {measured:.1}");
            rows.push(ValidationRow {
                n,
                b1,
                predicted,
                measured,
            });
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
        "| N | B_1 | predicted tok/s | measured tok/s | measured / predicted |\n|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        out += &format!(
            "| {} | {} | {:.1} | {:.1} | {:.3} |\n",
            r.n,
            r.b1,
            r.predicted,
            r.measured,
            r.measured / r.predicted
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

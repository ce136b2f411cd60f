//! `bench routing`: closed-loop clients (N workers, each sends its next request when the
//! previous one ends) against the runtime in each execution mode, modes interleaved round by
//! round in one run so their ratios share the machine's conditions.

use super::median;
use super::prompts::PROMPTS;
use crate::config::{Config, ExecutionMode};
use crate::engine::chat::{ChatMessage, ChatTemplate};
use crate::engine::SamplingParams;
use crate::runtime::{GenerateRequest, Runtime, RuntimeError};
use serde::Serialize;
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Instant;

pub struct RoutingBenchSettings {
    pub policies: Vec<String>,
    pub modes: Vec<ExecutionMode>,
    pub concurrency: Vec<usize>,
    pub requests: usize,
    pub max_tokens: usize,
    pub rounds: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct RoutingBenchRow {
    pub policy: String,
    pub mode: &'static str,
    pub concurrency: usize,
    pub round: usize,
    pub completed: usize,
    pub failed: usize,
    pub output_tokens: usize,
    pub seconds: f64,
    pub tokens_per_s: f64,
    pub handoffs_per_100_tokens: f64,
    pub ttft_ms_median: f64,
    pub latency_ms_median: f64,
}

/// Short-reasoning workload: one sentence of the shipped texts as a chat question.
fn short_prompts(runtime: &Runtime) -> Result<Vec<Vec<u32>>, RuntimeError> {
    let template = ChatTemplate::for_model(runtime.tokenizer())?;
    PROMPTS
        .iter()
        .flat_map(|p| p.split(". "))
        .map(|sentence| {
            let ask = format!("Explain briefly: {sentence}.");
            let text = template.render(&[ChatMessage::user(ask)], true)?;
            Ok(runtime.tokenizer().encode(&text)?)
        })
        .collect()
}

#[derive(Default)]
struct Tally {
    completed: usize,
    failed: usize,
    tokens: usize,
    handoffs: usize,
    ttft_ms: Vec<f64>,
    latency_ms: Vec<f64>,
}

async fn closed_loop(
    runtime: Rc<Runtime>,
    prompts: Rc<Vec<Vec<u32>>>,
    policy: &str,
    concurrency: usize,
    settings: &RoutingBenchSettings,
) -> Tally {
    let next = Rc::new(Cell::new(0usize));
    let tally = Rc::new(RefCell::new(Tally::default()));
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let (runtime, prompts, next, tally) = (
                runtime.clone(),
                prompts.clone(),
                next.clone(),
                tally.clone(),
            );
            let (policy, requests, max_tokens) =
                (policy.to_string(), settings.requests, settings.max_tokens);
            actix_rt::spawn(async move {
                loop {
                    let i = next.get();
                    if i >= requests {
                        break;
                    }
                    next.set(i + 1);
                    let request = GenerateRequest {
                        prompt: prompts[i % prompts.len()].clone(),
                        policy: Some(policy.clone()),
                        max_tokens,
                        sampling: SamplingParams {
                            seed: i as u64,
                            ..SamplingParams::greedy()
                        },
                        timeout: None,
                    };
                    let result = match runtime.submit(request) {
                        Ok(handle) => handle.collect().await,
                        Err(e) => Err(e),
                    };
                    let mut t = tally.borrow_mut();
                    match result {
                        Ok(c) => {
                            t.completed += 1;
                            t.tokens += c.token_ids.len();
                            t.handoffs += c.routing.handoffs;
                            t.ttft_ms.push(c.time_to_first_token.as_secs_f64() * 1e3);
                            t.latency_ms.push(c.total.as_secs_f64() * 1e3);
                        }
                        Err(_) => t.failed += 1,
                    }
                }
            })
        })
        .collect();
    for w in workers {
        let _ = w.await;
    }
    Rc::try_unwrap(tally)
        .ok()
        .expect("workers finished")
        .into_inner()
}

/// Runs every (round, policy, concurrency, mode) cell; one runtime per mode, started once.
pub async fn run(
    config: &Config,
    settings: &RoutingBenchSettings,
) -> Result<Vec<RoutingBenchRow>, RuntimeError> {
    let mut runtimes = Vec::new();
    for &mode in &settings.modes {
        runtimes.push((mode, Rc::new(Runtime::start(config, Some(mode))?)));
    }
    let registry = runtimes[0].1.policies();
    if let Some(unknown) = settings.policies.iter().find(|p| registry.get(p).is_none()) {
        return Err(RuntimeError::UnknownPolicy(unknown.clone()));
    }
    let prompts = Rc::new(short_prompts(&runtimes[0].1)?);
    let mut rows = Vec::new();
    for round in 0..settings.rounds {
        for policy in &settings.policies {
            for &concurrency in &settings.concurrency {
                for (mode, runtime) in &runtimes {
                    let start = Instant::now();
                    let mut t = closed_loop(
                        runtime.clone(),
                        prompts.clone(),
                        policy,
                        concurrency,
                        settings,
                    )
                    .await;
                    let seconds = start.elapsed().as_secs_f64();
                    let med = |v: &mut Vec<f64>| if v.is_empty() { 0.0 } else { median(v) };
                    rows.push(RoutingBenchRow {
                        policy: policy.clone(),
                        mode: mode.as_str(),
                        concurrency,
                        round,
                        completed: t.completed,
                        failed: t.failed,
                        output_tokens: t.tokens,
                        seconds,
                        tokens_per_s: t.tokens as f64 / seconds,
                        handoffs_per_100_tokens: 100.0 * t.handoffs as f64 / t.tokens.max(1) as f64,
                        ttft_ms_median: med(&mut t.ttft_ms),
                        latency_ms_median: med(&mut t.latency_ms),
                    });
                }
            }
        }
    }
    for (_, runtime) in runtimes {
        if let Ok(runtime) = Rc::try_unwrap(runtime) {
            runtime.shutdown();
        }
    }
    Ok(rows)
}

pub fn markdown(rows: &[RoutingBenchRow]) -> String {
    let mut out = String::from(
        "| policy | mode | concurrency | round | done | failed | tokens/s | handoffs/100 tok | TTFT ms (median) | latency ms (median) |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        out += &format!(
            "| {} | {} | {} | {} | {} | {} | {:.1} | {:.1} | {:.0} | {:.0} |\n",
            r.policy,
            r.mode,
            r.concurrency,
            r.round,
            r.completed,
            r.failed,
            r.tokens_per_s,
            r.handoffs_per_100_tokens,
            r.ttft_ms_median,
            r.latency_ms_median
        );
    }
    out
}

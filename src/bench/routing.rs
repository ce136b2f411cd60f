//! `bench routing`: closed-loop clients (N workers, each sends its next request when the
//! previous one ends) against the runtime in each execution mode, modes interleaved round by
//! round in one run so their ratios share the machine's conditions.

use super::median;
use super::prompts::PROMPTS;
use crate::config::{Config, ExecutionMode, PolicyConfig};
use crate::engine::chat::{ChatMessage, ChatTemplate};
use crate::engine::SamplingParams;
use crate::runtime::{GenerateRequest, Runtime, RuntimeError};
use serde::Serialize;
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Instant;

pub struct RoutingBenchSettings {
    pub policies: Vec<String>,
    /// A threshold sweep: variants `name@value` of one configured policy.
    pub sweep: Option<(String, Vec<f32>)>,
    /// The model whose greedy output, served alone, is the quality reference.
    pub reference: String,
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
    /// Share of output tokens each model wrote, by model name.
    pub token_share: Vec<(String, f64)>,
    /// Position-wise agreement with the reference model serving alone, greedy.
    pub agreement_with_reference: f64,
    pub ttft_ms_median: f64,
    pub latency_ms_median: f64,
}

/// Short-reasoning workload: one sentence of the shipped texts as a chat question.
fn short_prompts(runtime: &Runtime) -> Result<Vec<Vec<u32>>, RuntimeError> {
    let tokenizer = runtime.tokenizer()?;
    let template = ChatTemplate::for_model(tokenizer)?;
    PROMPTS
        .iter()
        .flat_map(|p| p.split(". "))
        .map(|sentence| {
            let ask = format!("Explain briefly: {sentence}.");
            let text = template.render(&[ChatMessage::user(ask)], true)?;
            Ok(tokenizer.encode(&text)?)
        })
        .collect()
}

#[derive(Default)]
struct Tally {
    completed: usize,
    failed: usize,
    tokens: usize,
    handoffs: usize,
    tokens_per_model: Vec<usize>,
    /// Output tokens by request index.
    outputs: Vec<(usize, Vec<u32>)>,
    ttft_ms: Vec<f64>,
    latency_ms: Vec<f64>,
}

/// Fraction of the reference's positions where `output` has the same token.
fn agreement(output: &[u32], reference: &[u32]) -> f64 {
    if reference.is_empty() {
        return 1.0;
    }
    let same = output.iter().zip(reference).filter(|(a, b)| a == b).count();
    same as f64 / reference.len() as f64
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
                        ignore_eos: false,
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
                            t.tokens_per_model
                                .resize(c.routing.tokens_per_model.len(), 0);
                            for (sum, n) in t
                                .tokens_per_model
                                .iter_mut()
                                .zip(&c.routing.tokens_per_model)
                            {
                                *sum += n;
                            }
                            t.outputs.push((i, c.token_ids.clone()));
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

/// Adds the sweep's `name@value` variants to a copy of the config.
fn with_sweep(
    config: &Config,
    settings: &RoutingBenchSettings,
) -> Result<(Config, Vec<String>), RuntimeError> {
    let mut config = config.clone();
    let mut policies = settings.policies.clone();
    if let Some((name, values)) = &settings.sweep {
        let base = config
            .policies
            .iter()
            .find(|p| &p.name == name)
            .cloned()
            .ok_or_else(|| RuntimeError::UnknownPolicy(name.clone()))?;
        for v in values {
            let variant = format!("{name}@{v}");
            config.policies.push(PolicyConfig {
                name: variant.clone(),
                threshold: Some(*v),
                ..base.clone()
            });
            policies.push(variant);
        }
    }
    Ok((config, policies))
}

/// Runs every (round, policy, concurrency, mode) cell; one runtime per mode, started once.
pub async fn run(
    config: &Config,
    settings: &RoutingBenchSettings,
) -> Result<Vec<RoutingBenchRow>, RuntimeError> {
    let (config, policies) = with_sweep(config, settings)?;
    let mut runtimes = Vec::new();
    for &mode in &settings.modes {
        runtimes.push((mode, Rc::new(Runtime::start(&config, Some(mode))?)));
    }
    let first = runtimes[0].1.clone();
    let registry = first.policies();
    if let Some(unknown) = policies.iter().find(|p| registry.get(p).is_none()) {
        return Err(RuntimeError::UnknownPolicy(unknown.clone()));
    }
    let names: Vec<String> = first.model_names().iter().map(|n| n.to_string()).collect();
    let prompts = Rc::new(short_prompts(&first)?);
    if registry.get(&settings.reference).is_none() {
        return Err(RuntimeError::UnknownPolicy(settings.reference.clone()));
    }
    let mut reference = closed_loop(
        first.clone(),
        prompts.clone(),
        &settings.reference,
        1,
        settings,
    )
    .await
    .outputs;
    reference.sort();
    let mut rows = Vec::new();
    for round in 0..settings.rounds {
        for policy in &policies {
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
                        token_share: names
                            .iter()
                            .zip(t.tokens_per_model.iter().chain(std::iter::repeat(&0)))
                            .map(|(n, &c)| (n.clone(), c as f64 / t.tokens.max(1) as f64))
                            .collect(),
                        agreement_with_reference: agreements.iter().sum::<f64>()
                            / agreements.len().max(1) as f64,
                        ttft_ms_median: med(&mut t.ttft_ms),
                        latency_ms_median: med(&mut t.latency_ms),
                    });
                }
            }
        }
    }
    drop(first);
    for (_, runtime) in runtimes {
        if let Ok(runtime) = Rc::try_unwrap(runtime) {
            runtime.shutdown();
        }
    }
    Ok(rows)
}

pub fn markdown(rows: &[RoutingBenchRow]) -> String {
    let mut out = String::from(
        "| policy | mode | concurrency | round | done | failed | tokens/s | token share | handoffs/100 tok | agreement with reference | TTFT ms (median) | latency ms (median) |\n|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|\n",
    );
    for r in rows {
        let share: Vec<String> = r
            .token_share
            .iter()
            .map(|(name, s)| format!("{name} {:.0}%", s * 100.0))
            .collect();
        out += &format!(
            "| {} | {} | {} | {} | {} | {} | {:.1} | {} | {:.1} | {:.1}% | {:.0} | {:.0} |\n",
            r.policy,
            r.mode,
            r.concurrency,
            r.round,
            r.completed,
            r.failed,
            r.tokens_per_s,
            share.join(", "),
            r.handoffs_per_100_tokens,
            r.agreement_with_reference * 100.0,
            r.ttft_ms_median,
            r.latency_ms_median
        );
    }
    out
}

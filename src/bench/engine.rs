//! `bench engine`: median decode-step time per batch size on one model, plus prefill rate.
//! Each batch row mixes sequences of different context lengths (a ragged batch).

use super::median;
use crate::engine::{Executor, Needs, SamplingParams, SeqWork, StepExecutor};
use crate::error::EngineResult;
use crate::tuning::online::fit_affine;
use serde::Serialize;
use std::time::Instant;

#[derive(Debug, Clone, Serialize)]
pub struct EngineBenchRow {
    pub batch: usize,
    pub step_ms_median: f64,
    pub tokens_per_s: f64,
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

#[derive(Debug, Clone, Serialize)]
pub struct EngineBenchReport {
    pub model: String,
    pub threads: usize,
    pub weights: String,
    pub rows: Vec<EngineBenchRow>,
    pub fit: AffineFit,
    pub prefill: PrefillResult,
}

pub struct EngineBenchSettings {
    pub batches: Vec<usize>,
    pub steps: usize,
    pub context: usize,
    pub prefill_tokens: usize,
}

/// Deterministic filler tokens from the ordinary part of the vocabulary.
fn filler(len: usize, salt: usize, vocab: usize) -> Vec<u32> {
    let span = (vocab - 200).max(1);
    (0..len)
        .map(|i| (200 + (i * 7919 + salt * 104_729) % span) as u32)
        .collect()
}

pub fn run(
    executor: &mut Executor,
    threads: usize,
    weights: &str,
    settings: &EngineBenchSettings,
) -> EngineResult<EngineBenchReport> {
    let vocab = executor.hyperparams().vocab;
    let work = |seq: u64, tokens: Vec<u32>| SeqWork {
        seq,
        tokens,
        sampling: SamplingParams::greedy(),
        needs: Needs::default(),
    };
    let mut rows = Vec::new();
    for &batch in &settings.batches {
        let prompts: Vec<SeqWork> = (0..batch)
            .map(|i| work(i as u64, filler(settings.context + 3 * i, i, vocab)))
            .collect();
        let mut next: Vec<u32> = executor
            .step(&prompts)?
            .iter()
            .map(|o| o.candidate)
            .collect();
        let mut times = Vec::with_capacity(settings.steps);
        for step in 0..settings.steps + 2 {
            let decode: Vec<SeqWork> = next
                .iter()
                .enumerate()
                .map(|(i, &t)| work(i as u64, vec![t]))
                .collect();
            let start = Instant::now();
            let out = executor.step(&decode)?;
            let elapsed = start.elapsed().as_secs_f64() * 1e3;
            if step >= 2 {
                times.push(elapsed);
            }
            next = out.iter().map(|o| o.candidate).collect();
        }
        for i in 0..batch {
            executor.free(i as u64);
        }
        let step_ms = median(&mut times);
        rows.push(EngineBenchRow {
            batch,
            step_ms_median: step_ms,
            tokens_per_s: batch as f64 * 1e3 / step_ms,
        });
    }
    let points: Vec<(f64, f64)> = rows
        .iter()
        .map(|r| (r.batch as f64, r.step_ms_median))
        .collect();
    let (a_ms, c_ms) = fit_affine(&points);

    let mut prefill_times = Vec::new();
    for round in 0..3 {
        let seq = 1_000_000 + round;
        let start = Instant::now();
        executor.step(&[work(
            seq,
            filler(settings.prefill_tokens, round as usize, vocab),
        )])?;
        prefill_times.push(start.elapsed().as_secs_f64() * 1e3);
        executor.free(seq);
    }
    let prefill_ms = median(&mut prefill_times);
    Ok(EngineBenchReport {
        model: executor.name().to_string(),
        threads,
        weights: weights.to_string(),
        rows,
        fit: AffineFit { a_ms, c_ms },
        prefill: PrefillResult {
            tokens: settings.prefill_tokens,
            ms_median: prefill_ms,
            tokens_per_s: settings.prefill_tokens as f64 * 1e3 / prefill_ms,
        },
    })
}

impl EngineBenchReport {
    pub fn markdown(&self) -> String {
        let mut out = format!(
            "model `{}` ({} weights), {} thread(s)\n\n| batch | step ms (median) | tokens/s |\n|---:|---:|---:|\n",
            self.model, self.weights, self.threads
        );
        for r in &self.rows {
            out += &format!(
                "| {} | {:.2} | {:.1} |\n",
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
        out
    }
}

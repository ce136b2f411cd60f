//! Single-model generation loop: prefill, then one decode token per step until EOS or the
//! token limit. The routing runtime drives the same `Executor::step` for many requests.

use super::{Executor, Needs, SamplingParams, SeqId, SeqWork};
use crate::error::EngineResult;
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    Stop,
    Length,
}

#[derive(Debug, Clone)]
pub struct Generation {
    pub token_ids: Vec<u32>,
    pub finish_reason: FinishReason,
    pub time_to_first_token: Duration,
    pub total: Duration,
}

/// Generates up to `max_tokens` after `prompt`; the sequence's KV is freed before returning.
pub fn generate(
    executor: &mut Executor,
    seq: SeqId,
    prompt: &[u32],
    max_tokens: usize,
    sampling: SamplingParams,
    eos: &BTreeSet<u32>,
) -> EngineResult<Generation> {
    let start = Instant::now();
    let result = decode_loop(executor, seq, prompt, max_tokens, sampling, eos, start);
    executor.free(seq);
    let (token_ids, finish_reason, time_to_first_token) = result?;
    Ok(Generation {
        token_ids,
        finish_reason,
        time_to_first_token,
        total: start.elapsed(),
    })
}

fn decode_loop(
    executor: &mut Executor,
    seq: SeqId,
    prompt: &[u32],
    max_tokens: usize,
    sampling: SamplingParams,
    eos: &BTreeSet<u32>,
    start: Instant,
) -> EngineResult<(Vec<u32>, FinishReason, Duration)> {
    let mut generated = Vec::new();
    let mut next_input = prompt.to_vec();
    let mut ttft = Duration::ZERO;
    while generated.len() < max_tokens {
        let work = SeqWork {
            seq,
            tokens: std::mem::take(&mut next_input),
            sampling,
            needs: Needs::default(),
        };
        let out = executor.step(std::slice::from_ref(&work))?;
        let token = out[0].candidate;
        if generated.is_empty() {
            ttft = start.elapsed();
        }
        if eos.contains(&token) {
            return Ok((generated, FinishReason::Stop, ttft));
        }
        generated.push(token);
        next_input.push(token);
    }
    Ok((generated, FinishReason::Length, ttft))
}

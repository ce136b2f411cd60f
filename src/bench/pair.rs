//! `bench pair`: how well a cheap model (a variant of the checkpoint) stands in for a
//! reference model. Agreement is teacher-forced on the reference's own greedy continuation:
//! at each generated position, does the candidate model's greedy token equal the reference's?
//! Costs are median single-sequence decode steps, measured alternately in one run.

use super::median;
use super::prompts::{first_sentence, PROMPTS};
use serde::Serialize;
use std::time::Instant;
use tokenrouter::engine::tokenizer::ModelTokenizer;
use tokenrouter::engine::{Needs, SamplingParams, SeqId, SeqWork, StepExecutor};
use tokenrouter::error::EngineResult;

#[derive(Debug, Clone, Serialize)]
pub struct PairReport {
    pub model: String,
    pub reference: String,
    pub positions: usize,
    pub agreement: f64,
    pub model_step_ms: f64,
    pub reference_step_ms: f64,
    pub cost_ratio: f64,
}

fn step_one(
    executor: &mut dyn StepExecutor,
    seq: u64,
    tokens: Vec<u32>,
) -> EngineResult<(u32, f64)> {
    let start = Instant::now();
    let out = executor.step(&[SeqWork {
        seq: SeqId(seq),
        tokens,
        sampling: SamplingParams::greedy(),
        needs: Needs::default(),
        filter: None,
    }])?;
    Ok((out[0].candidate, start.elapsed().as_secs_f64() * 1e3))
}

pub fn run(
    model: &mut dyn StepExecutor,
    reference: &mut dyn StepExecutor,
    tokenizer: &ModelTokenizer,
    continuation: usize,
) -> EngineResult<PairReport> {
    let (mut agree, mut positions) = (0usize, 0usize);
    let (mut model_ms, mut reference_ms) = (Vec::new(), Vec::new());
    for (p, prompt) in PROMPTS.iter().enumerate() {
        let ids = tokenizer.encode(first_sentence(prompt))?;
        let seq = p as u64;
        let (mut expected, _) = step_one(reference, seq, ids.clone())?;
        let (mut predicted, _) = step_one(model, seq, ids)?;
        for _ in 0..continuation {
            agree += usize::from(predicted == expected);
            positions += 1;
            let (next_ref, ref_ms) = step_one(reference, seq, vec![expected])?;
            let (next_model, m_ms) = step_one(model, seq, vec![expected])?;
            reference_ms.push(ref_ms);
            model_ms.push(m_ms);
            expected = next_ref;
            predicted = next_model;
        }
        model.free(SeqId(seq));
        reference.free(SeqId(seq));
    }
    let model_step_ms = median(&mut model_ms);
    let reference_step_ms = median(&mut reference_ms);
    Ok(PairReport {
        model: model.name().to_string(),
        reference: reference.name().to_string(),
        positions,
        agreement: agree as f64 / positions as f64,
        model_step_ms,
        reference_step_ms,
        cost_ratio: model_step_ms / reference_step_ms,
    })
}

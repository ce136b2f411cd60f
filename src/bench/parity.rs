//! `bench parity`: one model on two executors (the CPU and a GPU), greedy continuations of the
//! fixed prompts decoded together in ragged steps; the tokens must agree. Shows that a backend
//! computes the same model, not merely a plausible one.

use super::prompts::{first_sentence, PROMPTS};
use serde::Serialize;
use tokenrouter::engine::tokenizer::ModelTokenizer;
use tokenrouter::engine::{Needs, SamplingParams, SeqId, SeqWork, StepExecutor};
use tokenrouter::error::EngineResult;

#[derive(Debug, Clone, Serialize)]
pub struct ParityReport {
    pub reference: String,
    pub candidate: String,
    pub tokens_per_prompt: usize,
    pub prompts: Vec<PromptParity>,
    pub all_match: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct PromptParity {
    pub prompt: String,
    pub reference_text: String,
    pub candidate_text: String,
    /// First generated position where the tokens differ.
    pub first_mismatch: Option<usize>,
}

/// Greedy continuations of `prompts`, all sequences in each step.
fn greedy(
    executor: &mut dyn StepExecutor,
    prompts: &[Vec<u32>],
    tokens: usize,
) -> EngineResult<Vec<Vec<u32>>> {
    let mut generated = vec![Vec::with_capacity(tokens); prompts.len()];
    let mut inputs = prompts.to_vec();
    for _ in 0..tokens {
        let work: Vec<SeqWork> = inputs
            .iter()
            .enumerate()
            .map(|(i, t)| SeqWork {
                seq: SeqId(i as u64),
                tokens: t.clone(),
                sampling: SamplingParams::greedy(),
                needs: Needs::default(),
            })
            .collect();
        for (i, out) in executor.step(&work)?.into_iter().enumerate() {
            generated[i].push(out.candidate);
            inputs[i] = vec![out.candidate];
        }
    }
    for seq in 0..prompts.len() {
        executor.free(SeqId(seq as u64));
    }
    Ok(generated)
}

pub fn run(
    reference: &mut dyn StepExecutor,
    candidate: &mut dyn StepExecutor,
    tokenizer: &ModelTokenizer,
    tokens: usize,
) -> EngineResult<ParityReport> {
    let texts: Vec<&str> = PROMPTS.iter().map(|p| first_sentence(p)).collect();
    let prompts = texts
        .iter()
        .map(|t| tokenizer.encode(t))
        .collect::<EngineResult<Vec<_>>>()?;
    let expected = greedy(reference, &prompts, tokens)?;
    let actual = greedy(candidate, &prompts, tokens)?;
    let mut report = Vec::with_capacity(prompts.len());
    for ((text, e), a) in texts.iter().zip(&expected).zip(&actual) {
        report.push(PromptParity {
            prompt: text.to_string(),
            reference_text: tokenizer.decode(e, false)?,
            candidate_text: tokenizer.decode(a, false)?,
            first_mismatch: e.iter().zip(a).position(|(x, y)| x != y),
        });
    }
    Ok(ParityReport {
        reference: reference.name().to_string(),
        candidate: candidate.name().to_string(),
        tokens_per_prompt: tokens,
        all_match: report.iter().all(|p| p.first_mismatch.is_none()),
        prompts: report,
    })
}

impl ParityReport {
    pub fn markdown(&self) -> String {
        let mut out = format!(
            "Greedy parity, {} tokens per prompt: {} vs {}\n\n",
            self.tokens_per_prompt, self.candidate, self.reference
        );
        for p in &self.prompts {
            let verdict = match p.first_mismatch {
                None => "same tokens".to_string(),
                Some(i) => format!("DIFFER from token {i}"),
            };
            out += &format!(
                "- {:?}: {verdict}\n  reference: {:?}\n  candidate: {:?}\n",
                p.prompt, p.reference_text, p.candidate_text
            );
        }
        out
    }
}

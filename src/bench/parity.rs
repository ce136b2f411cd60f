//! `bench parity`: one model on two executors (the CPU and a GPU), greedy continuations of the
//! fixed prompts decoded together in ragged steps. Shows that a backend computes the same
//! model, not merely a plausible one. Two executors summing in different orders may rightly
//! part at a near-tie, so a first divergence passes only where the reference's top two logits
//! are within `TIE_MARGIN`, and the candidate, fed the reference's tokens, must pick the
//! reference's token at `MIN_FORCED_AGREEMENT` of the positions.

use super::prompts::{first_sentence, PROMPTS};
use serde::Serialize;
use tokenrouter::engine::sampling::top_logits;
use tokenrouter::engine::tokenizer::ModelTokenizer;
use tokenrouter::engine::{Needs, SamplingParams, SeqId, SeqWork, StepExecutor};
use tokenrouter::error::EngineResult;

/// Largest gap between the reference's two best logits at which a first divergence is a tie.
pub const TIE_MARGIN: f32 = 1e-3;
/// Least share of teacher-forced positions where the candidate picks the reference's token.
pub const MIN_FORCED_AGREEMENT: f64 = 0.99;

#[derive(Debug, Clone, Serialize)]
pub struct ParityReport {
    pub reference: String,
    pub candidate: String,
    pub tokens_per_prompt: usize,
    pub prompts: Vec<PromptParity>,
    /// Over every prompt's positions, fed the reference's tokens.
    pub forced_agreement: f64,
    /// Largest |reference − candidate| logit over the teacher-forced positions.
    pub max_logit_diff: f32,
    pub all_match: bool,
    /// Every divergence a tie and `forced_agreement` at least `MIN_FORCED_AGREEMENT`.
    pub passed: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct PromptParity {
    pub prompt: String,
    pub reference_text: String,
    pub candidate_text: String,
    /// First generated position where the tokens differ.
    pub first_mismatch: Option<usize>,
    /// The reference's top-2 logit margin at `first_mismatch`.
    pub margin_at_mismatch: Option<f32>,
    pub forced_agreement: f64,
}

/// One generated position: the executor's token and its logits.
struct Position {
    token: u32,
    logits: Vec<f32>,
}

/// Continuations of `prompts`, all sequences in each step: greedy, or fed `forced[i][j]` as
/// the input after position `j` (teacher forcing) when given.
fn decode(
    executor: &mut dyn StepExecutor,
    prompts: &[Vec<u32>],
    tokens: usize,
    forced: Option<&[Vec<u32>]>,
) -> EngineResult<Vec<Vec<Position>>> {
    let mut generated: Vec<Vec<Position>> = prompts.iter().map(|_| Vec::new()).collect();
    let mut inputs = prompts.to_vec();
    for step in 0..tokens {
        let work: Vec<SeqWork> = inputs
            .iter()
            .enumerate()
            .map(|(i, t)| SeqWork {
                seq: SeqId(i as u64),
                tokens: t.clone(),
                sampling: SamplingParams::greedy(),
                needs: Needs::default(),
                filter: None,
            })
            .collect();
        for (i, out) in executor.step(&work)?.into_iter().enumerate() {
            inputs[i] = vec![forced.map_or(out.candidate, |f| f[i][step])];
            generated[i].push(Position {
                token: out.candidate,
                logits: out.logits,
            });
        }
    }
    for seq in 0..prompts.len() {
        executor.free(SeqId(seq as u64));
    }
    Ok(generated)
}

/// Gap between the two largest logits (infinite with fewer than two).
pub(crate) fn top2_margin(logits: &[f32]) -> f32 {
    match top_logits(logits, 2)[..] {
        [(_, first), (_, second)] => first - second,
        _ => f32::INFINITY,
    }
}

/// First position where `candidate` leaves `reference`, and the reference's margin there.
fn first_divergence(reference: &[Position], candidate: &[u32]) -> Option<(usize, f32)> {
    let i = reference
        .iter()
        .zip(candidate)
        .position(|(r, &c)| r.token != c)?;
    Some((i, top2_margin(&reference[i].logits)))
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
    let expected = decode(reference, &prompts, tokens, None)?;
    let expected_tokens: Vec<Vec<u32>> = expected
        .iter()
        .map(|p| p.iter().map(|x| x.token).collect())
        .collect();
    let actual = decode(candidate, &prompts, tokens, None)?;
    let forced = decode(candidate, &prompts, tokens, Some(&expected_tokens))?;
    let mut report = Vec::with_capacity(prompts.len());
    let (mut agreeing, mut max_logit_diff) = (0, 0f32);
    for ((((text, e), reference_tokens), a), f) in texts
        .iter()
        .zip(&expected)
        .zip(&expected_tokens)
        .zip(&actual)
        .zip(&forced)
    {
        let actual_tokens: Vec<u32> = a.iter().map(|x| x.token).collect();
        let divergence = first_divergence(e, &actual_tokens);
        let agree = e.iter().zip(f).filter(|(e, f)| e.token == f.token).count();
        agreeing += agree;
        for (e, f) in e.iter().zip(f) {
            for (x, y) in e.logits.iter().zip(&f.logits) {
                max_logit_diff = max_logit_diff.max((x - y).abs());
            }
        }
        report.push(PromptParity {
            prompt: text.to_string(),
            reference_text: tokenizer.decode(reference_tokens, false)?,
            candidate_text: tokenizer.decode(&actual_tokens, false)?,
            first_mismatch: divergence.map(|d| d.0),
            margin_at_mismatch: divergence.map(|d| d.1),
            forced_agreement: agree as f64 / tokens as f64,
        });
    }
    let forced_agreement = agreeing as f64 / (tokens * prompts.len()) as f64;
    let ties_only = report
        .iter()
        .all(|p| p.margin_at_mismatch.is_none_or(|m| m < TIE_MARGIN));
    Ok(ParityReport {
        reference: reference.name().to_string(),
        candidate: candidate.name().to_string(),
        tokens_per_prompt: tokens,
        all_match: report.iter().all(|p| p.first_mismatch.is_none()),
        passed: ties_only && forced_agreement >= MIN_FORCED_AGREEMENT,
        forced_agreement,
        max_logit_diff,
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
            let verdict = match (p.first_mismatch, p.margin_at_mismatch) {
                (Some(i), Some(m)) if m < TIE_MARGIN => {
                    format!("differ from token {i}, at a tie (top-2 margin {m:.2e})")
                }
                (Some(i), Some(m)) => format!("DIFFER from token {i} (top-2 margin {m:.3})"),
                _ => "same tokens".to_string(),
            };
            out += &format!(
                "- {:?}: {verdict}; teacher-forced top-1 agreement {:.1} %\n  reference: {:?}\n  \
                 candidate: {:?}\n",
                p.prompt,
                100.0 * p.forced_agreement,
                p.reference_text,
                p.candidate_text
            );
        }
        out += &format!(
            "\nTeacher-forced top-1 agreement {:.2} % (needs ≥ {:.0} %), largest logit difference \
             {:.2e}: {}\n",
            100.0 * self.forced_agreement,
            100.0 * MIN_FORCED_AGREEMENT,
            self.max_logit_diff,
            if self.passed { "PASS" } else { "FAIL" }
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn positions(tokens: &[u32], margins: &[f32]) -> Vec<Position> {
        tokens
            .iter()
            .zip(margins)
            .map(|(&token, &m)| Position {
                token,
                logits: vec![0.5, 2.0, 2.0 - m, -1.0],
            })
            .collect()
    }

    #[test]
    fn the_margin_is_the_gap_between_the_two_best_logits() {
        assert_eq!(top2_margin(&[1.0, 3.0, 2.5, 3.0]), 0.0);
        assert!((top2_margin(&[-4.0, 0.25, -1.0]) - 1.25).abs() < 1e-6);
    }

    #[test]
    fn a_divergence_reports_its_first_position_and_the_reference_margin_there() {
        let reference = positions(&[1, 1, 2, 1], &[0.5, 0.25, 1e-4, 3.0]);
        assert_eq!(first_divergence(&reference, &[1, 1, 2, 1]), None);
        let (at, margin) = first_divergence(&reference, &[1, 1, 7, 0]).unwrap();
        assert_eq!(at, 2);
        assert!((margin - 1e-4).abs() < 1e-6);
        assert_eq!(first_divergence(&reference, &[0, 1, 2, 1]).unwrap().0, 0);
    }
}

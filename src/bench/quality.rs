//! `bench quality`: what routing costs in answers. Each policy (and each model alone) answers
//! the shipped questions greedily through the runtime, `concurrency` at a time; each answer is
//! scored (`answers::Scorable::is_correct`) and teacher-forced through the reference model
//! (the LLM) for its mean negative log-likelihood per token, lower meaning closer to what the
//! LLM itself would write. With the reference model served alone, an `oracle` row follows:
//! the router that hands the LLM exactly the positions where the SLM's greedy token differs
//! from the LLM's, whose answers are the LLM's, at the share the pair itself allows.

use super::answers::{self, Scorable, Split};
use super::routing::{add_threshold_variants, follow, Followed};
use serde::Serialize;
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Instant;
use tokenrouter::config::{Config, ModelConfig};
use tokenrouter::engine::chat::{ChatMessage, ChatTemplate};
use tokenrouter::engine::tokenizer::ModelTokenizer;
use tokenrouter::engine::{
    Executor, Needs, SamplingParams, SeqId, SeqWork, StepExecutor, StepOutput,
};
use tokenrouter::error::EngineResult;
use tokenrouter::runtime::{GenerateRequest, Prompt, Runtime, RuntimeError};

/// Sequences teacher-forced through the reference model together.
const NLL_BATCH: usize = 16;

pub struct QualityBenchSettings {
    /// Policies or model names; sweep variants are added after them.
    pub served: Vec<String>,
    pub sweeps: Vec<(String, Vec<f32>)>,
    /// `None`: every question.
    pub split: Option<Split>,
    /// At most this many questions (the first of the split), for quick runs.
    pub limit: Option<usize>,
    pub max_tokens: usize,
    pub concurrency: usize,
    /// The model whose likelihood scores answers and whose token share is reported.
    pub reference: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct QualityRow {
    /// A policy, a sweep variant (`name@threshold`) or a model alone.
    pub served: String,
    pub questions: usize,
    pub correct: usize,
    /// Requests that ended in an error (scored wrong).
    pub failed: usize,
    pub accuracy: f64,
    /// Mean over answer tokens of −log p under the reference model, nats.
    pub reference_nll: f64,
    pub reference_token_share: f64,
    pub handoffs_per_100_tokens: f64,
    /// Wall time per output token at the run's concurrency; none for the oracle, which is
    /// computed, not served.
    pub ms_per_token: Option<f64>,
    pub answers: Vec<ScoredAnswer>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ScoredAnswer {
    pub id: String,
    pub text: String,
    pub correct: bool,
}

/// One served name's answers, by question index.
struct Served {
    outputs: Vec<Option<Followed>>,
    seconds: f64,
}

async fn serve_all(
    runtime: Rc<Runtime>,
    prompts: Rc<Vec<Prompt>>,
    served: &str,
    settings: &QualityBenchSettings,
) -> Served {
    let outputs = Rc::new(RefCell::new(vec![None; prompts.len()]));
    let started = Instant::now();
    let (job_outputs, max_tokens) = (outputs.clone(), settings.max_tokens);
    let served: Rc<str> = served.into();
    super::for_each_closed_loop(settings.concurrency, prompts.len(), move |i| {
        let (runtime, prompts, outputs, served) = (
            runtime.clone(),
            prompts.clone(),
            job_outputs.clone(),
            served.clone(),
        );
        async move {
            let request = GenerateRequest {
                prompt: prompts[i].clone(),
                policy: Some(served.to_string()),
                max_tokens,
                sampling: SamplingParams::greedy(),
                timeout: None,
                ignore_eos: false,
            };
            let result = match runtime.submit(request) {
                Ok(handle) => follow(handle).await.ok(),
                Err(_) => None,
            };
            outputs.borrow_mut()[i] = result;
        }
    })
    .await;
    let seconds = started.elapsed().as_secs_f64();
    let outputs = Rc::into_inner(outputs)
        .expect("workers finished")
        .into_inner();
    Served { outputs, seconds }
}

/// Feeds every answer after its prompt through `executor`, one token per step, `NLL_BATCH`
/// sequences together, and calls `visit(answer, position, output)` with the step output that
/// predicts `answers[answer][position]`.
pub(crate) fn teacher_forced(
    executor: &mut dyn StepExecutor,
    prompts: &[Vec<u32>],
    answers: &[Vec<u32>],
    needs: Needs,
    mut visit: impl FnMut(usize, usize, &StepOutput),
) -> EngineResult<()> {
    let indices: Vec<usize> = (0..prompts.len())
        .filter(|&i| !answers[i].is_empty())
        .collect();
    for chunk in indices.chunks(NLL_BATCH) {
        let longest = chunk.iter().map(|&i| answers[i].len()).max().unwrap_or(0);
        for step in 0..longest {
            let live: Vec<usize> = chunk
                .iter()
                .copied()
                .filter(|&i| step < answers[i].len())
                .collect();
            let work: Vec<SeqWork> = live
                .iter()
                .map(|&i| SeqWork {
                    seq: SeqId(i as u64),
                    tokens: match step {
                        0 => prompts[i].clone(),
                        _ => vec![answers[i][step - 1]],
                    },
                    sampling: SamplingParams::greedy(),
                    needs,
                    filter: None,
                })
                .collect();
            for (out, &i) in executor.step(&work)?.iter().zip(&live) {
                visit(i, step, out);
            }
        }
        for &i in chunk {
            executor.free(SeqId(i as u64));
        }
    }
    Ok(())
}

/// Mean −log p per answer token under `executor`.
fn mean_nll(
    executor: &mut dyn StepExecutor,
    prompts: &[Vec<u32>],
    answers: &[Vec<u32>],
) -> EngineResult<f64> {
    let (mut total, mut count) = (0.0, 0usize);
    teacher_forced(
        executor,
        prompts,
        answers,
        Needs::default(),
        |i, position, out| {
            total += negative_log_likelihood(&out.logits, answers[i][position]);
            count += 1;
        },
    )?;
    Ok(total / count.max(1) as f64)
}

/// The oracle router on the reference model's own answers (`answers`: in the small model's
/// vocabulary, its reading of them where the two differ): the small model writes a position
/// exactly where its greedy token is the answer's, so the text is the reference's. Its
/// reference token share, and handoffs per 100 tokens (changes of writer).
fn oracle_routing(
    small: &mut dyn StepExecutor,
    prompts: &[Vec<u32>],
    answers: &[Vec<u32>],
) -> EngineResult<(f64, f64)> {
    let mut reference_writes: Vec<Vec<bool>> =
        answers.iter().map(|a| vec![false; a.len()]).collect();
    teacher_forced(
        small,
        prompts,
        answers,
        Needs::default(),
        |i, position, out| {
            reference_writes[i][position] = out.candidate != answers[i][position];
        },
    )?;
    let tokens: usize = answers.iter().map(Vec::len).sum();
    let reference: usize = reference_writes.iter().flatten().filter(|&&w| w).count();
    let handoffs: usize = reference_writes
        .iter()
        .map(|w| {
            w.windows(2).filter(|p| p[0] != p[1]).count() + usize::from(w.first() == Some(&true))
        })
        .sum();
    let per_token = |n: usize| n as f64 / tokens.max(1) as f64;
    Ok((per_token(reference), 100.0 * per_token(handoffs)))
}

/// −log softmax(logits)[token].
fn negative_log_likelihood(logits: &[f32], token: u32) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    max + sum.ln() - logits[token as usize] as f64
}

/// Each question as a one-message chat, rendered with the model's template and tokenized.
pub(crate) fn chat_prompts(
    tokenizer: &ModelTokenizer,
    questions: &[Scorable],
) -> Result<Vec<Vec<u32>>, RuntimeError> {
    let template = ChatTemplate::for_model(tokenizer)?;
    questions
        .iter()
        .map(|q| {
            let messages = [ChatMessage::user(q.question.question.clone())];
            Ok(tokenizer.encode(&template.render(&messages, true)?)?)
        })
        .collect()
}

/// Every question of the split (at most `limit`), scorable against the whole set's groups.
fn selected_questions(settings: &QualityBenchSettings) -> Result<Vec<Scorable>, RuntimeError> {
    let all = answers::questions().map_err(RuntimeError::Failed)?;
    let mut chosen: Vec<Scorable> = answers::scorable(&all)
        .into_iter()
        .filter(|q| settings.split.is_none_or(|s| q.question.split == s))
        .collect();
    if let Some(limit) = settings.limit {
        chosen.truncate(limit);
    }
    Ok(chosen)
}

pub async fn run(
    config: &Config,
    settings: &QualityBenchSettings,
) -> Result<Vec<QualityRow>, RuntimeError> {
    let mut config = config.clone();
    let mut served = settings.served.clone();
    for sweep in &settings.sweeps {
        served.extend(add_threshold_variants(&mut config, sweep)?);
    }
    let reference_config: ModelConfig = config
        .models
        .iter()
        .find(|m| m.name == settings.reference)
        .cloned()
        .ok_or_else(|| RuntimeError::UnknownPolicy(settings.reference.clone()))?;
    let runtime = Rc::new(Runtime::start(&config, None)?);
    let registry = runtime.policies();
    if let Some(unknown) = served.iter().find(|p| registry.get(p).is_none()) {
        return Err(RuntimeError::UnknownPolicy(unknown.clone()));
    }
    let names: Vec<String> = runtime
        .model_names()
        .iter()
        .map(|n| n.to_string())
        .collect();
    let reference_index = names.iter().position(|n| n == &settings.reference);
    let questions = selected_questions(settings)?;
    let prompts: Vec<Prompt> = questions
        .iter()
        .map(|q| runtime.render(&[ChatMessage::user(q.question.question.clone())]))
        .collect::<Result<_, _>>()?;
    // The reference scores answers in its own vocabulary.
    let reference_vocabulary = reference_index.map_or(0, |r| runtime.vocabulary_of(r));
    let reference_spelling = runtime.spellings()?[reference_index.unwrap_or(0)].clone();
    let forced_prompts: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            p.in_vocabulary(reference_vocabulary)
                .unwrap_or_default()
                .to_vec()
        })
        .collect();
    let longest_prompt = forced_prompts.iter().map(Vec::len).max().unwrap_or(0);
    // Teacher forcing holds NLL_BATCH whole answers at once, whatever the serving budget.
    let forcing = |model: &ModelConfig| ModelConfig {
        kv_tokens: model
            .kv_tokens
            .max(NLL_BATCH * (longest_prompt + settings.max_tokens + 1)),
        ..model.clone()
    };
    let mut scorer = Executor::load(&forcing(&reference_config))?;
    let prompts = Rc::new(prompts);
    let mut rows = Vec::new();
    let mut reference_answers = None;
    for name in &served {
        let result = serve_all(runtime.clone(), prompts.clone(), name, settings).await;
        let (mut tokens, mut reference_tokens, mut handoffs) = (0, 0, 0);
        let mut answers = Vec::with_capacity(questions.len());
        let mut answer_tokens = Vec::with_capacity(questions.len());
        for (q, output) in questions.iter().zip(&result.outputs) {
            let Followed {
                tokens: ids,
                writers,
                routing,
                ..
            } = output.clone().unwrap_or_default();
            tokens += ids.len();
            handoffs += routing.handoffs;
            reference_tokens += reference_index
                .and_then(|r| routing.tokens_per_model.get(r))
                .copied()
                .unwrap_or(0);
            let text = runtime.text_of(&ids, &writers)?;
            // Tokens another vocabulary wrote are read in the reference's.
            let in_reference = match writers
                .iter()
                .all(|&m| runtime.vocabulary_of(m) == reference_vocabulary)
            {
                true => ids,
                false => reference_spelling.encode(&text)?,
            };
            answers.push(ScoredAnswer {
                id: q.question.id.clone(),
                correct: output.is_some() && q.is_correct(&text),
                text,
            });
            answer_tokens.push(in_reference);
        }
        let correct = answers.iter().filter(|a| a.correct).count();
        rows.push(QualityRow {
            served: name.clone(),
            questions: questions.len(),
            correct,
            failed: result.outputs.iter().filter(|o| o.is_none()).count(),
            accuracy: correct as f64 / questions.len().max(1) as f64,
            reference_nll: mean_nll(&mut scorer, &forced_prompts, &answer_tokens)?,
            reference_token_share: reference_tokens as f64 / tokens.max(1) as f64,
            handoffs_per_100_tokens: 100.0 * handoffs as f64 / tokens.max(1) as f64,
            ms_per_token: Some(1e3 * result.seconds / tokens.max(1) as f64),
            answers,
        });
        if name == &settings.reference {
            reference_answers = Some((rows.len() - 1, answer_tokens));
        }
    }
    // The oracle teacher-forces the small model along its own reading of the reference's
    // answers (their tokens, in one vocabulary; their text re-read, in two).
    let small = (0..config.models.len()).find(|&m| config.models[m].name != settings.reference);
    if let (Some((row, answer_tokens)), Some(small)) = (reference_answers, small) {
        let small_vocabulary = runtime.vocabulary_of(small);
        let (small_prompts, small_answers) = match small_vocabulary == reference_vocabulary {
            true => (forced_prompts, answer_tokens),
            false => {
                let spelling = runtime.spellings()?[small].clone();
                let answers = rows[row]
                    .answers
                    .iter()
                    .map(|a| spelling.encode(&a.text))
                    .collect::<Result<_, _>>()?;
                let prompts = prompts
                    .iter()
                    .map(|p| {
                        p.in_vocabulary(small_vocabulary)
                            .unwrap_or_default()
                            .to_vec()
                    })
                    .collect();
                (prompts, answers)
            }
        };
        let mut small = Executor::load(&forcing(&config.models[small]))?;
        let (share, handoffs) = oracle_routing(&mut small, &small_prompts, &small_answers)?;
        rows.push(QualityRow {
            served: "oracle".into(),
            reference_token_share: share,
            handoffs_per_100_tokens: handoffs,
            ms_per_token: None,
            ..rows[row].clone()
        });
    }
    if let Ok(runtime) = Rc::try_unwrap(runtime) {
        runtime.shutdown();
    }
    Ok(rows)
}

pub fn markdown(rows: &[QualityRow], reference: &str) -> String {
    let mut out = format!(
        "| served | correct | accuracy | {reference} NLL (nats/token) | {reference} token share \
         | handoffs/100 tok | ms/token |\n|---|---:|---:|---:|---:|---:|---:|\n"
    );
    for r in rows {
        let failed = match r.failed {
            0 => String::new(),
            n => format!(" ({n} failed)"),
        };
        out += &format!(
            "| {} | {}/{}{failed} | {:.1} % | {:.3} | {:.1} % | {:.1} | {} |\n",
            r.served,
            r.correct,
            r.questions,
            100.0 * r.accuracy,
            r.reference_nll,
            100.0 * r.reference_token_share,
            r.handoffs_per_100_tokens,
            r.ms_per_token.map_or("–".into(), |ms| format!("{ms:.1}"))
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_negative_log_likelihood_is_minus_the_log_softmax() {
        let logits = [1.0f32, 2.0, 3.0];
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        for (token, &l) in logits.iter().enumerate() {
            let expected = -((l as f64).exp() / z).ln();
            assert!((negative_log_likelihood(&logits, token as u32) - expected).abs() < 1e-9);
        }
        assert!(negative_log_likelihood(&[0.0, 1000.0], 1).abs() < 1e-9);
    }
}

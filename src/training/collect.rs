//! `router collect`: the traces a router learns from. The LLM answers each shipped question
//! greedily; the SLM is then teacher-forced along that answer, and every answer position
//! yields the SLM's features as R2R and CITER read them while serving (hidden state after the
//! final norm, the 100 largest logits, the candidate's input embedding) and two labels:
//! - `label`: the SLM's greedy token differs from the LLM's;
//! - `divergent` (R2R's stricter label, with the answer scorer as its judge): the SLM's token
//!   differs *and* the LLM, continuing greedily after it, no longer answers correctly where
//!   its own answer was correct. Only these positions cost accuracy when the SLM writes them.

use crate::bench::answers::{self, Scorable, Split};
use crate::bench::quality::{chat_prompts, teacher_forced};
use anyhow::{bail, Context};
use candle_core::{Device, Tensor};
use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use tokenrouter::config::ModelConfig;
use tokenrouter::engine::spelling::Spelling;
use tokenrouter::engine::tokenizer::ModelTokenizer;
use tokenrouter::engine::{
    Executor, Needs, SamplingParams, SeqId, SeqWork, StepExecutor, StepOutput,
};
use tokenrouter::error::EngineResult;
use tokenrouter::policy::learned::{padded_top_logits, R2R_TOP_K};

/// Sequences the LLM answers together.
const ANSWER_BATCH: usize = 16;

/// One row per answer position, features row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Traces {
    pub hidden_size: usize,
    /// `[rows, hidden_size]`: the SLM's final hidden state.
    pub hidden: Vec<f32>,
    /// `[rows, hidden_size]`: the input embedding of the SLM's greedy candidate.
    pub embedding: Vec<f32>,
    /// `[rows, R2R_TOP_K]`: the SLM's largest logits, largest first.
    pub top_logits: Vec<f32>,
    /// The SLM's greedy candidate.
    pub token: Vec<u32>,
    /// 1 where the SLM's greedy token differs from the LLM's.
    pub label: Vec<u8>,
    /// 1 where the SLM's token turns the LLM's correct answer into a wrong one.
    pub divergent: Vec<u8>,
    /// 1 where the position belongs to a held-out question (evaluation only).
    pub heldout: Vec<u8>,
    /// Index of the question in the shipped set.
    pub question: Vec<u32>,
}

/// What the SLM's teacher-forced steps return: everything R2R's and CITER's routers read.
const ROUTER_NEEDS: Needs = Needs {
    hidden: true,
    top_k: R2R_TOP_K,
    embedding: true,
};

impl Traces {
    /// One position's row: the SLM's step `out` (run with `ROUTER_NEEDS`), whether its token
    /// differs from the LLM's, and the question it belongs to.
    fn push_row(&mut self, out: &StepOutput, differs: bool, question: &Scorable, index: usize) {
        let asked = "the executor returns what `ROUTER_NEEDS` asks for";
        self.hidden.extend(out.hidden.as_ref().expect(asked));
        self.embedding
            .extend(out.candidate_embedding.as_ref().expect(asked));
        padded_top_logits(&out.stats.top_k, &mut self.top_logits);
        self.token.push(out.candidate);
        self.label.push(u8::from(differs));
        self.heldout
            .push(u8::from(question.question.split == Split::Heldout));
        self.question.push(index as u32);
    }

    fn empty(hidden_size: usize) -> Self {
        Traces {
            hidden_size,
            hidden: Vec::new(),
            embedding: Vec::new(),
            top_logits: Vec::new(),
            token: Vec::new(),
            label: Vec::new(),
            divergent: Vec::new(),
            heldout: Vec::new(),
            question: Vec::new(),
        }
    }

    pub fn rows(&self) -> usize {
        self.label.len()
    }

    pub fn save(&self, path: &Path) -> anyhow::Result<()> {
        let (n, h) = (self.rows(), self.hidden_size);
        let cpu = &Device::Cpu;
        let tensors: HashMap<&str, Tensor> = HashMap::from([
            ("hidden", Tensor::from_slice(&self.hidden, (n, h), cpu)?),
            (
                "embedding",
                Tensor::from_slice(&self.embedding, (n, h), cpu)?,
            ),
            (
                "top_logits",
                Tensor::from_slice(&self.top_logits, (n, R2R_TOP_K), cpu)?,
            ),
            ("token", Tensor::from_slice(&self.token, n, cpu)?),
            ("label", Tensor::from_slice(&self.label, n, cpu)?),
            ("divergent", Tensor::from_slice(&self.divergent, n, cpu)?),
            ("heldout", Tensor::from_slice(&self.heldout, n, cpu)?),
            ("question", Tensor::from_slice(&self.question, n, cpu)?),
        ]);
        candle_core::safetensors::save(&tensors, path)
            .with_context(|| format!("cannot write traces to {}", path.display()))
    }

    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let tensors = candle_core::safetensors::load(path, &Device::Cpu)
            .with_context(|| format!("cannot read traces from {}", path.display()))?;
        let get = |name: &str| {
            tensors.get(name).with_context(|| {
                format!(
                    "{} lacks `{name}`: not a `router collect` file",
                    path.display()
                )
            })
        };
        let hidden = get("hidden")?;
        let (rows, hidden_size) = hidden.dims2()?;
        let traces = Traces {
            hidden_size,
            hidden: hidden.flatten_all()?.to_vec1()?,
            embedding: get("embedding")?.flatten_all()?.to_vec1()?,
            top_logits: get("top_logits")?.flatten_all()?.to_vec1()?,
            token: get("token")?.to_vec1()?,
            label: get("label")?.to_vec1()?,
            divergent: get("divergent")?.to_vec1()?,
            heldout: get("heldout")?.to_vec1()?,
            question: get("question")?.to_vec1()?,
        };
        let consistent = traces.embedding.len() == rows * hidden_size
            && traces.top_logits.len() == rows * R2R_TOP_K
            && [&traces.label, &traces.divergent, &traces.heldout]
                .iter()
                .all(|c| c.len() == rows)
            && traces.token.len() == rows
            && traces.question.len() == rows;
        if !consistent {
            bail!("{}: its tensors disagree on the row count", path.display());
        }
        Ok(traces)
    }
}

pub struct CollectSettings {
    /// Questions per split, the first of each (`None`: all).
    pub limit: Option<usize>,
    pub max_tokens: usize,
}

/// Greedy answers of `executor` to `prompts`, each ending after an end-of-sequence token or
/// `budgets[i]` tokens (the end token is kept: predicting it is a position too).
fn greedy_answers(
    executor: &mut dyn StepExecutor,
    prompts: &[Vec<u32>],
    budgets: &[usize],
    eos: &BTreeSet<u32>,
) -> EngineResult<Vec<Vec<u32>>> {
    let mut answers = vec![Vec::new(); prompts.len()];
    let indices: Vec<usize> = (0..prompts.len()).filter(|&i| budgets[i] > 0).collect();
    let mut held = vec![0; prompts.len()];
    for chunk in indices.chunks(ANSWER_BATCH) {
        // Continuations share their prompt and answer prefix: start each on what the
        // executor's prefix cache holds (at least the last token is computed).
        for &i in chunk {
            let prompt = &prompts[i][..prompts[i].len().saturating_sub(1)];
            held[i] = executor.attach_prefix(SeqId(i as u64), prompt);
        }
        let mut live = chunk.to_vec();
        while !live.is_empty() {
            let work: Vec<SeqWork> = live
                .iter()
                .map(|&i| SeqWork {
                    seq: SeqId(i as u64),
                    tokens: match answers[i].last() {
                        Some(&t) => vec![t],
                        None => prompts[i][held[i]..].to_vec(),
                    },
                    sampling: SamplingParams::greedy(),
                    needs: Needs::default(),
                    filter: None,
                })
                .collect();
            for (out, &i) in executor.step(&work)?.iter().zip(&live) {
                answers[i].push(out.candidate);
            }
            live.retain(|&i| {
                let done = answers[i].len() >= budgets[i]
                    || answers[i].last().is_some_and(|t| eos.contains(t));
                !done
            });
        }
        for &i in chunk {
            executor.free(SeqId(i as u64));
        }
    }
    Ok(answers)
}

/// Traces of the pair over the shipped questions of both splits (the held-out rows are marked
/// and serve only to evaluate).
pub fn collect(
    llm: &ModelConfig,
    slm: &ModelConfig,
    settings: &CollectSettings,
) -> anyhow::Result<Traces> {
    let tokenizer = ModelTokenizer::load_for(llm)?;
    let slm_tokenizer = ModelTokenizer::load_for(slm)?;
    let all = answers::scorable(&answers::questions().map_err(anyhow::Error::msg)?);
    let mut chosen = Vec::new();
    for split in [Split::Train, Split::Heldout] {
        let of_split = all
            .iter()
            .enumerate()
            .filter(|(_, q)| q.question.split == split);
        chosen.extend(of_split.take(settings.limit.unwrap_or(usize::MAX)));
    }
    let (indices, questions): (Vec<usize>, Vec<Scorable>) =
        chosen.into_iter().map(|(i, q)| (i, q.clone())).unzip();
    if !slm_tokenizer.reads_like(&tokenizer) {
        let pair = Pair {
            llm: (llm, &tokenizer),
            slm: (slm, &slm_tokenizer),
        };
        return collect_across_vocabularies(pair, &questions, &indices, settings);
    }
    let prompts = chat_prompts(&tokenizer, &questions)?;
    let mut llm = Executor::load(llm)?;
    let budgets = vec![settings.max_tokens; prompts.len()];
    let answers = greedy_answers(&mut llm, &prompts, &budgets, &tokenizer.eos)?;
    let mut slm = Executor::load(slm)?;
    let mut traces = Traces::empty(slm.hidden_size());
    let mut positions = Vec::new();
    teacher_forced(
        &mut slm,
        &prompts,
        &answers,
        ROUTER_NEEDS,
        |i, position, out| {
            let differs = out.candidate != answers[i][position];
            traces.push_row(out, differs, &questions[i], indices[i]);
            positions.push((i, position, out.candidate));
        },
    )?;
    drop(slm);
    traces.divergent = divergence(
        &mut llm, &tokenizer, &questions, &prompts, &answers, &positions,
    )?;
    Ok(traces)
}

/// R2R's divergence label per trace row (`rows[r]` = question, answer position, SLM token):
/// where the SLM's token differs from the LLM's and the LLM answered correctly, the LLM
/// continues greedily after the SLM's token to the same answer length; the row is divergent
/// when that answer is no longer correct.
fn divergence(
    llm: &mut dyn StepExecutor,
    tokenizer: &ModelTokenizer,
    questions: &[Scorable],
    prompts: &[Vec<u32>],
    answers: &[Vec<u32>],
    rows: &[(usize, usize, u32)],
) -> anyhow::Result<Vec<u8>> {
    let mut correct = Vec::with_capacity(answers.len());
    for (q, answer) in questions.iter().zip(answers) {
        correct.push(q.is_correct(&tokenizer.decode(answer, true)?));
    }
    let judged: Vec<usize> = (0..rows.len())
        .filter(|&r| {
            let (i, position, token) = rows[r];
            correct[i] && token != answers[i][position]
        })
        .collect();
    let (mut prefixes, mut written, mut budgets) = (Vec::new(), Vec::new(), Vec::new());
    for &r in &judged {
        let (i, position, token) = rows[r];
        let mut answer = answers[i][..position].to_vec();
        answer.push(token);
        prefixes.push([&prompts[i][..], &answer].concat());
        budgets.push(match tokenizer.eos.contains(&token) {
            true => 0,
            false => answers[i].len() - answer.len(),
        });
        written.push(answer);
    }
    let continuations = greedy_answers(llm, &prefixes, &budgets, &tokenizer.eos)?;
    let mut divergent = vec![0; rows.len()];
    for ((&r, answer), continuation) in judged.iter().zip(&written).zip(&continuations) {
        let text = tokenizer.decode(&[&answer[..], continuation].concat(), true)?;
        divergent[r] = u8::from(!questions[rows[r].0].is_correct(&text));
    }
    Ok(divergent)
}

/// Two models, each with the tokenizer (and chat template) it reads.
struct Pair<'a> {
    llm: (&'a ModelConfig, &'a ModelTokenizer),
    slm: (&'a ModelConfig, &'a ModelTokenizer),
}

/// `collect` for a pair of two vocabularies: the SLM is teacher-forced along its own reading
/// of the LLM's answer text, and its token agrees where the text it spells continues that
/// answer (or both end). A divergent row's continuation is the LLM's, after the text so far
/// and the SLM's token re-read in the LLM's vocabulary.
fn collect_across_vocabularies(
    pair: Pair,
    questions: &[Scorable],
    indices: &[usize],
    settings: &CollectSettings,
) -> anyhow::Result<Traces> {
    let (llm_config, llm_tokenizer) = pair.llm;
    let (slm_config, slm_tokenizer) = pair.slm;
    let llm_spelling = Spelling::new(llm_tokenizer)?;
    let slm_spelling = Spelling::new(slm_tokenizer)?;
    let llm_prompts = chat_prompts(llm_tokenizer, questions)?;
    let slm_prompts = chat_prompts(slm_tokenizer, questions)?;
    let mut llm = Executor::load(llm_config)?;
    let budgets = vec![settings.max_tokens; questions.len()];
    let answers = greedy_answers(&mut llm, &llm_prompts, &budgets, &llm_tokenizer.eos)?;
    let ends = |a: &[u32]| a.last().is_some_and(|t| llm_tokenizer.eos.contains(t));
    // Each answer's text, up to its last whole character.
    let texts: Vec<String> = answers
        .iter()
        .map(|a| {
            let bytes = llm_spelling.spell(a);
            let whole = std::str::from_utf8(&bytes).map_or_else(|e| e.valid_up_to(), str::len);
            String::from_utf8_lossy(&bytes[..whole]).into_owned()
        })
        .collect();
    let slm_eos = slm_tokenizer
        .eos
        .first()
        .copied()
        .context("the SLM has no end token")?;
    let mut slm_answers = Vec::with_capacity(texts.len());
    for (text, answer) in texts.iter().zip(&answers) {
        let mut read = slm_spelling.encode(text)?;
        if ends(answer) {
            read.push(slm_eos);
        }
        slm_answers.push(read);
    }
    let mut slm = Executor::load(slm_config)?;
    let mut traces = Traces::empty(slm.hidden_size());
    // Per row: question, the answer's byte offset before it, and the SLM's token.
    let mut rows = Vec::new();
    teacher_forced(
        &mut slm,
        &slm_prompts,
        &slm_answers,
        ROUTER_NEEDS,
        |i, position, out| {
            let offset = slm_spelling.spell(&slm_answers[i][..position]).len();
            let ends = |t: &u32| slm_tokenizer.eos.contains(t);
            let agrees = continues_answer(
                ends(&slm_answers[i][position]),
                ends(&out.candidate),
                slm_spelling.bytes(out.candidate),
                &texts[i].as_bytes()[offset..],
            );
            traces.push_row(out, !agrees, &questions[i], indices[i]);
            rows.push((i, offset, out.candidate, agrees));
        },
    )?;
    drop(slm);
    // Divergence: where the LLM's own answer was right and the SLM's token differs.
    let correct: Vec<bool> = questions
        .iter()
        .zip(&texts)
        .map(|(q, text)| q.is_correct(text))
        .collect();
    let judged: Vec<usize> = (0..rows.len())
        .filter(|&r| correct[rows[r].0] && !rows[r].3)
        .collect();
    let (mut prefixes, mut written, mut continuation_budgets) =
        (Vec::new(), Vec::new(), Vec::new());
    for &r in &judged {
        let (i, offset, token, _) = rows[r];
        let mut text = texts[i].as_bytes()[..offset].to_vec();
        let ends_here = slm_tokenizer.eos.contains(&token);
        if !ends_here {
            text.extend_from_slice(slm_spelling.bytes(token));
        }
        let text = String::from_utf8_lossy(&text).into_owned();
        let read = llm_spelling.encode(&text)?;
        continuation_budgets.push(match ends_here {
            true => 0,
            false => answers[i].len().saturating_sub(read.len()),
        });
        prefixes.push([&llm_prompts[i][..], &read].concat());
        written.push(text);
    }
    let continuations = greedy_answers(
        &mut llm,
        &prefixes,
        &continuation_budgets,
        &llm_tokenizer.eos,
    )?;
    traces.divergent = vec![0; rows.len()];
    for ((&r, text), continuation) in judged.iter().zip(&written).zip(&continuations) {
        let whole = format!(
            "{text}{}",
            String::from_utf8_lossy(&llm_spelling.spell(continuation))
        );
        traces.divergent[r] = u8::from(!questions[rows[r].0].is_correct(&whole));
    }
    Ok(traces)
}

/// Whether a token of another vocabulary than the answer's agrees with it at a point where
/// `rest` of the answer text is left: both end there, or it spells some of `rest`'s start.
fn continues_answer(answer_ends: bool, token_ends: bool, spelled: &[u8], rest: &[u8]) -> bool {
    match answer_ends {
        true => token_ends,
        false => !token_ends && !spelled.is_empty() && rest.starts_with(spelled),
    }
}

#[cfg(test)]
mod tests {
    use super::continues_answer;

    #[test]
    fn a_token_of_another_vocabulary_agrees_where_it_spells_the_answers_next_bytes() {
        let rest = b" Tokyo.";
        assert!(continues_answer(false, false, b" Tok", rest));
        assert!(continues_answer(false, false, b" Tokyo.", rest));
        assert!(!continues_answer(false, false, b" Kyoto", rest));
        assert!(
            !continues_answer(false, false, b" Tokyo. It", rest),
            "past the answer"
        );
        assert!(
            !continues_answer(false, false, b"", rest),
            "a special token"
        );
        assert!(!continues_answer(false, true, b"", rest), "an early end");
        assert!(continues_answer(true, true, b"", b""));
        assert!(!continues_answer(true, false, b" And", b""));
    }
}

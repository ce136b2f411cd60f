//! The prompts of `bench routing`, built from text the repository ships (no downloads):
//! `short` questions, `long` generations that ignore end-of-sequence, and `agent`
//! conversations with a long multi-turn context. Without a tokenizer (every model a
//! latency-profile simulation) prompts are synthetic token ids of the same shape.

use super::prompts::PROMPTS;
use tokenrouter::engine::chat::ChatMessage;
use tokenrouter::runtime::{Prompt, Runtime, RuntimeError};

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Workload {
    /// A one-sentence question; generation stops at end-of-sequence.
    Short,
    /// The same questions, but every request generates exactly `max_tokens`.
    Long,
    /// A conversation of earlier turns (~1k tokens of context), then a question.
    Agent,
}

impl Workload {
    pub fn ignores_eos(self) -> bool {
        self == Workload::Long
    }
}

impl std::str::FromStr for Workload {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "short" => Ok(Workload::Short),
            "long" => Ok(Workload::Long),
            "agent" => Ok(Workload::Agent),
            _ => Err(format!("unknown workload `{s}` (short, long, agent)")),
        }
    }
}

fn sentences() -> Vec<&'static str> {
    PROMPTS.iter().flat_map(|p| p.split(". ")).collect()
}

/// Chat messages per request of the workload in round `round` (later rounds tag each
/// question, so no request repeats an earlier round's: with greedy decoding a repeat would
/// replay its whole answer from a prefix cache).
fn conversations(workload: Workload, round: usize) -> Vec<Vec<ChatMessage>> {
    let sentences = sentences();
    let question = |s: &str| match round {
        0 => ChatMessage::user(format!("Explain briefly: {s}.")),
        r => ChatMessage::user(format!("Round {r}. Explain briefly: {s}.")),
    };
    match workload {
        Workload::Short | Workload::Long => sentences.iter().map(|s| vec![question(s)]).collect(),
        Workload::Agent => (0..sentences.len())
            .map(|i| {
                let mut turns = vec![ChatMessage {
                    role: "system".into(),
                    content: "You are a research assistant. Keep answers short.".into(),
                }];
                for (k, text) in PROMPTS.iter().enumerate() {
                    turns.push(ChatMessage::user(format!(
                        "Document {}:\n{text}\nSummarise it in one sentence.",
                        k + 1
                    )));
                    turns.push(ChatMessage {
                        role: "assistant".into(),
                        content: text.split(". ").next().unwrap_or(text).to_string(),
                    });
                }
                turns.push(question(sentences[i]));
                turns
            })
            .collect(),
    }
}

/// Token prompts for the workload in round `round`, in request order (request i takes
/// prompt i mod len); every round's differ from every other's.
pub fn prompts(
    runtime: &Runtime,
    workload: Workload,
    round: usize,
) -> Result<Vec<Prompt>, RuntimeError> {
    if runtime.tokenizer().is_err() {
        let len = if workload == Workload::Agent {
            1024
        } else {
            24
        };
        let shift = 13 * round as u32;
        return Ok((0..16u32)
            .map(|i| {
                (0..len)
                    .map(|j| 3 + (i * 31 + j * 7 + shift) % 200)
                    .collect::<Vec<u32>>()
                    .into()
            })
            .collect());
    }
    conversations(workload, round)
        .iter()
        .map(|messages| Ok(runtime.render(messages)?))
        .collect()
}

//! OpenAI's `logprobs` in both endpoints' shapes: chat's list of entries and the legacy
//! completions' parallel arrays. Each entry also carries the token id and the entropy of
//! the whole distribution (extensions): an external dispatcher routes on them, and a token's
//! text alone does not name its id.

use crate::engine::tokenizer::ModelTokenizer;
use crate::runtime::TokenLogprobs;
use serde::Serialize;
use std::collections::BTreeMap;

/// One committed token's log-probabilities with its place in the completion's text.
pub(super) struct Entry {
    id: u32,
    logprobs: TokenLogprobs,
    /// Characters of completion text before this token.
    text_offset: usize,
}

impl Entry {
    pub fn new(id: u32, logprobs: TokenLogprobs, text_offset: usize) -> Self {
        Self {
            id,
            logprobs,
            text_offset,
        }
    }
}

#[derive(Debug, Serialize)]
pub(super) struct Alternative {
    token: String,
    logprob: f32,
    bytes: Vec<u8>,
    token_id: u32,
}

#[derive(Debug, Serialize)]
pub(super) struct ChatEntry {
    token: String,
    logprob: f32,
    bytes: Vec<u8>,
    top_logprobs: Vec<Alternative>,
    token_id: u32,
    entropy: f32,
}

/// A choice's `logprobs`, in the shape of its endpoint.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub(super) enum ChoiceLogprobs {
    Chat {
        content: Vec<ChatEntry>,
    },
    Text {
        tokens: Vec<String>,
        token_logprobs: Vec<f32>,
        top_logprobs: Vec<BTreeMap<String, f32>>,
        text_offset: Vec<usize>,
        token_ids: Vec<u32>,
        entropies: Vec<f32>,
    },
}

/// A token's own text (a token ending inside a UTF-8 character shows U+FFFD there).
fn token_text(tokenizer: &ModelTokenizer, id: u32) -> String {
    tokenizer.decode(&[id], false).unwrap_or_default()
}

fn alternative(tokenizer: &ModelTokenizer, (id, logprob): (u32, f32)) -> Alternative {
    let token = token_text(tokenizer, id);
    Alternative {
        bytes: token.as_bytes().to_vec(),
        token,
        logprob,
        token_id: id,
    }
}

pub(super) fn chat(tokenizer: &ModelTokenizer, entries: Vec<Entry>) -> ChoiceLogprobs {
    let content = entries
        .into_iter()
        .map(|e| {
            let token = token_text(tokenizer, e.id);
            ChatEntry {
                bytes: token.as_bytes().to_vec(),
                token,
                logprob: e.logprobs.logprob,
                top_logprobs: e
                    .logprobs
                    .top
                    .iter()
                    .map(|&alt| alternative(tokenizer, alt))
                    .collect(),
                token_id: e.id,
                entropy: e.logprobs.entropy,
            }
        })
        .collect();
    ChoiceLogprobs::Chat { content }
}

pub(super) fn text(tokenizer: &ModelTokenizer, entries: Vec<Entry>) -> ChoiceLogprobs {
    ChoiceLogprobs::Text {
        tokens: entries
            .iter()
            .map(|e| token_text(tokenizer, e.id))
            .collect(),
        token_logprobs: entries.iter().map(|e| e.logprobs.logprob).collect(),
        top_logprobs: entries
            .iter()
            .map(|e| {
                // Alternatives whose texts coincide keep the likeliest (they come first).
                let mut top = BTreeMap::new();
                for &(id, logprob) in &e.logprobs.top {
                    top.entry(token_text(tokenizer, id)).or_insert(logprob);
                }
                top
            })
            .collect(),
        text_offset: entries.iter().map(|e| e.text_offset).collect(),
        token_ids: entries.iter().map(|e| e.id).collect(),
        entropies: entries.iter().map(|e| e.logprobs.entropy).collect(),
    }
}

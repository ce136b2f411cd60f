//! A request served by models that read different vocabularies. What they share is the
//! committed text (`engine::shared_text`): the routing state holds the tokens of the
//! vocabulary its current model reads, and a handoff into another vocabulary swaps in that
//! vocabulary's prompt and its reading of the text, rolled back to its last stable boundary.

use crate::engine::shared_text::SharedText;
use crate::engine::spelling::Spelling;
use crate::policy::{ModelIdx, RoutingState};
use std::collections::BTreeSet;
use std::sync::Arc;

/// Which vocabulary each of a runtime's models reads, and what each vocabulary's tokens
/// spell. Models read one vocabulary when their tokenizer and chat template are the same.
pub(crate) struct Vocabularies {
    of_model: Vec<usize>,
    spellings: Vec<Arc<Spelling>>,
}

impl Vocabularies {
    /// `of_model[m]` numbers model `m`'s vocabulary from 0 in order of first appearance;
    /// `spellings` has one entry per number.
    pub fn new(of_model: Vec<usize>, spellings: Vec<Arc<Spelling>>) -> Self {
        debug_assert!(of_model.iter().all(|&v| v < spellings.len()));
        Self {
            of_model,
            spellings,
        }
    }

    pub fn of(&self, model: ModelIdx) -> usize {
        self.of_model[model]
    }

    pub fn spelling(&self, vocabulary: usize) -> &Arc<Spelling> {
        &self.spellings[vocabulary]
    }

    pub fn count(&self) -> usize {
        self.spellings.len()
    }
}

/// The part of a request that only a cross-vocabulary request has: per vocabulary its
/// prompt and end-of-sequence tokens, and the committed text with every vocabulary's tokens.
pub(crate) struct CrossVocab {
    vocabularies: Arc<Vocabularies>,
    prompts: Vec<Vec<u32>>,
    eos: Vec<Arc<BTreeSet<u32>>>,
    text: SharedText,
    /// The vocabulary of the routing state's tokens.
    held: usize,
    /// The prompt's length as `usage` reports it (in the vocabulary of the policy's first
    /// model).
    prompt_tokens: usize,
}

impl CrossVocab {
    /// A request entering at model `entry`, with `prompts` and `eos` per vocabulary (empty
    /// sets where the request ignores end-of-sequence). Returns the entry's prompt tokens,
    /// which the routing state starts from.
    pub fn new(
        vocabularies: Arc<Vocabularies>,
        prompts: Vec<Vec<u32>>,
        eos: Vec<Arc<BTreeSet<u32>>>,
        entry: ModelIdx,
        prompt_tokens: usize,
    ) -> (Self, Vec<u32>) {
        let held = vocabularies.of(entry);
        let first = prompts[held].clone();
        let count = vocabularies.count();
        (
            Self {
                vocabularies,
                prompt_tokens,
                prompts,
                eos,
                text: SharedText::new(count),
                held,
            },
            first,
        )
    }

    pub fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    /// Whether `token` of `model` ends the generation.
    pub fn ends(&self, model: ModelIdx, token: u32) -> bool {
        self.eos[self.vocabularies.of(model)].contains(&token)
    }

    /// Records a token `model` committed (the routing state's tokens got it too).
    pub fn commit(&mut self, model: ModelIdx, token: u32) {
        let vocabulary = self.vocabularies.of(model);
        debug_assert_eq!(vocabulary, self.held, "a commit from a model not serving");
        self.text
            .commit(vocabulary, token, self.vocabularies.spelling(vocabulary));
    }

    /// Whether the request may move from `from` to `to` now: within one vocabulary always,
    /// into another once the text ends on a whole character (a byte token may have written
    /// part of one, which the other vocabulary cannot read).
    pub fn may_leave(&self, from: ModelIdx, to: ModelIdx) -> bool {
        self.vocabularies.of(from) == self.vocabularies.of(to) || self.text.at_char_boundary()
    }

    /// Makes `state` hold the tokens of `to`'s vocabulary: its prompt and its reading of the
    /// whole committed text. Every model of that vocabulary forgets the positions after its
    /// last stable boundary (its KV rolls back to them when it admits the request).
    /// Err (a message) when no token of that vocabulary spells some byte of the text.
    pub fn enter(&mut self, state: &mut RoutingState, to: ModelIdx) -> Result<(), String> {
        let vocabulary = self.vocabularies.of(to);
        if vocabulary == self.held {
            return Ok(());
        }
        let resync = self
            .text
            .resync(vocabulary, self.vocabularies.spelling(vocabulary))
            .map_err(|e| format!("handing off across vocabularies: {e}"))?;
        let prompt = &self.prompts[vocabulary];
        let valid = prompt.len() + resync.kept;
        state.tokens.clone_from(prompt);
        state.tokens.extend_from_slice(self.text.tokens(vocabulary));
        state.prompt_len = prompt.len();
        for (model, seen) in state.seen.iter_mut().enumerate() {
            if self.vocabularies.of(model) == vocabulary {
                *seen = (*seen).min(valid);
            }
        }
        self.held = vocabulary;
        Ok(())
    }
}

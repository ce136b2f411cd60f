//! A model's vocabulary as llguidance sees it: every token's bytes in a trie, and the parser
//! factory that compiles grammars against it (built once per tokenizer: ~0.1 s for 49k
//! tokens).

use crate::engine::spelling::Spelling;
use crate::error::{EngineError, EngineResult};
use llguidance::api::ParserLimits;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::ParserFactory;
use std::collections::BTreeSet;
use std::sync::Arc;

pub struct Vocabulary {
    factory: ParserFactory,
    /// Ids that end a generation; the trie knows one of them as its end-of-sequence.
    eos: BTreeSet<u32>,
}

impl std::fmt::Debug for Vocabulary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vocabulary")
            .field("tokens", &self.env().tok_trie().vocab_size())
            .field("eos", &self.eos)
            .finish()
    }
}

fn invalid(e: impl std::fmt::Display) -> EngineError {
    EngineError::Tokenizer(format!("structured output: {e}"))
}

impl Vocabulary {
    /// Built from a vocabulary's spelling (byte-level BPE or byte fallback) and the ids that
    /// end a generation.
    pub fn new(
        spelling: &Spelling,
        eos: BTreeSet<u32>,
        limits: ParserLimits,
    ) -> EngineResult<Arc<Self>> {
        Self::from_words(spelling.words(), eos, limits)
    }

    /// From each token's bytes (a special token's start with 0xFF) and the end ids.
    pub fn from_words(
        words: &[Vec<u8>],
        eos: BTreeSet<u32>,
        limits: ParserLimits,
    ) -> EngineResult<Arc<Self>> {
        let first_eos = *eos
            .first()
            .ok_or_else(|| invalid("the tokenizer declares no end-of-sequence token"))?;
        let info = TokRxInfo::new(words.len() as u32, first_eos);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, words)));
        let mut factory = ParserFactory::new_simple(&env).map_err(invalid)?;
        factory.quiet();
        *factory.limits_mut() = limits;
        Ok(Arc::new(Self { factory, eos }))
    }

    pub(crate) fn factory(&self) -> &ParserFactory {
        &self.factory
    }

    pub(crate) fn env(&self) -> &TokEnv {
        self.factory.tok_env()
    }

    pub(crate) fn eos(&self) -> &BTreeSet<u32> {
        &self.eos
    }

    /// The text bytes token `token` spells (none for a special token).
    pub(crate) fn token_bytes(&self, token: u32) -> Vec<u8> {
        self.env().tok_trie().decode_ext(&[token], false)
    }
}

/// Token 0 ends the sequence, then every byte alone but 0xFF, which UTF-8 never holds and the
/// trie reserves (id = byte + 1), then `pieces`: a vocabulary for tests, with no tokenizer
/// file, that can spell any text as a byte-level vocabulary can.
#[cfg(test)]
pub(crate) fn vocabulary_for_tests(pieces: &[&str]) -> Arc<Vocabulary> {
    let mut words: Vec<Vec<u8>> = vec![b"\xff<eos>".to_vec()];
    words.extend((0x00u8..0xff).map(|b| vec![b]));
    words.extend(pieces.iter().map(|p| p.as_bytes().to_vec()));
    Vocabulary::from_words(&words, BTreeSet::from([0]), ParserLimits::default())
        .expect("a vocabulary")
}

/// The id of a byte in [`vocabulary_for_tests`].
#[cfg(test)]
pub(crate) fn ascii_token(byte: u8) -> u32 {
    u32::from(byte) + 1
}

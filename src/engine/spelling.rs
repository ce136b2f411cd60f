//! What a vocabulary's tokens spell, as bytes: the common ground of models whose vocabularies
//! differ (a handoff between them passes text, not ids) and of grammars that advance by bytes.

use super::tokenizer::ModelTokenizer;
use crate::error::{EngineError, EngineResult};
use tokenizers::Tokenizer;

/// One vocabulary's spelling: the bytes each token adds to decoded text, and text to tokens
/// that spell exactly that text.
pub struct Spelling {
    /// Per token id, llguidance's table: a special token's bytes follow a 0xFF mark (UTF-8
    /// never holds 0xFF), and it spells no text.
    words: Vec<Vec<u8>>,
    /// Per byte value, a token spelling that one byte, where the vocabulary has one.
    byte_tokens: Vec<Option<u32>>,
    /// The model's tokenizer reading special-token markup as plain text: generated text that
    /// happens to contain `<end_of_turn>` must not become the control token.
    tokenizer: Tokenizer,
}

fn invalid(e: impl std::fmt::Display) -> EngineError {
    EngineError::Tokenizer(format!("spelling table: {e}"))
}

impl Spelling {
    pub fn new(tokenizer: &ModelTokenizer) -> EngineResult<Self> {
        let json: serde_json::Value =
            serde_json::from_str(&tokenizer.inner.to_string(false).map_err(invalid)?)
                .map_err(invalid)?;
        // llguidance's reading of byte-level BPE and of byte-fallback SentencePiece alike.
        let words = llguidance::token_bytes_from_tokenizer_json(&json).map_err(invalid)?;
        let mut byte_tokens = vec![None; 256];
        for (id, spelled) in words.iter().enumerate() {
            if let [byte] = spelled[..] {
                byte_tokens[byte as usize].get_or_insert(id as u32);
            }
        }
        let mut plain = tokenizer.inner.clone();
        plain.set_encode_special_tokens(true);
        Ok(Self {
            words,
            byte_tokens,
            tokenizer: plain,
        })
    }

    /// The bytes `token` adds to text (none for special tokens and ids past the table).
    pub fn bytes(&self, token: u32) -> &[u8] {
        match self.words.get(token as usize) {
            Some(word) if word.first() != Some(&0xFF) => word,
            _ => &[],
        }
    }

    /// Every token's bytes as llguidance reads a vocabulary (special ones after a 0xFF mark).
    pub fn words(&self) -> &[Vec<u8>] {
        &self.words
    }

    /// The bytes `tokens` spell, one after another.
    pub fn spell(&self, tokens: &[u32]) -> Vec<u8> {
        tokens
            .iter()
            .flat_map(|&t| self.bytes(t))
            .copied()
            .collect()
    }

    /// Tokens spelling exactly `text`: the tokenizer's own split where it spells the text
    /// back (a normalizer may not: SentencePiece reads a literal `▁` as a space); otherwise
    /// character by character, with byte tokens for a character the split would change.
    pub fn encode(&self, text: &str) -> EngineResult<Vec<u32>> {
        let split = |text: &str| -> EngineResult<Vec<u32>> {
            Ok(self
                .tokenizer
                .encode(text, false)
                .map_err(invalid)?
                .get_ids()
                .to_vec())
        };
        let whole = split(text)?;
        if self.spell(&whole) == text.as_bytes() {
            return Ok(whole);
        }
        let mut out = Vec::new();
        for (at, c) in text.char_indices() {
            let one = &text[at..at + c.len_utf8()];
            let ids = split(one)?;
            if self.spell(&ids) == one.as_bytes() {
                out.extend(ids);
                continue;
            }
            for &byte in one.as_bytes() {
                out.push(
                    self.byte_tokens[byte as usize].ok_or_else(|| {
                        invalid(format!("no token spells {c:?} (byte {byte:#04x})"))
                    })?,
                );
            }
        }
        Ok(out)
    }
}

/// The real SmolLM2 and Gemma 3 tokenizers' spellings (49k byte-level BPE, 262k
/// SentencePiece), for tests of handoffs between them; `None` where a file is not fetched, a
/// failure under `TOKENROUTER_REQUIRE_MODEL=1`.
#[cfg(test)]
pub(crate) fn real_spellings() -> Option<&'static [std::sync::Arc<Spelling>; 2]> {
    use crate::engine::tokenizer::ModelTokenizer;
    use std::sync::Arc;
    static SPELLINGS: std::sync::OnceLock<Option<[Arc<Spelling>; 2]>> = std::sync::OnceLock::new();
    SPELLINGS
        .get_or_init(|| {
            let models = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models");
            let files = [
                "SmolLM2-135M-Instruct.Q4_1.gguf",
                "gemma-3-270m-q4_k_m.gguf",
            ];
            if let Some(missing) = files.iter().find(|f| !models.join(f).exists()) {
                let required = std::env::var("TOKENROUTER_REQUIRE_MODEL").is_ok_and(|v| v == "1");
                assert!(!required, "models/{missing} is missing");
                eprintln!("skipping: models/{missing} not fetched");
                return None;
            }
            let spelling = |file: &str| {
                Arc::new(Spelling::new(&ModelTokenizer::load(&models.join(file)).unwrap()).unwrap())
            };
            Some([spelling(files[0]), spelling(files[1])])
        })
        .as_ref()
}

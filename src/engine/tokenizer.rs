//! Text <-> token ids: from a Hugging Face `tokenizer.json`, or rebuilt from the vocabulary
//! embedded in a GGUF file (`tokenizer.ggml.*`) as a `tokenizers::Tokenizer`: byte-level BPE
//! (`gpt2`) or SentencePiece BPE with byte fallback (`llama`, as Gemma ships).

use super::weights::{read_gguf, read_text, CheckpointFormat};
use crate::config::ModelConfig;
use crate::error::{EngineError, EngineResult};
use candle_core::quantized::gguf_file::{Content, Value};
use std::collections::BTreeSet;
use std::collections::HashMap;
use std::path::Path;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::replace::Replace;
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

/// GGUF token type of control tokens (`<|im_start|>` ...): they become special tokens.
const TOKEN_TYPE_CONTROL: u32 = 3;
/// GGUF token type of user-defined tokens: matched whole, but printed like text.
const TOKEN_TYPE_USER_DEFINED: u32 = 4;
/// GGUF token type of ordinary vocabulary pieces.
const TOKEN_TYPE_NORMAL: u32 = 1;
/// SentencePiece's visible space.
const SPM_SPACE: &str = "\u{2581}";
/// Ends of a chat turn that a model's metadata may not name as its end of sequence, though
/// generation ends there (llama.cpp treats them as end-of-generation tokens too).
const END_OF_TURN_TOKENS: [&str; 1] = ["<end_of_turn>"];

const REGEX_QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const REGEX_LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A model's tokenizer plus the special ids and chat template that come with it.
pub struct ModelTokenizer {
    pub inner: Tokenizer,
    pub bos: Option<u32>,
    /// Ids that end a generation (a model may declare several).
    pub eos: BTreeSet<u32>,
    pub add_bos: bool,
    pub chat_template: Option<String>,
}

fn tok_err(e: impl std::fmt::Display) -> EngineError {
    EngineError::Tokenizer(e.to_string())
}

impl ModelTokenizer {
    pub fn load(path: &Path) -> EngineResult<Self> {
        match CheckpointFormat::detect(path)? {
            CheckpointFormat::Gguf(path) => {
                let (content, _) = read_gguf(&path)?;
                Self::from_gguf(&content)
            }
            CheckpointFormat::HuggingFace(dir) => Self::from_hf_dir(&dir),
        }
    }

    /// A model entry's tokenizer, with the chat template its config puts in place of the
    /// model's own.
    pub fn load_for(config: &ModelConfig) -> EngineResult<Self> {
        let mut tokenizer = Self::load(&config.path)?;
        if let Some(path) = &config.chat_template {
            tokenizer.chat_template = Some(read_text(path)?);
        }
        Ok(tokenizer)
    }

    /// Encodes text; special-token markup in `text` (e.g. from a chat template) maps to its ids.
    pub fn encode(&self, text: &str) -> EngineResult<Vec<u32>> {
        let mut ids = Vec::new();
        if self.add_bos {
            ids.extend(self.bos);
        }
        let encoding = self.inner.encode(text, false).map_err(tok_err)?;
        ids.extend_from_slice(encoding.get_ids());
        Ok(ids)
    }

    pub fn decode(&self, ids: &[u32], skip_special: bool) -> EngineResult<String> {
        self.inner.decode(ids, skip_special).map_err(tok_err)
    }

    pub fn token_text(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Whether `other` reads a conversation and its answer as the same tokens (the same
    /// vocabulary, special ids and chat template).
    pub fn reads_like(&self, other: &ModelTokenizer) -> bool {
        self.chat_template == other.chat_template
            && self.bos == other.bos
            && self.eos == other.eos
            && self.add_bos == other.add_bos
            && self.vocab_size() == other.vocab_size()
            && self.inner.to_string(false).ok() == other.inner.to_string(false).ok()
    }

    pub fn from_gguf(content: &Content) -> EngineResult<Self> {
        let md = &content.metadata;
        let string = |key: &str| md.get(key).and_then(|v| v.to_string().ok()).cloned();
        let id = |key: &str| md.get(key).and_then(value_as_u32);
        let kind = string("tokenizer.ggml.model").unwrap_or_default();
        let tokens = string_array(md.get("tokenizer.ggml.tokens"), "tokenizer.ggml.tokens")?;
        let types: Vec<u32> = match md.get("tokenizer.ggml.token_type") {
            Some(v) => v
                .to_vec()
                .map_err(tok_err)?
                .iter()
                .map(|t| value_as_u32(t).unwrap_or(TOKEN_TYPE_NORMAL))
                .collect(),
            None => vec![TOKEN_TYPE_NORMAL; tokens.len()],
        };
        let mut inner = match kind.as_str() {
            "gpt2" => {
                let merges =
                    string_array(md.get("tokenizer.ggml.merges"), "tokenizer.ggml.merges")?;
                let pre = string("tokenizer.ggml.pre").unwrap_or_else(|| "gpt2".into());
                byte_level_bpe(&tokens, merges, &pre)?
            }
            "llama" => {
                let scores = float_array(md.get("tokenizer.ggml.scores"), "tokenizer.ggml.scores")?;
                if md
                    .get("tokenizer.ggml.add_space_prefix")
                    .and_then(|v| v.to_bool().ok())
                    .unwrap_or(true)
                {
                    return Err(EngineError::Tokenizer(
                        "SentencePiece with a space prefix (`tokenizer.ggml.add_space_prefix`) \
                         is not supported"
                            .into(),
                    ));
                }
                sentencepiece_bpe(&tokens, &scores, &types)?
            }
            other => {
                return Err(EngineError::Tokenizer(format!(
                    "GGUF tokenizer model `{other}` is not supported (byte-level BPE `gpt2`, \
                     SentencePiece BPE `llama`)"
                )))
            }
        };
        let added: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, &t)| t == TOKEN_TYPE_CONTROL || t == TOKEN_TYPE_USER_DEFINED)
            .map(|(text, &t)| {
                // SentencePiece matches them in the raw text, before spaces become `▁`.
                AddedToken::from(text.clone(), t == TOKEN_TYPE_CONTROL)
                    .normalized(kind != "llama" && t != TOKEN_TYPE_CONTROL)
            })
            .collect();
        inner.add_special_tokens(added).map_err(tok_err)?;
        let mut eos: BTreeSet<u32> = id("tokenizer.ggml.eos_token_id").into_iter().collect();
        eos.extend(
            END_OF_TURN_TOKENS
                .iter()
                .filter_map(|t| tokens.iter().position(|x| x == t))
                .map(|i| i as u32),
        );
        let add_bos = md
            .get("tokenizer.ggml.add_bos_token")
            .and_then(|v| v.to_bool().ok())
            .unwrap_or(false);
        Ok(Self {
            inner,
            bos: id("tokenizer.ggml.bos_token_id"),
            eos,
            add_bos,
            chat_template: string("tokenizer.chat_template"),
        })
    }

    pub fn from_hf_dir(dir: &Path) -> EngineResult<Self> {
        let file = dir.join("tokenizer.json");
        if !file.exists() {
            return Err(EngineError::MissingFile(file));
        }
        let inner = Tokenizer::from_file(&file).map_err(tok_err)?;
        let json = |name: &str| -> serde_json::Value {
            std::fs::read_to_string(dir.join(name))
                .ok()
                .and_then(|t| serde_json::from_str(&t).ok())
                .unwrap_or(serde_json::Value::Null)
        };
        let tok_config = json("tokenizer_config.json");
        let token_id = |v: &serde_json::Value| -> Option<u32> {
            let text = v
                .as_str()
                .or_else(|| v.get("content").and_then(|c| c.as_str()))?;
            inner.token_to_id(text)
        };
        let mut eos = BTreeSet::new();
        eos.extend(token_id(&tok_config["eos_token"]));
        for source in [json("config.json"), json("generation_config.json")] {
            match &source["eos_token_id"] {
                serde_json::Value::Number(n) => eos.extend(n.as_u64().map(|n| n as u32)),
                serde_json::Value::Array(list) => {
                    eos.extend(list.iter().filter_map(|n| n.as_u64()).map(|n| n as u32))
                }
                _ => {}
            }
        }
        let chat_template = match &tok_config["chat_template"] {
            serde_json::Value::String(s) => Some(s.clone()),
            // A list of named templates: take the default one.
            serde_json::Value::Array(list) => list
                .iter()
                .find(|t| t["name"] == "default")
                .or_else(|| list.first())
                .and_then(|t| t["template"].as_str())
                .map(str::to_string),
            _ => None,
        };
        Ok(Self {
            bos: token_id(&tok_config["bos_token"]),
            add_bos: tok_config["add_bos_token"].as_bool().unwrap_or(false),
            inner,
            eos,
            chat_template,
        })
    }
}

/// Each token's id by its text.
fn bpe_vocab(tokens: &[String]) -> tokenizers::models::bpe::Vocab {
    tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect()
}

/// GPT-2 style byte-level BPE from its vocabulary and ranked merges.
fn byte_level_bpe(tokens: &[String], merges: Vec<String>, pre: &str) -> EngineResult<Tokenizer> {
    let merges = merges
        .into_iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| tok_err(format!("invalid merge `{m}`")))
        })
        .collect::<EngineResult<Vec<_>>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(bpe_vocab(tokens), merges)
        .build()
        .map_err(tok_err)?;
    let mut inner = Tokenizer::new(bpe);
    inner.with_pre_tokenizer(Some(pre_tokenizer(pre)?));
    if pre == "qwen2" {
        inner.with_normalizer(Some(NFC)).map_err(tok_err)?;
    }
    inner.with_decoder(Some(ByteLevelDecoder::default()));
    Ok(inner)
}

/// SentencePiece BPE as llama.cpp runs it (`llm_tokenizer_spm`): spaces become `▁`, then
/// adjacent pieces merge, the pair whose union has the highest score first (the leftmost on a
/// tie), and characters no piece covers fall back to `<0xXX>` byte tokens. A BPE whose merges
/// are every split of a piece into two pieces, ranked by the union's score, merges the same
/// way (transformers' `SentencePieceExtractor` builds Gemma's `tokenizer.json` so).
fn sentencepiece_bpe(tokens: &[String], scores: &[f32], types: &[u32]) -> EngineResult<Tokenizer> {
    if scores.len() != tokens.len() || types.len() != tokens.len() {
        return Err(tok_err(format!(
            "{} tokens but {} scores and {} types",
            tokens.len(),
            scores.len(),
            types.len()
        )));
    }
    let normal: HashMap<&str, u32> = tokens
        .iter()
        .zip(types)
        .enumerate()
        .filter(|(_, (_, &t))| t == TOKEN_TYPE_NORMAL)
        .map(|(i, (text, _))| (text.as_str(), i as u32))
        .collect();
    // (union's score, left id, right id) per merge: the sort puts the best first, and a
    // piece's own splits in id order (as the extractor does).
    let mut ranked: Vec<(f32, u32, u32)> = Vec::new();
    for (&piece, &id) in &normal {
        for (split, _) in piece.char_indices().skip(1) {
            let (left, right) = piece.split_at(split);
            if let (Some(&l), Some(&r)) = (normal.get(left), normal.get(right)) {
                ranked.push((scores[id as usize], l, r));
            }
        }
    }
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let merges = ranked
        .into_iter()
        .map(|(_, l, r)| (tokens[l as usize].clone(), tokens[r as usize].clone()))
        .collect();
    let mut builder = BPE::builder()
        .vocab_and_merges(bpe_vocab(tokens), merges)
        .byte_fallback(true);
    if let Some(unk) = tokens.iter().find(|t| *t == "<unk>") {
        builder = builder.unk_token(unk.clone()).fuse_unk(true);
    }
    let mut inner = Tokenizer::new(builder.build().map_err(tok_err)?);
    inner
        .with_normalizer(Some(Replace::new(" ", SPM_SPACE).map_err(tok_err)?))
        .map_err(tok_err)?;
    inner.with_decoder(Some(DecoderSequence::new(vec![
        Replace::new(SPM_SPACE, " ").map_err(tok_err)?.into(),
        ByteFallback::default().into(),
        Fuse::default().into(),
    ])));
    Ok(inner)
}

/// The pre-tokenizer llama.cpp uses for a `tokenizer.ggml.pre` value.
fn pre_tokenizer(pre: &str) -> EngineResult<PreTokenizerWrapper> {
    let split = |regex: &str| -> EngineResult<PreTokenizerWrapper> {
        let split = Split::new(
            SplitPattern::Regex(regex.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(tok_err)?;
        Ok(Sequence::new(vec![
            split.into(),
            ByteLevel::new(false, false, false).into(),
        ])
        .into())
    };
    Ok(match pre {
        // SmolLM: single digits, then GPT-2 byte-level splitting, no prefix space.
        "smollm" => Sequence::new(vec![
            Digits::new(true).into(),
            ByteLevel::new(false, true, true).into(),
        ])
        .into(),
        "qwen2" | "deepseek-r1-qwen" => split(REGEX_QWEN2)?,
        "llama-bpe" | "llama3" | "smaug-bpe" => split(REGEX_LLAMA3)?,
        _ => ByteLevel::new(false, true, true).into(),
    })
}

fn value_as_u32(v: &Value) -> Option<u32> {
    match v {
        Value::U8(x) => Some(*x as u32),
        Value::U16(x) => Some(*x as u32),
        Value::U32(x) => Some(*x),
        Value::U64(x) => u32::try_from(*x).ok(),
        Value::I32(x) => u32::try_from(*x).ok(),
        Value::I64(x) => u32::try_from(*x).ok(),
        _ => None,
    }
}

fn float_array(v: Option<&Value>, key: &str) -> EngineResult<Vec<f32>> {
    let list = v
        .ok_or_else(|| tok_err(format!("missing GGUF key `{key}`")))?
        .to_vec()
        .map_err(tok_err)?;
    list.iter().map(|v| v.to_f32().map_err(tok_err)).collect()
}

fn string_array(v: Option<&Value>, key: &str) -> EngineResult<Vec<String>> {
    let list = v
        .ok_or_else(|| tok_err(format!("missing GGUF key `{key}`")))?
        .to_vec()
        .map_err(tok_err)?;
    list.iter()
        .map(|v| v.to_string().cloned().map_err(tok_err))
        .collect()
}

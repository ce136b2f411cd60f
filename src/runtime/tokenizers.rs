//! The runtime's vocabularies: which tokenizer and chat template each model reads, a
//! request's prompt in each, and what each vocabulary's tokens spell.

use super::core::Vocabularies;
use crate::config::Config;
use crate::engine::chat::{ChatMessage, ChatTemplate};
use crate::engine::spelling::Spelling;
use crate::engine::tokenizer::ModelTokenizer;
use crate::error::{EngineError, EngineResult};
use crate::policy::ModelIdx;
use std::sync::{Arc, OnceLock};

/// A prompt in the vocabularies a request's models read. Token ids name one vocabulary (the
/// runtime's first); text and messages are read by each (`Runtime::encode`, `Runtime::render`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prompt {
    by_vocabulary: Vec<Vec<u32>>,
}

impl From<Vec<u32>> for Prompt {
    fn from(tokens: Vec<u32>) -> Self {
        Self {
            by_vocabulary: vec![tokens],
        }
    }
}

impl Prompt {
    /// The prompt in the runtime's first vocabulary.
    pub fn tokens(&self) -> &[u32] {
        &self.by_vocabulary[0]
    }

    /// Tokens of its longest reading.
    pub fn longest(&self) -> usize {
        self.by_vocabulary.iter().map(Vec::len).max().unwrap_or(0)
    }

    /// The prompt in vocabulary `v`, when it came in that vocabulary.
    pub fn in_vocabulary(&self, v: usize) -> Option<&[u32]> {
        self.by_vocabulary.get(v).map(Vec::as_slice)
    }

    pub(crate) fn into_vocabularies(self) -> Vec<Vec<u32>> {
        self.by_vocabulary
    }
}

/// One vocabulary: the tokenizer and chat template of the first model that reads it.
struct Reading {
    tokenizer: Arc<ModelTokenizer>,
    /// Err: why the model has none (a chat request then fails with it).
    template: Result<ChatTemplate, String>,
    spelling: OnceLock<Arc<Spelling>>,
}

/// Every vocabulary of a runtime, and which one each model reads. Models read one
/// vocabulary when their tokenizers and chat templates are the same; a latency-profile
/// model reads the first (it has no tokenizer of its own).
pub(crate) struct Tokenizers {
    readings: Vec<Reading>,
    of_model: Vec<usize>,
    /// Built at start-up when there is more than one vocabulary: requests across them
    /// need every spelling.
    cross: Option<Arc<Vocabularies>>,
}

impl Tokenizers {
    /// Loads the tokenizer of every model `load` selects (others read the first vocabulary).
    pub fn load(config: &Config, load: impl Fn(ModelIdx) -> bool) -> EngineResult<Self> {
        let mut readings: Vec<Reading> = Vec::new();
        let mut of_model = Vec::with_capacity(config.models.len());
        for (m, model) in config.models.iter().enumerate() {
            if model.latency_profile_ms.is_some() || !load(m) {
                of_model.push(0);
                continue;
            }
            let tokenizer = ModelTokenizer::load_for(model)?;
            let v = match readings
                .iter()
                .position(|r| r.tokenizer.reads_like(&tokenizer))
            {
                Some(v) => v,
                None => {
                    readings.push(Reading {
                        template: ChatTemplate::for_model(&tokenizer).map_err(|e| e.to_string()),
                        tokenizer: Arc::new(tokenizer),
                        spelling: OnceLock::new(),
                    });
                    readings.len() - 1
                }
            };
            of_model.push(v);
        }
        let mut tokenizers = Self {
            readings,
            of_model,
            cross: None,
        };
        if tokenizers.count() > 1 {
            let spellings = (0..tokenizers.count())
                .map(|v| tokenizers.spelling(v))
                .collect::<EngineResult<Vec<_>>>()?;
            tokenizers.cross = Some(Arc::new(Vocabularies::new(
                tokenizers.of_model.clone(),
                spellings,
            )));
        }
        Ok(tokenizers)
    }

    pub fn count(&self) -> usize {
        self.readings.len()
    }

    pub fn of(&self, model: ModelIdx) -> usize {
        self.of_model[model]
    }

    /// The first vocabulary's tokenizer (`None` when every model is a latency profile).
    pub fn first(&self) -> Option<&Arc<ModelTokenizer>> {
        self.readings.first().map(|r| &r.tokenizer)
    }

    pub fn tokenizer(&self, vocabulary: usize) -> &Arc<ModelTokenizer> {
        &self.readings[vocabulary].tokenizer
    }

    /// What vocabulary `v`'s tokens spell (built on first use: ~0.2 s for 49k tokens, ~1 s
    /// for 262k).
    pub fn spelling(&self, v: usize) -> EngineResult<Arc<Spelling>> {
        let reading = &self.readings[v];
        if let Some(spelling) = reading.spelling.get() {
            return Ok(spelling.clone());
        }
        let built = Arc::new(Spelling::new(&reading.tokenizer)?);
        Ok(reading.spelling.get_or_init(|| built).clone())
    }

    /// The vocabularies of a runtime with more than one.
    pub fn cross(&self) -> Option<&Arc<Vocabularies>> {
        self.cross.as_ref()
    }

    /// Whether `models` read more than one vocabulary.
    pub fn spans(&self, models: &[ModelIdx]) -> bool {
        models.windows(2).any(|w| self.of(w[0]) != self.of(w[1]))
    }

    /// `text` in every vocabulary.
    pub fn encode(&self, text: &str) -> EngineResult<Prompt> {
        self.any()?;
        let by_vocabulary = self
            .readings
            .iter()
            .map(|r| r.tokenizer.encode(text))
            .collect::<EngineResult<_>>()?;
        Ok(Prompt { by_vocabulary })
    }

    /// `messages` rendered by each vocabulary's chat template and read in its vocabulary.
    pub fn render(&self, messages: &[ChatMessage]) -> EngineResult<Prompt> {
        self.any()?;
        let by_vocabulary = self
            .readings
            .iter()
            .map(|r| {
                let template = r
                    .template
                    .as_ref()
                    .map_err(|e| EngineError::ChatTemplate(e.clone()))?;
                r.tokenizer.encode(&template.render(messages, true)?)
            })
            .collect::<EngineResult<_>>()?;
        Ok(Prompt { by_vocabulary })
    }
}

impl Tokenizers {
    fn any(&self) -> EngineResult<()> {
        match self.readings.is_empty() {
            true => Err(EngineError::Tokenizer(
                "every model is a latency-profile simulation: no tokenizer".into(),
            )),
            false => Ok(()),
        }
    }
}

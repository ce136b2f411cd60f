//! OpenAI request bodies, and their validation into what the runtime takes. Unknown fields
//! are ignored (clients send many); known ones are checked and errors name the field.

use super::error::ApiError;
use crate::config::ServerConfig;
use crate::engine::chat::ChatMessage;
use crate::engine::SamplingParams;
use serde::Deserialize;

/// OpenAI's defaults where a field is absent.
const DEFAULT_COMPLETION_MAX_TOKENS: i64 = 16;
const DEFAULT_TEMPERATURE: f64 = 1.0;
const MAX_STOP_SEQUENCES: usize = 4;

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: Prompt,
}

#[derive(Debug, Deserialize)]
pub struct ChatCompletionRequest {
    pub model: Option<String>,
    pub messages: Vec<ChatMessageIn>,
    /// The newer name of `max_tokens` for chat.
    pub max_completion_tokens: Option<i64>,
}

/// The sampling and streaming fields both endpoints share, read from the same body.
#[derive(Debug, Default, Deserialize)]
pub struct GenerationOptions {
    pub max_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<i64>,
    /// Extension (as in vLLM): generate exactly `max_tokens`, for benchmarks.
    #[serde(default)]
    pub ignore_eos: bool,
    /// Extension: this request's deadline in seconds (at most `server.request_timeout_s`).
    pub timeout: Option<f64>,
}

#[derive(Debug, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
pub struct ChatMessageIn {
    pub role: String,
    pub content: Option<MessageContent>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

/// Validated generation parameters.
#[derive(Debug, Clone)]
pub struct Generation {
    /// The field that set it and its value; `None`: until the context is full (chat).
    pub max_tokens: Option<(&'static str, usize)>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub ignore_eos: bool,
    pub timeout: std::time::Duration,
}

impl GenerationOptions {
    /// `max_tokens` is the value the endpoint resolved (chat: `max_completion_tokens` too).
    pub fn validate(
        &self,
        max_tokens: Option<(&'static str, i64)>,
        limits: &ServerConfig,
    ) -> Result<Generation, ApiError> {
        let limit = limits.max_tokens_limit as i64;
        if let Some((field, value)) = max_tokens.filter(|(_, v)| !(1..=limit).contains(v)) {
            return Err(ApiError::invalid(
                field,
                format!("`{field}` must be between 1 and {limit}, got {value}"),
            ));
        }
        let temperature = self.temperature.unwrap_or(DEFAULT_TEMPERATURE);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::invalid(
                "temperature",
                format!("`temperature` must be between 0 and 2, got {temperature}"),
            ));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::invalid(
                "top_p",
                format!("`top_p` must be in (0, 1], got {top_p}"),
            ));
        }
        if let Some(n) = self.n.filter(|&n| n != 1) {
            return Err(ApiError::invalid(
                "n",
                format!("only `n` = 1 is supported, got {n}"),
            ));
        }
        let stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(list)) => list.clone(),
        };
        if stop.len() > MAX_STOP_SEQUENCES || stop.iter().any(String::is_empty) {
            return Err(ApiError::invalid(
                "stop",
                format!("`stop` takes up to {MAX_STOP_SEQUENCES} non-empty strings"),
            ));
        }
        let seed = self.seed.map_or_else(rand::random, |s| s as u64);
        let timeout = match self.timeout {
            None => limits.request_timeout_s,
            Some(t) if t > 0.0 && t.is_finite() => t.min(limits.request_timeout_s),
            Some(t) => {
                return Err(ApiError::invalid(
                    "timeout",
                    format!("`timeout` must be a positive number of seconds, got {t}"),
                ))
            }
        };
        Ok(Generation {
            max_tokens: max_tokens.map(|(field, v)| (field, v as usize)),
            sampling: SamplingParams {
                temperature: temperature as f32,
                top_k: 0,
                top_p: top_p as f32,
                seed,
            },
            stop,
            stream: self.stream,
            ignore_eos: self.ignore_eos,
            timeout: std::time::Duration::from_secs_f64(timeout),
            include_usage: self
                .stream_options
                .as_ref()
                .is_some_and(|o| o.include_usage),
        })
    }
}

impl CompletionRequest {
    pub fn generation(
        &self,
        options: &GenerationOptions,
        limits: &ServerConfig,
    ) -> Result<Generation, ApiError> {
        let max_tokens = options.max_tokens.unwrap_or(DEFAULT_COMPLETION_MAX_TOKENS);
        options.validate(Some(("max_tokens", max_tokens)), limits)
    }
}

impl ChatCompletionRequest {
    pub fn generation(
        &self,
        options: &GenerationOptions,
        limits: &ServerConfig,
    ) -> Result<Generation, ApiError> {
        let max_tokens = match (self.max_completion_tokens, options.max_tokens) {
            (Some(v), _) => Some(("max_completion_tokens", v)),
            (None, Some(v)) => Some(("max_tokens", v)),
            (None, None) => None,
        };
        // Chat has no default length: it runs until the context (or the server's limit) ends.
        options.validate(max_tokens, limits)
    }

    /// The messages as the chat template takes them.
    pub fn chat_messages(&self) -> Result<Vec<ChatMessage>, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::invalid(
                "messages",
                "`messages` must contain at least one message",
            ));
        }
        self.messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                if !matches!(
                    m.role.as_str(),
                    "system" | "user" | "assistant" | "developer"
                ) {
                    return Err(ApiError::invalid(
                        &format!("messages[{i}].role"),
                        format!(
                            "unsupported role `{}` (system, developer, user, assistant)",
                            m.role
                        ),
                    ));
                }
                let content = match &m.content {
                    None => String::new(),
                    Some(MessageContent::Text(text)) => text.clone(),
                    Some(MessageContent::Parts(parts)) => parts
                        .iter()
                        .map(|p| match (p.kind.as_str(), &p.text) {
                            ("text", Some(text)) => Ok(text.as_str()),
                            _ => Err(ApiError::invalid(
                                &format!("messages[{i}].content"),
                                "only text content parts are supported",
                            )),
                        })
                        .collect::<Result<Vec<_>, _>>()?
                        .concat(),
                };
                let role = if m.role == "developer" {
                    "system".to_string()
                } else {
                    m.role.clone()
                };
                Ok(ChatMessage { role, content })
            })
            .collect()
    }
}

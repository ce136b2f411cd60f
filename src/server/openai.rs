//! OpenAI request bodies, and their validation into what the runtime takes. Unknown fields
//! are ignored (clients send many); known ones are checked and errors name the field. A known
//! field asking for behaviour this server does not implement is refused, never dropped
//! (`docs/http-api.md` lists every field and its treatment).

use super::error::ApiError;
use super::tools;
use crate::config::ServerConfig;
use crate::constraint::OutputFormat;
use crate::engine::chat::ChatMessage;
use crate::engine::SamplingParams;
use serde::Deserialize;
use serde_json::Value;

/// OpenAI's defaults where a field is absent.
const DEFAULT_COMPLETION_MAX_TOKENS: i64 = 16;
const DEFAULT_TEMPERATURE: f64 = 1.0;
const MAX_STOP_SEQUENCES: usize = 4;
/// Most alternatives per token a request may ask for (OpenAI's chat limit).
pub const MAX_TOP_LOGPROBS: i64 = 20;

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: Prompt,
    /// A chat field: refused here unless it asks for nothing.
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
}

#[derive(Debug, Deserialize)]
pub struct ChatCompletionRequest {
    pub model: Option<String>,
    pub messages: Vec<ChatMessageIn>,
    /// The newer name of `max_tokens` for chat.
    pub max_completion_tokens: Option<i64>,
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
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
    /// Chat: a flag; completions: how many alternatives per token.
    pub logprobs: Option<LogprobsField>,
    /// Chat: how many alternatives per token (with `logprobs: true`).
    pub top_logprobs: Option<i64>,
    /// `{"type": "text" | "json_object" | "json_schema", ...}`.
    pub response_format: Option<Value>,
    /// Extension (as in vLLM): output valid under this JSON schema.
    pub guided_json: Option<Value>,
    /// Extension (as in vLLM): output matching this regular expression.
    pub guided_regex: Option<String>,
    /// Extension (as in vLLM): output exactly one of these strings.
    pub guided_choice: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum LogprobsField {
    Flag(bool),
    Count(i64),
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
    /// An assistant turn's calls (its `content` may then be null).
    pub tool_calls: Option<Vec<Value>>,
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
    /// Alternatives per token when log-probabilities were asked for.
    pub logprobs: Option<usize>,
    /// The structured output asked for, with the field that asked.
    pub format: Option<(&'static str, OutputFormat)>,
    /// Chat: the functions the reply must call one of (then `format` is not used).
    pub calling: Option<tools::ToolCalling>,
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
            logprobs: None,
            format: self.output_format()?,
            calling: None,
        })
    }

    /// The one structured-output field set, as a format (`text` is none).
    fn output_format(&self) -> Result<Option<(&'static str, OutputFormat)>, ApiError> {
        let mut asked = Vec::new();
        if let Some(format) = &self.response_format {
            if let Some(format) = response_format(format)? {
                asked.push(("response_format", format));
            }
        }
        if let Some(schema) = &self.guided_json {
            asked.push((
                "guided_json",
                OutputFormat::JsonSchema(json_schema("guided_json", schema)?),
            ));
        }
        if let Some(regex) = &self.guided_regex {
            asked.push(("guided_regex", OutputFormat::Regex(regex.clone())));
        }
        if let Some(choices) = &self.guided_choice {
            if choices.is_empty() || choices.iter().any(String::is_empty) {
                return Err(ApiError::invalid(
                    "guided_choice",
                    "`guided_choice` must be a non-empty list of non-empty strings",
                ));
            }
            asked.push(("guided_choice", OutputFormat::Choice(choices.clone())));
        }
        if asked.len() > 1 {
            let names: Vec<&str> = asked.iter().map(|(field, _)| *field).collect();
            return Err(ApiError::invalid(
                asked[1].0,
                format!(
                    "set one structured-output field, not {}",
                    names.join(" and ")
                ),
            ));
        }
        Ok(asked.pop())
    }
}

/// OpenAI's `response_format`, checked field by field.
fn response_format(format: &Value) -> Result<Option<OutputFormat>, ApiError> {
    let kind = format.get("type").and_then(Value::as_str);
    match kind {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(OutputFormat::JsonObject)),
        Some("json_schema") => {
            let field = "response_format.json_schema";
            let Some(spec) = format.get("json_schema").filter(|s| s.is_object()) else {
                return Err(ApiError::invalid(
                    field,
                    "`response_format.json_schema` must be an object with `name` and `schema`",
                ));
            };
            let name = spec.get("name").and_then(Value::as_str).unwrap_or_default();
            if !is_valid_name(name) {
                return Err(ApiError::invalid(
                    "response_format.json_schema.name",
                    "`response_format.json_schema.name` must be 1 to 64 letters, digits, `_` or `-`",
                ));
            }
            if spec
                .get("strict")
                .is_some_and(|s| !s.is_boolean() && !s.is_null())
            {
                return Err(ApiError::invalid(
                    "response_format.json_schema.strict",
                    "`response_format.json_schema.strict` must be a boolean",
                ));
            }
            // Output is always held to the schema: `strict` false is served as strict.
            let schema = match spec.get("schema") {
                None | Some(Value::Null) => serde_json::json!({}),
                Some(schema) => json_schema("response_format.json_schema.schema", schema)?,
            };
            Ok(Some(OutputFormat::JsonSchema(schema)))
        }
        _ => Err(ApiError::invalid(
            "response_format.type",
            "`response_format.type` must be \"text\", \"json_object\" or \"json_schema\"",
        )),
    }
}

/// OpenAI's rule for the names of schemas and functions: 1 to 64 letters, digits, `_`, `-`.
pub(crate) fn is_valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// A JSON schema: an object or a boolean, or (as vLLM takes `guided_json`) a string of one.
fn json_schema(field: &str, value: &Value) -> Result<Value, ApiError> {
    let schema = match value {
        Value::String(text) => serde_json::from_str(text)
            .map_err(|e| ApiError::invalid(field, format!("`{field}` is not valid JSON: {e}")))?,
        other => other.clone(),
    };
    if !(schema.is_object() || schema.is_boolean()) {
        return Err(ApiError::invalid(
            field,
            format!("`{field}` must be a JSON schema (an object)"),
        ));
    }
    Ok(schema)
}

/// A count of alternatives per token, checked.
fn top_count(field: &str, n: i64) -> Result<usize, ApiError> {
    if !(0..=MAX_TOP_LOGPROBS).contains(&n) {
        return Err(ApiError::invalid(
            field,
            format!("`{field}` must be between 0 and {MAX_TOP_LOGPROBS}, got {n}"),
        ));
    }
    Ok(n as usize)
}

impl CompletionRequest {
    pub fn generation(
        &self,
        options: &GenerationOptions,
        limits: &ServerConfig,
    ) -> Result<Generation, ApiError> {
        let max_tokens = options.max_tokens.unwrap_or(DEFAULT_COMPLETION_MAX_TOKENS);
        if tools::tool_calling(self.tools.as_ref(), self.tool_choice.as_ref())?.is_some() {
            return Err(ApiError::invalid(
                "tools",
                "tool calling is a chat feature: use /v1/chat/completions",
            ));
        }
        if options.top_logprobs.is_some() {
            return Err(ApiError::invalid(
                "top_logprobs",
                "`top_logprobs` is a chat field: on /v1/completions `logprobs` is the number \
                 of alternatives",
            ));
        }
        let logprobs = match options.logprobs {
            None | Some(LogprobsField::Flag(false)) => None,
            Some(LogprobsField::Flag(true)) => {
                return Err(ApiError::invalid(
                    "logprobs",
                    format!(
                        "`logprobs` on /v1/completions is the number of alternatives per \
                         token, 0 to {MAX_TOP_LOGPROBS}"
                    ),
                ))
            }
            Some(LogprobsField::Count(n)) => Some(top_count("logprobs", n)?),
        };
        Ok(Generation {
            logprobs,
            ..options.validate(Some(("max_tokens", max_tokens)), limits)?
        })
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
        let top = options
            .top_logprobs
            .map(|n| top_count("top_logprobs", n))
            .transpose()?;
        let logprobs = match (&options.logprobs, top) {
            (Some(LogprobsField::Flag(true)), top) => Some(top.unwrap_or(0)),
            (None | Some(LogprobsField::Flag(false)), None | Some(0)) => None,
            (None | Some(LogprobsField::Flag(false)), Some(_)) => {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    "`top_logprobs` needs `logprobs` set to true",
                ))
            }
            (Some(LogprobsField::Count(_)), _) => {
                return Err(ApiError::invalid(
                    "logprobs",
                    "`logprobs` in chat is true or false; `top_logprobs` sets the alternatives",
                ))
            }
        };
        let calling = tools::tool_calling(self.tools.as_ref(), self.tool_choice.as_ref())?;
        // Chat has no default length: it runs until the context (or the server's limit) ends.
        Ok(Generation {
            logprobs,
            calling,
            ..options.validate(max_tokens, limits)?
        })
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
                    "system" | "user" | "assistant" | "developer" | "tool"
                ) {
                    return Err(ApiError::invalid(
                        &format!("messages[{i}].role"),
                        format!(
                            "unsupported role `{}` (system, developer, user, assistant, tool)",
                            m.role
                        ),
                    ));
                }
                let calls = match (&m.tool_calls, m.role.as_str()) {
                    (None, _) => Vec::new(),
                    (Some(calls), "assistant") => calls
                        .iter()
                        .enumerate()
                        .map(|(j, call)| {
                            tools::call_as_text(call).ok_or_else(|| {
                                ApiError::invalid(
                                    &format!("messages[{i}].tool_calls[{j}]"),
                                    "a tool call is {\"id\", \"type\": \"function\", \"function\": \
                                     {\"name\", \"arguments\": a JSON string}}",
                                )
                            })
                        })
                        .collect::<Result<_, _>>()?,
                    (Some(_), role) => {
                        return Err(ApiError::invalid(
                            &format!("messages[{i}].tool_calls"),
                            format!("only assistant messages carry `tool_calls`, not {role}"),
                        ))
                    }
                };
                let content = match &m.content {
                    None if !calls.is_empty() => String::new(),
                    None => {
                        let field = format!("messages[{i}].content");
                        return Err(ApiError::invalid(
                            &field,
                            format!("`{field}` is required: a string or a list of text parts"),
                        ));
                    }
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
                let content = std::iter::once(content)
                    .filter(|c| !c.is_empty())
                    .chain(calls)
                    .collect::<Vec<_>>()
                    .join("\n");
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

/// Whether a field's value is its default (the behaviour this server implements).
type IsDefault = fn(&Value) -> bool;

/// OpenAI fields whose non-default values change what a client gets back, and which this
/// server does not implement: each may be absent, `null` or its default, nothing else.
const UNIMPLEMENTED: [(&str, IsDefault, &str); 12] = [
    (
        "functions",
        empty_list,
        "the legacy `functions` are not supported: declare them in `tools`",
    ),
    (
        "function_call",
        none_or_auto,
        "the legacy `function_call` is not supported: use `tool_choice`",
    ),
    (
        "echo",
        falsy,
        "echoing the prompt is not supported (only false)",
    ),
    ("best_of", one, "only `best_of` = 1 is supported"),
    (
        "suffix",
        empty_text,
        "suffixes (insertion) are not supported (only an empty string)",
    ),
    (
        "logit_bias",
        empty_object,
        "logit bias is not supported (only an empty object)",
    ),
    (
        "presence_penalty",
        zero,
        "presence penalties are not supported (only 0)",
    ),
    (
        "frequency_penalty",
        zero,
        "frequency penalties are not supported (only 0)",
    ),
    (
        "repetition_penalty",
        one,
        "repetition penalties are not supported (only 1)",
    ),
    (
        "modalities",
        text_only,
        "only the text modality is supported",
    ),
    ("audio", Value::is_null, "audio output is not supported"),
    (
        "prediction",
        Value::is_null,
        "predicted outputs are not supported",
    ),
];

fn empty_list(v: &Value) -> bool {
    v.as_array().is_some_and(Vec::is_empty)
}

fn none_or_auto(v: &Value) -> bool {
    matches!(v.as_str(), Some("none" | "auto"))
}

fn falsy(v: &Value) -> bool {
    v == &Value::Bool(false)
}

fn zero(v: &Value) -> bool {
    v.as_f64() == Some(0.0)
}

fn one(v: &Value) -> bool {
    v.as_f64() == Some(1.0)
}

fn empty_text(v: &Value) -> bool {
    v.as_str() == Some("")
}

fn empty_object(v: &Value) -> bool {
    v.as_object().is_some_and(|o| o.is_empty())
}

fn text_only(v: &Value) -> bool {
    v.as_array()
        .is_some_and(|m| m.len() == 1 && m[0].as_str() == Some("text"))
}

/// Refuses a body that asks for behaviour the server does not implement, naming the field.
pub fn refuse_unimplemented(body: &Value) -> Result<(), ApiError> {
    for (field, is_default, why) in UNIMPLEMENTED {
        match body.get(field) {
            Some(value) if !value.is_null() && !is_default(value) => {
                return Err(ApiError::invalid(field, format!("`{field}`: {why}")));
            }
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn unimplemented_fields_are_refused_unless_default() {
        for body in [
            json!({"functions": [], "function_call": "none", "response_format": {"type": "text"}}),
            json!({"echo": false, "best_of": 1}),
            json!({"logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0.0}),
            json!({"modalities": ["text"], "audio": null, "suffix": ""}),
        ] {
            assert!(refuse_unimplemented(&body).is_ok(), "{body}");
        }
        for (body, field) in [
            (json!({"functions": [{"name": "f"}]}), "functions"),
            (json!({"echo": true}), "echo"),
            (json!({"function_call": {"name": "f"}}), "function_call"),
            (json!({"presence_penalty": 0.5}), "presence_penalty"),
            (json!({"logit_bias": {"42": 100}}), "logit_bias"),
            (json!({"modalities": ["text", "audio"]}), "modalities"),
        ] {
            match refuse_unimplemented(&body) {
                Err(ApiError::InvalidRequest { param, message }) => {
                    assert_eq!(param.as_deref(), Some(field), "{body}");
                    assert!(message.contains(field), "{message}");
                }
                other => panic!("{body}: {other:?}"),
            }
        }
    }

    fn format_of(body: Value) -> Result<Option<(&'static str, OutputFormat)>, ApiError> {
        serde_json::from_value::<GenerationOptions>(body)
            .expect("a generation body")
            .output_format()
    }

    fn refused_field(body: Value) -> String {
        match format_of(body.clone()) {
            Err(ApiError::InvalidRequest { param, .. }) => param.expect("the field is named"),
            other => panic!("{body}: {other:?}"),
        }
    }

    #[test]
    fn structured_output_fields_become_one_format() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let cases = [
            (json!({"response_format": {"type": "text"}}), None),
            (
                json!({"response_format": {"type": "json_object"}}),
                Some(("response_format", OutputFormat::JsonObject)),
            ),
            (
                json!({"response_format": {"type": "json_schema",
                    "json_schema": {"name": "answer", "schema": schema, "strict": true}}}),
                Some(("response_format", OutputFormat::JsonSchema(schema.clone()))),
            ),
            (
                json!({"guided_json": schema.to_string()}),
                Some(("guided_json", OutputFormat::JsonSchema(schema.clone()))),
            ),
            (
                json!({"guided_regex": "[0-9]+"}),
                Some(("guided_regex", OutputFormat::Regex("[0-9]+".into()))),
            ),
            (
                json!({"guided_choice": ["yes", "no"]}),
                Some((
                    "guided_choice",
                    OutputFormat::Choice(vec!["yes".into(), "no".into()]),
                )),
            ),
        ];
        for (body, expected) in cases {
            assert_eq!(
                format_of(body.clone()).expect("accepted"),
                expected,
                "{body}"
            );
        }
    }

    #[test]
    fn malformed_structured_output_fields_are_refused_by_name() {
        for (body, field) in [
            (
                json!({"response_format": {"type": "yaml"}}),
                "response_format.type",
            ),
            (
                json!({"response_format": {"type": "json_schema"}}),
                "response_format.json_schema",
            ),
            (
                json!({"response_format": {"type": "json_schema",
                    "json_schema": {"name": "a b", "schema": {}}}}),
                "response_format.json_schema.name",
            ),
            (
                json!({"response_format": {"type": "json_schema",
                    "json_schema": {"name": "a", "schema": [1, 2]}}}),
                "response_format.json_schema.schema",
            ),
            (
                json!({"response_format": {"type": "json_schema",
                    "json_schema": {"name": "a", "strict": "yes"}}}),
                "response_format.json_schema.strict",
            ),
            (json!({"guided_json": "{not json"}), "guided_json"),
            (json!({"guided_choice": []}), "guided_choice"),
            (
                json!({"guided_regex": "a", "guided_choice": ["a"]}),
                "guided_choice",
            ),
        ] {
            assert_eq!(refused_field(body.clone()), field, "{body}");
        }
    }
}

//! What a request asks its output to be, validated into a typed value, and its compilation
//! into an llguidance grammar (which is where an unsupported schema is found).

use super::vocabulary::Vocabulary;
use llguidance::api::TopLevelGrammar;
use llguidance::TokenParser;
use serde_json::{json, Value};

/// A request's output format, as the HTTP layer validated it.
#[derive(Debug, Clone, PartialEq)]
pub enum OutputFormat {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid under a schema (`json_schema`, `guided_json`).
    JsonSchema(Value),
    /// Text matching a regular expression (`guided_regex`).
    Regex(String),
    /// Exactly one of these strings (`guided_choice`).
    Choice(Vec<String>),
}

/// Why a format cannot be served; `message` is llguidance's account of it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct FormatError {
    pub message: String,
}

impl OutputFormat {
    /// The grammar. JSON is emitted compactly (`,` and `:` with no whitespace between
    /// tokens), so a model cannot spend its tokens on indentation; a schema's own
    /// `x-guidance` options take precedence.
    fn grammar(&self) -> TopLevelGrammar {
        let compact = |mut schema: Value| {
            if let Some(object) = schema.as_object_mut() {
                object
                    .entry("x-guidance")
                    .or_insert_with(|| json!({"whitespace_flexible": false}));
            }
            TopLevelGrammar::from_json_schema(schema)
        };
        match self {
            OutputFormat::JsonObject => compact(json!({"type": "object"})),
            OutputFormat::JsonSchema(schema) => compact(schema.clone()),
            OutputFormat::Regex(regex) => TopLevelGrammar::from_regex(regex),
            OutputFormat::Choice(choices) => {
                let alternatives: Vec<String> =
                    choices.iter().map(|c| regex_syntax::escape(c)).collect();
                TopLevelGrammar::from_regex(&format!("({})", alternatives.join("|")))
            }
        }
    }

    /// A fresh parser for this format over `vocabulary`: fails on a schema or regex
    /// llguidance cannot compile, or one over the vocabulary's size limits.
    pub(crate) fn parser(&self, vocabulary: &Vocabulary) -> Result<TokenParser, FormatError> {
        vocabulary
            .factory()
            .create_parser(self.grammar())
            .map_err(|e| FormatError {
                message: e.to_string(),
            })
    }
}

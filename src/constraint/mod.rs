//! Structured output: a request's output format (a JSON object, a JSON schema, a regex, a
//! choice of strings) compiled by llguidance into a grammar, and the per-request state that
//! masks each model's next token by it.
//!
//! The grammar state belongs to the request, not to a model: it moves with the request on a
//! handoff, and each vocabulary the request's models speak has its own matcher, advanced by
//! the committed bytes it has not consumed yet (a model of another vocabulary catches up by
//! tokenizing those bytes in its own; see `docs/structured-output.md`).

mod format;
mod request;
mod vocabulary;

pub use format::{FormatError, OutputFormat};
pub use request::RequestGrammar;
pub use vocabulary::Vocabulary;
#[cfg(test)]
pub(crate) use vocabulary::{ascii_token, vocabulary_for_tests};

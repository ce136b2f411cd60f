//! Error types of the engine and the command line. The HTTP mapping lives in `server/`.

use std::path::PathBuf;

/// Everything that can go wrong while loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(
        "model file not found: {0} (run `tokenrouter models fetch` or fix `path` in the config)"
    )]
    MissingFile(PathBuf),
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid model file {path}: {message}")]
    InvalidModel { path: PathBuf, message: String },
    #[error("unsupported architecture `{0}` (supported: llama, qwen2, qwen3)")]
    UnsupportedArchitecture(String),
    #[error("unsupported tensor type {dtype} for `{tensor}`")]
    UnsupportedDType { tensor: String, dtype: String },
    #[error("tensor `{name}` has shape {actual:?}, expected {expected:?}")]
    ShapeMismatch {
        name: String,
        actual: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    ChatTemplate(String),
    #[error("KV cache full: {requested} more tokens requested, {free} of {capacity} free")]
    KvExhausted {
        requested: usize,
        free: usize,
        capacity: usize,
    },
    #[error("sequence would reach position {position}, beyond the model's context of {context}")]
    ContextOverflow { position: usize, context: usize },
    #[error("invalid step: {0}")]
    InvalidStep(String),
    #[error("this CPU lacks {0}; the binary is built for x86-64-v3 (AVX2 + FMA)")]
    UnsupportedCpu(&'static str),
    #[error("this CPU cannot run the `{0}` kernel (it runs: {1})")]
    UnavailableKernel(&'static str, String),
    #[error("GPU: {0}")]
    Gpu(String),
    #[error("tensor backend: {0}")]
    Candle(#[from] candle_core::Error),
}

pub type EngineResult<T> = Result<T, EngineError>;

/// Configuration problems, each naming the offending field.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid config {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("invalid config: {0}")]
    Invalid(String),
}

//! The server's errors and their one mapping to HTTP: status code and OpenAI's error shape
//! `{"error": {"message", "type", "param", "code"}}`.

use crate::error::{ConfigError, EngineError};
use crate::runtime::RuntimeError;
use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};
use serde::Serialize;

/// What 429 and 503 answers tell clients to wait before retrying.
const RETRY_AFTER_SECONDS: u64 = 1;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// A field is missing, of the wrong type or out of range; `param` names it.
    #[error("{message}")]
    InvalidRequest {
        message: String,
        param: Option<String>,
    },
    #[error("the prompt has {prompt} tokens; this server accepts at most {limit}")]
    ContextLength {
        prompt: usize,
        limit: usize,
        param: &'static str,
    },
    #[error("the model `{0}` does not exist (GET /v1/models lists the models and policies)")]
    UnknownModel(String),
    #[error("no route for {method} {path}")]
    NoRoute { method: String, path: String },
    #[error("{path} does not accept {method}")]
    MethodNotAllowed { method: String, path: String },
    #[error("the request body exceeds {limit} bytes")]
    PayloadTooLarge { limit: usize },
    #[error("missing or invalid bearer token")]
    Unauthorized,
    #[error("the admin routes are disabled: set server.admin_token or TOKENROUTER_ADMIN_TOKEN")]
    AdminDisabled,
    #[error("{0}")]
    Unavailable(String),
    /// Out of capacity now; `Retry-After` says when to try again.
    #[error("{0}")]
    Overloaded(String),
    #[error("{0}")]
    DeadlineExceeded(String),
    /// The body did not arrive in time; the connection is closed with the answer.
    #[error("the request body did not arrive within {after_ms} ms")]
    BodyTimeout { after_ms: u64 },
    #[error("{0}")]
    Internal(String),
}

impl ApiError {
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        ApiError::InvalidRequest {
            message: message.into(),
            param: Some(param.to_string()),
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            ApiError::Unauthorized | ApiError::AdminDisabled => "authentication_error",
            ApiError::Unavailable(_) | ApiError::Internal(_) => "server_error",
            ApiError::Overloaded(_) => "overloaded_error",
            ApiError::DeadlineExceeded(_) | ApiError::BodyTimeout { .. } => "timeout_error",
            _ => "invalid_request_error",
        }
    }

    fn code(&self) -> Option<&'static str> {
        match self {
            ApiError::ContextLength { .. } => Some("context_length_exceeded"),
            ApiError::UnknownModel(_) => Some("model_not_found"),
            ApiError::PayloadTooLarge { .. } => Some("payload_too_large"),
            ApiError::Unauthorized => Some("invalid_api_key"),
            _ => None,
        }
    }

    fn param(&self) -> Option<&str> {
        match self {
            ApiError::InvalidRequest { param, .. } => param.as_deref(),
            ApiError::ContextLength { param, .. } => Some(param),
            ApiError::UnknownModel(_) => Some("model"),
            _ => None,
        }
    }

    /// The error object alone, also sent as an SSE event when a stream fails midway.
    pub fn body(&self) -> ErrorBody<'_> {
        ErrorBody {
            error: ErrorObject {
                message: self.to_string(),
                kind: self.kind(),
                param: self.param(),
                code: self.code(),
            },
        }
    }
}

/// OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Serialize)]
pub struct ErrorBody<'a> {
    error: ErrorObject<'a>,
}

#[derive(Debug, Serialize)]
struct ErrorObject<'a> {
    message: String,
    #[serde(rename = "type")]
    kind: &'static str,
    param: Option<&'a str>,
    code: Option<&'static str>,
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        match self {
            ApiError::InvalidRequest { .. } | ApiError::ContextLength { .. } => {
                StatusCode::BAD_REQUEST
            }
            ApiError::UnknownModel(_) | ApiError::NoRoute { .. } => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::AdminDisabled => StatusCode::FORBIDDEN,
            ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Overloaded(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::DeadlineExceeded(_) | ApiError::BodyTimeout { .. } => {
                StatusCode::REQUEST_TIMEOUT
            }
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn error_response(&self) -> HttpResponse {
        let mut response = HttpResponse::build(self.status_code());
        if matches!(self, ApiError::Overloaded(_) | ApiError::Unavailable(_)) {
            response.insert_header(("Retry-After", RETRY_AFTER_SECONDS.to_string()));
        }
        if matches!(self, ApiError::BodyTimeout { .. }) {
            response.force_close();
        }
        response.json(self.body())
    }
}

impl From<RuntimeError> for ApiError {
    fn from(e: RuntimeError) -> Self {
        match e {
            RuntimeError::UnknownPolicy(name) => ApiError::UnknownModel(name),
            RuntimeError::InvalidRequest(message) => ApiError::InvalidRequest {
                message,
                param: None,
            },
            RuntimeError::Invalid(e) => ApiError::InvalidRequest {
                message: e.to_string(),
                param: None,
            },
            RuntimeError::Config(e) => e.into(),
            RuntimeError::Disconnected
            | RuntimeError::Unavailable(_)
            | RuntimeError::Cluster(_) => ApiError::Unavailable(e.to_string()),
            RuntimeError::Engine(EngineError::ContextOverflow { .. }) => ApiError::InvalidRequest {
                message: e.to_string(),
                param: Some("max_tokens".into()),
            },
            RuntimeError::Engine(EngineError::KvExhausted { .. }) => {
                ApiError::Unavailable(e.to_string())
            }
            RuntimeError::Overloaded(message) => ApiError::Overloaded(message),
            RuntimeError::DeadlineExceeded(message) => ApiError::DeadlineExceeded(message),
            RuntimeError::Failed(_) | RuntimeError::Engine(_) => ApiError::Internal(e.to_string()),
        }
    }
}

impl From<ConfigError> for ApiError {
    fn from(e: ConfigError) -> Self {
        ApiError::InvalidRequest {
            message: e.to_string(),
            param: None,
        }
    }
}

impl From<EngineError> for ApiError {
    /// Engine errors reaching the HTTP layer directly come from tokenizing or templating
    /// what the client sent.
    fn from(e: EngineError) -> Self {
        ApiError::InvalidRequest {
            message: e.to_string(),
            param: None,
        }
    }
}

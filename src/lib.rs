//! tokenrouter: a serving runtime for token-level model routing.

pub mod config;
pub mod constraint;
pub mod engine;
pub mod error;
pub mod policy;
pub mod runtime;
pub mod server;
pub(crate) mod telemetry;
pub mod tuning;

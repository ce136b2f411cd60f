//! tokenrouter: a serving runtime for token-level model routing.

pub mod bench;
pub mod config;
pub mod engine;
pub mod error;
pub mod fetch;
pub mod policy;
pub mod runtime;
pub mod server;
pub mod telemetry;
pub mod tuning;

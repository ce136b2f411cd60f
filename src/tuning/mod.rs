//! The Markov model of routing (`docs/tuning.md`): a DTMC over per-model (waiting, running batch,
//! residual time, timeout clock) states, solved for its stationary distribution to predict
//! throughput and admission delay for delayed-batching thresholds, and the threshold search.

pub mod controller;
pub mod dtmc;
pub mod online;
pub mod paper;

pub use dtmc::{predict, search, search_bounded, AffineLatency, DtmcModel, Prediction, TuneError};

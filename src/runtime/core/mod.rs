//! The scheduling core: every decision a model's actors take, as plain data and functions.
//! Nothing here knows actix, a clock or a real model: the batcher and model actors feed it
//! events (arrivals, an idle model, step outputs, cancellations) with the current time and
//! carry out the effects it returns. Unit tests drive it with a fake KV store and a manual
//! clock.

mod budget;
mod cross_vocab;
mod gate;
mod request;
mod scheduler;
mod stream_order;

pub(crate) use budget::StepLimits;
pub(crate) use cross_vocab::{CrossVocab, Vocabularies};
pub use gate::ReleaseReason;
pub(crate) use gate::{BatchGate, GateDecision};
pub use request::{
    EngineTiming, FailureKind, FinishReason, RequestId, RoutingStats, TokenLogprobs,
};
pub(crate) use request::{InFlight, RequestParams, Sampled};
pub(crate) use scheduler::{Effect, ModelScheduler, SchedulerCounters, StepPlan};
pub(crate) use stream_order::{Released, StreamOrder};

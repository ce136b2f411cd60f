//! The runtime: per model a supervised `ModelActor` and a `BatcherActor`, a `RequestActor` per
//! request; routing state migrates between models as messages. Every decision those actors
//! take lives in `core` as plain data and functions; `docs/architecture.md` walks through a
//! request's path and the four execution modes.

mod batcher;
mod bus;
pub(crate) mod core;
mod link;
mod live;
mod messages;
mod model;
mod record;
mod request;
mod step_lock;
mod system;
mod tokenizers;
mod tuner;

pub use self::core::{
    EngineTiming, FailureKind, FinishReason, ReleaseReason, RequestId, RoutingStats, TokenLogprobs,
};
pub use bus::{ClusterError, ReplicaStatus};
pub use record::{ModelSnapshot, Releases, RuntimeSnapshot, StepInterval};
pub use request::RequestEvent;
pub use system::{
    Completion, GenerateRequest, InvalidRequest, RequestHandle, Runtime, RuntimeError, ValidRequest,
};
pub use tokenizers::Prompt;

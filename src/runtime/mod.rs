//! Actors and messages (DESIGN §6): a supervised `ModelActor` and a `BatcherActor` per model,
//! a `RequestActor` per request; routing state migrates between models as messages. The
//! execution mode (`config::ExecutionMode`) switches between lockstep, standard, async and
//! tokenrouter behaviour inside these same actors.

pub mod batcher;
pub mod messages;
pub mod model;
pub mod request;
pub mod stats;
pub mod system;
pub mod tuner;

pub use messages::{FailureKind, FinishReason, RoutingStats};
pub use request::RequestEvent;
pub use system::{Completion, GenerateRequest, RequestHandle, Runtime, RuntimeError};

//! The NATS transport: models and request clients in other processes. It implements the local
//! actors' ports (`link::ModelPort`, `link::ClientPort`, `link::OwnRequests`,
//! `step_lock::SharedTurns`) over the bus and turns the bus's messages back into actor
//! messages; the local actors name none of its types, and wire types convert at this edge
//! (`docs/architecture.md`, "The local actors and the bus").

mod cluster;
mod join;
mod remote;
mod step_lock;
mod wire;

pub(crate) use cluster::Bus;
pub use cluster::{ClusterError, ReplicaStatus};
pub(crate) use join::join;
pub(crate) use remote::{BusSide, FrontendRequests, HostedModel, RemoteModel};
pub(crate) use step_lock::{serve_step_lock, BusStepLock};
pub(crate) use wire::ModelFacts;

//! The two ends a model actor talks to, wherever they live: a model's batcher (arrivals,
//! withdrawals, thresholds) and a request's client (its tokens). In one process they are
//! actor addresses; an end in another process is a port a transport implements (the NATS
//! bus, `runtime::bus`), which the actors here reach only through these interfaces.

use super::batcher::BatcherActor;
use super::core::RequestId;
use super::messages::{
    Admit, Committed, Failed, Finished, Placed, Request, SetThreshold, Withdraw,
};
use super::request::RequestActor;
use crate::policy::ModelIdx;
use actix::prelude::*;
use std::sync::Arc;

/// A model's batcher in another process, as a transport reaches it.
pub(crate) trait ModelPort: Send + Sync {
    fn admit(&self, arrivals: Vec<Request>);
    /// The request ended: the batcher forgets it and the model frees its KV.
    fn withdraw(&self, rid: RequestId);
    fn set_threshold(&self, threshold: usize);
}

/// Where a model's arrivals, withdrawals and thresholds go.
#[derive(Clone)]
pub(crate) enum ModelLink {
    Local(Addr<BatcherActor>),
    Remote(Arc<dyn ModelPort>),
}

impl ModelLink {
    pub fn admit(&self, arrivals: Vec<Request>) {
        match self {
            ModelLink::Local(batcher) => batcher.do_send(Admit(arrivals)),
            ModelLink::Remote(port) => port.admit(arrivals),
        }
    }

    /// The request ended: the batcher forgets it and the model frees its KV.
    pub fn withdraw(&self, rid: RequestId) {
        match self {
            ModelLink::Local(batcher) => batcher.do_send(Withdraw { rid }),
            ModelLink::Remote(port) => port.withdraw(rid),
        }
    }

    pub fn set_threshold(&self, threshold: usize) {
        match self {
            ModelLink::Local(batcher) => batcher.do_send(SetThreshold(threshold)),
            ModelLink::Remote(port) => port.set_threshold(threshold),
        }
    }
}

/// A request's `RequestActor` in another process (its front end), as a transport reaches it.
pub(crate) trait ClientPort: Send + Sync {
    fn committed(&self, msg: Committed);
    fn finished(&self, msg: Finished);
    fn failed(&self, msg: Failed);
    fn placed(&self, msg: Placed);
    /// The process that owns the request, in the transport's own naming.
    fn owner(&self) -> &str;
}

/// How a request's events reach the actor that streams them to its client.
#[derive(Clone)]
pub(crate) enum Client {
    Local(Addr<RequestActor>),
    Remote(Arc<dyn ClientPort>),
}

impl Client {
    pub fn committed(&self, msg: Committed) {
        match self {
            Client::Local(actor) => actor.do_send(msg),
            Client::Remote(port) => port.committed(msg),
        }
    }

    pub fn finished(&self, msg: Finished) {
        match self {
            Client::Local(actor) => actor.do_send(msg),
            Client::Remote(port) => port.finished(msg),
        }
    }

    pub fn failed(&self, msg: Failed) {
        match self {
            Client::Local(actor) => actor.do_send(msg),
            Client::Remote(port) => port.failed(msg),
        }
    }

    /// The request was just placed on replica `host` of model `model`.
    pub fn placed(&self, model: ModelIdx, host: &str) {
        let msg = Placed {
            model,
            host: host.to_string(),
        };
        match self {
            Client::Local(actor) => actor.do_send(msg),
            Client::Remote(port) => port.placed(msg),
        }
    }
}

/// This process's requests as a transport tracks them (which replicas hold their KV), told
/// by each request's actor.
pub(crate) trait OwnRequests: Send + Sync {
    /// Request `rid` now holds KV on replica `host` of `model`.
    fn place(&self, rid: RequestId, model: ModelIdx, host: String);
    fn remove(&self, rid: RequestId);
}

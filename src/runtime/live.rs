//! The requests that have not ended yet, shared by every actor of one runtime: a batcher
//! drops arrivals of ended requests, and its release rule and the tuner read the count.

use crate::policy::RequestId;
use dashmap::DashSet;
use std::sync::Arc;

#[derive(Clone, Default)]
pub(crate) struct LiveRequests(Arc<DashSet<RequestId>>);

impl LiveRequests {
    pub fn insert(&self, rid: RequestId) {
        self.0.insert(rid);
    }

    pub fn remove(&self, rid: RequestId) {
        self.0.remove(&rid);
    }

    pub fn contains(&self, rid: RequestId) -> bool {
        self.0.contains(&rid)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }
}

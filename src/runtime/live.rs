//! The requests that have not ended yet, shared by every actor of one runtime: a batcher
//! drops arrivals of ended requests, and its release rule and the tuner read the count.
//! In a cluster a model's host sees only the requests that reached it, so the count is the
//! larger of those and the sum the front ends announce (`Bus::announce_requests`): a model
//! whose requests are mostly elsewhere must not release as if all of them were waiting here.

use crate::policy::RequestId;
use crate::telemetry;
use dashmap::DashSet;
use metrics::Gauge;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

#[derive(Clone)]
pub(crate) struct LiveRequests(Arc<Inner>);

struct Inner {
    here: DashSet<RequestId>,
    /// Live requests of every front end of the deployment, as they last announced (0
    /// without a cluster).
    announced: AtomicUsize,
    gauge: Gauge,
}

impl Default for LiveRequests {
    fn default() -> Self {
        Self(Arc::new(Inner {
            here: DashSet::new(),
            announced: AtomicUsize::new(0),
            gauge: telemetry::live_requests(),
        }))
    }
}

impl LiveRequests {
    pub fn insert(&self, rid: RequestId) {
        self.0.here.insert(rid);
        self.publish();
    }

    pub fn remove(&self, rid: RequestId) {
        self.0.here.remove(&rid);
        self.publish();
    }

    pub fn contains(&self, rid: RequestId) -> bool {
        self.0.here.contains(&rid)
    }

    /// Requests not yet ended anywhere (as far as this process knows).
    pub fn len(&self) -> usize {
        self.here().max(self.0.announced.load(Ordering::Relaxed))
    }

    /// Requests that reached this process and have not ended: its load.
    pub fn here(&self) -> usize {
        self.0.here.len()
    }

    /// The front ends' latest announcements add up to `requests`.
    pub fn set_announced(&self, requests: usize) {
        self.0.announced.store(requests, Ordering::Relaxed);
        self.publish();
    }

    fn publish(&self) {
        self.0.gauge.set(self.len() as f64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_count_is_the_larger_of_the_requests_here_and_the_announced_ones() {
        let live = LiveRequests::default();
        live.insert(RequestId(1));
        live.insert(RequestId(2));
        assert_eq!((live.len(), live.here()), (2, 2));
        live.set_announced(5);
        assert_eq!((live.len(), live.here()), (5, 2));
        live.remove(RequestId(1));
        live.set_announced(0);
        assert_eq!((live.len(), live.here()), (1, 1));
        assert!(live.contains(RequestId(2)) && !live.contains(RequestId(1)));
    }
}

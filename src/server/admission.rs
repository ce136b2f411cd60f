//! Admission control: at most `max_concurrent_requests` generations run at once, up to
//! `max_queued_requests` more wait for a slot, and beyond that requests get 429 with
//! `Retry-After`. While draining (SIGTERM) new requests and queued ones get 503.

use super::error::ApiError;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

pub struct Admission {
    slots: Arc<Semaphore>,
    queued: AtomicUsize,
    max_queued: usize,
    draining: AtomicBool,
}

/// A running request's slot; dropping it (the response ended or the client left) frees it.
pub type Slot = OwnedSemaphorePermit;

/// Counts a request as queued until dropped (also when its client gives up while waiting).
struct Queued<'a>(&'a AtomicUsize);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Admission {
    pub fn new(max_concurrent: usize, max_queued: usize) -> Self {
        Self {
            slots: Arc::new(Semaphore::new(max_concurrent)),
            queued: AtomicUsize::new(0),
            max_queued,
            draining: AtomicBool::new(false),
        }
    }

    fn draining_error() -> ApiError {
        ApiError::Unavailable("the server is shutting down".into())
    }

    /// A slot now, or after waiting in the bounded queue.
    pub async fn enter(&self) -> Result<Slot, ApiError> {
        if self.draining.load(Ordering::Acquire) {
            return Err(Self::draining_error());
        }
        if let Ok(slot) = self.slots.clone().try_acquire_owned() {
            return Ok(slot);
        }
        if self.queued.fetch_add(1, Ordering::AcqRel) >= self.max_queued {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            return Err(ApiError::Overloaded(format!(
                "too many requests: every slot is busy and {} requests are queued",
                self.max_queued
            )));
        }
        let _queued = Queued(&self.queued);
        self.slots
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| Self::draining_error())
    }

    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::Acquire)
    }

    /// Stops admitting: new and queued requests get 503; running ones continue.
    pub fn drain(&self) {
        self.draining.store(true, Ordering::Release);
        self.slots.close();
    }
}

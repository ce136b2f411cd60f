//! `lockstep` mode: one model step at a time in the whole deployment. In one process that is
//! a fair mutex (turns in the order asked, so a model with a prompt chunk ready at once cannot
//! take turn after turn while the other waits); with models in several processes a transport
//! grants the turns (the bus's front end, `runtime::bus`), behind `SharedTurns`.

use parking_lot::{FairMutex, FairMutexGuard};
use std::sync::Arc;

/// Turns granted across processes.
pub(crate) trait SharedTurns: Send + Sync {
    /// Waits for this process's turn; the turn ends when the returned value is dropped.
    fn acquire(&self) -> Box<dyn HeldTurn + '_>;
}

/// A turn being held: whatever releases it on drop.
pub(crate) trait HeldTurn {}

#[derive(Clone)]
pub(crate) enum StepLock {
    /// Every model is in this process.
    Local(Arc<FairMutex<()>>),
    /// Some model is elsewhere: turns from a transport.
    Shared(Arc<dyn SharedTurns>),
}

/// Held while a model steps; releases on drop.
pub(crate) enum StepGuard<'a> {
    Local { _held: FairMutexGuard<'a, ()> },
    Shared { _turn: Box<dyn HeldTurn + 'a> },
}

impl StepLock {
    /// Waits for this model's turn to step.
    pub fn acquire(&self) -> StepGuard<'_> {
        match self {
            StepLock::Local(lock) => StepGuard::Local { _held: lock.lock() },
            StepLock::Shared(turns) => StepGuard::Shared {
                _turn: turns.acquire(),
            },
        }
    }
}

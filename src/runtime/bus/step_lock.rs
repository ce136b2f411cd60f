//! `lockstep` mode's turns over the bus: the front end grants the lock (`steplock.*`), first
//! come first served. A holder that neither steps nor releases within the lease (three
//! heartbeats: its process died) loses the lock, and a process that hears no grant within
//! the lease steps anyway: the lock orders steps, it guards no data, so under a fault it
//! gives way instead of stalling every model.

use super::cluster::{Bus, ClusterError};
use super::wire::{self, StepLockGrant, StepLockRequest};
use crate::runtime::step_lock::{HeldTurn, SharedTurns, StepLock};
use std::collections::VecDeque;
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// This process's side of the bus lock: one acquisition at a time (the mutex), each waiting
/// for its grant on this process's grant subject.
pub(crate) struct BusStepLock {
    bus: Bus,
    grants: Mutex<Receiver<u64>>,
}

/// A turn from the bus; its release is published on drop.
struct BusTurn<'a> {
    _turn: MutexGuard<'a, Receiver<u64>>,
    bus: &'a Bus,
    grant: Option<u64>,
}

impl HeldTurn for BusTurn<'_> {}

impl Drop for BusTurn<'_> {
    fn drop(&mut self) {
        if let Some(grant) = self.grant {
            let release = StepLockGrant { grant };
            self.bus.publish(
                self.bus.step_lock_subject("release"),
                wire::encode(&release),
            );
        }
    }
}

impl BusStepLock {
    /// The lock over the bus, for a process that does not hold every model.
    pub fn connect(bus: &Bus) -> Result<StepLock, ClusterError> {
        let (tx, rx) = channel();
        let tx = Mutex::new(tx);
        bus.subscribe(
            bus.step_lock_subject(&format!("grant.{}", bus.id())),
            move |payload, _| match wire::decode::<StepLockGrant>(payload) {
                Ok(StepLockGrant { grant }) => {
                    let _ = tx.lock().unwrap_or_else(|e| e.into_inner()).send(grant);
                }
                Err(e) => tracing::warn!("ignoring a step lock grant: {e}"),
            },
        )?;
        Ok(StepLock::Shared(Arc::new(BusStepLock {
            bus: bus.clone(),
            grants: Mutex::new(rx),
        })))
    }
}

impl SharedTurns for BusStepLock {
    fn acquire(&self) -> Box<dyn HeldTurn + '_> {
        let turn = self.grants.lock().unwrap_or_else(|e| e.into_inner());
        let bus = &self.bus;
        let request = StepLockRequest {
            host: bus.id().to_string(),
        };
        bus.publish(bus.step_lock_subject("acquire"), wire::encode(&request));
        let lease = lease(bus);
        let grant = turn.recv_timeout(lease).ok();
        if grant.is_none() {
            tracing::warn!(
                "no step lock grant within {} ms: stepping without it",
                lease.as_millis()
            );
        }
        Box::new(BusTurn {
            _turn: turn,
            bus,
            grant,
        })
    }
}

fn lease(bus: &Bus) -> Duration {
    bus.heartbeat() * 3
}

/// The front end's grants: who holds the lock, who waits.
#[derive(Default)]
struct Grants {
    holder: Option<(u64, Instant)>,
    waiting: VecDeque<String>,
    next_grant: u64,
}

impl Grants {
    /// Hands the lock to the next waiter if it is free: to whom, with which grant.
    fn hand_on(&mut self) -> Option<(String, u64)> {
        if self.holder.is_some() {
            return None;
        }
        let host = self.waiting.pop_front()?;
        self.next_grant += 1;
        self.holder = Some((self.next_grant, Instant::now()));
        Some((host, self.next_grant))
    }
}

/// Serves the deployment's step lock from this process (the front end).
pub(crate) fn serve_step_lock(bus: &Bus) -> Result<(), ClusterError> {
    let grants = Arc::new(Mutex::new(Grants::default()));
    let send = |bus: &Bus, next: Option<(String, u64)>| {
        if let Some((host, grant)) = next {
            bus.publish(
                bus.step_lock_subject(&format!("grant.{host}")),
                wire::encode(&StepLockGrant { grant }),
            );
        }
    };
    let (state, replier) = (grants.clone(), bus.clone());
    bus.subscribe(
        bus.step_lock_subject("acquire"),
        move |payload, _| match wire::decode::<StepLockRequest>(payload) {
            Ok(StepLockRequest { host }) => {
                let mut grants = state.lock().unwrap_or_else(|e| e.into_inner());
                grants.waiting.push_back(host);
                send(&replier, grants.hand_on());
            }
            Err(e) => tracing::warn!("ignoring a step lock request: {e}"),
        },
    )?;
    let (state, replier) = (grants.clone(), bus.clone());
    bus.subscribe(
        bus.step_lock_subject("release"),
        move |payload, _| match wire::decode::<StepLockGrant>(payload) {
            Ok(StepLockGrant { grant }) => {
                let mut grants = state.lock().unwrap_or_else(|e| e.into_inner());
                if grants.holder.is_some_and(|(held, _)| held == grant) {
                    grants.holder = None;
                    send(&replier, grants.hand_on());
                }
            }
            Err(e) => tracing::warn!("ignoring a step lock release: {e}"),
        },
    )?;
    let (replier, lease) = (bus.clone(), lease(bus));
    bus.every(lease / 4, move || {
        let mut grants = grants.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((grant, since)) = grants.holder {
            if since.elapsed() > lease {
                tracing::warn!(grant, "step lock not released within its lease: handed on");
                grants.holder = None;
                send(&replier, grants.hand_on());
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lock_goes_to_waiters_in_order_one_at_a_time() {
        let mut grants = Grants::default();
        grants.waiting.extend(["a".to_string(), "b".to_string()]);
        let (first, g1) = grants.hand_on().unwrap();
        assert_eq!(first, "a");
        assert!(grants.hand_on().is_none(), "a holds it");
        grants.holder = None;
        let (second, g2) = grants.hand_on().unwrap();
        assert_eq!(second, "b");
        assert!(g2 > g1);
        grants.holder = None;
        assert!(grants.hand_on().is_none(), "nobody waits");
    }
}

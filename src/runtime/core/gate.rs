//! The delayed-batching gate in front of one model: it holds arrivals while the model steps
//! and decides when the next batch launches. Outside `tokenrouter` mode anything ready
//! launches at once (B = 1).

use super::request::{InFlight, RequestId};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Why a batch was released; counted per model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ReleaseReason {
    /// Anything ready launches (modes without delayed batching).
    Ready,
    /// Ready requests reached the threshold.
    Threshold,
    /// The oldest ready request waited the configured timeout.
    Timeout,
    /// Every live request is already here: waiting longer cannot grow the batch.
    AllHere,
}

impl ReleaseReason {
    pub const ALL: [ReleaseReason; 4] = [
        ReleaseReason::Ready,
        ReleaseReason::Threshold,
        ReleaseReason::Timeout,
        ReleaseReason::AllHere,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ReleaseReason::Ready => "ready",
            ReleaseReason::Threshold => "threshold",
            ReleaseReason::Timeout => "timeout",
            ReleaseReason::AllHere => "all_here",
        }
    }
}

/// The release rule. `delayed`: delayed batching is on (`tokenrouter` mode); `ready`:
/// requests that could step now (arrivals and residents); `live`: requests not yet ended
/// anywhere; `waited`: how long the oldest ready request has waited.
pub(crate) fn release_reason(
    delayed: bool,
    ready: usize,
    live: usize,
    waited: Duration,
    threshold: usize,
    timeout: Duration,
) -> Option<ReleaseReason> {
    if ready == 0 {
        None
    } else if !delayed {
        Some(ReleaseReason::Ready)
    } else if ready >= threshold {
        Some(ReleaseReason::Threshold)
    } else if ready >= live {
        Some(ReleaseReason::AllHere)
    } else if waited >= timeout {
        Some(ReleaseReason::Timeout)
    } else {
        None
    }
}

/// What waits in a gate: anything with an id and an arrival time.
pub(crate) trait Arrival {
    fn rid(&self) -> RequestId;
    fn arrived(&self) -> Instant;
}

impl<C> Arrival for InFlight<C> {
    fn rid(&self) -> RequestId {
        self.state.rid
    }

    fn arrived(&self) -> Instant {
        self.arrived
    }
}

/// What the gate asks its actor to do after an event.
#[derive(Debug)]
pub(crate) enum GateDecision<T> {
    /// Launch the next step with these arrivals added to the model's resident set.
    Release {
        arrivals: Vec<T>,
        reason: ReleaseReason,
        /// Each arrival's wait, in the order of `arrivals`.
        delays: Vec<Duration>,
    },
    /// Nothing to launch yet; look again at this time (the timeout bound) at the latest.
    WaitUntil(Instant),
    /// Nothing to launch: the model is busy, or nothing is ready.
    Hold,
}

pub(crate) struct BatchGate<T> {
    delayed: bool,
    threshold: usize,
    timeout: Duration,
    waiting: VecDeque<T>,
    model_idle: bool,
    resident_ready: usize,
    /// When the model last went idle with resident requests ready to step.
    resident_ready_since: Option<Instant>,
}

impl<T: Arrival> BatchGate<T> {
    pub fn new(delayed: bool, threshold: usize, timeout: Duration) -> Self {
        Self {
            delayed,
            threshold: threshold.max(1),
            timeout,
            waiting: VecDeque::new(),
            model_idle: false,
            resident_ready: 0,
            resident_ready_since: None,
        }
    }

    pub fn threshold(&self) -> usize {
        self.threshold
    }

    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn arrive(&mut self, arrivals: impl IntoIterator<Item = T>) {
        self.waiting.extend(arrivals);
    }

    /// The model finished a step (or started) with `resident_ready` requests to step again.
    pub fn model_idle(&mut self, resident_ready: usize, now: Instant) {
        self.model_idle = true;
        self.resident_ready = resident_ready;
        self.resident_ready_since = (resident_ready > 0).then_some(now);
    }

    pub fn set_threshold(&mut self, threshold: usize) {
        self.threshold = threshold.max(1);
    }

    /// Forgets a waiting arrival of an ended request.
    pub fn withdraw(&mut self, rid: RequestId) {
        self.waiting.retain(|w| w.rid() != rid);
    }

    /// Decides at `now`, with `live` requests not yet ended; arrivals of ended requests
    /// (`is_live` false) are dropped first.
    pub fn poll(
        &mut self,
        now: Instant,
        live: usize,
        is_live: impl Fn(RequestId) -> bool,
    ) -> GateDecision<T> {
        if !self.model_idle {
            return GateDecision::Hold;
        }
        self.waiting.retain(|w| is_live(w.rid()));
        let ready = self.resident_ready + self.waiting.len();
        let Some(oldest) = self
            .waiting
            .front()
            .map(Arrival::arrived)
            .into_iter()
            .chain(self.resident_ready_since)
            .min()
        else {
            return GateDecision::Hold;
        };
        let waited = now.saturating_duration_since(oldest);
        match release_reason(
            self.delayed,
            ready,
            live,
            waited,
            self.threshold,
            self.timeout,
        ) {
            Some(reason) => {
                self.model_idle = false;
                self.resident_ready_since = None;
                let arrivals: Vec<T> = self.waiting.drain(..).collect();
                let delays = arrivals
                    .iter()
                    .map(|a| now.saturating_duration_since(a.arrived()))
                    .collect();
                GateDecision::Release {
                    arrivals,
                    reason,
                    delays,
                }
            }
            None => GateDecision::WaitUntil(oldest + self.timeout),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[derive(Debug, PartialEq)]
    struct Item(u64, Instant);

    impl Arrival for Item {
        fn rid(&self) -> RequestId {
            RequestId(self.0)
        }
        fn arrived(&self) -> Instant {
            self.1
        }
    }

    fn released(decision: GateDecision<Item>) -> (Vec<u64>, ReleaseReason, Vec<Duration>) {
        match decision {
            GateDecision::Release {
                arrivals,
                reason,
                delays,
            } => (arrivals.iter().map(|a| a.0).collect(), reason, delays),
            other => panic!("expected a release, got {other:?}"),
        }
    }

    #[test]
    fn the_rule_names_each_reason() {
        let t = 20 * MS;
        assert_eq!(
            release_reason(false, 1, 8, MS, 4, t),
            Some(ReleaseReason::Ready)
        );
        assert_eq!(release_reason(false, 0, 8, t, 4, t), None, "nothing ready");
        assert_eq!(
            release_reason(true, 4, 8, MS, 4, t),
            Some(ReleaseReason::Threshold)
        );
        assert_eq!(
            release_reason(true, 3, 3, MS, 4, t),
            Some(ReleaseReason::AllHere)
        );
        assert_eq!(
            release_reason(true, 3, 8, t, 4, t),
            Some(ReleaseReason::Timeout)
        );
        assert_eq!(
            release_reason(true, 3, 8, t - MS, 4, t),
            None,
            "below every bound"
        );
    }

    #[test]
    fn outside_tokenrouter_mode_anything_ready_launches() {
        let t0 = Instant::now();
        let mut gate = BatchGate::new(false, 8, 20 * MS);
        gate.model_idle(0, t0);
        gate.arrive([Item(1, t0)]);
        let (ids, reason, _) = released(gate.poll(t0, 10, |_| true));
        assert_eq!((ids, reason), (vec![1], ReleaseReason::Ready));
    }

    #[test]
    fn a_busy_model_releases_nothing() {
        let t0 = Instant::now();
        let mut gate = BatchGate::new(false, 1, 20 * MS);
        gate.arrive([Item(1, t0)]);
        assert!(matches!(gate.poll(t0, 1, |_| true), GateDecision::Hold));
        gate.model_idle(0, t0);
        released(gate.poll(t0, 1, |_| true));
        gate.arrive([Item(2, t0)]);
        assert!(
            matches!(gate.poll(t0, 1, |_| true), GateDecision::Hold),
            "the model is stepping the last release"
        );
    }

    #[test]
    fn threshold_counts_residents_and_arrivals() {
        let t0 = Instant::now();
        let mut gate = BatchGate::new(true, 3, 20 * MS);
        gate.model_idle(1, t0);
        gate.arrive([Item(1, t0)]);
        assert!(matches!(
            gate.poll(t0, 10, |_| true),
            GateDecision::WaitUntil(_)
        ));
        gate.arrive([Item(2, t0 + MS)]);
        let (ids, reason, delays) = released(gate.poll(t0 + 2 * MS, 10, |_| true));
        assert_eq!((ids, reason), (vec![1, 2], ReleaseReason::Threshold));
        assert_eq!(delays, vec![2 * MS, MS]);
    }

    #[test]
    fn every_live_request_here_releases_below_threshold() {
        let t0 = Instant::now();
        let mut gate = BatchGate::new(true, 8, 20 * MS);
        gate.model_idle(0, t0);
        gate.arrive([Item(1, t0), Item(2, t0)]);
        assert!(matches!(
            gate.poll(t0, 3, |_| true),
            GateDecision::WaitUntil(_)
        ));
        let (_, reason, _) = released(gate.poll(t0, 2, |_| true));
        assert_eq!(reason, ReleaseReason::AllHere);
    }

    #[test]
    fn the_timeout_bounds_every_wait() {
        let t0 = Instant::now();
        let timeout = 20 * MS;
        let mut gate = BatchGate::new(true, 8, timeout);
        gate.model_idle(0, t0);
        gate.arrive([Item(1, t0), Item(2, t0 + 5 * MS)]);
        match gate.poll(t0 + 5 * MS, 10, |_| true) {
            GateDecision::WaitUntil(at) => assert_eq!(at, t0 + timeout, "from the oldest"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            gate.poll(t0 + timeout - MS, 10, |_| true),
            GateDecision::WaitUntil(_)
        ));
        let (ids, reason, delays) = released(gate.poll(t0 + timeout, 10, |_| true));
        assert_eq!((ids, reason), (vec![1, 2], ReleaseReason::Timeout));
        assert_eq!(delays, vec![timeout, 15 * MS]);
    }

    #[test]
    fn resident_requests_start_the_timeout_when_the_model_goes_idle() {
        let t0 = Instant::now();
        let mut gate: BatchGate<Item> = BatchGate::new(true, 8, 20 * MS);
        gate.model_idle(2, t0);
        match gate.poll(t0, 10, |_| true) {
            GateDecision::WaitUntil(at) => assert_eq!(at, t0 + 20 * MS),
            other => panic!("{other:?}"),
        }
        let (ids, reason, _) = released(gate.poll(t0 + 20 * MS, 10, |_| true));
        assert_eq!((ids, reason), (vec![], ReleaseReason::Timeout));
    }

    #[test]
    fn the_timeout_runs_from_the_oldest_of_residents_and_arrivals() {
        let t0 = Instant::now();
        let mut gate = BatchGate::new(true, 8, 20 * MS);
        gate.model_idle(1, t0);
        gate.arrive([Item(1, t0 + 5 * MS)]);
        match gate.poll(t0 + 5 * MS, 10, |_| true) {
            GateDecision::WaitUntil(at) => assert_eq!(at, t0 + 20 * MS, "the resident is older"),
            other => panic!("{other:?}"),
        }
        let mut gate = BatchGate::new(true, 8, 20 * MS);
        gate.arrive([Item(1, t0)]);
        gate.model_idle(1, t0 + 5 * MS);
        match gate.poll(t0 + 5 * MS, 10, |_| true) {
            GateDecision::WaitUntil(at) => assert_eq!(at, t0 + 20 * MS, "the arrival is older"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn ended_requests_are_dropped_and_withdrawn() {
        let t0 = Instant::now();
        let mut gate = BatchGate::new(false, 1, 20 * MS);
        gate.arrive([Item(1, t0), Item(2, t0), Item(3, t0)]);
        gate.withdraw(RequestId(2));
        assert_eq!(gate.waiting(), 2);
        gate.model_idle(0, t0);
        let (ids, _, _) = released(gate.poll(t0, 1, |rid| rid != RequestId(3)));
        assert_eq!(ids, vec![1]);
        gate.model_idle(0, t0);
        assert!(matches!(gate.poll(t0, 1, |_| true), GateDecision::Hold));
    }

    #[test]
    fn thresholds_below_one_mean_one() {
        let t0 = Instant::now();
        let mut gate = BatchGate::new(true, 4, 20 * MS);
        gate.set_threshold(0);
        assert_eq!(gate.threshold(), 1);
        gate.model_idle(0, t0);
        gate.arrive([Item(1, t0)]);
        let (_, reason, _) = released(gate.poll(t0, 5, |_| true));
        assert_eq!(reason, ReleaseReason::Threshold);
    }
}

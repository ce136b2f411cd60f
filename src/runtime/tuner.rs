//! `TunerActor` (`tokenrouter` mode): re-estimates the routing matrix and each model's L(b)
//! from the runtime's counters, solves the Markov model for the live request count N, and
//! publishes the best thresholds B*(N) to the batchers. The batcher timeout still bounds
//! every wait, and an `EagerCheck` runs those thresholds against eager launch in trial
//! periods and keeps whichever measured faster, so a poor estimate costs throughput only
//! during the trials.

use super::link::ModelLink;
use super::live::LiveRequests;
use super::record::ModelRecorder;
use crate::telemetry::ControllerMetrics;
use crate::tuning::controller::{
    thresholds_to_run, Arm, ArmComparison, EagerCheck, MIN_PREDICTED_GAIN,
};
use crate::tuning::online::{fit_request_latency, RoutingEstimate};
use crate::tuning::{search_bounded, AffineLatency, DtmcModel};
use actix::prelude::*;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Weight of the newest tuning period in the routing EWMA.
const ROUTING_ALPHA: f64 = 0.3;
/// Recent steps per model the latency fit uses.
const LATENCY_SAMPLES: usize = 512;
/// Time grid of the online model: coarser than the paper's 0.1 ms keeps the state space
/// (and the solve) small; thresholds are integers, so the grid barely moves them.
const ONLINE_DELTA_MS: f64 = 1.0;
/// Largest threshold the online search tries.
const ONLINE_MAX_THRESHOLD: usize = 4;
/// Periods a threshold choice is kept before the model is solved again (for an unchanged
/// live-request count). The solve takes CPU from the models on a small machine: at
/// δ = 0.5 ms and thresholds up to N = 8 it took ~1.7 s of a core per period.
const RESOLVE_PERIODS: usize = 20;
/// Periods the better arm runs between two trials of the eager check.
const EXPLOIT_PERIODS: usize = 4;

pub(crate) struct TunerSettings {
    pub interval: Duration,
    /// Largest N solved for; more live requests use B*(max).
    pub max_requests: usize,
    pub timeout_ms: f64,
    /// Configured L(b) per model (`[tuning] latency_ms`), the fit's fallback.
    pub latency_prior: Vec<Option<AffineLatency>>,
}

/// Where the current tuning period started.
struct Period {
    /// Committed tokens so far, at its start.
    tokens: u64,
    /// Live requests at its start.
    live: usize,
    start: Instant,
    /// Whether it runs an arm of the eager check (delayed thresholds were in force).
    checked: bool,
}

pub(crate) struct TunerActor {
    settings: TunerSettings,
    recorders: Vec<ModelRecorder>,
    live: LiveRequests,
    batchers: Vec<ModelLink>,
    routing: RoutingEstimate,
    /// One eager check per live-request count: throughputs at different loads do not
    /// compare, and a load that returns resumes its comparison (a fresh one starts with trials
    /// of both arms, which cost throughput when one of them loses).
    checks: BTreeMap<usize, EagerCheck>,
    /// The comparison as the runtime's snapshot reads it.
    published: Arc<Mutex<Option<ArmComparison>>>,
    metrics: ControllerMetrics,
    period: Period,
    /// The last choice: for which N, the thresholds, and periods since.
    solved: Option<(usize, Vec<usize>, usize)>,
}

impl TunerActor {
    pub fn new(
        settings: TunerSettings,
        recorders: Vec<ModelRecorder>,
        live: LiveRequests,
        batchers: Vec<ModelLink>,
        published: Arc<Mutex<Option<ArmComparison>>>,
    ) -> Self {
        let models = batchers.len();
        Self {
            settings,
            recorders,
            live,
            batchers,
            routing: RoutingEstimate::new(models, ROUTING_ALPHA),
            checks: BTreeMap::new(),
            published,
            metrics: ControllerMetrics::new(),
            period: Period {
                tokens: 0,
                live: 0,
                start: Instant::now(),
                checked: false,
            },
            solved: None,
        }
    }

    fn committed_tokens(&self) -> u64 {
        self.recorders
            .iter()
            .map(|r| r.read(|m| m.committed_to.iter().sum::<u64>()))
            .sum()
    }

    /// The eager check for `live` requests.
    fn check(&mut self, live: usize) -> &mut EagerCheck {
        self.checks
            .entry(live)
            .or_insert_with(|| EagerCheck::new(EXPLOIT_PERIODS))
    }

    /// Starts the next period, inside the eager check or not, and returns the one that ended.
    fn next_period(&mut self, checked: bool) -> Period {
        let next = Period {
            tokens: self.committed_tokens(),
            live: self.live.len(),
            start: Instant::now(),
            checked,
        };
        std::mem::replace(&mut self.period, next)
    }

    /// Starts a period outside the eager check (its throughput compares nothing).
    fn restart_period(&mut self) {
        self.next_period(false);
    }

    /// Closes the period that just ran and starts one inside the eager check: its throughput
    /// goes to the arm it ran in its live-request count's check. A period outside the check,
    /// one whose count changed (the next runs the new count's arm), and one that committed
    /// fewer tokens than requests are live (mostly prefill) are left out.
    fn close_period(&mut self) -> Arm {
        let ended = self.next_period(true);
        let Period {
            tokens,
            live,
            start: now,
            ..
        } = self.period;
        let seconds = (now - ended.start).as_secs_f64();
        let committed = tokens - ended.tokens;
        if !ended.checked
            || live != ended.live
            || live == 0
            || seconds <= 0.0
            || committed < live as u64
        {
            return self.check(live).running();
        }
        let check = self.check(live);
        let ran = check.running();
        let arm = check.period_ended(committed as f64, seconds);
        let comparison = check.comparison();
        tracing::debug!(?ran, committed, seconds, live, next = ?arm, "eager check period");
        self.metrics.compared(&comparison);
        *self.published.lock().unwrap_or_else(|e| e.into_inner()) = Some(comparison);
        arm
    }

    /// The model as currently estimated, once every model has been observed.
    fn estimate(&mut self) -> Option<DtmcModel> {
        let (routed, committed): (Vec<_>, Vec<_>) = self
            .recorders
            .iter()
            .map(|r| r.read(|m| (m.routed_to.clone(), m.committed_to.clone())))
            .unzip();
        self.routing.update(&routed, &committed);
        if !self.routing.ready() {
            return None;
        }
        let latency = self
            .recorders
            .iter()
            .zip(&self.settings.latency_prior)
            .map(|(m, prior)| {
                let samples: Vec<(usize, usize, f64)> = m
                    .recent_steps(LATENCY_SAMPLES)
                    .iter()
                    .map(|s| s.request_sample())
                    .collect();
                let completing = m.read(|f| {
                    f.rows_stepped.saturating_sub(f.chunked_rows) as f64
                        / f.rows_stepped.max(1) as f64
                });
                fit_request_latency(&samples, *prior, completing)
            })
            .collect::<Option<Vec<_>>>()?;
        let models = latency.len();
        Some(DtmcModel {
            routing: self.routing.routing().to_vec(),
            commits: self.routing.commits().to_vec(),
            latency,
            delta_ms: ONLINE_DELTA_MS,
            timeout_ms: vec![Some(self.settings.timeout_ms); models],
        })
    }

    fn retune(&mut self) {
        let n = self.live.len().min(self.settings.max_requests);
        let tuned = (n > 0).then(|| self.tuned_thresholds(n)).flatten();
        let thresholds = match tuned {
            // The model is not ready yet: the configured thresholds stay.
            None => return self.restart_period(),
            // Eager launch is the model's own choice: there is nothing to check it against.
            Some(tuned) if tuned.iter().all(|&b| b == 1) => {
                self.restart_period();
                tuned
            }
            Some(tuned) => match self.close_period() {
                Arm::Tuned => tuned,
                Arm::Eager => vec![1; tuned.len()],
            },
        };
        tracing::debug!(n, ?thresholds, "thresholds");
        for (batcher, b) in self.batchers.iter().zip(thresholds) {
            batcher.set_threshold(b);
        }
    }

    /// The Markov model's thresholds for N live requests, solved again every
    /// `RESOLVE_PERIODS` periods or when N changes.
    fn tuned_thresholds(&mut self, n: usize) -> Option<Vec<usize>> {
        let model = self.estimate()?;
        if let Some((solved_n, thresholds, age)) = &mut self.solved {
            if *solved_n == n && *age < RESOLVE_PERIODS {
                *age += 1;
                return Some(thresholds.clone());
            }
        }
        let started = Instant::now();
        let searched = search_bounded(&model, n, ONLINE_MAX_THRESHOLD);
        tracing::debug!(
            n,
            seconds = started.elapsed().as_secs_f64(),
            "threshold search"
        );
        match searched {
            Ok(results) => {
                let thresholds = thresholds_to_run(&results, MIN_PREDICTED_GAIN)?;
                self.solved = Some((n, thresholds.clone(), 0));
                Some(thresholds)
            }
            Err(e) => {
                tracing::warn!("online tuning skipped a period: {e}");
                None
            }
        }
    }
}

impl Actor for TunerActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        lowest_priority_for_this_thread();
        ctx.run_interval(self.settings.interval, |act, _| act.retune());
    }
}

/// The threshold search is background work beside the models' step threads: on a machine with
/// a core per model, one search took up to 2.3 s of a core (dense pair, N = 8) and slowed
/// the models it tunes. At the lowest priority it runs on what they leave idle.
fn lowest_priority_for_this_thread() {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: plain system calls on the calling thread (Linux keeps a nice value per
        // thread); a failure only leaves the priority as it was.
        let failed = unsafe {
            let thread = libc::syscall(libc::SYS_gettid) as libc::id_t;
            libc::setpriority(libc::PRIO_PROCESS, thread, 19) != 0
        };
        if failed {
            tracing::debug!("the tuner keeps its thread's priority (setpriority failed)");
        }
    }
}

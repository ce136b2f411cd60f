//! The paper's discrete-time Markov chain (App. D) with our two extensions: step latency
//! affine in the batch size, and an optional per-model timeout. State at batch-completion
//! epochs, per model: waiting k, running batch b, residual ticks r, timeout ticks left w.
//! Reachable states by BFS from "all N requests waiting at model 0"; stationary distribution
//! by iteration of the lazy chain (aperiodic, same stationary law); throughput by
//! renewal–reward: Σπ·E[committed tokens] / Σπ·τ.

use std::collections::HashMap;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AffineLatency {
    pub a_ms: f64,
    pub c_ms: f64,
}

impl AffineLatency {
    pub fn constant(ms: f64) -> Self {
        Self {
            a_ms: ms,
            c_ms: 0.0,
        }
    }

    pub fn at(&self, batch: usize) -> f64 {
        self.a_ms + self.c_ms * batch as f64
    }
}

/// Routing, commits and latencies of M models.
#[derive(Debug, Clone)]
pub struct DtmcModel {
    /// `routing[i][j]`: probability that a request stepped on i goes to j next (rows sum to 1).
    pub routing: Vec<Vec<f64>>,
    /// `commits[i][j]`: tokens committed on that transition.
    pub commits: Vec<Vec<f64>>,
    pub latency: Vec<AffineLatency>,
    /// Time grid; every latency and timeout is rounded to whole ticks.
    pub delta_ms: f64,
    /// Per-model timeout W_i (`None` = wait for the threshold only, as in the paper).
    pub timeout_ms: Vec<Option<f64>>,
}

#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Prediction {
    /// Committed tokens per second.
    pub throughput: f64,
    pub states: usize,
    pub busy_fraction: Vec<f64>,
    /// Mean size of the batches each model launches.
    pub mean_batch: Vec<f64>,
    /// Mean wait from arrival at a model to the start of its step (Little's law).
    pub admission_delay_ms: Vec<f64>,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum TuneError {
    #[error("invalid model: {0}")]
    Invalid(String),
    #[error("thresholds {0:?} deadlock with {1} requests (need Σ(B_i − 1) < N or a timeout)")]
    Deadlock(Vec<usize>, usize),
    #[error("the stationary distribution did not converge within {0} iterations")]
    NoConvergence(usize),
}

/// One model's slice of the state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Slot {
    waiting: u16,
    batch: u16,
    residual: u32,
    timer: u32,
}

type State = Vec<Slot>;

struct Grid<'a> {
    model: &'a DtmcModel,
    thresholds: &'a [usize],
    n: usize,
    timeout_ticks: Vec<Option<u32>>,
}

impl Grid<'_> {
    fn ticks(&self, model: usize, batch: usize) -> u32 {
        (self.model.latency[model].at(batch) / self.model.delta_ms)
            .round()
            .max(1.0) as u32
    }

    /// Launches every idle model whose queue reached its threshold or timed out.
    fn launch(&self, state: &mut State) {
        for (i, slot) in state.iter_mut().enumerate() {
            let timed_out = self.timeout_ticks[i].is_some() && slot.waiting > 0 && slot.timer == 0;
            if slot.batch == 0
                && slot.waiting > 0
                && (slot.waiting as usize >= self.thresholds[i] || timed_out)
            {
                slot.batch = slot.waiting;
                slot.residual = self.ticks(i, slot.waiting as usize);
                slot.waiting = 0;
                slot.timer = 0;
            }
        }
    }

    fn initial(&self) -> State {
        let mut state = vec![
            Slot {
                waiting: 0,
                batch: 0,
                residual: 0,
                timer: 0
            };
            self.thresholds.len()
        ];
        state[0].waiting = self.n as u16;
        state[0].timer = self.timeout_ticks[0].unwrap_or(0);
        self.launch(&mut state);
        state
    }

    /// Ticks to the next event: a completion, or an idle queue's timeout.
    fn holding_time(&self, state: &State) -> Option<u32> {
        state
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                if s.batch > 0 {
                    Some(s.residual)
                } else if s.waiting > 0 && self.timeout_ticks[i].is_some() {
                    Some(s.timer)
                } else {
                    None
                }
            })
            .min()
    }

    /// Successor states with their probabilities, plus the expected tokens committed.
    fn successors(&self, state: &State, tau: u32) -> (Vec<(State, f64)>, f64) {
        let m = state.len();
        let mut advanced = state.clone();
        let mut completing = Vec::new();
        for (i, s) in advanced.iter_mut().enumerate() {
            if s.batch > 0 {
                s.residual -= tau;
                if s.residual == 0 {
                    completing.push((i, s.batch as usize));
                    s.batch = 0;
                }
            }
            if s.waiting > 0 {
                s.timer = s.timer.saturating_sub(tau);
            }
        }
        let reward: f64 = completing
            .iter()
            .map(|&(i, b)| {
                b as f64
                    * (0..m)
                        .map(|j| self.model.commits[i][j] * self.model.routing[i][j])
                        .sum::<f64>()
            })
            .sum();
        let mut outcomes: Vec<(Vec<usize>, f64)> = vec![(vec![0; m], 1.0)];
        for &(i, b) in &completing {
            let mut next = Vec::new();
            for split in compositions(b, m) {
                let p = multinomial(&split, &self.model.routing[i]);
                if p == 0.0 {
                    continue;
                }
                for (arrivals, q) in &outcomes {
                    let sum: Vec<usize> = arrivals.iter().zip(&split).map(|(a, s)| a + s).collect();
                    next.push((sum, q * p));
                }
            }
            outcomes = next;
        }
        let successors = outcomes
            .into_iter()
            .map(|(arrivals, p)| {
                let mut s = advanced.clone();
                for (j, &a) in arrivals.iter().enumerate() {
                    if a > 0 {
                        if s[j].waiting == 0 {
                            s[j].timer = self.timeout_ticks[j].unwrap_or(0);
                        }
                        s[j].waiting += a as u16;
                    }
                }
                self.launch(&mut s);
                (s, p)
            })
            .collect();
        (successors, reward)
    }
}

/// All ways to split `total` requests over `parts` destinations.
fn compositions(total: usize, parts: usize) -> Vec<Vec<usize>> {
    if parts == 1 {
        return vec![vec![total]];
    }
    (0..=total)
        .flat_map(|first| {
            compositions(total - first, parts - 1)
                .into_iter()
                .map(move |mut rest| {
                    rest.insert(0, first);
                    rest
                })
        })
        .collect()
}

fn multinomial(split: &[usize], probs: &[f64]) -> f64 {
    let total: usize = split.iter().sum();
    let mut p = (1..=total).map(|x| x as f64).product::<f64>();
    for (&k, &q) in split.iter().zip(probs) {
        if k > 0 && q == 0.0 {
            return 0.0;
        }
        p *= q.powi(k as i32) / (1..=k).map(|x| x as f64).product::<f64>();
    }
    p
}

fn validate(model: &DtmcModel, n: usize, thresholds: &[usize]) -> Result<(), TuneError> {
    let m = model.latency.len();
    let invalid = |s: String| Err(TuneError::Invalid(s));
    if m == 0 || model.routing.len() != m || model.commits.len() != m || model.timeout_ms.len() != m
    {
        return invalid("routing, commits, latency and timeouts need one row per model".into());
    }
    if thresholds.len() != m || thresholds.iter().any(|&t| t == 0 || t > n) {
        return invalid(format!(
            "thresholds {thresholds:?} must be one per model, each in 1..={n}"
        ));
    }
    if model.delta_ms.is_nan() || model.delta_ms <= 0.0 || n == 0 {
        return invalid("delta_ms and N must be positive".into());
    }
    for row in &model.routing {
        if row.len() != m
            || (row.iter().sum::<f64>() - 1.0).abs() > 1e-9
            || row.iter().any(|&p| p < 0.0)
        {
            return invalid(format!(
                "routing row {row:?} must be {m} probabilities summing to 1"
            ));
        }
    }
    let deadlock_free = model.timeout_ms.iter().all(Option::is_some)
        || thresholds.iter().map(|t| t - 1).sum::<usize>() < n;
    if !deadlock_free {
        return Err(TuneError::Deadlock(thresholds.to_vec(), n));
    }
    Ok(())
}

const MAX_ITERATIONS: usize = 1_000_000;

/// Predicts throughput and per-model statistics for `n` requests at `thresholds`.
pub fn predict(model: &DtmcModel, n: usize, thresholds: &[usize]) -> Result<Prediction, TuneError> {
    validate(model, n, thresholds)?;
    let grid = Grid {
        model,
        thresholds,
        n,
        timeout_ticks: model
            .timeout_ms
            .iter()
            .map(|w| w.map(|w| (w / model.delta_ms).round().max(0.0) as u32))
            .collect(),
    };
    // BFS over reachable states; sparse transitions.
    let mut index: HashMap<State, usize> = HashMap::new();
    let mut states: Vec<State> = Vec::new();
    let mut transitions: Vec<Vec<(usize, f64)>> = Vec::new();
    let mut holding: Vec<f64> = Vec::new();
    let mut rewards: Vec<f64> = Vec::new();
    let start = grid.initial();
    index.insert(start.clone(), 0);
    states.push(start);
    let mut cursor = 0;
    while cursor < states.len() {
        let state = states[cursor].clone();
        let tau = grid
            .holding_time(&state)
            .ok_or_else(|| TuneError::Deadlock(thresholds.to_vec(), n))?;
        let (next, reward) = grid.successors(&state, tau);
        let mut row = Vec::with_capacity(next.len());
        for (s, p) in next {
            let id = match index.get(&s) {
                Some(&id) => id,
                None => {
                    let id = states.len();
                    index.insert(s.clone(), id);
                    states.push(s);
                    id
                }
            };
            row.push((id, p));
        }
        transitions.push(row);
        holding.push(tau as f64);
        rewards.push(reward);
        cursor += 1;
    }
    let pi = stationary(&transitions)?;
    let time: f64 = pi.iter().zip(&holding).map(|(p, t)| p * t).sum();
    let tokens: f64 = pi.iter().zip(&rewards).map(|(p, r)| p * r).sum();
    let m = thresholds.len();
    let (mut busy, mut launched, mut launches, mut queue, mut arrivals) = (
        vec![0.0; m],
        vec![0.0; m],
        vec![0.0; m],
        vec![0.0; m],
        vec![0.0; m],
    );
    for (s, state) in states.iter().enumerate() {
        let weight = pi[s];
        let tau = holding[s];
        for (i, slot) in state.iter().enumerate() {
            if slot.batch > 0 {
                busy[i] += weight * tau;
                // A batch running with its full latency left was launched at this epoch.
                if slot.residual == grid.ticks(i, slot.batch as usize) {
                    launched[i] += weight * slot.batch as f64;
                    launches[i] += weight;
                }
            }
            queue[i] += weight * tau * slot.waiting as f64;
            if slot.batch > 0 && slot.residual as f64 == tau {
                for (j, arrival) in arrivals.iter_mut().enumerate() {
                    *arrival += weight * slot.batch as f64 * model.routing[i][j];
                }
            }
        }
    }
    let tick_s = model.delta_ms / 1000.0;
    Ok(Prediction {
        throughput: tokens / time / tick_s,
        states: states.len(),
        busy_fraction: busy.iter().map(|b| b / time).collect(),
        mean_batch: launched
            .iter()
            .zip(&launches)
            .map(|(b, l)| if *l > 0.0 { b / l } else { 0.0 })
            .collect(),
        admission_delay_ms: queue
            .iter()
            .zip(&arrivals)
            .map(|(q, a)| {
                if *a > 0.0 {
                    q / a * model.delta_ms
                } else {
                    0.0
                }
            })
            .collect(),
    })
}

/// Stationary distribution of the lazy chain ½(I + T): same law, aperiodic.
fn stationary(transitions: &[Vec<(usize, f64)>]) -> Result<Vec<f64>, TuneError> {
    let n = transitions.len();
    let mut pi = vec![1.0 / n as f64; n];
    let mut next = vec![0.0; n];
    for iteration in 0..MAX_ITERATIONS {
        next.iter_mut().zip(&pi).for_each(|(x, p)| *x = 0.5 * p);
        for (s, row) in transitions.iter().enumerate() {
            let mass = 0.5 * pi[s];
            for &(t, p) in row {
                next[t] += mass * p;
            }
        }
        let change: f64 = next.iter().zip(&pi).map(|(a, b)| (a - b).abs()).sum();
        std::mem::swap(&mut pi, &mut next);
        if change < 1e-13 && iteration > 10 {
            return Ok(pi);
        }
    }
    Err(TuneError::NoConvergence(MAX_ITERATIONS))
}

/// Every feasible threshold vector (Σ(B_i − 1) < N unless every model has a timeout),
/// with its prediction, best first.
pub fn search(model: &DtmcModel, n: usize) -> Result<Vec<(Vec<usize>, Prediction)>, TuneError> {
    search_bounded(model, n, n)
}

/// `search` over thresholds of at most `max_threshold` (the online tuner's budget: each
/// candidate is a solve).
pub fn search_bounded(
    model: &DtmcModel,
    n: usize,
    max_threshold: usize,
) -> Result<Vec<(Vec<usize>, Prediction)>, TuneError> {
    let m = model.latency.len();
    let limit = max_threshold.clamp(1, n.max(1));
    let mut results = Vec::new();
    let mut candidate = vec![1usize; m];
    loop {
        match predict(model, n, &candidate) {
            Ok(p) => results.push((candidate.clone(), p)),
            Err(TuneError::Deadlock(..)) => {}
            Err(e) => return Err(e),
        }
        let Some(i) = (0..m).find(|&i| candidate[i] < limit) else {
            break;
        };
        candidate[i] += 1;
        candidate[..i].iter_mut().for_each(|c| *c = 1);
    }
    results.sort_by(|a, b| b.1.throughput.total_cmp(&a.1.throughput));
    Ok(results)
}

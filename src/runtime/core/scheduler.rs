//! `ModelScheduler`: one model's residency decisions. It owns the requests resident here
//! (stepping) and pending here (left for another model, KV kept), and maps each request to
//! its KV sequence. Each step it plans which rows run within the model's token budget and
//! KV: long prompts and catch-ups go in chunks beside the decode rows (Sarathi-Serve), a
//! request whose prefix another row is computing waits a step to share it, and under KV
//! pressure pending requests and then the newest residents give up their KV before anyone
//! fails. Its methods change KV only through `KvOps` and return the effects on clients and
//! other models for the actor to carry out, in order.

use super::budget::StepLimits;
use super::request::{
    EngineTiming, FailureKind, FinishReason, InFlight, RequestId, RoutingStats, Sampled,
    TokenLogprobs,
};
use crate::config::ExecutionMode;
use crate::engine::kv::{KvStore, BLOCK_TOKENS};
use crate::engine::{SeqId, SeqWork, StepExecutor, StepOutput};
use crate::policy::{ModelIdx, Route, SharedPolicy, StepView};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The KV operations the scheduler decides; an executor carries them out on its cache.
pub(crate) trait KvOps {
    /// Positions `seq` holds (0 when unknown).
    fn seq_len(&self, seq: SeqId) -> usize;
    /// Capacity appending `tokens` to `seq` would take.
    fn tokens_needed(&self, seq: SeqId, tokens: usize) -> usize;
    /// Positions `seq` can append without new blocks.
    fn slack(&self, seq: SeqId) -> usize;
    /// Capacity free for reservations (cached prefixes count: they are evictable).
    fn free_tokens(&self) -> usize;
    fn capacity_tokens(&self) -> usize;
    /// Starts `seq` on the longest cached prefix of `tokens`; returns the positions held.
    fn attach_prefix(&mut self, seq: SeqId, tokens: &[u32]) -> usize;
    /// Rolls `seq` back to at most `len` positions; returns the positions held.
    fn truncate(&mut self, seq: SeqId, len: usize) -> usize;
    fn free(&mut self, seq: SeqId);
}

/// The block manager alone (the scheduler's tests; a latency-profile model has nothing else).
impl KvOps for KvStore {
    fn seq_len(&self, seq: SeqId) -> usize {
        KvStore::seq_len(self, seq)
    }
    fn tokens_needed(&self, seq: SeqId, tokens: usize) -> usize {
        KvStore::tokens_needed(self, seq, tokens)
    }
    fn slack(&self, seq: SeqId) -> usize {
        self.table(seq).len() * BLOCK_TOKENS - KvStore::seq_len(self, seq)
    }
    fn free_tokens(&self) -> usize {
        KvStore::free_tokens(self)
    }
    fn capacity_tokens(&self) -> usize {
        self.usage().capacity_tokens
    }
    fn attach_prefix(&mut self, seq: SeqId, tokens: &[u32]) -> usize {
        KvStore::attach_prefix(self, seq, tokens).0
    }
    fn truncate(&mut self, seq: SeqId, len: usize) -> usize {
        KvStore::truncate(self, seq, len).0
    }
    fn free(&mut self, seq: SeqId) {
        KvStore::free(self, seq)
    }
}

impl KvOps for Box<dyn StepExecutor> {
    fn seq_len(&self, seq: SeqId) -> usize {
        StepExecutor::seq_len(self.as_ref(), seq)
    }
    fn tokens_needed(&self, seq: SeqId, tokens: usize) -> usize {
        self.kv().tokens_needed(seq, tokens)
    }
    fn slack(&self, seq: SeqId) -> usize {
        KvOps::slack(self.kv(), seq)
    }
    fn free_tokens(&self) -> usize {
        self.kv().free_tokens()
    }
    fn capacity_tokens(&self) -> usize {
        self.kv().usage().capacity_tokens
    }
    fn attach_prefix(&mut self, seq: SeqId, tokens: &[u32]) -> usize {
        StepExecutor::attach_prefix(self.as_mut(), seq, tokens)
    }
    fn truncate(&mut self, seq: SeqId, len: usize) -> usize {
        StepExecutor::truncate(self.as_mut(), seq, len)
    }
    fn free(&mut self, seq: SeqId) {
        StepExecutor::free(self.as_mut(), seq)
    }
}

/// What the actor must do after a scheduler call, in order.
pub(crate) enum Effect<C> {
    /// Stream a committed token to the client.
    Commit {
        client: C,
        token: u32,
        /// Its place in the completion.
        index: usize,
        logprobs: Option<TokenLogprobs>,
        policy: SharedPolicy,
    },
    /// The generation is over (its KV here is already freed).
    Finish {
        client: C,
        reason: FinishReason,
        stats: RoutingStats,
        timing: EngineTiming,
        prompt_tokens: usize,
        /// Tokens committed in all.
        completion_tokens: usize,
    },
    /// The generation failed (its KV here is already freed).
    Fail {
        client: C,
        message: String,
        kind: FailureKind,
    },
    /// Send the request to model `to`'s batcher (with the step's other handoffs there).
    HandOff {
        to: ModelIdx,
        request: Box<InFlight<C>>,
    },
}

/// Counts of the scheduler's own decisions, for the runtime's snapshot.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct SchedulerCounters {
    /// KV sequences created (a new request, a return in `standard` mode, a re-prefill).
    pub kv_allocations: u64,
    /// Requests whose KV was taken for others (they re-prefill, from the prefix cache where
    /// their blocks survive, when they run again).
    pub preemptions: u64,
    /// Rows that ran part of their unseen tokens (a chunk).
    pub chunked_rows: u64,
    /// Row-steps a request waited for another row computing the same prefix.
    pub prefix_waits: u64,
}

/// One row of a step: a resident and how many of its unseen tokens it appends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PlannedRow {
    resident: usize,
    tokens: usize,
    /// Whether this appends every unseen token (so the step yields its next candidate).
    completes: bool,
}

/// What a step did for one resident.
#[derive(Clone)]
enum RowOutcome {
    NotRun,
    /// Appended this many of its unseen tokens, not all.
    Chunk(usize),
    /// Appended every unseen token: its candidate and the policy's route.
    Completed(Sampled, Route),
}

/// A step's plan: the executor runs `work`; `update_from_output` takes the plan back.
pub(crate) struct StepPlan {
    pub work: Vec<SeqWork>,
    rows: Vec<PlannedRow>,
    /// Per row: alternatives to report when its request asked for log-probabilities.
    pub logprobs: Vec<Option<usize>>,
    started: Instant,
}

impl StepPlan {
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Tokens the step appends.
    pub fn tokens(&self) -> usize {
        self.rows.iter().map(|r| r.tokens).sum()
    }
}

pub(crate) struct ModelScheduler<C> {
    model: ModelIdx,
    /// Every model's count: handoff targets are checked against it.
    models: usize,
    name: String,
    mode: ExecutionMode,
    limits: StepLimits,
    resident: Vec<InFlight<C>>,
    /// Per resident: the steps it has waited since it became ready (admitted, or last ran).
    waited: HashMap<RequestId, usize>,
    /// The KV sequence of each request this model holds (resident or pending).
    seqs: HashMap<RequestId, SeqId>,
    pending: HashSet<RequestId>,
    /// Residents that waited for a prefix another row computed: they look it up again.
    reattach: HashSet<RequestId>,
    next_seq: u64,
    counters: SchedulerCounters,
}

impl<C: Clone> ModelScheduler<C> {
    pub fn new(
        model: ModelIdx,
        models: usize,
        name: &str,
        mode: ExecutionMode,
        limits: StepLimits,
    ) -> Self {
        Self {
            model,
            models,
            name: name.to_string(),
            mode,
            limits,
            resident: Vec::new(),
            waited: HashMap::new(),
            seqs: HashMap::new(),
            pending: HashSet::new(),
            reattach: HashSet::new(),
            next_seq: 0,
            counters: SchedulerCounters::default(),
        }
    }

    pub fn resident(&self) -> usize {
        self.resident.len()
    }

    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    pub fn counters(&self) -> SchedulerCounters {
        self.counters
    }

    /// Forgets everything after the model's KV was wiped (a restart): pending requests
    /// re-prefill from their committed tokens when they return.
    pub fn reset(&mut self) {
        self.resident.clear();
        self.waited.clear();
        self.seqs.clear();
        self.pending.clear();
        self.reattach.clear();
    }

    /// A fresh sequence for `rid`, started on the longest cached prefix of its committed
    /// tokens but the last (whose logits the next step must compute). Returns its length
    /// and the time the prefix lookup took.
    fn start_seq(
        &mut self,
        kv: &mut impl KvOps,
        rid: RequestId,
        tokens: &[u32],
    ) -> (usize, Duration) {
        if let Some(old) = self.seqs.remove(&rid) {
            kv.free(old);
        }
        let seq = SeqId(self.next_seq);
        self.next_seq += 1;
        self.seqs.insert(rid, seq);
        self.counters.kv_allocations += 1;
        let started = Instant::now();
        let len = kv.attach_prefix(seq, &tokens[..tokens.len() - 1]);
        (len, started.elapsed())
    }

    /// Frees everything this model holds for `rid`.
    fn release_seq(&mut self, kv: &mut impl KvOps, rid: RequestId) {
        if let Some(seq) = self.seqs.remove(&rid) {
            kv.free(seq);
        }
        self.pending.remove(&rid);
        self.reattach.remove(&rid);
        self.waited.remove(&rid);
    }

    /// A request ended (finished, cancelled, failed elsewhere): drop it and all its KV here.
    pub fn free_request(&mut self, kv: &mut impl KvOps, rid: RequestId) {
        self.resident.retain(|r| r.rid() != rid);
        self.release_seq(kv, rid);
    }

    /// Takes an arrival into the resident set with its KV ready for its unseen tokens.
    /// An arrival of a request that already ended is dropped and its KV freed.
    pub fn admit(&mut self, kv: &mut impl KvOps, mut arrival: InFlight<C>, live: bool) {
        let rid = arrival.rid();
        if !live {
            self.release_seq(kv, rid);
            return;
        }
        if let Some(handoff) = arrival.handoff.take() {
            arrival.params.policy.receive(&mut arrival.state, &handoff);
        }
        arrival.state.current = self.model;
        self.pending.remove(&rid);
        let mut seen = match self.seqs.get(&rid) {
            // async/tokenrouter/lockstep: the request's KV is still here; append from `seen`
            // (rolled back to it where a handoff across vocabularies re-read the text).
            Some(&seq)
                if self.mode != ExecutionMode::Standard
                    && kv.seq_len(seq) >= arrival.state.seen[self.model] =>
            {
                kv.truncate(seq, arrival.state.seen[self.model])
            }
            // A new request, a return in `standard` mode (a new request there), or KV lost
            // meanwhile (preempted, the model restarted): the longest cached prefix.
            _ => {
                let (len, lookup) = self.start_seq(kv, rid, &arrival.state.tokens);
                arrival.timing.prefix_match += lookup;
                len
            }
        };
        let committed = arrival.state.tokens.len();
        if seen >= committed {
            // Nothing unseen (its own candidate here was rejected): recompute the last position.
            seen = kv.truncate(self.seqs[&rid], committed - 1);
        }
        arrival.state.seen[self.model] = seen;
        self.waited.insert(rid, 0);
        self.resident.push(arrival);
    }

    /// Drops residents whose request ended while they waited, freeing their KV.
    pub fn drop_ended(&mut self, kv: &mut impl KvOps, is_live: impl Fn(RequestId) -> bool) {
        let ended: Vec<RequestId> = self
            .resident
            .iter()
            .map(InFlight::rid)
            .filter(|&rid| !is_live(rid))
            .collect();
        for rid in ended {
            self.free_request(kv, rid);
        }
    }

    /// The next step: which residents run and how many of their unseen tokens each appends
    /// (decode rows and catch-ups first, shortest first, then prompts in arrival order,
    /// within the token budget and the KV). Effects are failures of requests the KV budget cannot hold alone.
    pub fn schedule(&mut self, kv: &mut impl KvOps) -> (StepPlan, Vec<Effect<C>>) {
        for rid in std::mem::take(&mut self.reattach) {
            if let Some(i) = self.resident.iter().position(|r| r.rid() == rid) {
                let tokens = self.resident[i].state.tokens.clone();
                let (seen, lookup) = self.start_seq(kv, rid, &tokens);
                let r = &mut self.resident[i];
                r.state.seen[self.model] = seen;
                r.timing.prefix_match += lookup;
            }
        }
        let mut effects = Vec::new();
        loop {
            let rows = self.plan_rows(kv);
            if !rows.is_empty() || self.resident.is_empty() {
                return (self.plan(rows), effects);
            }
            // Nothing fits: every free block is held by residents that cannot all go on.
            let holders: Vec<usize> = (0..self.resident.len())
                .filter(|&i| kv.seq_len(self.seqs[&self.resident[i].rid()]) > 0)
                .collect();
            match holders[..] {
                [.., newest] if holders.len() > 1 => {
                    let r = &mut self.resident[newest];
                    r.state.seen[self.model] = 0;
                    let rid = r.rid();
                    kv.free(self.seqs[&rid]);
                    self.reattach.insert(rid);
                    self.counters.preemptions += 1;
                }
                _ => {
                    // One request holds all the KV a step could use and still needs more.
                    let victim = holders.first().copied().unwrap_or(self.resident.len() - 1);
                    let r = self.resident.remove(victim);
                    let capacity = kv.capacity_tokens();
                    self.release_seq(kv, r.rid());
                    effects.push(Effect::Fail {
                        client: r.client,
                        message: format!(
                            "model `{}`: the request needs more KV than its budget of \
                             {capacity} tokens",
                            self.name
                        ),
                        kind: FailureKind::Capacity,
                    });
                }
            }
        }
    }

    /// Chooses the rows of the next step (see `schedule`), preempting pending requests where
    /// the KV they hold is needed.
    fn plan_rows(&mut self, kv: &mut impl KvOps) -> Vec<PlannedRow> {
        // The shortest work first (decode rows, then catch-ups and prompts by their unseen
        // tokens), so a long prompt's chunks never hold up a decode or a catch-up; a row that
        // waited its bound runs past the budget, so shorter work arriving all the time cannot
        // starve it, and without taking the budget from the rows before it.
        let due_after = self.limits.max_wait_steps.saturating_sub(1);
        let waited: Vec<usize> = self
            .resident
            .iter()
            .map(|r| self.waited.get(&r.rid()).copied().unwrap_or(0))
            .collect();
        let mut order: Vec<usize> = (0..self.resident.len()).collect();
        order.sort_by_key(|&i| self.resident[i].state.unseen(self.model).len());
        let mut left = self.limits.budget.unwrap_or(f64::INFINITY);
        let mut reserved = 0;
        let mut rows: Vec<PlannedRow> = Vec::new();
        for i in order {
            let r = &self.resident[i];
            let (rid, from, unseen) = (
                r.rid(),
                r.state.seen[self.model],
                r.state.unseen(self.model).len(),
            );
            if self.reattach.contains(&rid) {
                // Preempted in this round: it starts over next step.
                continue;
            }
            let due = waited[i] >= due_after;
            let mut tokens = match self.limits.tokens_within(from, unseen, left) {
                // The bound outranks the budget: a due row runs a token at least.
                0 if due => 1,
                0 => continue,
                fits => fits,
            };
            if tokens > 1 && !due && self.computed_by_another_row(i, &rows) {
                self.reattach.insert(rid);
                self.counters.prefix_waits += 1;
                continue;
            }
            let seq = self.seqs[&rid];
            let needed = kv.tokens_needed(seq, tokens);
            while needed > kv.free_tokens() - reserved && self.preempt_oldest_pending(kv) {}
            let free = kv.free_tokens() - reserved;
            if needed > free {
                tokens = tokens.min(kv.slack(seq) + free);
            }
            if tokens == 0 {
                continue;
            }
            reserved += kv.tokens_needed(seq, tokens);
            left -= self.limits.cost(from, tokens);
            rows.push(PlannedRow {
                resident: i,
                tokens,
                completes: tokens == unseen,
            });
        }
        rows.sort_by_key(|row| row.resident);
        rows
    }

    /// Whether resident `i` would prefill a block of tokens that a row already planned is
    /// computing at the same positions: it then waits a step and takes them from the cache.
    fn computed_by_another_row(&self, i: usize, rows: &[PlannedRow]) -> bool {
        let state = &self.resident[i].state;
        let from = state.seen[self.model];
        let until = (from + BLOCK_TOKENS).min(state.tokens.len());
        rows.iter().any(|row| {
            let other = &self.resident[row.resident].state;
            let other_from = other.seen[self.model];
            other_from <= from
                && other_from + row.tokens >= until
                && other.tokens.get(..until) == Some(&state.tokens[..until])
        })
    }

    /// Takes the KV of the pending request that left first. False when none is pending.
    fn preempt_oldest_pending(&mut self, kv: &mut impl KvOps) -> bool {
        // In submission order (ids grow), so the choice is deterministic.
        let Some(&oldest) = self.pending.iter().min() else {
            return false;
        };
        self.release_seq(kv, oldest);
        self.counters.preemptions += 1;
        true
    }

    fn plan(&mut self, rows: Vec<PlannedRow>) -> StepPlan {
        for (i, r) in self.resident.iter().enumerate() {
            let ran = rows.iter().any(|row| row.resident == i);
            let waited = self.waited.entry(r.rid()).or_default();
            *waited = if ran { 0 } else { *waited + 1 };
        }
        let work = rows
            .iter()
            .map(|row| {
                let r = &self.resident[row.resident];
                let from = r.state.seen[self.model];
                let mut needs = r.params.policy.needs();
                if let Some(top) = r.params.logprobs {
                    // The largest logit gives the normaliser of the log-probabilities.
                    needs.top_k = needs.top_k.max(top).max(1);
                }
                // Only a row that samples needs its grammar's mask.
                let filter = r
                    .grammar
                    .as_ref()
                    .filter(|_| row.completes)
                    .map(|grammar| grammar.filter(self.model));
                SeqWork {
                    seq: self.seqs[&r.rid()],
                    tokens: r.state.tokens[from..from + row.tokens].to_vec(),
                    sampling: r.params.sampling,
                    needs,
                    filter,
                }
            })
            .collect();
        let logprobs = rows
            .iter()
            .map(|row| self.resident[row.resident].params.logprobs)
            .collect();
        self.counters.chunked_rows += rows.iter().filter(|row| !row.completes).count() as u64;
        StepPlan {
            work,
            rows,
            logprobs,
            started: Instant::now(),
        }
    }

    /// Fails every resident request (an engine error or a crash mid-step).
    pub fn fail_resident(&mut self, kv: &mut impl KvOps, message: &str) -> Vec<Effect<C>> {
        let mut effects = Vec::new();
        for r in std::mem::take(&mut self.resident) {
            self.release_seq(kv, r.rid());
            effects.push(Effect::Fail {
                client: r.client,
                message: message.to_string(),
                kind: FailureKind::Fault,
            });
        }
        effects
    }

    /// Asks each policy about its requests' completed rows (one `route_batch` per policy,
    /// over the batch). `outputs` are in plan order; rows that ran a chunk get `None`.
    pub fn decide(&self, plan: &StepPlan, outputs: &[StepOutput]) -> Vec<Option<Route>> {
        let mut routes = vec![None; plan.rows.len()];
        let mut groups: Vec<(&SharedPolicy, Vec<usize>)> = Vec::new();
        for (k, row) in plan
            .rows
            .iter()
            .enumerate()
            .filter(|(_, row)| row.completes)
        {
            let policy = &self.resident[row.resident].params.policy;
            match groups.iter_mut().find(|(p, _)| Arc::ptr_eq(p, policy)) {
                Some((_, members)) => members.push(k),
                None => groups.push((policy, vec![k])),
            }
        }
        for (policy, members) in groups {
            let states: Vec<_> = members
                .iter()
                .map(|&k| &self.resident[plan.rows[k].resident].state)
                .collect();
            let views: Vec<StepView> = members
                .iter()
                .map(|&k| StepView {
                    model: self.model,
                    candidate: outputs[k].candidate,
                    stats: &outputs[k].stats,
                    logits: &outputs[k].logits,
                    hidden: outputs[k].hidden.as_deref(),
                    embedding: outputs[k].candidate_embedding.as_deref(),
                })
                .collect();
            for (&k, route) in members.iter().zip(policy.route_batch(&states, &views)) {
                routes[k] = Some(route);
            }
        }
        routes
    }

    /// Applies a finished step: chunks advance; completed rows commit, finish and hand off
    /// per `routes` (plan order, as from `decide`). Leaving requests stay pending here with
    /// their KV (in `standard` mode they free it: their blocks stay in the prefix cache).
    /// Returns the effects and, per completed row, the model that steps it next and whether
    /// its candidate was committed (the routing counts).
    pub fn update_from_output(
        &mut self,
        kv: &mut impl KvOps,
        plan: &StepPlan,
        candidates: Vec<Sampled>,
        routes: &[Option<Route>],
        now: Instant,
    ) -> (Vec<Effect<C>>, Vec<(ModelIdx, bool)>) {
        let mut effects = Vec::new();
        let mut transitions = Vec::new();
        let mut outcome = vec![RowOutcome::NotRun; self.resident.len()];
        for ((row, candidate), route) in plan.rows.iter().zip(candidates).zip(routes) {
            outcome[row.resident] = match route {
                Some(route) => RowOutcome::Completed(candidate, *route),
                None => RowOutcome::Chunk(row.tokens),
            };
        }
        let step_time = now.saturating_duration_since(plan.started);
        let residents = std::mem::take(&mut self.resident);
        for (mut r, outcome) in residents.into_iter().zip(outcome) {
            if !matches!(outcome, RowOutcome::NotRun) {
                r.timing.compute += step_time;
            }
            let (candidate, route) = match outcome {
                RowOutcome::NotRun => {
                    self.resident.push(r);
                    continue;
                }
                RowOutcome::Chunk(tokens) => {
                    r.state.seen[self.model] += tokens;
                    self.resident.push(r);
                    continue;
                }
                RowOutcome::Completed(candidate, route) => (candidate, route),
            };
            r.state.seen[self.model] = r.state.tokens.len();
            let leave_to = match route {
                Route::Stay => None,
                Route::CommitThenSwitch(to) | Route::RejectAndSwitch(to) => Some(to),
            };
            if let Some(to) = leave_to.filter(|&to| to >= self.models || to == self.model) {
                self.release_seq(kv, r.rid());
                effects.push(Effect::Fail {
                    message: format!(
                        "policy `{}` routed to invalid model {to}",
                        r.params.policy.name()
                    ),
                    client: r.client,
                    kind: FailureKind::Fault,
                });
                continue;
            }
            // Into another vocabulary only on a whole character: until then it stays, and
            // keeps its candidate.
            let here = self.model;
            let may_leave = |r: &InFlight<C>, to| {
                r.cross
                    .as_ref()
                    .is_none_or(|cross| cross.may_leave(here, to))
            };
            let (leave_to, commits) = match route {
                Route::RejectAndSwitch(to) if !may_leave(&r, to) => (None, true),
                route => (leave_to, !matches!(route, Route::RejectAndSwitch(_))),
            };
            if commits {
                if let Some(finish) = self.commit(&mut r, candidate, &mut effects) {
                    self.release_seq(kv, r.rid());
                    effects.push(finish);
                    continue;
                }
            }
            let leave_to = leave_to.filter(|&to| may_leave(&r, to));
            transitions.push((leave_to.unwrap_or(self.model), commits));
            match leave_to {
                None => self.resident.push(r),
                Some(to) => match self.hand_off(kv, r, to, now) {
                    Ok(request) => effects.push(Effect::HandOff {
                        to,
                        request: Box::new(request),
                    }),
                    Err(failure) => effects.push(failure),
                },
            }
        }
        (effects, transitions)
    }

    /// Commits a token and streams it; returns the finish effect when the generation is over.
    fn commit(
        &self,
        r: &mut InFlight<C>,
        sampled: Sampled,
        effects: &mut Vec<Effect<C>>,
    ) -> Option<Effect<C>> {
        let token = sampled.token;
        let ends = r.ends(self.model, token);
        if let Some(grammar) = &r.grammar {
            let accepted = if ends {
                grammar.error().map_or(Ok(()), Err)
            } else {
                grammar.commit(self.model, token)
            };
            if let Err(message) = accepted {
                return Some(Effect::Fail {
                    client: r.client.clone(),
                    message,
                    kind: FailureKind::Fault,
                });
            }
        }
        let reason = if ends {
            Some(FinishReason::Stop)
        } else {
            r.state.tokens.push(token);
            if let Some(cross) = &mut r.cross {
                cross.commit(self.model, token);
            }
            r.stats.tokens_per_model[self.model] += 1;
            effects.push(Effect::Commit {
                client: r.client.clone(),
                token,
                index: r.completion_tokens() - 1,
                logprobs: sampled.logprobs,
                policy: r.params.policy.clone(),
            });
            (r.completion_tokens() >= r.params.max_tokens).then_some(FinishReason::Length)
        };
        reason.map(|reason| Effect::Finish {
            client: r.client.clone(),
            reason,
            stats: r.stats.clone(),
            timing: r.timing,
            prompt_tokens: r.prompt_tokens(),
            completion_tokens: r.completion_tokens(),
        })
    }

    /// Packs a leaving request for `to` (in `to`'s vocabulary) and marks it pending here
    /// (in `standard` mode, a return is a new request: its KV goes to the prefix cache).
    /// Err: the failure of a request whose text `to`'s vocabulary cannot spell.
    fn hand_off(
        &mut self,
        kv: &mut impl KvOps,
        mut r: InFlight<C>,
        to: ModelIdx,
        now: Instant,
    ) -> Result<InFlight<C>, Effect<C>> {
        let rid = r.rid();
        if let Some(cross) = &mut r.cross {
            if let Err(message) = cross.enter(&mut r.state, to) {
                self.release_seq(kv, rid);
                return Err(Effect::Fail {
                    client: r.client,
                    message,
                    kind: FailureKind::Fault,
                });
            }
        }
        r.handoff = Some(r.params.policy.send(&r.state, to));
        r.stats.handoffs += 1;
        r.arrived = now;
        self.waited.remove(&rid);
        if self.mode == ExecutionMode::Standard {
            self.release_seq(kv, rid);
        } else {
            self.pending.insert(rid);
        }
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{LogitStats, SamplingParams};
    use crate::policy::single::Single;
    use crate::policy::{RoutingState, SharedPolicy};
    use crate::runtime::core::RequestParams;
    use std::collections::BTreeSet;

    const EOS: u32 = 0;

    mod cross_vocab;
    mod fairness;
    mod grammar;

    /// What an executor's step does to the block manager: reserve, then commit the tokens.
    fn run_on_kv(kv: &mut KvStore, work: &[SeqWork]) {
        let appends: Vec<(SeqId, usize)> = work.iter().map(|w| (w.seq, w.tokens.len())).collect();
        kv.reserve(&appends).expect("the plan fits the KV budget");
        for w in work {
            kv.advance(w.seq, &w.tokens);
        }
    }

    /// A request from client `rid` with `prompt`, as it first reaches model 0.
    fn request(rid: u64, prompt: &[u32], max_tokens: usize) -> InFlight<u64> {
        let policy: SharedPolicy = Arc::new(Single::new("test", 0));
        InFlight {
            state: RoutingState::new(RequestId(rid), prompt.to_vec(), 2, 0),
            params: RequestParams {
                max_tokens,
                sampling: SamplingParams::default(),
                eos: Arc::new(BTreeSet::from([EOS])),
                policy,
                policy_spec: None,
                logprobs: None,
            },
            stats: RoutingStats {
                tokens_per_model: vec![0; 2],
                handoffs: 0,
            },
            client: rid,
            handoff: None,
            arrived: Instant::now(),
            timing: EngineTiming::default(),
            hosts: vec![None; 2],
            grammar: None,
            cross: None,
        }
    }

    fn scheduler(mode: ExecutionMode) -> ModelScheduler<u64> {
        ModelScheduler::new(0, 2, "m0", mode, StepLimits::unlimited())
    }

    /// A budget of `tokens` per step, priced by tokens only, with the default wait bound.
    fn budget(tokens: f64) -> StepLimits {
        StepLimits {
            budget: Some(tokens),
            ..StepLimits::unlimited()
        }
    }

    /// Plans and runs one step with `candidate` for every completed row and `routes` for
    /// the completed rows in plan order (`Stay` past its end); returns the step's work and
    /// the effects.
    fn step(
        s: &mut ModelScheduler<u64>,
        kv: &mut KvStore,
        candidate: u32,
        routes: &[Route],
    ) -> (Vec<SeqWork>, Vec<Effect<u64>>) {
        let (plan, failed) = s.schedule(kv);
        assert!(fails(&failed).is_empty());
        run_on_kv(kv, &plan.work);
        let candidates = vec![Sampled::from(candidate); plan.work.len()];
        let mut routes = routes.iter().copied();
        let routes: Vec<Option<Route>> = plan
            .rows
            .iter()
            .map(|row| row.completes.then(|| routes.next().unwrap_or(Route::Stay)))
            .collect();
        let (effects, _) = s.update_from_output(kv, &plan, candidates, &routes, Instant::now());
        (plan.work, effects)
    }

    fn handed_off(effects: Vec<Effect<u64>>) -> InFlight<u64> {
        effects
            .into_iter()
            .find_map(|e| match e {
                Effect::HandOff { request, .. } => Some(*request),
                _ => None,
            })
            .expect("a handoff")
    }

    /// What another model does meanwhile: commits `tokens` and hands the request back.
    fn elsewhere(mut r: InFlight<u64>, tokens: &[u32]) -> InFlight<u64> {
        r.state.current = 1;
        r.state.tokens.extend_from_slice(tokens);
        r.state.seen[1] = r.state.tokens.len() - 1;
        r.handoff = Some(r.params.policy.send(&r.state, 0));
        r
    }

    fn fails(effects: &[Effect<u64>]) -> Vec<(u64, FailureKind)> {
        effects
            .iter()
            .filter_map(|e| match e {
                Effect::Fail { client, kind, .. } => Some((*client, *kind)),
                _ => None,
            })
            .collect()
    }

    fn committed(effects: &[Effect<u64>]) -> Vec<(u64, u32)> {
        effects
            .iter()
            .filter_map(|e| match e {
                Effect::Commit { client, token, .. } => Some((*client, *token)),
                _ => None,
            })
            .collect()
    }

    fn tokens(from: u32, n: usize) -> Vec<u32> {
        (from..from + n as u32).collect()
    }

    #[test]
    fn a_returning_request_appends_only_the_tokens_it_has_not_seen() {
        let mut kv = KvStore::new(1024);
        let mut s = scheduler(ExecutionMode::Tokenrouter);
        s.admit(&mut kv, request(1, &[5, 6, 7], 16), true);
        let (work, effects) = step(&mut s, &mut kv, 8, &[Route::CommitThenSwitch(1)]);
        assert_eq!(work[0].tokens, vec![5, 6, 7], "the prompt, once");
        assert_eq!((s.resident(), s.pending()), (0, 1), "pending, KV kept");
        assert_eq!(kv.seq_len(work[0].seq), 3);
        let back = elsewhere(handed_off(effects), &[9, 10]);
        s.admit(&mut kv, back, true);
        let (work_back, _) = step(&mut s, &mut kv, 11, &[]);
        assert_eq!(work_back[0].seq, work[0].seq, "the same sequence resumes");
        assert_eq!(
            work_back[0].tokens,
            vec![8, 9, 10],
            "only what it has not seen"
        );
        assert_eq!(s.pending(), 0);
        assert_eq!(s.counters().kv_allocations, 1);
    }

    #[test]
    fn a_rejected_candidate_recomputes_the_last_position() {
        let mut kv = KvStore::new(1024);
        let mut s = scheduler(ExecutionMode::Async);
        s.admit(&mut kv, request(1, &[5, 6, 7], 16), true);
        let (work, effects) = step(&mut s, &mut kv, 8, &[Route::RejectAndSwitch(1)]);
        let mut back = handed_off(effects);
        assert_eq!(
            back.state.tokens,
            vec![5, 6, 7],
            "the candidate was dropped"
        );
        // The other model wrote nothing new here yet (say its token was also rejected).
        back.state.current = 1;
        back.handoff = Some(back.params.policy.send(&back.state, 0));
        s.admit(&mut kv, back, true);
        assert_eq!(
            kv.seq_len(work[0].seq),
            2,
            "truncated before the last position"
        );
        assert_eq!(step(&mut s, &mut kv, 9, &[]).0[0].tokens, vec![7]);
    }

    #[test]
    fn a_sequence_lost_meanwhile_starts_again_from_the_cache_or_the_committed_tokens() {
        for sharing in [true, false] {
            let mut kv = KvStore::new(1024);
            kv.set_prefix_sharing(sharing);
            let mut s = scheduler(ExecutionMode::Tokenrouter);
            s.admit(&mut kv, request(1, &[5, 6, 7], 16), true);
            let (work, effects) = step(&mut s, &mut kv, 8, &[Route::CommitThenSwitch(1)]);
            kv.free(work[0].seq);
            s.admit(&mut kv, elsewhere(handed_off(effects), &[9]), true);
            let expected: &[u32] = if sharing { &[8, 9] } else { &[5, 6, 7, 8, 9] };
            assert_eq!(step(&mut s, &mut kv, 1, &[]).0[0].tokens, expected);
            assert_eq!(s.counters().kv_allocations, 2);
        }
    }

    #[test]
    fn every_mode_shares_prefixes_and_standard_returns_start_from_the_cache() {
        for mode in [
            ExecutionMode::Standard,
            ExecutionMode::Async,
            ExecutionMode::Tokenrouter,
            ExecutionMode::Lockstep,
        ] {
            let mut kv = KvStore::new(1024);
            let mut s = scheduler(mode);
            let system = tokens(100, 40);
            let ask = |rid: u64, question: u32| {
                let mut prompt = system.clone();
                prompt.extend([question, question]);
                request(rid, &prompt, 16)
            };
            s.admit(&mut kv, ask(1, 1), true);
            let (first, effects) = step(&mut s, &mut kv, 9, &[Route::CommitThenSwitch(1)]);
            assert_eq!(first[0].tokens.len(), 42);
            // Another request with the same system prompt computes only its own tokens.
            s.admit(&mut kv, ask(2, 2), true);
            let (work, _) = step(&mut s, &mut kv, 9, &[]);
            assert_eq!(work[0].tokens, vec![2, 2], "{mode:?}");
            assert_eq!(kv.prefix_counters().hit_tokens, 40, "{mode:?}");
            // The first returns: in standard mode a new sequence on its own cached blocks.
            s.admit(&mut kv, elsewhere(handed_off(effects), &[10]), true);
            let (work, _) = step(&mut s, &mut kv, 11, &[]);
            let back = work.iter().find(|w| w.tokens.contains(&10)).unwrap();
            assert_eq!(back.tokens, vec![9, 10], "{mode:?}");
            let fresh = mode == ExecutionMode::Standard;
            assert_eq!(back.seq != first[0].seq, fresh, "{mode:?}");
            assert_eq!(s.counters().kv_allocations, 2 + fresh as u64, "{mode:?}");
        }
    }

    #[test]
    fn long_prompts_run_in_chunks_beside_the_decode_rows() {
        let mut kv = KvStore::new(1024);
        let mut s = ModelScheduler::new(0, 2, "m0", ExecutionMode::Async, budget(7.0));
        s.admit(&mut kv, request(1, &[5], 8), true);
        step(&mut s, &mut kv, 6, &[]);
        s.admit(&mut kv, request(2, &tokens(100, 20), 8), true);
        let mut chunks = Vec::new();
        let mut commits = Vec::new();
        for _ in 0..4 {
            let (work, effects) = step(&mut s, &mut kv, 7, &[]);
            assert!(work.iter().map(|w| w.tokens.len()).sum::<usize>() <= 7);
            assert_eq!(work[0].tokens.len(), 1, "the decode row runs every step");
            chunks.extend(work.get(1).map(|w| w.tokens.len()));
            commits.extend(committed(&effects));
        }
        assert_eq!(chunks, vec![6, 6, 6, 2]);
        assert_eq!(
            commits.iter().filter(|(client, _)| *client == 2).count(),
            1,
            "no token before the whole prompt ran"
        );
        assert_eq!(s.counters().chunked_rows, 3);
    }

    #[test]
    fn a_catch_up_is_not_held_up_by_a_long_prompt_that_came_first() {
        let mut kv = KvStore::new(1024);
        let mut s = ModelScheduler::new(0, 2, "m0", ExecutionMode::Async, budget(8.0));
        s.admit(&mut kv, request(1, &[5], 8), true);
        let (_, effects) = step(&mut s, &mut kv, 6, &[Route::CommitThenSwitch(1)]);
        s.admit(&mut kv, request(2, &tokens(100, 40), 8), true);
        step(&mut s, &mut kv, 7, &[]);
        // Request 1 returns with three tokens to catch up while request 2 is mid-prompt.
        s.admit(&mut kv, elsewhere(handed_off(effects), &[8, 9]), true);
        let (work, _) = step(&mut s, &mut kv, 7, &[]);
        let sizes: Vec<usize> = work.iter().map(|w| w.tokens.len()).collect();
        assert_eq!(
            sizes,
            vec![5, 3],
            "the prompt's chunk gets what the catch-up leaves"
        );
    }

    /// The starvation a context-weighted budget exposed: a catch-up longer than a block (a
    /// run the other model wrote) queued behind a long prompt that came first and waited for
    /// every one of its chunks, more of them and smaller once late chunks are priced by the
    /// context they attend over.
    #[test]
    fn a_long_catch_up_is_not_held_up_by_a_long_prompt_that_came_first() {
        let mut kv = KvStore::new(4096);
        let limits = StepLimits {
            budget: Some(24.0),
            context_cost: 0.4 / 1500.0,
            max_wait_steps: usize::MAX,
        };
        let mut s = ModelScheduler::new(0, 2, "m0", ExecutionMode::Tokenrouter, limits);
        s.admit(&mut kv, request(1, &[5], 64), true);
        let (_, effects) = step(&mut s, &mut kv, 6, &[Route::CommitThenSwitch(1)]);
        s.admit(&mut kv, request(2, &tokens(100, 1500), 8), true);
        for _ in 0..10 {
            step(&mut s, &mut kv, 7, &[]);
        }
        // Request 1 returns with 20 tokens the other model wrote, mid-prompt.
        s.admit(
            &mut kv,
            elsewhere(handed_off(effects), &tokens(30, 20)),
            true,
        );
        let (work, effects) = step(&mut s, &mut kv, 7, &[]);
        // Rows in resident order: request 2's chunk, then request 1 (admitted again).
        assert_eq!(work[1].tokens.len(), 21, "the whole catch-up, at once");
        assert_eq!(committed(&effects), vec![(1, 7)]);
        let late_chunk = work[0].tokens.len();
        assert!(
            (1..3).contains(&late_chunk),
            "the prompt's chunk gets what the catch-up leaves: {late_chunk}"
        );
    }

    #[test]
    fn a_request_waits_a_step_for_the_prefix_another_row_is_computing() {
        let mut kv = KvStore::new(1024);
        let mut s = scheduler(ExecutionMode::Tokenrouter);
        let prompt = tokens(100, 40);
        s.admit(&mut kv, request(1, &prompt, 8), true);
        s.admit(&mut kv, request(2, &prompt, 8), true);
        let (work, _) = step(&mut s, &mut kv, 9, &[]);
        assert_eq!(work.len(), 1, "the second request waits");
        let (work, _) = step(&mut s, &mut kv, 9, &[]);
        assert_eq!(
            work[1].tokens,
            vec![prompt[39]],
            "and takes the rest from the cache"
        );
        assert_eq!(kv.prefix_counters().hit_tokens, 39);
        assert_eq!(s.counters().prefix_waits, 1);
    }

    #[test]
    fn under_kv_pressure_pending_requests_go_first_then_residents_wait_or_start_over() {
        // 8 blocks of 16 tokens.
        let mut kv = KvStore::new(8 * BLOCK_TOKENS);
        kv.set_prefix_sharing(false);
        let mut s = scheduler(ExecutionMode::Tokenrouter);
        // Requests 1 and 2 take a block each and leave: pending here.
        for rid in [1, 2] {
            s.admit(&mut kv, request(rid, &[rid as u32; 10], 64), true);
        }
        step(&mut s, &mut kv, 3, &[Route::CommitThenSwitch(1); 2]);
        assert_eq!((s.pending(), kv.usage().used_tokens), (2, 2 * BLOCK_TOKENS));
        // Residents 3..=5 need 2 + 2 + 3 blocks, one more than is free: the older pending
        // request gives up its KV.
        for (rid, prompt) in [(3, 20), (4, 20), (5, 40)] {
            s.admit(&mut kv, request(rid, &vec![rid as u32; prompt], 64), true);
        }
        let (work, _) = step(&mut s, &mut kv, 3, &[]);
        assert_eq!(work.len(), 3);
        assert_eq!(s.counters().preemptions, 1);
        assert!(
            !s.pending.contains(&RequestId(1)),
            "the older pending request went first"
        );
        // Two more residents of three blocks each: the other pending request goes, and what
        // still does not fit waits (a shorter chunk, or a later step) instead of failing.
        for rid in [6, 7] {
            s.admit(&mut kv, request(rid, &[rid as u32; 40], 64), true);
        }
        let (work, effects) = step(&mut s, &mut kv, 3, &[]);
        assert!(fails(&effects).is_empty());
        assert_eq!(s.counters().preemptions, 2);
        assert_eq!(work.len(), 4, "three decode rows and a chunk of request 6");
        assert_eq!(work[3].tokens.len(), BLOCK_TOKENS, "the one block freed");
        assert_eq!(s.resident(), 5);
    }

    #[test]
    fn a_kv_deadlock_restarts_the_newest_resident_and_fails_only_what_cannot_fit_alone() {
        let mut kv = KvStore::new(4 * BLOCK_TOKENS);
        kv.set_prefix_sharing(false);
        let mut s = scheduler(ExecutionMode::Async);
        // Two requests of two full blocks each: both need a fifth block for their next token.
        for rid in [1, 2] {
            s.admit(
                &mut kv,
                request(rid, &[rid as u32; 2 * BLOCK_TOKENS], 64),
                true,
            );
        }
        step(&mut s, &mut kv, 9, &[]);
        let (work, effects) = step(&mut s, &mut kv, 9, &[]);
        assert!(fails(&effects).is_empty());
        assert_eq!(work.len(), 1, "request 2 gave up its KV to request 1");
        assert_eq!(s.counters().preemptions, 1);
        // Request 1 alone grows past the whole budget: it fails, retryably; 2 goes on.
        let mut failed = Vec::new();
        for _ in 0..2 * BLOCK_TOKENS + 2 {
            let (plan, effects) = s.schedule(&mut kv);
            failed.extend(fails(&effects));
            run_on_kv(&mut kv, &plan.work);
            let routes: Vec<Option<Route>> = plan
                .rows
                .iter()
                .map(|r| r.completes.then_some(Route::Stay))
                .collect();
            let candidates = vec![Sampled::from(9); plan.work.len()];
            s.update_from_output(&mut kv, &plan, candidates, &routes, Instant::now());
        }
        assert_eq!(failed, vec![(1, FailureKind::Capacity)]);
        assert_eq!(s.resident(), 1);
    }

    #[test]
    fn cancelling_frees_everything_the_model_holds() {
        for mode in [ExecutionMode::Tokenrouter, ExecutionMode::Standard] {
            let mut kv = KvStore::new(1024);
            let mut s = scheduler(mode);
            s.admit(&mut kv, request(1, &[5, 6, 7], 16), true);
            s.admit(&mut kv, request(2, &[5, 6, 8], 16), true);
            step(
                &mut s,
                &mut kv,
                9,
                &[Route::CommitThenSwitch(1), Route::Stay],
            );
            step(&mut s, &mut kv, 9, &[]);
            assert!(kv.usage().used_tokens > 0);
            s.free_request(&mut kv, RequestId(1));
            s.free_request(&mut kv, RequestId(2));
            assert_eq!((s.resident(), s.pending()), (0, 0), "{mode:?}");
            let usage = kv.usage();
            assert_eq!((usage.used_tokens, usage.sequences), (0, 0), "{mode:?}");
            assert!(usage.cached_tokens > 0, "{mode:?}: the prompts stay cached");
            assert!(s.seqs.is_empty(), "{mode:?}");
        }
    }

    #[test]
    fn arrivals_and_residents_of_ended_requests_are_dropped() {
        let mut kv = KvStore::new(1024);
        let mut s = scheduler(ExecutionMode::Async);
        s.admit(&mut kv, request(1, &[5], 16), false);
        assert_eq!(s.resident(), 0);
        s.admit(&mut kv, request(2, &[5], 16), true);
        s.admit(&mut kv, request(3, &[6], 16), true);
        step(&mut s, &mut kv, 7, &[]);
        s.drop_ended(&mut kv, |rid| rid != RequestId(2));
        assert_eq!(s.resident(), 1);
        assert_eq!(kv.usage().sequences, 1);
    }

    #[test]
    fn commits_stream_and_the_end_frees_the_kv() {
        let mut kv = KvStore::new(1024);
        let mut s = scheduler(ExecutionMode::Async);
        s.admit(&mut kv, request(1, &[5], 2), true);
        s.admit(&mut kv, request(2, &[5], 8), true);
        let (_, effects) = step(&mut s, &mut kv, 7, &[]);
        assert!(matches!(
            effects[..],
            [Effect::Commit { token: 7, .. }, Effect::Commit { .. }]
        ));
        let (_, effects) = step(&mut s, &mut kv, 7, &[]);
        match &effects[..] {
            [Effect::Commit { client: 1, .. }, Effect::Finish {
                client: 1,
                reason: FinishReason::Length,
                stats,
                prompt_tokens: 1,
                ..
            }, Effect::Commit { client: 2, .. }] => assert_eq!(stats.tokens_per_model, [2, 0]),
            _ => panic!("max_tokens = 2 ends request 1 after its second token"),
        }
        let (_, effects) = step(&mut s, &mut kv, EOS, &[]);
        assert!(matches!(
            effects[..],
            [Effect::Finish {
                client: 2,
                reason: FinishReason::Stop,
                ..
            }]
        ));
        assert_eq!((s.resident(), kv.usage().used_tokens), (0, 0));
    }

    /// A request's compute time is the wall time of the steps that ran its rows (a chunked
    /// prompt's too), and its log-probabilities travel with its committed tokens.
    #[test]
    fn a_finished_request_reports_its_steps_time_and_logprobs() {
        let mut kv = KvStore::new(1024);
        let mut s = scheduler(ExecutionMode::Async);
        s.limits = budget(2.0);
        let mut r = request(1, &[5, 6, 7], 1);
        r.params.logprobs = Some(0);
        s.admit(&mut kv, r, true);
        let step_ms = 7;
        let logprobs = TokenLogprobs {
            logprob: -0.5,
            entropy: 1.0,
            top: vec![],
        };
        let mut effects = Vec::new();
        for _ in 0..2 {
            let (plan, _) = s.schedule(&mut kv);
            assert_eq!(plan.logprobs, vec![Some(0)]);
            run_on_kv(&mut kv, &plan.work);
            let routes: Vec<Option<Route>> = plan
                .rows
                .iter()
                .map(|r| r.completes.then_some(Route::Stay))
                .collect();
            let sampled = Sampled {
                token: 9,
                logprobs: Some(logprobs.clone()),
            };
            let end = plan.started + Duration::from_millis(step_ms);
            effects = s
                .update_from_output(&mut kv, &plan, vec![sampled], &routes, end)
                .0;
        }
        match &effects[..] {
            [Effect::Commit {
                token: 9,
                logprobs: Some(got),
                ..
            }, Effect::Finish { timing, .. }] => {
                assert_eq!(got, &logprobs);
                // Two steps: the prompt's first chunk, then its rest and the token.
                assert_eq!(timing.compute, Duration::from_millis(2 * step_ms));
            }
            _ => panic!("one token committed with its logprobs, then the end"),
        }
    }

    #[test]
    fn a_route_to_an_unknown_model_fails_the_request() {
        let mut kv = KvStore::new(1024);
        let mut s = scheduler(ExecutionMode::Async);
        s.admit(&mut kv, request(1, &[5], 8), true);
        s.admit(&mut kv, request(2, &[6], 8), true);
        let (_, effects) = step(
            &mut s,
            &mut kv,
            7,
            &[Route::CommitThenSwitch(5), Route::RejectAndSwitch(0)],
        );
        assert_eq!(
            fails(&effects),
            vec![(1, FailureKind::Fault), (2, FailureKind::Fault)]
        );
        assert_eq!(kv.usage().used_tokens, 0);
    }

    #[test]
    fn each_policy_routes_its_own_completed_rows_as_one_batch() {
        /// Hands over exactly the requests of a batch of `size`.
        struct BatchSize(usize, [ModelIdx; 2]);
        impl crate::policy::RoutingPolicy for BatchSize {
            fn name(&self) -> &str {
                "batch-size"
            }
            fn describe(&self) -> crate::policy::PolicyInfo {
                unreachable!()
            }
            fn models(&self) -> &[ModelIdx] {
                &self.1
            }
            fn entry(&self, _: &crate::policy::RequestInfo) -> ModelIdx {
                0
            }
            fn route_batch(&self, reqs: &[&RoutingState], _: &[StepView]) -> Vec<Route> {
                let route = if reqs.len() == self.0 {
                    Route::CommitThenSwitch(1)
                } else {
                    Route::Stay
                };
                vec![route; reqs.len()]
            }
        }
        let mut kv = KvStore::new(1024);
        let mut s = ModelScheduler::new(0, 2, "m0", ExecutionMode::Async, budget(4.0));
        let two: SharedPolicy = Arc::new(BatchSize(2, [0, 1]));
        let one: SharedPolicy = Arc::new(BatchSize(1, [0, 1]));
        // Request 4 (policy `one`) runs a chunk of its prompt: it is not routed yet, so
        // `one` sees a batch of one (request 2) and `two` one of two.
        for (rid, policy, prompt) in [(1, &two, 1), (2, &one, 1), (3, &two, 1), (4, &one, 9)] {
            let mut r = request(rid, &tokens(10 * rid as u32, prompt), 8);
            r.params.policy = policy.clone();
            s.admit(&mut kv, r, true);
        }
        let (plan, _) = s.schedule(&mut kv);
        let outputs: Vec<StepOutput> = plan
            .work
            .iter()
            .map(|w| StepOutput {
                seq: w.seq,
                position: 0,
                candidate: 7,
                logits: vec![],
                stats: LogitStats {
                    entropy: 0.0,
                    max_prob: 1.0,
                    top_k: vec![],
                },
                hidden: None,
                candidate_embedding: None,
            })
            .collect();
        let mut expected = vec![Some(Route::CommitThenSwitch(1)); 3];
        expected.push(None);
        assert_eq!(s.decide(&plan, &outputs), expected);
    }
}

//! `ModelActor`: one model's scheduler, executor and private KV cache, on its own arbiter
//! thread under an actix `Supervisor`. It steps its resident requests, calls the policy in
//! process, commits and streams tokens, and hands leaving requests to the target's batcher.
//! A request that leaves stays **pending** here (KV kept) and resumes with a token append.

use super::batcher::BatcherActor;
use super::messages::{
    Admit, Committed, Failed, FailureKind, FinishReason, Finished, FreeRequest, InFlight,
    ModelIdle, Release,
};
use super::stats::{RuntimeStats, StepInterval};
use crate::config::ExecutionMode;
use crate::engine::{SeqId, SeqWork, StepExecutor, StepOutput};
use crate::policy::{ModelIdx, Route, StepView};
use crate::telemetry::ModelMetrics;
use actix::prelude::*;
use dashmap::DashMap;
use std::collections::{HashMap, HashSet};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// A `standard`-mode cache entry: the KV a request left behind, keyed by its tokens.
struct CachedPrefix {
    rid: u64,
    seq: SeqId,
    tokens: Vec<u32>,
}

pub struct ModelActor {
    idx: ModelIdx,
    name: String,
    executor: Box<dyn StepExecutor>,
    mode: ExecutionMode,
    batcher: Addr<BatcherActor>,
    /// Every model's batcher, by model index (handoff targets).
    peers: Vec<Addr<BatcherActor>>,
    resident: Vec<InFlight>,
    /// The KV sequence of each request this model holds (resident or pending).
    seqs: HashMap<u64, SeqId>,
    pending: HashSet<u64>,
    prefix_cache: Vec<CachedPrefix>,
    next_seq: SeqId,
    live: Arc<DashMap<u64, ()>>,
    stats: Arc<RuntimeStats>,
    /// `lockstep`: one step at a time across all models.
    global_step_lock: Option<Arc<Mutex<()>>>,
    fault_every_steps: u64,
    steps_run: u64,
    metrics: ModelMetrics,
    /// Every model's name, by index (handoff metric labels).
    model_names: Arc<[String]>,
}

/// Everything a model actor is built from (kept apart so the supervisor can restart it).
pub struct ModelActorParts {
    pub idx: ModelIdx,
    pub executor: Box<dyn StepExecutor>,
    pub mode: ExecutionMode,
    pub peers: Vec<Addr<BatcherActor>>,
    pub live: Arc<DashMap<u64, ()>>,
    pub stats: Arc<RuntimeStats>,
    pub global_step_lock: Option<Arc<Mutex<()>>>,
    pub fault_every_steps: u64,
    pub model_names: Arc<[String]>,
}

impl ModelActor {
    pub fn new(parts: ModelActorParts) -> Self {
        let name = parts.executor.name().to_string();
        Self {
            idx: parts.idx,
            metrics: ModelMetrics::new(&name),
            name,
            model_names: parts.model_names,
            batcher: parts.peers[parts.idx].clone(),
            executor: parts.executor,
            mode: parts.mode,
            peers: parts.peers,
            resident: Vec::new(),
            seqs: HashMap::new(),
            pending: HashSet::new(),
            prefix_cache: Vec::new(),
            next_seq: 0,
            live: parts.live,
            stats: parts.stats,
            global_step_lock: parts.global_step_lock,
            fault_every_steps: parts.fault_every_steps,
            steps_run: 0,
        }
    }

    fn new_seq(&mut self, rid: u64) -> SeqId {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.seqs.insert(rid, seq);
        self.stats.models[self.idx]
            .kv_allocations
            .fetch_add(1, Ordering::Relaxed);
        seq
    }

    fn release_seq(&mut self, rid: u64) {
        if let Some(seq) = self.seqs.remove(&rid) {
            self.executor.free(seq);
        }
        self.pending.remove(&rid);
        let executor = &mut self.executor;
        self.prefix_cache.retain(|c| {
            if c.rid == rid {
                executor.free(c.seq);
            }
            c.rid != rid
        });
    }

    /// Takes an arrival into the resident set with its KV ready for the unseen tokens.
    fn admit(&mut self, mut arrival: InFlight) {
        let rid = arrival.state.rid;
        if !self.live.contains_key(&rid) {
            self.release_seq(rid);
            return;
        }
        if let Some(handoff) = arrival.handoff.take() {
            arrival.params.policy.receive(&mut arrival.state, &handoff);
        }
        arrival.state.current = self.idx;
        self.pending.remove(&rid);
        let mut seen = match self.mode {
            ExecutionMode::Standard => self.prefix_lookup(rid, &arrival.state.tokens),
            _ => self.resume(rid, arrival.state.seen[self.idx]),
        };
        let committed = arrival.state.tokens.len();
        if seen >= committed {
            // Nothing unseen (its own candidate here was rejected): recompute the last position.
            seen = committed - 1;
            self.executor.truncate(self.seqs[&rid], seen);
        }
        arrival.state.seen[self.idx] = seen;
        self.resident.push(arrival);
    }

    /// `standard`: a return is a new request: longest cached prefix, fresh allocation, copy.
    fn prefix_lookup(&mut self, rid: u64, tokens: &[u32]) -> usize {
        self.stats.models[self.idx]
            .prefix_lookups
            .fetch_add(1, Ordering::Relaxed);
        let limit = tokens.len() - 1;
        let best = self
            .prefix_cache
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let common = c
                    .tokens
                    .iter()
                    .zip(tokens)
                    .take_while(|(a, b)| a == b)
                    .count();
                (i, common.min(limit))
            })
            .max_by_key(|&(_, common)| common);
        let seq = self.new_seq(rid);
        let Some((i, matched)) = best.filter(|&(_, m)| m > 0) else {
            return 0;
        };
        let source = self.prefix_cache[i].seq;
        let copied = self.executor.fork_prefix(source, seq, matched).is_ok();
        // The request's own leftover is superseded by the new copy; another request's entry
        // stays cached for its owner.
        if self.prefix_cache[i].rid == rid {
            self.prefix_cache.swap_remove(i);
            self.executor.free(source);
        }
        if copied {
            matched
        } else {
            0
        }
    }

    /// `async`/`tokenrouter`/`lockstep`: the request's KV is still here; append from `seen`.
    /// Where it is gone (the actor restarted meanwhile) the request is re-admitted from its
    /// committed tokens.
    fn resume(&mut self, rid: u64, seen: usize) -> usize {
        match self.seqs.get(&rid).copied() {
            Some(seq) if self.executor.seq_len(seq) == seen => seen,
            Some(seq) => {
                self.executor.free(seq);
                self.new_seq(rid);
                0
            }
            None => {
                self.new_seq(rid);
                0
            }
        }
    }

    /// KV this step's appends need beyond what is free.
    fn kv_shortfall(&self) -> usize {
        let kv = self.executor.kv();
        let needed: usize = self
            .resident
            .iter()
            .map(|r| kv.tokens_needed(self.seqs[&r.state.rid], r.state.unseen(self.idx).len()))
            .sum();
        needed.saturating_sub(kv.free_tokens())
    }

    /// Makes this step fit the KV budget. Cached prefixes and pending requests give up their
    /// KV first (a pending request re-prefills from its committed tokens when it returns:
    /// preempted, then resumed); only if the resident batch alone does not fit do the newest
    /// residents fail, cleanly and retryably, so the others keep going.
    fn make_room(&mut self) {
        if self.kv_shortfall() == 0 {
            return;
        }
        for cached in std::mem::take(&mut self.prefix_cache) {
            self.executor.free(cached.seq);
        }
        let pending: Vec<u64> = self.pending.iter().copied().collect();
        for rid in pending {
            if self.kv_shortfall() == 0 {
                return;
            }
            self.release_seq(rid);
            self.stats.models[self.idx]
                .preemptions
                .fetch_add(1, Ordering::Relaxed);
        }
        while self.kv_shortfall() > 0 {
            let Some(r) = self.resident.pop() else { return };
            let capacity = self.executor.kv_usage().capacity_tokens;
            r.client.do_send(Failed {
                message: format!(
                    "model `{}`: KV cache full ({capacity} tokens); retry later",
                    self.name
                ),
                kind: FailureKind::Capacity,
            });
            self.release_seq(r.state.rid);
        }
    }

    fn fail_resident(&mut self, message: &str) {
        for r in std::mem::take(&mut self.resident) {
            r.client.do_send(Failed {
                message: message.to_string(),
                kind: FailureKind::Fault,
            });
            self.release_seq(r.state.rid);
        }
    }

    /// Publishes this model's KV usage and pending count to the shared stats.
    fn publish_usage(&self) {
        let stats = &self.stats.models[self.idx];
        stats
            .kv_tokens_used
            .store(self.executor.kv_usage().used_tokens, Ordering::Relaxed);
        stats.pending.store(self.pending.len(), Ordering::Relaxed);
        self.metrics
            .usage(self.executor.kv_usage().used_tokens, self.pending.len());
    }

    fn report_idle(&self) {
        self.publish_usage();
        self.batcher.do_send(ModelIdle {
            resident_ready: self.resident.len(),
        });
    }

    fn step(&mut self, ctx: &mut Context<Self>) {
        let dead: Vec<u64> = self
            .resident
            .iter()
            .map(|r| r.state.rid)
            .filter(|rid| !self.live.contains_key(rid))
            .collect();
        self.resident.retain(|r| !dead.contains(&r.state.rid));
        for rid in dead {
            self.release_seq(rid);
        }
        self.make_room();
        if self.resident.is_empty() {
            self.report_idle();
            return;
        }
        let work: Vec<SeqWork> = self
            .resident
            .iter()
            .map(|r| SeqWork {
                seq: self.seqs[&r.state.rid],
                tokens: r.state.unseen(self.idx).to_vec(),
                sampling: r.params.sampling,
                needs: r.params.policy.needs(),
            })
            .collect();
        let tokens: usize = work.iter().map(|w| w.tokens.len()).sum();
        self.steps_run += 1;
        let inject_fault =
            self.fault_every_steps > 0 && self.steps_run.is_multiple_of(self.fault_every_steps);
        let lock = self.global_step_lock.clone();
        let guard = lock
            .as_ref()
            .map(|l| l.lock().unwrap_or_else(|e| e.into_inner()));
        let start = Instant::now();
        let executor = &mut self.executor;
        let result = catch_unwind(AssertUnwindSafe(|| {
            if inject_fault {
                panic!("injected fault");
            }
            executor.step(&work)
        }));
        let end = Instant::now();
        drop(guard);
        match result {
            Err(panic) => {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "panic".into());
                let message = format!(
                    "model `{}` crashed during a step ({what}); it restarts",
                    self.name
                );
                self.fail_resident(&message);
                ctx.stop();
            }
            Ok(Err(e)) => {
                self.fail_resident(&format!("model `{}`: {e}", self.name));
                self.report_idle();
            }
            Ok(Ok(outputs)) => {
                self.metrics.step((end - start).as_secs_f64(), work.len());
                self.stats.models[self.idx].record_step(
                    StepInterval {
                        start,
                        end,
                        batch: work.len(),
                    },
                    tokens,
                );
                self.apply_routes(outputs);
                self.report_idle();
            }
        }
    }

    /// Asks each request's policy (per policy, over the batch) and acts on the answers.
    fn apply_routes(&mut self, outputs: Vec<StepOutput>) {
        let residents = std::mem::take(&mut self.resident);
        let routes = self.decide(&residents, &outputs);
        let mut leaving: HashMap<ModelIdx, Vec<InFlight>> = HashMap::new();
        for ((mut r, out), route) in residents.into_iter().zip(outputs).zip(routes) {
            r.state.seen[self.idx] = r.state.tokens.len();
            let leave_to = match route {
                Route::Stay => None,
                Route::CommitThenSwitch(to) | Route::RejectAndSwitch(to) => Some(to),
            };
            if let Some(to) = leave_to {
                if to >= self.peers.len() || to == self.idx {
                    let message = format!(
                        "policy `{}` routed to invalid model {to}",
                        r.params.policy.name()
                    );
                    r.client.do_send(Failed {
                        message,
                        kind: FailureKind::Fault,
                    });
                    self.release_seq(r.state.rid);
                    continue;
                }
            }
            let commits = !matches!(route, Route::RejectAndSwitch(_));
            if commits && self.commit(&mut r, out.candidate) {
                self.release_seq(r.state.rid);
                continue;
            }
            self.stats.models[self.idx].record_route(leave_to.unwrap_or(self.idx), commits as u64);
            match leave_to {
                None => self.resident.push(r),
                Some(to) => leaving.entry(to).or_default().push(self.hand_off(r, to)),
            }
        }
        for (to, arrivals) in leaving {
            self.peers[to].do_send(Admit(arrivals));
        }
    }

    fn decide(&self, residents: &[InFlight], outputs: &[StepOutput]) -> Vec<Route> {
        let mut routes = vec![Route::Stay; residents.len()];
        let mut groups: HashMap<*const (), Vec<usize>> = HashMap::new();
        for (i, r) in residents.iter().enumerate() {
            let key = Arc::as_ptr(&r.params.policy) as *const ();
            groups.entry(key).or_default().push(i);
        }
        for indices in groups.values() {
            let policy = &residents[indices[0]].params.policy;
            let states: Vec<_> = indices.iter().map(|&i| &residents[i].state).collect();
            let views: Vec<StepView> = indices
                .iter()
                .map(|&i| StepView {
                    model: self.idx,
                    candidate: outputs[i].candidate,
                    stats: &outputs[i].stats,
                    logits: &outputs[i].logits,
                    hidden: outputs[i].hidden.as_deref(),
                    embedding: outputs[i].candidate_embedding.as_deref(),
                })
                .collect();
            for (&i, route) in indices.iter().zip(policy.route_batch(&states, &views)) {
                routes[i] = route;
            }
        }
        routes
    }

    /// Commits a token and streams it; returns true when the generation is over.
    fn commit(&self, r: &mut InFlight, token: u32) -> bool {
        let finish = if r.params.eos.contains(&token) {
            Some(FinishReason::Stop)
        } else {
            r.state.tokens.push(token);
            r.stats.tokens_per_model[self.idx] += 1;
            self.metrics.committed(r.params.policy.name(), 1);
            r.client.do_send(Committed {
                tokens: vec![token],
                model: self.idx,
            });
            (r.state.generated().len() >= r.params.max_tokens).then_some(FinishReason::Length)
        };
        if let Some(reason) = finish {
            r.client.do_send(Finished {
                reason,
                stats: r.stats.clone(),
                prompt_tokens: r.state.prompt_len,
            });
        }
        finish.is_some()
    }

    /// Packs a leaving request for `to` and marks it pending here (or caches its prefix in
    /// `standard` mode); the caller sends it with the step's other handoffs.
    fn hand_off(&mut self, mut r: InFlight, to: ModelIdx) -> InFlight {
        let rid = r.state.rid;
        r.handoff = Some(r.params.policy.send(&r.state, to));
        r.stats.handoffs += 1;
        self.metrics
            .handoff(&self.model_names[to], r.params.policy.name());
        r.arrived = Instant::now();
        if self.mode == ExecutionMode::Standard {
            if let Some(seq) = self.seqs.remove(&rid) {
                let tokens = r.state.tokens[..r.state.seen[self.idx]].to_vec();
                self.prefix_cache.push(CachedPrefix { rid, seq, tokens });
            }
        } else {
            self.pending.insert(rid);
        }
        r
    }
}

impl Actor for ModelActor {
    type Context = Context<Self>;

    fn started(&mut self, _ctx: &mut Context<Self>) {
        self.report_idle();
    }
}

impl Supervised for ModelActor {
    /// A fresh KV store after a crash; requests that were pending here are re-admitted from
    /// their committed tokens when they return.
    fn restarting(&mut self, _ctx: &mut Context<Self>) {
        self.executor.clear_kv();
        self.resident.clear();
        self.seqs.clear();
        self.pending.clear();
        self.prefix_cache.clear();
        self.stats.models[self.idx]
            .restarts
            .fetch_add(1, Ordering::Relaxed);
        self.metrics.restarted();
    }
}

impl Handler<Release> for ModelActor {
    type Result = ();

    fn handle(&mut self, msg: Release, ctx: &mut Context<Self>) {
        for arrival in msg.arrivals {
            self.admit(arrival);
        }
        self.step(ctx);
    }
}

impl Handler<FreeRequest> for ModelActor {
    type Result = ();

    fn handle(&mut self, msg: FreeRequest, _ctx: &mut Context<Self>) {
        self.resident.retain(|r| r.state.rid != msg.rid);
        self.release_seq(msg.rid);
        self.publish_usage();
    }
}

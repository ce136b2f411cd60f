//! `ModelScheduler`: one model's residency decisions. It owns the requests resident here
//! (stepping), pending here (left for another model, KV kept) and, in `standard` mode, the
//! cached prefixes requests left behind; it maps each request to its KV sequence. Its
//! methods change KV only through `KvOps` and return the effects on clients and other
//! models for the actor to carry out, in order.

use super::request::{FailureKind, FinishReason, InFlight, RequestId, RoutingStats};
use crate::config::ExecutionMode;
use crate::engine::{SeqId, SeqWork, StepExecutor, StepOutput};
use crate::error::EngineResult;
use crate::policy::{ModelIdx, Route, SharedPolicy, StepView};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

/// The KV operations the scheduler decides; an executor carries them out on its cache.
pub(crate) trait KvOps {
    /// Positions `seq` holds (0 when unknown).
    fn seq_len(&self, seq: SeqId) -> usize;
    /// Capacity appending `tokens` to `seq` would take.
    fn tokens_needed(&self, seq: SeqId, tokens: usize) -> usize;
    fn free_tokens(&self) -> usize;
    fn capacity_tokens(&self) -> usize;
    /// Allocates `dst` holding a copy of the first `len` positions of `src`.
    fn fork_prefix(&mut self, src: SeqId, dst: SeqId, len: usize) -> EngineResult<()>;
    fn truncate(&mut self, seq: SeqId, len: usize);
    fn free(&mut self, seq: SeqId);
}

impl KvOps for Box<dyn StepExecutor> {
    fn seq_len(&self, seq: SeqId) -> usize {
        StepExecutor::seq_len(self.as_ref(), seq)
    }
    fn tokens_needed(&self, seq: SeqId, tokens: usize) -> usize {
        self.kv().tokens_needed(seq, tokens)
    }
    fn free_tokens(&self) -> usize {
        self.kv().free_tokens()
    }
    fn capacity_tokens(&self) -> usize {
        self.kv().usage().capacity_tokens
    }
    fn fork_prefix(&mut self, src: SeqId, dst: SeqId, len: usize) -> EngineResult<()> {
        StepExecutor::fork_prefix(self.as_mut(), src, dst, len)
    }
    fn truncate(&mut self, seq: SeqId, len: usize) {
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
        policy: SharedPolicy,
    },
    /// The generation is over (its KV here is already freed).
    Finish {
        client: C,
        reason: FinishReason,
        stats: RoutingStats,
        prompt_tokens: usize,
    },
    /// The generation failed (its KV here is already freed).
    Fail {
        client: C,
        message: String,
        kind: FailureKind,
    },
    /// Send the request to model `to`'s batcher (with the step's other handoffs there).
    HandOff { to: ModelIdx, request: InFlight<C> },
}

/// Counts of the scheduler's own decisions, for the runtime's snapshot.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct SchedulerCounters {
    /// KV sequences created (a new request, or every return in `standard` mode).
    pub kv_allocations: u64,
    /// Prefix-cache lookups (`standard` mode returns).
    pub prefix_lookups: u64,
    /// Pending requests whose KV was taken for others (they re-prefill on return).
    pub preemptions: u64,
}

/// A `standard`-mode cache entry: the KV a request left behind, keyed by its tokens.
struct CachedPrefix {
    rid: RequestId,
    seq: SeqId,
    tokens: Vec<u32>,
}

pub(crate) struct ModelScheduler<C> {
    model: ModelIdx,
    /// Every model's count: handoff targets are checked against it.
    models: usize,
    name: String,
    mode: ExecutionMode,
    resident: Vec<InFlight<C>>,
    /// The KV sequence of each request this model holds (resident or pending).
    seqs: HashMap<RequestId, SeqId>,
    pending: HashSet<RequestId>,
    prefix_cache: Vec<CachedPrefix>,
    next_seq: u64,
    counters: SchedulerCounters,
}

impl<C: Clone> ModelScheduler<C> {
    pub fn new(model: ModelIdx, models: usize, name: &str, mode: ExecutionMode) -> Self {
        Self {
            model,
            models,
            name: name.to_string(),
            mode,
            resident: Vec::new(),
            seqs: HashMap::new(),
            pending: HashSet::new(),
            prefix_cache: Vec::new(),
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
        self.seqs.clear();
        self.pending.clear();
        self.prefix_cache.clear();
    }

    fn new_seq(&mut self, rid: RequestId) -> SeqId {
        let seq = SeqId(self.next_seq);
        self.next_seq += 1;
        self.seqs.insert(rid, seq);
        self.counters.kv_allocations += 1;
        seq
    }

    /// Frees everything this model holds for `rid`: its sequence and cached prefixes.
    fn release_seq(&mut self, kv: &mut impl KvOps, rid: RequestId) {
        if let Some(seq) = self.seqs.remove(&rid) {
            kv.free(seq);
        }
        self.pending.remove(&rid);
        self.prefix_cache.retain(|c| {
            if c.rid == rid {
                kv.free(c.seq);
            }
            c.rid != rid
        });
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
        let mut seen = match self.mode {
            ExecutionMode::Standard => self.prefix_lookup(kv, rid, &arrival.state.tokens),
            _ => self.resume(kv, rid, arrival.state.seen[self.model]),
        };
        let committed = arrival.state.tokens.len();
        if seen >= committed {
            // Nothing unseen (its own candidate here was rejected): recompute the last position.
            seen = committed - 1;
            kv.truncate(self.seqs[&rid], seen);
        }
        arrival.state.seen[self.model] = seen;
        self.resident.push(arrival);
    }

    /// `standard`: a return is a new request: longest cached prefix, fresh allocation, copy.
    fn prefix_lookup(&mut self, kv: &mut impl KvOps, rid: RequestId, tokens: &[u32]) -> usize {
        self.counters.prefix_lookups += 1;
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
        let copied = kv.fork_prefix(source, seq, matched).is_ok();
        // The request's own leftover is superseded by the new copy; another request's entry
        // stays cached for its owner.
        if self.prefix_cache[i].rid == rid {
            self.prefix_cache.swap_remove(i);
            kv.free(source);
        }
        if copied {
            matched
        } else {
            0
        }
    }

    /// `async`/`tokenrouter`/`lockstep`: the request's KV is still here; append from `seen`.
    /// Where it is gone (preempted, or the model restarted) it re-prefills from its
    /// committed tokens.
    fn resume(&mut self, kv: &mut impl KvOps, rid: RequestId, seen: usize) -> usize {
        match self.seqs.get(&rid).copied() {
            Some(seq) if kv.seq_len(seq) == seen => seen,
            Some(seq) => {
                kv.free(seq);
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
    fn kv_shortfall(&self, kv: &impl KvOps) -> usize {
        let needed: usize = self
            .resident
            .iter()
            .map(|r| kv.tokens_needed(self.seqs[&r.rid()], r.state.unseen(self.model).len()))
            .sum();
        needed.saturating_sub(kv.free_tokens())
    }

    /// Makes the next step fit the KV budget. Cached prefixes and pending requests give up
    /// their KV first (a pending request re-prefills when it returns: preempted, then
    /// resumed); only if the resident batch alone does not fit do the newest residents fail,
    /// cleanly and retryably, so the others keep going.
    pub fn make_room(&mut self, kv: &mut impl KvOps) -> Vec<Effect<C>> {
        let mut effects = Vec::new();
        if self.kv_shortfall(kv) == 0 {
            return effects;
        }
        for cached in std::mem::take(&mut self.prefix_cache) {
            kv.free(cached.seq);
        }
        let mut pending: Vec<RequestId> = self.pending.iter().copied().collect();
        // In submission order (ids grow), so the choice is deterministic.
        pending.sort_unstable();
        for rid in pending {
            if self.kv_shortfall(kv) == 0 {
                return effects;
            }
            self.release_seq(kv, rid);
            self.counters.preemptions += 1;
        }
        while self.kv_shortfall(kv) > 0 {
            let Some(r) = self.resident.pop() else { break };
            let capacity = kv.capacity_tokens();
            self.release_seq(kv, r.rid());
            effects.push(Effect::Fail {
                client: r.client,
                message: format!(
                    "model `{}`: KV cache full ({capacity} tokens); retry later",
                    self.name
                ),
                kind: FailureKind::Capacity,
            });
        }
        effects
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

    /// The next step's work: every resident request appends the tokens this model has not
    /// seen (a prompt, a catch-up after a handoff, or the last token).
    pub fn schedule(&self) -> Vec<SeqWork> {
        self.resident
            .iter()
            .map(|r| SeqWork {
                seq: self.seqs[&r.rid()],
                tokens: r.state.unseen(self.model).to_vec(),
                sampling: r.params.sampling,
                needs: r.params.policy.needs(),
            })
            .collect()
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

    /// Asks each resident's policy about its step (one `route_batch` per policy, over the
    /// batch). `outputs` are in `schedule` order.
    pub fn decide(&self, outputs: &[StepOutput]) -> Vec<Route> {
        let mut routes = vec![Route::Stay; self.resident.len()];
        let mut groups: Vec<(&SharedPolicy, Vec<usize>)> = Vec::new();
        for (i, r) in self.resident.iter().enumerate() {
            let policy = &r.params.policy;
            match groups.iter_mut().find(|(p, _)| Arc::ptr_eq(p, policy)) {
                Some((_, members)) => members.push(i),
                None => groups.push((policy, vec![i])),
            }
        }
        for (policy, members) in groups {
            let states: Vec<_> = members.iter().map(|&i| &self.resident[i].state).collect();
            let views: Vec<StepView> = members
                .iter()
                .map(|&i| StepView {
                    model: self.model,
                    candidate: outputs[i].candidate,
                    stats: &outputs[i].stats,
                    logits: &outputs[i].logits,
                    hidden: outputs[i].hidden.as_deref(),
                    embedding: outputs[i].candidate_embedding.as_deref(),
                })
                .collect();
            for (&i, route) in members.iter().zip(policy.route_batch(&states, &views)) {
                routes[i] = route;
            }
        }
        routes
    }

    /// Applies a finished step: commits, finishes and hands off per `routes` (in `schedule`
    /// order). Leaving requests stay pending here with their KV (or, in `standard` mode,
    /// leave it as a cached prefix). Returns the effects and, per resident, the model that
    /// steps it next and whether its candidate was committed (the routing counts).
    pub fn update_from_output(
        &mut self,
        kv: &mut impl KvOps,
        candidates: &[u32],
        routes: &[Route],
        now: Instant,
    ) -> (Vec<Effect<C>>, Vec<(ModelIdx, bool)>) {
        let mut effects = Vec::new();
        let mut transitions = Vec::new();
        let residents = std::mem::take(&mut self.resident);
        for ((mut r, &candidate), &route) in residents.into_iter().zip(candidates).zip(routes) {
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
            let commits = !matches!(route, Route::RejectAndSwitch(_));
            if commits {
                if let Some(finish) = self.commit(&mut r, candidate, &mut effects) {
                    self.release_seq(kv, r.rid());
                    effects.push(finish);
                    continue;
                }
            }
            transitions.push((leave_to.unwrap_or(self.model), commits));
            match leave_to {
                None => self.resident.push(r),
                Some(to) => {
                    let request = self.hand_off(r, to, now);
                    effects.push(Effect::HandOff { to, request });
                }
            }
        }
        (effects, transitions)
    }

    /// Commits a token and streams it; returns the finish effect when the generation is over.
    fn commit(
        &self,
        r: &mut InFlight<C>,
        token: u32,
        effects: &mut Vec<Effect<C>>,
    ) -> Option<Effect<C>> {
        let reason = if r.params.eos.contains(&token) {
            Some(FinishReason::Stop)
        } else {
            r.state.tokens.push(token);
            r.stats.tokens_per_model[self.model] += 1;
            effects.push(Effect::Commit {
                client: r.client.clone(),
                token,
                policy: r.params.policy.clone(),
            });
            (r.state.generated().len() >= r.params.max_tokens).then_some(FinishReason::Length)
        };
        reason.map(|reason| Effect::Finish {
            client: r.client.clone(),
            reason,
            stats: r.stats.clone(),
            prompt_tokens: r.state.prompt_len,
        })
    }

    /// Packs a leaving request for `to` and marks it pending here (or caches its prefix in
    /// `standard` mode).
    fn hand_off(&mut self, mut r: InFlight<C>, to: ModelIdx, now: Instant) -> InFlight<C> {
        let rid = r.rid();
        r.handoff = Some(r.params.policy.send(&r.state, to));
        r.stats.handoffs += 1;
        r.arrived = now;
        if self.mode == ExecutionMode::Standard {
            if let Some(seq) = self.seqs.remove(&rid) {
                let tokens = r.state.tokens[..r.state.seen[self.model]].to_vec();
                self.prefix_cache.push(CachedPrefix { rid, seq, tokens });
            }
        } else {
            self.pending.insert(rid);
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::kv::BLOCK_TOKENS;
    use crate::engine::{LogitStats, SamplingParams};
    use crate::policy::single::Single;
    use crate::policy::{RoutingState, SharedPolicy};
    use crate::runtime::core::RequestParams;
    use std::collections::BTreeSet;

    const EOS: u32 = 0;

    /// The KV accounting of an executor, without tensors: block-granular like the engine's.
    struct FakeKv {
        capacity_blocks: usize,
        seqs: HashMap<SeqId, (usize, usize)>,
    }

    impl FakeKv {
        fn new(capacity_tokens: usize) -> Self {
            Self {
                capacity_blocks: capacity_tokens / BLOCK_TOKENS,
                seqs: HashMap::new(),
            }
        }

        fn used_blocks(&self) -> usize {
            self.seqs.values().map(|&(_, blocks)| blocks).sum()
        }

        /// A step: every sequence appends its work's tokens.
        fn step(&mut self, work: &[SeqWork]) {
            for w in work {
                let needed = self.tokens_needed(w.seq, w.tokens.len()) / BLOCK_TOKENS;
                let entry = self.seqs.entry(w.seq).or_insert((0, 0));
                entry.0 += w.tokens.len();
                entry.1 += needed;
            }
            assert!(
                self.used_blocks() <= self.capacity_blocks,
                "step over budget"
            );
        }
    }

    impl KvOps for FakeKv {
        fn seq_len(&self, seq: SeqId) -> usize {
            self.seqs.get(&seq).map_or(0, |s| s.0)
        }
        fn tokens_needed(&self, seq: SeqId, tokens: usize) -> usize {
            let (len, blocks) = self.seqs.get(&seq).copied().unwrap_or((0, 0));
            (len + tokens).div_ceil(BLOCK_TOKENS).saturating_sub(blocks) * BLOCK_TOKENS
        }
        fn free_tokens(&self) -> usize {
            (self.capacity_blocks - self.used_blocks()) * BLOCK_TOKENS
        }
        fn capacity_tokens(&self) -> usize {
            self.capacity_blocks * BLOCK_TOKENS
        }
        fn fork_prefix(&mut self, src: SeqId, dst: SeqId, len: usize) -> EngineResult<()> {
            assert!(len <= self.seq_len(src) && !self.seqs.contains_key(&dst));
            self.seqs.insert(dst, (len, len.div_ceil(BLOCK_TOKENS)));
            Ok(())
        }
        fn truncate(&mut self, seq: SeqId, len: usize) {
            if let Some(s) = self.seqs.get_mut(&seq) {
                s.0 = s.0.min(len);
            }
        }
        fn free(&mut self, seq: SeqId) {
            self.seqs.remove(&seq);
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
            },
            stats: RoutingStats {
                tokens_per_model: vec![0; 2],
                handoffs: 0,
            },
            client: rid,
            handoff: None,
            arrived: Instant::now(),
        }
    }

    fn scheduler(mode: ExecutionMode) -> ModelScheduler<u64> {
        ModelScheduler::new(0, 2, "m0", mode)
    }

    /// Steps the scheduler on the fake KV with `routes` and the same `candidate` for every
    /// resident; returns the step's work and the effects.
    fn step(
        s: &mut ModelScheduler<u64>,
        kv: &mut FakeKv,
        candidate: u32,
        routes: &[Route],
    ) -> (Vec<SeqWork>, Vec<Effect<u64>>) {
        let work = s.schedule();
        kv.step(&work);
        let candidates = vec![candidate; work.len()];
        let (effects, _) = s.update_from_output(kv, &candidates, routes, Instant::now());
        (work, effects)
    }

    fn handed_off(effects: Vec<Effect<u64>>) -> InFlight<u64> {
        effects
            .into_iter()
            .find_map(|e| match e {
                Effect::HandOff { request, .. } => Some(request),
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

    #[test]
    fn a_returning_request_appends_only_the_tokens_it_has_not_seen() {
        let mut kv = FakeKv::new(1024);
        let mut s = scheduler(ExecutionMode::Tokenrouter);
        s.admit(&mut kv, request(1, &[5, 6, 7], 16), true);
        let (work, effects) = step(&mut s, &mut kv, 8, &[Route::CommitThenSwitch(1)]);
        assert_eq!(work[0].tokens, vec![5, 6, 7], "the prompt, once");
        assert_eq!((s.resident(), s.pending()), (0, 1), "pending, KV kept");
        assert_eq!(kv.seq_len(work[0].seq), 3);
        let back = elsewhere(handed_off(effects), &[9, 10]);
        s.admit(&mut kv, back, true);
        let work_back = s.schedule();
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
        let mut kv = FakeKv::new(1024);
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
        assert_eq!(s.schedule()[0].tokens, vec![7]);
        assert_eq!(
            kv.seq_len(work[0].seq),
            2,
            "truncated before the last position"
        );
    }

    #[test]
    fn a_sequence_lost_meanwhile_re_prefills_from_the_committed_tokens() {
        let mut kv = FakeKv::new(1024);
        let mut s = scheduler(ExecutionMode::Tokenrouter);
        s.admit(&mut kv, request(1, &[5, 6, 7], 16), true);
        let (work, effects) = step(&mut s, &mut kv, 8, &[Route::CommitThenSwitch(1)]);
        kv.free(work[0].seq);
        s.admit(&mut kv, elsewhere(handed_off(effects), &[9]), true);
        assert_eq!(s.schedule()[0].tokens, vec![5, 6, 7, 8, 9]);
        assert_eq!(s.counters().kv_allocations, 2);
    }

    #[test]
    fn standard_mode_copies_the_longest_cached_prefix() {
        let mut kv = FakeKv::new(1024);
        let mut s = scheduler(ExecutionMode::Standard);
        s.admit(&mut kv, request(1, &[5, 6, 7, 8], 16), true);
        let (first, effects) = step(&mut s, &mut kv, 9, &[Route::CommitThenSwitch(1)]);
        assert_eq!(s.pending(), 0, "standard mode keeps no pending requests");
        assert_eq!(
            kv.seq_len(first[0].seq),
            4,
            "left behind as a cached prefix"
        );
        // Another request sharing three prompt tokens is matched against that cache.
        s.admit(&mut kv, request(2, &[5, 6, 7, 1, 2], 16), true);
        let work = s.schedule();
        assert_eq!(work[0].tokens, vec![1, 2]);
        assert_eq!(kv.seq_len(work[0].seq), 3, "a copy of the shared prefix");
        // The first request returns: a fresh allocation with its own prefix copied, and its
        // cache entry is gone (superseded).
        s.admit(&mut kv, elsewhere(handed_off(effects), &[10]), true);
        let work = s.schedule();
        assert_eq!(work[1].tokens, vec![9, 10]);
        assert_ne!(work[1].seq, first[0].seq);
        assert!(
            !kv.seqs.contains_key(&first[0].seq),
            "the old entry was freed"
        );
        let counters = s.counters();
        assert_eq!((counters.kv_allocations, counters.prefix_lookups), (3, 3));
    }

    #[test]
    fn under_kv_pressure_caches_go_first_then_pending_then_the_newest_residents() {
        // 8 blocks of 16 tokens.
        let mut kv = FakeKv::new(8 * BLOCK_TOKENS);
        let mut s = scheduler(ExecutionMode::Tokenrouter);
        // Requests 1 and 2 take a block each and leave: pending here.
        for rid in [1, 2] {
            s.admit(&mut kv, request(rid, &[1; 10], 64), true);
        }
        step(&mut s, &mut kv, 3, &[Route::CommitThenSwitch(1); 2]);
        assert_eq!((s.pending(), kv.used_blocks()), (2, 2));
        // Residents 3..=5 need 2 + 2 + 3 blocks, one more than is free: one pending
        // request must go.
        for (rid, prompt) in [(3, 20), (4, 20), (5, 40)] {
            s.admit(&mut kv, request(rid, &vec![1; prompt], 64), true);
        }
        assert!(fails(&s.make_room(&mut kv)).is_empty());
        assert_eq!(s.counters().preemptions, 1);
        assert_eq!(s.pending(), 1);
        assert!(
            !s.pending.contains(&RequestId(1)),
            "the older pending request went first"
        );
        // Two more residents of three blocks each: the other pending request goes, then the
        // newest residents fail, retryably, until the rest fit.
        for rid in [6, 7] {
            s.admit(&mut kv, request(rid, &[1; 40], 64), true);
        }
        let effects = s.make_room(&mut kv);
        assert_eq!(s.counters().preemptions, 2);
        assert_eq!(
            fails(&effects),
            vec![(7, FailureKind::Capacity), (6, FailureKind::Capacity)]
        );
        assert_eq!(s.resident(), 3);
        kv.step(&s.schedule());
    }

    #[test]
    fn standard_mode_drops_its_cached_prefixes_before_failing_anyone() {
        let mut kv = FakeKv::new(4 * BLOCK_TOKENS);
        let mut s = scheduler(ExecutionMode::Standard);
        s.admit(&mut kv, request(1, &[1; 10], 64), true);
        step(&mut s, &mut kv, 3, &[Route::CommitThenSwitch(1)]);
        assert_eq!(kv.used_blocks(), 1, "a cached prefix");
        s.admit(&mut kv, request(2, &[2; 60], 64), true);
        assert!(fails(&s.make_room(&mut kv)).is_empty());
        assert_eq!(kv.used_blocks(), 0);
        assert_eq!(s.counters().preemptions, 0);
    }

    #[test]
    fn cancelling_frees_everything_the_model_holds() {
        let mut kv = FakeKv::new(1024);
        for mode in [ExecutionMode::Tokenrouter, ExecutionMode::Standard] {
            let mut s = scheduler(mode);
            s.admit(&mut kv, request(1, &[5, 6, 7], 16), true);
            s.admit(&mut kv, request(2, &[5, 6, 8], 16), true);
            step(
                &mut s,
                &mut kv,
                9,
                &[Route::CommitThenSwitch(1), Route::Stay],
            );
            kv.step(&s.schedule());
            assert!(kv.used_blocks() > 0);
            s.free_request(&mut kv, RequestId(1));
            s.free_request(&mut kv, RequestId(2));
            assert_eq!((s.resident(), s.pending()), (0, 0), "{mode:?}");
            assert!(kv.seqs.is_empty(), "{mode:?}: KV left behind");
            assert!(s.seqs.is_empty() && s.prefix_cache.is_empty(), "{mode:?}");
        }
    }

    #[test]
    fn arrivals_and_residents_of_ended_requests_are_dropped() {
        let mut kv = FakeKv::new(1024);
        let mut s = scheduler(ExecutionMode::Async);
        s.admit(&mut kv, request(1, &[5], 16), false);
        assert_eq!(s.resident(), 0);
        s.admit(&mut kv, request(2, &[5], 16), true);
        s.admit(&mut kv, request(3, &[5], 16), true);
        kv.step(&s.schedule());
        s.drop_ended(&mut kv, |rid| rid != RequestId(2));
        assert_eq!(s.resident(), 1);
        assert_eq!(kv.seqs.len(), 1);
    }

    #[test]
    fn commits_stream_and_the_end_frees_the_kv() {
        let mut kv = FakeKv::new(1024);
        let mut s = scheduler(ExecutionMode::Async);
        s.admit(&mut kv, request(1, &[5], 2), true);
        s.admit(&mut kv, request(2, &[5], 8), true);
        let (_, effects) = step(&mut s, &mut kv, 7, &[Route::Stay, Route::Stay]);
        assert!(matches!(
            effects[..],
            [Effect::Commit { token: 7, .. }, Effect::Commit { .. }]
        ));
        let (_, effects) = step(&mut s, &mut kv, 7, &[Route::Stay, Route::Stay]);
        match &effects[..] {
            [Effect::Commit { client: 1, .. }, Effect::Finish {
                client: 1,
                reason: FinishReason::Length,
                stats,
                prompt_tokens: 1,
            }, Effect::Commit { client: 2, .. }] => assert_eq!(stats.tokens_per_model, [2, 0]),
            _ => panic!("max_tokens = 2 ends request 1 after its second token"),
        }
        let (_, effects) = step(&mut s, &mut kv, EOS, &[Route::Stay]);
        assert!(matches!(
            effects[..],
            [Effect::Finish {
                client: 2,
                reason: FinishReason::Stop,
                ..
            }]
        ));
        assert_eq!((s.resident(), kv.seqs.len()), (0, 0));
    }

    #[test]
    fn a_route_to_an_unknown_model_fails_the_request() {
        let mut kv = FakeKv::new(1024);
        let mut s = scheduler(ExecutionMode::Async);
        s.admit(&mut kv, request(1, &[5], 8), true);
        s.admit(&mut kv, request(2, &[5], 8), true);
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
        assert!(kv.seqs.is_empty());
    }

    #[test]
    fn each_policy_routes_its_own_requests_as_one_batch() {
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
        let mut kv = FakeKv::new(1024);
        let mut s = scheduler(ExecutionMode::Async);
        let two: SharedPolicy = Arc::new(BatchSize(2, [0, 1]));
        let one: SharedPolicy = Arc::new(BatchSize(1, [0, 1]));
        for (rid, policy) in [(1, &two), (2, &one), (3, &two)] {
            let mut r = request(rid, &[5], 8);
            r.params.policy = policy.clone();
            s.admit(&mut kv, r, true);
        }
        let outputs: Vec<StepOutput> = s
            .schedule()
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
        assert_eq!(s.decide(&outputs), vec![Route::CommitThenSwitch(1); 3]);
    }
}

//! The wait bound under adversarial mixes: two models' schedulers driven step by step with a
//! manual clock, requests handed between them as the actors would, and every resident's
//! wait since it became ready counted from the plans alone (not from the scheduler's own
//! bookkeeping). With the bound switched off the same mixes starve some row, so each test
//! also shows that it can fail.

use super::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;

/// How requests of a mix behave.
#[derive(Clone, Copy)]
enum Kind {
    /// Stays on model 0 until it finishes.
    Stays,
    /// Hands off to the other model after every token.
    Bounces,
    /// Hands off with probability 1/4 after each token (R2R-like).
    Routed,
}

struct Arrival {
    step: usize,
    prompt: usize,
    max_tokens: usize,
    kind: Kind,
}

/// Two models, their block managers and the requests in flight between them.
struct Pair {
    models: [ModelScheduler<u64>; 2],
    kvs: [KvStore; 2],
    kinds: HashMap<u64, Kind>,
    /// Per model, per resident request: steps of that model since it became ready there.
    waits: [BTreeMap<u64, usize>; 2],
    longest_wait: usize,
    /// Handoffs on their way to a model, admitted before its next step.
    in_transit: [Vec<InFlight<u64>>; 2],
    finished: usize,
    rng: StdRng,
}

impl Pair {
    fn new(limits: StepLimits, seed: u64) -> Self {
        let model = |m| ModelScheduler::new(m, 2, "m", ExecutionMode::Tokenrouter, limits);
        Self {
            models: [model(0), model(1)],
            kvs: [KvStore::new(1 << 20), KvStore::new(1 << 20)],
            kinds: HashMap::new(),
            waits: [BTreeMap::new(), BTreeMap::new()],
            longest_wait: 0,
            in_transit: [Vec::new(), Vec::new()],
            finished: 0,
            rng: StdRng::seed_from_u64(seed),
        }
    }

    fn admit(&mut self, m: usize, r: InFlight<u64>) {
        self.waits[m].insert(r.client, 0);
        self.models[m].admit(&mut self.kvs[m], r, true);
    }

    /// One step of model `m`: plan, run on its KV, route, apply; then count the waits.
    fn step(&mut self, m: usize, now: Instant) {
        for r in std::mem::take(&mut self.in_transit[m]) {
            self.admit(m, r);
        }
        let (plan, failed) = self.models[m].schedule(&mut self.kvs[m]);
        assert!(fails(&failed).is_empty());
        run_on_kv(&mut self.kvs[m], &plan.work);
        let ran: HashSet<u64> = plan
            .rows
            .iter()
            .map(|row| self.models[m].resident[row.resident].client)
            .collect();
        let routes: Vec<Option<Route>> = plan
            .rows
            .iter()
            .map(|row| {
                let rid = self.models[m].resident[row.resident].client;
                let other = 1 - m;
                row.completes.then(|| match self.kinds[&rid] {
                    Kind::Stays => Route::Stay,
                    Kind::Bounces => Route::CommitThenSwitch(other),
                    Kind::Routed if self.rng.gen_bool(0.25) => Route::CommitThenSwitch(other),
                    Kind::Routed => Route::Stay,
                })
            })
            .collect();
        let candidates = vec![Sampled::from(7); plan.work.len()];
        let (effects, _) =
            self.models[m].update_from_output(&mut self.kvs[m], &plan, candidates, &routes, now);
        for (rid, waited) in self.waits[m].iter_mut() {
            *waited = if ran.contains(rid) { 0 } else { *waited + 1 };
            self.longest_wait = self.longest_wait.max(*waited);
        }
        for effect in effects {
            match effect {
                Effect::HandOff { to, request } => {
                    self.waits[m].remove(&request.client);
                    self.in_transit[to].push(*request);
                }
                Effect::Finish { client, .. } => {
                    self.waits[m].remove(&client);
                    let other = 1 - m;
                    self.models[other].free_request(&mut self.kvs[other], RequestId(client));
                    self.finished += 1;
                }
                Effect::Fail { client, .. } => panic!("request {client} failed"),
                Effect::Commit { .. } => {}
            }
        }
    }

    /// Runs `arrivals` (all entering at model 0) for `steps` rounds of both models; returns
    /// the longest wait any resident saw, in steps of the model it waited on.
    fn run(mut self, arrivals: &[Arrival], steps: usize) -> usize {
        let start = Instant::now();
        let mut next = 0;
        for round in 0..steps {
            while next < arrivals.len() && arrivals[next].step == round {
                let a = &arrivals[next];
                let rid = next as u64 + 1;
                let prompt = tokens(1000 * rid as u32 % 40_000 + 1, a.prompt);
                self.kinds.insert(rid, a.kind);
                self.admit(0, request(rid, &prompt, a.max_tokens));
                next += 1;
            }
            let now = start + Duration::from_millis(10 * round as u64);
            self.step(0, now);
            self.step(1, now);
        }
        assert!(self.finished > 0, "the mix made progress");
        self.longest_wait
    }
}

/// A step budget of 24 tokens priced by context as the shipped model's profile prices it,
/// with the bound at `max_wait_steps`.
fn limits(max_wait_steps: usize) -> StepLimits {
    StepLimits {
        budget: Some(24.0),
        context_cost: 0.4 / 1500.0,
        max_wait_steps,
    }
}

const K: usize = 4;

/// The longest wait with the bound on and with it off (`usize::MAX`).
fn waits_with_and_without_the_bound(arrivals: &[Arrival], steps: usize) -> (usize, usize) {
    (
        Pair::new(limits(K), 1).run(arrivals, steps),
        Pair::new(limits(usize::MAX), 1).run(arrivals, steps),
    )
}

#[test]
fn many_long_prompts_under_a_stream_of_short_ones_wait_at_most_k_steps() {
    // Four long prompts, and three short requests arriving every step: the short work alone
    // takes the whole budget, so shortest-first would never reach the long prompts.
    let mut arrivals = Vec::new();
    for step in 0..120 {
        if step % 10 == 0 && step < 40 {
            arrivals.push(Arrival {
                step,
                prompt: 600 + 300 * (step / 10),
                max_tokens: 4,
                kind: Kind::Stays,
            });
        }
        for _ in 0..3 {
            arrivals.push(Arrival {
                step,
                prompt: 8,
                max_tokens: 1,
                kind: Kind::Stays,
            });
        }
    }
    let (bounded, unbounded) = waits_with_and_without_the_bound(&arrivals, 150);
    assert!(bounded < K, "a row waited {bounded} steps (bound {K})");
    assert!(
        unbounded >= 10 * K,
        "without the bound the long prompts starve ({unbounded} steps), or the mix is too tame"
    );
}

#[test]
fn many_handoffs_and_requests_bouncing_every_token_wait_at_most_k_steps() {
    let mut rng = StdRng::seed_from_u64(7);
    let mut arrivals = Vec::new();
    for step in 0..80 {
        // A long prompt now and then, and routed and bouncing requests whose catch-ups
        // (some longer than a block) come back all the time.
        if step % 20 == 5 {
            arrivals.push(Arrival {
                step,
                prompt: 1500,
                max_tokens: 8,
                kind: Kind::Routed,
            });
        }
        if step % 2 == 0 {
            let kind = if rng.gen_bool(0.5) {
                Kind::Bounces
            } else {
                Kind::Routed
            };
            arrivals.push(Arrival {
                step,
                prompt: rng.gen_range(4..40),
                max_tokens: rng.gen_range(8..48),
                kind,
            });
        }
    }
    let (bounded, unbounded) = waits_with_and_without_the_bound(&arrivals, 200);
    assert!(bounded < K, "a row waited {bounded} steps (bound {K})");
    assert!(unbounded >= 2 * K, "without the bound: {unbounded} steps");
}

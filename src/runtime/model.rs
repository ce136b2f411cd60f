//! `ModelActor`: one model's executor and private KV cache, on its own arbiter thread under
//! an actix `Supervisor`. It carries out its `ModelScheduler`'s decisions (see
//! `core::scheduler`): admit, make room, step, route, and send the effects on their way. A
//! request that leaves stays **pending** here (KV kept) and resumes with a token append.

use super::batcher::BatcherActor;
use super::core::{Effect, ModelScheduler, Sampled, StepLimits, StepPlan, TokenLogprobs};
use super::link::{Client, ModelLink};
use super::live::LiveRequests;
use super::messages::{Committed, Failed, Finished, FreeRequest, ModelIdle, Release, Request};
use super::record::{ModelRecorder, StepInterval};
use super::step_lock::StepLock;
use crate::config::ExecutionMode;
use crate::engine::{StepExecutor, StepOutput};
use crate::policy::ModelIdx;
use actix::prelude::*;
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Instant;

pub(crate) struct ModelActor {
    idx: ModelIdx,
    name: String,
    executor: Box<dyn StepExecutor>,
    scheduler: ModelScheduler<Client>,
    batcher: Addr<BatcherActor>,
    /// Every model, by index (handoff targets).
    peers: Vec<ModelLink>,
    live: LiveRequests,
    recorder: ModelRecorder,
    /// `lockstep`: one step at a time across all models.
    global_step_lock: Option<StepLock>,
    fault_every_steps: u64,
    steps_run: u64,
    /// Every model's name, by index (handoff metric labels).
    model_names: Arc<[String]>,
}

/// Everything a model actor is built from (kept apart so the supervisor can restart it).
pub(crate) struct ModelActorParts {
    pub idx: ModelIdx,
    pub executor: Box<dyn StepExecutor>,
    pub mode: ExecutionMode,
    pub batcher: Addr<BatcherActor>,
    pub peers: Vec<ModelLink>,
    pub live: LiveRequests,
    pub recorder: ModelRecorder,
    pub global_step_lock: Option<StepLock>,
    pub fault_every_steps: u64,
    pub model_names: Arc<[String]>,
    pub step_limits: StepLimits,
}

impl ModelActor {
    pub fn new(parts: ModelActorParts) -> Self {
        let name = parts.executor.name().to_string();
        Self {
            idx: parts.idx,
            scheduler: ModelScheduler::new(
                parts.idx,
                parts.peers.len(),
                &name,
                parts.mode,
                parts.step_limits,
            ),
            name,
            model_names: parts.model_names,
            batcher: parts.batcher,
            executor: parts.executor,
            peers: parts.peers,
            live: parts.live,
            recorder: parts.recorder,
            global_step_lock: parts.global_step_lock,
            fault_every_steps: parts.fault_every_steps,
            steps_run: 0,
        }
    }

    /// Publishes this model's KV usage and scheduler state.
    fn publish_usage(&self) {
        self.recorder.usage(
            self.executor.kv_usage(),
            self.executor.kv().prefix_counters(),
            self.scheduler.pending(),
            self.scheduler.counters(),
        );
    }

    fn report_idle(&self) {
        self.publish_usage();
        self.batcher.do_send(ModelIdle {
            resident_ready: self.scheduler.resident(),
        });
    }

    /// Sends the scheduler's effects on their way; a step's handoffs to one model travel
    /// together.
    fn carry_out(&self, effects: Vec<Effect<Client>>) {
        let mut leaving: BTreeMap<ModelIdx, Vec<Request>> = BTreeMap::new();
        for effect in effects {
            match effect {
                Effect::Commit {
                    client,
                    token,
                    index,
                    logprobs,
                    policy,
                } => {
                    self.recorder.committed(policy.name());
                    client.committed(Committed {
                        token,
                        index,
                        model: self.idx,
                        logprobs,
                    });
                }
                Effect::Finish {
                    client,
                    reason,
                    stats,
                    timing,
                    prompt_tokens,
                    completion_tokens,
                } => client.finished(Finished {
                    reason,
                    stats,
                    timing,
                    prompt_tokens,
                    completion_tokens,
                }),
                Effect::Fail {
                    client,
                    message,
                    kind,
                } => {
                    tracing::debug!(model = %self.name, %message, "request failed");
                    client.failed(Failed { message, kind });
                }
                Effect::HandOff { to, request } => {
                    self.recorder
                        .handoff(&self.model_names[to], request.params.policy.name());
                    leaving.entry(to).or_default().push(*request);
                }
            }
        }
        for (to, arrivals) in leaving {
            self.peers[to].admit(arrivals);
        }
    }

    fn step(&mut self, ctx: &mut Context<Self>) {
        let entered = Instant::now();
        let live = &self.live;
        self.scheduler
            .drop_ended(&mut self.executor, |rid| live.contains(rid));
        let (plan, failed) = self.scheduler.schedule(&mut self.executor);
        self.carry_out(failed);
        if plan.is_empty() {
            self.report_idle();
            return;
        }
        let tokens = plan.tokens();
        let span =
            tracing::debug_span!("step", model = %self.name, batch = plan.work.len(), tokens);
        let _entered = span.enter();
        self.steps_run += 1;
        let inject_fault =
            self.fault_every_steps > 0 && self.steps_run.is_multiple_of(self.fault_every_steps);
        let lock = self.global_step_lock.clone();
        let guard = lock.as_ref().map(StepLock::acquire);
        let start = Instant::now();
        let executor = &mut self.executor;
        let result = catch_unwind(AssertUnwindSafe(|| {
            if inject_fault {
                panic!("injected fault");
            }
            executor.step(&plan.work)
        }));
        let end = Instant::now();
        drop(guard);
        tracing::trace!(
            wait_ms = (start - entered).as_secs_f64() * 1e3,
            run_ms = (end - start).as_secs_f64() * 1e3,
            rows = ?plan.work.iter().map(|w| (w.seq.0, w.tokens.len())).collect::<Vec<_>>(),
            "stepped: (sequence, tokens) per row"
        );
        match result {
            Err(panic) => {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "panic".into());
                tracing::error!(model = %self.name, "crashed during a step ({what}); restarting");
                let message = format!(
                    "model `{}` crashed during a step ({what}); it restarts",
                    self.name
                );
                let failed = self.scheduler.fail_resident(&mut self.executor, &message);
                self.carry_out(failed);
                ctx.stop();
            }
            Ok(Err(e)) => {
                tracing::warn!(model = %self.name, "step failed: {e}");
                let message = format!("model `{}`: {e}", self.name);
                let failed = self.scheduler.fail_resident(&mut self.executor, &message);
                self.carry_out(failed);
                self.report_idle();
            }
            Ok(Ok(outputs)) => {
                self.apply(&plan, &outputs);
                self.recorder.step(StepInterval {
                    start,
                    end,
                    batch: plan.work.len(),
                    tokens,
                    host: Some((start - entered) + end.elapsed()),
                });
                self.report_idle();
            }
        }
    }

    /// Routes each resident's step through its policy and applies the answers.
    fn apply(&mut self, plan: &StepPlan, outputs: &[StepOutput]) {
        let routes = self.scheduler.decide(plan, outputs);
        let candidates = outputs
            .iter()
            .zip(&plan.logprobs)
            .map(|(output, &top)| Sampled {
                token: output.candidate,
                logprobs: top.map(|top| TokenLogprobs::of(output, top)),
            })
            .collect();
        let (effects, transitions) = self.scheduler.update_from_output(
            &mut self.executor,
            plan,
            candidates,
            &routes,
            Instant::now(),
        );
        for (to, committed) in transitions {
            self.recorder.routed(to, committed);
        }
        self.carry_out(effects);
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
        self.scheduler.reset();
        self.recorder.restarted();
    }
}

impl Handler<Release> for ModelActor {
    type Result = ();

    fn handle(&mut self, msg: Release, ctx: &mut Context<Self>) {
        for arrival in msg.arrivals {
            let live = self.live.contains(arrival.rid());
            self.scheduler.admit(&mut self.executor, arrival, live);
        }
        self.step(ctx);
    }
}

impl Handler<FreeRequest> for ModelActor {
    type Result = ();

    fn handle(&mut self, msg: FreeRequest, _ctx: &mut Context<Self>) {
        self.scheduler.free_request(&mut self.executor, msg.rid);
        self.publish_usage();
    }
}

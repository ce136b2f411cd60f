//! The bus's ends of the local actors' ports: a model hosted by other processes
//! (`RemoteModel`, a `ModelPort`), a request whose client lives in another process
//! (`RemoteClient`, a `ClientPort`), this process's own requests as the bus tracks them
//! (`FrontendRequests`), and the handlers that turn the bus's messages back into actor
//! messages on the receiving side (`BusSide`). Wire types convert to and from the actors'
//! messages here and nowhere else.

use super::cluster::{Bus, ClusterError};
use super::wire::{
    self, ClientEvent, FrontendBeat, RecordDigest, WireAdmit, WireEvent, WireRequest,
    WireThreshold, WireWithdraw,
};
use crate::config::{Config, PolicyConfig};
use crate::policy::registry::PolicyRegistry;
use crate::policy::{ModelIdx, SharedPolicy};
use crate::runtime::batcher::BatcherActor;
use crate::runtime::core::{FailureKind, InFlight, RequestId, RequestParams};
use crate::runtime::link::{Client, ClientPort, ModelPort, OwnRequests};
use crate::runtime::live::LiveRequests;
use crate::runtime::messages::{
    Admit, Committed, Failed, Finished, Placed, Recount, Request, SetThreshold, Withdraw,
};
use crate::runtime::record::ModelRecorder;
use crate::runtime::request::{RequestActor, RequestEvent};
use actix::prelude::*;
use arc_swap::ArcSwap;
use dashmap::DashMap;
use std::collections::{BTreeMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A model hosted by other processes (one or more replicas).
#[derive(Clone)]
pub(crate) struct RemoteModel {
    pub bus: Bus,
    pub idx: ModelIdx,
    pub name: Arc<str>,
}

impl RemoteModel {
    fn subject(&self, what: &str) -> String {
        self.bus.model_subject(&self.name, what)
    }

    /// Sends each arrival to the replica holding its KV, or places a new one on the least
    /// loaded replica (telling its front end where); fails it at once, retryably, when that
    /// replica or every replica is down.
    fn admit_to_replicas(&self, arrivals: Vec<Request>) {
        let mut by_host: BTreeMap<Arc<str>, Vec<WireRequest>> = BTreeMap::new();
        for mut request in arrivals {
            let host = match request.hosts[self.idx].clone() {
                Some(host) if self.bus.replica_is_up(&self.name, &host) => Some(host),
                Some(_) => None,
                None => self.bus.pick_replica(&self.name).map(|host| {
                    let host: Arc<str> = host.into();
                    request.hosts[self.idx] = Some(host.clone());
                    request.client.placed(self.idx, &host);
                    host
                }),
            };
            match host {
                Some(host) => by_host
                    .entry(host)
                    .or_default()
                    .push(to_wire(request, self.bus.id())),
                None => request.client.failed(Failed {
                    message: format!(
                        "model `{}` is unavailable: no worker hosting it (or holding this \
                         request) is answering on the bus",
                        self.name
                    ),
                    kind: FailureKind::Unavailable,
                }),
            }
        }
        let limit = self.bus.max_payload();
        for (host, requests) in by_host {
            let subject = self.bus.replica_subject(&self.name, &host, "admit");
            let together = WireAdmit {
                requests,
                sent_unix_us: wire::unix_us(),
            };
            let payload = wire::encode(&together);
            if payload.len() <= limit {
                self.bus.publish(subject, payload);
                continue;
            }
            // Too big together: one message each, and a request too big alone fails.
            for request in together.requests {
                let alone = WireAdmit {
                    requests: vec![request],
                    sent_unix_us: together.sent_unix_us,
                };
                let payload = wire::encode(&alone);
                if payload.len() <= limit {
                    self.bus.publish(subject.clone(), payload);
                    continue;
                }
                let request = &alone.requests[0];
                self.fail_oversized(request.state.rid, &request.frontend, payload.len(), limit);
            }
        }
    }

    /// A request whose state exceeds the server's `max_payload` cannot travel: it fails,
    /// told to its front end `frontend` (this process or another) over the bus.
    fn fail_oversized(&self, rid: RequestId, frontend: &str, bytes: usize, limit: usize) {
        let message = format!(
            "request {rid} is {bytes} bytes on the bus, over the NATS server's max_payload of \
             {limit}; raise max_payload in its config"
        );
        let event = ClientEvent {
            rid,
            event: WireEvent::Request(RequestEvent::Failed {
                message,
                kind: FailureKind::Fault,
            }),
        };
        self.bus
            .publish(self.bus.client_subject(frontend), wire::encode(&event));
    }
}

impl ModelPort for RemoteModel {
    fn admit(&self, arrivals: Vec<Request>) {
        self.admit_to_replicas(arrivals);
    }

    fn withdraw(&self, rid: RequestId) {
        self.bus.publish(
            self.subject("withdraw"),
            wire::encode(&WireWithdraw { rid }),
        );
    }

    fn set_threshold(&self, threshold: usize) {
        self.bus.publish(
            self.subject("threshold"),
            wire::encode(&WireThreshold { threshold }),
        );
    }
}

fn to_wire(request: Request, this_process: &str) -> WireRequest {
    let frontend = match &request.client {
        Client::Local(_) => this_process.to_string(),
        Client::Remote(port) => port.owner().to_string(),
    };
    WireRequest {
        state: request.state,
        max_tokens: request.params.max_tokens,
        sampling: request.params.sampling,
        eos: request.params.eos.iter().copied().collect(),
        policy: request.params.policy.name().to_string(),
        policy_spec: request.params.policy_spec.as_deref().cloned(),
        logprobs: request.params.logprobs,
        stats: request.stats,
        handoff: request.handoff,
        timing: request.timing,
        frontend,
        hosts: request
            .hosts
            .iter()
            .map(|h| h.as_deref().map(str::to_string))
            .collect(),
    }
}

/// A request whose `RequestActor` lives in another process (its front end).
#[derive(Clone)]
pub(crate) struct RemoteClient {
    bus: Bus,
    frontend: Arc<str>,
    rid: RequestId,
}

impl RemoteClient {
    fn send(&self, event: WireEvent) {
        let event = ClientEvent {
            rid: self.rid,
            event,
        };
        self.bus.publish(
            self.bus.client_subject(&self.frontend),
            wire::encode(&event),
        );
    }
}

impl ClientPort for RemoteClient {
    fn committed(&self, msg: Committed) {
        self.send(WireEvent::Request(RequestEvent::Token {
            id: msg.token,
            index: msg.index,
            model: msg.model,
            logprobs: msg.logprobs,
        }));
    }

    fn finished(&self, msg: Finished) {
        self.send(WireEvent::Request(RequestEvent::Finished {
            reason: msg.reason,
            stats: msg.stats,
            timing: msg.timing,
            prompt_tokens: msg.prompt_tokens,
            completion_tokens: msg.completion_tokens,
        }));
    }

    fn failed(&self, msg: Failed) {
        self.send(WireEvent::Request(RequestEvent::Failed {
            message: msg.message,
            kind: msg.kind,
        }));
    }

    fn placed(&self, msg: Placed) {
        self.send(WireEvent::Placed {
            model: msg.model,
            host: msg.host,
        });
    }

    fn owner(&self) -> &str {
        &self.frontend
    }
}

/// One of this process's requests: its actor, and where it was placed on remote models.
struct OwnRequest {
    actor: Addr<RequestActor>,
    placed: Vec<(ModelIdx, String)>,
}

/// This process's own requests, by id: their actors, for events and arrivals from the bus,
/// and the replicas each was placed on, to fail the right ones when a replica goes down.
/// Each change is announced on the bus, for the hosts' live counts.
#[derive(Clone)]
pub(crate) struct FrontendRequests {
    own: Arc<DashMap<RequestId, OwnRequest>>,
    bus: Bus,
}

impl FrontendRequests {
    pub fn new(bus: Bus) -> Self {
        Self {
            own: Arc::default(),
            bus,
        }
    }

    pub fn insert(&self, rid: RequestId, actor: Addr<RequestActor>) {
        self.own.insert(
            rid,
            OwnRequest {
                actor,
                placed: Vec::new(),
            },
        );
        self.bus.announce_requests(self.len());
    }

    pub fn len(&self) -> usize {
        self.own.len()
    }

    fn actor(&self, rid: RequestId) -> Option<Addr<RequestActor>> {
        self.own.get(&rid).map(|entry| entry.actor.clone())
    }

    /// Fails (retryably) every request placed on replica `host` of `model`: its KV there
    /// is gone, and this process cannot tell how far that replica got.
    pub fn fail_placed_on(&self, model: ModelIdx, name: &str, host: &str) {
        for entry in self.own.iter() {
            let own = entry.value();
            if own.placed.iter().any(|(m, h)| *m == model && h == host) {
                own.actor.do_send(Failed {
                    message: format!(
                        "model `{name}`'s worker {host} stopped answering on the bus; retry \
                         the request"
                    ),
                    kind: FailureKind::Unavailable,
                });
            }
        }
    }
}

impl OwnRequests for FrontendRequests {
    fn place(&self, rid: RequestId, model: ModelIdx, host: String) {
        if let Some(mut own) = self.own.get_mut(&rid) {
            own.placed.retain(|(m, _)| *m != model);
            own.placed.push((model, host));
        }
    }

    fn remove(&self, rid: RequestId) {
        if self.own.remove(&rid).is_some() {
            self.bus.announce_requests(self.len());
        }
    }
}

/// What cumulative counters added since `last`; all of `now` when they went back (the
/// host restarted).
fn counter_delta(last: &[u64], now: &[u64]) -> Vec<u64> {
    if now.iter().zip(last).any(|(n, l)| n < l) {
        return now.to_vec();
    }
    now.iter().zip(last).map(|(n, l)| n - l).collect()
}

/// Requests that ended recently, so a handoff still on the bus when its request's withdrawal
/// overtook it is dropped instead of holding KV for a request nobody will withdraw again.
#[derive(Default)]
pub(crate) struct RecentlyEnded {
    order: VecDeque<RequestId>,
    set: HashSet<RequestId>,
}

const RECENTLY_ENDED: usize = 65_536;

impl RecentlyEnded {
    fn insert(&mut self, rid: RequestId) {
        if self.set.insert(rid) {
            self.order.push_back(rid);
            if self.order.len() > RECENTLY_ENDED {
                let oldest = self.order.pop_front().expect("non-empty");
                self.set.remove(&oldest);
            }
        }
    }
}

/// What a process hosting a model needs to take that model's messages from the bus.
pub(crate) struct HostedModel {
    pub name: String,
    pub batcher: Addr<BatcherActor>,
}

/// Everything the bus handlers of this process share.
#[derive(Clone)]
pub(crate) struct BusSide {
    pub bus: Bus,
    pub policies: Arc<ArcSwap<PolicyRegistry>>,
    /// Policies built from specs other processes sent, by spec: each version once.
    pub built: Arc<DashMap<String, (SharedPolicy, Arc<PolicyConfig>)>>,
    pub config: Arc<Config>,
    pub hidden_sizes: Arc<[usize]>,
    pub live: LiveRequests,
    pub frontend: FrontendRequests,
    /// Requests that ended lately (one set for every model hosted here).
    pub ended: Arc<Mutex<RecentlyEnded>>,
    /// Requests here owned by other processes, by id: their front end.
    pub owners: Arc<DashMap<RequestId, Arc<str>>>,
}

impl BusSide {
    /// A request ended: every hosted model forgets it and frees its KV.
    fn forget(&self, rid: RequestId, batchers: &[Addr<BatcherActor>]) {
        self.ended
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(rid);
        if self.owners.remove(&rid).is_some() {
            self.live.remove(rid);
        }
        for batcher in batchers {
            batcher.do_send(Withdraw { rid });
        }
    }

    /// Follows every front end's beats: the live count is the sum of their requests, and
    /// the requests of a front end that stopped beating (three missed beats) are freed here,
    /// since nobody would withdraw them and their KV would stay for good.
    pub fn follow_frontends(&self, batchers: Vec<Addr<BatcherActor>>) -> Result<(), ClusterError> {
        /// Per front end: when it was last heard of, and its requests then.
        type Frontends = DashMap<Arc<str>, (Instant, usize)>;
        /// Sets the live count; when it fell, the batchers look again (a batch may be
        /// complete now, as a withdrawal tells them in one process).
        fn count(frontends: &Frontends, live: &LiveRequests, batchers: &[Addr<BatcherActor>]) {
            let (before, now) = (live.len(), frontends.iter().map(|e| e.value().1).sum());
            live.set_announced(now);
            if live.len() < before {
                for batcher in batchers {
                    batcher.do_send(Recount);
                }
            }
        }
        let frontends: Arc<Frontends> = Arc::default();
        let (heard, live, poked) = (frontends.clone(), self.live.clone(), batchers.clone());
        self.bus
            .subscribe(
                self.bus.frontend_beat_subject("*"),
                move |payload, _| match wire::decode::<FrontendBeat>(payload) {
                    Ok(beat) => {
                        heard.insert(beat.host.into(), (Instant::now(), beat.requests));
                        count(&heard, &live, &poked);
                    }
                    Err(e) => tracing::warn!("ignoring a front end's beat: {e}"),
                },
            )?;
        let side = self.clone();
        let silence = self.bus.heartbeat() * 3;
        self.bus.every(self.bus.heartbeat(), move || {
            // A front end is heard from its first request on, beat or not.
            for entry in side.owners.iter() {
                frontends
                    .entry(entry.value().clone())
                    .or_insert_with(|| (Instant::now(), 0));
            }
            let gone: Vec<Arc<str>> = frontends
                .iter()
                .filter(|e| e.value().0.elapsed() > silence)
                .map(|e| e.key().clone())
                .collect();
            for frontend in gone {
                let orphans: Vec<RequestId> = side
                    .owners
                    .iter()
                    .filter(|e| *e.value() == frontend)
                    .map(|e| *e.key())
                    .collect();
                if !orphans.is_empty() {
                    tracing::warn!(
                        %frontend,
                        requests = orphans.len(),
                        "front end stopped beating: freeing its requests"
                    );
                }
                for rid in orphans {
                    side.forget(rid, &batchers);
                }
                frontends.remove(&frontend);
                count(&frontends, &side.live, &batchers);
            }
        });
        Ok(())
    }

    /// Sends what each hosted model did, every quarter heartbeat while it does anything.
    pub fn share_records(&self, hosted: Vec<(String, ModelRecorder)>) {
        let bus = self.bus.clone();
        let mut seen = vec![0u64; hosted.len()];
        self.bus.every(self.bus.heartbeat() / 4, move || {
            for ((name, recorder), seen) in hosted.iter().zip(&mut seen) {
                let (steps, total) = recorder.steps_after(*seen);
                if total == *seen {
                    continue;
                }
                *seen = total;
                let (routed_to, committed_to) =
                    recorder.read(|m| (m.routed_to.clone(), m.committed_to.clone()));
                let digest = RecordDigest {
                    host: bus.id().to_string(),
                    steps: steps
                        .iter()
                        .map(|s| (s.batch, s.tokens, (s.end - s.start).as_micros() as u64))
                        .collect(),
                    routed_to,
                    committed_to,
                };
                bus.publish(bus.record_subject(name), wire::encode(&digest));
            }
        });
    }

    /// Feeds the digests of models hosted elsewhere into this process's records of them,
    /// where the tuner reads them.
    pub fn follow_records(&self, remote: Vec<(String, ModelRecorder)>) -> Result<(), ClusterError> {
        for (name, recorder) in remote {
            // Per replica: its cumulative counters as last heard.
            let mut heard: BTreeMap<String, (Vec<u64>, Vec<u64>)> = BTreeMap::new();
            let subject = self.bus.record_subject(&name);
            self.bus.subscribe(subject, move |payload, _| {
                let digest = match wire::decode::<RecordDigest>(payload) {
                    Ok(digest) => digest,
                    Err(e) => return tracing::warn!(model = %name, "ignoring a record: {e}"),
                };
                let models = recorder.read(|m| m.routed_to.len());
                if digest.routed_to.len() != models || digest.committed_to.len() != models {
                    return tracing::warn!(
                        model = %name,
                        host = %digest.host,
                        "ignoring a record for {} models where this process has {models}",
                        digest.routed_to.len()
                    );
                }
                let zeros = || (vec![0; models], vec![0; models]);
                let (routed, committed) = heard.entry(digest.host.clone()).or_insert_with(zeros);
                let routed_delta = counter_delta(routed, &digest.routed_to);
                let committed_delta = counter_delta(committed, &digest.committed_to);
                let steps: Vec<(usize, usize, Duration)> = digest
                    .steps
                    .iter()
                    .map(|&(rows, tokens, us)| (rows, tokens, Duration::from_micros(us)))
                    .collect();
                recorder.absorb_remote(&steps, &routed_delta, &committed_delta);
                *routed = digest.routed_to;
                *committed = digest.committed_to;
            })?;
        }
        Ok(())
    }

    /// Takes `admit`, `withdraw` and `threshold` for a hosted model.
    pub fn serve_model(&self, model: HostedModel) -> Result<(), ClusterError> {
        let bus = &self.bus;
        let (side, batcher, name) = (self.clone(), model.batcher.clone(), model.name.clone());
        let recent = self.ended.clone();
        bus.subscribe(
            bus.replica_subject(&model.name, bus.id(), "admit"),
            move |payload, _| match wire::decode::<WireAdmit>(payload) {
                Ok(admit) => {
                    if admit.requests.iter().any(|r| r.handoff.is_some()) {
                        let transit = wire::unix_us().saturating_sub(admit.sent_unix_us);
                        side.bus
                            .handoff_arrived(&name, Duration::from_micros(transit));
                    }
                    let recent = recent.lock().unwrap_or_else(|e| e.into_inner());
                    let arrivals: Vec<Request> = admit
                        .requests
                        .into_iter()
                        .filter(|r| !recent.set.contains(&r.state.rid))
                        .filter_map(|r| side.arrival(r))
                        .collect();
                    if !arrivals.is_empty() {
                        batcher.do_send(Admit(arrivals));
                    }
                }
                Err(e) => tracing::warn!(model = %name, "ignoring an admit message: {e}"),
            },
        )?;
        let (side, batcher, name) = (self.clone(), model.batcher.clone(), model.name.clone());
        bus.subscribe(
            bus.model_subject(&model.name, "withdraw"),
            move |payload, _| match wire::decode::<WireWithdraw>(payload) {
                Ok(WireWithdraw { rid }) => side.forget(rid, std::slice::from_ref(&batcher)),
                Err(e) => tracing::warn!(model = %name, "ignoring a withdraw message: {e}"),
            },
        )?;
        let (batcher, name) = (model.batcher, model.name.clone());
        bus.subscribe(
            bus.model_subject(&model.name, "threshold"),
            move |payload, _| match wire::decode::<WireThreshold>(payload) {
                Ok(WireThreshold { threshold }) => batcher.do_send(SetThreshold(threshold)),
                Err(e) => tracing::warn!(model = %name, "ignoring a threshold message: {e}"),
            },
        )
    }

    /// Takes the events other processes send for this process's own requests.
    pub fn serve_clients(&self) -> Result<(), ClusterError> {
        let frontend = self.frontend.clone();
        self.bus
            .subscribe(self.bus.client_subject(self.bus.id()), move |payload, _| {
                let ClientEvent { rid, event } = match wire::decode::<ClientEvent>(payload) {
                    Ok(event) => event,
                    Err(e) => return tracing::warn!("ignoring a client event: {e}"),
                };
                // A request that already ended (cancelled, say) has no actor: drop it.
                let Some(actor) = frontend.actor(rid) else {
                    return;
                };
                match event {
                    WireEvent::Request(RequestEvent::Token {
                        id,
                        index,
                        model,
                        logprobs,
                    }) => actor.do_send(Committed {
                        token: id,
                        index,
                        model,
                        logprobs,
                    }),
                    WireEvent::Request(RequestEvent::Finished {
                        reason,
                        stats,
                        timing,
                        prompt_tokens,
                        completion_tokens,
                    }) => actor.do_send(Finished {
                        reason,
                        stats,
                        timing,
                        prompt_tokens,
                        completion_tokens,
                    }),
                    WireEvent::Request(RequestEvent::Failed { message, kind }) => {
                        actor.do_send(Failed { message, kind })
                    }
                    WireEvent::Placed { model, host } => frontend.place(rid, model, host),
                }
            })
    }

    /// A request from the bus as an arrival here, or `None` when it already ended. A policy
    /// this process does not know fails the request.
    fn arrival(&self, request: WireRequest) -> Option<Request> {
        let rid = request.state.rid;
        let client = if request.frontend == self.bus.id() {
            Client::Local(self.frontend.actor(rid)?)
        } else {
            self.live.insert(rid);
            self.owners.insert(rid, request.frontend.as_str().into());
            Client::Remote(Arc::new(RemoteClient {
                bus: self.bus.clone(),
                frontend: request.frontend.into(),
                rid,
            }))
        };
        let resolved = match &request.policy_spec {
            Some(spec) => self.built_policy(spec).map(|(p, s)| (p, Some(s))),
            None => self
                .policies
                .load()
                .get(&request.policy)
                .map(|p| (p, None))
                .ok_or_else(|| format!("policy `{}` is not configured here", request.policy)),
        };
        let (policy, policy_spec) = match resolved {
            Ok(resolved) => resolved,
            Err(why) => {
                client.failed(Failed {
                    message: format!("model host {}: {why}", self.bus.id()),
                    kind: FailureKind::Fault,
                });
                self.live.remove(rid);
                self.owners.remove(&rid);
                return None;
            }
        };
        Some(InFlight {
            state: request.state,
            params: RequestParams {
                max_tokens: request.max_tokens,
                sampling: request.sampling,
                eos: Arc::new(request.eos.into_iter().collect()),
                policy,
                policy_spec,
                logprobs: request.logprobs,
            },
            stats: request.stats,
            client,
            handoff: request.handoff,
            arrived: Instant::now(),
            timing: request.timing,
            hosts: request
                .hosts
                .into_iter()
                .map(|h| h.map(Arc::from))
                .collect(),
            // A deployment with models in other processes refuses structured output and
            // pairs across vocabularies.
            grammar: None,
            cross: None,
        })
    }

    /// The policy a spec describes, built here the first time a request brings it.
    fn built_policy(
        &self,
        spec: &PolicyConfig,
    ) -> Result<(SharedPolicy, Arc<PolicyConfig>), String> {
        let key = serde_json::to_string(spec).expect("a policy entry serializes");
        if let Some(built) = self.built.get(&key) {
            return Ok(built.clone());
        }
        let policy = PolicyRegistry::build_spec(&self.config, spec, &self.hidden_sizes)
            .map_err(|e| e.to_string())?;
        let built = (policy, Arc::new(spec.clone()));
        self.built.insert(key, built.clone());
        Ok(built)
    }
}

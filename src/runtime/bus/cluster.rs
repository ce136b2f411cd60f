//! The cluster bus: this process's connection to NATS, on a thread of its own (the actors run
//! on actix arbiters; the NATS client wants a tokio runtime that outlives any one of them).
//! Subjects, all under `[cluster] subject_prefix`:
//!
//! | subject | what | from → to |
//! |---|---|---|
//! | `model.<m>.<host>.admit` | `WireAdmit`: new requests and handoffs | any process → one replica of m |
//! | `model.<m>.withdraw` | `WireWithdraw`: a request ended | its front end → every replica of m |
//! | `model.<m>.threshold` | `WireThreshold` | the front end's tuner → every replica of m |
//! | `model.<m>.describe` | `ModelFacts`, request/reply | a joining process → a replica of m |
//! | `heartbeat.<m>` | `Heartbeat` (host, load), every `heartbeat_ms` | each replica of m → everyone |
//! | `record.<m>` | `RecordDigest`: steps and route counts, every quarter heartbeat | each replica of m → everyone |
//! | `steplock.acquire` / `.grant.<id>` / `.release` | `lockstep`: a turn to step | a host → the front end → that host |
//! | `frontend.<id>` | `FrontendBeat` (host, requests), every `heartbeat_ms` and on each change | every process → everyone |
//! | `client.<id>` | `ClientEvent`: tokens, finish, failure, placement | a host → the front end `id` |
//!
//! Outgoing messages go through one queue and one task, so they leave in the order the actors
//! sent them (a token before its request's finish); NATS keeps that order per connection.

use super::wire::{self, FrontendBeat, Heartbeat};
use crate::config::ClusterConfig;
use crate::telemetry;
use dashmap::DashMap;
use futures_util::StreamExt;
use std::collections::{BTreeMap, VecDeque};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};

/// Missed heartbeats after which a model counts as down.
const MISSED_BEATS: u32 = 3;
/// How long connecting to the NATS server may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// Never carries the token: async-nats's errors name the server and the refusal only.
    #[error("cannot join the NATS bus at {url}: {reason}")]
    Connect { url: String, reason: String },
    #[error("NATS subscription to `{subject}` failed: {reason}")]
    Subscribe { subject: String, reason: String },
    #[error(
        "no process hosting model `{model}` answered on the NATS bus within {waited_ms} ms \
         (start `tokenrouter worker --model {model}` with the same [cluster] settings)"
    )]
    NoHost { model: String, waited_ms: u64 },
    #[error("model `{model}`'s host answered with {reason}")]
    BadReply { model: String, reason: String },
}

/// A handle on this process's bus connection; cheap to clone.
#[derive(Clone)]
pub(crate) struct Bus(Arc<BusInner>);

struct BusInner {
    /// This process on the bus: where events for its requests are sent.
    id: String,
    prefix: String,
    client: async_nats::Client,
    runtime: tokio::runtime::Handle,
    outbox: UnboundedSender<(String, Vec<u8>)>,
    heartbeat: Duration,
    /// Each model's replicas (by host id) as their heartbeats describe them.
    replicas: DashMap<String, BTreeMap<String, Replica>>,
    /// Subscriptions, heartbeats and watchers, ended by `close`.
    tasks: Mutex<Vec<tokio::task::AbortHandle>>,
    /// The latest round trips of pings to remote replicas.
    round_trips: Samples,
    /// The latest transits of handoffs that arrived here.
    transits: Samples,
}

/// The latest durations of something, for the bench to take.
#[derive(Default)]
struct Samples(Mutex<VecDeque<Duration>>);

impl Samples {
    const KEPT: usize = 4096;

    fn push(&self, sample: Duration) {
        let mut kept = self.0.lock().unwrap_or_else(|e| e.into_inner());
        kept.push_back(sample);
        if kept.len() > Self::KEPT {
            kept.pop_front();
        }
    }

    /// Every sample since the last call, oldest first.
    fn take(&self) -> Vec<Duration> {
        let mut kept = self.0.lock().unwrap_or_else(|e| e.into_inner());
        kept.drain(..).collect()
    }
}

impl Bus {
    /// Connects (token and TLS as configured) and starts the bus thread.
    pub fn connect(config: &ClusterConfig) -> Result<Self, ClusterError> {
        let id = format!(
            "{}-{}-{:08x}",
            hostname(),
            std::process::id(),
            rand::random::<u32>()
        );
        let mut options = async_nats::ConnectOptions::new()
            .connection_timeout(CONNECT_TIMEOUT)
            .name(id.clone());
        if let Some(token) = config.token() {
            options = options.token(token);
        }
        let seed = config.nkey_seed().map_err(|e| ClusterError::Connect {
            url: config.url.clone(),
            reason: e.to_string(),
        })?;
        if let Some(seed) = seed {
            options = options.nkey(seed);
        }
        if let Some(ca) = &config.tls_ca {
            options = options.require_tls(true).add_root_certificates(ca.clone());
        }
        let url = config.url.clone();
        let (ready_tx, ready_rx) = std_mpsc::channel();
        let (outbox, mut queue) = unbounded_channel::<(String, Vec<u8>)>();
        std::thread::Builder::new()
            .name("nats-bus".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(runtime) => runtime,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.to_string()));
                        return;
                    }
                };
                let client = match runtime.block_on(options.connect(url.as_str())) {
                    Ok(client) => client,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.to_string()));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok((client.clone(), runtime.handle().clone())));
                runtime.block_on(async move {
                    while let Some((subject, payload)) = queue.recv().await {
                        if let Err(e) = client.publish(subject.clone(), payload.into()).await {
                            tracing::warn!(%subject, "bus publish failed: {e}");
                        }
                    }
                });
            })
            .map_err(|e| ClusterError::Connect {
                url: config.url.clone(),
                reason: e.to_string(),
            })?;
        let (client, runtime) = ready_rx
            .recv()
            .map_err(|_| "the bus thread ended".to_string())
            .and_then(|r| r)
            .map_err(|reason| ClusterError::Connect {
                url: config.url.clone(),
                reason,
            })?;
        tracing::info!(url = %config.url, id = %id, "joined the NATS bus");
        Ok(Self(Arc::new(BusInner {
            id,
            prefix: config.subject_prefix.clone(),
            client,
            runtime,
            outbox,
            heartbeat: Duration::from_millis(config.heartbeat_ms),
            replicas: DashMap::new(),
            tasks: Mutex::new(Vec::new()),
            round_trips: Samples::default(),
            transits: Samples::default(),
        })))
    }

    /// Runs `task` on the bus thread until `close`.
    fn spawn(&self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        let handle = self.0.runtime.spawn(task).abort_handle();
        self.0
            .tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(handle);
    }

    /// Leaves the bus: every subscription ends (the server forgets them) and heartbeats stop,
    /// so other processes see this one's models go down.
    pub fn close(&self) {
        for task in self
            .0
            .tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            task.abort();
        }
    }

    pub fn id(&self) -> &str {
        &self.0.id
    }

    /// `<prefix>.model.<model>.<what>`.
    pub fn model_subject(&self, model: &str, what: &str) -> String {
        format!("{}.model.{model}.{what}", self.0.prefix)
    }

    /// `<prefix>.model.<model>.<host>.<what>`: one replica's own subject.
    pub fn replica_subject(&self, model: &str, host: &str, what: &str) -> String {
        format!("{}.model.{model}.{host}.{what}", self.0.prefix)
    }

    /// Where the hosts of `model` beat.
    fn heartbeat_subject(&self, model: &str) -> String {
        format!("{}.heartbeat.{model}", self.0.prefix)
    }

    /// Where the hosts of `model` send what it did (`RecordDigest`).
    pub fn record_subject(&self, model: &str) -> String {
        format!("{}.record.{model}", self.0.prefix)
    }

    /// `<prefix>.steplock.<what>`: the `lockstep` turn to step.
    pub fn step_lock_subject(&self, what: &str) -> String {
        format!("{}.steplock.{what}", self.0.prefix)
    }

    /// Where front end `frontend` beats (`*` for every front end).
    pub fn frontend_beat_subject(&self, frontend: &str) -> String {
        format!("{}.frontend.{frontend}", self.0.prefix)
    }

    pub fn heartbeat(&self) -> Duration {
        self.0.heartbeat
    }

    /// Runs `tick` on the bus thread every `period` until `close`.
    pub fn every(&self, period: Duration, mut tick: impl FnMut() + Send + 'static) {
        self.spawn(async move {
            let mut every = tokio::time::interval(period);
            loop {
                every.tick().await;
                tick();
            }
        });
    }

    /// Where events for front end `frontend`'s requests go.
    pub fn client_subject(&self, frontend: &str) -> String {
        format!("{}.client.{frontend}", self.0.prefix)
    }

    /// The largest payload the server takes (its `max_payload`).
    pub fn max_payload(&self) -> usize {
        self.0.client.server_info().max_payload
    }

    /// Queues a message; it leaves after every message queued before it.
    pub fn publish(&self, subject: String, payload: Vec<u8>) {
        // Fails only once the bus thread is gone (the process is ending).
        let _ = self.0.outbox.send((subject, payload));
    }

    /// Subscribes, returning once the server has the subscription; `handle` runs on the bus
    /// thread for every message, with its payload and reply subject.
    pub fn subscribe(
        &self,
        subject: String,
        mut handle: impl FnMut(&[u8], Option<&str>) + Send + 'static,
    ) -> Result<(), ClusterError> {
        let (ready_tx, ready_rx) = std_mpsc::channel();
        let client = self.0.client.clone();
        let name = subject.clone();
        self.spawn(async move {
            let subscribed = client.subscribe(name.clone()).await;
            let flushed = match &subscribed {
                Ok(_) => client.flush().await.map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            let _ = ready_tx.send(flushed);
            if let Ok(mut messages) = subscribed {
                while let Some(message) = messages.next().await {
                    handle(&message.payload, message.reply.as_deref());
                }
            }
        });
        let failed = |reason: String| ClusterError::Subscribe {
            subject: subject.clone(),
            reason,
        };
        ready_rx
            .recv_timeout(CONNECT_TIMEOUT)
            .map_err(|e| failed(e.to_string()))?
            .map_err(failed)
    }

    /// Asks `subject` and waits for one reply, or `None` after `timeout`.
    pub fn request(&self, subject: String, payload: Vec<u8>, timeout: Duration) -> Option<Vec<u8>> {
        let (tx, rx) = std_mpsc::channel();
        let client = self.0.client.clone();
        self.0.runtime.spawn(async move {
            let reply =
                tokio::time::timeout(timeout, client.request(subject, payload.into())).await;
            let _ = tx.send(match reply {
                Ok(Ok(message)) => Some(message.payload.to_vec()),
                _ => None,
            });
        });
        rx.recv_timeout(timeout + Duration::from_secs(1))
            .ok()
            .flatten()
    }

    /// Says every `heartbeat_ms` that this process hosts `models`, with its load (live
    /// requests here) for the front ends that spread new requests over replicas, and how
    /// many requests it owns as a front end (`requests`).
    pub fn beat_for(
        &self,
        models: Vec<String>,
        load: impl Fn() -> usize + Send + 'static,
        requests: impl Fn() -> usize + Send + 'static,
    ) {
        let bus = self.clone();
        self.every(self.0.heartbeat, move || {
            let beat = wire::encode(&Heartbeat {
                host: bus.0.id.clone(),
                load: load(),
            });
            for model in &models {
                bus.publish(bus.heartbeat_subject(model), beat.clone());
            }
            bus.announce_requests(requests());
        });
    }

    /// Says that this process, as a front end, owns `requests` live requests: its requests'
    /// hosts free them when these beats stop, and count them as live.
    pub fn announce_requests(&self, requests: usize) {
        let beat = FrontendBeat {
            host: self.0.id.clone(),
            requests,
        };
        self.publish(self.frontend_beat_subject(&self.0.id), wire::encode(&beat));
    }

    /// Follows the heartbeats of `models` (hosted elsewhere, by one or more replicas), and
    /// runs `on_change(model index, replica, up)` on the bus thread whenever a replica goes
    /// down or comes back.
    pub fn watch(
        &self,
        models: Vec<(usize, String)>,
        on_change: impl Fn(usize, &str, bool) + Send + 'static,
    ) -> Result<(), ClusterError> {
        let bus = self.clone();
        for (_, model) in &models {
            let (bus, model_name) = (bus.clone(), model.clone());
            self.subscribe(
                self.heartbeat_subject(model),
                move |payload, _| match wire::decode::<Heartbeat>(payload) {
                    Ok(beat) => bus.beat(&model_name, &beat.host, Some(beat.load)),
                    Err(e) => tracing::warn!(model = %model_name, "ignoring a heartbeat: {e}"),
                },
            )?;
        }
        // A replica first seen up is no change; first seen down is one.
        let mut up: BTreeMap<(usize, String), bool> = BTreeMap::new();
        self.every(self.0.heartbeat / 2, move || {
            for status in bus.replica_status() {
                telemetry::replica_seen(&status.model, &status.host, status.up, status.load);
            }
            for (idx, model) in &models {
                for (host, now_up) in bus.replicas_of(model) {
                    let was_up = up.insert((*idx, host.clone()), now_up).unwrap_or(true);
                    if was_up == now_up {
                        continue;
                    }
                    if now_up {
                        tracing::info!(model = %model, %host, "replica back on the bus");
                    } else {
                        tracing::warn!(
                            model = %model,
                            %host,
                            "replica missed {MISSED_BEATS} heartbeats: down"
                        );
                    }
                    on_change(*idx, &host, now_up);
                }
            }
        });
        Ok(())
    }

    /// Answers pings for `model` hosted here (`<prefix>.model.<model>.<host>.ping`).
    pub fn answer_pings(&self, model: &str) -> Result<(), ClusterError> {
        let replier = self.clone();
        self.subscribe(
            self.replica_subject(model, self.id(), "ping"),
            move |_, reply| {
                if let Some(reply) = reply {
                    replier.publish(reply.to_string(), Vec::new());
                }
            },
        )
    }

    /// Pings every up replica of `models` four times per heartbeat: the round trip of a
    /// message and its answer over the bus, what a handoff to another process adds (its
    /// arrivals there, its tokens back). Exported as `tokenrouter_cluster_bus_rtt_seconds`.
    pub fn ping(&self, models: Vec<String>) {
        let bus = self.clone();
        self.spawn(async move {
            let mut every = tokio::time::interval(bus.0.heartbeat / 4);
            loop {
                every.tick().await;
                for model in &models {
                    for (host, up) in bus.replicas_of(model) {
                        if !up {
                            continue;
                        }
                        let subject = bus.replica_subject(model, &host, "ping");
                        let sent = Instant::now();
                        let answer = tokio::time::timeout(
                            bus.0.heartbeat,
                            bus.0.client.request(subject, Vec::new().into()),
                        )
                        .await;
                        if let Ok(Ok(_)) = answer {
                            let rtt = sent.elapsed();
                            telemetry::bus_round_trip(model, &host, rtt);
                            bus.0.round_trips.push(rtt);
                        }
                    }
                }
            }
        });
    }

    /// The round trips measured since the last call (oldest first).
    pub fn take_round_trips(&self) -> Vec<Duration> {
        self.0.round_trips.take()
    }

    /// A handoff to `model`, hosted here, arrived `transit` after its sender queued it.
    pub fn handoff_arrived(&self, model: &str, transit: Duration) {
        telemetry::handoff_transit(model, transit);
        self.0.transits.push(transit);
    }

    /// The transits of handoffs that arrived since the last call (oldest first).
    pub fn take_handoff_transits(&self) -> Vec<Duration> {
        self.0.transits.take()
    }

    /// Records that `host` (a replica of `model`) is alive now, with its load when it said.
    pub fn beat(&self, model: &str, host: &str, load: Option<usize>) {
        let mut replicas = self.0.replicas.entry(model.to_string()).or_default();
        let replica = replicas.entry(host.to_string()).or_insert(Replica {
            last_beat: Instant::now(),
            load: 0,
            placed_since_beat: 0,
            beaten: false,
            placed_total: 0,
        });
        replica.last_beat = Instant::now();
        if let Some(load) = load {
            replica.load = load;
            replica.placed_since_beat = 0;
            replica.beaten = true;
        }
    }

    /// Every remote replica this process knows of.
    pub fn replica_status(&self) -> Vec<ReplicaStatus> {
        let limit = self.0.heartbeat * MISSED_BEATS;
        let mut all = Vec::new();
        for entry in self.0.replicas.iter() {
            for (host, r) in entry.value() {
                all.push(ReplicaStatus {
                    model: entry.key().clone(),
                    host: host.clone(),
                    up: r.beaten && r.last_beat.elapsed() < limit,
                    load: r.load,
                    placed: r.placed_total,
                });
            }
        }
        all.sort_by(|a, b| (&a.model, &a.host).cmp(&(&b.model, &b.host)));
        all
    }

    /// Each known replica of `model` and whether it is up.
    pub fn replicas_of(&self, model: &str) -> Vec<(String, bool)> {
        let limit = self.0.heartbeat * MISSED_BEATS;
        self.0
            .replicas
            .get(model)
            .map_or_else(Vec::new, |replicas| {
                replicas
                    .iter()
                    .map(|(host, r)| (host.clone(), r.last_beat.elapsed() < limit))
                    .collect()
            })
    }

    /// Whether replica `host` of `model` is up.
    pub fn replica_is_up(&self, model: &str, host: &str) -> bool {
        self.replicas_of(model)
            .iter()
            .any(|(h, up)| h == host && *up)
    }

    /// Whether some replica of `model` has sent a heartbeat: it beats once it takes requests.
    pub fn has_beaten(&self, model: &str) -> bool {
        self.0
            .replicas
            .get(model)
            .is_some_and(|replicas| replicas.values().any(|r| r.beaten))
    }

    /// The up replica of `model` a new request should go to: the least loaded (its last
    /// reported load plus what this process sent it since), the first by id among equals.
    /// Replicas that have sent a heartbeat go first: one known only from its answer to
    /// `describe` may still be starting (a worker that joins while others serve); with no
    /// other, it is taken (at start-up every host answers before any request exists).
    pub fn pick_replica(&self, model: &str) -> Option<String> {
        let limit = self.0.heartbeat * MISSED_BEATS;
        let mut replicas = self.0.replicas.get_mut(model)?;
        let (host, replica) = replicas
            .iter_mut()
            .filter(|(_, r)| r.last_beat.elapsed() < limit)
            .min_by_key(|(_, r)| (!r.beaten, r.load + r.placed_since_beat))?;
        replica.placed_since_beat += 1;
        replica.placed_total += 1;
        telemetry::replica_placed(model, host);
        Some(host.clone())
    }
}

/// One host of a model, as this process last heard of it.
struct Replica {
    last_beat: Instant,
    load: usize,
    /// Requests this process sent it since its last heartbeat (not in `load` yet).
    placed_since_beat: usize,
    /// It has sent a heartbeat (a describe answer alone does not count).
    beaten: bool,
    placed_total: u64,
}

/// A remote model's replica as this process sees it (`Runtime::replicas`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ReplicaStatus {
    pub model: String,
    /// The hosting process's id on the bus.
    pub host: String,
    /// It sent a heartbeat within the last three periods.
    pub up: bool,
    /// Live requests there, as its last heartbeat said.
    pub load: usize,
    /// Requests this process placed there.
    pub placed: u64,
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| {
            h.trim()
                .replace(|c: char| !c.is_ascii_alphanumeric() && c != '-', "_")
        })
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "host".into())
}

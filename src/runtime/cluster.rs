//! The cluster bus: this process's connection to NATS, on a thread of its own (the actors run
//! on actix arbiters; the NATS client wants a tokio runtime that outlives any one of them).
//! Subjects, all under `[cluster] subject_prefix`:
//!
//! | subject | what | from → to |
//! |---|---|---|
//! | `model.<m>.admit` | `WireAdmit`: new requests and handoffs | any process → m's host |
//! | `model.<m>.withdraw` | `WireWithdraw`: a request ended | its front end → m's host |
//! | `model.<m>.threshold` | `WireThreshold` | the front end's tuner → m's host |
//! | `model.<m>.describe` | `ModelFacts`, request/reply | a joining process → m's host |
//! | `heartbeat.<m>` | `Heartbeat`, every `heartbeat_ms` | m's host → everyone |
//! | `client.<id>` | `ClientEvent`: tokens, finish, failure | m's host → the front end `id` |
//!
//! Outgoing messages go through one queue and one task, so they leave in the order the actors
//! sent them (a token before its request's finish); NATS keeps that order per connection.

use super::wire::{self, Heartbeat};
use crate::config::ClusterConfig;
use dashmap::{DashMap, DashSet};
use futures_util::StreamExt;
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
    /// When each model's host last said it is alive (a heartbeat, or an answer).
    last_beat: DashMap<String, Instant>,
    /// Models whose host has sent a heartbeat: it beats once it takes requests.
    beating: DashSet<String>,
    /// Subscriptions, heartbeats and watchers, ended by `close`.
    tasks: Mutex<Vec<tokio::task::AbortHandle>>,
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
            last_beat: DashMap::new(),
            beating: DashSet::new(),
            tasks: Mutex::new(Vec::new()),
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

    /// Where events for front end `frontend`'s requests go.
    pub fn client_subject(&self, frontend: &str) -> String {
        format!("{}.client.{frontend}", self.0.prefix)
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

    /// Says every `heartbeat_ms` that this process hosts `models`.
    pub fn beat_for(&self, models: Vec<String>) {
        let bus = self.clone();
        self.spawn(async move {
            let mut every = tokio::time::interval(bus.0.heartbeat);
            loop {
                every.tick().await;
                for model in &models {
                    let beat = wire::encode(&Heartbeat {
                        host: bus.0.id.clone(),
                    });
                    bus.publish(format!("{}.heartbeat.{model}", bus.0.prefix), beat);
                }
            }
        });
    }

    /// Follows the heartbeats of `models` (hosted elsewhere): `is_up` answers from them, and
    /// `on_change(model index, up)` runs on the bus thread whenever one goes down or comes back.
    pub fn watch(
        &self,
        models: Vec<(usize, String)>,
        on_change: impl Fn(usize, bool) + Send + 'static,
    ) -> Result<(), ClusterError> {
        let bus = self.clone();
        for (_, model) in &models {
            let (bus, model_name) = (bus.clone(), model.clone());
            self.subscribe(
                format!("{}.heartbeat.{model}", self.0.prefix),
                move |payload, _| match wire::decode::<Heartbeat>(payload) {
                    Ok(_) => {
                        bus.saw(&model_name);
                        bus.0.beating.insert(model_name.clone());
                    }
                    Err(e) => tracing::warn!(model = %model_name, "ignoring a heartbeat: {e}"),
                },
            )?;
        }
        self.spawn(async move {
            let mut up: Vec<bool> = models.iter().map(|(_, m)| bus.is_up(m)).collect();
            let mut every = tokio::time::interval(bus.0.heartbeat / 2);
            loop {
                every.tick().await;
                for ((idx, model), was_up) in models.iter().zip(&mut up) {
                    let now_up = bus.is_up(model);
                    if now_up != *was_up {
                        *was_up = now_up;
                        if now_up {
                            tracing::info!(model = %model, "model's host is back on the bus");
                        } else {
                            tracing::warn!(
                                model = %model,
                                "model's host missed {MISSED_BEATS} heartbeats: down"
                            );
                        }
                        on_change(*idx, now_up);
                    }
                }
            }
        });
        Ok(())
    }

    /// Whether `model`'s host sent a heartbeat within the last `MISSED_BEATS` periods.
    pub fn is_up(&self, model: &str) -> bool {
        self.0
            .last_beat
            .get(model)
            .is_some_and(|at| at.elapsed() < self.0.heartbeat * MISSED_BEATS)
    }

    /// Whether `model`'s host has sent a heartbeat since this process joined.
    pub fn has_beaten(&self, model: &str) -> bool {
        self.0.beating.contains(model)
    }

    /// Marks `model` alive now (its host just answered).
    pub fn saw(&self, model: &str) {
        self.0.last_beat.insert(model.to_string(), Instant::now());
    }
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

//! Starts the actors (one arbiter per model, supervised) and exposes the `Runtime` handle
//! that the CLI, the server and the bench call. Must be used inside a running actix System.

use super::batcher::{AttachModel, BatcherActor};
use super::bus::{
    join, serve_step_lock, Bus, BusSide, BusStepLock, ClusterError, FrontendRequests, HostedModel,
    ModelFacts, RemoteModel, ReplicaStatus,
};
use super::core::{
    BatchGate, CrossVocab, EngineTiming, FailureKind, FinishReason, InFlight, RequestId,
    RequestParams, RoutingStats,
};
use super::link::{Client, ModelLink, OwnRequests};
use super::live::LiveRequests;
use super::messages::{Cancel, Start};
use super::model::{ModelActor, ModelActorParts};
use super::record::{ModelRecorder, RuntimeSnapshot};
use super::request::{RequestActor, RequestEvent};
use super::step_lock::StepLock;
use super::tokenizers::{Prompt, Tokenizers};
use super::tuner::{TunerActor, TunerSettings};
use crate::config::{Config, ExecutionMode, Placement, PolicyConfig, PolicyUpdate};
use crate::constraint::{FormatError, OutputFormat, RequestGrammar, Vocabulary};
use crate::engine::chat::ChatMessage;
use crate::engine::simulated::LatencyProfileExecutor;
use crate::engine::spelling::Spelling;
use crate::engine::tokenizer::ModelTokenizer;
use crate::engine::{load_executor, SamplingParams, StepExecutor};
use crate::error::{ConfigError, EngineError};
use crate::policy::registry::PolicyRegistry;
use crate::policy::{PolicyKind, RequestInfo, RoutingState, SharedPolicy};
use crate::telemetry;
use crate::tuning::controller::ArmComparison;
use crate::tuning::AffineLatency;
use actix::prelude::*;
use arc_swap::ArcSwap;
use llguidance::api::ParserLimits;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("unknown model or policy `{0}`")]
    UnknownPolicy(String),
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// Not a `source` of the error: its text is already in this one's (a CLI printing the
    /// chain would say it twice).
    #[error("invalid request: {0}")]
    Invalid(InvalidRequest),
    #[error("generation failed: {0}")]
    Failed(String),
    /// Out of capacity (KV); the same request may succeed later.
    #[error("overloaded: {0}")]
    Overloaded(String),
    #[error("{0}")]
    DeadlineExceeded(String),
    #[error("the runtime stopped before the request finished")]
    Disconnected,
    /// A model's process stopped answering; the same request may succeed on a retry.
    #[error("unavailable: {0}")]
    Unavailable(String),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Cluster(#[from] ClusterError),
}

impl From<InvalidRequest> for RuntimeError {
    fn from(invalid: InvalidRequest) -> Self {
        Self::Invalid(invalid)
    }
}

impl RuntimeError {
    pub fn failed(kind: FailureKind, message: String) -> Self {
        match kind {
            FailureKind::Fault => RuntimeError::Failed(message),
            FailureKind::Unavailable => RuntimeError::Unavailable(message),
            FailureKind::Capacity => RuntimeError::Overloaded(message),
            FailureKind::Deadline => RuntimeError::DeadlineExceeded(message),
        }
    }
}

/// Why a request can never run as asked (the same request will fail again).
#[derive(Debug, thiserror::Error)]
pub enum InvalidRequest {
    #[error("the prompt has no tokens")]
    EmptyPrompt,
    #[error("max_tokens must be at least 1")]
    NoTokensAsked,
    #[error(
        "the prompt ({prompt} tokens) plus max_tokens ({max_tokens}) exceeds the models' \
         context of {context} tokens"
    )]
    Context {
        prompt: usize,
        max_tokens: usize,
        context: usize,
    },
    #[error(
        "the prompt ({prompt} tokens) plus max_tokens ({max_tokens}) exceeds model `{model}`'s \
         whole KV budget of {capacity} tokens (the longest sequence its kv_tokens holds)"
    )]
    KvBudget {
        prompt: usize,
        max_tokens: usize,
        model: String,
        capacity: usize,
    },
    #[error("the output format cannot be served: {0}")]
    OutputFormat(#[from] FormatError),
    #[error("structured output {0}")]
    Unconstrainable(&'static str),
    #[error(
        "policy `{policy}` routes to model `{model}`, which reads another vocabulary than the \
         prompt's token ids: send the prompt as text or messages"
    )]
    PromptVocabulary { policy: String, model: String },
    #[error("{0} across vocabularies: token ids and their log-probabilities name one vocabulary")]
    AcrossVocabularies(&'static str),
}

/// A request checked by `Runtime::validate`: its policy resolved, its size known to fit.
pub struct ValidRequest {
    prompt: Prompt,
    /// Whether its policy's models read more than one vocabulary.
    across_vocabularies: bool,
    /// What `usage` reports (`Runtime::prompt_tokens`).
    prompt_tokens: usize,
    /// The vocabulary of the policy's first model.
    vocabulary: usize,
    policy: SharedPolicy,
    policy_spec: Option<Arc<PolicyConfig>>,
    max_tokens: usize,
    sampling: SamplingParams,
    timeout: Option<Duration>,
    ignore_eos: bool,
    logprobs: Option<usize>,
    grammar: Option<Arc<RequestGrammar>>,
}

impl ValidRequest {
    /// The prompt's tokens in the vocabulary of the policy's first model.
    pub fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    /// The vocabulary of the policy's first model (`Runtime::tokenizer_of` reads it).
    pub fn vocabulary(&self) -> usize {
        self.vocabulary
    }

    /// Reports each committed token's log-probability, `top` alternatives' and the
    /// distribution's entropy (`RequestEvent::Token::logprobs`). Refused across
    /// vocabularies: ids of two vocabularies would read as one.
    pub fn with_logprobs(self, top: usize) -> Result<Self, InvalidRequest> {
        if self.across_vocabularies {
            return Err(InvalidRequest::AcrossVocabularies("logprobs"));
        }
        Ok(Self {
            logprobs: Some(top),
            ..self
        })
    }
}

/// One generation as submitted to the runtime: its prompt in each vocabulary the models
/// read (token ids: the first model's), token ids out.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt: Prompt,
    /// A policy or model name; the default policy when `None`.
    pub policy: Option<String>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub timeout: Option<Duration>,
    /// Generate exactly `max_tokens` (benchmarks): end-of-sequence tokens do not stop it.
    pub ignore_eos: bool,
}

/// The result of a finished generation.
#[derive(Debug, Clone)]
pub struct Completion {
    pub rid: RequestId,
    pub policy: String,
    pub token_ids: Vec<u32>,
    /// The model that wrote each token (ids of models of different vocabularies mix).
    pub writers: Vec<usize>,
    pub finish_reason: FinishReason,
    pub routing: RoutingStats,
    pub prompt_tokens: usize,
    pub time_to_first_token: Duration,
    pub total: Duration,
}

/// A submitted request: its event stream, and a way to cancel it. Dropping the handle
/// cancels the request (a client that went away frees its KV everywhere).
pub struct RequestHandle {
    pub rid: RequestId,
    pub policy: String,
    pub events: UnboundedReceiver<RequestEvent>,
    actor: Addr<RequestActor>,
    submitted: Instant,
}

impl RequestHandle {
    pub fn cancel(&self) {
        self.actor.do_send(Cancel);
    }

    /// Waits for the whole generation.
    pub async fn collect(mut self) -> Result<Completion, RuntimeError> {
        let (mut token_ids, mut writers) = (Vec::new(), Vec::new());
        let mut ttft = None;
        while let Some(event) = self.events.recv().await {
            match event {
                RequestEvent::Token { id, model, .. } => {
                    ttft.get_or_insert_with(|| self.submitted.elapsed());
                    token_ids.push(id);
                    writers.push(model);
                }
                RequestEvent::Finished {
                    reason,
                    stats,
                    prompt_tokens,
                    ..
                } => {
                    let total = self.submitted.elapsed();
                    return Ok(Completion {
                        rid: self.rid,
                        policy: std::mem::take(&mut self.policy),
                        token_ids,
                        writers,
                        finish_reason: reason,
                        routing: stats,
                        prompt_tokens,
                        time_to_first_token: ttft.unwrap_or(total),
                        total,
                    });
                }
                RequestEvent::Failed { message, kind } => {
                    return Err(RuntimeError::failed(kind, message))
                }
            }
        }
        Err(RuntimeError::Disconnected)
    }
}

impl Drop for RequestHandle {
    /// A no-op for a request that already ended (its actor is gone).
    fn drop(&mut self) {
        self.cancel();
    }
}

pub struct Runtime {
    /// Every model, by index: its batcher here, or its host on the bus.
    models: Vec<ModelLink>,
    model_names: Vec<String>,
    /// One per model hosted in this process.
    model_arbiters: Vec<Arbiter>,
    batch_arbiter: Arbiter,
    /// The online tuner's thread (`tokenrouter` mode with re-tuning on).
    tuner_arbiter: Option<Arbiter>,
    /// The tuner's eager check, as last published.
    controller: Arc<Mutex<Option<ArmComparison>>>,
    /// Swapped whole at run time; a request keeps the policy it started with.
    policies: Arc<ArcSwap<PolicyRegistry>>,
    /// The config the registry was built from; updates apply to it and are validated whole.
    config: Mutex<Config>,
    hidden_sizes: Vec<usize>,
    /// The shortest context of the routed models: a request must fit every one.
    context_length: usize,
    /// Per model: its name and the longest sequence its whole KV budget holds (a request
    /// must fit each model its policy may route to, even with nothing else running).
    longest_sequences: Vec<(String, usize)>,
    /// Each model's tokenizer and chat template, by vocabulary (none when every model is a
    /// latency-profile simulation).
    tokenizers: Tokenizers,
    /// Per vocabulary, its tokens for structured output, built by the first request that
    /// asks for it.
    grammar_vocabularies: Vec<OnceLock<Arc<Vocabulary>>>,
    /// Per vocabulary (one when there is none), the tokens that end a generation.
    eos: Vec<Arc<BTreeSet<u32>>>,
    live: LiveRequests,
    /// This process's requests, when some model is hosted elsewhere (`[cluster]`).
    frontend: Option<FrontendRequests>,
    bus: Option<Bus>,
    next_rid: AtomicU64,
    recorders: Vec<ModelRecorder>,
    mode: ExecutionMode,
}

/// Which models this process runs, and whether it takes requests.
enum Role {
    /// `serve`, `generate`, the benches: hosts the models placed `local`, takes requests.
    Frontend,
    /// `tokenrouter worker`: hosts the named models for the front ends on the bus.
    Worker,
}

impl Runtime {
    /// Loads every model placed in this process and starts its actors; models placed
    /// `remote` are reached over the `[cluster]` bus. `mode` overrides the config's.
    pub fn start(config: &Config, mode: Option<ExecutionMode>) -> Result<Self, RuntimeError> {
        let hosted = config
            .models
            .iter()
            .map(|m| m.placement == Placement::Local)
            .collect();
        Self::start_hosting(config, mode, hosted, Role::Frontend)
    }

    /// `tokenrouter worker`: hosts `models` (by name) for the front ends on the config's bus.
    /// `mode` overrides the config's (every process of a deployment must run the same).
    pub fn start_worker(
        config: &Config,
        models: &[String],
        mode: Option<ExecutionMode>,
    ) -> Result<Self, RuntimeError> {
        if config.cluster.is_none() {
            return Err(ConfigError::Invalid(
                "a worker needs a [cluster] section with the NATS url".into(),
            )
            .into());
        }
        let mut hosted = vec![false; config.models.len()];
        for name in models {
            let idx = config.model_index(name).ok_or_else(|| {
                RuntimeError::UnknownPolicy(format!("{name} (no such model in the config)"))
            })?;
            hosted[idx] = true;
        }
        if !hosted.contains(&true) {
            return Err(RuntimeError::InvalidRequest(
                "a worker must host at least one model (--model NAME)".into(),
            ));
        }
        Self::start_hosting(config, mode, hosted, Role::Worker)
    }

    fn start_hosting(
        config: &Config,
        mode: Option<ExecutionMode>,
        hosted: Vec<bool>,
        role: Role,
    ) -> Result<Self, RuntimeError> {
        let latency_priors = config.latency_priors_ms()?;
        let mode = mode.unwrap_or(config.runtime.mode);
        let everything_here = hosted.iter().all(|&h| h);
        let uses_bus =
            config.cluster.is_some() && (matches!(role, Role::Worker) || !everything_here);
        // Over the bus every model reads the first one's vocabulary (checked below): the
        // other models' files need not be here.
        let first_real = config
            .models
            .iter()
            .position(|m| m.latency_profile_ms.is_none());
        let tokenizers = Tokenizers::load(config, |m| !uses_bus || Some(m) == first_real)?;
        let eos: Vec<Arc<BTreeSet<u32>>> = match tokenizers.count() {
            0 => vec![Arc::default()],
            n => (0..n)
                .map(|v| Arc::new(tokenizers.tokenizer(v).eos.clone()))
                .collect(),
        };
        let mut executors = config
            .models
            .iter()
            .zip(&hosted)
            .map(
                |(m, &here)| -> Result<Option<Box<dyn StepExecutor>>, RuntimeError> {
                    if !here {
                        return Ok(None);
                    }
                    Ok(Some(match m.latency_profile_ms {
                        Some(latency) => Box::new(LatencyProfileExecutor::new(
                            &m.name,
                            latency,
                            m.latency_context_cost,
                            m.kv_tokens,
                        )),
                        None => load_executor(m)?,
                    }))
                },
            )
            .collect::<Result<Vec<_>, _>>()?;
        for executor in executors.iter_mut().flatten() {
            executor
                .kv_mut()
                .set_prefix_sharing(config.runtime.prefix_cache);
        }
        let step_limits = config
            .models
            .iter()
            .map(|m| m.step_limits(config.runtime.max_wait_steps))
            .collect::<Result<Vec<_>, _>>()?;
        // With a bus, every process hosting a model says what it is and asks the others.
        let bus = match &config.cluster {
            Some(cluster) if uses_bus => Some(Bus::connect(cluster)?),
            _ => None,
        };
        let facts: Vec<Option<ModelFacts>> = executors
            .iter()
            .map(|e| {
                let host = bus.as_ref().map_or("", |b| b.id());
                e.as_ref().map(|e| facts_of(e.as_ref(), mode, host))
            })
            .collect();
        let facts = match &bus {
            None => facts.into_iter().map(|f| f.expect("hosted")).collect(),
            Some(bus) => {
                let join_timeout =
                    Duration::from_millis(config.cluster.as_ref().map_or(0, |c| c.join_timeout_ms));
                join(bus, config, facts, join_timeout, mode)?
            }
        };
        let names: Vec<&str> = config.models.iter().map(|m| m.name.as_str()).collect();
        check_vocabularies(&names, &facts, &tokenizers)?;
        let hidden_sizes: Vec<usize> = facts.iter().map(|f| f.hidden_size).collect();
        let longest_sequences = names
            .iter()
            .zip(&facts)
            .map(|(name, f)| (name.to_string(), f.longest_sequence_tokens))
            .collect();
        let context_length = facts
            .iter()
            .map(|f| f.context_length)
            .min()
            .unwrap_or(usize::MAX);
        let policies = PolicyRegistry::from_config(config, &hidden_sizes)?;
        refuse_mixing_vocabularies(&policies, &tokenizers, &names)?;
        if matches!(role, Role::Frontend) {
            for policy in policies.all() {
                let info = policy.describe();
                if info.kind != PolicyKind::Single {
                    tracing::info!(policy = %info.name, kind = %info.kind, "{}", info.rule);
                }
            }
        }
        let policies = Arc::new(ArcSwap::from_pointee(policies));
        let models = config.models.len();
        let recorders: Vec<ModelRecorder> = config
            .models
            .iter()
            .map(|m| ModelRecorder::new(&m.name, models, m.batch_threshold))
            .collect();
        let model_names: Arc<[String]> = config.models.iter().map(|m| m.name.clone()).collect();
        let live = LiveRequests::default();
        let frontend = bus.as_ref().map(|bus| FrontendRequests::new(bus.clone()));
        let timeout = Duration::from_millis(config.runtime.batch_timeout_ms);
        let batch_arbiter = Arbiter::new();
        let batchers: Vec<Option<Addr<BatcherActor>>> = config
            .models
            .iter()
            .zip(&recorders)
            .zip(&hosted)
            .map(|((m, recorder), &here)| {
                here.then(|| {
                    let (live, recorder) = (live.clone(), recorder.clone());
                    let delayed = mode == ExecutionMode::Tokenrouter;
                    let gate = BatchGate::new(delayed, m.batch_threshold, timeout);
                    BatcherActor::start_in_arbiter(&batch_arbiter.handle(), move |_| {
                        BatcherActor::new(gate, live, recorder)
                    })
                })
            })
            .collect();
        let links: Vec<ModelLink> = batchers
            .iter()
            .zip(&model_names[..])
            .enumerate()
            .map(|(idx, (batcher, name))| match (batcher, &bus) {
                (Some(batcher), _) => ModelLink::Local(batcher.clone()),
                (None, Some(bus)) => ModelLink::Remote(Arc::new(RemoteModel {
                    bus: bus.clone(),
                    idx,
                    name: name.as_str().into(),
                })),
                (None, None) => unreachable!("a model hosted elsewhere needs the bus"),
            })
            .collect();
        let controller = Arc::new(Mutex::new(None));
        let tuner_arbiter = (matches!(role, Role::Frontend)
            && mode == ExecutionMode::Tokenrouter
            && config.runtime.retune_interval_ms > 0)
            .then(|| {
                let arbiter = Arbiter::new();
                let settings = TunerSettings {
                    interval: Duration::from_millis(config.runtime.retune_interval_ms),
                    max_requests: config.runtime.retune_max_requests.max(1),
                    timeout_ms: config.runtime.batch_timeout_ms as f64,
                    latency_prior: latency_priors
                        .iter()
                        .map(|p| p.map(|[a_ms, c_ms]| AffineLatency { a_ms, c_ms }))
                        .collect(),
                };
                let (recorders, live, links, published) = (
                    recorders.clone(),
                    live.clone(),
                    links.clone(),
                    controller.clone(),
                );
                TunerActor::start_in_arbiter(&arbiter.handle(), move |_| {
                    TunerActor::new(settings, recorders, live, links, published)
                });
                arbiter
            });
        let global_step_lock = match (mode, &bus) {
            (ExecutionMode::Lockstep, None) => Some(StepLock::Local(Arc::default())),
            (ExecutionMode::Lockstep, Some(bus)) => {
                if matches!(role, Role::Frontend) {
                    serve_step_lock(bus)?;
                }
                Some(BusStepLock::connect(bus)?)
            }
            _ => None,
        };
        let mut model_arbiters = Vec::new();
        let mut hosted_models = Vec::new();
        for (idx, (executor, model_config)) in executors.into_iter().zip(&config.models).enumerate()
        {
            let (Some(executor), Some(batcher)) = (executor, batchers[idx].clone()) else {
                continue;
            };
            let arbiter = Arbiter::new();
            let parts = ModelActorParts {
                idx,
                executor,
                mode,
                batcher: batcher.clone(),
                peers: links.clone(),
                live: live.clone(),
                recorder: recorders[idx].clone(),
                global_step_lock: global_step_lock.clone(),
                fault_every_steps: model_config.fault_every_steps,
                model_names: model_names.clone(),
                step_limits: step_limits[idx],
            };
            let model =
                Supervisor::start_in_arbiter(&arbiter.handle(), move |_| ModelActor::new(parts));
            batcher.do_send(AttachModel(model));
            model_arbiters.push(arbiter);
            hosted_models.push(HostedModel {
                name: model_config.name.clone(),
                batcher,
            });
        }
        if let (Some(bus), Some(frontend)) = (&bus, &frontend) {
            let side = BusSide {
                bus: bus.clone(),
                policies: policies.clone(),
                built: Arc::default(),
                config: Arc::new(config.clone()),
                hidden_sizes: hidden_sizes.clone().into(),
                live: live.clone(),
                frontend: frontend.clone(),
                ended: Arc::default(),
                owners: Arc::default(),
            };
            let names: Vec<String> = hosted_models.iter().map(|m| m.name.clone()).collect();
            let (here, elsewhere_records): (Vec<_>, Vec<_>) = hosted
                .iter()
                .zip(model_names.iter().cloned().zip(recorders.iter().cloned()))
                .partition(|(&here, _)| here);
            side.share_records(here.into_iter().map(|(_, r)| r).collect());
            side.follow_records(elsewhere_records.into_iter().map(|(_, r)| r).collect())?;
            side.follow_frontends(hosted_models.iter().map(|m| m.batcher.clone()).collect())?;
            for model in hosted_models {
                bus.answer_pings(&model.name)?;
                side.serve_model(model)?;
            }
            side.serve_clients()?;
            let (load, owned) = (live.clone(), frontend.clone());
            bus.beat_for(names, move || load.here(), move || owned.len());
            let elsewhere: Vec<(usize, String)> = hosted
                .iter()
                .enumerate()
                .filter(|(_, &here)| !here)
                .map(|(idx, _)| (idx, model_names[idx].clone()))
                .collect();
            let (watcher, names) = (frontend.clone(), model_names.clone());
            bus.watch(elsewhere.clone(), move |idx, host, up| {
                if !up {
                    watcher.fail_placed_on(idx, &names[idx], host);
                }
            })?;
            bus.ping(elsewhere.iter().map(|(_, name)| name.clone()).collect());
            // A front end takes requests once every model's host listens (it beats only then).
            if matches!(role, Role::Frontend) {
                let join_timeout = config.cluster.as_ref().map_or(0, |c| c.join_timeout_ms);
                for (_, name) in &elsewhere {
                    let waited = Instant::now();
                    while !bus.has_beaten(name) {
                        if waited.elapsed() >= Duration::from_millis(join_timeout) {
                            return Err(ClusterError::NoHost {
                                model: name.clone(),
                                waited_ms: join_timeout,
                            }
                            .into());
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                }
            }
        }
        // Request ids from several front ends must not meet in one model's KV.
        let first_rid = match &bus {
            Some(_) => (u64::from(rand::random::<u16>()) << 40) + 1,
            None => 1,
        };
        Ok(Self {
            models: links,
            model_names: model_names.to_vec(),
            model_arbiters,
            batch_arbiter,
            tuner_arbiter,
            controller,
            policies,
            config: Mutex::new(config.clone()),
            hidden_sizes,
            context_length,
            longest_sequences,
            grammar_vocabularies: (0..tokenizers.count()).map(|_| OnceLock::new()).collect(),
            tokenizers,
            eos,
            live,
            frontend,
            bus,
            next_rid: AtomicU64::new(first_rid),
            recorders,
            mode,
        })
    }

    pub fn mode(&self) -> ExecutionMode {
        self.mode
    }

    /// The tokenizer of the first model's vocabulary: token-id prompts are read in it.
    pub fn tokenizer(&self) -> Result<&Arc<ModelTokenizer>, RuntimeError> {
        self.tokenizers.first().ok_or_else(no_tokenizer)
    }

    /// Vocabulary `v`'s tokenizer (`ValidRequest::vocabulary`, `Runtime::vocabulary_of`).
    pub fn tokenizer_of(&self, v: usize) -> Result<&Arc<ModelTokenizer>, RuntimeError> {
        match v < self.tokenizers.count() {
            true => Ok(self.tokenizers.tokenizer(v)),
            false => Err(no_tokenizer()),
        }
    }

    /// Per model, the bytes each token of its vocabulary spells (built by the first caller:
    /// ~0.2 s for 49k tokens, ~1 s for 262k).
    pub fn spellings(&self) -> Result<Vec<Arc<Spelling>>, RuntimeError> {
        if self.tokenizers.count() == 0 {
            return Err(no_tokenizer());
        }
        let spellings = (0..self.tokenizers.count())
            .map(|v| self.tokenizers.spelling(v))
            .collect::<Result<Vec<_>, _>>()?;
        Ok((0..self.models.len())
            .map(|m| spellings[self.tokenizers.of(m)].clone())
            .collect())
    }

    /// The tokens that end a generation of `model` (unless it ignores them).
    pub fn eos_tokens(&self, model: usize) -> &BTreeSet<u32> {
        &self.eos[self.tokenizers.of(model)]
    }

    /// Whether some model reads another vocabulary than the first.
    pub fn has_several_vocabularies(&self) -> bool {
        self.tokenizers.count() > 1
    }

    /// The text of tokens `writers` wrote (one model index per token), without special
    /// tokens: decoded by the tokenizer when every model reads one vocabulary, spelled
    /// token by token in each writer's vocabulary otherwise.
    pub fn text_of(&self, tokens: &[u32], writers: &[usize]) -> Result<String, RuntimeError> {
        if !self.has_several_vocabularies() {
            return Ok(self.tokenizer()?.decode(tokens, true)?);
        }
        let spellings = self.spellings()?;
        let bytes: Vec<u8> = tokens
            .iter()
            .zip(writers)
            .flat_map(|(&t, &m)| spellings[m].bytes(t).to_vec())
            .collect();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// Which vocabulary model `model` reads (0 for the first model's; numbered in order of
    /// first appearance): `Prompt::in_vocabulary` takes it.
    pub fn vocabulary_of(&self, model: usize) -> usize {
        self.tokenizers.of(model)
    }

    /// `text` as a prompt in every vocabulary the models read.
    pub fn encode(&self, text: &str) -> Result<Prompt, EngineError> {
        self.tokenizers.encode(text)
    }

    /// `messages` rendered by each vocabulary's chat template, as a prompt in each.
    pub fn render(&self, messages: &[ChatMessage]) -> Result<Prompt, EngineError> {
        self.tokenizers.render(messages)
    }

    pub fn context_length(&self) -> usize {
        self.context_length
    }

    /// The most tokens (prompt + max_tokens) a request may ask for: the shortest context,
    /// and no longer than any model's whole KV budget holds.
    pub fn request_token_limit(&self) -> usize {
        self.longest_sequences
            .iter()
            .map(|(_, capacity)| *capacity)
            .fold(self.context_length, usize::min)
    }

    /// Every figure the runtime keeps, as of now.
    pub fn snapshot(&self) -> RuntimeSnapshot {
        RuntimeSnapshot {
            mode: self.mode,
            live_requests: self.live.len(),
            models: self.recorders.iter().map(ModelRecorder::snapshot).collect(),
            controller: *self.controller.lock().unwrap_or_else(|e| e.into_inner()),
        }
    }

    pub fn model_names(&self) -> Vec<&str> {
        self.model_names.iter().map(String::as_str).collect()
    }

    /// The current registry (a snapshot: later swaps do not change it).
    pub fn policies(&self) -> Arc<PolicyRegistry> {
        self.policies.load_full()
    }

    /// Applies a run-time policy change: validated and built whole, then swapped in
    /// atomically; on error nothing changes. Returns the new registry.
    pub fn update_policies(
        &self,
        update: &PolicyUpdate,
    ) -> Result<Arc<PolicyRegistry>, RuntimeError> {
        self.swap_policies(|config| config.with_policy_update(update))
    }

    /// Takes the policies and default policy of a re-read config file (SIGHUP).
    pub fn reload_policies(&self, reloaded: &Config) -> Result<Arc<PolicyRegistry>, RuntimeError> {
        self.swap_policies(|config| config.with_policies_of(reloaded))
    }

    fn swap_policies(
        &self,
        next_config: impl FnOnce(&Config) -> Result<Config, ConfigError>,
    ) -> Result<Arc<PolicyRegistry>, RuntimeError> {
        let mut config = self.config.lock().unwrap_or_else(|e| e.into_inner());
        let next = next_config(&config)?;
        let registry = Arc::new(PolicyRegistry::from_config(&next, &self.hidden_sizes)?);
        refuse_mixing_vocabularies(&registry, &self.tokenizers, &self.model_names())?;
        self.policies.store(registry.clone());
        *config = next;
        telemetry::policy_swapped();
        Ok(registry)
    }

    /// Each model's delayed-batching threshold in force.
    pub fn thresholds(&self) -> Vec<usize> {
        self.recorders
            .iter()
            .map(|r| r.read(|m| m.threshold))
            .collect()
    }

    /// The replicas of the models other processes host, as this process sees them.
    pub fn replicas(&self) -> Vec<ReplicaStatus> {
        self.bus.as_ref().map_or_else(Vec::new, Bus::replica_status)
    }

    /// Round trips of pings to remote replicas since the last call (`[cluster]`).
    pub fn take_bus_round_trips(&self) -> Vec<Duration> {
        self.bus
            .as_ref()
            .map_or_else(Vec::new, Bus::take_round_trips)
    }

    /// Transits of handoffs that came over the bus to models hosted here, since the last call.
    pub fn take_handoff_transits(&self) -> Vec<Duration> {
        self.bus
            .as_ref()
            .map_or_else(Vec::new, Bus::take_handoff_transits)
    }

    /// Requests that have not ended yet.
    pub fn live_requests(&self) -> usize {
        self.live.len()
    }

    /// KV tokens held per model, as last reported by the model actors.
    pub fn kv_tokens_used(&self) -> Vec<usize> {
        self.recorders
            .iter()
            .map(|r| r.read(|m| m.kv_tokens_used))
            .collect()
    }

    /// Checks a request against the policy registry, the models' context and each routed
    /// model's KV budget, once: the runtime never re-checks a `ValidRequest`.
    pub fn validate(&self, request: GenerateRequest) -> Result<ValidRequest, RuntimeError> {
        let registry = self.policies.load();
        let policy = match &request.policy {
            Some(name) => registry
                .get(name)
                .ok_or_else(|| RuntimeError::UnknownPolicy(name.clone()))?,
            None => registry.default_policy(),
        };
        let max_tokens = request.max_tokens;
        if request.prompt.tokens().is_empty() {
            return Err(InvalidRequest::EmptyPrompt.into());
        }
        if max_tokens == 0 {
            return Err(InvalidRequest::NoTokensAsked.into());
        }
        for &m in policy.models() {
            // Each model reads the prompt in its own vocabulary.
            let prompt = request
                .prompt
                .in_vocabulary(self.tokenizers.of(m))
                .ok_or_else(|| InvalidRequest::PromptVocabulary {
                    policy: policy.name().to_string(),
                    model: self.model_names[m].clone(),
                })?
                .len();
            let needed = prompt.saturating_add(max_tokens);
            if needed > self.context_length {
                return Err(InvalidRequest::Context {
                    prompt,
                    max_tokens,
                    context: self.context_length,
                }
                .into());
            }
            let (model, capacity) = &self.longest_sequences[m];
            if needed > *capacity {
                return Err(InvalidRequest::KvBudget {
                    prompt,
                    max_tokens,
                    model: model.clone(),
                    capacity: *capacity,
                }
                .into());
            }
        }
        Ok(ValidRequest {
            across_vocabularies: self.tokenizers.spans(policy.models()),
            vocabulary: policy
                .models()
                .first()
                .map_or(0, |&m| self.tokenizers.of(m)),
            prompt_tokens: self.prompt_tokens(&request.prompt, &policy),
            prompt: request.prompt,
            policy_spec: registry.spec(policy.name()),
            policy,
            max_tokens,
            sampling: request.sampling,
            timeout: request.timeout,
            ignore_eos: request.ignore_eos,
            logprobs: None,
            grammar: None,
        })
    }

    /// Compiles `format` into a request's grammar over every model's vocabulary, so a schema
    /// llguidance cannot serve fails before any generation. CPU-bound (a large schema takes
    /// milliseconds to seconds): the server calls it off its event loop.
    pub fn compile(&self, format: &OutputFormat) -> Result<Arc<RequestGrammar>, RuntimeError> {
        if self.bus.is_some() {
            return Err(InvalidRequest::Unconstrainable(
                "is not served with models in other processes ([cluster])",
            )
            .into());
        }
        self.tokenizer()?;
        let by_vocabulary = (0..self.tokenizers.count())
            .map(|v| -> Result<Arc<Vocabulary>, RuntimeError> {
                if let Some(vocabulary) = self.grammar_vocabularies[v].get() {
                    return Ok(vocabulary.clone());
                }
                let eos = self.tokenizers.tokenizer(v).eos.clone();
                let spelling = self.tokenizers.spelling(v)?;
                let built = Vocabulary::new(&spelling, eos, ParserLimits::default())?;
                Ok(self.grammar_vocabularies[v].get_or_init(|| built).clone())
            })
            .collect::<Result<Vec<_>, _>>()?;
        // Models of one vocabulary share its matcher; a handoff into another vocabulary
        // advances that one's by the committed bytes.
        let vocabularies: Vec<Arc<Vocabulary>> = (0..self.models.len())
            .map(|m| by_vocabulary[self.tokenizers.of(m)].clone())
            .collect();
        let grammar = RequestGrammar::new(format, &vocabularies).map_err(InvalidRequest::from)?;
        Ok(Arc::new(grammar))
    }

    /// Constrains a validated request's output by a grammar from `compile`.
    pub fn constrain(
        &self,
        request: ValidRequest,
        grammar: Arc<RequestGrammar>,
    ) -> Result<ValidRequest, RuntimeError> {
        if request.ignore_eos {
            return Err(InvalidRequest::Unconstrainable(
                "needs end-of-sequence to end the output (not `ignore_eos`)",
            )
            .into());
        }
        Ok(ValidRequest {
            grammar: Some(grammar),
            ..request
        })
    }

    /// Validates and starts a generation.
    pub fn submit(&self, request: GenerateRequest) -> Result<RequestHandle, RuntimeError> {
        Ok(self.launch(self.validate(request)?))
    }

    /// The prompt's length in the vocabulary of the policy's first model: what `usage`
    /// reports.
    fn prompt_tokens(&self, prompt: &Prompt, policy: &SharedPolicy) -> usize {
        let v = policy
            .models()
            .first()
            .map_or(0, |&m| self.tokenizers.of(m));
        prompt.in_vocabulary(v).map_or(0, <[u32]>::len)
    }

    /// Starts a validated generation; its tokens arrive on the handle's event stream.
    pub fn launch(&self, request: ValidRequest) -> RequestHandle {
        let ValidRequest {
            prompt,
            across_vocabularies: _,
            vocabulary: _,
            prompt_tokens,
            policy,
            policy_spec,
            max_tokens,
            sampling,
            timeout,
            ignore_eos,
            logprobs,
            grammar,
        } = request;
        let rid = RequestId(self.next_rid.fetch_add(1, Ordering::Relaxed));
        let seed = sampling.seed;
        let entry = policy.entry(&RequestInfo {
            rid,
            prompt_len: prompt_tokens,
            seed,
        });
        let eos: Vec<Arc<BTreeSet<u32>>> = if ignore_eos {
            vec![Arc::default(); self.eos.len()]
        } else {
            self.eos.clone()
        };
        let (first_prompt, cross) = match self.tokenizers.cross() {
            Some(vocabularies) if self.tokenizers.spans(policy.models()) => {
                let (cross, first) = CrossVocab::new(
                    vocabularies.clone(),
                    prompt.into_vocabularies(),
                    eos.clone(),
                    entry,
                    prompt_tokens,
                );
                (first, Some(Box::new(cross)))
            }
            _ => {
                let v = self.tokenizers.of(entry);
                let first = prompt.in_vocabulary(v).expect("validated").to_vec();
                (first, None)
            }
        };
        let mut state = RoutingState::new(rid, first_prompt, self.models.len(), seed);
        state.current = entry;
        let (tx, rx) = unbounded_channel();
        self.live.insert(rid);
        let actor = RequestActor::new(
            rid,
            policy.name(),
            tx,
            self.models.clone(),
            self.live.clone(),
            self.frontend
                .clone()
                .map(|f| Arc::new(f) as Arc<dyn OwnRequests>),
            timeout,
        )
        .start();
        if let Some(frontend) = &self.frontend {
            frontend.insert(rid, actor.clone());
        }
        let policy_name = policy.name().to_string();
        let in_flight = InFlight {
            stats: RoutingStats {
                tokens_per_model: vec![0; self.models.len()],
                handoffs: 0,
            },
            params: RequestParams {
                max_tokens,
                sampling,
                eos: eos[self.tokenizers.of(entry)].clone(),
                policy,
                policy_spec,
                logprobs,
            },
            state,
            client: Client::Local(actor.clone()),
            handoff: None,
            arrived: Instant::now(),
            timing: EngineTiming::default(),
            hosts: vec![None; self.models.len()],
            grammar,
            cross,
        };
        actor.do_send(Start(in_flight));
        RequestHandle {
            rid,
            policy: policy_name,
            events: rx,
            actor,
            submitted: Instant::now(),
        }
    }

    /// Stops every actor thread.
    pub fn shutdown(&self) {
        if let Some(bus) = &self.bus {
            bus.close();
        }
        for arbiter in &self.model_arbiters {
            arbiter.stop();
        }
        self.batch_arbiter.stop();
        if let Some(tuner) = &self.tuner_arbiter {
            tuner.stop();
        }
    }
}

fn facts_of(executor: &dyn StepExecutor, mode: ExecutionMode, host: &str) -> ModelFacts {
    ModelFacts {
        host: host.to_string(),
        mode,
        vocab_size: executor.vocab_size(),
        hidden_size: executor.hidden_size(),
        context_length: executor.context_length(),
        longest_sequence_tokens: executor.kv().longest_sequence(),
    }
}

fn no_tokenizer() -> RuntimeError {
    RuntimeError::InvalidRequest("every model is a latency-profile simulation: no tokenizer".into())
}

/// Models that read one vocabulary must agree on its size (over the bus every model reads
/// the first one's).
fn check_vocabularies(
    names: &[&str],
    facts: &[ModelFacts],
    tokenizers: &Tokenizers,
) -> Result<(), RuntimeError> {
    for (m, f) in facts.iter().enumerate() {
        let first = (0..m).find(|&o| tokenizers.of(o) == tokenizers.of(m));
        if let Some(o) = first.filter(|&o| facts[o].vocab_size != f.vocab_size) {
            return Err(RuntimeError::InvalidRequest(format!(
                "model `{}` has a vocabulary of {} tokens, `{}` has {}; models with one \
                 tokenizer must share its vocabulary (and over a [cluster] bus every routed \
                 model must)",
                names[m], f.vocab_size, names[o], facts[o].vocab_size
            )));
        }
    }
    Ok(())
}

/// Co-LLM and the mixture ensemble combine the models' distributions over one vocabulary:
/// a pair that reads two cannot run them.
fn refuse_mixing_vocabularies(
    registry: &PolicyRegistry,
    tokenizers: &Tokenizers,
    names: &[&str],
) -> Result<(), RuntimeError> {
    for policy in registry.all() {
        let info = policy.describe();
        if matches!(info.kind, PolicyKind::Colm | PolicyKind::Me) && tokenizers.spans(&info.models)
        {
            let models: Vec<&str> = info.models.iter().map(|&m| names[m]).collect();
            return Err(RuntimeError::InvalidRequest(format!(
                "policy `{}` ({}) combines its models' next-token distributions, which needs \
                 one vocabulary; its models {} read different vocabularies (route across them \
                 with r2r, citer or rstitch)",
                info.name,
                info.kind,
                models.join(", ")
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CLI prints an error with its chain of sources: an invalid request's reason must
    /// appear once.
    #[test]
    fn an_invalid_request_says_its_reason_once() {
        let reason = InvalidRequest::EmptyPrompt.to_string();
        let printed = format!(
            "{:#}",
            anyhow::Error::from(RuntimeError::from(InvalidRequest::EmptyPrompt))
        );
        assert_eq!(printed.matches(&reason).count(), 1, "{printed}");
    }
}

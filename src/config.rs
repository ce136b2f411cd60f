//! The TOML configuration: schema, defaults and validation in one place.

use crate::error::ConfigError;
use crate::runtime::core::StepLimits;
use serde::Deserialize;
use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

pub const DEFAULT_CONFIG_PATH: &str = "config/default.toml";

/// The default config and the step profiles and router weights it names, carried by the
/// binary: where such a relative path does not exist (a binary copied into an empty
/// directory), its carried copy is read instead.
const CARRIED_FILES: [(&str, &[u8]); 5] = [
    (
        DEFAULT_CONFIG_PATH,
        include_bytes!("../config/default.toml"),
    ),
    (
        "config/profiles/smollm2-135m.json",
        include_bytes!("../config/profiles/smollm2-135m.json"),
    ),
    (
        "config/profiles/smollm2-135m-skip7.json",
        include_bytes!("../config/profiles/smollm2-135m-skip7.json"),
    ),
    (
        "config/routers/r2r.safetensors",
        include_bytes!("../config/routers/r2r.safetensors"),
    ),
    (
        "config/routers/citer.safetensors",
        include_bytes!("../config/routers/citer.safetensors"),
    ),
];

/// Reads `path`, or the binary's carried copy of it when it does not exist.
pub fn read_or_carried(path: &Path) -> std::io::Result<Vec<u8>> {
    match std::fs::read(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            match CARRIED_FILES
                .iter()
                .find(|(name, _)| Path::new(name) == path)
            {
                Some((name, bytes)) => {
                    tracing::info!("{name} not found here: using the copy built into the binary");
                    Ok(bytes.to_vec())
                }
                None => Err(e),
            }
        }
        other => other,
    }
}

fn read_text_or_carried(path: &Path) -> std::io::Result<String> {
    String::from_utf8(read_or_carried(path)?)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub models: Vec<ModelConfig>,
    #[serde(default)]
    pub runtime: RuntimeConfig,
    #[serde(default)]
    pub policies: Vec<PolicyConfig>,
    #[serde(default)]
    pub tuning: Option<TuningConfig>,
    #[serde(default)]
    pub server: ServerConfig,
    /// The NATS bus between processes, when some model runs in a `tokenrouter worker`.
    #[serde(default)]
    pub cluster: Option<ClusterConfig>,
}

/// `[cluster]`: how this process reaches the others (docs/deployment.md).
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    /// The NATS server, e.g. `nats://10.0.0.5:4222` (`tls://` for TLS).
    pub url: String,
    /// The server's auth token. Prefer `token_env`: a config file is often readable by more
    /// people than the process's environment.
    #[serde(default)]
    pub token: Option<String>,
    /// Environment variable holding the token, read when `token` is absent.
    #[serde(default = "default_token_env")]
    pub token_env: String,
    /// Subjects start with this, so several deployments can share one NATS server.
    #[serde(default = "default_subject_prefix")]
    pub subject_prefix: String,
    /// Every process hosting a model says so this often; a model is down after three
    /// missed beats.
    #[serde(default = "default_heartbeat_ms")]
    pub heartbeat_ms: u64,
    /// How long a process waits at start for the models it does not host to announce
    /// themselves.
    #[serde(default = "default_join_timeout_ms")]
    pub join_timeout_ms: u64,
    /// PEM file of the CA that signed the server's certificate; turns TLS on.
    #[serde(default)]
    pub tls_ca: Option<PathBuf>,
    /// File holding this process's NATS nkey seed (`SU...`), for a server that
    /// authenticates users by key pair; `nkey_seed_env` is read when absent.
    #[serde(default)]
    pub nkey_seed_file: Option<PathBuf>,
    /// Environment variable holding the nkey seed.
    #[serde(default = "default_nkey_seed_env")]
    pub nkey_seed_env: String,
}

/// Never prints the token.
impl std::fmt::Debug for ClusterConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterConfig")
            .field("url", &self.url)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("token_env", &self.token_env)
            .field("subject_prefix", &self.subject_prefix)
            .field("heartbeat_ms", &self.heartbeat_ms)
            .field("join_timeout_ms", &self.join_timeout_ms)
            .field("tls_ca", &self.tls_ca)
            .field("nkey_seed_file", &self.nkey_seed_file)
            .field("nkey_seed_env", &self.nkey_seed_env)
            .finish()
    }
}

impl ClusterConfig {
    /// The bus at `url` with every other setting at its default.
    pub fn at(url: &str) -> Self {
        Self {
            url: url.to_string(),
            token: None,
            token_env: default_token_env(),
            subject_prefix: default_subject_prefix(),
            heartbeat_ms: default_heartbeat_ms(),
            join_timeout_ms: default_join_timeout_ms(),
            tls_ca: None,
            nkey_seed_file: None,
            nkey_seed_env: default_nkey_seed_env(),
        }
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let field = |f: &str, why: &str| Err(ConfigError::Invalid(format!("cluster.{f}: {why}")));
        if self.url.trim().is_empty() {
            return field(
                "url",
                "must name the NATS server, e.g. nats://127.0.0.1:4222",
            );
        }
        let subject_token_ok = |t: &str| {
            !t.is_empty() && !t.contains(|c: char| c.is_whitespace() || "*>.".contains(c))
        };
        if !self.subject_prefix.split('.').all(subject_token_ok) {
            return field(
                "subject_prefix",
                "must be dot-separated NATS subject tokens without spaces, `*` or `>`",
            );
        }
        if self.heartbeat_ms == 0 {
            return field("heartbeat_ms", "must be at least 1");
        }
        Ok(())
    }

    /// The nkey seed from `nkey_seed_file`, else from `nkey_seed_env`.
    pub fn nkey_seed(&self) -> Result<Option<String>, ConfigError> {
        let seed = match &self.nkey_seed_file {
            Some(path) => std::fs::read_to_string(path).map(Some).map_err(|e| {
                ConfigError::Invalid(format!(
                    "cluster.nkey_seed_file: cannot read {}: {e}",
                    path.display()
                ))
            })?,
            None => std::env::var(&self.nkey_seed_env).ok(),
        };
        Ok(seed.map(|s| s.trim().to_string()).filter(|s| !s.is_empty()))
    }

    /// The token from the config, else from `token_env`.
    pub fn token(&self) -> Option<String> {
        self.token
            .clone()
            .or_else(|| std::env::var(&self.token_env).ok())
            .filter(|t| !t.is_empty())
    }
}

fn default_token_env() -> String {
    "TOKENROUTER_NATS_TOKEN".into()
}

fn default_nkey_seed_env() -> String {
    "TOKENROUTER_NATS_NKEY_SEED".into()
}

fn default_subject_prefix() -> String {
    "tokenrouter".into()
}

fn default_heartbeat_ms() -> u64 {
    1000
}

fn default_join_timeout_ms() -> u64 {
    60_000
}

/// The priority of a GPU model's stream: where two models share a GPU, the scheduler runs a
/// high-priority stream's ready blocks first (the SLM's short steps between the LLM's).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StreamPriority {
    #[default]
    Normal,
    High,
}

/// Which process runs a model: `tokenrouter serve` itself, or a `tokenrouter worker`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    #[default]
    Local,
    Remote,
}

/// `tokenrouter serve`: where it listens and what it accepts.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    pub host: String,
    pub port: u16,
    /// HTTP worker threads (they only parse, validate and stream; the models have their own).
    pub workers: usize,
    /// Largest request body accepted (413 beyond).
    pub max_body_bytes: usize,
    /// Longest prompt accepted, in tokens (400 beyond).
    pub max_prompt_tokens: usize,
    /// Largest `max_tokens` a request may ask for.
    pub max_tokens_limit: usize,
    /// Generations running at once; more wait in a queue of `max_queued_requests`, and
    /// beyond that get 429.
    pub max_concurrent_requests: usize,
    pub max_queued_requests: usize,
    /// Default per-request deadline in seconds (a request's `timeout` may shorten it).
    pub request_timeout_s: f64,
    /// After SIGTERM/SIGINT: how long running requests may take to finish.
    pub shutdown_grace_s: u64,
    /// Bearer token of the admin routes; `TOKENROUTER_ADMIN_TOKEN` overrides it. Without
    /// either, the admin routes are disabled.
    pub admin_token: Option<String>,
    /// Open connections per HTTP worker; further ones wait in the kernel's backlog. Each
    /// takes a file descriptor: keep `workers × max_connections` under `ulimit -n`.
    pub max_connections: usize,
    /// How long an idle keep-alive connection stays open; 0 closes after each response.
    pub keep_alive_s: f64,
    /// A client must send a request's headers within this, or gets 408 and is closed (idle
    /// and slow-loris clients do not hold connections).
    pub header_timeout_ms: u64,
    /// A request's body must arrive within this after its headers, or it gets 408 and the
    /// connection is closed (actix-web has no knob for body reads; the handlers time them).
    pub body_timeout_ms: u64,
    /// How long a closing connection may take to shut down cleanly before it is dropped.
    pub disconnect_timeout_ms: u64,
    /// A streaming client that reads nothing for this long while tokens wait (its socket
    /// buffer is full) is treated like a disconnect: its request is cancelled and its KV
    /// freed. 0 turns it off.
    pub stream_stall_timeout_ms: u64,
    /// Each connection's kernel send buffer (SO_SNDBUF; Linux doubles it). It bounds what a
    /// client that stops reading can leave unread before its stream counts as stalled (the
    /// kernel's autotuning would let it grow to megabytes); 0 leaves the kernel's default.
    pub send_buffer_bytes: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8080,
            workers: 2,
            max_body_bytes: 1 << 20,
            max_prompt_tokens: 4096,
            max_tokens_limit: 4096,
            max_concurrent_requests: 64,
            max_queued_requests: 256,
            request_timeout_s: 600.0,
            shutdown_grace_s: 30,
            admin_token: None,
            max_connections: 2048,
            keep_alive_s: 5.0,
            header_timeout_ms: 5000,
            body_timeout_ms: 10_000,
            disconnect_timeout_ms: 1000,
            stream_stall_timeout_ms: 10_000,
            send_buffer_bytes: 65_536,
        }
    }
}

/// A change to the policy registry at run time (`PUT /admin/policy`): a new default and/or
/// per-policy fields. A patch of an unknown name defines a new policy (`kind` and `models`
/// then required).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyUpdate {
    #[serde(default)]
    pub default: Option<String>,
    #[serde(default)]
    pub policies: BTreeMap<String, PolicyPatch>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyPatch {
    pub kind: Option<PolicyKind>,
    pub models: Option<Vec<String>>,
    pub weights: Option<Vec<f64>>,
    pub threshold: Option<f32>,
    pub router: Option<PathBuf>,
}

/// Inputs of the delayed-batching model for `tokenrouter tune` (per model, in config order).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TuningConfig {
    /// `routing[i][j]`: probability that a step on model i is followed by one on j.
    pub routing: Vec<Vec<f64>>,
    /// `commits[i][j]`: tokens committed on that transition.
    pub commits: Vec<Vec<f64>>,
    /// Per model `[a, c]`: step latency a + c·batch in ms (empty: the models' step profiles).
    #[serde(default)]
    pub latency_ms: Vec<[f64; 2]>,
    /// B*(N) is tabulated for N = 1..=max_requests.
    #[serde(default = "default_max_requests")]
    pub max_requests: usize,
    #[serde(default = "default_delta_ms")]
    pub delta_ms: f64,
}

fn default_max_requests() -> usize {
    8
}

fn default_delta_ms() -> f64 {
    0.1
}

/// How requests move between model actors.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuntimeConfig {
    #[serde(default)]
    pub mode: ExecutionMode,
    /// Policy for requests that name none; a policy or a model name. Defaults to the first
    /// configured policy, or the first model alone.
    #[serde(default)]
    pub default_policy: Option<String>,
    /// Longest time an arrival waits in a batcher for its threshold (`tokenrouter` mode).
    #[serde(default = "default_batch_timeout_ms")]
    pub batch_timeout_ms: u64,
    /// `tokenrouter` mode: how often thresholds are re-derived from the Markov model with
    /// online estimates of routing and step latency; 0 keeps each model's `batch_threshold`.
    #[serde(default = "default_retune_interval_ms")]
    pub retune_interval_ms: u64,
    /// Largest live-request count the online model is solved for.
    #[serde(default = "default_retune_max_requests")]
    pub retune_max_requests: usize,
    /// Each model keeps the KV of ended requests and of prefixes requests share, indexed by
    /// tokens, and a new sequence starts on its longest cached prefix (evicted LRU when the
    /// KV budget needs the room). Off, every request computes its whole prompt.
    #[serde(default = "default_true")]
    pub prefix_cache: bool,
    /// Every row a model holds (a decode, a prompt chunk, a catch-up) runs within this many
    /// of its steps of becoming ready, whatever the step budget says (>= 1).
    #[serde(default = "default_max_wait_steps")]
    pub max_wait_steps: usize,
}

fn default_true() -> bool {
    true
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self {
            mode: ExecutionMode::default(),
            default_policy: None,
            batch_timeout_ms: default_batch_timeout_ms(),
            retune_interval_ms: default_retune_interval_ms(),
            retune_max_requests: default_retune_max_requests(),
            prefix_cache: true,
            max_wait_steps: default_max_wait_steps(),
        }
    }
}

fn default_max_wait_steps() -> usize {
    4
}

fn default_batch_timeout_ms() -> u64 {
    20
}

fn default_retune_interval_ms() -> u64 {
    1000
}

fn default_retune_max_requests() -> usize {
    8
}

/// The four execution modes (same code, one switch; `docs/architecture.md`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ExecutionMode {
    /// One model steps at a time across the whole system (the algorithms' official loops).
    Lockstep,
    /// Each model as an independent server: a returning request is a new request
    /// (prefix lookup, fresh KV allocation, copy, extend).
    Standard,
    /// Pending/resume; each model launches as soon as anything is ready.
    Async,
    /// `async` plus delayed batching at per-model thresholds.
    #[default]
    Tokenrouter,
}

impl ExecutionMode {
    pub const ALL: [ExecutionMode; 4] = [
        ExecutionMode::Lockstep,
        ExecutionMode::Standard,
        ExecutionMode::Async,
        ExecutionMode::Tokenrouter,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ExecutionMode::Lockstep => "lockstep",
            ExecutionMode::Standard => "standard",
            ExecutionMode::Async => "async",
            ExecutionMode::Tokenrouter => "tokenrouter",
        }
    }
}

impl std::str::FromStr for ExecutionMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| format!("unknown mode `{s}` (lockstep, standard, async, tokenrouter)"))
    }
}

/// The routing algorithms a policy can run; a config or an admin update naming another
/// kind is refused with the list of these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyKind {
    R2r,
    Citer,
    Rstitch,
    Colm,
    Me,
    Single,
}

impl PolicyKind {
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::R2r => "r2r",
            PolicyKind::Citer => "citer",
            PolicyKind::Rstitch => "rstitch",
            PolicyKind::Colm => "colm",
            PolicyKind::Me => "me",
            PolicyKind::Single => "single",
        }
    }

    /// Kinds that may load learned router weights.
    pub fn takes_router(self) -> bool {
        matches!(self, PolicyKind::R2r | PolicyKind::Citer | PolicyKind::Colm)
    }
}

impl std::fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A named routing policy over configured models.
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyConfig {
    pub name: String,
    pub kind: PolicyKind,
    /// Model names, in the order the algorithm expects (SLM first for two-model policies).
    pub models: Vec<String>,
    /// `me`: one positive weight per model.
    #[serde(default)]
    pub weights: Vec<f64>,
    /// The policy's decision threshold (θ, τ or η); the algorithm's default when absent.
    #[serde(default)]
    pub threshold: Option<f32>,
    /// Learned router weights (safetensors) for `r2r`, `citer` or `colm`; without them the
    /// policy runs its training-free rule and says so.
    #[serde(default)]
    pub router: Option<PathBuf>,
}

/// One served model: a checkpoint, optionally as a variant (layer subset, requantized weights).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    pub name: String,
    /// A `.gguf` file or a Hugging Face directory (`config.json` + `*.safetensors`).
    /// Relative paths are resolved against the working directory.
    #[serde(default)]
    pub path: PathBuf,
    /// SIMULATION: instead of a model, a latency-profile executor whose steps sleep
    /// `[a, c]` → a + c·batch ms (no `path` then); for checking scheduling on any machine.
    #[serde(default)]
    pub latency_profile_ms: Option<[f64; 2]>,
    /// SIMULATION: with `latency_profile_ms`, a step costs a + c·Σ t·(1 + k·(context + (t −
    /// 1)/2)) over its rows (t tokens after `context` positions; k this, a step profile's
    /// `chunk.context_cost`) instead of a + c·rows, so prompts and chunks cost what the CPU
    /// models' do.
    #[serde(default)]
    pub latency_context_cost: Option<f64>,
    /// Size of this model's own compute thread pool.
    #[serde(default = "default_threads")]
    pub threads: usize,
    /// Where the model runs: `"cpu"` or `"cuda:N"` (GPU N, in a build with `--features cuda`).
    #[serde(default)]
    pub device: ModelDevice,
    /// On a GPU, replay decode steps as CUDA graphs captured per bucket of rows (the same
    /// tokens as launching each kernel; a small model's step costs a fraction). Ignored on
    /// the CPU.
    #[serde(default = "default_cuda_graphs")]
    pub cuda_graphs: bool,
    /// On a GPU, the priority of this model's stream. Ignored on the CPU.
    #[serde(default)]
    pub stream_priority: StreamPriority,
    /// KV cache budget in tokens (summed over all sequences this model holds).
    #[serde(default = "default_kv_tokens")]
    pub kv_tokens: usize,
    #[serde(default)]
    pub weights: WeightPrecision,
    /// Decoder layers to run, e.g. `"0-9,20-29"`; all when absent.
    #[serde(default)]
    pub layers: Option<String>,
    /// Delayed-batching threshold B (`tokenrouter` mode): launch once this many requests
    /// are ready, or on timeout, or when every live request is here.
    #[serde(default = "default_batch_threshold")]
    pub batch_threshold: usize,
    /// Fault injection for tests: panic in the forward pass every N steps (0 = never).
    #[serde(default)]
    pub fault_every_steps: u64,
    /// A `tokenrouter bench engine --json` report measured for this model (same weights and
    /// threads): its fitted step latency a + c·b seeds the online tuner and `tune` wherever
    /// `[tuning] latency_ms` does not give one.
    #[serde(default)]
    pub step_profile: Option<PathBuf>,
    /// Most tokens one step appends (a number, or `"unlimited"`): longer prompts and
    /// catch-ups run in chunks so that the decode rows batched with them keep going. When
    /// absent: from the step profile (see `StepProfile::token_budget`), else unlimited.
    #[serde(default)]
    pub step_token_budget: Option<TokenBudget>,
    /// Where `tokenrouter serve` runs it; `remote` needs `[cluster]` and a worker hosting it.
    #[serde(default)]
    pub placement: Placement,
    /// A Jinja chat template file to render conversations with instead of the one the model
    /// ships: a completion prompt for a pretrained model (`config/templates/`).
    #[serde(default)]
    pub chat_template: Option<PathBuf>,
}

/// A model's configured step cost: L(b) = a + c·b ms for b decode rows, and what each
/// further token of a prompt or catch-up adds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepCost {
    pub a_ms: f64,
    pub c_ms: f64,
    pub prefill_ms_per_token: Option<f64>,
}

/// A per-step token budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(try_from = "toml::Value")]
pub enum TokenBudget {
    Tokens(usize),
    Unlimited,
}

impl TryFrom<toml::Value> for TokenBudget {
    type Error = String;

    fn try_from(value: toml::Value) -> Result<Self, Self::Error> {
        match value {
            toml::Value::Integer(n) if n >= 1 => Ok(Self::Tokens(n as usize)),
            toml::Value::String(s) if s == "unlimited" => Ok(Self::Unlimited),
            other => Err(format!(
                "step_token_budget must be a token count >= 1 or \"unlimited\", not {other}"
            )),
        }
    }
}

/// The part of a `bench engine --json` report a step profile needs.
#[derive(Deserialize)]
struct StepProfile {
    fit: StepProfileFit,
    #[serde(default)]
    prefill: Option<StepProfilePrefill>,
    #[serde(default)]
    chunk: Option<StepProfileChunk>,
}

#[derive(Deserialize)]
struct StepProfileFit {
    a_ms: f64,
    c_ms: f64,
}

#[derive(Deserialize)]
struct StepProfilePrefill {
    tokens: usize,
    tokens_per_s: f64,
}

/// One chunk timed early and late in a long prompt: what attending the context costs.
#[derive(Deserialize)]
struct StepProfileChunk {
    context_cost: f64,
}

/// Decode rows a default token budget leaves room for.
const BUDGET_DECODE_ROWS: f64 = 8.0;

/// What a step's prompt or catch-up chunk may add to it, in steps of those decode rows.
const BUDGET_CHUNK_STEPS: f64 = 0.5;

impl StepProfile {
    /// What one token attending one more position costs, in tokens at context 0.
    fn context_cost(&self) -> f64 {
        self.chunk.as_ref().map_or(0.0, |c| c.context_cost)
    }

    /// The default step budget in tokens at context 0: room for 8 decode rows plus a chunk
    /// that costs about half of one of their steps at the measured prefill rate, so a step
    /// carrying a chunk takes about 1.5× an ordinary one, early or late in a long prompt. `None`
    /// without a prefill measurement.
    fn budget(&self) -> Option<f64> {
        let prefill = self.prefill.as_ref()?;
        // The prefill ran from context 0: its tokens' mean cost in tokens at context 0.
        let k = self.context_cost();
        let mean_cost = 1.0 + k * (prefill.tokens as f64 - 1.0) / 2.0;
        let decode_step_ms = self.fit.a_ms + BUDGET_DECODE_ROWS * self.fit.c_ms;
        let chunk = prefill.tokens_per_s * mean_cost * BUDGET_CHUNK_STEPS * decode_step_ms / 1e3;
        (chunk.is_finite() && chunk > 0.0).then(|| (BUDGET_DECODE_ROWS + chunk).ceil())
    }
}

fn default_batch_threshold() -> usize {
    1
}

/// Precision of the matmul weights: as stored in the file, or requantized at load.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightPrecision {
    #[default]
    Stored,
    F32,
    /// Dense 16-bit weights, widened to f32 in the kernels.
    F16,
    Bf16,
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    /// K-quants; rows whose width 256 does not divide fall back to Q5_0 / Q5_1 / Q8_0.
    Q4K,
    Q5K,
    Q6K,
}

/// The processor a model's executor runs on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub enum ModelDevice {
    #[default]
    Cpu,
    /// A CUDA GPU by ordinal.
    Cuda(usize),
}

impl TryFrom<String> for ModelDevice {
    type Error = String;

    fn try_from(value: String) -> Result<Self, Self::Error> {
        value.parse()
    }
}

impl std::str::FromStr for ModelDevice {
    type Err = String;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        let invalid = || format!("device `{value}` is not \"cpu\" or \"cuda:N\" (N a GPU ordinal)");
        match value {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            _ => value
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Self::Cuda)
                .ok_or_else(invalid),
        }
    }
}

impl std::fmt::Display for ModelDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Cpu => write!(f, "cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

fn default_threads() -> usize {
    1
}

/// The shortest header deadline actix-web keeps reliably.
const MIN_HEADER_TIMEOUT_MS: u64 = 1000;

fn default_cuda_graphs() -> bool {
    true
}

fn default_kv_tokens() -> usize {
    32_768
}

impl Config {
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = read_text_or_carried(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            message: e.to_string(),
        })
    }

    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let config: Config =
            toml::from_str(text).map_err(|e| ConfigError::Invalid(e.message().to_string()))?;
        config.validate()?;
        Ok(config)
    }

    /// The config of a single-model server for `model`: only that model, served alone under
    /// its own name with eager batching (what a standard one-model engine does); the
    /// routing policies and the tuner go, the server settings stay.
    pub fn only_model(&self, model: &str) -> Result<Config, ConfigError> {
        let Some(found) = self.models.iter().find(|m| m.name == model) else {
            let names: Vec<&str> = self.models.iter().map(|m| m.name.as_str()).collect();
            return Err(ConfigError::Invalid(format!(
                "no model `{model}` in the config (models: {})",
                names.join(", ")
            )));
        };
        let config = Config {
            models: vec![ModelConfig {
                placement: Placement::Local,
                ..found.clone()
            }],
            runtime: RuntimeConfig {
                mode: ExecutionMode::Async,
                default_policy: Some(model.to_string()),
                ..self.runtime.clone()
            },
            policies: Vec::new(),
            tuning: None,
            server: self.server.clone(),
            cluster: None,
        };
        config.validate()?;
        Ok(config)
    }

    /// Each model's step latency `[a, c]` ms for the tuner: `[tuning] latency_ms`, else the
    /// model's step profile (read now, so that re-measuring a profile never needs the old one).
    pub fn latency_priors_ms(&self) -> Result<Vec<Option<[f64; 2]>>, ConfigError> {
        Ok(self
            .step_costs()?
            .into_iter()
            .map(|cost| cost.map(|c| [c.a_ms, c.c_ms]))
            .collect())
    }

    /// Each model's step cost as configured: L(b) from `[tuning] latency_ms`, a simulated
    /// model's `latency_profile_ms` or the step profile, and the prefill cost per token where
    /// the profile measured it.
    pub fn step_costs(&self) -> Result<Vec<Option<StepCost>>, ConfigError> {
        let configured = self.tuning.as_ref().map(|t| t.latency_ms.as_slice());
        self.models
            .iter()
            .enumerate()
            .map(|(i, model)| {
                let profile = model.read_step_profile()?;
                let prefill_ms_per_token = profile
                    .as_ref()
                    .and_then(|p| p.prefill.as_ref())
                    .filter(|p| p.tokens_per_s > 0.0)
                    .map(|p| 1000.0 / p.tokens_per_s);
                // A simulated model's profile is the one it sleeps by.
                let latency = match configured.and_then(|c| c.get(i)) {
                    Some(&latency) => Some(latency),
                    None => model
                        .latency_profile_ms
                        .or_else(|| profile.map(|p| [p.fit.a_ms, p.fit.c_ms])),
                };
                Ok(latency.map(|[a_ms, c_ms]| StepCost {
                    a_ms,
                    c_ms,
                    prefill_ms_per_token,
                }))
            })
            .collect()
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if self.models.is_empty() {
            return Err(ConfigError::Invalid(
                "`models` must name at least one model".into(),
            ));
        }
        if self.runtime.max_wait_steps == 0 {
            return Err(ConfigError::Invalid(
                "runtime.max_wait_steps must be >= 1 (1: every row runs every step)".into(),
            ));
        }
        let mut names = HashSet::new();
        for model in &self.models {
            if !names.insert(model.name.as_str()) {
                return Err(ConfigError::Invalid(format!(
                    "duplicate model name `{}`",
                    model.name
                )));
            }
            model.validate()?;
        }
        for policy in &self.policies {
            if !names.insert(policy.name.as_str()) {
                return Err(ConfigError::Invalid(format!(
                    "policy name `{}` is already a model or policy name",
                    policy.name
                )));
            }
            for model in &policy.models {
                if self.model_index(model).is_none() {
                    return Err(ConfigError::Invalid(format!(
                        "policies.{}.models: unknown model `{model}`",
                        policy.name
                    )));
                }
            }
        }
        if let Some(remote) = self
            .models
            .iter()
            .find(|m| m.placement == Placement::Remote)
        {
            let Some(cluster) = &self.cluster else {
                return Err(ConfigError::Invalid(format!(
                    "models.{}.placement = \"remote\" needs a [cluster] section with the NATS url",
                    remote.name
                )));
            };
            cluster.validate()?;
        }
        if let Some(t) = &self.tuning {
            let m = self.models.len();
            let latency_rows_ok = t.latency_ms.len() == m
                || (t.latency_ms.is_empty()
                    && self.models.iter().all(|m| m.step_profile.is_some()));
            if t.routing.len() != m || t.commits.len() != m || !latency_rows_ok {
                return Err(ConfigError::Invalid(format!(
                    "tuning: routing, commits and latency_ms need one row per model ({m}); \
                     latency_ms may be left out when every model has a step_profile"
                )));
            }
        }
        let server = &self.server;
        for (field, value) in [
            ("workers", server.workers),
            ("max_body_bytes", server.max_body_bytes),
            ("max_prompt_tokens", server.max_prompt_tokens),
            ("max_tokens_limit", server.max_tokens_limit),
            ("max_concurrent_requests", server.max_concurrent_requests),
            ("max_connections", server.max_connections),
            ("body_timeout_ms", server.body_timeout_ms as usize),
        ] {
            if value == 0 {
                return Err(ConfigError::Invalid(format!(
                    "server.{field}: must be at least 1"
                )));
            }
        }
        // actix-web measures the header deadline on a clock it advances every 500 ms: under
        // a second, a deadline can pass before a prompt client's headers arrive (measured:
        // 300 ms answered 408 at once).
        if server.header_timeout_ms < MIN_HEADER_TIMEOUT_MS {
            return Err(ConfigError::Invalid(format!(
                "server.header_timeout_ms: must be at least {MIN_HEADER_TIMEOUT_MS} (actix-web \
                 times it on a clock that advances every 500 ms), got {}",
                server.header_timeout_ms
            )));
        }
        if !(server.keep_alive_s >= 0.0 && server.keep_alive_s.is_finite()) {
            return Err(ConfigError::Invalid(
                "server.keep_alive_s: must be a non-negative number of seconds".into(),
            ));
        }
        if !(server.request_timeout_s > 0.0 && server.request_timeout_s.is_finite()) {
            return Err(ConfigError::Invalid(
                "server.request_timeout_s: must be a positive number of seconds".into(),
            ));
        }
        if let Some(default) = &self.runtime.default_policy {
            if !names.contains(default.as_str()) {
                return Err(ConfigError::Invalid(format!(
                    "runtime.default_policy: unknown policy or model `{default}`"
                )));
            }
        }
        Ok(())
    }

    /// This config with `update` applied, validated as a whole (the caller keeps the old one
    /// on error).
    pub fn with_policy_update(&self, update: &PolicyUpdate) -> Result<Config, ConfigError> {
        let mut next = self.clone();
        for (name, patch) in &update.policies {
            let policy = match next.policies.iter_mut().find(|p| &p.name == name) {
                Some(existing) => existing,
                None => {
                    let (Some(kind), Some(models)) = (&patch.kind, &patch.models) else {
                        return Err(ConfigError::Invalid(format!(
                            "policies.{name}: not a configured policy; a new one needs `kind` and `models`"
                        )));
                    };
                    next.policies.push(PolicyConfig {
                        name: name.clone(),
                        kind: *kind,
                        models: models.clone(),
                        weights: Vec::new(),
                        threshold: None,
                        router: None,
                    });
                    next.policies.last_mut().expect("just pushed")
                }
            };
            if let Some(kind) = patch.kind {
                policy.kind = kind;
            }
            if let Some(models) = &patch.models {
                policy.models = models.clone();
            }
            if let Some(weights) = &patch.weights {
                policy.weights = weights.clone();
            }
            if patch.threshold.is_some() {
                policy.threshold = patch.threshold;
            }
            if patch.router.is_some() {
                policy.router = patch.router.clone();
            }
        }
        if let Some(default) = &update.default {
            next.runtime.default_policy = Some(default.clone());
        }
        next.validate()?;
        Ok(next)
    }

    /// This config with the policies and default policy of `reloaded` (SIGHUP). Models cannot
    /// change without a restart: their weights are loaded once.
    pub fn with_policies_of(&self, reloaded: &Config) -> Result<Config, ConfigError> {
        let names = |c: &Config| -> Vec<(String, PathBuf)> {
            c.models
                .iter()
                .map(|m| (m.name.clone(), m.path.clone()))
                .collect()
        };
        if names(self) != names(reloaded) {
            return Err(ConfigError::Invalid(
                "the reloaded config changes `models`; restart the server to change models".into(),
            ));
        }
        let mut next = self.clone();
        next.policies = reloaded.policies.clone();
        next.runtime.default_policy = reloaded.runtime.default_policy.clone();
        next.validate()?;
        Ok(next)
    }

    pub fn model_index(&self, name: &str) -> Option<usize> {
        self.models.iter().position(|m| m.name == name)
    }

    pub fn model(&self, name: &str) -> Option<&ModelConfig> {
        self.models.iter().find(|m| m.name == name)
    }
}

impl ModelConfig {
    /// How this model's steps are limited: the token budget (`step_token_budget`, else from
    /// the step profile, else unlimited), the context cost the profile measured (0 without
    /// one: tokens only) and the runtime's wait bound.
    pub(crate) fn step_limits(&self, max_wait_steps: usize) -> Result<StepLimits, ConfigError> {
        let profile = self.read_step_profile()?;
        Ok(StepLimits {
            budget: match self.step_token_budget {
                Some(TokenBudget::Tokens(n)) => Some(n as f64),
                Some(TokenBudget::Unlimited) => None,
                None => profile.as_ref().and_then(StepProfile::budget),
            },
            context_cost: profile.as_ref().map_or(0.0, StepProfile::context_cost),
            max_wait_steps,
        })
    }

    fn read_step_profile(&self) -> Result<Option<StepProfile>, ConfigError> {
        let Some(path) = &self.step_profile else {
            return Ok(None);
        };
        let invalid = |why: String| {
            ConfigError::Invalid(format!(
                "models.{}.step_profile: {}: {why}",
                self.name,
                path.display()
            ))
        };
        let text = read_text_or_carried(path).map_err(|e| invalid(e.to_string()))?;
        let profile: StepProfile = serde_json::from_str(&text).map_err(|e| {
            invalid(format!(
                "not a `tokenrouter bench engine --json` report ({e})"
            ))
        })?;
        let StepProfileFit { a_ms, c_ms } = profile.fit;
        if !(a_ms.is_finite() && c_ms.is_finite() && a_ms >= 0.0 && c_ms >= 0.0) {
            return Err(invalid(format!(
                "fit a = {a_ms}, c = {c_ms} must be finite and >= 0"
            )));
        }
        Ok(Some(profile))
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let field = |f: &str, why: &str| {
            Err(ConfigError::Invalid(format!(
                "models.{}.{f}: {why}",
                self.name
            )))
        };
        if self.name.trim().is_empty() {
            return Err(ConfigError::Invalid("models.name must not be empty".into()));
        }
        if self.threads == 0 {
            return field("threads", "must be at least 1");
        }
        match (&self.latency_profile_ms, self.path.as_os_str().is_empty()) {
            (None, true) => {
                return field(
                    "path",
                    "is required (or latency_profile_ms for a simulation)",
                )
            }
            (Some(_), false) => return field("path", "a latency-profile simulation takes no path"),
            (None, _) if self.latency_context_cost.is_some() => {
                return field(
                    "latency_context_cost",
                    "prices a simulation's steps: it needs latency_profile_ms",
                )
            }
            (Some(l), true) if l.iter().any(|v| !v.is_finite() || *v < 0.0) => {
                return field(
                    "latency_profile_ms",
                    "must be two non-negative numbers [a, c]",
                )
            }
            _ => {}
        }
        if matches!(self.latency_context_cost, Some(k) if !k.is_finite() || k < 0.0) {
            return field("latency_context_cost", "must be a non-negative number");
        }
        if self.kv_tokens == 0 {
            return field("kv_tokens", "must be at least 1");
        }
        if self.batch_threshold == 0 {
            return field("batch_threshold", "must be at least 1");
        }
        if let Some(layers) = &self.layers {
            if let Err(why) = parse_layer_ranges(layers) {
                return field("layers", &why);
            }
        }
        Ok(())
    }

    /// The decoder layers this variant runs, out of `total` in the checkpoint.
    pub fn layer_indices(&self, total: usize) -> Result<Vec<usize>, ConfigError> {
        let Some(spec) = &self.layers else {
            return Ok((0..total).collect());
        };
        let layers = parse_layer_ranges(spec)
            .map_err(|why| ConfigError::Invalid(format!("models.{}.layers: {why}", self.name)))?;
        if let Some(&bad) = layers.iter().find(|&&l| l >= total) {
            return Err(ConfigError::Invalid(format!(
                "models.{}.layers: layer {bad} does not exist (the checkpoint has {total})",
                self.name
            )));
        }
        Ok(layers)
    }
}

/// Parses `"0-9,20,25-29"` into strictly increasing layer indices.
pub fn parse_layer_ranges(spec: &str) -> Result<Vec<usize>, String> {
    let mut layers = Vec::new();
    for part in spec.split(',').map(str::trim) {
        let (lo, hi) = match part.split_once('-') {
            Some((lo, hi)) => (lo.trim(), hi.trim()),
            None => (part, part),
        };
        let parse = |s: &str| {
            s.parse::<usize>()
                .map_err(|_| format!("`{part}` is not a layer index or range like 3-7"))
        };
        let (lo, hi) = (parse(lo)?, parse(hi)?);
        if lo > hi {
            return Err(format!("range `{part}` is reversed"));
        }
        for layer in lo..=hi {
            if layers.last().is_some_and(|&last| last >= layer) {
                return Err(format!(
                    "layers must be increasing without repeats (at {layer})"
                ));
            }
            layers.push(layer);
        }
    }
    Ok(layers)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every config the repository ships parses and validates, and the files its models'
    /// `chat_template` entries name exist.
    #[test]
    fn shipped_configs_are_valid() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut checked = 0;
        for entry in std::fs::read_dir(root.join("config")).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_none_or(|e| e != "toml") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let config = Config::parse(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            for template in config
                .models
                .iter()
                .filter_map(|m| m.chat_template.as_ref())
            {
                assert!(
                    root.join(template).exists(),
                    "{}: {}",
                    path.display(),
                    template.display()
                );
            }
            checked += 1;
        }
        assert!(checked >= 5, "{checked} configs");
    }

    #[test]
    fn layer_ranges_parse_and_reject_bad_specs() {
        assert_eq!(
            parse_layer_ranges("0-2, 5,7-8").unwrap(),
            vec![0, 1, 2, 5, 7, 8]
        );
        assert!(parse_layer_ranges("3-1").unwrap_err().contains("reversed"));
        assert!(parse_layer_ranges("1,1")
            .unwrap_err()
            .contains("increasing"));
        assert!(parse_layer_ranges("a").unwrap_err().contains("not a layer"));
    }

    #[test]
    fn validation_names_the_field() {
        let err = Config::parse("[[models]]\nname = \"m\"\npath = \"x.gguf\"\nthreads = 0\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("models.m.threads"), "{err}");
        let err = Config::parse(
            "[[models]]\nname = \"m\"\npath = \"a\"\n[[models]]\nname = \"m\"\npath = \"b\"\n",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("duplicate model name"), "{err}");
        let err = Config::parse("[[models]]\nname = \"m\"\npath = \"a\"\nweights = \"q2\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("weights") || err.contains("variant"), "{err}");
        for (line, field) in [
            ("header_timeout_ms = 0", "server.header_timeout_ms"),
            ("header_timeout_ms = 300", "server.header_timeout_ms"),
            ("body_timeout_ms = 0", "server.body_timeout_ms"),
            ("max_connections = 0", "server.max_connections"),
            ("keep_alive_s = -1.0", "server.keep_alive_s"),
        ] {
            let err = Config::parse(&format!(
                "[[models]]\nname = \"m\"\npath = \"a\"\n[server]\n{line}\n"
            ))
            .unwrap_err()
            .to_string();
            assert!(err.contains(field), "{line}: {err}");
        }
    }

    #[test]
    fn a_context_cost_needs_a_simulation_and_a_non_negative_number() {
        let model = |fields: &str| format!("[[models]]\nname = \"m\"\n{fields}\n");
        for fields in [
            "path = \"a\"\nlatency_context_cost = 0.001",
            "latency_profile_ms = [1.0, 1.0]\nlatency_context_cost = -0.001",
        ] {
            let err = Config::parse(&model(fields)).unwrap_err().to_string();
            assert!(err.contains("models.m.latency_context_cost"), "{err}");
        }
        Config::parse(&model(
            "latency_profile_ms = [1.0, 1.0]\nlatency_context_cost = 0.001",
        ))
        .unwrap();
    }

    /// The simulated CPU pair steps what the CPU pair's profiles say and schedules with
    /// the same limits, so its long-prompt gaps are the CPU pair's scheduling without the noise.
    #[test]
    fn the_simulated_cpu_pair_is_priced_and_limited_as_the_cpu_pair() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let load = |name: &str| Config::load(&root.join("config").join(name)).unwrap();
        let (real, simulated) = (load("cpu-pair.toml"), load("cpu-pair-sim.toml"));
        assert_eq!(real.models.len(), simulated.models.len());
        for (r, s) in real.models.iter().zip(&simulated.models) {
            assert_eq!(r.name, s.name);
            assert_eq!(
                r.step_limits(4).unwrap(),
                s.step_limits(4).unwrap(),
                "{}",
                r.name
            );
            let profile = r.read_step_profile().unwrap().unwrap();
            let [a, c] = s.latency_profile_ms.unwrap();
            assert!((a - profile.fit.a_ms).abs() < 0.01, "{}: a {a}", r.name);
            assert!((c - profile.fit.c_ms).abs() < 0.01, "{}: c {c}", r.name);
            let k = s.latency_context_cost.unwrap();
            assert!(
                (k / profile.context_cost() - 1.0).abs() < 0.01,
                "{}: k {k}",
                r.name
            );
        }
        assert_eq!(real.runtime.mode, simulated.runtime.mode);
        assert_eq!(
            real.runtime.batch_timeout_ms,
            simulated.runtime.batch_timeout_ms
        );
    }

    #[test]
    fn device_parses_cpu_and_cuda_ordinals_and_rejects_the_rest() {
        let device = |d: &str| {
            Config::parse(&format!(
                "[[models]]\nname = \"m\"\npath = \"a\"\ndevice = \"{d}\"\n"
            ))
            .map(|c| c.models[0].device)
            .map_err(|e| e.to_string())
        };
        assert_eq!(device("cpu"), Ok(ModelDevice::Cpu));
        assert_eq!(device("cuda:1"), Ok(ModelDevice::Cuda(1)));
        assert_eq!(device("cuda"), Ok(ModelDevice::Cuda(0)));
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1"] {
            let err = device(bad).unwrap_err();
            assert!(err.contains("device") && err.contains(bad), "{err}");
        }
        let default = Config::parse("[[models]]\nname = \"m\"\npath = \"a\"\n").unwrap();
        assert_eq!(default.models[0].device, ModelDevice::Cpu);
    }

    #[test]
    fn gpu_settings_default_to_graphs_on_and_normal_priority() {
        let model = |extra: &str| {
            Config::parse(&format!("[[models]]\nname = \"m\"\npath = \"a\"\n{extra}"))
                .map(|c| (c.models[0].cuda_graphs, c.models[0].stream_priority))
                .map_err(|e| e.to_string())
        };
        assert_eq!(model(""), Ok((true, StreamPriority::Normal)));
        assert_eq!(
            model("cuda_graphs = false\nstream_priority = \"high\"\n"),
            Ok((false, StreamPriority::High))
        );
        let err = model("stream_priority = \"urgent\"\n").unwrap_err();
        assert!(err.contains("urgent"), "{err}");
    }

    #[test]
    fn layer_indices_check_the_checkpoint_depth() {
        let config =
            Config::parse("[[models]]\nname = \"m\"\npath = \"a\"\nlayers = \"0-3\"\n").unwrap();
        assert_eq!(config.models[0].layer_indices(4).unwrap(), vec![0, 1, 2, 3]);
        assert!(config.models[0].layer_indices(3).is_err());
    }

    #[test]
    fn the_nkey_seed_comes_from_its_file_else_its_variable() {
        let dir = tempfile::tempdir().unwrap();
        let mut cluster = ClusterConfig::at("nats://127.0.0.1:4222");
        cluster.nkey_seed_env = "TOKENROUTER_TEST_NKEY_SEED_UNSET".into();
        assert_eq!(cluster.nkey_seed().unwrap(), None);
        let path = dir.path().join("seed");
        std::fs::write(&path, "SUSEED\n").unwrap();
        cluster.nkey_seed_file = Some(path.clone());
        assert_eq!(cluster.nkey_seed().unwrap().as_deref(), Some("SUSEED"));
        cluster.nkey_seed_file = Some(dir.path().join("missing"));
        let err = cluster.nkey_seed().unwrap_err().to_string();
        assert!(
            err.contains("cluster.nkey_seed_file") && err.contains("missing"),
            "{err}"
        );
    }
}

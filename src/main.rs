//! Command line: serve | generate | bench | tune | models (`docs/cli.md`). The benchmarks,
//! their plots and load client, and model fetching live in this binary, not in the library.

mod bench;
mod fetch;
mod training;

use anyhow::{anyhow, Context};
use clap::{Args, Parser, Subcommand};
use serde_json::json;
use std::path::PathBuf;
use tokenrouter::config::{
    Config, ExecutionMode, ModelConfig, WeightPrecision, DEFAULT_CONFIG_PATH,
};
use tokenrouter::constraint::{OutputFormat, Vocabulary};
use tokenrouter::engine::chat::ChatMessage;
use tokenrouter::engine::spelling::Spelling;
use tokenrouter::engine::tokenizer::ModelTokenizer;
use tokenrouter::engine::{load_executor, weights, Executor, SamplingParams};
use tokenrouter::runtime::{GenerateRequest, Runtime};

#[derive(Parser)]
#[command(
    name = "tokenrouter",
    version,
    about = "Serving runtime for token-level model routing"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the OpenAI-compatible HTTP API.
    Serve(ServeArgs),
    /// Host models for the front ends on the `[cluster]` bus (docs/deployment.md).
    Worker(WorkerArgs),
    /// Generate text for one prompt.
    Generate(GenerateArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// List or fetch the configured models.
    #[command(subcommand)]
    Models(ModelsCommand),
    /// Delayed-batching thresholds from the Markov model of routing.
    Tune(TuneArgs),
    /// Learned routers for the configured pair: collect traces, train.
    #[command(subcommand)]
    Router(RouterCommand),
}

#[derive(Subcommand)]
enum RouterCommand {
    /// The LLM answers the shipped questions; the SLM's features and a label per position.
    Collect(RouterCollectArgs),
    /// Train R2R's or CITER's router on collected traces.
    Train(RouterTrainArgs),
}

#[derive(Args)]
struct RouterCollectArgs {
    #[command(flatten)]
    config: ConfigArg,
    /// The two-model policy whose pair (SLM first) the router is for.
    #[arg(long, default_value = "r2r")]
    policy: String,
    /// Only the first N questions of each split, for quick runs.
    #[arg(long)]
    questions: Option<usize>,
    /// Longest LLM answer per question.
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    /// Where the traces go (safetensors).
    #[arg(long)]
    out: PathBuf,
}

#[derive(Args)]
struct RouterTrainArgs {
    /// Traces written by `router collect`.
    #[arg(long)]
    traces: PathBuf,
    #[arg(long, value_enum)]
    kind: training::train::RouterKind,
    /// What the router learns to flag.
    #[arg(long, value_enum, default_value = "divergent")]
    label: training::train::Label,
    /// Where the router goes (safetensors, f16, with its threshold).
    #[arg(long)]
    out: PathBuf,
    /// R2R's backbone width (the released routers: 1024).
    #[arg(long, default_value_t = 128)]
    width: usize,
    /// R2R's residual blocks (the released routers: 6).
    #[arg(long, default_value_t = 2)]
    blocks: usize,
    #[arg(long, default_value_t = 30)]
    epochs: usize,
    #[arg(long, default_value_t = 64)]
    batch: usize,
    #[arg(long, default_value_t = 1e-3)]
    learning_rate: f64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// The shipped threshold sends this share of validation positions to the LLM.
    #[arg(long, default_value_t = 0.3)]
    target_share: f64,
    /// R2R's rule, reported beside: keep this recall of the positions the SLM gets wrong.
    #[arg(long, default_value_t = 0.95)]
    target_recall: f64,
    /// R2R: train on standardised inputs (top logits relative to the largest), folded into
    /// the saved weights, which still read raw inputs.
    #[arg(long)]
    standardize_inputs: bool,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct ServeArgs {
    #[command(flatten)]
    config: ConfigArg,
    /// Overrides `server.host`.
    #[arg(long)]
    host: Option<String>,
    /// Overrides `server.port`; 0 picks a free port (the log line says which).
    #[arg(long)]
    port: Option<u16>,
    /// Serves only this configured model, alone under its own name: a single-model server
    /// (the `std-serving` baseline of `bench routing` runs one per model).
    #[arg(long)]
    model: Option<String>,
}

#[derive(Args)]
struct WorkerArgs {
    #[command(flatten)]
    config: ConfigArg,
    /// A configured model to host (repeat for several).
    #[arg(long = "model", required = true)]
    models: Vec<String>,
    /// The NATS server, overriding (or standing in for) the config's `[cluster] url`.
    #[arg(long)]
    nats_url: Option<String>,
    /// Subject prefix, overriding `[cluster] subject_prefix`.
    #[arg(long)]
    subject_prefix: Option<String>,
    /// Execution mode, overriding the config's (the front ends must run the same).
    #[arg(long)]
    mode: Option<ExecutionMode>,
    /// Serve this worker's own `/metrics` (its models' steps, KV, batches) on HOST:PORT.
    #[arg(long)]
    metrics_addr: Option<String>,
}

#[derive(Args)]
struct TuneArgs {
    #[command(flatten)]
    config: ConfigArg,
    /// Print the paper's validation grid and the worked example instead.
    #[arg(long)]
    validate_paper: bool,
    /// Run the paper's grid (N = 2..4) on the latency-profile executor (a simulation) and
    /// print measured next to predicted throughput. Timing-sensitive: run on an idle machine.
    #[arg(long, conflicts_with = "validate_paper")]
    validate_runtime: bool,
    /// Measurement window per (N, B_1) for --validate-runtime.
    #[arg(long, default_value_t = 15.0)]
    window_s: f64,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct ConfigArg {
    #[arg(long, default_value = DEFAULT_CONFIG_PATH)]
    config: PathBuf,
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    config: ConfigArg,
    /// A policy name, or a model name (served alone); the config's default policy if absent.
    #[arg(long, conflicts_with = "model")]
    policy: Option<String>,
    /// One model served alone: one of the config's, or a model fetched by name
    /// (`smollm2-135m`, `gemma3-270m`) when the config has none of that name.
    #[arg(long)]
    model: Option<String>,
    /// Execution mode; the config's if absent.
    #[arg(long)]
    mode: Option<ExecutionMode>,
    #[arg(
        long,
        conflicts_with = "prompt_file",
        required_unless_present = "prompt_file"
    )]
    prompt: Option<String>,
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    /// Wrap the prompt as a user message in the model's own chat template.
    #[arg(long)]
    chat: bool,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print one JSON object instead of the text.
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Decode-step time per batch size and prefill rate of one model.
    Engine(BenchEngineArgs),
    /// Greedy agreement and step-cost ratio of a model against a reference model.
    Pair(BenchPairArgs),
    /// One model on the CPU and on another device: greedy tokens from fixed prompts must match.
    Parity(BenchParityArgs),
    /// Closed-loop clients through the runtime, per policy, mode and concurrency.
    Routing(BenchRoutingArgs),
    /// Answer accuracy, LLM likelihood, token share and cost per policy on shipped questions.
    Quality(BenchQualityArgs),
    /// Load a running server over HTTP: disconnects, policy swaps; nothing may hang or leak.
    Load(BenchLoadArgs),
}

#[derive(Args)]
struct BenchLoadArgs {
    /// The server, e.g. http://127.0.0.1:8080 (loopback).
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    #[arg(long, default_value_t = 2000)]
    requests: usize,
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    #[arg(long, default_value_t = 8)]
    max_tokens: usize,
    /// Fraction of requests whose client hangs up early.
    #[arg(long, default_value_t = 0.1)]
    disconnect: f64,
    /// Policies the default policy is swapped between (needs the admin token); '' for none.
    #[arg(long, value_delimiter = ',', default_value = "me,r2r,citer")]
    swap_policies: Vec<String>,
    #[arg(long, default_value_t = 10.0)]
    swap_every_s: f64,
    /// A request unanswered this long counts as hung.
    #[arg(long, default_value_t = 600.0)]
    hang_after_s: f64,
    /// Run for this long instead of --requests (a soak), then judge memory and descriptors.
    #[arg(long, conflicts_with = "idle_clients")]
    duration_s: Option<f64>,
    /// How often to sample the server (its memory and descriptors with --server-pid).
    #[arg(long, default_value_t = 30.0)]
    sample_every_s: f64,
    /// The server's process id (same host): its resident memory and open descriptors.
    #[arg(long)]
    server_pid: Option<u32>,
    /// Measure the load alone and beside this many idle connections (and --slow-clients).
    #[arg(long, default_value_t = 0)]
    idle_clients: usize,
    /// ... and this many slow-loris connections (a header byte a second).
    #[arg(long, default_value_t = 0)]
    slow_clients: usize,
    /// Rounds of alone / beside the slow connections.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    #[arg(long)]
    json: bool,
    /// Write the soak's plot over time (`soak.svg`) into this directory.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum BenchPlacement {
    Local,
    Remote,
}

#[derive(Args)]
struct BenchRoutingArgs {
    #[command(flatten)]
    config: ConfigArg,
    #[arg(long, value_delimiter = ',', default_value = "me")]
    policy: Vec<String>,
    /// Threshold sweep of one configured policy, e.g. `r2r=0.2,0.45,1.0`.
    #[arg(long)]
    sweep: Option<String>,
    /// Model whose greedy output alone is the quality reference; the first model if absent.
    #[arg(long)]
    reference: Option<String>,
    /// Execution modes, and `llm-only` (the reference model serving alone).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "lockstep,standard,async,tokenrouter,llm-only"
    )]
    mode: Vec<bench::routing::BenchMode>,
    /// `remote`: each runtime mode also runs with the reference model in a worker process
    /// (its `<mode>-remote` twin) beside it in one run; `local` (default): in-process only.
    #[arg(long, value_enum, default_value = "local")]
    placement: BenchPlacement,
    #[arg(long, value_delimiter = ',', default_value = "8")]
    concurrency: Vec<usize>,
    /// `short` (a question, answer until end-of-sequence), `long` (exactly --max-tokens),
    /// `agent` (a long multi-turn context, then a question).
    #[arg(long, default_value = "short")]
    workload: bench::workloads::Workload,
    /// Requests per (policy, mode, concurrency) cell.
    #[arg(long, default_value_t = 16)]
    requests: usize,
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    /// Repetitions; modes are interleaved within each round, each round starting one mode later.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Tokens of one extra prompt sent into each cell once its requests decode; the report
    /// gives the others' largest inter-token gap during its prefill over their median gap.
    #[arg(long)]
    long_prompt: Option<usize>,
    /// Device for every model (`cpu` or `cuda:N`), overriding the config's `device`.
    #[arg(long)]
    device: Option<tokenrouter::config::ModelDevice>,
    /// Price the profile prediction with each model's step profile measured in this process
    /// (as `bench engine` measures it) before and after every cell, instead of the
    /// configured profiles: on a machine whose speed drifts, the shipped ones go stale.
    #[arg(long)]
    profile_steps: bool,
    /// Run every cell twice: its requests unconstrained, and held to the JSON schema in
    /// this file (as `response_format` json_schema would), and compare what a step costs.
    #[arg(long, value_name = "FILE")]
    json_schema: Option<PathBuf>,
    #[arg(long)]
    json: bool,
    /// Write SVG plots into this directory.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Args)]
struct BenchQualityArgs {
    #[command(flatten)]
    config: ConfigArg,
    /// Policies or model names; every configured policy and every model alone if absent.
    #[arg(long, value_delimiter = ',')]
    policy: Vec<String>,
    /// Threshold sweep of a configured policy, e.g. `r2r=3,4,5,6`; repeatable.
    #[arg(long)]
    sweep: Vec<String>,
    /// `heldout`, `train` or `all`.
    #[arg(long, default_value = "heldout")]
    split: String,
    /// Only the first N questions of the split.
    #[arg(long)]
    questions: Option<usize>,
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// The model scoring answers (likelihood, token share); the first model if absent.
    #[arg(long)]
    reference: Option<String>,
    #[arg(long)]
    json: bool,
    /// Write the accuracy-versus-share plot into this directory.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Args)]
struct BenchEngineArgs {
    #[command(flatten)]
    config: ConfigArg,
    #[arg(long)]
    model: Option<String>,
    /// Weights file (GGUF) or checkpoint directory, overriding the model's `path`.
    #[arg(long)]
    path: Option<std::path::PathBuf>,
    /// Weight precision (`stored`, `f32`, `q8_0`, ...), overriding the model's `weights`.
    #[arg(long, value_parser = parse_weight_precision)]
    weights: Option<WeightPrecision>,
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16")]
    batch: Vec<usize>,
    /// Timed decode steps per batch size.
    #[arg(long, default_value_t = 16)]
    steps: usize,
    /// Context tokens per sequence before timing (row i gets 3·i more: a ragged batch).
    #[arg(long, default_value_t = 64)]
    context: usize,
    #[arg(long, default_value_t = 512)]
    prefill_tokens: usize,
    /// Threads for the model(s), overriding the config's `threads`.
    #[arg(long)]
    threads: Option<usize>,
    /// Device for the model(s) (`cpu` or `cuda:N`), overriding the config's `device`.
    #[arg(long)]
    device: Option<tokenrouter::config::ModelDevice>,
    /// On a GPU: decode steps replayed as CUDA graphs or launched kernel by kernel, one
    /// report per setting, in this order (e.g. `on,off`); the config's `cuda_graphs` when
    /// absent.
    #[arg(long, value_delimiter = ',', value_parser = parse_on_off)]
    cuda_graphs: Vec<bool>,
    /// Instead: step this model and MODEL in turn on one thread, then at the same time on
    /// their own threads, and report each one's step time both ways against running alone.
    #[arg(long, value_name = "OTHER_MODEL")]
    concurrent_with: Option<String>,
    /// Instead: step a batch of the largest `--batch` rows, each generating JSON under the
    /// schema in this file, in turn with the same batch unmasked, and report both step times.
    #[arg(long, value_name = "FILE")]
    json_schema: Option<PathBuf>,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct BenchPairArgs {
    #[command(flatten)]
    config: ConfigArg,
    /// Candidate (cheap) models, comma-separated.
    #[arg(long, value_delimiter = ',')]
    model: Vec<String>,
    /// The reference model; defaults to the first model in the config.
    #[arg(long)]
    reference: Option<String>,
    /// Generated positions per prompt.
    #[arg(long, default_value_t = 48)]
    tokens: usize,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct BenchParityArgs {
    #[command(flatten)]
    config: ConfigArg,
    /// The model; the first in the config if absent.
    #[arg(long)]
    model: Option<String>,
    /// The device compared with the CPU.
    #[arg(long)]
    device: tokenrouter::config::ModelDevice,
    /// Generated tokens per prompt.
    #[arg(long, default_value_t = 64)]
    tokens: usize,
    /// The CPU reference's integer kernel (`avx512-vnni`, `avx2`, `portable`) instead of the
    /// fastest; with `--device cpu`, shows how far two CPU kernels' rounding moves the tokens.
    #[arg(long)]
    reference_kernel: Option<tokenrouter::engine::Kernel>,
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand)]
enum ModelsCommand {
    List {
        #[command(flatten)]
        config: ConfigArg,
        #[arg(long)]
        json: bool,
    },
    /// Fetch models by name (`smollm2-135m`, `gemma3-270m`) into models/, or without names
    /// the known checkpoints the config names; files already there are kept.
    Fetch {
        #[command(flatten)]
        config: ConfigArg,
        names: Vec<String>,
    },
}

/// Logs go to stderr, at `info` (actix-web's per-worker lines at `warn`) unless `RUST_LOG`
/// says otherwise; with `debug`, each request's and each step's span is logged when it closes.
fn init_logging() {
    use std::io::IsTerminal;
    use tracing_subscriber::fmt::format::FmtSpan;
    use tracing_subscriber::EnvFilter;
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| EnvFilter::new("info,actix_server=warn")),
        )
        .with_span_events(FmtSpan::CLOSE)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();
}

fn main() {
    init_logging();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => run_serve(args),
        Command::Worker(args) => run_worker(args),
        Command::Generate(args) => run_generate(args),
        Command::Bench(BenchCommand::Engine(args)) => run_bench_engine(args),
        Command::Bench(BenchCommand::Pair(args)) => run_bench_pair(args),
        Command::Bench(BenchCommand::Parity(args)) => run_bench_parity(args),
        Command::Bench(BenchCommand::Quality(args)) => run_bench_quality(args),
        Command::Bench(BenchCommand::Routing(args)) => run_bench_routing(args),
        Command::Bench(BenchCommand::Load(args)) => run_bench_load(args),
        Command::Models(ModelsCommand::List { config, json }) => run_models_list(&config, json),
        Command::Tune(args) => run_tune(args),
        Command::Router(RouterCommand::Collect(args)) => run_router_collect(args),
        Command::Router(RouterCommand::Train(args)) => run_router_train(args),
        Command::Models(ModelsCommand::Fetch { config, names }) => {
            run_models_fetch(&config, &names)
        }
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn load_config(arg: &ConfigArg) -> anyhow::Result<Config> {
    Ok(Config::load(&arg.config)?)
}

fn run_models_fetch(config: &ConfigArg, names: &[String]) -> anyhow::Result<()> {
    if names.is_empty() {
        return load_config(config).and_then(|c| fetch::ensure_models_present(&c));
    }
    let known = names
        .iter()
        .map(|name| fetch::KnownModel::by_name(name))
        .collect::<anyhow::Result<Vec<_>>>()?;
    for model in known {
        let path = model.default_path();
        model.fetch_to(&path)?;
        println!("{}: {}", model.name, path.display());
    }
    Ok(())
}

/// The config and policy that serve model `name` alone: the config's model of that name, or
/// else a known checkpoint fetched into models/ and run with the defaults.
fn model_alone(arg: &ConfigArg, name: &str) -> anyhow::Result<(Config, String)> {
    let config = load_config(arg)?;
    if config.models.iter().any(|m| m.name == name) {
        fetch::ensure_models_present(&config)?;
        return Ok((config, name.to_string()));
    }
    let known = fetch::KnownModel::by_name(name)
        .with_context(|| format!("{} has no model `{name}`", arg.config.display()))?;
    let path = known.default_path();
    known.fetch_to(&path)?;
    let entry = format!(
        "[[models]]\nname = {name:?}\npath = {:?}\n",
        path.display().to_string()
    );
    Ok((Config::parse(&entry)?, name.to_string()))
}

/// Loads the config and fetches the shipped checkpoint when missing.
fn ready_config(arg: &ConfigArg) -> anyhow::Result<Config> {
    let config = load_config(arg)?;
    fetch::ensure_models_present(&config)?;
    Ok(config)
}

fn pick_model<'a>(config: &'a Config, name: Option<&str>) -> anyhow::Result<&'a ModelConfig> {
    match name {
        None => Ok(&config.models[0]),
        Some(name) => config.model(name).ok_or_else(|| {
            let known: Vec<&str> = config.models.iter().map(|m| m.name.as_str()).collect();
            anyhow!(
                "unknown model or policy `{name}` (known: {})",
                known.join(", ")
            )
        }),
    }
}

fn run_serve(args: ServeArgs) -> anyhow::Result<()> {
    let mut config = ready_config(&args.config)?;
    if let Some(model) = &args.model {
        config = config.only_model(model)?;
    }
    if let Some(host) = args.host {
        config.server.host = host;
    }
    if let Some(port) = args.port {
        config.server.port = port;
    }
    actix_web::rt::System::new().block_on(tokenrouter::server::serve(config, args.config.config))
}

/// Hosts the models until SIGTERM or SIGINT; the front ends see its heartbeats stop.
fn run_worker(args: WorkerArgs) -> anyhow::Result<()> {
    let mut config = ready_config(&args.config)?;
    if let Some(url) = &args.nats_url {
        let cluster = config
            .cluster
            .get_or_insert_with(|| tokenrouter::config::ClusterConfig::at(url));
        cluster.url = url.clone();
    }
    if let (Some(prefix), Some(cluster)) = (&args.subject_prefix, &mut config.cluster) {
        cluster.subject_prefix = prefix.clone();
    }
    actix::System::new().block_on(async move {
        let metrics = match &args.metrics_addr {
            Some(addr) => Some(tokenrouter::server::serve_metrics_only(addr)?),
            None => None,
        };
        let runtime = Runtime::start_worker(&config, &args.models, args.mode)?;
        if let Some(server) = metrics {
            actix::spawn(async move {
                if let Err(e) = server.await {
                    tracing::error!("worker metrics server stopped: {e}");
                }
            });
        }
        tracing::info!(models = ?args.models, "worker hosting");
        let mut terminate =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = terminate.recv() => {}
        }
        tracing::info!("worker stopping");
        runtime.shutdown();
        Ok(())
    })
}

fn run_generate(args: GenerateArgs) -> anyhow::Result<()> {
    if !(args.temperature >= 0.0 && args.temperature.is_finite()) {
        anyhow::bail!("--temperature must be a finite number >= 0");
    }
    if !(args.top_p > 0.0 && args.top_p <= 1.0) {
        anyhow::bail!("--top-p must be in (0, 1]");
    }
    let (config, policy) = match &args.model {
        Some(name) => {
            let (config, policy) = model_alone(&args.config, name)?;
            (config, Some(policy))
        }
        None => (ready_config(&args.config)?, args.policy.clone()),
    };
    let prompt = match (&args.prompt, &args.prompt_file) {
        (Some(p), _) => p.clone(),
        (None, Some(file)) => std::fs::read_to_string(file)
            .with_context(|| format!("cannot read --prompt-file {}", file.display()))?,
        (None, None) => unreachable!("clap requires one of them"),
    };
    actix::System::new().block_on(async move {
        let runtime = Runtime::start(&config, args.mode)?;
        let prompt = if args.chat {
            runtime.render(&[ChatMessage::user(prompt)])?
        } else {
            runtime.encode(&prompt)?
        };
        let request = GenerateRequest {
            prompt,
            policy,
            max_tokens: args.max_tokens,
            sampling: SamplingParams {
                temperature: args.temperature,
                top_k: args.top_k,
                top_p: args.top_p,
                seed: args.seed,
            },
            timeout: None,
            ignore_eos: false,
        };
        let out = runtime.submit(request)?.collect().await?;
        let names = runtime.model_names();
        let text = runtime.text_of(&out.token_ids, &out.writers)?;
        if args.json {
            let total_s = out.total.as_secs_f64();
            let tokens_per_model: serde_json::Map<String, serde_json::Value> = names
                .iter()
                .zip(&out.routing.tokens_per_model)
                .filter(|(_, &n)| n > 0)
                .map(|(name, &n)| (name.to_string(), json!(n)))
                .collect();
            let report = json!({
                "text": text,
                "token_ids": out.token_ids,
                "finish_reason": out.finish_reason,
                "routing": {
                    "policy": out.policy,
                    "mode": runtime.mode().as_str(),
                    "tokens_per_model": tokens_per_model,
                    "handoffs": out.routing.handoffs,
                },
                "timing": {
                    "ttft_ms": out.time_to_first_token.as_secs_f64() * 1e3,
                    "total_ms": total_s * 1e3,
                    "tokens_per_s": out.token_ids.len() as f64 / total_s.max(1e-9),
                },
            });
            println!("{report}");
        } else {
            println!("{text}");
        }
        runtime.shutdown();
        Ok(())
    })
}

/// A `weights` value as the config file spells it.
fn parse_on_off(value: &str) -> Result<bool, String> {
    match value {
        "on" => Ok(true),
        "off" => Ok(false),
        other => Err(format!("`{other}` is not `on` or `off`")),
    }
}

fn parse_weight_precision(value: &str) -> Result<WeightPrecision, String> {
    serde_json::from_value(json!(value)).map_err(|e| format!("{e}"))
}

fn run_bench_engine(args: BenchEngineArgs) -> anyhow::Result<()> {
    if args.batch.is_empty() || args.batch.contains(&0) || args.steps == 0 {
        anyhow::bail!("--batch needs positive sizes and --steps must be at least 1");
    }
    if args.threads == Some(0) {
        anyhow::bail!("--threads must be at least 1");
    }
    let config = ready_config(&args.config)?;
    let with_overrides = |model: &ModelConfig| ModelConfig {
        threads: args.threads.unwrap_or(model.threads),
        device: args.device.unwrap_or(model.device),
        ..model.clone()
    };
    let mut model = with_overrides(pick_model(&config, args.model.as_deref())?);
    if let Some(path) = &args.path {
        model.path = path.clone();
    }
    model.weights = args.weights.unwrap_or(model.weights);
    let on_gpu = matches!(model.device, tokenrouter::config::ModelDevice::Cuda(_));
    if !args.cuda_graphs.is_empty() && !on_gpu {
        anyhow::bail!("--cuda-graphs applies to a model on a GPU (--device cuda:N)");
    }
    let graph_settings = match args.cuda_graphs.is_empty() {
        true => vec![model.cuda_graphs],
        false => args.cuda_graphs.clone(),
    };
    model.cuda_graphs = graph_settings[0];
    let mut executor = load_executor(&model)?;
    let load_peak_rss_mib = bench::soak::peak_rss_mib(std::process::id());
    let settings = bench::engine::EngineBenchSettings {
        batches: args.batch,
        steps: args.steps,
        context: args.context,
        prefill_tokens: args.prefill_tokens.max(1),
        ..Default::default()
    };
    if let Some(path) = &args.json_schema {
        let format = read_json_schema(path)?;
        let tokenizer = ModelTokenizer::load(&model.path)?;
        let vocabulary = Vocabulary::new(
            &Spelling::new(&tokenizer)?,
            tokenizer.eos.clone(),
            llguidance::api::ParserLimits::default(),
        )?;
        let batch = settings.batches.iter().copied().max().unwrap_or(1);
        let report = bench::engine::constrained_step(
            executor.as_mut(),
            &format,
            &vocabulary,
            &tokenizer.eos,
            batch,
            &settings,
        )?;
        return print_report(args.json, &report, |r| r.markdown());
    }
    if let Some(other) = &args.concurrent_with {
        let other = with_overrides(pick_model(&config, Some(other))?);
        let mut other_executor = load_executor(&other)?;
        let report = bench::engine::concurrent(
            [
                (executor.as_mut(), model.threads),
                (other_executor.as_mut(), other.threads),
            ],
            &settings,
        )?;
        return print_report(args.json, &report, |r| r.markdown());
    }
    let weights = serde_json::to_value(model.weights)?;
    let weights = weights.as_str().unwrap_or("stored");
    for (i, &cuda_graphs) in graph_settings.iter().enumerate() {
        if i > 0 {
            // One copy of the model in memory at a time.
            drop(executor);
            executor = load_executor(&ModelConfig {
                cuda_graphs,
                ..model.clone()
            })?;
        }
        let report = bench::engine::run(
            executor.as_mut(),
            model.threads,
            weights,
            on_gpu.then_some(cuda_graphs),
            load_peak_rss_mib,
            &settings,
        )?;
        print_report(args.json, &report, |r| r.markdown())?;
    }
    Ok(())
}

/// A report as one JSON line (`--json`) or as Markdown.
fn print_report<R: serde::Serialize>(
    json: bool,
    report: &R,
    markdown: impl FnOnce(&R) -> String,
) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(report)?);
    } else {
        print!("{}", markdown(report));
    }
    Ok(())
}

fn run_bench_pair(args: BenchPairArgs) -> anyhow::Result<()> {
    let config = ready_config(&args.config)?;
    let reference_cfg = pick_model(&config, args.reference.as_deref())?;
    let candidates: Vec<&ModelConfig> = if args.model.is_empty() {
        config
            .models
            .iter()
            .filter(|m| m.name != reference_cfg.name)
            .collect()
    } else {
        args.model
            .iter()
            .map(|n| pick_model(&config, Some(n)))
            .collect::<anyhow::Result<_>>()?
    };
    let tokenizer = ModelTokenizer::load_for(reference_cfg)?;
    let mut reference = load_executor(reference_cfg)?;
    let mut reports = Vec::new();
    for candidate in candidates {
        let mut model = load_executor(candidate)?;
        let report = bench::pair::run(model.as_mut(), reference.as_mut(), &tokenizer, args.tokens)?;
        if !args.json {
            println!(
                "{:<28} agreement {:>5.1}% over {} positions; step {:.2} ms vs {:.2} ms (cost ratio {:.2})",
                report.model,
                report.agreement * 100.0,
                report.positions,
                report.model_step_ms,
                report.reference_step_ms,
                report.cost_ratio
            );
        }
        reports.push(report);
    }
    if args.json {
        println!("{}", serde_json::to_string(&reports)?);
    }
    Ok(())
}

fn run_bench_parity(args: BenchParityArgs) -> anyhow::Result<()> {
    if args.tokens == 0 {
        anyhow::bail!("--tokens must be at least 1");
    }
    let config = ready_config(&args.config)?;
    let model = pick_model(&config, args.model.as_deref())?;
    let on = |device| ModelConfig {
        name: format!("{}@{device}", model.name),
        device,
        ..model.clone()
    };
    let tokenizer = ModelTokenizer::load_for(model)?;
    let mut cpu = Executor::load(&ModelConfig {
        name: match args.reference_kernel {
            Some(kernel) => format!("{}@cpu ({} kernel)", model.name, kernel.name()),
            None => format!("{}@cpu", model.name),
        },
        ..on(tokenrouter::config::ModelDevice::Cpu)
    })?;
    if let Some(kernel) = args.reference_kernel {
        cpu.use_kernel(kernel)?;
    }
    let mut other = load_executor(&on(args.device))?;
    let report = bench::parity::run(&mut cpu, other.as_mut(), &tokenizer, args.tokens)?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", report.markdown());
    }
    if !report.passed {
        anyhow::bail!("{} on {} does not match the CPU", model.name, args.device);
    }
    Ok(())
}

/// `POLICY=V1,V2,...` of `--sweep`.
fn parse_sweep(spec: &str) -> anyhow::Result<(String, Vec<f32>)> {
    let (name, values) = spec
        .split_once('=')
        .ok_or_else(|| anyhow!("--sweep takes POLICY=V1,V2,..., got `{spec}`"))?;
    let values = values
        .split(',')
        .map(|v| {
            v.trim()
                .parse::<f32>()
                .map_err(|_| anyhow!("--sweep: `{v}` is not a number"))
        })
        .collect::<anyhow::Result<Vec<f32>>>()?;
    Ok((name.to_string(), values))
}

fn run_bench_quality(args: BenchQualityArgs) -> anyhow::Result<()> {
    if args.max_tokens == 0 || args.concurrency == 0 || args.questions == Some(0) {
        anyhow::bail!("--max-tokens, --concurrency and --questions must be positive");
    }
    let split = match args.split.as_str() {
        "heldout" => Some(bench::answers::Split::Heldout),
        "train" => Some(bench::answers::Split::Train),
        "all" => None,
        other => anyhow::bail!("--split takes heldout, train or all, not `{other}`"),
    };
    let sweeps = args
        .sweep
        .iter()
        .map(|s| parse_sweep(s))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let config = ready_config(&args.config)?;
    let reference = args
        .reference
        .unwrap_or_else(|| config.models[0].name.clone());
    let served = match args.policy.is_empty() {
        false => args.policy,
        true => config
            .policies
            .iter()
            .map(|p| p.name.clone())
            .chain(config.models.iter().map(|m| m.name.clone()))
            .collect(),
    };
    let settings = bench::quality::QualityBenchSettings {
        served,
        sweeps,
        split,
        limit: args.questions,
        max_tokens: args.max_tokens,
        concurrency: args.concurrency,
        reference: reference.clone(),
    };
    let rows = actix::System::new()
        .block_on(async move { bench::quality::run(&config, &settings).await })?;
    if args.json {
        println!("{}", serde_json::to_string(&rows)?);
    } else {
        print!("{}", bench::quality::markdown(&rows, &reference));
    }
    if let Some(dir) = &args.out {
        let path = bench::plots::quality(&rows, &reference, dir)
            .map_err(|e| anyhow!("cannot write the plot to {}: {e}", dir.display()))?;
        tracing::info!("wrote {}", path.display());
    }
    Ok(())
}

fn run_router_collect(args: RouterCollectArgs) -> anyhow::Result<()> {
    if args.max_tokens == 0 || args.questions == Some(0) {
        anyhow::bail!("--max-tokens and --questions must be positive");
    }
    let config = ready_config(&args.config)?;
    let policy = config.policies.iter().find(|p| p.name == args.policy);
    let Some([slm, llm]) = policy.and_then(|p| <&[String; 2]>::try_from(&p.models[..]).ok()) else {
        anyhow::bail!(
            "--policy `{}` must be a configured policy over two models (SLM, LLM)",
            args.policy
        );
    };
    let settings = training::collect::CollectSettings {
        limit: args.questions,
        max_tokens: args.max_tokens,
    };
    let traces = training::collect::collect(
        pick_model(&config, Some(llm))?,
        pick_model(&config, Some(slm))?,
        &settings,
    )?;
    traces.save(&args.out)?;
    let percent = |label: &[u8]| {
        100.0 * label.iter().filter(|&&l| l == 1).count() as f64 / traces.rows().max(1) as f64
    };
    println!(
        "{} positions ({} held out); the SLM's token differs from the LLM's at {:.1} %, is \
         divergent at {:.1} %: {}",
        traces.rows(),
        traces.heldout.iter().filter(|&&h| h == 1).count(),
        percent(&traces.label),
        percent(&traces.divergent),
        args.out.display()
    );
    Ok(())
}

fn run_router_train(args: RouterTrainArgs) -> anyhow::Result<()> {
    let fractions = [args.target_share, args.target_recall];
    if fractions.iter().any(|f| !(*f > 0.0 && *f <= 1.0)) {
        anyhow::bail!("--target-share and --target-recall must be in (0, 1]");
    }
    if [args.width, args.epochs, args.batch].contains(&0)
        || !(args.learning_rate.is_finite() && args.learning_rate > 0.0)
    {
        anyhow::bail!("--width, --epochs, --batch and --learning-rate must be positive");
    }
    let traces = training::collect::Traces::load(&args.traces)?;
    let settings = training::train::TrainSettings {
        kind: args.kind,
        label: args.label,
        width: args.width,
        blocks: args.blocks,
        epochs: args.epochs,
        batch: args.batch,
        learning_rate: args.learning_rate,
        seed: args.seed,
        target_share: args.target_share,
        target_recall: args.target_recall,
        standardize_inputs: args.standardize_inputs,
    };
    let report = training::train::train(&traces, &settings, &args.out)?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", training::train::markdown(&report));
    }
    Ok(())
}

/// A JSON schema from a file, as `--json-schema` takes it.
fn read_json_schema(path: &std::path::Path) -> anyhow::Result<OutputFormat> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--json-schema: reading {}", path.display()))?;
    let schema: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("--json-schema: {} is not JSON", path.display()))?;
    if !(schema.is_object() || schema.is_boolean()) {
        anyhow::bail!(
            "--json-schema: {} is not a JSON schema (an object)",
            path.display()
        );
    }
    Ok(OutputFormat::JsonSchema(schema))
}

fn run_bench_routing(args: BenchRoutingArgs) -> anyhow::Result<()> {
    if args.concurrency.contains(&0)
        || args.requests == 0
        || args.max_tokens == 0
        || args.rounds == 0
        || args.long_prompt == Some(0)
    {
        anyhow::bail!(
            "--concurrency, --requests, --max-tokens, --rounds and --long-prompt must be positive"
        );
    }
    let sweep = match &args.sweep {
        None => None,
        Some(spec) => Some(parse_sweep(spec)?),
    };
    let mut config = ready_config(&args.config)?;
    if args.device.is_some() && args.mode.contains(&bench::routing::BenchMode::StdServing) {
        anyhow::bail!(
            "--device does not reach std-serving's single-model servers: set `device` in the \
             config instead"
        );
    }
    if let Some(device) = args.device {
        for model in &mut config.models {
            model.device = device;
        }
    }
    let reference = args
        .reference
        .unwrap_or_else(|| config.models[0].name.clone());
    let settings = bench::routing::RoutingBenchSettings {
        config_path: args.config.config.clone(),
        policies: args.policy,
        sweep,
        reference,
        modes: match args.placement {
            BenchPlacement::Local => args.mode,
            BenchPlacement::Remote => args
                .mode
                .iter()
                .copied()
                .flat_map(|m| m.with_remote_twin())
                .collect(),
        },
        concurrency: args.concurrency,
        requests: args.requests,
        max_tokens: args.max_tokens,
        rounds: args.rounds,
        workload: args.workload,
        long_prompt: args.long_prompt,
        profile_steps: args.profile_steps,
        constraint: args
            .json_schema
            .as_deref()
            .map(read_json_schema)
            .transpose()?,
    };
    let rows = actix::System::new()
        .block_on(async move { bench::routing::run(&config, &settings).await })?;
    if args.json {
        println!("{}", serde_json::to_string(&rows)?);
    } else {
        print!("{}", bench::routing::markdown(&rows));
    }
    if let Some(dir) = &args.out {
        let written = bench::plots::write_all(&rows, dir)
            .map_err(|e| anyhow!("cannot write plots to {}: {e}", dir.display()))?;
        for path in written {
            tracing::info!("wrote {}", path.display());
        }
    }
    Ok(())
}

fn run_bench_load(args: BenchLoadArgs) -> anyhow::Result<()> {
    if args.requests == 0 || args.concurrency == 0 || args.max_tokens == 0 || args.rounds == 0 {
        anyhow::bail!("--requests, --concurrency, --max-tokens and --rounds must be positive");
    }
    if !(0.0..=1.0).contains(&args.disconnect) {
        anyhow::bail!("--disconnect is a fraction in [0, 1]");
    }
    let positive = |v: f64| v > 0.0 && v.is_finite();
    if !(positive(args.swap_every_s)
        && positive(args.hang_after_s)
        && positive(args.sample_every_s)
        && args.duration_s.is_none_or(positive))
    {
        anyhow::bail!(
            "--swap-every-s, --hang-after-s, --sample-every-s and --duration-s must be positive"
        );
    }
    let slow = args.idle_clients + args.slow_clients > 0;
    let settings = bench::load::LoadSettings {
        url: args.url.trim_end_matches('/').to_string(),
        requests: args.requests,
        concurrency: args.concurrency,
        max_tokens: args.max_tokens,
        disconnect_fraction: args.disconnect,
        // `--swap-policies ''`: no swaps.
        swap_policies: args
            .swap_policies
            .into_iter()
            .filter(|p| !p.is_empty())
            .collect(),
        swap_every: std::time::Duration::from_secs_f64(args.swap_every_s),
        admin_token: std::env::var("TOKENROUTER_ADMIN_TOKEN").ok(),
        hang_after: std::time::Duration::from_secs_f64(args.hang_after_s),
        duration: args.duration_s.map(std::time::Duration::from_secs_f64),
        sample_every: std::time::Duration::from_secs_f64(args.sample_every_s),
        // Beside slow connections the descriptor count says nothing about leaks.
        server_pid: args.server_pid.filter(|_| !slow),
    };
    if slow {
        let report =
            bench::slow_clients::run(&settings, args.idle_clients, args.slow_clients, args.rounds)?;
        if args.json {
            println!("{}", serde_json::to_string(&report)?);
        } else {
            print!("{}", report.markdown());
        }
        if !report.passed() {
            anyhow::bail!("normal requests failed or slowed past the limits beside slow clients");
        }
        return Ok(());
    }
    let report = bench::load::run(&settings);
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", report.markdown());
    }
    if let Some(dir) = &args.out {
        let path = bench::plots::soak(&report.samples, dir)
            .map_err(|e| anyhow!("cannot write the plot to {}: {e}", dir.display()))?;
        tracing::info!("wrote {}", path.display());
    }
    if !report.passed() {
        anyhow::bail!(
            "requests hung or were lost, KV is still held, the server is unhealthy, or its \
             memory or descriptors grew"
        );
    }
    Ok(())
}

fn run_tune(args: TuneArgs) -> anyhow::Result<()> {
    use tokenrouter::tuning::controller::{thresholds_to_run, MIN_PREDICTED_GAIN};
    use tokenrouter::tuning::{paper, predict, search, AffineLatency, DtmcModel};
    if args.validate_runtime {
        if !(args.window_s > 0.0 && args.window_s.is_finite()) {
            anyhow::bail!("--window-s must be a positive number of seconds");
        }
        let window = std::time::Duration::from_secs_f64(args.window_s);
        let rows = actix::System::new()
            .block_on(async move { bench::validate::run(&[2, 3, 4], window).await })?;
        if args.json {
            println!("{}", json!({"rows": rows}));
        } else {
            print!("{}", bench::validate::markdown(&rows));
        }
        return Ok(());
    }
    if args.validate_paper {
        let model = paper::validation_model();
        let mut rows = Vec::new();
        for (n, b1, paper_value) in paper::VALIDATION_GRID {
            let p = predict(&model, n, &[1, b1])?;
            rows.push(json!({"n": n, "b1": b1, "predicted": p.throughput, "paper": paper_value, "states": p.states}));
        }
        let example = search(&paper::worked_example(), paper::WORKED_EXAMPLE_N)?;
        let (best, best_prediction) = &example[0];
        let worked = json!({
            "n": paper::WORKED_EXAMPLE_N,
            "best": best,
            "predicted": best_prediction.throughput,
            "expected": paper::WORKED_EXAMPLE_OPTIMUM,
            "large_busy_fraction": best_prediction.busy_fraction[1],
            "large_admission_delay_ms": best_prediction.admission_delay_ms[1],
            "all": example.iter().map(|(b, p)| json!({"b": b, "predicted": p.throughput})).collect::<Vec<_>>(),
        });
        if args.json {
            println!("{}", json!({"rows": rows, "worked_example": worked}));
        } else {
            println!("R2R validation (p = 0.35, L = 6.0 / 27.9 ms, δ = 0.1 ms, B_0 = 1)\n");
            println!("| N | B_1 | predicted tok/s | paper | states |\n|---:|---:|---:|---:|---:|");
            for r in &rows {
                println!(
                    "| {} | {} | {:.2} | {} | {} |",
                    r["n"],
                    r["b1"],
                    r["predicted"].as_f64().unwrap_or(0.0),
                    r["paper"],
                    r["states"]
                );
            }
            println!(
                "\nworked example (N = 8, p = 0.05, L = 5 + 0.1b / 25 + 0.5b ms): best B = {:?} at {:.2} tok/s (expected {}); large model busy {:.0} %, admission delay {:.1} ms",
                best,
                best_prediction.throughput,
                paper::WORKED_EXAMPLE_OPTIMUM,
                best_prediction.busy_fraction[1] * 100.0,
                best_prediction.admission_delay_ms[1]
            );
        }
        return Ok(());
    }
    let config = load_config(&args.config)?;
    let tuning = config.tuning.as_ref().ok_or_else(|| {
        anyhow!(
            "{} has no [tuning] section (routing, commits, latency_ms); see docs/tuning.md",
            args.config.config.display()
        )
    })?;
    let model = DtmcModel {
        routing: tuning.routing.clone(),
        commits: tuning.commits.clone(),
        latency: config
            .latency_priors_ms()?
            .into_iter()
            .map(|p| {
                let [a_ms, c_ms] = p.expect("validated: latency_ms or a step_profile per model");
                AffineLatency { a_ms, c_ms }
            })
            .collect(),
        delta_ms: tuning.delta_ms,
        timeout_ms: vec![None; config.models.len()],
    };
    let mut table = Vec::new();
    for n in 1..=tuning.max_requests {
        let results = search(&model, n)?;
        let eager = results
            .iter()
            .find(|(b, _)| b.iter().all(|&t| t == 1))
            .map(|(_, p)| p.throughput);
        let (best, p) = &results[0];
        let run = thresholds_to_run(&results, MIN_PREDICTED_GAIN);
        table.push(json!({"n": n, "thresholds": best, "runs": run, "predicted": p.throughput, "eager": eager, "admission_delay_ms": p.admission_delay_ms, "mean_batch": p.mean_batch}));
    }
    if args.json {
        println!(
            "{}",
            json!({"models": config.models.iter().map(|m| &m.name).collect::<Vec<_>>(), "rows": table})
        );
    } else {
        let names: Vec<&str> = config.models.iter().map(|m| m.name.as_str()).collect();
        println!(
            "| N | B* ({}) | predicted tok/s | eager (all 1) tok/s | the tuner runs |\n|---:|---|---:|---:|---|",
            names.join(", ")
        );
        for r in &table {
            println!(
                "| {} | {} | {:.1} | {:.1} | {} |",
                r["n"],
                r["thresholds"],
                r["predicted"].as_f64().unwrap_or(0.0),
                r["eager"].as_f64().unwrap_or(0.0),
                r["runs"]
            );
        }
        println!(
            "\nThe tuner runs B* only where it predicts at least {:.0} % more than eager launch.",
            MIN_PREDICTED_GAIN * 100.0
        );
    }
    Ok(())
}

fn run_models_list(arg: &ConfigArg, as_json: bool) -> anyhow::Result<()> {
    let config = load_config(arg)?;
    let mut rows = Vec::new();
    for m in &config.models {
        let info = weights::describe(&m.path);
        rows.push(json!({
            "name": m.name,
            "path": m.path,
            "present": m.path.exists(),
            "weights": m.weights,
            "layers": m.layers.as_deref().unwrap_or("all"),
            "threads": m.threads,
            "kv_tokens": m.kv_tokens,
            "checkpoint": info.as_ref().ok(),
            "error": info.as_ref().err().map(|e| e.to_string()),
        }));
    }
    if as_json {
        println!("{}", serde_json::Value::Array(rows));
    } else {
        for r in rows {
            println!(
                "{:<24} {:<8} layers={:<12} present={} {}",
                r["name"].as_str().unwrap_or_default(),
                r["weights"].as_str().unwrap_or_default(),
                r["layers"].as_str().unwrap_or_default(),
                r["present"],
                r["path"].as_str().unwrap_or_default()
            );
        }
    }
    Ok(())
}

//! The `std-serving` mode of `bench routing`: the paper's "Std. Serving" baseline, built the
//! way a user would build it from existing engines. One single-model server per model (this
//! binary's own `serve --model`, each in its own process), asked for one token per call over
//! HTTP, and an external dispatcher that applies the same policy to every token from what the
//! API returns: the token id, and the entropy and largest probability of the distribution it
//! came from. Each call resends every committed token; the server finds all but the newest in
//! its prefix cache. Its `Server-Timing` header splits each call's time (`breakdown`).

use super::routing::Tally;
use anyhow::Context;
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::io::Read;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokenrouter::config::{Config, PolicyKind};
use tokenrouter::engine::shared_text::SharedText;
use tokenrouter::engine::spelling::Spelling;
use tokenrouter::engine::LogitStats;
use tokenrouter::policy::{RequestId, RequestInfo, Route, RoutingState, SharedPolicy, StepView};
use tokenrouter::runtime::{Prompt, Runtime, RuntimeError};

/// How long a single-model server may take to load its model and answer `/health`.
const START_TIMEOUT: Duration = Duration::from_secs(180);

/// The single-model servers, one process per configured model, killed on drop.
pub(super) struct Servers {
    children: Vec<Child>,
    /// Base URL and model name per model index.
    endpoints: Arc<Vec<(String, String)>>,
}

impl Servers {
    /// Starts `serve --model` for every model of the config at `config_path` on free
    /// loopback ports and waits until each answers `/health`.
    pub fn start(config_path: &Path, config: &Config) -> anyhow::Result<Self> {
        let exe = std::env::current_exe().context("cannot find this binary")?;
        let mut servers = Servers {
            children: Vec::new(),
            endpoints: Arc::new(Vec::new()),
        };
        let mut endpoints = Vec::new();
        for model in &config.models {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .context("no free loopback port")?
                .port();
            let child = Command::new(&exe)
                .arg("serve")
                .arg("--config")
                .arg(config_path)
                .args(["--model", &model.name, "--host", "127.0.0.1"])
                .args(["--port", &port.to_string()])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .with_context(|| format!("cannot start the server for `{}`", model.name))?;
            servers.children.push(child);
            endpoints.push((format!("http://127.0.0.1:{port}"), model.name.clone()));
        }
        let agent = ureq::agent();
        for (child, (url, name)) in servers.children.iter_mut().zip(&endpoints) {
            let started = Instant::now();
            while agent.get(&format!("{url}/health")).call().is_err() {
                if let Ok(Some(status)) = child.try_wait() {
                    let mut stderr = String::new();
                    if let Some(mut pipe) = child.stderr.take() {
                        let _ = pipe.read_to_string(&mut stderr);
                    }
                    anyhow::bail!(
                        "the server for `{name}` exited ({status}): {}",
                        stderr.trim()
                    );
                }
                if started.elapsed() > START_TIMEOUT {
                    anyhow::bail!(
                        "the server for `{name}` did not answer /health within {} s",
                        START_TIMEOUT.as_secs()
                    );
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            // Its log is not read again: a full pipe must never block the server.
            drop(child.stderr.take());
        }
        servers.endpoints = Arc::new(endpoints);
        Ok(servers)
    }
}

impl Drop for Servers {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Why a policy cannot run over an HTTP API, if it cannot.
pub(super) fn unsupported(policy: &SharedPolicy) -> Option<String> {
    let info = policy.describe();
    let needs = policy.needs();
    if needs.hidden || needs.embedding || needs.top_k > 0 {
        return Some(format!(
            "policy `{}` reads hidden states or top logits (a learned router), which an HTTP \
             API does not return; std-serving routes on the entropy and largest probability",
            info.name
        ));
    }
    if info.kind == PolicyKind::Me {
        return Some(format!(
            "policy `{}` mixes both models' distributions at every token; std-serving hands \
             whole tokens between single-model servers",
            info.name
        ));
    }
    None
}

/// Where the dispatcher's time per committed token went, in ms (summed over its calls,
/// divided by committed tokens). `http` is each call's round trip less the server's own
/// time: connection, request and response bodies, the dispatcher's JSON.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Breakdown {
    pub calls_per_token: f64,
    pub http_ms: f64,
    pub parse_ms: f64,
    pub tokenize_ms: f64,
    pub queue_ms: f64,
    pub prefix_match_ms: f64,
    pub compute_ms: f64,
    /// The dispatcher applying the policy.
    pub policy_ms: f64,
}

impl Breakdown {
    fn add_call(&mut self, round_trip: Duration, server_timing: &str) {
        self.calls_per_token += 1.0;
        let mut server_total = 0.0;
        for part in server_timing.split(',') {
            let mut fields = part.trim().split(";dur=");
            let (Some(name), Some(ms)) = (fields.next(), fields.next()) else {
                continue;
            };
            let ms: f64 = ms.parse().unwrap_or(0.0);
            match name {
                "parse" => self.parse_ms += ms,
                "tokenize" => self.tokenize_ms += ms,
                "queue" => self.queue_ms += ms,
                "prefix" => self.prefix_match_ms += ms,
                "compute" => self.compute_ms += ms,
                "total" => server_total = ms,
                _ => {}
            }
        }
        self.http_ms += (round_trip.as_secs_f64() * 1e3 - server_total).max(0.0);
    }

    /// Every field, so sums and scalings cannot miss one.
    fn fields_mut(&mut self) -> [&mut f64; 8] {
        [
            &mut self.calls_per_token,
            &mut self.http_ms,
            &mut self.parse_ms,
            &mut self.tokenize_ms,
            &mut self.queue_ms,
            &mut self.prefix_match_ms,
            &mut self.compute_ms,
            &mut self.policy_ms,
        ]
    }

    fn merge(&mut self, mut other: Breakdown) {
        for (sum, v) in self.fields_mut().into_iter().zip(other.fields_mut()) {
            *sum += *v;
        }
    }

    fn per_token(mut self, tokens: usize) -> Self {
        let n = tokens.max(1) as f64;
        for v in self.fields_mut() {
            *v /= n;
        }
        self
    }
}

/// What every request of a cell shares.
pub(super) struct Cell {
    pub policy: SharedPolicy,
    /// Per prompt, its tokens in each model's vocabulary.
    pub prompts: Vec<Vec<Vec<u32>>>,
    pub concurrency: usize,
    pub requests: usize,
    pub max_tokens: usize,
    /// Per model, the end-of-sequence tokens that end a request (empty when the workload
    /// ignores them).
    pub eos: Vec<BTreeSet<u32>>,
    /// Per model, its vocabulary's size.
    pub vocab_sizes: Vec<usize>,
    /// Per model what its tokens spell, when the models read different vocabularies: the
    /// dispatcher then hands the committed text over, as the runtime does.
    pub spellings: Option<Vec<Arc<Spelling>>>,
}

impl Cell {
    /// `[concurrency, requests, max_tokens]` requests of `policy` on `prompts`, as `runtime`'s
    /// models read them.
    pub fn new(
        runtime: &Runtime,
        policy: SharedPolicy,
        prompts: &[Prompt],
        [concurrency, requests, max_tokens]: [usize; 3],
        ignore_eos: bool,
    ) -> Result<Self, RuntimeError> {
        let models = runtime.model_names().len();
        let spellings = runtime.spellings()?;
        let prompts = prompts
            .iter()
            .map(|p| {
                (0..models)
                    .map(|m| {
                        p.in_vocabulary(runtime.vocabulary_of(m))
                            .unwrap_or_default()
                            .to_vec()
                    })
                    .collect()
            })
            .collect();
        Ok(Self {
            policy,
            prompts,
            concurrency,
            requests,
            max_tokens,
            eos: (0..models)
                .map(|m| match ignore_eos {
                    true => BTreeSet::new(),
                    false => runtime.eos_tokens(m).clone(),
                })
                .collect(),
            vocab_sizes: spellings.iter().map(|s| s.words().len()).collect(),
            spellings: runtime.has_several_vocabularies().then_some(spellings),
        })
    }
}

/// One call's answer: the token and its routing signals.
struct OneToken {
    id: u32,
    stats: LogitStats,
}

fn ask(
    agent: &ureq::Agent,
    (url, model): &(String, String),
    tokens: &[u32],
    seed: u64,
    breakdown: &mut Breakdown,
) -> Result<OneToken, String> {
    let body = json!({
        "model": model,
        "prompt": tokens,
        "max_tokens": 1,
        "temperature": 0,
        "seed": seed,
        "logprobs": 1,
        // The dispatcher decides what an end-of-sequence token means, after routing.
        "ignore_eos": true,
    });
    let sent = Instant::now();
    let response = match agent
        .post(&format!("{url}/v1/completions"))
        .set("Content-Type", "application/json")
        .send_string(&body.to_string())
    {
        Ok(response) => response,
        Err(ureq::Error::Status(status, response)) => {
            let text = response.into_string().unwrap_or_default();
            return Err(format!("{model}: HTTP {status}: {text}"));
        }
        Err(e) => return Err(format!("{model}: {e}")),
    };
    let timing = response.header("server-timing").unwrap_or("").to_string();
    let answer: Value = response
        .into_string()
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok())
        .ok_or_else(|| format!("{model}: an answer that is not JSON"))?;
    breakdown.add_call(sent.elapsed(), &timing);
    let logprobs = &answer["choices"][0]["logprobs"];
    let id = logprobs["token_ids"][0].as_u64();
    let entropy = logprobs["entropies"][0].as_f64();
    let top = logprobs["top_logprobs"][0]
        .as_object()
        .and_then(|top| top.values().filter_map(Value::as_f64).reduce(f64::max));
    match (id, entropy, top) {
        (Some(id), Some(entropy), Some(top)) => Ok(OneToken {
            id: id as u32,
            stats: LogitStats {
                entropy: entropy as f32,
                max_prob: top.exp() as f32,
                top_k: Vec::new(),
            },
        }),
        _ => Err(format!("{model}: an answer without logprobs: {answer}")),
    }
}

/// One request, token by token, as the external dispatcher drives it. Across vocabularies
/// each model is sent its own prompt and its reading of the committed text (re-read from its
/// last stable boundary, as the runtime does), and a handoff waits for a whole character.
fn dispatch(
    agent: &ureq::Agent,
    endpoints: &[(String, String)],
    cell: &Cell,
    index: usize,
    logits: &[Vec<f32>],
    breakdown: &mut Breakdown,
) -> Result<super::routing::Followed, String> {
    let prompts = &cell.prompts[index % cell.prompts.len()];
    let seed = index as u64;
    let rid = RequestId(index as u64);
    let entry = cell.policy.entry(&RequestInfo {
        rid,
        prompt_len: prompts[0].len(),
        seed,
    });
    let mut state = RoutingState::new(rid, prompts[entry].clone(), endpoints.len(), seed);
    state.current = entry;
    let mut text = cell
        .spellings
        .as_ref()
        .map(|_| SharedText::new(endpoints.len()));
    let mut routing = tokenrouter::runtime::RoutingStats {
        tokens_per_model: vec![0; endpoints.len()],
        handoffs: 0,
    };
    let (mut committed, mut times, mut writers) = (Vec::new(), Vec::new(), Vec::new());
    while committed.len() < cell.max_tokens {
        let model = state.current;
        if let (Some(text), Some(spellings)) = (&mut text, &cell.spellings) {
            text.resync(model, &spellings[model])
                .map_err(|e| e.to_string())?;
            state.tokens = [&prompts[model][..], text.tokens(model)].concat();
        }
        let answer = ask(agent, &endpoints[model], &state.tokens, seed, breakdown)?;
        let decided = Instant::now();
        let view = StepView {
            model,
            candidate: answer.id,
            stats: &answer.stats,
            logits: &logits[model],
            hidden: None,
            embedding: None,
        };
        let route = cell.policy.route(&state, &view);
        breakdown.policy_ms += decided.elapsed().as_secs_f64() * 1e3;
        let (mut commits, mut next) = match route {
            Route::Stay => (true, model),
            Route::CommitThenSwitch(to) => (true, to),
            Route::RejectAndSwitch(to) => (false, to),
        };
        if next >= endpoints.len() {
            return Err(format!("the policy routed to model {next}"));
        }
        let inside_character =
            |text: &Option<SharedText>| text.as_ref().is_some_and(|t| !t.at_char_boundary());
        if next != model && inside_character(&text) {
            (commits, next) = (true, model);
        }
        if commits {
            if cell.eos[model].contains(&answer.id) {
                break;
            }
            state.tokens.push(answer.id);
            if let (Some(text), Some(spellings)) = (&mut text, &cell.spellings) {
                text.commit(model, answer.id, &spellings[model]);
            }
            committed.push(answer.id);
            routing.tokens_per_model[model] += 1;
            writers.push(model);
            times.push(Instant::now());
        }
        if next != model && inside_character(&text) {
            next = model;
        }
        if next != model {
            routing.handoffs += 1;
        }
        state.current = next;
    }
    Ok(super::routing::Followed {
        tokens: committed,
        writers,
        routing,
        times,
    })
}

/// Runs a cell's requests from `concurrency` closed-loop dispatcher threads.
pub(super) fn run_cell(servers: &Servers, cell: Cell) -> (Tally, Breakdown) {
    let next = AtomicUsize::new(0);
    let tally = Mutex::new(Tally::default());
    let breakdown = Mutex::new(Breakdown::default());
    let endpoints = servers.endpoints.clone();
    // The dispatcher sees no logits, only their count (R-Stitch normalises by it).
    let logits: Vec<Vec<f32>> = cell.vocab_sizes.iter().map(|&n| vec![0.0; n]).collect();
    std::thread::scope(|scope| {
        for _ in 0..cell.concurrency {
            scope.spawn(|| {
                let agent = ureq::agent();
                let mut mine = Breakdown::default();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= cell.requests {
                        break;
                    }
                    let sent = Instant::now();
                    let result = dispatch(&agent, &endpoints, &cell, i, &logits, &mut mine);
                    let ended = Instant::now();
                    let mut t = tally.lock().unwrap_or_else(|e| e.into_inner());
                    match result {
                        Ok(followed) => t.record(i, sent, ended, followed),
                        Err(e) => {
                            tracing::warn!("std-serving request {i}: {e}");
                            t.fail(sent);
                        }
                    }
                }
                let mut total = breakdown.lock().unwrap_or_else(|e| e.into_inner());
                total.merge(mine);
            });
        }
    });
    let tally = tally.into_inner().unwrap_or_else(|e| e.into_inner());
    let tokens = tally.tokens;
    let breakdown = breakdown.into_inner().unwrap_or_else(|e| e.into_inner());
    (tally, breakdown.per_token(tokens))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_is_split_by_its_server_timing() {
        let mut b = Breakdown::default();
        b.add_call(
            Duration::from_millis(10),
            "parse;dur=0.5, tokenize;dur=1.0, queue;dur=2.0, prefix;dur=0.25, \
             compute;dur=4.0, total;dur=8.0",
        );
        b.add_call(Duration::from_millis(4), "total;dur=3.0, compute;dur=2.0");
        let b = b.per_token(2);
        assert_eq!(b.calls_per_token, 1.0);
        assert!((b.http_ms - 1.5).abs() < 1e-9, "{b:?}");
        assert!((b.compute_ms - 3.0).abs() < 1e-9, "{b:?}");
        assert!((b.prefix_match_ms - 0.125).abs() < 1e-9, "{b:?}");
        assert!((b.queue_ms - 1.0).abs() < 1e-9, "{b:?}");
    }
}

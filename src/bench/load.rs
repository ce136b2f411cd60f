//! `bench load`: drives a running server over loopback HTTP, bounded in count and time:
//! closed-loop workers mixing streamed and whole completions, random client disconnects,
//! and periodic policy swaps through the admin API. Every request must end as a complete
//! response, a clean (OpenAI-shaped) error, or a disconnect the tool made itself; afterwards
//! the server must be healthy with no KV held.

use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub struct LoadSettings {
    pub url: String,
    pub requests: usize,
    pub concurrency: usize,
    pub max_tokens: usize,
    /// Fraction of requests whose client hangs up early.
    pub disconnect_fraction: f64,
    /// Policies the default is swapped between, every `swap_every`.
    pub swap_policies: Vec<String>,
    pub swap_every: Duration,
    pub admin_token: Option<String>,
    /// A request with no answer after this long counts as hung.
    pub hang_after: Duration,
}

/// How one request ended.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Completed,
    /// An OpenAI-shaped error: a status, or an error event inside a stream.
    CleanError(String),
    /// The tool hung up on purpose.
    Disconnected,
    /// No answer within `hang_after`.
    Hung,
    /// A transport failure or an answer outside the API's shape.
    Lost(String),
}

#[derive(Debug, Serialize)]
pub struct LoadReport {
    pub requests: usize,
    pub concurrency: usize,
    pub seconds: f64,
    pub outcomes: BTreeMap<String, usize>,
    pub hung: usize,
    pub lost: usize,
    pub policy_swaps: usize,
    pub policy_swap_failures: usize,
    pub kv_tokens_used_after: BTreeMap<String, f64>,
    pub model_restarts: BTreeMap<String, f64>,
    pub requests_total_by_status: BTreeMap<String, f64>,
    pub healthy_after: bool,
}

const PROMPTS: [&str; 4] = [
    "The capital of France is",
    "Write one sentence about the sea.",
    "List three colours:",
    "The printing press changed Europe because",
];

fn is_timeout(e: &ureq::Error) -> bool {
    matches!(e, ureq::Error::Transport(t) if t.to_string().contains("timed out"))
}

/// An error answer: clean when it has OpenAI's shape.
fn error_outcome(status: u16, response: ureq::Response) -> Outcome {
    let body: Value = response
        .into_string()
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default();
    if body["error"]["message"].is_string() {
        Outcome::CleanError(format!("http {status}"))
    } else {
        Outcome::Lost(format!("http {status} without an OpenAI error body"))
    }
}

fn one_request(settings: &LoadSettings, i: usize, stream: bool, disconnect: bool) -> Outcome {
    let body = json!({
        "prompt": PROMPTS[i % PROMPTS.len()],
        "max_tokens": settings.max_tokens,
        "temperature": 0.7,
        "seed": i,
        "stream": stream,
    });
    // A whole answer is abandoned by timing out early; a stream after its first event.
    let timeout = match (disconnect, stream) {
        (true, false) => Duration::from_millis(50),
        _ => settings.hang_after,
    };
    let response = ureq::post(&format!("{}/v1/completions", settings.url))
        .timeout(timeout)
        .set("Content-Type", "application/json")
        .send_string(&body.to_string());
    let response = match response {
        Ok(r) => r,
        Err(ureq::Error::Status(status, r)) => return error_outcome(status, r),
        Err(e) if disconnect && is_timeout(&e) => return Outcome::Disconnected,
        Err(e) if is_timeout(&e) => return Outcome::Hung,
        Err(e) => return Outcome::Lost(e.to_string()),
    };
    if !stream {
        let answer: Value = match response.into_string().map(|t| serde_json::from_str(&t)) {
            Ok(Ok(v)) => v,
            _ if disconnect => return Outcome::Disconnected,
            _ => return Outcome::Lost("unreadable answer".into()),
        };
        return if answer["choices"][0]["finish_reason"].is_string() {
            Outcome::Completed
        } else {
            Outcome::Lost(format!("no finish_reason: {answer}"))
        };
    }
    let mut last = Value::Null;
    for line in BufReader::new(response.into_reader()).lines() {
        let Ok(line) = line else {
            return Outcome::Lost("the stream broke".into());
        };
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if disconnect {
            return Outcome::Disconnected;
        }
        if data == "[DONE]" {
            return if last.get("error").is_some() {
                Outcome::CleanError("error event in stream".into())
            } else if last["choices"][0]["finish_reason"].is_string() {
                Outcome::Completed
            } else {
                Outcome::Lost(format!("[DONE] without a finish: {last}"))
            };
        }
        last = serde_json::from_str(data).unwrap_or(Value::Null);
    }
    Outcome::Lost("the stream ended without [DONE]".into())
}

fn swap_default(settings: &LoadSettings, policy: &str) -> bool {
    let mut request = ureq::put(&format!("{}/admin/policy", settings.url))
        .timeout(Duration::from_secs(30))
        .set("Content-Type", "application/json");
    if let Some(token) = &settings.admin_token {
        request = request.set("Authorization", &format!("Bearer {token}"));
    }
    request
        .send_string(&json!({"default": policy}).to_string())
        .is_ok()
}

fn get(settings: &LoadSettings, path: &str) -> Option<String> {
    ureq::get(&format!("{}{path}", settings.url))
        .timeout(Duration::from_secs(30))
        .call()
        .ok()?
        .into_string()
        .ok()
}

/// `label value` of every sample of `name`, keyed by the value of label `key`.
fn samples_by(metrics: &str, name: &str, key: &str) -> BTreeMap<String, f64> {
    metrics
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix(name)?.strip_prefix('{')?;
            let (labels, value) = rest.split_once("} ")?;
            let label = labels
                .split(',')
                .find_map(|kv| kv.strip_prefix(&format!("{key}=\"")))?
                .trim_end_matches('"');
            Some((label.to_string(), value.trim().parse::<f64>().ok()?))
        })
        .fold(BTreeMap::new(), |mut acc, (k, v)| {
            *acc.entry(k).or_insert(0.0) += v;
            acc
        })
}

pub fn run(settings: &LoadSettings) -> LoadReport {
    let start = Instant::now();
    let next = AtomicUsize::new(0);
    let done = AtomicBool::new(false);
    let outcomes = Mutex::new(BTreeMap::<Outcome, usize>::new());
    let swaps = (AtomicUsize::new(0), AtomicUsize::new(0));
    std::thread::scope(|scope| {
        for worker in 0..settings.concurrency {
            let (next, outcomes) = (&next, &outcomes);
            scope.spawn(move || {
                let mut rng = rand::rngs::StdRng::seed_from_u64(worker as u64);
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= settings.requests {
                        return;
                    }
                    let disconnect = rng.gen_bool(settings.disconnect_fraction);
                    let outcome = one_request(settings, i, i % 2 == 0, disconnect);
                    *outcomes.lock().unwrap().entry(outcome).or_default() += 1;
                }
            });
        }
        if !settings.swap_policies.is_empty() {
            let (done, swaps) = (&done, &swaps);
            scope.spawn(move || {
                let mut k = 0;
                let mut last = Instant::now();
                while !done.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(100));
                    if last.elapsed() < settings.swap_every {
                        continue;
                    }
                    last = Instant::now();
                    k += 1;
                    let policy = &settings.swap_policies[k % settings.swap_policies.len()];
                    let counter = if swap_default(settings, policy) {
                        &swaps.0
                    } else {
                        &swaps.1
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
        while next.load(Ordering::Relaxed) < settings.requests + settings.concurrency {
            std::thread::sleep(Duration::from_millis(100));
        }
        done.store(true, Ordering::Relaxed);
    });
    let seconds = start.elapsed().as_secs_f64();
    // Cancelled requests free their KV within a step; give the server a moment to settle.
    let settle = Instant::now();
    let mut metrics = String::new();
    while settle.elapsed() < Duration::from_secs(30) {
        metrics = get(settings, "/metrics").unwrap_or_default();
        let kv = samples_by(&metrics, "tokenrouter_kv_tokens_used", "model");
        if !kv.is_empty() && kv.values().all(|&v| v == 0.0) {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let healthy_after = get(settings, "/health")
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .is_some_and(|h| h["status"] == "ok");
    let outcomes = outcomes.into_inner().unwrap();
    let count = |pick: fn(&Outcome) -> bool| -> usize {
        outcomes
            .iter()
            .filter(|(o, _)| pick(o))
            .map(|(_, n)| n)
            .sum()
    };
    let mut by_name = BTreeMap::new();
    for (outcome, n) in &outcomes {
        let name = match outcome {
            Outcome::Completed => "completed".to_string(),
            Outcome::CleanError(what) => format!("clean error ({what})"),
            Outcome::Disconnected => "client disconnect".to_string(),
            Outcome::Hung => "hung".to_string(),
            Outcome::Lost(what) => format!("lost ({what})"),
        };
        *by_name.entry(name).or_default() += n;
    }
    LoadReport {
        requests: settings.requests,
        concurrency: settings.concurrency,
        seconds,
        outcomes: by_name,
        hung: count(|o| *o == Outcome::Hung),
        lost: count(|o| matches!(o, Outcome::Lost(_))),
        policy_swaps: swaps.0.into_inner(),
        policy_swap_failures: swaps.1.into_inner(),
        kv_tokens_used_after: samples_by(&metrics, "tokenrouter_kv_tokens_used", "model"),
        model_restarts: samples_by(&metrics, "tokenrouter_model_restarts_total", "model"),
        requests_total_by_status: samples_by(&metrics, "tokenrouter_requests_total", "status"),
        healthy_after,
    }
}

impl LoadReport {
    /// Nothing hung or was lost, no KV is held and the server answers.
    pub fn passed(&self) -> bool {
        self.hung == 0
            && self.lost == 0
            && self.healthy_after
            && !self.kv_tokens_used_after.is_empty()
            && self.kv_tokens_used_after.values().all(|&v| v == 0.0)
    }

    pub fn markdown(&self) -> String {
        let mut out = format!(
            "{} requests at concurrency {} in {:.0} s.\n\n| outcome | requests |\n|---|---:|\n",
            self.requests, self.concurrency, self.seconds
        );
        for (name, n) in &self.outcomes {
            out += &format!("| {name} | {n} |\n");
        }
        let fmt = |m: &BTreeMap<String, f64>| {
            m.iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        out += &format!(
            "\nHung: {}. Lost: {}. Policy swaps: {} ({} failed). Model restarts (injected \
             panics): {}. Server-side request counts by status: {}. KV tokens held afterwards: \
             {}. Healthy afterwards: {}. **{}**\n",
            self.hung,
            self.lost,
            self.policy_swaps,
            self.policy_swap_failures,
            fmt(&self.model_restarts),
            fmt(&self.requests_total_by_status),
            fmt(&self.kv_tokens_used_after),
            self.healthy_after,
            if self.passed() { "PASS" } else { "FAIL" }
        );
        out
    }
}

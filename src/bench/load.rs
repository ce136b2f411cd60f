//! `bench load`: drives a running server over loopback HTTP, for a request count or a
//! duration: closed-loop workers mixing streamed and whole completions, random client
//! disconnects, and periodic policy swaps through the admin API. Every request must end as a
//! complete response, a clean (OpenAI-shaped) error, or a disconnect the tool made itself;
//! afterwards the server must be healthy with no KV held. Every `sample_every` it records the
//! server's memory, file descriptors, KV and the latency of the requests that completed
//! (`soak`); `slow_clients` measures a normal load beside idle and slow-loris connections.

use super::soak;
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
    /// Run for this long instead of `requests` requests.
    pub duration: Option<Duration>,
    pub sample_every: Duration,
    /// The server's process, whose memory and file descriptors are sampled (same host).
    pub server_pid: Option<u32>,
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

#[derive(Debug, Clone, Serialize)]
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
    /// Completed requests' latency over the whole run.
    pub latency_ms_p50: f64,
    pub latency_ms_p99: f64,
    /// Before the load, every `sample_every` during it, and after it settled.
    pub samples: Vec<soak::Sample>,
    /// In duration mode with the server's pid: memory and descriptors against the limits.
    pub soak: Option<soak::SoakCheck>,
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

/// One sample of the server now; latencies of the requests that ended since `since`.
fn sample(
    settings: &LoadSettings,
    start: Instant,
    latencies: &soak::Latencies,
    since: Instant,
) -> soak::Sample {
    let now = Instant::now();
    // The process first: the metrics request's own connection is not counted.
    let rss_mib = settings.server_pid.and_then(soak::rss_mib);
    let fds = settings.server_pid.and_then(soak::fds);
    let metrics = get(settings, "/metrics").unwrap_or_default();
    let sum = |name: &str| samples_by(&metrics, name, "model").values().sum::<f64>();
    let window = latencies.between(since, now);
    soak::Sample {
        at_s: now.saturating_duration_since(start).as_secs_f64(),
        rss_mib,
        fds,
        kv_tokens_used: sum("tokenrouter_kv_tokens_used"),
        kv_tokens_cached: sum("tokenrouter_kv_tokens_cached"),
        kv_tokens_capacity: sum("tokenrouter_kv_tokens_capacity"),
        completed: window.len(),
        latency_ms_p50: soak::quantile(&window, 0.5),
        latency_ms_p99: soak::quantile(&window, 0.99),
    }
}

pub fn run(settings: &LoadSettings) -> LoadReport {
    let latencies = soak::Latencies::default();
    // A whole and a streamed request first, so the server's lazily opened descriptors (its
    // HTTP workers' first connections) are in the idle count, not taken for a leak.
    let _ = one_request(settings, 0, false, false);
    let _ = one_request(settings, 1, true, false);
    std::thread::sleep(Duration::from_millis(200));
    let mut samples = vec![sample(settings, Instant::now(), &latencies, Instant::now())];
    let start = Instant::now();
    // A request count, or as many as the duration takes.
    let requests = if settings.duration.is_some() {
        usize::MAX
    } else {
        settings.requests
    };
    let out_of_time = || settings.duration.is_some_and(|d| start.elapsed() >= d);
    let next = AtomicUsize::new(0);
    let working = AtomicUsize::new(settings.concurrency);
    let done = AtomicBool::new(false);
    let outcomes = Mutex::new(BTreeMap::<Outcome, usize>::new());
    let swaps = (AtomicUsize::new(0), AtomicUsize::new(0));
    let during = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for worker in 0..settings.concurrency {
            let (next, outcomes, working, latencies) = (&next, &outcomes, &working, &latencies);
            scope.spawn(move || {
                let mut rng = rand::rngs::StdRng::seed_from_u64(worker as u64);
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= requests || out_of_time() {
                        working.fetch_sub(1, Ordering::Relaxed);
                        return;
                    }
                    let disconnect = rng.gen_bool(settings.disconnect_fraction);
                    let sent = Instant::now();
                    let outcome = one_request(settings, i, i % 2 == 0, disconnect);
                    if outcome == Outcome::Completed {
                        latencies.record(sent.elapsed());
                    }
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
        {
            let (done, during, latencies) = (&done, &during, &latencies);
            scope.spawn(move || {
                let mut last = Instant::now();
                while !done.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(100));
                    if last.elapsed() >= settings.sample_every {
                        let s = sample(settings, start, latencies, last);
                        last = Instant::now();
                        during.lock().unwrap().push(s);
                    }
                }
            });
        }
        while working.load(Ordering::Relaxed) > 0 {
            std::thread::sleep(Duration::from_millis(100));
        }
        done.store(true, Ordering::Relaxed);
    });
    let seconds = start.elapsed().as_secs_f64();
    samples.extend(during.into_inner().unwrap());
    // Cancelled requests free their KV within a step, and closed connections their
    // descriptors once both ends shut: give the server a moment to settle.
    let idle_fds = samples[0].fds;
    let settle = Instant::now();
    let last = loop {
        let last = sample(settings, start, &latencies, Instant::now());
        let settled = last.kv_tokens_used == 0.0 && last.fds <= idle_fds;
        if settled || settle.elapsed() >= Duration::from_secs(30) {
            break last;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    samples.push(last);
    let metrics = get(settings, "/metrics").unwrap_or_default();
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
    let all = latencies.all();
    LoadReport {
        requests: outcomes.values().sum(),
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
        latency_ms_p50: soak::quantile(&all, 0.5).unwrap_or(0.0),
        latency_ms_p99: soak::quantile(&all, 0.99).unwrap_or(0.0),
        soak: settings
            .duration
            .and_then(|_| soak::SoakCheck::from_samples(&samples)),
        samples,
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
            && self.soak.as_ref().is_none_or(soak::SoakCheck::passed)
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
        out += &format!(
            "\nCompleted requests' latency: p50 {:.0} ms, p99 {:.0} ms.\n",
            self.latency_ms_p50, self.latency_ms_p99
        );
        if let Some(check) = &self.soak {
            out += &format!(
                "\nMemory: {:.1} MiB at the end against {:.1} MiB at {:.0} s ({}), {:+.1} % \
                 (limit ±{:.0} %). Open file descriptors: {} idle before the load, {} after it.\n",
                check.rss_end_mib,
                check.rss_reference_mib,
                check.rss_reference_at_s,
                if check.kv_full_at_reference {
                    "the KV at its budget, prefix cache full"
                } else {
                    "5 minutes in; the KV never reached its budget"
                },
                100.0 * check.rss_change(),
                100.0 * soak::RSS_TOLERANCE,
                check.fds_idle,
                check.fds_after,
            );
        }
        out += &format!(
            "\nSamples (the first before the load, the last after it settled):\n\n{}",
            soak::table(&self.samples)
        );
        out
    }
}

//! A `tokenrouter serve` child process on a free loopback port, and small HTTP helpers.

use super::{Arch, TinySpec};
use candle_core::quantized::GgmlDType;
use serde_json::Value;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const ADMIN_TOKEN: &str = "test-admin-token-7f3a";

pub struct Server {
    child: Child,
    pub base: String,
    /// Everything the server wrote to stderr so far.
    pub log: Arc<Mutex<String>>,
}

impl Server {
    /// Starts the server on `config` (port 0) with the test admin token in the environment,
    /// and waits for its "listening on" line.
    pub fn start(config: &Path) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tokenrouter"))
            .args(["serve", "--port", "0", "--config"])
            .arg(config)
            .env("TOKENROUTER_ADMIN_TOKEN", ADMIN_TOKEN)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn tokenrouter serve");
        let stderr = child.stderr.take().unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(addr) = line.split("listening on ").nth(1) {
                    let _ = tx.send(addr.trim().to_string());
                }
                let mut log = sink.lock().unwrap();
                log.push_str(&line);
                log.push('\n');
            }
        });
        let base = match rx.recv_timeout(Duration::from_secs(120)) {
            Ok(base) => base,
            Err(_) => {
                let _ = child.kill();
                panic!("server did not start:\n{}", log.lock().unwrap());
            }
        };
        Server { child, base, log }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Sends `body` (raw) and returns the status and the parsed JSON answer.
    pub fn call(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<&str>,
    ) -> (u16, serde_json::Value) {
        let mut request = ureq::request(method, &self.url(path))
            .set("Content-Type", "application/json")
            .timeout(Duration::from_secs(300));
        if let Some(token) = token {
            request = request.set("Authorization", &format!("Bearer {token}"));
        }
        let result = match body {
            Some(body) => request.send_string(body),
            None => request.call(),
        };
        let response = match result {
            Ok(r) => r,
            Err(ureq::Error::Status(_, r)) => r,
            Err(e) => panic!("{method} {path}: {e}"),
        };
        let status = response.status();
        let text = response.into_string().unwrap();
        let json = serde_json::from_str(&text)
            .unwrap_or_else(|_| panic!("{method} {path} -> {status}: not JSON: {text}"));
        (status, json)
    }

    pub fn post(&self, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
        self.call("POST", path, None, Some(&body.to_string()))
    }

    pub fn put_policy(&self, body: &serde_json::Value) -> (u16, serde_json::Value) {
        self.call(
            "PUT",
            "/admin/policy",
            Some(ADMIN_TOKEN),
            Some(&body.to_string()),
        )
    }

    pub fn metrics(&self) -> String {
        ureq::get(&self.url("/metrics"))
            .call()
            .unwrap()
            .into_string()
            .unwrap()
    }

    /// Waits until the server's log (read from its stderr by another thread) holds `line`.
    pub fn wait_for_log(&self, line: &str) {
        let start = Instant::now();
        while !self.log.lock().unwrap().contains(line) {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "timed out waiting for `{line}` in the log:\n{}",
                self.log.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until `done` holds on the metrics text.
    pub fn wait_for_metrics(&self, what: &str, done: impl Fn(&str) -> bool) {
        let start = Instant::now();
        loop {
            let text = self.metrics();
            if done(&text) {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "timed out waiting for {what}:\n{text}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Server {
    /// Waits up to `limit` for the process to exit on its own.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let start = Instant::now();
        while start.elapsed() < limit {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sum of every sample of `name` (any labels) in Prometheus text.
pub fn metric_sum(text: &str, name: &str) -> f64 {
    samples(text, name).map(|(_, v)| v).sum()
}

/// `(labels, value)` of every sample of `name`.
pub fn samples<'a>(text: &'a str, name: &'a str) -> impl Iterator<Item = (&'a str, f64)> + 'a {
    text.lines().filter_map(move |line| {
        let rest = line.strip_prefix(name)?;
        let (labels, value) = match rest.strip_prefix('{') {
            Some(r) => {
                let (labels, value) = r.split_once("} ")?;
                (labels, value)
            }
            None => ("", rest.strip_prefix(' ')?),
        };
        Some((labels, value.trim().parse().ok()?))
    })
}

/// One streamed generation: its SSE `data:` payloads, read until `[DONE]`.
pub fn stream_events(server: &Server, path: &str, body: &serde_json::Value) -> Vec<String> {
    let response = ureq::post(&server.url(path))
        .set("Content-Type", "application/json")
        .timeout(Duration::from_secs(300))
        .send_string(&body.to_string())
        .unwrap_or_else(|e| panic!("POST {path}: {e}"));
    assert_eq!(
        response.header("content-type"),
        Some("text/event-stream"),
        "streams are SSE"
    );
    let mut text = String::new();
    response.into_reader().read_to_string(&mut text).unwrap();
    text.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            e.strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not an SSE data event: {e:?}"))
                .to_string()
        })
        .collect()
}

/// One streamed generation's text: its chunks' `delta.content` (chat) or `text`
/// (completions), joined.
pub fn stream_text(server: &Server, path: &str, body: &serde_json::Value) -> String {
    stream_events(server, path, body)
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| {
            let chunk: serde_json::Value = serde_json::from_str(e).unwrap();
            let choice = &chunk["choices"][0];
            let piece = choice["delta"]["content"]
                .as_str()
                .or(choice["text"].as_str());
            piece.unwrap_or_default().to_string()
        })
        .collect()
}

/// Two tiny models; `r2r` at θ = 0 sends every token to `large`, at θ = 1e6 none.
pub fn write_tiny_config(dir: &Path, r2r_threshold: f64) -> PathBuf {
    write_tiny_config_with(dir, r2r_threshold, 8192, "")
}

/// The same, with each model's KV budget and extra `[server]` lines.
pub fn write_tiny_config_with(
    dir: &Path,
    r2r_threshold: f64,
    kv_tokens: usize,
    server: &str,
) -> PathBuf {
    let spec = TinySpec::new(Arch::Llama);
    let small = super::write_gguf(&dir.join("small.gguf"), &spec, GgmlDType::Q8_0);
    let large_spec = TinySpec { seed: 99, ..spec };
    let large = super::write_gguf(&dir.join("large.gguf"), &large_spec, GgmlDType::Q8_0);
    let path = dir.join("server.toml");
    std::fs::write(
        &path,
        format!(
            r#"
[[models]]
name = "large"
path = "{}"
kv_tokens = {kv_tokens}
[[models]]
name = "small"
path = "{}"
kv_tokens = {kv_tokens}
[runtime]
default_policy = "me"
batch_timeout_ms = 2
[server]
max_body_bytes = 4096
max_prompt_tokens = 200
{server}
[[policies]]
name = "me"
kind = "me"
models = ["small", "large"]
weights = [0.5, 0.5]
[[policies]]
name = "r2r"
kind = "r2r"
models = ["small", "large"]
threshold = {r2r_threshold}
"#,
            large.display(),
            small.display()
        ),
    )
    .unwrap();
    path
}

/// Every `expr` of every panel in `dashboards/<file>` (`tokenrouter.json`: one process;
/// `tokenrouter-cluster.json`: front ends and workers on a bus).
pub fn dashboard_exprs(file: &str) -> Vec<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("dashboards")
        .join(file);
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut exprs = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            exprs.push(target["expr"].as_str().expect("expr").to_string());
        }
    }
    exprs
}

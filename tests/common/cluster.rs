//! A real `nats-server` and `tokenrouter worker` children for the cluster tests, and the
//! tiny pair's configs with `large` on a worker.

use super::{Arch, TinySpec};
use candle_core::quantized::GgmlDType;
use std::io::{BufRead, BufReader};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokenrouter::config::Config;

pub const TOKEN: &str = "cluster-test-token-51c9";

/// A `nats-server` child on a free loopback port, requiring `TOKEN`.
pub struct Nats {
    child: Child,
    pub port: u16,
}

impl Drop for Nats {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn nats_server() -> Option<Nats> {
    nats_server_with(&[])
}

/// `nats-server` requiring `TOKEN`, with extra arguments (TLS).
pub fn nats_server_with(extra: &[&str]) -> Option<Nats> {
    nats_server_args(&[&["--auth", TOKEN], extra].concat())
}

/// `nats-server` on a free loopback port with `args` alone (its own authorization).
pub fn nats_server_args(args: &[&str]) -> Option<Nats> {
    let program = ["/usr/sbin/nats-server", "/usr/bin/nats-server"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.exists());
    let Some(program) = program else {
        if std::env::var("TOKENROUTER_REQUIRE_CLIENTS").is_ok_and(|v| v == "1") {
            panic!("nats-server is missing; scripts/test.sh installs it");
        }
        eprintln!("skipping: nats-server is missing (scripts/test.sh installs it)");
        return None;
    };
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = Command::new(program)
        .args(["-a", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn nats-server");
    let started = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "nats-server did not listen"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    Some(Nats { child, port })
}

/// A `tokenrouter worker` child; its stderr is collected.
pub struct Worker {
    pub child: Child,
    /// Everything the worker wrote to stderr so far.
    pub log: Arc<Mutex<String>>,
}

impl Worker {
    pub fn start(config: &Path, model: &str, token: &str) -> Worker {
        Self::start_with(config, model, token, &[])
    }

    pub fn start_with(config: &Path, model: &str, token: &str, extra: &[&str]) -> Worker {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tokenrouter"))
            .args(["worker", "--model", model, "--config"])
            .arg(config)
            .args(extra)
            .env("TOKENROUTER_NATS_TOKEN", token)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn tokenrouter worker");
        let stderr = child.stderr.take().unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let mut log = sink.lock().unwrap();
                log.push_str(&line);
                log.push('\n');
            }
        });
        Worker { child, log }
    }

    /// A worker hosting `model` that serves its `/metrics` on the returned loopback port.
    pub fn with_metrics(config: &Path, model: &str) -> (Worker, u16) {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr = format!("127.0.0.1:{port}");
        let worker = Self::start_with(config, model, TOKEN, &["--metrics-addr", &addr]);
        (worker, port)
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The tiny pair with `large` placed remote (the worker hosts it) and the bus's settings.
pub fn write_configs(dir: &Path, port: u16, mode: &str) -> (PathBuf, Config) {
    write_configs_with(dir, port, mode, "")
}

pub fn write_configs_with(dir: &Path, port: u16, mode: &str, bus: &str) -> (PathBuf, Config) {
    let (worker, frontend) = config_texts(dir, port, mode, bus);
    let worker_config = dir.join(format!("worker-{mode}.toml"));
    std::fs::write(&worker_config, worker).unwrap();
    (worker_config, Config::parse(&frontend).unwrap())
}

/// The worker's and the front end's config files (the front end's with the token): the
/// tiny pair written into `dir`, `large` placed on the worker.
pub fn config_texts(dir: &Path, port: u16, mode: &str, bus: &str) -> (String, String) {
    let small = super::write_gguf(
        &dir.join("small.gguf"),
        &TinySpec::new(Arch::Llama),
        GgmlDType::Q8_0,
    );
    let large_spec = TinySpec {
        seed: 18,
        ..TinySpec::new(Arch::Llama)
    };
    let large = super::write_gguf(&dir.join("large.gguf"), &large_spec, GgmlDType::Q8_0);
    let text = |placement: &str, cluster: &str| {
        format!(
            r#"
[[models]]
name = "small"
path = "{}"
batch_threshold = 2
[[models]]
name = "large"
path = "{}"
batch_threshold = 2
placement = "{placement}"
[runtime]
mode = "{mode}"
batch_timeout_ms = 5
retune_interval_ms = 0
[[policies]]
name = "me"
kind = "me"
models = ["small", "large"]
weights = [0.5, 0.5]
[[policies]]
name = "rstitch"
kind = "rstitch"
models = ["small", "large"]
threshold = 1.0
{cluster}
"#,
            small.display(),
            large.display()
        )
    };
    let cluster = format!(
        "[cluster]\nurl = \"nats://127.0.0.1:{port}\"\nheartbeat_ms = 500\njoin_timeout_ms = 30000\n{bus}"
    );
    (
        text("local", &cluster),
        text("remote", &format!("{cluster}token = \"{TOKEN}\"\n")),
    )
}

/// `config` with every model in this process and no bus: the reference a cluster must match.
pub fn in_one_process(config: &Config) -> Config {
    let mut local = config.clone();
    local.cluster = None;
    for m in &mut local.models {
        m.placement = tokenrouter::config::Placement::Local;
    }
    local
}

/// `GET path` on a loopback port; the response body.
pub fn http_get(port: u16, path: &str) -> String {
    use std::io::{Read, Write};
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response
}

/// The sum of metric `name`'s samples on the `/metrics` at a loopback port (0 without any).
pub fn worker_metric(port: u16, name: &str) -> f64 {
    super::server::metric_sum(&http_get(port, "/metrics"), name)
}

//! Real clients against the server: the official `openai` Python client on the real CPU pair,
//! and a real Prometheus scraping it under load, evaluating every dashboard query. The test
//! script installs both (a venv with `openai`, Debian's `prometheus`); with
//! `TOKENROUTER_REQUIRE_CLIENTS=1` (CI) a missing one fails instead of skipping.

mod common;

use common::server::{dashboard_exprs, write_tiny_config, Server, ADMIN_TOKEN};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn missing(what: &str) -> Option<PathBuf> {
    if std::env::var("TOKENROUTER_REQUIRE_CLIENTS").is_ok_and(|v| v == "1") {
        panic!("{what} is missing; scripts/test.sh installs it");
    }
    eprintln!("skipping: {what} is missing (scripts/test.sh installs it)");
    None
}

/// The program `env` names (or `default`) when running it with `args` succeeds.
fn working_program(env: &str, default: PathBuf, args: &[&str], what: &str) -> Option<PathBuf> {
    let program = std::env::var_os(env).map(PathBuf::from).unwrap_or(default);
    let ok = Command::new(&program)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if ok {
        Some(program)
    } else {
        missing(what)
    }
}

/// A Python that can `import openai`.
fn python_with_openai() -> Option<PathBuf> {
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv-test/bin/python");
    let what = "a Python with the `openai` package";
    working_program("TOKENROUTER_PYTHON", venv, &["-c", "import openai"], what)
}

fn prometheus() -> Option<PathBuf> {
    let what = "the `prometheus` server";
    working_program(
        "TOKENROUTER_PROMETHEUS",
        "prometheus".into(),
        &["--version"],
        what,
    )
}

#[test]
fn the_openai_python_client_talks_to_the_real_pair() {
    let (Some(_), Some(python)) = (common::real_model(), python_with_openai()) else {
        return;
    };
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/default.toml");
    let server = Server::start(&config);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/clients/openai_client.py");
    let output = Command::new(python)
        .arg(script)
        .arg(&server.base)
        .arg("me,r2r,citer,rstitch,colm")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "client failed:\n{stdout}\n{stderr}"
    );
    let summary: Value = serde_json::from_str(stdout.trim()).unwrap();
    eprintln!("{summary:#}");
    let results = summary["results"].as_array().unwrap();
    assert_eq!(results.len(), 5);
    // R-Stitch at its calibrated thresholds hands nearly every token to the LLM, so its
    // answer is the LLM's; the layer-skip draft's own continuations change with any change
    // in rounding, so they are not pinned.
    let rstitch = results.iter().find(|r| r["policy"] == "rstitch").unwrap();
    let answer = rstitch["chat"].as_str().unwrap();
    assert!(answer.contains("Tokyo"), "the real pair answers: {answer}");
}

struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn query(prometheus: &str, expr: &str) -> Value {
    let response = ureq::get(&format!("{prometheus}/api/v1/query"))
        .query("query", expr)
        .call()
        .unwrap_or_else(|e| panic!("query {expr}: {e}"));
    serde_json::from_str(&response.into_string().unwrap()).unwrap()
}

#[test]
fn prometheus_scrapes_under_load_and_every_dashboard_query_returns_data() {
    let Some(binary) = prometheus() else { return };
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&write_tiny_config(dir.path(), 0.0));
    let target = server.base.trim_start_matches("http://").to_string();
    let scrape = dir.path().join("prometheus.yml");
    std::fs::write(
        &scrape,
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: tokenrouter\n    static_configs:\n      - targets: [\"{target}\"]\n"
        ),
    )
    .unwrap();
    let port = free_port();
    let prometheus = format!("http://127.0.0.1:{port}");
    let _child = ChildGuard(
        Command::new(binary)
            .arg(format!("--config.file={}", scrape.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("tsdb").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start prometheus"),
    );
    let start = Instant::now();
    while ureq::get(&format!("{prometheus}/-/ready")).call().is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "prometheus never got ready"
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // A short load: 4 clients over both policies, streaming and not, and one policy swap.
    let load_end = Instant::now() + Duration::from_secs(6);
    std::thread::scope(|scope| {
        for client in 0..4 {
            let server = &server;
            scope.spawn(move || {
                let mut i = 0;
                while Instant::now() < load_end {
                    let model = ["me", "r2r"][(client + i) % 2];
                    let body = json!({
                        "model": model,
                        "prompt": "the weather in the city",
                        "max_tokens": 16,
                        "stream": i % 2 == 0,
                    });
                    let response = ureq::post(&server.url("/v1/completions"))
                        .send_string(&body.to_string())
                        .unwrap();
                    assert_eq!(response.status(), 200);
                    response.into_string().unwrap();
                    i += 1;
                }
            });
        }
        std::thread::sleep(Duration::from_secs(2));
        let (status, _) = server.call(
            "PUT",
            "/admin/policy",
            Some(ADMIN_TOKEN),
            Some(r#"{"policies": {"r2r": {"threshold": 3.0}}}"#),
        );
        assert_eq!(status, 200);
    });
    // Let a few more scrapes land after the load.
    std::thread::sleep(Duration::from_secs(3));

    let up = query(&prometheus, "up{job=\"tokenrouter\"}");
    assert_eq!(
        up["data"]["result"][0]["value"][1], "1",
        "scrape target up: {up}"
    );
    let exprs = dashboard_exprs();
    let mut empty = Vec::new();
    for expr in &exprs {
        let concrete = expr
            .replace("$__rate_interval", "1m")
            .replace("$model", ".*")
            .replace("$policy", ".*");
        let answer = query(&prometheus, &concrete);
        assert_eq!(answer["status"], "success", "{concrete}: {answer}");
        if answer["data"]["result"]
            .as_array()
            .is_none_or(|r| r.is_empty())
        {
            empty.push(concrete);
        }
    }
    assert!(
        empty.is_empty(),
        "dashboard queries without data: {empty:#?}"
    );
    eprintln!("{} dashboard queries returned data", exprs.len());
}

//! Fuzzing of the request parsing and validation path through a real server (tiny models):
//! the corpus in `tests/fuzz-corpus/`, then proptest-generated bodies shaped like OpenAI
//! requests (known fields, hostile values) and raw byte mutations of the corpus. No body may
//! get a 5xx or an error outside OpenAI's shape, and the server must stay healthy.
//! `PROPTEST_CASES=N` runs longer.

mod common;

use common::server::{write_tiny_config, Server};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use serde_json::{json, Map, Value};
use std::path::Path;

const ENDPOINTS: [&str; 2] = ["/v1/completions", "/v1/chat/completions"];
const FIELDS: [&str; 17] = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "ignore_eos",
    "timeout",
    "role",
    "content",
    "include_usage",
];

thread_local! {
    /// Answers per status, printed at the end (what the run exercised).
    static STATUSES: std::cell::RefCell<std::collections::BTreeMap<u16, usize>> = Default::default();
}

/// Sends `body` raw; checks the answer is a success or a 4xx OpenAI error.
fn check(server: &Server, path: &str, body: &[u8]) -> Result<(), TestCaseError> {
    let response = ureq::post(&server.url(path))
        .set("Content-Type", "application/json")
        .send_bytes(body);
    let (status, text) = match response {
        Ok(r) => (r.status(), r.into_string().unwrap_or_default()),
        Err(ureq::Error::Status(code, r)) => (code, r.into_string().unwrap_or_default()),
        Err(e) => return Err(TestCaseError::fail(format!("transport error: {e}"))),
    };
    STATUSES.with(|s| *s.borrow_mut().entry(status).or_default() += 1);
    let shown = String::from_utf8_lossy(body);
    prop_assert!(status < 500, "{status} for {shown}: {text}");
    if status >= 400 {
        let error: Value = serde_json::from_str(&text)
            .map_err(|_| TestCaseError::fail(format!("{status}, not JSON: {text}")))?;
        prop_assert!(error["error"]["message"].is_string(), "{shown} -> {text}");
        prop_assert!(error["error"]["type"].is_string(), "{shown} -> {text}");
    }
    Ok(())
}

fn scalar() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        (-3i64..5000).prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        (0.0f64..3.0).prop_map(Value::from),
        "\\PC{0,12}".prop_map(Value::from),
        prop::sample::select(vec![
            "user",
            "system",
            "assistant",
            "me",
            "r2r",
            "large",
            "text"
        ])
        .prop_map(Value::from),
    ]
}

fn value() -> impl Strategy<Value = Value> {
    scalar().prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            prop::collection::vec((prop::sample::select(FIELDS.to_vec()), inner), 0..4).prop_map(
                |pairs| Value::Object(pairs.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
            ),
        ]
    })
}

/// An object of known fields with arbitrary values: what a confused client sends.
fn request() -> impl Strategy<Value = Value> {
    prop::collection::vec((prop::sample::select(FIELDS.to_vec()), value()), 0..7).prop_map(
        |pairs| {
            let mut body: Map<String, Value> =
                pairs.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
            // Keep valid generations short: the point is the parser, not the model.
            body.entry("max_tokens").or_insert(json!(4));
            Value::Object(body)
        },
    )
}

fn corpus() -> Vec<Vec<u8>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz-corpus");
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    files.iter().map(|f| std::fs::read(f).unwrap()).collect()
}

#[test]
fn no_request_body_gets_a_5xx_or_breaks_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&write_tiny_config(dir.path(), 0.0));
    let seeds = corpus();
    assert!(seeds.len() >= 8);
    for seed in &seeds {
        for path in ENDPOINTS {
            check(&server, path, seed).unwrap();
        }
    }
    let runner = || {
        TestRunner::new(Config {
            cases: std::env::var("PROPTEST_CASES")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(256),
            failure_persistence: None,
            ..Config::default()
        })
    };
    runner()
        .run(&(request(), 0..2usize), |(body, endpoint)| {
            check(&server, ENDPOINTS[endpoint], body.to_string().as_bytes())
        })
        .unwrap();
    // Byte-level mutations of the corpus: flips, cuts and insertions.
    let mutation = (
        0..seeds.len(),
        prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0..3u8), 1..6),
        0..2usize,
    );
    runner()
        .run(&mutation, |(which, edits, endpoint)| {
            let mut body = seeds[which].clone();
            for (at, byte, kind) in edits {
                if body.is_empty() {
                    body.push(byte);
                    continue;
                }
                let i = at.index(body.len());
                match kind {
                    0 => body[i] = byte,
                    1 => body.truncate(i),
                    _ => body.insert(i, byte),
                }
            }
            check(&server, ENDPOINTS[endpoint], &body)
        })
        .unwrap();
    let statuses = STATUSES.with(|s| s.borrow().clone());
    eprintln!("answers by status: {statuses:?}");
    assert!(
        statuses.contains_key(&200) && statuses.contains_key(&400),
        "{statuses:?}"
    );
    let (status, health) = server.call("GET", "/health", None, None);
    assert_eq!((status, &health["status"]), (200, &json!("ok")));
}

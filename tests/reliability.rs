//! Overload, deadlines and shutdown on a real `tokenrouter serve` child process (tiny
//! models): nothing hangs, nothing is lost, every refusal says when to retry.

mod common;

use common::server::{metric_sum, samples, stream_events, write_tiny_config_with, Server};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// A raw connection to `server`; reads give up after 10 s.
fn raw_connection(server: &Server) -> TcpStream {
    let stream = TcpStream::connect(server.base.trim_start_matches("http://")).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream
}

/// Everything the server sends on `stream` until it closes it.
fn read_until_closed(mut stream: TcpStream) -> String {
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).unwrap();
    String::from_utf8_lossy(&answer).to_string()
}

/// A streamed completion that runs for a while (end-of-sequence ignored).
fn long_stream(tokens: u32) -> Value {
    json!({"model": "me", "prompt": "the city", "max_tokens": tokens, "stream": true,
           "ignore_eos": true, "temperature": 0})
}

#[test]
fn past_the_queue_bound_requests_get_429_with_retry_after_and_the_rest_complete() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_tiny_config_with(
        dir.path(),
        0.0,
        8192,
        "max_concurrent_requests = 1\nmax_queued_requests = 1",
    );
    let server = Server::start(&config);
    std::thread::scope(|scope| {
        // One running (its first event arrived), one queued behind it...
        let first = ureq::post(&server.url("/v1/completions"))
            .send_string(&long_stream(480).to_string())
            .unwrap();
        let mut first = first.into_reader();
        let mut head = [0u8; 6];
        first.read_exact(&mut head).unwrap();
        let started = Instant::now();
        let queued = scope.spawn(|| stream_events(&server, "/v1/completions", &long_stream(256)));
        while server.call("GET", "/health", None, None).1["queued_requests"] != 1 {
            assert!(started.elapsed() < Duration::from_secs(5), "never queued");
        }
        // ...so a third is refused at once.
        let refused =
            ureq::post(&server.url("/v1/completions")).send_string(&long_stream(8).to_string());
        match refused {
            Err(ureq::Error::Status(429, response)) => {
                assert_eq!(response.header("retry-after"), Some("1"));
                let body: Value = serde_json::from_str(&response.into_string().unwrap()).unwrap();
                assert_eq!(body["error"]["type"], "overloaded_error", "{body}");
            }
            other => panic!("expected 429, got {other:?}"),
        }
        eprintln!(
            "refused {:?} after the first stream started",
            started.elapsed()
        );
        let mut rest = String::new();
        first.read_to_string(&mut rest).unwrap();
        assert!(rest.ends_with("data: [DONE]\n\n"));
        let events = queued.join().unwrap();
        assert_eq!(events.last().unwrap(), "[DONE]");
        let last: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
        assert_eq!(last["usage"]["completion_tokens"], 256, "{last}");
    });
    let (status, _) = server.post(
        "/v1/completions",
        &json!({"prompt": "the city", "max_tokens": 4}),
    );
    assert_eq!(status, 200, "slots are free again");
}

#[test]
fn an_expired_deadline_answers_408_and_frees_the_request() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&write_tiny_config_with(dir.path(), 0.0, 8192, ""));
    let (status, body) = server.post(
        "/v1/completions",
        &json!({"model": "me", "prompt": "the city", "max_tokens": 256, "ignore_eos": true,
                "timeout": 0.02}),
    );
    assert_eq!(status, 408, "{body}");
    assert_eq!(body["error"]["type"], "timeout_error");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("deadline"));
    let (status, body) = server.post(
        "/v1/completions",
        &json!({"prompt": "the city", "timeout": -1}),
    );
    assert_eq!((status, &body["error"]["param"]), (400, &json!("timeout")));
    server.wait_for_metrics("the expired request freed", |text| {
        text.contains(r#"tokenrouter_requests_total{policy="me",status="deadline"} 1"#)
            && common::server::samples(text, "tokenrouter_kv_tokens_used").all(|(_, v)| v == 0.0)
    });
}

#[test]
fn sigterm_refuses_queued_requests_lets_running_streams_finish_then_exits_zero() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = Server::start(&write_tiny_config_with(
        dir.path(),
        0.0,
        8192,
        "shutdown_grace_s = 20\nmax_concurrent_requests = 3\nmax_queued_requests = 4",
    ));
    let streams: Vec<_> = (0..3)
        .map(|_| {
            let response = ureq::post(&server.url("/v1/completions"))
                .send_string(&long_stream(240).to_string())
                .unwrap();
            let mut reader = response.into_reader();
            let mut first = [0u8; 6];
            reader.read_exact(&mut first).unwrap();
            assert_eq!(&first, b"data: ");
            reader
        })
        .collect();
    // A fourth request waits for a slot: draining answers it 503 with Retry-After.
    let queued = std::thread::spawn({
        let url = server.url("/v1/completions");
        move || match ureq::post(&url).send_string(&long_stream(8).to_string()) {
            Ok(r) => (r.status(), None),
            Err(ureq::Error::Status(code, r)) => {
                (code, r.header("retry-after").map(str::to_string))
            }
            Err(e) => panic!("transport error: {e}"),
        }
    });
    while server.call("GET", "/health", None, None).1["queued_requests"] != 1 {
        std::thread::sleep(Duration::from_millis(2));
    }
    let sent = Instant::now();
    let status = std::process::Command::new("kill")
        .args(["-TERM", &server.pid().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let (status, retry_after) = queued.join().unwrap();
    assert_eq!(
        (status, retry_after.as_deref()),
        (503, Some("1")),
        "the queued request"
    );
    for mut reader in streams {
        let mut rest = String::new();
        reader.read_to_string(&mut rest).unwrap();
        assert!(
            rest.ends_with("data: [DONE]\n\n"),
            "a stream was cut: {rest:?}"
        );
        assert!(rest.contains("\"finish_reason\":\"length\""));
    }
    let exit = server
        .wait_exit(Duration::from_secs(30))
        .expect("the server exits after draining");
    assert!(exit.success(), "{exit:?}");
    assert!(sent.elapsed() < Duration::from_secs(25));
    let log = server.log.lock().unwrap().clone();
    assert!(
        log.contains("draining") && log.contains("tokenrouter stopped"),
        "{log}"
    );
}

#[test]
fn kv_exhaustion_makes_requests_wait_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    // 96 KV tokens per model: one 40-token request fits, eight at once cannot; they wait for
    // room or start over, and every one completes.
    let server = Server::start(&write_tiny_config_with(dir.path(), 0.0, 96, ""));
    let results: Vec<(u16, Value)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..8)
            .map(|i| {
                let server = &server;
                scope.spawn(move || {
                    let body = json!({"model": "me", "prompt": "the weather in the city",
                                      "max_tokens": 32, "ignore_eos": true, "seed": i});
                    match ureq::post(&server.url("/v1/completions")).send_string(&body.to_string())
                    {
                        Ok(r) => (
                            r.status(),
                            serde_json::from_str(&r.into_string().unwrap()).unwrap(),
                        ),
                        Err(ureq::Error::Status(code, r)) => (
                            code,
                            serde_json::from_str(&r.into_string().unwrap()).unwrap(),
                        ),
                        Err(e) => panic!("lost: {e}"),
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (status, body) in &results {
        assert_eq!(*status, 200, "{body}");
        assert_eq!(body["usage"]["completion_tokens"], 32, "{body}");
    }
    server.wait_for_metrics("KV freed", |text| {
        common::server::samples(text, "tokenrouter_kv_tokens_used").all(|(_, v)| v == 0.0)
    });
    // Larger than a model's whole budget: no retry would help, so 400, not 429.
    let body = json!({"model": "me", "prompt": "the weather", "max_tokens": 120});
    match ureq::post(&server.url("/v1/completions")).send_string(&body.to_string()) {
        Err(ureq::Error::Status(400, r)) => {
            let body: Value = serde_json::from_str(&r.into_string().unwrap()).unwrap();
            let message = body["error"]["message"].as_str().unwrap();
            assert!(message.contains("KV budget of 96"), "{message}");
        }
        other => panic!("expected 400, got {other:?}"),
    }
    // Without max_tokens, a chat gets as many as the budget holds (not a 400).
    let body = json!({"model": "me", "messages": [{"role": "user", "content": "the weather"}],
                      "ignore_eos": true});
    let response = ureq::post(&server.url("/v1/chat/completions"))
        .send_string(&body.to_string())
        .unwrap();
    let body: Value = serde_json::from_str(&response.into_string().unwrap()).unwrap();
    let usage = &body["usage"];
    assert_eq!(usage["total_tokens"], 96, "{body}");
}

/// A client that never finishes its headers (slow-loris) is answered 408 and closed once
/// `header_timeout_ms` passes, while a normal client is served meanwhile.
#[test]
fn a_client_that_never_finishes_its_headers_is_closed() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&write_tiny_config_with(
        dir.path(),
        0.0,
        8192,
        "header_timeout_ms = 1000",
    ));
    let mut slow = raw_connection(&server);
    slow.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    let started = Instant::now();
    let (status, _) = server.post(
        "/v1/completions",
        &json!({"model": "me", "prompt": "the city", "max_tokens": 2}),
    );
    assert_eq!(status, 200);
    let answer = read_until_closed(slow);
    let waited = started.elapsed();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer:?}");
    assert!(waited < Duration::from_secs(5), "closed after {waited:?}");
}

/// A client that sends its headers but withholds the rest of the body is answered 408 with an
/// OpenAI-style error once `body_timeout_ms` passes, and its connection is closed.
#[test]
fn a_client_that_withholds_its_body_gets_408_and_is_closed() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&write_tiny_config_with(
        dir.path(),
        0.0,
        8192,
        "body_timeout_ms = 300",
    ));
    let mut slow = raw_connection(&server);
    slow.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
          Content-Length: 100\r\n\r\n{\"model\": ",
    )
    .unwrap();
    let started = Instant::now();
    let answer = read_until_closed(slow);
    let waited = started.elapsed();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer:?}");
    assert!(answer.contains(r#""type":"timeout_error""#), "{answer:?}");
    assert!(
        answer.contains("did not arrive within 300 ms"),
        "{answer:?}"
    );
    assert!(waited < Duration::from_secs(5), "closed after {waited:?}");
    let (status, _) = server.post(
        "/v1/completions",
        &json!({"model": "me", "prompt": "the city", "max_tokens": 2}),
    );
    assert_eq!(status, 200);
}

/// An idle client (connects, sends nothing) is closed once `header_timeout_ms` passes, and a
/// keep-alive connection idle after its response once `keep_alive_s` passes, while another
/// client is served meanwhile.
#[test]
fn idle_connections_are_closed_after_their_timeouts() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&write_tiny_config_with(
        dir.path(),
        0.0,
        8192,
        "header_timeout_ms = 1000\nkeep_alive_s = 1.0",
    ));
    let timed_read = |stream: TcpStream| {
        let started = Instant::now();
        let answer = read_until_closed(stream);
        (started.elapsed(), answer)
    };
    let idle = raw_connection(&server);
    let (status, _) = server.post(
        "/v1/completions",
        &json!({"model": "me", "prompt": "the city", "max_tokens": 2}),
    );
    assert_eq!(status, 200);
    let (waited, answer) = timed_read(idle);
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 408"),
        "{answer:?}"
    );
    assert!(waited < Duration::from_secs(5), "closed after {waited:?}");

    let mut kept = raw_connection(&server);
    kept.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let (waited, answer) = timed_read(kept);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer:?}");
    assert!(waited < Duration::from_secs(5), "closed after {waited:?}");
}

/// A streaming client that stops reading is treated like a disconnect: once its socket
/// buffer is full and tokens wait unread for `stream_stall_timeout_ms`, the request is
/// cancelled and its KV freed on every model.
#[test]
fn a_streaming_client_that_stops_reading_is_cancelled_and_its_kv_freed() {
    // The real model (tens of tokens a second): the stream outlasts the stall limit.
    let Some(model) = common::real_model() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("server.toml");
    std::fs::write(
        &config,
        format!(
            "[[models]]\nname = \"llm\"\npath = \"{}\"\nthreads = 1\n\
             [server]\nstream_stall_timeout_ms = 300\nsend_buffer_bytes = 4096\n",
            model.display()
        ),
    )
    .unwrap();
    let server = Server::start(&config);
    let address: std::net::SocketAddr = server.base.trim_start_matches("http://").parse().unwrap();
    let socket = socket2::Socket::new(
        socket2::Domain::IPV4,
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )
    .unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    socket.connect(&address.into()).unwrap();
    let mut stalled: TcpStream = socket.into();
    // Every token's chunk carries 20 alternatives (~1 KB): a few fill both 4 KB buffers.
    let body = json!({"model": "llm", "prompt": "Tell me a long story.", "max_tokens": 1000,
                      "ignore_eos": true, "stream": true, "logprobs": 20})
    .to_string();
    write!(
        stalled,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // The request ends cancelled, never completed, and no KV stays held.
    let started = Instant::now();
    while !samples(&server.metrics(), "tokenrouter_requests_total")
        .any(|(labels, n)| labels.contains("status=\"cancelled\"") && n >= 1.0)
    {
        assert!(started.elapsed() < Duration::from_secs(20), "not cancelled");
        std::thread::sleep(Duration::from_millis(100));
    }
    let metrics = server.metrics();
    assert!(
        !samples(&metrics, "tokenrouter_requests_total")
            .any(|(labels, n)| labels.contains("status=\"completed\"") && n > 0.0),
        "{metrics}"
    );
    server.wait_for_metrics("KV freed", |metrics| {
        metric_sum(metrics, "tokenrouter_kv_tokens_used") == 0.0
    });
    // The server goes on serving.
    let (status, _) = server.post(
        "/v1/completions",
        &json!({"prompt": "the city", "max_tokens": 2}),
    );
    assert_eq!(status, 200);
    drop(stalled);
}

/// `bench load` in duration mode samples the server over time (memory and descriptors from
/// its pid, KV from its metrics), and beside idle and slow-loris connections the normal load
/// still completes while the server keeps closing the slow ones.
#[test]
fn bench_load_samples_a_soak_and_measures_a_load_beside_slow_clients() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&write_tiny_config_with(
        dir.path(),
        0.0,
        8192,
        "header_timeout_ms = 1000",
    ));
    let load = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tokenrouter"))
            .args(["bench", "load", "--url", &server.base, "--concurrency", "2"])
            .args([
                "--max-tokens",
                "4",
                "--disconnect",
                "0",
                "--swap-policies",
                "",
            ])
            .args(args)
            .arg("--json")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        let report: Value =
            serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {stderr}"));
        (out.status.success(), report, stderr)
    };
    let pid = server.pid().to_string();
    let (ok, soak, stderr) = load(&[
        "--duration-s",
        "2",
        "--sample-every-s",
        "0.5",
        "--server-pid",
        &pid,
    ]);
    assert!(ok, "{soak}\n{stderr}");
    let samples = soak["samples"].as_array().unwrap();
    assert!(samples.len() >= 4, "{soak}");
    let fds = |s: &Value| s["fds"].as_u64().unwrap();
    assert!(fds(&samples[0]) > 0 && samples[0]["rss_mib"].as_f64().unwrap() > 0.0);
    assert!(fds(samples.last().unwrap()) <= fds(&samples[0]), "{soak}");
    assert!(samples.iter().any(|s| s["completed"].as_u64().unwrap() > 0));
    assert!(soak["outcomes"]["completed"].as_u64().unwrap() > 0);

    let (_, slow, stderr) = load(&[
        "--requests",
        "8",
        "--idle-clients",
        "20",
        "--slow-clients",
        "5",
        "--rounds",
        "1",
    ]);
    let round = &slow["rounds"][0];
    for arm in ["alone", "beside"] {
        assert_eq!(round[arm]["outcomes"]["completed"], 8, "{arm}: {stderr}");
    }
    // Closed after about a second and reopened, for the whole 3 s warm-up and the load.
    assert!(
        round["slow"]["idle_closed"].as_u64().unwrap() >= 20,
        "{round}"
    );
    assert!(
        round["slow"]["slow_closed"].as_u64().unwrap() >= 5,
        "{round}"
    );
}

//! The runtime across processes, on a real NATS server (Debian's `nats-server`, installed by
//! `scripts/install-test-clients.sh`; with `TOKENROUTER_REQUIRE_CLIENTS=1`, as in CI, a
//! missing one fails instead of skipping): this test process is the front end hosting the
//! small model, a `tokenrouter worker` child process hosts the large one. Greedy tokens are
//! those of one process, a killed worker's requests end cleanly, a restarted one serves, and
//! a worker with the wrong token is refused without the token in its log.

mod common;

use common::cluster::*;
use common::greedy_request as request;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use tokenrouter::config::{Config, ExecutionMode};
use tokenrouter::runtime::{GenerateRequest, Runtime, RuntimeError};

/// Polls `holds` every 20 ms until it does, failing after 10 s with `what`.
async fn eventually(what: &str, holds: impl Fn() -> bool) {
    let started = Instant::now();
    while !holds() {
        assert!(started.elapsed() < Duration::from_secs(10), "never: {what}");
        actix_rt::time::sleep(Duration::from_millis(20)).await;
    }
}

fn prompts() -> Vec<Vec<u32>> {
    (0..6u32)
        .map(|i| {
            (0..4 + i % 5)
                .map(|j| 3 + (i * 31 + j * 17) % 250)
                .collect()
        })
        .collect()
}

/// Every prompt under every policy, all in flight at once; tokens per request.
async fn run(rt: &Runtime, max_tokens: usize) -> Vec<Vec<u32>> {
    let mut handles = Vec::new();
    for policy in ["me", "small", "large"] {
        for (i, p) in prompts().iter().enumerate() {
            handles.push(
                rt.submit(request(p, policy, max_tokens, 100 + i as u64))
                    .unwrap(),
            );
        }
    }
    let mut out = Vec::new();
    for h in handles {
        out.push(h.collect().await.unwrap().token_ids);
    }
    out
}

#[actix_rt::test]
async fn greedy_tokens_across_processes_match_one_process_in_every_mode() {
    let Some(nats) = nats_server() else { return };
    let dir = tempfile::tempdir().unwrap();
    for mode in ["async", "standard", "tokenrouter", "lockstep"] {
        let (worker_config, frontend) = write_configs(dir.path(), nats.port, mode);
        let local = Runtime::start(&in_one_process(&frontend), None).unwrap();
        let want = run(&local, 24).await;
        local.shutdown();

        let worker = Worker::start(&worker_config, "large", TOKEN);
        let rt = Runtime::start(&frontend, None)
            .unwrap_or_else(|e| panic!("{e}; worker: {}", worker.log.lock().unwrap()));
        let got = run(&rt, 24).await;
        assert_eq!(got, want, "mode {mode}");
        // In lockstep every step of the worker's model waited for the front end's grant.
        let log = worker.log.lock().unwrap().clone();
        assert!(!log.contains("step lock"), "mode {mode}: {log}");
        assert!(
            rt.snapshot().models[0].steps > 0,
            "the small model here never stepped"
        );
        // `me` hands requests back from the worker: each such handoff's transit is measured.
        let transits = rt.take_handoff_transits();
        assert!(
            !transits.is_empty() && transits.iter().all(|t| *t < Duration::from_secs(5)),
            "handoff transits: {transits:?}"
        );
        // The worker's steps and route counts reach this process's record of `large`,
        // where the tuner reads them.
        let heard = Instant::now();
        loop {
            let large = &rt.snapshot().models[1];
            if large.steps > 0 && large.committed_to.iter().sum::<u64>() > 0 {
                break;
            }
            assert!(
                heard.elapsed() < Duration::from_secs(5),
                "no record of the worker's steps here: {large:?}"
            );
            actix_rt::time::sleep(Duration::from_millis(50)).await;
        }
        wait_for_zero_kv(&rt).await;
        rt.shutdown();
    }
}

async fn wait_for_zero_kv(rt: &Runtime) {
    let start = Instant::now();
    while rt.kv_tokens_used()[0] > 0 || rt.live_requests() > 0 {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "KV still held here: {:?}, live {}",
            rt.kv_tokens_used(),
            rt.live_requests()
        );
        actix_rt::time::sleep(Duration::from_millis(5)).await;
    }
}

#[actix_rt::test]
async fn a_killed_workers_requests_end_cleanly_and_a_restarted_worker_serves() {
    let Some(nats) = nats_server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (worker_config, frontend) = write_configs(dir.path(), nats.port, "async");
    let mut worker = Worker::start(&worker_config, "large", TOKEN);
    let rt = Runtime::start(&frontend, Some(ExecutionMode::Async)).unwrap();
    let long = |i: u64| GenerateRequest {
        ignore_eos: true,
        ..request(&[5, 6, 7, 8], "me", 400, i)
    };
    let handles: Vec<_> = (0..64).map(|i| rt.submit(long(i)).unwrap()).collect();
    actix_rt::time::sleep(Duration::from_millis(300)).await;
    worker.kill();
    let killed = Instant::now();
    let mut unavailable = 0;
    for h in handles {
        match actix_rt::time::timeout(Duration::from_secs(10), h.collect()).await {
            Err(_) => panic!("a request still runs 10 s after the kill"),
            Ok(Ok(_)) => {}
            Ok(Err(RuntimeError::Unavailable(message))) => {
                assert!(message.contains("large"), "{message}");
                unavailable += 1;
            }
            Ok(Err(e)) => panic!("not a clean retryable error: {e}"),
        }
    }
    assert!(killed.elapsed() < Duration::from_secs(10));
    assert!(unavailable > 0, "every request finished before the kill");
    wait_for_zero_kv(&rt).await;
    // While the worker is down, a request that may need it fails at once, retryably.
    let refused = rt
        .submit(request(&[5, 6], "large", 4, 1))
        .unwrap()
        .collect()
        .await;
    assert!(
        matches!(refused, Err(RuntimeError::Unavailable(_))),
        "{refused:?}"
    );

    let _restarted = Worker::start(&worker_config, "large", TOKEN);
    let started = Instant::now();
    loop {
        match rt
            .submit(request(&[5, 6], "large", 4, 1))
            .unwrap()
            .collect()
            .await
        {
            Ok(done) => {
                assert_eq!(done.token_ids.len(), 4);
                break;
            }
            Err(RuntimeError::Unavailable(_)) if started.elapsed() < Duration::from_secs(60) => {
                actix_rt::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("the restarted worker does not serve: {e}"),
        }
    }
    rt.shutdown();
}

#[test]
fn a_worker_with_the_wrong_token_is_refused_and_does_not_log_it() {
    let Some(nats) = nats_server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (worker_config, _) = write_configs(dir.path(), nats.port, "async");
    let wrong = "wrong-secret-0d17";
    let mut worker = Worker::start(&worker_config, "large", wrong);
    let log = refused(&mut worker);
    assert!(log.to_lowercase().contains("authorization"), "{log}");
    assert!(!log.contains(wrong), "the token is in the log: {log}");
}

/// Waits for a worker that should be refused to exit; its log.
fn refused(worker: &mut Worker) -> String {
    let started = Instant::now();
    let status = loop {
        if let Some(status) = worker.child.try_wait().unwrap() {
            break status;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the worker was not refused"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(!status.success());
    std::thread::sleep(Duration::from_millis(100));
    let log = worker.log.lock().unwrap().clone();
    assert!(log.contains("cannot join the NATS bus"), "{log}");
    log
}

/// A server that authenticates users by nkey: a worker and a front end with the user's seed
/// (from a file) serve; a worker with another key pair's seed is refused without it logged.
#[actix_rt::test]
async fn nkey_credentials_join_and_another_key_is_refused_without_its_seed_logged() {
    let dir = tempfile::tempdir().unwrap();
    let user = nkeys::KeyPair::new_user();
    let conf = dir.path().join("nkey.conf");
    std::fs::write(
        &conf,
        format!(
            "authorization {{\n  users = [ {{ nkey: \"{}\" }} ]\n}}\n",
            user.public_key()
        ),
    )
    .unwrap();
    let conf = conf.display().to_string();
    let Some(nats) = nats_server_args(&["-c", &conf]) else {
        return;
    };
    let seed_file = |name: &str, seed: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, format!("{seed}\n")).unwrap();
        format!("nkey_seed_file = \"{}\"\n", path.display())
    };

    let stranger = nkeys::KeyPair::new_user().seed().unwrap();
    let (wrong_config, _) = write_configs_with(
        dir.path(),
        nats.port,
        "async",
        &seed_file("wrong", &stranger),
    );
    let mut wrong = Worker::start(&wrong_config, "large", "");
    let log = refused(&mut wrong);
    assert!(log.to_lowercase().contains("authorization"), "{log}");
    assert!(!log.contains(&stranger), "the seed is in the log: {log}");

    let seed = user.seed().unwrap();
    let (worker_config, mut frontend) =
        write_configs_with(dir.path(), nats.port, "async", &seed_file("right", &seed));
    frontend.cluster.as_mut().unwrap().token = None;
    let _worker = Worker::start(&worker_config, "large", "");
    let rt = Runtime::start(&frontend, None).unwrap();
    let done = rt
        .submit(request(&[5, 6, 7], "large", 4, 1))
        .unwrap()
        .collect()
        .await
        .unwrap();
    assert_eq!(done.token_ids.len(), 4);
    assert!(!format!("{frontend:?}").contains(&seed));
    rt.shutdown();
}

/// A CA and a server certificate for 127.0.0.1 signed by it, made with `openssl`.
fn certificates(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let run = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("run openssl");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
    ]);
    run(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
    ]);
    std::fs::write(dir.join("san.ext"), "subjectAltName=IP:127.0.0.1\n").unwrap();
    run(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        "san.ext",
        "-out",
        "server.pem",
    ]);
    (
        dir.join("ca.pem"),
        dir.join("server.pem"),
        dir.join("server.key"),
    )
}

#[actix_rt::test]
async fn a_tls_bus_with_a_self_signed_ca_works_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = certificates(dir.path());
    let (cert, key) = (cert.display().to_string(), key.display().to_string());
    let Some(nats) = nats_server_with(&["--tls", "--tlscert", &cert, "--tlskey", &key]) else {
        return;
    };
    let bus = format!("tls_ca = \"{}\"\n", ca.display());
    let (worker_config, frontend) = write_configs_with(dir.path(), nats.port, "async", &bus);
    let worker = Worker::start(&worker_config, "large", TOKEN);
    let rt = Runtime::start(&frontend, None)
        .unwrap_or_else(|e| panic!("{e}; worker: {}", worker.log.lock().unwrap()));
    let done = rt
        .submit(request(&[5, 6, 7], "large", 6, 1))
        .unwrap()
        .collect()
        .await
        .unwrap();
    assert_eq!(done.token_ids.len(), 6);
    rt.shutdown();

    // Without the CA the server's certificate is not trusted.
    let (_, mut untrusting) = write_configs(dir.path(), nats.port, "async");
    untrusting.cluster.as_mut().unwrap().url = format!("tls://127.0.0.1:{}", nats.port);
    let refused = Runtime::start(&untrusting, None)
        .err()
        .expect("an untrusted server");
    assert!(
        refused.to_string().contains("cannot join the NATS bus"),
        "{refused}"
    );
}

#[actix_rt::test]
async fn policy_swaps_during_a_remote_load_fail_nothing_and_never_mix_versions() {
    let Some(nats) = nats_server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (worker_config, frontend) = write_configs(dir.path(), nats.port, "async");
    let _worker = Worker::start(&worker_config, "large", TOKEN);
    let rt = std::rc::Rc::new(Runtime::start(&frontend, None).unwrap());
    let stop = std::rc::Rc::new(std::cell::Cell::new(false));
    let writers = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
    let streams: Vec<_> = (0..16u64)
        .map(|i| {
            let (rt, stop, writers) = (rt.clone(), stop.clone(), writers.clone());
            actix_rt::spawn(async move {
                while !stop.get() {
                    let long = GenerateRequest {
                        ignore_eos: true,
                        ..request(&[5, 6, 7, 8], "rstitch", 24, i)
                    };
                    let done = rt.submit(long).unwrap().collect().await;
                    let done = done.unwrap_or_else(|e| panic!("a request failed: {e}"));
                    let wrote: Vec<usize> = (0..2)
                        .filter(|&m| done.routing.tokens_per_model[m] > 0)
                        .collect();
                    writers.borrow_mut().push((wrote, done.routing.handoffs));
                }
            })
        })
        .collect();
    for i in 0..20 {
        actix_rt::time::sleep(Duration::from_millis(60)).await;
        // R-Stitch alternates between "the small model writes everything" (normalised
        // entropy never above 1) and "the large one does" (one handoff, then it stays: a
        // version that let the small model back would hand off at every token).
        let threshold = if i % 2 == 0 { 0.0 } else { 1.0 };
        let update = serde_json::from_value(serde_json::json!({
            "policies": {"rstitch": {"threshold": threshold}},
        }))
        .unwrap();
        rt.update_policies(&update).unwrap();
    }
    actix_rt::time::sleep(Duration::from_millis(60)).await;
    stop.set(true);
    for stream in streams {
        stream.await.unwrap();
    }
    let writers = writers.borrow();
    for (wrote, handoffs) in writers.iter() {
        assert!(
            wrote.len() <= 1 && *handoffs <= 1,
            "a request ran two versions of rstitch: writers {wrote:?}, {handoffs} handoffs"
        );
    }
    let seen: std::collections::BTreeSet<_> = writers.iter().flat_map(|(w, _)| w).collect();
    assert_eq!(
        seen.len(),
        2,
        "both versions served ({} requests)",
        writers.len()
    );
    rt.shutdown();
}

/// `config/default.toml` with both models hosted by workers (absolute model paths) and the
/// bus, for `mode`.
fn real_pair_config(dir: &Path, model: &Path, port: u16, mode: &str) -> (PathBuf, Config) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("config/default.toml"))
        .unwrap()
        .replace(
            "path = \"models/SmolLM2-135M-Instruct.Q4_1.gguf\"",
            &format!("path = \"{}\"\nplacement = \"remote\"", model.display()),
        )
        .replace("mode = \"tokenrouter\"", &format!("mode = \"{mode}\""));
    assert_eq!(text.matches("placement = \"remote\"").count(), 2);
    let text = format!(
        "{text}\n[cluster]\nurl = \"nats://127.0.0.1:{port}\"\nheartbeat_ms = 500\n\
         join_timeout_ms = 60000\n"
    );
    let path = dir.join(format!("real-{mode}.toml"));
    std::fs::write(&path, &text).unwrap();
    let mut frontend = Config::parse(&text).unwrap();
    frontend.cluster.as_mut().unwrap().token = Some(TOKEN.into());
    (path, frontend)
}

/// The real pair with each model in a worker of its own and a front end hosting neither:
/// every policy's greedy tokens are those of one process, in every mode a cluster runs.
#[actix_rt::test]
async fn the_real_pair_on_two_workers_writes_the_tokens_of_one_process() {
    let Some(model) = common::real_model() else {
        return;
    };
    let Some(nats) = nats_server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let prompts = [
        "The capital of France is",
        "Write a haiku about rivers:",
        "def fibonacci(n):",
    ];
    let policies = ["me", "r2r", "citer", "r2r-entropy", "rstitch", "colm"];
    let run = |rt: &Runtime| {
        let handles: Vec<_> = policies
            .iter()
            .flat_map(|policy| prompts.iter().map(move |p| (policy, p)))
            .enumerate()
            .map(|(i, (policy, text))| {
                let prompt = rt.tokenizer().unwrap().encode(text).unwrap();
                rt.submit(request(&prompt, policy, 16, i as u64)).unwrap()
            })
            .collect();
        async move {
            let mut out = Vec::new();
            for h in handles {
                out.push(h.collect().await.unwrap().token_ids);
            }
            out
        }
    };
    for mode in ["async", "standard", "tokenrouter", "lockstep"] {
        let (worker_config, frontend) = real_pair_config(dir.path(), &model, nats.port, mode);
        let local = Runtime::start(&in_one_process(&frontend), None).unwrap();
        let want = run(&local).await;
        local.shutdown();

        let workers = [
            Worker::start(&worker_config, "smollm2-135m", TOKEN),
            Worker::start(&worker_config, "smollm2-135m-skip7", TOKEN),
        ];
        let rt = Runtime::start(&frontend, None).unwrap_or_else(|e| {
            let logs: Vec<String> = workers
                .iter()
                .map(|w| w.log.lock().unwrap().clone())
                .collect();
            panic!("{e}; workers: {logs:?}")
        });
        let got = run(&rt).await;
        for (i, (got, want)) in got.iter().zip(&want).enumerate() {
            let (policy, prompt) = (policies[i / prompts.len()], prompts[i % prompts.len()]);
            assert_eq!(got, want, "mode {mode}, policy {policy}, prompt {prompt:?}");
        }
        rt.shutdown();
    }
}

/// Two workers host the small model (the large one stays in the front end): new requests
/// spread over both replicas by load, each stays on its replica, and the tokens are one
/// process's.
#[actix_rt::test]
async fn two_slm_replicas_share_the_requests_and_write_one_replicas_tokens() {
    let Some(nats) = nats_server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (worker_config, mut frontend) = write_configs(dir.path(), nats.port, "async");
    frontend.models[0].placement = tokenrouter::config::Placement::Remote;
    frontend.models[1].placement = tokenrouter::config::Placement::Local;
    let requests: Vec<GenerateRequest> = (0..32u64)
        .map(|i| {
            request(
                &prompts()[i as usize % 6],
                ["small", "me"][i as usize % 2],
                16,
                i,
            )
        })
        .collect();
    let run = |rt: &Runtime| {
        let handles: Vec<_> = requests
            .iter()
            .map(|r| rt.submit(r.clone()).unwrap())
            .collect();
        async move {
            let mut out = Vec::new();
            for h in handles {
                out.push(h.collect().await.unwrap().token_ids);
            }
            out
        }
    };
    let local = Runtime::start(&in_one_process(&frontend), None).unwrap();
    let want = run(&local).await;
    local.shutdown();

    let _replicas = [
        Worker::start(&worker_config, "small", TOKEN),
        Worker::start(&worker_config, "small", TOKEN),
    ];
    let rt = Runtime::start(&frontend, None).unwrap();
    // Both replicas beat before the load starts (the front end waits for one).
    let started = Instant::now();
    while rt.replicas().iter().filter(|r| r.up).count() < 2 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{:?}",
            rt.replicas()
        );
        actix_rt::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(run(&rt).await, want);
    let replicas = rt.replicas();
    let placed: u64 = replicas.iter().map(|r| r.placed).sum();
    for r in &replicas {
        assert!(
            r.placed as f64 >= 0.3 * placed as f64,
            "replica {} got {} of {placed} requests: {replicas:?}",
            r.host,
            r.placed
        );
    }
    rt.shutdown();
}

#[actix_rt::test]
async fn a_worker_serves_its_own_models_metrics() {
    let Some(nats) = nats_server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (worker_config, frontend) = write_configs(dir.path(), nats.port, "async");
    let (_worker, port) = Worker::with_metrics(&worker_config, "large");
    let rt = Runtime::start(&frontend, None).unwrap();
    rt.submit(request(&[5, 6, 7], "large", 6, 1))
        .unwrap()
        .collect()
        .await
        .unwrap();
    let metrics = http_get(port, "/metrics");
    let steps = metrics
        .lines()
        .find(|l| l.starts_with("tokenrouter_step_seconds_count{model=\"large\"}"))
        .unwrap_or_else(|| panic!("no step count for the hosted model: {metrics}"));
    let count: f64 = steps.rsplit(' ').next().unwrap().parse().unwrap();
    assert!(count >= 6.0, "{steps}");
    // The front end sees the worker as an up replica and has pinged it.
    let up = rt.replicas();
    assert!(up.len() == 1 && up[0].up && up[0].placed == 1, "{up:?}");
    rt.shutdown();
}

/// A request whose state is over the server's `max_payload` fails with a message saying so,
/// instead of vanishing on the bus; smaller ones pass.
#[actix_rt::test]
async fn a_request_too_big_for_the_bus_fails_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("nats.conf");
    std::fs::write(&conf, "max_payload: 1800\n").unwrap();
    let conf = conf.display().to_string();
    let Some(nats) = nats_server_with(&["-c", &conf]) else {
        return;
    };
    let (worker_config, frontend) = write_configs(dir.path(), nats.port, "async");
    let _worker = Worker::start(&worker_config, "large", TOKEN);
    let rt = Runtime::start(&frontend, None).unwrap();
    let long: Vec<u32> = (0..400).map(|i| 3 + i % 250).collect();
    let failed = rt
        .submit(request(&long, "large", 4, 1))
        .unwrap()
        .collect()
        .await;
    match failed {
        Err(RuntimeError::Failed(message)) => assert!(message.contains("max_payload"), "{message}"),
        other => panic!("expected a clear failure, got {other:?}"),
    }
    let fits = rt
        .submit(request(&[5, 6, 7], "large", 4, 1))
        .unwrap()
        .collect()
        .await;
    assert_eq!(fits.unwrap().token_ids.len(), 4);
    rt.shutdown();
}

/// A front end that dies leaves requests pending on a worker; the worker frees them once the
/// front end misses three beats.
#[actix_rt::test]
async fn a_workers_requests_of_a_dead_front_end_are_freed() {
    let Some(nats) = nats_server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (worker_config, frontend) = write_configs(dir.path(), nats.port, "async");
    let (_worker, port) = Worker::with_metrics(&worker_config, "large");
    let kv_used = || worker_metric(port, "tokenrouter_kv_tokens_used");
    let rt = Runtime::start(&frontend, None).unwrap();
    let mut handles: Vec<_> = (0..8u64)
        .map(|i| {
            let long = GenerateRequest {
                ignore_eos: true,
                ..request(&[5, 6, 7, 8], "me", 400, i)
            };
            rt.submit(long).unwrap()
        })
        .collect();
    for h in &mut handles {
        h.events.recv().await.unwrap();
    }
    eventually("the worker holds KV", || kv_used() > 0.0).await;
    // The front end dies without withdrawing anything.
    for h in handles {
        std::mem::forget(h);
    }
    rt.shutdown();
    eventually("the worker's KV back to 0", || kv_used() == 0.0).await;
}

/// Both models latency-profile simulations (10 ms a step) in `tokenrouter` mode, `large` on
/// a worker; `large_extra` goes into `large`'s section. The worker's config file and the
/// front end's config.
fn simulated_pair(dir: &Path, port: u16, large_extra: &str) -> (PathBuf, Config) {
    let text = |placement: &str, token: &str| {
        format!(
            r#"
[[models]]
name = "small"
latency_profile_ms = [10.0, 0.0]
[[models]]
name = "large"
latency_profile_ms = [10.0, 0.0]
placement = "{placement}"
{large_extra}
[runtime]
mode = "tokenrouter"
retune_interval_ms = 0
batch_timeout_ms = 60000
[cluster]
url = "nats://127.0.0.1:{port}"
heartbeat_ms = 500
{token}
"#
        )
    };
    let worker_config = dir.join("worker.toml");
    std::fs::write(&worker_config, text("local", "")).unwrap();
    let frontend = Config::parse(&text("remote", &format!("token = \"{TOKEN}\""))).unwrap();
    (worker_config, frontend)
}

/// A model's host counts the requests live anywhere, not only those that reached it: the
/// worker hosting `large` counts eight requests that only `small` (here) writes. Both models
/// are latency-profile simulations, so the requests outlast the polling.
#[actix_rt::test]
async fn a_worker_counts_the_requests_live_on_other_processes() {
    let Some(nats) = nats_server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (worker_config, frontend) = simulated_pair(dir.path(), nats.port, "");
    let (_worker, port) = Worker::with_metrics(&worker_config, "large");
    let live_there = || worker_metric(port, "tokenrouter_live_requests");
    let rt = Runtime::start(&frontend, None).unwrap();
    let handles: Vec<_> = (0..8u64)
        .map(|i| {
            let long = GenerateRequest {
                ignore_eos: true,
                ..request(&[5, 6, 7, 8], "small", 1000, i)
            };
            rt.submit(long).unwrap()
        })
        .collect();
    eventually("the worker counts 8 live requests", || live_there() == 8.0).await;
    drop(handles);
    eventually("the worker counts none", || live_there() == 0.0).await;
    rt.shutdown();
}

/// A worker's batch completes when the live count falls without a withdrawal reaching its
/// gate: `large` waits for 8 (its threshold; the timeout is a minute) while three requests
/// live, two of them waiting on it; the third belongs to another front end that dies, and
/// once the worker stops counting it (three missed beats) the two are all there is and step.
#[actix_rt::test]
async fn a_worker_batch_completes_when_the_live_count_falls() {
    let Some(nats) = nats_server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (worker_config, frontend) = simulated_pair(dir.path(), nats.port, "batch_threshold = 8");
    let (_worker, port) = Worker::with_metrics(&worker_config, "large");
    let doomed = Runtime::start(&frontend, None).unwrap();
    let elsewhere = GenerateRequest {
        ignore_eos: true,
        ..request(&[5, 6, 7], "small", 1000, 0)
    };
    let handle = doomed.submit(elsewhere).unwrap();
    let live_there = || worker_metric(port, "tokenrouter_live_requests");
    eventually("the worker counts the other front end's request", || {
        live_there() == 1.0
    })
    .await;
    let rt = Runtime::start(&frontend, None).unwrap();
    let waiting: Vec<_> = (1..3u64)
        .map(|i| rt.submit(request(&[5, 6, 7], "large", 4, i)).unwrap())
        .collect();
    // The other front end dies without a word.
    std::mem::forget(handle);
    doomed.shutdown();
    for h in waiting {
        let done = actix_rt::time::timeout(Duration::from_secs(10), h.collect())
            .await
            .expect("the worker's batch never completed");
        assert_eq!(done.unwrap().token_ids.len(), 4);
    }
    rt.shutdown();
}

/// Over the bus every routed model must read one vocabulary: the hetero pair (Gemma 3 here,
/// SmolLM2 in a worker) is refused at start-up with the vocabulary named, not served wrongly.
#[actix_rt::test]
async fn a_pair_of_two_vocabularies_over_the_bus_is_refused_at_start_up() {
    let (Some(_), Some(_)) = (common::real_model(), common::real_gemma3()) else {
        return;
    };
    let Some(nats) = nats_server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("config/hetero-pair.toml"))
        .unwrap()
        .replace("path = \"", &format!("path = \"{}/", root.display()))
        .replace(
            "chat_template = \"",
            &format!("chat_template = \"{}/", root.display()),
        )
        .replace("router = \"", &format!("router = \"{}/", root.display()))
        .replace(
            "weights = \"stored\"",
            "weights = \"stored\"\nplacement = \"remote\"",
        );
    let text = format!(
        "{text}\n[cluster]\nurl = \"nats://127.0.0.1:{}\"\nheartbeat_ms = 500\n\
         join_timeout_ms = 30000\n",
        nats.port
    );
    let path = dir.path().join("hetero-bus.toml");
    std::fs::write(&path, &text).unwrap();
    let mut frontend = Config::parse(&text).unwrap();
    frontend.cluster.as_mut().unwrap().token = Some(TOKEN.into());
    let _worker = Worker::start(&path, "smollm2-135m", TOKEN);
    let err = Runtime::start(&frontend, None)
        .map(|_| ())
        .expect_err("two vocabularies over the bus");
    let message = err.to_string();
    assert!(
        message.contains("vocabulary") && message.contains("[cluster]"),
        "{message}"
    );
}

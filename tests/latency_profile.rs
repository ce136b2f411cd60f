//! The runtime against the Markov model, on the latency-profile executor (a simulation: steps
//! sleep the paper's latencies and routing signals realise p = 0.35): the timeout bounds every
//! admission delay, online tuning publishes thresholds that follow the live request count, and
//! (ignored, timing-sensitive) measured throughput follows the prediction.

use std::cell::Cell;
use std::rc::Rc;
use std::time::Duration;
use tokenrouter::config::{Config, ExecutionMode};
use tokenrouter::engine::SamplingParams;
use tokenrouter::runtime::batcher::ReleaseReason;
use tokenrouter::runtime::stats::ModelStats;
use tokenrouter::runtime::{GenerateRequest, RequestEvent, RequestHandle, Runtime};
use tokenrouter::tuning::{paper, predict};

fn config(b1: usize) -> Config {
    config_with(b1, 100_000, 0)
}

/// The paper's pair: 6.0 / 27.9 ms steps, R2R sending 35 % of SLM steps to the LLM.
fn config_with(b1: usize, timeout_ms: u64, retune_ms: u64) -> Config {
    Config::parse(&format!(
        r#"
[[models]]
name = "small"
latency_profile_ms = [6.0, 0.0]
[[models]]
name = "large"
latency_profile_ms = [27.9, 0.0]
batch_threshold = {b1}
[runtime]
batch_timeout_ms = {timeout_ms}
retune_interval_ms = {retune_ms}
[[policies]]
name = "r2r"
kind = "r2r"
models = ["small", "large"]
threshold = 0.65
"#
    ))
    .unwrap()
}

fn endless(rt: &Runtime, seed: u64) -> RequestHandle {
    rt.submit(GenerateRequest {
        prompt: vec![1, 2, 3],
        policy: Some("r2r".into()),
        max_tokens: usize::MAX,
        sampling: SamplingParams {
            seed,
            ..SamplingParams::greedy()
        },
        timeout: None,
        ignore_eos: false,
    })
    .unwrap()
}

#[actix_rt::test]
async fn the_timeout_bounds_admission_when_the_threshold_can_never_fill() {
    let (n, timeout_ms, large_step_ms): (u64, f64, f64) = (4, 30.0, 27.9);
    let rt = Runtime::start(
        &config_with(100, timeout_ms as u64, 0),
        Some(ExecutionMode::Tokenrouter),
    )
    .unwrap();
    let handles: Vec<_> = (0..n).map(|seed| endless(&rt, seed)).collect();
    actix_rt::time::sleep(Duration::from_millis(1500)).await;
    let stats = &rt.stats().models[1];
    let releases = *stats.releases.lock().unwrap();
    assert_eq!(
        releases[ReleaseReason::Threshold as usize],
        0,
        "B = 100 never fills"
    );
    assert!(
        releases[ReleaseReason::Timeout as usize] > 0,
        "{releases:?}"
    );
    let worst_ms = ModelStats::get(&stats.max_admission_delay_us) as f64 / 1e3;
    // L(N − 1) is the longest step an arrival can wait behind (constant latency here).
    let bound_ms = timeout_ms.max(large_step_ms) + SCHEDULING_SLACK_MS;
    println!("worst admission delay {worst_ms:.1} ms, bound {bound_ms:.1} ms");
    assert!(
        worst_ms <= bound_ms,
        "worst admission delay {worst_ms:.1} ms > {bound_ms:.1} ms"
    );
    drop(handles);
    rt.shutdown();
}

/// Thread wake-ups and message hops on a loaded 2-core machine.
const SCHEDULING_SLACK_MS: f64 = 25.0;

#[actix_rt::test]
async fn online_tuning_publishes_thresholds_that_follow_the_live_request_count() {
    let rt = Runtime::start(&config_with(1, 100, 200), Some(ExecutionMode::Tokenrouter)).unwrap();
    let wait_for = |want: fn(&[usize]) -> bool, what: &'static str| {
        let rt = &rt;
        async move {
            for _ in 0..100 {
                if want(&rt.thresholds()) {
                    return;
                }
                actix_rt::time::sleep(Duration::from_millis(100)).await;
            }
            panic!("{what}: thresholds stayed {:?}", rt.thresholds());
        }
    };
    let mut handles: Vec<_> = (0..4).map(|seed| endless(&rt, seed)).collect();
    // At N = 4 the model batches the LLM (the paper's B* is 3 without a timeout, 3 with
    // W = 100 ms); the SLM never waits.
    wait_for(|t| t[0] == 1 && t[1] > 1, "N = 4 batches the LLM").await;
    println!("N = 4: thresholds {:?}", rt.thresholds());
    handles.truncate(1);
    wait_for(|t| t == [1, 1], "N = 1 waits for nobody").await;
    drop(handles);
    rt.shutdown();
}

/// Committed tokens per second with `n` endless requests, after a warm-up.
async fn measure(n: usize, b1: usize, window: Duration) -> f64 {
    let rt = Runtime::start(&config(b1), Some(ExecutionMode::Tokenrouter)).unwrap();
    let tokens = Rc::new(Cell::new(0usize));
    let mut handles = Vec::new();
    for seed in 0..n as u64 {
        let mut handle = endless(&rt, seed);
        let counter = tokens.clone();
        handles.push(actix_rt::spawn(async move {
            while let Some(event) = handle.events.recv().await {
                if matches!(event, RequestEvent::Token { .. }) {
                    counter.set(counter.get() + 1);
                }
            }
        }));
    }
    actix_rt::time::sleep(Duration::from_millis(400)).await;
    let before = tokens.get();
    actix_rt::time::sleep(window).await;
    let rate = (tokens.get() - before) as f64 / window.as_secs_f64();
    for h in handles {
        h.abort();
    }
    rt.shutdown();
    rate
}

/// Wall-clock sensitive (steps are real sleeps) and slow: routing draws are random, so a
/// window must hold ~500 LLM visits before the realised p settles near 0.35 (2.5 s windows
/// measured 80 tok/s against 99.0 predicted at N=2, B1=1, with p realised at 0.39–0.41).
/// Run alone on an idle machine: `cargo test --test latency_profile -- --ignored --nocapture`.
/// It does not pass reliably yet. 2026-11-29, 6 s windows, after handoffs of one step started
/// travelling together (measured / predicted tok/s): N=2: 93.8/99.0, 107.7/110.3;
/// N=3: 128.2/142.3, 143.2/158.1, 144.2/151.9 — all within 10 %, but at N=3 the best measured
/// B1 (3) and the predicted one (2) differ by less than the window's noise.
#[actix_rt::test]
#[ignore = "timing-sensitive; run alone on an idle machine with --ignored"]
async fn measured_throughput_follows_the_dtmc_prediction() {
    let model = paper::validation_model();
    for n in 2..=4 {
        let mut best = (0, 0.0);
        let mut best_predicted = (0, 0.0);
        for b1 in 1..=n {
            let predicted = predict(&model, n, &[1, b1]).unwrap().throughput;
            let measured = measure(n, b1, Duration::from_secs(15)).await;
            println!("N={n} B1={b1}: predicted {predicted:.1} tok/s, measured {measured:.1}");
            assert!(
                (measured / predicted - 1.0).abs() < 0.10,
                "N={n} B1={b1}: measured {measured:.1} vs predicted {predicted:.1}"
            );
            if measured > best.1 {
                best = (b1, measured);
            }
            if predicted > best_predicted.1 {
                best_predicted = (b1, predicted);
            }
        }
        assert_eq!(
            best.0, best_predicted.0,
            "N={n}: best measured B1 vs predicted"
        );
    }
}

//! Runtime tests on tiny random models: determinism across modes and concurrency, pending
//! resume, concurrent stepping, supervision and cancellation.

mod common;

use candle_core::quantized::GgmlDType;
use common::{Arch, TinySpec};
use std::path::Path;
use std::time::{Duration, Instant};
use tokenrouter::config::{Config, ExecutionMode, TokenBudget};
use tokenrouter::runtime::{Completion, RequestEvent, Runtime, RuntimeError};
use tokenrouter::runtime::{ModelSnapshot, StepInterval};

/// Two tiny models of one vocabulary (different seeds), an `me` policy over both.
fn pair_config(dir: &Path, spec: TinySpec, extra_model_toml: &str) -> Config {
    let a = common::write_gguf(&dir.join("a.gguf"), &spec, GgmlDType::Q8_0);
    let b_spec = TinySpec {
        seed: spec.seed + 1,
        ..spec
    };
    let b = common::write_gguf(&dir.join("b.gguf"), &b_spec, GgmlDType::Q8_0);
    Config::parse(&format!(
        r#"
[[models]]
name = "small"
path = "{}"
batch_threshold = 2
{extra_model_toml}
[[models]]
name = "large"
path = "{}"
batch_threshold = 3
{extra_model_toml}
[runtime]
batch_timeout_ms = 5
[[policies]]
name = "me"
kind = "me"
models = ["small", "large"]
weights = [0.5, 0.5]
"#,
        a.display(),
        b.display()
    ))
    .unwrap()
}

fn prompts(n: usize) -> Vec<Vec<u32>> {
    (0..n as u32)
        .map(|i| {
            (0..3 + i % 7)
                .map(|j| 3 + (i * 13 + j * 29) % 270)
                .collect()
        })
        .collect()
}

use common::greedy_request as request;

/// Runs every prompt with at most `concurrency` requests in flight.
async fn run_all(
    rt: &Runtime,
    prompts: &[Vec<u32>],
    policy: &str,
    concurrency: usize,
    max_tokens: usize,
) -> Vec<Result<Completion, RuntimeError>> {
    let mut results = Vec::new();
    let numbered: Vec<(u64, &Vec<u32>)> = (1000..).zip(prompts).collect();
    for chunk in numbered.chunks(concurrency) {
        let handles: Vec<_> = chunk
            .iter()
            .map(|&(seed, p)| rt.submit(request(p, policy, max_tokens, seed)).unwrap())
            .collect();
        for h in handles {
            results.push(h.collect().await);
        }
    }
    results
}

async fn wait_for_zero_kv(rt: &Runtime) {
    let start = Instant::now();
    while rt.kv_tokens_used().iter().any(|&t| t > 0) || rt.live_requests() > 0 {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "KV still held: {:?}",
            rt.kv_tokens_used()
        );
        actix_rt::time::sleep(Duration::from_millis(5)).await;
    }
}

#[actix_rt::test]
async fn committed_tokens_are_identical_across_modes_and_concurrency() {
    let dir = tempfile::tempdir().unwrap();
    let config = pair_config(dir.path(), TinySpec::new(Arch::Llama), "");
    let prompts = prompts(32);
    let mut reference: Option<Vec<Vec<u32>>> = None;
    for policy in ["me", "large"] {
        reference = None;
        for mode in ExecutionMode::ALL {
            let rt = Runtime::start(&config, Some(mode)).unwrap();
            for concurrency in [1, 8, 32] {
                let tokens: Vec<Vec<u32>> = run_all(&rt, &prompts, policy, concurrency, 12)
                    .await
                    .into_iter()
                    .map(|r| r.unwrap().token_ids)
                    .collect();
                match &reference {
                    None => reference = Some(tokens),
                    Some(want) => {
                        assert_eq!(&tokens, want, "{policy} {mode:?} concurrency {concurrency}")
                    }
                }
            }
            wait_for_zero_kv(&rt).await;
            rt.shutdown();
        }
    }
    assert!(reference.unwrap().iter().all(|t| t.len() == 12));
}

#[actix_rt::test]
async fn me_routes_through_both_models_and_reports_it() {
    let dir = tempfile::tempdir().unwrap();
    let rt = Runtime::start(
        &pair_config(dir.path(), TinySpec::new(Arch::Qwen2), ""),
        Some(ExecutionMode::Async),
    )
    .unwrap();
    let out = rt
        .submit(request(&[5, 6, 7], "me", 40, 3))
        .unwrap()
        .collect()
        .await
        .unwrap();
    assert_eq!(
        out.routing.tokens_per_model.iter().sum::<usize>(),
        out.token_ids.len()
    );
    assert!(
        out.routing.tokens_per_model.iter().all(|&n| n > 5),
        "{:?}",
        out.routing
    );
    assert!(out.routing.handoffs > 5);
    rt.shutdown();
}

fn counter(stats: &ModelSnapshot) -> (u64, u64, u64) {
    (
        stats.tokens_processed,
        stats.kv_allocations,
        stats.prefix_cache.lookups,
    )
}

#[actix_rt::test]
async fn returning_requests_append_only_unseen_tokens_unless_standard() {
    let dir = tempfile::tempdir().unwrap();
    let config = pair_config(dir.path(), TinySpec::new(Arch::Llama), "");
    let prompt: Vec<u32> = (3..23).collect();
    for mode in [
        ExecutionMode::Async,
        ExecutionMode::Tokenrouter,
        ExecutionMode::Standard,
    ] {
        let rt = Runtime::start(&config, Some(mode)).unwrap();
        let out = rt
            .submit(request(&prompt, "me", 30, 11))
            .unwrap()
            .collect()
            .await
            .unwrap();
        assert!(out.routing.handoffs >= 4, "{:?}", out.routing);
        let final_len = (prompt.len() + out.token_ids.len()) as u64;
        for m in 0..2 {
            let (tokens, allocations, lookups) = counter(&rt.snapshot().models[m]);
            // Each model processes every position at most once: a return appends only the
            // tokens it has not seen, never the prompt again.
            assert!(
                tokens <= final_len,
                "{mode:?} model {m}: {tokens} tokens for {final_len} positions"
            );
            match mode {
                ExecutionMode::Standard => {
                    assert!(
                        allocations >= 2,
                        "{mode:?} model {m}: a return allocates again"
                    );
                    assert!(
                        lookups >= 2,
                        "{mode:?} model {m}: a return looks up the prefix"
                    );
                }
                _ => {
                    assert_eq!(
                        (allocations, lookups),
                        (1, 1),
                        "{mode:?} model {m}: one allocation and lookup per request"
                    );
                }
            }
        }
        wait_for_zero_kv(&rt).await;
        rt.shutdown();
    }
}

/// A 200-token system prompt before each of `prompts(n)`.
fn with_system_prompt(n: usize) -> Vec<Vec<u32>> {
    let system: Vec<u32> = (0..200).map(|j| 3 + (j * 7 + j / 9) % 250).collect();
    prompts(n)
        .into_iter()
        .map(|question| system.iter().chain(&question).copied().collect())
        .collect()
}

#[actix_rt::test]
async fn tokens_are_identical_with_the_prefix_cache_on_or_off_and_any_chunk_budget() {
    let dir = tempfile::tempdir().unwrap();
    let base = pair_config(dir.path(), TinySpec::new(Arch::Llama), "");
    let prompts = with_system_prompt(6);
    let mut reference: Option<Vec<Vec<u32>>> = None;
    for mode in ExecutionMode::ALL {
        for prefix_cache in [true, false] {
            for budget in [
                TokenBudget::Tokens(1),
                TokenBudget::Tokens(7),
                TokenBudget::Tokens(64),
                TokenBudget::Unlimited,
            ] {
                let mut config = base.clone();
                config.runtime.prefix_cache = prefix_cache;
                for model in &mut config.models {
                    model.step_token_budget = Some(budget);
                }
                let rt = Runtime::start(&config, Some(mode)).unwrap();
                let tokens: Vec<Vec<u32>> = run_all(&rt, &prompts, "me", 6, 8)
                    .await
                    .into_iter()
                    .map(|r| r.unwrap().token_ids)
                    .collect();
                let what = format!("{mode:?}, prefix cache {prefix_cache}, budget {budget:?}");
                match &reference {
                    None => reference = Some(tokens),
                    Some(want) => assert_eq!(&tokens, want, "{what}"),
                }
                let chunked = rt
                    .snapshot()
                    .models
                    .iter()
                    .map(|m| m.chunked_rows)
                    .sum::<u64>();
                assert_eq!(
                    chunked > 0,
                    budget != TokenBudget::Unlimited,
                    "{what}: chunked rows"
                );
                wait_for_zero_kv(&rt).await;
                rt.shutdown();
            }
        }
    }
}

#[actix_rt::test]
async fn a_shared_system_prompt_is_prefilled_once_per_model_and_stays_cached() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = pair_config(dir.path(), TinySpec::new(Arch::Llama), "");
    for model in &mut config.models {
        model.kv_tokens = 512;
    }
    let (n, max_tokens) = (8, 12);
    let prompts = with_system_prompt(n);
    for mode in ExecutionMode::ALL {
        let rt = Runtime::start(&config, Some(mode)).unwrap();
        for result in run_all(&rt, &prompts, "me", n, max_tokens).await {
            result.unwrap();
        }
        wait_for_zero_kv(&rt).await;
        for m in rt.snapshot().models {
            // Past the system prompt a request brings at most its question and its tokens.
            // In `standard` a return is a new request: where its own blocks were evicted
            // meanwhile (512 tokens of KV for 8 requests) it computes them again, so there the
            // bound is only that the 200 shared tokens are not computed twice.
            let own: usize = prompts.iter().map(|p| p.len() - 200 + max_tokens).sum();
            let bound = match mode {
                ExecutionMode::Standard => 2 * 200 + own - 1,
                _ => 200 + own,
            };
            assert!(
                m.tokens_processed as usize <= bound,
                "{mode:?} {}: {} tokens processed",
                m.name,
                m.tokens_processed
            );
            assert!(m.prefix_cache.hit_tokens >= 200, "{mode:?} {}", m.name);
            assert!(
                m.kv_tokens_cached > 0,
                "{mode:?} {}: nothing cached",
                m.name
            );
        }
        // The cache is evictable: a prompt needing most of the budget still runs.
        let long: Vec<u32> = (0..420).map(|j| 3 + (j * 11) % 250).collect();
        rt.submit(request(&long, "me", 4, 1))
            .unwrap()
            .collect()
            .await
            .unwrap();
        wait_for_zero_kv(&rt).await;
        rt.shutdown();
    }
}

fn overlapping(a: &[StepInterval], b: &[StepInterval]) -> usize {
    a.iter()
        .filter(|x| b.iter().any(|y| x.start < y.end && y.start < x.end))
        .count()
}

#[actix_rt::test]
async fn models_step_concurrently_in_async_and_never_in_lockstep() {
    let dir = tempfile::tempdir().unwrap();
    let spec = TinySpec {
        hidden: 256,
        ffn: 1024,
        layers: 6,
        heads: 8,
        kv_heads: 4,
        head_dim: 32,
        ..TinySpec::new(Arch::Llama)
    };
    let config = pair_config(dir.path(), spec, "");
    for (mode, expect_overlap) in [
        (ExecutionMode::Async, true),
        (ExecutionMode::Lockstep, false),
    ] {
        let rt = Runtime::start(&config, Some(mode)).unwrap();
        run_all(&rt, &prompts(8), "me", 8, 40).await;
        let (a, b) = (
            rt.snapshot().models[0].recent_steps.clone(),
            rt.snapshot().models[1].recent_steps.clone(),
        );
        assert!(a.len() > 20 && b.len() > 20);
        let overlaps = overlapping(&a, &b);
        if expect_overlap {
            assert!(
                overlaps > 0,
                "{mode:?}: no overlapping steps among {} and {}",
                a.len(),
                b.len()
            );
        } else {
            assert_eq!(overlaps, 0, "{mode:?}: models stepped at the same time");
        }
        rt.shutdown();
    }
}

#[actix_rt::test]
async fn injected_faults_fail_requests_cleanly_and_the_actor_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let config = pair_config(
        dir.path(),
        TinySpec::new(Arch::Llama),
        "fault_every_steps = 50",
    );
    let rt = Runtime::start(&config, Some(ExecutionMode::Tokenrouter)).unwrap();
    let results = run_all(&rt, &prompts(32), "me", 32, 120).await;
    let failed = results.iter().filter(|r| r.is_err()).count();
    for r in results.iter().filter_map(|r| r.as_ref().err()) {
        assert!(r.to_string().contains("crashed"), "{r}");
    }
    assert!(failed > 0, "faults every 50 steps must hit some request");
    let restarts: u64 = rt.snapshot().models.iter().map(|m| m.restarts).sum();
    assert!(restarts > 0);
    wait_for_zero_kv(&rt).await;
    let mut succeeded = 0;
    for attempt in 0..20 {
        if rt
            .submit(request(&[4, 5, 6], "me", 4, attempt))
            .unwrap()
            .collect()
            .await
            .is_ok()
        {
            succeeded += 1;
        }
    }
    assert!(
        succeeded >= 10,
        "only {succeeded}/20 later requests succeeded"
    );
    wait_for_zero_kv(&rt).await;
    rt.shutdown();
}

#[actix_rt::test]
async fn dropping_or_cancelling_a_request_frees_its_kv_everywhere() {
    let dir = tempfile::tempdir().unwrap();
    let rt = Runtime::start(
        &pair_config(dir.path(), TinySpec::new(Arch::Llama), ""),
        Some(ExecutionMode::Async),
    )
    .unwrap();
    let prompt: Vec<u32> = (3..40).collect();
    let mut handle = rt.submit(request(&prompt, "me", 400, 5)).unwrap();
    for _ in 0..10 {
        assert!(matches!(
            handle.events.recv().await,
            Some(RequestEvent::Token { .. })
        ));
    }
    assert!(rt.kv_tokens_used().iter().sum::<usize>() > 0);
    drop(handle);
    wait_for_zero_kv(&rt).await;

    let mut handle = rt.submit(request(&prompt, "me", 400, 6)).unwrap();
    handle.events.recv().await.unwrap();
    handle.cancel();
    wait_for_zero_kv(&rt).await;
    rt.shutdown();
}

#[actix_rt::test]
async fn bad_requests_are_refused_with_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let rt = Runtime::start(
        &pair_config(dir.path(), TinySpec::new(Arch::Llama), ""),
        None,
    )
    .unwrap();
    let err = rt.submit(request(&[1, 2], "nope", 4, 0)).err().unwrap();
    assert!(matches!(err, RuntimeError::UnknownPolicy(ref p) if p == "nope"));
    assert!(rt.submit(request(&[], "me", 4, 0)).is_err());
    assert!(rt.submit(request(&[1], "me", 0, 0)).is_err());
    let beyond_context = rt.submit(request(&[1, 2], "me", 600, 0)).err().unwrap();
    assert!(
        beyond_context.to_string().contains("context of 512"),
        "{beyond_context}"
    );
    let mut timed = request(&(3..50).collect::<Vec<_>>(), "me", 400, 0);
    timed.ignore_eos = true;
    timed.timeout = Some(Duration::from_millis(30));
    let err = rt.submit(timed).unwrap().collect().await.unwrap_err();
    assert!(err.to_string().contains("deadline"), "{err}");
    wait_for_zero_kv(&rt).await;
    rt.shutdown();
}

#[actix_rt::test]
async fn kv_pressure_preempts_and_waits_and_fails_only_what_cannot_fit_alone() {
    let dir = tempfile::tempdir().unwrap();
    let spec = TinySpec::new(Arch::Llama);
    let prompts = prompts(16);
    let roomy = Runtime::start(&pair_config(dir.path(), spec, ""), None).unwrap();
    let reference: Vec<Vec<u32>> = run_all(&roomy, &prompts, "me", 1, 12)
        .await
        .into_iter()
        .map(|r| r.unwrap().token_ids)
        .collect();
    roomy.shutdown();

    // 4 blocks of 16 tokens per model; a request needs up to 2 blocks on each model.
    let mut tight = pair_config(dir.path(), spec, "kv_tokens = 64");
    tight.runtime.prefix_cache = false;
    for mode in ExecutionMode::ALL {
        let rt = Runtime::start(&tight, Some(mode)).unwrap();
        // A request larger than a model's whole budget can never run: a bad request.
        let err = rt
            .submit(request(&(3..53).collect::<Vec<_>>(), "me", 15, 0))
            .err()
            .expect("50 + 15 tokens exceed a 64-token budget");
        assert!(
            matches!(&err, RuntimeError::Invalid(e) if e.to_string().contains("KV budget of 64")),
            "{err}"
        );
        // Eight at a time do not fit at once: pending KV gives way first, then residents
        // wait for room or start over (re-prefilling changes none of their tokens); every
        // request that fits alone completes; nothing leaks.
        let crowd = run_all(&rt, &prompts, "me", 8, 12).await;
        for (result, want) in crowd.iter().zip(&reference) {
            let completion = result.as_ref().unwrap_or_else(|e| panic!("{mode:?}: {e}"));
            assert_eq!(&completion.token_ids, want, "{mode:?}");
        }
        if mode != ExecutionMode::Standard {
            let preempted: u64 = rt.snapshot().models.iter().map(|m| m.preemptions).sum();
            assert!(
                preempted > 0,
                "{mode:?}: pending KV was taken for residents"
            );
        }
        wait_for_zero_kv(&rt).await;
        rt.shutdown();
    }
}

//! `config/hetero-pair.toml`: Gemma 3 270M and SmolLM2-135M, two vocabularies, routed token by
//! token through the runtime and the server. Both real files are needed (skipped with a
//! message when absent, a failure under TOKENROUTER_REQUIRE_MODEL=1).

mod common;

use std::path::Path;
use std::time::{Duration, Instant};
use tokenrouter::config::{Config, ExecutionMode};
use tokenrouter::engine::SamplingParams;
use tokenrouter::runtime::{Completion, FinishReason, GenerateRequest, Runtime};

const CONFIG: &str = "config/hetero-pair.toml";

/// Multilingual text, code, numbers and emoji: byte-fallback pieces on both sides.
const PROMPTS: [&str; 6] = [
    "What is the capital of Japan?",
    "Translate to Japanese and Chinese: good morning, my friend.",
    "Write a Python function that returns the sum of a list of numbers.",
    "What is 12,345 × 6.7? Show the digits.",
    "Reply with three emoji that describe a party 🎉, then explain each.",
    "Écris une phrase en français sur Zürich, puis une en русский.",
];

/// Entropy thresholds for `r2r`: from handing most tokens over to handing few.
const THRESHOLDS: [f32; 3] = [0.5, 1.5, 3.0];

fn both_models() -> bool {
    common::real_model().is_some() && common::real_gemma3().is_some()
}

/// The shipped hetero pair with one `r2r` per threshold and a training-free `citer` and
/// `rstitch` (each hands off both ways on these prompts), and `colm`/`me` entries appended
/// when `mixing` names one.
fn config_text(mixing: Option<&str>) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut text = std::fs::read_to_string(root.join(CONFIG)).unwrap();
    for t in THRESHOLDS {
        text += &format!(
            "\n[[policies]]\nname = \"r2r-{t}\"\nkind = \"r2r\"\n\
             models = [\"gemma3-270m\", \"smollm2-135m\"]\nthreshold = {t}\n"
        );
    }
    for (kind, threshold) in [("citer", 0.4), ("rstitch", 0.15)] {
        text += &format!(
            "\n[[policies]]\nname = \"{kind}\"\nkind = \"{kind}\"\n\
             models = [\"gemma3-270m\", \"smollm2-135m\"]\nthreshold = {threshold}\n"
        );
    }
    if let Some(kind) = mixing {
        text += &format!(
            "\n[[policies]]\nname = \"mixing\"\nkind = \"{kind}\"\n\
             models = [\"gemma3-270m\", \"smollm2-135m\"]\n"
        );
        if kind == "me" {
            text += "weights = [0.5, 0.5]\n";
        }
    }
    text
}

fn config(mixing: Option<&str>) -> Config {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut config: Config = Config::parse(&config_text(mixing)).unwrap();
    for m in &mut config.models {
        m.path = root.join(&m.path);
        if let Some(template) = &mut m.chat_template {
            *template = root.join(&*template);
        }
    }
    config
}

async fn run_all(rt: &Runtime, max_tokens: usize) -> Vec<(String, Completion)> {
    let mut handles = Vec::new();
    let policies = THRESHOLDS
        .iter()
        .map(|t| format!("r2r-{t}"))
        .chain(["citer".into(), "rstitch".into()]);
    for policy in policies {
        for text in PROMPTS {
            let prompt = rt
                .render(&[tokenrouter::engine::chat::ChatMessage::user(text)])
                .unwrap();
            let request = GenerateRequest {
                prompt,
                policy: Some(policy.clone()),
                max_tokens,
                sampling: SamplingParams::greedy(),
                timeout: None,
                ignore_eos: false,
            };
            handles.push((format!("{policy} {text:?}"), rt.submit(request).unwrap()));
        }
    }
    let mut out = Vec::new();
    for (name, handle) in handles {
        out.push((name, handle.collect().await.unwrap()));
    }
    out
}

async fn wait_for_zero_kv(rt: &Runtime, mode: ExecutionMode) {
    let start = Instant::now();
    while rt.kv_tokens_used().iter().any(|&t| t > 0) || rt.live_requests() > 0 {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{mode:?}: KV still held at idle: {:?}",
            rt.kv_tokens_used()
        );
        actix_rt::time::sleep(Duration::from_millis(5)).await;
    }
}

/// R2R, CITER and R-Stitch across the two vocabularies: every mode commits the same tokens
/// from the same writers; the committed bytes are
/// whole UTF-8 (an unfinished character only where `max_tokens` cut it), each writer's
/// tokens counted to it; the pair hands off in both directions; KV returns to 0.
#[actix_rt::test]
async fn routing_across_vocabularies_keeps_the_text_whole_and_identical_in_every_mode() {
    if !both_models() {
        return;
    }
    let config = config(None);
    let mut reference: Option<Vec<(Vec<u32>, Vec<usize>)>> = None;
    for mode in ExecutionMode::ALL {
        let rt = Runtime::start(&config, Some(mode)).unwrap();
        let spellings = rt.spellings().unwrap();
        let outputs = run_all(&rt, 40).await;
        let (mut to_llm, mut to_slm) = (0, 0);
        for (name, c) in &outputs {
            let bytes: Vec<u8> = c
                .token_ids
                .iter()
                .zip(&c.writers)
                .flat_map(|(&t, &m)| spellings[m].bytes(t).to_vec())
                .collect();
            let whole = match std::str::from_utf8(&bytes) {
                Ok(_) => bytes.len(),
                Err(e) => e.valid_up_to(),
            };
            let cut = c.finish_reason == FinishReason::Length && bytes.len() - whole < 4;
            assert!(
                whole == bytes.len() || cut && e_is_incomplete(&bytes[whole..]),
                "{mode:?} {name}: broken UTF-8 at byte {whole} of {bytes:?}"
            );
            let text = rt.text_of(&c.token_ids, &c.writers).unwrap();
            assert!(
                !text.contains('\u{FFFD}') || cut,
                "{mode:?} {name}: {text:?}"
            );
            for m in 0..2 {
                let written = c.writers.iter().filter(|&&w| w == m).count();
                assert_eq!(c.routing.tokens_per_model[m], written, "{mode:?} {name}");
            }
            for pair in c.writers.windows(2) {
                match (pair[0], pair[1]) {
                    (0, 1) => to_llm += 1,
                    (1, 0) => to_slm += 1,
                    _ => {}
                }
            }
        }
        assert!(
            to_llm > 0 && to_slm > 0,
            "{mode:?}: {to_llm} to the LLM, {to_slm} back"
        );
        wait_for_zero_kv(&rt, mode).await;
        let got: Vec<(Vec<u32>, Vec<usize>)> = outputs
            .into_iter()
            .map(|(_, c)| (c.token_ids, c.writers))
            .collect();
        match &reference {
            None => reference = Some(got),
            Some(want) => assert_eq!(&got, want, "{mode:?} differs from lockstep"),
        }
        rt.shutdown();
    }
}

/// The first bytes of a UTF-8 character that `max_tokens` cut short.
fn e_is_incomplete(tail: &[u8]) -> bool {
    matches!(std::str::from_utf8(tail), Err(e) if e.error_len().is_none())
}

/// Co-LLM and the mixture ensemble combine distributions over one vocabulary.
#[test]
fn mixing_policies_on_two_vocabularies_fail_at_start_up_with_the_reason() {
    if !both_models() {
        return;
    }
    let system = actix::System::new();
    for kind in ["colm", "me"] {
        let config = config(Some(kind));
        let err = system
            .block_on(async { Runtime::start(&config, None).map(|_| ()) })
            .expect_err(kind)
            .to_string();
        assert!(
            err.contains("`mixing`") && err.contains("read different vocabularies"),
            "{kind}: {err}"
        );
    }
}

/// Over HTTP, whole and streamed, the shipped `r2r` (its learned router) hands off both ways: the streamed text is the whole
/// reply's, usage counts the committed tokens, and token-id prompts or logprobs, which name
/// one vocabulary, are refused with a 400.
#[test]
fn the_hetero_pair_serves_whole_and_streamed_replies() {
    if !both_models() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("hetero.toml");
    let mut text = config_text(None);
    let root = env!("CARGO_MANIFEST_DIR");
    text = text.replace("path = \"", &format!("path = \"{root}/"));
    text = text.replace("chat_template = \"", &format!("chat_template = \"{root}/"));
    std::fs::write(&path, text).unwrap();
    let server = common::server::Server::start(&path);
    let body = serde_json::json!({
        "model": "r2r",
        "messages": [{"role": "user", "content": PROMPTS[0]}],
        "max_tokens": 32,
        "temperature": 0,
    });
    let (status, whole) = server.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{whole}");
    let content = whole["choices"][0]["message"]["content"].as_str().unwrap();
    let usage = &whole["usage"];
    let per_model = &whole["routing"]["tokens_per_model"];
    assert!(
        per_model["gemma3-270m"].as_u64() > Some(0) && per_model["smollm2-135m"].as_u64() > Some(0),
        "{whole}"
    );
    assert_eq!(
        usage["completion_tokens"].as_u64(),
        Some(
            per_model["gemma3-270m"].as_u64().unwrap()
                + per_model["smollm2-135m"].as_u64().unwrap()
        )
    );
    let mut streamed = body.clone();
    streamed["stream"] = true.into();
    let text = common::server::stream_text(&server, "/v1/chat/completions", &streamed);
    assert_eq!(text, content);

    let ids = serde_json::json!({"model": "r2r", "prompt": [1, 2, 3], "max_tokens": 4});
    let (status, err) = server.post("/v1/completions", &ids);
    assert_eq!(status, 400, "{err}");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("vocabulary"),
        "{err}"
    );
    assert_eq!(err["error"]["param"], "prompt", "{err}");
    let mut logprobs = body;
    logprobs["logprobs"] = true.into();
    let (status, err) = server.post("/v1/chat/completions", &logprobs);
    assert_eq!(status, 400, "{err}");
    assert_eq!(err["error"]["param"], "logprobs", "{err}");

    // A model of the second vocabulary alone: its log-probabilities name its own tokens.
    logprobs["model"] = "smollm2-135m".into();
    let (status, alone) = server.post("/v1/chat/completions", &logprobs);
    assert_eq!(status, 200, "{alone}");
    let tokens: String = alone["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["token"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(tokens, alone["choices"][0]["message"]["content"], "{alone}");
}

/// The `std-serving` baseline's dispatcher hands the committed text between the two
/// single-model servers as the runtime does: the same tokens from the same writers.
#[test]
fn std_serving_hands_the_text_over_as_the_runtime_does() {
    if !both_models() {
        return;
    }
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tokenrouter"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args([
            "bench",
            "routing",
            "--config",
            CONFIG,
            "--policy",
            "r2r-entropy",
        ])
        .args(["--mode", "async,std-serving", "--concurrency", "2"])
        .args(["--requests", "4", "--max-tokens", "12", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    let cell = |mode: &str| rows.iter().find(|r| r["mode"] == mode).unwrap().clone();
    let (runtime, dispatched) = (cell("async"), cell("std-serving"));
    assert_eq!(dispatched["completed"], 4, "{dispatched}");
    assert_eq!(runtime["outputs_digest"], dispatched["outputs_digest"]);
    assert_eq!(runtime["token_share"], dispatched["token_share"]);
    let share = runtime["token_share"].to_string();
    assert!(
        share.contains("gemma3-270m") && share.contains("smollm2-135m"),
        "{share}"
    );
}

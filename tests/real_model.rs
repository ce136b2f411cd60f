//! End-to-end checks on the real SmolLM2-135M-Instruct GGUF (fetched by scripts/fetch-model.sh;
//! skipped with a message when absent, a failure under TOKENROUTER_REQUIRE_MODEL=1).

mod common;
use common::work;
/// The binary's fixed benchmark prompts (benchmarks live outside the library).
#[allow(dead_code)]
#[path = "../src/bench/prompts.rs"]
mod prompts;

use candle_core::quantized::{gguf_file, GgmlDType};
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama;
use prompts::PROMPTS;
use tokenrouter::engine::ops::argmax;
use tokenrouter::engine::tokenizer::ModelTokenizer;
use tokenrouter::engine::{Executor, SamplingParams, SeqId, StepExecutor};
use tokenrouter::policy::learned::{CiterRouter, HiddenScorer, R2rRouter};

#[test]
fn chat_generation_answers_tokyo_through_the_cli() {
    if common::real_model().is_none() {
        return;
    }
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tokenrouter"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["generate", "--policy", "smollm2-135m", "--chat"])
        .args(["--prompt", "What is the capital of Japan?"])
        .args(["--temperature", "0", "--max-tokens", "16", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let text = report["text"].as_str().unwrap();
    assert!(text.contains("Tokyo"), "{text}");
    let ids = report["token_ids"].as_array().unwrap().len();
    assert_eq!(report["routing"]["tokens_per_model"]["smollm2-135m"], ids);
    assert!(report["timing"]["tokens_per_s"].as_f64().unwrap() > 0.0);
    assert!(["stop", "length"].contains(&report["finish_reason"].as_str().unwrap()));
}

#[test]
fn tokenizer_round_trips_real_text_and_matches_smollm_pretokenization() {
    let Some(path) = common::real_model() else {
        return;
    };
    let tok = ModelTokenizer::load(&path).unwrap();
    for text in [
        PROMPTS[0],
        "Grüße aus München — 東京タワー, naïve café, emoji 🚀 and ασπίδα.",
        "<|im_start|>user\nWhat is 12345 + 678?<|im_end|>\n",
    ] {
        let ids = tok.encode(text).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
    }
    assert_eq!(tok.encode("<|im_start|>").unwrap(), vec![1]);
    assert_eq!(
        tok.encode("12345").unwrap().len(),
        5,
        "smollm splits digits"
    );
    let hello = tok.encode("Hello").unwrap();
    assert_eq!(hello.len(), 1);
    assert_eq!(
        tok.token_text(hello[0]).as_deref(),
        Some("Hello"),
        "no prefix space"
    );
    assert!(tok.eos.contains(&2));
}

/// Teacher-forced top-1 agreement of our logits on the GGUF file `path` with candle's
/// `quantized_llama` on `reference` over the first `prompts` benchmark prompts, and the
/// largest logit difference.
fn teacher_forced_agreement(
    path: &std::path::Path,
    reference: &std::path::Path,
    prompts: usize,
) -> (f64, f32) {
    let tok = ModelTokenizer::load(path).unwrap();
    let mut ours = Executor::load(&common::model_config("smollm2", path)).unwrap();
    let (mut agree, mut total, mut max_diff) = (0usize, 0usize, 0f32);
    for (p, text) in PROMPTS.iter().take(prompts).enumerate() {
        let tokens = tok.encode(text).unwrap();
        assert!(
            tokens.len() > 200,
            "prompt {p} has only {} tokens",
            tokens.len()
        );
        let mut file = std::fs::File::open(reference).unwrap();
        let content = gguf_file::Content::read(&mut file).unwrap();
        let mut reference =
            quantized_llama::ModelWeights::from_gguf(content, &mut file, &Device::Cpu).unwrap();
        for (pos, &t) in tokens.iter().enumerate() {
            let mine = ours
                .step(&[work(p as u64, vec![t])])
                .unwrap()
                .remove(0)
                .logits;
            let x = Tensor::new(&[[t]], &Device::Cpu).unwrap();
            let theirs = reference
                .forward(&x, pos)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            agree += usize::from(argmax(&mine) == argmax(&theirs));
            total += 1;
            let diff = mine
                .iter()
                .zip(&theirs)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            max_diff = max_diff.max(diff);
        }
        ours.free(SeqId(p as u64));
    }
    let rate = agree as f64 / total as f64;
    println!(
        "{} against candle quantized_llama on {}: teacher-forced top-1 agreement \
         {agree}/{total} = {:.2}%, max |Δlogit| = {max_diff:.3}",
        path.display(),
        reference.display(),
        rate * 100.0
    );
    (rate, max_diff)
}

#[test]
fn teacher_forced_top1_agrees_with_candle_quantized_llama() {
    let Some(path) = common::real_model() else {
        return;
    };
    let (rate, _) = teacher_forced_agreement(&path, &path, PROMPTS.len());
    assert!(rate >= 0.95, "agreement {rate}");
}

/// The real model requantized into each further integer-kernel format (a GGUF file written by
/// the test; K-quants only where 256 divides a matrix's width: `ffn_down`, the rest stays
/// Q4_1), against candle's f32 forward on the same weights (that file dequantized: candle's
/// quantized path carries its own 8-bit rounding noise, and two such paths disagree more than
/// either does with f32). 8-bit activations flip near-ties: 94-99 % top-1 agreement per format
/// over the first prompt's 236 positions, as candle's own quantized path scores against its
/// f32 path on the same files (94.1-98.7 %), where a broken kernel falls far below.
#[test]
fn requantized_formats_agree_with_candle_on_the_same_weights() {
    let Some(path) = common::real_model() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    for (dtype, min_rate, max_logit_diff) in [
        (GgmlDType::Q5_0, 0.93, 3.0),
        (GgmlDType::Q5_1, 0.93, 3.0),
        (GgmlDType::Q4K, 0.93, 3.0),
        (GgmlDType::Q5K, 0.93, 3.0),
        (GgmlDType::Q6K, 0.93, 3.0),
        // Dense kernels keep f32 activations: only the summation order differs.
        (GgmlDType::BF16, 0.99, 0.05),
    ] {
        let file = dir.path().join(format!("{dtype:?}.gguf"));
        let requantized = common::requantized_gguf(&path, &file, dtype);
        let dense = dir.path().join(format!("{dtype:?}-f32.gguf"));
        let reference = common::requantized_gguf(&requantized, &dense, GgmlDType::F32);
        let (rate, max_diff) = teacher_forced_agreement(&requantized, &reference, 1);
        assert!(rate >= min_rate, "{dtype:?}: agreement {rate}");
        assert!(
            max_diff < max_logit_diff,
            "{dtype:?}: logits {max_diff} apart"
        );
    }
}

/// A bf16 safetensors directory written from the bf16 GGUF of the real model loads with its
/// matrices still bf16 and decodes the GGUF's greedy tokens (the two differ only in the rope
/// layout of q and k, so logits agree to float rounding).
#[test]
fn bf16_safetensors_copy_decodes_like_the_gguf_of_the_same_weights() {
    let Some(path) = common::real_model() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let gguf = common::requantized_gguf(&path, &dir.path().join("bf16.gguf"), GgmlDType::BF16);
    let hf = common::hf_copy_of_gguf(&gguf, &dir.path().join("hf"));
    let weights = tokenrouter::engine::weights::load_weights(&common::model_config("hf", &hf));
    let weights = weights.unwrap();
    assert!(weights
        .layers
        .iter()
        .all(|l| l.w_down.dtype() == GgmlDType::BF16));
    assert_eq!(weights.lm_head.dtype(), GgmlDType::BF16);
    let tok = ModelTokenizer::load(&path).unwrap();
    let greedy = |model: &std::path::Path| {
        let mut executor = Executor::load(&common::model_config("m", model)).unwrap();
        let mut all = Vec::new();
        for (p, text) in PROMPTS.iter().take(3).enumerate() {
            let prefix: String = text.chars().take(200).collect();
            let mut input = tok.encode(&prefix).unwrap();
            let mut tokens = Vec::new();
            for _ in 0..32 {
                let out = executor.step(&[work(p as u64, input)]).unwrap().remove(0);
                tokens.push(out.candidate);
                input = vec![out.candidate];
            }
            executor.free(SeqId(p as u64));
            all.push(tokens);
        }
        all
    };
    assert_eq!(greedy(&hf), greedy(&gguf));
}

#[test]
fn batch_of_16_ragged_sequences_equals_each_alone() {
    let Some(path) = common::real_model() else {
        return;
    };
    let tok = ModelTokenizer::load(&path).unwrap();
    let mut executor = Executor::load(&common::model_config("smollm2", &path)).unwrap();
    let words: Vec<&str> = PROMPTS.iter().flat_map(|p| p.split(' ')).collect();
    let prompts: Vec<Vec<u32>> = (0..16)
        .map(|i| {
            tok.encode(&words[i * 7..i * 7 + 4 + 2 * i].join(" "))
                .unwrap()
        })
        .collect();
    let candidates = |executor: &mut Executor, seqs: &[(u64, Vec<u32>)]| -> Vec<Vec<u32>> {
        common::decode_together(executor, seqs, 8)
            .into_iter()
            .map(|steps| steps.into_iter().map(|(candidate, _)| candidate).collect())
            .collect()
    };
    let all: Vec<(u64, Vec<u32>)> = prompts
        .iter()
        .cloned()
        .enumerate()
        .map(|(i, p)| (i as u64, p))
        .collect();
    let batched = candidates(&mut executor, &all);
    for (i, seq) in all.iter().enumerate() {
        let alone = candidates(&mut executor, std::slice::from_ref(seq));
        assert_eq!(batched[i], alone[0], "sequence {i}");
    }
    assert_eq!(executor.kv_usage().used_tokens, 0);
}

/// `config/default.toml` with model paths made absolute (tests run from any directory).
fn default_config() -> tokenrouter::config::Config {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut config = tokenrouter::config::Config::load(&root.join("config/default.toml")).unwrap();
    for m in &mut config.models {
        m.path = root.join(&m.path);
    }
    config
}

/// Greedy outputs of `policy` for `prompts`, all in flight at once in `concurrency`-sized groups.
async fn run_policy(
    rt: &tokenrouter::runtime::Runtime,
    policy: &str,
    prompts: &[String],
    concurrency: usize,
    max_tokens: usize,
) -> Vec<tokenrouter::runtime::Completion> {
    use tokenrouter::runtime::GenerateRequest;
    let mut outputs = Vec::new();
    let numbered: Vec<(u64, &String)> = (0..).zip(prompts).collect();
    for chunk in numbered.chunks(concurrency) {
        let handles: Vec<_> = chunk
            .iter()
            .map(|&(seed, text)| {
                let request = GenerateRequest {
                    prompt: rt.encode(text).unwrap(),
                    policy: Some(policy.into()),
                    max_tokens,
                    sampling: SamplingParams {
                        seed,
                        ..SamplingParams::greedy()
                    },
                    timeout: None,
                    ignore_eos: false,
                };
                rt.submit(request).unwrap()
            })
            .collect();
        for h in handles {
            outputs.push(h.collect().await.unwrap());
        }
    }
    outputs
}

#[actix_rt::test]
async fn me_on_the_real_pair_is_identical_across_modes_and_concurrency() {
    use tokenrouter::config::ExecutionMode;
    use tokenrouter::runtime::Runtime;
    if common::real_model().is_none() {
        return;
    }
    let config = default_config();
    let words: Vec<&str> = PROMPTS.iter().flat_map(|p| p.split(' ')).collect();
    let prompts: Vec<String> = (0..32)
        .map(|i| words[i * 5..i * 5 + 3 + i % 4].join(" "))
        .collect();
    let mut reference: Option<Vec<Vec<u32>>> = None;
    for mode in ExecutionMode::ALL {
        let rt = Runtime::start(&config, Some(mode)).unwrap();
        for concurrency in [1, 8, 32] {
            let outputs: Vec<Vec<u32>> = run_policy(&rt, "me", &prompts, concurrency, 6)
                .await
                .into_iter()
                .map(|c| c.token_ids)
                .collect();
            match &reference {
                None => reference = Some(outputs),
                Some(want) => assert_eq!(&outputs, want, "{mode:?} at concurrency {concurrency}"),
            }
        }
        rt.shutdown();
    }
}

#[actix_rt::test]
async fn every_routing_policy_runs_on_the_real_pair_identically_in_all_modes() {
    use tokenrouter::config::ExecutionMode;
    use tokenrouter::runtime::Runtime;
    if common::real_model().is_none() {
        return;
    }
    let mut config = default_config();
    // Each algorithm also at its published default threshold, next to the calibrated one.
    let defaults: Vec<_> = config
        .policies
        .iter()
        .filter(|p| p.kind != tokenrouter::policy::PolicyKind::Me)
        .map(|p| tokenrouter::config::PolicyConfig {
            name: format!("{}-default", p.name),
            threshold: None,
            ..p.clone()
        })
        .collect();
    config.policies.extend(defaults);
    let template = {
        let tok = ModelTokenizer::load(&config.models[0].path).unwrap();
        tokenrouter::engine::chat::ChatTemplate::for_model(&tok).unwrap()
    };
    let prompts: Vec<String> = ["How does a printing press work?", "How do I bake bread?"]
        .iter()
        .map(|q| {
            let message = tokenrouter::engine::chat::ChatMessage::user(*q);
            template.render(&[message], true).unwrap()
        })
        .collect();
    let calibrated = ["r2r", "citer", "rstitch", "colm"];
    let mut reference: std::collections::HashMap<String, Vec<Vec<u32>>> = Default::default();
    for mode in ExecutionMode::ALL {
        let rt = Runtime::start(&config, Some(mode)).unwrap();
        for policy in calibrated
            .iter()
            .flat_map(|p| [p.to_string(), format!("{p}-default")])
        {
            let outputs = run_policy(&rt, &policy, &prompts, 2, 12).await;
            if calibrated.contains(&policy.as_str()) {
                let per_model = outputs.iter().fold(vec![0; 2], |acc, c| {
                    acc.iter()
                        .zip(&c.routing.tokens_per_model)
                        .map(|(a, b)| a + b)
                        .collect()
                });
                assert!(
                    per_model.iter().all(|&n| n > 0),
                    "{policy} {mode:?}: tokens per model {per_model:?}"
                );
            }
            let tokens: Vec<Vec<u32>> = outputs.into_iter().map(|c| c.token_ids).collect();
            match reference.get(&policy) {
                None => {
                    reference.insert(policy, tokens);
                }
                Some(want) => assert_eq!(&tokens, want, "{policy} in {mode:?}"),
            }
        }
        rt.shutdown();
    }
}

/// `router collect` and `router train` on the real pair, at a bounded size: the traces hold a
/// row per answer position of both splits, the trained routers load into the policies with the
/// threshold their report names, and a router trained on traces without enough questions to
/// validate is refused with a message.
#[test]
fn router_collect_and_train_run_end_to_end_on_the_real_pair() {
    if common::real_model().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let traces = dir.path().join("traces.safetensors");
    let tokenrouter = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tokenrouter"))
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .args(args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).to_string(),
            stderr,
        )
    };
    let (ok, stdout, stderr) = tokenrouter(&[
        "router",
        "collect",
        "--questions",
        "5",
        "--max-tokens",
        "6",
        "--out",
        traces.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    // Five questions per split, up to six answer positions each.
    let rows: usize = stdout.split_whitespace().next().unwrap().parse().unwrap();
    assert!((10..=60).contains(&rows), "{stdout}");
    for kind in ["r2r", "citer"] {
        let router = dir.path().join(format!("{kind}.safetensors"));
        let (ok, stdout, stderr) = tokenrouter(&[
            "router",
            "train",
            "--traces",
            traces.to_str().unwrap(),
            "--kind",
            kind,
            "--label",
            "differs",
            "--epochs",
            "2",
            "--width",
            "16",
            "--blocks",
            "1",
            "--out",
            router.to_str().unwrap(),
            "--json",
        ]);
        assert!(ok, "{stderr}");
        let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        let threshold = report["share_rule"]["threshold"].as_f64().unwrap() as f32;
        let saved = match kind {
            "r2r" => R2rRouter::load(&router, 576).unwrap().threshold,
            _ => CiterRouter::load(&router, 576).unwrap().threshold(),
        };
        assert_eq!(saved, Some(threshold), "{report}");
        let auc = report["heldout_auc"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&auc), "{report}");
    }
    let (ok, _, stderr) = tokenrouter(&[
        "router",
        "collect",
        "--questions",
        "1",
        "--max-tokens",
        "2",
        "--out",
        traces.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    let (ok, _, stderr) = tokenrouter(&[
        "router",
        "train",
        "--traces",
        traces.to_str().unwrap(),
        "--kind",
        "r2r",
        "--out",
        dir.path().join("x").to_str().unwrap(),
    ]);
    assert!(!ok && stderr.contains("collect more questions"), "{stderr}");
}

/// `bench routing`'s `std-serving` mode (single-model `serve --model` processes and a
/// per-token HTTP dispatcher) makes the runtime's routing decisions: for the training-free
/// rules, every request's tokens equal the in-process `async` runtime's (greedy), and its
/// time per token is split by the servers' timing. A learned router, which reads hidden
/// states no HTTP API returns, is refused with a message.
#[test]
fn std_serving_dispatches_the_same_tokens_as_the_runtime() {
    if common::real_model().is_none() {
        return;
    }
    let bench = |policies: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_tokenrouter"))
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .args(["bench", "routing", "--policy", policies])
            .args(["--mode", "async,std-serving", "--concurrency", "2"])
            .args(["--requests", "4", "--max-tokens", "8", "--json"])
            .output()
            .unwrap()
    };
    let out = bench("r2r-entropy,colm,rstitch");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    for policy in ["r2r-entropy", "colm", "rstitch"] {
        let cell = |mode: &str| {
            rows.iter()
                .find(|r| r["policy"] == policy && r["mode"] == mode)
                .unwrap_or_else(|| panic!("no {policy} {mode} row"))
                .clone()
        };
        let (runtime, dispatched) = (cell("async"), cell("std-serving"));
        assert_eq!(dispatched["completed"], 4, "{dispatched}");
        assert_eq!(
            runtime["outputs_digest"], dispatched["outputs_digest"],
            "{policy}: {runtime} / {dispatched}"
        );
        assert_eq!(
            runtime["token_share"], dispatched["token_share"],
            "{policy}"
        );
        let times = &dispatched["std_serving_breakdown"];
        assert!(times["calls_per_token"].as_f64().unwrap() >= 1.0, "{times}");
        assert!(times["compute_ms"].as_f64().unwrap() > 0.0, "{times}");
    }
    let refused = bench("r2r");
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("policy `r2r` reads hidden states"),
        "{stderr}"
    );
}

//! Learned routers against a direct tensor computation, their load-time validation, and the
//! extreme thresholds through the runtime.

mod common;

use candle_core::quantized::GgmlDType;
use candle_core::{Device, Tensor, D};
use common::{Arch, TinySpec};
use std::collections::HashMap;
use tokenrouter::config::{Config, ExecutionMode};
use tokenrouter::engine::{LogitStats, SamplingParams};
use tokenrouter::policy::learned::{CiterRouter, DeferralHead, HiddenScorer, R2rRouter};
use tokenrouter::policy::registry::PolicyRegistry;
use tokenrouter::policy::{RequestId, Route, RoutingState, StepView};
use tokenrouter::runtime::{GenerateRequest, Runtime};

const HIDDEN: usize = 64;

fn linear(w: &HashMap<String, Tensor>, name: &str, x: &Tensor) -> Tensor {
    x.matmul(&w[&format!("{name}.weight")].t().unwrap())
        .unwrap()
        .broadcast_add(&w[&format!("{name}.bias")])
        .unwrap()
}

fn layer_norm(w: &HashMap<String, Tensor>, name: &str, x: &Tensor) -> Tensor {
    let mean = x.mean_keepdim(D::Minus1).unwrap();
    let centred = x.broadcast_sub(&mean).unwrap();
    let var = centred.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
    centred
        .broadcast_div(&(var + 1e-5).unwrap().sqrt().unwrap())
        .unwrap()
        .broadcast_mul(&w[&format!("{name}.weight")])
        .unwrap()
        .broadcast_add(&w[&format!("{name}.bias")])
        .unwrap()
}

fn sigmoid(x: &Tensor) -> Vec<f32> {
    x.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|v| 1.0 / (1.0 + (-v).exp()))
        .collect()
}

fn random_rows(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..rows * cols)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) as f32 / (1u64 << 31) as f32) * 4.0 - 2.0
        })
        .collect()
}

fn assert_close(got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() < 1e-4, "{got:?} vs {want:?}");
    }
}

#[test]
fn r2r_router_matches_a_direct_tensor_computation_and_decides_per_row() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("r2r.safetensors");
    let w = common::write_router(&path, "r2r", HIDDEN, 5);
    let router = R2rRouter::load(&path, HIDDEN).unwrap();
    let rows = 6;
    let (hidden, embedding) = (random_rows(rows, HIDDEN, 1), random_rows(rows, HIDDEN, 2));
    let mut top = random_rows(rows, 100, 3);
    for row in top.chunks_mut(100) {
        row.sort_by(|a, b| b.total_cmp(a));
    }
    let got = router.score(&hidden, &embedding, &top);

    let dev = Device::Cpu;
    let t = |v: &[f32], c: usize| Tensor::from_slice(v, (rows, c), &dev).unwrap();
    let u = linear(&w, "topk_proj", &t(&top, 100));
    let joined = Tensor::cat(&[t(&hidden, HIDDEN), t(&embedding, HIDDEN), u], 1).unwrap();
    let mut x = linear(&w, "backbone_proj", &linear(&w, "input_proj", &joined));
    for i in 0..2 {
        let mid = linear(
            &w,
            &format!("blocks.{i}.fc1"),
            &layer_norm(&w, &format!("blocks.{i}.norm"), &x),
        );
        x = (x + linear(&w, &format!("blocks.{i}.fc2"), &mid.gelu_erf().unwrap())).unwrap();
    }
    let want = sigmoid(&linear(&w, "head", &layer_norm(&w, "final_norm", &x)));
    assert_close(&got, &want);

    // The policy scores the batch and applies p >= θ to SLM rows only.
    let threshold = want.iter().copied().fold(0.0, f32::max) - 1e-3;
    let policy = tokenrouter::policy::r2r::R2r::new("r2r", 0, 1, Some(threshold), Some(router));
    let stats: Vec<LogitStats> = top
        .chunks(100)
        .map(|row| LogitStats {
            entropy: 0.0,
            max_prob: 0.0,
            top_k: row
                .iter()
                .enumerate()
                .map(|(i, &l)| (i as u32, l))
                .collect(),
        })
        .collect();
    let state = RoutingState::new(RequestId(1), vec![1], 2, 0);
    let views: Vec<StepView> = (0..rows)
        .map(|r| StepView {
            model: 0,
            candidate: 1,
            stats: &stats[r],
            logits: &[],
            hidden: Some(&hidden[r * HIDDEN..(r + 1) * HIDDEN]),
            embedding: Some(&embedding[r * HIDDEN..(r + 1) * HIDDEN]),
        })
        .collect();
    let states = vec![&state; rows];
    use tokenrouter::policy::RoutingPolicy;
    let routes = policy.route_batch(&states, &views);
    for (route, p) in routes.iter().zip(&want) {
        let expected = if *p >= threshold {
            Route::RejectAndSwitch(1)
        } else {
            Route::Stay
        };
        assert_eq!(*route, expected, "p = {p}, θ = {threshold}");
    }
    assert!(routes.contains(&Route::Stay) && routes.contains(&Route::RejectAndSwitch(1)));
}

#[test]
fn citer_router_and_deferral_head_match_direct_computations() {
    let dir = tempfile::tempdir().unwrap();
    let rows = 5;
    let hidden = random_rows(rows, HIDDEN, 8);
    let h = Tensor::from_slice(&hidden, (rows, HIDDEN), &Device::Cpu).unwrap();

    let path = dir.path().join("citer.safetensors");
    let w = common::write_router(&path, "citer", HIDDEN, 6);
    let got = CiterRouter::load(&path, HIDDEN).unwrap().score(&hidden);
    let x = linear(&w, "fc1", &h);
    let normed = x
        .broadcast_sub(&w["bn.running_mean"])
        .unwrap()
        .broadcast_div(
            &(w["bn.running_var"].clone() + 1e-5)
                .unwrap()
                .sqrt()
                .unwrap(),
        )
        .unwrap()
        .broadcast_mul(&w["bn.weight"])
        .unwrap()
        .broadcast_add(&w["bn.bias"])
        .unwrap()
        .relu()
        .unwrap();
    assert_close(
        &got,
        &sigmoid(&linear(&w, "head", &linear(&w, "fc2", &normed))),
    );

    let path = dir.path().join("colm.safetensors");
    let w = common::write_router(&path, "colm", HIDDEN, 7);
    let got = DeferralHead::load(&path, HIDDEN).unwrap().score(&hidden);
    assert_close(&got, &sigmoid(&linear(&w, "defer", &h)));
}

/// The released checkpoints' name for a tensor of `write_router`, written out here rather
/// than taken from the loader (tables from docs/policies.md and the releases).
fn released_name(kind: &str, own: &str) -> String {
    let renames: &[(&str, &str)] = match kind {
        "r2r" => &[
            ("topk_proj.", "logits_projection."),
            ("input_proj.", "combined_projection."),
            ("backbone_proj.", "backbone.input_projection."),
            ("final_norm.", "backbone.output_layer.0."),
            ("head.", "backbone.output_layer.1."),
            (".norm.", ".layer_norm."),
            (".fc1.", ".mlp.0."),
            (".fc2.", ".mlp.3."),
            ("blocks.", "backbone.blocks."),
        ],
        _ => &[
            ("fc1.", "mlp.0."),
            ("bn.", "mlp.1."),
            ("fc2.", "mlp.4."),
            ("head.", "linear."),
        ],
    };
    let mut name = own.to_string();
    for (from, to) in renames {
        if name.starts_with(from) || (from.starts_with('.') && name.contains(from)) {
            name = name.replacen(from, to, 1);
        }
    }
    name
}

/// R2R's inputs for `rows` rows: hidden states, candidate embeddings, sorted top-100 logits.
fn router_inputs(rows: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (hidden, embedding) = (random_rows(rows, HIDDEN, 11), random_rows(rows, HIDDEN, 12));
    let mut top = random_rows(rows, 100, 13);
    for row in top.chunks_mut(100) {
        row.sort_by(|a, b| b.total_cmp(a));
    }
    (hidden, embedding, top)
}

/// One router's weights twice in `dir`: under this project's names (`{kind}.safetensors`) and
/// under the released names with the extra tensors those files carry
/// (`{kind}-released.safetensors`). Returns both paths and the released tensors.
fn write_released(
    dir: &std::path::Path,
    kind: &str,
) -> (
    std::path::PathBuf,
    std::path::PathBuf,
    HashMap<String, Tensor>,
) {
    let own = dir.join(format!("{kind}.safetensors"));
    let weights = common::write_router(&own, kind, HIDDEN, 21);
    let mut released: HashMap<String, Tensor> = weights
        .iter()
        .map(|(name, t)| (released_name(kind, name), t.clone()))
        .collect();
    let extra = match kind {
        "r2r" => (
            "token_embeddings.weight",
            Tensor::zeros((7, HIDDEN), candle_core::DType::F32, &Device::Cpu),
        ),
        _ => (
            "mlp.1.num_batches_tracked",
            Tensor::new(&[3i64], &Device::Cpu),
        ),
    };
    released.insert(extra.0.to_string(), extra.1.unwrap());
    let path = dir.join(format!("{kind}-released.safetensors"));
    candle_core::safetensors::save(&released, &path).unwrap();
    assert!(
        !released.keys().any(|k| weights.contains_key(k)),
        "{released:?}"
    );
    (own, path, released)
}

/// Weights under the released names (with the extra tensors those files carry) score exactly
/// as the same weights under this project's names; a missing tensor is named.
#[test]
fn released_checkpoint_names_load_and_score_like_the_projects_own() {
    let dir = tempfile::tempdir().unwrap();
    let (hidden, embedding, top) = router_inputs(4);
    for kind in ["r2r", "citer"] {
        let (own, path, mut released) = write_released(dir.path(), kind);
        let (got, want) = match kind {
            "r2r" => (
                R2rRouter::load(&path, HIDDEN)
                    .unwrap()
                    .score(&hidden, &embedding, &top),
                R2rRouter::load(&own, HIDDEN)
                    .unwrap()
                    .score(&hidden, &embedding, &top),
            ),
            _ => (
                CiterRouter::load(&path, HIDDEN).unwrap().score(&hidden),
                CiterRouter::load(&own, HIDDEN).unwrap().score(&hidden),
            ),
        };
        assert_eq!(got, want, "{kind}");

        let missing = match kind {
            "r2r" => "backbone.output_layer.1.weight",
            _ => "mlp.1.running_var",
        };
        released.remove(missing);
        candle_core::safetensors::save(&released, &path).unwrap();
        let err = match kind {
            "r2r" => R2rRouter::load(&path, HIDDEN).err().unwrap().to_string(),
            _ => CiterRouter::load(&path, HIDDEN).err().unwrap().to_string(),
        };
        assert!(err.contains(missing), "{err}");
    }
}

/// Co-LLM ships no separate head: its deferral weights are the fine-tuned LM head's last row.
#[test]
fn a_deferral_head_reads_the_last_row_of_a_fine_tuned_lm_head() {
    let dir = tempfile::tempdir().unwrap();
    let hidden = random_rows(3, HIDDEN, 31);
    let lm_head =
        Tensor::from_slice(&random_rows(6, HIDDEN, 32), (6, HIDDEN), &Device::Cpu).unwrap();
    let path = dir.path().join("colm-released.safetensors");
    let tensors = HashMap::from([("lm_head.weight".to_string(), lm_head.clone())]);
    candle_core::safetensors::save(&tensors, &path).unwrap();
    let got = DeferralHead::load(&path, HIDDEN).unwrap().score(&hidden);
    let h = Tensor::from_slice(&hidden, (3, HIDDEN), &Device::Cpu).unwrap();
    let last = lm_head.narrow(0, 5, 1).unwrap();
    let want = sigmoid(&h.matmul(&last.t().unwrap()).unwrap());
    assert_close(&got, &want);

    let err = DeferralHead::load(&path, HIDDEN + 1)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("lm_head.weight"), "{err}");
}

fn pair_config(dir: &std::path::Path, policies: &str) -> Config {
    let spec = TinySpec::new(Arch::Llama);
    let slm = common::write_gguf(&dir.join("slm.gguf"), &spec, GgmlDType::Q8_0);
    let llm = common::write_gguf(
        &dir.join("llm.gguf"),
        &TinySpec { seed: 99, ..spec },
        GgmlDType::Q8_0,
    );
    Config::parse(&format!(
        "[[models]]\nname = \"slm\"\npath = \"{}\"\n[[models]]\nname = \"llm\"\npath = \"{}\"\n{policies}",
        slm.display(),
        llm.display()
    ))
    .unwrap()
}

#[test]
fn routers_are_validated_against_the_model_at_load() {
    let dir = tempfile::tempdir().unwrap();
    let router = dir.path().join("r2r.safetensors");
    common::write_router(&router, "r2r", 48, 1);
    let config = pair_config(
        dir.path(),
        &format!("[[policies]]\nname = \"r2r\"\nkind = \"r2r\"\nmodels = [\"slm\", \"llm\"]\nrouter = \"{}\"\n", router.display()),
    );
    let err = PolicyRegistry::from_config(&config, &[HIDDEN, HIDDEN])
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("policies.r2r") && err.contains("hidden size"),
        "{err}"
    );
    let missing = pair_config(
        dir.path(),
        "[[policies]]\nname = \"c\"\nkind = \"citer\"\nmodels = [\"slm\", \"llm\"]\nrouter = \"/nonexistent.safetensors\"\n",
    );
    let err = PolicyRegistry::from_config(&missing, &[HIDDEN, HIDDEN])
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("not found"), "{err}");
}

async fn generate(rt: &Runtime, policy: &str) -> (Vec<u32>, Vec<usize>) {
    let out = rt
        .submit(GenerateRequest {
            prompt: vec![5, 9, 14, 30, 42].into(),
            policy: Some(policy.into()),
            max_tokens: 24,
            sampling: SamplingParams::greedy(),
            timeout: None,
            ignore_eos: false,
        })
        .unwrap()
        .collect()
        .await
        .unwrap();
    (out.token_ids, out.routing.tokens_per_model)
}

#[actix_rt::test]
async fn r2r_extreme_thresholds_reduce_to_one_model_alone() {
    let dir = tempfile::tempdir().unwrap();
    let router = dir.path().join("r2r.safetensors");
    common::write_router(&router, "r2r", HIDDEN, 4);
    let policy = |name: &str, threshold: f32| {
        format!(
            "[[policies]]\nname = \"{name}\"\nkind = \"r2r\"\nmodels = [\"slm\", \"llm\"]\nthreshold = {threshold}\nrouter = \"{}\"\n",
            router.display()
        )
    };
    let config = pair_config(
        dir.path(),
        &(policy("all-llm", 0.0) + &policy("all-slm", 1.5) + &policy("mixed", 0.5)),
    );
    for mode in [ExecutionMode::Async, ExecutionMode::Standard] {
        let rt = Runtime::start(&config, Some(mode)).unwrap();
        let (llm_alone, _) = generate(&rt, "llm").await;
        let (slm_alone, _) = generate(&rt, "slm").await;
        assert_ne!(
            llm_alone, slm_alone,
            "the two tiny models must differ for this test to mean anything"
        );
        let (tokens, per_model) = generate(&rt, "all-llm").await;
        assert_eq!(tokens, llm_alone);
        assert_eq!(per_model, vec![0, tokens.len()]);
        let (tokens, per_model) = generate(&rt, "all-slm").await;
        assert_eq!(tokens, slm_alone);
        assert_eq!(per_model, vec![tokens.len(), 0]);
        assert!(
            rt.policies()
                .get("mixed")
                .unwrap()
                .describe()
                .learned_router
        );
        rt.shutdown();
    }
}

/// `.venv-torch` (made by `scripts/install-test-clients.sh`): torch and safetensors, to write
/// checkpoints the way the routers' authors do. Absent: the test skips, or fails under
/// `TOKENROUTER_REQUIRE_CLIENTS=1`.
fn python_with_torch() -> Option<std::path::PathBuf> {
    let python = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv-torch/bin/python");
    let found = std::process::Command::new(&python)
        .args(["-c", "import torch, safetensors"])
        .output()
        .is_ok_and(|o| o.status.success());
    match found {
        true => Some(python),
        false if std::env::var("TOKENROUTER_REQUIRE_CLIENTS").is_ok_and(|v| v == "1") => {
            panic!(
                "{} lacks torch: run scripts/install-test-clients.sh",
                python.display()
            )
        }
        false => {
            eprintln!("skipping: no torch venv (scripts/install-test-clients.sh makes it)");
            None
        }
    }
}

/// Writes a checkpoint as the authors release it (torch.save of R2R's dict with
/// `common_args.threshold`, CITER's plain state dict) from weights under the released names.
const WRITE_OFFICIAL: &str = r#"
import sys, torch
from safetensors.torch import load_file
source, kind, out = sys.argv[1:]
state = load_file(source)
if kind == "r2r":
    torch.save({"model_type": "HiddenStatesTokenLMHeadLogitsClassifier",
                "init_args": {"hidden_size": 8, "num_blocks": 2},
                "common_args": {"threshold": 0.37, "input_type": ["hidden_states", "token", "logits"]},
                "model_specific_args": {}, "state_dict": state}, out)
else:
    torch.save(state, out)
"#;

/// `scripts/convert-router.py` turns checkpoints written the official way into a safetensors
/// file (and a JSON sidecar with the threshold) that scores exactly like the same weights under
/// this project's names.
#[test]
fn converted_official_checkpoints_score_like_the_projects_own_with_their_threshold() {
    let Some(python) = python_with_torch() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (hidden, embedding, top) = router_inputs(4);
    for kind in ["r2r", "citer"] {
        let (own, released, _) = write_released(dir.path(), kind);
        let checkpoint = dir.path().join(format!("{kind}.pt"));
        let converted = dir.path().join(format!("{kind}-converted.safetensors"));
        let run = |args: &[&std::ffi::OsStr]| {
            let out = std::process::Command::new(&python)
                .args(args)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        run(&[
            "-c".as_ref(),
            WRITE_OFFICIAL.as_ref(),
            released.as_ref(),
            kind.as_ref(),
            checkpoint.as_ref(),
        ]);
        let script =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/convert-router.py");
        run(&[script.as_ref(), checkpoint.as_ref(), converted.as_ref()]);
        let (got, want, threshold) = match kind {
            "r2r" => {
                let router = R2rRouter::load(&converted, HIDDEN).unwrap();
                let own = R2rRouter::load(&own, HIDDEN).unwrap();
                (
                    router.score(&hidden, &embedding, &top),
                    own.score(&hidden, &embedding, &top),
                    router.threshold,
                )
            }
            _ => {
                let router = CiterRouter::load(&converted, HIDDEN).unwrap();
                let own = CiterRouter::load(&own, HIDDEN).unwrap();
                (
                    router.score(&hidden),
                    own.score(&hidden),
                    router.threshold(),
                )
            }
        };
        assert_eq!(got, want, "{kind}");
        let expected = (kind == "r2r").then_some(0.37);
        assert_eq!(threshold, expected, "{kind}: the sidecar's threshold");
    }
}

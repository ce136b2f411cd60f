//! The GPU backend (`--features cuda`). Kernel sources compile with NVRTC on any machine that
//! has libnvrtc (CI installs the `nvidia-cuda-nvrtc-cu12` wheel; `TOKENROUTER_REQUIRE_NVRTC=1`
//! turns a missing library into a failure). Tests that run kernels skip without a GPU.
#![cfg(feature = "cuda")]

mod common;
/// The binary's parity check and its prompts (benchmarks live outside the library).
#[allow(dead_code)]
#[path = "../src/bench/parity.rs"]
mod parity;
#[allow(dead_code)]
#[path = "../src/bench/prompts.rs"]
mod prompts;

use candle_core::quantized::GgmlDType;
use common::{Arch, TinySpec};
use tokenrouter::config::{ModelConfig, ModelDevice};
use tokenrouter::engine::cuda::{gpu_available, kernels, CudaExecutor};
use tokenrouter::engine::tokenizer::ModelTokenizer;
use tokenrouter::engine::{Executor, Needs, SamplingParams, SeqId, SeqWork, StepExecutor};

fn nvrtc_or_skip() -> bool {
    if kernels::nvrtc_available() {
        return true;
    }
    assert!(
        std::env::var("TOKENROUTER_REQUIRE_NVRTC").is_err(),
        "TOKENROUTER_REQUIRE_NVRTC is set but libnvrtc cannot be loaded (LD_LIBRARY_PATH?)"
    );
    eprintln!("skipping: libnvrtc not found (scripts/test.sh installs it)");
    false
}

fn gpu_or_skip() -> bool {
    if gpu_available() {
        return true;
    }
    eprintln!("skipping: no CUDA GPU on this machine");
    false
}

#[test]
fn every_kernel_source_compiles_to_ptx() {
    if !nvrtc_or_skip() {
        return;
    }
    for arch in ["compute_61", "compute_80", "compute_90"] {
        for (file, source) in kernels::SOURCES {
            let ptx = kernels::compile(file, source, arch)
                .unwrap_or_else(|e| panic!("{file} for {arch}: {e}"))
                .to_src();
            let launched = kernels::FUNCTIONS.iter().filter(|(f, _)| *f == file);
            let entries = ptx.matches(".entry").count();
            assert_eq!(
                entries,
                launched.clone().count(),
                "{file}: unlaunched kernels"
            );
            for (_, function) in launched {
                assert!(
                    ptx.contains(&format!(".entry {function}(")),
                    "{file} for {arch}: no kernel `{function}`"
                );
            }
        }
    }
}

#[test]
fn a_broken_source_fails_with_the_compiler_log() {
    if !nvrtc_or_skip() {
        return;
    }
    let err = kernels::compile(
        "broken.cu",
        "extern \"C\" __global__ void f(float* x) { x[0] = undeclared_value; }",
        "compute_80",
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("broken.cu") && err.contains("undeclared_value"),
        "{err}"
    );
}

#[test]
fn a_missing_gpu_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = common::write_gguf(
        &dir.path().join("m.gguf"),
        &TinySpec::new(Arch::Llama),
        GgmlDType::Q8_0,
    );
    let err = CudaExecutor::load(&common::model_config("tiny", &path), 99)
        .err()
        .expect("there is no GPU 99")
        .to_string();
    assert!(
        err.contains("no NVIDIA driver") || err.contains("cuda:99, but"),
        "{err}"
    );
}

fn work(seq: u64, tokens: Vec<u32>) -> SeqWork {
    SeqWork {
        seq: SeqId(seq),
        tokens,
        sampling: SamplingParams::greedy(),
        needs: Needs {
            hidden: true,
            top_k: 3,
            embedding: false,
        },
    }
}

/// Greedy decoding of ragged prompts batched together; the tokens and every step's outputs.
fn decode(
    executor: &mut dyn StepExecutor,
    prompts: &[Vec<u32>],
    steps: usize,
) -> (Vec<Vec<u32>>, Vec<tokenrouter::engine::StepOutput>) {
    let mut tokens = vec![Vec::new(); prompts.len()];
    let mut outputs = Vec::new();
    let mut inputs = prompts.to_vec();
    for _ in 0..steps {
        let batch: Vec<SeqWork> = inputs
            .iter()
            .enumerate()
            .map(|(i, t)| work(i as u64, t.clone()))
            .collect();
        for (i, out) in executor.step(&batch).unwrap().into_iter().enumerate() {
            tokens[i].push(out.candidate);
            inputs[i] = vec![out.candidate];
            outputs.push(out);
        }
    }
    for seq in 0..prompts.len() {
        executor.free(SeqId(seq as u64));
    }
    (tokens, outputs)
}

fn on_gpu(config: &ModelConfig) -> CudaExecutor {
    CudaExecutor::load(config, 0).unwrap()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn tiny_models_decode_on_the_gpu_as_on_the_cpu() {
    if !gpu_or_skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let prompts: Vec<Vec<u32>> = (0..5)
        .map(|i| {
            (0..3 + 7 * i)
                .map(|j| 3 + (j * 31 + i * 17) % 270)
                .collect()
        })
        .collect();
    for arch in [Arch::Llama, Arch::Qwen2, Arch::Qwen3] {
        for dtype in [
            GgmlDType::Q8_0,
            GgmlDType::Q4_0,
            GgmlDType::Q4_1,
            GgmlDType::F32,
        ] {
            let path = common::write_gguf(&dir.path().join("m.gguf"), &TinySpec::new(arch), dtype);
            let config = common::model_config("tiny", &path);
            let mut gpu = on_gpu(&config);
            let (gpu_tokens, gpu_out) = decode(&mut gpu, &prompts, 10);
            let (cpu_tokens, cpu_out) = decode(&mut Executor::load(&config).unwrap(), &prompts, 10);
            assert_eq!(gpu_tokens, cpu_tokens, "{arch:?} {dtype:?}");
            for (g, c) in gpu_out.iter().zip(&cpu_out) {
                let what = format!("{arch:?} {dtype:?} position {}", c.position);
                assert_eq!(g.position, c.position, "{what}");
                assert!(max_abs_diff(&g.logits, &c.logits) < 2e-3, "{what}: logits");
                let (gh, ch) = (g.hidden.as_ref().unwrap(), c.hidden.as_ref().unwrap());
                assert!(max_abs_diff(gh, ch) < 2e-3, "{what}: hidden");
                assert!((g.stats.entropy - c.stats.entropy).abs() < 1e-3, "{what}");
                assert!((g.stats.max_prob - c.stats.max_prob).abs() < 1e-4, "{what}");
                let top = |o: &tokenrouter::engine::StepOutput| -> Vec<u32> {
                    o.stats.top_k.iter().map(|t| t.0).collect()
                };
                assert_eq!(top(g), top(c), "{what}");
            }
            assert_eq!(gpu.kv_usage().used_tokens, 0, "{arch:?} {dtype:?}");
        }
    }
}

#[test]
fn gpu_batched_equals_unbatched_and_shared_prefixes_keep_their_kv() {
    if !gpu_or_skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = common::write_gguf(
        &dir.path().join("m.gguf"),
        &TinySpec::new(Arch::Llama),
        GgmlDType::Q4_1,
    );
    let mut gpu = on_gpu(&common::model_config("tiny", &path));
    let prompts: Vec<Vec<u32>> = (0..8)
        .map(|i| (0..2 + 5 * i).map(|j| 5 + (j * 13 + i) % 250).collect())
        .collect();
    let (batched, _) = decode(&mut gpu, &prompts, 12);
    for (i, p) in prompts.iter().enumerate() {
        let (alone, _) = decode(&mut gpu, std::slice::from_ref(p), 12);
        assert_eq!(batched[i], alone[0], "sequence {i}");
    }
    // A sequence started on a cached prefix continues as its source would: two full blocks
    // shared, five positions of the third copied on the device.
    let long: Vec<u32> = (0..40).map(|j| 7 + (j * 11) % 200).collect();
    gpu.step(&[work(1, long.clone())]).unwrap();
    assert_eq!(gpu.attach_prefix(SeqId(2), &long[..37]), 37);
    let source = gpu.step(&[work(1, vec![9])]).unwrap().remove(0);
    let mut rest = long[37..].to_vec();
    rest.push(9);
    let forked = gpu.step(&[work(2, rest)]).unwrap().remove(0);
    assert_eq!(source.candidate, forked.candidate);
    assert!(max_abs_diff(&source.logits, &forked.logits) < 1e-3);
    gpu.free(SeqId(1));
    gpu.free(SeqId(2));
    assert_eq!(gpu.kv_usage().used_tokens, 0);
}

#[test]
fn real_model_greedy_tokens_match_the_cpu_for_64_tokens() {
    if !gpu_or_skip() {
        return;
    }
    let Some(path) = common::real_model() else {
        return;
    };
    let tokenizer = ModelTokenizer::load(&path).unwrap();
    let config = ModelConfig {
        device: ModelDevice::Cuda(0),
        ..common::model_config("smollm2", &path)
    };
    let mut cpu = Executor::load(&config).unwrap();
    let report = parity::run(&mut cpu, &mut on_gpu(&config), &tokenizer, 64).unwrap();
    println!("{}", report.markdown());
    assert_eq!(report.prompts.len(), 3);
    assert!(report.all_match);
}

//! The GPU backend (`--features cuda`). Kernel sources compile with NVRTC on any machine that
//! has libnvrtc (CI installs the `nvidia-cuda-nvrtc-cu12` wheel; `TOKENROUTER_REQUIRE_NVRTC=1`
//! turns a missing library into a failure). Tests that run kernels skip without a GPU
//! (`TOKENROUTER_REQUIRE_GPU=1`, as `scripts/gpu-check.sh` sets, makes that a failure).
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
use tokenrouter::config::{ModelConfig, ModelDevice, WeightPrecision};
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
    assert!(
        std::env::var("TOKENROUTER_REQUIRE_GPU").is_err(),
        "TOKENROUTER_REQUIRE_GPU is set but no CUDA GPU can be used (driver, LD_LIBRARY_PATH?)"
    );
    eprintln!("skipping: no CUDA GPU on this machine");
    false
}

#[test]
fn every_kernel_source_compiles_to_ptx() {
    if !nvrtc_or_skip() {
        return;
    }
    let mut archs = vec!["compute_80", "compute_90"];
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two out-parameters, written by the loaded library.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    // NVRTC 13 dropped Pascal, the oldest GPU the integer-dot kernels run on.
    if major < 13 {
        archs.insert(0, "compute_61");
    }
    for arch in archs {
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
        filter: None,
    }
}

/// Greedy decoding of ragged prompts batched together; the tokens and every step's outputs.
fn decode(
    executor: &mut dyn StepExecutor,
    prompts: &[Vec<u32>],
    steps: usize,
) -> (Vec<Vec<u32>>, Vec<tokenrouter::engine::StepOutput>) {
    decode_fed(executor, prompts, steps, None)
}

/// `decode`, but fed `forced[i][step]` after each step when given (teacher forcing).
fn decode_fed(
    executor: &mut dyn StepExecutor,
    prompts: &[Vec<u32>],
    steps: usize,
    forced: Option<&[Vec<u32>]>,
) -> (Vec<Vec<u32>>, Vec<tokenrouter::engine::StepOutput>) {
    let mut tokens = vec![Vec::new(); prompts.len()];
    let mut outputs = Vec::new();
    let mut inputs = prompts.to_vec();
    for step in 0..steps {
        let batch: Vec<SeqWork> = inputs
            .iter()
            .enumerate()
            .map(|(i, t)| work(i as u64, t.clone()))
            .collect();
        for (i, out) in executor.step(&batch).unwrap().into_iter().enumerate() {
            tokens[i].push(out.candidate);
            inputs[i] = vec![forced.map_or(out.candidate, |f| f[i][step])];
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

/// f32 arithmetic on both sides, in another order; both keep the KV cache in f16, where a
/// flipped rounding of a key or value moves the logits by up to ~8e-4 of the largest (see
/// `gguf_forward_matches_candle_transformers_for_every_family`). A Q3_K model measured 3.2e-4
/// on an H200.
const F32_TOLERANCE: f32 = 1e-3;

fn prompts_for_tiny_models() -> Vec<Vec<u32>> {
    (0..5)
        .map(|i| {
            (0..3 + 7 * i)
                .map(|j| 3 + (j * 31 + i * 17) % 270)
                .collect()
        })
        .collect()
}

/// `gpu` (fed the CPU's greedy tokens) against `cpu`: logits within `tolerance` of the CPU's
/// largest logit, and the CPU's token wherever its top-2 margin exceeds twice the difference.
fn assert_follows(
    gpu: &[tokenrouter::engine::StepOutput],
    cpu: &[tokenrouter::engine::StepOutput],
    tolerance: f32,
    what: &str,
) {
    let scale = cpu
        .iter()
        .flat_map(|o| &o.logits)
        .fold(0f32, |m, x| m.max(x.abs()));
    for (g, c) in gpu.iter().zip(cpu) {
        let at = format!("{what} position {}", c.position);
        assert_eq!(g.position, c.position, "{at}");
        let diff = max_abs_diff(&g.logits, &c.logits);
        assert!(
            diff <= tolerance * scale,
            "{at}: logits differ by {diff} (largest logit {scale})"
        );
        if parity::top2_margin(&c.logits) > 2.0 * diff {
            assert_eq!(g.candidate, c.candidate, "{at}");
        }
    }
}

/// Decodes the tiny prompts on the CPU (`cpu`), feeds the GPU (`gpu`) the CPU's tokens and
/// checks it with `assert_follows`; the GPU's KV must be free afterwards.
fn assert_gpu_follows_cpu(cpu: &ModelConfig, gpu: &ModelConfig, tolerance: f32, what: &str) {
    let prompts = prompts_for_tiny_models();
    let (cpu_tokens, cpu_out) = decode(&mut Executor::load(cpu).unwrap(), &prompts, 10);
    let mut executor = on_gpu(gpu);
    let (_, gpu_out) = decode_fed(&mut executor, &prompts, 10, Some(&cpu_tokens));
    assert_follows(&gpu_out, &cpu_out, tolerance, what);
    assert_eq!(executor.kv_usage().used_tokens, 0, "{what}");
}

#[test]
fn tiny_models_decode_on_the_gpu_as_on_the_cpu() {
    if !gpu_or_skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let prompts = prompts_for_tiny_models();
    for arch in [Arch::Llama, Arch::Qwen2, Arch::Qwen3, Arch::Gemma3] {
        let path = common::write_gguf(
            &dir.path().join("m.gguf"),
            &TinySpec::new(arch),
            GgmlDType::F32,
        );
        let config = common::model_config("tiny", &path);
        let mut gpu = on_gpu(&config);
        let (gpu_tokens, gpu_out) = decode(&mut gpu, &prompts, 10);
        let (cpu_tokens, cpu_out) = decode(&mut Executor::load(&config).unwrap(), &prompts, 10);
        assert_eq!(gpu_tokens, cpu_tokens, "{arch:?}");
        for (g, c) in gpu_out.iter().zip(&cpu_out) {
            let what = format!("{arch:?} position {}", c.position);
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
        assert_eq!(gpu.kv_usage().used_tokens, 0, "{arch:?}");
    }
}

/// Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K run the integer-dot kernels on
/// 8-bit activations on both sides (K-quant blocks span 256 inputs, hence a wider model for
/// them).
#[test]
fn tiny_models_in_int8_formats_follow_the_cpu_on_the_gpu() {
    if !gpu_or_skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    for arch in [Arch::Llama, Arch::Qwen2, Arch::Qwen3, Arch::Gemma3] {
        for dtype in [
            GgmlDType::Q8_0,
            GgmlDType::Q4_0,
            GgmlDType::Q4_1,
            GgmlDType::Q5_0,
            GgmlDType::Q5_1,
        ] {
            let path = common::write_gguf(&dir.path().join("m.gguf"), &TinySpec::new(arch), dtype);
            let config = common::model_config("tiny", &path);
            let what = format!("{arch:?} {dtype:?}");
            let tolerance = common::INT8_ACTIVATION_TOLERANCE;
            assert_gpu_follows_cpu(&config, &config, tolerance, &what);
        }
    }
    for dtype in [GgmlDType::Q4K, GgmlDType::Q5K, GgmlDType::Q6K] {
        let path = common::write_gguf(&dir.path().join("m.gguf"), &TinySpec::wide(), dtype);
        let config = common::model_config("tiny", &path);
        let tolerance = common::WIDE_INT8_ACTIVATION_TOLERANCE;
        assert_gpu_follows_cpu(&config, &config, tolerance, &format!("{dtype:?}"));
    }
}

/// Formats without integer GPU kernels are dequantized at load and multiplied in f32 by
/// cuBLAS, so the CPU reference is the same model dequantized to f32 (`weights = "f32"`);
/// bf16 runs cuBLAS's bf16 GEMM on activations rounded to bf16, a coarser rounding than f32's
/// but finer than 8-bit activations'. K-quant blocks span 256 inputs, hence a wider model.
#[test]
fn tiny_models_in_dense_gpu_formats_follow_the_cpu() {
    if !gpu_or_skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let narrow = TinySpec::new(Arch::Llama);
    let wide = TinySpec::wide();
    let cases = [
        (GgmlDType::F16, &narrow, F32_TOLERANCE),
        (GgmlDType::BF16, &narrow, common::INT8_ACTIVATION_TOLERANCE),
        (GgmlDType::Q2K, &wide, F32_TOLERANCE),
        (GgmlDType::Q3K, &wide, F32_TOLERANCE),
    ];
    for (dtype, spec, tolerance) in cases {
        let path = common::write_gguf(&dir.path().join("m.gguf"), spec, dtype);
        let config = common::model_config("tiny", &path);
        let dense = ModelConfig {
            weights: WeightPrecision::F32,
            ..config.clone()
        };
        assert_gpu_follows_cpu(&dense, &config, tolerance, &format!("{dtype:?}"));
    }
}

/// Decode steps replayed as CUDA graphs (ragged batches of 1 to 64 rows, each padded to its
/// bucket) give exactly the eager steps' tokens; with integer kernels, whose rows never mix,
/// exactly their logits too. Prompts run eagerly in both.
#[test]
fn graph_replay_decodes_exactly_as_eager_steps() {
    if !gpu_or_skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    for (arch, dtype) in [
        (Arch::Llama, GgmlDType::Q4_1),
        (Arch::Gemma3, GgmlDType::Q8_0),
        (Arch::Qwen2, GgmlDType::F32),
    ] {
        let path = common::write_gguf(&dir.path().join("m.gguf"), &TinySpec::new(arch), dtype);
        let config = common::model_config("tiny", &path);
        let mut graphs = on_gpu(&config);
        let mut eager = on_gpu(&ModelConfig {
            cuda_graphs: false,
            ..config.clone()
        });
        for rows in [1usize, 3, 8, 13, 33, 64] {
            let prompts: Vec<Vec<u32>> = (0..rows)
                .map(|i| {
                    (0..1 + (i * 7) % 23)
                        .map(|j| 4 + ((j * 29 + i * 11) % 260) as u32)
                        .collect()
                })
                .collect();
            let what = format!("{arch:?} {dtype:?} {rows} rows");
            let (replayed, replayed_out) = decode(&mut graphs, &prompts, 6);
            let (launched, launched_out) = decode(&mut eager, &prompts, 6);
            assert_eq!(replayed, launched, "{what}");
            if dtype != GgmlDType::F32 {
                for (r, l) in replayed_out.iter().zip(&launched_out) {
                    assert_eq!(r.logits, l.logits, "{what}: position {}", l.position);
                    assert_eq!(r.hidden, l.hidden, "{what}: position {}", l.position);
                }
            }
            let bucket = tokenrouter::engine::step_inputs::decode_bucket(rows).unwrap();
            assert!(
                graphs.captured_graph_buckets().contains(&bucket),
                "{what}: no graph captured for {bucket} rows"
            );
            assert_eq!(graphs.kv_usage().used_tokens, 0, "{what}");
        }
        assert!(eager.captured_graph_buckets().is_empty(), "{arch:?}");
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
    // Dequantized to f32: with 8-bit activations, ulps upstream flip roundings and even this
    // project's two CPU kernels part at non-ties (see `common::INT8_ACTIVATION_TOLERANCE`).
    let config = ModelConfig {
        device: ModelDevice::Cuda(0),
        weights: WeightPrecision::F32,
        ..common::model_config("smollm2", &path)
    };
    let mut cpu = Executor::load(&config).unwrap();
    let report = parity::run(&mut cpu, &mut on_gpu(&config), &tokenizer, 64).unwrap();
    println!("{}", report.markdown());
    assert_eq!(report.prompts.len(), 3);
    assert!(report.passed, "{}", report.markdown());
}

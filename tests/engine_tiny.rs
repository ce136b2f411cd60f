//! Engine tests on tiny random-weight models written by the test itself.

mod common;
use common::work;

use candle_core::quantized::{gguf_file, GgmlDType};
use candle_core::{Device, Tensor};
use common::{Arch, TinySpec};
use tokenrouter::config::WeightPrecision;
use tokenrouter::engine::chat::{ChatMessage, ChatTemplate};
use tokenrouter::engine::tokenizer::ModelTokenizer;
use tokenrouter::engine::{Executor, Kernel, Needs, SamplingParams, SeqId, SeqWork, StepExecutor};
use tokenrouter::error::EngineError;

fn load(path: &std::path::Path) -> Executor {
    Executor::load(&common::model_config("tiny", path)).unwrap()
}

/// A tiny llama in Q8_0, written into `dir` and loaded.
fn tiny_llama(dir: &std::path::Path) -> Executor {
    let path = common::write_gguf(
        &dir.join("m.gguf"),
        &TinySpec::new(Arch::Llama),
        GgmlDType::Q8_0,
    );
    load(&path)
}

/// Logits at every position of `tokens`, fed one token per step.
fn logits_per_position(executor: &mut Executor, seq: u64, tokens: &[u32]) -> Vec<Vec<f32>> {
    let out = tokens
        .iter()
        .map(|&t| {
            executor
                .step(&[work(seq, vec![t])])
                .unwrap()
                .remove(0)
                .logits
        })
        .collect();
    executor.free(SeqId(seq));
    out
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 3 + (i * 31 + salt * 17) % 270)
        .collect()
}

/// candle-transformers' reference forward for the same GGUF file, one token at a time.
fn candle_reference_logits(path: &std::path::Path, arch: Arch, tokens: &[u32]) -> Vec<Vec<f32>> {
    use candle_transformers::models::{quantized_llama, quantized_qwen2, quantized_qwen3};
    let mut file = std::fs::File::open(path).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let dev = Device::Cpu;
    enum Model {
        Llama(quantized_llama::ModelWeights),
        Qwen2(quantized_qwen2::ModelWeights),
        Qwen3(quantized_qwen3::ModelWeights),
    }
    let mut model = match arch {
        Arch::Llama => Model::Llama(
            quantized_llama::ModelWeights::from_gguf(content, &mut file, &dev).unwrap(),
        ),
        Arch::Qwen2 => Model::Qwen2(
            quantized_qwen2::ModelWeights::from_gguf(content, &mut file, &dev).unwrap(),
        ),
        Arch::Qwen3 => Model::Qwen3(
            quantized_qwen3::ModelWeights::from_gguf(content, &mut file, &dev).unwrap(),
        ),
        Arch::Gemma3 => unreachable!("candle_gemma3_logits"),
    };
    tokens
        .iter()
        .enumerate()
        .map(|(pos, &t)| {
            let x = Tensor::new(&[[t]], &dev).unwrap();
            let logits = match &mut model {
                Model::Llama(m) => m.forward(&x, pos),
                Model::Qwen2(m) => m.forward(&x, pos),
                Model::Qwen3(m) => m.forward(&x, pos),
            }
            .unwrap();
            logits.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        })
        .collect()
}

#[test]
fn gguf_forward_matches_candle_transformers_for_every_family() {
    let dir = tempfile::tempdir().unwrap();
    for arch in [Arch::Llama, Arch::Qwen2, Arch::Qwen3] {
        let spec = TinySpec::new(arch);
        let path = common::write_gguf(
            &dir.path().join(format!("{arch:?}.gguf")),
            &spec,
            GgmlDType::F32,
        );
        let tokens = prompt(24, 1);
        let ours = logits_per_position(&mut load(&path), 1, &tokens);
        let reference = candle_reference_logits(&path, arch, &tokens);
        // Our KV cache holds f16 (candle's f32): keys and values round to 11 bits, which
        // moves these logits (|logit| up to ~7) by up to 5.3e-3; a wrong forward pass moves
        // them by tenths.
        for (pos, (a, b)) in ours.iter().zip(&reference).enumerate() {
            let diff = max_abs_diff(a, b);
            assert!(diff < 1e-2, "{arch:?} position {pos}: max |Δlogit| {diff}");
        }
    }
}

/// candle-transformers' `gemma3` (the transformers port, unquantized: its `quantized_gemma3`
/// gates with SiLU where Gemma uses GELU) over the tiny model's Hugging Face tensors, one token
/// at a time: its decode steps keep the last `sliding_window` positions in a rotating cache,
/// the window transformers and llama.cpp define (its prefill mask keeps one more, and its
/// prefill cannot append a multi-token value tensor on the CPU).
fn candle_gemma3_logits(spec: &TinySpec, tokens: &[u32]) -> Vec<Vec<f32>> {
    use candle_transformers::models::gemma3;
    let config: gemma3::Config = serde_json::from_value(serde_json::json!({
        "attention_bias": false,
        "head_dim": spec.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": spec.hidden,
        "intermediate_size": spec.ffn,
        "num_attention_heads": spec.heads,
        "num_hidden_layers": spec.layers,
        "num_key_value_heads": spec.kv_heads,
        "rms_norm_eps": 1e-5,
        "rope_theta": common::GEMMA_ROPE_THETA,
        "rope_local_base_freq": common::GEMMA_LOCAL_ROPE_THETA,
        "vocab_size": spec.vocab(),
        "final_logit_softcapping": null,
        "attn_logit_softcapping": null,
        "query_pre_attn_scalar": spec.head_dim,
        "sliding_window": common::GEMMA_WINDOW,
        "sliding_window_pattern": common::GEMMA_GLOBAL_EVERY,
        "max_position_embeddings": 512,
    }))
    .unwrap();
    let vb = candle_nn::VarBuilder::from_tensors(
        common::tiny_weights(spec),
        candle_core::DType::F32,
        &Device::Cpu,
    );
    let mut model = gemma3::Model::new(false, &config, vb).unwrap();
    tokens
        .iter()
        .enumerate()
        .map(|(pos, &t)| {
            let x = Tensor::new(&[[t]], &Device::Cpu).unwrap();
            let logits = model.forward(&x, pos).unwrap();
            logits.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        })
        .collect()
}

/// Gemma 3's departures (√hidden embedding scale, (1 + w) norms, post-norms, QK-norm, GeGLU,
/// sliding-window layers with their own rope base between global ones) against the
/// transformers port, past the window: a forward pass without any one of them misses by
/// tenths.
#[test]
fn gemma3_forward_matches_candle_transformers_past_the_sliding_window() {
    let dir = tempfile::tempdir().unwrap();
    let spec = TinySpec::new(Arch::Gemma3);
    let path = common::write_gguf(&dir.path().join("gemma3.gguf"), &spec, GgmlDType::F32);
    let tokens = prompt(24, 1);
    let ours = logits_per_position(&mut load(&path), 1, &tokens);
    let reference = candle_gemma3_logits(&spec, &tokens);
    for (pos, (a, b)) in ours.iter().zip(&reference).enumerate() {
        let diff = max_abs_diff(a, b);
        let largest = b.iter().fold(0f32, |m, x| m.max(x.abs()));
        // f16 KV (candle's f32) as above, on logits up to ~`largest`.
        assert!(
            diff < 1e-2 * largest.max(1.0),
            "position {pos}: max |Δlogit| {diff} (largest {largest})"
        );
    }
    // Prefill in one step takes the same window as token by token.
    let mut executor = load(&path);
    let whole = executor.step(&[work(2, tokens.clone())]).unwrap().remove(0);
    let diff = max_abs_diff(&whole.logits, ours.last().unwrap());
    assert!(diff < 1e-4, "prefill against decode: {diff}");
}

/// A KV budget shorter than the sequences it holds: positions a window behind cost only the
/// global layer, so two 80-position sequences decode in 48 positions of budget each, their
/// local layers' old blocks evicted and freed, to the tokens and logits of an ample budget.
#[test]
fn gemma3_decodes_past_its_kv_budget_as_local_blocks_are_evicted() {
    let dir = tempfile::tempdir().unwrap();
    let spec = TinySpec::new(Arch::Gemma3);
    let path = common::write_gguf(&dir.path().join("gemma3.gguf"), &spec, GgmlDType::Q8_0);
    let seqs = [(1, prompt(20, 4)), (2, prompt(19, 5))];
    let with_budget = |kv_tokens: usize| {
        let mut config = common::model_config("tiny", &path);
        config.kv_tokens = kv_tokens;
        let mut executor = Executor::load(&config).unwrap();
        let out = common::decode_together(&mut executor, &seqs, 60);
        assert_eq!(executor.kv().usage().used_tokens, 0);
        out
    };
    let tight = with_budget(96);
    let ample = with_budget(4096);
    assert_eq!(tight, ample);
    // Without the window's eviction 2 × 80 positions would not fit 96.
    assert!(seqs.iter().map(|s| s.1.len() + 60).sum::<usize>() > 96);
}

#[test]
fn safetensors_directory_matches_gguf_of_the_same_weights() {
    let dir = tempfile::tempdir().unwrap();
    for arch in [Arch::Llama, Arch::Qwen2, Arch::Qwen3] {
        let spec = TinySpec::new(arch);
        let gguf = common::write_gguf(
            &dir.path().join(format!("{arch:?}.gguf")),
            &spec,
            GgmlDType::F32,
        );
        let hf = common::write_hf_dir(&dir.path().join(format!("{arch:?}-hf")), &spec);
        let tokens = prompt(20, 2);
        let a = logits_per_position(&mut load(&gguf), 5, &tokens);
        let b = logits_per_position(&mut load(&hf), 5, &tokens);
        for (pos, (x, y)) in a.iter().zip(&b).enumerate() {
            let diff = max_abs_diff(x, y);
            assert!(diff < 1e-3, "{arch:?} position {pos}: max |Δlogit| {diff}");
        }
    }
}

#[test]
fn prefill_in_one_step_equals_token_by_token() {
    let dir = tempfile::tempdir().unwrap();
    let path = common::write_gguf(
        &dir.path().join("m.gguf"),
        &TinySpec::new(Arch::Qwen2),
        GgmlDType::F32,
    );
    let mut executor = load(&path);
    let tokens = prompt(17, 3);
    let stepwise = logits_per_position(&mut executor, 1, &tokens);
    let whole = executor.step(&[work(2, tokens.clone())]).unwrap().remove(0);
    assert_eq!(whole.position, tokens.len());
    let diff = max_abs_diff(&whole.logits, stepwise.last().unwrap());
    assert!(diff < 1e-4, "prefill vs stepwise: {diff}");
}

/// Greedy decoding of several ragged sequences, batched in one step each time.
fn decode_batched(executor: &mut Executor, prompts: &[Vec<u32>], steps: usize) -> Vec<Vec<u32>> {
    let mut outputs = vec![Vec::new(); prompts.len()];
    let mut inputs: Vec<Vec<u32>> = prompts.to_vec();
    for _ in 0..steps {
        let batch: Vec<SeqWork> = inputs
            .iter()
            .enumerate()
            .map(|(i, t)| work(100 + i as u64, t.clone()))
            .collect();
        for (i, out) in executor.step(&batch).unwrap().into_iter().enumerate() {
            outputs[i].push(out.candidate);
            inputs[i] = vec![out.candidate];
        }
    }
    for i in 0..prompts.len() {
        executor.free(SeqId(100 + i as u64));
    }
    outputs
}

#[test]
fn batched_equals_unbatched_token_for_token() {
    let dir = tempfile::tempdir().unwrap();
    for dtype in [GgmlDType::Q8_0, GgmlDType::Q4_1, GgmlDType::F32] {
        let path = common::write_gguf(
            &dir.path().join("m.gguf"),
            &TinySpec::new(Arch::Llama),
            dtype,
        );
        let mut executor = load(&path);
        let prompts: Vec<Vec<u32>> = (0..16).map(|i| prompt(3 + 5 * i, i as u32)).collect();
        let batched = decode_batched(&mut executor, &prompts, 12);
        for (i, p) in prompts.iter().enumerate() {
            let alone = decode_batched(&mut executor, std::slice::from_ref(p), 12);
            assert_eq!(batched[i], alone[0], "{dtype:?} sequence {i}");
        }
        assert_eq!(executor.kv_usage().used_tokens, 0);
    }
}

/// The premise of the GPU tests' int8 tolerances (`common::INT8_ACTIVATION_TOLERANCE`, and
/// `WIDE_INT8_ACTIVATION_TOLERANCE` for the K-quants' wider model): two kernels of this CPU,
/// exact in their integer dot products, differ only in f32 rounding, which an 8-bit
/// activation rounding can amplify, and stay within the tolerance.
#[test]
fn cpu_kernels_on_int8_models_differ_within_the_activation_rounding_tolerance() {
    let fastest = Kernel::detect();
    if fastest == Kernel::Portable {
        eprintln!("skipping: this CPU runs only the portable kernel");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let tokens = prompt(40, 5);
    let narrow = [Arch::Llama, Arch::Qwen2, Arch::Qwen3]
        .map(|arch| (TinySpec::new(arch), common::INT8_ACTIVATION_TOLERANCE));
    let narrow_formats = [
        GgmlDType::Q8_0,
        GgmlDType::Q4_0,
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q5_1,
    ];
    let cases = narrow
        .iter()
        .flat_map(|&(spec, tolerance)| narrow_formats.map(|dtype| (spec, dtype, tolerance)))
        .chain(
            [GgmlDType::Q4K, GgmlDType::Q5K, GgmlDType::Q6K].map(|dtype| {
                (
                    TinySpec::wide(),
                    dtype,
                    common::WIDE_INT8_ACTIVATION_TOLERANCE,
                )
            }),
        );
    for (spec, dtype, tolerance) in cases {
        let path = common::write_gguf(&dir.path().join("m.gguf"), &spec, dtype);
        let simd = logits_per_position(&mut load(&path), 1, &tokens);
        let mut portable = load(&path);
        portable.use_kernel(Kernel::Portable).unwrap();
        let portable = logits_per_position(&mut portable, 1, &tokens);
        let scale = simd.iter().flatten().fold(0f32, |m, x| m.max(x.abs()));
        for (position, (a, b)) in simd.iter().zip(&portable).enumerate() {
            let diff = max_abs_diff(a, b);
            assert!(
                diff <= tolerance * scale,
                "{:?} hidden {} {dtype:?} position {position}: {fastest:?} and portable differ \
                 by {diff} (largest logit {scale})",
                spec.arch,
                spec.hidden
            );
        }
    }
}

#[test]
fn thread_count_does_not_change_results() {
    let dir = tempfile::tempdir().unwrap();
    let path = common::write_gguf(
        &dir.path().join("m.gguf"),
        &TinySpec::new(Arch::Qwen3),
        GgmlDType::Q8_0,
    );
    let mut config = common::model_config("tiny", &path);
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| prompt(6 + i, i as u32)).collect();
    let one = decode_batched(&mut Executor::load(&config).unwrap(), &prompts, 8);
    config.threads = 2;
    let two = decode_batched(&mut Executor::load(&config).unwrap(), &prompts, 8);
    assert_eq!(one, two);
}

#[test]
fn kv_usage_returns_to_zero_and_exhaustion_is_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = common::write_gguf(
        &dir.path().join("m.gguf"),
        &TinySpec::new(Arch::Llama),
        GgmlDType::Q8_0,
    );
    let mut config = common::model_config("tiny", &path);
    config.kv_tokens = 64;
    let mut executor = Executor::load(&config).unwrap();
    executor
        .step(&[work(1, prompt(20, 0)), work(2, prompt(10, 1))])
        .unwrap();
    assert_eq!(executor.kv_usage().used_tokens, 48);
    assert_eq!(executor.seq_len(SeqId(1)), 20);
    let err = executor
        .step(&[work(1, prompt(5, 2)), work(3, prompt(30, 3))])
        .unwrap_err();
    assert!(matches!(err, EngineError::KvExhausted { .. }), "{err}");
    assert_eq!(
        executor.seq_len(SeqId(1)),
        20,
        "a failed step leaves sequences untouched"
    );
    assert!(
        executor.step(&[work(1, vec![9999])]).is_err(),
        "out-of-vocabulary token"
    );
    executor.free(SeqId(1));
    executor.free(SeqId(2));
    assert_eq!(executor.kv_usage().used_tokens, 0);
    assert_eq!(executor.kv_usage().sequences, 0);
}

#[test]
fn a_sequence_on_a_cached_prefix_computes_exactly_what_a_full_prefill_does() {
    let dir = tempfile::tempdir().unwrap();
    let mut executor = tiny_llama(dir.path());
    let long = prompt(45, 7);
    let full = executor.step(&[work(1, long.clone())]).unwrap().remove(0);
    executor.free(SeqId(1));
    // Two full blocks shared, 8 positions of the third copied, 5 computed.
    assert_eq!(executor.attach_prefix(SeqId(2), &long[..40]), 40);
    let cached = executor
        .step(&[work(2, long[40..].to_vec())])
        .unwrap()
        .remove(0);
    assert_eq!(cached.logits, full.logits);
    // A rollback into a shared full block (a rejected token) and a different token after it.
    assert_eq!(executor.attach_prefix(SeqId(3), &long[..40]), 40);
    assert_eq!(executor.truncate(SeqId(3), 30), 30);
    let mut other = long[..30].to_vec();
    other.extend([11, 12]);
    let rewritten = executor
        .step(&[work(3, other[30..].to_vec())])
        .unwrap()
        .remove(0);
    let fresh = executor.step(&[work(4, other.clone())]).unwrap().remove(0);
    assert_eq!(rewritten.logits, fresh.logits);
    // Sequence 2 still sees its own positions 30.. (the shared block was not written).
    let again = executor.step(&[work(2, vec![5])]).unwrap().remove(0);
    let mut extended = long.clone();
    extended.push(5);
    let reference = executor.step(&[work(5, extended)]).unwrap().remove(0);
    assert_eq!(again.logits, reference.logits);
    for seq in 2..=5 {
        executor.free(SeqId(seq));
    }
    assert_eq!(executor.kv_usage().used_tokens, 0);
    assert!(executor.kv_usage().cached_tokens > 0);
}

#[test]
fn seeded_sampling_is_reproducible_and_outputs_carry_requested_signals() {
    let dir = tempfile::tempdir().unwrap();
    let mut executor = tiny_llama(dir.path());
    let run = |executor: &mut Executor, seed: u64| -> Vec<u32> {
        let params = SamplingParams {
            temperature: 1.5,
            top_k: 0,
            top_p: 0.95,
            seed,
        };
        let mut input = prompt(5, 0);
        let mut out = Vec::new();
        for _ in 0..24 {
            let step = executor
                .step(&[SeqWork {
                    seq: SeqId(9),
                    tokens: input,
                    sampling: params,
                    needs: Needs::default(),
                    filter: None,
                }])
                .unwrap()
                .remove(0);
            out.push(step.candidate);
            input = vec![step.candidate];
        }
        executor.free(SeqId(9));
        out
    };
    let a = run(&mut executor, 7);
    assert_eq!(a, run(&mut executor, 7));
    assert_ne!(a, run(&mut executor, 8));

    let needs = Needs {
        hidden: true,
        top_k: 5,
        embedding: true,
    };
    let out = executor
        .step(&[SeqWork {
            seq: SeqId(1),
            tokens: prompt(4, 1),
            sampling: SamplingParams::greedy(),
            needs,
            filter: None,
        }])
        .unwrap()
        .remove(0);
    assert_eq!(out.hidden.as_ref().map(Vec::len), Some(64));
    assert_eq!(out.stats.top_k.len(), 5);
    let embedding = out.candidate_embedding.as_ref().unwrap();
    assert_eq!(embedding.len(), 64);

    assert_eq!(
        out.stats.top_k[0].0, out.candidate,
        "greedy candidate is the top logit"
    );
    assert!(out.stats.entropy > 0.0 && out.stats.max_prob > 0.0 && out.stats.max_prob <= 1.0);
}

#[test]
fn variants_select_layers_and_requantize() {
    let dir = tempfile::tempdir().unwrap();
    let path = common::write_gguf(
        &dir.path().join("m.gguf"),
        &TinySpec::new(Arch::Llama),
        GgmlDType::F32,
    );
    let mut config = common::model_config("tiny", &path);
    let full = logits_per_position(&mut Executor::load(&config).unwrap(), 1, &prompt(6, 0));
    config.layers = Some("0,2".into());
    let skip = Executor::load(&config).unwrap();
    assert_eq!(skip.layer_count(), 2);
    config.weights = WeightPrecision::Q8_0;
    config.layers = None;
    let q8 = logits_per_position(&mut Executor::load(&config).unwrap(), 1, &prompt(6, 0));
    let diff = max_abs_diff(full.last().unwrap(), q8.last().unwrap());
    assert!(
        diff > 0.0 && diff < 0.5,
        "Q8_0 requantization moves logits slightly: {diff}"
    );
    config.layers = Some("0-5".into());
    let err = Executor::load(&config).err().unwrap().to_string();
    assert!(err.contains("layer 3 does not exist"), "{err}");
}

#[test]
fn gguf_and_json_tokenizers_agree_and_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let spec = TinySpec::new(Arch::Llama);
    let gguf = ModelTokenizer::load(&common::write_gguf(
        &dir.path().join("m.gguf"),
        &spec,
        GgmlDType::Q8_0,
    ))
    .unwrap();
    let json = ModelTokenizer::load(&common::write_hf_dir(&dir.path().join("hf"), &spec)).unwrap();
    for text in [
        "the cat sat on the mat",
        "Grüße, 東京! 2026 años ☕",
        "<|im_start|>user\nhi<|im_end|>",
    ] {
        let a = gguf.encode(text).unwrap();
        assert_eq!(a, json.encode(text).unwrap(), "{text}");
        assert_eq!(gguf.decode(&a, false).unwrap(), text);
    }
    assert_eq!(
        gguf.encode("<|im_start|>").unwrap(),
        vec![1],
        "control tokens are special"
    );
    assert_eq!(
        gguf.encode("2026").unwrap().len(),
        4,
        "digits split individually"
    );
    assert!(gguf.eos.contains(&common::EOS_ID) && json.eos.contains(&common::EOS_ID));
    let chat = ChatTemplate::for_model(&gguf).unwrap();
    let text = chat.render(&[ChatMessage::user("hello")], true).unwrap();
    assert_eq!(
        text,
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn loading_errors_are_clear() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.gguf");
    let err = Executor::load(&common::model_config("m", &missing))
        .err()
        .unwrap();
    assert!(matches!(err, EngineError::MissingFile(_)), "{err}");

    let corrupt = dir.path().join("corrupt.gguf");
    std::fs::write(&corrupt, b"GGUF\x03\x00\x00\x00garbage").unwrap();
    let err = Executor::load(&common::model_config("m", &corrupt))
        .err()
        .unwrap();
    assert!(matches!(err, EngineError::InvalidModel { .. }), "{err}");

    let good = common::write_gguf(
        &dir.path().join("good.gguf"),
        &TinySpec::new(Arch::Llama),
        GgmlDType::Q8_0,
    );
    let bytes = std::fs::read(&good).unwrap();
    let truncated = dir.path().join("truncated.gguf");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    let err = Executor::load(&common::model_config("m", &truncated))
        .err()
        .unwrap();
    assert!(matches!(err, EngineError::InvalidModel { .. }), "{err}");

    let hf = common::write_hf_dir(&dir.path().join("hf"), &TinySpec::new(Arch::Llama));
    let config = std::fs::read_to_string(hf.join("config.json")).unwrap();
    std::fs::write(
        hf.join("config.json"),
        config.replace("\"llama\"", "\"mamba\""),
    )
    .unwrap();
    let err = Executor::load(&common::model_config("m", &hf))
        .err()
        .unwrap();
    assert!(
        matches!(err, EngineError::UnsupportedArchitecture(ref a) if a == "mamba"),
        "{err}"
    );
}

#[cfg(not(feature = "cuda"))]
#[test]
fn a_cuda_device_without_the_cuda_feature_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = common::write_gguf(
        &dir.path().join("m.gguf"),
        &TinySpec::new(Arch::Llama),
        GgmlDType::Q8_0,
    );
    let config = tokenrouter::config::ModelConfig {
        device: tokenrouter::config::ModelDevice::Cuda(0),
        ..common::model_config("tiny", &path)
    };
    let err = tokenrouter::engine::load_executor(&config)
        .err()
        .expect("a CPU-only build cannot load onto a GPU")
        .to_string();
    assert!(
        err.contains("`tiny`") && err.contains("cuda:0") && err.contains("--features cuda"),
        "{err}"
    );
}

/// A model entry's `chat_template` replaces the template the model ships: the shipped
/// completion prompt for pretrained models renders a conversation as questions and answers.
#[test]
fn a_configured_chat_template_replaces_the_models_own() {
    let dir = tempfile::tempdir().unwrap();
    let path = common::write_gguf(
        &dir.path().join("m.gguf"),
        &TinySpec::new(Arch::Llama),
        GgmlDType::F32,
    );
    let mut config = common::model_config("tiny", &path);
    let own = ModelTokenizer::load_for(&config).unwrap();
    assert_eq!(own.chat_template.as_deref(), Some(common::CHAT_TEMPLATE));
    config.chat_template = Some(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/templates/completion.jinja"),
    );
    let tokenizer = ModelTokenizer::load_for(&config).unwrap();
    let messages = [
        ChatMessage {
            role: "system".into(),
            content: "Answer in one word.".into(),
        },
        ChatMessage::user("What is the capital of Japan? "),
        ChatMessage {
            role: "assistant".into(),
            content: "Tokyo".into(),
        },
        ChatMessage::user("And of France?"),
    ];
    let rendered = ChatTemplate::for_model(&tokenizer)
        .unwrap()
        .render(&messages, true)
        .unwrap();
    assert_eq!(
        rendered,
        "Answer in one word.\n\nQuestion: What is the capital of Japan?\nAnswer: Tokyo\n\n\
         Question: And of France?\nAnswer:"
    );
    config.chat_template = Some(dir.path().join("missing.jinja"));
    assert!(matches!(
        ModelTokenizer::load_for(&config),
        Err(EngineError::MissingFile(p)) if p.ends_with("missing.jinja")
    ));
}

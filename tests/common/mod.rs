//! Tiny random-weight models written by the tests themselves (GGUF and Hugging Face
//! directories), so the real loading code runs on every machine without downloads.
#![allow(dead_code)]

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub mod cluster;
pub mod server;

use tokenrouter::engine::{Needs, SamplingParams, SeqId, SeqWork, StepExecutor};

/// One sequence's greedy share of a step.
pub fn work(seq: u64, tokens: Vec<u32>) -> SeqWork {
    SeqWork {
        seq: SeqId(seq),
        tokens,
        sampling: SamplingParams::greedy(),
        needs: Needs::default(),
        filter: None,
    }
}

/// Greedy decoding of `seqs` (id, prompt) stepped together for `steps` steps: per sequence,
/// each step's candidate and its logit. The sequences are freed after.
pub fn decode_together(
    executor: &mut impl StepExecutor,
    seqs: &[(u64, Vec<u32>)],
    steps: usize,
) -> Vec<Vec<(u32, f32)>> {
    let mut inputs: Vec<Vec<u32>> = seqs.iter().map(|s| s.1.clone()).collect();
    let mut outputs = vec![Vec::new(); seqs.len()];
    for _ in 0..steps {
        let batch: Vec<SeqWork> = seqs
            .iter()
            .zip(&inputs)
            .map(|(s, t)| work(s.0, t.clone()))
            .collect();
        for (i, out) in executor.step(&batch).unwrap().into_iter().enumerate() {
            outputs[i].push((out.candidate, out.logits[out.candidate as usize]));
            inputs[i] = vec![out.candidate];
        }
    }
    for s in seqs {
        executor.free(SeqId(s.0));
    }
    outputs
}
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, Tokenizer};

pub const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
pub const EOS_ID: u32 = 2;
pub const CHAT_TEMPLATE: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// Merges of a tiny byte-level BPE (GPT-2 alphabet, `Ġ` = space).
const MERGES: &[(&str, &str)] = &[
    ("Ġ", "t"),
    ("h", "e"),
    ("Ġt", "he"),
    ("i", "n"),
    ("Ġ", "a"),
    ("e", "r"),
    ("o", "n"),
    ("Ġ", "s"),
    ("r", "e"),
    ("a", "t"),
    ("e", "n"),
    ("Ġ", "w"),
    ("o", "r"),
    ("Ġ", "c"),
    ("in", "g"),
    ("Ġ", "o"),
    ("Ġ", "b"),
    ("Ġ", "m"),
    ("l", "l"),
    ("Ġ", "p"),
];

/// The tiny vocabulary: special tokens, the 256 byte symbols, then one token per merge.
pub fn tiny_vocab() -> (Vec<String>, Vec<(String, String)>) {
    let mut tokens: Vec<String> = SPECIAL_TOKENS.iter().map(|s| s.to_string()).collect();
    let mut alphabet: Vec<char> = ByteLevel::alphabet().into_iter().collect();
    alphabet.sort();
    tokens.extend(alphabet.iter().map(|c| c.to_string()));
    let merges: Vec<(String, String)> = MERGES
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    tokens.extend(merges.iter().map(|(a, b)| format!("{a}{b}")));
    (tokens, merges)
}

/// The same tokenizer as a `tokenizers::Tokenizer` (written as `tokenizer.json`).
pub fn tiny_tokenizer() -> Tokenizer {
    let (tokens, merges) = tiny_vocab();
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .unwrap();
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(Sequence::new(vec![
        Digits::new(true).into(),
        ByteLevel::new(false, true, true).into(),
    ])));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
    let specials: Vec<AddedToken> = SPECIAL_TOKENS
        .iter()
        .map(|s| AddedToken::from(s.to_string(), true))
        .collect();
    tokenizer.add_special_tokens(specials).unwrap();
    tokenizer
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Qwen3,
    Gemma3,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Gemma3 => "gemma3",
        }
    }
}

/// Tiny Gemma 3's local attention window and layer pattern (layers 1, 3, … global): a
/// 24-token prompt runs past the window on every other layer.
pub const GEMMA_WINDOW: usize = 5;
pub const GEMMA_GLOBAL_EVERY: usize = 2;
pub const GEMMA_ROPE_THETA: f32 = 1_000_000.0;
pub const GEMMA_LOCAL_ROPE_THETA: f32 = 10_000.0;

/// Largest logit difference, relative to the largest logit, between two correct executors
/// of a tiny model (`TinySpec::new`) whose matmuls round activations to 8 bits (Q8_0, Q4_0,
/// Q4_1, Q5_0, Q5_1): an ulp of difference upstream can flip a rounding, so they part by more
/// than f32 rounding. This project's own CPU kernels (portable against SIMD) differ by up to
/// ~1.8 % on these models; a GPU may differ by 3 %.
pub const INT8_ACTIVATION_TOLERANCE: f32 = 0.03;

/// `INT8_ACTIVATION_TOLERANCE` for `TinySpec::wide`, which amplifies a flipped rounding more
/// (random weights, logits up to ~20): the CPU's two kernels differ by up to 5.3 % there
/// (Q6_K; Q4_K 4.2 %, Q4_1 4.1 %), and a GPU, which rounds in yet another order, may differ
/// by 8 %. A wrong kernel moves these logits by tens of percent.
pub const WIDE_INT8_ACTIVATION_TOLERANCE: f32 = 0.08;

#[derive(Debug, Clone, Copy)]
pub struct TinySpec {
    pub arch: Arch,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub layers: usize,
    pub tied: bool,
    pub seed: u64,
}

impl TinySpec {
    pub fn new(arch: Arch) -> Self {
        Self {
            arch,
            hidden: 64,
            heads: 4,
            kv_heads: 2,
            // Qwen3 and Gemma 3 checkpoints decouple head_dim from hidden / heads; exercise that.
            head_dim: if matches!(arch, Arch::Qwen3 | Arch::Gemma3) {
                32
            } else {
                16
            },
            ffn: 128,
            layers: 3,
            tied: arch != Arch::Qwen2,
            seed: 17,
        }
    }

    /// A llama whose widths K-quant superblocks (256 inputs) divide.
    pub fn wide() -> Self {
        Self {
            hidden: 256,
            head_dim: 64,
            ffn: 512,
            ..Self::new(Arch::Llama)
        }
    }

    pub fn vocab(&self) -> usize {
        tiny_vocab().0.len()
    }
}

struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
    }
    fn tensor(&mut self, shape: &[usize], scale: f32, offset: f32) -> Tensor {
        let n: usize = shape.iter().product();
        let data: Vec<f32> = (0..n).map(|_| offset + scale * self.next()).collect();
        Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
    }
}

/// Random weights under their Hugging Face names.
pub fn tiny_weights(spec: &TinySpec) -> HashMap<String, Tensor> {
    let mut rng = Lcg(spec.seed);
    let mut w = HashMap::new();
    let (h, q_dim, kv_dim) = (
        spec.hidden,
        spec.heads * spec.head_dim,
        spec.kv_heads * spec.head_dim,
    );
    w.insert(
        "model.embed_tokens.weight".into(),
        rng.tensor(&[spec.vocab(), h], 0.5, 0.0),
    );
    w.insert("model.norm.weight".into(), rng.tensor(&[h], 0.1, 1.0));
    if !spec.tied {
        w.insert(
            "lm_head.weight".into(),
            rng.tensor(&[spec.vocab(), h], 0.3, 0.0),
        );
    }
    for l in 0..spec.layers {
        let p = format!("model.layers.{l}");
        let mut put = |name: &str, t: Tensor| {
            w.insert(format!("{p}.{name}"), t);
        };
        put("input_layernorm.weight", rng.tensor(&[h], 0.1, 1.0));
        put(
            "post_attention_layernorm.weight",
            rng.tensor(&[h], 0.1, 1.0),
        );
        put(
            "self_attn.q_proj.weight",
            rng.tensor(&[q_dim, h], 0.25, 0.0),
        );
        put(
            "self_attn.k_proj.weight",
            rng.tensor(&[kv_dim, h], 0.25, 0.0),
        );
        put(
            "self_attn.v_proj.weight",
            rng.tensor(&[kv_dim, h], 0.25, 0.0),
        );
        put(
            "self_attn.o_proj.weight",
            rng.tensor(&[h, q_dim], 0.15, 0.0),
        );
        put("mlp.gate_proj.weight", rng.tensor(&[spec.ffn, h], 0.2, 0.0));
        put("mlp.up_proj.weight", rng.tensor(&[spec.ffn, h], 0.2, 0.0));
        put(
            "mlp.down_proj.weight",
            rng.tensor(&[h, spec.ffn], 0.15, 0.0),
        );
        if spec.arch == Arch::Qwen2 {
            put("self_attn.q_proj.bias", rng.tensor(&[q_dim], 0.1, 0.0));
            put("self_attn.k_proj.bias", rng.tensor(&[kv_dim], 0.1, 0.0));
            put("self_attn.v_proj.bias", rng.tensor(&[kv_dim], 0.1, 0.0));
        }
        if spec.arch == Arch::Gemma3 {
            put(
                "pre_feedforward_layernorm.weight",
                rng.tensor(&[h], 0.1, 0.0),
            );
            put(
                "post_feedforward_layernorm.weight",
                rng.tensor(&[h], 0.1, 0.0),
            );
        }
        if matches!(spec.arch, Arch::Qwen3 | Arch::Gemma3) {
            put(
                "self_attn.q_norm.weight",
                rng.tensor(&[spec.head_dim], 0.1, 1.0),
            );
            put(
                "self_attn.k_norm.weight",
                rng.tensor(&[spec.head_dim], 0.1, 1.0),
            );
        }
    }
    w
}

/// Writes `config.json`, `model.safetensors`, `tokenizer.json` and `tokenizer_config.json`.
pub fn write_hf_dir(dir: &Path, spec: &TinySpec) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let config = serde_json::json!({
        "model_type": spec.arch.name(),
        "hidden_size": spec.hidden,
        "intermediate_size": spec.ffn,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab(),
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": spec.tied,
        "eos_token_id": EOS_ID,
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    candle_core::safetensors::save(&tiny_weights(spec), dir.join("model.safetensors")).unwrap();
    tiny_tokenizer()
        .save(dir.join("tokenizer.json"), false)
        .unwrap();
    let tok_config = serde_json::json!({
        "eos_token": "<|im_end|>",
        "bos_token": null,
        "chat_template": CHAT_TEMPLATE,
    });
    std::fs::write(dir.join("tokenizer_config.json"), tok_config.to_string()).unwrap();
    dir.to_path_buf()
}

/// llama.cpp's conversion permutes llama q/k rows so that rope rotates adjacent pairs.
fn permute_for_gguf(t: &Tensor, heads: usize) -> Tensor {
    swap_head_row_axes(t, heads, 2)
}

/// The inverse of `permute_for_gguf`.
fn unpermute_from_gguf(t: &Tensor, heads: usize) -> Tensor {
    let head_dim = t.dims2().unwrap().0 / heads;
    swap_head_row_axes(t, heads, head_dim / 2)
}

/// Each head's rows seen as `[outer, head_dim / outer]`, transposed.
fn swap_head_row_axes(t: &Tensor, heads: usize, outer: usize) -> Tensor {
    let (rows, cols) = t.dims2().unwrap();
    let head_dim = rows / heads;
    t.reshape((heads, outer, head_dim / outer, cols))
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .contiguous()
        .unwrap()
        .reshape((rows, cols))
        .unwrap()
}

fn gguf_name(hf: &str, arch: Arch) -> String {
    match hf {
        "model.embed_tokens.weight" => return "token_embd.weight".into(),
        "model.norm.weight" => return "output_norm.weight".into(),
        "lm_head.weight" => return "output.weight".into(),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.").unwrap();
    let (layer, name) = rest.split_once('.').unwrap();
    let (base, suffix) = name.rsplit_once('.').unwrap();
    let base = match base {
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" if arch == Arch::Gemma3 => "post_attention_norm",
        "post_attention_layernorm" => "ffn_norm",
        "pre_feedforward_layernorm" => "ffn_norm",
        "post_feedforward_layernorm" => "post_ffw_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        other => panic!("unmapped tensor {other}"),
    };
    format!("blk.{layer}.{base}.{suffix}")
}

/// Writes the same random model as a GGUF file with its tokenizer embedded; matrices are
/// stored as `dtype`, vectors as F32.
pub fn write_gguf(path: &Path, spec: &TinySpec, dtype: GgmlDType) -> PathBuf {
    let arch = spec.arch.name();
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut weights: Vec<(String, Tensor)> = tiny_weights(spec).into_iter().collect();
    weights.sort_by(|a, b| a.0.cmp(&b.0));
    for (hf, t) in weights {
        let mut t = t;
        if spec.arch == Arch::Llama && hf.ends_with("q_proj.weight") {
            t = permute_for_gguf(&t, spec.heads);
        }
        if spec.arch == Arch::Llama && hf.ends_with("k_proj.weight") {
            t = permute_for_gguf(&t, spec.kv_heads);
        }
        // Gemma's norms scale by (1 + w); llama.cpp's conversion stores 1 + w.
        if spec.arch == Arch::Gemma3 && hf.ends_with("norm.weight") {
            t = (t + 1.0).unwrap();
        }
        let q = if t.rank() == 2 { dtype } else { GgmlDType::F32 };
        tensors.push((gguf_name(&hf, spec.arch), QTensor::quantize(&t, q).unwrap()));
    }
    let (tokens, merges) = tiny_vocab();
    let types: Vec<Value> = (0..tokens.len())
        .map(|i| Value::I32(if i < SPECIAL_TOKENS.len() { 3 } else { 1 }))
        .collect();
    let u32v = |v: usize| Value::U32(v as u32);
    let rope_theta = if spec.arch == Arch::Gemma3 {
        GEMMA_ROPE_THETA
    } else {
        10000.0
    };
    let mut metadata: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        // candle-transformers' qwen3 reference computes in F16 unless told F32 (0).
        ("general.dtype".into(), Value::U32(0)),
        (format!("{arch}.block_count"), u32v(spec.layers)),
        (format!("{arch}.embedding_length"), u32v(spec.hidden)),
        (format!("{arch}.feed_forward_length"), u32v(spec.ffn)),
        (format!("{arch}.attention.head_count"), u32v(spec.heads)),
        (
            format!("{arch}.attention.head_count_kv"),
            u32v(spec.kv_heads),
        ),
        (format!("{arch}.attention.key_length"), u32v(spec.head_dim)),
        (
            format!("{arch}.attention.value_length"),
            u32v(spec.head_dim),
        ),
        (format!("{arch}.rope.dimension_count"), u32v(spec.head_dim)),
        (
            format!("{arch}.attention.layer_norm_rms_epsilon"),
            Value::F32(1e-5),
        ),
        (format!("{arch}.rope.freq_base"), Value::F32(rope_theta)),
        (format!("{arch}.context_length"), u32v(512)),
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("smollm".into())),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(tokens.into_iter().map(Value::String).collect()),
        ),
        (
            "tokenizer.ggml.merges".into(),
            Value::Array(
                merges
                    .into_iter()
                    .map(|(a, b)| Value::String(format!("{a} {b}")))
                    .collect(),
            ),
        ),
        ("tokenizer.ggml.token_type".into(), Value::Array(types)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(EOS_ID)),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(1)),
        (
            "tokenizer.chat_template".into(),
            Value::String(CHAT_TEMPLATE.into()),
        ),
    ];
    if spec.arch == Arch::Gemma3 {
        metadata.extend([
            (
                format!("{arch}.attention.sliding_window"),
                u32v(GEMMA_WINDOW),
            ),
            (
                format!("{arch}.attention.sliding_window_pattern"),
                u32v(GEMMA_GLOBAL_EVERY),
            ),
            (
                format!("{arch}.rope.freq_base_swa"),
                Value::F32(GEMMA_LOCAL_ROPE_THETA),
            ),
        ]);
    }
    let md: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut file = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut file, &md, &ts).unwrap();
    path.to_path_buf()
}

/// A copy of the GGUF file `from` at `to` with every matrix whose rows `dtype`'s blocks divide
/// requantized to `dtype` (the rest, and the vectors, as stored).
pub fn requantized_gguf(from: &Path, to: &Path, dtype: GgmlDType) -> PathBuf {
    let mut file = std::fs::File::open(from).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let tensors: Vec<(&str, QTensor)> = names
        .into_iter()
        .map(|name| {
            let stored = content.tensor(&mut file, name, &Device::Cpu).unwrap();
            let dims = stored.shape().dims().to_vec();
            let tensor = if dims.len() == 2 && dims[1].is_multiple_of(dtype.block_size()) {
                QTensor::quantize(&stored.dequantize(&Device::Cpu).unwrap(), dtype).unwrap()
            } else {
                stored
            };
            (name.as_str(), tensor)
        })
        .collect();
    let md: Vec<(&str, &Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (*k, v)).collect();
    let mut out = std::fs::File::create(to).unwrap();
    gguf_file::write(&mut out, &md, &ts).unwrap();
    to.to_path_buf()
}

/// A model entry for a tiny checkpoint.
pub fn model_config(name: &str, path: &Path) -> tokenrouter::config::ModelConfig {
    tokenrouter::config::ModelConfig {
        name: name.into(),
        path: path.to_path_buf(),
        latency_profile_ms: None,
        latency_context_cost: None,
        threads: 1,
        device: Default::default(),
        cuda_graphs: true,
        stream_priority: Default::default(),
        kv_tokens: 4096,
        weights: tokenrouter::config::WeightPrecision::Stored,
        layers: None,
        batch_threshold: 1,
        fault_every_steps: 0,
        step_profile: None,
        step_token_budget: None,
        chat_template: None,
        placement: Default::default(),
    }
}

/// Path of the real SmolLM2 GGUF, or `None` (with a message) when it has not been fetched.
/// With `TOKENROUTER_REQUIRE_MODEL=1` (set by CI) a missing model is a failure instead.
pub fn real_model() -> Option<PathBuf> {
    fetched_model("SmolLM2-135M-Instruct.Q4_1.gguf", "scripts/fetch-model.sh")
}

/// Path of the real Gemma 3 270M GGUF, as `real_model`.
pub fn real_gemma3() -> Option<PathBuf> {
    fetched_model("gemma-3-270m-q4_k_m.gguf", "scripts/fetch-gemma3.sh")
}

fn fetched_model(file: &str, script: &str) -> Option<PathBuf> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("models")
        .join(file);
    if path.exists() {
        return Some(path);
    }
    if std::env::var("TOKENROUTER_REQUIRE_MODEL").is_ok_and(|v| v == "1") {
        panic!("{} is missing; run {script}", path.display());
    }
    eprintln!("skipping: {} not fetched ({script})", path.display());
    None
}

/// Random router weights under the names `policy::learned` documents, written to `path`.
pub fn write_router(path: &Path, kind: &str, hidden: usize, seed: u64) -> HashMap<String, Tensor> {
    let mut rng = Lcg(seed);
    let mut w: HashMap<String, Tensor> = HashMap::new();
    let mut linear = |w: &mut HashMap<String, Tensor>, name: &str, n_out: usize, n_in: usize| {
        let scale = 1.0 / (n_in as f32).sqrt();
        w.insert(
            format!("{name}.weight"),
            rng.tensor(&[n_out, n_in], scale, 0.0),
        );
        w.insert(format!("{name}.bias"), rng.tensor(&[n_out], 0.1, 0.0));
    };
    match kind {
        "r2r" => {
            let width = 32;
            linear(&mut w, "topk_proj", hidden, 100);
            linear(&mut w, "input_proj", width, 3 * hidden);
            linear(&mut w, "backbone_proj", width, width);
            for i in 0..2 {
                linear(&mut w, &format!("blocks.{i}.norm"), width, 1);
                w.insert(
                    format!("blocks.{i}.norm.weight"),
                    Lcg(seed + i).tensor(&[width], 0.1, 1.0),
                );
                linear(&mut w, &format!("blocks.{i}.fc1"), 4 * width, width);
                linear(&mut w, &format!("blocks.{i}.fc2"), width, 4 * width);
            }
            linear(&mut w, "final_norm", width, 1);
            w.insert(
                "final_norm.weight".into(),
                Lcg(seed + 9).tensor(&[width], 0.1, 1.0),
            );
            linear(&mut w, "head", 1, width);
        }
        "citer" => {
            linear(&mut w, "fc1", 2 * hidden, hidden);
            let mut bn = Lcg(seed + 3);
            w.insert("bn.weight".into(), bn.tensor(&[2 * hidden], 0.2, 1.0));
            w.insert("bn.bias".into(), bn.tensor(&[2 * hidden], 0.1, 0.0));
            w.insert("bn.running_mean".into(), bn.tensor(&[2 * hidden], 0.1, 0.0));
            w.insert("bn.running_var".into(), bn.tensor(&[2 * hidden], 0.3, 1.0));
            linear(&mut w, "fc2", hidden, 2 * hidden);
            linear(&mut w, "head", 1, hidden);
        }
        "colm" => linear(&mut w, "defer", 1, hidden),
        other => panic!("unknown router kind {other}"),
    }
    // Norm layers got a throwaway [n, 1] weight from `linear`; keep only 1-D norm tensors.
    w.retain(|name, t| !(name.contains("norm") && t.rank() == 2));
    candle_core::safetensors::save(&w, path).unwrap();
    w
}

/// Writes a llama GGUF file as a Hugging Face directory (`config.json` + `model.safetensors`):
/// f32/f16/bf16 tensors keep their type and values, others are dequantized to f32, and q/k
/// rows are put back in the transformers order (the loader's rope then rotates halves).
pub fn hf_copy_of_gguf(gguf: &Path, dir: &Path) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let mut file = std::fs::File::open(gguf).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let int = |key: &str| content.metadata[&format!("llama.{key}")].to_u32().unwrap() as usize;
    let float = |key: &str| content.metadata[&format!("llama.{key}")].to_f32().unwrap();
    let (heads, kv_heads) = (int("attention.head_count"), int("attention.head_count_kv"));
    let layers = int("block_count");
    let vocab = content.tensor_infos["token_embd.weight"].shape.dims()[0];
    let config = serde_json::json!({
        "model_type": "llama",
        "hidden_size": int("embedding_length"),
        "intermediate_size": int("feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "rms_norm_eps": float("attention.layer_norm_rms_epsilon"),
        "rope_theta": float("rope.freq_base"),
        "max_position_embeddings": int("context_length"),
        "tie_word_embeddings": !content.tensor_infos.contains_key("output.weight"),
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let mut names = vec![
        "model.embed_tokens.weight".to_string(),
        "model.norm.weight".into(),
    ];
    for l in 0..layers {
        for t in [
            "input_layernorm",
            "post_attention_layernorm",
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ] {
            names.push(format!("model.layers.{l}.{t}.weight"));
        }
    }
    let mut tensors = HashMap::new();
    for hf in names {
        let stored = content
            .tensor(&mut file, &gguf_name(&hf, Arch::Llama), &Device::Cpu)
            .unwrap();
        let dtype = match stored.dtype() {
            GgmlDType::F16 => candle_core::DType::F16,
            GgmlDType::BF16 => candle_core::DType::BF16,
            _ => candle_core::DType::F32,
        };
        let mut t = stored.dequantize(&Device::Cpu).unwrap();
        for (proj, n) in [("q_proj", heads), ("k_proj", kv_heads)] {
            if hf.ends_with(&format!("{proj}.weight")) {
                t = unpermute_from_gguf(&t, n);
            }
        }
        tensors.insert(hf, t.to_dtype(dtype).unwrap());
    }
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();
    dir.to_path_buf()
}

/// A greedy request (sampling seed `seed`) for the runtime's API.
pub fn greedy_request(
    prompt: &[u32],
    policy: &str,
    max_tokens: usize,
    seed: u64,
) -> tokenrouter::runtime::GenerateRequest {
    tokenrouter::runtime::GenerateRequest {
        prompt: prompt.to_vec().into(),
        policy: Some(policy.into()),
        max_tokens,
        sampling: tokenrouter::engine::SamplingParams {
            seed,
            ..tokenrouter::engine::SamplingParams::greedy()
        },
        timeout: None,
        ignore_eos: false,
    }
}

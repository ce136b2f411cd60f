//! Loading checkpoints: GGUF (quantized tensors stay quantized) and Hugging Face directories
//! (`config.json` + `*.safetensors`). Both are read through one `TensorStore` keyed by the
//! GGUF tensor names, so the model code sees a single layout.

use super::qmatmul::QWeight;
use crate::config::{ModelConfig, WeightPrecision};
use crate::error::{EngineError, EngineResult};
use candle_core::quantized::{gguf_file, GgmlDType, QStorage, QTensor};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device};
use indicatif::{ProgressBar, ProgressStyle};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Qwen2,
    Qwen3,
    Gemma3,
}

impl Architecture {
    pub fn parse(name: &str) -> EngineResult<Self> {
        match name {
            "llama" | "LlamaForCausalLM" => Ok(Self::Llama),
            "qwen2" | "Qwen2ForCausalLM" => Ok(Self::Qwen2),
            "qwen3" | "Qwen3ForCausalLM" => Ok(Self::Qwen3),
            "gemma3" => Ok(Self::Gemma3),
            other => Err(EngineError::UnsupportedArchitecture(other.to_string())),
        }
    }
}

/// Shape and numerics of a decoder-only transformer, read from the checkpoint.
#[derive(Debug, Clone)]
pub struct Hyperparams {
    pub arch: Architecture,
    pub hidden: usize,
    pub intermediate: usize,
    /// Decoder layers in the checkpoint (a variant may run fewer).
    pub checkpoint_layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
    /// GGUF llama checkpoints store q/k permuted for rotation of adjacent pairs; every other
    /// layout rotates the two halves of a head (`rotate_half`).
    pub rope_interleaved: bool,
    pub context: usize,
    /// Gemma 3's departures from the llama layout; `None` for the llama family.
    pub gemma: Option<GemmaParams>,
}

/// What Gemma 3 adds to a llama-style decoder: local layers that attend over a sliding
/// window with their own rope base, global layers between them, and tanh-GELU gating.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GemmaParams {
    /// Positions a local layer attends over, its own included (llama.cpp's and transformers'
    /// reading: position p sees p − window + 1 ..= p).
    pub sliding_window: usize,
    /// Every `global_every`-th layer (checkpoint index i with (i + 1) % global_every == 0)
    /// attends over the whole context.
    pub global_every: usize,
    /// The local layers' rope base (`rope_theta` is the global layers').
    pub local_rope_theta: f32,
}

impl GemmaParams {
    /// Gemma 3's pattern and local rope base where a GGUF file omits them, as llama.cpp
    /// assumes for `gemma3` (llama-model.cpp: `set_swa_pattern(6)`, `rope_freq_base_train_swa
    /// = 10000`): files converted by llama.cpp carry neither key.
    const DEFAULT_GLOBAL_EVERY: usize = 6;
    const DEFAULT_LOCAL_ROPE_THETA: f32 = 10_000.0;

    /// The window checkpoint layer `index` attends over; `None` for a global layer.
    pub fn window_of(&self, index: usize) -> Option<usize> {
        (!(index + 1).is_multiple_of(self.global_every)).then_some(self.sliding_window)
    }
}

pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub wq: QWeight,
    pub wk: QWeight,
    pub wv: QWeight,
    pub wo: QWeight,
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
    /// Qwen3's and Gemma 3's per-head RMS norms of q and k.
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    /// Gemma 3's norms of the attention's and the MLP's outputs before their residual adds.
    pub post_attn_norm: Option<Vec<f32>>,
    pub post_ffn_norm: Option<Vec<f32>>,
    /// Positions this layer attends over (Gemma 3's local layers); `None`: all.
    pub window: Option<usize>,
    pub ffn_norm: Vec<f32>,
    pub w_gate: QWeight,
    pub w_up: QWeight,
    pub w_down: QWeight,
}

pub struct ModelWeights {
    pub hp: Hyperparams,
    /// Row-major `[vocab, hidden]`, dequantized once: lookups are row copies.
    pub embedding: Vec<f32>,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Vec<f32>,
    pub lm_head: QWeight,
    /// Per-frequency divisors (Llama 3.1 rope scaling); `None` for plain rope.
    pub rope_freq_divisors: Option<Vec<f32>>,
}

impl ModelWeights {
    /// Bytes of every matrix a decode step reads: each layer's and the output head (the
    /// embedding is only looked up, a row per token).
    pub fn matrix_bytes(&self) -> u64 {
        let layers: usize = self
            .layers
            .iter()
            .flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down])
            .map(|w| w.stored_bytes())
            .sum();
        (layers + self.lm_head.stored_bytes()) as u64
    }
}

/// What a model entry points at, resolved from the file system.
pub enum CheckpointFormat {
    Gguf(PathBuf),
    HuggingFace(PathBuf),
}

impl CheckpointFormat {
    pub fn detect(path: &Path) -> EngineResult<Self> {
        if !path.exists() {
            return Err(EngineError::MissingFile(path.to_path_buf()));
        }
        if path.is_dir() {
            Ok(Self::HuggingFace(path.to_path_buf()))
        } else {
            Ok(Self::Gguf(path.to_path_buf()))
        }
    }
}

/// Tensor access by GGUF name, whatever the file format.
trait TensorStore {
    fn get(&mut self, gguf_name: &str) -> EngineResult<Option<QTensor>>;
}

struct GgufStore {
    path: PathBuf,
    content: gguf_file::Content,
    reader: BufReader<File>,
}

impl TensorStore for GgufStore {
    fn get(&mut self, name: &str) -> EngineResult<Option<QTensor>> {
        if !self.content.tensor_infos.contains_key(name) {
            return Ok(None);
        }
        self.content
            .tensor(&mut self.reader, name, &Device::Cpu)
            .map(Some)
            .map_err(|e| invalid(&self.path, format!("tensor `{name}`: {e}")))
    }
}

struct SafetensorsStore {
    tensors: MmapedSafetensors,
    names: std::collections::HashSet<String>,
}

impl TensorStore for SafetensorsStore {
    fn get(&mut self, gguf_name: &str) -> EngineResult<Option<QTensor>> {
        let name = hf_tensor_name(gguf_name);
        if !self.names.contains(&name) {
            return Ok(None);
        }
        // f16 and bf16 stay 16-bit (a bf16 model loads without an f32 copy); where the file
        // aligns them, the stored bytes are taken as they are.
        let view = self.tensors.get(&name)?;
        let stored = match DType::try_from(view.dtype()) {
            Ok(DType::F32) => Some((GgmlDType::F32, 4)),
            Ok(DType::F16) => Some((GgmlDType::F16, 2)),
            Ok(DType::BF16) => Some((GgmlDType::BF16, 2)),
            _ => None,
        };
        let dtype = match stored {
            Some((dtype, align)) if view.data().as_ptr().align_offset(align) == 0 => {
                let bytes = Cow::Borrowed(view.data());
                let storage = QStorage::from_data(bytes, &Device::Cpu, dtype)?;
                return Ok(Some(QTensor::new(storage, view.shape())?));
            }
            Some((dtype, _)) => dtype,
            None => GgmlDType::F32,
        };
        let tensor = self.tensors.load(&name, &Device::Cpu)?;
        Ok(Some(QTensor::quantize(&tensor, dtype)?))
    }
}

/// Maps a GGUF tensor name to its Hugging Face transformers name.
fn hf_tensor_name(gguf_name: &str) -> String {
    let fixed = match gguf_name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(name) = fixed {
        return name.to_string();
    }
    let Some(rest) = gguf_name.strip_prefix("blk.") else {
        return gguf_name.to_string();
    };
    let (layer, tensor) = rest.split_once('.').unwrap_or((rest, ""));
    let (base, suffix) = tensor.rsplit_once('.').unwrap_or((tensor, ""));
    let hf = match base {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        other => other,
    };
    format!("model.layers.{layer}.{hf}.{suffix}")
}

fn invalid(path: &Path, message: impl Into<String>) -> EngineError {
    EngineError::InvalidModel {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// Opens a GGUF file's header (metadata + tensor directory) without reading tensor data.
pub fn read_gguf(path: &Path) -> EngineResult<(gguf_file::Content, BufReader<File>)> {
    if !path.exists() {
        return Err(EngineError::MissingFile(path.to_path_buf()));
    }
    let file = File::open(path).map_err(|source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut reader = BufReader::new(file);
    let content = gguf_file::Content::read(&mut reader)
        .map_err(|e| invalid(path, format!("not a readable GGUF file ({e})")))?;
    Ok((content, reader))
}

fn gguf_hyperparams(path: &Path, content: &gguf_file::Content) -> EngineResult<Hyperparams> {
    let md = &content.metadata;
    let arch_name = md
        .get("general.architecture")
        .and_then(|v| v.to_string().ok())
        .ok_or_else(|| invalid(path, "missing `general.architecture`"))?;
    let arch = Architecture::parse(arch_name)?;
    let int = |key: &str| -> EngineResult<usize> {
        let full = format!("{arch_name}.{key}");
        md.get(&full)
            .and_then(|v| v.to_u64().ok().or_else(|| v.to_u32().ok().map(u64::from)))
            .map(|v| v as usize)
            .ok_or_else(|| invalid(path, format!("missing or non-integer `{full}`")))
    };
    let float = |key: &str, default: f32| -> f32 {
        md.get(&format!("{arch_name}.{key}"))
            .and_then(|v| v.to_f32().ok())
            .unwrap_or(default)
    };
    let hidden = int("embedding_length")?;
    let heads = int("attention.head_count")?;
    let gemma = match arch {
        Architecture::Gemma3 => Some(gguf_gemma_params(path, md, arch_name)?),
        _ => None,
    };
    let vocab = content
        .tensor_infos
        .get("token_embd.weight")
        .map(|t| t.shape.dims()[0])
        .ok_or_else(|| invalid(path, "missing tensor `token_embd.weight`"))?;
    Ok(Hyperparams {
        arch,
        hidden,
        intermediate: int("feed_forward_length")?,
        checkpoint_layers: int("block_count")?,
        heads,
        kv_heads: int("attention.head_count_kv").unwrap_or(heads),
        head_dim: int("attention.key_length").unwrap_or(hidden / heads),
        vocab,
        rms_eps: float("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta: float("rope.freq_base", 10_000.0),
        rope_interleaved: arch == Architecture::Llama,
        context: int("context_length").unwrap_or(4096),
        gemma,
    })
}

/// Gemma 3's window (required: a file without it cannot be run as trained), pattern and local
/// rope base (Gemma 3's constants where absent, as llama.cpp reads the same files).
fn gguf_gemma_params(
    path: &Path,
    md: &HashMap<String, gguf_file::Value>,
    arch_name: &str,
) -> EngineResult<GemmaParams> {
    let key = |k: &str| format!("{arch_name}.{k}");
    let int = |k: &str| {
        md.get(&key(k))
            .and_then(|v| {
                v.to_u32()
                    .ok()
                    .or_else(|| v.to_u64().ok().map(|v| v as u32))
            })
            .map(|v| v as usize)
    };
    let sliding_window = int("attention.sliding_window")
        .filter(|&w| w > 0)
        .ok_or_else(|| {
            invalid(
                path,
                format!(
                    "missing or zero `{}` (Gemma 3's local attention window)",
                    key("attention.sliding_window")
                ),
            )
        })?;
    // llama.cpp's key names first, candle's after.
    let pattern_key = [
        "attention.sliding_window_pattern",
        "attention.sliding_window_type",
    ]
    .into_iter()
    .find(|k| md.contains_key(&key(k)));
    let global_every = match pattern_key {
        None => GemmaParams::DEFAULT_GLOBAL_EVERY,
        Some(k) => int(k).filter(|&n| n > 0).ok_or_else(|| {
            invalid(
                path,
                format!(
                    "`{}` must be a positive integer (every n-th layer global)",
                    key(k)
                ),
            )
        })?,
    };
    let local_rope_theta = ["rope.freq_base_swa", "rope.local_freq_base"]
        .into_iter()
        .find_map(|k| md.get(&key(k)))
        .map(|v| {
            v.to_f32()
                .map_err(|_| invalid(path, "the local rope base is not a float"))
        })
        .transpose()?
        .unwrap_or(GemmaParams::DEFAULT_LOCAL_ROPE_THETA);
    for unsupported in ["final_logit_softcapping", "attn_logit_softcapping"] {
        if md.contains_key(&key(unsupported)) {
            return Err(invalid(
                path,
                format!(
                    "`{}` is set: logit soft-capping (Gemma 2) is not supported",
                    key(unsupported)
                ),
            ));
        }
    }
    Ok(GemmaParams {
        sliding_window,
        global_every,
        local_rope_theta,
    })
}

/// The fields of a Hugging Face `config.json` that the forward pass needs.
#[derive(serde::Deserialize)]
struct HfConfig {
    #[serde(default)]
    model_type: Option<String>,
    #[serde(default)]
    architectures: Vec<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    #[serde(default)]
    num_key_value_heads: Option<usize>,
    #[serde(default)]
    head_dim: Option<usize>,
    vocab_size: usize,
    #[serde(default = "default_rms_eps")]
    rms_norm_eps: f32,
    #[serde(default = "default_rope_theta")]
    rope_theta: f32,
    #[serde(default = "default_context")]
    max_position_embeddings: usize,
    #[serde(default)]
    rope_scaling: Option<RopeScaling>,
}

#[derive(serde::Deserialize)]
struct RopeScaling {
    #[serde(default, alias = "type")]
    rope_type: Option<String>,
    #[serde(default)]
    factor: f32,
    #[serde(default)]
    low_freq_factor: f32,
    #[serde(default)]
    high_freq_factor: f32,
    #[serde(default)]
    original_max_position_embeddings: usize,
}

fn default_rms_eps() -> f32 {
    1e-6
}
fn default_rope_theta() -> f32 {
    10_000.0
}
fn default_context() -> usize {
    4096
}

/// A text file beside a model (its config, a chat template), a missing one named as such.
pub(crate) fn read_text(path: &Path) -> EngineResult<String> {
    std::fs::read_to_string(path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            EngineError::MissingFile(path.to_path_buf())
        } else {
            EngineError::Io {
                path: path.to_path_buf(),
                source,
            }
        }
    })
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> EngineResult<T> {
    let text = read_text(path)?;
    serde_json::from_str(&text).map_err(|e| invalid(path, e.to_string()))
}

fn hf_hyperparams(dir: &Path) -> EngineResult<(Hyperparams, Option<Vec<f32>>)> {
    let path = dir.join("config.json");
    let cfg: HfConfig = read_json(&path)?;
    let arch_name = cfg
        .model_type
        .clone()
        .or_else(|| cfg.architectures.first().cloned())
        .ok_or_else(|| invalid(&path, "neither `model_type` nor `architectures` is set"))?;
    let arch = Architecture::parse(&arch_name)?;
    if arch == Architecture::Gemma3 {
        return Err(invalid(
            &path,
            "Gemma 3 loads from GGUF only (convert with llama.cpp's convert_hf_to_gguf.py)",
        ));
    }
    let head_dim = cfg
        .head_dim
        .unwrap_or(cfg.hidden_size / cfg.num_attention_heads);
    let hp = Hyperparams {
        arch,
        hidden: cfg.hidden_size,
        intermediate: cfg.intermediate_size,
        checkpoint_layers: cfg.num_hidden_layers,
        heads: cfg.num_attention_heads,
        kv_heads: cfg.num_key_value_heads.unwrap_or(cfg.num_attention_heads),
        head_dim,
        vocab: cfg.vocab_size,
        rms_eps: cfg.rms_norm_eps,
        rope_theta: cfg.rope_theta,
        rope_interleaved: false,
        context: cfg.max_position_embeddings,
        gemma: None,
    };
    let divisors = match &cfg.rope_scaling {
        Some(s) if s.rope_type.as_deref() == Some("llama3") => {
            Some(llama3_freq_divisors(s, head_dim, cfg.rope_theta))
        }
        _ => None,
    };
    Ok((hp, divisors))
}

/// Llama 3.1's frequency-dependent rope scaling, expressed as a divisor per frequency.
fn llama3_freq_divisors(s: &RopeScaling, head_dim: usize, theta: f32) -> Vec<f32> {
    let low_wavelen = s.original_max_position_embeddings as f32 / s.low_freq_factor;
    let high_wavelen = s.original_max_position_embeddings as f32 / s.high_freq_factor;
    (0..head_dim / 2)
        .map(|i| {
            let freq = theta.powf(-((2 * i) as f32) / head_dim as f32);
            let wavelen = 2.0 * std::f32::consts::PI / freq;
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                s.factor
            } else {
                let smooth = (s.original_max_position_embeddings as f32 / wavelen
                    - s.low_freq_factor)
                    / (s.high_freq_factor - s.low_freq_factor);
                1.0 / ((1.0 - smooth) / s.factor + smooth)
            }
        })
        .collect()
}

fn safetensors_files(dir: &Path) -> EngineResult<Vec<PathBuf>> {
    let entries = std::fs::read_dir(dir).map_err(|source| EngineError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(invalid(dir, "no *.safetensors files"));
    }
    Ok(files)
}

/// Loads the weights a model entry asks for (its layer subset, at its precision).
pub fn load_weights(config: &ModelConfig) -> EngineResult<ModelWeights> {
    match CheckpointFormat::detect(&config.path)? {
        CheckpointFormat::Gguf(path) => {
            let (content, reader) = read_gguf(&path)?;
            let hp = gguf_hyperparams(&path, &content)?;
            let mut store = GgufStore {
                path: path.clone(),
                content,
                reader,
            };
            let divisors = store
                .get("rope_freqs.weight")?
                .map(|t| dense(&path, "rope_freqs.weight", &t))
                .transpose()?;
            assemble(&mut store, &path, hp, divisors, config)
        }
        CheckpointFormat::HuggingFace(dir) => {
            let (hp, divisors) = hf_hyperparams(&dir)?;
            let files = safetensors_files(&dir)?;
            // SAFETY: the files are memory-mapped read-only; tokenrouter never writes them and
            // a concurrent writer is a misuse of the model directory.
            let tensors = unsafe { MmapedSafetensors::multi(&files) }
                .map_err(|e| invalid(&dir, format!("unreadable safetensors: {e}")))?;
            let names = tensors.tensors().into_iter().map(|(n, _)| n).collect();
            let mut store = SafetensorsStore { tensors, names };
            assemble(&mut store, &dir, hp, divisors, config)
        }
    }
}

fn dense(path: &Path, name: &str, t: &QTensor) -> EngineResult<Vec<f32>> {
    t.dequantize(&Device::Cpu)?
        .flatten_all()?
        .to_vec1::<f32>()
        .map_err(|e| invalid(path, format!("tensor `{name}`: {e}")))
}

fn assemble(
    store: &mut dyn TensorStore,
    path: &Path,
    hp: Hyperparams,
    rope_freq_divisors: Option<Vec<f32>>,
    config: &ModelConfig,
) -> EngineResult<ModelWeights> {
    let layer_ids = config
        .layer_indices(hp.checkpoint_layers)
        .map_err(|e| invalid(path, e.to_string()))?;
    let progress = ProgressBar::new((layer_ids.len() + 2) as u64).with_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} layers")
            .expect("static progress template"),
    );
    progress.set_message(format!("loading {}", config.name));
    let mut loader = Loader {
        store,
        path,
        precision: config.weights,
        formats: BTreeMap::new(),
    };
    let q_dim = hp.heads * hp.head_dim;
    let kv_dim = hp.kv_heads * hp.head_dim;
    let embedding_q = loader.required("token_embd.weight", &[hp.vocab, hp.hidden])?;
    let embedding = embedding_q
        .dequantize(&Device::Cpu)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let lm_head = match loader.store.get("output.weight")? {
        Some(t) => loader.matrix("output.weight", t, &[hp.vocab, hp.hidden])?,
        None => loader.matrix("token_embd.weight", embedding_q, &[hp.vocab, hp.hidden])?,
    };
    let final_norm = loader.vector("output_norm.weight", hp.hidden)?;
    progress.inc(2);
    let mut layers = Vec::with_capacity(layer_ids.len());
    for &i in &layer_ids {
        let name = |t: &str| format!("blk.{i}.{t}");
        let qk_norm = matches!(hp.arch, Architecture::Qwen3 | Architecture::Gemma3);
        let gemma = hp.gemma.is_some();
        let mut norm_if = |wanted: bool, tensor: &str, len: usize| {
            wanted
                .then(|| loader.vector(&name(tensor), len))
                .transpose()
        };
        let q_norm = norm_if(qk_norm, "attn_q_norm.weight", hp.head_dim)?;
        let k_norm = norm_if(qk_norm, "attn_k_norm.weight", hp.head_dim)?;
        let post_attn_norm = norm_if(gemma, "post_attention_norm.weight", hp.hidden)?;
        let post_ffn_norm = norm_if(gemma, "post_ffw_norm.weight", hp.hidden)?;
        layers.push(LayerWeights {
            attn_norm: loader.vector(&name("attn_norm.weight"), hp.hidden)?,
            wq: loader.weight(&name("attn_q.weight"), q_dim, hp.hidden)?,
            wk: loader.weight(&name("attn_k.weight"), kv_dim, hp.hidden)?,
            wv: loader.weight(&name("attn_v.weight"), kv_dim, hp.hidden)?,
            wo: loader.weight(&name("attn_output.weight"), hp.hidden, q_dim)?,
            bq: loader.optional_vector(&name("attn_q.bias"), q_dim)?,
            bk: loader.optional_vector(&name("attn_k.bias"), kv_dim)?,
            bv: loader.optional_vector(&name("attn_v.bias"), kv_dim)?,
            q_norm,
            k_norm,
            post_attn_norm,
            post_ffn_norm,
            window: hp.gemma.and_then(|g| g.window_of(i)),
            ffn_norm: loader.vector(&name("ffn_norm.weight"), hp.hidden)?,
            w_gate: loader.weight(&name("ffn_gate.weight"), hp.intermediate, hp.hidden)?,
            w_up: loader.weight(&name("ffn_up.weight"), hp.intermediate, hp.hidden)?,
            w_down: loader.weight(&name("ffn_down.weight"), hp.hidden, hp.intermediate)?,
        });
        progress.inc(1);
    }
    progress.finish_and_clear();
    let formats: Vec<String> = loader
        .formats
        .iter()
        .map(|(dtype, n)| format!("{n} {dtype}"))
        .collect();
    tracing::info!(model = %config.name, "matrices: {}", formats.join(", "));
    Ok(ModelWeights {
        hp,
        embedding,
        layers,
        final_norm,
        lm_head,
        rope_freq_divisors,
    })
}

/// Reads tensors with shape checks and applies the variant's precision to matrices.
struct Loader<'a> {
    store: &'a mut dyn TensorStore,
    path: &'a Path,
    precision: WeightPrecision,
    /// Matrices loaded per format (a requantization may fall back: see `QWeight::requantize`).
    formats: BTreeMap<String, usize>,
}

impl Loader<'_> {
    fn required(&mut self, name: &str, shape: &[usize]) -> EngineResult<QTensor> {
        let t = self
            .store
            .get(name)?
            .ok_or_else(|| invalid(self.path, format!("missing tensor `{name}`")))?;
        check_shape(name, t.shape().dims(), shape)?;
        Ok(t)
    }

    fn matrix(&mut self, name: &str, t: QTensor, shape: &[usize]) -> EngineResult<QWeight> {
        check_shape(name, t.shape().dims(), shape)?;
        let weight = QWeight::from_qtensor(name, &t)?.requantize(name, self.precision)?;
        *self
            .formats
            .entry(format!("{:?}", weight.dtype()))
            .or_default() += 1;
        Ok(weight)
    }

    fn weight(&mut self, name: &str, n_out: usize, k_in: usize) -> EngineResult<QWeight> {
        let t = self.required(name, &[n_out, k_in])?;
        self.matrix(name, t, &[n_out, k_in])
    }

    fn vector(&mut self, name: &str, len: usize) -> EngineResult<Vec<f32>> {
        let t = self.required(name, &[len])?;
        dense(self.path, name, &t)
    }

    fn optional_vector(&mut self, name: &str, len: usize) -> EngineResult<Option<Vec<f32>>> {
        match self.store.get(name)? {
            Some(t) => {
                check_shape(name, t.shape().dims(), &[len])?;
                Ok(Some(dense(self.path, name, &t)?))
            }
            None => Ok(None),
        }
    }
}

fn check_shape(name: &str, actual: &[usize], expected: &[usize]) -> EngineResult<()> {
    if actual != expected {
        return Err(EngineError::ShapeMismatch {
            name: name.to_string(),
            actual: actual.to_vec(),
            expected: expected.to_vec(),
        });
    }
    Ok(())
}

/// Summary of a checkpoint for `models list`, read from headers only.
pub fn describe(path: &Path) -> EngineResult<HashMap<&'static str, String>> {
    let (format, hp) = match CheckpointFormat::detect(path)? {
        CheckpointFormat::Gguf(path) => {
            let (content, _) = read_gguf(&path)?;
            ("gguf", gguf_hyperparams(&path, &content)?)
        }
        CheckpointFormat::HuggingFace(dir) => ("huggingface", hf_hyperparams(&dir)?.0),
    };
    Ok(HashMap::from([
        ("format", format.to_string()),
        ("architecture", format!("{:?}", hp.arch).to_lowercase()),
        ("layers", hp.checkpoint_layers.to_string()),
    ]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gguf_names_map_to_transformers_names() {
        assert_eq!(
            hf_tensor_name("blk.3.attn_q.bias"),
            "model.layers.3.self_attn.q_proj.bias"
        );
        assert_eq!(
            hf_tensor_name("blk.0.ffn_norm.weight"),
            "model.layers.0.post_attention_layernorm.weight"
        );
        assert_eq!(
            hf_tensor_name("blk.1.attn_k_norm.weight"),
            "model.layers.1.self_attn.k_norm.weight"
        );
        assert_eq!(hf_tensor_name("output.weight"), "lm_head.weight");
    }
}

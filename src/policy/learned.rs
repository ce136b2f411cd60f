//! Learned routers, loaded from safetensors and evaluated over a whole batch per layer.
//! Tensor names (all `[out, in]` weights, PyTorch `nn.Linear` layout), this project's and, in
//! brackets, the released checkpoints' (either is read; a file uses one or the other):
//! - R2R (`r2r`): `topk_proj` [`logits_projection`], `input_proj` [`combined_projection`],
//!   `backbone_proj` [`backbone.input_projection`], `blocks.{i}.norm`
//!   [`backbone.blocks.{i}.layer_norm`], `blocks.{i}.fc1` [`….mlp.0`], `blocks.{i}.fc2`
//!   [`….mlp.3`], `final_norm` [`backbone.output_layer.0`], `head` [`backbone.output_layer.1`]
//!   (+ `.weight`/`.bias`), optional scalar `threshold`; a released file's
//!   `token_embeddings.weight` is ignored (the SLM's embedding is the same table).
//! - CITER (`citer`): `fc1` [`mlp.0`], `bn` [`mlp.1`] (`weight`, `bias`, `running_mean`,
//!   `running_var`), `fc2` [`mlp.4`], `head` [`linear`].
//! - Co-LLM (`colm`): `defer.weight` `[1, hidden]`, optional `defer.bias`; or, as released, a
//!   fine-tuned `lm_head.weight` (`output.weight`) whose last row is the `<|defer|>` token.

use super::PolicyError;
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::Path;

/// Number of top logits R2R's router reads.
pub const R2R_TOP_K: usize = 100;
/// Stands in for the logits a vocabulary smaller than `R2R_TOP_K` lacks: very unlikely.
const MISSING_LOGIT: f32 = -1e4;

/// Appends R2R's logits input for one row: the `(token, logit)` pairs' logits, largest first,
/// padded to `R2R_TOP_K`.
pub fn padded_top_logits(top_k: &[(u32, f32)], out: &mut Vec<f32>) {
    let row_start = out.len();
    out.extend(top_k.iter().take(R2R_TOP_K).map(|&(_, l)| l));
    out.resize(row_start + R2R_TOP_K, MISSING_LOGIT);
}

type Tensors = HashMap<String, Tensor>;

/// The file's tensors; the default config's routers are also carried by the binary.
fn load(path: &Path) -> Result<Tensors, String> {
    let bytes = crate::config::read_or_carried(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => "not found".to_string(),
        _ => format!("cannot read: {e}"),
    })?;
    candle_core::safetensors::load_buffer(&bytes, &Device::Cpu)
        .map_err(|e| format!("cannot read: {e}"))
}

/// Names the file in a loader's error.
fn at<T>(path: &Path, loaded: Result<T, String>) -> Result<T, PolicyError> {
    loaded.map_err(|message| PolicyError::RouterWeights {
        path: path.to_path_buf(),
        message,
    })
}

/// A learned router that scores each row of a batch of the small model's hidden states.
pub trait HiddenScorer: Send + Sync {
    fn score(&self, hidden: &[f32]) -> Vec<f32>;
    /// The threshold saved with the weights, if any.
    fn threshold(&self) -> Option<f32>;
}

/// The threshold saved with a router: a scalar `threshold` tensor (`router train` writes one),
/// else `common_args.threshold` of the JSON sidecar beside the file
/// (`scripts/convert-router.py` writes one from a released checkpoint).
fn saved_threshold(t: &Tensors, path: &Path) -> Result<Option<f32>, String> {
    if t.contains_key("threshold") {
        return Ok(get(t, "threshold")?.1.first().copied());
    }
    let sidecar = path.with_extension("json");
    let Ok(text) = std::fs::read_to_string(&sidecar) else {
        return Ok(None);
    };
    let json: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| format!("sidecar {}: not JSON ({e})", sidecar.display()))?;
    match &json["common_args"]["threshold"] {
        serde_json::Value::Null => Ok(None),
        value => value.as_f64().map(|v| Some(v as f32)).ok_or_else(|| {
            format!(
                "sidecar {}: `common_args.threshold` is not a number",
                sidecar.display()
            )
        }),
    }
}

fn get(t: &Tensors, name: &str) -> Result<(Vec<usize>, Vec<f32>), String> {
    let tensor = t
        .get(name)
        .ok_or_else(|| format!("router weights lack `{name}`"))?;
    let dims = tensor.dims().to_vec();
    let data = tensor
        .to_dtype(DType::F32)
        .and_then(|x| x.flatten_all())
        .and_then(|x| x.to_vec1::<f32>())
        .map_err(|e| format!("`{name}`: {e}"))?;
    Ok((dims, data))
}

/// The released R2R checkpoints' name for one of this project's tensor prefixes.
fn released_r2r_name(own: &str) -> String {
    if let Some(rest) = own.strip_prefix("blocks.") {
        let (i, part) = rest.split_once('.').unwrap_or((rest, ""));
        let part = match part {
            "norm" => "layer_norm",
            "fc1" => "mlp.0",
            "fc2" => "mlp.3",
            other => other,
        };
        return format!("backbone.blocks.{i}.{part}");
    }
    match own {
        "topk_proj" => "logits_projection",
        "input_proj" => "combined_projection",
        "backbone_proj" => "backbone.input_projection",
        "final_norm" => "backbone.output_layer.0",
        "head" => "backbone.output_layer.1",
        other => other,
    }
    .to_string()
}

/// The released CITER checkpoints' name (torchvision `MLP`, then `linear`).
fn released_citer_name(own: &str) -> String {
    match own {
        "fc1" => "mlp.0",
        "bn" => "mlp.1",
        "fc2" => "mlp.4",
        "head" => "linear",
        other => other,
    }
    .to_string()
}

/// Maps this project's tensor prefixes to the names `t` uses: its own, or the released
/// checkpoints' when `t` holds `probe` under its released name.
fn naming(t: &Tensors, probe: &str, released: fn(&str) -> String) -> impl Fn(&str) -> String {
    let is_released = t.contains_key(&format!("{}.weight", released(probe)));
    move |own: &str| match is_released {
        true => released(own),
        false => own.to_string(),
    }
}

/// `y = x Wᵀ + b` over a batch of rows.
struct Linear {
    n_in: usize,
    n_out: usize,
    weight: Vec<f32>,
    bias: Vec<f32>,
}

impl Linear {
    fn load(t: &Tensors, prefix: &str, n_in: Option<usize>) -> Result<Self, String> {
        let (dims, weight) = get(t, &format!("{prefix}.weight"))?;
        let [n_out, found_in] = dims[..] else {
            return Err(format!("`{prefix}.weight` must be 2-D, is {dims:?}"));
        };
        if let Some(n_in) = n_in.filter(|&n| n != found_in) {
            return Err(format!(
                "`{prefix}.weight` takes {found_in} inputs, expected {n_in}"
            ));
        }
        let bias = match t.get(&format!("{prefix}.bias")) {
            Some(_) => get(t, &format!("{prefix}.bias"))?.1,
            None => vec![0.0; n_out],
        };
        if bias.len() != n_out {
            return Err(format!(
                "`{prefix}.bias` has {} entries, expected {n_out}",
                bias.len()
            ));
        }
        Ok(Self {
            n_in: found_in,
            n_out,
            weight,
            bias,
        })
    }

    fn forward(&self, x: &[f32]) -> Vec<f32> {
        let rows = x.len() / self.n_in;
        let mut out = Vec::with_capacity(rows * self.n_out);
        for row in x.chunks(self.n_in) {
            for (o, b) in self.weight.chunks(self.n_in).zip(&self.bias) {
                out.push(crate::engine::ops::dot(row, o) + b);
            }
        }
        out
    }
}

struct LayerNorm {
    weight: Vec<f32>,
    bias: Vec<f32>,
}

impl LayerNorm {
    fn load(t: &Tensors, prefix: &str, n: usize) -> Result<Self, String> {
        let weight = get(t, &format!("{prefix}.weight"))?.1;
        let bias = get(t, &format!("{prefix}.bias"))?.1;
        if weight.len() != n || bias.len() != n {
            return Err(format!("`{prefix}` must have {n} entries"));
        }
        Ok(Self { weight, bias })
    }

    fn forward(&self, x: &[f32]) -> Vec<f32> {
        let n = self.weight.len();
        let mut out = x.to_vec();
        for row in out.chunks_mut(n) {
            let mean = row.iter().sum::<f32>() / n as f32;
            let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / n as f32;
            let inv = 1.0 / (var + 1e-5).sqrt();
            for ((v, w), b) in row.iter_mut().zip(&self.weight).zip(&self.bias) {
                *v = (*v - mean) * inv * w + b;
            }
        }
        out
    }
}

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// GELU with the error function (PyTorch's default), erf by Abramowitz–Stegun 7.1.26.
fn gelu(x: f32) -> f32 {
    let z = (x as f64) / std::f64::consts::SQRT_2;
    let t = 1.0 / (1.0 + 0.327_591_1 * z.abs());
    let poly = t
        * (0.254_829_592
            + t * (-0.284_496_736
                + t * (1.421_413_741 + t * (-1.453_152_027 + t * 1.061_405_429))));
    let erf = (1.0 - poly * (-z * z).exp()).copysign(z);
    (0.5 * x as f64 * (1.0 + erf)) as f32
}

/// R2R's router: top-100 logits, SLM hidden state and candidate embedding → P(divergent).
pub struct R2rRouter {
    hidden: usize,
    topk_proj: Linear,
    input_proj: Linear,
    backbone_proj: Linear,
    blocks: Vec<(LayerNorm, Linear, Linear)>,
    final_norm: LayerNorm,
    head: Linear,
    /// θ saved with the checkpoint, if any.
    pub threshold: Option<f32>,
}

impl R2rRouter {
    pub fn load(path: &Path, hidden: usize) -> Result<Self, PolicyError> {
        at(path, Self::read(path, hidden))
    }

    fn read(path: &Path, hidden: usize) -> Result<Self, String> {
        let t = load(path)?;
        let name = naming(&t, "topk_proj", released_r2r_name);
        let topk_proj = Linear::load(&t, &name("topk_proj"), Some(R2R_TOP_K))?;
        if topk_proj.n_out != hidden {
            return Err(format!(
                "`{}` projects to {}, the SLM hidden size is {hidden}",
                name("topk_proj"),
                topk_proj.n_out
            ));
        }
        let input_proj = Linear::load(&t, &name("input_proj"), Some(3 * hidden))?;
        let width = input_proj.n_out;
        let backbone_proj = Linear::load(&t, &name("backbone_proj"), Some(width))?;
        let mut blocks = Vec::new();
        loop {
            let block = |part: &str| name(&format!("blocks.{}.{part}", blocks.len()));
            if !t.contains_key(&format!("{}.weight", block("fc1"))) {
                break;
            }
            let fc1 = Linear::load(&t, &block("fc1"), Some(width))?;
            let fc2 = Linear::load(&t, &block("fc2"), Some(fc1.n_out))?;
            let norm = LayerNorm::load(&t, &block("norm"), width)?;
            blocks.push((norm, fc1, fc2));
        }
        Ok(Self {
            threshold: saved_threshold(&t, path)?,
            hidden,
            topk_proj,
            input_proj,
            backbone_proj,
            blocks,
            final_norm: LayerNorm::load(&t, &name("final_norm"), width)?,
            head: Linear::load(&t, &name("head"), Some(width))?,
        })
    }

    /// One probability per row; rows are (hidden, embedding, top-100 logits).
    pub fn score(&self, hidden: &[f32], embedding: &[f32], top_logits: &[f32]) -> Vec<f32> {
        let u = self.topk_proj.forward(top_logits);
        let rows = u.len() / self.hidden;
        let mut joined = Vec::with_capacity(rows * 3 * self.hidden);
        for r in 0..rows {
            let span = r * self.hidden..(r + 1) * self.hidden;
            joined.extend_from_slice(&hidden[span.clone()]);
            joined.extend_from_slice(&embedding[span.clone()]);
            joined.extend_from_slice(&u[span]);
        }
        let mut x = self
            .backbone_proj
            .forward(&self.input_proj.forward(&joined));
        for (norm, fc1, fc2) in &self.blocks {
            let mut mid = fc1.forward(&norm.forward(&x));
            mid.iter_mut().for_each(|v| *v = gelu(*v));
            crate::engine::ops::add_in_place(&mut x, &fc2.forward(&mid));
        }
        self.head
            .forward(&self.final_norm.forward(&x))
            .into_iter()
            .map(sigmoid)
            .collect()
    }
}

/// CITER's router: SLM hidden state → confidence that the SLM token is fine.
pub struct CiterRouter {
    fc1: Linear,
    bn_scale: Vec<f32>,
    bn_shift: Vec<f32>,
    fc2: Linear,
    head: Linear,
    threshold: Option<f32>,
}

impl CiterRouter {
    pub fn load(path: &Path, hidden: usize) -> Result<Self, PolicyError> {
        at(path, Self::read(path, hidden))
    }

    fn read(path: &Path, hidden: usize) -> Result<Self, String> {
        let t = load(path)?;
        let name = naming(&t, "fc1", released_citer_name);
        let fc1 = Linear::load(&t, &name("fc1"), Some(hidden))?;
        let n = fc1.n_out;
        let bn = name("bn");
        let (_, weight) = get(&t, &format!("{bn}.weight"))?;
        let (_, bias) = get(&t, &format!("{bn}.bias"))?;
        let (_, mean) = get(&t, &format!("{bn}.running_mean"))?;
        let (_, var) = get(&t, &format!("{bn}.running_var"))?;
        if [weight.len(), bias.len(), mean.len(), var.len()]
            .iter()
            .any(|&l| l != n)
        {
            return Err(format!("`{bn}.*` must have {n} entries"));
        }
        // Inference-mode batch norm folded into one scale and shift per channel.
        let bn_scale: Vec<f32> = weight
            .iter()
            .zip(&var)
            .map(|(w, v)| w / (v + 1e-5).sqrt())
            .collect();
        let bn_shift = bias
            .iter()
            .zip(&mean)
            .zip(&bn_scale)
            .map(|((b, m), s)| b - m * s)
            .collect();
        let fc2 = Linear::load(&t, &name("fc2"), Some(n))?;
        let head = Linear::load(&t, &name("head"), Some(fc2.n_out))?;
        Ok(Self {
            fc1,
            bn_scale,
            bn_shift,
            fc2,
            head,
            threshold: saved_threshold(&t, path)?,
        })
    }
}

impl HiddenScorer for CiterRouter {
    fn score(&self, hidden: &[f32]) -> Vec<f32> {
        let mut x = self.fc1.forward(hidden);
        for row in x.chunks_mut(self.bn_scale.len()) {
            for ((v, s), b) in row.iter_mut().zip(&self.bn_scale).zip(&self.bn_shift) {
                *v = (*v * s + b).max(0.0);
            }
        }
        self.head
            .forward(&self.fc2.forward(&x))
            .into_iter()
            .map(sigmoid)
            .collect()
    }

    fn threshold(&self) -> Option<f32> {
        self.threshold
    }
}

/// Co-LLM's deferral head: one extra LM-head row over the base model's hidden state.
pub struct DeferralHead {
    head: Linear,
    threshold: Option<f32>,
}

impl DeferralHead {
    pub fn load(path: &Path, hidden: usize) -> Result<Self, PolicyError> {
        at(path, Self::read(path, hidden))
    }

    fn read(path: &Path, hidden: usize) -> Result<Self, String> {
        let t = load(path)?;
        let lm_head = ["lm_head.weight", "output.weight"]
            .into_iter()
            .find(|name| t.contains_key(*name));
        let threshold = saved_threshold(&t, path)?;
        if let (Some(lm_head), false) = (lm_head, t.contains_key("defer.weight")) {
            let head = Self::last_row(&t, lm_head, hidden)?;
            return Ok(Self { head, threshold });
        }
        let head = Linear::load(&t, "defer", Some(hidden))?;
        if head.n_out != 1 {
            return Err(format!("`defer.weight` must be [1, {hidden}]"));
        }
        Ok(Self { head, threshold })
    }

    /// Co-LLM's release: the `<|defer|>` token is the last row of the fine-tuned LM head.
    fn last_row(t: &Tensors, name: &str, hidden: usize) -> Result<Linear, String> {
        let (dims, weight) = get(t, name)?;
        let [rows, columns] = dims[..] else {
            return Err(format!("`{name}` must be 2-D, is {dims:?}"));
        };
        if columns != hidden || rows == 0 {
            return Err(format!(
                "`{name}` is [{rows}, {columns}]; its rows must have the model's {hidden} entries"
            ));
        }
        Ok(Linear {
            n_in: hidden,
            n_out: 1,
            weight: weight[(rows - 1) * hidden..].to_vec(),
            bias: vec![0.0],
        })
    }
}

impl HiddenScorer for DeferralHead {
    fn score(&self, hidden: &[f32]) -> Vec<f32> {
        self.head.forward(hidden).into_iter().map(sigmoid).collect()
    }

    fn threshold(&self) -> Option<f32> {
        self.threshold
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gelu_matches_reference_values() {
        for (x, want) in [
            (0.0, 0.0),
            (1.0, 0.841_344_7),
            (-1.0, -0.158_655_3),
            (2.5, 2.484_466),
        ] {
            assert!((gelu(x) - want).abs() < 1e-5, "gelu({x}) = {}", gelu(x));
        }
    }
}

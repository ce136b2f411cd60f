//! `router train`: R2R's and CITER's routers in their official shapes, trained with candle-nn
//! (the engine already depends on candle-core, whose autograd candle-nn's layers and AdamW
//! use; a Python script would need torch, which these machines' registries only offer as a
//! multi-GB CUDA build). The saved tensors carry this project's names, which
//! `policy::learned` reads.
//!
//! Rows from every fifth training question are kept apart for validation: the best epoch and
//! the thresholds are chosen there; the held-out questions' rows are only reported.

use super::collect::Traces;
use anyhow::{bail, Context};
use candle_core::{DType, Device, Module, ModuleT, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use tokenrouter::policy::learned::R2R_TOP_K;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum RouterKind {
    R2r,
    Citer,
}

/// What a router learns to flag (`collect` writes both).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Label {
    /// The SLM's greedy token differs from the LLM's.
    Differs,
    /// The SLM's token turns the LLM's correct answer into a wrong one.
    Divergent,
}

impl Label {
    fn of(self, traces: &Traces) -> &[u8] {
        match self {
            Label::Differs => &traces.label,
            Label::Divergent => &traces.divergent,
        }
    }
}

pub struct TrainSettings {
    pub kind: RouterKind,
    pub label: Label,
    /// R2R's backbone width (the official routers use 1024).
    pub width: usize,
    /// R2R's residual blocks (officially 6).
    pub blocks: usize,
    pub epochs: usize,
    pub batch: usize,
    pub learning_rate: f64,
    pub seed: u64,
    /// The shipped threshold sends this share of validation positions to the LLM.
    pub target_share: f64,
    /// R2R's own rule, reported beside: the threshold keeping this recall of label-1 rows.
    pub target_recall: f64,
    /// R2R: train on standardised inputs, folded into the saved weights (`InputScale`).
    pub standardize_inputs: bool,
}

/// How a threshold does on one set of rows.
#[derive(Debug, Clone, Serialize)]
pub struct AtThreshold {
    /// The router's own threshold (for CITER a confidence: below it the LLM writes).
    pub threshold: f32,
    /// Share of positions the LLM writes.
    pub share: f64,
    /// Share of label-1 positions the LLM writes.
    pub recall: f64,
    /// Share of the LLM's positions that are label 1.
    pub precision: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct TrainReport {
    pub kind: RouterKind,
    pub label: Label,
    pub parameters: usize,
    pub rows: [usize; 3],
    /// Share of label-1 rows in the held-out questions.
    pub heldout_label_rate: f64,
    pub best_epoch: usize,
    pub validation_auc: f64,
    pub heldout_auc: f64,
    /// The shipped threshold (target share on validation), measured on the held-out rows.
    pub share_rule: AtThreshold,
    /// The target-recall threshold, measured on the held-out rows.
    pub recall_rule: AtThreshold,
}

/// The router's inputs and targets for a subset of rows.
struct Batch {
    hidden: Tensor,
    embedding: Tensor,
    top_logits: Tensor,
    /// 1 where the LLM should write.
    labels: Vec<u8>,
    /// `labels` as the loss reads them.
    flagged: Tensor,
}

impl Batch {
    /// `rows` of `traces`, as `scale` standardises them (raw without one).
    fn of(
        traces: &Traces,
        label: Label,
        rows: &[usize],
        scale: Option<&InputScale>,
    ) -> candle_core::Result<Self> {
        let pick = |data: &[f32], width: usize, standard: Option<&Standard>| {
            let mut out = Vec::with_capacity(rows.len() * width);
            for &r in rows {
                let row = &data[r * width..(r + 1) * width];
                match standard {
                    Some(standard) => out.extend(standard.apply(row)),
                    None => out.extend_from_slice(row),
                }
            }
            Tensor::from_vec(out, (rows.len(), width), &Device::Cpu)
        };
        let h = traces.hidden_size;
        let labels: Vec<u8> = rows.iter().map(|&r| label.of(traces)[r]).collect();
        let flagged: Vec<f32> = labels.iter().map(|&l| f32::from(l)).collect();
        Ok(Batch {
            hidden: pick(&traces.hidden, h, scale.map(|s| &s.hidden))?,
            embedding: pick(&traces.embedding, h, scale.map(|s| &s.embedding))?,
            top_logits: pick(&traces.top_logits, R2R_TOP_K, scale.map(|s| &s.top_logits))?,
            flagged: Tensor::from_vec(flagged, rows.len(), &Device::Cpu)?,
            labels,
        })
    }
}

/// Per feature, the shift and scale that standardise it over the fitting rows.
struct Standard {
    mean: Vec<f32>,
    /// 1/σ (0 for a constant feature).
    inv_std: Vec<f32>,
    /// Whether each row is first taken relative to its first (largest) value.
    relative_to_first: bool,
}

impl Standard {
    fn fit(data: &[f32], width: usize, rows: &[usize], relative_to_first: bool) -> Self {
        let mut standard = Self {
            mean: vec![0.0; width],
            inv_std: vec![1.0; width],
            relative_to_first,
        };
        let (mut sum, mut squares) = (vec![0.0f64; width], vec![0.0f64; width]);
        for &r in rows {
            for (k, v) in standard
                .apply(&data[r * width..(r + 1) * width])
                .enumerate()
            {
                sum[k] += v as f64;
                squares[k] += (v as f64).powi(2);
            }
        }
        let n = rows.len().max(1) as f64;
        for k in 0..width {
            let mean = sum[k] / n;
            let std = (squares[k] / n - mean * mean).max(0.0).sqrt();
            standard.mean[k] = mean as f32;
            standard.inv_std[k] = if std > 1e-6 { (1.0 / std) as f32 } else { 0.0 };
        }
        standard
    }

    fn apply<'a>(&'a self, row: &'a [f32]) -> impl Iterator<Item = f32> + 'a {
        let first = if self.relative_to_first { row[0] } else { 0.0 };
        row.iter()
            .zip(self.mean.iter().zip(&self.inv_std))
            .map(move |(&v, (&mean, &inv))| (v - first - mean) * inv)
    }

    /// Folds the standardisation into the `[out, width]` weight columns `columns` of `w`
    /// (row-major, `in_width` wide) and into bias `b`: the layer then reads raw values.
    fn fold(&self, w: &mut [f32], in_width: usize, columns: usize, b: &mut [f32]) {
        for (row, bias) in w.chunks_mut(in_width).zip(b.iter_mut()) {
            let scaled: Vec<f32> = (0..self.mean.len())
                .map(|k| row[columns + k] * self.inv_std[k])
                .collect();
            *bias -= scaled
                .iter()
                .zip(&self.mean)
                .map(|(w, m)| w * m)
                .sum::<f32>();
            for (k, &w) in scaled.iter().enumerate() {
                row[columns + k] = w;
            }
            if self.relative_to_first {
                row[columns] -= scaled.iter().sum::<f32>();
            }
        }
    }
}

/// R2R's inputs standardised while it trains (hidden states and embeddings per feature,
/// the top logits relative to the largest), folded into its first layers when it is saved,
/// so the shipped router reads raw inputs as R2R's does. Raw top logits share a large offset
/// per row that the router would otherwise have to learn to ignore.
struct InputScale {
    hidden: Standard,
    embedding: Standard,
    top_logits: Standard,
}

impl InputScale {
    fn fit(traces: &Traces, rows: &[usize]) -> Self {
        let h = traces.hidden_size;
        Self {
            hidden: Standard::fit(&traces.hidden, h, rows, false),
            embedding: Standard::fit(&traces.embedding, h, rows, false),
            top_logits: Standard::fit(&traces.top_logits, R2R_TOP_K, rows, true),
        }
    }

    /// R2R weights trained on standardised inputs, as weights that read raw ones.
    fn fold(
        &self,
        mut weights: HashMap<String, Tensor>,
    ) -> candle_core::Result<HashMap<String, Tensor>> {
        let mut layer = |name: &str, folds: &[(&Standard, usize)]| -> candle_core::Result<()> {
            let w = &weights[&format!("{name}.weight")];
            let (out, in_width) = w.dims2()?;
            let mut w_values = w.flatten_all()?.to_vec1::<f32>()?;
            let mut b_values = weights[&format!("{name}.bias")].to_vec1::<f32>()?;
            for &(standard, columns) in folds {
                standard.fold(&mut w_values, in_width, columns, &mut b_values);
            }
            let w = Tensor::from_vec(w_values, (out, in_width), &Device::Cpu)?;
            let b = Tensor::from_vec(b_values, out, &Device::Cpu)?;
            weights.insert(format!("{name}.weight"), w);
            weights.insert(format!("{name}.bias"), b);
            Ok(())
        };
        let h = self.hidden.mean.len();
        layer("topk_proj", &[(&self.top_logits, 0)])?;
        layer("input_proj", &[(&self.hidden, 0), (&self.embedding, h)])?;
        Ok(weights)
    }
}

/// R2R's router with this project's tensor names.
struct R2rNet {
    topk_proj: candle_nn::Linear,
    input_proj: candle_nn::Linear,
    backbone_proj: candle_nn::Linear,
    blocks: Vec<(candle_nn::LayerNorm, candle_nn::Linear, candle_nn::Linear)>,
    final_norm: candle_nn::LayerNorm,
    head: candle_nn::Linear,
}

impl R2rNet {
    fn new(
        vb: VarBuilder,
        hidden: usize,
        width: usize,
        blocks: usize,
    ) -> candle_core::Result<Self> {
        let blocks = (0..blocks)
            .map(|i| {
                let vb = vb.pp(format!("blocks.{i}"));
                Ok((
                    candle_nn::layer_norm(width, 1e-5, vb.pp("norm"))?,
                    candle_nn::linear(width, 4 * width, vb.pp("fc1"))?,
                    candle_nn::linear(4 * width, width, vb.pp("fc2"))?,
                ))
            })
            .collect::<candle_core::Result<_>>()?;
        Ok(Self {
            topk_proj: candle_nn::linear(R2R_TOP_K, hidden, vb.pp("topk_proj"))?,
            input_proj: candle_nn::linear(3 * hidden, width, vb.pp("input_proj"))?,
            backbone_proj: candle_nn::linear(width, width, vb.pp("backbone_proj"))?,
            blocks,
            final_norm: candle_nn::layer_norm(width, 1e-5, vb.pp("final_norm"))?,
            head: candle_nn::linear(width, 1, vb.pp("head"))?,
        })
    }

    /// The logit of P(divergent), `[rows]`.
    fn forward(&self, b: &Batch) -> candle_core::Result<Tensor> {
        let projected = self.topk_proj.forward(&b.top_logits)?;
        let joined = Tensor::cat(&[&b.hidden, &b.embedding, &projected], 1)?;
        let mut x = self
            .backbone_proj
            .forward(&self.input_proj.forward(&joined)?)?;
        for (norm, fc1, fc2) in &self.blocks {
            let mid = fc1.forward(&norm.forward(&x)?)?.gelu_erf()?;
            x = (x + fc2.forward(&mid)?)?;
        }
        self.head.forward(&self.final_norm.forward(&x)?)?.squeeze(1)
    }
}

/// CITER's router (torchvision `MLP(H, [2H, H])`, then `Linear(H, 1)`): its logit is the
/// confidence that the SLM's token is fine.
struct CiterNet {
    fc1: candle_nn::Linear,
    bn: candle_nn::BatchNorm,
    fc2: candle_nn::Linear,
    head: candle_nn::Linear,
}

impl CiterNet {
    fn new(vb: VarBuilder, hidden: usize) -> candle_core::Result<Self> {
        Ok(Self {
            fc1: candle_nn::linear(hidden, 2 * hidden, vb.pp("fc1"))?,
            bn: candle_nn::batch_norm(2 * hidden, 1e-5, vb.pp("bn"))?,
            fc2: candle_nn::linear(2 * hidden, hidden, vb.pp("fc2"))?,
            head: candle_nn::linear(hidden, 1, vb.pp("head"))?,
        })
    }

    /// The logit of the confidence, `[rows]`.
    fn forward_t(&self, b: &Batch, train: bool) -> candle_core::Result<Tensor> {
        let x = self.fc1.forward(&b.hidden)?;
        let x = self.bn.forward_t(&x, train)?.relu()?;
        self.head.forward(&self.fc2.forward(&x)?)?.squeeze(1)
    }
}

enum Net {
    R2r(R2rNet),
    Citer(CiterNet),
}

impl Net {
    /// The logit of the router's own score and the target it is trained towards.
    fn logits(&self, b: &Batch, train: bool) -> candle_core::Result<(Tensor, Tensor)> {
        match self {
            Net::R2r(net) => Ok((net.forward(b)?, b.flagged.clone())),
            Net::Citer(net) => Ok((net.forward_t(b, train)?, b.flagged.affine(-1.0, 1.0)?)),
        }
    }

    /// Per row, how strongly the router sends it to the LLM (R2R: P(divergent); CITER: one
    /// minus its confidence).
    fn llm_scores(&self, b: &Batch) -> candle_core::Result<Vec<f32>> {
        let (logits, _) = self.logits(b, false)?;
        let p = candle_nn::ops::sigmoid(&logits)?;
        match self {
            Net::R2r(_) => p.to_vec1(),
            Net::Citer(_) => p.affine(-1.0, 1.0)?.to_vec1(),
        }
    }
}

/// Binary cross-entropy on logits, in the stable form max(x, 0) − x·t + log(1 + e^−|x|).
fn bce_with_logits(logits: &Tensor, target: &Tensor) -> candle_core::Result<Tensor> {
    let softplus_tail = logits.abs()?.neg()?.exp()?.affine(1.0, 1.0)?.log()?;
    (logits.relu()? - (logits * target)? + softplus_tail)?.mean_all()
}

/// Area under the ROC curve of `scores` against `labels` (ties count half).
pub fn auc(scores: &[f32], labels: &[u8]) -> f64 {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[a].total_cmp(&scores[b]));
    let (mut rank_sum, mut i) = (0.0, 0);
    while i < order.len() {
        let mut j = i;
        while j < order.len() && scores[order[j]] == scores[order[i]] {
            j += 1;
        }
        let mean_rank = (i + j + 1) as f64 / 2.0;
        rank_sum += mean_rank * order[i..j].iter().filter(|&&r| labels[r] == 1).count() as f64;
        i = j;
    }
    let positives = labels.iter().filter(|&&l| l == 1).count() as f64;
    let negatives = labels.len() as f64 - positives;
    if positives == 0.0 || negatives == 0.0 {
        return 0.5;
    }
    (rank_sum - positives * (positives + 1.0) / 2.0) / (positives * negatives)
}

/// The LLM-score threshold that sends `share` of `scores` (at least one row) to the LLM.
fn threshold_for_share(scores: &[f32], share: f64) -> f32 {
    let mut sorted = scores.to_vec();
    sorted.sort_by(|a, b| b.total_cmp(a));
    let k = ((share * sorted.len() as f64).round() as usize).clamp(1, sorted.len());
    sorted[k - 1]
}

/// The highest LLM-score threshold that keeps `recall` of the label-1 rows.
fn threshold_for_recall(scores: &[f32], labels: &[u8], recall: f64) -> f32 {
    let mut positive: Vec<f32> = scores
        .iter()
        .zip(labels)
        .filter(|(_, &l)| l == 1)
        .map(|(&s, _)| s)
        .collect();
    if positive.is_empty() {
        return f32::INFINITY;
    }
    positive.sort_by(|a, b| b.total_cmp(a));
    let k = ((recall * positive.len() as f64).ceil() as usize).clamp(1, positive.len());
    positive[k - 1]
}

fn measure(kind: RouterKind, scores: &[f32], labels: &[u8], threshold: f32) -> AtThreshold {
    let flagged: Vec<bool> = scores.iter().map(|&s| s >= threshold).collect();
    let count = |keep: &dyn Fn(usize) -> bool| (0..scores.len()).filter(|&i| keep(i)).count();
    let llm = count(&|i| flagged[i]);
    let positives = count(&|i| labels[i] == 1);
    let hits = count(&|i| flagged[i] && labels[i] == 1);
    let ratio = |a: usize, b: usize| a as f64 / b.max(1) as f64;
    AtThreshold {
        threshold: match kind {
            RouterKind::R2r => threshold,
            RouterKind::Citer => 1.0 - threshold,
        },
        share: ratio(llm, scores.len()),
        recall: ratio(hits, positives),
        precision: ratio(hits, llm),
    }
}

/// PyTorch's default `nn.Linear` initialisation, U(±1/√fan_in) for weights and biases, from a
/// seeded generator (candle's CPU generator cannot be seeded).
fn initialise(varmap: &VarMap, seed: u64) -> candle_core::Result<()> {
    let vars = varmap.data().lock().expect("the var map is not shared");
    let mut names: Vec<&String> = vars.keys().collect();
    names.sort();
    let mut rng = StdRng::seed_from_u64(seed);
    for name in names {
        let Some(layer) = name.strip_suffix(".weight").or(name.strip_suffix(".bias")) else {
            continue;
        };
        let Some(weight) = vars.get(&format!("{layer}.weight")) else {
            continue;
        };
        let &[_, fan_in] = weight.dims() else {
            continue; // a norm's scale or shift keeps its constant start
        };
        let bound = 1.0 / (fan_in as f32).sqrt();
        let var = &vars[name];
        let values: Vec<f32> = (0..var.elem_count())
            .map(|_| rng.gen_range(-bound..bound))
            .collect();
        var.set(&Tensor::from_vec(values, var.shape(), &Device::Cpu)?)?;
    }
    Ok(())
}

fn snapshot(varmap: &VarMap) -> candle_core::Result<HashMap<String, Tensor>> {
    let vars = varmap.data().lock().expect("the var map is not shared");
    vars.iter()
        .map(|(name, var)| Ok((name.clone(), var.as_tensor().copy()?)))
        .collect()
}

/// Restores `weights`, rounded to f16 as they are saved, so what is measured is what ships.
fn restore_as_saved(varmap: &VarMap, weights: &HashMap<String, Tensor>) -> candle_core::Result<()> {
    let vars = varmap.data().lock().expect("the var map is not shared");
    for (name, var) in vars.iter() {
        var.set(&weights[name].to_dtype(DType::F16)?.to_dtype(DType::F32)?)?;
    }
    Ok(())
}

/// Trains a router on `traces`, writes it to `out` (safetensors, f16, with its `threshold`)
/// and reports how it separates the held-out rows.
pub fn train(traces: &Traces, settings: &TrainSettings, out: &Path) -> anyhow::Result<TrainReport> {
    let (mut fit, mut validation, mut heldout) = (Vec::new(), Vec::new(), Vec::new());
    let train_questions: Vec<u32> = (0..traces.rows())
        .filter(|&r| traces.heldout[r] == 0)
        .map(|r| traces.question[r])
        .collect::<BTreeSet<u32>>()
        .into_iter()
        .collect();
    for r in 0..traces.rows() {
        let position = train_questions.binary_search(&traces.question[r]).ok();
        match (traces.heldout[r], position) {
            (0, Some(p)) if p % 5 == 4 => validation.push(r),
            (0, _) => fit.push(r),
            _ => heldout.push(r),
        }
    }
    if fit.is_empty() || validation.is_empty() || heldout.is_empty() {
        bail!(
            "too few traces to train and evaluate ({} fitting, {} validation, {} held-out rows): \
             collect more questions",
            fit.len(),
            validation.len(),
            heldout.len()
        );
    }
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let hidden = traces.hidden_size;
    let net = match settings.kind {
        RouterKind::R2r => Net::R2r(R2rNet::new(vb, hidden, settings.width, settings.blocks)?),
        RouterKind::Citer => Net::Citer(CiterNet::new(vb, hidden)?),
    };
    initialise(&varmap, settings.seed)?;
    let trainable: Vec<Var> = {
        let vars = varmap.data().lock().expect("the var map is not shared");
        vars.iter()
            .filter(|(name, _)| !name.contains("running_"))
            .map(|(_, v)| v.clone())
            .collect()
    };
    let parameters = trainable.iter().map(|v| v.elem_count()).sum();
    let params = ParamsAdamW {
        lr: settings.learning_rate,
        weight_decay: 0.01,
        ..Default::default()
    };
    let mut optimizer = AdamW::new(trainable, params)?;
    let scale = (settings.kind == RouterKind::R2r && settings.standardize_inputs)
        .then(|| InputScale::fit(traces, &fit));
    let validation_batch = Batch::of(traces, settings.label, &validation, scale.as_ref())?;
    let mut rng = StdRng::seed_from_u64(settings.seed);
    let mut best: Option<(f64, usize, HashMap<String, Tensor>)> = None;
    for epoch in 1..=settings.epochs {
        fit.shuffle(&mut rng);
        for rows in fit.chunks(settings.batch) {
            let batch = Batch::of(traces, settings.label, rows, scale.as_ref())?;
            let (logits, target) = net.logits(&batch, rows.len() > 1)?;
            optimizer.backward_step(&bce_with_logits(&logits, &target)?)?;
        }
        let score = auc(
            &net.llm_scores(&validation_batch)?,
            &validation_batch.labels,
        );
        tracing::info!("epoch {epoch}: validation AUC {score:.4}");
        if best.as_ref().is_none_or(|(b, _, _)| score > *b) {
            best = Some((score, epoch, snapshot(&varmap)?));
        }
    }
    let (validation_auc, best_epoch, weights) = best.context("--epochs must be positive")?;
    let weights = match &scale {
        Some(scale) => scale.fold(weights)?,
        None => weights,
    };
    restore_as_saved(&varmap, &weights)?;
    // From here the router reads raw inputs, as it will when it serves.
    let validation_batch = Batch::of(traces, settings.label, &validation, None)?;
    let validation_labels = &validation_batch.labels;
    let validation_scores = net.llm_scores(&validation_batch)?;
    let share_threshold = threshold_for_share(&validation_scores, settings.target_share);
    let recall_threshold = threshold_for_recall(
        &validation_scores,
        validation_labels,
        settings.target_recall,
    );
    let heldout_batch = Batch::of(traces, settings.label, &heldout, None)?;
    let heldout_scores = net.llm_scores(&heldout_batch)?;
    let heldout_labels = &heldout_batch.labels;
    let share_rule = measure(
        settings.kind,
        &heldout_scores,
        heldout_labels,
        share_threshold,
    );
    let mut saved = snapshot(&varmap)?
        .into_iter()
        .map(|(name, t)| Ok((name, t.to_dtype(DType::F16)?)))
        .collect::<candle_core::Result<HashMap<_, _>>>()?;
    saved.insert(
        "threshold".into(),
        Tensor::new(&[share_rule.threshold], &Device::Cpu)?,
    );
    candle_core::safetensors::save(&saved, out)
        .with_context(|| format!("cannot write the router to {}", out.display()))?;
    Ok(TrainReport {
        kind: settings.kind,
        label: settings.label,
        parameters,
        rows: [fit.len(), validation.len(), heldout.len()],
        heldout_label_rate: heldout_labels.iter().map(|&l| l as f64).sum::<f64>()
            / heldout_labels.len() as f64,
        best_epoch,
        validation_auc,
        heldout_auc: auc(&heldout_scores, heldout_labels),
        share_rule,
        recall_rule: measure(
            settings.kind,
            &heldout_scores,
            heldout_labels,
            recall_threshold,
        ),
    })
}

pub fn markdown(report: &TrainReport) -> String {
    let [fit, validation, heldout] = report.rows;
    let mut out = format!(
        "{:?} router ({:?} label), {} parameters; rows: {fit} fitting, {validation} \
         validation, {heldout} held out ({:.1} % of them label 1)\n\nbest epoch {}: validation AUC {:.3}, held-out \
         AUC {:.3}\n\n| rule | threshold | held-out LLM share | recall | precision |\n\
         |---|---:|---:|---:|---:|\n",
        report.kind,
        report.label,
        report.parameters,
        100.0 * report.heldout_label_rate,
        report.best_epoch,
        report.validation_auc,
        report.heldout_auc,
    );
    for (rule, at) in [
        ("target share (shipped)", &report.share_rule),
        ("target recall", &report.recall_rule),
    ] {
        out += &format!(
            "| {rule} | {:.4} | {:.1} % | {:.1} % | {:.1} % |\n",
            at.threshold,
            100.0 * at.share,
            100.0 * at.recall,
            100.0 * at.precision
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenrouter::policy::learned::{CiterRouter, HiddenScorer, R2rRouter};

    const HIDDEN: usize = 8;

    /// 40 questions of 3 positions each, the second half held out; label 1 where the first
    /// hidden feature is positive, so a router can learn it (the other inputs are weak noise).
    fn synthetic_traces() -> Traces {
        let mut rng = StdRng::seed_from_u64(7);
        let rows = 120;
        let mut uniform =
            |n: usize| -> Vec<f32> { (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect() };
        let hidden = uniform(rows * HIDDEN);
        let label: Vec<u8> = (0..rows)
            .map(|r| u8::from(hidden[r * HIDDEN] > 0.0))
            .collect();
        Traces {
            hidden_size: HIDDEN,
            embedding: uniform(rows * HIDDEN),
            top_logits: uniform(rows * R2R_TOP_K).iter().map(|v| 0.05 * v).collect(),
            token: (0..rows as u32).collect(),
            divergent: label.clone(),
            label,
            heldout: (0..rows).map(|r| u8::from(r >= rows / 2)).collect(),
            question: (0..rows as u32).map(|r| r / 3).collect(),
            hidden,
        }
    }

    fn settings(kind: RouterKind) -> TrainSettings {
        TrainSettings {
            kind,
            label: Label::Divergent,
            width: 16,
            blocks: 2,
            epochs: 150,
            batch: 8,
            learning_rate: 3e-3,
            seed: 1,
            target_share: 0.5,
            target_recall: 0.95,
            standardize_inputs: kind == RouterKind::R2r,
        }
    }

    fn rows(traces: &Traces, heldout: u8) -> Vec<usize> {
        (0..traces.rows())
            .filter(|&r| traces.heldout[r] == heldout)
            .collect()
    }

    #[test]
    fn a_trained_r2r_router_loads_and_scores_as_it_was_trained_with_its_threshold() {
        let traces = synthetic_traces();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r2r.safetensors");
        let report = train(&traces, &settings(RouterKind::R2r), &path).unwrap();
        assert!(report.heldout_auc > 0.8, "learnable label: {report:?}");
        let router = R2rRouter::load(&path, HIDDEN).unwrap();
        assert_eq!(router.threshold, Some(report.share_rule.threshold));
        let heldout = rows(&traces, 1);
        let pick = |data: &[f32], width: usize| -> Vec<f32> {
            heldout
                .iter()
                .flat_map(|&r| data[r * width..(r + 1) * width].to_vec())
                .collect()
        };
        let served = router.score(
            &pick(&traces.hidden, HIDDEN),
            &pick(&traces.embedding, HIDDEN),
            &pick(&traces.top_logits, R2R_TOP_K),
        );
        let flagged = served
            .iter()
            .filter(|&&p| p >= router.threshold.unwrap())
            .count();
        let share = flagged as f64 / served.len() as f64;
        assert!(
            (share - report.share_rule.share).abs() < 0.02,
            "{share} {report:?}"
        );
        assert_eq!(
            auc(&served, &traces.label[heldout[0]..]),
            report.heldout_auc
        );
    }

    #[test]
    fn a_trained_citer_router_loads_with_its_batch_norm_and_inverted_threshold() {
        let traces = synthetic_traces();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("citer.safetensors");
        let report = train(&traces, &settings(RouterKind::Citer), &path).unwrap();
        assert!(report.heldout_auc > 0.8, "learnable label: {report:?}");
        let router = CiterRouter::load(&path, HIDDEN).unwrap();
        assert_eq!(router.threshold(), Some(report.share_rule.threshold));
        let heldout = rows(&traces, 1);
        let hidden: Vec<f32> = heldout
            .iter()
            .flat_map(|&r| traces.hidden[r * HIDDEN..(r + 1) * HIDDEN].to_vec())
            .collect();
        let confidence = router.score(&hidden);
        let to_llm = confidence
            .iter()
            .filter(|&&c| c < report.share_rule.threshold)
            .count();
        let share = to_llm as f64 / confidence.len() as f64;
        assert!(
            (share - report.share_rule.share).abs() < 0.02,
            "{share} {report:?}"
        );
        let llm_scores: Vec<f32> = confidence.iter().map(|c| 1.0 - c).collect();
        let served_auc = auc(&llm_scores, &traces.label[heldout[0]..]);
        assert!(
            (served_auc - report.heldout_auc).abs() < 1e-3,
            "{served_auc} {report:?}"
        );
    }

    #[test]
    fn too_few_questions_to_validate_is_a_clear_error() {
        let mut traces = synthetic_traces();
        traces.question.iter_mut().for_each(|q| *q %= 4);
        let dir = tempfile::tempdir().unwrap();
        let err = train(&traces, &settings(RouterKind::R2r), &dir.path().join("x"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("collect more questions"), "{err}");
    }

    /// A layer folded with a standardisation reads raw rows as the unfolded one reads them
    /// standardised (per feature, and relative to each row's first value).
    #[test]
    fn a_folded_standardisation_reads_raw_inputs_exactly() {
        let data: Vec<f32> = (0..24).map(|i| ((i * 7 % 11) as f32) * 1.5 - 3.0).collect();
        let (width, rows) = (4, [0, 1, 2, 3, 4, 5]);
        for relative in [false, true] {
            let standard = Standard::fit(&data, width, &rows, relative);
            // Two outputs over [2 leading columns, the 4 standardised features].
            let in_width = 2 + width;
            let w: Vec<f32> = (0..2 * in_width).map(|i| (i as f32 * 0.37).sin()).collect();
            let b = vec![0.5f32, -1.0];
            let (mut folded_w, mut folded_b) = (w.clone(), b.clone());
            standard.fold(&mut folded_w, in_width, 2, &mut folded_b);
            for r in rows {
                let raw = &data[r * width..(r + 1) * width];
                let lead = [0.25f32, -2.0];
                let standardised: Vec<f32> =
                    lead.iter().copied().chain(standard.apply(raw)).collect();
                let as_read: Vec<f32> = lead.iter().chain(raw).copied().collect();
                for o in 0..2 {
                    let dot = |w: &[f32], x: &[f32], b: f32| {
                        b + w[o * in_width..(o + 1) * in_width]
                            .iter()
                            .zip(x)
                            .map(|(w, x)| w * x)
                            .sum::<f32>()
                    };
                    let want = dot(&w, &standardised, b[o]);
                    let got = dot(&folded_w, &as_read, folded_b[o]);
                    assert!(
                        (want - got).abs() < 1e-4,
                        "relative {relative}: {want} {got}"
                    );
                }
            }
        }
    }

    #[test]
    fn auc_is_one_when_every_positive_outranks_every_negative_and_half_for_ties() {
        assert_eq!(auc(&[0.1, 0.2, 0.8, 0.9], &[0, 0, 1, 1]), 1.0);
        assert_eq!(auc(&[0.9, 0.8, 0.2, 0.1], &[0, 0, 1, 1]), 0.0);
        assert_eq!(auc(&[0.5, 0.5, 0.5, 0.5], &[0, 1, 0, 1]), 0.5);
        assert_eq!(auc(&[0.1, 0.4, 0.35, 0.8], &[0, 0, 1, 1]), 0.75);
    }

    #[test]
    fn thresholds_meet_their_share_and_recall() {
        let scores = [0.9, 0.1, 0.7, 0.3, 0.5, 0.2, 0.8, 0.4, 0.6, 0.0];
        let labels = [1, 0, 1, 0, 0, 0, 1, 1, 0, 0];
        let t = threshold_for_share(&scores, 0.3);
        assert_eq!(t, 0.7);
        let at = measure(RouterKind::R2r, &scores, &labels, t);
        assert_eq!((at.share, at.recall, at.precision), (0.3, 0.75, 1.0));
        let t = threshold_for_recall(&scores, &labels, 1.0);
        assert_eq!(t, 0.4);
        let citer = measure(RouterKind::Citer, &scores, &labels, t);
        assert_eq!((citer.threshold, citer.recall), (0.6, 1.0));
    }
}

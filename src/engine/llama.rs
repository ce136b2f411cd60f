//! The llama / qwen2 / qwen3 / gemma3 decoder, batched over ragged sequences. All rows of a
//! step go through each weight matmul together (`[rows, hidden] × Wᵀ`); attention runs per
//! sequence over its own KV. Sequences at different lengths share a step without padding.

use super::attention::{HeadBlocks, HeadRows, KvRows, Vectors};
use super::kv::{BlockId, KvStore, SeqId, SlidingWindow, BLOCK_TOKENS};
use super::kv_blocks::KvBlocks;
use super::ops;
use super::parallel;
use super::qmatmul::{Kernel, QWeight};
use super::weights::{Hyperparams, LayerWeights, ModelWeights};
use crate::error::{EngineError, EngineResult};
use std::ops::Range;

pub struct LlamaModel {
    pub weights: ModelWeights,
    /// Inverse rope frequency per pair of head dimensions.
    inv_freq: Vec<f32>,
    /// The sliding-window layers' own frequencies (Gemma 3's local rope base).
    local_inv_freq: Option<Vec<f32>>,
    /// The integer matmul kernel; the fastest this CPU has unless chosen.
    pub kernel: Kernel,
    /// Attention's registers (its floats are the same on every set), the widest here.
    vectors: Vectors,
}

/// The last position of one sequence after a step.
pub struct LastPosition {
    /// Final hidden state after the output norm, `[hidden]`.
    pub hidden: Vec<f32>,
    /// `[vocab]`.
    pub logits: Vec<f32>,
}

/// Where one sequence's rows sit in the step's row matrix.
pub struct Segment {
    pub first_row: usize,
    pub rows: usize,
    pub first_position: usize,
}

/// Runs a prompt's rows are cut into for attention (later rows attend to more positions, so
/// several runs per thread let the pool balance them), each of at least `MIN_ROWS_PER_RUN`.
const ROW_RUNS_PER_PROMPT: usize = 8;
const MIN_ROWS_PER_RUN: usize = 16;

/// Where a step's rows go: per row its position and rotation; per sequence its rows and KV
/// blocks.
struct StepShape {
    segments: Vec<Segment>,
    tables: Vec<Vec<BlockId>>,
    rotations: Rotations,
    /// The sliding-window layers' rotations, where their rope base differs.
    local_rotations: Option<Rotations>,
}

/// Each row's rope angles' cosines and sines, `[rows, head_dim / 2]` each: the same for
/// every layer and for queries and keys, so computed once per step, not 2 · layers times.
struct Rotations {
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Rotations {
    fn new(positions: impl Iterator<Item = usize>, inv_freq: &[f32]) -> Self {
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for position in positions {
            for &frequency in inv_freq {
                let (s, c) = (position as f32 * frequency).sin_cos();
                cos.push(c);
                sin.push(s);
            }
        }
        Self { cos, sin }
    }
}

/// Inverse rope frequency per pair of head dimensions for rope base `theta` (with Llama 3.1's
/// divisors if any).
pub fn inverse_frequencies(weights: &ModelWeights, theta: f32) -> Vec<f32> {
    let hp = &weights.hp;
    (0..hp.head_dim / 2)
        .map(|i| {
            let base = 1f32 / theta.powf((2 * i) as f32 / hp.head_dim as f32);
            match &weights.rope_freq_divisors {
                Some(div) => base / div[i],
                None => base,
            }
        })
        .collect()
}

/// Row `token` of a row-major `[vocab, hidden]` embedding table.
pub fn embedding_row(embedding: &[f32], hidden: usize, token: u32) -> &[f32] {
    let t = token as usize;
    &embedding[t * hidden..(t + 1) * hidden]
}

/// What the embedding rows are multiplied by: Gemma scales them by √hidden, as it was
/// trained; other models take them as they are.
pub fn embedding_scale(hp: &Hyperparams) -> f32 {
    match hp.gemma {
        Some(_) => (hp.hidden as f32).sqrt(),
        None => 1.0,
    }
}

/// The input rows of `tokens`, one after another: `[tokens, hidden]`.
fn embed_tokens(embedding: &[f32], hp: &Hyperparams, tokens: &[u32]) -> Vec<f32> {
    let hidden = hp.hidden;
    let mut x = Vec::with_capacity(tokens.len() * hidden);
    for &t in tokens {
        x.extend_from_slice(embedding_row(embedding, hidden, t));
    }
    let scale = embedding_scale(hp);
    if scale != 1.0 {
        x.iter_mut().for_each(|v| *v *= scale);
    }
    x
}

/// `x / rms(x) · weight` per row of `hidden`, into a new matrix (runs of a long input in
/// parallel).
fn rms_norm_rows(x: &[f32], hidden: usize, weight: &[f32], eps: f32) -> Vec<f32> {
    let mut out = x.to_vec();
    parallel::for_each_row_run(&mut out, hidden, |_, run| {
        ops::rms_norm_rows_in_place(run, weight, eps)
    });
    out
}

/// `x += y`, both `[rows, hidden]` (runs of a long input in parallel).
fn add_rows(x: &mut [f32], hidden: usize, y: &[f32]) {
    parallel::for_each_row_run(x, hidden, |first, run| {
        ops::add_in_place(run, &y[first * hidden..first * hidden + run.len()])
    });
}

/// Checks a step's batch against the model and the KV it holds, and lays its sequences out as
/// consecutive row segments. Touches nothing: every backend calls this before reserving KV.
pub fn plan_step(
    hp: &Hyperparams,
    kv: &KvStore,
    batch: &[(SeqId, &[u32])],
) -> EngineResult<Vec<Segment>> {
    let mut segments = Vec::with_capacity(batch.len());
    let mut total_rows = 0;
    for (i, &(seq, tokens)) in batch.iter().enumerate() {
        if tokens.is_empty() {
            return Err(EngineError::InvalidStep(format!(
                "sequence {seq} has no tokens"
            )));
        }
        if batch[..i].iter().any(|&(other, _)| other == seq) {
            return Err(EngineError::InvalidStep(format!(
                "sequence {seq} appears twice"
            )));
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= hp.vocab) {
            return Err(EngineError::InvalidStep(format!(
                "token {bad} is outside the vocabulary of {}",
                hp.vocab
            )));
        }
        let first_position = kv.seq_len(seq);
        if first_position + tokens.len() > hp.context {
            return Err(EngineError::ContextOverflow {
                position: first_position + tokens.len(),
                context: hp.context,
            });
        }
        segments.push(Segment {
            first_row: total_rows,
            rows: tokens.len(),
            first_position,
        });
        total_rows += tokens.len();
    }
    Ok(segments)
}

impl LlamaModel {
    pub fn new(weights: ModelWeights) -> Self {
        let inv_freq = inverse_frequencies(&weights, weights.hp.rope_theta);
        let local_inv_freq = weights
            .hp
            .gemma
            .map(|g| inverse_frequencies(&weights, g.local_rope_theta));
        Self {
            weights,
            inv_freq,
            local_inv_freq,
            kernel: Kernel::detect(),
            vectors: Vectors::detect(),
        }
    }

    pub fn kv_dim(&self) -> usize {
        self.weights.hp.kv_heads * self.weights.hp.head_dim
    }

    pub fn layer_count(&self) -> usize {
        self.weights.layers.len()
    }

    /// Per layer, whether it attends over a sliding window only.
    pub fn local_layers(&self) -> Vec<bool> {
        self.weights
            .layers
            .iter()
            .map(|l| l.window.is_some())
            .collect()
    }

    /// The layers that keep only a window of positions, as the block manager prices them.
    pub fn sliding_window(&self) -> Option<SlidingWindow> {
        let local = self.local_layers();
        let local_layers = local.iter().filter(|&&l| l).count();
        let window = self.weights.layers.iter().find_map(|l| l.window)?;
        Some(SlidingWindow {
            window,
            layers: local.len(),
            local_layers,
        })
    }

    /// Appends each sequence's tokens to its KV and returns its last position's outputs.
    /// Validation and KV reservation happen first, so an error leaves every sequence as it was.
    pub fn forward(
        &self,
        kv: &mut KvStore,
        data: &mut KvBlocks,
        batch: &[(SeqId, &[u32])],
    ) -> EngineResult<Vec<LastPosition>> {
        let hp = &self.weights.hp;
        let segments = plan_step(hp, kv, batch)?;
        let reservations: Vec<(SeqId, usize)> =
            batch.iter().map(|&(seq, t)| (seq, t.len())).collect();
        kv.reserve(&reservations)?;
        for id in kv.take_evicted_local() {
            data.free_local(id);
        }
        let tokens: Vec<u32> = batch.iter().flat_map(|&(_, t)| t.iter().copied()).collect();
        let positions = || {
            segments
                .iter()
                .flat_map(|s| s.first_position..s.first_position + s.rows)
        };
        let shape = StepShape {
            rotations: Rotations::new(positions(), &self.inv_freq),
            local_rotations: self
                .local_inv_freq
                .as_ref()
                .map(|f| Rotations::new(positions(), f)),
            tables: batch
                .iter()
                .map(|&(seq, _)| kv.table(seq).to_vec())
                .collect(),
            segments,
        };

        let mut x = embed_tokens(&self.weights.embedding, hp, &tokens);
        for (layer_idx, layer) in self.weights.layers.iter().enumerate() {
            self.layer(layer_idx, layer, &mut x, &shape, data);
        }
        let segments = shape.segments;
        for &(seq, t) in batch {
            kv.advance(seq, t);
        }

        let mut last: Vec<f32> = Vec::with_capacity(segments.len() * hp.hidden);
        for s in &segments {
            let row = s.first_row + s.rows - 1;
            last.extend_from_slice(&x[row * hp.hidden..(row + 1) * hp.hidden]);
        }
        ops::rms_norm_rows_in_place(&mut last, &self.weights.final_norm, hp.rms_eps);
        let logits = self
            .weights
            .lm_head
            .matmul_with(self.kernel, &last, segments.len());
        Ok(last
            .chunks(hp.hidden)
            .zip(logits.chunks(hp.vocab))
            .map(|(h, l)| LastPosition {
                hidden: h.to_vec(),
                logits: l.to_vec(),
            })
            .collect())
    }

    pub fn embedding_row(&self, token: u32) -> &[f32] {
        embedding_row(&self.weights.embedding, self.weights.hp.hidden, token)
    }

    fn layer(
        &self,
        layer_idx: usize,
        w: &LayerWeights,
        x: &mut [f32],
        shape: &StepShape,
        data: &mut KvBlocks,
    ) {
        let hp = &self.weights.hp;
        let rows = x.len() / hp.hidden;
        let h = rms_norm_rows(x, hp.hidden, &w.attn_norm, hp.rms_eps);
        let [mut q, mut k, mut v] =
            QWeight::matmul_each_with(self.kernel, [&w.wq, &w.wk, &w.wv], &h, rows);
        for (t, bias) in [(&mut q, &w.bq), (&mut k, &w.bk), (&mut v, &w.bv)] {
            if let Some(bias) = bias {
                ops::add_bias_rows(t, bias);
            }
        }
        if let Some(norm) = &w.q_norm {
            ops::rms_norm_rows_in_place(&mut q, norm, hp.rms_eps);
        }
        if let Some(norm) = &w.k_norm {
            ops::rms_norm_rows_in_place(&mut k, norm, hp.rms_eps);
        }
        let rotations = match (&w.window, &shape.local_rotations) {
            (Some(_), Some(local)) => local,
            _ => &shape.rotations,
        };
        self.rope(&mut q, rotations);
        self.rope(&mut k, rotations);
        let (segments, tables) = (&shape.segments, &shape.tables);

        let kv_dim = self.kv_dim();
        for (s, table) in segments.iter().zip(tables) {
            for i in 0..s.rows {
                let (row, position) = (s.first_row + i, s.first_position + i);
                let span = row * kv_dim..(row + 1) * kv_dim;
                let block = table[position / BLOCK_TOKENS];
                let slot = position % BLOCK_TOKENS;
                data.write(block, layer_idx, slot, &k[span.clone()], &v[span]);
            }
        }
        let attn = self.attention(layer_idx, w.window, &q, segments, tables, data);
        let attn = w.wo.matmul_with(self.kernel, &attn, rows);
        add_rows(x, hp.hidden, &self.post_norm(attn, &w.post_attn_norm));

        let h = rms_norm_rows(x, hp.hidden, &w.ffn_norm, hp.rms_eps);
        let [mut gate, up] = QWeight::matmul_each_with(self.kernel, [&w.w_gate, &w.w_up], &h, rows);
        let ffn = gate.len() / rows;
        let gated = if hp.gemma.is_some() {
            ops::gelu_tanh_mul_in_place
        } else {
            ops::silu_mul_in_place
        };
        parallel::for_each_row_run(&mut gate, ffn, |first, run| {
            gated(run, &up[first * ffn..first * ffn + run.len()])
        });
        let down = w.w_down.matmul_with(self.kernel, &gate, rows);
        add_rows(x, hp.hidden, &self.post_norm(down, &w.post_ffn_norm));
    }

    /// A sublayer's output normed before its residual add where the model has such a norm
    /// (Gemma 3), as it is otherwise.
    fn post_norm(&self, mut out: Vec<f32>, norm: &Option<Vec<f32>>) -> Vec<f32> {
        if let Some(norm) = norm {
            let hidden = self.weights.hp.hidden;
            parallel::for_each_row_run(&mut out, hidden, |_, run| {
                ops::rms_norm_rows_in_place(run, norm, self.weights.hp.rms_eps)
            });
        }
        out
    }

    /// Rotates every head of every row by its position.
    fn rope(&self, x: &mut [f32], rotations: &Rotations) {
        let hd = self.weights.hp.head_dim;
        let half = hd / 2;
        let row_len = x.len() / (rotations.cos.len() / half);
        let interleaved = self.weights.hp.rope_interleaved;
        parallel::for_each_row_run(x, row_len, |first, run| {
            let angles = first * half..first * half + run.len() / row_len * half;
            let cos = rotations.cos[angles.clone()].chunks_exact(half);
            let sin = rotations.sin[angles].chunks_exact(half);
            for ((row, cos), sin) in run.chunks_exact_mut(row_len).zip(cos).zip(sin) {
                for head in row.chunks_exact_mut(hd) {
                    for i in 0..half {
                        let (a, b) = if interleaved {
                            (2 * i, 2 * i + 1)
                        } else {
                            (i, i + half)
                        };
                        let (x0, x1) = (head[a], head[b]);
                        head[a] = x0 * cos[i] - x1 * sin[i];
                        head[b] = x0 * sin[i] + x1 * cos[i];
                    }
                }
            }
        });
    }

    /// Causal attention of each sequence's new rows over its KV (the last `window` positions
    /// of it, for a sliding-window layer), `[rows, heads * hd]`.
    /// A task (sequence, KV head, run of rows) serves its whole query group from that KV
    /// head's rows: read in place for one row, widened once for more (`attention`); per head
    /// the arithmetic is the same as alone.
    fn attention(
        &self,
        layer_idx: usize,
        window: Option<usize>,
        q: &[f32],
        segments: &[Segment],
        tables: &[Vec<BlockId>],
        data: &KvBlocks,
    ) -> Vec<f32> {
        let hp = &self.weights.hp;
        let (hd, heads) = (hp.head_dim, hp.heads);
        let group = heads / hp.kv_heads;
        let q_dim = heads * hd;
        let kv_dim = self.kv_dim();
        let scale = 1.0 / (hd as f32).sqrt();
        let vectors = self.vectors;
        // A task is one KV head over a run of one sequence's rows: a long prompt's rows are
        // split, so its few KV heads (3 here) still spread evenly over the threads.
        let tasks: Vec<(usize, usize, Range<usize>)> = segments
            .iter()
            .enumerate()
            .flat_map(|(s, seg)| {
                let run = seg.rows.div_ceil(ROW_RUNS_PER_PROMPT).max(MIN_ROWS_PER_RUN);
                (0..seg.rows.div_ceil(run)).flat_map(move |r| {
                    let rows = r * run..((r + 1) * run).min(seg.rows);
                    (0..hp.kv_heads).map(move |kv_head| (s, kv_head, rows.clone()))
                })
            })
            .collect();
        // Per task `[rows, group, hd]`.
        let per_task: Vec<Vec<f32>> = parallel::map_indices(tasks.len(), |task| {
            let (s, kv_head, ref rows) = tasks[task];
            let seg = &segments[s];
            let table = &tables[s];
            let kv_off = kv_head * hd;
            let first_head = kv_head * group;
            let mut out = vec![0f32; rows.len() * group * hd];
            // A window's rows read from the block holding the run's first visible position:
            // the blocks before it may have been freed.
            let visible_from = |i: usize| {
                let seen = seg.first_position + i + 1;
                window.map_or(0, |w| seen.saturating_sub(w))
            };
            let skipped = visible_from(rows.start) / BLOCK_TOKENS;
            let base = skipped * BLOCK_TOKENS;
            let blocks = || {
                table[skipped..]
                    .iter()
                    .map(|&b| (data.keys(b, layer_idx), data.values(b, layer_idx)))
            };
            let held = seg.first_position + rows.end - base;
            let query_rows = rows
                .clone()
                .zip(out.chunks_exact_mut(group * hd))
                .map(|(i, out)| {
                    let start = (seg.first_row + i) * q_dim + first_head * hd;
                    let seen = seg.first_position + i + 1;
                    (
                        &q[start..start + group * hd],
                        visible_from(i) - base..seen - base,
                        out,
                    )
                });
            // One row reads the cache in place; more share one widened copy.
            let in_place = (rows.len() == 1)
                .then(|| HeadBlocks::new(blocks(), (kv_dim, kv_off), hd, held))
                .flatten();
            match in_place {
                Some(in_place) => in_place.attend(vectors, scale, query_rows),
                None => HeadRows::widen(blocks(), (kv_dim, kv_off), hd, held)
                    .attend(vectors, scale, query_rows),
            }
            out
        });
        let rows: usize = segments.iter().map(|s| s.rows).sum();
        let mut attn = vec![0f32; rows * q_dim];
        for ((s, kv_head, rows), out) in tasks.iter().zip(per_task) {
            let row_span = group * hd;
            let first = kv_head * row_span;
            for (i, o) in rows.clone().zip(out.chunks(row_span)) {
                let row = segments[*s].first_row + i;
                attn[row * q_dim + first..row * q_dim + first + row_span].copy_from_slice(o);
            }
        }
        attn
    }
}

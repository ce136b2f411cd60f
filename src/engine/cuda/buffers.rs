//! The device buffers a step reads and writes, allocated per step shape: an eager step gets
//! its own, a captured decode graph keeps one set for every replay (its kernels' arguments
//! point into them).

use super::launch::{AttentionRows, Gpu};
use super::matrix::ActivationScratch;
use super::DeviceModel;
use crate::engine::step_inputs::{InputsLayout, StepInputs};
use crate::error::EngineResult;
use cudarc::driver::{CudaSlice, CudaView};

/// A step's packed integer inputs (`engine::step_inputs`) on the device.
pub struct DeviceInputs {
    data: CudaSlice<i32>,
    layout: InputsLayout,
}

impl DeviceInputs {
    pub fn upload(gpu: &Gpu, inputs: &StepInputs) -> EngineResult<Self> {
        Ok(Self {
            data: gpu.upload(&inputs.packed)?,
            layout: inputs.layout,
        })
    }

    /// Overwrites the inputs with a step of the same layout (one copy).
    pub fn refill(&mut self, gpu: &Gpu, inputs: &StepInputs) -> EngineResult<()> {
        debug_assert_eq!(
            inputs.layout, self.layout,
            "a graph's inputs keep their layout"
        );
        gpu.upload_into(&inputs.packed, &mut self.data)
    }

    pub fn rows(&self) -> usize {
        self.layout.rows
    }

    pub fn tokens(&self) -> CudaView<'_, i32> {
        self.data.slice(self.layout.tokens())
    }

    pub fn positions(&self) -> CudaView<'_, i32> {
        self.data.slice(self.layout.positions())
    }

    pub fn slots(&self) -> CudaView<'_, i32> {
        self.data.slice(self.layout.slots())
    }

    pub fn attention(&self) -> AttentionRows<'_> {
        AttentionRows {
            positions: self.positions(),
            row_tables: self.data.slice(self.layout.row_tables()),
            block_table: self.data.slice(self.layout.block_tables()),
        }
    }
}

/// The activations of `rows` rows through the decoder stack.
pub struct StepBuffers {
    pub rows: usize,
    /// The residual stream `[rows, hidden]`.
    pub x: CudaSlice<f32>,
    /// A normed copy of it `[rows, hidden]` (a sublayer's input, or a normed output).
    pub h: CudaSlice<f32>,
    /// The stacked q/k/v projection's output `[rows, (heads + 2 · kv_heads) · head_dim]`.
    pub qkv: CudaSlice<f32>,
    /// The rotated queries `[rows, heads · head_dim]`.
    pub q: CudaSlice<f32>,
    /// The attention's output `[rows, heads · head_dim]`.
    pub attn: CudaSlice<f32>,
    /// An output projection before its post-norm `[rows, hidden]` (Gemma 3).
    pub proj: CudaSlice<f32>,
    /// The stacked gate/up projection's output `[rows, 2 · intermediate]`.
    pub gate_up: CudaSlice<f32>,
    /// The gated activations `[rows, intermediate]`, where materialized (a dense down
    /// projection).
    pub act: CudaSlice<f32>,
    pub scratch: ActivationScratch,
}

impl StepBuffers {
    pub fn new(model: &DeviceModel, rows: usize) -> EngineResult<Self> {
        let (hp, gpu) = (&model.hp, &model.gpu);
        let q_dim = hp.heads * hp.head_dim;
        let kv_dim = hp.kv_heads * hp.head_dim;
        let k_max = hp.hidden.max(q_dim).max(hp.intermediate);
        Ok(Self {
            rows,
            x: gpu.zeros(rows * hp.hidden)?,
            h: gpu.zeros(rows * hp.hidden)?,
            qkv: gpu.zeros(rows * (q_dim + 2 * kv_dim))?,
            q: gpu.zeros(rows * q_dim)?,
            attn: gpu.zeros(rows * q_dim)?,
            proj: gpu.zeros(rows * hp.hidden)?,
            gate_up: gpu.zeros(rows * 2 * hp.intermediate)?,
            act: gpu.zeros(rows * hp.intermediate)?,
            scratch: ActivationScratch::new(gpu, model.matrices(), rows, k_max)?,
        })
    }
}

/// The output head's results for `seqs` sequences.
pub struct HeadBuffers {
    /// `[seqs, hidden]` after the final norm.
    pub normed: CudaSlice<f32>,
    pub logits: CudaSlice<f32>,
    /// `[seqs, 3]`: max, Z', Σ e·shift (see `kernels/sampling.cu`).
    pub stats: CudaSlice<f32>,
    pub argmax: CudaSlice<i32>,
}

impl HeadBuffers {
    pub fn new(model: &DeviceModel, seqs: usize) -> EngineResult<Self> {
        let (hp, gpu) = (&model.hp, &model.gpu);
        Ok(Self {
            normed: gpu.zeros(seqs * hp.hidden)?,
            logits: gpu.zeros(seqs * hp.vocab)?,
            stats: gpu.zeros(seqs * 3)?,
            argmax: gpu.zeros(seqs)?,
        })
    }
}

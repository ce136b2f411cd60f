//! The device side of the KV cache: one pool of fixed-size blocks per model (keys and values,
//! every layer), indexed by the `BlockId`s of the model's `KvStore`, which keeps the budget,
//! the lengths, each sequence's block table and the prefix cache, as for every backend. This
//! file only maps positions to device slots and carries out the block copies it asks for.

use super::launch::Gpu;
use crate::engine::kv::{BlockCopy, BLOCK_TOKENS};
use crate::error::EngineResult;
use cudarc::driver::CudaSlice;

pub struct PagedKv {
    /// `[layers, blocks · BLOCK_TOKENS, kv_dim]`, f16 bits (as the CPU cache: the same
    /// rounding on both devices).
    pub keys: CudaSlice<u16>,
    pub values: CudaSlice<u16>,
    layers: usize,
    kv_dim: usize,
    blocks: usize,
}

impl PagedKv {
    /// A pool of `blocks` blocks, the budget `KvStore` enforces.
    pub fn new(gpu: &Gpu, layers: usize, kv_dim: usize, blocks: usize) -> EngineResult<Self> {
        let elements = layers * blocks * BLOCK_TOKENS * kv_dim;
        Ok(Self {
            keys: gpu.zeros(elements)?,
            values: gpu.zeros(elements)?,
            layers,
            kv_dim,
            blocks,
        })
    }

    /// Floats between one layer's cache and the next.
    pub fn layer_stride(&self) -> usize {
        self.blocks * BLOCK_TOKENS * self.kv_dim
    }

    /// Copies a whole block (the positions past `copy.positions` are never read: the
    /// target's sequence appends over them).
    pub fn copy(&mut self, gpu: &Gpu, copy: BlockCopy) -> EngineResult<()> {
        let stride = self.layer_stride();
        gpu.kv_copy_blocks(
            &mut self.keys,
            &mut self.values,
            &[copy.from as i32],
            &[copy.to as i32],
            self.layers,
            stride,
            self.kv_dim,
        )
    }
}

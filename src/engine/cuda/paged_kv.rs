//! The device side of the KV cache: one pool of fixed-size blocks per model (keys and values,
//! every layer), and per sequence the table of blocks it owns. `KvStore` keeps the budget and
//! the lengths, as for every backend; this file only maps positions to device slots, so a
//! sequence that leaves and comes back keeps its blocks and appends where it stopped.

use super::launch::Gpu;
use crate::engine::kv::{SeqId, BLOCK_TOKENS};
use crate::error::{EngineError, EngineResult};
use cudarc::driver::CudaSlice;
use std::collections::HashMap;

pub struct PagedKv {
    /// `[layers, blocks · BLOCK_TOKENS, kv_dim]`, f16 bits (as the CPU cache: the same
    /// rounding on both devices).
    pub keys: CudaSlice<u16>,
    pub values: CudaSlice<u16>,
    layers: usize,
    kv_dim: usize,
    blocks: usize,
    free: Vec<i32>,
    tables: HashMap<SeqId, Vec<i32>>,
}

impl PagedKv {
    /// A pool of `kv_tokens` (rounded up to whole blocks), as the budget `KvStore` enforces.
    pub fn new(gpu: &Gpu, layers: usize, kv_dim: usize, kv_tokens: usize) -> EngineResult<Self> {
        let blocks = kv_tokens.div_ceil(BLOCK_TOKENS);
        let elements = layers * blocks * BLOCK_TOKENS * kv_dim;
        Ok(Self {
            keys: gpu.zeros(elements)?,
            values: gpu.zeros(elements)?,
            layers,
            kv_dim,
            blocks,
            free: (0..blocks as i32).rev().collect(),
            tables: HashMap::new(),
        })
    }

    /// Floats between one layer's cache and the next.
    pub fn layer_stride(&self) -> usize {
        self.blocks * BLOCK_TOKENS * self.kv_dim
    }

    /// Gives `seq` blocks for its first `positions` positions (after `KvStore::reserve`
    /// accepted them, so the pool has them).
    pub fn ensure(&mut self, seq: SeqId, positions: usize) -> EngineResult<()> {
        let table = self.tables.entry(seq).or_default();
        while table.len() * BLOCK_TOKENS < positions {
            let block = self.free.pop().ok_or_else(|| {
                EngineError::Gpu("KV block pool and KV budget disagree (no free block)".into())
            })?;
            table.push(block);
        }
        Ok(())
    }

    pub fn table(&self, seq: SeqId) -> &[i32] {
        self.tables.get(&seq).map_or(&[], Vec::as_slice)
    }

    /// The device slot (row of a layer's cache) of `seq`'s position `position`.
    pub fn slot(&self, seq: SeqId, position: usize) -> i32 {
        self.table(seq)[position / BLOCK_TOKENS] * BLOCK_TOKENS as i32
            + (position % BLOCK_TOKENS) as i32
    }

    /// `dst` gets blocks for `len` positions holding copies of `src`'s.
    pub fn fork_prefix(
        &mut self,
        gpu: &Gpu,
        src: SeqId,
        dst: SeqId,
        len: usize,
    ) -> EngineResult<()> {
        self.ensure(dst, len)?;
        let used = len.div_ceil(BLOCK_TOKENS);
        let from = self.table(src)[..used].to_vec();
        let to = self.table(dst)[..used].to_vec();
        if used == 0 {
            return Ok(());
        }
        let stride = self.layer_stride();
        gpu.kv_copy_blocks(
            &mut self.keys,
            &mut self.values,
            &from,
            &to,
            self.layers,
            stride,
            self.kv_dim,
        )
    }

    pub fn release(&mut self, seq: SeqId) {
        if let Some(table) = self.tables.remove(&seq) {
            self.free.extend(table);
        }
    }

    pub fn clear(&mut self) {
        self.tables.clear();
        self.free = (0..self.blocks as i32).rev().collect();
    }
}

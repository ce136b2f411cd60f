//! The CPU backend's KV contents, by block of `KvStore`: per block and layer, the keys then
//! the values of `BLOCK_TOKENS` positions, in f16: attention reads a sequence's whole cache
//! every step, so half the bytes is half its memory traffic (llama.cpp's default cache type
//! too). Values are row-major `[position, kv_heads * head_dim]`; keys are transposed,
//! `[kv_heads * head_dim, position]`, because attention scores consecutive positions in one
//! register and so wants each key dimension's positions contiguous. A block keeps its global
//! layers and its sliding-window layers apart, so the latter's memory can be freed on its own
//! once the block manager evicts it.

use super::kv::{BlockCopy, BlockId, BLOCK_TOKENS};
use half::f16;

/// A layer's kind, indexing a block's parts (`BlockData`) and the layer counts.
const GLOBAL: usize = 0;
const LOCAL: usize = 1;

/// One block's data: its global layers' planes, then its local layers' (empty once freed).
type BlockData = [Vec<f16>; 2];

pub struct KvBlocks {
    kv_dim: usize,
    /// Per model layer: its kind (`GLOBAL` or `LOCAL`: keeps only a sliding window) and its
    /// index among the layers of its kind.
    layers: Vec<(usize, usize)>,
    /// Layers of each kind.
    counts: [usize; 2],
    /// Indexed by `BlockId`; a block's memory is allocated on first use and kept for reuse,
    /// except a local part evicted by the block manager, which is freed.
    blocks: Vec<BlockData>,
}

impl KvBlocks {
    /// Storage for layers of which those marked `true` in `local` keep a sliding window.
    pub fn new(local: &[bool], kv_dim: usize) -> Self {
        let mut counts = [0; 2];
        let layers = local
            .iter()
            .map(|&is_local| {
                let kind = if is_local { LOCAL } else { GLOBAL };
                counts[kind] += 1;
                (kind, counts[kind] - 1)
            })
            .collect();
        Self {
            kv_dim,
            layers,
            counts,
            blocks: Vec::new(),
        }
    }

    fn plane(&self) -> usize {
        BLOCK_TOKENS * self.kv_dim
    }

    /// Which part of a block holds `layer`, and where its keys (`part` 0) or values (1) start
    /// in it.
    fn offset(&self, layer: usize, part: usize) -> (usize, usize) {
        let (kind, index) = self.layers[layer];
        (kind, (index * 2 + part) * self.plane())
    }

    /// Block `id`'s planes of `kind`, allocated (zeroed) if they hold nothing yet.
    fn part_mut(&mut self, id: BlockId, kind: usize) -> &mut Vec<f16> {
        let id = id as usize;
        if self.blocks.len() <= id {
            self.blocks.resize_with(id + 1, BlockData::default);
        }
        let size = self.counts[kind] * 2 * self.plane();
        let part = &mut self.blocks[id][kind];
        if part.is_empty() {
            part.resize(size, f16::ZERO);
        }
        part
    }

    /// Frees block `id`'s local layers' data (the block manager evicted it).
    pub fn free_local(&mut self, id: BlockId) {
        if let Some(block) = self.blocks.get_mut(id as usize) {
            block[LOCAL] = Vec::new();
        }
    }

    /// Stores one position's key and value rows of `layer` in slot `slot` of block `id`.
    pub fn write(&mut self, id: BlockId, layer: usize, slot: usize, key: &[f32], value: &[f32]) {
        let kv_dim = self.kv_dim;
        let ((kind, k_at), (_, v_at)) = (self.offset(layer, 0), self.offset(layer, 1));
        let block = self.part_mut(id, kind);
        for (c, &from) in key.iter().enumerate() {
            block[k_at + c * BLOCK_TOKENS + slot] = f16::from_f32(from);
        }
        let row = slot * kv_dim;
        for (to, &from) in block[v_at + row..v_at + row + kv_dim].iter_mut().zip(value) {
            *to = f16::from_f32(from);
        }
    }

    /// `layer`'s keys of block `id`, transposed: `[kv_dim, BLOCK_TOKENS]`.
    pub fn keys(&self, id: BlockId, layer: usize) -> &[f16] {
        let (kind, at) = self.offset(layer, 0);
        &self.blocks[id as usize][kind][at..at + self.plane()]
    }

    /// `layer`'s value rows of block `id`: `[BLOCK_TOKENS, kv_dim]`.
    pub fn values(&self, id: BlockId, layer: usize) -> &[f16] {
        let (kind, at) = self.offset(layer, 1);
        &self.blocks[id as usize][kind][at..at + self.plane()]
    }

    /// Carries out a copy the block manager asked for (only the positions it names, in
    /// every layer; the block manager copies only blocks whose local part it holds).
    pub fn copy(&mut self, copy: BlockCopy) {
        // Per layer: each key dimension's run of the leading positions, then the leading
        // value rows, as (kind, start, length).
        let (kv_dim, positions) = (self.kv_dim, copy.positions);
        let runs: Vec<(usize, usize, usize)> = (0..self.layers.len())
            .flat_map(|layer| {
                let ((kind, k_at), (_, v_at)) = (self.offset(layer, 0), self.offset(layer, 1));
                (0..kv_dim)
                    .map(move |c| (kind, k_at + c * BLOCK_TOKENS, positions))
                    .chain([(kind, v_at, positions * kv_dim)])
            })
            .collect();
        for kind in [GLOBAL, LOCAL] {
            self.part_mut(copy.to, kind);
        }
        let [source, target] = self
            .blocks
            .get_disjoint_mut([copy.from as usize, copy.to as usize])
            .expect("two distinct allocated blocks");
        for (kind, at, len) in runs {
            target[kind][at..at + len].copy_from_slice(&source[kind][at..at + len]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_moves_the_leading_positions_of_every_layer() {
        let mut data = KvBlocks::new(&[false, true], 2);
        for layer in 0..2 {
            for slot in 0..3 {
                let x = (layer * 10 + slot) as f32;
                data.write(4, layer, slot, &[x, x + 0.5], &[-x, -x - 0.5]);
            }
        }
        data.copy(BlockCopy {
            from: 4,
            to: 1,
            positions: 2,
        });
        let floats = |v: &[f16]| v.iter().map(|h| h.to_f32()).collect::<Vec<_>>();
        let keys = floats(data.keys(1, 1));
        assert_eq!(keys[..3], [10.0, 11.0, 0.0]);
        assert_eq!(keys[BLOCK_TOKENS..BLOCK_TOKENS + 3], [10.5, 11.5, 0.0]);
        assert_eq!(floats(&data.values(1, 0)[..4]), [-0.0, -0.5, -1.0, -1.5]);
        // Layer 1 is local: freeing block 1's local part leaves layer 0's data.
        data.free_local(1);
        assert_eq!(floats(&data.values(1, 0)[..2]), [-0.0, -0.5]);
        assert!(std::panic::catch_unwind(|| data.keys(1, 1).len()).is_err());
    }

    /// Decode attention reads these blocks in place (their layout is the one
    /// `attention::HeadBlocks` takes) and gets the widened copy's floats.
    #[test]
    fn attention_reads_the_blocks_in_place_as_widened() {
        use crate::engine::attention::{HeadBlocks, HeadRows, KvRows, Vectors};
        let (layers, heads, hd) = (2, 2, 16);
        let kv_dim = heads * hd;
        let mut data = KvBlocks::new(&vec![false; layers], kv_dim);
        let positions = BLOCK_TOKENS + 5;
        let row = |p: usize, salt: usize| -> Vec<f32> {
            (0..kv_dim)
                .map(|c| ((p * 37 + c * 11 + salt) % 23) as f32 / 7.0 - 1.5)
                .collect()
        };
        for p in 0..positions {
            let (id, slot) = ((p / BLOCK_TOKENS) as BlockId + 3, p % BLOCK_TOKENS);
            data.write(id, 1, slot, &row(p, 0), &row(p, 5));
        }
        let blocks = || {
            [3, 4]
                .into_iter()
                .map(|id| (data.keys(id, 1), data.values(id, 1)))
        };
        let query: Vec<f32> = (0..hd).map(|d| (d as f32 * 0.3).cos()).collect();
        let vectors = Vectors::detect();
        for head in 0..heads {
            let at = (kv_dim, head * hd);
            let in_place = HeadBlocks::new(blocks(), at, hd, positions).expect("in place");
            let widened = HeadRows::widen(blocks(), at, hd, positions);
            let (mut a, mut b) = (vec![0f32; hd], vec![0f32; hd]);
            in_place.attend(vectors, 0.25, [(&query[..], 0..positions, &mut a[..])]);
            widened.attend(vectors, 0.25, [(&query[..], 0..positions, &mut b[..])]);
            assert_eq!(a, b, "head {head}");
            assert!(a.iter().any(|&v| v != 0.0));
        }
    }
}

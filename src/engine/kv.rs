//! Per-sequence KV storage for one model, allocated in fixed-size blocks from a token budget.
//! Reserving happens before a step touches anything, so exhaustion is a typed error the
//! scheduler can act on (wait, preempt, reject), never a half-applied step.

use crate::error::{EngineError, EngineResult};
use half::f16;
use std::collections::HashMap;

/// One KV sequence of a model's cache (a request's, or a cached prefix).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

impl std::fmt::Display for SeqId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// Tokens per allocation block.
pub const BLOCK_TOKENS: usize = 16;

/// One sequence's keys and values: per layer, row-major `[position, kv_heads * head_dim]`,
/// in f16: attention reads a sequence's whole cache every step, so half the bytes is half
/// its memory traffic (llama.cpp's default cache type too).
pub struct SeqKv {
    len: usize,
    blocks: usize,
    pub keys: Vec<Vec<f16>>,
    pub values: Vec<Vec<f16>>,
}

impl SeqKv {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

pub struct KvStore {
    layers: usize,
    kv_dim: usize,
    capacity_blocks: usize,
    used_blocks: usize,
    seqs: HashMap<SeqId, SeqKv>,
}

/// Usage counters, in tokens (block-granular).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct KvUsage {
    pub used_tokens: usize,
    pub capacity_tokens: usize,
    pub sequences: usize,
}

impl KvStore {
    pub fn new(layers: usize, kv_dim: usize, kv_tokens: usize) -> Self {
        Self {
            layers,
            kv_dim,
            capacity_blocks: kv_tokens.div_ceil(BLOCK_TOKENS),
            used_blocks: 0,
            seqs: HashMap::new(),
        }
    }

    pub fn usage(&self) -> KvUsage {
        KvUsage {
            used_tokens: self.used_blocks * BLOCK_TOKENS,
            capacity_tokens: self.capacity_blocks * BLOCK_TOKENS,
            sequences: self.seqs.len(),
        }
    }

    /// Tokens sequence `seq` holds (0 when unknown).
    pub fn seq_len(&self, seq: SeqId) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.len)
    }

    pub fn contains(&self, seq: SeqId) -> bool {
        self.seqs.contains_key(&seq)
    }

    /// Tokens of free capacity (whole blocks).
    pub fn free_tokens(&self) -> usize {
        (self.capacity_blocks - self.used_blocks) * BLOCK_TOKENS
    }

    /// Capacity `reserve` would take to append `new_tokens` to `seq` (whole blocks).
    pub fn tokens_needed(&self, seq: SeqId, new_tokens: usize) -> usize {
        self.blocks_needed(seq, new_tokens) * BLOCK_TOKENS
    }

    fn blocks_needed(&self, seq: SeqId, new_tokens: usize) -> usize {
        let (len, have) = self.seqs.get(&seq).map_or((0, 0), |s| (s.len, s.blocks));
        (len + new_tokens)
            .div_ceil(BLOCK_TOKENS)
            .saturating_sub(have)
    }

    /// Reserves room for all `(seq, new_tokens)` at once, or nothing.
    pub fn reserve(&mut self, requests: &[(SeqId, usize)]) -> EngineResult<()> {
        let needed: usize = requests
            .iter()
            .map(|&(seq, n)| self.blocks_needed(seq, n))
            .sum();
        let free = self.capacity_blocks - self.used_blocks;
        if needed > free {
            return Err(EngineError::KvExhausted {
                requested: needed * BLOCK_TOKENS,
                free: free * BLOCK_TOKENS,
                capacity: self.capacity_blocks * BLOCK_TOKENS,
            });
        }
        for &(seq, n) in requests {
            let extra = self.blocks_needed(seq, n);
            let (layers, kv_dim) = (self.layers, self.kv_dim);
            let entry = self.seqs.entry(seq).or_insert_with(|| SeqKv {
                len: 0,
                blocks: 0,
                keys: vec![Vec::new(); layers],
                values: vec![Vec::new(); layers],
            });
            entry.blocks += extra;
            let capacity = entry.blocks * BLOCK_TOKENS * kv_dim;
            for buf in entry.keys.iter_mut().chain(entry.values.iter_mut()) {
                buf.reserve_exact(capacity - buf.len());
            }
            self.used_blocks += extra;
        }
        Ok(())
    }

    pub fn seq_mut(&mut self, seq: SeqId) -> Option<&mut SeqKv> {
        self.seqs.get_mut(&seq)
    }

    /// Marks `n` appended positions as committed (after every layer wrote them).
    pub fn advance(&mut self, seq: SeqId, n: usize) {
        if let Some(s) = self.seqs.get_mut(&seq) {
            s.len += n;
            debug_assert!(s.len <= s.blocks * BLOCK_TOKENS);
        }
    }

    /// Drops a sequence and returns its blocks to the budget. Unknown ids are a no-op.
    pub fn free(&mut self, seq: SeqId) {
        if let Some(s) = self.seqs.remove(&seq) {
            self.used_blocks -= s.blocks;
        }
    }

    /// Allocates `dst` holding a copy of the first `len` positions of `src` (a prefix-cache
    /// hit in a standard server: fresh allocation, then copy). All or nothing.
    pub fn fork_prefix(&mut self, src: SeqId, dst: SeqId, len: usize) -> EngineResult<()> {
        let available = self.seq_len(src);
        if len > available || self.contains(dst) {
            return Err(EngineError::InvalidStep(format!(
                "cannot fork {len} positions of sequence {src} ({available} held) into {dst}"
            )));
        }
        self.reserve(&[(dst, len)])?;
        let kv_dim = self.kv_dim;
        let [source, target] = self.seqs.get_disjoint_mut([&src, &dst]);
        let (source, target) = (source.expect("checked"), target.expect("reserved"));
        for (to, from) in target.keys.iter_mut().zip(&source.keys) {
            to.extend_from_slice(&from[..len * kv_dim]);
        }
        for (to, from) in target.values.iter_mut().zip(&source.values) {
            to.extend_from_slice(&from[..len * kv_dim]);
        }
        target.len = len;
        Ok(())
    }

    /// Forgets positions from `len` on (their blocks stay allocated to the sequence).
    pub fn truncate(&mut self, seq: SeqId, len: usize) {
        let kv_dim = self.kv_dim;
        if let Some(s) = self.seqs.get_mut(&seq) {
            s.len = s.len.min(len);
            for buf in s.keys.iter_mut().chain(s.values.iter_mut()) {
                buf.truncate(s.len * kv_dim);
            }
        }
    }

    /// Drops every sequence (a restarted model starts with a fresh cache).
    pub fn clear(&mut self) {
        self.seqs.clear();
        self.used_blocks = 0;
    }

    /// Removes sequences out of the map so a step can write them in parallel; `put_back` returns them.
    pub fn take(&mut self, seq: SeqId) -> Option<SeqKv> {
        self.seqs.remove(&seq)
    }

    pub fn put_back(&mut self, seq: SeqId, kv: SeqKv) {
        self.seqs.insert(seq, kv);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserve_is_all_or_nothing_and_free_returns_blocks() {
        let mut kv = KvStore::new(2, 8, 64);
        kv.reserve(&[(SeqId(1), 20), (SeqId(2), 10)]).unwrap();
        assert_eq!(kv.usage().used_tokens, 48);
        let err = kv.reserve(&[(SeqId(1), 12), (SeqId(3), 17)]).unwrap_err();
        assert!(matches!(err, EngineError::KvExhausted { .. }), "{err}");
        assert_eq!(
            kv.usage().used_tokens,
            48,
            "a failed reservation changes nothing"
        );
        assert!(!kv.contains(SeqId(3)));
        kv.free(SeqId(1));
        kv.free(SeqId(2));
        kv.free(SeqId(99));
        assert_eq!(
            kv.usage(),
            KvUsage {
                used_tokens: 0,
                capacity_tokens: 64,
                sequences: 0
            }
        );
    }

    #[test]
    fn fork_copies_a_prefix_into_a_fresh_allocation() {
        let mut kv = KvStore::new(1, 2, 64);
        kv.reserve(&[(SeqId(1), 3)]).unwrap();
        let seq = kv.seq_mut(SeqId(1)).unwrap();
        let halves = |v: [f32; 6]| v.map(f16::from_f32);
        seq.keys[0].extend_from_slice(&halves([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]));
        seq.values[0].extend_from_slice(&halves([6.0, 5.0, 4.0, 3.0, 2.0, 1.0]));
        kv.advance(SeqId(1), 3);
        kv.fork_prefix(SeqId(1), SeqId(2), 2).unwrap();
        assert_eq!(kv.seq_len(SeqId(2)), 2);
        let forked = kv.take(SeqId(2)).unwrap();
        let floats = |v: &[f16]| v.iter().map(|h| h.to_f32()).collect::<Vec<_>>();
        assert_eq!(floats(&forked.keys[0]), [1.0, 2.0, 3.0, 4.0]);
        assert_eq!(floats(&forked.values[0]), [6.0, 5.0, 4.0, 3.0]);
        assert!(
            kv.fork_prefix(SeqId(1), SeqId(3), 4).is_err(),
            "longer than the source"
        );
        kv.clear();
        assert_eq!(kv.usage().used_tokens, 0);
    }

    #[test]
    fn growth_within_a_block_costs_nothing() {
        let mut kv = KvStore::new(1, 4, 64);
        kv.reserve(&[(SeqId(7), 3)]).unwrap();
        kv.advance(SeqId(7), 3);
        kv.reserve(&[(SeqId(7), 13)]).unwrap();
        assert_eq!(kv.usage().used_tokens, BLOCK_TOKENS);
        kv.advance(SeqId(7), 13);
        kv.reserve(&[(SeqId(7), 1)]).unwrap();
        assert_eq!(kv.usage().used_tokens, 2 * BLOCK_TOKENS);
    }
}

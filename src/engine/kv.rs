//! One model's KV block manager: a budget of fixed-size blocks, per sequence the table of
//! blocks holding its positions, and a prefix index shared across sequences (vLLM's automatic
//! prefix caching, SGLang's radix cache). Plain data: the backends keep the blocks' contents
//! (`BlockId` indexes their storage) and carry out the `BlockCopy`s it asks for.
//!
//! Invariants: a full block never changes, so any number of sequences may share it; a
//! partly filled block belongs to at most one sequence (a match of one is copied, unless no
//! sequence holds it and the match takes all its tokens: then it is taken over, so a request
//! returning to a model costs no copy and no new block); a block no sequence references but
//! which holds tokens stays cached, evictable in LRU order.
//! Reserving happens before a step touches anything, so exhaustion is a typed error the
//! scheduler can act on (wait, preempt, reject), never a half-applied step.
//!
//! A model whose local layers attend over a sliding window (Gemma 3) splits each block in two
//! parts: its global layers' and its local layers'. Once every sequence holding a block has
//! moved a window past it, the local part is read by no one and becomes evictable on its own
//! (kept, and counted free, until its memory is needed), so long contexts cost mostly the
//! global layers. A prefix or a rollback resumes only where the next position's window still
//! has every local part it reads.

use crate::error::{EngineError, EngineResult};
use std::collections::{BTreeSet, HashMap};

/// One KV sequence of a model's cache (a request's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

impl std::fmt::Display for SeqId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// Tokens per allocation block.
pub const BLOCK_TOKENS: usize = 16;

/// A block of a backend's KV storage (`0..capacity_blocks`).
pub type BlockId = u32;

/// Positions `0..positions` of block `from` to be copied into block `to` (every layer) before
/// the next step: a shared prefix ending inside a block, or a rollback into a full one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockCopy {
    pub from: BlockId,
    pub to: BlockId,
    pub positions: usize,
}

/// A node of the prefix index: the content of one block at one place in a chain. Node ids are
/// never reused, so an entry under an evicted parent can never match a different prefix.
type NodeId = u64;
const ROOT: NodeId = 0;

/// The layers of a model that keep only a sliding window of positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlidingWindow {
    /// Position p of a local layer reads p − window + 1 ..= p.
    pub window: usize,
    /// All layers of the model, and how many of them are local.
    pub layers: usize,
    pub local_layers: usize,
}

/// Which part of a block an evictable entry frees: the local layers' alone, or the whole
/// (unreferenced) block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Part {
    Local,
    Whole,
}

struct Block {
    /// Sequences whose table holds this block.
    refs: u32,
    /// Of those, the sequences a window past it (its local part is read by the others only).
    passed: u32,
    /// Whether the local layers' part still holds data (always false without local layers).
    local_present: bool,
    /// When the local part became unread (its place in the LRU order of eviction).
    local_released_at: u64,
    /// The tokens of the positions written so far (`BLOCK_TOKENS` when full).
    tokens: Vec<u32>,
    /// The node of the previous block of the chain (`ROOT` for a first block).
    parent: NodeId,
    node: NodeId,
    /// When it last became unreferenced (LRU order of eviction).
    released_at: u64,
}

struct SeqTable {
    len: usize,
    blocks: Vec<BlockId>,
    /// Leading blocks of `blocks` a window behind `len` (none without local layers).
    passed: usize,
}

impl SeqTable {
    fn empty() -> Self {
        Self {
            len: 0,
            blocks: Vec::new(),
            passed: 0,
        }
    }
}

/// What a block's parts cost of the budget, in layers (a block without local layers: 1).
#[derive(Debug, Clone, Copy)]
struct BlockUnits {
    global: usize,
    local: usize,
}

impl BlockUnits {
    fn full(&self) -> usize {
        self.global + self.local
    }
}

/// Usage counters, in tokens (block-granular).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct KvUsage {
    /// Blocks some sequence references.
    pub used_tokens: usize,
    /// Blocks only the prefix cache holds (evictable).
    pub cached_tokens: usize,
    pub capacity_tokens: usize,
    pub sequences: usize,
}

/// The prefix cache's counters, cumulative.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PrefixCounters {
    pub lookups: u64,
    /// Lookups that matched at least one token.
    pub hits: u64,
    /// Positions taken from the cache instead of computed.
    pub hit_tokens: u64,
    /// Cached blocks evicted to make room.
    pub evictions: u64,
}

pub struct KvStore {
    capacity_blocks: usize,
    /// Indexed by `BlockId`; `None` for a free slot.
    blocks: Vec<Option<Block>>,
    free_slots: Vec<BlockId>,
    /// Blocks that hold tokens, by the node they follow.
    children: HashMap<NodeId, Vec<BlockId>>,
    /// Unreferenced blocks holding tokens and unread local parts, oldest release first.
    evictable: BTreeSet<(u64, BlockId, Part)>,
    window: Option<usize>,
    units: BlockUnits,
    /// The budget, and what the parts holding data and the parts some sequence reads take of
    /// it, in `units`.
    capacity_units: usize,
    allocated_units: usize,
    referenced_units: usize,
    /// Blocks whose local part was evicted since the backend last asked (it frees them).
    evicted_local: Vec<BlockId>,
    seqs: HashMap<SeqId, SeqTable>,
    next_node: NodeId,
    clock: u64,
    sharing: bool,
    counters: PrefixCounters,
}

impl KvStore {
    pub fn new(kv_tokens: usize) -> Self {
        Self::with_window(kv_tokens, None)
    }

    /// A budget of `kv_tokens` positions of every layer; with a sliding window, positions
    /// behind it cost only the global layers' share.
    pub fn with_window(kv_tokens: usize, window: Option<SlidingWindow>) -> Self {
        let capacity_blocks = kv_tokens.div_ceil(BLOCK_TOKENS);
        let (window, units) = match window {
            Some(w) if w.local_layers > 0 => (
                Some(w.window.max(1)),
                BlockUnits {
                    global: w.layers - w.local_layers,
                    local: w.local_layers,
                },
            ),
            _ => (
                None,
                BlockUnits {
                    global: 1,
                    local: 0,
                },
            ),
        };
        Self {
            capacity_blocks,
            blocks: Vec::new(),
            free_slots: Vec::new(),
            children: HashMap::new(),
            evictable: BTreeSet::new(),
            window,
            units,
            capacity_units: capacity_blocks * units.full(),
            allocated_units: 0,
            referenced_units: 0,
            evicted_local: Vec::new(),
            seqs: HashMap::new(),
            next_node: ROOT + 1,
            clock: 0,
            sharing: true,
            counters: PrefixCounters::default(),
        }
    }

    /// Turns prefix sharing on or off: off, `attach_prefix` matches nothing and released
    /// blocks are freed at once.
    pub fn set_prefix_sharing(&mut self, on: bool) {
        self.sharing = on;
        if !on {
            while self.evict_one() {}
        }
    }

    pub fn capacity_blocks(&self) -> usize {
        self.capacity_blocks
    }

    /// Whole blocks' worth of `units`, as tokens (rounded down).
    fn tokens_of(&self, units: usize) -> usize {
        units / self.units.full() * BLOCK_TOKENS
    }

    pub fn usage(&self) -> KvUsage {
        let capacity_tokens = self.capacity_blocks * BLOCK_TOKENS;
        KvUsage {
            used_tokens: capacity_tokens - self.free_tokens(),
            cached_tokens: self.tokens_of(self.allocated_units - self.referenced_units),
            capacity_tokens,
            sequences: self.seqs.len(),
        }
    }

    /// The longest sequence the whole budget holds with nothing else running (with a
    /// sliding window, longer than the budget).
    pub fn longest_sequence(&self) -> usize {
        // A sequence's n-th block is reserved while it has passed what its first n − 1 blocks
        // put a window behind: those cost their global part only.
        let units_of = |blocks: usize| {
            let behind = self.blocks_behind(blocks.saturating_sub(1) * BLOCK_TOKENS);
            blocks * self.units.full() - behind * self.units.local
        };
        let mut blocks = self.capacity_blocks;
        while units_of(blocks + 1) <= self.capacity_units {
            blocks += 1;
        }
        blocks * BLOCK_TOKENS
    }

    /// The blocks whose local layers' data was evicted since the last call: the backend may
    /// free it (no sequence reads it again; a block reused later is not listed).
    pub fn take_evicted_local(&mut self) -> Vec<BlockId> {
        std::mem::take(&mut self.evicted_local)
    }

    pub fn prefix_counters(&self) -> PrefixCounters {
        self.counters
    }

    /// Tokens sequence `seq` holds (0 when unknown).
    pub fn seq_len(&self, seq: SeqId) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.len)
    }

    pub fn contains(&self, seq: SeqId) -> bool {
        self.seqs.contains_key(&seq)
    }

    /// The blocks holding `seq`'s positions, in order (position p in `table[p / BLOCK_TOKENS]`).
    pub fn table(&self, seq: SeqId) -> &[BlockId] {
        self.seqs.get(&seq).map_or(&[], |s| s.blocks.as_slice())
    }

    /// Tokens of capacity a reservation may take: free blocks and evictable cached ones
    /// (and unread local parts).
    pub fn free_tokens(&self) -> usize {
        self.tokens_of(self.capacity_units - self.referenced_units)
    }

    /// Capacity `reserve` would take to append `new_tokens` to `seq` (whole blocks).
    pub fn tokens_needed(&self, seq: SeqId, new_tokens: usize) -> usize {
        self.blocks_needed(seq, new_tokens) * BLOCK_TOKENS
    }

    fn blocks_needed(&self, seq: SeqId, new_tokens: usize) -> usize {
        let (len, have) = self
            .seqs
            .get(&seq)
            .map_or((0, 0), |s| (s.len, s.blocks.len()));
        (len + new_tokens)
            .div_ceil(BLOCK_TOKENS)
            .saturating_sub(have)
    }

    fn block(&self, id: BlockId) -> &Block {
        self.blocks[id as usize].as_ref().expect("a live block")
    }

    fn block_mut(&mut self, id: BlockId) -> &mut Block {
        self.blocks[id as usize].as_mut().expect("a live block")
    }

    /// Reserves room for all `(seq, new_tokens)` at once, or nothing. Unknown sequences are
    /// created. Cached blocks are evicted, oldest first, where free ones run out.
    pub fn reserve(&mut self, requests: &[(SeqId, usize)]) -> EngineResult<()> {
        let needed: usize = requests
            .iter()
            .map(|&(seq, n)| self.blocks_needed(seq, n))
            .sum();
        let free = self.free_tokens();
        if needed * BLOCK_TOKENS > free {
            return Err(EngineError::KvExhausted {
                requested: needed * BLOCK_TOKENS,
                free,
                capacity: self.capacity_blocks * BLOCK_TOKENS,
            });
        }
        for &(seq, n) in requests {
            let extra = self.blocks_needed(seq, n);
            self.seqs.entry(seq).or_insert_with(SeqTable::empty);
            for _ in 0..extra {
                let parent = self.tail_node(seq);
                let id = self.allocate(parent).expect("counted as free above");
                self.seqs.get_mut(&seq).expect("created").blocks.push(id);
            }
        }
        Ok(())
    }

    /// The node a block appended to `seq` follows.
    fn tail_node(&self, seq: SeqId) -> NodeId {
        self.table(seq)
            .last()
            .map_or(ROOT, |&last| self.block(last).node)
    }

    /// A fresh, referenced block following `parent`; `None` when every block is referenced.
    fn allocate(&mut self, parent: NodeId) -> Option<BlockId> {
        let full = self.units.full();
        while self.allocated_units + full > self.capacity_units {
            if !self.evict_one() {
                return None;
            }
        }
        let id = self.free_slots.pop().unwrap_or_else(|| {
            self.blocks.push(None);
            (self.blocks.len() - 1) as BlockId
        });
        // Its storage is in use again: not to be freed for an earlier eviction.
        self.evicted_local.retain(|&b| b != id);
        let node = self.next_node;
        self.next_node += 1;
        self.blocks[id as usize] = Some(Block {
            refs: 1,
            passed: 0,
            local_present: self.window.is_some(),
            local_released_at: 0,
            tokens: Vec::with_capacity(BLOCK_TOKENS),
            parent,
            node,
            released_at: 0,
        });
        self.allocated_units += full;
        self.referenced_units += full;
        Some(id)
    }

    /// Evicts the least recently released evictable part: an unread local part, or a cached
    /// block (and the cached blocks after it, which no lookup could reach any more). False
    /// when nothing is evictable.
    fn evict_one(&mut self) -> bool {
        let Some(&(released_at, id, part)) = self.evictable.first() else {
            return false;
        };
        match part {
            Part::Whole => self.remove_cached(id),
            Part::Local => {
                self.evictable.remove(&(released_at, id, part));
                self.block_mut(id).local_present = false;
                self.allocated_units -= self.units.local;
                self.evicted_local.push(id);
            }
        }
        true
    }

    fn remove_cached(&mut self, id: BlockId) {
        let released_at = self.block(id).released_at;
        self.evictable.remove(&(released_at, id, Part::Whole));
        self.counters.evictions += 1;
        self.drop_block(id);
    }

    /// Frees a block nobody references: out of the index, its slot back to the free list,
    /// and the cached blocks after it (no lookup could reach them any more) evicted.
    fn drop_block(&mut self, id: BlockId) {
        let block = self.blocks[id as usize].take().expect("a live block");
        self.allocated_units -= self.units.global;
        if block.local_present {
            // Unreferenced, so its local part was evictable.
            self.evictable
                .remove(&(block.local_released_at, id, Part::Local));
            self.allocated_units -= self.units.local;
        }
        self.unlink(id, block.parent);
        self.free_slots.push(id);
        for child in self.children.remove(&block.node).unwrap_or_default() {
            if self.block(child).refs == 0 {
                self.remove_cached(child);
            }
        }
    }

    fn unlink(&mut self, id: BlockId, parent: NodeId) {
        if let Some(siblings) = self.children.get_mut(&parent) {
            siblings.retain(|&b| b != id);
            if siblings.is_empty() {
                self.children.remove(&parent);
            }
        }
    }

    /// Drops one reference (of a sequence a window past the block where `passed`): a block
    /// nobody references is cached if it holds tokens (and sharing is on), freed otherwise.
    fn release(&mut self, id: BlockId, passed: bool) {
        self.clock += 1;
        let (clock, sharing) = (self.clock, self.sharing);
        let was_read = self.local_read(id);
        let block = self.block_mut(id);
        block.refs -= 1;
        block.passed -= u32::from(passed);
        let unreferenced = block.refs == 0;
        self.settle_local(id, was_read);
        if !unreferenced {
            return;
        }
        self.referenced_units -= self.units.global;
        let block = self.block_mut(id);
        if sharing && !block.tokens.is_empty() {
            block.released_at = clock;
            self.evictable.insert((clock, id, Part::Whole));
        } else {
            self.drop_block(id);
        }
    }

    /// Takes one more reference to `id` (out of the evictable set if it was there).
    fn retain(&mut self, id: BlockId) {
        let was_read = self.local_read(id);
        let block = self.block_mut(id);
        block.refs += 1;
        if block.refs == 1 {
            let key = (block.released_at, id, Part::Whole);
            self.evictable.remove(&key);
            self.referenced_units += self.units.global;
        }
        self.settle_local(id, was_read);
    }

    /// Whether some holder of `id` still reads its local part.
    fn local_read(&self, id: BlockId) -> bool {
        let block = self.block(id);
        block.local_present && block.passed < block.refs
    }

    /// Moves `id`'s local part into or out of the evictable set after its holders changed.
    fn settle_local(&mut self, id: BlockId, was_read: bool) {
        let read = self.local_read(id);
        if read == was_read || !self.block(id).local_present {
            return;
        }
        let local = self.units.local;
        if read {
            let key = (self.block(id).local_released_at, id, Part::Local);
            self.evictable.remove(&key);
            self.referenced_units += local;
        } else {
            self.clock += 1;
            let clock = self.clock;
            self.block_mut(id).local_released_at = clock;
            self.evictable.insert((clock, id, Part::Local));
            self.referenced_units -= local;
        }
    }

    /// Leading blocks no position from `len` on reads in a local layer (0 without them).
    fn blocks_behind(&self, len: usize) -> usize {
        self.window
            .map_or(0, |w| (len + 1).saturating_sub(w) / BLOCK_TOKENS)
    }

    /// Marks as passed by `seq` exactly the blocks a window behind `len` (its length now
    /// or after a rollback to it): blocks it moved past are marked, blocks a rollback brings
    /// back into its window unmarked.
    fn sync_passed(&mut self, seq: SeqId, len: usize) {
        let Some(table) = self.seqs.get(&seq) else {
            return;
        };
        let (from, to) = (table.passed, self.blocks_behind(len));
        let changed: Vec<BlockId> = table.blocks[from.min(to)..from.max(to)].to_vec();
        for id in changed {
            let was_read = self.local_read(id);
            let block = self.block_mut(id);
            block.passed = if to > from {
                block.passed + 1
            } else {
                block.passed - 1
            };
            self.settle_local(id, was_read);
        }
        self.seqs.get_mut(&seq).expect("checked").passed = to;
    }

    /// The longest `len' <= len` the chain `blocks` can go on from: every local part the
    /// position `len'` reads still holds its data.
    fn resumable(&self, blocks: &[BlockId], mut len: usize) -> usize {
        if self.window.is_none() {
            return len;
        }
        loop {
            let read = self.blocks_behind(len)..len.div_ceil(BLOCK_TOKENS);
            let gone = read.rev().find(|&j| !self.block(blocks[j]).local_present);
            match gone {
                Some(j) => len = j * BLOCK_TOKENS,
                None => return len,
            }
        }
    }

    /// Marks `tokens` appended to `seq` as committed (after every layer wrote them) and
    /// indexes the blocks they fill.
    pub fn advance(&mut self, seq: SeqId, tokens: &[u32]) {
        let Some(table) = self.seqs.get(&seq) else {
            return;
        };
        let start = table.len;
        let first_block = start / BLOCK_TOKENS;
        let touched =
            table.blocks[first_block..(start + tokens.len()).div_ceil(BLOCK_TOKENS)].to_vec();
        for (offset, &token) in tokens.iter().enumerate() {
            let position = start + offset;
            let id = touched[position / BLOCK_TOKENS - first_block];
            let block = self.block_mut(id);
            debug_assert_eq!(block.tokens.len(), position % BLOCK_TOKENS);
            block.tokens.push(token);
            if block.tokens.len() == 1 {
                let parent = block.parent;
                self.children.entry(parent).or_default().push(id);
            }
        }
        let table = self.seqs.get_mut(&seq).expect("checked");
        table.len += tokens.len();
        let len = table.len;
        self.sync_passed(seq, len);
    }

    /// Starts sequence `seq` (unknown or empty) on the longest cached prefix of `tokens`:
    /// full blocks are shared, a match ending inside a block gets a copy of that block (or
    /// the block itself, where nobody holds it and the match takes all of it).
    /// Returns the positions matched and the copy the backend must make.
    pub fn attach_prefix(&mut self, seq: SeqId, tokens: &[u32]) -> (usize, Option<BlockCopy>) {
        self.free(seq);
        self.seqs.insert(seq, SeqTable::empty());
        if !self.sharing {
            return (0, None);
        }
        self.counters.lookups += 1;
        let (mut full, mut partial) = self.longest_prefix(tokens);
        let chain: Vec<BlockId> = full.iter().copied().chain(partial.map(|p| p.0)).collect();
        let longest = full.len() * BLOCK_TOKENS + partial.map_or(0, |p| p.1);
        let resumable = self.resumable(&chain, longest);
        if resumable < longest {
            // A local part the next position reads was evicted: its blocks are recomputed.
            full.truncate(resumable / BLOCK_TOKENS);
            partial = None;
        }
        for &id in &full {
            self.retain(id);
        }
        let mut matched = full.len() * BLOCK_TOKENS;
        self.seqs.get_mut(&seq).expect("inserted").blocks = full;
        let mut copy = None;
        if let Some((from, positions)) = partial {
            let block = self.block(from);
            if block.refs == 0 && block.tokens.len() == positions {
                // Nobody else holds it and the match takes all it holds (a request coming
                // back to a model it left): the sequence takes the block over and extends it.
                self.retain(from);
                self.seqs.get_mut(&seq).expect("inserted").blocks.push(from);
                matched += positions;
            } else {
                copy = self.append_copy(seq, from, positions);
                if copy.is_some() {
                    matched += positions;
                }
            }
        }
        self.seqs.get_mut(&seq).expect("inserted").len = matched;
        // Where the copy found no block, the match ends earlier and its window reaches
        // further back.
        let resumable = self.resumable(self.table(seq), matched);
        let matched = match resumable < matched {
            true => self.truncate(seq, resumable).0,
            false => matched,
        };
        self.sync_passed(seq, matched);
        if matched > 0 {
            self.counters.hits += 1;
            self.counters.hit_tokens += matched as u64;
        }
        (matched, copy)
    }

    /// Appends to `seq` a private block holding the first `positions` tokens of block `from`
    /// (pinned meanwhile, so the allocation cannot evict it); returns the copy the backend
    /// must make, or `None` when no block is left for it.
    fn append_copy(&mut self, seq: SeqId, from: BlockId, positions: usize) -> Option<BlockCopy> {
        self.retain(from);
        let parent = self.tail_node(seq);
        let copy = self.allocate(parent).map(|to| {
            let prefix = self.block(from).tokens[..positions].to_vec();
            self.block_mut(to).tokens = prefix;
            self.children.entry(parent).or_default().push(to);
            self.seqs
                .get_mut(&seq)
                .expect("a live sequence")
                .blocks
                .push(to);
            BlockCopy {
                from,
                to,
                positions,
            }
        });
        self.release(from, false);
        copy
    }

    /// Full blocks matching `tokens` from the start, then the block (if any) sharing the
    /// longest run of the rest, with that run's length.
    fn longest_prefix(&self, tokens: &[u32]) -> (Vec<BlockId>, Option<(BlockId, usize)>) {
        let mut full = Vec::new();
        let mut node = ROOT;
        let mut rest = tokens;
        loop {
            let best = self
                .children
                .get(&node)
                .into_iter()
                .flatten()
                .map(|&id| {
                    let common = self
                        .block(id)
                        .tokens
                        .iter()
                        .zip(rest)
                        .take_while(|(a, b)| a == b)
                        .count();
                    (common, id)
                })
                .max();
            match best {
                Some((BLOCK_TOKENS, id)) => {
                    full.push(id);
                    node = self.block(id).node;
                    rest = &rest[BLOCK_TOKENS..];
                }
                Some((common, id)) if common > 0 => return (full, Some((id, common))),
                _ => return (full, None),
            }
        }
    }

    /// Forgets positions from `len` on. A cut inside a full (possibly shared) block moves
    /// the kept part to a private copy; where no block is left for it, the cut moves back
    /// to the block's start, as it does past a block whose local part the window would read
    /// but was evicted. Returns the length kept and the copy to make.
    pub fn truncate(&mut self, seq: SeqId, len: usize) -> (usize, Option<BlockCopy>) {
        let Some(table) = self.seqs.get(&seq) else {
            return (0, None);
        };
        if len >= table.len {
            return (table.len, None);
        }
        let len = self.resumable(&table.blocks, len);
        self.sync_passed(seq, len);
        let table = &self.seqs[&seq];
        let keep = len.div_ceil(BLOCK_TOKENS);
        let dropped = table.blocks[keep..].to_vec();
        let blocks = table.blocks[..keep].to_vec();
        for id in dropped.into_iter().rev() {
            self.release(id, false);
        }
        let table = self.seqs.get_mut(&seq).expect("checked");
        table.blocks = blocks;
        table.len = len;
        let within = len % BLOCK_TOKENS;
        if within == 0 {
            return (len, None);
        }
        let last = *table.blocks.last().expect("len > 0");
        let block = self.block(last);
        if block.refs == 1 && block.tokens.len() < BLOCK_TOKENS {
            self.block_mut(last).tokens.truncate(within);
            return (len, None);
        }
        self.seqs.get_mut(&seq).expect("checked").blocks.pop();
        let copy = self.append_copy(seq, last, within);
        self.release(last, false);
        if copy.is_some() {
            return (len, copy);
        }
        // No block for the copy: back to the block's start, whose window reaches further.
        let start = len - within;
        self.seqs.get_mut(&seq).expect("checked").len = start;
        self.sync_passed(seq, start);
        let kept = self.resumable(self.table(seq), start);
        if kept < start {
            return self.truncate(seq, kept);
        }
        (start, None)
    }

    /// Drops a sequence: its blocks stay cached for later prefixes where they hold tokens.
    /// Unknown ids are a no-op.
    pub fn free(&mut self, seq: SeqId) {
        if let Some(table) = self.seqs.remove(&seq) {
            // Tail first, so that under pressure a chain is evicted from its end.
            for (index, id) in table.blocks.into_iter().enumerate().rev() {
                self.release(id, index < table.passed);
            }
        }
    }

    /// Drops every sequence and cached block (a restarted model starts with a fresh cache).
    pub fn clear(&mut self) {
        self.blocks.clear();
        self.free_slots.clear();
        self.children.clear();
        self.evictable.clear();
        self.seqs.clear();
        self.allocated_units = 0;
        self.referenced_units = 0;
        self.evicted_local.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reserves and commits `tokens` onto `seq`.
    fn write(kv: &mut KvStore, seq: u64, tokens: &[u32]) {
        kv.reserve(&[(SeqId(seq), tokens.len())]).unwrap();
        kv.advance(SeqId(seq), tokens);
    }

    fn run(from: u32, n: usize) -> Vec<u32> {
        (from..from + n as u32).collect()
    }

    /// The cached chain holding `tokens` (its full blocks and the partial one, if any).
    fn kv_table_of_prompt(kv: &KvStore, tokens: &[u32]) -> Vec<BlockId> {
        let (mut blocks, partial) = kv.longest_prefix(tokens);
        blocks.extend(partial.map(|(id, _)| id));
        blocks
    }

    #[test]
    fn a_sequence_coming_back_takes_over_its_partial_block_instead_of_copying_it() {
        let mut kv = KvStore::new(1024);
        let prompt = run(1, BLOCK_TOKENS + 5);
        write(&mut kv, 1, &prompt);
        let before = kv.table(SeqId(1)).to_vec();
        kv.free(SeqId(1));
        // Back with one more token: the whole chain matches, the partial block is taken over.
        let mut longer = prompt.clone();
        longer.push(77);
        let (matched, copy) = kv.attach_prefix(SeqId(2), &longer[..longer.len() - 1]);
        assert_eq!((matched, copy), (prompt.len(), None));
        assert_eq!(kv.table(SeqId(2)), before);
        assert_eq!(kv.usage().used_tokens, 2 * BLOCK_TOKENS, "no block added");
        kv.reserve(&[(SeqId(2), 1)]).unwrap();
        kv.advance(SeqId(2), &[77]);
        // While sequence 2 holds it, a match inside it is copied, and the original is intact.
        let (matched, copy) = kv.attach_prefix(SeqId(3), &longer);
        assert_eq!(matched, longer.len());
        assert_eq!(copy.map(|c| (c.from, c.positions)), Some((before[1], 6)));
        kv.free(SeqId(3));
        kv.free(SeqId(2));
        // Unheld, but the match stops short of what it holds: copied, so the cache keeps the
        // longer chain.
        let (matched, copy) = kv.attach_prefix(SeqId(4), &prompt[..BLOCK_TOKENS + 2]);
        assert_eq!(matched, BLOCK_TOKENS + 2);
        assert!(copy.is_some());
        let (matched, _) = kv.attach_prefix(SeqId(5), &longer);
        assert_eq!(matched, longer.len());
    }

    #[test]
    fn reserve_is_all_or_nothing_and_free_returns_blocks() {
        let mut kv = KvStore::new(64);
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
                cached_tokens: 0,
                capacity_tokens: 64,
                sequences: 0
            },
            "blocks reserved but never written are not cached"
        );
    }

    #[test]
    fn growth_within_a_block_costs_nothing() {
        let mut kv = KvStore::new(64);
        write(&mut kv, 7, &[1, 2, 3]);
        kv.reserve(&[(SeqId(7), 13)]).unwrap();
        assert_eq!(kv.usage().used_tokens, BLOCK_TOKENS);
        kv.advance(SeqId(7), &run(4, 13));
        kv.reserve(&[(SeqId(7), 1)]).unwrap();
        assert_eq!(kv.usage().used_tokens, 2 * BLOCK_TOKENS);
    }

    #[test]
    fn full_blocks_are_shared_and_a_partial_match_is_copied() {
        let mut kv = KvStore::new(1024);
        let prompt = run(100, 40);
        write(&mut kv, 1, &prompt);
        // Same first 37 tokens: two full blocks shared, 5 positions of the third copied.
        let mut other = prompt[..37].to_vec();
        other.extend([7, 7, 7]);
        let (matched, copy) = kv.attach_prefix(SeqId(2), &other);
        assert_eq!(matched, 37);
        let (first, second) = (kv.table(SeqId(1)).to_vec(), kv.table(SeqId(2)).to_vec());
        assert_eq!(first[..2], second[..2], "full blocks are shared");
        assert_eq!(
            copy,
            Some(BlockCopy {
                from: first[2],
                to: second[2],
                positions: 5
            })
        );
        assert_eq!(kv.usage().used_tokens, 4 * BLOCK_TOKENS, "3 + 1 copied");
        kv.reserve(&[(SeqId(2), 3)]).unwrap();
        kv.advance(SeqId(2), &[7, 7, 7]);
        assert_eq!(kv.seq_len(SeqId(2)), 40);
        let counters = kv.prefix_counters();
        assert_eq!((counters.hits, counters.hit_tokens), (1, 37));
    }

    #[test]
    fn ended_sequences_stay_cached_until_their_blocks_are_needed() {
        let mut kv = KvStore::new(4 * BLOCK_TOKENS);
        let prompt = run(1, 2 * BLOCK_TOKENS + 3);
        write(&mut kv, 1, &prompt);
        kv.free(SeqId(1));
        assert_eq!(kv.usage().used_tokens, 0);
        assert_eq!(kv.usage().cached_tokens, 3 * BLOCK_TOKENS);
        assert_eq!(
            kv.free_tokens(),
            4 * BLOCK_TOKENS,
            "cached blocks are evictable"
        );
        // The same prompt later: every position comes from the cache (the last block, which
        // nobody holds, taken over).
        let (matched, copy) = kv.attach_prefix(SeqId(2), &prompt);
        assert_eq!(matched, prompt.len());
        assert_eq!(copy, None);
        assert_eq!(kv.table(SeqId(2)), kv_table_of_prompt(&kv, &prompt));
        kv.free(SeqId(2));
        // Room for a different 64-token prompt: the cache is evicted, tail blocks first.
        write(&mut kv, 3, &run(500, 4 * BLOCK_TOKENS));
        assert_eq!(kv.usage().cached_tokens, 0);
        assert!(kv.prefix_counters().evictions >= 3);
        kv.free(SeqId(3));
        let (matched, _) = kv.attach_prefix(SeqId(4), &prompt);
        assert_eq!(matched, 0, "evicted blocks match nothing");
    }

    #[test]
    fn a_referenced_block_is_never_evicted() {
        let mut kv = KvStore::new(2 * BLOCK_TOKENS);
        write(&mut kv, 1, &run(1, BLOCK_TOKENS));
        write(&mut kv, 2, &run(50, BLOCK_TOKENS));
        kv.free(SeqId(2));
        let err = kv.reserve(&[(SeqId(3), 2 * BLOCK_TOKENS)]).unwrap_err();
        assert!(matches!(err, EngineError::KvExhausted { .. }));
        kv.reserve(&[(SeqId(3), BLOCK_TOKENS)]).unwrap();
        assert_eq!(kv.seq_len(SeqId(1)), BLOCK_TOKENS);
        let (matched, _) = kv.attach_prefix(SeqId(4), &run(1, BLOCK_TOKENS + 1));
        assert_eq!(matched, BLOCK_TOKENS, "sequence 1's block is still indexed");
    }

    #[test]
    fn a_rollback_into_a_shared_block_copies_it_and_leaves_the_original_intact() {
        let mut kv = KvStore::new(1024);
        let prompt = run(1, 2 * BLOCK_TOKENS);
        write(&mut kv, 1, &prompt);
        let (matched, _) = kv.attach_prefix(SeqId(2), &prompt);
        assert_eq!(matched, 2 * BLOCK_TOKENS);
        let (kept, copy) = kv.truncate(SeqId(2), 2 * BLOCK_TOKENS - 1);
        assert_eq!(kept, 2 * BLOCK_TOKENS - 1);
        let shared = kv.table(SeqId(1))[1];
        assert_eq!(copy.map(|c| (c.from, c.positions)), Some((shared, 15)));
        assert_ne!(kv.table(SeqId(2))[1], shared);
        kv.reserve(&[(SeqId(2), 1)]).unwrap();
        kv.advance(SeqId(2), &[999]);
        // Sequence 1's chain still matches in full; the rewritten one as well.
        let (matched, _) = kv.attach_prefix(SeqId(3), &prompt);
        assert_eq!(matched, 2 * BLOCK_TOKENS);
        let mut rewritten = prompt.clone();
        *rewritten.last_mut().unwrap() = 999;
        rewritten.push(5);
        let (matched, _) = kv.attach_prefix(SeqId(4), &rewritten);
        assert_eq!(matched, 2 * BLOCK_TOKENS);
        // A cut inside a private partial block truncates in place.
        write(&mut kv, 5, &run(300, 5));
        assert_eq!(kv.truncate(SeqId(5), 3), (3, None));
        kv.reserve(&[(SeqId(5), 1)]).unwrap();
        kv.advance(SeqId(5), &[42]);
        let (matched, _) = kv.attach_prefix(SeqId(6), &[300, 301, 302, 42, 0]);
        assert_eq!(matched, 4);
    }

    #[test]
    fn without_sharing_nothing_is_matched_or_cached() {
        let mut kv = KvStore::new(1024);
        kv.set_prefix_sharing(false);
        let prompt = run(1, 40);
        write(&mut kv, 1, &prompt);
        assert_eq!(kv.attach_prefix(SeqId(2), &prompt), (0, None));
        kv.free(SeqId(1));
        assert_eq!(kv.usage().cached_tokens, 0);
        assert_eq!(kv.prefix_counters().lookups, 0);
    }

    /// Two layers, one of them local with a window of 8 positions.
    fn windowed(kv_tokens: usize) -> KvStore {
        KvStore::with_window(
            kv_tokens,
            Some(SlidingWindow {
                window: 8,
                layers: 2,
                local_layers: 1,
            }),
        )
    }

    /// Recomputes from the tables and blocks what the counters and the evictable set must
    /// be, and checks that every sequence's next position reads only local parts that hold
    /// data.
    fn check_window_invariants(kv: &KvStore) {
        let mut holders: HashMap<BlockId, (u32, u32)> = HashMap::new();
        for table in kv.seqs.values() {
            assert_eq!(table.passed, kv.blocks_behind(table.len));
            assert_eq!(kv.resumable(&table.blocks, table.len), table.len);
            for (index, &id) in table.blocks.iter().enumerate() {
                let entry = holders.entry(id).or_default();
                entry.0 += 1;
                entry.1 += u32::from(index < table.passed);
            }
        }
        let units = kv.units;
        let (mut allocated, mut referenced) = (0, 0);
        let mut evictable = BTreeSet::new();
        for (id, block) in kv.blocks.iter().enumerate() {
            let Some(block) = block else { continue };
            let id = id as BlockId;
            let held = holders.get(&id).copied().unwrap_or_default();
            assert_eq!((block.refs, block.passed), held, "block {id}");
            allocated += units.global;
            if block.refs > 0 {
                referenced += units.global;
            } else {
                evictable.insert((block.released_at, id, Part::Whole));
            }
            if block.local_present {
                allocated += units.local;
                if block.passed < block.refs {
                    referenced += units.local;
                } else {
                    evictable.insert((block.local_released_at, id, Part::Local));
                }
            }
        }
        assert_eq!(kv.allocated_units, allocated);
        assert_eq!(kv.referenced_units, referenced);
        assert_eq!(kv.evictable, evictable);
        assert!(allocated <= kv.capacity_units);
    }

    #[test]
    fn positions_a_window_behind_cost_only_the_global_layers() {
        let mut kv = windowed(4 * BLOCK_TOKENS);
        // 4 blocks of 2 units; 40 positions: blocks 0 and 1 lie a window behind.
        write(&mut kv, 1, &run(1, 40));
        check_window_invariants(&kv);
        assert_eq!(kv.seqs[&SeqId(1)].passed, 2);
        assert_eq!(kv.free_tokens(), 2 * BLOCK_TOKENS, "8 - 3·2 + 2·1 units");
        // Without the window the budget is full at 64 positions; with it a sequence goes on
        // while its old local parts are evicted (and listed for the backend to free).
        write(&mut kv, 1, &run(41, 40));
        check_window_invariants(&kv);
        assert_eq!(kv.seq_len(SeqId(1)), 80);
        let evicted = kv.take_evicted_local();
        assert_eq!(evicted, kv.table(SeqId(1))[..2].to_vec());
        assert!(kv.take_evicted_local().is_empty());
        let err = kv.reserve(&[(SeqId(2), 2 * BLOCK_TOKENS)]).unwrap_err();
        assert!(matches!(err, EngineError::KvExhausted { .. }), "{err}");
        kv.free(SeqId(1));
        check_window_invariants(&kv);
        assert_eq!(kv.usage().used_tokens, 0);
    }

    #[test]
    fn the_longest_sequence_fits_the_budget_alone() {
        assert_eq!(
            KvStore::new(4 * BLOCK_TOKENS).longest_sequence(),
            4 * BLOCK_TOKENS
        );
        for blocks in [1, 2, 4, 9] {
            let mut kv = windowed(blocks * BLOCK_TOKENS);
            let longest = kv.longest_sequence();
            assert!(longest >= blocks * BLOCK_TOKENS);
            for position in 0..longest {
                kv.reserve(&[(SeqId(1), 1)]).unwrap();
                kv.advance(SeqId(1), &[position as u32]);
            }
            assert!(
                kv.reserve(&[(SeqId(1), 1)]).is_err(),
                "{blocks} blocks: {longest} is the longest"
            );
        }
    }

    #[test]
    fn a_shared_block_keeps_its_local_part_while_one_holder_reads_it() {
        let mut kv = windowed(1024);
        let prompt = run(1, 3 * BLOCK_TOKENS);
        write(&mut kv, 1, &prompt);
        // Sequence 2 shares the first two blocks and stops just after them.
        let (matched, _) = kv.attach_prefix(SeqId(2), &prompt[..2 * BLOCK_TOKENS]);
        assert_eq!(matched, 2 * BLOCK_TOKENS);
        let first = kv.table(SeqId(1))[0];
        let second = kv.table(SeqId(1))[1];
        assert!(kv.local_read(second), "sequence 2's window reads block 1");
        assert!(!kv.local_read(first), "both are past block 0");
        write(&mut kv, 2, &run(500, BLOCK_TOKENS));
        assert!(!kv.local_read(second));
        kv.free(SeqId(2));
        check_window_invariants(&kv);
        // A new holder inside the window makes a passed part read again.
        let (matched, _) = kv.attach_prefix(SeqId(3), &prompt[..BLOCK_TOKENS + 4]);
        assert_eq!(matched, BLOCK_TOKENS + 4);
        assert!(kv.local_read(first));
        check_window_invariants(&kv);
    }

    #[test]
    fn a_prefix_resumes_only_where_its_window_kept_its_local_parts() {
        let mut kv = windowed(3 * BLOCK_TOKENS);
        let prompt = run(1, 3 * BLOCK_TOKENS);
        write(&mut kv, 1, &prompt);
        kv.free(SeqId(1));
        // Cached whole: the same prompt resumes from its end.
        assert_eq!(kv.attach_prefix(SeqId(2), &prompt).0, prompt.len());
        // The local parts of its first two blocks are unread, and evicted for a newcomer's
        // block.
        write(&mut kv, 3, &run(900, BLOCK_TOKENS));
        assert_eq!(kv.take_evicted_local(), kv.table(SeqId(2))[..2].to_vec());
        kv.free(SeqId(2));
        check_window_invariants(&kv);
        // Position 18's window reads block 0, so the match stops before it; position 48's
        // reads block 2 only.
        assert_eq!(kv.attach_prefix(SeqId(4), &prompt[..BLOCK_TOKENS + 2]).0, 0);
        assert_eq!(kv.attach_prefix(SeqId(5), &prompt).0, prompt.len());
        check_window_invariants(&kv);
        // A rollback whose window would read block 0 goes back to its start.
        assert_eq!(kv.truncate(SeqId(5), 20), (0, None));
        check_window_invariants(&kv);
    }

    /// Random writes, prefix attaches, rollbacks and frees over a tight budget: the counters,
    /// the evictable set and every sequence's readable window stay consistent, and no copy
    /// is asked from a block whose local part is gone.
    #[test]
    fn random_work_keeps_the_window_accounting_consistent() {
        use rand::{rngs::StdRng, Rng, SeedableRng};
        let (mut evicted, mut cut_short) = (0, 0);
        for seed in 0..40 {
            let mut rng = StdRng::seed_from_u64(seed);
            let mut kv = windowed(rng.gen_range(3..12) * BLOCK_TOKENS);
            let stories: Vec<Vec<u32>> = (0..3).map(|k| run(k * 1000, 200)).collect();
            let mut story_of: HashMap<u64, usize> = HashMap::new();
            for _ in 0..300 {
                let seq = rng.gen_range(0..5u64);
                let len = kv.seq_len(SeqId(seq));
                match rng.gen_range(0..10) {
                    0..=4 => {
                        let story = *story_of.entry(seq).or_insert(rng.gen_range(0..3));
                        let n = rng.gen_range(1..24).min(200 - len);
                        if kv.reserve(&[(SeqId(seq), n)]).is_ok() {
                            kv.advance(SeqId(seq), &stories[story][len..len + n]);
                        }
                    }
                    5 | 6 => {
                        let story = rng.gen_range(0..3);
                        story_of.insert(seq, story);
                        let upto = rng.gen_range(0..120);
                        let (matched, copy) = kv.attach_prefix(SeqId(seq), &stories[story][..upto]);
                        assert!(matched <= upto);
                        if let Some(copy) = copy {
                            assert!(kv.block(copy.from).local_present, "seed {seed}");
                        }
                    }
                    7 | 8 if len > 0 => {
                        let to = rng.gen_range(0..len);
                        let (kept, copy) = kv.truncate(SeqId(seq), to);
                        assert!(kept <= to);
                        cut_short += usize::from(kept < to);
                        if let Some(copy) = copy {
                            assert!(kv.block(copy.from).local_present, "seed {seed}");
                        }
                    }
                    _ => kv.free(SeqId(seq)),
                }
                evicted += kv.take_evicted_local().len();
                check_window_invariants(&kv);
            }
        }
        assert!(
            evicted > 100,
            "the budget is tight enough to evict local parts: {evicted}"
        );
        assert!(
            cut_short > 10,
            "some rollbacks go back further: {cut_short}"
        );
    }

    #[test]
    fn clear_forgets_sequences_and_cache() {
        let mut kv = KvStore::new(1024);
        write(&mut kv, 1, &run(1, 40));
        write(&mut kv, 2, &run(1, 20));
        kv.free(SeqId(2));
        kv.clear();
        assert_eq!(kv.usage().used_tokens + kv.usage().cached_tokens, 0);
        assert_eq!(kv.attach_prefix(SeqId(3), &run(1, 40)).0, 0);
    }
}

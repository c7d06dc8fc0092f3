//! Block tables over the pool: what a scheduler asks before it admits or
//! grows a sequence, prefix caching, copy-on-write and forks.
//!
//! - **admit**: the longest cached prefix of the prompt's full blocks is
//!   reused (hash hit, confirmed by tokens; never the whole prompt: the
//!   last token is always computed, for its logits), the rest allocated;
//! - **grow**: more blocks as positions are appended, one block at a
//!   time; a shared block about to be written is replaced by a fresh one,
//!   and the copy is recorded for the runner to make before the step
//!   ([`KvManager::take_ops`]: the bookkeeping moves no K/V);
//! - **commit**: blocks that became full are hashed and enter the prefix
//!   cache (they stay there after their sequence ends, until evicted);
//! - **free**: a sequence's blocks are released tail first, so its tail
//!   is evicted before the prefix others may share;
//! - **fork**: a child shares all its parent's blocks (`n > 1` samples of
//!   one prompt).

use std::collections::HashMap;

use p08_continuous::kv_transfer::KvLayout;
use p08_continuous::runner::KvOp;
use p08_continuous::scheduler::SeqId;

use crate::block_pool::{BlockId, BlockPool};
use crate::block_storage::BlockStorage;
use crate::prefix_hash::{BlockHasher, Xxh3BlockHasher};

#[derive(Debug, Default)]
struct SeqBlocks {
    /// Block i holds positions i*block_size..(i+1)*block_size.
    table: Vec<BlockId>,
    /// Chained hashes of the full blocks committed so far.
    hashes: Vec<u64>,
}

/// Prefix-cache counters, in tokens (vLLM's `prefix_cache_queries`/`hits`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixStats {
    pub queries: u64,
    pub hits: u64,
}

#[derive(Debug)]
pub struct KvManager {
    pool: BlockPool,
    hasher: Box<dyn BlockHasher>,
    seqs: HashMap<SeqId, SeqBlocks>,
    prefix_caching: bool,
    stats: PrefixStats,
    /// Copies recorded by `grow`, for the runner.
    ops: Vec<KvOp>,
}

impl KvManager {
    pub fn new(pool: BlockPool, prefix_caching: bool) -> KvManager {
        KvManager::with_hasher(pool, prefix_caching, Box::new(Xxh3BlockHasher))
    }

    pub fn with_hasher(
        pool: BlockPool,
        prefix_caching: bool,
        hasher: Box<dyn BlockHasher>,
    ) -> KvManager {
        KvManager {
            pool,
            hasher,
            seqs: HashMap::new(),
            prefix_caching,
            stats: PrefixStats::default(),
            ops: Vec::new(),
        }
    }

    /// A storage for this pool: every block, every K/V head.
    pub fn new_storage(&self) -> BlockStorage {
        BlockStorage::new(self.layout(), self.pool.num_blocks())
    }

    /// The layout of this pool's blocks (all K/V heads).
    pub fn layout(&self) -> KvLayout {
        KvLayout::whole(self.pool.shape(), self.pool.block_size())
    }

    /// The copies recorded since the last call, in order.
    pub fn take_ops(&mut self, into: &mut Vec<KvOp>) {
        into.append(&mut self.ops);
    }

    /// Forget the prefix cache (see [`BlockPool::forget_cached`]).
    pub fn forget_cached(&mut self) {
        self.pool.forget_cached();
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub fn block_size(&self) -> usize {
        self.pool.block_size()
    }

    pub fn prefix_stats(&self) -> PrefixStats {
        self.stats
    }

    /// Blocks to hold `positions`.
    pub fn blocks_for(&self, positions: usize) -> usize {
        positions.div_ceil(self.block_size())
    }

    /// A sequence's block table.
    pub fn table(&self, id: SeqId) -> Option<&[BlockId]> {
        self.seqs.get(&id).map(|s| s.table.as_slice())
    }

    /// Blocks held by live sequences (shared ones once).
    pub fn used_blocks(&self) -> usize {
        self.pool.num_blocks() - self.pool.num_free()
    }

    /// Admit `id` with its known `tokens`, reserving room for `reserve`
    /// positions. Returns how many leading tokens' K/V came from the prefix
    /// cache, or None (nothing changed) when the blocks are not there.
    pub fn admit(
        &mut self,
        id: SeqId,
        tokens: &[u32],
        salt: &[u8],
        reserve: usize,
    ) -> Option<usize> {
        self.admit_with(id, tokens, salt, reserve, true)
    }

    /// Admit `id` with fresh blocks for `reserve` positions, looking up no
    /// prefix: its K/V arrives computed (an import writes every block).
    pub fn admit_fresh(&mut self, id: SeqId, tokens: &[u32], reserve: usize) -> bool {
        self.admit_with(id, tokens, &[], reserve, false).is_some()
    }

    fn admit_with(
        &mut self,
        id: SeqId,
        tokens: &[u32],
        salt: &[u8],
        reserve: usize,
        lookup: bool,
    ) -> Option<usize> {
        if self.seqs.contains_key(&id) {
            return None;
        }
        let bs = self.block_size();
        // The cached prefix: full blocks, leaving at least the last token to compute.
        let mut hits: Vec<(BlockId, u64)> = Vec::new();
        if self.prefix_caching && lookup && !tokens.is_empty() {
            let (mut parent_hash, mut parent_block) = (None, None);
            for block in tokens[..tokens.len() - 1].chunks_exact(bs) {
                let h = self.hasher.hash(parent_hash, block, salt);
                match self.pool.lookup(h, parent_block, block, salt) {
                    Some(b) => hits.push((b, h)),
                    None => break,
                }
                (parent_hash, parent_block) = (Some(h), hits.last().map(|x| x.0));
            }
        }
        let need = self
            .blocks_for(reserve.max(tokens.len()))
            .saturating_sub(hits.len());
        let hits_free = hits
            .iter()
            .filter(|(b, _)| self.pool.ref_count(*b) == 0)
            .count();
        if need > self.pool.num_free() - hits_free {
            return None;
        }
        if self.prefix_caching && lookup {
            self.stats.queries += tokens.len() as u64;
            self.stats.hits += (hits.len() * bs) as u64;
        }
        let mut seq = SeqBlocks::default();
        for (b, h) in hits {
            // In range and counted above: cannot fail.
            let _ = self.pool.acquire(b);
            seq.table.push(b);
            seq.hashes.push(h);
        }
        for _ in 0..need {
            seq.table.extend(self.pool.allocate());
        }
        let cached = seq.hashes.len() * bs;
        self.seqs.insert(id, seq);
        Some(cached)
    }

    /// Make positions `start..end` of `id` writable: blocks up to `end`
    /// exist, and any shared block among them is copied first. False (and
    /// nothing changed) when the free blocks do not suffice.
    pub fn grow(&mut self, id: SeqId, start: usize, end: usize) -> bool {
        let bs = self.block_size();
        let Some(seq) = self.seqs.get(&id) else {
            return false;
        };
        let new_blocks = self.blocks_for(end).saturating_sub(seq.table.len());
        let first = start / bs;
        let copies = seq
            .table
            .iter()
            .enumerate()
            .filter(|&(i, &b)| i >= first && i * bs < end && self.pool.ref_count(b) > 1)
            .count();
        if new_blocks + copies > self.pool.num_free() {
            return false;
        }
        let Some(seq) = self.seqs.get_mut(&id) else {
            return false;
        };
        for i in first..seq.table.len() {
            let b = seq.table[i];
            if i * bs < end && self.pool.ref_count(b) > 1 {
                if let Some(copy) = self.pool.allocate() {
                    self.ops.push(KvOp::CopyBlock { src: b, dst: copy });
                    let _ = self.pool.release(b);
                    seq.table[i] = copy;
                    // A copied block is this sequence's own from here.
                    seq.hashes.truncate(i);
                }
            }
        }
        for _ in 0..new_blocks {
            seq.table.extend(self.pool.allocate());
        }
        true
    }

    /// After a step: the first `computed` of `tokens` have their K/V in
    /// `id`'s blocks; full blocks enter the prefix cache under `salt`.
    pub fn commit(&mut self, id: SeqId, tokens: &[u32], salt: &[u8], computed: usize) {
        if !self.prefix_caching {
            return;
        }
        let bs = self.block_size();
        let Some(seq) = self.seqs.get_mut(&id) else {
            return;
        };
        let full = (computed.min(tokens.len()) / bs).min(seq.table.len());
        while seq.hashes.len() < full {
            let i = seq.hashes.len();
            let block = &tokens[i * bs..(i + 1) * bs];
            let h = self.hasher.hash(seq.hashes.last().copied(), block, salt);
            let parent = i.checked_sub(1).map(|p| seq.table[p]);
            let _ = self.pool.register(seq.table[i], h, parent, block, salt);
            seq.hashes.push(h);
        }
    }

    /// Release `id`'s blocks, tail first.
    pub fn free(&mut self, id: SeqId) {
        if let Some(seq) = self.seqs.remove(&id) {
            for &b in seq.table.iter().rev() {
                let _ = self.pool.release(b);
            }
        }
    }

    /// `child` shares every block of `parent` (copy-on-write on its first
    /// write into a shared block).
    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> bool {
        if self.seqs.contains_key(&child) {
            return false;
        }
        let Some(p) = self.seqs.get(&parent) else {
            return false;
        };
        let seq = SeqBlocks {
            table: p.table.clone(),
            hashes: p.hashes.clone(),
        };
        for &b in &seq.table {
            let _ = self.pool.acquire(b);
        }
        self.seqs.insert(child, seq);
        true
    }
}

#[cfg(test)]
mod tests;

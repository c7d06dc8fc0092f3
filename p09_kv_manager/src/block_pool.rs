//! The block pool: the bookkeeping of all K/V memory, fixed-size blocks
//! counted once at start (vLLM's `BlockPool`, nano-vllm's `BlockManager`).
//! It holds no K/V: the blocks' memory is the runner's
//! ([`crate::block_storage::BlockStorage`], on every rank), while ids,
//! reference counts, prefix hashes and the free list live here, once.
//!
//! A block holds `block_size` consecutive positions of one sequence. Each
//! block has a reference count (several sequences may share a prompt
//! prefix); a block nobody holds is **free**. A free block that is full
//! and hashed stays in the prefix cache until it is evicted: the free list
//! is kept in eviction order (least recently freed first), and allocating
//! takes its front.

use std::collections::{BTreeMap, HashMap};

use common::batch::KvShape;
use thiserror::Error;

/// Index of a block in the pool (the plan's block ids).
pub use p08_continuous::runner::BlockId;

#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum PoolError {
    #[error("block size must be at least 1")]
    BlockSize,
    #[error("a K/V budget of {bytes} bytes holds no block of {block_bytes} bytes")]
    NoBlocks { bytes: usize, block_bytes: usize },
    #[error("block {0} is outside the pool")]
    OutOfRange(BlockId),
    #[error("block {0} is free")]
    NotHeld(BlockId),
    #[error("block {0} is written twice in one step (or written and read by another sequence)")]
    SharedWrite(BlockId),
    #[error("sequence {0} holds no blocks")]
    UnknownSequence(u64),
    #[error("sequence {seq} needs {positions} positions but holds {blocks} blocks")]
    NoRoom {
        seq: u64,
        positions: usize,
        blocks: usize,
    },
}

/// What the prefix cache keeps of a full block, to confirm a hash hit: its
/// tokens, its salt, and the exact block (and incarnation) holding the
/// prefix before it. A hit is thus confirmed along the whole chain, so even
/// colliding hashes never serve another prefix's keys.
#[derive(Clone, Debug, PartialEq, Eq)]
struct CachedBlock {
    hash: u64,
    parent: Option<(BlockId, u64)>,
    tokens: Vec<u32>,
    salt: Vec<u8>,
}

#[derive(Debug)]
pub struct BlockPool {
    shape: KvShape,
    block_size: usize,
    ref_count: Vec<u32>,
    /// Bumped each time a block is allocated: tells incarnations apart.
    generation: Vec<u64>,
    /// A full block's hash and what confirms it, while in the prefix cache.
    cached: Vec<Option<CachedBlock>>,
    /// Hash → the block that holds it.
    by_hash: HashMap<u64, BlockId>,
    /// Free blocks in eviction order: stamp → block.
    free: BTreeMap<u64, BlockId>,
    /// Each free block's stamp.
    free_stamp: Vec<Option<u64>>,
    next_stamp: u64,
    /// Free blocks that still hold a cached prefix (kept as blocks move, so
    /// the metric costs nothing per step).
    cached_free: usize,
}

impl BlockPool {
    /// `num_blocks` blocks of `block_size` positions, all free.
    pub fn new(
        shape: KvShape,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<BlockPool, PoolError> {
        if block_size == 0 {
            return Err(PoolError::BlockSize);
        }
        let mut pool = BlockPool {
            shape,
            block_size,
            ref_count: vec![0; num_blocks],
            generation: vec![0; num_blocks],
            cached: vec![None; num_blocks],
            by_hash: HashMap::new(),
            free: BTreeMap::new(),
            free_stamp: vec![None; num_blocks],
            next_stamp: 0,
            cached_free: 0,
        };
        for id in 0..num_blocks as BlockId {
            pool.push_free(id);
        }
        Ok(pool)
    }

    /// As many blocks as `bytes` holds.
    pub fn with_bytes(
        shape: KvShape,
        block_size: usize,
        bytes: usize,
    ) -> Result<BlockPool, PoolError> {
        if block_size == 0 {
            return Err(PoolError::BlockSize);
        }
        let block_bytes = block_floats(shape, block_size) * 4;
        let n = bytes / block_bytes.max(1);
        if n == 0 {
            return Err(PoolError::NoBlocks { bytes, block_bytes });
        }
        BlockPool::new(shape, block_size, n)
    }

    pub fn shape(&self) -> KvShape {
        self.shape
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_count.len()
    }

    /// Blocks nobody holds (cached ones included: they can be evicted).
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Free blocks that still hold a cached prefix.
    pub fn num_cached_free(&self) -> usize {
        self.cached_free
    }

    /// The same, counted from scratch (the tests check the counter).
    #[cfg(test)]
    pub(crate) fn count_cached_free(&self) -> usize {
        self.free
            .values()
            .filter(|&&b| self.cached[b as usize].is_some())
            .count()
    }

    pub fn block_bytes(&self) -> usize {
        block_floats(self.shape, self.block_size) * 4
    }

    pub fn ref_count(&self, id: BlockId) -> u32 {
        self.ref_count.get(id as usize).copied().unwrap_or(0)
    }

    /// Take the front of the free list (evicting its cached prefix, if any).
    pub fn allocate(&mut self) -> Option<BlockId> {
        let (_, id) = self.free.pop_first()?;
        self.free_stamp[id as usize] = None;
        if let Some(c) = self.cached[id as usize].take() {
            self.cached_free -= 1;
            if self.by_hash.get(&c.hash) == Some(&id) {
                self.by_hash.remove(&c.hash);
            }
        }
        self.generation[id as usize] += 1;
        self.ref_count[id as usize] = 1;
        Some(id)
    }

    /// One more holder of `id` (a prefix-cache hit or a fork); a free
    /// block leaves the free list.
    pub fn acquire(&mut self, id: BlockId) -> Result<(), PoolError> {
        let i = self.index(id)?;
        if let Some(stamp) = self.free_stamp[i].take() {
            self.free.remove(&stamp);
            if self.cached[i].is_some() {
                self.cached_free -= 1;
            }
        }
        self.ref_count[i] += 1;
        Ok(())
    }

    /// One holder fewer; at zero the block is free (and stays cached if
    /// it was), at the back of the eviction order.
    pub fn release(&mut self, id: BlockId) -> Result<(), PoolError> {
        let i = self.index(id)?;
        if self.ref_count[i] == 0 {
            return Err(PoolError::NotHeld(id));
        }
        self.ref_count[i] -= 1;
        if self.ref_count[i] == 0 {
            self.push_free(id);
        }
        Ok(())
    }

    /// The block caching `hash`, confirmed: same tokens, same salt, and
    /// its prefix held by `parent` (the block the previous lookup of this
    /// prompt returned; None for the first block). A collision is a miss,
    /// never another prefix's K/V.
    pub fn lookup(
        &self,
        hash: u64,
        parent: Option<BlockId>,
        tokens: &[u32],
        salt: &[u8],
    ) -> Option<BlockId> {
        let &id = self.by_hash.get(&hash)?;
        let c = self.cached.get(id as usize)?.as_ref()?;
        let parent = match parent {
            Some(p) => Some((p, *self.generation.get(p as usize)?)),
            None => None,
        };
        (c.hash == hash && c.parent == parent && c.tokens == tokens && c.salt == salt).then_some(id)
    }

    /// Put a full block in the prefix cache under `hash`, its prefix held
    /// by `parent`. A hash already cached by another block keeps that block
    /// (one copy per prefix).
    pub fn register(
        &mut self,
        id: BlockId,
        hash: u64,
        parent: Option<BlockId>,
        tokens: &[u32],
        salt: &[u8],
    ) -> Result<(), PoolError> {
        let i = self.index(id)?;
        if self.by_hash.contains_key(&hash) || self.cached[i].is_some() {
            return Ok(());
        }
        let parent = match parent {
            Some(p) => Some((p, self.generation[self.index(p)?])),
            None => None,
        };
        self.by_hash.insert(hash, id);
        if self.free_stamp[i].is_some() {
            self.cached_free += 1;
        }
        self.cached[i] = Some(CachedBlock {
            hash,
            parent,
            tokens: tokens.to_vec(),
            salt: salt.to_vec(),
        });
        Ok(())
    }

    /// Drop every prefix-cache entry (the blocks' contents are gone: a
    /// runner that lost its K/V, Project 13's restarted rank).
    pub fn forget_cached(&mut self) {
        self.by_hash.clear();
        self.cached.iter_mut().for_each(|c| *c = None);
        self.cached_free = 0;
    }

    /// Every prefix-cache entry points at a block cached under that hash.
    pub fn cache_is_consistent(&self) -> bool {
        self.by_hash.iter().all(|(h, &b)| {
            self.cached
                .get(b as usize)
                .is_some_and(|c| c.as_ref().is_some_and(|c| c.hash == *h))
        })
    }

    /// Whether the block is in the prefix cache.
    pub fn is_cached(&self, id: BlockId) -> bool {
        self.cached.get(id as usize).is_some_and(Option::is_some)
    }

    fn index(&self, id: BlockId) -> Result<usize, PoolError> {
        let i = id as usize;
        if i >= self.ref_count.len() {
            return Err(PoolError::OutOfRange(id));
        }
        Ok(i)
    }

    fn push_free(&mut self, id: BlockId) {
        if self.cached[id as usize].is_some() {
            self.cached_free += 1;
        }
        self.free.insert(self.next_stamp, id);
        self.free_stamp[id as usize] = Some(self.next_stamp);
        self.next_stamp += 1;
    }
}

/// f32s in one block: (n_layer, 2, n_kv_head, block_size, head_dim).
pub fn block_floats(shape: KvShape, block_size: usize) -> usize {
    shape.n_layer * 2 * shape.n_kv_head * block_size * shape.head_dim
}

/// Offset of (layer, K or V, kv_head, slot) in a block.
pub fn offset(
    shape: KvShape,
    block_size: usize,
    layer: usize,
    v: bool,
    kv_head: usize,
    slot: usize,
) -> usize {
    (((layer * 2 + v as usize) * shape.n_kv_head + kv_head) * block_size + slot) * shape.head_dim
}

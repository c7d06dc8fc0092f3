//! Where the engine core keeps its sequences' K/V, and how memory is
//! granted: the scheduler asks before it admits or grows a sequence, and
//! the core asks for each step's stores. Project 08's backend is
//! [`ContiguousKv`] (one p05 `KvCache` per sequence, growing by doubling
//! within a byte budget); Project 09 plugs in paged blocks with prefix
//! caching behind the same trait.

use std::collections::HashMap;

use common::batch::{KvShape, KvStore};
use p05_kv_cache::kv_cache::KvCache;

use crate::scheduler::SeqId;

/// Caches grow in multiples of this many positions.
pub const GRAIN: usize = 16;

/// One sequence's part of a step, as the K/V memory sees it: tokens at
/// positions `start..start + len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub id: SeqId,
    pub start: usize,
    pub len: usize,
}

/// What the scheduler asks of K/V memory.
pub trait KvAllocator {
    /// Memory for a waiting sequence with `tokens` known, which may grow to
    /// `max_len` positions. Returns how many leading tokens already have
    /// their K/V (a prefix cache hit; 0 without one), or None when it does
    /// not fit now (nothing changed).
    fn admit(&mut self, id: SeqId, tokens: &[u32], max_len: usize) -> Option<usize>;

    /// Make positions `start..end` of a running sequence writable. False
    /// (nothing changed) when memory is short: the scheduler preempts.
    fn grow(&mut self, id: SeqId, start: usize, end: usize, max_len: usize) -> bool;

    /// Release everything the sequence holds.
    fn free(&mut self, id: SeqId);

    /// Give `child` (holding nothing) the K/V of running `parent`, for
    /// parallel sampling: a paged backend shares the blocks (copy-on-write),
    /// a contiguous one copies. False (nothing changed) when memory is
    /// short; the child then computes the prompt itself.
    fn fork(&mut self, _parent: SeqId, _child: SeqId) -> bool {
        false
    }

    /// Positions the whole memory holds: a sequence longer than this can
    /// never run, even alone.
    fn capacity_positions(&self) -> usize;
}

/// A core's K/V backend: the allocator plus the memory itself.
pub trait KvBackend: KvAllocator {
    type Store<'s>: KvStore
    where
        Self: 's;

    /// Why `stores` could not hand out a chunk's store.
    type Error: std::error::Error + Send + Sync + 'static;

    /// The stores of a step's chunks, in order (each made writable by
    /// [`KvAllocator::grow`] or admission before).
    fn stores(&mut self, chunks: &[Chunk]) -> Result<Vec<Self::Store<'_>>, Self::Error>;

    /// After a step: the first `computed` of `tokens` have their K/V (a
    /// paged backend caches full blocks here).
    fn commit(&mut self, _id: SeqId, _tokens: &[u32], _computed: usize) {}

    /// A new request's prefix-cache salt (`cache_salt`), kept until
    /// [`KvBackend::release`]: only requests with the same salt share
    /// cached K/V. Backends without a prefix cache ignore it.
    fn set_salt(&mut self, _id: SeqId, _salt: &[u8]) {}

    /// The request is gone for good (finished or cancelled): free its K/V
    /// and forget its salt. (Plain `free` is a preemption: it comes back.)
    fn release(&mut self, id: SeqId) {
        self.free(id);
    }

    /// Bytes held by running sequences, and the budget.
    fn used_bytes(&self) -> usize;
    fn capacity_bytes(&self) -> usize;

    /// The backend's own metrics for `/metrics` (prefix-cache counters,
    /// cached blocks, ...).
    fn metrics(&self) -> Vec<KvMetric> {
        Vec::new()
    }
}

/// One metric of a backend, in Prometheus' terms.
#[derive(Clone, Debug, PartialEq)]
pub struct KvMetric {
    pub name: &'static str,
    pub help: &'static str,
    /// "counter" or "gauge".
    pub kind: &'static str,
    pub value: f64,
}

/// Position accounting for contiguous caches: a sequence is admitted with
/// room for its known tokens + 1 (rounded up to [`GRAIN`]); its cache grows
/// by doubling (capped at `max_len`), else exactly, within `capacity`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ContiguousAllocator {
    capacity: usize,
    allocated: HashMap<SeqId, usize>,
}

impl ContiguousAllocator {
    pub fn new(capacity_positions: usize) -> Self {
        ContiguousAllocator {
            capacity: capacity_positions,
            allocated: HashMap::new(),
        }
    }

    /// Positions allocated to `id` (0 if none).
    pub fn allocated(&self, id: SeqId) -> usize {
        self.allocated.get(&id).copied().unwrap_or(0)
    }

    pub fn used(&self) -> usize {
        self.allocated.values().sum()
    }

    fn free_positions(&self) -> usize {
        self.capacity.saturating_sub(self.used())
    }
}

impl KvAllocator for ContiguousAllocator {
    fn admit(&mut self, id: SeqId, tokens: &[u32], max_len: usize) -> Option<usize> {
        let n = tokens.len();
        let need = round_up(n + 1).min(max_len).max(n);
        if need > self.free_positions() || self.allocated.contains_key(&id) {
            return None;
        }
        self.allocated.insert(id, need);
        Some(0)
    }

    fn grow(&mut self, id: SeqId, _start: usize, end: usize, max_len: usize) -> bool {
        let have = self.allocated(id);
        if end <= have {
            return true;
        }
        let free = self.free_positions();
        let exact = round_up(end).min(max_len).max(end);
        let doubled = (2 * have).min(max_len).max(exact);
        for target in [doubled, exact] {
            if target - have <= free {
                self.allocated.insert(id, target);
                return true;
            }
        }
        false
    }

    fn free(&mut self, id: SeqId) {
        self.allocated.remove(&id);
    }

    fn fork(&mut self, parent: SeqId, child: SeqId) -> bool {
        let need = self.allocated(parent);
        if need == 0 || need > self.free_positions() || self.allocated.contains_key(&child) {
            return false;
        }
        self.allocated.insert(child, need);
        true
    }

    fn capacity_positions(&self) -> usize {
        self.capacity
    }
}

/// Project 08's backend: one contiguous p05 `KvCache` per running
/// sequence, sized by [`ContiguousAllocator`] (growing reallocates and
/// copies: `KvCache::grow`).
#[derive(Debug)]
pub struct ContiguousKv {
    shape: KvShape,
    alloc: ContiguousAllocator,
    caches: HashMap<SeqId, KvCache>,
}

impl ContiguousKv {
    /// As many positions as `bytes` holds.
    pub fn new(shape: KvShape, bytes: usize) -> Self {
        ContiguousKv {
            shape,
            alloc: ContiguousAllocator::new(bytes / shape.bytes_per_position().max(1)),
            caches: HashMap::new(),
        }
    }
}

impl KvAllocator for ContiguousKv {
    fn admit(&mut self, id: SeqId, tokens: &[u32], max_len: usize) -> Option<usize> {
        let cached = self.alloc.admit(id, tokens, max_len)?;
        let s = self.shape;
        let cap = self.alloc.allocated(id);
        self.caches
            .insert(id, KvCache::new(s.n_layer, s.n_kv_head, s.head_dim, cap));
        Some(cached)
    }

    fn grow(&mut self, id: SeqId, start: usize, end: usize, max_len: usize) -> bool {
        if !self.alloc.grow(id, start, end, max_len) {
            return false;
        }
        let cap = self.alloc.allocated(id);
        if let Some(kv) = self.caches.get_mut(&id) {
            if kv.max_seq() < cap {
                kv.grow(cap);
            }
        }
        true
    }

    fn free(&mut self, id: SeqId) {
        self.alloc.free(id);
        self.caches.remove(&id);
    }

    /// A copy of the parent's cache: what pages avoid.
    fn fork(&mut self, parent: SeqId, child: SeqId) -> bool {
        let Some(copy) = self.caches.get(&parent).cloned() else {
            return false;
        };
        if !self.alloc.fork(parent, child) {
            return false;
        }
        self.caches.insert(child, copy);
        true
    }

    fn capacity_positions(&self) -> usize {
        self.alloc.capacity_positions()
    }
}

/// A chunk whose sequence has no cache here (or that appears twice).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("sequence {0} has no K/V cache (or appears twice)")]
pub struct NoStore(pub SeqId);

impl KvBackend for ContiguousKv {
    type Store<'s> = &'s mut KvCache;
    type Error = NoStore;

    fn stores(&mut self, chunks: &[Chunk]) -> Result<Vec<&mut KvCache>, NoStore> {
        let mut by_id: HashMap<SeqId, &mut KvCache> = self
            .caches
            .iter_mut()
            .filter(|(id, _)| chunks.iter().any(|c| c.id == **id))
            .map(|(id, kv)| (*id, kv))
            .collect();
        chunks
            .iter()
            .map(|c| by_id.remove(&c.id).ok_or(NoStore(c.id)))
            .collect()
    }

    fn used_bytes(&self) -> usize {
        self.caches.values().map(KvCache::allocated_bytes).sum()
    }

    fn capacity_bytes(&self) -> usize {
        self.alloc.capacity_positions() * self.shape.bytes_per_position()
    }
}

fn round_up(n: usize) -> usize {
    n.div_ceil(GRAIN) * GRAIN
}

//! How the engine core keeps account of its sequences' K/V. The scheduler
//! asks before it admits or grows a sequence ([`KvAllocator`]); the core
//! asks where each planned sequence's K/V lives and which storage work the
//! runner must do first ([`KvBackend`]). The K/V itself is the runner's
//! ([`crate::runner::KvStorage`]): under tensor parallelism this
//! bookkeeping lives once, on rank 0, while every rank stores its heads.
//! Project 08's backend is [`ContiguousKv`] (one p05 `KvCache` per
//! sequence, growing by doubling within a byte budget); Project 09 plugs
//! in paged blocks with prefix caching behind the same traits.

use crate::runner::{KvOp, KvStorage, SeqKv};
use crate::scheduler::SeqId;

pub use crate::contiguous::{ContiguousAllocator, ContiguousKv, ContiguousStorage, GRAIN};

/// What the scheduler asks of K/V memory.
pub trait KvAllocator {
    /// Memory for a waiting sequence with `tokens` known, which may grow to
    /// `max_len` positions. Returns how many leading tokens already have
    /// their K/V (a prefix cache hit; 0 without one), or None when it does
    /// not fit now (nothing changed).
    /// `salt` keys the prefix cache: only requests with the same salt
    /// share cached K/V (a tenant's `cache_salt`).
    fn admit(&mut self, id: SeqId, tokens: &[u32], salt: &[u8], max_len: usize) -> Option<usize>;

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

/// A core's K/V bookkeeping: the allocator, plus what the runner needs to
/// find and prepare each sequence's K/V.
pub trait KvBackend: KvAllocator {
    /// The storage a runner keeps for this bookkeeping.
    type Storage: KvStorage;

    /// A storage of this layout with every K/V head (an in-process runner's).
    fn new_storage(&self) -> Self::Storage;

    /// Where a running sequence's K/V lives (None: it holds none).
    fn seq_kv(&self, id: SeqId) -> Option<SeqKv>;

    /// Storage work recorded since the last call (copy-on-write copies,
    /// forks, frees), in the order it must be done.
    fn take_ops(&mut self, into: &mut Vec<KvOp>);

    /// Memory for a sequence whose first `tokens.len()` positions arrive
    /// computed (an import): fresh memory, never a prefix-cache hit, with
    /// room for one more position. False (nothing changed) when short.
    fn admit_computed(&mut self, id: SeqId, tokens: &[u32], max_len: usize) -> bool;

    /// After a step: the first `computed` of `tokens` have their K/V (a
    /// paged backend caches full blocks here, keyed by `salt`).
    fn commit(&mut self, _id: SeqId, _tokens: &[u32], _salt: &[u8], _computed: usize) {}

    /// Forget any K/V cached for reuse (a prefix cache): the runner lost
    /// its contents. Nothing to forget by default.
    fn forget_cached(&mut self) {}

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
    /// A `rank` label (one series per rank of a split model), or none.
    pub rank: Option<usize>,
}

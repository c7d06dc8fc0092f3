//! Project 08's K/V: one contiguous p05 `KvCache` per sequence. The core
//! keeps the accounting ([`ContiguousKv`]: positions per sequence within a
//! byte budget, growing by doubling); the runner keeps the caches
//! ([`ContiguousStorage`]), made, grown, copied and dropped as the plans
//! say.

use std::collections::HashMap;

use common::batch::{KvShape, KvStore};
use p05_kv_cache::kv_cache::KvCache;

use crate::kv_backend::{KvAllocator, KvBackend};
use crate::kv_transfer::{KvBuffer, KvLayout, TransferError};
use crate::runner::{KvOp, KvStorage, PlannedSeq, SeqKv};
use crate::scheduler::SeqId;

/// Caches grow in multiples of this many positions (and export in blocks
/// of as many).
pub const GRAIN: usize = 16;

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
    fn admit(&mut self, id: SeqId, tokens: &[u32], _salt: &[u8], max_len: usize) -> Option<usize> {
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

/// Project 08's bookkeeping: positions per sequence ([`ContiguousAllocator`]),
/// and the storage work its decisions imply.
#[derive(Debug)]
pub struct ContiguousKv {
    shape: KvShape,
    alloc: ContiguousAllocator,
    ops: Vec<KvOp>,
}

impl ContiguousKv {
    /// As many positions as `bytes` holds.
    pub fn new(shape: KvShape, bytes: usize) -> Self {
        ContiguousKv {
            shape,
            alloc: ContiguousAllocator::new(bytes / shape.bytes_per_position().max(1)),
            ops: Vec::new(),
        }
    }
}

impl KvAllocator for ContiguousKv {
    fn admit(&mut self, id: SeqId, tokens: &[u32], salt: &[u8], max_len: usize) -> Option<usize> {
        self.alloc.admit(id, tokens, salt, max_len)
    }

    fn grow(&mut self, id: SeqId, start: usize, end: usize, max_len: usize) -> bool {
        self.alloc.grow(id, start, end, max_len)
    }

    fn free(&mut self, id: SeqId) {
        if self.alloc.allocated(id) > 0 {
            self.ops.push(KvOp::Free { id });
        }
        self.alloc.free(id);
    }

    /// A copy of the parent's cache: what pages avoid.
    fn fork(&mut self, parent: SeqId, child: SeqId) -> bool {
        if !self.alloc.fork(parent, child) {
            return false;
        }
        self.ops.push(KvOp::Fork { parent, child });
        true
    }

    fn capacity_positions(&self) -> usize {
        self.alloc.capacity_positions()
    }
}

impl KvBackend for ContiguousKv {
    type Storage = ContiguousStorage;

    fn new_storage(&self) -> ContiguousStorage {
        ContiguousStorage::new(self.shape)
    }

    fn seq_kv(&self, id: SeqId) -> Option<SeqKv> {
        let capacity = self.alloc.allocated(id);
        (capacity > 0).then_some(SeqKv::Slot { capacity })
    }

    fn take_ops(&mut self, into: &mut Vec<KvOp>) {
        into.append(&mut self.ops);
    }

    fn admit_computed(&mut self, id: SeqId, tokens: &[u32], max_len: usize) -> bool {
        self.alloc.admit(id, tokens, &[], max_len).is_some()
    }

    fn used_bytes(&self) -> usize {
        self.alloc.used() * self.shape.bytes_per_position()
    }

    fn capacity_bytes(&self) -> usize {
        self.alloc.capacity_positions() * self.shape.bytes_per_position()
    }
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ContiguousError {
    /// A chunk's sequence has no cache here, appears twice, or is planned
    /// with a block table.
    #[error("sequence {0} has no K/V cache here (or appears twice in the step)")]
    NoStore(SeqId),
    #[error("a contiguous storage has no blocks to copy")]
    NotPaged,
    #[error(transparent)]
    Transfer(#[from] TransferError),
}

/// The runner's caches: one `KvCache` per sequence.
#[derive(Debug)]
pub struct ContiguousStorage {
    shape: KvShape,
    caches: HashMap<SeqId, KvCache>,
}

impl ContiguousStorage {
    pub fn new(shape: KvShape) -> Self {
        ContiguousStorage {
            shape,
            caches: HashMap::new(),
        }
    }

    /// `id`'s cache with room for `capacity` positions.
    fn slot(&mut self, id: SeqId, capacity: usize) -> &mut KvCache {
        let s = self.shape;
        let kv = self
            .caches
            .entry(id)
            .or_insert_with(|| KvCache::new(s.n_layer, s.n_kv_head, s.head_dim, capacity));
        if kv.max_seq() < capacity {
            kv.grow(capacity);
        }
        kv
    }
}

impl KvStorage for ContiguousStorage {
    type Store<'s> = &'s mut KvCache;
    type Error = ContiguousError;

    fn layout(&self) -> KvLayout {
        KvLayout::whole(self.shape, GRAIN)
    }

    fn apply(&mut self, op: &KvOp) -> Result<(), ContiguousError> {
        match *op {
            KvOp::Free { id } => {
                self.caches.remove(&id);
            }
            KvOp::Fork { parent, child } => {
                let copy = self
                    .caches
                    .get(&parent)
                    .cloned()
                    .ok_or(ContiguousError::NoStore(parent))?;
                self.caches.insert(child, copy);
            }
            KvOp::CopyBlock { .. } => return Err(ContiguousError::NotPaged),
        }
        Ok(())
    }

    fn stores(&mut self, seqs: &[PlannedSeq]) -> Result<Vec<&mut KvCache>, ContiguousError> {
        for s in seqs {
            let SeqKv::Slot { capacity } = s.kv else {
                return Err(ContiguousError::NoStore(s.id));
            };
            self.slot(s.id, capacity);
        }
        let mut by_id: HashMap<SeqId, &mut KvCache> = self
            .caches
            .iter_mut()
            .filter(|(id, _)| seqs.iter().any(|s| s.id == **id))
            .map(|(id, kv)| (*id, kv))
            .collect();
        seqs.iter()
            .map(|s| by_id.remove(&s.id).ok_or(ContiguousError::NoStore(s.id)))
            .collect()
    }

    fn export(&self, id: SeqId, _kv: &SeqKv, tokens: usize) -> Result<KvBuffer, ContiguousError> {
        let kv = self.caches.get(&id).ok_or(ContiguousError::NoStore(id))?;
        if tokens > kv.len() {
            return Err(TransferError::NoRoom {
                tokens,
                room: kv.len(),
            }
            .into());
        }
        let layout = self.layout();
        let (hd, bs) = (layout.head_dim, layout.block_size);
        let mut buf = KvBuffer::zeros(layout, tokens);
        for layer in 0..layout.n_layer {
            for h in 0..layout.n_kv_head {
                let (k, v) = kv.head(layer, h);
                for p in 0..tokens {
                    let block = buf.block_mut(p / bs);
                    let (kd, vd) = (
                        layout.offset(layer, false, h, p % bs),
                        layout.offset(layer, true, h, p % bs),
                    );
                    block[kd..kd + hd].copy_from_slice(&k[p * hd..(p + 1) * hd]);
                    block[vd..vd + hd].copy_from_slice(&v[p * hd..(p + 1) * hd]);
                }
            }
        }
        Ok(buf)
    }

    fn import(&mut self, id: SeqId, kv: &SeqKv, buf: &KvBuffer) -> Result<(), ContiguousError> {
        let layout = self.layout();
        buf.check(&layout)?;
        let SeqKv::Slot { capacity } = *kv else {
            return Err(ContiguousError::NoStore(id));
        };
        if buf.tokens > capacity {
            return Err(TransferError::NoRoom {
                tokens: buf.tokens,
                room: capacity,
            }
            .into());
        }
        let (hd, bs, nkv) = (layout.head_dim, layout.block_size, layout.n_kv_head);
        let cache = self.slot(id, capacity);
        // A fresh fill: positions 0..tokens, every layer, then one advance.
        let _ = cache.set_len(0);
        let w = nkv * hd;
        let (mut k_rows, mut v_rows) = (vec![0.0; buf.tokens * w], vec![0.0; buf.tokens * w]);
        for layer in 0..layout.n_layer {
            for p in 0..buf.tokens {
                let block = buf.block(p / bs);
                for h in 0..nkv {
                    let (kd, vd) = (
                        layout.offset(layer, false, h, p % bs),
                        layout.offset(layer, true, h, p % bs),
                    );
                    k_rows[p * w + h * hd..][..hd].copy_from_slice(&block[kd..kd + hd]);
                    v_rows[p * w + h * hd..][..hd].copy_from_slice(&block[vd..vd + hd]);
                }
            }
            KvStore::write(cache, layer, &k_rows, &v_rows, buf.tokens);
        }
        KvStore::advance(cache, buf.tokens);
        Ok(())
    }
}

fn round_up(n: usize) -> usize {
    n.div_ceil(GRAIN) * GRAIN
}

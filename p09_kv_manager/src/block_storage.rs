//! The blocks' memory: what a runner owns (every tensor-parallel rank
//! holds one, for its own K/V heads), apart from the pool's bookkeeping.
//! It knows no reference counts and no hashes: it copies blocks when a
//! plan says so, lends each step's blocks to the step (written ones
//! mutably, each to one sequence; the rest readable), and copies a
//! sequence's blocks out and in for a hand-off, or lends them (moves their
//! memory out, to be filled on another thread, and back).
//!
//! Each block is (n_layer, 2 (K, V), n_kv_head, block_size, head_dim), so
//! one KV head's keys for the block are contiguous (one run for the
//! attention), and an exported buffer is the blocks one after another.

use p08_continuous::kv_transfer::{KvBuffer, KvLayout, KvLease, TransferError};
use p08_continuous::runner::{KvOp, KvStorage, PlannedSeq, SeqKv};
use p08_continuous::scheduler::SeqId;

use crate::block_pool::{BlockId, PoolError};
use crate::paged_store::{BlockRef, PagedStore};

#[derive(Debug)]
pub struct BlockStorage {
    layout: KvLayout,
    /// (num_blocks,), each (n_layer, 2, n_kv_head, block_size, head_dim)
    blocks: Vec<Box<[f32]>>,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StorageError {
    #[error(transparent)]
    Pool(#[from] PoolError),
    #[error(transparent)]
    Transfer(#[from] TransferError),
    #[error("sequence {0} is planned without a block table")]
    NotPaged(SeqId),
    #[error("a paged storage forks and frees nothing: {0:?} belongs to contiguous storage")]
    Op(KvOp),
    /// A step, copy or export named a block whose memory is lent out.
    #[error("block {0} is lent out (a transfer is filling it)")]
    Lent(BlockId),
    /// A lease given back that this storage did not lend as it is.
    #[error("block {block} was not lent, or comes back with {got} floats (a block holds {want})")]
    NotLent {
        block: BlockId,
        got: usize,
        want: usize,
    },
}

impl BlockStorage {
    /// `num_blocks` zeroed blocks of `layout`.
    pub fn new(layout: KvLayout, num_blocks: usize) -> BlockStorage {
        let floats = layout.block_floats();
        BlockStorage {
            layout,
            blocks: (0..num_blocks)
                .map(|_| vec![0.0f32; floats].into_boxed_slice())
                .collect(),
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    fn index(&self, id: BlockId) -> Result<usize, PoolError> {
        let i = id as usize;
        if i >= self.blocks.len() {
            return Err(PoolError::OutOfRange(id));
        }
        Ok(i)
    }

    /// Block `id`'s slot, refused while its memory is lent out.
    fn present(&self, id: BlockId) -> Result<usize, StorageError> {
        let i = self.index(id)?;
        if self.blocks[i].is_empty() {
            return Err(StorageError::Lent(id));
        }
        Ok(i)
    }

    /// Copy a block's K/V (copy-on-write).
    pub fn copy(&mut self, src: BlockId, dst: BlockId) -> Result<(), StorageError> {
        let (s, d) = (self.present(src)?, self.present(dst)?);
        if s != d {
            let (lo, hi) = self.blocks.split_at_mut(s.max(d));
            let (from, to) = if s < d {
                (&lo[s], &mut hi[0])
            } else {
                (&hi[0], &mut lo[d])
            };
            to.copy_from_slice(from);
        }
        Ok(())
    }

    /// The blocks' memory for one step: `writes` (each listed once)
    /// mutable, every other block readable. Returns (writable in the order
    /// of `writes`, readable by id).
    #[allow(clippy::type_complexity)]
    pub fn split(
        &mut self,
        writes: &[BlockId],
    ) -> Result<(Vec<&mut [f32]>, Vec<Option<&[f32]>>), PoolError> {
        let mut slots: Vec<Option<&mut [f32]>> =
            self.blocks.iter_mut().map(|b| Some(&mut **b)).collect();
        let mut writable = Vec::with_capacity(writes.len());
        for &w in writes {
            let slot = slots.get_mut(w as usize).ok_or(PoolError::OutOfRange(w))?;
            writable.push(slot.take().ok_or(PoolError::SharedWrite(w))?);
        }
        let readable = slots.into_iter().map(|s| s.map(|m| &*m)).collect();
        Ok((writable, readable))
    }
}

fn table(s: &PlannedSeq) -> Result<&[BlockId], StorageError> {
    match &s.kv {
        SeqKv::Blocks(t) => Ok(t),
        SeqKv::Slot { .. } => Err(StorageError::NotPaged(s.id)),
    }
}

impl KvStorage for BlockStorage {
    type Store<'s> = PagedStore<'s>;
    type Error = StorageError;

    fn layout(&self) -> KvLayout {
        self.layout
    }

    fn apply(&mut self, op: &KvOp) -> Result<(), StorageError> {
        match *op {
            KvOp::CopyBlock { src, dst } => Ok(self.copy(src, dst)?),
            // Paged forks share blocks; frees are the pool's alone.
            KvOp::Fork { .. } | KvOp::Free { .. } => Err(StorageError::Op(*op)),
        }
    }

    /// Blocks covering each sequence's new tokens are writable (the
    /// bookkeeping gave each to one sequence alone, copying shared ones
    /// first); every other block is read in place. A block written by two
    /// sequences, or written by one and read by another, is refused.
    fn stores(&mut self, seqs: &[PlannedSeq]) -> Result<Vec<PagedStore<'_>>, StorageError> {
        let bs = self.layout.block_size;
        let mut writes: Vec<BlockId> = Vec::new();
        let mut plan = Vec::with_capacity(seqs.len());
        for s in seqs {
            let t = table(s)?;
            for &b in t {
                self.present(b)?;
            }
            let (len, n) = (s.start, s.tokens.len());
            let range = len / bs..(len + n).div_ceil(bs);
            if range.end > t.len() {
                return Err(PoolError::NoRoom {
                    seq: s.id,
                    positions: len + n,
                    blocks: t.len(),
                }
                .into());
            }
            writes.extend_from_slice(&t[range.clone()]);
            plan.push((t, len, range));
        }
        let shape = common::batch::KvShape {
            n_layer: self.layout.n_layer,
            n_kv_head: self.layout.n_kv_head,
            head_dim: self.layout.head_dim,
        };
        let (writable, readable) = self.split(&writes)?;
        let mut writable = writable.into_iter();
        let mut stores = Vec::with_capacity(plan.len());
        for (t, len, range) in plan {
            let mut blocks = Vec::with_capacity(t.len());
            for (i, &b) in t.iter().enumerate() {
                if range.contains(&i) {
                    let w = writable.next().ok_or(PoolError::OutOfRange(b))?;
                    blocks.push(BlockRef::Write(w));
                } else {
                    let r = readable.get(b as usize).copied().flatten();
                    blocks.push(BlockRef::Read(r.ok_or(PoolError::SharedWrite(b))?));
                }
            }
            stores.push(PagedStore::new(shape, bs, len, blocks));
        }
        Ok(stores)
    }

    /// The blocks holding the first `tokens` positions, one after another.
    fn export(&self, id: SeqId, kv: &SeqKv, tokens: usize) -> Result<KvBuffer, StorageError> {
        let SeqKv::Blocks(t) = kv else {
            return Err(StorageError::NotPaged(id));
        };
        let mut buf = KvBuffer::zeros(self.layout, tokens);
        let n = buf.n_blocks();
        if n > t.len() {
            return Err(TransferError::NoRoom {
                tokens,
                room: t.len() * self.layout.block_size,
            }
            .into());
        }
        for (i, &b) in t[..n].iter().enumerate() {
            buf.block_mut(i)
                .copy_from_slice(&self.blocks[self.present(b)?]);
        }
        Ok(buf)
    }

    fn import(&mut self, id: SeqId, kv: &SeqKv, buf: &KvBuffer) -> Result<(), StorageError> {
        buf.check(&self.layout)?;
        let SeqKv::Blocks(t) = kv else {
            return Err(StorageError::NotPaged(id));
        };
        let n = buf.n_blocks();
        if n > t.len() {
            return Err(TransferError::NoRoom {
                tokens: buf.tokens,
                room: t.len() * self.layout.block_size,
            }
            .into());
        }
        for (i, &b) in t[..n].iter().enumerate() {
            let at = self.present(b)?;
            self.blocks[at].copy_from_slice(buf.block(i));
        }
        Ok(())
    }

    /// Move the memory of the blocks for `tokens` positions out: their
    /// slots stay empty (and refused) until [`Self::take_back`].
    fn lend(
        &mut self,
        id: SeqId,
        kv: &SeqKv,
        tokens: usize,
    ) -> Result<Option<KvLease>, StorageError> {
        let SeqKv::Blocks(t) = kv else {
            return Err(StorageError::NotPaged(id));
        };
        let n = tokens.div_ceil(self.layout.block_size.max(1));
        if n > t.len() {
            return Err(TransferError::NoRoom {
                tokens,
                room: t.len() * self.layout.block_size,
            }
            .into());
        }
        // Checked whole before any slot is emptied: a refusal moves nothing.
        let mut at = Vec::with_capacity(n);
        for (k, &b) in t[..n].iter().enumerate() {
            let i = self.present(b)?;
            if t[..k].contains(&b) {
                return Err(StorageError::Lent(b));
            }
            at.push((b, i));
        }
        let blocks = at
            .into_iter()
            .map(|(b, i)| (b, std::mem::take(&mut self.blocks[i])))
            .collect();
        Ok(Some(KvLease {
            layout: self.layout,
            tokens,
            blocks,
        }))
    }

    fn take_back(&mut self, lease: KvLease) -> Result<(), StorageError> {
        if lease.layout != self.layout {
            return Err(TransferError::Layout {
                got: lease.layout,
                want: self.layout,
            }
            .into());
        }
        let want = self.layout.block_floats();
        for (k, (b, mem)) in lease.blocks.iter().enumerate() {
            let i = self.index(*b)?;
            let twice = lease.blocks[..k].iter().any(|(o, _)| o == b);
            if twice || !self.blocks[i].is_empty() || mem.len() != want {
                return Err(StorageError::NotLent {
                    block: *b,
                    got: mem.len(),
                    want,
                });
            }
        }
        for (b, mem) in lease.blocks {
            self.blocks[b as usize] = mem;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use p08_continuous::kv_transfer::KvDtype;

    fn storage() -> BlockStorage {
        let layout = KvLayout {
            n_layer: 2,
            n_kv_head: 1,
            head_start: 0,
            head_dim: 2,
            block_size: 2,
            dtype: KvDtype::F32,
        };
        BlockStorage::new(layout, 4)
    }

    fn planned(id: SeqId, table: Vec<BlockId>, start: usize) -> PlannedSeq {
        PlannedSeq {
            id,
            start,
            tokens: vec![0],
            kv: SeqKv::Blocks(table),
            logits: true,
        }
    }

    #[test]
    fn lent_blocks_are_refused_until_they_come_back_holding_what_was_written() {
        let mut s = storage();
        let kv = SeqKv::Blocks(vec![2, 0]);
        let mut lease = s.lend(1, &kv, 3).unwrap().unwrap();
        assert_eq!(lease.blocks.iter().map(|b| b.0).collect::<Vec<_>>(), [2, 0]);
        // Nothing names a lent block: a step, a copy, an export, a second lend.
        let step = s.stores(&[planned(5, vec![1, 2], 3)]).map(|v| v.len());
        assert_eq!(step, Err(StorageError::Lent(2)));
        assert_eq!(s.copy(0, 3), Err(StorageError::Lent(0)));
        assert!(matches!(s.export(1, &kv, 3), Err(StorageError::Lent(2))));
        assert!(matches!(s.lend(1, &kv, 1), Err(StorageError::Lent(2))));
        // A block not lent still steps.
        assert!(s.stores(&[planned(6, vec![3], 0)]).is_ok());
        for (i, (_, mem)) in lease.blocks.iter_mut().enumerate() {
            mem.fill(i as f32 + 1.0);
        }
        s.take_back(lease).unwrap();
        let back = s.export(1, &kv, 3).unwrap();
        assert!(back.block(0).iter().all(|&x| x == 1.0));
        assert!(back.block(1).iter().all(|&x| x == 2.0));
        // Home again: a second return of the same blocks is refused.
        let twice = KvLease {
            layout: s.layout(),
            tokens: 1,
            blocks: vec![(2, vec![0.0; s.layout().block_floats()].into_boxed_slice())],
        };
        assert!(matches!(
            s.take_back(twice),
            Err(StorageError::NotLent { block: 2, .. })
        ));
    }

    #[test]
    fn a_lend_that_does_not_fit_moves_nothing() {
        let mut s = storage();
        let short = SeqKv::Blocks(vec![1]);
        assert!(matches!(
            s.lend(1, &short, 3),
            Err(StorageError::Transfer(TransferError::NoRoom { .. }))
        ));
        let twice = SeqKv::Blocks(vec![1, 1]);
        assert_eq!(s.lend(1, &twice, 3).map(|_| ()), Err(StorageError::Lent(1)));
        assert!(s.stores(&[planned(2, vec![1], 0)]).is_ok());
    }
}

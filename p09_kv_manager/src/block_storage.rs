//! The blocks' memory: what a runner owns (every tensor-parallel rank
//! holds one, for its own K/V heads), apart from the pool's bookkeeping.
//! It knows no reference counts and no hashes: it copies blocks when a
//! plan says so, lends each step's blocks to the step (written ones
//! mutably, each to one sequence; the rest readable), and copies a
//! sequence's blocks out and in for a hand-off.
//!
//! Each block is (n_layer, 2 (K, V), n_kv_head, block_size, head_dim), so
//! one KV head's keys for the block are contiguous (one run for the
//! attention), and an exported buffer is the blocks one after another.

use p08_continuous::kv_transfer::{KvBuffer, KvLayout, TransferError};
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

    /// Copy a block's K/V (copy-on-write).
    pub fn copy(&mut self, src: BlockId, dst: BlockId) -> Result<(), PoolError> {
        let (s, d) = (self.index(src)?, self.index(dst)?);
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
                .copy_from_slice(&self.blocks[self.index(b)?]);
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
            let at = self.index(b)?;
            self.blocks[at].copy_from_slice(buf.block(i));
        }
        Ok(())
    }
}

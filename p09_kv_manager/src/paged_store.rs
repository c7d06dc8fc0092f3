//! One sequence's view of the block pool for one step: its block table as
//! the [`KvStore`] the batched step of Project 07 reads and writes. Blocks
//! it writes this step are borrowed mutably (each is held by this sequence
//! alone: copy-on-write has run before); every other block, shared or not,
//! is read in place. The attention reads one run per block: a paged
//! attention on the CPU, with no copy of the sequence's K/V.

use common::batch::{KvRunFn, KvShape, KvStore};

use crate::block_pool::offset;

/// A block as the step sees it.
#[derive(Debug)]
pub enum BlockRef<'a> {
    Read(&'a [f32]),
    Write(&'a mut [f32]),
}

impl BlockRef<'_> {
    fn data(&self) -> &[f32] {
        match self {
            BlockRef::Read(b) => b,
            BlockRef::Write(b) => b,
        }
    }
}

#[derive(Debug)]
pub struct PagedStore<'a> {
    shape: KvShape,
    block_size: usize,
    /// Positions filled.
    len: usize,
    /// In table order: block i holds positions i*block_size..(i+1)*block_size.
    blocks: Vec<BlockRef<'a>>,
}

impl<'a> PagedStore<'a> {
    pub fn new(shape: KvShape, block_size: usize, len: usize, blocks: Vec<BlockRef<'a>>) -> Self {
        PagedStore {
            shape,
            block_size,
            len,
            blocks,
        }
    }
}

impl KvStore for PagedStore<'_> {
    fn shape(&self) -> KvShape {
        self.shape
    }

    fn len(&self) -> usize {
        self.len
    }

    fn capacity(&self) -> usize {
        self.blocks.len() * self.block_size
    }

    fn write(&mut self, layer: usize, k_rows: &[f32], v_rows: &[f32], n: usize) {
        let (hd, nkv, bs) = (self.shape.head_dim, self.shape.n_kv_head, self.block_size);
        let w = nkv * hd;
        for i in 0..n {
            let pos = self.len + i;
            // The step checked the room and the engine made these blocks
            // writable; a read-only block here is a bug of the manager.
            let Some(BlockRef::Write(block)) = self.blocks.get_mut(pos / bs) else {
                panic!("position {pos} of a paged store is not writable in this step");
            };
            for h in 0..nkv {
                let k_at = offset(self.shape, bs, layer, false, h, pos % bs);
                let v_at = offset(self.shape, bs, layer, true, h, pos % bs);
                block[k_at..k_at + hd].copy_from_slice(&k_rows[i * w + h * hd..][..hd]);
                block[v_at..v_at + hd].copy_from_slice(&v_rows[i * w + h * hd..][..hd]);
            }
        }
    }

    fn advance(&mut self, n: usize) {
        self.len += n;
    }

    /// One run per block: (first position, keys, values), each (run, head_dim).
    fn for_each_run(&self, layer: usize, kv_head: usize, upto: usize, f: &mut KvRunFn<'_>) {
        let (hd, bs) = (self.shape.head_dim, self.block_size);
        for (b, block) in self.blocks.iter().enumerate() {
            let p0 = b * bs;
            if p0 >= upto {
                break;
            }
            let run = (upto - p0).min(bs);
            let data = block.data();
            let k_at = offset(self.shape, bs, layer, false, kv_head, 0);
            let v_at = offset(self.shape, bs, layer, true, kv_head, 0);
            f(
                p0,
                &data[k_at..k_at + run * hd],
                &data[v_at..v_at + run * hd],
            );
        }
    }

    fn bytes(&self) -> usize {
        self.blocks.len() * crate::block_pool::block_floats(self.shape, self.block_size) * 4
    }
}

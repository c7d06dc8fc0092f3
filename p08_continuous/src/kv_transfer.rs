//! A sequence's K/V outside any storage: what a prefill worker hands a
//! decode worker (Project 14), and what a test moves from one engine to
//! another. The buffer declares its layout; a storage refuses a buffer
//! whose layout is not its own, rather than reading keys as values or one
//! model's heads as another's.
//!
//! Data order, block by block (the paged storage's own block layout, so a
//! paged export or import is one copy per block):
//!
//! ```text
//! (n_blocks, n_layer, 2 (K, V), n_kv_head, block_size, head_dim)
//! n_blocks = ceil(tokens / block_size); positions past `tokens` are zeros
//! ```

use common::batch::KvShape;
use thiserror::Error;

/// The element type of K/V.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvDtype {
    F32,
}

/// How a storage lays out K/V, and so what its buffers hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub n_layer: usize,
    /// K/V heads held (a tensor-parallel rank holds a slice).
    pub n_kv_head: usize,
    /// The first of them among the model's K/V heads.
    pub head_start: usize,
    pub head_dim: usize,
    /// Positions per block of the buffer.
    pub block_size: usize,
    pub dtype: KvDtype,
}

impl KvLayout {
    /// All of a model's K/V heads, in blocks of `block_size`.
    pub fn whole(shape: KvShape, block_size: usize) -> KvLayout {
        KvLayout {
            n_layer: shape.n_layer,
            n_kv_head: shape.n_kv_head,
            head_start: 0,
            head_dim: shape.head_dim,
            block_size,
            dtype: KvDtype::F32,
        }
    }

    /// Floats in one block: (n_layer, 2, n_kv_head, block_size, head_dim).
    pub fn block_floats(&self) -> usize {
        self.n_layer * 2 * self.n_kv_head * self.block_size * self.head_dim
    }

    /// Offset of (layer, K or V, kv_head, slot) within a block.
    pub fn offset(&self, layer: usize, v: bool, kv_head: usize, slot: usize) -> usize {
        (((layer * 2 + v as usize) * self.n_kv_head + kv_head) * self.block_size + slot)
            * self.head_dim
    }
}

#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum TransferError {
    #[error("the K/V buffer's layout {got:?} is not this storage's {want:?}")]
    Layout { got: KvLayout, want: KvLayout },
    #[error("the K/V buffer holds {got} floats; {tokens} tokens in {layout:?} need {want}")]
    Size {
        got: usize,
        want: usize,
        tokens: usize,
        layout: KvLayout,
    },
    #[error("{tokens} tokens of K/V do not fit in {room} positions")]
    NoRoom { tokens: usize, room: usize },
}

/// A sequence's first `tokens` positions of K/V, in `layout`.
#[derive(Clone, Debug, PartialEq)]
pub struct KvBuffer {
    pub layout: KvLayout,
    pub tokens: usize,
    /// (n_blocks, n_layer, 2, n_kv_head, block_size, head_dim)
    pub data: Vec<f32>,
}

impl KvBuffer {
    /// Zeros for `tokens` positions.
    pub fn zeros(layout: KvLayout, tokens: usize) -> KvBuffer {
        let n = tokens.div_ceil(layout.block_size.max(1)) * layout.block_floats();
        KvBuffer {
            layout,
            tokens,
            data: vec![0.0; n],
        }
    }

    pub fn n_blocks(&self) -> usize {
        self.tokens.div_ceil(self.layout.block_size.max(1))
    }

    /// Block `i`'s floats.
    pub fn block(&self, i: usize) -> &[f32] {
        let n = self.layout.block_floats();
        &self.data[i * n..(i + 1) * n]
    }

    pub fn block_mut(&mut self, i: usize) -> &mut [f32] {
        let n = self.layout.block_floats();
        &mut self.data[i * n..(i + 1) * n]
    }

    /// Refuse a buffer of another layout, or one whose data does not hold
    /// its `tokens` (it may come from another process).
    pub fn check(&self, want: &KvLayout) -> Result<(), TransferError> {
        if self.layout != *want {
            return Err(TransferError::Layout {
                got: self.layout,
                want: *want,
            });
        }
        let need = self
            .tokens
            .div_ceil(want.block_size.max(1))
            .checked_mul(want.block_floats());
        if need != Some(self.data.len()) {
            return Err(TransferError::Size {
                got: self.data.len(),
                want: need.unwrap_or(usize::MAX),
                tokens: self.tokens,
                layout: *want,
            });
        }
        Ok(())
    }
}

/// A sequence's blocks lent out of a paged storage, so that another thread
/// (Project 14's pull) can fill them while the model thread runs steps on
/// the others. Each block's memory is moved out, not shared: while it is
/// lent the storage holds an empty slot there and refuses a step that
/// names it, so nothing reads memory the filler is writing. Given back
/// ([`crate::runner::KvStorage::take_back`]), the same memory returns to
/// its slot: no copy either way.
#[derive(Debug)]
pub struct KvLease {
    pub layout: KvLayout,
    /// Positions the blocks are lent for (they cover ceil(tokens / block_size) blocks).
    pub tokens: usize,
    /// (block id, its floats: (n_layer, 2, n_kv_head, block_size, head_dim)), in table order.
    pub blocks: Vec<(u32, Box<[f32]>)>,
}

/// K/V blocks a transfer's frames can land in: a [`KvBuffer`] or a
/// [`KvLease`] (the same block layout, one memory or one per block).
pub trait KvBlocksMut {
    fn layout(&self) -> &KvLayout;
    /// Positions the blocks are for.
    fn tokens(&self) -> usize;
    /// Every block's floats, in position order.
    fn blocks_mut(&mut self) -> Vec<&mut [f32]>;
}

impl KvBlocksMut for KvBuffer {
    fn layout(&self) -> &KvLayout {
        &self.layout
    }

    fn tokens(&self) -> usize {
        self.tokens
    }

    fn blocks_mut(&mut self) -> Vec<&mut [f32]> {
        let n = self.layout.block_floats().max(1);
        self.data.chunks_mut(n).collect()
    }
}

impl KvBlocksMut for KvLease {
    fn layout(&self) -> &KvLayout {
        &self.layout
    }

    fn tokens(&self) -> usize {
        self.tokens
    }

    fn blocks_mut(&mut self) -> Vec<&mut [f32]> {
        self.blocks.iter_mut().map(|(_, b)| &mut **b).collect()
    }
}

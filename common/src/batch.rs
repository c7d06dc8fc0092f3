//! The batched, ragged step (Project 07): the seam every serving project
//! runs on (dynamic batching, continuous batching, paged KV, parallelism).
//!
//! A step takes several sequences at once. Each brings its own new tokens (a
//! whole prompt, a prompt chunk, or one decode token) at its own positions;
//! they are flattened into one (n_tokens,) array with per-sequence offsets,
//! no padding. Projections and the MLP run as one matrix product over all
//! n_tokens rows; attention runs per sequence over that sequence's own keys
//! and values, which live behind [`KvStore`]. The step returns the logits of
//! each sequence's last new token only.
//!
//! ```text
//! tokens   [ a0 a1 a2 a3 | b0 | c0 c1 ]      n_tokens = 7, no padding
//! seqs     (0, 4, p=0)  (4, 1, p=37) (5, 2, p=12)   (offset, len, start_pos)
//! logits   [ a3's row, b0's row, c1's row ]  (n_seqs, vocab)
//! ```

use thiserror::Error;

use crate::Model;

/// One sequence's share of a step: token rows `offset..offset + len`, at
/// positions `start_pos..start_pos + len` of that sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqSlice {
    pub offset: usize,
    pub len: usize,
    pub start_pos: usize,
}

#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum BatchError {
    #[error("sequence {seq} brings no tokens to the step")]
    EmptySequence { seq: usize },
    #[error("the step has {stores} K/V stores for {seqs} sequences")]
    StoreCount { stores: usize, seqs: usize },
    #[error("sequence {seq} starts at position {start_pos} but its K/V store holds {len}")]
    Position {
        seq: usize,
        start_pos: usize,
        len: usize,
    },
    #[error("sequence {seq}: KV cache is full: {len} of {capacity} positions used, {adding} more requested")]
    StoreFull {
        seq: usize,
        len: usize,
        adding: usize,
        capacity: usize,
    },
    #[error("sequence {seq} reaches position {end}, beyond the context of {context}")]
    Context {
        seq: usize,
        end: usize,
        context: usize,
    },
    #[error("token id {id} (sequence {seq}) is outside the vocabulary (0..{vocab})")]
    TokenId { seq: usize, id: u32, vocab: usize },
    #[error("logits buffer has {len} entries; {rows} rows x {vocab} vocabulary needed")]
    Logits {
        len: usize,
        rows: usize,
        vocab: usize,
    },
    #[error("the K/V store's shape {got:?} is not the model's {want:?}")]
    Shape { got: KvShape, want: KvShape },
}

/// A step's new tokens of all its sequences, flattened. Reused across steps
/// ([`Batch::clear`] keeps the memory), so building one allocates nothing
/// once warm.
#[derive(Clone, Debug, Default)]
pub struct Batch {
    /// (n_tokens,)
    tokens: Vec<u32>,
    /// (n_seqs,)
    seqs: Vec<SeqSlice>,
}

impl Batch {
    pub fn new() -> Batch {
        Batch::default()
    }

    pub fn clear(&mut self) {
        self.tokens.clear();
        self.seqs.clear();
    }

    /// Add a sequence's new tokens, at positions `start_pos..`. Returns its
    /// index in the step (the row of its logits).
    pub fn push(&mut self, tokens: &[u32], start_pos: usize) -> Result<usize, BatchError> {
        let seq = self.seqs.len();
        if tokens.is_empty() {
            return Err(BatchError::EmptySequence { seq });
        }
        self.seqs.push(SeqSlice {
            offset: self.tokens.len(),
            len: tokens.len(),
            start_pos,
        });
        self.tokens.extend_from_slice(tokens);
        Ok(seq)
    }

    /// (n_tokens,)
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// (n_seqs,)
    pub fn seqs(&self) -> &[SeqSlice] {
        &self.seqs
    }

    pub fn n_tokens(&self) -> usize {
        self.tokens.len()
    }

    pub fn n_seqs(&self) -> usize {
        self.seqs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }

    /// Everything a step must satisfy before any work: one store per
    /// sequence of the model's shape, each starting where its store ends
    /// with room for its tokens, positions inside `context_length`, ids
    /// inside the vocabulary, and a logits buffer of (n_seqs, vocab_size).
    pub fn check<S: KvStore>(
        &self,
        stores: &[&mut S],
        shape: KvShape,
        context_length: usize,
        vocab_size: usize,
        logits_len: usize,
    ) -> Result<(), BatchError> {
        self.check_rows(
            stores,
            shape,
            context_length,
            vocab_size,
            logits_len,
            self.seqs.len(),
        )
    }

    /// [`Batch::check`] for a logits buffer of `logit_rows` rows (every
    /// token's, for a perplexity pass, instead of each sequence's last).
    pub fn check_rows<S: KvStore>(
        &self,
        stores: &[&mut S],
        shape: KvShape,
        context_length: usize,
        vocab_size: usize,
        logits_len: usize,
        logit_rows: usize,
    ) -> Result<(), BatchError> {
        if stores.len() != self.seqs.len() {
            return Err(BatchError::StoreCount {
                stores: stores.len(),
                seqs: self.seqs.len(),
            });
        }
        for (seq, (s, store)) in self.seqs.iter().zip(stores).enumerate() {
            if store.shape() != shape {
                return Err(BatchError::Shape {
                    got: store.shape(),
                    want: shape,
                });
            }
            if s.start_pos != store.len() {
                return Err(BatchError::Position {
                    seq,
                    start_pos: s.start_pos,
                    len: store.len(),
                });
            }
            let end = s.start_pos.saturating_add(s.len);
            if end > store.capacity() {
                return Err(BatchError::StoreFull {
                    seq,
                    len: store.len(),
                    adding: s.len,
                    capacity: store.capacity(),
                });
            }
            if end > context_length {
                return Err(BatchError::Context {
                    seq,
                    end,
                    context: context_length,
                });
            }
            let ids = &self.tokens[s.offset..s.offset + s.len];
            if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab_size) {
                return Err(BatchError::TokenId {
                    seq,
                    id,
                    vocab: vocab_size,
                });
            }
        }
        if Some(logits_len) != logit_rows.checked_mul(vocab_size) {
            return Err(BatchError::Logits {
                len: logits_len,
                rows: logit_rows,
                vocab: vocab_size,
            });
        }
        Ok(())
    }
}

/// The geometry of a model's keys and values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    pub n_layer: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
}

impl KvShape {
    /// f32 bytes of K and V for one position over all layers.
    pub fn bytes_per_position(&self) -> usize {
        2 * self.n_layer * self.n_kv_head * self.head_dim * 4
    }
}

/// What [`KvStore::for_each_run`] calls per run: (first position, keys
/// (run, head_dim), values (run, head_dim)).
pub type KvRunFn<'f> = dyn FnMut(usize, &[f32], &[f32]) + 'f;

/// Where one sequence's keys and values live. Today's contiguous cache
/// (p05's `KvCache`) is one implementation; paged blocks (Project 09)
/// another. The step writes the new positions of every layer, reads them
/// back as runs of consecutive positions, then [`KvStore::advance`]s.
pub trait KvStore: Send + Sync {
    fn shape(&self) -> KvShape;

    /// Positions filled (and counted) so far.
    fn len(&self) -> usize;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Positions this store can hold without growing.
    fn capacity(&self) -> usize;

    /// Store K and V rows, each (n, n_kv_head * head_dim), of `layer` at
    /// positions `len()..len() + n`. The caller has checked the room
    /// ([`Batch::check`]); they count once [`KvStore::advance`] is called.
    fn write(&mut self, layer: usize, k_rows: &[f32], v_rows: &[f32], n: usize);

    /// Count `n` more positions as filled, after every layer wrote them.
    fn advance(&mut self, n: usize);

    /// Keys and values of positions `0..upto` of one layer and KV head, as
    /// runs of consecutive positions in order: `f(first_position, keys,
    /// values)`, keys and values each (run, head_dim). `upto` may include
    /// positions written in this step but not yet advanced.
    fn for_each_run(&self, layer: usize, kv_head: usize, upto: usize, f: &mut KvRunFn<'_>);

    /// Bytes of K/V memory this store holds.
    fn bytes(&self) -> usize;
}

/// A borrowed store is a store: a backend that owns its caches lends them
/// to a step as `&mut` (p08's contiguous backend does).
impl<S: KvStore + ?Sized> KvStore for &mut S {
    fn shape(&self) -> KvShape {
        (**self).shape()
    }

    fn len(&self) -> usize {
        (**self).len()
    }

    fn capacity(&self) -> usize {
        (**self).capacity()
    }

    fn write(&mut self, layer: usize, k_rows: &[f32], v_rows: &[f32], n: usize) {
        (**self).write(layer, k_rows, v_rows, n);
    }

    fn advance(&mut self, n: usize) {
        (**self).advance(n);
    }

    fn for_each_run(&self, layer: usize, kv_head: usize, upto: usize, f: &mut KvRunFn<'_>) {
        (**self).for_each_run(layer, kv_head, upto, f);
    }

    fn bytes(&self) -> usize {
        (**self).bytes()
    }
}

/// A model that runs batched, ragged steps. Its single-sequence
/// [`Model`] API (`prefill`, `decode`) is a thin adapter over
/// `forward_batch` with a batch of one; it also gives the model's info and
/// error type.
pub trait BatchModel: Model + Send + Sync {
    /// The step's scratch buffers, sized by its token count and owned by
    /// whoever drives the steps (an engine thread), never by a sequence.
    type Workspace: Send;

    fn kv_shape(&self) -> KvShape;

    fn new_workspace(&self) -> Self::Workspace;

    /// Run one step: every sequence's new tokens through the model, their
    /// K/V appended to `stores[i]` (one per sequence, in batch order), and
    /// the logits of each sequence's last new token written to `logits`
    /// (n_seqs, vocab). Checks everything ([`Batch::check`]) before any work.
    fn forward_batch<S: KvStore>(
        &self,
        batch: &Batch,
        stores: &mut [&mut S],
        ws: &mut Self::Workspace,
        logits: &mut [f32],
    ) -> Result<(), <Self as Model>::Error>;
}

/// The single-sequence adapter every engine's `Model` API runs: `ids` at
/// positions `store.len()..` as a batch of one (reusing `batch`), the last
/// token's logits into `logits` (vocab).
pub fn forward_one<M, S>(
    model: &M,
    batch: &mut Batch,
    ws: &mut M::Workspace,
    ids: &[u32],
    mut store: &mut S,
    logits: &mut [f32],
) -> Result<(), <M as Model>::Error>
where
    M: BatchModel,
    S: KvStore,
    <M as Model>::Error: From<BatchError>,
{
    batch.clear();
    batch.push(ids, store.len())?;
    model.forward_batch(batch, std::slice::from_mut(&mut store), ws, logits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_flattens_without_padding_and_refuses_empty_sequences() {
        let mut b = Batch::new();
        assert_eq!(b.push(&[1, 2, 3, 4], 0), Ok(0));
        assert_eq!(b.push(&[5], 37), Ok(1));
        assert_eq!(b.push(&[6, 7], 12), Ok(2));
        assert_eq!(b.tokens(), &[1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(
            b.seqs()[2],
            SeqSlice {
                offset: 5,
                len: 2,
                start_pos: 12
            }
        );
        assert_eq!(b.push(&[], 3), Err(BatchError::EmptySequence { seq: 3 }));
        assert_eq!(b.n_seqs(), 3);
        b.clear();
        assert!(b.is_empty());
        assert_eq!(b.n_tokens(), 0);
    }
}

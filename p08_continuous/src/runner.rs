//! The model-runner seam (nano-vllm's `ModelRunner`, vLLM's workers): the
//! engine core decides, a runner executes.
//!
//! ```text
//! engine core (rank 0)                     model runner (every rank)
//!   scheduler, block bookkeeping,            the weights (or its shard),
//!   sequences, sampling                      the K/V storage it owns
//!        │  StepPlan: per sequence its new tokens, first position,
//!        │  block table (or slot), whether it needs logits;
//!        │  K/V work to do first (block copies, forks, frees)
//!        └──────────────────────────────────▶ execute(plan)
//!        ◀────────────────────────────────── logits rows (the asked ones)
//! ```
//!
//! A [`StepPlan`] is plain data: nothing in it points into the core, so it
//! can be encoded ([`crate::plan_codec`]) and broadcast to tensor-parallel
//! ranks or shipped to a worker on another host. Every plan is complete in
//! itself (whole block tables, not changes since the last step), so a
//! runner keeps no copy of the core's bookkeeping. [`LocalRunner`] is the
//! in-process runner: the model and the storage in this process, the
//! plan's tokens fed straight into the batched step (no copy of K/V or
//! activations).

use std::ops::Deref;

use common::batch::{Batch, BatchError, BatchModel, KvStore};
use thiserror::Error;

use crate::kv_transfer::{KvBuffer, KvLayout, KvLease};
use crate::scheduler::SeqId;

/// Index of a block in a paged K/V storage.
pub type BlockId = u32;

/// Where a sequence's K/V lives in the runner's storage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SeqKv {
    /// Paged: block i holds positions i*block_size..(i+1)*block_size.
    Blocks(Vec<BlockId>),
    /// Contiguous: the sequence's own cache, holding at least `capacity`
    /// positions (the runner makes or grows it).
    Slot { capacity: usize },
}

/// K/V work a runner does before a step's forward, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvOp {
    /// Copy block `src` into `dst` (copy-on-write of a shared block).
    CopyBlock { src: BlockId, dst: BlockId },
    /// `child` starts with a copy of `parent`'s K/V (contiguous storage;
    /// paged children share the blocks and need nothing).
    Fork { parent: SeqId, child: SeqId },
    /// Drop the sequence's own K/V (contiguous storage; a paged free is
    /// bookkeeping only).
    Free { id: SeqId },
}

/// One sequence's part of a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedSeq {
    pub id: SeqId,
    /// Position of the first new token: the K/V positions already held.
    pub start: usize,
    /// The new tokens, at positions `start..start + tokens.len()`.
    pub tokens: Vec<u32>,
    pub kv: SeqKv,
    /// Return the logits of its last token (it samples this step).
    pub logits: bool,
}

/// What one step asks of a runner.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepPlan {
    /// The core's step counter: ranks check they execute the same step.
    pub step: u64,
    pub ops: Vec<KvOp>,
    /// In batch order.
    pub seqs: Vec<PlannedSeq>,
}

impl StepPlan {
    pub fn num_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.tokens.len()).sum()
    }

    /// Rows of logits the runner returns.
    pub fn logit_rows(&self) -> usize {
        self.seqs.iter().filter(|s| s.logits).count()
    }
}

#[derive(Debug, Error)]
pub enum RunnerError {
    #[error(transparent)]
    Batch(#[from] BatchError),
    #[error("K/V storage: {0}")]
    Storage(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("forward: {0}")]
    Model(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The step did not run, and every K/V the runner held is gone, but
    /// the runner is whole again (Project 13: a lost rank restarted). The
    /// core recomputes every running sequence, as after a preemption.
    #[error("the runner lost its K/V and recovered ({0}); every running sequence recomputes")]
    Recovered(String),
}

/// Executes step plans against the K/V storage it owns.
pub trait ModelRunner {
    /// Do `plan.ops`, then one batched forward of `plan.seqs`; `logits`
    /// becomes (plan.logit_rows(), vocab): the rows of the sequences with
    /// `logits` set, in plan order.
    fn execute(&mut self, plan: &StepPlan, logits: &mut Vec<f32>) -> Result<(), RunnerError>;

    /// Do K/V work outside a step (before an export or an import, so that
    /// recorded copies read the blocks as they were).
    fn apply(&mut self, ops: &[KvOp]) -> Result<(), RunnerError>;

    /// The storage's layout: what [`ModelRunner::export_kv`] writes and
    /// [`ModelRunner::import_kv`] accepts.
    fn layout(&self) -> KvLayout;

    /// A copy of the first `tokens` positions of a sequence's K/V.
    fn export_kv(&mut self, id: SeqId, kv: &SeqKv, tokens: usize) -> Result<KvBuffer, RunnerError>;

    /// Write `buf` into a sequence's K/V (allocated by the core), refusing
    /// a buffer whose layout is not this storage's.
    fn import_kv(&mut self, id: SeqId, kv: &SeqKv, buf: &KvBuffer) -> Result<(), RunnerError>;

    /// Lend a sequence's blocks for its first `tokens` positions to be
    /// filled off the model thread ([`KvStorage::lend`]). None by default:
    /// a runner whose K/V is not in this process lends nothing.
    fn lend_kv(
        &mut self,
        _id: SeqId,
        _kv: &SeqKv,
        _tokens: usize,
    ) -> Result<Option<KvLease>, RunnerError> {
        Ok(None)
    }

    /// Take lent blocks back ([`KvStorage::take_back`]).
    fn take_back_kv(&mut self, _lease: KvLease) -> Result<(), RunnerError> {
        Ok(())
    }

    /// The runner's own metrics for `/metrics` (Project 13's: ranks, time
    /// in collectives, restarts). None by default.
    fn metrics(&self) -> Vec<crate::kv_backend::KvMetric> {
        Vec::new()
    }
}

/// A runner's K/V memory: per layer, the K/V of the heads it owns.
pub trait KvStorage: Send {
    /// One sequence's view for one step.
    type Store<'s>: KvStore
    where
        Self: 's;
    type Error: std::error::Error + Send + Sync + 'static;

    fn layout(&self) -> KvLayout;

    fn apply(&mut self, op: &KvOp) -> Result<(), Self::Error>;

    /// The step's stores, in `seqs` order: each holds `start` positions and
    /// has room for its new tokens.
    fn stores(&mut self, seqs: &[PlannedSeq]) -> Result<Vec<Self::Store<'_>>, Self::Error>;

    /// A copy of sequence `id`'s first `tokens` positions.
    fn export(&self, id: SeqId, kv: &SeqKv, tokens: usize) -> Result<KvBuffer, Self::Error>;

    /// Fill sequence `id`'s K/V (allocated as `kv`) from `buf`: it then
    /// holds `buf.tokens` positions.
    fn import(&mut self, id: SeqId, kv: &SeqKv, buf: &KvBuffer) -> Result<(), Self::Error>;

    /// Lend the blocks holding sequence `id`'s first `tokens` positions
    /// (allocated as `kv`, not in any step until they come back) to be
    /// filled elsewhere. None: this storage lends nothing (the caller
    /// fills a buffer and imports it instead), the default.
    fn lend(
        &mut self,
        _id: SeqId,
        _kv: &SeqKv,
        _tokens: usize,
    ) -> Result<Option<KvLease>, Self::Error> {
        Ok(None)
    }

    /// Put lent blocks back in their slots, holding what was written into
    /// them. A storage that lends nothing is never given a lease.
    fn take_back(&mut self, _lease: KvLease) -> Result<(), Self::Error> {
        Ok(())
    }
}

/// The in-process runner: a model and its storage in this process. `P`
/// is how it holds the model: borrowed (`&M`, the engines' own) or shared
/// (`Arc<M>`, a runner that outlives its maker's scope, such as a rank's).
pub struct LocalRunner<P: Deref<Target: BatchModel>, S: KvStorage> {
    model: P,
    storage: S,
    workspace: <P::Target as BatchModel>::Workspace,
    batch: Batch,
}

impl<P: Deref<Target: BatchModel>, S: KvStorage> std::fmt::Debug for LocalRunner<P, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalRunner")
            .field("layout", &self.storage.layout())
            .finish_non_exhaustive()
    }
}

impl<P: Deref<Target: BatchModel>, S: KvStorage> LocalRunner<P, S> {
    pub fn new(model: P, storage: S) -> Self {
        let workspace = model.new_workspace();
        LocalRunner {
            model,
            storage,
            workspace,
            batch: Batch::new(),
        }
    }
}

/// Squeeze `logits` (one row of `vocab` per sequence of the step, in
/// plan order) down to the rows of the sequences that sample, in place.
pub fn keep_sampled_rows(seqs: &[PlannedSeq], logits: &mut Vec<f32>, vocab: usize) {
    let mut kept = 0;
    for (row, s) in seqs.iter().enumerate() {
        if s.logits {
            if row != kept {
                logits.copy_within(row * vocab..(row + 1) * vocab, kept * vocab);
            }
            kept += 1;
        }
    }
    logits.truncate(kept * vocab);
}

fn storage_err<E: std::error::Error + Send + Sync + 'static>(e: E) -> RunnerError {
    RunnerError::Storage(Box::new(e))
}

impl<P: Deref<Target: BatchModel>, S: KvStorage> ModelRunner for LocalRunner<P, S> {
    fn execute(&mut self, plan: &StepPlan, logits: &mut Vec<f32>) -> Result<(), RunnerError> {
        self.apply(&plan.ops)?;
        self.batch.clear();
        for s in &plan.seqs {
            self.batch.push(&s.tokens, s.start)?;
        }
        // The batched step gives every sequence's row; the rows not asked
        // for (prompt chunks that do not end their prompt) are squeezed
        // out in place after it.
        let vocab = common::Model::info(&*self.model).vocab_size;
        logits.resize(plan.seqs.len() * vocab, 0.0);
        let mut stores = self.storage.stores(&plan.seqs).map_err(storage_err)?;
        let mut refs: Vec<&mut S::Store<'_>> = stores.iter_mut().collect();
        self.model
            .forward_batch(&self.batch, &mut refs, &mut self.workspace, logits)
            .map_err(|e| RunnerError::Model(Box::new(e)))?;
        keep_sampled_rows(&plan.seqs, logits, vocab);
        Ok(())
    }

    fn apply(&mut self, ops: &[KvOp]) -> Result<(), RunnerError> {
        for op in ops {
            self.storage.apply(op).map_err(storage_err)?;
        }
        Ok(())
    }

    fn layout(&self) -> KvLayout {
        self.storage.layout()
    }

    fn export_kv(&mut self, id: SeqId, kv: &SeqKv, tokens: usize) -> Result<KvBuffer, RunnerError> {
        self.storage.export(id, kv, tokens).map_err(storage_err)
    }

    fn import_kv(&mut self, id: SeqId, kv: &SeqKv, buf: &KvBuffer) -> Result<(), RunnerError> {
        self.storage.import(id, kv, buf).map_err(storage_err)
    }

    fn lend_kv(
        &mut self,
        id: SeqId,
        kv: &SeqKv,
        tokens: usize,
    ) -> Result<Option<KvLease>, RunnerError> {
        self.storage.lend(id, kv, tokens).map_err(storage_err)
    }

    fn take_back_kv(&mut self, lease: KvLease) -> Result<(), RunnerError> {
        self.storage.take_back(lease).map_err(storage_err)
    }
}

//! Pipeline parallelism (GPipe): stage s of S keeps layers s·L/S ..
//! (s+1)·L/S and their K/V; the first stage also embeds, the last applies
//! the head. A step's sequences are cut into micro-batches; each goes
//! stage to stage as its residual stream (n_tokens, hidden), so while
//! stage 1 runs micro-batch 0, stage 0 runs micro-batch 1:
//!
//! ```text
//! stage 0: [mb0][mb1][mb2]                 ← then waits for the logits
//! stage 1:      [mb0][mb1][mb2]
//! stage 2:           [mb0][mb1][mb2] → logits to stage 0
//! ```
//!
//! Rank 0 (stage 0) schedules, broadcasts the plan (every stage applies
//! its block copies and knows the micro-batches), and samples. No sum
//! changes order: every token's arithmetic is the one-process forward's,
//! so a pipeline's logits equal one process's bit for bit.

use std::ops::{Deref, Range};
use std::sync::Arc;
use std::time::Instant;

use common::batch::Batch;
use p05_kv_cache::llama_engine::{LlamaEngine, LlamaWorkspace, StageOut};
use p08_continuous::kv_transfer::{KvBuffer, KvLayout};
use p08_continuous::runner::{keep_sampled_rows, KvOp, KvStorage, PlannedSeq, RunnerError, SeqKv};
use p08_continuous::scheduler::SeqId;
use p08_continuous::{ModelRunner, StepPlan};

use crate::comm::{bytes_f32, chunk, f32_bytes, CommError, Communicator};
use crate::report::RankTimes;
use crate::runner::{broadcast_plan, broadcast_stop, follow_plans, RankError, Recovery};

fn comm_err(e: CommError) -> RunnerError {
    RunnerError::Model(Box::new(e))
}

/// One stage's layers and K/V.
#[derive(Debug)]
pub struct Stage<P: Deref<Target = LlamaEngine>, S: KvStorage> {
    model: P,
    storage: S,
    ws: LlamaWorkspace,
    batch: Batch,
    /// (n_tokens, hidden) the stream in and out
    hidden: Vec<f32>,
    bytes: Vec<u8>,
}

impl<P: Deref<Target = LlamaEngine>, S: KvStorage> Stage<P, S> {
    pub fn new(model: P, storage: S) -> Stage<P, S> {
        Stage {
            model,
            storage,
            ws: LlamaWorkspace::default(),
            batch: Batch::new(),
            hidden: Vec::new(),
            bytes: Vec::new(),
        }
    }

    fn apply(&mut self, ops: &[KvOp]) -> Result<(), RunnerError> {
        for op in ops {
            self.storage
                .apply(op)
                .map_err(|e| RunnerError::Storage(Box::new(e)))?;
        }
        Ok(())
    }

    /// This stage's layers over `seqs`, from `input` (or the embeddings).
    fn run(
        &mut self,
        seqs: &[PlannedSeq],
        input: Option<&[f32]>,
        out: StageOut<'_>,
    ) -> Result<(), RunnerError> {
        self.batch.clear();
        for s in seqs {
            self.batch.push(&s.tokens, s.start)?;
        }
        let mut stores = self
            .storage
            .stores(seqs)
            .map_err(|e| RunnerError::Storage(Box::new(e)))?;
        let mut refs: Vec<&mut S::Store<'_>> = stores.iter_mut().collect();
        self.model
            .forward_stage(&self.batch, &mut refs, &mut self.ws, input, out)
            .map_err(|e| RunnerError::Model(Box::new(e)))
    }
}

/// The micro-batches of a step of `n` sequences: at most `m` runs of
/// consecutive sequences, none empty.
pub fn micro_batches(n: usize, m: usize) -> Vec<Range<usize>> {
    let m = m.clamp(1, n.max(1));
    (0..m)
        .map(|i| chunk(n, m, i))
        .filter(|r| !r.is_empty())
        .collect()
}

/// Rank 0, stage 0: broadcast, run its layers micro-batch by micro-batch,
/// send each on, collect the logits from the last stage.
pub struct PpRunner<P: Deref<Target = LlamaEngine>, S: KvStorage> {
    stage: Stage<P, S>,
    comm: Arc<dyn Communicator>,
    micro: usize,
    msg: Vec<u8>,
    recovery: Option<Recovery>,
    times: RankTimes,
}

impl<P: Deref<Target = LlamaEngine>, S: KvStorage> std::fmt::Debug for PpRunner<P, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PpRunner")
            .field("micro", &self.micro)
            .field("recovers", &self.recovery.is_some())
            .finish_non_exhaustive()
    }
}

impl<P: Deref<Target = LlamaEngine>, S: KvStorage> PpRunner<P, S> {
    pub fn new(stage: Stage<P, S>, comm: Arc<dyn Communicator>, micro: usize) -> Self {
        PpRunner {
            stage,
            comm,
            micro,
            msg: Vec::new(),
            recovery: None,
            times: RankTimes::default(),
        }
    }

    /// A runner that survives a lost stage (see [`crate::runner::TpRunner::with_recovery`]).
    pub fn with_recovery(stage: Stage<P, S>, recovery: Recovery, micro: usize) -> Self {
        PpRunner {
            stage,
            comm: recovery.swap.clone(),
            micro,
            msg: Vec::new(),
            recovery: Some(recovery),
            times: RankTimes::default(),
        }
    }
}

impl<P: Deref<Target = LlamaEngine>, S: KvStorage> PpRunner<P, S> {
    /// One step: broadcast, each micro-batch through this stage and on,
    /// the logits back from the last stage.
    fn execute_once(&mut self, plan: &StepPlan, logits: &mut Vec<f32>) -> Result<(), RunnerError> {
        let world = self.comm.world();
        let vocab = common::Model::info(&*self.stage.model).vocab_size;
        broadcast_plan(&*self.comm, plan, &mut self.msg)?;
        self.stage.apply(&plan.ops)?;
        logits.resize(plan.seqs.len() * vocab, 0.0);
        let mbs = micro_batches(plan.seqs.len(), self.micro);
        if world == 1 {
            self.stage.run(&plan.seqs, None, StageOut::Logits(logits))?;
        } else {
            // Each micro-batch through this stage, then on to stage 1. At
            // most `world` micro-batches are in flight: before sending
            // micro-batch k ≥ S − 1, the logits of k − S + 1 are taken, so
            // no link ever waits on a full one whatever the socket buffers.
            let mut taken = 0;
            for (k, mb) in mbs.iter().enumerate() {
                let mut hidden = std::mem::take(&mut self.stage.hidden);
                self.stage
                    .run(&plan.seqs[mb.clone()], None, StageOut::Hidden(&mut hidden))?;
                if k + 1 >= world {
                    self.take_logits(&mbs[taken], logits, vocab)?;
                    taken += 1;
                }
                self.msg.clear();
                f32_bytes(&hidden, &mut self.msg);
                self.stage.hidden = hidden;
                self.comm.send(1, &self.msg).map_err(comm_err)?;
            }
            for mb in &mbs[taken..] {
                self.take_logits(mb, logits, vocab)?;
            }
        }
        // The rows not asked for (prompt chunks that do not end their
        // prompt) are squeezed out, as the in-process runner does.
        keep_sampled_rows(&plan.seqs, logits, vocab);
        Ok(())
    }

    /// Micro-batch `mb`'s logits from the last stage into its rows.
    fn take_logits(
        &mut self,
        mb: &Range<usize>,
        logits: &mut [f32],
        vocab: usize,
    ) -> Result<(), RunnerError> {
        let last = self.comm.world() - 1;
        self.comm.recv(last, &mut self.msg).map_err(comm_err)?;
        let rows = &mut logits[mb.start * vocab..mb.end * vocab];
        if self.msg.len() != rows.len() * 4 {
            return Err(comm_err(CommError::Usage {
                rank: 0,
                what: format!(
                    "the last stage sent {} bytes of logits for {} rows",
                    self.msg.len(),
                    mb.len()
                ),
            }));
        }
        bytes_f32(&self.msg, rows);
        Ok(())
    }
}

impl<P: Deref<Target = LlamaEngine>, S: KvStorage> ModelRunner for PpRunner<P, S> {
    fn execute(&mut self, plan: &StepPlan, logits: &mut Vec<f32>) -> Result<(), RunnerError> {
        let (t0, c0) = (Instant::now(), self.comm.stats().seconds);
        let ran = self.execute_once(plan, logits);
        (self.times.mine).add(t0.elapsed(), self.comm.stats().seconds - c0);
        let ran = ran.and_then(|()| self.times.after_step(&*self.comm).map_err(comm_err));
        ran.map_err(|e| Recovery::recover(self.recovery.as_mut(), &*self.comm, e))
    }

    fn apply(&mut self, ops: &[KvOp]) -> Result<(), RunnerError> {
        let plan = StepPlan {
            ops: ops.to_vec(),
            ..StepPlan::default()
        };
        let ran =
            broadcast_plan(&*self.comm, &plan, &mut self.msg).and_then(|()| self.stage.apply(ops));
        ran.map_err(|e| Recovery::recover(self.recovery.as_mut(), &*self.comm, e))
    }

    fn layout(&self) -> KvLayout {
        self.stage.storage.layout()
    }

    fn export_kv(&mut self, _: SeqId, _: &SeqKv, _: usize) -> Result<KvBuffer, RunnerError> {
        Err(RunnerError::Storage(
            "exporting K/V held across pipeline stages is not supported".into(),
        ))
    }

    fn import_kv(&mut self, _: SeqId, _: &SeqKv, _: &KvBuffer) -> Result<(), RunnerError> {
        Err(RunnerError::Storage(
            "importing K/V into pipeline stages is not supported".into(),
        ))
    }

    fn metrics(&self) -> Vec<p08_continuous::kv_backend::KvMetric> {
        let mut m = crate::runner::world_metrics(
            &*self.comm,
            self.recovery.as_ref().map_or(0, |r| r.restarts),
        );
        m.extend(self.times.metrics());
        m
    }
}

impl<P: Deref<Target = LlamaEngine>, S: KvStorage> Drop for PpRunner<P, S> {
    fn drop(&mut self) {
        broadcast_stop(&*self.comm);
    }
}

/// A stage other than the first: for each plan, each micro-batch from
/// the stage before, through this stage's layers, to the next (or, from
/// the last stage, its logits to rank 0).
pub fn follow_stage<P: Deref<Target = LlamaEngine>, S: KvStorage>(
    comm: &dyn Communicator,
    stage: &mut Stage<P, S>,
    micro: usize,
) -> Result<(), RankError> {
    let (me, world) = (comm.rank(), comm.world());
    let vocab = common::Model::info(&*stage.model).vocab_size;
    let mut input: Vec<f32> = Vec::new();
    let mut logits: Vec<f32> = Vec::new();
    follow_plans(comm, |plan| {
        stage.apply(&plan.ops)?;
        for mb in micro_batches(plan.seqs.len(), micro) {
            let mut bytes = std::mem::take(&mut stage.bytes);
            comm.recv(me - 1, &mut bytes)?;
            input.resize(bytes.len() / 4, 0.0);
            bytes_f32(&bytes, &mut input);
            let seqs = &plan.seqs[mb.clone()];
            bytes.clear();
            if me + 1 == world {
                logits.resize(mb.len() * vocab, 0.0);
                stage.run(seqs, Some(&input), StageOut::Logits(&mut logits))?;
                f32_bytes(&logits, &mut bytes);
                comm.send(0, &bytes)?;
            } else {
                let mut hidden = std::mem::take(&mut stage.hidden);
                stage.run(seqs, Some(&input), StageOut::Hidden(&mut hidden))?;
                f32_bytes(&hidden, &mut bytes);
                stage.hidden = hidden;
                comm.send(me + 1, &bytes)?;
            }
            stage.bytes = bytes;
        }
        Ok(())
    })
}

//! The tensor-parallel runner: rank 0's engine core (scheduler, block
//! manager, sampling; Projects 08–09) makes each step's plan; its runner
//! broadcasts the plan to every rank, then every rank, rank 0 included,
//! runs it on its own slice of the weights and its own K/V heads. The
//! ranks' collectives inside the forward keep them in step; only rank 0
//! reads the logits.
//!
//! ```text
//! rank 0:  schedule → plan ─broadcast─▶ execute(plan) ─┐ sample, stream
//! rank r:            wait ◀────────────  execute(plan) ─┘ (all-reduces inside)
//! ```
//!
//! A command is one byte, then its body: 1 = a step's plan (Project 08's
//! binary encoding), 2 = stop, 3 = report your times
//! ([`crate::report`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use p08_continuous::kv_backend::KvMetric;
use p08_continuous::kv_transfer::{KvBuffer, KvLayout};
use p08_continuous::runner::{KvOp, RunnerError, SeqKv};
use p08_continuous::scheduler::SeqId;
use p08_continuous::{ModelRunner, StepPlan};
use thiserror::Error;

use crate::comm::{CommError, Communicator};
use crate::report::{RankTimes, Since, REPORT};
use crate::swap::SwapComm;

const STEP: u8 = 1;
const STOP: u8 = 2;

#[derive(Debug, Error)]
pub enum RankError {
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error("rank 0 sent a command this rank cannot read: {0}")]
    Command(String),
    #[error(transparent)]
    Runner(#[from] RunnerError),
}

/// Rebuilds the world after a rank is lost: starts the other ranks again
/// and returns rank 0's new communicator once they have loaded.
pub type Restart = Box<
    dyn FnMut() -> Result<Arc<dyn Communicator>, Box<dyn std::error::Error + Send + Sync>> + Send,
>;

/// How rank 0 survives a lost rank: where a rebuilt world's communicator
/// goes (the one its runner and model call) and how to rebuild it.
pub struct Recovery {
    pub swap: Arc<SwapComm>,
    pub restart: Restart,
    /// Worlds rebuilt so far.
    pub restarts: u64,
}

/// Rank 0's view of its world for `/metrics`: the ranks, its time and
/// bytes in collectives (waits for slower ranks included), and restarts.
pub fn world_metrics(comm: &dyn Communicator, restarts: u64) -> Vec<KvMetric> {
    let s = comm.stats();
    let m = |name, help, kind, value| KvMetric {
        name,
        help,
        kind,
        value,
        rank: None,
    };
    vec![
        m(
            "inference_lab:ranks",
            "Ranks the model is split over.",
            "gauge",
            comm.world() as f64,
        ),
        m(
            "inference_lab:collective_seconds_total",
            "Seconds rank 0 spent in collectives and stage hand-offs, waiting included.",
            "counter",
            s.seconds,
        ),
        m(
            "inference_lab:collectives_total",
            "Collectives and messages rank 0 completed.",
            "counter",
            s.calls as f64,
        ),
        m(
            "inference_lab:collective_bytes_sent_total",
            "Payload bytes rank 0 sent to other ranks.",
            "counter",
            s.bytes_sent as f64,
        ),
        m(
            "inference_lab:rank_restarts_total",
            "Times the other ranks were restarted after one was lost.",
            "counter",
            restarts as f64,
        ),
    ]
}

impl std::fmt::Debug for Recovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recovery").finish_non_exhaustive()
    }
}

impl Recovery {
    /// After a failed step: if `comm` broke (a rank was lost), rebuild the
    /// world and answer [`RunnerError::Recovered`]; else `e` as it is.
    pub fn recover(
        this: Option<&mut Recovery>,
        comm: &dyn Communicator,
        e: RunnerError,
    ) -> RunnerError {
        let (Some(why), Some(r)) = (comm.broken(), this) else {
            return e;
        };
        eprintln!("rank 0: {why}; restarting the other ranks");
        match (r.restart)() {
            Ok(next) => {
                r.swap.replace(next);
                r.restarts += 1;
                eprintln!("rank 0: the ranks are back; every running sequence recomputes");
                RunnerError::Recovered(why)
            }
            Err(re) => {
                RunnerError::Model(format!("{why}; restarting the ranks failed: {re}").into())
            }
        }
    }
}

/// Rank 0's runner: broadcast, then run its own slice.
pub struct TpRunner<R: ModelRunner> {
    local: R,
    comm: Arc<dyn Communicator>,
    msg: Vec<u8>,
    recovery: Option<Recovery>,
    times: RankTimes,
}

impl<R: ModelRunner + std::fmt::Debug> std::fmt::Debug for TpRunner<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TpRunner")
            .field("local", &self.local)
            .field("recovers", &self.recovery.is_some())
            .finish_non_exhaustive()
    }
}

impl<R: ModelRunner> TpRunner<R> {
    pub fn new(local: R, comm: Arc<dyn Communicator>) -> TpRunner<R> {
        TpRunner {
            local,
            comm,
            msg: Vec::new(),
            recovery: None,
            times: RankTimes::default(),
        }
    }

    /// A runner that survives a lost rank: when a step fails because the
    /// communicator broke, the world is rebuilt, its communicator goes
    /// into `recovery.swap` (which `local`'s model calls), and the step
    /// reports [`RunnerError::Recovered`], so the core recomputes every
    /// running sequence on the new ranks.
    pub fn with_recovery(local: R, recovery: Recovery) -> TpRunner<R> {
        TpRunner {
            local,
            comm: recovery.swap.clone(),
            msg: Vec::new(),
            recovery: Some(recovery),
            times: RankTimes::default(),
        }
    }

    fn recover(&mut self, e: RunnerError) -> RunnerError {
        Recovery::recover(self.recovery.as_mut(), &*self.comm, e)
    }

    fn send(&mut self, plan: &StepPlan) -> Result<(), RunnerError> {
        broadcast_plan(&*self.comm, plan, &mut self.msg)
    }
}

/// Rank 0: every rank gets `plan` (encoded into `msg`).
pub fn broadcast_plan(
    comm: &dyn Communicator,
    plan: &StepPlan,
    msg: &mut Vec<u8>,
) -> Result<(), RunnerError> {
    msg.clear();
    msg.push(STEP);
    plan.encode_into(msg)
        .map_err(|e| RunnerError::Model(Box::new(e)))?;
    comm.broadcast(0, msg)
        .map_err(|e| RunnerError::Model(Box::new(e)))
}

/// Rank 0's last word to the others: stop following.
pub fn broadcast_stop(comm: &dyn Communicator) {
    let mut stop = vec![STOP];
    let _ = comm.broadcast(0, &mut stop);
}

impl<R: ModelRunner> ModelRunner for TpRunner<R> {
    fn execute(&mut self, plan: &StepPlan, logits: &mut Vec<f32>) -> Result<(), RunnerError> {
        let (t0, c0) = (Instant::now(), self.comm.stats().seconds);
        let ran = self
            .send(plan)
            .and_then(|()| self.local.execute(plan, logits));
        (self.times.mine).add(t0.elapsed(), self.comm.stats().seconds - c0);
        let ran = ran.and_then(|()| {
            (self.times.after_step(&*self.comm)).map_err(|e| RunnerError::Model(Box::new(e)))
        });
        ran.map_err(|e| self.recover(e))
    }

    fn apply(&mut self, ops: &[KvOp]) -> Result<(), RunnerError> {
        // A plan of operations and no sequences.
        let plan = StepPlan {
            ops: ops.to_vec(),
            ..StepPlan::default()
        };
        let ran = self.send(&plan).and_then(|()| self.local.apply(ops));
        ran.map_err(|e| self.recover(e))
    }

    fn layout(&self) -> KvLayout {
        self.local.layout()
    }

    fn export_kv(&mut self, _: SeqId, _: &SeqKv, _: usize) -> Result<KvBuffer, RunnerError> {
        Err(RunnerError::Storage(
            "exporting K/V held across tensor-parallel ranks is not supported".into(),
        ))
    }

    fn import_kv(&mut self, _: SeqId, _: &SeqKv, _: &KvBuffer) -> Result<(), RunnerError> {
        Err(RunnerError::Storage(
            "importing K/V into tensor-parallel ranks is not supported".into(),
        ))
    }

    fn metrics(&self) -> Vec<KvMetric> {
        let mut m = world_metrics(
            &*self.comm,
            self.recovery.as_ref().map_or(0, |r| r.restarts),
        );
        m.extend(self.times.metrics());
        m
    }
}

impl<R: ModelRunner> Drop for TpRunner<R> {
    /// The other ranks' loops end with rank 0's runner.
    fn drop(&mut self) {
        broadcast_stop(&*self.comm);
    }
}

/// A rank other than 0: run every plan rank 0 broadcasts until it says
/// stop (Ok) or its link breaks (the error). Waits as long as the server
/// is idle; a dead rank 0 ends the wait at once.
pub fn follow<R: ModelRunner>(comm: &dyn Communicator, local: &mut R) -> Result<(), RankError> {
    let mut logits = Vec::new();
    follow_plans(comm, |plan| {
        if plan.seqs.is_empty() {
            local.apply(&plan.ops)?;
        } else {
            local.execute(plan, &mut logits)?;
        }
        Ok(())
    })
}

/// Receive rank 0's plans and hand each to `step` (timed, for the
/// reports rank 0 asks for), until stop.
pub fn follow_plans(
    comm: &dyn Communicator,
    mut step: impl FnMut(&StepPlan) -> Result<(), RankError>,
) -> Result<(), RankError> {
    let mut msg = Vec::new();
    let mut since = Since::default();
    loop {
        comm.broadcast_wait(0, &mut msg, None::<Duration>)?;
        match msg.split_first() {
            Some((&STEP, body)) => {
                let plan = StepPlan::decode(body).map_err(|e| RankError::Command(e.to_string()))?;
                let (t0, c0) = (Instant::now(), comm.stats().seconds);
                step(&plan)?;
                since.add(t0.elapsed(), comm.stats().seconds - c0);
            }
            Some((&REPORT, _)) => {
                since.answer(comm)?;
            }
            Some((&STOP, _)) => return Ok(()),
            _ => {
                return Err(RankError::Command(format!(
                    "{} bytes, tag {:?}",
                    msg.len(),
                    msg.first()
                )))
            }
        }
    }
}

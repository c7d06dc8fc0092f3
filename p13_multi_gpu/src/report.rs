//! Each rank's own step and communication time, for rank 0's `/metrics`.
//!
//! Every rank times its steps (the plan's execution, its collectives
//! inside) and the part of them spent in collectives. After
//! [`REPORT_EVERY`] steps, or half a second of steps, rank 0 broadcasts
//! the report command instead of a plan, and every rank answers with one
//! all-gather of its two figures since its last answer: two message rounds
//! per 64 steps or half a second, which no step notices; a rank restarted
//! after a loss simply answers from zero.

use std::time::{Duration, Instant};

use p08_continuous::kv_backend::KvMetric;

use crate::comm::{CommError, Communicator};

/// The command byte of a report (beside a plan's and stop's).
pub const REPORT: u8 = 3;
/// Steps between reports, at most.
pub const REPORT_EVERY: u64 = 64;
/// Time between reports, at most (while steps run).
pub const REPORT_AFTER: Duration = Duration::from_millis(500);

/// One rank's seconds since its last report.
#[derive(Clone, Copy, Debug, Default)]
pub struct Since {
    step_s: f64,
    comm_s: f64,
}

impl Since {
    /// A step took `step`, of which `comm_s` seconds in collectives.
    pub fn add(&mut self, step: Duration, comm_s: f64) {
        self.step_s += step.as_secs_f64();
        // A world rebuilt inside the step restarts the counts: never < 0.
        self.comm_s += comm_s.max(0.0);
    }

    /// Answer a report: every rank's [step s, collective s] since its last
    /// answer, in rank order (2 · world values).
    pub fn answer(&mut self, comm: &dyn Communicator) -> Result<Vec<f32>, CommError> {
        let mine = [self.step_s as f32, self.comm_s as f32];
        let mut all = vec![0f32; 2 * comm.world()];
        comm.all_gather(&mine, &mut all)?;
        *self = Since::default();
        Ok(all)
    }
}

/// Rank 0's running totals of every rank's times.
#[derive(Debug, Default)]
pub struct RankTimes {
    /// Steps since the last report, and when it was.
    steps: u64,
    last: Option<Instant>,
    pub mine: Since,
    /// (step s, collective s) per rank, as of the last report.
    totals: Vec<(f64, f64)>,
}

impl RankTimes {
    /// After one of rank 0's steps: every [`REPORT_EVERY`] steps or
    /// [`REPORT_AFTER`], ask every rank for its figures (the report
    /// command, then the gather).
    pub fn after_step(&mut self, comm: &dyn Communicator) -> Result<(), CommError> {
        self.steps += 1;
        let last = *self.last.get_or_insert_with(Instant::now);
        if (self.steps < REPORT_EVERY && last.elapsed() < REPORT_AFTER) || comm.world() == 1 {
            return Ok(());
        }
        self.steps = 0;
        self.last = Some(Instant::now());
        let mut cmd = vec![REPORT];
        comm.broadcast(0, &mut cmd)?;
        let all = self.mine.answer(comm)?;
        self.totals.resize(comm.world(), (0.0, 0.0));
        for (t, v) in self.totals.iter_mut().zip(all.chunks_exact(2)) {
            t.0 += f64::from(v[0]);
            t.1 += f64::from(v[1]);
        }
        Ok(())
    }

    /// `inference_lab:rank_step_seconds_total{rank}` and
    /// `inference_lab:rank_collective_seconds_total{rank}`, every rank.
    pub fn metrics(&self) -> Vec<KvMetric> {
        let series = |name, help, pick: fn(&(f64, f64)) -> f64| {
            self.totals.iter().enumerate().map(move |(r, t)| KvMetric {
                name,
                help,
                kind: "counter",
                value: pick(t),
                rank: Some(r),
            })
        };
        series(
            "inference_lab:rank_step_seconds_total",
            "Seconds each rank spent running steps (its compute and its collectives), as of its last report (every 64 steps or 0.5 s).",
            |t| t.0,
        )
        .chain(series(
            "inference_lab:rank_collective_seconds_total",
            "Of those, seconds in collectives and stage hand-offs, waits for slower ranks included.",
            |t| t.1,
        ))
        .collect()
    }
}

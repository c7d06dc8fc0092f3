//! The batcher's own metrics, appended to the server's `/metrics`:
//! `inference_lab:batch_size` (members per batch), `inference_lab:queue_time_seconds`
//! (arrival to the batch's start), and the lock-step waste: decode steps ×
//! slots of each batch, and how many of those slots were empty because
//! their member had already finished.

use std::fmt::Write;

use p06_server::metrics::Histogram;

const BATCH_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0];
const QUEUE_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

#[derive(Clone, Debug)]
pub struct BatchStats {
    pub batch_size: Histogram,
    pub queue_time: Histogram,
    /// Sum over decode steps of the batch's size (members it started with).
    pub slot_steps: u64,
    /// Sum over decode steps of the members already finished.
    pub empty_slot_steps: u64,
    pub batches: u64,
}

impl Default for BatchStats {
    fn default() -> Self {
        BatchStats {
            batch_size: Histogram::new(BATCH_BUCKETS),
            queue_time: Histogram::new(QUEUE_BUCKETS),
            slot_steps: 0,
            empty_slot_steps: 0,
            batches: 0,
        }
    }
}

impl BatchStats {
    /// Fraction of lock-step decode slots that held a finished member.
    pub fn empty_fraction(&self) -> f64 {
        self.empty_slot_steps as f64 / (self.slot_steps.max(1)) as f64
    }

    pub fn render(&self, out: &mut String, labels: &str) {
        self.batch_size.render(
            out,
            "inference_lab:batch_size",
            "Requests per batch the batcher dispatched.",
            labels,
        );
        self.queue_time.render(
            out,
            "inference_lab:queue_time_seconds",
            "Time from a request's arrival to the start of its batch.",
            labels,
        );
        for (name, help, v) in [
            (
                "inference_lab:batch_slot_steps_total",
                "Decode steps times the size of the batch that ran them.",
                self.slot_steps,
            ),
            (
                "inference_lab:batch_empty_slot_steps_total",
                "Decode-step slots whose member had already finished (lock-step waste).",
                self.empty_slot_steps,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            let _ = writeln!(out, "{name}{{{labels}}} {v}");
        }
    }
}

//! The front every local engine shares (the serial engine, Project 07's
//! batcher, Project 08's continuous batcher): a model thread that owns the
//! model, a queue of jobs to it, the gauges both sides read, and the
//! shutdown. Only the model thread's loop differs between the engines.
//!
//! ```text
//! HTTP side (submit)                       model thread (the engine's loop)
//!   check open ─ tokenize, check context     recv jobs, run steps,
//!   count waiting (429 past max_waiting) ──▶ send tokens and the end
//!   streams back to the caller               on each job's channels
//! ```
//!
//! Dropping the front closes the queue and joins the model thread (after
//! its current step: every engine checks `closing` between steps).

use std::sync::atomic::Ordering;
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;

use common::engine::{EngineError, EngineEvent, EngineLoad, EngineRequest, EngineStream};
use tokio::sync::mpsc;

use crate::gauges::EngineGauges;
use crate::input::{InputProcessor, Prepared};
use crate::load::StartError;

/// A job's way back: one channel per choice.
pub type Events = Vec<mpsc::UnboundedSender<EngineEvent>>;

/// How the front bounds and prices its queue.
#[derive(Clone, Copy, Debug)]
pub struct QueueLimits {
    /// Requests (choices) that may wait; more get 429.
    pub max_waiting: usize,
    /// Requests one unit of service takes off the queue (1 for the serial
    /// engine, a batch for the batchers): a 429's `Retry-After` is
    /// (waiting / per_unit + 1) units of the smoothed service time.
    pub per_unit: usize,
}

#[derive(Debug)]
pub struct EngineFront<J> {
    name: String,
    /// `model_name="..."`, escaped, for the engine's own metrics.
    labels: String,
    input: InputProcessor,
    limits: QueueLimits,
    queue: Option<std_mpsc::Sender<J>>,
    gauges: Arc<EngineGauges>,
    worker: Option<JoinHandle<()>>,
}

impl<J: Send + 'static> EngineFront<J> {
    /// Start the model thread running `body` on the job queue.
    pub fn start<F>(
        name: &str,
        input: InputProcessor,
        limits: QueueLimits,
        gauges: Arc<EngineGauges>,
        body: F,
    ) -> Result<EngineFront<J>, StartError>
    where
        F: FnOnce(std_mpsc::Receiver<J>) + Send + 'static,
    {
        let limits = QueueLimits {
            max_waiting: limits.max_waiting.max(1),
            per_unit: limits.per_unit.max(1),
        };
        let (queue, rx) = std_mpsc::channel();
        let worker = std::thread::Builder::new()
            .name("model".into())
            .spawn(move || body(rx))
            .map_err(StartError::Thread)?;
        let escaped = name.replace('\\', "\\\\").replace('"', "\\\"");
        Ok(EngineFront {
            name: name.to_string(),
            labels: format!("model_name=\"{escaped}\""),
            input,
            limits,
            queue: Some(queue),
            gauges,
            worker: Some(worker),
        })
    }

    pub fn model_name(&self) -> &str {
        &self.name
    }

    pub fn labels(&self) -> &str {
        &self.labels
    }

    pub fn context_length(&self) -> Option<usize> {
        Some(self.input.context())
    }

    pub fn load(&self) -> EngineLoad {
        self.gauges.load()
    }

    /// Refuse new work and end what is running (between steps).
    pub fn abort_all(&self) {
        self.gauges.closing.store(true, Ordering::SeqCst);
    }

    /// Check, tokenize and queue a request of `n` choices (each counts as
    /// one waiting request); `job` makes the queued job from the prepared
    /// prompt and the choices' channels. Never waits for the model: a full
    /// queue is a 429 at once, a closing engine a 503.
    pub fn submit(
        &self,
        request: EngineRequest,
        n: usize,
        job: impl FnOnce(Prepared, Events) -> J,
    ) -> Result<Vec<EngineStream>, EngineError> {
        self.gauges.check_open()?;
        let Some(queue) = &self.queue else {
            return Err(EngineError::Unavailable(
                "the server is shutting down".into(),
            ));
        };
        let n = n.max(1);
        let prepared = self.input.prepare(request)?;
        let waiting = self.gauges.waiting.fetch_add(n, Ordering::SeqCst);
        if waiting + n > self.limits.max_waiting {
            self.gauges.waiting.fetch_sub(n, Ordering::SeqCst);
            let units = (waiting / self.limits.per_unit + 1) as f64;
            return Err(self.gauges.queue_full(waiting, units));
        }
        let (events, streams) = (0..n).map(|_| mpsc::unbounded_channel()).unzip();
        if queue.send(job(prepared, events)).is_err() {
            self.gauges.waiting.fetch_sub(n, Ordering::SeqCst);
            return Err(EngineError::Unavailable(
                "the model thread has stopped".into(),
            ));
        }
        Ok(streams)
    }

    /// One choice's stream.
    pub fn submit_one(
        &self,
        request: EngineRequest,
        job: impl FnOnce(Prepared, Events) -> J,
    ) -> Result<EngineStream, EngineError> {
        self.submit(request, 1, job)?
            .pop()
            .ok_or_else(|| EngineError::Internal("no stream for the request".into()))
    }
}

impl<J> Drop for EngineFront<J> {
    fn drop(&mut self) {
        self.gauges.closing.store(true, Ordering::SeqCst);
        // Closing the queue ends the model thread after its current step.
        drop(self.queue.take());
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

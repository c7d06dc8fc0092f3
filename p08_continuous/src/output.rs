//! What the engine core hands back: each step's outputs and timing, and
//! the errors of adding a request or running a step.

use p05_kv_cache::generate::{GenerateError, Step};
use thiserror::Error;

use crate::runner::RunnerError;
use crate::scheduler::{Schedule, SchedulerError, SeqId};

#[derive(Debug, Error)]
pub enum AddError {
    /// The request does not fit the model's context or has bad settings
    /// (no model runs when a request is added, so no model error here).
    #[error(transparent)]
    Request(#[from] GenerateError<std::convert::Infallible>),
    /// It could not run even alone in the K/V memory, or its id is taken.
    #[error(transparent)]
    Scheduler(#[from] SchedulerError),
    /// A request continued after tokens generated elsewhere has one choice.
    #[error("a request continued after its generated tokens takes one choice (n = 1)")]
    Continued,
}

/// A sequence that sampled in this step.
#[derive(Clone, Debug)]
pub struct SeqOutput {
    pub id: SeqId,
    pub step: Step,
    /// The token joins the output (false for a stop token).
    pub is_token: bool,
    /// Prompt and generated tokens so far.
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
}

/// Why a step's forward did not run. The runner's error keeps the
/// storage's and the model's own errors (boxed: the core is generic over
/// both), so a caller can downcast and act on the kind (e.g. a full pool).
#[derive(Debug, Error)]
pub enum StepError {
    #[error("sequence {0} has no tokens for its chunk")]
    NoTokens(SeqId),
    #[error("sequence {0} is scheduled but holds no K/V")]
    NoKv(SeqId),
    #[error(transparent)]
    Runner(#[from] RunnerError),
}

/// Where one step's time went, in seconds.
#[derive(Clone, Copy, Debug, Default)]
pub struct StepTiming {
    pub schedule_s: f64,
    /// Building the runner's plan from the schedule: the seam's cost.
    pub plan_s: f64,
    pub execute_s: f64,
    pub postprocess_s: f64,
}

/// What one step did. `C` is each sequence's client (the serving engine's
/// stream; `()` in tests).
#[derive(Debug)]
pub struct StepOutput<C = ()> {
    pub schedule: Schedule,
    /// Sequences that sampled, in batch order; those whose `step.finish` is
    /// set have been retired (their clients are in `retired`).
    pub outputs: Vec<SeqOutput>,
    /// Sequences retired because the step failed, with the reason (one
    /// error shared by every sequence of the failed step).
    pub failed: Vec<(SeqId, std::sync::Arc<StepError>)>,
    /// Choices of parallel sampling that forked their parent's K/V in this
    /// step and now run (they sampled their first token here).
    pub forked: Vec<SeqId>,
    /// The clients of the sequences that finished or failed in this step.
    pub retired: Vec<(SeqId, C)>,
    /// Each sampling row's logits as the model gave them, before sampling,
    /// when the core records them ([`EngineCore::record_logits`]): what a
    /// test compares bit for bit across batch compositions.
    pub logits: Vec<(SeqId, Vec<f32>)>,
    pub timing: StepTiming,
}

impl<C> Default for StepOutput<C> {
    fn default() -> Self {
        StepOutput {
            schedule: Schedule::default(),
            outputs: Vec::new(),
            failed: Vec::new(),
            forked: Vec::new(),
            retired: Vec::new(),
            logits: Vec::new(),
            timing: StepTiming::default(),
        }
    }
}

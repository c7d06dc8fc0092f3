//! The serial engine: one OS thread owns the model and serves requests one
//! at a time from a bounded queue (Projects 07 and 08 batch them).
//!
//! `submit` runs on the HTTP side (the shared [`EngineFront`]): it
//! tokenizes, checks the request against the context and queues it (or
//! answers "queue full" at once). The model
//! thread prefills, then decodes one token per step, sending each token as
//! it is made; before every step it checks whether the client is still
//! there, so a disconnect ends the work within one step and drops the
//! request's KV cache.

use std::sync::atomic::Ordering;
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::time::Instant;

use common::engine::{
    Engine, EngineError, EngineEvent, EngineLoad, EngineRequest, EngineStream, Finish,
    TokenLogprob, TokenOut,
};
use common::Model;
use p04_transformer::Tokenizer;
use p05_kv_cache::generate::{GenerateError, GenerateParams, Generator, Step};
use tokio::sync::mpsc;

use crate::front::{EngineFront, QueueLimits};
use crate::gauges::EngineGauges;
use crate::input::{InputProcessor, Prepared};
use crate::load::{load_local, LoadError, StartError};

/// A queued request: token ids, settings, and where its events go.
#[derive(Debug)]
struct Job {
    prompt: Vec<u32>,
    params: GenerateParams,
    events: mpsc::UnboundedSender<EngineEvent>,
}

#[derive(Debug)]
pub struct SerialEngine {
    front: EngineFront<Job>,
}

impl SerialEngine {
    /// Start the model thread. `max_waiting` bounds the queue (≥ 1).
    pub fn start<M>(
        model: Arc<M>,
        tokenizer: Arc<Tokenizer>,
        name: &str,
        max_waiting: usize,
    ) -> Result<SerialEngine, StartError>
    where
        M: Model + Send + Sync + 'static,
    {
        let input = InputProcessor::new(tokenizer.clone(), model.info())?;
        let gauges = Arc::new(EngineGauges::default());
        let shared = gauges.clone();
        let limits = QueueLimits {
            max_waiting,
            per_unit: 1,
        };
        let front = EngineFront::start(name, input, limits, gauges, move |rx| {
            model_thread(&*model, &tokenizer, &rx, &shared)
        })?;
        Ok(SerialEngine { front })
    }

    /// Load a GGUF / HF Llama model and start the serial engine on it.
    pub fn load(
        path: &std::path::Path,
        name: &str,
        max_waiting: usize,
    ) -> Result<SerialEngine, LoadError> {
        let (engine, tokenizer) = load_local(path)?;
        Ok(SerialEngine::start(
            Arc::new(engine),
            Arc::new(tokenizer),
            name,
            max_waiting,
        )?)
    }
}

impl Engine for SerialEngine {
    fn model_name(&self) -> &str {
        self.front.model_name()
    }

    fn context_length(&self) -> Option<usize> {
        self.front.context_length()
    }

    fn load(&self) -> EngineLoad {
        self.front.load()
    }

    fn submit(&self, request: EngineRequest) -> Result<EngineStream, EngineError> {
        self.front
            .submit_one(request, |Prepared { prompt, params }, mut events| Job {
                prompt,
                params,
                events: events.remove(0),
            })
    }

    fn abort_all(&self) {
        self.front.abort_all();
    }
}

fn model_thread<M: Model>(
    model: &M,
    tok: &Tokenizer,
    queue: &std_mpsc::Receiver<Job>,
    shared: &EngineGauges,
) {
    while let Ok(job) = queue.recv() {
        shared.running.fetch_add(1, Ordering::SeqCst);
        shared.waiting.fetch_sub(1, Ordering::SeqCst);
        let t0 = Instant::now();
        // A panic in one job (a bug, never input: input is checked before
        // it gets here) fails that job with a 500 and leaves the model
        // thread serving; uncaught, it would end the thread and every later
        // request would get 503 until a restart.
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            run_job(model, tok, &job, shared)
        }))
        .unwrap_or_else(|panic| Err(EngineError::Internal(panic_message(panic.as_ref()))));
        shared.kv_cache_bytes.store(0, Ordering::SeqCst);
        shared.running.fetch_sub(1, Ordering::SeqCst);
        let _ = job.events.send(match outcome {
            Ok((finish, prompt_tokens, completion_tokens)) => EngineEvent::Done {
                finish,
                prompt_tokens,
                completion_tokens,
            },
            Err(e) => EngineEvent::Error(e),
        });
        shared.observe_service(t0.elapsed().as_secs_f64());
    }
}

/// Generate for one job until it finishes or is cancelled; returns the
/// finish reason and token counts. The generator (and with it the KV cache)
/// is dropped on return.
fn run_job<M: Model>(
    model: &M,
    tok: &Tokenizer,
    job: &Job,
    shared: &EngineGauges,
) -> Result<(Finish, usize, usize), EngineError> {
    let cancelled = || job.events.is_closed() || shared.is_closing();
    let prompt_tokens = job.prompt.len();
    if cancelled() {
        return Ok((Finish::Abort, prompt_tokens, 0));
    }
    let mut gen = Generator::start(model, tok, &job.prompt, &job.params).map_err(engine_error)?;
    shared
        .kv_cache_bytes
        .store(gen.cache_bytes(), Ordering::SeqCst);
    loop {
        if cancelled() {
            return Ok((Finish::Abort, prompt_tokens, gen.generated_tokens()));
        }
        let before = gen.generated_tokens();
        let step = match gen.next_token() {
            Ok(Some(step)) => step,
            Ok(None) => return Ok((Finish::Length, prompt_tokens, gen.generated_tokens())),
            Err(e) => return Err(engine_error(e)),
        };
        // A stop token is not output: only count and send real tokens.
        if gen.generated_tokens() > before {
            let _ = job.events.send(EngineEvent::Token(token_out(tok, &step)));
        }
        if let Some(finish) = step.finish {
            return Ok((finish, prompt_tokens, gen.generated_tokens()));
        }
    }
}

/// A generation error as the engine seam reports it: the request's faults
/// (context, sampling, a token id or an empty prompt that reached the
/// model) keep their kind as a 400; the rest is a 500.
pub fn engine_error<E: std::error::Error + 'static>(e: GenerateError<E>) -> EngineError {
    match e {
        GenerateError::Context {
            prompt,
            max_tokens,
            context,
        } => EngineError::ContextLength {
            prompt,
            max_tokens,
            context,
        },
        GenerateError::Sampling(s) => EngineError::InvalidRequest {
            message: s.to_string(),
            param: Some(s.param().into()),
        },
        GenerateError::Model(m) => model_error(&m),
    }
}

/// A local model's error (Project 05's `LocalModelError`, found by
/// downcasting: the engines are generic over the model) as the seam's kind.
fn model_error(m: &(dyn std::error::Error + 'static)) -> EngineError {
    use p04_transformer::ModelError;
    use p05_kv_cache::LocalModelError;
    let invalid = |param: &str| EngineError::InvalidRequest {
        message: m.to_string(),
        param: Some(param.into()),
    };
    match m.downcast_ref::<LocalModelError>() {
        Some(
            LocalModelError::EmptyPrompt | LocalModelError::Model(ModelError::EmptyInput { .. }),
        ) => invalid("prompt"),
        Some(LocalModelError::Model(ModelError::TokenId { .. })) => invalid("prompt"),
        Some(LocalModelError::Model(ModelError::Context { .. })) => invalid("max_tokens"),
        _ => EngineError::Internal(m.to_string()),
    }
}

/// The text of a caught panic, for the error the job reports.
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    let what = panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic without a message");
    format!("the engine failed on this request ({what}); it keeps serving others")
}

/// A sampled step as the engine seam streams it (text, logprobs as text and bytes).
pub fn token_out(tok: &Tokenizer, step: &Step) -> TokenOut {
    let lp = |id: u32, logprob: f32| {
        let bytes = tok.decode_bytes(&[id]);
        TokenLogprob {
            token: String::from_utf8_lossy(&bytes).into_owned(),
            bytes,
            logprob,
        }
    };
    TokenOut {
        text: step.text.clone(),
        logprob: step.logprob.map(|l| lp(step.token, l)),
        top_logprobs: step.top_logprobs.iter().map(|&(i, l)| lp(i, l)).collect(),
    }
}

#[cfg(test)]
mod tests {
    use p05_kv_cache::kv_cache::CacheError;
    use p05_kv_cache::LocalModelError;

    use super::*;

    /// Errors keep their kind across the seam: a request's fault is a 400
    /// naming its field, an engine fault a 500.
    #[test]
    fn model_errors_keep_their_kind() {
        let e = engine_error(GenerateError::Model(LocalModelError::EmptyPrompt));
        assert!(
            matches!(&e, EngineError::InvalidRequest { param: Some(p), .. } if p == "prompt"),
            "{e:?}"
        );
        let id = p04_transformer::ModelError::TokenId {
            id: 9,
            pos: 0,
            vocab: 4,
        };
        let e = engine_error(GenerateError::Model(LocalModelError::Model(id)));
        assert!(matches!(&e, EngineError::InvalidRequest { .. }), "{e:?}");
        let full = CacheError::Full {
            len: 4,
            max_seq: 4,
            adding: 1,
        };
        let e = engine_error(GenerateError::Model(LocalModelError::Cache(full)));
        assert!(
            matches!(&e, EngineError::Internal(m) if m.contains("KV cache is full")),
            "{e:?}"
        );
        let e = engine_error::<LocalModelError>(GenerateError::Sampling(
            common::sampling::SamplingError::TopK,
        ));
        assert!(
            matches!(&e, EngineError::InvalidRequest { param: Some(p), .. } if p == "top_k"),
            "{e:?}"
        );
    }
}

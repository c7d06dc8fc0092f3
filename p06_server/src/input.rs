//! Request → model input, shared by every local engine (the serial engine
//! here, p07's batcher): the engine request's prompt through p04's
//! [`PromptBuilder`] (the model's chat template, its BOS policy,
//! tokenisation; the same path the CLIs use), the context check, and the
//! request's sampling settings as the generation loop's parameters.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use common::engine::{ChatEnd, EngineError, EngineRequest, PromptInput};
use common::ModelInfo;
use p04_transformer::prompt::check_context;
use p04_transformer::{PromptBuilder, PromptError, Tokenizer};
use p05_kv_cache::generate::GenerateParams;

use crate::template::{prompt_error, turns};

/// A request made ready for a model: its token ids and generation settings.
#[derive(Clone, Debug)]
pub struct Prepared {
    pub prompt: Vec<u32>,
    pub params: GenerateParams,
}

#[derive(Debug)]
pub struct InputProcessor {
    prompts: PromptBuilder,
    context: usize,
    vocab: usize,
    /// Seeds for requests that bring none.
    seed_counter: AtomicU64,
}

impl InputProcessor {
    /// Fails when the model's chat template does not compile.
    pub fn new(tokenizer: Arc<Tokenizer>, info: &ModelInfo) -> Result<InputProcessor, PromptError> {
        Ok(InputProcessor {
            prompts: PromptBuilder::new(tokenizer)?,
            context: info.context_length,
            vocab: info.vocab_size,
            seed_counter: AtomicU64::new(common::openai::unix_now()),
        })
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        self.prompts.tokenizer()
    }

    pub fn context(&self) -> usize {
        self.context
    }

    /// Token ids for a prompt: text and chat through the model's template and
    /// BOS policy; token prompts as given (checked against the vocabulary).
    pub fn encode(&self, prompt: &PromptInput) -> Result<Vec<u32>, EngineError> {
        self.encode_ending(prompt, ChatEnd::Open)
    }

    /// As [`Self::encode`], a chat ending as `end` asks.
    pub fn encode_ending(
        &self,
        prompt: &PromptInput,
        end: ChatEnd,
    ) -> Result<Vec<u32>, EngineError> {
        let invalid = |param: &str, message: String| EngineError::InvalidRequest {
            message,
            param: Some(param.to_string()),
        };
        match prompt {
            PromptInput::Tokens(ids) => {
                if let Some(bad) = ids.iter().find(|&&i| i as usize >= self.vocab) {
                    return Err(invalid(
                        "prompt",
                        format!(
                            "token id {bad} is outside the vocabulary (0..{})",
                            self.vocab
                        ),
                    ));
                }
                Ok(ids.clone())
            }
            PromptInput::Text(t) => {
                self.check_bytes("prompt", t.len())?;
                Ok(self.prompts.encode_text(t))
            }
            PromptInput::Chat(messages) => {
                let turns = turns(messages)?;
                // The contents' bytes bound the rendered prompt's from
                // below (a template adds text around them; one that trimmed
                // contents would make this bound too strict).
                self.check_bytes("messages", turns.iter().map(|(_, c)| c.len()).sum())?;
                let turns: Vec<(&str, &str)> =
                    turns.iter().map(|(r, c)| (*r, c.as_str())).collect();
                self.prompts
                    .encode_chat_ending(&turns, end)
                    .map_err(prompt_error)
            }
        }
    }

    /// Refuse text that cannot fit the context whatever its tokens: every
    /// token stands for at most `max_token_bytes` bytes, so `bytes` of text
    /// are at least bytes / max_token_bytes tokens. Checked before
    /// tokenizing, so an oversized prompt costs no tokenizer time.
    fn check_bytes(&self, param: &str, bytes: usize) -> Result<(), EngineError> {
        let per = self.prompts.tokenizer().max_token_bytes();
        let fewest = bytes.div_ceil(per);
        if fewest > self.context {
            return Err(EngineError::InvalidRequest {
                message: format!(
                    "the prompt is {bytes} bytes, so at least {fewest} tokens (no token is \
                     longer than {per} bytes): more than the model's context of {} tokens",
                    self.context
                ),
                param: Some(param.to_string()),
            });
        }
        Ok(())
    }

    /// Tokenise, check against the context and convert the settings.
    pub fn prepare(&self, request: EngineRequest) -> Result<Prepared, EngineError> {
        let prompt = self.encode_ending(&request.prompt, request.chat_end)?;
        if prompt.is_empty() {
            return Err(EngineError::InvalidRequest {
                message: "the prompt is empty".into(),
                param: Some("prompt".into()),
            });
        }
        let max_tokens = check_context(prompt.len(), request.max_tokens, self.context).map_err(
            |max_tokens| EngineError::ContextLength {
                prompt: prompt.len(),
                max_tokens,
                context: self.context,
            },
        )?;
        // The request's settings as they are; a request without a seed
        // gets the next of this server's counter.
        let mut sampling = request.sampling.clone();
        sampling
            .seed
            .get_or_insert_with(|| self.seed_counter.fetch_add(1, Ordering::Relaxed));
        sampling
            .validate()
            .map_err(|e| EngineError::InvalidRequest {
                message: e.to_string(),
                param: Some(e.param().into()),
            })?;
        Ok(Prepared {
            prompt,
            params: GenerateParams {
                max_tokens,
                sampling,
                stop_ids: Vec::new(),
                stop_strings: request.stop,
                ignore_eos: request.ignore_eos,
                min_tokens: request.min_tokens,
                logprobs: request.logprobs,
            },
        })
    }
}

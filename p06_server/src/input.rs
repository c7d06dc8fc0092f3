//! Request → model input, shared by every local engine (the serial engine
//! here, p07's batcher): the chat template, the BOS policy, tokenisation,
//! the context check and the request's sampling settings as the generation
//! loop's parameters. No HTTP in here.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use common::engine::{EngineError, EngineRequest, PromptInput};
use common::ModelInfo;
use p04_transformer::Tokenizer;
use p05_kv_cache::generate::GenerateParams;
use p05_kv_cache::sampling::SamplingParams;

use crate::template::ChatTemplate;

/// A request made ready for a model: its token ids and generation settings.
#[derive(Clone, Debug)]
pub struct Prepared {
    pub prompt: Vec<u32>,
    pub params: GenerateParams,
}

#[derive(Debug)]
pub struct InputProcessor {
    pub tokenizer: Arc<Tokenizer>,
    template: ChatTemplate,
    context: usize,
    vocab: usize,
    /// Seeds for requests that bring none.
    seed_counter: AtomicU64,
}

impl InputProcessor {
    pub fn new(tokenizer: Arc<Tokenizer>, info: &ModelInfo) -> Result<InputProcessor, String> {
        let token = |id: Option<u32>| id.map(|i| tokenizer.decode(&[i])).unwrap_or_default();
        let template = ChatTemplate::new(
            tokenizer.chat_template.as_deref(),
            &token(tokenizer.bos_id),
            &token(tokenizer.eos_id),
        )?;
        Ok(InputProcessor {
            template,
            context: info.context_length,
            vocab: info.vocab_size,
            seed_counter: AtomicU64::new(common::openai::unix_now()),
            tokenizer,
        })
    }

    pub fn context(&self) -> usize {
        self.context
    }

    /// Token ids for a prompt (BOS first when the tokenizer says so).
    pub fn encode(&self, prompt: &PromptInput) -> Result<Vec<u32>, EngineError> {
        let invalid = |param: &str, message: String| EngineError::InvalidRequest {
            message,
            param: Some(param.to_string()),
        };
        let text = match prompt {
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
                return Ok(ids.clone());
            }
            PromptInput::Text(t) => t.clone(),
            PromptInput::Chat(messages) => {
                self.template
                    .render(messages)
                    .map_err(|e| EngineError::InvalidRequest {
                        message: e.message,
                        param: e.param,
                    })?
            }
        };
        let mut ids: Vec<u32> = Vec::new();
        if self.tokenizer.add_bos {
            ids.extend(self.tokenizer.bos_id);
        }
        ids.extend(self.tokenizer.encode(&text));
        Ok(ids)
    }

    /// Tokenise, check against the context and convert the settings.
    pub fn prepare(&self, request: EngineRequest) -> Result<Prepared, EngineError> {
        let prompt = self.encode(&request.prompt)?;
        if prompt.is_empty() {
            return Err(EngineError::InvalidRequest {
                message: "the prompt is empty".into(),
                param: Some("prompt".into()),
            });
        }
        let room = self.context.saturating_sub(prompt.len());
        let max_tokens = request.max_tokens.unwrap_or(room);
        if max_tokens == 0 || prompt.len() + max_tokens > self.context {
            return Err(EngineError::ContextLength {
                prompt: prompt.len(),
                max_tokens,
                context: self.context,
            });
        }
        let s = &request.sampling;
        let sampling = SamplingParams {
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            min_p: s.min_p,
            repetition_penalty: s.repetition_penalty,
            seed: s
                .seed
                .unwrap_or_else(|| self.seed_counter.fetch_add(1, Ordering::Relaxed)),
        };
        sampling
            .validate()
            .map_err(|e| EngineError::InvalidRequest {
                message: e.to_string(),
                param: None,
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

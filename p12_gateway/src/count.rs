//! What the gateway must know of a request before it is admitted: the
//! model, whether it streams, and the most tokens it can cost, counted with
//! the model's real tokenizer and chat template (Project 06's input
//! processing, the same code our backends run), so the reservation is
//! exact for the prompt and an upper bound for the completion. The rest of
//! the body is passed on as sent: each backend validates its own.

use std::path::Path;
use std::sync::Arc;

use common::engine::PromptInput;
use common::openai::{ChatMessage, Content};
use common::ModelInfo;
use p04_transformer::{GgufFile, Tokenizer};
use p06_server::error::ApiError;
use p06_server::input::InputProcessor;
use serde_json::Value;

/// Which endpoint (the prompt's field differs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
        }
    }
}

/// The fields the gateway reads.
#[derive(Clone, Debug, PartialEq)]
pub struct Peek {
    pub model: String,
    pub stream: bool,
    /// The client asked for the final usage chunk of a stream.
    pub include_usage: bool,
    /// `max_tokens` (or chat's `max_completion_tokens`).
    pub max_tokens: Option<u64>,
    /// Choices per prompt.
    pub n: u64,
    /// One entry per prompt (a completions request may carry several).
    pub prompts: Vec<PromptInput>,
}

fn field_u64(body: &Value, name: &str) -> Result<Option<u64>, ApiError> {
    match body.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            ApiError::invalid(name, format!("{name} must be a non-negative integer"))
        }),
    }
}

/// Read the gateway's fields from a JSON body.
pub fn peek(body: &Value, endpoint: Endpoint) -> Result<Peek, ApiError> {
    if !body.is_object() {
        return Err(ApiError::bad_body("the body must be a JSON object"));
    }
    let model = match body.get("model") {
        Some(Value::String(m)) => m.clone(),
        _ => return Err(ApiError::invalid("model", "model is required (a string)")),
    };
    let stream = match body.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::invalid("stream", "stream must be a boolean")),
    };
    let include_usage = body
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    // A length field the gateway would not bound is refused, not guessed.
    if body.get("n_predict").is_some() {
        return Err(ApiError::invalid(
            "n_predict",
            "n_predict is not accepted through the gateway: use max_tokens",
        ));
    }
    // Both names given (backends differ in which wins): reserve the larger.
    let max_tokens = match (
        field_u64(body, "max_tokens")?,
        field_u64(body, "max_completion_tokens")?,
    ) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    };
    // `best_of` candidates are generated (and billed) too.
    let n = field_u64(body, "n")?
        .unwrap_or(1)
        .max(field_u64(body, "best_of")?.unwrap_or(1))
        .max(1);
    let prompts = match endpoint {
        Endpoint::Completions => match body.get("prompt") {
            Some(Value::String(s)) => vec![PromptInput::Text(s.clone())],
            Some(Value::Array(items)) if items.is_empty() => {
                return Err(ApiError::invalid("prompt", "prompt must not be empty"))
            }
            Some(Value::Array(items)) if items.iter().all(Value::is_string) => items
                .iter()
                .filter_map(|s| s.as_str().map(|s| PromptInput::Text(s.to_string())))
                .collect(),
            Some(Value::Array(items)) => {
                let ids: Option<Vec<u32>> = items
                    .iter()
                    .map(|v| v.as_u64().and_then(|x| u32::try_from(x).ok()))
                    .collect();
                vec![PromptInput::Tokens(ids.ok_or_else(|| {
                    ApiError::invalid("prompt", "prompt must be a string, strings or token ids")
                })?)]
            }
            _ => return Err(ApiError::invalid("prompt", "prompt is required")),
        },
        Endpoint::Chat => {
            let messages: Vec<ChatMessage> = body
                .get("messages")
                .cloned()
                .map(serde_json::from_value)
                .transpose()
                .map_err(|e| ApiError::invalid("messages", format!("messages: {e}")))?
                .ok_or_else(|| ApiError::invalid("messages", "messages is required"))?;
            vec![PromptInput::Chat(messages)]
        }
    };
    Ok(Peek {
        model,
        stream,
        include_usage,
        max_tokens,
        n,
        prompts,
    })
}

/// A model's prompt counter: its tokenizer and template, or bytes.
#[derive(Debug)]
pub struct Counter {
    input: Option<InputProcessor>,
    context: Option<usize>,
}

/// The prompt's tokens (`ids` empty when a text prompt is counted by bytes).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counted {
    pub tokens: u64,
    /// The first prompt's ids (what prefix affinity hashes).
    pub ids: Vec<u32>,
}

impl Counter {
    /// Counting by bytes: an upper bound (no token is shorter than a byte).
    pub fn bytes(context: Option<usize>) -> Counter {
        Counter {
            input: None,
            context,
        }
    }

    pub fn with_tokenizer(
        tokenizer: Tokenizer,
        context: usize,
        name: &str,
    ) -> Result<Counter, String> {
        let info = ModelInfo {
            name: name.to_string(),
            vocab_size: tokenizer.vocab_size(),
            context_length: context,
            bos_id: None,
            stop_ids: Vec::new(),
        };
        let input = InputProcessor::new(Arc::new(tokenizer), &info).map_err(|e| e.to_string())?;
        Ok(Counter {
            input: Some(input),
            context: Some(context),
        })
    }

    /// The tokenizer of a GGUF file (a path, or a name p06 resolves), and
    /// its context length unless `context` is given.
    pub fn from_gguf(spec: &str, context: Option<usize>, name: &str) -> anyhow::Result<Counter> {
        let path = p06_server::load::resolve_model(spec)?;
        let f = GgufFile::open(Path::new(&path))?;
        let tok = Tokenizer::from_gguf(&f.header)?;
        let ctx = match context {
            Some(c) => c,
            None => usize::try_from(f.header.get_u64("llama.context_length")?)?,
        };
        Counter::with_tokenizer(tok, ctx, name).map_err(anyhow::Error::msg)
    }

    pub fn context(&self) -> Option<usize> {
        self.context
    }

    /// Count every prompt of a request (CPU work: call off the async workers).
    pub fn count(&self, prompts: &[PromptInput]) -> Result<Counted, ApiError> {
        let mut out = Counted::default();
        for (i, p) in prompts.iter().enumerate() {
            let (n, ids) = match &self.input {
                Some(input) => {
                    let ids = input.encode(p).map_err(ApiError::from)?;
                    (ids.len() as u64, ids)
                }
                None => match p {
                    PromptInput::Tokens(ids) => (ids.len() as u64, ids.clone()),
                    _ => (bytes_of(p), Vec::new()),
                },
            };
            out.tokens = out.tokens.saturating_add(n);
            if i == 0 {
                out.ids = ids;
            }
        }
        Ok(out)
    }

    /// The most tokens a request can cost: its prompts, plus for each
    /// prompt `n` completions of `max_tokens` (absent: up to the context).
    pub fn cost(&self, peek: &Peek, prompt_tokens: u64) -> u64 {
        let per_prompt = prompt_tokens / peek.prompts.len().max(1) as u64;
        let completion = match (peek.max_tokens, self.context) {
            (Some(m), _) => m,
            (None, Some(ctx)) => (ctx as u64).saturating_sub(per_prompt),
            // Nothing bounds it: the whole of any limit.
            (None, None) => u64::MAX / 4,
        };
        let completions = completion
            .saturating_mul(peek.n)
            .saturating_mul(peek.prompts.len() as u64);
        prompt_tokens.saturating_add(completions)
    }
}

/// An upper bound on a prompt's tokens without a tokenizer: its bytes
/// (chat: the contents' bytes plus 16 per message for the template).
fn bytes_of(p: &PromptInput) -> u64 {
    match p {
        PromptInput::Text(t) => t.len() as u64,
        PromptInput::Tokens(ids) => ids.len() as u64,
        PromptInput::Chat(messages) => messages
            .iter()
            .map(|m| {
                let content = match &m.content {
                    Some(Content::Text(t)) => t.len(),
                    Some(Content::Parts(parts)) => parts
                        .iter()
                        .map(|p| p.text.as_deref().map_or(0, str::len))
                        .sum(),
                    None => 0,
                };
                (content + m.role.len() + 16) as u64
            })
            .sum(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn peek_reads_the_fields_and_names_bad_ones() {
        let p = peek(
            &json!({"model": "m", "prompt": "hi", "max_tokens": 5, "n": 2, "stream": true}),
            Endpoint::Completions,
        )
        .unwrap();
        assert_eq!(
            (p.model.as_str(), p.stream, p.max_tokens, p.n),
            ("m", true, Some(5), 2)
        );
        let chat = json!({"model": "m", "messages": [{"role": "user", "content": "x"}],
                          "max_completion_tokens": 3, "max_tokens": 9, "best_of": 4});
        let p = peek(&chat, Endpoint::Chat).unwrap();
        assert_eq!(
            (p.max_tokens, p.n),
            (Some(9), 4),
            "the larger bound, best_of candidates"
        );
        let bad = [
            (json!({"prompt": "x"}), "model"),
            (
                json!({"model": "m", "prompt": "x", "max_tokens": -1}),
                "max_tokens",
            ),
            (
                json!({"model": "m", "prompt": "x", "stream": "yes"}),
                "stream",
            ),
            (json!({"model": "m"}), "prompt"),
            (json!({"model": "m", "prompt": [1, "a"]}), "prompt"),
            (json!({"model": "m", "prompt": []}), "prompt"),
            (
                json!({"model": "m", "prompt": "x", "n_predict": 9}),
                "n_predict",
            ),
        ];
        for (body, param) in bad {
            let e = peek(&body, Endpoint::Completions).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
            assert_eq!(e.status, 400);
        }
    }

    #[test]
    fn byte_counting_is_an_upper_bound_and_cost_adds_every_completion() {
        let c = Counter::bytes(Some(100));
        let p = peek(
            &json!({"model": "m", "prompt": ["abcd", "ef"], "n": 3}),
            Endpoint::Completions,
        )
        .unwrap();
        let counted = c.count(&p.prompts).unwrap();
        assert_eq!(counted.tokens, 6);
        // No max_tokens: each of 2 prompts x 3 choices may run to the context.
        assert_eq!(c.cost(&p, 6), 6 + 2 * 3 * (100 - 3));
    }
}

//! Building responses: whole `chat.completion` / `text_completion` objects,
//! and the streamed `chat.completion.chunk` / `text_completion` frames.

use common::engine::{Finish, TokenLogprob, TokenOut};
use common::openai::{
    self, ChatChoice, ChatLogprobs, ChatResponse, CompletionChoice, CompletionLogprobs,
    CompletionResponse, ResponseMessage, TopLogprob, Usage,
};
use serde_json::{json, Value};

use crate::request::Endpoint;

/// Shapes every frame of one response (same id, time and model throughout).
#[derive(Clone, Debug)]
pub struct Builder {
    pub endpoint: Endpoint,
    pub id: String,
    pub created: u64,
    pub model: String,
    /// Whether the request asked for logprobs.
    pub logprobs: bool,
}

fn chat_logprob(t: &TokenOut) -> Option<openai::TokenLogprob> {
    let lp = t.logprob.as_ref()?;
    let top = |x: &TokenLogprob| TopLogprob {
        token: x.token.clone(),
        logprob: x.logprob,
        bytes: x.bytes.clone(),
    };
    Some(openai::TokenLogprob {
        token: lp.token.clone(),
        logprob: lp.logprob,
        bytes: lp.bytes.clone(),
        top_logprobs: t.top_logprobs.iter().map(top).collect(),
    })
}

/// Completions' logprobs for `tokens`, whose text starts at `offset`.
fn completion_logprobs(tokens: &[TokenOut], mut offset: usize) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    for t in tokens {
        let Some(lp) = &t.logprob else { continue };
        out.tokens.push(lp.token.clone());
        out.token_logprobs.push(lp.logprob);
        out.top_logprobs.push(
            t.top_logprobs
                .iter()
                .map(|x| (x.token.clone(), json!(x.logprob)))
                .collect(),
        );
        out.text_offset.push(offset);
        offset += t.text.len();
    }
    out
}

impl Builder {
    fn chat(&self, choices: Vec<ChatChoice>, usage: Option<Usage>, object: &str) -> Value {
        serde_json::to_value(ChatResponse {
            id: self.id.clone(),
            object: object.into(),
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        })
        .unwrap_or(Value::Null)
    }

    fn completion(&self, choices: Vec<CompletionChoice>, usage: Option<Usage>) -> Value {
        serde_json::to_value(CompletionResponse {
            id: self.id.clone(),
            object: "text_completion".into(),
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        })
        .unwrap_or(Value::Null)
    }

    /// The chat stream's opening frame of choice `index` (the assistant
    /// role, no content).
    pub fn role_chunk(&self, index: usize) -> Option<Value> {
        (self.endpoint == Endpoint::Chat).then(|| {
            let delta = ResponseMessage {
                role: Some("assistant".into()),
                content: Some(String::new()),
            };
            self.chat(
                vec![chat_choice(index, None, Some(delta), None, None)],
                None,
                CHUNK,
            )
        })
    }

    /// One token's frame of choice `index`; `offset` is the byte offset of
    /// its text in that choice.
    pub fn token_chunk(&self, index: usize, t: &TokenOut, offset: usize) -> Value {
        match self.endpoint {
            Endpoint::Chat => {
                let delta = ResponseMessage {
                    role: None,
                    content: Some(t.text.clone()),
                };
                let lp = self.logprobs.then(|| ChatLogprobs {
                    content: chat_logprob(t).into_iter().collect(),
                });
                self.chat(
                    vec![chat_choice(index, None, Some(delta), lp, None)],
                    None,
                    CHUNK,
                )
            }
            Endpoint::Completions => {
                let lp = self
                    .logprobs
                    .then(|| completion_logprobs(std::slice::from_ref(t), offset));
                self.completion(
                    vec![completion_choice(index, t.text.clone(), lp, None)],
                    None,
                )
            }
        }
    }

    /// The frame that carries choice `index`'s finish reason.
    pub fn finish_chunk(&self, index: usize, finish: Finish) -> Value {
        let reason = Some(finish.as_str().to_string());
        match self.endpoint {
            Endpoint::Chat => self.chat(
                vec![chat_choice(
                    index,
                    None,
                    Some(ResponseMessage::default()),
                    None,
                    reason,
                )],
                None,
                CHUNK,
            ),
            Endpoint::Completions => self.completion(
                vec![completion_choice(index, String::new(), None, reason)],
                None,
            ),
        }
    }

    /// `stream_options.include_usage`: a last frame with no choices.
    pub fn usage_chunk(&self, usage: Usage) -> Value {
        match self.endpoint {
            Endpoint::Chat => self.chat(vec![], Some(usage), CHUNK),
            Endpoint::Completions => self.completion(vec![], Some(usage)),
        }
    }

    /// The whole (non-streamed) response: each choice's tokens and finish
    /// reason, in choice order.
    pub fn full(&self, choices: &[(Vec<TokenOut>, Finish)], usage: Usage) -> Value {
        let text = |tokens: &[TokenOut]| tokens.iter().map(|t| t.text.as_str()).collect();
        let reason = |finish: &Finish| Some(finish.as_str().to_string());
        match self.endpoint {
            Endpoint::Chat => {
                let choices = choices.iter().enumerate().map(|(i, (tokens, finish))| {
                    let lp = self.logprobs.then(|| ChatLogprobs {
                        content: tokens.iter().filter_map(chat_logprob).collect(),
                    });
                    let msg = ResponseMessage {
                        role: Some("assistant".into()),
                        content: Some(text(tokens)),
                    };
                    chat_choice(i, Some(msg), None, lp, reason(finish))
                });
                self.chat(choices.collect(), Some(usage), "chat.completion")
            }
            Endpoint::Completions => {
                let choices = choices.iter().enumerate().map(|(i, (tokens, finish))| {
                    let lp = self.logprobs.then(|| completion_logprobs(tokens, 0));
                    completion_choice(i, text(tokens), lp, reason(finish))
                });
                self.completion(choices.collect(), Some(usage))
            }
        }
    }
}

const CHUNK: &str = "chat.completion.chunk";

fn chat_choice(
    index: usize,
    message: Option<ResponseMessage>,
    delta: Option<ResponseMessage>,
    logprobs: Option<ChatLogprobs>,
    finish_reason: Option<String>,
) -> ChatChoice {
    ChatChoice {
        index,
        message,
        delta,
        logprobs,
        finish_reason,
    }
}

fn completion_choice(
    index: usize,
    text: String,
    logprobs: Option<CompletionLogprobs>,
    finish_reason: Option<String>,
) -> CompletionChoice {
    CompletionChoice {
        index,
        text,
        logprobs,
        finish_reason,
    }
}

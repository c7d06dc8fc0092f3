//! An HTTP client of the OpenAI API: server-sent-event decoding, and
//! [`RemoteEngine`], an [`Engine`] that forwards each request to any
//! OpenAI-compatible server (ours, llama.cpp's, vLLM) and streams its answer
//! back, so a real external engine can stand behind our HTTP layer.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use futures_util::StreamExt;
use serde_json::Value;
use tokio::sync::mpsc;

use crate::engine::{
    Engine, EngineError, EngineEvent, EngineLoad, EngineRequest, EngineStream, Finish, PromptInput,
    TokenOut,
};
use crate::openai::{
    ChatEnd, ChatRequest, CommonParams, CompletionRequest, ErrorBody, PromptSpec, StopSpec,
    StreamOptions,
};

/// Splits a `text/event-stream` body into the `data:` payloads of its events.
#[derive(Debug, Default)]
pub struct SseDecoder {
    buf: Vec<u8>,
}

impl SseDecoder {
    /// Feed bytes as they arrive; get the events completed by them.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some((end, sep)) = find_event_end(&self.buf) {
            let event: Vec<u8> = self.buf.drain(..end + sep).take(end).collect();
            let text = String::from_utf8_lossy(&event);
            let data: Vec<&str> = text
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            if !data.is_empty() {
                out.push(data.join("\n"));
            }
        }
        out
    }
}

/// End of the first event (a blank line) and the separator's length.
fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|i| (i, 2));
    let crlf = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| (i, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

/// The message of an OpenAI-style error body, or the body itself.
pub fn error_message(body: &str) -> String {
    serde_json::from_str::<ErrorBody>(body)
        .map(|e| e.error.message)
        .unwrap_or_else(|_| body.chars().take(500).collect())
}

/// The text of a streamed chunk of either endpoint (`delta.content` or `text`).
pub fn chunk_text(chunk: &Value) -> Option<&str> {
    let choice = chunk.get("choices")?.get(0)?;
    choice
        .get("delta")
        .and_then(|d| d.get("content"))
        .or_else(|| choice.get("text"))
        .and_then(Value::as_str)
}

/// The finish reason of a streamed chunk, if it carries one.
pub fn chunk_finish(chunk: &Value) -> Option<&str> {
    chunk
        .get("choices")?
        .get(0)?
        .get("finish_reason")
        .and_then(Value::as_str)
}

/// `(prompt_tokens, completion_tokens)` of a chunk that carries `usage`
/// (the last one, with `stream_options.include_usage`).
pub fn chunk_usage(chunk: &Value) -> Option<(Option<usize>, Option<usize>)> {
    let u = chunk.get("usage").filter(|u| !u.is_null())?;
    let field = |k: &str| u.get(k).and_then(Value::as_u64).map(|v| v as usize);
    Some((field("prompt_tokens"), field("completion_tokens")))
}

/// A streaming request body for `request`, and the endpoint path it goes to.
pub fn request_body(request: &EngineRequest, model: &str) -> (&'static str, Value) {
    let s = &request.sampling;
    let common = CommonParams {
        model: Some(model.to_string()),
        max_tokens: request.max_tokens.map(|m| m as i64),
        temperature: Some(s.temperature),
        top_p: Some(s.top_p),
        top_k: s.top_k.map(|k| k as i64),
        min_p: (s.min_p > 0.0).then_some(s.min_p),
        repetition_penalty: (s.repetition_penalty != 1.0).then_some(s.repetition_penalty),
        seed: s.seed.map(|v| v as i64),
        stop: (!request.stop.is_empty()).then(|| StopSpec::Many(request.stop.clone())),
        stream: Some(true),
        stream_options: Some(StreamOptions {
            include_usage: true,
        }),
        ignore_eos: request.ignore_eos.then_some(true),
        min_tokens: (request.min_tokens > 0).then_some(request.min_tokens as i64),
        ..CommonParams::default()
    };
    let body = match &request.prompt {
        PromptInput::Chat(messages) => serde_json::to_value(ChatRequest {
            messages: Some(messages.clone()),
            common,
            logprobs: request.logprobs.map(|_| true),
            top_logprobs: request.logprobs.map(|k| k as i64),
            add_generation_prompt: (request.chat_end != ChatEnd::Open).then_some(false),
            continue_final_message: (request.chat_end == ChatEnd::ContinueFinal).then_some(true),
            ..ChatRequest::default()
        }),
        PromptInput::Text(t) => serde_json::to_value(CompletionRequest {
            prompt: Some(PromptSpec::Text(t.clone())),
            common,
            logprobs: request.logprobs.map(|k| k as i64),
            ..CompletionRequest::default()
        }),
        PromptInput::Tokens(ids) => serde_json::to_value(CompletionRequest {
            prompt: Some(PromptSpec::Tokens(ids.clone())),
            common,
            logprobs: request.logprobs.map(|k| k as i64),
            ..CompletionRequest::default()
        }),
    };
    let path = match request.prompt {
        PromptInput::Chat(_) => "/v1/chat/completions",
        _ => "/v1/completions",
    };
    (path, body.unwrap_or(Value::Null))
}

/// An [`Engine`] that is another OpenAI-compatible server.
#[derive(Debug)]
pub struct RemoteEngine {
    base_url: String,
    model: String,
    http: reqwest::Client,
    running: Arc<AtomicUsize>,
    closed: Arc<AtomicBool>,
}

impl RemoteEngine {
    /// `base_url` like `http://127.0.0.1:8080` (no `/v1`); `model` is sent as is.
    pub fn new(base_url: &str, model: &str) -> RemoteEngine {
        RemoteEngine {
            base_url: base_url.trim_end_matches('/').to_string(),
            model: model.to_string(),
            http: reqwest::Client::new(),
            running: Arc::new(AtomicUsize::new(0)),
            closed: Arc::new(AtomicBool::new(false)),
        }
    }
}

/// Decrements the running count however the forwarding task ends.
struct RunningGuard(Arc<AtomicUsize>);

impl Drop for RunningGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Engine for RemoteEngine {
    fn model_name(&self) -> &str {
        &self.model
    }

    fn context_length(&self) -> Option<usize> {
        None
    }

    fn load(&self) -> EngineLoad {
        EngineLoad {
            running: self.running.load(Ordering::Relaxed),
            waiting: 0,
            kv_cache_bytes: 0,
        }
    }

    fn submit(&self, request: EngineRequest) -> Result<EngineStream, EngineError> {
        if self.closed.load(Ordering::Relaxed) {
            return Err(EngineError::Unavailable(
                "the engine is shutting down".into(),
            ));
        }
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|_| EngineError::Internal("RemoteEngine needs a tokio runtime".into()))?;
        let (path, body) = request_body(&request, &self.model);
        let url = format!("{}{path}", self.base_url);
        let (tx, rx) = mpsc::unbounded_channel();
        self.running.fetch_add(1, Ordering::Relaxed);
        let guard = RunningGuard(self.running.clone());
        let http = self.http.clone();
        let closed = self.closed.clone();
        runtime.spawn(async move {
            let _guard = guard;
            let out = tx.clone();
            tokio::select! {
                // The caller dropped the stream: dropping the response closes
                // the connection, which cancels the request upstream.
                () = out.closed() => {}
                () = forward(http, url, body, tx, closed) => {}
            }
        });
        Ok(rx)
    }

    fn abort_all(&self) {
        self.closed.store(true, Ordering::Relaxed);
    }
}

async fn forward(
    http: reqwest::Client,
    url: String,
    body: Value,
    tx: mpsc::UnboundedSender<EngineEvent>,
    closed: Arc<AtomicBool>,
) {
    let fail = |e: EngineError| {
        let _ = tx.send(EngineEvent::Error(e));
    };
    let resp = match http.post(&url).json(&body).send().await {
        Ok(r) => r,
        Err(e) => return fail(EngineError::Unavailable(format!("{url}: {e}"))),
    };
    let status = resp.status();
    if !status.is_success() {
        let text = resp.text().await.unwrap_or_default();
        return fail(EngineError::Upstream {
            status: status.as_u16(),
            message: error_message(&text),
        });
    }
    let mut sse = SseDecoder::default();
    let mut bytes = resp.bytes_stream();
    let (mut finish, mut prompt_tokens, mut completion_tokens, mut chunks) =
        (Finish::Length, 0, None, 0);
    while let Some(piece) = bytes.next().await {
        if closed.load(Ordering::Relaxed) {
            finish = Finish::Abort;
            break;
        }
        let piece = match piece {
            Ok(p) => p,
            Err(e) => return fail(EngineError::Unavailable(format!("{url}: {e}"))),
        };
        for data in sse.push(&piece) {
            if data == "[DONE]" {
                break;
            }
            let Ok(chunk) = serde_json::from_str::<Value>(&data) else {
                return fail(EngineError::Internal(format!(
                    "{url} sent an event that is not JSON: {data}"
                )));
            };
            if let Some((p, c)) = chunk_usage(&chunk) {
                prompt_tokens = p.unwrap_or(prompt_tokens);
                completion_tokens = c.or(completion_tokens);
            }
            if let Some(text) = chunk_text(&chunk) {
                chunks += 1;
                let token = TokenOut {
                    text: text.to_string(),
                    logprob: None,
                    top_logprobs: Vec::new(),
                };
                if tx.send(EngineEvent::Token(token)).is_err() {
                    return;
                }
            }
            finish = match chunk_finish(&chunk) {
                Some("stop") => Finish::Stop,
                Some("length") => Finish::Length,
                Some(_) => Finish::Abort,
                None => finish,
            };
        }
    }
    let _ = tx.send(EngineEvent::Done {
        finish,
        prompt_tokens,
        completion_tokens: completion_tokens.unwrap_or(chunks),
    });
}

#[cfg(test)]
mod tests {
    use super::SseDecoder;

    #[test]
    fn events_split_across_reads_and_line_endings_are_reassembled() {
        let mut d = SseDecoder::default();
        assert!(d.push(b"data: {\"a\"").is_empty());
        assert_eq!(
            d.push(b":1}\n\ndata: x\r\n\r\n: comment\n\ndata"),
            ["{\"a\":1}", "x"]
        );
        assert_eq!(d.push(b": [DONE]\n\n"), ["[DONE]"]);
    }

    #[test]
    fn a_chat_request_carries_how_its_prompt_ends() {
        use crate::engine::{ChatEnd, EngineRequest, PromptInput};
        use crate::openai::ChatMessage;
        let mut r = EngineRequest::new(
            "x",
            PromptInput::Chat(vec![ChatMessage {
                role: "assistant".into(),
                content: Some(crate::openai::Content::Text("Once".into())),
            }]),
        );
        let fields = |r: &EngineRequest| {
            let (_, body) = super::request_body(r, "m");
            (
                body.get("add_generation_prompt").cloned(),
                body.get("continue_final_message").cloned(),
            )
        };
        assert_eq!(fields(&r), (None, None), "the default is not sent");
        r.chat_end = ChatEnd::ContinueFinal;
        let f = fields(&r);
        assert_eq!((f.0.unwrap(), f.1.unwrap()), (false.into(), true.into()));
        r.chat_end = ChatEnd::Closed;
        assert_eq!(fields(&r), (Some(false.into()), None));
    }
}

//! Resuming a completion stream whose backend died after its first event.
//!
//! A stream is committed at its first event: the client has shown those
//! tokens, so the request cannot be sent again from the start. It can be
//! *continued*: the text the client has been sent is appended to the
//! prompt and the rest of the budget asked of another backend, whose
//! events are relayed as if they were the first backend's (its `id` and
//! `created` stamped on them, its usage counted over the whole answer).
//!
//! ```text
//! client asked   prompt P, max_tokens M, stream
//! backend A      "Once" " upon" " a"  ✗ (died)
//! continuation   prompt P + "Once upon a", max_tokens M - 3  -> backend B
//! backend B      " time" "," ... [DONE]
//! client sees    "Once" " upon" " a" " time" "," ... [DONE]   (one stream)
//! ```
//!
//! For greedy decoding the continuation is the answer the first backend
//! would have given, as long as the prompt and the text so far tokenize
//! back to the ids that produced them (for text a model generated, they
//! almost always do); a sampled stream continues as another sample from
//! the same text. A stream cut after its last token (the budget spent)
//! or its finish reason is closed by the gateway instead: the finish
//! chunk, the usage, `[DONE]`. Resumed: `/v1/completions` with one string
//! prompt and one choice (no `echo`, `logprobs`, `best_of` or `suffix`),
//! and `/v1/chat/completions` with one choice, no tools and no logprobs.
//! A chat continues through vLLM's `continue_final_message` (the OpenAI
//! API has no field for it): the text sent becomes an unfinished assistant
//! message (or is appended to the client's own unfinished one) that the
//! backend goes on writing; the continuation's opening role chunk is not
//! relayed again. A stop string that straddles the cut is not seen by the
//! continuation.
//!
//! ```text
//! chat asked     messages M, max_completion_tokens K
//! continuation   messages M + {assistant: "Once upon a"}, add_generation_prompt
//!                false, continue_final_message true, K - 3
//! ```

use axum::body::Bytes;
use serde_json::{Map, Value};

use crate::count::Endpoint;
use crate::sse;

/// What a committed stream needs to be continued elsewhere.
#[derive(Clone, Debug)]
pub struct Resume {
    endpoint: Endpoint,
    /// The client's request body.
    body: Map<String, Value>,
    /// Completions: the prompt.
    prompt: String,
    /// The budget's field (chat may name it `max_completion_tokens`).
    budget: &'static str,
    max_tokens: Option<u64>,
    /// Text sent to the client so far.
    text: String,
    /// Chunks with text sent so far (one token each from our servers).
    tokens: u64,
    /// A finish reason was sent: the answer is whole but for `[DONE]`.
    finished: bool,
    /// Chunks whose text the latest continuation's prompt carries.
    moved: u64,
    /// The first stream's `id` and `created`.
    id: Option<Value>,
    created: Option<Value>,
}

impl Resume {
    /// The resume state of a request, or None when it cannot be resumed.
    pub fn new(endpoint: Endpoint, body: &[u8]) -> Option<Resume> {
        let Value::Object(body) = serde_json::from_slice(body).ok()? else {
            return None;
        };
        let one = |k: &str| {
            body.get(k)
                .is_none_or(|v| v.is_null() || v.as_u64() == Some(1))
        };
        let off = |k: &str| {
            body.get(k)
                .is_none_or(|v| v.is_null() || v.as_bool() == Some(false))
        };
        let set = |k: &str| body.get(k).is_some_and(|v| !v.is_null());
        if !one("n") {
            return None;
        }
        let mut budget = "max_tokens";
        let prompt = match endpoint {
            Endpoint::Completions => {
                if !one("best_of") || !off("echo") || set("suffix") || set("logprobs") {
                    return None;
                }
                body.get("prompt")?.as_str()?.to_string()
            }
            Endpoint::Chat => {
                if !off("logprobs") || set("top_logprobs") || set("tools") {
                    return None;
                }
                let messages = body.get("messages")?.as_array()?;
                // A prompt closed without a generation prompt cannot be
                // written as messages once text follows it.
                let continues = body.get("continue_final_message") == Some(&Value::Bool(true));
                let closed = body.get("add_generation_prompt") == Some(&Value::Bool(false));
                if closed && !continues {
                    return None;
                }
                // Appended to: the client's own unfinished message must
                // be a string.
                if continues && !messages.last()?.get("content")?.is_string() {
                    return None;
                }
                if set("max_completion_tokens") {
                    budget = "max_completion_tokens";
                }
                String::new()
            }
        };
        let max_tokens = match body.get(budget) {
            None | Some(Value::Null) => None,
            Some(v) => Some(v.as_u64()?),
        };
        Some(Resume {
            endpoint,
            body,
            prompt,
            budget,
            max_tokens,
            text: String::new(),
            tokens: 0,
            finished: false,
            moved: 0,
            id: None,
            created: None,
        })
    }

    /// Note an event sent to the client, by its JSON payload (chunks only
    /// count).
    pub fn sent(&mut self, v: &Value) {
        if self.id.is_none() {
            self.id = v.get("id").cloned();
            self.created = v.get("created").cloned();
        }
        let text = match self.endpoint {
            Endpoint::Completions => v.pointer("/choices/0/text"),
            Endpoint::Chat => v.pointer("/choices/0/delta/content"),
        };
        if let Some(t) = text.and_then(Value::as_str) {
            if !t.is_empty() {
                self.text.push_str(t);
                self.tokens += 1;
            }
        }
        if v.pointer("/choices/0/finish_reason")
            .is_some_and(|f| !f.is_null())
        {
            self.finished = true;
        }
    }

    /// Whether a finish reason was sent (only `[DONE]` is missing).
    pub fn finished(&self) -> bool {
        self.finished
    }

    /// Whether the client has every token it asked for (only the closing
    /// events are missing).
    pub fn spent(&self) -> bool {
        self.max_tokens.is_some_and(|m| self.tokens >= m)
    }

    /// The events that close an answer that is whole but for them: the
    /// finish chunk (`length`: the budget is spent) unless one was sent,
    /// the usage chunk (`prompt_tokens` as the gateway counted them), and
    /// `[DONE]`.
    pub fn closing(&self, prompt_tokens: u64) -> Vec<Vec<u8>> {
        let head = |o: &mut Map<String, Value>| {
            for (k, v) in [("id", &self.id), ("created", &self.created)] {
                if let Some(v) = v {
                    o.insert(k.into(), v.clone());
                }
            }
            let object = match self.endpoint {
                Endpoint::Completions => "text_completion",
                Endpoint::Chat => "chat.completion.chunk",
            };
            o.insert("object".into(), object.into());
            if let Some(m) = self.body.get("model") {
                o.insert("model".into(), m.clone());
            }
        };
        let event = |o: Map<String, Value>| format!("data: {}\n\n", Value::Object(o)).into_bytes();
        let mut out = Vec::new();
        if !self.finished {
            let mut o = Map::new();
            head(&mut o);
            let choice = match self.endpoint {
                Endpoint::Completions => serde_json::json!({"index": 0, "text": "",
                    "logprobs": null, "finish_reason": "length"}),
                Endpoint::Chat => serde_json::json!({"index": 0, "delta": {},
                    "logprobs": null, "finish_reason": "length"}),
            };
            o.insert("choices".into(), Value::Array(vec![choice]));
            out.push(event(o));
        }
        let mut o = Map::new();
        head(&mut o);
        o.insert("choices".into(), Value::Array(Vec::new()));
        let usage = serde_json::json!({"prompt_tokens": prompt_tokens,
            "completion_tokens": self.tokens,
            "total_tokens": prompt_tokens.saturating_add(self.tokens)});
        o.insert("usage".into(), usage);
        out.push(event(o));
        out.push(b"data: [DONE]\n\n".to_vec());
        out
    }

    /// Whether the client was sent text already (before any, a failed
    /// stream is simply retried).
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// The continuation's body, or None when the budget is spent or a
    /// finish reason was already sent. Its events go through [`rewrite`].
    ///
    /// [`rewrite`]: Resume::rewrite
    pub fn continuation(&mut self) -> Option<Bytes> {
        if self.finished {
            return None;
        }
        let left = match self.max_tokens {
            Some(m) if m <= self.tokens => return None,
            Some(m) => Some(m - self.tokens),
            None => None,
        };
        self.moved = self.tokens;
        let mut b = self.body.clone();
        match self.endpoint {
            Endpoint::Completions => {
                b.insert(
                    "prompt".into(),
                    Value::String(format!("{}{}", self.prompt, self.text)),
                );
            }
            Endpoint::Chat => {
                let continues = b.get("continue_final_message") == Some(&Value::Bool(true));
                let Some(Value::Array(messages)) = b.get_mut("messages") else {
                    return None;
                };
                match (continues, messages.last_mut()) {
                    (true, Some(Value::Object(last))) => {
                        let was = last.get("content").and_then(Value::as_str).unwrap_or("");
                        let content = format!("{was}{}", self.text);
                        last.insert("content".into(), content.into());
                    }
                    _ => messages.push(serde_json::json!({"role": "assistant",
                                                          "content": self.text})),
                }
                b.insert("add_generation_prompt".into(), false.into());
                b.insert("continue_final_message".into(), true.into());
            }
        }
        if let Some(left) = left {
            b.insert(self.budget.into(), left.into());
        }
        // The gateway settles at the usage: always ask for it.
        let opts = b
            .entry("stream_options")
            .or_insert_with(|| Value::Object(Map::new()));
        if let Value::Object(o) = opts {
            o.insert("include_usage".into(), true.into());
        }
        serde_json::to_vec(&Value::Object(b)).ok().map(Bytes::from)
    }

    /// An event of the continuation as the client should see it: the first
    /// stream's `id` and `created`, and usage over the whole answer (the
    /// text that became prompt counted as completion again); None for a
    /// chat's opening role chunk (the client had one).
    pub fn rewrite(&self, event: Vec<u8>) -> Option<Vec<u8>> {
        let Some(mut v) = sse::data(&event).and_then(|d| serde_json::from_str::<Value>(&d).ok())
        else {
            return Some(event); // [DONE], comments
        };
        let finished = v
            .pointer("/choices/0/finish_reason")
            .is_some_and(|f| !f.is_null());
        if let Some(Value::Object(delta)) = v.pointer_mut("/choices/0/delta") {
            if delta.remove("role").is_some()
                && delta.get("content").is_none_or(|c| c.as_str() == Some(""))
                && !finished
            {
                return None;
            }
        }
        let Some(o) = v.as_object_mut() else {
            return Some(event);
        };
        for (k, was) in [("id", &self.id), ("created", &self.created)] {
            if let (Some(was), true) = (was, o.contains_key(k)) {
                o.insert(k.into(), was.clone());
            }
        }
        if let Some(Value::Object(u)) = o.get_mut("usage") {
            let get = |u: &Map<String, Value>, k: &str| u.get(k).and_then(Value::as_u64);
            if let (Some(p), Some(c)) = (get(u, "prompt_tokens"), get(u, "completion_tokens")) {
                let moved = self.moved.min(p);
                u.insert("prompt_tokens".into(), (p - moved).into());
                u.insert("completion_tokens".into(), c.saturating_add(moved).into());
            }
        }
        Some(format!("data: {}\n\n", Value::Object(o.clone())).into_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn event(v: Value) -> Vec<u8> {
        format!("data: {v}\n\n").into_bytes()
    }

    fn parse(ev: &[u8]) -> Value {
        serde_json::from_str(&sse::data(ev).unwrap()).unwrap()
    }

    #[test]
    fn only_a_single_string_completion_is_resumable() {
        let ok = |b: Value| Resume::new(Endpoint::Completions, b.to_string().as_bytes()).is_some();
        assert!(ok(json!({"prompt": "p", "stream": true})));
        assert!(ok(
            json!({"prompt": "p", "n": 1, "echo": false, "logprobs": null})
        ));
        assert!(!ok(json!({"prompt": ["a", "b"]})));
        assert!(!ok(json!({"prompt": [1, 2, 3]})));
        assert!(!ok(json!({"prompt": "p", "n": 2})));
        assert!(!ok(json!({"prompt": "p", "echo": true})));
        assert!(!ok(json!({"prompt": "p", "logprobs": 2})));
        assert!(!ok(json!({"prompt": "p", "best_of": 3})));
        assert!(!ok(json!({"prompt": "p", "suffix": "s"})));
        assert!(!ok(json!({"prompt": "p", "max_tokens": -1})));
        assert!(Resume::new(Endpoint::Completions, b"not json").is_none());
        let chat = |extra: Value| {
            let mut b = json!({"messages": [{"role": "user", "content": "hi"}]});
            for (k, v) in extra.as_object().unwrap() {
                b[k] = v.clone();
            }
            Resume::new(Endpoint::Chat, b.to_string().as_bytes()).is_some()
        };
        assert!(chat(json!({})));
        assert!(chat(json!({"n": 1, "logprobs": false, "tools": null})));
        assert!(!chat(json!({"n": 2})));
        assert!(!chat(json!({"logprobs": true})));
        assert!(!chat(json!({"top_logprobs": 2})));
        assert!(!chat(json!({"tools": [{"type": "function"}]})));
        assert!(!chat(json!({"add_generation_prompt": false})));
        assert!(!chat(json!({"max_completion_tokens": -1})));
    }

    #[test]
    fn the_continuation_carries_the_text_sent_and_the_budget_left() {
        let body = json!({"model": "m", "prompt": "Once", "max_tokens": 5, "stream": true,
                          "temperature": 0});
        let mut r = Resume::new(Endpoint::Completions, body.to_string().as_bytes()).unwrap();
        for t in [" upon", "", " a"] {
            r.sent(&json!({"id": "cmpl-1", "created": 7, "choices": [{"text": t}]}));
        }
        assert_eq!(r.tokens(), 2, "an empty chunk is no token");
        let c: Value = serde_json::from_slice(&r.continuation().unwrap()).unwrap();
        assert_eq!(c["prompt"], "Once upon a");
        assert_eq!(c["max_tokens"], 3);
        assert_eq!(c["temperature"], 0);
        assert_eq!(c["stream_options"]["include_usage"], true);
        // The continuation's events wear the first stream's id; its usage
        // counts the moved text as completion.
        let ev = r
            .rewrite(event(
                json!({"id": "cmpl-2", "created": 9, "choices": [{"text": " time"}]}),
            ))
            .unwrap();
        assert_eq!(parse(&ev)["id"], "cmpl-1");
        assert_eq!(parse(&ev)["created"], 7);
        r.sent(&parse(&ev)); // the continuation's own text is not what moved
        let ev = r
            .rewrite(event(
                json!({"id": "cmpl-2", "choices": [], "usage": {"prompt_tokens": 6, "completion_tokens": 3, "total_tokens": 9}}),
            ))
            .unwrap();
        assert_eq!(parse(&ev)["usage"]["prompt_tokens"], 4);
        assert_eq!(parse(&ev)["usage"]["completion_tokens"], 5);
        assert_eq!(
            r.rewrite(b"data: [DONE]\n\n".to_vec()).unwrap(),
            b"data: [DONE]\n\n"
        );
        // Budget spent: nothing to continue.
        for t in [" b", " c", " d"] {
            r.sent(&json!({"choices": [{"text": t}]}));
        }
        assert!(r.continuation().is_none());
        assert!(r.spent() && !r.finished());
        // Spent: the answer closes here, with a finish reason, the usage
        // and [DONE], as the first stream's.
        let close = r.closing(4);
        assert_eq!(close.len(), 3);
        let fin = parse(&close[0]);
        assert_eq!(fin["choices"][0]["finish_reason"], "length");
        assert_eq!(
            (fin["id"].clone(), fin["model"].clone()),
            (json!("cmpl-1"), json!("m"))
        );
        assert_eq!(sse::classify(&close[1]), sse::Event::Usage(4, 6));
        assert_eq!(close[2], b"data: [DONE]\n\n");
        r.sent(&json!({"choices": [{"text": "", "finish_reason": "length"}]}));
        assert!(r.finished());
        assert_eq!(r.closing(4).len(), 2, "no second finish chunk");
        // No max_tokens: none in the continuation either.
        let body = json!({"prompt": "x", "stream": true});
        let mut r = Resume::new(Endpoint::Completions, body.to_string().as_bytes()).unwrap();
        let c: Value = serde_json::from_slice(&r.continuation().unwrap()).unwrap();
        assert!(c.get("max_tokens").is_none());
    }

    #[test]
    fn a_chat_continues_its_unfinished_assistant_message() {
        let body = json!({"model": "m", "stream": true, "max_completion_tokens": 6,
                          "messages": [{"role": "user", "content": "Tell a tale"}]});
        let mut r = Resume::new(Endpoint::Chat, body.to_string().as_bytes()).unwrap();
        let chunk = |delta: Value| {
            json!({"id": "chatcmpl-1", "created": 7,
                                          "choices": [{"index": 0, "delta": delta}]})
        };
        r.sent(&chunk(json!({"role": "assistant", "content": ""})));
        for t in ["Once", " upon"] {
            r.sent(&chunk(json!({"content": t})));
        }
        assert_eq!(r.tokens(), 2, "the role chunk is no token");
        let c: Value = serde_json::from_slice(&r.continuation().unwrap()).unwrap();
        assert_eq!(
            c["messages"],
            json!([{"role": "user", "content": "Tell a tale"},
                   {"role": "assistant", "content": "Once upon"}])
        );
        assert_eq!(
            (
                c["add_generation_prompt"].clone(),
                c["continue_final_message"].clone()
            ),
            (json!(false), json!(true))
        );
        assert_eq!(c["max_completion_tokens"], 4);
        assert!(c.get("max_tokens").is_none());
        // The continuation's role chunk is not relayed; its text is, as
        // the first stream's.
        let role = event(json!({"id": "chatcmpl-2", "created": 9,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}));
        assert_eq!(r.rewrite(role), None);
        let ev = r
            .rewrite(event(json!({"id": "chatcmpl-2", "created": 9,
                "choices": [{"index": 0, "delta": {"content": " a"}}]})))
            .unwrap();
        assert_eq!(parse(&ev)["id"], "chatcmpl-1");
        assert_eq!(parse(&ev)["choices"][0]["delta"]["content"], " a");
        // Spent: closed with a chat finish chunk.
        for t in [" a", " time", ",", " there"] {
            r.sent(&chunk(json!({"content": t})));
        }
        assert!(r.spent());
        let fin = parse(&r.closing(5)[0]);
        assert_eq!(fin["object"], "chat.completion.chunk");
        assert_eq!(fin["choices"][0]["delta"], json!({}));
        assert_eq!(fin["choices"][0]["finish_reason"], "length");
        // A client that continues its own message: the text is appended.
        let body = json!({"stream": true, "add_generation_prompt": false,
                          "continue_final_message": true,
                          "messages": [{"role": "user", "content": "Tell a tale"},
                                       {"role": "assistant", "content": "Once"}]});
        let mut r = Resume::new(Endpoint::Chat, body.to_string().as_bytes()).unwrap();
        r.sent(&chunk(json!({"content": " upon"})));
        let c: Value = serde_json::from_slice(&r.continuation().unwrap()).unwrap();
        assert_eq!(c["messages"][1]["content"], "Once upon");
        assert_eq!(c["messages"].as_array().unwrap().len(), 2);
    }
}

//! From request bytes to an [`EngineRequest`]: JSON parsed with the failing
//! field named, every value range-checked, unsupported options refused by
//! name (never silently ignored).

use std::sync::atomic::{AtomicU64, Ordering};

use common::engine::{ChatEnd, EngineRequest, PromptInput, SamplingParams};
use common::openai::{ChatRequest, CommonParams, CompletionRequest, PromptSpec};
use serde::de::DeserializeOwned;

use crate::error::ApiError;

/// Which endpoint a request came to (it decides the response's shape).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

/// A checked request and how to answer it.
#[derive(Clone, Debug, PartialEq)]
pub struct Parsed {
    pub endpoint: Endpoint,
    pub engine: EngineRequest,
    pub stream: bool,
    pub include_usage: bool,
}

/// Most alternatives per token (vLLM's limit; OpenAI's is 5 for completions).
pub const MAX_TOP_LOGPROBS: i64 = 20;
/// OpenAI's limit on stop sequences.
pub const MAX_STOP: usize = 4;
/// Longest stop sequence, in bytes: the stop filter holds back any suffix
/// of the output that could begin one, at a cost quadratic in its length
/// per token, so a near-1 MiB stop string would stall every step.
pub const MAX_STOP_BYTES: usize = 256;
/// Most choices per request (`n`): each is a running sequence, so a
/// request may take this many of the batch's slots.
pub const MAX_CHOICES: i64 = 16;

/// The body as a JSON object (syntax errors and non-objects are 400s).
fn parse_object(bytes: &[u8]) -> Result<serde_json::Value, ApiError> {
    let value: serde_json::Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::bad_body(format!("the body is not valid JSON: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::bad_body("the body must be a JSON object"));
    }
    Ok(value)
}

/// Parse a JSON object, naming the field that failed (`max_tokens: invalid type ...`).
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    from_value(parse_object(bytes)?)
}

/// Deserialize from a `Value` (owned, or borrowed to read part of it).
fn from_value<'de, T: serde::Deserialize<'de>>(
    value: impl serde::Deserializer<'de, Error = serde_json::Error>,
) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." || path.is_empty() {
            ApiError::bad_body(format!("invalid request: {inner}"))
        } else {
            ApiError::invalid(&path, format!("{path}: {inner}"))
        }
    })
}

/// The endpoints' structs flatten [`CommonParams`] in, and serde loses the
/// path of a flattened field: read those fields alone first (borrowing the
/// parsed body) so a bad one is named, then the whole request.
fn parse_request<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let value = parse_object(bytes)?;
    from_value::<CommonParams>(&value)?;
    from_value(value)
}

fn next_id(prefix: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}-{:x}{n:06x}", common::openai::unix_now())
}

/// Check the model name: absent, the served name, or 404.
pub fn check_model(requested: Option<&str>, served: &str) -> Result<(), ApiError> {
    match requested {
        None => Ok(()),
        Some(m) if m == served => Ok(()),
        Some(m) => Err(ApiError::model_not_found(m)),
    }
}

fn range<T: PartialOrd + Copy + std::fmt::Display>(
    param: &str,
    v: Option<T>,
    ok: impl Fn(T) -> bool,
    what: &str,
) -> Result<Option<T>, ApiError> {
    match v {
        Some(x) if !ok(x) => Err(ApiError::invalid(
            param,
            format!("{param} must be {what}, got {x}"),
        )),
        other => Ok(other),
    }
}

/// The checked values of the fields both endpoints share.
struct Common {
    sampling: SamplingParams,
    max_tokens: Option<usize>,
    stop: Vec<String>,
    stream: bool,
    include_usage: bool,
    ignore_eos: bool,
    min_tokens: usize,
    n: usize,
    cache_salt: Option<String>,
}

impl Common {
    /// The engine request and how to answer it.
    fn into_parsed(
        self,
        endpoint: Endpoint,
        prompt: PromptInput,
        max_tokens: Option<usize>,
        logprobs: Option<usize>,
    ) -> Parsed {
        let prefix = match endpoint {
            Endpoint::Completions => "cmpl",
            Endpoint::Chat => "chatcmpl",
        };
        let mut engine = EngineRequest::new(next_id(prefix), prompt);
        engine.max_tokens = max_tokens;
        engine.sampling = self.sampling;
        engine.stop = self.stop;
        engine.ignore_eos = self.ignore_eos;
        engine.min_tokens = self.min_tokens;
        engine.n = self.n;
        engine.cache_salt = self.cache_salt;
        engine.logprobs = logprobs;
        Parsed {
            endpoint,
            engine,
            stream: self.stream,
            include_usage: self.include_usage,
        }
    }
}

/// A count of alternatives per token, 0–20.
fn top_count(param: &str, v: Option<i64>) -> Result<Option<usize>, ApiError> {
    let ok = |k: i64| (0..=MAX_TOP_LOGPROBS).contains(&k);
    Ok(range(param, v, ok, "in [0, 20]")?.map(|k| k as usize))
}

/// Check the fields both endpoints share. `max_tokens` is (the field it came
/// from, its value): chat may name it `max_completion_tokens`.
fn common_fields(
    c: &CommonParams,
    served: &str,
    (max_param, max_tokens): (&str, Option<i64>),
) -> Result<Common, ApiError> {
    check_model(c.model.as_deref(), served)?;
    let n = range(
        "n",
        c.n,
        |n| (1..=MAX_CHOICES).contains(&n),
        &format!("in [1, {MAX_CHOICES}]"),
    )?;
    if c.cache_salt.as_ref().is_some_and(String::is_empty) {
        return Err(ApiError::invalid(
            "cache_salt",
            "cache_salt must be a non-empty string if given",
        ));
    }
    range("best_of", c.best_of, |n| n == 1, "1")?;
    range(
        "presence_penalty",
        c.presence_penalty,
        |v| v == 0.0,
        "0 (not supported)",
    )?;
    range(
        "frequency_penalty",
        c.frequency_penalty,
        |v| v == 0.0,
        "0 (not supported; see repetition_penalty)",
    )?;
    if c.logit_bias.as_ref().is_some_and(|m| !m.is_empty()) {
        return Err(ApiError::invalid(
            "logit_bias",
            "logit_bias is not supported",
        ));
    }
    let max_tokens = range(max_param, max_tokens, |m| m >= 1, "at least 1")?;
    let min_tokens = range(
        "min_tokens",
        c.min_tokens,
        |m| m >= 0 && max_tokens.is_none_or(|max| m <= max),
        &format!("between 0 and {max_param}"),
    )?;
    let temperature = range(
        "temperature",
        c.temperature,
        |t| (0.0..=2.0).contains(&t),
        "in [0, 2]",
    )?;
    let top_p = range("top_p", c.top_p, |p| p > 0.0 && p <= 1.0, "in (0, 1]")?;
    let top_k = range(
        "top_k",
        c.top_k,
        |k| k >= -1,
        "-1 (off) or a positive count",
    )?;
    let min_p = range("min_p", c.min_p, |p| (0.0..=1.0).contains(&p), "in [0, 1]")?;
    let rep = range(
        "repetition_penalty",
        c.repetition_penalty,
        |r| r > 0.0 && r.is_finite(),
        "greater than 0",
    )?;
    let stop = c.stop.clone().map(|s| s.into_vec()).unwrap_or_default();
    if stop.len() > MAX_STOP {
        return Err(ApiError::invalid(
            "stop",
            format!("at most {MAX_STOP} stop sequences, got {}", stop.len()),
        ));
    }
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid(
            "stop",
            "stop sequences must not be empty",
        ));
    }
    if let Some(long) = stop.iter().find(|s| s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "stop sequences may be at most {MAX_STOP_BYTES} bytes, got one of {}",
                long.len()
            ),
        ));
    }
    let stream = c.stream.unwrap_or(false);
    if c.stream_options.is_some() && !stream {
        return Err(ApiError::invalid(
            "stream_options",
            "stream_options is only allowed when stream is true",
        ));
    }
    let include_usage = c.stream_options.as_ref().is_some_and(|o| o.include_usage);
    let sampling = SamplingParams {
        temperature: temperature.unwrap_or(1.0),
        top_p: top_p.unwrap_or(1.0),
        top_k: top_k.filter(|&k| k > 0).map(|k| k as usize),
        min_p: min_p.unwrap_or(0.0),
        repetition_penalty: rep.unwrap_or(1.0),
        seed: c.seed.map(|s| s as u64),
    };
    Ok(Common {
        sampling,
        max_tokens: max_tokens.map(|m| m as usize),
        stop,
        stream,
        include_usage,
        ignore_eos: c.ignore_eos.unwrap_or(false),
        min_tokens: min_tokens.unwrap_or(0) as usize,
        n: n.unwrap_or(1) as usize,
        cache_salt: c.cache_salt.clone(),
    })
}

/// `POST /v1/completions`.
pub fn completion(bytes: &[u8], served: &str) -> Result<Parsed, ApiError> {
    let r: CompletionRequest = parse_request(bytes)?;
    let common = common_fields(&r.common, served, ("max_tokens", r.common.max_tokens))?;
    if r.echo == Some(true) {
        return Err(ApiError::invalid("echo", "echo is not supported"));
    }
    if r.suffix.is_some() {
        return Err(ApiError::invalid("suffix", "suffix is not supported"));
    }
    let logprobs = top_count("logprobs", r.logprobs)?;
    let prompt = match r.prompt {
        None => return Err(ApiError::invalid("prompt", "prompt is required")),
        Some(PromptSpec::Text(t)) => PromptInput::Text(t),
        Some(PromptSpec::Texts(mut v)) if v.len() == 1 => PromptInput::Text(v.remove(0)),
        Some(PromptSpec::Texts(v)) => {
            return Err(ApiError::invalid(
                "prompt",
                format!("one prompt per request is supported, got {}", v.len()),
            ))
        }
        Some(PromptSpec::Tokens(ids)) => PromptInput::Tokens(ids),
    };
    // OpenAI's default for completions is 16 tokens.
    let max_tokens = Some(common.max_tokens.unwrap_or(16));
    Ok(common.into_parsed(Endpoint::Completions, prompt, max_tokens, logprobs))
}

/// `POST /v1/chat/completions`.
pub fn chat(bytes: &[u8], served: &str) -> Result<Parsed, ApiError> {
    let r: ChatRequest = parse_request(bytes)?;
    let max = match r.max_completion_tokens {
        Some(m) => ("max_completion_tokens", Some(m)),
        None => ("max_tokens", r.common.max_tokens),
    };
    let common = common_fields(&r.common, served, max)?;
    if r.tools.as_ref().is_some_and(|t| !t.is_null()) {
        return Err(ApiError::invalid("tools", "tool calling is not supported"));
    }
    let top = top_count("top_logprobs", r.top_logprobs)?;
    let logprobs = match (r.logprobs.unwrap_or(false), top) {
        (true, k) => Some(k.unwrap_or(0)),
        (false, None) => None,
        (false, Some(_)) => {
            return Err(ApiError::invalid(
                "top_logprobs",
                "top_logprobs needs logprobs set to true",
            ))
        }
    };
    let Some(messages) = r.messages else {
        return Err(ApiError::invalid("messages", "messages is required"));
    };
    // vLLM's two fields: both set is refused, as there.
    let open = r.add_generation_prompt.unwrap_or(true);
    let chat_end = match (open, r.continue_final_message.unwrap_or(false)) {
        (true, false) => ChatEnd::Open,
        (false, false) => ChatEnd::Closed,
        (false, true) => ChatEnd::ContinueFinal,
        (true, true) => {
            return Err(ApiError::invalid(
                "continue_final_message",
                "continue_final_message needs add_generation_prompt set to false",
            ))
        }
    };
    let max_tokens = common.max_tokens;
    let mut parsed = common.into_parsed(
        Endpoint::Chat,
        PromptInput::Chat(messages),
        max_tokens,
        logprobs,
    );
    parsed.engine.chat_end = chat_end;
    Ok(parsed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(body: &str) -> ApiError {
        chat(body.as_bytes(), "m").unwrap_err()
    }

    #[test]
    fn wrong_types_and_ranges_name_the_field() {
        let e = err(r#"{"messages": [], "max_tokens": "ten"}"#);
        assert_eq!(e.param.as_deref(), Some("max_tokens"), "{e:?}");
        let e = err(r#"{"messages": [{"role": "user", "content": 5}]}"#);
        assert!(e.param.unwrap().starts_with("messages[0]"));
        assert_eq!(
            err(r#"{"messages": [], "temperature": 2.5}"#)
                .param
                .as_deref(),
            Some("temperature")
        );
        assert_eq!(
            err(r#"{"messages": [], "top_p": 0}"#).param.as_deref(),
            Some("top_p")
        );
        assert_eq!(
            err(r#"{"messages": [], "n": 0}"#).param.as_deref(),
            Some("n")
        );
        assert_eq!(
            err(r#"{"messages": [], "n": 17}"#).param.as_deref(),
            Some("n")
        );
        assert_eq!(
            err(r#"{"messages": [], "max_completion_tokens": 0}"#)
                .param
                .as_deref(),
            Some("max_completion_tokens")
        );
        assert_eq!(
            err(r#"{"messages": [], "stream_options": {}}"#)
                .param
                .as_deref(),
            Some("stream_options")
        );
        assert_eq!(
            err(r#"{"messages": [], "top_logprobs": 2}"#)
                .param
                .as_deref(),
            Some("top_logprobs")
        );
        assert_eq!(
            err(r#"{"messages": [], "model": "other"}"#).status.as_u16(),
            404
        );
        assert_eq!(err(r#"{"messages": [}"#).param, None);
        assert_eq!(err("[1]").status.as_u16(), 400);
    }

    #[test]
    fn fields_reach_the_engine_request() {
        let p = completion(
            br#"{"prompt": ["hi"], "max_tokens": 7, "temperature": 0, "top_k": -1,
                 "stop": "x", "seed": 3, "logprobs": 2, "stream": true,
                 "stream_options": {"include_usage": true}, "ignore_eos": true}"#,
            "m",
        )
        .unwrap();
        assert_eq!(p.engine.prompt, PromptInput::Text("hi".into()));
        assert_eq!(p.engine.max_tokens, Some(7));
        assert_eq!(p.engine.sampling.temperature, 0.0);
        assert_eq!(p.engine.sampling.top_k, None);
        assert_eq!(p.engine.sampling.seed, Some(3));
        assert_eq!(p.engine.stop, ["x"]);
        assert_eq!(p.engine.logprobs, Some(2));
        assert!(p.stream && p.include_usage && p.engine.ignore_eos);
    }

    #[test]
    fn a_chat_ends_as_add_generation_prompt_and_continue_final_message_ask() {
        let end = |extra: &str| {
            let body = format!(r#"{{"messages": [{{"role": "user", "content": "hi"}}]{extra}}}"#);
            chat(body.as_bytes(), "m").map(|p| p.engine.chat_end)
        };
        assert_eq!(end("").unwrap(), ChatEnd::Open);
        assert_eq!(
            end(r#", "add_generation_prompt": false"#).unwrap(),
            ChatEnd::Closed
        );
        assert_eq!(
            end(r#", "add_generation_prompt": false, "continue_final_message": true"#).unwrap(),
            ChatEnd::ContinueFinal
        );
        // vLLM refuses both; so does this server (add_generation_prompt
        // defaults to true).
        let e = end(r#", "continue_final_message": true"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("continue_final_message"));
    }
}

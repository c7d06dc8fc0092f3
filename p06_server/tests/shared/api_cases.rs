// The cases of tests/api.rs, shared with the p07 batcher's tests (which
// include them with `include!` against their own `support::test_engine`).

use p05_kv_cache::generate::{generate, GenerateParams};
use p05_kv_cache::sampling::SamplingParams;
use serde_json::{json, Value};
use support::{post, short_completion, smollm2, sse_events, TestServer, MODEL};

const QUESTION: &str = "What is the capital of France?";

/// What p05 generates greedily for the chat prompt the model's own template
/// renders (p04's `PromptBuilder`, checked against transformers'
/// `apply_chat_template` in p04's tokenizer parity test): (prompt ids, text,
/// token count).
fn reference(max_tokens: usize) -> (usize, String, usize) {
    let s = smollm2();
    let ids = p04_transformer::PromptBuilder::new(s.tokenizer.clone())
        .unwrap()
        .encode_chat(&[("user", QUESTION)])
        .unwrap();
    let params = GenerateParams {
        max_tokens,
        sampling: SamplingParams::greedy(),
        stop_ids: vec![],
        stop_strings: vec![],
        ignore_eos: false,
        min_tokens: 0,
        logprobs: None,
    };
    let g = generate(&*s.engine, &s.tokenizer, &ids, &params, |_| {}).unwrap();
    (ids.len(), g.text, g.tokens.len())
}

fn chat_body(extra: Value) -> String {
    let mut b = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 24,
        "temperature": 0,
    });
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b.to_string()
}

#[tokio::test]
async fn chat_non_streaming_equals_the_engine_with_the_models_template() {
    let srv = TestServer::default().await;
    let (prompt_len, text, n) = reference(24);
    let r = post(&srv.url, "/v1/chat/completions", &chat_body(json!({}))).await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], MODEL);
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["message"]["content"], text.as_str());
    let want_finish = if n < 24 { "stop" } else { "length" };
    assert_eq!(v["choices"][0]["finish_reason"], want_finish);
    assert_eq!(v["usage"]["prompt_tokens"], prompt_len);
    assert_eq!(v["usage"]["completion_tokens"], n);
    assert_eq!(v["usage"]["total_tokens"], prompt_len + n);
}

#[tokio::test]
async fn chat_stream_has_role_content_finish_usage_and_done() {
    let srv = TestServer::default().await;
    let (prompt_len, text, n) = reference(24);
    let body = chat_body(json!({"stream": true, "stream_options": {"include_usage": true}}));
    let r = post(&srv.url, "/v1/chat/completions", &body).await;
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let events = sse_events(r).await;
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk"));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content, text);
    let finish: Vec<&Value> = chunks
        .iter()
        .map(|c| &c["choices"][0]["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(
        finish.len(),
        1,
        "exactly one chunk carries the finish reason"
    );
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(chunks.last().unwrap()["choices"], json!([]));
    assert_eq!(usage["prompt_tokens"], prompt_len);
    assert_eq!(usage["completion_tokens"], n);
}

#[tokio::test]
async fn completions_text_and_token_prompts_stop_strings_and_logprobs() {
    let srv = TestServer::default().await;
    let tok = &smollm2().tokenizer;
    let prompt = "The capital of France is";
    let a: Value = post(
        &srv.url,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 3}).to_string(),
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(a["object"], "text_completion");
    let text = a["choices"][0]["text"].as_str().unwrap().to_string();
    let lp = &a["choices"][0]["logprobs"];
    let n = a["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    assert_eq!(lp["tokens"].as_array().unwrap().len(), n);
    assert_eq!(
        lp["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap())
            .collect::<String>(),
        text
    );
    for (i, top) in lp["top_logprobs"].as_array().unwrap().iter().enumerate() {
        let top = top.as_object().unwrap();
        assert_eq!(top.len(), 3);
        // greedy: the chosen token is the most likely one
        let best = top
            .values()
            .map(|v| v.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        assert_eq!(lp["token_logprobs"][i].as_f64().unwrap(), best);
        assert!(best <= 0.0);
    }
    // The same prompt as token ids gives the same text.
    let ids = tok.encode(prompt);
    let b: Value = post(
        &srv.url,
        "/v1/completions",
        &json!({"prompt": ids, "max_tokens": 12, "temperature": 0}).to_string(),
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(b["choices"][0]["text"], text.as_str());
    // A stop string cuts the text before it and ends with "stop".
    let cut = text.trim_start().split(' ').nth(1).expect("two words");
    let c: Value = post(
        &srv.url,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "stop": [cut]}).to_string(),
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(c["choices"][0]["finish_reason"], "stop");
    assert_eq!(c["choices"][0]["text"], text[..text.find(cut).unwrap()]);
}

#[tokio::test]
async fn seeded_sampling_repeats_and_chat_logprobs_have_their_shape() {
    let srv = TestServer::default().await;
    let body = chat_body(
        json!({"temperature": 1.0, "top_p": 0.9, "top_k": 40, "seed": 11,
                                "logprobs": true, "top_logprobs": 2, "max_completion_tokens": 10}),
    );
    let a: Value = post(&srv.url, "/v1/chat/completions", &body)
        .await
        .json()
        .await
        .unwrap();
    let b: Value = post(&srv.url, "/v1/chat/completions", &body)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(a["choices"][0]["message"], b["choices"][0]["message"]);
    let content = a["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(
        content.len(),
        a["usage"]["completion_tokens"].as_u64().unwrap() as usize
    );
    for c in content {
        assert_eq!(c["top_logprobs"].as_array().unwrap().len(), 2);
        assert!(c["logprob"].as_f64().unwrap() <= 0.0);
        let bytes: Vec<u8> = c["bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap() as u8)
            .collect();
        assert_eq!(
            String::from_utf8_lossy(&bytes),
            c["token"].as_str().unwrap()
        );
    }
}

#[tokio::test]
async fn models_health_metrics_and_unknown_routes() {
    let srv = TestServer::default().await;
    let m: Value = reqwest::get(format!("{}/v1/models", srv.url))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(m["data"][0]["id"], MODEL);
    assert_eq!(m["data"][0]["max_model_len"], 8192);
    assert_eq!(
        reqwest::get(format!("{}/health", srv.url))
            .await
            .unwrap()
            .status(),
        200
    );
    let r = short_completion(&srv.url, 3).await;
    assert_eq!(r.status(), 200);
    assert_eq!(srv.metric("vllm:request_success_total{model_name=\"SmolLM2-135M-Instruct\",finished_reason=\"length\"}").await, 1.0);
    assert_eq!(srv.metric("vllm:generation_tokens_total").await, 3.0);
    assert_eq!(
        srv.metric("vllm:time_to_first_token_seconds_count").await,
        1.0
    );
    assert_eq!(
        srv.metric("vllm:inter_token_latency_seconds_count").await,
        2.0
    );
    assert_eq!(
        srv.metric("vllm:e2e_request_latency_seconds_count").await,
        1.0
    );
    assert_eq!(srv.metric("vllm:num_requests_running").await, 0.0);
    // While the model is loading (or the server draining): 503 with Retry-After.
    srv.state
        .ready
        .store(false, std::sync::atomic::Ordering::SeqCst);
    let r = reqwest::get(format!("{}/health", srv.url)).await.unwrap();
    assert_eq!(r.status(), 503);
    let r = short_completion(&srv.url, 2).await;
    assert_eq!(r.status(), 503);
    assert!(r.headers().contains_key("retry-after"));
    srv.state
        .ready
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let r = reqwest::get(format!("{}/v2/nothing", srv.url))
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["type"], "not_found_error");
}

/// (status, error body) for a request.
async fn error_of(srv: &TestServer, path: &str, body: &str) -> (u16, Value) {
    let r = post(&srv.url, path, body).await;
    let status = r.status().as_u16();
    let v: Value = r.json().await.unwrap();
    for key in ["message", "type", "param", "code"] {
        assert!(v["error"].get(key).is_some(), "error body lacks {key}: {v}");
    }
    (status, v["error"].clone())
}

#[tokio::test]
async fn bad_requests_get_openai_error_bodies_naming_the_problem() {
    let srv = TestServer::start(64, 4096, std::time::Duration::from_secs(30)).await;
    let chat = "/v1/chat/completions";
    let (s, e) = error_of(
        &srv,
        chat,
        r#"{"messages": [{"role": "user", "content": "x"}"#,
    )
    .await;
    assert_eq!(s, 400);
    assert!(
        e["message"].as_str().unwrap().contains("not valid JSON"),
        "{e}"
    );
    let (s, e) = error_of(&srv, chat, r#"{"messages": [], "max_tokens": "many"}"#).await;
    assert_eq!((s, e["param"].as_str()), (400, Some("max_tokens")));
    let (s, e) = error_of(&srv, chat, &chat_body(json!({"temperature": -1}))).await;
    assert_eq!((s, e["param"].as_str()), (400, Some("temperature")));
    let (s, e) = error_of(&srv, chat, &chat_body(json!({"n": 17}))).await;
    assert_eq!((s, e["param"].as_str()), (400, Some("n")));
    // A stop string long enough to stall the stop filter (the body limit
    // here is 4,096 bytes, so 300 bytes fit).
    let (s, e) = error_of(&srv, chat, &chat_body(json!({"stop": "y".repeat(300)}))).await;
    assert_eq!((s, e["param"].as_str()), (400, Some("stop")));
    let (s, e) = error_of(&srv, chat, &chat_body(json!({"cache_salt": ""}))).await;
    assert_eq!((s, e["param"].as_str()), (400, Some("cache_salt")));
    let (s, e) = error_of(&srv, chat, &chat_body(json!({"messages": []}))).await;
    assert_eq!((s, e["param"].as_str()), (400, Some("messages")));
    let (s, e) = error_of(&srv, chat, &chat_body(json!({"max_tokens": 9000}))).await;
    assert_eq!(
        (s, e["code"].as_str()),
        (400, Some("context_length_exceeded"))
    );
    let msg = e["message"].as_str().unwrap();
    assert!(
        msg.contains("8192") && msg.contains("9000") && msg.contains(" 37 "),
        "{msg}"
    );
    let (s, e) = error_of(&srv, chat, &chat_body(json!({"model": "gpt-9"}))).await;
    assert_eq!((s, e["code"].as_str()), (404, Some("model_not_found")));
    let (s, e) = error_of(
        &srv,
        "/v1/completions",
        &json!({"prompt": [5, 999999]}).to_string(),
    )
    .await;
    assert_eq!((s, e["param"].as_str()), (400, Some("prompt")));
    let (s, _) = error_of(
        &srv,
        "/v1/completions",
        &json!({"prompt": "x".repeat(5000)}).to_string(),
    )
    .await;
    assert_eq!(s, 413);
    // Nothing was lost: the server still answers.
    let r = short_completion(&srv.url, 2).await;
    assert_eq!(r.status(), 200);
}

#[tokio::test]
async fn min_tokens_holds_off_the_stop_token() {
    let srv = TestServer::default().await;
    let (_, _, n) = reference(24);
    assert!(
        n < 12,
        "the reference answer stops early ({n} tokens), so the test means something"
    );
    let body = chat_body(json!({"max_tokens": 12, "min_tokens": 12}));
    let v: Value = post(&srv.url, "/v1/chat/completions", &body)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 12);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let (s, e) = error_of(
        &srv,
        "/v1/chat/completions",
        &chat_body(json!({"max_tokens": 4, "min_tokens": 5})),
    )
    .await;
    assert_eq!((s, e["param"].as_str()), (400, Some("min_tokens")));
}

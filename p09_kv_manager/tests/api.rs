//! p06's HTTP API tests, unchanged, against the paged server: every
//! endpoint over a real socket must return exactly what the p05 engine
//! generates (prefix caching on: the tests repeat prompts).

mod support;

include!("../../p06_server/tests/shared/api_cases.rs");

/// A sampled chat request of `n` choices with `seed`.
fn sampled_body(n: usize, seed: u64, stream: bool) -> String {
    chat_body(
        json!({"temperature": 1.0, "seed": seed, "n": n, "max_tokens": 12,
                     "stream": stream, "ignore_eos": true}),
    )
}

#[tokio::test]
async fn n_choices_each_equal_their_own_seeded_request() {
    let srv = TestServer::default().await;
    let chat = "/v1/chat/completions";
    let v: Value = post(&srv.url, chat, &sampled_body(3, 5, false))
        .await
        .json()
        .await
        .unwrap();
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3, "{v}");
    let mut completion_tokens = 0;
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        let one: Value = post(&srv.url, chat, &sampled_body(1, 5 + i as u64, false))
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(c["message"], one["choices"][0]["message"], "choice {i}");
        assert_eq!(c["finish_reason"], "length");
        assert_eq!(v["usage"]["prompt_tokens"], one["usage"]["prompt_tokens"]);
        completion_tokens += one["usage"]["completion_tokens"].as_u64().unwrap();
    }
    assert_eq!(v["usage"]["completion_tokens"], completion_tokens);
    assert!(choices[0]["message"] != choices[1]["message"], "{v}");
}

#[tokio::test]
async fn n_choices_stream_interleaved_by_index_and_end_once() {
    let srv = TestServer::default().await;
    let chat = "/v1/chat/completions";
    let whole: Value = post(&srv.url, chat, &sampled_body(2, 9, false))
        .await
        .json()
        .await
        .unwrap();
    let mut body: Value = serde_json::from_str(&sampled_body(2, 9, true)).unwrap();
    body["stream_options"] = json!({"include_usage": true});
    let events = sse_events(post(&srv.url, chat, &body.to_string()).await).await;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    assert_eq!(events.iter().filter(|e| *e == "[DONE]").count(), 1);
    let (mut text, mut roles, mut finishes) = (vec![String::new(); 2], [0; 2], [0; 2]);
    let mut usage = Value::Null;
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        let Some(c) = v["choices"].get(0) else {
            usage = v["usage"].clone();
            continue;
        };
        let i = c["index"].as_u64().unwrap() as usize;
        if c["delta"]["role"] == "assistant" {
            roles[i] += 1;
        }
        text[i] += c["delta"]["content"].as_str().unwrap_or("");
        if c["finish_reason"].is_string() {
            finishes[i] += 1;
        }
    }
    assert_eq!((roles, finishes), ([1, 1], [1, 1]));
    for (i, t) in text.iter().enumerate() {
        assert_eq!(t, &whole["choices"][i]["message"]["content"], "choice {i}");
    }
    assert_eq!(usage, whole["usage"]);
}

#[tokio::test]
async fn a_cache_salt_is_accepted_and_changes_no_output() {
    let srv = TestServer::default().await;
    let chat = "/v1/chat/completions";
    let (_, text, _) = reference(8);
    let mut hits = Vec::new();
    for salt in ["a", "b", "a"] {
        let v: Value = post(
            &srv.url,
            chat,
            &chat_body(json!({"max_tokens": 8, "cache_salt": salt})),
        )
        .await
        .json()
        .await
        .unwrap();
        assert_eq!(v["choices"][0]["message"]["content"], text.as_str());
        hits.push(srv.metric("vllm:prefix_cache_hits").await);
    }
    // Salt "b" finds nothing of salt "a"'s prompt; the second "a" does.
    assert_eq!(hits[0], hits[1], "{hits:?}");
    assert!(hits[2] > hits[1], "{hits:?}");
}

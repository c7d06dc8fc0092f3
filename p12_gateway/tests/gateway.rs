//! The gateway against real backends on 127.0.0.1: keys, limits with exact
//! token accounting, routing and byte-identical streaming. Failures
//! (retries, the breaker, a killed backend, the activator) are in
//! `failover.rs`.

mod support;

use std::sync::Arc;
use std::time::Duration;

use p12_gateway::clock::FakeClock;
use serde_json::{json, Value};
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_and_models_are_checked_before_anything_is_sent() {
    let m = mock(Script::Status(200, r#"{"choices":[]}"#)).await;
    let (url, _) = gateway(
        config(&[&m.url], "round-robin", "", ""),
        Arc::new(FakeClock::default()),
        false,
    )
    .await;
    let body = chat("Hi", 4);
    let (s, e) = error_of(post(&url, "/v1/chat/completions", None, &body).await).await;
    assert_eq!(
        (s, e["error"]["code"].as_str()),
        (401, Some("invalid_api_key")),
        "{e}"
    );
    let (s, _) = error_of(post(&url, "/v1/chat/completions", Some("sk-wrong"), &body).await).await;
    assert_eq!(s, 401);
    // Bob's tenant may not use MODEL; nobody may use an unknown model.
    let (s, e) = error_of(post(&url, "/v1/chat/completions", Some(OTHER_KEY), &body).await).await;
    assert_eq!(
        (s, e["error"]["code"].as_str()),
        (404, Some("model_not_found"))
    );
    let (s, e) = error_of(
        post(
            &url,
            "/v1/completions",
            Some(KEY),
            &json!({"model": "nope", "prompt": "x"}),
        )
        .await,
    )
    .await;
    assert_eq!((s, e["error"]["param"].as_str()), (404, Some("model")));
    let (s, e) = error_of(
        post(
            &url,
            "/v1/completions",
            Some(KEY),
            &json!({"model": MODEL, "prompt": "x", "n": "2"}),
        )
        .await,
    )
    .await;
    assert_eq!((s, e["error"]["param"].as_str()), (400, Some("n")));
    assert_eq!(
        m.hits.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "nothing reached the backend"
    );
    let r = client()
        .get(format!("{url}/v1/models"))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap();
    let models: Value = r.json().await.unwrap();
    assert_eq!(models["data"].as_array().unwrap().len(), 1);
    assert_eq!(models["data"][0]["id"], MODEL);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_and_token_limits_answer_429_with_retry_after() {
    let m = mock(Script::Status(
        200,
        r#"{"choices":[{"text":"x"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#,
    ))
    .await;
    let clock = FakeClock::default();
    let limits = "requests_per_minute = 2\ntokens_per_minute = 1000";
    let (url, _) = gateway(
        config(&[&m.url], "round-robin", limits, ""),
        Arc::new(clock.clone()),
        false,
    )
    .await;
    let body = json!({"model": MODEL, "prompt": "abcd", "max_tokens": 10});
    for _ in 0..2 {
        assert_eq!(
            post(&url, "/v1/completions", Some(KEY), &body)
                .await
                .status(),
            200
        );
    }
    let r = post(&url, "/v1/completions", Some(KEY), &body).await;
    assert_eq!(r.status(), 429);
    // 2 per minute: one more after 30 s.
    assert_eq!(r.headers()["retry-after"], "30");
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["code"], "rate_limit_exceeded");
    assert_eq!(e["error"]["type"], "requests");
    clock.advance(Duration::from_secs(30));
    assert_eq!(
        post(&url, "/v1/completions", Some(KEY), &body)
            .await
            .status(),
        200
    );
    // More than the whole per-minute budget can never pass: a 400, not a 429.
    clock.advance(Duration::from_secs(60));
    let big = json!({"model": MODEL, "prompt": "abcd", "max_tokens": 5000});
    let (s, e) = error_of(post(&url, "/v1/completions", Some(KEY), &big).await).await;
    assert_eq!(
        (s, e["error"]["code"].as_str()),
        (400, Some("tokens_exceed_limit"))
    );
}

/// 20 requests at once on one key with a small tokens-per-minute limit, on a
/// clock that does not move: the tokens admitted never exceed the limit,
/// the prompt counts equal the backend's, and after settlement the bucket
/// holds exactly the limit minus the usage the backends reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_limits_hold_exactly_under_twenty_concurrent_requests() {
    let (a, b) = (OurServer::start(0), OurServer::start(0));
    let clock = FakeClock::default();
    let limit = 300u64;
    let limits = format!("tokens_per_minute = {limit}");
    let (url, g) = gateway(
        config(&[&a.url, &b.url], "round-robin", &limits, ""),
        Arc::new(clock),
        true,
    )
    .await;
    let prompts: Vec<String> = (0..20).map(|i| format!("Count to {i}.")).collect();
    let bodies: Vec<Value> = prompts.iter().map(|p| chat(p, 6)).collect();
    let answers = futures_util::future::join_all(
        bodies
            .iter()
            .map(|b| post(&url, "/v1/chat/completions", Some(KEY), b)),
    )
    .await;
    let (mut used, mut ok, mut limited) = (0u64, 0, 0);
    let counter = g.routes[MODEL].counter.clone();
    for (p, r) in prompts.iter().zip(answers) {
        match r.status().as_u16() {
            200 => {
                let v: Value = r.json().await.unwrap();
                let u = &v["usage"];
                let msgs = vec![common::openai::ChatMessage {
                    role: "user".into(),
                    content: Some(common::openai::Content::Text(p.clone())),
                }];
                let counted = counter
                    .count(&[common::engine::PromptInput::Chat(msgs)])
                    .unwrap();
                assert_eq!(
                    u["prompt_tokens"].as_u64(),
                    Some(counted.tokens),
                    "exact prompt count"
                );
                used += u["total_tokens"].as_u64().unwrap();
                ok += 1;
            }
            429 => {
                assert!(r.headers().contains_key("retry-after"));
                limited += 1;
            }
            s => panic!("unexpected status {s}: {}", r.text().await.unwrap()),
        }
    }
    assert_eq!(ok + limited, 20);
    assert!(
        ok >= 1 && limited >= 1,
        "the limit binds: {ok} admitted, {limited} limited"
    );
    // The bucket never went below zero: every admitted request's usage
    // fit in the one window, and the refunds are exact.
    let left = g.limiter.tokens_left("alice").unwrap();
    assert_eq!(
        left,
        (limit - used) as f64,
        "settled at the reported usage, the rest refunded"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_policies_distribute_as_specified() {
    let ok = r#"{"choices":[{"text":"x"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#;
    let (m0, m1) = (
        mock(Script::Status(200, ok)).await,
        mock(Script::Status(200, ok)).await,
    );
    let clock = Arc::new(FakeClock::default());
    let (url, g) = gateway(
        config(&[&m0.url, &m1.url], "round-robin", "", ""),
        clock.clone(),
        false,
    )
    .await;
    for i in 0..10 {
        let body = json!({"model": MODEL, "prompt": format!("p{i}"), "max_tokens": 1});
        assert_eq!(
            post(&url, "/v1/completions", Some(KEY), &body)
                .await
                .status(),
            200
        );
    }
    assert_eq!((served_by(&g, &m0.url), served_by(&g, &m1.url)), (5, 5));

    // Prefix affinity: one long shared prefix always lands on one backend;
    // many different prefixes use both.
    let (url, g) = gateway(
        config(&[&m0.url, &m1.url], "prefix-affinity", "", ""),
        clock,
        false,
    )
    .await;
    // Counted by bytes here, so the ids are empty: affinity needs token ids.
    let shared: Vec<u32> = (0..80).collect();
    for i in 0..8u32 {
        let mut ids = shared.clone();
        ids.push(1000 + i);
        let body = json!({"model": MODEL, "prompt": ids, "max_tokens": 1});
        assert_eq!(
            post(&url, "/v1/completions", Some(KEY), &body)
                .await
                .status(),
            200
        );
    }
    let (a, b) = (served_by(&g, &m0.url), served_by(&g, &m1.url));
    assert!(
        (a, b) == (8, 0) || (a, b) == (0, 8),
        "one shared prefix went to both: {a} / {b}"
    );
    for i in 0..16u32 {
        let ids: Vec<u32> = (0..80).map(|t| t * 7 + i).collect();
        let body = json!({"model": MODEL, "prompt": ids, "max_tokens": 1});
        assert_eq!(
            post(&url, "/v1/completions", Some(KEY), &body)
                .await
                .status(),
            200
        );
    }
    let (a2, b2) = (served_by(&g, &m0.url) - a, served_by(&g, &m1.url) - b);
    assert!(
        a2 > 0 && b2 > 0,
        "16 prefixes all on one backend: {a2} / {b2}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scored_routing_reads_the_servers_reports_and_filters_a_full_kv_pool() {
    let ok = r#"{"choices":[{"text":"x"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#;
    let (m0, m1) = (
        mock(Script::Status(200, ok)).await,
        mock(Script::Status(200, ok)).await,
    );
    let report = |m: &Mock, waiting: u32, kv: f64| {
        *m.metrics.lock().unwrap() = format!(
            "# TYPE vllm:num_requests_waiting gauge\n\
             vllm:num_requests_waiting{{model_name=\"m\"}} {waiting}\n\
             vllm:num_requests_running{{model_name=\"m\"}} 1\n\
             vllm:kv_cache_usage_perc{{model_name=\"m\"}} {kv}\n"
        );
    };
    let (url, g) = gateway(
        config(&[&m0.url, &m1.url], "scored", "", ""),
        Arc::new(FakeClock::default()),
        false,
    )
    .await;
    let send = |i: u32| {
        let url = url.clone();
        async move {
            // Distinct token ids: no prefix is shared, the reports decide.
            let ids: Vec<u32> = (0..32).map(|t| t * 13 + i * 1000).collect();
            let body = json!({"model": MODEL, "prompt": ids, "max_tokens": 1});
            post(&url, "/v1/completions", Some(KEY), &body)
                .await
                .status()
        }
    };
    // m0 reports a queue of 9: everything goes to m1.
    report(&m0, 9, 0.2);
    report(&m1, 0, 0.2);
    p12_gateway::score::scrape_all(&g).await;
    for i in 0..6 {
        assert_eq!(send(i).await, 200);
    }
    assert_eq!((served_by(&g, &m0.url), served_by(&g, &m1.url)), (0, 6));
    // m1's K/V pool is full: filtered out though its queue is shorter.
    report(&m1, 0, 0.99);
    p12_gateway::score::scrape_all(&g).await;
    for i in 6..10 {
        assert_eq!(send(i).await, 200);
    }
    assert_eq!((served_by(&g, &m0.url), served_by(&g, &m1.url)), (4, 6));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_pass_through_byte_identical_and_the_usage_chunk_only_when_asked() {
    let m = mock(Script::Stream {
        chunks: CHUNKS.to_vec(),
        gap: Duration::from_millis(20),
        then_die: false,
    })
    .await;
    let limits = "tokens_per_minute = 1000";
    let (url, g) = gateway(
        config(&[&m.url], "round-robin", limits, ""),
        Arc::new(FakeClock::default()),
        false,
    )
    .await;
    let asked = json!({"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stream": true,
                       "stream_options": {"include_usage": true}});
    let (bytes, reads) = stream_bytes(&url, &asked).await;
    assert_eq!(bytes, CHUNKS.concat(), "byte-identical");
    assert!(reads >= 3, "event by event, not buffered ({reads} reads)");
    // The client's body went as it was.
    assert_eq!(
        m.bodies.lock().unwrap()[0],
        serde_json::to_vec(&asked).unwrap()
    );
    let plain = json!({"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stream": true});
    let (bytes, _) = stream_bytes(&url, &plain).await;
    let want: Vec<u8> = CHUNKS.concat();
    let usage_event = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":2,\"completion_tokens\":2,\"total_tokens\":4}}\n\n";
    let pos = want
        .windows(usage_event.len())
        .position(|w| w == usage_event)
        .unwrap();
    let mut without = want[..pos].to_vec();
    without.extend_from_slice(&want[pos + usage_event.len()..]);
    assert_eq!(
        bytes, without,
        "the usage the gateway asked for is not shown"
    );
    let sent: Value = serde_json::from_slice(&m.bodies.lock().unwrap()[1]).unwrap();
    assert_eq!(sent["stream_options"]["include_usage"], true);
    // Both settled at the backend's usage: 4 tokens each.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(g.limiter.tokens_left("alice"), Some(1000.0 - 8.0));
}

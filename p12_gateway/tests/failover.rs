//! The gateway when backends fail, against real backends on 127.0.0.1:
//! retries before the first byte, the breaker, streams that fail before
//! and after their first event, a backend killed mid-run, and the
//! activator holding requests while no backend is in rotation.

mod support;

use std::sync::Arc;
use std::time::Duration;

use p12_gateway::clock::{FakeClock, SystemClock};
use serde_json::json;
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_are_retried_on_another_backend_before_the_first_byte() {
    let ok = r#"{"choices":[{"text":"x"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#;
    let bad = mock(Script::Status(503, r#"{"error":{"message":"busy"}}"#)).await;
    let good = mock(Script::Status(200, ok)).await;
    let extra = "[breaker]\nfailures_to_open = 2\ncooldown_ms = 60000\nsuccesses_to_close = 1";
    let cfg = config(&[&bad.url, &good.url], "round-robin", "", extra);
    let (url, g) = gateway(cfg, Arc::new(SystemClock::default()), false).await;
    for i in 0..6 {
        let body = json!({"model": MODEL, "prompt": format!("p{i}"), "max_tokens": 1});
        let r = post(&url, "/v1/completions", Some(KEY), &body).await;
        assert_eq!(r.status(), 200, "request {i}");
    }
    // The failing backend was tried until its breaker opened after 2 failures.
    assert_eq!(bad.hits.load(std::sync::atomic::Ordering::SeqCst), 2);
    assert_eq!(
        metric(
            &g,
            &format!(
                "gateway_breaker_state{{model=\"{MODEL}\",backend=\"{}\"}}",
                bad.url
            )
        ),
        Some(1.0)
    );
    // Every backend ejected: a 503 at once, and the key is charged nothing.
    let cfg = config(&[&good.url], "round-robin", "tokens_per_minute = 1000", "");
    let (url, g) = gateway(cfg, Arc::new(SystemClock::default()), false).await;
    g.routes[MODEL].pool.backends()[0]
        .healthy
        .store(false, std::sync::atomic::Ordering::Relaxed);
    let r = post(
        &url,
        "/v1/completions",
        Some(KEY),
        &json!({"model": MODEL, "prompt": "x", "max_tokens": 9}),
    )
    .await;
    assert_eq!(r.status(), 503);
    assert_eq!(g.limiter.tokens_left("alice"), Some(1000.0));
    // Every backend failing: the last answer is passed on.
    let cfg = config(&[&bad.url], "round-robin", "", "");
    let (url, _) = gateway(cfg, Arc::new(SystemClock::default()), false).await;
    let r = post(
        &url,
        "/v1/completions",
        Some(KEY),
        &json!({"model": MODEL, "prompt": "x"}),
    )
    .await;
    assert_eq!(r.status(), 503);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_first_event_is_an_error_is_retried_elsewhere() {
    let bad = mock(Script::Stream {
        chunks: vec![
            b": keep-alive\n\n",
            b"data: {\"error\":{\"message\":\"out of memory\"}}\n\n",
        ],
        gap: Duration::from_millis(5),
        then_die: false,
    })
    .await;
    let good = mock(Script::Stream {
        chunks: CHUNKS.to_vec(),
        gap: Duration::from_millis(5),
        then_die: false,
    })
    .await;
    let cfg = config(&[&bad.url, &good.url], "round-robin", "", "");
    let (url, _) = gateway(cfg, Arc::new(FakeClock::default()), false).await;
    let asked = json!({"model": MODEL, "prompt": "Hi", "stream": true, "max_tokens": 2,
                       "stream_options": {"include_usage": true}});
    let (bytes, _) = stream_bytes(&url, &asked).await;
    assert_eq!(
        bytes,
        CHUNKS.concat(),
        "nothing of the failed attempt reached the client"
    );
    assert_eq!(bad.hits.load(std::sync::atomic::Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_cut_after_its_first_event_ends_with_an_error_event() {
    let m = mock(Script::Stream {
        chunks: CHUNKS[..1].to_vec(),
        gap: Duration::from_millis(10),
        then_die: true,
    })
    .await;
    let (url, g) = gateway(
        config(&[&m.url], "round-robin", "", ""),
        Arc::new(FakeClock::default()),
        false,
    )
    .await;
    let body = json!({"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stream": true});
    let (bytes, _) = stream_bytes(&url, &body).await;
    let text = String::from_utf8(bytes).unwrap();
    assert!(
        text.starts_with(std::str::from_utf8(CHUNKS[0]).unwrap()),
        "{text}"
    );
    assert!(
        text.contains("backend_stream_failed") && !text.contains("[DONE]"),
        "{text}"
    );
    assert_eq!(
        m.hits.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "a started stream is never replayed"
    );
    assert_eq!(metric(&g, "gateway_stream_errors_total"), Some(1.0));
}

/// Two of our servers; one is killed while requests run. No non-streaming
/// request fails, a chat stream running on it is continued on the other, the
/// health checks eject it, and after it comes back the breaker closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_killed_mid_run_fails_no_request_and_comes_back() {
    let mut a = OurServer::start(0);
    let b = OurServer::start(0);
    let extra = "[health]\ninterval_ms = 100\ntimeout_ms = 500\nfailures_to_eject = 2\n\
                 [breaker]\nfailures_to_open = 1\ncooldown_ms = 300\nsuccesses_to_close = 1";
    let cfg = config(&[&a.url, &b.url], "round-robin", "", extra);
    let (url, g) = gateway(cfg, Arc::new(SystemClock::default()), true).await;
    tokio::spawn(p12_gateway::health::run(g.clone()));
    // Round-robin starts at a: this stream runs there.
    let stream_body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Tell a story."}],
                             "max_tokens": 200, "temperature": 0, "ignore_eos": true, "stream": true});
    let mut stream = post(&url, "/v1/chat/completions", Some(KEY), &stream_body).await;
    assert_eq!(stream.status(), 200);
    let first = stream.chunk().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "));
    let requests = (0..8).map(|i| {
        let url = url.clone();
        async move {
            tokio::time::sleep(Duration::from_millis(40 * i)).await;
            post(
                &url,
                "/v1/chat/completions",
                Some(KEY),
                &chat(&format!("Say {i}."), 4),
            )
            .await
        }
    });
    let run = futures_util::future::join_all(requests);
    // Kill once a request waits on `a` behind the stream (so the kill hits
    // it for certain, whatever the machine's speed).
    let a_url = a.url.clone();
    let g2 = g.clone();
    let kill = async {
        for _ in 0..400 {
            let busy = g2
                .backends()
                .iter()
                .any(|(_, url, _, _, n)| *url == a_url && *n >= 2);
            if busy {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        a.kill();
    };
    let (answers, ()) = tokio::join!(run, kill);
    for (i, r) in answers.into_iter().enumerate() {
        let s = r.status();
        assert_eq!(s, 200, "request {i}: {}", r.text().await.unwrap());
    }
    let retried = g.metrics.retries_total();
    assert!(
        retried >= 1,
        "the kill hit no request: the test would prove nothing"
    );
    let mut rest = Vec::new();
    while let Ok(Some(c)) = stream.chunk().await {
        rest.extend_from_slice(&c);
    }
    let rest = String::from_utf8_lossy(&rest);
    assert!(
        !rest.contains("backend_stream_failed") && rest.ends_with("data: [DONE]\n\n"),
        "the chat stream is continued on the other backend: {rest}"
    );
    let resumed = format!(
        "gateway_stream_resumes_total{{model=\"{MODEL}\",backend=\"{}\"}}",
        b.url
    );
    assert_eq!(metric(&g, &resumed), Some(1.0));
    // Ejected by the health checks.
    let healthy = format!(
        "gateway_backend_healthy{{model=\"{MODEL}\",backend=\"{}\"}}",
        a.url
    );
    for _ in 0..50 {
        if metric(&g, &healthy) == Some(0.0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(metric(&g, &healthy), Some(0.0), "ejected");
    // Back on the same port: checked healthy again, and it serves.
    let a2 = OurServer::start(a.port);
    let before = served_by(&g, &a2.url);
    for _ in 0..60 {
        if metric(&g, &healthy) == Some(1.0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(metric(&g, &healthy), Some(1.0), "back in rotation");
    tokio::time::sleep(Duration::from_millis(350)).await; // past the breaker's cool-down
    for i in 0..4 {
        let r = post(
            &url,
            "/v1/chat/completions",
            Some(KEY),
            &chat(&format!("Again {i}."), 2),
        )
        .await;
        assert_eq!(r.status(), 200);
    }
    assert!(
        served_by(&g, &a2.url) > before,
        "the revived backend serves again"
    );
    let breaker = format!(
        "gateway_breaker_state{{model=\"{MODEL}\",backend=\"{}\"}}",
        a.url
    );
    assert_eq!(metric(&g, &breaker), Some(0.0), "the breaker closed again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_activator_holds_for_a_first_backend_and_counts_only_waiting_requests() {
    let ok = r#"{"choices":[{"text":"x"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#;
    let good = mock(Script::Status(200, ok)).await;
    let extra = "[activator]\nhold_ms = 5000\nretry_after_s = 3";
    let cfg = config(&[], "round-robin", "", extra);
    let (url, g) = gateway(cfg, Arc::new(SystemClock::default()), false).await;
    let held = || {
        g.routes[MODEL]
            .pool
            .held
            .load(std::sync::atomic::Ordering::SeqCst)
    };
    let body = json!({"model": MODEL, "prompt": "p", "max_tokens": 1});
    // A client that gives up while held: the count goes back to zero.
    let quitter = reqwest::Client::new()
        .post(format!("{url}/v1/completions"))
        .bearer_auth(KEY)
        .json(&body)
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    assert!(quitter.is_err(), "held past the client's timeout");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(held(), 0, "a dropped request is no longer counted");
    // A held request is served once a backend appears.
    let (u2, b2) = (url.clone(), body.clone());
    let waiting =
        tokio::spawn(async move { post(&u2, "/v1/completions", Some(KEY), &b2).await.status() });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(held(), 1);
    let breaker = g.cfg.breaker.config();
    g.routes[MODEL]
        .pool
        .set_urls(std::slice::from_ref(&good.url), breaker);
    assert_eq!(waiting.await.unwrap(), 200);
    assert_eq!(held(), 0);
    // None comes within the hold: 503 with Retry-After.
    g.routes[MODEL].pool.set_urls(&[], breaker);
    let cfg = config(
        &[],
        "round-robin",
        "",
        "[activator]\nhold_ms = 300\nretry_after_s = 3",
    );
    let (url, _g) = gateway(cfg, Arc::new(SystemClock::default()), false).await;
    let r = post(&url, "/v1/completions", Some(KEY), &body).await;
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers().get("retry-after").unwrap(), "3");
    let (_, e) = error_of(r).await;
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no healthy backend"),
        "{e}"
    );
}

/// A platform withdraws a dead server and publishes its replacement while
/// requests retry: a retry reads the pool afresh, a backend that refuses
/// the connection is out of rotation at once, and with nothing left in
/// rotation the request is held (as at zero) until the replacement comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_finds_a_backend_published_while_the_request_waits() {
    let ok = r#"{"choices":[{"text":"x"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#;
    let good = mock(Script::Status(200, ok)).await;
    // A port with nothing listening on it: connections are refused.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    // Checks on, but slow: what ejects the dead backend is its refusal.
    let extra = "[activator]\nhold_ms = 5000\nretry_after_s = 3\n[health]\ninterval_ms = 60000";
    let cfg = config(&[&dead], "round-robin", "", extra);
    let (url, g) = gateway(cfg, Arc::new(SystemClock::default()), false).await;
    let body = json!({"model": MODEL, "prompt": "p", "max_tokens": 1});
    let (u2, b2) = (url.clone(), body.clone());
    let waiting =
        tokio::spawn(async move { post(&u2, "/v1/completions", Some(KEY), &b2).await.status() });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let healthy = format!("gateway_backend_healthy{{model=\"{MODEL}\",backend=\"{dead}\"}}");
    assert_eq!(metric(&g, &healthy), Some(0.0), "refused: ejected at once");
    assert_eq!(
        g.routes[MODEL]
            .pool
            .held
            .load(std::sync::atomic::Ordering::SeqCst),
        1,
        "held while nothing is in rotation"
    );
    let breaker = g.cfg.breaker.config();
    g.routes[MODEL]
        .pool
        .set_urls(&[dead.clone(), good.url.clone()], breaker);
    assert_eq!(waiting.await.unwrap(), 200);
    assert_eq!(good.hits.load(std::sync::atomic::Ordering::SeqCst), 1);
    // Without a hold, the answer names what went wrong.
    let cfg = config(&[&dead], "round-robin", "", "");
    let (url, _) = gateway(cfg, Arc::new(SystemClock::default()), false).await;
    let (status, e) = error_of(post(&url, "/v1/completions", Some(KEY), &body).await).await;
    assert_eq!(status, 502);
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(msg.contains("onnection refused"), "{msg}");
}

/// The `data:` payloads of a stream's events, parsed ([DONE] as a string).
fn events(bytes: &[u8]) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(bytes)
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .map(|d| serde_json::from_str(d).unwrap_or(serde_json::Value::String(d.into())))
        .collect()
}

fn text_of(events: &[serde_json::Value]) -> String {
    events
        .iter()
        .filter_map(|v| v.pointer("/choices/0/text")?.as_str())
        .collect()
}

/// A completion stream whose backend dies after its first event goes on
/// on another backend: the continuation asks for the prompt plus the text
/// sent, for the tokens left; the client sees one stream, usage whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_stream_cut_mid_way_is_continued_on_another_backend() {
    let dies = mock(Script::Stream {
        chunks: CHUNKS[..1].to_vec(), // "Hel", then the connection breaks
        gap: Duration::from_millis(10),
        then_die: true,
    })
    .await;
    let rest: Vec<&'static [u8]> = vec![
        b"data: {\"id\":\"other\",\"choices\":[{\"index\":0,\"text\":\"lo\",\"finish_reason\":\"length\"}]}\n\n",
        b"data: {\"id\":\"other\",\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1,\"total_tokens\":4}}\n\n",
        b"data: [DONE]\n\n",
    ];
    let takes_over = mock(Script::Stream {
        chunks: rest,
        gap: Duration::from_millis(5),
        then_die: false,
    })
    .await;
    let cfg = config(&[&dies.url, &takes_over.url], "round-robin", "", "");
    let (url, g) = gateway(cfg, Arc::new(FakeClock::default()), false).await;
    let body = json!({"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stream": true,
                      "stream_options": {"include_usage": true}});
    let (bytes, _) = stream_bytes(&url, &body).await;
    let evs = events(&bytes);
    assert_eq!(
        text_of(&evs),
        "Hello",
        "{}",
        String::from_utf8_lossy(&bytes)
    );
    assert_eq!(evs.last().unwrap(), "[DONE]");
    assert!(
        evs.iter().all(|v| v.get("error").is_none()),
        "no error event"
    );
    let usage = evs.iter().find_map(|v| v.get("usage")).unwrap();
    assert_eq!(
        (
            usage["prompt_tokens"].as_u64(),
            usage["completion_tokens"].as_u64()
        ),
        (Some(2), Some(2)),
        "the continuation's usage, the moved text counted as completion"
    );
    let sent: serde_json::Value =
        serde_json::from_slice(&takes_over.bodies.lock().unwrap()[0]).unwrap();
    assert_eq!(sent["prompt"], "HiHel");
    assert_eq!(sent["max_tokens"], 1);
    let resumed = format!(
        "gateway_stream_resumes_total{{model=\"{MODEL}\",backend=\"{}\"}}",
        takes_over.url
    );
    assert_eq!(metric(&g, &resumed), Some(1.0));
    // Cut after its last token: closed by the gateway (finish reason,
    // usage, [DONE]); nothing more is asked of anyone.
    let spent = json!({"model": MODEL, "prompt": "Hi", "max_tokens": 1, "stream": true,
                       "stream_options": {"include_usage": true}});
    let (bytes, _) = stream_bytes(&url, &spent).await;
    let evs = events(&bytes);
    assert_eq!(text_of(&evs), "Hel");
    assert_eq!(
        evs.last().unwrap(),
        "[DONE]",
        "{}",
        String::from_utf8_lossy(&bytes)
    );
    let fin = evs
        .iter()
        .find_map(|v| v.pointer("/choices/0/finish_reason")?.as_str());
    assert_eq!(fin, Some("length"));
    assert_eq!(
        evs.iter().find_map(|v| v.get("usage")).unwrap()["completion_tokens"],
        1
    );
    assert_eq!(
        takes_over.bodies.lock().unwrap().len(),
        1,
        "no second continuation"
    );
    // A chat stream with logprobs cannot be continued (the continuation's
    // would not be the first's): cut, it ends with an error event.
    let cfg = config(&[&dies.url, &takes_over.url], "round-robin", "", "");
    let (url, _) = gateway(cfg, Arc::new(FakeClock::default()), false).await;
    let mut r = post(
        &url,
        "/v1/chat/completions",
        Some(KEY),
        &json!({"model": MODEL, "logprobs": true,
        "messages": [{"role": "user", "content": "Hi"}], "stream": true}),
    )
    .await;
    let mut got = Vec::new();
    while let Ok(Some(c)) = r.chunk().await {
        got.extend_from_slice(&c);
    }
    assert!(String::from_utf8_lossy(&got).contains("backend_stream_failed"));
}

/// A chat stream's text, from its deltas.
fn chat_text_of(events: &[serde_json::Value]) -> String {
    events
        .iter()
        .filter_map(|v| v.pointer("/choices/0/delta/content")?.as_str())
        .collect()
}

/// Two of our servers; `body` streamed uncut from the second, then through
/// the gateway (round-robin starts at the first), the first killed after
/// `after` events: (the uncut events, the gateway's events). Asserts that
/// the kill cut the stream (one resume on the second) and that the
/// client's stream still ends with `[DONE]`.
async fn killed_after(
    path: &str,
    body: &serde_json::Value,
    after: usize,
) -> [Vec<serde_json::Value>; 2] {
    let mut a = OurServer::start(0);
    let b = OurServer::start(0);
    let mut direct = client()
        .post(format!("{}{path}", b.url))
        .json(body)
        .send()
        .await
        .unwrap();
    let mut want = Vec::new();
    while let Some(c) = direct.chunk().await.unwrap() {
        want.extend_from_slice(&c);
    }
    let cfg = config(&[&a.url, &b.url], "round-robin", "", "");
    let (url, g) = gateway(cfg, Arc::new(SystemClock::default()), true).await;
    let mut r = post(&url, path, Some(KEY), body).await;
    assert_eq!(r.status(), 200);
    let mut got = Vec::new();
    while events(&got).len() < after {
        got.extend_from_slice(&r.chunk().await.unwrap().unwrap());
    }
    a.kill();
    while let Some(c) = r.chunk().await.unwrap() {
        got.extend_from_slice(&c);
    }
    let resumed = format!(
        "gateway_stream_resumes_total{{model=\"{MODEL}\",backend=\"{}\"}}",
        b.url
    );
    assert_eq!(metric(&g, &resumed), Some(1.0), "the kill cut the stream");
    let evs = events(&got);
    assert_eq!(
        evs.last().unwrap(),
        "[DONE]",
        "{}",
        String::from_utf8_lossy(&got)
    );
    [events(&want), evs]
}

/// Our server killed mid-stream: a greedy chat continued on the other
/// server (vLLM's `continue_final_message`) is the very text an uncut run
/// gives, with one role chunk and one id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_greedy_chat_stream_continued_after_a_kill_is_the_uncut_answer() {
    let body = json!({"model": MODEL, "max_tokens": 64, "temperature": 0, "ignore_eos": true,
                      "stream": true, "messages": [
                          {"role": "user", "content": "Name the three primary colours."}]});
    let [want, evs] = killed_after("/v1/chat/completions", &body, 6).await;
    let want = chat_text_of(&want);
    assert!(want.len() > 100, "a long answer: {want:?}");
    assert_eq!(chat_text_of(&evs), want);
    let roles = evs
        .iter()
        .filter(|v| v.pointer("/choices/0/delta/role").is_some())
        .count();
    assert_eq!(roles, 1, "one opening role chunk");
    let ids: std::collections::BTreeSet<&str> =
        evs.iter().filter_map(|v| v.get("id")?.as_str()).collect();
    assert_eq!(ids.len(), 1, "one stream's id: {ids:?}");
}

/// Our server killed mid-stream: a greedy completion continued on the
/// other server is the very text an uncut run gives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_greedy_stream_continued_after_a_kill_is_the_uncut_answer() {
    let body = json!({"model": MODEL, "prompt": "The three primary colours are",
                      "max_tokens": 64, "temperature": 0, "ignore_eos": true, "stream": true});
    let [want, evs] = killed_after("/v1/completions", &body, 5).await;
    let want = text_of(&want);
    assert!(want.len() > 100, "a long answer: {want:?}");
    assert_eq!(text_of(&evs), want);
}

// The cases of tests/lifecycle.rs, shared with the p07 batcher's tests.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::{post, short_completion, sse_events, TestServer};

fn long_stream(max_tokens: usize) -> String {
    json!({"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": true,
           "temperature": 0, "stream": true})
    .to_string()
}

/// Read until the first content chunk has arrived.
async fn first_chunk(resp: &mut reqwest::Response) {
    let mut dec = common::client::SseDecoder::default();
    loop {
        let c = resp.chunk().await.unwrap().expect("stream ended early");
        if dec.push(&c).iter().any(|d| d.contains("\"text\":\"")) {
            return;
        }
    }
}

#[tokio::test]
async fn client_disconnect_stops_generation_and_frees_the_cache() {
    let srv = TestServer::default().await;
    let mut resp = post(&srv.url, "/v1/completions", &long_stream(2000)).await;
    first_chunk(&mut resp).await;
    assert_eq!(srv.metric("vllm:num_requests_running").await, 1.0);
    assert!(srv.metric("inference_lab:kv_cache_bytes").await > 0.0);
    drop(resp); // the client goes away mid-stream
    let left = Instant::now();
    // One decode step is ~30 ms here; allow for a noisy machine.
    srv.wait_metric("vllm:num_requests_running", 0.0, Duration::from_secs(3))
        .await;
    assert_eq!(srv.metric("inference_lab:kv_cache_bytes").await, 0.0);
    let generated = srv.metric("vllm:generation_tokens_total").await;
    assert!(
        generated < 200.0,
        "kept generating after the client left: {generated} tokens"
    );
    let abort = "vllm:request_success_total{model_name=\"SmolLM2-135M-Instruct\",finished_reason=\"abort\"}";
    srv.wait_metric(abort, 1.0, Duration::from_secs(3)).await;
    eprintln!(
        "engine idle {:?} after the disconnect, {generated} tokens generated",
        left.elapsed()
    );
    // The next request starts at once (not after 2,000 tokens of the old one).
    let t0 = Instant::now();
    let r = short_completion(&srv.url, 2).await;
    assert_eq!(r.status(), 200);
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "next request took {:?}",
        t0.elapsed()
    );
}

#[tokio::test]
async fn a_full_queue_answers_429_with_retry_after_and_recovers() {
    let srv = TestServer::start(1, 1 << 20, Duration::from_secs(30)).await;
    let mut running = post(&srv.url, "/v1/completions", &long_stream(2000)).await;
    first_chunk(&mut running).await;
    let url = srv.url.clone();
    let waiting = tokio::spawn(async move { short_completion(&url, 2).await });
    srv.wait_metric("vllm:num_requests_waiting", 1.0, Duration::from_secs(5))
        .await;
    let r = short_completion(&srv.url, 2).await;
    assert_eq!(r.status(), 429);
    let retry: u64 = r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(retry >= 1);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "rate_limit_exceeded");
    drop(running);
    let r = waiting.await.unwrap();
    assert_eq!(
        r.status(),
        200,
        "the queued request is served once the running one is cancelled"
    );
    srv.wait_metric("vllm:num_requests_waiting", 0.0, Duration::from_secs(5))
        .await;
    srv.wait_metric("vllm:num_requests_running", 0.0, Duration::from_secs(5))
        .await;
}

#[tokio::test]
async fn draining_finishes_in_flight_work_and_refuses_new_requests() {
    let mut srv = TestServer::default().await;
    let mut resp = post(&srv.url, "/v1/completions", &long_stream(40)).await;
    first_chunk(&mut resp).await;
    srv.shutdown();
    // New requests on a fresh connection are refused (the listener is closed)
    // or answered 503 while the old one finishes.
    tokio::time::sleep(Duration::from_millis(50)).await;
    match reqwest::Client::new()
        .post(format!("{}/v1/completions", srv.url))
        .body(r#"{"prompt": "Hi", "max_tokens": 2}"#)
        .send()
        .await
    {
        Ok(r) => assert_eq!(r.status(), 503),
        Err(e) => assert!(e.is_connect(), "{e}"),
    }
    let events = sse_events(resp).await;
    assert_eq!(events.last().unwrap(), "[DONE]");
    assert!(events
        .iter()
        .any(|e| e.contains("\"finish_reason\":\"length\"")));
    let done = srv.done.take().unwrap();
    tokio::time::timeout(Duration::from_secs(10), done)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

#[test]
fn sigterm_aborts_what_outlives_the_grace_period_and_exits_zero() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let path =
        common::assets::ensure(common::assets::Asset::SmolLm2).unwrap_or_else(|e| panic!("{e}"));
    let mut child = Command::new(support::SERVER_BIN)
        .args([
            "--model",
            path.to_str().unwrap(),
            "--port",
            "0",
            "--shutdown-grace-s",
            "1",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    let url = first.split_whitespace().nth(2).unwrap().to_string();
    assert!(url.starts_with("http://127.0.0.1:"), "{first}");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let t0 = Instant::now();
        loop {
            // Each probe has its own deadline: a socket that accepts and
            // never answers fails the test, not hangs it.
            let probe = reqwest::get(format!("{url}/health"));
            let ok = tokio::time::timeout(Duration::from_secs(5), probe)
                .await
                .map(|r| r.map(|r| r.status().as_u16()));
            if matches!(ok, Ok(Ok(200))) {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "never became healthy: {ok:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let mut resp = post(&url, "/v1/completions", &long_stream(5000)).await;
        first_chunk(&mut resp).await;
        // SAFETY: kill(2) on our own child's pid.
        assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
        let t1 = Instant::now();
        let events = sse_events(resp).await;
        assert!(t1.elapsed() < Duration::from_secs(10), "{:?}", t1.elapsed());
        assert_eq!(events.last().unwrap(), "[DONE]");
        assert!(
            events
                .iter()
                .any(|e| e.contains("\"finish_reason\":\"abort\"")),
            "{:?}",
            &events[events.len() - 3..]
        );
    });
    let status = child.wait().unwrap();
    assert!(status.success(), "exit status {status:?}");
}

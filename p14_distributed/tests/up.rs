//! `up` as a user runs it, the whole cluster in one command, over HTTP:
//! its only decode worker SIGKILLed mid-stream. The supervisor starts
//! another under the same id; the proxy holds the cut request until it
//! registers, then continues the stream where it stopped: the text the
//! single engine gives, nothing lost or repeated, and later requests
//! served by the replacement.

mod support;

use std::process::Command;
use std::time::{Duration, Instant};

use common::engine::EngineEvent;
use futures_util::StreamExt;
use p14_distributed::cluster::{self, EtcdCluster, Nats};
use p14_distributed::etcd::Etcd;
use p14_distributed::registry::{self, Role, WorkerRecord};
use support::*;

/// The decode workers registered in etcd at `urls`.
async fn decode_workers(urls: &[String]) -> Vec<WorkerRecord> {
    let etcd = Etcd::new(urls.to_vec(), Duration::from_secs(2));
    let (kvs, _) = etcd.get_prefix(registry::PREFIX).await.expect("etcd");
    kvs.iter()
        .filter_map(|kv| serde_json::from_slice::<WorkerRecord>(&kv.value).ok())
        .filter(|w| w.role == Role::Decode)
        .collect()
}

fn text_of(events: &[EngineEvent]) -> String {
    events
        .iter()
        .filter_map(|e| match e {
            EngineEvent::Token(t) => Some(t.text.as_str()),
            _ => None,
        })
        .collect()
}

#[test]
fn up_survives_its_only_decode_worker_dying_mid_stream() {
    let one = colocated("native");
    let want = text_of(&collect(&one, request(0, PROMPTS[3], 64)));
    let etcd = EtcdCluster::start(1, "127.0.0.1")
        .expect("etcd (install it: apt-get install -y etcd-server)");
    let nats = Nats::start("127.0.0.1").expect("NATS (install it: apt-get install -y nats-server)");
    let port = cluster::free_port("127.0.0.1").unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_p14_distributed"));
    cmd.args(["up", "--prefill", "1", "--decode", "1"])
        .args(["--port", &port.to_string()])
        .args(["--etcd", &etcd.urls[0], "--nats", &nats.url])
        .args(["--kv-cache-mib", "48", "--worker-wait-s", "60"])
        .arg("--worker-args=--lease-ttl-s 2");
    let mut up = cluster::spawn("up", cmd, None).unwrap();
    let addr = format!("127.0.0.1:{port}");
    cluster::wait_tcp(&addr, Duration::from_secs(300), &mut up).expect("up listens");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let http = reqwest::Client::new();
    let body = serde_json::json!({
        "model": p06_server::load::served_name("smollm2"),
        "prompt": PROMPTS[3],
        "max_tokens": 64,
        "temperature": 0,
        "ignore_eos": true,
        "stream": true,
    });
    let (got, first_pid, pause) = rt.block_on(async {
        let before = decode_workers(&etcd.urls).await;
        assert_eq!(before.len(), 1, "{before:?}");
        let r = http
            .post(format!("http://{addr}/v1/completions"))
            .json(&body)
            .timeout(Duration::from_secs(180))
            .send()
            .await
            .expect("the stream starts");
        assert!(r.status().is_success(), "{}", r.status());
        let mut sse = r.bytes_stream();
        let (mut buf, mut text, mut chunks) = (Vec::new(), String::new(), 0);
        let (mut killed_at, mut pause) = (None::<Instant>, None);
        'read: while let Some(c) = sse.next().await {
            buf.extend_from_slice(&c.expect("the stream is never cut"));
            while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = buf.drain(..=nl).collect();
                let line = String::from_utf8_lossy(&line);
                let Some(data) = line.trim().strip_prefix("data: ") else {
                    continue;
                };
                if data == "[DONE]" {
                    break 'read;
                }
                let v: serde_json::Value = serde_json::from_str(data).expect("a JSON chunk");
                assert!(v.get("error").is_none(), "the stream errored: {v}");
                text.push_str(v["choices"][0]["text"].as_str().unwrap_or(""));
                chunks += 1;
                if let (Some(t), None) = (killed_at, pause) {
                    pause = Some(t.elapsed());
                }
                if chunks == 8 {
                    // SAFETY: kill(2) on a pid read from etcd: the worker.
                    unsafe { libc::kill(before[0].pid as i32, libc::SIGKILL) };
                    killed_at = Some(Instant::now());
                }
            }
        }
        (text, before[0].pid, pause)
    });
    assert_eq!(got, want, "the single engine's text across the kill");
    let pause = pause.expect("tokens came after the kill");
    eprintln!("pause across the restart: {pause:?}");
    // The replacement: the same id, another process; it serves.
    let after = rt.block_on(decode_workers(&etcd.urls));
    assert_eq!(after.len(), 1, "{after:?}");
    assert_eq!(after[0].id, "decode-0");
    assert_ne!(after[0].pid, first_pid, "a new process");
    let mut again = body.clone();
    again["stream"] = false.into();
    let v: serde_json::Value = rt.block_on(async {
        http.post(format!("http://{addr}/v1/completions"))
            .json(&again)
            .timeout(Duration::from_secs(120))
            .send()
            .await
            .expect("answered")
            .json()
            .await
            .expect("JSON")
    });
    assert_eq!(v["choices"][0]["text"].as_str(), Some(want.as_str()), "{v}");
    up.kill();
}

//! A lost rank is survived: while 8 streams decode on the TP = 3 server
//! and on the PP = 3 one (native weights, ranks as processes), rank 2's
//! process is killed (or stopped: then it is lost when a collective
//! waits past its timeout). Rank
//! 0 notices at once (its link breaks), starts the ranks again (they
//! reload their slices) and recomputes every running sequence, as after a
//! preemption: every stream finishes, with exactly the text it has with
//! no rank lost, and no client sees an error.

mod support;

/// The harness's in-process engine (unused here: this file runs the binary).
const KIND: support::Kind = support::Kind::Tp;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::MODEL;

const PROMPTS: [&str; 8] = [
    "What is the capital of France?",
    "Write a haiku about the sea in winter.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
    "Who wrote Romeo and Juliet?",
    "Translate to French: the cat sleeps on the warm windowsill.",
    "Write a Python function that reverses a string.",
    "Give me a short recipe for pancakes.",
];

/// A greedy streamed chat answer; `deltas` counts content chunks as they come.
async fn stream(url: String, prompt: &str, deltas: Arc<AtomicUsize>) -> Result<String, String> {
    let body = json!({"model": MODEL, "max_tokens": 40, "temperature": 0, "stream": true,
                      "messages": [{"role": "user", "content": prompt}]});
    let mut resp = reqwest::Client::new()
        .post(format!("{url}/v1/chat/completions"))
        .json(&body)
        .timeout(Duration::from_secs(600))
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if !resp.status().is_success() {
        return Err(format!("status {}", resp.status()));
    }
    let mut dec = common::client::SseDecoder::default();
    let mut text = String::new();
    while let Some(chunk) = resp.chunk().await.map_err(|e| e.to_string())? {
        for ev in dec.push(&chunk) {
            if ev == "[DONE]" {
                continue;
            }
            let v: Value = serde_json::from_str(&ev).map_err(|e| e.to_string())?;
            if v.get("error").is_some() {
                return Err(ev);
            }
            if let Some(t) = common::client::chunk_text(&v) {
                text.push_str(t);
                deltas.fetch_add(1, Ordering::SeqCst);
            }
        }
    }
    Ok(text)
}

async fn all_streams(url: &str, deltas: Arc<AtomicUsize>) -> Vec<Result<String, String>> {
    let tasks: Vec<_> = PROMPTS
        .iter()
        .map(|p| tokio::spawn(stream(url.to_string(), p, deltas.clone())))
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

/// The pid of rank `rank`, a child of `parent`.
fn rank_pid(parent: u32, rank: usize) -> Option<i32> {
    let want = format!("rank\0--rank\0{rank}\0");
    for e in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // stat: pid (comm) state ppid ...
        let ppid = stat
            .rsplit(')')
            .next()
            .and_then(|r| r.split_whitespace().nth(1));
        if String::from_utf8_lossy(&cmd).contains(&want) && ppid == Some(&parent.to_string()) {
            return Some(pid);
        }
    }
    None
}

#[test]
fn a_killed_rank_is_restarted_and_every_stream_finishes_as_if_nothing_happened() {
    survive(&["--tp", "3"]);
}

/// A rank that stops answering (SIGSTOP: alive, its sockets open) is
/// lost once a collective waits past `--collective-timeout-s`, and is
/// replaced as a dead one is.
#[test]
fn a_stopped_rank_is_replaced_after_the_collective_timeout() {
    survive(&["--tp", "3", "--stopped"]);
}

#[test]
fn a_killed_pipeline_stage_is_restarted_likewise() {
    survive(&["--pp", "3"]);
}

/// Ranks joined with `--peers` (as on several hosts): rank 0 cannot start
/// the lost one, so the test does (as systemd or a platform would), with
/// the same command; every rank rejoins on the same addresses.
#[test]
fn a_killed_rank_joined_with_peers_rejoins_when_started_again() {
    survive(&["--tp", "3", "--joined"]);
}

/// Ranks 1 and 2 of a `--peers` world, as this test's own processes.
struct Joined {
    args: Vec<String>,
    ranks: Vec<std::process::Child>,
}

impl Joined {
    fn start(&mut self, rank: usize) {
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_p13_multi_gpu"))
            .args(["rank", "--rank", &rank.to_string()])
            .args(&self.args)
            .spawn()
            .unwrap();
        self.ranks[rank] = child;
    }
}

impl Drop for Joined {
    fn drop(&mut self) {
        for c in &mut self.ranks {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The server with `split` (native weights), 8 streams, rank 2 killed.
fn survive(split: &[&str]) {
    let joined = split.contains(&"--joined");
    let stopped = split.contains(&"--stopped");
    let split: Vec<&str> = split
        .iter()
        .copied()
        .filter(|a| !["--joined", "--stopped"].contains(a))
        .collect();
    let mut args = vec!["--weights", "native", "--kv-cache-mib", "256"];
    let timeout = if stopped { "3" } else { "30" };
    args.extend_from_slice(&["--collective-timeout-s", timeout]);
    args.extend_from_slice(&split);
    let mut common_args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let mut others = None;
    if joined {
        // Three free loopback ports, one per rank.
        let ports: Vec<String> = (0..3)
            .map(|_| {
                let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
                l.local_addr().unwrap().to_string()
            })
            .collect();
        let model = common::assets::ensure(common::assets::Asset::SmolLm2).unwrap();
        common_args.extend([
            "--peers".into(),
            ports.join(","),
            "--token".into(),
            "4242".into(),
        ]);
        common_args.extend(["--rejoin-timeout-s".into(), "120".into()]);
        let mut rank_args = common_args.clone();
        rank_args.extend(["--model".into(), model.display().to_string()]);
        let mut j = Joined {
            args: rank_args,
            ranks: Vec::new(),
        };
        for r in 0..3 {
            // Slot 0 is a placeholder (rank 0 is the server).
            j.ranks
                .push(std::process::Command::new("true").spawn().unwrap());
            if r > 0 {
                j.start(r);
            }
        }
        others = Some(j);
    }
    let server_args: Vec<&str> = common_args.iter().map(String::as_str).collect();
    let (mut child, url) = support::spawn_server(&server_args);
    let rt = tokio::runtime::Runtime::new().unwrap();
    // 1. The answers with no rank lost.
    let want = rt.block_on(all_streams(&url, Arc::new(AtomicUsize::new(0))));
    // 2. The same 8 streams; rank 2 is killed once they have begun (and,
    //    joined with --peers, started again at once by this test).
    let old = match &others {
        Some(j) => j.ranks[2].id() as i32,
        None => rank_pid(child.id(), 2).expect("rank 2 runs as a child of rank 0"),
    };
    let deltas = Arc::new(AtomicUsize::new(0));
    let (got, killed_after) = rt.block_on(async {
        let run = tokio::spawn({
            let (url, deltas) = (url.clone(), deltas.clone());
            async move { all_streams(&url, deltas).await }
        });
        let t0 = Instant::now();
        while deltas.load(Ordering::SeqCst) < 16 && t0.elapsed() < Duration::from_secs(120) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let killed_after = deltas.load(Ordering::SeqCst);
        let signal = if stopped {
            libc::SIGSTOP
        } else {
            libc::SIGKILL
        };
        // SAFETY: kill(2) of a process this test (or its server) started.
        unsafe {
            libc::kill(old, signal);
        }
        if let Some(j) = &mut others {
            let _ = j.ranks[2].wait();
            j.start(2);
        }
        (run.await.unwrap(), killed_after)
    });
    // 3. The world is whole again: rank 2 is a new process, and /metrics
    //    counts one restart of a world of 3.
    let new = match &others {
        Some(j) => Some(j.ranks[2].id() as i32),
        None => rank_pid(child.id(), 2),
    };
    let metrics = rt.block_on(async {
        reqwest::get(format!("{url}/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    });
    let metric = |name: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(name) && !l.starts_with('#'))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
    };
    if stopped && !joined {
        // Its server ended the stopped process (a stopped rank left alive
        // would hold its memory and its old connections).
        let state = std::fs::read_to_string(format!("/proc/{old}/stat")).unwrap_or_default();
        let state = state
            .rsplit(')')
            .next()
            .and_then(|r| r.split_whitespace().next());
        assert!(
            matches!(state, None | Some("Z")),
            "the stopped rank {old} is still there (state {state:?})"
        );
    }
    // SAFETY: kill(2) on our own child's pid, and on the stopped rank
    // (gone already if its server replaced it as it should).
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
        if stopped {
            libc::kill(old, libc::SIGKILL);
        }
    }
    let _ = child.wait();
    let total: usize = want.iter().map(|w| w.as_ref().map_or(0, |t| t.len())).sum();
    assert!(
        killed_after >= 16 && killed_after < total,
        "the kill came mid-stream ({killed_after} chunks in)"
    );
    for (i, (w, g)) in want.iter().zip(&got).enumerate() {
        let w = w
            .as_ref()
            .unwrap_or_else(|e| panic!("reference stream {i}: {e}"));
        let g = g
            .as_ref()
            .unwrap_or_else(|e| panic!("stream {i} failed across the lost rank: {e}"));
        assert_eq!(
            g, w,
            "{split:?} stream {i}: the text changed across the lost rank"
        );
    }
    assert!(
        new.is_some_and(|p| p != old),
        "rank 2 was restarted ({old} → {new:?})"
    );
    assert_eq!(
        metric("inference_lab:rank_restarts_total{"),
        Some(1.0),
        "{metrics}"
    );
    assert_eq!(metric("inference_lab:ranks{"), Some(3.0), "{metrics}");
    assert!(metric("inference_lab:collective_seconds_total{").is_some_and(|s| s > 0.0));
    // Every rank's own times, reported to rank 0 (rank 2's new process
    // included): steps took time, and their collectives were part of it.
    for r in 0..3 {
        let series = |name: &str| {
            metrics
                .lines()
                .find(|l| l.starts_with(name) && l.contains(&format!("rank=\"{r}\"}}")))
                .and_then(|l| l.rsplit(' ').next())
                .and_then(|v| v.parse::<f64>().ok())
        };
        let step = series("inference_lab:rank_step_seconds_total{");
        let comm = series("inference_lab:rank_collective_seconds_total{");
        assert!(
            step.is_some_and(|s| s > 0.0) && comm.is_some_and(|c| c > 0.0 && c <= step.unwrap()),
            "rank {r}: step {step:?} s, collectives {comm:?} s\n{metrics}"
        );
    }
}

//! The fault matrix: each fault, and that nothing is lost. A request that
//! could be served is served with the tokens one engine gives; one that
//! cannot (policy `fail`) ends with an error; no K/V is left held on
//! either side.

mod support;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::engine::{Engine, EngineEvent, EngineRequest, EngineStream, SamplingParams};
use p14_distributed::registry::Role;
use p14_distributed::wire::LoadFailurePolicy;
use support::*;

fn is_error(events: &[EngineEvent]) -> bool {
    matches!(events.last(), Some(EngineEvent::Error(_)))
}

#[test]
fn a_corrupted_frame_is_refused_then_recomputed_or_failed_by_policy() {
    let one = colocated("native");
    let req = request(0, PROMPTS[2], 10);
    let want = collect(&one, req.clone());
    for policy in [LoadFailurePolicy::Recompute, LoadFailurePolicy::Fail] {
        let rig = rig(
            "native",
            1,
            &[&["--fault-corrupt-layer", "7"]],
            &[&[]],
            policy,
        );
        let got = rig.run(req.clone());
        match policy {
            LoadFailurePolicy::Recompute => {
                assert_eq!(got, want, "recomputed after a bad checksum");
                let d = rig.stats(&rig.workers[1]);
                assert_eq!(
                    (d["recomputed"].as_u64(), d["imported"].as_u64()),
                    (Some(1), Some(0))
                );
            }
            LoadFailurePolicy::Fail => assert!(is_error(&got), "{got:?}"),
        }
        // The receiver's corrupt ack freed the prefill's copy at once.
        let p = wait_stat(&rig, &rig.workers[0], "transfers_acked", 1);
        assert_eq!(p["transfers_acked"], 1, "{p}");
        nothing_held(&rig);
    }
}

#[test]
fn a_layout_mismatch_is_refused_at_the_handshake() {
    let one = colocated("native");
    let req = request(1, PROMPTS[0], 8);
    let want = collect(&one, req.clone());
    // Blocks of 16 on the prefill side, 32 on the decode side.
    let rig = rig(
        "native",
        1,
        &[&[]],
        &[&["--block-size", "32"]],
        LoadFailurePolicy::Recompute,
    );
    let got = rig.run(req);
    assert_eq!(got, want);
    let p = rig.stats(&rig.workers[0]);
    assert_eq!(p["transfers_refused"], 1, "{p}");
    assert_eq!(p["transfer_bytes_sent"], 0, "no K/V crossed: {p}");
    // The refused transfer is freed by its lease (5 s here).
    std::thread::sleep(Duration::from_millis(5500));
    let p = wait_stat(&rig, &rig.workers[0], "transfers_expired", 1);
    assert_eq!(
        (
            p["transfers_held"].as_u64(),
            p["transfers_expired"].as_u64()
        ),
        (Some(0), Some(1))
    );
    nothing_held(&rig);
}

#[test]
fn a_prefill_worker_killed_mid_transfer_loses_nothing() {
    let one = colocated("native");
    let req = request(2, PROMPTS[3], 10);
    let want = collect(&one, req.clone());
    // Whole prompts, then one streamed while it is prefilled (the worker
    // dies with its forward pass still running).
    for (policy, layerwise) in [
        (LoadFailurePolicy::Recompute, false),
        (LoadFailurePolicy::Fail, false),
        (LoadFailurePolicy::Recompute, true),
    ] {
        // It exits after sending 12 of 30 layers.
        let rig = rig_with(
            "native",
            1,
            &[&["--fault-die-after-layers", "12"]],
            &[&[]],
            policy,
            layerwise,
        );
        let got = rig.run(req.clone());
        match policy {
            LoadFailurePolicy::Recompute => assert_eq!(got, want),
            LoadFailurePolicy::Fail => assert!(is_error(&got), "{got:?}"),
        }
        let mut rig = rig;
        let status = rig.workers[0].proc.child.wait().unwrap();
        assert_eq!(
            status.code(),
            Some(17),
            "the prefill worker died mid-transfer"
        );
        let dead = rig.workers.remove(0);
        nothing_held(&rig);
        // Its lease expires and it leaves routing; requests then go
        // straight to the decode worker, which recomputes.
        rig.wait_view(0, 1, Duration::from_secs(10));
        drop(dead);
        if policy == LoadFailurePolicy::Recompute {
            assert_eq!(rig.run(req.clone()), want);
        }
    }
}

/// The prefill worker dies while it prefills (before any K/V is offered):
/// the proxy finds no other and the decode worker computes the prompt
/// itself, with the single engine's tokens; nothing is left held.
#[test]
fn a_prefill_worker_killed_mid_prefill_is_recomputed_with_the_same_tokens() {
    let one = colocated("native");
    // About 1,400 tokens prefilled 64 at a time: a second or more of
    // prefill to kill it in.
    let long = PROMPTS.join(" ").repeat(20);
    let req = request(7, &long, 8);
    let want = collect(&one, req.clone());
    let chunked: &[&str] = &["--kv-cache-mib", "160", "--max-num-batched-tokens", "64"];
    let none: &[&str] = &["--kv-cache-mib", "160"];
    let mut rig = rig_with(
        "native",
        1,
        &[chunked],
        &[none],
        LoadFailurePolicy::Recompute,
        false,
    );
    let rx = Engine::submit(&*rig.proxy, req).expect("submitted");
    let t0 = Instant::now();
    while rig.stats(&rig.workers[0])["running"].as_u64() != Some(1) {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the prefill never ran"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    rig.workers[0].proc.kill();
    assert_eq!(drain(rx), want, "recomputed on the decode worker");
    assert!(rig.proxy.stats.prefill_retries.load(Ordering::SeqCst) >= 1);
    let dead = rig.workers.remove(0);
    nothing_held(&rig);
    drop(dead);
}

#[test]
fn nats_down_routes_by_load_alone_and_etcd_down_by_the_last_view() {
    let one = colocated("native");
    let none: &[&str] = &[];
    let mut rig = rig(
        "native",
        1,
        &[none, none],
        &[none, none],
        LoadFailurePolicy::Fail,
    );
    let reqs: Vec<_> = PROMPTS
        .iter()
        .enumerate()
        .map(|(i, t)| request(i, t, 6))
        .collect();
    let want: Vec<_> = reqs.iter().map(|r| collect(&one, r.clone())).collect();
    std::thread::sleep(Duration::from_millis(500)); // load reports arrive
    for (r, w) in reqs.iter().zip(&want) {
        assert_eq!(&rig.run(r.clone()), w);
    }
    // (by load report, by cached prefix, by in-flight count): a prefix
    // learned from NATS stays known after NATS dies; load reports do not.
    let by = |rig: &Rig| {
        let s = &rig.proxy.stats;
        let n = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::SeqCst);
        (n(&s.by_report), n(&s.by_prefix), n(&s.by_inflight))
    };
    let (reported, prefix, inflight) = by(&rig);
    assert!(
        reported + prefix >= 1,
        "with NATS: routed on its reports ({reported}, {prefix}, {inflight})"
    );
    // NATS down: the reports go stale within a second (the last ones may
    // still be in flight when it dies).
    drop(rig.nats.take());
    let t0 = std::time::Instant::now();
    while rig.proxy.board.fresh_reports() > 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "reports still fresh 5 s after NATS died"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    for (r, w) in reqs.iter().zip(&want) {
        assert_eq!(&rig.run(r.clone()), w);
    }
    let (r2, p2, i2) = by(&rig);
    assert_eq!(r2 - reported, 0, "without NATS: no stale load report used");
    assert_eq!(
        (p2 - prefix) + (i2 - inflight),
        8,
        "without NATS: by the known prefixes and in-flight counts"
    );
    // etcd down too: the proxy keeps its last view, the workers serve.
    for m in &mut rig.etcd.members {
        m.kill();
    }
    std::thread::sleep(Duration::from_secs(3)); // past the workers' lease TTL
    rig.wait_view(2, 2, Duration::from_secs(1));
    for (r, w) in reqs.iter().zip(&want) {
        assert_eq!(&rig.run(r.clone()), w);
    }
    nothing_held(&rig);
}

#[test]
fn a_stopped_worker_leaves_routing_and_comes_back_when_resumed() {
    let one = colocated("native");
    let none: &[&str] = &[];
    let rig = rig("native", 1, &[none], &[none, none], LoadFailurePolicy::Fail);
    let req = request(3, PROMPTS[1], 6);
    let want = collect(&one, req.clone());
    let stopped = &rig.workers[2];
    stopped.proc.signal(libc::SIGSTOP);
    // Its lease (2 s) expires: etcd deletes its record, the watch says so.
    rig.wait_view(1, 1, Duration::from_secs(6));
    for _ in 0..3 {
        assert_eq!(
            rig.run(req.clone()),
            want,
            "served by the other decode worker"
        );
    }
    stopped.proc.signal(libc::SIGCONT);
    // It finds its lease gone and registers again.
    rig.wait_view(1, 2, Duration::from_secs(6));
    assert_eq!(rig.run(req), want);
    nothing_held(&rig);
}

#[test]
fn a_decode_worker_stopped_by_sigterm_leaves_the_registry_and_finishes_its_stream() {
    let one = colocated("native");
    let none: &[&str] = &[];
    let mut rig = rig("native", 1, &[none], &[none], LoadFailurePolicy::Fail);
    let req = request(5, PROMPTS[3], 160);
    let want = collect(&one, req.clone());
    let rx = common::engine::Engine::submit(&*rig.proxy, req).expect("submitted");
    let decode = &rig.workers[1];
    wait_stat(&rig, decode, "running", 1);
    decode.proc.signal(libc::SIGTERM);
    // Out of the registry at once (not after its lease), its stream whole.
    rig.wait_view(1, 0, Duration::from_secs(2));
    assert_eq!(
        drain(rx),
        want,
        "the stream finished on the draining worker"
    );
    let t0 = std::time::Instant::now();
    let code = loop {
        if let Some(code) = rig.workers[1].proc.child.try_wait().expect("try_wait") {
            break code;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the drained worker did not exit"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(code.success(), "a drained worker exits cleanly: {code}");
}

/// Request `i` of a mixed load: greedy, or seeded sampling with a
/// repetition penalty (the sampler's position and the penalty's history
/// must travel with a migrated request).
fn mixed(i: usize, max_tokens: usize) -> EngineRequest {
    let mut r = request(100 + i, PROMPTS[i % PROMPTS.len()], max_tokens);
    if i % 2 == 1 {
        r.sampling = SamplingParams {
            temperature: 0.8,
            top_p: 0.95,
            repetition_penalty: 1.1,
            seed: Some(i as u64),
            ..SamplingParams::greedy()
        };
    }
    r
}

/// Read each stream into `got` until it holds `n` events or has ended.
fn read_until(rxs: &mut [EngineStream], got: &mut [Vec<EngineEvent>], n: usize) {
    let t0 = Instant::now();
    loop {
        let mut short = false;
        for (rx, g) in rxs.iter_mut().zip(got.iter_mut()) {
            while let Ok(ev) = rx.try_recv() {
                g.push(ev);
            }
            let ended = g
                .last()
                .is_some_and(|e| !matches!(e, EngineEvent::Token(_)));
            short |= !ended && g.len() < n;
        }
        if !short {
            return;
        }
        assert!(t0.elapsed() < Duration::from_secs(120), "{got:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Each stream's events after `got`, to its end.
fn finish(rxs: Vec<EngineStream>, mut got: Vec<Vec<EngineEvent>>) -> Vec<Vec<EngineEvent>> {
    for (rx, g) in rxs.into_iter().zip(got.iter_mut()) {
        if g.last()
            .is_some_and(|e| !matches!(e, EngineEvent::Token(_)))
        {
            continue;
        }
        g.extend(drain(rx));
    }
    got
}

/// `reqs` through the single engine (the reference), then submitted to
/// the proxy and streamed until each has 4 events: (reference, streams,
/// events so far).
fn under_way(
    rig: &Rig,
    one: &p08_continuous::ContinuousEngine,
    reqs: impl Iterator<Item = EngineRequest>,
) -> (
    Vec<Vec<EngineEvent>>,
    Vec<EngineStream>,
    Vec<Vec<EngineEvent>>,
) {
    let reqs: Vec<_> = reqs.collect();
    let want = reqs.iter().map(|r| collect(one, r.clone())).collect();
    let mut rxs: Vec<_> = reqs
        .iter()
        .map(|r| Engine::submit(&*rig.proxy, r.clone()).expect("submitted"))
        .collect();
    let mut got = vec![Vec::new(); rxs.len()];
    read_until(&mut rxs, &mut got, 4);
    (want, rxs, got)
}

fn migrated(rig: &Rig) -> u64 {
    rig.proxy.stats.migrated.load(Ordering::SeqCst)
}

/// The decode worker (index in `rig.workers`) running the most sequences.
fn busiest_decode(rig: &Rig) -> (usize, u64) {
    (0..rig.workers.len())
        .filter(|&i| rig.workers[i].role == Role::Decode)
        .map(|i| {
            (
                i,
                rig.stats(&rig.workers[i])["running"].as_u64().unwrap_or(0),
            )
        })
        .max_by_key(|&(_, n)| n)
        .expect("a decode worker")
}

#[test]
fn a_decode_worker_killed_mid_stream_loses_no_request() {
    let one = colocated("native");
    let none: &[&str] = &[];
    // Policy `fail`: a migrated request's K/V must really cross from a
    // prefill worker (no silent recompute on the decode side).
    let mut rig = rig(
        "native",
        1,
        &[none, none],
        &[none, none],
        LoadFailurePolicy::Fail,
    );
    let (want, rxs, got) = under_way(&rig, &one, (0..8).map(|i| mixed(i, 40)));
    let (victim, running) = busiest_decode(&rig);
    assert!(running >= 1, "the victim holds streams");
    rig.workers[victim].proc.kill();
    let got = finish(rxs, got);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(
            g, w,
            "request {i}: the single engine's events, none lost or repeated"
        );
    }
    assert!(
        migrated(&rig) >= 1 && migrated(&rig) <= running,
        "{} migrated; the victim ran {running}",
        migrated(&rig)
    );
    drop(rig.workers.remove(victim));
    nothing_held(&rig);
}

#[test]
fn a_decode_worker_stopped_inside_its_lease_is_left_and_its_stream_moves_on() {
    let one = colocated("native");
    let none: &[&str] = &[];
    let rig = rig("native", 1, &[none], &[none, none], LoadFailurePolicy::Fail);
    let (want, rxs, got) = under_way(&rig, &one, (0..2).map(|i| mixed(i, 48)));
    let (victim, running) = busiest_decode(&rig);
    assert!(running >= 1);
    // Stopped: its socket stays open, no reset comes. Its lease (2 s)
    // runs out, then its silence is taken as death.
    let t0 = Instant::now();
    rig.workers[victim].proc.signal(libc::SIGSTOP);
    let got = finish(rxs, got);
    let took = t0.elapsed();
    assert_eq!(got, want, "the stopped worker's streams moved on, exact");
    assert!(migrated(&rig) >= 1);
    assert!(
        took < Duration::from_secs(12),
        "moved on within the lease and the silence allowed ({took:?})"
    );
    // Resumed, it finds its streams gone (the proxy dropped them), frees
    // them, and registers again.
    rig.workers[victim].proc.signal(libc::SIGCONT);
    rig.wait_view(1, 2, Duration::from_secs(6));
    nothing_held(&rig);
}

#[test]
fn a_dead_decode_worker_still_in_the_view_is_passed_over_before_its_stream() {
    let one = colocated("native");
    let none: &[&str] = &[];
    let mut rig = rig("native", 1, &[none], &[none, none], LoadFailurePolicy::Fail);
    // Once its load reports are stale, decode routing goes by in-flight
    // counts, ties to the last id: decode-1 is picked first. Dead inside
    // its etcd lease (2 s), it refuses the connection; the proxy marks it
    // and takes the other, and the request succeeds.
    let dead = rig.workers.len() - 1; // decode-1
    assert_eq!(rig.workers[dead].role, Role::Decode);
    rig.workers[dead].proc.kill();
    let t0 = Instant::now();
    while rig.proxy.board.fresh_reports() > 2 {
        assert!(
            t0.elapsed() < Duration::from_secs(3),
            "the dead worker's reports stay fresh"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    rig.wait_view(1, 2, Duration::from_secs(1));
    let req = request(5, PROMPTS[0], 8);
    let want = collect(&one, req.clone());
    for _ in 0..3 {
        assert_eq!(rig.run(req.clone()), want);
    }
    let retries = rig.proxy.stats.decode_retries.load(Ordering::SeqCst);
    assert!(retries >= 1, "the dead worker was tried and passed over");
    drop(rig.workers.remove(dead));
    rig.wait_view(1, 1, Duration::from_secs(6));
    nothing_held(&rig);
}

/// (member id, leader id) of an etcd member, from its status.
fn etcd_status(rig: &Rig, url: &str) -> Option<(String, String)> {
    let http = rig.http.clone();
    let url = format!("{url}/v3/maintenance/status");
    rig.rt.block_on(async move {
        let v: serde_json::Value = http
            .post(url)
            .body("{}")
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        Some((
            v["header"]["member_id"].as_str()?.to_string(),
            v["leader"].as_str()?.to_string(),
        ))
    })
}

#[test]
fn a_three_member_etcd_loses_a_follower_then_its_leader_and_service_continues() {
    let one = colocated("native");
    let none: &[&str] = &[];
    let mut rig = rig("native", 3, &[none], &[none], LoadFailurePolicy::Fail);
    let req = request(6, PROMPTS[1], 8);
    let want = collect(&one, req.clone());
    assert_eq!(rig.run(req.clone()), want);
    let status: Vec<_> = rig
        .etcd
        .urls
        .iter()
        .map(|u| etcd_status(&rig, u).unwrap())
        .collect();
    let leader = status.iter().position(|(me, l)| me == l).expect("a leader");
    let follower = (leader + 1) % 3;
    // A follower down: two of three keep quorum; a new worker registers.
    rig.etcd.members[follower].kill();
    assert_eq!(rig.run(req.clone()), want);
    let urls: Vec<String> = (0..3)
        .filter(|&i| i != follower)
        .map(|i| rig.etcd.urls[i].clone())
        .collect();
    let args = worker_args("native", &urls.join(","), None, "decode-late", &[]);
    rig.workers.push(start_worker(Role::Decode, &args));
    rig.wait_view(1, 2, Duration::from_secs(10));
    // The leader down too: no quorum; the proxy serves from its last view.
    rig.etcd.members[leader].kill();
    for _ in 0..3 {
        assert_eq!(rig.run(req.clone()), want);
    }
    rig.wait_view(1, 2, Duration::from_secs(1));
    nothing_held(&rig);
}

/// Every worker of `rig` holds nothing (no sequence running, waiting or
/// reserved, no K/V block, no transfer) within `within`, or the test fails
/// naming what is still held.
fn freed_within(rig: &Rig, within: Duration) {
    let t0 = Instant::now();
    loop {
        let held: Vec<String> = rig
            .workers
            .iter()
            .flat_map(|w| {
                let s = rig.stats(w);
                [
                    "running",
                    "waiting",
                    "reserved",
                    "kv_used_blocks",
                    "transfers_held",
                ]
                .into_iter()
                .filter(|k| s[*k].as_u64().unwrap_or(0) > 0)
                .map(|k| format!("{} {k}: {}", w.role.as_str(), s[k]))
                .collect::<Vec<_>>()
            })
            .collect();
        if held.is_empty() {
            return;
        }
        assert!(
            t0.elapsed() < within,
            "{:?} after the client left: {held:?}",
            t0.elapsed()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_client_gone_mid_prefill_mid_transfer_or_mid_decode_frees_everything_within_1_s() {
    // About 1,400 tokens, prefilled 64 at a time: a prefill of a second or
    // more, dropped at the next chunk.
    let long = PROMPTS.join(" ").repeat(20);
    let worker: &[&str] = &["--kv-cache-mib", "160", "--max-num-batched-tokens", "64"];
    for layerwise in [false, true] {
        let rig = rig_with(
            "native",
            1,
            &[worker],
            &[worker],
            LoadFailurePolicy::Recompute,
            layerwise,
        );
        let prefill = &rig.workers[0];
        // Mid-prefill: gone while the prefill worker runs the prompt (and,
        // layer by layer, while the decode worker pulls what it wrote).
        let rx = Engine::submit(&*rig.proxy, request(300, &long, 64)).expect("submitted");
        let t0 = Instant::now();
        while rig.stats(prefill)["running"].as_u64() != Some(1) {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "the prefill never ran"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        drop(rx);
        freed_within(&rig, Duration::from_secs(1));
        let p = rig.stats(prefill);
        assert_eq!(
            p["prefilled"], 0,
            "the prefill was dropped, not run out: {p}"
        );
        // Mid-decode: gone after its first tokens.
        let mut rxs = vec![Engine::submit(&*rig.proxy, request(301, &long, 400)).unwrap()];
        let mut got = vec![Vec::new()];
        read_until(&mut rxs, &mut got, 3);
        assert!(
            matches!(got[0].last(), Some(EngineEvent::Token(_))),
            "{got:?}"
        );
        drop(rxs);
        freed_within(&rig, Duration::from_secs(1));
        // And the workers serve the next request as before.
        let one = colocated("native");
        let req = request(302, PROMPTS[1], 12);
        assert_eq!(rig.run(req.clone()), collect(&one, req));
    }
}

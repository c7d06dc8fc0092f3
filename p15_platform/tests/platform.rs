//! The platform's processes together on loopback: a real etcd, node
//! agents, controllers and the router as child processes, the model
//! servers (SmolLM2) the agents start. What each test asks of it:
//! fencing refuses a stale leader's writes; a paused leader's standby
//! takes over and nothing is started twice; a killed server and a dead
//! node's servers are replaced while requests keep succeeding and no
//! stream is cut; a
//! deployment at zero holds its first request, serves it, and scales back
//! to zero; a rolling update under load fails no request.

mod support;

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use p14_distributed::etcd::{Compare, Op};
use p15_platform::election::{fenced, fenced_if, Candidate};
use p15_platform::local::signal_pid;
use p15_platform::state::generation;
use support::{
    answers, complete, deployment, finish, load, nothing_held, ready, router_sees, Platform,
};

const MIN: Duration = Duration::from_secs(60);

#[test]
fn a_stale_leader_is_fenced_out_by_etcd() {
    let p = Platform::start();
    p.rt.block_on(async {
        let etcd = p.etcd_client();
        let mut c1 = Candidate::new(etcd.clone(), "c1", 2);
        let mut c2 = Candidate::new(etcd.clone(), "c2", 2);
        let f1 = c1.step().await.unwrap().expect("the first candidate leads");
        assert_eq!(c2.step().await.unwrap(), None, "one leader at a time");
        // c1 "pauses": no renewal past its TTL. c2 takes over.
        let t0 = Instant::now();
        let f2 = loop {
            if let Some(f) = c2.step().await.unwrap() {
                break f;
            }
            assert!(t0.elapsed() < Duration::from_secs(10), "no takeover");
            tokio::time::sleep(c2.tick()).await;
        };
        assert!(f2.revision > f1.revision);
        // c1 wakes believing it leads: etcd refuses its write.
        let put = |k: &str| Op::Put {
            key: k.into(),
            value: b"x".to_vec(),
            lease: None,
        };
        assert!(!fenced(&etcd, f1, &[put("/inference-lab/p15/test/a")])
            .await
            .unwrap());
        assert_eq!(etcd.get("/inference-lab/p15/test/a").await.unwrap(), None);
        assert!(fenced(&etcd, f2, &[put("/inference-lab/p15/test/a")])
            .await
            .unwrap());
        // A start is a create: the second of the same key does nothing.
        let absent = Compare::CreateRevision("/inference-lab/p15/test/b".into(), 0);
        let once = [put("/inference-lab/p15/test/b")];
        assert!(fenced_if(&etcd, f2, std::slice::from_ref(&absent), &once)
            .await
            .unwrap());
        assert!(!fenced_if(&etcd, f2, &[absent], &once).await.unwrap());
        assert_eq!(c1.step().await.unwrap(), None, "the old leader has lost");
    });
}

#[test]
fn a_paused_leader_is_replaced_within_its_ttl_and_nothing_starts_twice() {
    let mut p = Platform::start();
    p.agent("n1", 2);
    p.controller("c1");
    p.controller("c2");
    p.apply(&deployment("pause", ""));
    let s = p.wait_for("one ready server", MIN, |s| ready(s, "pause").len() == 1);
    let (leader, _) = s.leader.clone().expect("a leader");
    p.signal(&leader, libc::SIGSTOP);
    let paused = Instant::now();
    // The server dies while the leader is paused: only a new leader can replace it.
    let pid = s
        .servers
        .values()
        .find_map(|st| st.pid)
        .expect("the server's pid");
    signal_pid(pid, libc::SIGKILL);
    p.wait_for("a new leader", Duration::from_secs(10), |s| {
        s.leader.as_ref().is_some_and(|(id, _)| *id != leader)
    });
    let took = paused.elapsed();
    assert!(
        took < Duration::from_secs(5),
        "takeover took {took:?} with a 2 s TTL"
    );
    // A new server (the killed one may still show ready until its agent
    // reports it: waiting for any ready one would race that report).
    let killed = ready(&s, "pause");
    p.wait_for("a new server ready in the killed one's place", MIN, |s| {
        let now = ready(s, "pause");
        now.len() == 1 && now != killed && s.assignments.len() == 1
    });
    p.signal(&leader, libc::SIGCONT);
    // The old leader wakes: for 3 s, never more than one server.
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(3) {
        let s = p.snapshot();
        assert!(
            s.assignments.len() <= 1,
            "a second server:\n{}",
            p15_platform::state::servers_table(&s)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn killed_servers_and_a_dead_node_are_replaced_while_requests_succeed() {
    let mut p = Platform::start();
    p.agent("n1", 2);
    p.agent("n2", 2);
    p.controller("c1");
    let url = p.router(&["heal"], 30_000);
    p.apply(&deployment("heal", "replicas: {min: 2, max: 2}"));
    let s = p.wait_for("two ready servers", MIN, |s| ready(s, "heal").len() == 2);
    let nodes: std::collections::BTreeSet<&str> =
        s.assignments.iter().map(|a| a.node.as_str()).collect();
    assert_eq!(nodes.len(), 2, "placed by free capacity: one per node");
    let want = answers(&p, &["native"]);
    let p = Arc::new(p);
    let stop = Arc::new(AtomicBool::new(false));
    // Two clients waiting for whole answers, two streaming: a stream cut
    // by a kill is continued on another server, with the single server's
    // text.
    let loads: Vec<_> = [false, false, true, true]
        .into_iter()
        .map(|stream| load(&p, url.clone(), "heal", stop.clone(), stream, &want))
        .collect();
    std::thread::sleep(Duration::from_secs(1));
    // 1. A server dies.
    let victim = s
        .servers
        .values()
        .find(|st| st.node == "n1")
        .unwrap()
        .clone();
    eprintln!("killing {} at {:?}", victim.id, Instant::now());
    signal_pid(victim.pid.unwrap(), libc::SIGKILL);
    let s = p.wait_for("the killed server replaced", MIN, |s| {
        let r = ready(s, "heal");
        r.len() == 2 && !r.contains(&victim.id)
    });
    router_sees(&p, &url, "heal", &s);
    // 2. A node agent dies (its servers with it); its lease runs out.
    let on_n2: Vec<String> = s
        .assignments
        .iter()
        .filter(|a| a.node == "n2")
        .map(|a| a.id.clone())
        .collect();
    assert!(!on_n2.is_empty());
    let killed = Instant::now();
    eprintln!("killing n2 at {killed:?}, its {on_n2:?}");
    p.signal("n2", libc::SIGKILL);
    let s = p.wait_for("n2's servers moved to n1", MIN, |s| {
        let r = ready(s, "heal");
        r.len() == 2 && s.assignments.iter().all(|a| a.node == "n1")
    });
    eprintln!("a dead node's servers healed in {:?}", killed.elapsed());
    assert!(s.nodes.iter().all(|n| n.id != "n2"), "n2's lease expired");
    std::thread::sleep(Duration::from_secs(1));
    finish(loads, &stop);
    nothing_held(&p, "heal", Duration::from_secs(5));
    let page = p.rt.block_on(async {
        let r = reqwest::get(format!("{url}/metrics")).await.ok()?;
        r.text().await.ok()
    });
    let resumed =
        p12_gateway::score::metric_sum(&page.unwrap_or_default(), "gateway_stream_resumes_total");
    eprintln!("streams continued on another server after a kill: {resumed}");
}

#[test]
fn a_deployment_at_zero_holds_its_first_request_serves_it_and_scales_back_to_zero() {
    let mut p = Platform::start();
    p.agent("n1", 1);
    let url = p.router(&["zero"], 3_000);
    p.apply(&deployment("zero", "replicas: {min: 0, max: 1}\nautoscaling: {metric: concurrency, target: 1, stable_window: 6s, panic_window: 2s, scale_to_zero_grace: 0s}"));
    // No controller yet: nothing will come; held for the hold, then 503 + Retry-After.
    let t0 = Instant::now();
    let (code, body, retry) = complete(&p.rt, &url, "zero", 4);
    assert_eq!(code, 503, "{body}");
    assert!(
        t0.elapsed() >= Duration::from_millis(2_900),
        "held only {:?}",
        t0.elapsed()
    );
    assert_eq!(retry.as_deref(), Some("2"));
    assert!(
        body.contains("\"error\""),
        "an OpenAI-style error body: {body}"
    );
    drop(p.local.router.take());
    let url = p.router(&["zero"], 60_000);
    p.controller("c1");
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        p.snapshot().assignments.is_empty(),
        "min 0 and no load: no server"
    );
    let t0 = Instant::now();
    let (code, body, _) = complete(&p.rt, &url, "zero", 4);
    let waited = t0.elapsed();
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("\"text\""), "{body}");
    eprintln!("scale from zero: first request answered after {waited:?}");
    // Quiet for the stable window: back to zero.
    p.wait_for("scaled back to zero", MIN, |s| s.assignments.is_empty());
}

#[test]
fn a_rolling_update_under_load_fails_no_request() {
    let mut p = Platform::start();
    p.agent("n1", 2);
    p.controller("c1");
    let url = p.router(&["roll"], 30_000);
    let before = deployment("roll", "");
    p.apply(&before);
    p.wait_for("one ready server", MIN, |s| ready(s, "roll").len() == 1);
    // Each answer is one generation's: native's or f32's.
    let want = answers(&p, &["native", "f32"]);
    let p = Arc::new(p);
    let stop = Arc::new(AtomicBool::new(false));
    let loads: Vec<_> = (0..2)
        .map(|_| load(&p, url.clone(), "roll", stop.clone(), false, &want))
        .collect();
    std::thread::sleep(Duration::from_secs(1));
    let after = deployment("roll", "weights: f32");
    assert_ne!(generation(&before), generation(&after));
    p.apply(&after);
    let most = Arc::new(Mutex::new(0usize));
    let m2 = most.clone();
    p.wait_for("the new generation alone", MIN, move |s| {
        let mut m = m2.lock().unwrap();
        *m = (*m).max(s.assignments.len());
        let r = ready(s, "roll");
        r.len() == 1
            && s.assignments.len() == 1
            && s.assignments[0].generation == generation(&after)
    });
    std::thread::sleep(Duration::from_secs(1));
    finish(loads, &stop);
    assert!(*most.lock().unwrap() <= 2, "max_surge 1: at most 2 servers");
}

/// Stopped servers (alive, silent) cost a tick its scrapes' deadline once,
/// together, not once each: with eight of them stopped the leader keeps
/// its 2 s lease (read one after another, at 500 ms each, they took 4 s).
#[test]
fn stopped_servers_do_not_cost_the_leader_its_lease() {
    let mut p = Platform::start();
    p.agent("n1", 8);
    p.controller("c1");
    p.apply(&deployment("mute", "replicas: {min: 8, max: 8}"));
    let s = p.wait_for("eight ready servers", 3 * MIN, |s| {
        ready(s, "mute").len() == 8
    });
    let leader = s.leader.clone().expect("a leader");
    let pids: Vec<_> = s.servers.values().filter_map(|st| st.pid).collect();
    assert_eq!(pids.len(), 8, "every server's pid");
    for &pid in &pids {
        signal_pid(pid, libc::SIGSTOP);
    }
    std::thread::sleep(Duration::from_secs(8));
    let now = p.snapshot();
    for &pid in &pids {
        signal_pid(pid, libc::SIGCONT);
    }
    assert_eq!(
        now.leader,
        Some(leader),
        "the leader lost its lease while its servers were stopped"
    );
}

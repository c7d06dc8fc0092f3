//! The platform's fault matrix, the control plane's cells: under load
//! (two streaming clients, two waiting for whole answers), the leading
//! controller is SIGKILLed, then etcd's leader (of three members); after
//! each, a server is killed too, so that only the survivors (the standby
//! controller; the two remaining etcd members) can replace it. Every
//! answer must be the single-process server's text, and when the load
//! stops no server holds a sequence or a K/V block.
//!
//! The data-plane cells are beside their features: a server and a node
//! agent killed (`platform.rs`), a split deployment's decode worker
//! killed (`roles.rs`).

mod support;

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use p15_platform::local::signal_pid;
use support::{answers, deployment, finish, load, nothing_held, ready, router_sees, Platform};

const MIN: Duration = Duration::from_secs(60);
const NAME: &str = "matrix";

/// Kill one of `NAME`'s servers and wait for its replacement (another id)
/// to be ready and routed to.
fn replace_a_server(p: &Platform, url: &str, who: &str) {
    let s = p.snapshot();
    let victim = ready(&s, NAME).remove(0);
    signal_pid(s.servers[&victim].pid.expect("its pid"), libc::SIGKILL);
    let t0 = Instant::now();
    let s = p.wait_for(&format!("the killed server replaced by {who}"), MIN, |s| {
        let r = ready(s, NAME);
        r.len() == 2 && !r.contains(&victim)
    });
    eprintln!("{who} replaced a killed server in {:?}", t0.elapsed());
    router_sees(p, url, NAME, &s);
}

#[test]
fn the_leading_controller_and_etcds_leader_killed_under_load_lose_and_change_nothing() {
    let mut p = Platform::with_etcd(3);
    p.agent("n1", 2);
    p.agent("n2", 2);
    p.controller("c1");
    p.controller("c2");
    let url = p.router(&[NAME], 30_000);
    p.apply(&deployment(NAME, "replicas: {min: 2, max: 2}"));
    let s = p.wait_for("two ready servers", 2 * MIN, |s| ready(s, NAME).len() == 2);
    router_sees(&p, &url, NAME, &s);
    let want = answers(&p, &["native"]);
    let p = Arc::new(p);
    let under_load = |cell: &dyn Fn()| {
        let stop = Arc::new(AtomicBool::new(false));
        let loads: Vec<_> = [false, false, true, true]
            .into_iter()
            .map(|stream| load(&p, url.clone(), NAME, stop.clone(), stream, &want))
            .collect();
        std::thread::sleep(Duration::from_secs(1));
        cell();
        std::thread::sleep(Duration::from_secs(1));
        finish(loads, &stop);
        nothing_held(&p, NAME, Duration::from_secs(5));
    };

    // 1. The leading controller dies; the standby leads and heals.
    under_load(&|| {
        let (leader, _) = p.snapshot().leader.expect("a leader");
        p.signal(&leader, libc::SIGKILL);
        let t0 = Instant::now();
        p.wait_for("the standby leading", Duration::from_secs(10), |s| {
            s.leader.as_ref().is_some_and(|(id, _)| *id != leader)
        });
        eprintln!("the standby led {:?} after the leader's kill", t0.elapsed());
        replace_a_server(&p, &url, "the new leader");
        let s = p.snapshot();
        assert_eq!(s.assignments.len(), 2, "nothing started twice");
    });

    // 2. etcd's leader dies; two of three members keep quorum.
    under_load(&|| {
        let m =
            p.rt.block_on(p.etcd_client().leader())
                .expect("etcd has a leader");
        p.local.etcd.members[m].signal(libc::SIGKILL);
        eprintln!("killed etcd member {m}, the leader");
        replace_a_server(&p, &url, "the controller through two etcd members");
    });
}

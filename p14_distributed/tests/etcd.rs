//! The etcd client against a real three-member cluster: a write made
//! just after the etcd leader dies finishes within the call's one
//! deadline (a surviving follower holds it for 7 s; the client leaves it
//! for the other, and returns once they have elected a leader), and a
//! cluster that never answers is an error at that deadline, not later.
//!
//! Needs `etcd` (Debian `etcd-server`).

use std::net::TcpListener;
use std::time::{Duration, Instant};

use p14_distributed::cluster::EtcdCluster;
use p14_distributed::etcd::{Etcd, EtcdError};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

#[test]
fn a_write_after_the_etcd_leader_dies_lands_within_the_call_deadline() {
    let mut cluster = EtcdCluster::start(3, "127.0.0.1")
        .expect("etcd (apt-get install etcd-server) on 127.0.0.1");
    // The whole call's deadline: shorter than the 7 s a leaderless
    // follower holds a write, longer than an election (about 1.3 s).
    let deadline = Duration::from_secs(4);
    let rt = runtime();
    let leader = rt
        .block_on(Etcd::new(cluster.urls.clone(), deadline).leader())
        .expect("the members name their leader");
    cluster.members[leader].kill();
    // Start with the member after the dead leader: a follower, which
    // holds the write (the dead leader's port would refuse it at once).
    let mut urls = cluster.urls.clone();
    let n = urls.len();
    urls.rotate_left((leader + 1) % n);
    let etcd = Etcd::new(urls, deadline);
    let t0 = Instant::now();
    let put = rt.block_on(etcd.put("/test/after-leader", b"written", None));
    let took = t0.elapsed();
    put.unwrap_or_else(|e| panic!("the write failed after {took:?}: {e}"));
    assert!(
        took < deadline,
        "the write took {took:?}, past the call's deadline {deadline:?}"
    );
    let read = rt
        .block_on(etcd.get("/test/after-leader"))
        .expect("a read")
        .expect("the key");
    assert_eq!(read.value, b"written".to_vec());
}

#[test]
fn members_that_never_answer_are_an_error_at_the_call_deadline() {
    // Two "members" that accept connections and say nothing.
    let silent: Vec<TcpListener> = (0..2)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("a port"))
        .collect();
    let urls = silent
        .iter()
        .map(|l| format!("http://{}", l.local_addr().expect("an address")))
        .collect();
    let deadline = Duration::from_millis(1500);
    let etcd = Etcd::new(urls, deadline);
    let t0 = Instant::now();
    let r = runtime().block_on(etcd.get("/test/k"));
    let took = t0.elapsed();
    assert!(
        matches!(r, Err(EtcdError::Unreachable { .. })),
        "expected an unreachable error, got {r:?}"
    );
    assert!(
        took >= deadline && took < deadline + Duration::from_millis(500),
        "the call ended after {took:?}; its deadline was {deadline:?}"
    );
}

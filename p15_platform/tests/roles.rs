//! A deployment split into prefill and decode roles, on the platform's
//! processes on loopback (a real etcd, two node agents, a controller and
//! the router): the agents run Project 14's prefill worker, decode worker
//! and proxy for it, placed across both nodes; through the router its
//! greedy answer is the co-located server's, token for token; a killed
//! decode worker is replaced, the four requests it was decoding move on
//! to the replacement from their last token (the co-located server's
//! text), and a request sent meanwhile waits in the proxy for the
//! replacement and is answered. A rolling update of a split
//! deployment under load (streamed and not) fails and cuts nothing: the
//! new generation's proxy serves before the old one drains, and the old
//! workers stay until the old proxy has finished its streams.
//!
//! Needs etcd (`apt-get install -y etcd-server`) and SmolLM2
//! (`bash scripts/fetch_assets.sh smollm2`).

mod support;

use std::collections::BTreeSet;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use p15_platform::local::signal_pid;
use p15_platform::reconcile::Role;
use p15_platform::state::{generation, Reported, Snapshot};
use support::{answers, complete, deployment, finish, load, ready, router_sees, Platform};

const MIN: Duration = Duration::from_secs(60);

/// Tokens of the requests a decode worker is killed under: long enough
/// to be decoding when it dies.
const LONG: u32 = 160;

/// The choice's text of a completion's JSON body.
fn text(body: &str) -> String {
    let v: serde_json::Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
    v["choices"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("no text: {body}"))
        .to_string()
}

/// `deployment`'s assignments of `role` whose servers report ready.
fn ready_of(s: &Snapshot, deployment: &str, role: Role) -> Vec<String> {
    s.assignments
        .iter()
        .filter(|a| a.deployment == deployment && a.role == role && !a.drain)
        .filter(|a| {
            s.servers
                .get(&a.id)
                .is_some_and(|st| st.phase == Reported::Ready)
        })
        .map(|a| a.id.clone())
        .collect()
}

#[test]
fn a_split_deployment_answers_as_the_colocated_server_and_replaces_a_dead_worker() {
    let mut p = Platform::start();
    p.agent("n1", 2);
    p.agent("n2", 2);
    p.controller("c1");
    let url = p.router(&["co", "pd"], 60_000);
    p.apply(&deployment("co", ""));
    p.apply(&deployment("pd", "roles: {prefill: 1, decode: 1}"));
    let s = p.wait_for("both deployments ready", 2 * MIN, |s| {
        ready(s, "co").len() == 1 && ready(s, "pd").len() == 1
    });
    // Only the proxy is an endpoint; its workers run beside it.
    assert!(
        ready(&s, "pd")[0].contains("-proxy-"),
        "{:?}",
        ready(&s, "pd")
    );
    for role in [Role::Prefill, Role::Decode, Role::Proxy] {
        assert_eq!(ready_of(&s, "pd", role).len(), 1, "one {role:?}");
    }
    let nodes: BTreeSet<&str> = s
        .assignments
        .iter()
        .filter(|a| a.deployment == "pd")
        .map(|a| a.node.as_str())
        .collect();
    assert_eq!(nodes.len(), 2, "the roles spread over both nodes");
    router_sees(&p, &url, "co", &s);
    router_sees(&p, &url, "pd", &s);

    let (code, co, _) = complete(&p.rt, &url, "co", 24);
    assert_eq!(code, 200, "{co}");
    let (code, pd, _) = complete(&p.rt, &url, "pd", 24);
    assert_eq!(code, 200, "{pd}");
    eprintln!(
        "co-located: {:?}\nprefill/decode: {:?}",
        text(&co),
        text(&pd)
    );
    assert_eq!(
        text(&pd),
        text(&co),
        "prefill/decode against co-located, greedy"
    );

    // Kill the decode worker with four requests decoding on it: the
    // controller replaces it (a new id), the proxy finds the new one
    // through etcd and moves each request on from its last token, and a
    // request sent meanwhile waits in the proxy for it. Every answer is
    // the co-located server's.
    let (code, co_long, _) = complete(&p.rt, &url, "co", LONG);
    assert_eq!(code, 200, "{co_long}");
    let dead = ready_of(&s, "pd", Role::Decode).remove(0);
    let pid = s.servers[&dead].pid.expect("a pid");
    let stats = format!("{}/stats", s.servers[&dead].url.as_deref().expect("a url"));
    let (cut, held) = std::thread::scope(|scope| {
        let streams: Vec<_> = (0..4)
            .map(|_| scope.spawn(|| complete(&p.rt, &url, "pd", LONG)))
            .collect();
        p.rt.block_on(async {
            let t0 = std::time::Instant::now();
            loop {
                let running = match reqwest::get(&stats).await {
                    Ok(r) => r.json::<serde_json::Value>().await.ok(),
                    Err(_) => None,
                }
                .and_then(|v| v["running"].as_u64());
                if running == Some(4) {
                    break;
                }
                assert!(t0.elapsed() < MIN, "never four decoding: {running:?}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
        signal_pid(pid, libc::SIGKILL);
        let held = complete(&p.rt, &url, "pd", 24);
        let cut: Vec<_> = streams.into_iter().map(|t| t.join().unwrap()).collect();
        (cut, held)
    });
    for (code, body, _) in &cut {
        assert_eq!(*code, 200, "{body}");
        assert_eq!(text(body), text(&co_long), "a request cut mid-decode");
    }
    let (code, held, _) = held;
    assert_eq!(code, 200, "{held}");
    assert_eq!(text(&held), text(&co));
    let proxy = &s.servers[&ready(&s, "pd")[0]];
    let metrics = p.rt.block_on(async {
        let url = format!("{}/metrics", proxy.url.as_deref().expect("a url"));
        reqwest::get(url).await.unwrap().text().await.unwrap()
    });
    assert!(
        metrics.contains("p14_proxy_migrated_total 4\n"),
        "the four were moved on mid-stream: {metrics}"
    );
    let s = p.wait_for("a new decode worker", 2 * MIN, |s| {
        let d = ready_of(s, "pd", Role::Decode);
        d.len() == 1 && d[0] != dead && ready(s, "pd").len() == 1
    });
    router_sees(&p, &url, "pd", &s);
    let (code, again, _) = complete(&p.rt, &url, "pd", 24);
    assert_eq!(code, 200, "{again}");
    assert_eq!(text(&again), text(&co));
}

#[test]
fn a_rolling_update_of_a_split_deployment_under_load_fails_and_cuts_nothing() {
    let mut p = Platform::start();
    p.agent("n1", 4);
    p.agent("n2", 4);
    p.controller("c1");
    let url = p.router(&["pdroll"], 30_000);
    let before = deployment("pdroll", "roles: {prefill: 1, decode: 1}");
    p.apply(&before);
    let s = p.wait_for("the proxy ready", 2 * MIN, |s| {
        ready(s, "pdroll").len() == 1
    });
    router_sees(&p, &url, "pdroll", &s);
    let want = answers(&p, &["native", "f32"]);
    let p = Arc::new(p);
    let stop = Arc::new(AtomicBool::new(false));
    let loads: Vec<_> = [false, true]
        .into_iter()
        .map(|stream| load(&p, url.clone(), "pdroll", stop.clone(), stream, &want))
        .collect();
    std::thread::sleep(Duration::from_secs(1));
    let after = deployment("pdroll", "roles: {prefill: 1, decode: 1}\nweights: f32");
    p.apply(&after);
    let g = generation(&after);
    // The old generation's workers outlive its proxy.
    let order = Arc::new(Mutex::new(Vec::new()));
    let o2 = order.clone();
    let old = generation(&before);
    p.wait_for("the new generation alone", 2 * MIN, move |s| {
        let of_old = |role: Role| {
            s.assignments
                .iter()
                .any(|a| a.generation == old && a.role == role)
        };
        let now = (
            of_old(Role::Proxy),
            of_old(Role::Decode) && of_old(Role::Prefill),
        );
        let mut o = o2.lock().unwrap();
        if o.last() != Some(&now) {
            o.push(now);
        }
        s.assignments.len() == 3 && s.assignments.iter().all(|a| a.generation == g)
    });
    std::thread::sleep(Duration::from_secs(1));
    finish(loads, &stop);
    let order = order.lock().unwrap();
    assert!(
        !order.contains(&(true, false)),
        "an old proxy ran without its workers: {order:?}"
    );
}

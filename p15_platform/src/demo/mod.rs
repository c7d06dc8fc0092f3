//! `p15_platform demo`: the platform on one machine, run through a day in
//! three minutes.
//!
//! ```text
//! start   etcd (3 members), NATS, node agents n1 n2 (3 servers each),
//!         controllers c1 c2 (one leads), the router (hold 120 s)
//! apply   `demo`: SmolLM2 native, 0..4 replicas, concurrency target 2,
//!         stable window 20 s, panic window 4 s, grace 4 s, surge 1
//! load    2 streaming clients          (scale from zero: the first is held)
//! step    8 clients (4x)               (panic mode: 4 replicas)
//! chaos   kill a server; kill node agent n2 (restarted: a host reboot);
//!         kill the leading controller (restarted as a standby);
//!         kill an etcd member
//! rollout weights native -> f32        (surge 1: new ready before old drains)
//! stop    0 clients                    (back to zero after the stable window)
//! split   `demo-pd`: 1 prefill worker, 1 decode worker and their proxy;
//!         4 streaming clients; kill its decode worker (SIGKILL): the
//!         proxy moves each stream on to the controller's replacement
//! ```
//!
//! It prints the timeline as it goes (its own actions, and each server's
//! phase changes as the node agents publish them on NATS), then the
//! figures: failed or cut requests, cold starts, the step's reaction,
//! time to heal each event, replica-seconds against the ideal, flaps,
//! TTFT, and the fault matrix (each fault's requests in flight, lost,
//! changed, and their longest wait for a token). The plot goes to `p15_platform/plots/demo.png` and the figures
//! to numbers.md (unless `--no-rows`).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use futures_util::StreamExt;

use crate::agent::EVENTS;
use crate::clients::{Clients, Record};
use crate::local::{signal_pid, Local};
use crate::reconcile::Role;
use crate::spec::ModelDeployment;
use crate::state::{generation, Reported, ServerStatus, Snapshot};

mod report;

const KEY: &str = "sk-demo";
const NAME: &str = "demo";
/// The split (prefill/decode) deployment of the last phase.
const SPLIT: &str = "demo-pd";
/// The deployment's concurrency target (streams per replica).
pub const TARGET: f64 = 2.0;

#[derive(Clone, Debug, Args)]
pub struct DemoArgs {
    /// Where the plot goes.
    #[arg(long, default_value = "p15_platform/plots")]
    pub plots: PathBuf,
    /// Do not append rows to numbers.md.
    #[arg(long)]
    pub no_rows: bool,
    /// Seconds of each steady phase (low load, after the step).
    #[arg(long, default_value_t = 15)]
    pub phase_s: u64,
    /// A time-to-first-token objective, for SLO attainment.
    #[arg(long, default_value_t = 2.0)]
    pub slo_ttft_s: f64,
    /// Run the scenario this many times (5 or more: medians and p95s of
    /// each event's time).
    #[arg(long, default_value_t = 1)]
    pub runs: usize,
}

fn deployment(weights: &str) -> ModelDeployment {
    let yaml = format!(
        "name: {NAME}\nmodel: smollm2\nweights: {weights}\nreplicas: {{min: 0, max: 4}}\n\
         autoscaling: {{metric: concurrency, target: {TARGET}, stable_window: 20s, panic_window: 4s,\n  \
         scale_down_delay: 0s, max_scale_up_rate: 1000, max_scale_down_rate: 2, scale_to_zero_grace: 4s}}\n\
         roles: colocated\nrollout: {{max_surge: 1, max_unavailable: 0}}\n"
    );
    ModelDeployment::from_yaml(&yaml, "the demo deployment").expect("a valid deployment")
}

fn split_deployment() -> ModelDeployment {
    let yaml = format!(
        "name: {SPLIT}\nmodel: smollm2\nweights: native\nreplicas: {{min: 1, max: 1}}\n\
         autoscaling: {{metric: concurrency, target: 4, stable_window: 6s, panic_window: 2s}}\n\
         roles: {{prefill: 1, decode: 1}}\nrollout: {{max_surge: 1, max_unavailable: 0}}\n"
    );
    ModelDeployment::from_yaml(&yaml, "the demo's split deployment").expect("a valid deployment")
}

pub use crate::measure::Sample;

/// What one run of the scenario saw (times in seconds from its start).
#[derive(Clone, Debug, Default)]
pub struct Run {
    pub records: Vec<Record>,
    pub samples: Vec<Sample>,
    /// Every server's cold start.
    pub cold: Vec<f64>,
    /// Each event's time to heal (or react), by name.
    pub marks: BTreeMap<&'static str, f64>,
    /// When a server or a node was killed outright.
    pub kills: Vec<f64>,
    /// Each fault of the matrix: its cell ([`report::CELLS`]) and when.
    pub faults: Vec<(&'static str, f64)>,
    /// The windows of steady load.
    pub steady: Vec<(f64, f64)>,
    /// The split deployment's requests (its decode worker killed under
    /// them).
    pub split: Vec<Record>,
}

#[derive(Clone, Debug)]
struct Timeline {
    t0: Instant,
    events: Arc<Mutex<Vec<(f64, String)>>>,
}

impl Timeline {
    fn note(&self, what: impl Into<String>) -> f64 {
        let t = self.t0.elapsed().as_secs_f64();
        let what = what.into();
        println!("{t:7.1} s  {what}");
        self.events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((t, what));
        t
    }
}

fn running(s: &Snapshot) -> usize {
    s.running()
}

fn ready(s: &Snapshot) -> usize {
    s.ready(NAME)
}

/// `name`'s `p15_replicas_desired` from whichever controller leads.
pub(crate) async fn desired(
    http: &reqwest::Client,
    controllers: &[String],
    name: &str,
) -> Option<f64> {
    for url in controllers {
        let Ok(r) = http
            .get(format!("{url}/metrics"))
            .timeout(Duration::from_millis(300))
            .send()
            .await
        else {
            continue;
        };
        let text = r.text().await.unwrap_or_default();
        if !text.contains("p15_controller_leader 1") {
            continue;
        }
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("p15_replicas_desired{{deployment=\"{name}\"}}")))?;
        return line.rsplit(' ').next()?.parse().ok();
    }
    None
}

pub fn run(a: &DemoArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let mut runs = Vec::new();
    for i in 0..a.runs.max(1) {
        if a.runs > 1 {
            println!("\n== run {} of {} ==", i + 1, a.runs);
        }
        let run = rt.block_on(scenario(a))?;
        report::print(a, &run);
        runs.push(run);
    }
    report::plot(a, runs.last().expect("one run at least"))?;
    if !a.no_rows {
        report::record(a, &runs)?;
    }
    Ok(())
}

async fn scenario(a: &DemoArgs) -> anyhow::Result<Run> {
    let exe = std::env::current_exe()?;
    let mut l = Local::start(&exe, 3, true)?;
    let tl = Timeline {
        t0: Instant::now(),
        events: Arc::new(Mutex::new(Vec::new())),
    };
    tl.note(format!(
        "etcd (3 members) and NATS at {}",
        l.nats.as_ref().map_or("", |n| n.url.as_str())
    ));
    // Server phase changes, as the node agents publish them.
    let cold: Arc<Mutex<Vec<f64>>> = Arc::new(Mutex::new(Vec::new()));
    if let Some(n) = &l.nats {
        let nc = async_nats::connect(n.url.as_str()).await.context("NATS")?;
        let mut sub = nc.subscribe(EVENTS).await?;
        let (tl2, cold2) = (tl.clone(), cold.clone());
        tokio::spawn(async move {
            let _keep = nc;
            while let Some(m) = sub.next().await {
                let Ok(st) = serde_json::from_slice::<ServerStatus>(&m.payload) else {
                    continue;
                };
                let extra = match st.cold_start_ms {
                    Some(ms) if st.phase == Reported::Ready => {
                        cold2
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push(ms as f64 / 1e3);
                        format!(" (cold start {:.2} s)", ms as f64 / 1e3)
                    }
                    _ => String::new(),
                };
                tl2.note(format!("  {} on {}: {:?}{extra}", st.id, st.node, st.phase));
            }
        });
    }
    l.agent("n1", 3)?;
    l.agent("n2", 3)?;
    l.controller("c1")?;
    l.controller("c2")?;
    let url = l.router(&[NAME, SPLIT], KEY, 120_000)?;
    tl.note(format!(
        "node agents n1 n2, controllers c1 c2, router at {url}"
    ));
    let before = deployment("native");
    l.apply(&before).await?;
    tl.note("applied `demo` (native weights, 0..4 replicas, target 2 streams each)");

    let clients = Clients::start(&url, NAME, KEY, 8, 16, tl.t0);
    let samples: Arc<Mutex<Vec<Sample>>> = Arc::new(Mutex::new(Vec::new()));
    let ctl_urls =
        |l: &Local| -> Vec<String> { l.controllers.iter().filter_map(|m| m.url.clone()).collect() };
    let sampler = {
        let (samples, etcd, want) = (samples.clone(), l.etcd_client(), clients.t0);
        let ctls = Arc::new(Mutex::new(ctl_urls(&l)));
        let clients_now = clients.want.clone();
        let http = reqwest::Client::new();
        let ctls2 = ctls.clone();
        let tl2 = tl.clone();
        let h = tokio::spawn(async move {
            let mut last = None;
            loop {
                if let Ok(s) = Snapshot::read(&etcd).await {
                    let urls = ctls2.lock().unwrap_or_else(|p| p.into_inner()).clone();
                    let smp = Sample {
                        t: want.elapsed().as_secs_f64(),
                        clients: clients_now.load(std::sync::atomic::Ordering::Relaxed),
                        running: running(&s),
                        ready: ready(&s),
                        desired: desired(&http, &urls, NAME).await,
                    };
                    if smp.desired.is_some() && smp.desired != last {
                        let was = last.map_or("-".into(), |d: f64| d.to_string());
                        let now = smp.desired.unwrap_or_default();
                        tl2.note(format!(
                            "  autoscaler: desired {was} -> {now} ({} ready)",
                            smp.ready
                        ));
                        last = smp.desired;
                    }
                    samples.lock().unwrap_or_else(|p| p.into_inner()).push(smp);
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        });
        (h, ctls)
    };
    let phase = Duration::from_secs(a.phase_s);
    let long = Duration::from_secs(120);
    let mut marks: BTreeMap<&'static str, f64> = BTreeMap::new();
    // Hard kills (streams in flight on the victim are cut), and the
    // windows of steady load where the count must not flap.
    let mut kills: Vec<f64> = Vec::new();
    let mut faults: Vec<(&'static str, f64)> = Vec::new();
    let mut steady: Vec<(f64, f64)> = Vec::new();

    // Scale from zero.
    clients.set(2);
    let t = tl.note("load: 2 streaming clients (the first request is held: no server yet)");
    l.wait_for("a first server", long, |s| ready(s) >= 1)
        .await?;
    let t_ready = tl.note("first server ready");
    marks.insert("from zero", t_ready - t);
    tokio::time::sleep(phase).await;

    // A 4x step.
    clients.set(8);
    let t_step = tl.note("load: 8 clients (a 4x step)");
    steady.push((t_ready + 3.0, t_step));
    l.wait_for("a second server", long, |s| ready(s) >= 2)
        .await?;
    marks.insert("step first", tl.note("a new replica is serving") - t_step);
    l.wait_for("four servers", long, |s| ready(s) >= 4).await?;
    let t_all = tl.note("all four replicas serving");
    marks.insert("step all", t_all - t_step);
    tokio::time::sleep(phase).await;
    steady.push((t_all + 3.0, tl.t0.elapsed().as_secs_f64()));

    // Chaos 1: a server dies.
    let s = l.snapshot().await?;
    let victim = s
        .servers
        .values()
        .find(|st| st.phase == Reported::Ready)
        .cloned()
        .context("a ready server")?;
    signal_pid(victim.pid.context("its pid")?, libc::SIGKILL);
    let t = tl.note(format!("chaos: killed server {} (SIGKILL)", victim.id));
    kills.push(t);
    faults.push(("server", t));
    l.wait_for("the server replaced", long, |s| {
        ready(s) >= 4
            && !s
                .endpoints
                .get(NAME)
                .is_some_and(|v| v.iter().any(|(id, _)| *id == victim.id))
    })
    .await?;
    marks.insert("heal server", tl.note("healed: four replicas serving") - t);

    // Chaos 2: a node agent dies; the host comes back later.
    let s = l.snapshot().await?;
    let on_n2: Vec<String> = s
        .assignments
        .iter()
        .filter(|a| a.node == "n2")
        .map(|a| a.id.clone())
        .collect();
    if let Some(m) = l.agents.iter().find(|m| m.id == "n2") {
        m.proc.signal(libc::SIGKILL);
    }
    let t = tl.note(format!(
        "chaos: killed node agent n2 (its servers {on_n2:?} die with it)"
    ));
    kills.push(t);
    faults.push(("node", t));
    l.wait_for("n2's lease gone", long, |s| {
        s.nodes.iter().all(|n| n.id != "n2")
    })
    .await?;
    l.wait_for("n2's servers re-placed on n1", long, |s| {
        ready(s) >= 3 && !s.assignments.iter().any(|a| on_n2.contains(&a.id))
    })
    .await?;
    marks.insert(
        "heal node",
        tl.note("n2's lease expired; n1 runs three (its capacity)") - t,
    );
    l.agent("n2", 3)?;
    tl.note("node n2 back (its agent restarted)");
    l.wait_for("four again", long, |s| ready(s) >= 4).await?;
    tl.note("four replicas serving");

    // Chaos 3: the leading controller dies.
    let s = l.snapshot().await?;
    let (leader, _) = s.leader.clone().context("a leader")?;
    if let Some(m) = l.controllers.iter().find(|m| m.id == leader) {
        m.proc.signal(libc::SIGKILL);
    }
    let t = tl.note(format!("chaos: killed the leading controller {leader}"));
    faults.push(("leader", t));
    l.wait_for("a new leader", long, |s| {
        s.leader.as_ref().is_some_and(|(id, _)| *id != leader)
    })
    .await?;
    marks.insert("heal leader", tl.note("the standby leads") - t);
    l.controller(&leader)?;
    *sampler.1.lock().unwrap_or_else(|p| p.into_inner()) = ctl_urls(&l);
    tl.note(format!("{leader} back, as a standby"));

    // Chaos 4: etcd's leader dies (two of three keep quorum and elect another).
    let m = l.etcd_client().leader().await.unwrap_or(0);
    l.etcd.members[m].signal(libc::SIGKILL);
    let t = tl.note(format!("chaos: killed etcd member m{m}, the etcd leader"));
    faults.push(("etcd", t));
    // A write through the surviving members (it waits for their new leader).
    l.etcd_client()
        .put(
            "/inference-lab/p15/demo-probe",
            b"after the etcd leader died",
            None,
        )
        .await?;
    marks.insert(
        "heal etcd",
        tl.note("etcd answers reads and writes with two members (a new etcd leader)") - t,
    );

    // Rolling update.
    let after = deployment("f32");
    l.apply(&after).await?;
    let t = tl.note("rollout: weights native -> f32");
    let g = generation(&after);
    l.wait_for("the new generation alone", Duration::from_secs(300), |s| {
        ready(s) >= 4 && s.assignments.iter().all(|a| a.generation == g)
    })
    .await?;
    marks.insert(
        "rollout",
        tl.note("rollout done: four f32 replicas serving") - t,
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    // The leader's live page, as a browser shows it.
    let leader_url = {
        let s = l.snapshot().await?;
        let id = s.leader.map(|(id, _)| id).unwrap_or_default();
        l.controllers
            .iter()
            .find(|m| m.id == id)
            .and_then(|m| m.url.clone())
    };
    if let Some(u) = leader_url {
        let shot = a.plots.join("dashboard.png");
        std::fs::create_dir_all(&a.plots)?;
        let shot2 = shot.clone();
        match tokio::task::spawn_blocking(move || {
            crate::dashboard::screenshot(&u, &shot2, (1000, 1500))
        })
        .await?
        {
            Ok(()) => tl.note(format!("dashboard screenshot: {}", shot.display())),
            Err(e) => tl.note(format!("no dashboard screenshot: {e:#}")),
        };
    }

    // Load stops.
    clients.set(0);
    let t = tl.note("load: 0 clients");
    l.wait_for("back to zero", long, |s| s.assignments.is_empty())
        .await?;
    marks.insert("to zero", tl.note("scaled to zero") - t);
    sampler.0.abort();
    clients.set(0);
    let split = split_phase(&mut l, &url, &tl, &mut marks, &mut faults).await?;

    let records = clients.records();
    let samples = samples.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let cold = cold.lock().unwrap_or_else(|p| p.into_inner()).clone();
    Ok(Run {
        records,
        samples,
        cold,
        marks,
        kills,
        faults,
        steady,
        split,
    })
}

/// A split deployment under 4 streaming clients loses its decode worker:
/// the controller starts another, and the proxy moves each stream on to
/// it from its last token. Its requests.
async fn split_phase(
    l: &mut Local,
    url: &str,
    tl: &Timeline,
    marks: &mut BTreeMap<&'static str, f64>,
    faults: &mut Vec<(&'static str, f64)>,
) -> anyhow::Result<Vec<Record>> {
    let long = Duration::from_secs(120);
    l.apply(&split_deployment()).await?;
    tl.note(format!(
        "split: applied `{SPLIT}` (1 prefill worker, 1 decode worker, their proxy)"
    ));
    l.wait_for("the split deployment ready", long, |s| s.ready(SPLIT) >= 1)
        .await?;
    let clients = Clients::start(url, SPLIT, KEY, 4, 64, tl.t0);
    clients.set(4);
    tl.note(format!("load: 4 streaming clients on `{SPLIT}`"));
    tokio::time::sleep(Duration::from_secs(3)).await;
    let s = l.snapshot().await?;
    let victim = s
        .assignments
        .iter()
        .find(|a| a.deployment == SPLIT && a.role == Role::Decode)
        .map(|a| a.id.clone())
        .context("a decode worker")?;
    let pid = s
        .servers
        .get(&victim)
        .and_then(|st| st.pid)
        .context("its pid")?;
    signal_pid(pid, libc::SIGKILL);
    let t = tl.note(format!("chaos: killed decode worker {victim} (SIGKILL)"));
    faults.push(("decode", t));
    l.wait_for("a new decode worker", long, |s| {
        s.assignments.iter().any(|a| {
            a.deployment == SPLIT
                && a.role == Role::Decode
                && a.id != victim
                && s.servers
                    .get(&a.id)
                    .is_some_and(|st| st.phase == Reported::Ready)
        })
    })
    .await?;
    marks.insert(
        "heal decode",
        tl.note("healed: a new decode worker serving") - t,
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    clients.set(0);
    // The last requests finish (64 tokens each): until none is added for 1 s.
    let t0 = Instant::now();
    let mut n = usize::MAX;
    while clients.records().len() != n && t0.elapsed() < long {
        n = clients.records().len();
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    tl.note(format!("load: 0 clients on `{SPLIT}`"));
    Ok(clients.records())
}

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
//! ```
//!
//! It prints the timeline as it goes (its own actions, and each server's
//! phase changes as the node agents publish them on NATS), then the
//! figures: failed or cut requests, cold starts, the step's reaction,
//! time to heal each event, replica-seconds against the ideal, flaps,
//! TTFT. The plot goes to `p15_platform/plots/demo.png` and the figures
//! to numbers.md (unless `--no-rows`).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use common::numbers::{Recorder, Row};
use common::plot::{line_chart, Labels, Scale, Series};
use common::stats::percentile_sorted;
use futures_util::StreamExt;

use crate::agent::EVENTS;
use crate::clients::{Clients, Record};
use crate::local::{signal_pid, Local};
use crate::spec::ModelDeployment;
use crate::state::{generation, Reported, ServerStatus, Snapshot};

const KEY: &str = "sk-demo";
const NAME: &str = "demo";
const TARGET: f64 = 2.0;

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

/// The state every half second, for the plot and the figures.
#[derive(Clone, Debug, Default)]
struct Sample {
    t: f64,
    clients: usize,
    /// Servers running (starting, ready or draining).
    running: usize,
    /// Published endpoints (what the router routes to).
    ready: usize,
    desired: Option<f64>,
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
    s.assignments
        .iter()
        .filter(|a| {
            !matches!(
                s.servers.get(&a.id).map(|st| st.phase),
                Some(Reported::Stopped | Reported::Failed)
            )
        })
        .count()
}

fn ready(s: &Snapshot) -> usize {
    s.endpoints.get(NAME).map_or(0, Vec::len)
}

/// `p15_replicas_desired` from whichever controller leads.
async fn desired(http: &reqwest::Client, controllers: &[String]) -> Option<f64> {
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
            .find(|l| l.starts_with(&format!("p15_replicas_desired{{deployment=\"{NAME}\"}}")))?;
        return line.rsplit(' ').next()?.parse().ok();
    }
    None
}

pub fn run(a: &DemoArgs) -> anyhow::Result<()> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(scenario(a))
}

async fn scenario(a: &DemoArgs) -> anyhow::Result<()> {
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
    let url = l.router(&[NAME], KEY, 120_000)?;
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
        let clients_now = Arc::new(clients_handle(&clients));
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
                        clients: clients_now(),
                        running: running(&s),
                        ready: ready(&s),
                        desired: desired(&http, &urls).await,
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
    let mut marks: BTreeMap<&str, f64> = BTreeMap::new();
    // Hard kills (streams in flight on the victim are cut), and the
    // windows of steady load where the count must not flap.
    let mut kills: Vec<f64> = Vec::new();
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
    let s = l
        .wait_for("a second server", long, |s| ready(s) >= 2)
        .await?;
    marks.insert("step first", tl.note("a new replica is serving") - t_step);
    let _ = s;
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
    l.wait_for("a new leader", long, |s| {
        s.leader.as_ref().is_some_and(|(id, _)| *id != leader)
    })
    .await?;
    marks.insert("heal leader", tl.note("the standby leads") - t);
    l.controller(&leader)?;
    *sampler.1.lock().unwrap_or_else(|p| p.into_inner()) = ctl_urls(&l);
    tl.note(format!("{leader} back, as a standby"));

    // Chaos 4: etcd's leader dies (two of three keep quorum and elect another).
    let m = etcd_leader(&l.etcd.urls).await.unwrap_or(0);
    l.etcd.members[m].signal(libc::SIGKILL);
    let t = tl.note(format!("chaos: killed etcd member m{m}, the etcd leader"));
    let probe = deployment("native");
    l.wait_for("etcd answering", long, |_| true).await?;
    l.apply(&probe).await?; // a write goes through the other members
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

    let records = clients.records();
    let samples = samples.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let cold = cold.lock().unwrap_or_else(|p| p.into_inner()).clone();
    report(a, &records, &samples, &cold, &marks, &kills, &steady)
}

/// The index of the member leading etcd (from the members' maintenance
/// status), if one answers.
async fn etcd_leader(urls: &[String]) -> Option<usize> {
    let http = reqwest::Client::new();
    let status = |u: String| {
        let http = http.clone();
        async move {
            let r = http
                .post(format!("{u}/v3/maintenance/status"))
                .body("{}")
                .timeout(Duration::from_secs(2))
                .send()
                .await
                .ok()?;
            r.json::<serde_json::Value>().await.ok()
        }
    };
    let mut ids = Vec::new();
    let mut leader = None;
    for u in urls {
        let v = status(u.clone()).await;
        let id = v
            .as_ref()
            .and_then(|v| v.pointer("/header/member_id")?.as_str().map(str::to_string));
        leader = leader.or_else(|| {
            v.as_ref()
                .and_then(|v| v.get("leader")?.as_str().map(str::to_string))
        });
        ids.push(id);
    }
    let leader = leader?;
    ids.iter()
        .position(|id| id.as_deref() == Some(leader.as_str()))
}

/// A closure reading how many clients run now.
fn clients_handle(c: &Clients) -> impl Fn() -> usize + Send + Sync + 'static {
    let want = c.want.clone();
    move || want.load(std::sync::atomic::Ordering::Relaxed)
}

fn report(
    a: &DemoArgs,
    records: &[Record],
    samples: &[Sample],
    cold: &[f64],
    marks: &BTreeMap<&str, f64>,
    kills: &[f64],
    steady: &[(f64, f64)],
) -> anyhow::Result<()> {
    let failed: Vec<&Record> = records.iter().filter(|r| !r.ok).collect();
    let cut = failed.iter().filter(|r| r.cut).count();
    // In flight when a server or its node was killed: cut with it.
    let at_kill = |r: &Record| kills.iter().any(|&k| r.start <= k && k <= r.end + 0.5);
    let n_kill = failed.iter().filter(|r| at_kill(r)).count();
    let other = failed.len() - n_kill;
    let mut ttft: Vec<f64> = records.iter().filter_map(|r| r.ttft).collect();
    ttft.sort_by(f64::total_cmp);
    let within = ttft.iter().filter(|&&t| t <= a.slo_ttft_s).count();
    let pct = |v: &[f64], q: f64| {
        if v.is_empty() {
            f64::NAN
        } else {
            percentile_sorted(v, q)
        }
    };
    // Replica-seconds: servers running against ceil(clients / target).
    let (mut actual, mut ideal) = (0.0, 0.0);
    for w in samples.windows(2) {
        let dt = w[1].t - w[0].t;
        actual += w[0].running as f64 * dt;
        ideal += (w[0].clients as f64 / TARGET).ceil() * dt;
    }
    // Flaps: the desired count changing direction while the load holds.
    let mut flaps = 0;
    let mut last_dir = 0i32;
    let in_steady = |t: f64| steady.iter().any(|&(a, b)| a <= t && t <= b);
    for w in samples.windows(2) {
        let (Some(d0), Some(d1)) = (w[0].desired, w[1].desired) else {
            continue;
        };
        if w[0].clients != w[1].clients || !in_steady(w[0].t) || !in_steady(w[1].t) {
            last_dir = 0;
            continue;
        }
        let dir = (d1 - d0).signum() as i32;
        if dir != 0 {
            if last_dir != 0 && dir != last_dir {
                flaps += 1;
            }
            last_dir = dir;
        }
    }
    let mut cold_sorted = cold.to_vec();
    cold_sorted.sort_by(f64::total_cmp);
    println!(
        "\n{} requests: {} failed ({} cut mid-stream); {} of them in flight on a killed server or node, {} otherwise",
        records.len(),
        failed.len(),
        cut,
        n_kill,
        other
    );
    for r in failed.iter().take(5) {
        println!("  at {:.1} s: {}", r.start, r.error);
    }
    println!(
        "TTFT p50 {:.3} s, p99 {:.3} s; {:.1}% within {} s",
        pct(&ttft, 50.0),
        pct(&ttft, 99.0),
        100.0 * within as f64 / ttft.len().max(1) as f64,
        a.slo_ttft_s
    );
    println!(
        "cold start (spawn to ready) median {:.2} s, p95 {:.2} s over {}",
        pct(&cold_sorted, 50.0),
        pct(&cold_sorted, 95.0),
        cold.len()
    );
    for (k, v) in marks {
        println!("{k:>12}: {v:.2} s");
    }
    println!(
        "replica-seconds {actual:.0}, ideal {ideal:.0} (ratio {:.2}); flaps {flaps}",
        actual / ideal.max(1e-9)
    );
    plot(a, samples, records)?;
    if a.no_rows {
        return Ok(());
    }
    let n = records.len();
    let nc = cold.len();
    let mut rows = vec![
        Row::new(
            format!("p15 demo: requests failed or cut, of {n}, other than those in flight on a killed server or node"),
            other as f64,
            "requests",
        )
        .predicted("0"),
        Row::new(
            format!("p15 demo: requests cut in flight on a killed server or node, of {n}"),
            n_kill as f64,
            "requests",
        )
        .predicted("the streams the victims held (no mid-stream resume)"),
        Row::new(
            "p15 demo: replica-seconds, ratio to the ideal ceil(clients / target)",
            actual / ideal.max(1e-9),
            "x",
        )
        .predicted("1.15 (target <= 1.3)"),
        Row::new(
            "p15 demo: flaps of the desired count under steady load (two steady windows)",
            flaps as f64,
            "flaps",
        )
        .predicted("0"),
        Row::new(
            format!(
                "p15 demo: TTFT within {} s, fraction of {}",
                a.slo_ttft_s,
                ttft.len()
            ),
            within as f64 / ttft.len().max(1) as f64,
            "fraction",
        ),
    ];
    rows.extend(Row::median_p95(
        format!("p15 demo: cold start, spawn to ready, of {nc}"),
        pct(&cold_sorted, 50.0),
        pct(&cold_sorted, 95.0),
        "s",
        "about 1 s (native weights)",
    ));
    rows.push(Row::new(
        format!("p15 demo: TTFT, p50 of {}", ttft.len()),
        pct(&ttft, 50.0),
        "s",
    ));
    rows.push(Row::new(
        format!("p15 demo: TTFT, p99 of {}", ttft.len()),
        pct(&ttft, 99.0),
        "s",
    ));
    let names = [
        (
            "from zero",
            "first request to a first server ready (scale from zero), one run",
            "cold start + 1 s",
        ),
        (
            "step first",
            "4x step to a new replica serving, one run",
            "about 3 s (target: panic window 4 s + one cold start)",
        ),
        ("step all", "4x step to all four serving, one run", ""),
        (
            "heal server",
            "a killed server to four serving again, one run",
            "cold start + 1 s",
        ),
        (
            "heal node",
            "a killed node agent to its servers re-placed, one run",
            "lease TTL 2 s + cold start",
        ),
        (
            "heal leader",
            "a killed leading controller to the standby leading, one run",
            "under the 2 s TTL + 0.5 s",
        ),
        (
            "heal etcd",
            "a killed etcd member to a write through the others, one run",
            "under 1 s",
        ),
        (
            "rollout",
            "rolling update of four replicas (native to f32), one run",
            "4 x (cold start + drain)",
        ),
        (
            "to zero",
            "load stopped to zero replicas, one run",
            "stable window 20 s + grace 4 s",
        ),
    ];
    for (k, metric, pred) in names {
        if let Some(v) = marks.get(k) {
            rows.push(Row::new(format!("p15 demo: {metric}"), *v, "s").predicted(pred));
        }
    }
    let isa = p10_quant::NativeWeights::detect().dot.isa();
    Recorder::for_workspace("cargo run --release -p p15_platform -- demo")
        .machine_note(&format!("native kernels {isa}"))
        .append(&rows)
        .context("appending to numbers.md")?;
    println!("rows appended to numbers.md");
    Ok(())
}

fn plot(a: &DemoArgs, samples: &[Sample], records: &[Record]) -> anyhow::Result<()> {
    let pts = |f: &dyn Fn(&Sample) -> Option<f64>| -> Vec<(f64, f64)> {
        samples.iter().filter_map(|s| Some((s.t, f(s)?))).collect()
    };
    let series = vec![
        Series::new(
            "offered load: clients / target",
            pts(&|s| Some(s.clients as f64 / TARGET)),
        ),
        Series::new("desired (autoscaler)", pts(&|s| s.desired)),
        Series::new("servers running", pts(&|s| Some(s.running as f64))),
        Series::new("ready (routed to)", pts(&|s| Some(s.ready as f64))),
    ];
    let path = a.plots.join("demo.png");
    line_chart(
        &path,
        Labels {
            title: "p15 demo: replicas against load",
            x: "time (s)",
            y: "replicas",
        },
        &series,
        Scale::Linear,
    )?;
    // TTFT p99 per 5 s of request starts.
    let mut by: BTreeMap<i64, Vec<f64>> = BTreeMap::new();
    for r in records {
        if let Some(t) = r.ttft {
            by.entry((r.start / 5.0).floor() as i64)
                .or_default()
                .push(t);
        }
    }
    let p99: Vec<(f64, f64)> = by
        .into_iter()
        .map(|(k, mut v)| {
            v.sort_by(f64::total_cmp);
            (k as f64 * 5.0 + 2.5, percentile_sorted(&v, 99.0))
        })
        .collect();
    let path2 = a.plots.join("demo_ttft.png");
    line_chart(
        &path2,
        Labels {
            title: "p15 demo: TTFT p99 per 5 s",
            x: "time (s)",
            y: "seconds",
        },
        &[Series::new("TTFT p99", p99)],
        Scale::Linear,
    )?;
    println!("plots: {} {}", path.display(), path2.display());
    Ok(())
}

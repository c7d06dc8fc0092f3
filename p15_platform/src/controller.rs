//! The controller: a leader-elected, level-triggered reconcile loop.
//!
//! ```text
//! every tick (250 ms):
//!   election step (renew, or campaign)             not leader: stop here
//!   snapshot = one range read of the whole state   (one revision)
//!   once a second: scrape the ready servers' /metrics and the routers'
//!     held requests; feed each deployment's KPA; decide its replica count
//!   plan = reconcile::plan(wants, actual, live nodes)
//!   each action as a fenced txn:
//!     Start  -> put assign/<node>/<id>   if the key does not exist yet
//!     Drain  -> put the assignment with drain = true
//!     Remove -> delete the assignment
//!   endpoints/<deployment>/<id> = ready, not draining servers (fenced)
//! ```
//!
//! Nothing is carried from one tick to the next but the autoscalers'
//! windows: a restarted or newly elected controller rebuilds its picture
//! from etcd, and a missed watch event cannot leave it wrong.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use p14_distributed::etcd::{Compare, Etcd, Op};

use crate::dashboard::Point;
use crate::election::{fenced, fenced_if, Candidate, Fence};
use crate::kpa::{Decision, Kpa, KpaSpec};
use crate::reconcile::{plan, Action, Server};
use crate::spec::Metric;
use crate::state::{self, assign_key, endpoint_key, Assignment, Snapshot, ENDPOINTS};
use crate::ttft::TtftWindow;

#[derive(Clone, Debug)]
pub struct ControllerConfig {
    pub id: String,
    pub etcd: Vec<String>,
    pub ttl_s: i64,
}

/// What the controller exposes on `/metrics` and `/status`.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub leader: bool,
    pub reconciles: u64,
    pub reconcile_seconds_sum: f64,
    pub actions: BTreeMap<&'static str, u64>,
    /// Actions refused by etcd because the fence no longer held.
    pub fenced_out: u64,
    /// By deployment: the last decision, ready and total servers.
    pub decisions: BTreeMap<String, Decision>,
    pub ready: BTreeMap<String, u32>,
    pub servers: BTreeMap<String, u32>,
    pub metric_value: BTreeMap<String, f64>,
    pub snapshot: Option<Snapshot>,
    /// By deployment, one point a second (the page's plots).
    pub history: BTreeMap<String, VecDeque<Point>>,
}

#[derive(Debug)]
pub struct Controller {
    cfg: ControllerConfig,
    etcd: Etcd,
    http: reqwest::Client,
    candidate: Candidate,
    t0: Instant,
    kpa: BTreeMap<String, Kpa>,
    last_scrape: Option<Instant>,
    /// The dashboard's TTFT, from the same scrapes (the autoscaler does
    /// not read it).
    ttft: TtftWindow,
    pub report: Arc<Mutex<Report>>,
}

/// The most one tick spends reading the servers' `/metrics` (each read
/// has its own 500 ms deadline; this bounds them together).
const SCRAPE_BUDGET: Duration = Duration::from_millis(800);

/// A server's load for `metric`, from its `/metrics` page.
fn load_of(text: &str, metric: Metric) -> f64 {
    let gauge = p12_gateway::score::metric_sum;
    let running = gauge(text, "vllm:num_requests_running");
    let waiting = gauge(text, "vllm:num_requests_waiting");
    match metric {
        Metric::Concurrency => running + waiting,
        Metric::Queue => waiting,
        Metric::KvUsage => gauge(text, "vllm:kv_cache_usage_perc"),
    }
}

/// Seconds of history kept for the page.
const HISTORY: usize = 600;

impl Controller {
    pub fn new(cfg: ControllerConfig) -> Controller {
        let etcd = Etcd::new(cfg.etcd.clone(), Duration::from_secs(2));
        let candidate = Candidate::new(etcd.clone(), &cfg.id, cfg.ttl_s);
        Controller {
            cfg,
            etcd,
            http: reqwest::Client::new(),
            candidate,
            t0: Instant::now(),
            kpa: BTreeMap::new(),
            last_scrape: None,
            ttft: TtftWindow::default(),
            report: Arc::new(Mutex::new(Report::default())),
        }
    }

    fn report(&self) -> std::sync::MutexGuard<'_, Report> {
        self.report.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub async fn run(mut self) -> anyhow::Result<()> {
        println!("controller {} ready", self.cfg.id);
        let mut was_leader = false;
        loop {
            match self.tick().await {
                Ok(leader) if leader != was_leader => {
                    println!("controller {} leader={leader}", self.cfg.id);
                    was_leader = leader;
                }
                Ok(_) => {}
                Err(e) => eprintln!("controller {}: {e:#}", self.cfg.id),
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// One pass; whether this controller leads.
    pub async fn tick(&mut self) -> anyhow::Result<bool> {
        let Some(fence) = self.candidate.step().await? else {
            self.report().leader = false;
            return Ok(false);
        };
        let t = Instant::now();
        let snap = Snapshot::read(&self.etcd).await?;
        let actual = snap.actual();
        let replicas = self.autoscale(&snap, &actual).await;
        let wants = state::wants(&snap, &replicas);
        let p = plan(&wants, &actual, &snap.live_nodes());
        let mut refused = 0;
        for a in &p.actions {
            if !self.act(fence, &snap, a).await? {
                refused += 1;
            }
        }
        refused += self.publish_endpoints(fence, &snap).await?;
        let mut r = self.report();
        r.leader = true;
        r.reconciles += 1;
        r.reconcile_seconds_sum += t.elapsed().as_secs_f64();
        for a in &p.actions {
            let k = match a {
                Action::Start { .. } => "start",
                Action::Drain { .. } => "drain",
                Action::Remove { .. } => "remove",
            };
            *r.actions.entry(k).or_default() += 1;
        }
        r.fenced_out += refused;
        for w in &wants {
            let mine = actual.iter().filter(|s| s.deployment == w.name);
            r.servers.insert(w.name.clone(), mine.count() as u32);
        }
        r.snapshot = Some(snap);
        Ok(true)
    }

    /// Do one action, fenced: whether etcd took it.
    async fn act(&self, fence: Fence, snap: &Snapshot, a: &Action) -> anyhow::Result<bool> {
        match a {
            Action::Start {
                id,
                deployment,
                generation,
                role,
                node,
            } => {
                let Some(d) = snap.deployment(deployment) else {
                    return Ok(false);
                };
                let asg = Assignment {
                    id: id.clone(),
                    deployment: deployment.clone(),
                    generation: *generation,
                    role: *role,
                    node: node.clone(),
                    model: d.model.clone(),
                    weights: d.weights,
                    drain: false,
                };
                let key = assign_key(node, id);
                let put = Op::Put {
                    key: key.clone(),
                    value: serde_json::to_vec(&asg)?,
                    lease: None,
                };
                // Not there yet: a second start of one id does nothing.
                let absent = Compare::CreateRevision(key, 0);
                Ok(fenced_if(&self.etcd, fence, &[absent], &[put]).await?)
            }
            Action::Drain { id } => {
                let Some(asg) = snap.assignment(id) else {
                    return Ok(false);
                };
                let mut asg = asg.clone();
                asg.drain = true;
                let ops = [
                    Op::Delete(endpoint_key(&asg.deployment, id)),
                    Op::Put {
                        key: assign_key(&asg.node, id),
                        value: serde_json::to_vec(&asg)?,
                        lease: None,
                    },
                ];
                Ok(fenced(&self.etcd, fence, &ops).await?)
            }
            Action::Remove { id } => {
                let Some(asg) = snap.assignment(id) else {
                    return Ok(false);
                };
                let ops = [
                    Op::Delete(endpoint_key(&asg.deployment, id)),
                    Op::Delete(assign_key(&asg.node, id)),
                ];
                Ok(fenced(&self.etcd, fence, &ops).await?)
            }
        }
    }

    /// Make endpoints/ hold exactly the ready, not draining servers; the
    /// number of writes refused by the fence.
    async fn publish_endpoints(&self, fence: Fence, snap: &Snapshot) -> anyhow::Result<u64> {
        let want: BTreeSet<(String, String, String)> = snap
            .ready_endpoints()
            .into_iter()
            .flat_map(|(d, v)| v.into_iter().map(move |(id, url)| (d.clone(), id, url)))
            .collect();
        let have: BTreeSet<(String, String, String)> = snap
            .endpoints
            .iter()
            .flat_map(|(d, v)| {
                v.iter()
                    .map(move |(id, url)| (d.clone(), id.clone(), url.clone()))
            })
            .collect();
        let mut ops = Vec::new();
        for (d, id, url) in want.difference(&have) {
            ops.push(Op::Put {
                key: endpoint_key(d, id),
                value: url.as_bytes().to_vec(),
                lease: None,
            });
        }
        for (d, id, _) in have.difference(&want) {
            if !want.iter().any(|(d2, id2, _)| d2 == d && id2 == id) {
                ops.push(Op::Delete(format!("{ENDPOINTS}{d}/{id}")));
            }
        }
        if ops.is_empty() {
            return Ok(0);
        }
        Ok(u64::from(!fenced(&self.etcd, fence, &ops).await?))
    }

    /// Each deployment's replica count from its KPA, fed once a second.
    async fn autoscale(&mut self, snap: &Snapshot, actual: &[Server]) -> BTreeMap<String, u32> {
        let now = self.t0.elapsed();
        let names: BTreeSet<String> = snap
            .deployments
            .iter()
            .map(|d| d.deployment.name.clone())
            .collect();
        self.kpa.retain(|n, _| names.contains(n));
        for st in &snap.deployments {
            let spec = KpaSpec::of(&st.deployment);
            let k = self
                .kpa
                .entry(st.deployment.name.clone())
                .or_insert_with(|| Kpa::new(spec.clone()));
            if *k.spec() != spec {
                *k = Kpa::new(spec);
            }
        }
        let due = self
            .last_scrape
            .is_none_or(|t| t.elapsed() >= Duration::from_secs(1));
        let ready = snap.ready_endpoints();
        if due {
            self.last_scrape = Some(Instant::now());
            let urls: Vec<&str> = ready.values().flatten().map(|(_, u)| u.as_str()).collect();
            let (held, mut pages) = tokio::join!(self.held(snap), self.scrape_all(&urls));
            // By deployment, its servers' pages: the load the autoscaler
            // reads, and the TTFT the dashboard plots.
            let mut by: BTreeMap<String, Vec<(String, String)>> = BTreeMap::new();
            for st in &snap.deployments {
                let d = &st.deployment;
                let mut value = held.get(&d.name).copied().unwrap_or(0.0);
                let servers = by.entry(d.name.clone()).or_default();
                for (_, url) in ready.get(&d.name).into_iter().flatten() {
                    let text = pages.remove(url.as_str()).unwrap_or_default();
                    value += load_of(&text, d.autoscaling.metric);
                    servers.push((url.clone(), text));
                }
                if let Some(k) = self.kpa.get_mut(&d.name) {
                    k.record(now, value);
                }
                self.report().metric_value.insert(d.name.clone(), value);
            }
            self.ttft.scraped(&by);
        }
        let mut out = BTreeMap::new();
        for st in &snap.deployments {
            let d = &st.deployment;
            let n_ready = ready.get(&d.name).map_or(0, |v| v.len()) as u32;
            let Some(k) = self.kpa.get_mut(&d.name) else {
                continue;
            };
            let keep = actual.iter().filter(|s| s.deployment == d.name).count() as u32;
            let decision = if due { k.decide(now, n_ready) } else { None };
            let desired = match decision {
                Some(dec) => {
                    let n = dec.desired;
                    self.report().decisions.insert(d.name.clone(), dec);
                    n
                }
                None => match self.report().decisions.get(&d.name) {
                    Some(dec) => dec.desired,
                    None => keep.max(d.replicas.min),
                },
            };
            self.report().ready.insert(d.name.clone(), n_ready);
            out.insert(d.name.clone(), desired);
            if due {
                let running = actual
                    .iter()
                    .filter(|s| {
                        s.deployment == d.name && s.phase != crate::reconcile::Phase::Failed
                    })
                    .count();
                let (ttft_p50, ttft_p99) = self.ttft.p50_p99(&d.name);
                let mut r = self.report();
                let load =
                    r.metric_value.get(&d.name).copied().unwrap_or(0.0) / d.autoscaling.target;
                let point = Point {
                    t: now.as_secs_f64(),
                    desired: desired as f64,
                    running: running as f64,
                    ready: n_ready as f64,
                    load,
                    ttft_p50,
                    ttft_p99,
                };
                let hist = r.history.entry(d.name.clone()).or_default();
                hist.push_back(point);
                while hist.len() > HISTORY {
                    hist.pop_front();
                }
            }
        }
        self.report().history.retain(|n, _| names.contains(n));
        out
    }

    /// Every server's `/metrics` page at once (64 in flight), all within
    /// [`SCRAPE_BUDGET`] whatever their number or state: a stopped server
    /// costs its own 500 ms, never the tick's lease. A page not read in
    /// time is missing (the server then counts no load this second).
    async fn scrape_all<'u>(&self, urls: &[&'u str]) -> BTreeMap<&'u str, String> {
        use futures_util::StreamExt;
        futures_util::stream::iter(urls.iter().copied())
            .map(|u| async move { (u, self.scrape(u).await) })
            .buffer_unordered(64)
            .take_until(tokio::time::sleep(SCRAPE_BUDGET))
            .collect()
            .await
    }

    /// One server's `/metrics` page (empty if it does not answer in time).
    async fn scrape(&self, url: &str) -> String {
        match self
            .http
            .get(format!("{url}/metrics"))
            .timeout(Duration::from_millis(500))
            .send()
            .await
        {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        }
    }

    /// Requests the routers hold for deployments with no ready server
    /// (Knative's activator reports these, so zero can scale up).
    async fn held(&self, snap: &Snapshot) -> BTreeMap<String, f64> {
        let ask = |url: String| async move {
            let resp = self
                .http
                .get(format!("{url}/p15/held"))
                .timeout(Duration::from_millis(500))
                .send()
                .await
                .ok()?;
            resp.json::<BTreeMap<String, f64>>().await.ok()
        };
        let answers =
            futures_util::future::join_all(snap.routers.iter().map(|r| ask(r.url.clone()))).await;
        let mut out: BTreeMap<String, f64> = BTreeMap::new();
        for (d, n) in answers.into_iter().flatten().flatten() {
            *out.entry(d).or_default() += n;
        }
        out
    }
}

/// One metric family: its TYPE line and a sample per label value.
fn family(o: &mut String, name: &str, kind: &str, label: &str, rows: Vec<(String, String)>) {
    use std::fmt::Write;
    let _ = writeln!(o, "# TYPE {name} {kind}");
    for (l, v) in rows {
        match label.is_empty() {
            true => {
                let _ = writeln!(o, "{name} {v}");
            }
            false => {
                let _ = writeln!(o, "{name}{{{label}=\"{l}\"}} {v}");
            }
        }
    }
}

/// The controller's `/metrics` page (Prometheus text).
pub fn render_metrics(r: &Report) -> String {
    let mut o = String::new();
    let one = |v: String| vec![(String::new(), v)];
    let by_dep = |f: &dyn Fn(&Decision) -> String| -> Vec<(String, String)> {
        r.decisions
            .iter()
            .map(|(d, dec)| (d.clone(), f(dec)))
            .collect()
    };
    family(
        &mut o,
        "p15_controller_leader",
        "gauge",
        "",
        one((r.leader as u8).to_string()),
    );
    family(
        &mut o,
        "p15_reconcile_total",
        "counter",
        "",
        one(r.reconciles.to_string()),
    );
    let secs = format!("{:.6}", r.reconcile_seconds_sum);
    family(
        &mut o,
        "p15_reconcile_seconds_sum",
        "counter",
        "",
        one(secs),
    );
    let actions = r
        .actions
        .iter()
        .map(|(k, n)| (k.to_string(), n.to_string()))
        .collect();
    family(
        &mut o,
        "p15_reconcile_actions_total",
        "counter",
        "action",
        actions,
    );
    family(
        &mut o,
        "p15_fenced_out_total",
        "counter",
        "",
        one(r.fenced_out.to_string()),
    );
    let dep = "deployment";
    family(
        &mut o,
        "p15_replicas_desired",
        "gauge",
        dep,
        by_dep(&|d| d.desired.to_string()),
    );
    family(
        &mut o,
        "p15_autoscaler_panic",
        "gauge",
        dep,
        by_dep(&|d| (d.panicking as u8).to_string()),
    );
    family(
        &mut o,
        "p15_autoscaler_stable_value",
        "gauge",
        dep,
        by_dep(&|d| format!("{:.3}", d.stable_value)),
    );
    family(
        &mut o,
        "p15_autoscaler_panic_value",
        "gauge",
        dep,
        by_dep(&|d| format!("{:.3}", d.panic_value)),
    );
    let counts =
        |m: &BTreeMap<String, u32>| m.iter().map(|(d, n)| (d.clone(), n.to_string())).collect();
    family(&mut o, "p15_replicas_ready", "gauge", dep, counts(&r.ready));
    family(&mut o, "p15_servers", "gauge", dep, counts(&r.servers));
    let metric = r
        .metric_value
        .iter()
        .map(|(d, v)| (d.clone(), format!("{v:.3}")))
        .collect();
    family(&mut o, "p15_autoscaler_metric", "gauge", dep, metric);
    o
}

/// The controller's HTTP face: `/` (the live page), `/metrics` (the
/// fleet, Prometheus text) and `/status` (each node's servers, JSON).
pub async fn serve_http(
    id: String,
    report: Arc<Mutex<Report>>,
    listener: tokio::net::TcpListener,
) -> anyhow::Result<()> {
    use axum::routing::get;
    let r1 = report.clone();
    let r0 = report.clone();
    let app = axum::Router::new()
        .route(
            "/",
            get(move || {
                let r = r0.lock().unwrap_or_else(|p| p.into_inner());
                let page = crate::dashboard::html(&id, r.leader, &r.history, r.snapshot.as_ref());
                drop(r);
                async move { axum::response::Html(page) }
            }),
        )
        .route(
            "/metrics",
            get(move || {
                // Rendered under the lock: no copy of the history and snapshot.
                let text = render_metrics(&r1.lock().unwrap_or_else(|p| p.into_inner()));
                async move { text }
            }),
        )
        .route(
            "/status",
            get(move || {
                let json = status_json(&report.lock().unwrap_or_else(|p| p.into_inner()));
                async move { axum::Json(json) }
            }),
        );
    axum::serve(listener, app).await?;
    Ok(())
}

/// Each deployment's desired and ready count, and each server where it runs.
pub fn status_json(r: &Report) -> serde_json::Value {
    let servers: Vec<serde_json::Value> = r
        .snapshot
        .iter()
        .flat_map(|s| {
            s.assignments.iter().map(|a| {
                let st = s.servers.get(&a.id);
                serde_json::json!({
                    "id": a.id, "deployment": a.deployment, "role": a.role.as_str(), "node": a.node,
                    "generation": a.generation, "drain": a.drain,
                    "phase": st.map(|s| format!("{:?}", s.phase)).unwrap_or_else(|| "Assigned".into()),
                    "url": st.and_then(|s| s.url.clone()),
                    "cold_start_ms": st.and_then(|s| s.cold_start_ms),
                })
            })
        })
        .collect();
    let deployments: serde_json::Map<String, serde_json::Value> = r
        .decisions
        .iter()
        .map(|(d, dec)| {
            (
                d.clone(),
                serde_json::json!({
                    "desired": dec.desired, "panicking": dec.panicking,
                    "ready": r.ready.get(d).copied().unwrap_or(0),
                    "metric": r.metric_value.get(d).copied().unwrap_or(0.0),
                }),
            )
        })
        .collect();
    serde_json::json!({ "leader": r.leader, "deployments": deployments, "servers": servers })
}

//! The node agent: one per host. It registers its node under an etcd
//! lease, runs the servers assigned to it as child processes, reports
//! each one's phase under the same lease, and drains a server before it
//! stops it.
//!
//! ```text
//! every tick (250 ms):
//!   renew the lease (expired: a new lease, node and statuses put again)
//!   read /assign/<node>/...
//!   new assignment            -> spawn `p15_platform server ...`  (Starting)
//!                                (or `prefill`, `decode`, `proxy`: Project
//!                                14's, in the generation's namespace)
//!   Starting and /health 200  -> Ready (cold start = spawn to 200; a
//!                                proxy also sees a prefill and a decode
//!                                worker on its /metrics)
//!   assignment drained        -> Draining; after drain_delay, SIGTERM
//!                                (the server refuses new requests with 503
//!                                and finishes its streams, then exits)
//!   child exited              -> Stopped (drained) or Failed
//!   assignment removed        -> kill the child if it still runs, drop its status
//! ```
//!
//! The drain delay is Kubernetes' preStop pause: the controller has
//! already taken the server's endpoint out, and routers need a moment to
//! see it before the server starts refusing.
//!
//! Children die with the agent (PR_SET_PDEATHSIG): a dead agent's lease
//! runs out, the controller places its servers elsewhere, and no orphan
//! keeps serving behind nobody's back.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use p14_distributed::cluster::{free_port, spawn, Proc};
use p14_distributed::etcd::{Etcd, EtcdError};

use crate::reconcile::Role;
use crate::state::{
    assign_key, node_key, server_key, Assignment, NodeRecord, Reported, ServerStatus, ASSIGN,
};

#[derive(Clone, Debug)]
pub struct AgentConfig {
    pub node: String,
    pub capacity: u32,
    /// Where its servers listen.
    pub host: String,
    pub etcd: Vec<String>,
    pub ttl_s: i64,
    /// The binary whose `server` subcommand runs a model server (this one).
    pub exe: PathBuf,
    /// Between a drain and SIGTERM: routers' time to see the endpoint go.
    pub drain_delay: Duration,
    /// Seconds a draining server's streams get before it is killed.
    pub shutdown_grace_s: u64,
    pub log_dir: PathBuf,
    /// Where to publish each server's phase changes (NATS), if anywhere.
    pub nats: Option<String>,
}

/// The NATS subject of server phase changes (a [`ServerStatus`] as JSON).
pub const EVENTS: &str = "inference-lab.p15.events";

#[derive(Debug)]
struct Child {
    proc: Proc,
    role: Role,
    url: String,
    spawned: Instant,
    status: ServerStatus,
    /// When SIGTERM is due (set by a drain), and whether it was sent.
    term_at: Option<Instant>,
    termed: bool,
}

#[derive(Debug)]
pub struct Agent {
    cfg: AgentConfig,
    etcd: Etcd,
    http: reqwest::Client,
    lease: Option<i64>,
    children: BTreeMap<String, Child>,
    /// Servers that exited: (last status). Not restarted: the controller
    /// removes the assignment and, if still wanted, starts a new id.
    exited: BTreeMap<String, ServerStatus>,
    /// Statuses as last written (only changes are written).
    written: BTreeMap<String, ServerStatus>,
    events: Option<async_nats::Client>,
}

impl Agent {
    pub fn new(cfg: AgentConfig) -> Agent {
        let etcd = Etcd::new(cfg.etcd.clone(), Duration::from_secs(2));
        Agent {
            cfg,
            etcd,
            http: reqwest::Client::new(),
            lease: None,
            children: BTreeMap::new(),
            exited: BTreeMap::new(),
            written: BTreeMap::new(),
            events: None,
        }
    }

    /// Run until the process is stopped (errors reaching etcd are retried).
    pub async fn run(mut self) -> anyhow::Result<()> {
        std::fs::create_dir_all(&self.cfg.log_dir)
            .with_context(|| format!("creating {}", self.cfg.log_dir.display()))?;
        if let Some(url) = &self.cfg.nats {
            // Events are a hint for watchers (the demo's timeline), not a
            // dependency: without NATS the agent runs as before.
            let c = async_nats::ConnectOptions::new()
                .connection_timeout(Duration::from_secs(2))
                .connect(url.as_str())
                .await;
            match c {
                Ok(c) => self.events = Some(c),
                Err(e) => eprintln!(
                    "node agent {}: no NATS at {url} ({e}); no events",
                    self.cfg.node
                ),
            }
        }
        println!("node agent {} ready", self.cfg.node);
        loop {
            if let Err(e) = self.tick().await {
                eprintln!("node agent {}: {e}", self.cfg.node);
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    async fn register(&mut self) -> Result<i64, EtcdError> {
        if let Some(l) = self.lease {
            match self.etcd.keep_alive(l).await {
                Ok(_) => return Ok(l),
                Err(EtcdError::LeaseExpired(_)) => {}
                Err(e) => return Err(e),
            }
        }
        let l = self.etcd.grant(self.cfg.ttl_s).await?;
        let rec = NodeRecord {
            id: self.cfg.node.clone(),
            capacity: self.cfg.capacity,
            host: self.cfg.host.clone(),
        };
        let v = serde_json::to_vec(&rec).unwrap_or_default();
        self.etcd
            .put(&node_key(&self.cfg.node), &v, Some(l))
            .await?;
        self.lease = Some(l);
        self.written.clear(); // the old lease took them: write all again
        Ok(l)
    }

    pub async fn tick(&mut self) -> anyhow::Result<()> {
        let lease = self.register().await?;
        let prefix = format!("{ASSIGN}{}/", self.cfg.node);
        let (kvs, _) = self.etcd.get_prefix(&prefix).await?;
        let assigned: BTreeMap<String, Assignment> = kvs
            .iter()
            .filter_map(|kv| serde_json::from_slice::<Assignment>(&kv.value).ok())
            .filter(|a| kv_matches(&prefix, a))
            .map(|a| (a.id.clone(), a))
            .collect();
        for (id, a) in &assigned {
            if !self.children.contains_key(id) && !self.exited.contains_key(id) && !a.drain {
                let st = match self.start(a) {
                    Ok(()) => continue,
                    Err(e) => ServerStatus {
                        id: id.clone(),
                        node: self.cfg.node.clone(),
                        phase: Reported::Failed,
                        url: None,
                        pid: None,
                        cold_start_ms: None,
                        detail: format!("{e:#}"),
                    },
                };
                self.exited.insert(id.clone(), st);
            }
        }
        self.watch_children(&assigned).await;
        // Removed assignments: kill what still runs, forget what exited.
        let gone: Vec<String> = self
            .children
            .keys()
            .filter(|id| !assigned.contains_key(*id))
            .cloned()
            .collect();
        for id in gone {
            if let Some(mut c) = self.children.remove(&id) {
                c.proc.kill();
            }
        }
        self.exited.retain(|id, _| assigned.contains_key(id));
        self.publish(lease).await
    }

    fn start(&mut self, a: &Assignment) -> anyhow::Result<()> {
        let port = free_port(&self.cfg.host)?;
        let log = self.cfg.log_dir.join(format!("{}.log", a.id));
        let out =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let err = out.try_clone()?;
        let load = p10_quant::serve::LoadArgs::of(a.weights).to_args();
        let mut cmd = Command::new(&self.cfg.exe);
        let (host, port) = (self.cfg.host.as_str(), port.to_string());
        let grace = self.cfg.shutdown_grace_s.to_string();
        match a.role {
            Role::Server => {
                cmd.arg("server")
                    .args(["--model", &a.model])
                    .args(&load)
                    .args(["--served-model-name", &a.deployment]);
            }
            // Project 14's processes take their own arguments after `--`.
            Role::Prefill | Role::Decode => {
                cmd.args([a.role.as_str(), "--"])
                    .args(["--model", &a.model])
                    .args(&load)
                    .args(["--id", &a.id, "--namespace", &a.namespace()]);
            }
            Role::Proxy => {
                cmd.args(["proxy", "--"])
                    .args(["--model", &a.model])
                    .args(["--served-model-name", &a.deployment])
                    .args(["--namespace", &a.namespace()]);
            }
        }
        if a.role != Role::Server {
            cmd.args(["--etcd", &self.cfg.etcd.join(",")]);
            if let Some(nats) = &self.cfg.nats {
                cmd.args(["--nats", nats]);
            }
        }
        cmd.args(["--host", host, "--port", &port])
            .args(["--shutdown-grace-s", &grace])
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        let proc = spawn(&a.id, cmd, None)?;
        let url = format!("http://{host}:{port}");
        let status = ServerStatus {
            id: a.id.clone(),
            node: self.cfg.node.clone(),
            phase: Reported::Starting,
            url: Some(url.clone()),
            pid: Some(proc.pid()),
            cold_start_ms: None,
            detail: format!("log {}", log.display()),
        };
        self.children.insert(
            a.id.clone(),
            Child {
                proc,
                role: a.role,
                url,
                spawned: Instant::now(),
                status,
                term_at: None,
                termed: false,
            },
        );
        Ok(())
    }

    async fn watch_children(&mut self, assigned: &BTreeMap<String, Assignment>) {
        let mut exited = Vec::new();
        for (id, c) in self.children.iter_mut() {
            if let Ok(Some(code)) = c.proc.child.try_wait() {
                c.status.phase = match c.status.phase {
                    Reported::Draining => Reported::Stopped,
                    _ => Reported::Failed,
                };
                c.status.detail = format!("exited ({code})");
                exited.push(id.clone());
                continue;
            }
            let drain = assigned.get(id).is_some_and(|a| a.drain);
            if drain && c.status.phase != Reported::Draining {
                c.status.phase = Reported::Draining;
                c.term_at = Some(Instant::now() + self.cfg.drain_delay);
            }
            if let Some(at) = c.term_at {
                if !c.termed && Instant::now() >= at {
                    c.proc.signal(libc::SIGTERM);
                    c.termed = true;
                }
            }
            if c.status.phase == Reported::Starting {
                let health = self
                    .http
                    .get(format!("{}/health", c.url))
                    .timeout(Duration::from_millis(500))
                    .send()
                    .await;
                let mut ready = health.is_ok_and(|r| r.status().is_success());
                if ready && c.role == Role::Proxy {
                    ready = proxy_sees_workers(&self.http, &c.url).await;
                }
                if ready {
                    c.status.phase = Reported::Ready;
                    c.status.cold_start_ms = Some(c.spawned.elapsed().as_millis() as u64);
                }
            }
        }
        for id in exited {
            if let Some(c) = self.children.remove(&id) {
                self.exited.insert(id, c.status.clone());
            }
        }
    }

    /// Write the statuses that changed; delete those of removed servers.
    async fn publish(&mut self, lease: i64) -> anyhow::Result<()> {
        let now: BTreeMap<String, ServerStatus> = self
            .children
            .iter()
            .map(|(id, c)| (id.clone(), c.status.clone()))
            .chain(self.exited.iter().map(|(id, s)| (id.clone(), s.clone())))
            .collect();
        for (id, st) in &now {
            if self.written.get(id) != Some(st) {
                let v = serde_json::to_vec(st)?;
                self.etcd.put(&server_key(id), &v, Some(lease)).await?;
                let changed = self.written.get(id).is_none_or(|w| w.phase != st.phase);
                if let (true, Some(nc)) = (changed, &self.events) {
                    let _ = nc.publish(EVENTS, v.clone().into()).await;
                }
                self.written.insert(id.clone(), st.clone());
            }
        }
        let stale: BTreeSet<String> = self
            .written
            .keys()
            .filter(|id| !now.contains_key(*id))
            .cloned()
            .collect();
        for id in stale {
            self.etcd.delete(&server_key(&id)).await?;
            self.written.remove(&id);
        }
        Ok(())
    }
}

/// Whether a proxy's `/metrics` counts at least one prefill and one
/// decode worker (before that it can only fail requests).
async fn proxy_sees_workers(http: &reqwest::Client, url: &str) -> bool {
    let text = match http
        .get(format!("{url}/metrics"))
        .timeout(Duration::from_millis(500))
        .send()
        .await
    {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => return false,
    };
    let workers = |role: &str| {
        let name = format!("p14_proxy_workers{{role=\"{role}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(name.as_str()))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    workers("prefill") > 0 && workers("decode") > 0
}

/// An assignment is this node's only if its key says so.
fn kv_matches(prefix: &str, a: &Assignment) -> bool {
    assign_key(&a.node, &a.id).starts_with(prefix)
}

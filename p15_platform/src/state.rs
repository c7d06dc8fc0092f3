//! The actual state in etcd, and one consistent read of all of it.
//!
//! ```text
//! /inference-lab/p15/deployments/<name>         desired (apply)            no lease
//! /inference-lab/p15/nodes/<node>               NodeRecord  (node agent)   agent's lease
//! /inference-lab/p15/assign/<node>/<server>     Assignment  (controller)   no lease, fenced
//! /inference-lab/p15/servers/<server>           ServerStatus (node agent)  agent's lease
//! /inference-lab/p15/endpoints/<deployment>/<server>  URL (controller)     no lease, fenced
//! /inference-lab/p15/routers/<router>           RouterRecord (router)      router's lease
//! /inference-lab/p15/leader                     controller id              leader's lease
//! ```
//!
//! What a process writes under its lease vanishes when it dies (its lease
//! runs out), so a dead node agent's node and servers disappear from the
//! next snapshot by themselves. The controller's writes carry no lease
//! (they outlive a leader change) but are fenced: each is a transaction
//! that holds only while the writer's leader key is the one it created.
//!
//! One range read over the root is a snapshot at a single revision:
//! desired and actual state are never read at two different moments.

use std::collections::BTreeMap;

use p14_distributed::etcd::{Etcd, EtcdError, Kv};
use serde::{Deserialize, Serialize};

use crate::reconcile::{self, Node, Phase, Role, Server, Want};
use crate::spec::{ModelDeployment, Roles, Weights};
use crate::store::{self, StoreError, Stored, ROOT};

pub const NODES: &str = "/inference-lab/p15/nodes/";
pub const ASSIGN: &str = "/inference-lab/p15/assign/";
pub const SERVERS: &str = "/inference-lab/p15/servers/";
pub const ENDPOINTS: &str = "/inference-lab/p15/endpoints/";
pub const ROUTERS: &str = "/inference-lab/p15/routers/";
pub const LEADER: &str = "/inference-lab/p15/leader";

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub id: String,
    /// Servers it can host at once.
    pub capacity: u32,
    /// The address its servers listen on (a namespace's, or loopback).
    pub host: String,
}

/// What a server is to run: written by the leader, read by its node's agent.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Assignment {
    pub id: String,
    pub deployment: String,
    pub generation: u64,
    /// A co-located server, or one of Project 14's prefill worker, decode
    /// worker or proxy (absent in records written before roles: a server).
    #[serde(default)]
    pub role: Role,
    pub node: String,
    pub model: String,
    pub weights: Weights,
    /// Stop admitting, finish the streams, stop.
    pub drain: bool,
}

impl Assignment {
    /// The etcd namespace a prefill/decode deployment's generation
    /// registers its workers in: its proxies see those workers only (K/V
    /// made by one model file or weight format is garbage to another).
    pub fn namespace(&self) -> String {
        format!("p15-{}-g{}", self.deployment, self.generation)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reported {
    /// Started, loading its weights (`/health` answers 503).
    Starting,
    Ready,
    Draining,
    /// Exited after a drain.
    Stopped,
    /// Exited unasked, or could not start.
    Failed,
}

/// A server as its node agent sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerStatus {
    pub id: String,
    pub node: String,
    pub phase: Reported,
    /// Its base URL once it listens.
    pub url: Option<String>,
    /// Its process (on its node).
    pub pid: Option<u32>,
    /// From spawn to `/health` 200: the cold start (weights, warm-up).
    pub cold_start_ms: Option<u64>,
    pub detail: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouterRecord {
    pub id: String,
    pub url: String,
}

pub fn node_key(node: &str) -> String {
    format!("{NODES}{node}")
}
pub fn assign_key(node: &str, server: &str) -> String {
    format!("{ASSIGN}{node}/{server}")
}
pub fn server_key(server: &str) -> String {
    format!("{SERVERS}{server}")
}
pub fn endpoint_key(deployment: &str, server: &str) -> String {
    format!("{ENDPOINTS}{deployment}/{server}")
}

/// A deployment's generation: what its servers run (model, weights,
/// roles), hashed (FNV-1a, 32 bits): a change of replicas or autoscaling
/// keeps it, a change of weights or model file starts a rollout.
pub fn generation(d: &ModelDeployment) -> u64 {
    let roles = match d.roles {
        Roles::Colocated => "colocated".to_string(),
        Roles::Disaggregated { prefill, decode } => format!("p{prefill}d{decode}"),
    };
    let text = format!("{}|{:?}|{roles}", d.model, d.weights);
    let mut h: u32 = 0x811c_9dc5;
    for b in text.bytes() {
        h ^= b as u32;
        h = h.wrapping_mul(0x0100_0193);
    }
    h as u64
}

/// Everything under the root at one revision.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub revision: i64,
    pub deployments: Vec<Stored>,
    pub nodes: Vec<NodeRecord>,
    pub assignments: Vec<Assignment>,
    pub servers: BTreeMap<String, ServerStatus>,
    /// By deployment: (server, URL).
    pub endpoints: BTreeMap<String, Vec<(String, String)>>,
    pub routers: Vec<RouterRecord>,
    /// The leader key as read (its value and creation revision).
    pub leader: Option<(String, i64)>,
    /// Keys whose values could not be read (shown by `status`).
    pub unreadable: Vec<String>,
}

fn json<T: for<'a> Deserialize<'a>>(kv: &Kv, bad: &mut Vec<String>) -> Option<T> {
    let v = serde_json::from_slice(&kv.value).ok();
    if v.is_none() {
        bad.push(kv.key.clone());
    }
    v
}

impl Snapshot {
    /// Servers assigned and not stopped or failed (starting, ready or
    /// draining): what the fleet runs.
    pub fn running(&self) -> usize {
        self.assignments
            .iter()
            .filter(|a| {
                !matches!(
                    self.servers.get(&a.id).map(|st| st.phase),
                    Some(Reported::Stopped | Reported::Failed)
                )
            })
            .count()
    }

    /// `deployment`'s published endpoints (what routers send to).
    pub fn ready(&self, deployment: &str) -> usize {
        self.endpoints.get(deployment).map_or(0, Vec::len)
    }

    pub async fn read(etcd: &Etcd) -> Result<Snapshot, EtcdError> {
        let (kvs, revision) = etcd.get_prefix(ROOT).await?;
        let mut s = Snapshot {
            revision,
            ..Snapshot::default()
        };
        let mut bad = Vec::new();
        for kv in &kvs {
            let k = kv.key.as_str();
            if k.starts_with(store::PREFIX) {
                match store::decode(k, &kv.value, kv.mod_revision) {
                    Ok(d) => s.deployments.push(d),
                    Err(StoreError::Stored { .. }) | Err(_) => bad.push(k.to_string()),
                }
            } else if k.starts_with(NODES) {
                s.nodes.extend(json(kv, &mut bad));
            } else if k.starts_with(ASSIGN) {
                s.assignments.extend(json::<Assignment>(kv, &mut bad));
            } else if k.starts_with(SERVERS) {
                if let Some(st) = json::<ServerStatus>(kv, &mut bad) {
                    s.servers.insert(st.id.clone(), st);
                }
            } else if let Some(rest) = k.strip_prefix(ENDPOINTS) {
                if let Some((dep, server)) = rest.split_once('/') {
                    let url = String::from_utf8_lossy(&kv.value).to_string();
                    s.endpoints
                        .entry(dep.to_string())
                        .or_default()
                        .push((server.to_string(), url));
                }
            } else if k.starts_with(ROUTERS) {
                s.routers.extend(json(kv, &mut bad));
            } else if k == LEADER {
                let id = String::from_utf8_lossy(&kv.value).to_string();
                s.leader = Some((id, kv.create_revision));
            }
        }
        s.unreadable = bad;
        Ok(s)
    }

    /// The live nodes, as the reconcile step takes them.
    pub fn live_nodes(&self) -> Vec<Node> {
        self.nodes
            .iter()
            .map(|n| Node {
                id: n.id.clone(),
                capacity: n.capacity,
            })
            .collect()
    }

    /// Each assignment with what its agent reports, as the reconcile step
    /// takes them: an exited server is `Failed` (removed; replaced if
    /// still wanted), a drained one `Draining` until it exits, one not
    /// reported yet `Starting`.
    pub fn actual(&self) -> Vec<Server> {
        self.assignments
            .iter()
            .map(|a| {
                let reported = self.servers.get(&a.id).map(|s| s.phase);
                let phase = match reported {
                    Some(Reported::Stopped | Reported::Failed) => Phase::Failed,
                    _ if a.drain => Phase::Draining,
                    Some(Reported::Ready) => Phase::Ready,
                    Some(Reported::Draining) => Phase::Draining,
                    Some(Reported::Starting) | None => Phase::Starting,
                };
                Server {
                    id: a.id.clone(),
                    deployment: a.deployment.clone(),
                    generation: a.generation,
                    role: a.role,
                    node: a.node.clone(),
                    phase,
                }
            })
            .collect()
    }

    pub fn deployment(&self, name: &str) -> Option<&ModelDeployment> {
        self.deployments
            .iter()
            .map(|s| &s.deployment)
            .find(|d| d.name == name)
    }

    /// An assigned server as `status` and the page show it: its phase
    /// (`Assigned` before its agent reports), cold start and URL.
    pub fn shown(&self, a: &Assignment) -> (String, String, String) {
        let st = self.servers.get(&a.id);
        let phase = match (a.drain, st.map(|s| s.phase)) {
            (_, Some(p)) => format!("{p:?}"),
            (true, None) => "Draining".into(),
            (false, None) => "Assigned".into(),
        };
        let cold = st
            .and_then(|s| s.cold_start_ms)
            .map_or("-".into(), |ms| format!("{:.2} s", ms as f64 / 1e3));
        let url = st.and_then(|s| s.url.clone()).unwrap_or_default();
        (phase, cold, url)
    }

    pub fn assignment(&self, id: &str) -> Option<&Assignment> {
        self.assignments.iter().find(|a| a.id == id)
    }

    /// The ready, not draining servers (and proxies) of each deployment,
    /// with URLs; prefill and decode workers are their proxies' business.
    pub fn ready_endpoints(&self) -> BTreeMap<String, Vec<(String, String)>> {
        let mut out: BTreeMap<String, Vec<(String, String)>> = BTreeMap::new();
        for a in self
            .assignments
            .iter()
            .filter(|a| !a.drain && a.role.serves())
        {
            if let Some(ServerStatus {
                phase: Reported::Ready,
                url: Some(url),
                ..
            }) = self.servers.get(&a.id)
            {
                out.entry(a.deployment.clone())
                    .or_default()
                    .push((a.id.clone(), url.clone()));
            }
        }
        out
    }
}

/// The wants for the reconcile step: each deployment at `replicas[name]`
/// (the autoscaler's count; `min` where it has none yet), split into its
/// roles' wants where it declares roles.
pub fn wants(s: &Snapshot, replicas: &BTreeMap<String, u32>) -> Vec<Want> {
    s.deployments
        .iter()
        .flat_map(|st| {
            let d = &st.deployment;
            let n = replicas.get(&d.name).copied().unwrap_or(d.replicas.min);
            let n = n.clamp(d.replicas.min, d.replicas.max);
            reconcile::wants_of(&d.name, generation(d), d.roles, n, d.rollout)
        })
        .collect()
}

/// Each server, where it runs and how it is doing (`status`).
pub fn servers_table(s: &Snapshot) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "{:<32} {:<14} {:<8} {:<10} {:<9} {:>10}  URL",
        "SERVER", "DEPLOYMENT", "ROLE", "NODE", "PHASE", "COLD START"
    );
    for a in &s.assignments {
        let (phase, cold, url) = s.shown(a);
        let _ = writeln!(
            o,
            "{:<32} {:<14} {:<8} {:<10} {:<9} {:>10}  {url}",
            a.id,
            a.deployment,
            a.role.as_str(),
            a.node,
            phase,
            cold
        );
    }
    let nodes: Vec<String> = s
        .nodes
        .iter()
        .map(|n| format!("{} ({})", n.id, n.capacity))
        .collect();
    let leader = s
        .leader
        .as_ref()
        .map_or("none".into(), |(id, _)| id.clone());
    let _ = writeln!(o, "nodes: {}; leader: {leader}", nodes.join(", "));
    o
}

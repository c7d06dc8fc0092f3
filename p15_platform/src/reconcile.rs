//! The controller's reconcile step: desired and actual state in, the
//! actions that make them agree out.
//!
//! It is a pure function of what etcd holds now (Kubernetes' level-
//! triggered reconcile): recomputed from scratch every time, never from
//! the events the controller happened to see, so a missed or repeated
//! event changes nothing. Once a plan's actions are in the state, the same
//! plan again is empty (idempotent). Server ids are chosen
//! deterministically (`<deployment>-g<generation>-<n>`, the smallest free
//! `n`), so two plans made from one state start the same server, and a
//! node agent told twice to start it starts it once.
//!
//! ```text
//! for each deployment and role:
//!   servers on dead nodes, failed servers       -> remove (replaced below)
//!   no rollout in progress:                      start or drain to the count
//!   a rollout (servers of an older generation):  start new ones while
//!       new < count and new + old < count + max_surge;
//!     drain old ones (not ready first) while
//!       ready (new + old) - 1 >= count - max_unavailable
//!   prefill/decode workers of an older generation: drain once no proxy
//!       of their generation runs (its streams use them to the end)
//! servers of deleted deployments                 -> drain
//! a start goes to the live node with the most free capacity
//! ```
//!
//! A co-located deployment wants `replicas` servers. One split into
//! roles `{prefill: p, decode: d}` wants `p * replicas` prefill workers,
//! `d * replicas` decode workers and `replicas` proxies (Project 14's),
//! each its own process placed on its own; the proxies are its endpoints.
//! Servers and proxies both serve: when a deployment changes from one
//! shape to the other, the old ones are the rollout's old generation.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::spec::{Roles, Rollout};

/// What a server process is to its deployment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// A co-located server: prefill and decode in one process.
    #[default]
    Server,
    /// Project 14's prefill worker.
    Prefill,
    /// Project 14's decode worker.
    Decode,
    /// Project 14's proxy in front of its generation's workers.
    Proxy,
}

impl Role {
    /// A server or a proxy: an endpoint clients are routed to.
    pub fn serves(self) -> bool {
        matches!(self, Role::Server | Role::Proxy)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Server => "server",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Proxy => "proxy",
        }
    }
}

/// A live node (its agent's lease holds) and how many servers it hosts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    pub id: String,
    pub capacity: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Starting,
    Ready,
    /// Stops admitting, finishes its streams, then is stopped.
    Draining,
    Failed,
}

/// A server as its node agent reports it (or as assigned, not yet
/// reported: `Starting`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Server {
    pub id: String,
    pub deployment: String,
    pub generation: u64,
    pub role: Role,
    pub node: String,
    pub phase: Phase,
}

/// A deployment's desired state: its generation (what its servers must
/// run) and replica count (the autoscaler's, within min and max).
#[derive(Clone, Debug, PartialEq)]
pub struct Want {
    pub name: String,
    pub generation: u64,
    pub role: Role,
    pub replicas: u32,
    pub rollout: Rollout,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    Start {
        id: String,
        deployment: String,
        generation: u64,
        role: Role,
        node: String,
    },
    Drain {
        id: String,
    },
    Remove {
        id: String,
    },
}

/// The wants of deployment `name` at `replicas`: one for a co-located
/// deployment; prefill, decode and proxy for one split into roles.
pub fn wants_of(
    name: &str,
    generation: u64,
    roles: Roles,
    replicas: u32,
    rollout: Rollout,
) -> Vec<Want> {
    let want = |role, replicas| Want {
        name: name.to_string(),
        generation,
        role,
        replicas,
        rollout,
    };
    match roles {
        Roles::Colocated => vec![want(Role::Server, replicas)],
        Roles::Disaggregated { prefill, decode } => vec![
            want(Role::Prefill, prefill.saturating_mul(replicas)),
            want(Role::Decode, decode.saturating_mul(replicas)),
            want(Role::Proxy, replicas),
        ],
    }
}

/// What a plan could not do (shown by `status`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pending {
    pub deployment: String,
    pub unplaced: u32,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub actions: Vec<Action>,
    pub pending: Vec<Pending>,
}

fn server_id(deployment: &str, generation: u64, role: Role, n: u32) -> String {
    match role {
        Role::Server => format!("{deployment}-g{generation}-{n}"),
        r => format!("{deployment}-g{generation}-{}-{n}", r.as_str()),
    }
}

/// Whether `s` counts toward `w`: its deployment, and its role (servers
/// and proxies alike: either serves the deployment).
fn belongs(s: &Server, w: &Want) -> bool {
    s.deployment == w.name && (s.role == w.role || (s.role.serves() && w.role.serves()))
}

/// A server id's `n` (ids not made here sort first), so that `-10`
/// counts as newer than `-2`.
fn ordinal(id: &str) -> (u64, &str) {
    let n = id.rsplit('-').next().and_then(|n| n.parse().ok());
    (n.unwrap_or(0), id)
}

/// The `n` servers to drain when there are too many: not-ready ones
/// first, then the newest (highest number).
fn extras<'a>(servers: &[&'a Server], n: u32) -> Vec<&'a Server> {
    let mut v = servers.to_vec();
    v.sort_by_key(|s| (s.phase == Phase::Ready, std::cmp::Reverse(ordinal(&s.id))));
    v.truncate(n as usize);
    v
}

/// The plan for `wants` given `servers` on live `nodes`.
pub fn plan(wants: &[Want], servers: &[Server], nodes: &[Node]) -> Plan {
    let live: BTreeSet<&str> = nodes.iter().map(|n| n.id.as_str()).collect();
    let mut p = Plan::default();
    // Servers each node hosts, draining ones included (they still run).
    let mut load: BTreeMap<&str, u32> = nodes.iter().map(|n| (n.id.as_str(), 0)).collect();
    let mut gone: BTreeSet<&str> = BTreeSet::new();
    for s in servers {
        if !live.contains(s.node.as_str()) || s.phase == Phase::Failed {
            p.actions.push(Action::Remove { id: s.id.clone() });
            gone.insert(&s.id);
        } else if let Some(l) = load.get_mut(s.node.as_str()) {
            *l += 1;
        }
    }
    let active = |s: &&Server| !gone.contains(s.id.as_str()) && s.phase != Phase::Draining;
    let taken: BTreeSet<&str> = servers.iter().map(|s| s.id.as_str()).collect();
    // A generation's workers stay while one of its proxies runs (draining
    // included: its streams still decode on them).
    let proxies: BTreeSet<(&str, u64)> = servers
        .iter()
        .filter(|p| p.role == Role::Proxy && !gone.contains(p.id.as_str()))
        .map(|p| (p.deployment.as_str(), p.generation))
        .collect();
    let proxied = |dep: &str, generation: u64| proxies.contains(&(dep, generation));
    // Ids this plan starts (a set: one lookup per start, whatever the size).
    let mut planned: BTreeSet<String> = BTreeSet::new();
    for w in wants {
        let mine: Vec<&Server> = servers
            .iter()
            .filter(|s| belongs(s, w))
            .filter(active)
            .collect();
        let (new, old): (Vec<&Server>, Vec<&Server>) =
            mine.iter().partition(|s| s.generation == w.generation);
        let ready = |v: &[&Server]| v.iter().filter(|s| s.phase == Phase::Ready).count() as u32;
        let (n_new, n_old) = (new.len() as u32, old.len() as u32);
        let mut start = 0;
        let mut drain: Vec<&Server> = Vec::new();
        if !w.role.serves() {
            // Workers: the proxies' rollout paces the generations.
            start = w.replicas.saturating_sub(n_new);
            drain.extend(extras(&new, n_new.saturating_sub(w.replicas)));
            drain.extend(old.iter().filter(|s| !proxied(&w.name, s.generation)));
        } else if old.is_empty() {
            if n_new < w.replicas {
                start = w.replicas - n_new;
            } else {
                drain.extend(extras(&new, n_new - w.replicas));
            }
        } else {
            let surge_room = (w.replicas + w.rollout.max_surge).saturating_sub(n_new + n_old);
            start = w.replicas.saturating_sub(n_new).min(surge_room);
            if n_new > w.replicas {
                drain.extend(extras(&new, n_new - w.replicas));
            }
            let min_available = w.replicas.saturating_sub(w.rollout.max_unavailable);
            let mut available = ready(&new) + ready(&old);
            let mut olds = old.clone();
            olds.sort_by_key(|s| (s.phase == Phase::Ready, s.id.clone()));
            for s in olds {
                if s.phase != Phase::Ready {
                    drain.push(s); // serves nothing yet: replaced freely
                } else if available > min_available {
                    drain.push(s);
                    available -= 1;
                } else {
                    break;
                }
            }
        }
        p.actions.extend(
            drain
                .into_iter()
                .map(|s| Action::Drain { id: s.id.clone() }),
        );
        let mut n = 0;
        let mut unplaced = 0;
        for _ in 0..start {
            let node = nodes
                .iter()
                .filter(|nd| load.get(nd.id.as_str()).copied().unwrap_or(0) < nd.capacity)
                .max_by_key(|nd| {
                    let free = nd.capacity - load.get(nd.id.as_str()).copied().unwrap_or(0);
                    (free, std::cmp::Reverse(nd.id.as_str()))
                });
            let Some(node) = node else {
                unplaced += 1;
                continue;
            };
            let id = |n| server_id(&w.name, w.generation, w.role, n);
            let mut next = id(n);
            while taken.contains(next.as_str()) || planned.contains(&next) {
                n += 1;
                next = id(n);
            }
            planned.insert(next.clone());
            p.actions.push(Action::Start {
                id: next,
                deployment: w.name.clone(),
                generation: w.generation,
                role: w.role,
                node: node.id.clone(),
            });
            *load.entry(node.id.as_str()).or_default() += 1;
        }
        if unplaced > 0 {
            p.pending.push(Pending {
                deployment: w.name.clone(),
                unplaced,
            });
        }
    }
    // Servers no want counts: their deployment was deleted, or changed
    // shape (its workers leave once their proxies have).
    for s in servers.iter().filter(active) {
        let wanted = wants.iter().any(|w| belongs(s, w));
        let held = !s.role.serves() && proxied(&s.deployment, s.generation);
        if !wanted && !held {
            p.actions.push(Action::Drain { id: s.id.clone() });
        }
    }
    p
}

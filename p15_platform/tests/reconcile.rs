//! The reconcile step on scripted states: it places by free capacity and
//! is idempotent (the same state gives the same plan; a state with the
//! plan in it gives none); it replaces failed servers and servers on dead
//! nodes; it scales down not-ready servers first; a rolling update keeps
//! the availability its rollout settings promise at every step and ends
//! with only the new generation; a deleted deployment drains. A
//! deployment split into prefill and decode roles gets its workers and
//! proxies, placed each on its own; its rollout keeps a generation's
//! workers while a proxy of that generation runs; a change of shape rolls
//! servers into proxies; a deleted one drains its proxies, then their
//! workers.

use p15_platform::reconcile::{plan, wants_of, Action, Node, Phase, Plan, Role, Server, Want};
use p15_platform::spec::{Roles, Rollout};

fn nodes(caps: &[(&str, u32)]) -> Vec<Node> {
    caps.iter()
        .map(|(id, c)| Node {
            id: id.to_string(),
            capacity: *c,
        })
        .collect()
}

fn want(replicas: u32, generation: u64, surge: u32, unavailable: u32) -> Want {
    Want {
        name: "m".into(),
        generation,
        role: Role::Server,
        replicas,
        rollout: Rollout {
            max_surge: surge,
            max_unavailable: unavailable,
        },
    }
}

/// What the node agents do with a plan: start (Starting), drain, remove.
fn apply(p: &Plan, servers: &mut Vec<Server>) {
    for a in &p.actions {
        match a {
            Action::Start {
                id,
                deployment,
                generation,
                role,
                node,
            } => {
                assert!(servers.iter().all(|s| s.id != *id), "{id} started twice");
                servers.push(Server {
                    id: id.clone(),
                    deployment: deployment.clone(),
                    generation: *generation,
                    role: *role,
                    node: node.clone(),
                    phase: Phase::Starting,
                });
            }
            Action::Drain { id } => {
                let s = servers
                    .iter_mut()
                    .find(|s| s.id == *id)
                    .expect("drains a server");
                s.phase = Phase::Draining;
            }
            Action::Remove { id } => servers.retain(|s| s.id != *id),
        }
    }
}

/// Time passes: started servers are ready, drained ones have stopped.
fn tick(servers: &mut Vec<Server>) {
    servers.retain(|s| s.phase != Phase::Draining);
    for s in servers.iter_mut() {
        if s.phase == Phase::Starting {
            s.phase = Phase::Ready;
        }
    }
}

fn starts(p: &Plan) -> Vec<(&str, &str)> {
    p.actions
        .iter()
        .filter_map(|a| match a {
            Action::Start { id, node, .. } => Some((id.as_str(), node.as_str())),
            _ => None,
        })
        .collect()
}

#[test]
fn a_new_deployment_is_placed_by_free_capacity_and_the_plan_is_idempotent() {
    let n = nodes(&[("a", 2), ("b", 3)]);
    let w = [want(4, 1, 1, 0)];
    let mut servers = Vec::new();
    let p = plan(&w, &servers, &n);
    assert_eq!(p, plan(&w, &servers, &n), "one state, one plan");
    assert_eq!(
        starts(&p),
        [
            ("m-g1-0", "b"),
            ("m-g1-1", "a"),
            ("m-g1-2", "b"),
            ("m-g1-3", "a")
        ]
    );
    apply(&p, &mut servers);
    assert_eq!(plan(&w, &servers, &n), Plan::default(), "nothing twice");
    tick(&mut servers);
    assert_eq!(plan(&w, &servers, &n), Plan::default());
}

#[test]
fn failed_servers_and_servers_on_dead_nodes_are_replaced() {
    let mut n = nodes(&[("a", 4), ("b", 4)]);
    let w = [want(4, 1, 1, 0)];
    let mut servers = Vec::new();
    apply(&plan(&w, &servers, &n), &mut servers);
    tick(&mut servers);
    servers[0].phase = Phase::Failed;
    n.retain(|x| x.id != "b"); // b's lease expired
    let p = plan(&w, &servers, &n);
    let want_removed = servers
        .iter()
        .filter(|s| s.node == "b" || s.phase == Phase::Failed)
        .count();
    let removed = p
        .actions
        .iter()
        .filter(|a| matches!(a, Action::Remove { .. }))
        .count();
    assert_eq!(removed, want_removed);
    assert!(starts(&p).iter().all(|(_, node)| *node == "a"));
    apply(&p, &mut servers);
    tick(&mut servers);
    let live = servers
        .iter()
        .filter(|s| s.node == "a" && s.phase == Phase::Ready)
        .count();
    assert_eq!(live, 4);
    assert_eq!(plan(&w, &servers, &n), Plan::default());
}

#[test]
fn scaling_down_drains_servers_not_ready_first() {
    let n = nodes(&[("a", 8)]);
    let mut servers = Vec::new();
    apply(&plan(&[want(2, 1, 1, 0)], &servers, &n), &mut servers);
    tick(&mut servers);
    apply(&plan(&[want(4, 1, 1, 0)], &servers, &n), &mut servers); // two starting
    let p = plan(&[want(2, 1, 1, 0)], &servers, &n);
    let drained: Vec<_> = p
        .actions
        .iter()
        .map(|a| match a {
            Action::Drain { id } => servers.iter().find(|s| s.id == *id).unwrap().phase,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(drained, [Phase::Starting, Phase::Starting]);
}

/// Roll generation 1 to 2 with (surge, unavailable); the availability
/// and surge bounds hold at every step, and it ends on generation 2 alone.
fn roll(replicas: u32, surge: u32, unavailable: u32) {
    let n = nodes(&[("a", 4), ("b", 4)]);
    let mut servers = Vec::new();
    apply(
        &plan(&[want(replicas, 1, surge, unavailable)], &servers, &n),
        &mut servers,
    );
    tick(&mut servers);
    let w = [want(replicas, 2, surge, unavailable)];
    for step in 0..50 {
        let p = plan(&w, &servers, &n);
        apply(&p, &mut servers);
        let running = servers.iter().filter(|s| s.phase != Phase::Draining);
        assert!(
            running.count() as u32 <= replicas + surge,
            "step {step}: more than the surge"
        );
        let ready = servers.iter().filter(|s| s.phase == Phase::Ready).count() as u32;
        assert!(
            ready + unavailable >= replicas,
            "step {step}: {ready} ready"
        );
        tick(&mut servers);
        if servers
            .iter()
            .all(|s| s.generation == 2 && s.phase == Phase::Ready)
            && servers.len() as u32 == replicas
        {
            assert_eq!(plan(&w, &servers, &n), Plan::default());
            return;
        }
    }
    panic!("the rollout did not finish: {servers:?}");
}

#[test]
fn a_rolling_update_keeps_every_replica_serving_with_surge_one() {
    roll(3, 1, 0);
}

#[test]
fn a_rolling_update_with_no_surge_goes_one_down_at_a_time() {
    roll(3, 0, 1);
}

#[test]
fn a_deleted_deployment_drains_and_a_full_fleet_reports_what_it_could_not_place() {
    let n = nodes(&[("a", 2)]);
    let mut servers = Vec::new();
    let p = plan(&[want(3, 1, 1, 0)], &servers, &n);
    assert_eq!(starts(&p).len(), 2);
    assert_eq!(p.pending.len(), 1);
    assert_eq!(p.pending[0].unplaced, 1);
    apply(&p, &mut servers);
    let p = plan(&[], &servers, &n);
    assert_eq!(p.actions.len(), 2);
    assert!(p.actions.iter().all(|a| matches!(a, Action::Drain { .. })));
}

#[test]
fn scaling_down_drains_the_newest_by_number_not_by_spelling() {
    let n = nodes(&[("a", 16)]);
    let mut servers = Vec::new();
    apply(&plan(&[want(11, 1, 1, 0)], &servers, &n), &mut servers);
    tick(&mut servers);
    let p = plan(&[want(9, 1, 1, 0)], &servers, &n);
    assert_eq!(
        p.actions,
        [
            Action::Drain {
                id: "m-g1-10".into()
            },
            Action::Drain {
                id: "m-g1-9".into()
            }
        ]
    );
}

const SURGE_ONE: Rollout = Rollout {
    max_surge: 1,
    max_unavailable: 0,
};

fn split(generation: u64, prefill: u32, decode: u32, replicas: u32) -> Vec<Want> {
    let roles = Roles::Disaggregated { prefill, decode };
    wants_of("m", generation, roles, replicas, SURGE_ONE)
}

fn count(servers: &[Server], role: Role, generation: u64) -> usize {
    servers
        .iter()
        .filter(|s| s.role == role && s.generation == generation && s.phase != Phase::Draining)
        .count()
}

#[test]
fn a_split_deployment_gets_its_workers_and_proxies_each_placed_on_its_own() {
    let n = nodes(&[("a", 4), ("b", 4)]);
    let w = split(1, 1, 2, 2);
    let mut servers = Vec::new();
    let p = plan(&w, &servers, &n);
    apply(&p, &mut servers);
    assert_eq!(count(&servers, Role::Prefill, 1), 2);
    assert_eq!(count(&servers, Role::Decode, 1), 4);
    assert_eq!(count(&servers, Role::Proxy, 1), 2);
    // Spread by free capacity: 4 on each node.
    let on_a = servers.iter().filter(|s| s.node == "a").count();
    assert_eq!(on_a, 4, "{servers:?}");
    let ids: std::collections::BTreeSet<&str> = servers.iter().map(|s| s.id.as_str()).collect();
    assert!(
        ids.contains("m-g1-prefill-0")
            && ids.contains("m-g1-decode-1")
            && ids.contains("m-g1-proxy-1")
    );
    assert_eq!(plan(&w, &servers, &n), Plan::default(), "idempotent");
    tick(&mut servers);
    assert_eq!(
        plan(&w, &servers, &n),
        Plan::default(),
        "idempotent once ready"
    );
}

/// Every proxy that runs (ready or draining) has its generation's
/// prefill and decode workers, not draining.
fn proxies_have_workers(servers: &[Server], step: usize) {
    for p in servers.iter().filter(|s| s.role == Role::Proxy) {
        for role in [Role::Prefill, Role::Decode] {
            assert!(
                count(servers, role, p.generation) > 0,
                "step {step}: proxy {} ({:?}) has no {role:?} worker of its generation: {servers:?}",
                p.id,
                p.phase
            );
        }
    }
}

#[test]
fn a_split_rollout_keeps_each_generations_workers_while_its_proxies_run() {
    let n = nodes(&[("a", 8), ("b", 8)]);
    let mut servers = Vec::new();
    apply(&plan(&split(1, 1, 1, 2), &servers, &n), &mut servers);
    tick(&mut servers);
    let w = split(2, 1, 1, 2);
    for step in 0..50 {
        let p = plan(&w, &servers, &n);
        apply(&p, &mut servers);
        proxies_have_workers(&servers, step);
        let ready = |s: &&Server| s.role == Role::Proxy && s.phase == Phase::Ready;
        assert!(
            servers.iter().filter(ready).count() >= 2,
            "step {step}: fewer than 2 proxies serve: {servers:?}"
        );
        tick(&mut servers);
        if servers.iter().all(|s| s.generation == 2) {
            assert_eq!(servers.len(), 6, "{servers:?}");
            assert_eq!(plan(&w, &servers, &n), Plan::default());
            return;
        }
    }
    panic!("the rollout did not finish: {servers:?}");
}

#[test]
fn a_colocated_deployment_split_into_roles_rolls_its_servers_into_proxies() {
    let n = nodes(&[("a", 8), ("b", 8)]);
    let mut servers = Vec::new();
    let colocated = wants_of("m", 1, Roles::Colocated, 2, SURGE_ONE);
    apply(&plan(&colocated, &servers, &n), &mut servers);
    tick(&mut servers);
    let w = split(2, 1, 1, 2);
    for step in 0..50 {
        apply(&plan(&w, &servers, &n), &mut servers);
        let serving = servers
            .iter()
            .filter(|s| s.role.serves() && s.phase == Phase::Ready)
            .count();
        assert!(serving >= 2, "step {step}: {serving} serve: {servers:?}");
        tick(&mut servers);
        if servers.iter().all(|s| s.role != Role::Server) && count(&servers, Role::Proxy, 2) == 2 {
            assert_eq!(plan(&w, &servers, &n), Plan::default());
            return;
        }
    }
    panic!("the change of shape did not finish: {servers:?}");
}

#[test]
fn a_deleted_split_deployment_drains_its_proxies_then_their_workers() {
    let n = nodes(&[("a", 8)]);
    let mut servers = Vec::new();
    apply(&plan(&split(1, 1, 1, 1), &servers, &n), &mut servers);
    tick(&mut servers);
    let p = plan(&[], &servers, &n);
    assert_eq!(
        p.actions,
        [Action::Drain {
            id: "m-g1-proxy-0".into()
        }],
        "the workers wait for their proxy's streams"
    );
    apply(&p, &mut servers);
    assert_eq!(plan(&[], &servers, &n), Plan::default(), "still draining");
    tick(&mut servers);
    let p = plan(&[], &servers, &n);
    assert_eq!(p.actions.len(), 2, "{p:?}");
    assert!(p.actions.iter().all(|a| matches!(a, Action::Drain { .. })));
}

/// The largest state the bounds allow (`MAX_DEPLOYMENTS` deployments of
/// `MAX_PROCESSES` processes each: half co-located, half split into the
/// most workers per role, on as many nodes as they need), planned from
/// nothing and then with the plan carried out: each plan within a tenth
/// of the controller's default 3 s lease, so no spec can make a tick
/// outlive the lease.
#[test]
fn the_largest_state_the_bounds_allow_plans_well_within_a_lease() {
    use p15_platform::spec::{MAX_DEPLOYMENTS, MAX_PROCESSES, MAX_WORKERS_PER_ROLE};
    let rollout = Rollout {
        max_surge: 1,
        max_unavailable: 0,
    };
    let per_split = 1 + 2 * MAX_WORKERS_PER_ROLE;
    let wants: Vec<Want> = (0..MAX_DEPLOYMENTS)
        .flat_map(|d| match d % 2 {
            0 => wants_of(
                &format!("m{d}"),
                1,
                Roles::Colocated,
                MAX_PROCESSES,
                rollout,
            ),
            _ => wants_of(
                &format!("m{d}"),
                1,
                Roles::Disaggregated {
                    prefill: MAX_WORKERS_PER_ROLE,
                    decode: MAX_WORKERS_PER_ROLE,
                },
                MAX_PROCESSES / per_split,
                rollout,
            ),
        })
        .collect();
    let total: u32 = wants.iter().map(|w| w.replicas).sum();
    let ids: Vec<String> = (0..total.div_ceil(256)).map(|i| format!("n{i}")).collect();
    let caps: Vec<(&str, u32)> = ids.iter().map(|id| (id.as_str(), 256)).collect();
    let nodes = nodes(&caps);
    let mut servers = Vec::new();
    let t0 = std::time::Instant::now();
    let p = plan(&wants, &servers, &nodes);
    let first = t0.elapsed();
    assert_eq!(starts(&p).len() as u32, total, "every process placed");
    apply(&p, &mut servers);
    tick(&mut servers);
    let t1 = std::time::Instant::now();
    let again = plan(&wants, &servers, &nodes);
    let second = t1.elapsed();
    eprintln!(
        "{total} processes on {} nodes: planned in {first:?}, then {second:?}",
        nodes.len()
    );
    assert!(
        again.actions.is_empty(),
        "the carried-out plan plans nothing"
    );
    for t in [first, second] {
        assert!(
            t < std::time::Duration::from_millis(300),
            "a plan took {t:?}"
        );
    }
}

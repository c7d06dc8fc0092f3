//! Project 15: the platform. A declared [`spec::ModelDeployment`] (YAML)
//! is written to etcd as the desired state ([`store`]); the autoscaler
//! ([`kpa`], Knative's KPA rules) turns the fleet's load into a replica
//! count. In progress: node agents, the leader-elected controller that
//! reconciles desired against actual state, the router, rollouts, the
//! dashboard and the demo.
//!
//!   cargo run --release -p p15_platform -- apply -f p15_platform/examples/smollm2.yaml --etcd http://127.0.0.1:2379

pub mod kpa;
pub mod reconcile;
pub mod spec;
pub mod store;

//! Project 15: the platform. A declared [`spec::ModelDeployment`] (YAML)
//! is written to etcd as the desired state ([`store`]); the autoscaler
//! ([`kpa`], Knative's KPA rules) turns the fleet's load into a replica
//! count. Node agents ([`agent`]) run the model servers (Project 10's
//! `serve`, the README's server) a
//! leader-elected controller ([`controller`], [`election`]) assigns by
//! reconciling desired against actual state ([`reconcile`], [`state`]);
//! the router ([`router`]) follows the endpoints the controller publishes;
//! [`ops`] is what `apply`, `get`, `delete` and `status` do.
//! The controller serves a live page ([`dashboard`]); [`demo`] runs it
//! all on one machine ([`local`], [`clients`]); [`route_bench`] measures
//! the router's policies, [`scale_bench`] the autoscaler against Ray
//! Serve's ([`measure`]: replica-seconds, flaps). For Kubernetes: the
//! same deployment as a custom resource ([`crd`]) and an operator
//! ([`operator`]) that reconciles it into a Deployment and a Service.
//!
//!   cargo run --release -p p15_platform -- apply -f p15_platform/examples/smollm2.yaml --etcd http://127.0.0.1:2379

pub mod agent;
pub mod clients;
pub mod controller;
pub mod crd;
pub mod dashboard;
#[cfg(feature = "bench")]
pub mod demo;
pub mod election;
pub mod kpa;
pub mod local;
#[cfg(feature = "bench")]
pub mod measure;
pub mod operator;
pub mod ops;
pub mod reconcile;
#[cfg(feature = "bench")]
pub mod route_bench;
pub mod router;
#[cfg(feature = "bench")]
pub mod scale_bench;
pub mod spec;
pub mod state;
pub mod store;
pub mod ttft;

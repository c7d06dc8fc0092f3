//! Project 14: prefill and decode on separate workers, processes and
//! hosts. Workers find each other through etcd (leases, a watched
//! prefix), report load and cached blocks through NATS, and move a
//! prompt's K/V over a framed TCP protocol of their own; a proxy speaks
//! the OpenAI API in front. See the crate README for the protocol.

#[cfg(feature = "bench")]
pub mod bench_hosts;
#[cfg(feature = "bench")]
pub mod bench_itl;
#[cfg(feature = "bench")]
pub mod bench_migrate;
#[cfg(feature = "bench")]
pub mod bench_ratios;
#[cfg(feature = "bench")]
pub mod bench_transfer;
pub mod cluster;
pub mod etcd;
pub mod events;
pub mod frames;
pub mod kv_client;
pub mod kv_server;
pub mod live;
#[cfg(feature = "bench")]
pub mod mooncake;
pub mod netns;
pub mod protocol;
pub mod proxy;
pub mod proxy_serve;
pub mod registry;
pub mod routing;
pub mod supervise;
pub mod tap;
pub mod wire;
pub mod worker;
pub mod worker_pull;
pub mod worker_serve;

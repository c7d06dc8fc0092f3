//! Worlds of ranks as threads of the test process: over channels, loopback
//! TCP and shared memory.

#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use p13_multi_gpu::{shm, tcp, threads, Algorithm, Communicator};

const DEADLINE: Duration = Duration::from_secs(30);

fn shared<C: Communicator + 'static>(cs: Vec<C>) -> Vec<Arc<dyn Communicator>> {
    cs.into_iter()
        .map(|c| Arc::new(c) as Arc<dyn Communicator>)
        .collect()
}

pub fn threads_world(world: usize) -> Vec<Arc<dyn Communicator>> {
    shared(threads::group(world, DEADLINE, Algorithm::default()))
}

pub fn tcp_world(world: usize) -> Vec<Arc<dyn Communicator>> {
    shared(tcp::loopback_group(world, DEADLINE, Algorithm::default()).unwrap())
}

pub fn shm_world(world: usize) -> Vec<Arc<dyn Communicator>> {
    shared(shm::group(world, DEADLINE).unwrap())
}

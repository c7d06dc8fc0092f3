//! A communicator that can be replaced while the model that calls it
//! stays loaded: rank 0's projections hold this one, and when a rank is
//! lost and the world is rebuilt, the new communicator goes in here.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use crate::comm::{CommError, CommStats, Communicator};

#[derive(Debug)]
pub struct SwapComm {
    inner: RwLock<Arc<dyn Communicator>>,
}

impl SwapComm {
    pub fn new(inner: Arc<dyn Communicator>) -> SwapComm {
        SwapComm {
            inner: RwLock::new(inner),
        }
    }

    /// Put `next` in (the old one is dropped with its links).
    pub fn replace(&self, next: Arc<dyn Communicator>) {
        *self.inner.write().unwrap_or_else(|e| e.into_inner()) = next;
    }

    fn get(&self) -> Arc<dyn Communicator> {
        self.inner.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl Communicator for SwapComm {
    fn rank(&self) -> usize {
        self.get().rank()
    }
    fn world(&self) -> usize {
        self.get().world()
    }
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CommError> {
        self.get().all_reduce_sum(buf)
    }
    fn all_gather(&self, mine: &[f32], all: &mut [f32]) -> Result<(), CommError> {
        self.get().all_gather(mine, all)
    }
    fn broadcast(&self, root: usize, bytes: &mut Vec<u8>) -> Result<(), CommError> {
        self.get().broadcast(root, bytes)
    }
    fn broadcast_wait(
        &self,
        root: usize,
        bytes: &mut Vec<u8>,
        wait: Option<Duration>,
    ) -> Result<(), CommError> {
        self.get().broadcast_wait(root, bytes, wait)
    }
    fn barrier(&self) -> Result<(), CommError> {
        self.get().barrier()
    }
    fn send(&self, to: usize, bytes: &[u8]) -> Result<(), CommError> {
        self.get().send(to, bytes)
    }
    fn recv(&self, from: usize, bytes: &mut Vec<u8>) -> Result<(), CommError> {
        self.get().recv(from, bytes)
    }
    fn stats(&self) -> CommStats {
        self.get().stats()
    }
    fn broken(&self) -> Option<String> {
        self.get().broken()
    }
}

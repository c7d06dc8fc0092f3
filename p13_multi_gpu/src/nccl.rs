//! NCCL behind the same [`Communicator`]: ranks are GPUs, the collectives
//! NVIDIA's (cudarc's `nccl`, loaded at run time, so this builds and its
//! other tests run on machines with no CUDA).
//!
//! Buffers are host memory, as the trait's are: each call copies its
//! values to the GPU, runs the collective on the rank's stream, waits for
//! it within the deadline (polling an event recorded after it, so a dead
//! peer is a [`CommError::Timeout`], not a hang) and copies the result
//! back. Messages whose length a receiver cannot know (broadcast,
//! send/recv) go as a length first, then the bytes.
//!
//! The library: cudarc opens `libnccl.so` (or a CUDA-versioned name),
//! never `libnccl.so.2`, the one name NVIDIA's pip wheel ships;
//! `scripts/fetch_assets.sh nccl` unpacks the wheel into
//! `assets/nccl/lib` with a `libnccl.so` link beside it, and that folder
//! must be on `LD_LIBRARY_PATH` when the process starts (the loader reads
//! it only then). [`probe`] says so instead of cudarc's panic.
//!
//! Summation order: NCCL's own (ring or tree, by size and topology), not
//! [`crate::comm::reference_sum`]'s, so TP over NCCL is not bitwise equal
//! to TP over the other backends once W > 1. At W = 1 it is the identity.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cudarc::nccl::safe::{Comm, Id, ReduceOp};

use crate::comm::{CommError, CommStats, Communicator, Op, Seen};

/// Where `scripts/fetch_assets.sh nccl` puts the library.
pub fn fetched_dir() -> std::path::PathBuf {
    common::assets::workspace_root().join("assets/nccl/lib")
}

/// The CUDA driver and NCCL as cudarc will open them, or why not.
pub fn probe() -> Result<(), CommError> {
    p03_gpu_kernel::probe::driver().map_err(|e| usage(0, e.to_string()))?;
    let names = p03_gpu_kernel::probe::candidates("nccl");
    if p03_gpu_kernel::probe::first_loadable(&names).is_none() {
        return Err(usage(
            0,
            format!(
                "NCCL not found (tried {}): run `bash scripts/fetch_assets.sh nccl` and start with LD_LIBRARY_PATH={}",
                names.join(", "),
                fetched_dir().display()
            ),
        ));
    }
    Ok(())
}

fn usage(rank: usize, what: String) -> CommError {
    CommError::Usage { rank, what }
}

/// One rank's NCCL communicator.
pub struct NcclComm {
    rank: usize,
    world: usize,
    deadline: Duration,
    inner: Mutex<Inner>,
    seen: Seen,
}

struct Inner {
    comm: Comm,
    stream: Arc<CudaStream>,
    seq: u64,
    stats: CommStats,
    broken: Option<String>,
}

// SAFETY: an NCCL communicator may be used from any thread as long as
// calls on it do not overlap; every use goes through `inner`'s lock.
unsafe impl Send for Inner {}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish()
    }
}

impl NcclComm {
    /// Rank `rank` of `world` on GPU `ordinal`, all ranks given the same
    /// `id` (made by one rank with [`Id::new`] and sent to the others).
    pub fn new(
        rank: usize,
        world: usize,
        ordinal: usize,
        id: Id,
        deadline: Duration,
    ) -> Result<NcclComm, CommError> {
        probe()?;
        let ctx =
            CudaContext::new(ordinal).map_err(|e| usage(rank, format!("GPU {ordinal}: {e}")))?;
        let stream = ctx.default_stream();
        let comm = Comm::from_rank(stream.clone(), rank, world, id)
            .map_err(|e| usage(rank, format!("ncclCommInitRank: {e:?}")))?;
        Ok(NcclComm {
            rank,
            world,
            deadline,
            inner: Mutex::new(Inner {
                comm,
                stream,
                seq: 0,
                stats: CommStats::default(),
                broken: None,
            }),
            seen: Seen::default(),
        })
    }

    /// A world of one on GPU 0 (NCCL refuses two ranks on one GPU).
    pub fn single(deadline: Duration) -> Result<NcclComm, CommError> {
        probe()?;
        let id = Id::new().map_err(|e| usage(0, format!("ncclGetUniqueId: {e:?}")))?;
        NcclComm::new(0, 1, 0, id, deadline)
    }

    /// Run `f` (which enqueues work on the stream), then wait for it
    /// within `wait` (None: as long as it takes).
    fn call<R>(
        &self,
        op: Op,
        bytes: u64,
        wait_for: Option<Duration>,
        f: impl FnOnce(&mut Inner) -> Result<R, String>,
    ) -> Result<R, CommError> {
        let mut st = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(first) = &st.broken {
            return Err(CommError::Broken {
                rank: self.rank,
                first: first.clone(),
            });
        }
        st.seq += 1;
        let seq = st.seq;
        let t0 = Instant::now();
        let r = f(&mut st).and_then(|v| wait(&st.stream, wait_for).map(|()| v));
        st.stats.seconds += t0.elapsed().as_secs_f64();
        let r = match r {
            Ok(v) => {
                st.stats.calls += 1;
                st.stats.bytes_sent += bytes;
                Ok(v)
            }
            Err(what) if what == TIMED_OUT => Err(CommError::Timeout {
                rank: self.rank,
                peer: usize::MAX,
                op,
                seq,
                deadline: self.deadline,
            }),
            Err(what) => Err(usage(self.rank, format!("{op:?} #{seq}: {what}"))),
        };
        if let Err(e) = &r {
            st.broken = Some(e.to_string());
        }
        self.seen.publish(st.stats, &st.broken);
        r
    }
}

const TIMED_OUT: &str = "timed out";

/// Wait for the stream's work so far, within `deadline` (None: no limit).
fn wait(stream: &Arc<CudaStream>, deadline: Option<Duration>) -> Result<(), String> {
    let ev = stream.record_event(None).map_err(|e| e.to_string())?;
    let until = deadline.map(|d| Instant::now() + d);
    while !ev.is_complete() {
        if until.is_some_and(|u| Instant::now() >= u) {
            return Err(TIMED_OUT.into());
        }
        std::thread::sleep(Duration::from_micros(20));
    }
    Ok(())
}

fn up<T: cudarc::driver::DeviceRepr>(st: &Inner, v: &[T]) -> Result<CudaSlice<T>, String> {
    st.stream.clone_htod(v).map_err(|e| e.to_string())
}

/// The device's `d` into `v`, once the stream's work is done within
/// `limit` (the copy itself would wait with no limit).
fn down<T: cudarc::driver::DeviceRepr>(
    st: &Inner,
    d: &CudaSlice<T>,
    v: &mut [T],
    limit: Option<Duration>,
) -> Result<(), String> {
    wait(&st.stream, limit)?;
    st.stream.memcpy_dtoh(d, v).map_err(|e| e.to_string())
}

fn nccl<T>(r: Result<T, cudarc::nccl::result::NcclError>) -> Result<(), String> {
    r.map(|_| ()).map_err(|e| format!("NCCL: {e:?}"))
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CommError> {
        let bytes = (buf.len() * 4) as u64;
        self.call(Op::AllReduce, bytes, Some(self.deadline), |st| {
            if buf.is_empty() {
                return Ok(());
            }
            let mut d = up(st, buf)?;
            nccl(st.comm.all_reduce_in_place(&mut d, &ReduceOp::Sum))?;
            down(st, &d, buf, Some(self.deadline))
        })
    }

    fn all_gather(&self, mine: &[f32], all: &mut [f32]) -> Result<(), CommError> {
        if all.len() != mine.len() * self.world {
            return Err(usage(
                self.rank,
                format!("all-gather of {} values into {}", mine.len(), all.len()),
            ));
        }
        self.call(
            Op::AllGather,
            (mine.len() * 4) as u64,
            Some(self.deadline),
            |st| {
                if mine.is_empty() {
                    return Ok(());
                }
                let d_in = up(st, mine)?;
                let mut d_out = st
                    .stream
                    .alloc_zeros::<f32>(all.len())
                    .map_err(|e| e.to_string())?;
                nccl(st.comm.all_gather(&d_in, &mut d_out))?;
                down(st, &d_out, all, Some(self.deadline))
            },
        )
    }

    fn broadcast(&self, root: usize, bytes: &mut Vec<u8>) -> Result<(), CommError> {
        self.broadcast_wait(root, bytes, Some(self.deadline))
    }

    fn broadcast_wait(
        &self,
        root: usize,
        bytes: &mut Vec<u8>,
        limit: Option<Duration>,
    ) -> Result<(), CommError> {
        if root >= self.world {
            return Err(usage(self.rank, format!("broadcast from rank {root}")));
        }
        let me = self.rank;
        self.call(Op::Broadcast, bytes.len() as u64, limit, |st| {
            let mut len = up(st, &[bytes.len() as u64])?;
            nccl(st.comm.broadcast_in_place(&mut len, root as i32))?;
            let mut n = [0u64];
            down(st, &len, &mut n, limit)?;
            let n =
                usize::try_from(n[0]).map_err(|_| "a length beyond this machine".to_string())?;
            if me != root {
                bytes.resize(n, 0);
            }
            if n == 0 {
                return Ok(());
            }
            let mut d = up(st, bytes)?;
            nccl(st.comm.broadcast_in_place(&mut d, root as i32))?;
            down(st, &d, bytes, limit)
        })
    }

    fn barrier(&self) -> Result<(), CommError> {
        let mut one = [0f32];
        self.call(Op::Barrier, 0, Some(self.deadline), |st| {
            let mut d = up(st, &one)?;
            nccl(st.comm.all_reduce_in_place(&mut d, &ReduceOp::Sum))?;
            down(st, &d, &mut one, Some(self.deadline))
        })
    }

    fn send(&self, to: usize, bytes: &[u8]) -> Result<(), CommError> {
        if to >= self.world || to == self.rank {
            return Err(usage(self.rank, format!("send to rank {to}")));
        }
        self.call(Op::Send, bytes.len() as u64, Some(self.deadline), |st| {
            st.stats.sends += 1;
            st.stats.send_bytes += bytes.len() as u64;
            nccl(st.comm.send(&up(st, &[bytes.len() as u64])?, to as i32))?;
            if !bytes.is_empty() {
                nccl(st.comm.send(&up(st, bytes)?, to as i32))?;
            }
            Ok(())
        })
    }

    fn recv(&self, from: usize, bytes: &mut Vec<u8>) -> Result<(), CommError> {
        if from >= self.world || from == self.rank {
            return Err(usage(self.rank, format!("recv from rank {from}")));
        }
        self.call(Op::Send, 0, Some(self.deadline), |st| {
            let mut len = st.stream.alloc_zeros::<u64>(1).map_err(|e| e.to_string())?;
            nccl(st.comm.recv(&mut len, from as i32))?;
            let mut n = [0u64];
            down(st, &len, &mut n, Some(self.deadline))?;
            let n =
                usize::try_from(n[0]).map_err(|_| "a length beyond this machine".to_string())?;
            bytes.resize(n, 0);
            if n > 0 {
                let mut d = st.stream.alloc_zeros::<u8>(n).map_err(|e| e.to_string())?;
                nccl(st.comm.recv(&mut d, from as i32))?;
                down(st, &d, bytes, Some(self.deadline))?;
            }
            Ok(())
        })
    }

    fn stats(&self) -> CommStats {
        self.seen.stats()
    }

    fn broken(&self) -> Option<String> {
        self.seen.broken()
    }
}

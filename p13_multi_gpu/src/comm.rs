//! The communicator: the collectives tensor- and pipeline-parallel ranks
//! call, behind one trait, whatever carries the bytes (threads of one
//! process, TCP between processes or hosts, shared memory, NCCL).
//!
//! Two rules make every backend interchangeable:
//! - **one summation order.** Element i of a buffer is summed left to
//!   right starting at rank i mod W: `((x_c + x_{c+1}) + x_{c+2}) + …`
//!   (ranks mod W, c = i mod W), the order a ring reduce-scatter adds in
//!   when chunk c is the elements ≡ c (mod W). Every backend and algorithm
//!   sums this way ([`reference_sum`]), so tensor parallelism over TCP
//!   equals tensor parallelism over threads bit for bit. And an element's
//!   order depends on its column alone when the buffer is rows whose width
//!   is a multiple of W (a hidden row under tensor parallelism always is:
//!   hidden = heads × head_dim, and W divides the heads), so a token's sums
//!   do not depend on how many rows share its step;
//! - **every collective is numbered.** Each rank counts its collectives;
//!   a frame carries the operation and the count, and a receive checks
//!   both, so ranks that call collectives in different orders get an
//!   error, never a deadlock or a silently wrong sum. Every receive has a
//!   deadline: a dead or stuck rank is an error on every other rank within
//!   bounded time.

use std::fmt;
use std::ops::Range;
use std::time::Duration;

use thiserror::Error;

/// A collective (or point-to-point) operation, as frames name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Op {
    AllReduce = 1,
    AllGather = 2,
    Broadcast = 3,
    Barrier = 4,
    /// A point-to-point message (pipeline stages); numbered per pair of
    /// ranks, not with the collectives.
    Send = 5,
}

impl Op {
    pub fn from_u8(b: u8) -> Option<Op> {
        Some(match b {
            1 => Op::AllReduce,
            2 => Op::AllGather,
            3 => Op::Broadcast,
            4 => Op::Barrier,
            5 => Op::Send,
            _ => return None,
        })
    }
}

/// Why a collective failed. After any of these the communicator is broken
/// (its links may hold half a frame): every later call is [`CommError::Broken`].
#[derive(Debug, Error)]
pub enum CommError {
    #[error("rank {rank}: no word from rank {peer} within {deadline:?} during {op:?} #{seq}")]
    Timeout {
        rank: usize,
        peer: usize,
        op: Op,
        seq: u64,
        deadline: Duration,
    },
    #[error("rank {rank}: the link to rank {peer} broke during {op:?} #{seq}: {detail}")]
    PeerGone {
        rank: usize,
        peer: usize,
        op: Op,
        seq: u64,
        detail: String,
    },
    #[error("rank {rank}: collectives called out of order: this rank is at {op:?} #{seq}, rank {peer} sent {got}")]
    OutOfOrder {
        rank: usize,
        peer: usize,
        op: Op,
        seq: u64,
        got: String,
    },
    #[error("rank {rank}: {op:?} #{seq}: rank {peer} sent {got} bytes where {want} were expected")]
    Length {
        rank: usize,
        peer: usize,
        op: Op,
        seq: u64,
        got: u64,
        want: u64,
    },
    #[error("handshake with {peer}: {reason}")]
    Handshake { peer: String, reason: String },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("rank {rank}: {what}")]
    Usage { rank: usize, what: String },
    #[error("rank {rank}: the communicator is broken by an earlier error: {first}")]
    Broken { rank: usize, first: String },
}

/// What a communicator has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CommStats {
    /// Collectives and point-to-point calls completed.
    pub calls: u64,
    /// Payload bytes this rank sent.
    pub bytes_sent: u64,
    /// Of those calls, point-to-point sends (a pipeline's hand-offs), and
    /// their bytes.
    pub sends: u64,
    pub send_bytes: u64,
    /// Seconds spent inside calls (waiting for peers included).
    pub seconds: f64,
}

/// A backend's counts and first error as of its last finished call, kept
/// apart from the lock a call holds while it waits: a rank blocked in a
/// collective (a follower waiting for rank 0's next plan) can still be
/// asked for its stats.
#[derive(Debug, Default)]
pub(crate) struct Seen(std::sync::Mutex<(CommStats, Option<String>)>);

impl Seen {
    pub(crate) fn publish(&self, stats: CommStats, broken: &Option<String>) {
        let mut s = self.0.lock().unwrap_or_else(|e| e.into_inner());
        s.0 = stats;
        if s.1.is_none() {
            s.1.clone_from(broken);
        }
    }

    pub(crate) fn stats(&self) -> CommStats {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).0
    }

    pub(crate) fn broken(&self) -> Option<String> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).1.clone()
    }
}

/// The collectives ranks call. `&self` methods: a backend keeps its own
/// state behind a lock, so a model's projections can hold one in an `Arc`.
/// Every rank of the world must make the same calls in the same order.
pub trait Communicator: Send + Sync + fmt::Debug {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;

    /// buf ← Σ over ranks of buf, in the order of [`reference_sum`].
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CommError>;

    /// all (world · mine.len()) ← every rank's `mine`, in rank order.
    fn all_gather(&self, mine: &[f32], all: &mut [f32]) -> Result<(), CommError>;

    /// Every rank's `bytes` ← the root's (any length; a receiver's buffer
    /// is resized).
    fn broadcast(&self, root: usize, bytes: &mut Vec<u8>) -> Result<(), CommError>;

    /// [`Communicator::broadcast`] with its own wait in place of the
    /// deadline (`None`: as long as the link lives): a rank waiting for
    /// rank 0's next command waits while the server is idle, and still
    /// hears at once when rank 0's link breaks.
    fn broadcast_wait(
        &self,
        root: usize,
        bytes: &mut Vec<u8>,
        wait: Option<Duration>,
    ) -> Result<(), CommError>;

    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<(), CommError>;

    /// A message to one rank (a pipeline stage's activations).
    fn send(&self, to: usize, bytes: &[u8]) -> Result<(), CommError>;

    /// The next message from `from` into `bytes` (resized).
    fn recv(&self, from: usize, bytes: &mut Vec<u8>) -> Result<(), CommError>;

    fn stats(&self) -> CommStats;

    /// The error that broke this communicator, if one has.
    fn broken(&self) -> Option<String>;
}

/// Part `c` of `n` items cut into `world` runs (the first runs are never
/// longer than the last: ⌊n·c/world⌋ .. ⌊n·(c+1)/world⌋).
pub fn chunk(n: usize, world: usize, c: usize) -> Range<usize> {
    let at = |c: usize| ((n as u128 * c as u128) / world.max(1) as u128) as usize;
    at(c)..at(c + 1)
}

/// How many of the indices 0..n are ≡ c (mod world): the length of the
/// summation chunk c.
pub fn strided_len(n: usize, world: usize, c: usize) -> usize {
    if c >= n {
        0
    } else {
        (n - c).div_ceil(world.max(1))
    }
}

/// The sum every backend computes: element i is `((x_c + x_{c+1}) + …) +
/// x_{c−1}` over ranks mod W, c = i mod W. The reference the fast paths
/// are tested against; the direct algorithm calls it.
pub fn reference_sum(bufs: &[&[f32]], out: &mut [f32]) {
    reference_sum_from(bufs, 0, out);
}

/// [`reference_sum`] of a piece of a larger buffer: `bufs[r][j]` and
/// `out[j]` are element `first + j` of the whole, whose index sets the
/// order (the shared-memory backend sums a buffer slot by slot).
pub fn reference_sum_from(bufs: &[&[f32]], first: usize, out: &mut [f32]) {
    let w = bufs.len();
    for (j, o) in out.iter_mut().enumerate() {
        let c = (first + j) % w;
        let mut acc = bufs[c][j];
        for k in 1..w {
            acc += bufs[(c + k) % w][j];
        }
        *o = acc;
    }
}
/// f32 values as little-endian bytes (appended to `out`).
pub fn f32_bytes(v: &[f32], out: &mut Vec<u8>) {
    out.reserve(v.len() * 4);
    for x in v {
        out.extend_from_slice(&x.to_le_bytes());
    }
}

/// Little-endian bytes back into f32 values; `bytes` is 4 · out.len() long.
pub fn bytes_f32(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strided_chunks_count_every_index_once() {
        for n in [0, 1, 2, 3, 7, 576, 1001] {
            for w in 1..=5 {
                let total: usize = (0..w).map(|c| strided_len(n, w, c)).sum();
                assert_eq!(total, n, "n {n} world {w}");
                for c in 0..w {
                    assert_eq!(strided_len(n, w, c), (c..n).step_by(w).count());
                }
            }
        }
    }

    #[test]
    fn chunks_tile_the_buffer_for_awkward_sizes() {
        for n in [0, 1, 2, 3, 7, 576, 1001] {
            for w in 1..=5 {
                let mut next = 0;
                for c in 0..w {
                    let r = chunk(n, w, c);
                    assert_eq!(r.start, next);
                    next = r.end;
                }
                assert_eq!(next, n, "n {n} world {w}");
            }
        }
    }

    #[test]
    fn the_reference_order_starts_each_chunk_at_its_own_rank() {
        // Values whose sum depends on the order: 1e8 + 1 - 1e8.
        let (a, b, c) = ([1e8f32; 3], [1.0f32; 3], [-1e8f32; 3]);
        let mut out = [0.0f32; 3];
        reference_sum(&[&a, &b, &c], &mut out);
        // chunk 0: (a + b) + c = 0; chunk 1: (b + c) + a = 0; chunk 2: (c + a) + b = 1.
        assert_eq!(
            out,
            [
                (1e8f32 + 1.0) - 1e8,
                (1.0f32 - 1e8) + 1e8,
                (-1e8f32 + 1e8) + 1.0
            ]
        );
        assert_eq!(out[2], 1.0);
    }
}

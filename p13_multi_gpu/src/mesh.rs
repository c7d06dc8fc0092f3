//! The collectives, written once over any [`Transport`] that moves framed
//! messages between every pair of ranks (threads' channels, TCP sockets).
//! gloo is organised the same way: pairs of endpoints below, algorithms
//! above.
//!
//! All-reduce has two algorithms; both sum in [`reference_sum`]'s order:
//! - **direct**: every rank sends its whole buffer to every other rank and
//!   sums what it receives. One round of messages (latency α), (W−1)·n
//!   bytes out of each rank: best for small buffers (a decode step's
//!   hidden rows);
//! - **ring** (reduce-scatter, then all-gather): 2(W−1) rounds, each
//!   moving one chunk (the elements ≡ c mod W) to the next rank: 2(W−1)/W·n bytes out of
//!   each rank, whatever W is. Best for large buffers (a long prefill).
//!
//! [`Algorithm::Auto`] picks direct up to a size, ring above it.

use std::fmt;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::comm::{
    bytes_f32, f32_bytes, reference_sum, strided_len, CommError, CommStats, Communicator, Op, Seen,
};
use crate::frame::{Expected, Outgoing};

/// Moves frames between this rank and its peers.
pub trait Transport: Send + fmt::Debug {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;

    /// Send every `sends` frame and receive every `recvs` frame,
    /// concurrently (so two ranks sending each other large frames never
    /// wait on each other), each header checked against its
    /// [`Expected`]. No peer may take longer than `deadline` between two
    /// signs of progress.
    fn exchange(
        &mut self,
        sends: &[Outgoing<'_>],
        recvs: &mut [Expected<'_>],
        deadline: Duration,
    ) -> Result<(), CommError>;

    /// Close every link (after an error: the peers then fail at once
    /// instead of waiting out their deadlines).
    fn shutdown(&mut self);
}

/// How an all-reduce moves its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algorithm {
    Direct,
    Ring,
    /// Direct up to `direct_max_bytes` of payload, ring above.
    Auto {
        direct_max_bytes: usize,
    },
}

impl Default for Algorithm {
    /// 256 KiB: where the ring's 2(W−1) rounds start costing less than
    /// the direct algorithm's extra bytes on loopback TCP with W = 3
    /// (n = 4.5 α/β for α ≈ 30 µs, β ≈ 0.5 ns/B; the bench measures both).
    fn default() -> Algorithm {
        Algorithm::Auto {
            direct_max_bytes: 256 << 10,
        }
    }
}

/// A communicator over a transport.
#[derive(Debug)]
pub struct Mesh<T: Transport> {
    rank: usize,
    world: usize,
    deadline: Duration,
    algorithm: Algorithm,
    state: Mutex<State<T>>,
    seen: Seen,
}

#[derive(Debug)]
struct State<T> {
    transport: T,
    /// The next collective's number.
    seq: u64,
    /// Point-to-point messages sent to / received from each rank.
    sent: Vec<u64>,
    received: Vec<u64>,
    /// The first error, once there is one.
    broken: Option<String>,
    stats: CommStats,
    /// Byte buffers kept between calls.
    out: Vec<u8>,
    ins: Vec<Vec<u8>>,
    vals: Vec<Vec<f32>>,
}

impl<T: Transport> Mesh<T> {
    pub fn new(transport: T, deadline: Duration, algorithm: Algorithm) -> Mesh<T> {
        let (rank, world) = (transport.rank(), transport.world());
        Mesh {
            rank,
            world,
            deadline,
            algorithm,
            state: Mutex::new(State {
                transport,
                seq: 0,
                sent: vec![0; world],
                received: vec![0; world],
                broken: None,
                stats: CommStats::default(),
                out: Vec::new(),
                ins: vec![Vec::new(); world],
                vals: vec![Vec::new(); world],
            }),
            seen: Seen::default(),
        }
    }

    /// Run one call: refuse it if broken; count it, time it; on an error
    /// break the communicator and close its links.
    fn call<R>(
        &self,
        bytes_out: u64,
        f: impl FnOnce(&mut State<T>, Duration) -> Result<R, CommError>,
    ) -> Result<R, CommError> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(first) = &st.broken {
            return Err(CommError::Broken {
                rank: self.rank,
                first: first.clone(),
            });
        }
        let t0 = Instant::now();
        let r = f(&mut st, self.deadline);
        st.stats.seconds += t0.elapsed().as_secs_f64();
        match &r {
            Ok(_) => {
                st.stats.calls += 1;
                st.stats.bytes_sent += bytes_out;
            }
            Err(e) => {
                st.broken = Some(e.to_string());
                st.transport.shutdown();
            }
        }
        self.seen.publish(st.stats, &st.broken);
        r
    }

    fn peers(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.world).filter(move |&p| p != self.rank)
    }

    fn usage(&self, what: String) -> CommError {
        CommError::Usage {
            rank: self.rank,
            what,
        }
    }
}

impl<T: Transport> State<T> {
    fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }
}

/// Every rank's whole `payload` to every other rank; theirs into `ins`.
fn direct<T: Transport>(
    st: &mut State<T>,
    rank: usize,
    world: usize,
    op: Op,
    seq: u64,
    deadline: Duration,
) -> Result<(), CommError> {
    let State {
        transport,
        out,
        ins,
        ..
    } = st;
    let len = Some(out.len() as u64);
    let sends: Vec<Outgoing<'_>> = (0..world)
        .filter(|&p| p != rank)
        .map(|peer| Outgoing {
            peer,
            op,
            seq,
            payload: out,
        })
        .collect();
    let mut recvs: Vec<Expected<'_>> = ins
        .iter_mut()
        .enumerate()
        .filter(|(p, _)| *p != rank)
        .map(|(peer, into)| Expected {
            peer,
            op,
            seq,
            len,
            into,
        })
        .collect();
    transport.exchange(&sends, &mut recvs, deadline)
}

impl<T: Transport> Mesh<T> {
    fn all_reduce_direct(&self, buf: &mut [f32]) -> Result<(), CommError> {
        let (rank, world) = (self.rank, self.world);
        let bytes = (buf.len() * 4 * (world - 1)) as u64;
        self.call(bytes, |st, deadline| {
            let seq = st.next_seq();
            st.out.clear();
            f32_bytes(buf, &mut st.out);
            direct(st, rank, world, Op::AllReduce, seq, deadline)?;
            let State { ins, vals, .. } = st;
            for (p, v) in vals.iter_mut().enumerate() {
                v.resize(buf.len(), 0.0);
                if p == rank {
                    v.copy_from_slice(buf);
                } else {
                    bytes_f32(&ins[p], v);
                }
            }
            let all: Vec<&[f32]> = vals.iter().map(|v| v.as_slice()).collect();
            reference_sum(&all, buf);
            Ok(())
        })
    }

    /// Reduce-scatter then all-gather around the ring r → r+1, chunk c
    /// being the elements ≡ c (mod W). In reduce-scatter step s rank r
    /// sends chunk (r − s) and adds its own values into chunk (r − s − 1)
    /// from rank r − 1; after W − 1 steps it holds chunk (r + 1) summed
    /// from rank r + 1 on, in the reference order.
    fn all_reduce_ring(&self, buf: &mut [f32]) -> Result<(), CommError> {
        let (r, w, n) = (self.rank, self.world, buf.len());
        let bytes = (0..2)
            .flat_map(|phase| (0..w - 1).map(move |s| strided_len(n, w, (r + phase + w - s) % w)))
            .sum::<usize>() as u64
            * 4;
        self.call(bytes, |st, deadline| {
            let seq = st.next_seq();
            let (next, prev) = ((r + 1) % w, (r + w - 1) % w);
            let mut got = Vec::new();
            let mut vals: Vec<f32> = Vec::new();
            let mut partial = vec![0.0f32; 0];
            for phase in 0..2 {
                for s in 0..w - 1 {
                    // Phase 0 sends chunk r − s; phase 1 sends the summed
                    // chunk r + 1 − s.
                    let send_c = (r + phase + w - s) % w;
                    let recv_c = (r + phase + w - s - 1) % w;
                    vals.clear();
                    vals.extend(buf.iter().skip(send_c).step_by(w));
                    st.out.clear();
                    f32_bytes(&vals, &mut st.out);
                    let State { transport, out, .. } = st;
                    transport.exchange(
                        &[Outgoing {
                            peer: next,
                            op: Op::AllReduce,
                            seq,
                            payload: out,
                        }],
                        &mut [Expected {
                            peer: prev,
                            op: Op::AllReduce,
                            seq,
                            len: Some(strided_len(n, w, recv_c) as u64 * 4),
                            into: &mut got,
                        }],
                        deadline,
                    )?;
                    partial.resize(strided_len(n, w, recv_c), 0.0);
                    bytes_f32(&got, &mut partial);
                    let mine = buf.iter_mut().skip(recv_c).step_by(w);
                    if phase == 0 {
                        // The partial sum of the ranks before, then this one.
                        mine.zip(&partial).for_each(|(m, p)| *m += p);
                    } else {
                        mine.zip(&partial).for_each(|(m, p)| *m = *p);
                    }
                }
            }
            Ok(())
        })
    }
}

impl<T: Transport> Communicator for Mesh<T> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CommError> {
        if self.world == 1 {
            return Ok(());
        }
        let ring = match self.algorithm {
            Algorithm::Direct => false,
            Algorithm::Ring => true,
            Algorithm::Auto { direct_max_bytes } => buf.len() * 4 > direct_max_bytes,
        };
        match ring {
            true => self.all_reduce_ring(buf),
            false => self.all_reduce_direct(buf),
        }
    }

    fn all_gather(&self, mine: &[f32], all: &mut [f32]) -> Result<(), CommError> {
        let (rank, world, n) = (self.rank, self.world, mine.len());
        if Some(all.len()) != n.checked_mul(world) {
            return Err(self.usage(format!(
                "all_gather: {} values of output for {world} ranks of {n}",
                all.len()
            )));
        }
        all[rank * n..(rank + 1) * n].copy_from_slice(mine);
        if world == 1 {
            return Ok(());
        }
        self.call((n * 4 * (world - 1)) as u64, |st, deadline| {
            let seq = st.next_seq();
            st.out.clear();
            f32_bytes(mine, &mut st.out);
            direct(st, rank, world, Op::AllGather, seq, deadline)?;
            for p in (0..world).filter(|&p| p != rank) {
                bytes_f32(&st.ins[p], &mut all[p * n..(p + 1) * n]);
            }
            Ok(())
        })
    }

    fn broadcast(&self, root: usize, bytes: &mut Vec<u8>) -> Result<(), CommError> {
        self.broadcast_wait(root, bytes, Some(self.deadline))
    }

    fn broadcast_wait(
        &self,
        root: usize,
        bytes: &mut Vec<u8>,
        wait: Option<Duration>,
    ) -> Result<(), CommError> {
        let (rank, world) = (self.rank, self.world);
        if root >= world {
            return Err(self.usage(format!("broadcast from rank {root} in a world of {world}")));
        }
        if world == 1 {
            return Ok(());
        }
        let out = if rank == root {
            (bytes.len() * (world - 1)) as u64
        } else {
            0
        };
        self.call(out, |st, _| {
            let seq = st.next_seq();
            let deadline = wait.unwrap_or(Duration::MAX);
            if rank == root {
                let sends: Vec<Outgoing<'_>> = self
                    .peers()
                    .map(|peer| Outgoing {
                        peer,
                        op: Op::Broadcast,
                        seq,
                        payload: bytes,
                    })
                    .collect();
                st.transport.exchange(&sends, &mut [], deadline)
            } else {
                st.transport.exchange(
                    &[],
                    &mut [Expected {
                        peer: root,
                        op: Op::Broadcast,
                        seq,
                        len: None,
                        into: bytes,
                    }],
                    deadline,
                )
            }
        })
    }

    fn barrier(&self) -> Result<(), CommError> {
        if self.world == 1 {
            return Ok(());
        }
        self.call(0, |st, deadline| {
            let seq = st.next_seq();
            st.out.clear();
            direct(st, self.rank, self.world, Op::Barrier, seq, deadline)
        })
    }

    fn send(&self, to: usize, bytes: &[u8]) -> Result<(), CommError> {
        if to >= self.world || to == self.rank {
            return Err(self.usage(format!("send from rank {} to rank {to}", self.rank)));
        }
        self.call(bytes.len() as u64, |st, deadline| {
            st.sent[to] += 1;
            st.stats.sends += 1;
            st.stats.send_bytes += bytes.len() as u64;
            let seq = st.sent[to];
            st.transport.exchange(
                &[Outgoing {
                    peer: to,
                    op: Op::Send,
                    seq,
                    payload: bytes,
                }],
                &mut [],
                deadline,
            )
        })
    }

    fn recv(&self, from: usize, bytes: &mut Vec<u8>) -> Result<(), CommError> {
        if from >= self.world || from == self.rank {
            return Err(self.usage(format!("recv at rank {} from rank {from}", self.rank)));
        }
        self.call(0, |st, deadline| {
            st.received[from] += 1;
            let seq = st.received[from];
            st.transport.exchange(
                &[],
                &mut [Expected {
                    peer: from,
                    op: Op::Send,
                    seq,
                    len: None,
                    into: bytes,
                }],
                deadline,
            )
        })
    }

    fn stats(&self) -> CommStats {
        self.seen.stats()
    }

    fn broken(&self) -> Option<String> {
        self.seen.broken()
    }
}

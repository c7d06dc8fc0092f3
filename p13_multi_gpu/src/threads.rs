//! Ranks as threads of one process: a channel for every ordered pair of
//! ranks. The reference backend the others are tested against, and the
//! one tests use to run a tensor-parallel model without processes.

use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::time::Duration;

use crate::comm::CommError;
use crate::frame::{Expected, Header, Outgoing};
use crate::mesh::{Algorithm, Mesh, Transport};

type Msg = (Header, Vec<u8>);

/// One rank's ends of the channels.
#[derive(Debug)]
pub struct ThreadLinks {
    rank: usize,
    world: usize,
    /// to[p]: to rank p (None for this rank, or once shut down)
    to: Vec<Option<Sender<Msg>>>,
    /// from[p]: from rank p
    from: Vec<Option<Receiver<Msg>>>,
}

/// `world` communicators, one per thread-rank, in rank order.
pub fn group(world: usize, deadline: Duration, algorithm: Algorithm) -> Vec<Mesh<ThreadLinks>> {
    let mut to: Vec<Vec<Option<Sender<Msg>>>> = (0..world).map(|_| vec![None; world]).collect();
    let mut from: Vec<Vec<Option<Receiver<Msg>>>> = (0..world)
        .map(|_| (0..world).map(|_| None).collect())
        .collect();
    for a in 0..world {
        for b in (0..world).filter(|&b| b != a) {
            let (tx, rx) = channel();
            to[a][b] = Some(tx);
            from[b][a] = Some(rx);
        }
    }
    to.into_iter()
        .zip(from)
        .enumerate()
        .map(|(rank, (to, from))| {
            Mesh::new(
                ThreadLinks {
                    rank,
                    world,
                    to,
                    from,
                },
                deadline,
                algorithm,
            )
        })
        .collect()
}

impl ThreadLinks {
    fn gone(&self, peer: usize, e: &Expected<'_>, detail: &str) -> CommError {
        CommError::PeerGone {
            rank: self.rank,
            peer,
            op: e.op,
            seq: e.seq,
            detail: detail.to_string(),
        }
    }
}

impl Transport for ThreadLinks {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn exchange(
        &mut self,
        sends: &[Outgoing<'_>],
        recvs: &mut [Expected<'_>],
        deadline: Duration,
    ) -> Result<(), CommError> {
        // Channels never block a sender: send everything, then receive.
        for s in sends {
            let header = Header {
                op: s.op as u8,
                seq: s.seq,
                len: s.payload.len() as u64,
            };
            let sent = self.to[s.peer]
                .as_ref()
                .map(|tx| tx.send((header, s.payload.to_vec())));
            if !matches!(sent, Some(Ok(()))) {
                return Err(CommError::PeerGone {
                    rank: self.rank,
                    peer: s.peer,
                    op: s.op,
                    seq: s.seq,
                    detail: "its thread has left the group".into(),
                });
            }
        }
        for e in recvs.iter_mut() {
            let Some(rx) = self.from[e.peer].as_ref() else {
                return Err(self.gone(e.peer, e, "this rank's link is closed"));
            };
            let (header, payload) = match rx.recv_timeout(deadline) {
                Ok(m) => m,
                Err(RecvTimeoutError::Timeout) => {
                    return Err(CommError::Timeout {
                        rank: self.rank,
                        peer: e.peer,
                        op: e.op,
                        seq: e.seq,
                        deadline,
                    })
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(self.gone(e.peer, e, "its thread has left the group"))
                }
            };
            e.check(self.rank, &header)?;
            *e.into = payload;
        }
        Ok(())
    }

    fn shutdown(&mut self) {
        self.to.iter_mut().for_each(|t| *t = None);
        self.from.iter_mut().for_each(|f| *f = None);
    }
}

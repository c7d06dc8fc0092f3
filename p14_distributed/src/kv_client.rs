//! The decode worker's side of a transfer: connect to the prefill
//! worker's K/V server, say what it holds (the hello), check the accept's
//! length against the blocks allocated beforehand, read and check every
//! layer into them, acknowledge. Runs on a thread of its own (never the
//! model thread); every wait has the deadline it is given.
//!
//! Frames land in the decode worker's own blocks, lent to the pull by its
//! storage (a [`KvLease`](p08_continuous::kv_transfer::KvLease)), or,
//! when no blocks are free yet, in a buffer the sequence is imported from
//! later: a [`RecvPool`] keeps a few that were used already, so their
//! pages are mapped (a fresh 45 MiB buffer, 1,024 positions of SmolLM2,
//! costs about 18 ms of page faults on first touch here).

use std::io::{BufReader, BufWriter, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use p08_continuous::kv_transfer::{KvBlocksMut, KvBuffer, KvLayout};

use crate::frames::{self, Next};
use crate::protocol::{self, Hello, ProtocolError, Status, VERSION};
use crate::wire::TransferHandle;

/// A pulled transfer (its K/V is in the blocks it was pulled into).
#[derive(Debug)]
pub struct Pulled {
    pub meta: Vec<u8>,
    /// Payload bytes read.
    pub bytes: usize,
    pub seconds: f64,
}

fn resolve(addr: &str) -> Result<SocketAddr, ProtocolError> {
    addr.to_socket_addrs()?.next().ok_or_else(|| {
        ProtocolError::Io(std::io::Error::new(
            std::io::ErrorKind::AddrNotAvailable,
            format!("no address for {addr}"),
        ))
    })
}

/// Receive buffers kept for the next pulls (at most `keep`).
#[derive(Debug)]
pub struct RecvPool {
    free: std::sync::Mutex<Vec<Vec<f32>>>,
    keep: usize,
}

impl RecvPool {
    pub fn new(keep: usize) -> RecvPool {
        RecvPool {
            free: std::sync::Mutex::new(Vec::new()),
            keep,
        }
    }

    /// A buffer for `tokens` positions of `layout`: a kept one if there is
    /// one. Every position a transfer fills is overwritten by its frames;
    /// the last block (whose empty slots are not sent) is zeroed.
    pub fn take(&self, layout: KvLayout, tokens: usize) -> KvBuffer {
        let kept = self.free.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let Some(mut data) = kept else {
            return KvBuffer::zeros(layout, tokens);
        };
        let bf = layout.block_floats();
        let n = tokens.div_ceil(layout.block_size.max(1)) * bf;
        data.truncate(n);
        data.resize(n, 0.0);
        let last = n.saturating_sub(bf);
        data[last..].fill(0.0);
        KvBuffer {
            layout,
            tokens,
            data,
        }
    }

    /// Keep `buf`'s memory for a later pull.
    pub fn give(&self, buf: KvBuffer) {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        if free.len() < self.keep {
            free.push(buf.data);
        }
    }
}

/// Pull `handle`'s K/V into `dest`, blocks allocated beforehand for
/// exactly its positions in this worker's layout; gives up after
/// `timeout` without progress.
pub fn pull(
    handle: &TransferHandle,
    dest: &mut impl KvBlocksMut,
    model_id: u64,
    timeout: Duration,
) -> Result<Pulled, ProtocolError> {
    let t0 = Instant::now();
    let (layout, room) = (*dest.layout(), dest.tokens());
    let addr = resolve(&handle.kv_addr)?;
    let conn = TcpStream::connect_timeout(&addr, timeout)?;
    conn.set_nodelay(true)?;
    conn.set_read_timeout(Some(timeout))?;
    conn.set_write_timeout(Some(timeout))?;
    let mut r = BufReader::with_capacity(1 << 20, conn.try_clone()?);
    let mut w = BufWriter::new(conn);
    let hello = Hello {
        version: VERSION,
        layout,
        model_id,
        transfer_id: handle.transfer_id,
        prompt_hash: handle.prompt_hash,
    };
    w.write_all(&hello.encode()?)?;
    w.flush()?;
    let tokens = protocol::read_accept(&mut r, room)?;
    if tokens != handle.tokens || tokens != room {
        return Err(ProtocolError::Range {
            what: "tokens (against the prefill's reply and the blocks allocated)",
            got: tokens as u64,
            max: handle.tokens.min(room) as u64,
        });
    }
    let mut scratch = Vec::new();
    let mut filled = vec![0usize; layout.n_layer];
    let mut bytes = 0;
    // Frames until the trailer; a prefill still running sends heartbeats
    // while it has nothing new, so the deadline counts from the last word.
    let meta = loop {
        match frames::read_next(&mut r, handle.transfer_id, dest, &mut filled, &mut scratch) {
            Ok(Next::Frame { bytes: n, .. }) => bytes += n,
            Ok(Next::Heartbeat) => {}
            Ok(Next::Trailer(meta)) => break meta,
            Err(e) => {
                if matches!(e, ProtocolError::Checksum { .. }) {
                    let _ = protocol::write_ack(&mut w, handle.transfer_id, Status::Corrupt);
                    let _ = w.flush();
                }
                return Err(e);
            }
        }
    };
    protocol::write_ack(&mut w, handle.transfer_id, Status::Ok)?;
    w.flush()?;
    Ok(Pulled {
        meta,
        bytes,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

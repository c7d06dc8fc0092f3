//! The decode worker's side of a transfer: connect to the prefill
//! worker's K/V server, say what it holds (the hello), size the buffer
//! from the accept before any frame arrives, read and check every layer,
//! acknowledge. Runs on a thread of its own (never the model thread);
//! every wait has the deadline it is given.
//!
//! Frames land in a buffer allocated beforehand: a [`RecvPool`] keeps a
//! few that were used already, so their pages are mapped. A fresh 45 MiB
//! buffer (1,024 positions of SmolLM2) costs about 18 ms of page faults
//! on first touch here, more than the copy itself (7 ms).

use std::io::{BufReader, BufWriter, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use p08_continuous::kv_transfer::{KvBuffer, KvLayout};

use crate::frames::{self, Next};
use crate::protocol::{self, Hello, ProtocolError, Status, VERSION};
use crate::wire::TransferHandle;

/// A pulled transfer.
#[derive(Debug)]
pub struct Pulled {
    pub kv: KvBuffer,
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

/// Pull `handle`'s K/V into a buffer of `layout` (from `pool`), refusing
/// more than `max_tokens` positions; gives up after `timeout` without
/// progress.
pub fn pull(
    handle: &TransferHandle,
    layout: KvLayout,
    model_id: u64,
    max_tokens: usize,
    timeout: Duration,
    pool: &RecvPool,
) -> Result<Pulled, ProtocolError> {
    let t0 = Instant::now();
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
    let tokens = protocol::read_accept(&mut r, max_tokens)?;
    if tokens != handle.tokens {
        return Err(ProtocolError::Range {
            what: "tokens (against the prefill's reply)",
            got: tokens as u64,
            max: handle.tokens as u64,
        });
    }
    // Allocated before the first frame (a kept buffer if the pool has one).
    let mut kv = pool.take(layout, tokens);
    let mut scratch = Vec::new();
    let mut filled = vec![0usize; layout.n_layer];
    let mut bytes = 0;
    // Frames until the trailer; a prefill still running sends heartbeats
    // while it has nothing new, so the deadline counts from the last word.
    let meta = loop {
        match frames::read_next(
            &mut r,
            handle.transfer_id,
            &mut kv,
            &mut filled,
            &mut scratch,
        ) {
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
        kv,
        meta,
        bytes,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

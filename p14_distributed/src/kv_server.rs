//! The prefill worker's side of a transfer: exported K/V held under a
//! lease until a decode worker pulls it and acknowledges, or the lease
//! expires; and the TCP server decode workers pull from, one thread per
//! connection, so the model thread never touches a socket.
//!
//! Who frees: the prefill worker, always. An ack frees at once; a decode
//! worker that never comes (dead, or told to recompute) is covered by the
//! lease, swept every 100 ms. Nothing held outlives its lease.

use std::collections::HashMap;
use std::io::{BufReader, BufWriter, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use p08_continuous::kv_transfer::{KvBuffer, KvLayout};

use crate::protocol::{self, Hello, ProtocolError, Status, HELLO_LEN};

/// A prompt's K/V waiting to be pulled.
#[derive(Debug)]
struct Held {
    /// Shared with the senders (no copy per pull).
    kv: Arc<KvBuffer>,
    prompt_hash: u64,
    /// The sequence's state for the decode worker (JSON, see `SeqMeta`).
    meta: Vec<u8>,
    expires: Instant,
}

/// Counters `/metrics` and the tests read.
#[derive(Debug, Default)]
pub struct ServerStats {
    pub held: AtomicUsize,
    pub held_bytes: AtomicUsize,
    pub sent_bytes: AtomicU64,
    pub acked: AtomicU64,
    pub expired: AtomicU64,
    pub refused: AtomicU64,
}

/// Fault injection for the fault tests (off in normal runs).
#[derive(Clone, Copy, Debug, Default)]
pub struct Faults {
    /// Flip a bit in this layer's frame.
    pub corrupt_layer: Option<usize>,
    /// Exit the process after sending this many layers.
    pub die_after_layers: Option<usize>,
}

#[derive(Debug)]
pub struct KvServer {
    held: Mutex<HashMap<u64, Held>>,
    next_id: AtomicU64,
    pub model_id: u64,
    pub layout: KvLayout,
    pub lease: Duration,
    pub stats: ServerStats,
    faults: Faults,
    /// host:port decode workers connect to.
    pub addr: String,
}

impl KvServer {
    /// Listen on `listener` and serve pulls on threads of their own.
    pub fn start(
        listener: TcpListener,
        advertise: String,
        model_id: u64,
        layout: KvLayout,
        lease: Duration,
        faults: Faults,
    ) -> Arc<KvServer> {
        let server = Arc::new(KvServer {
            held: Mutex::new(HashMap::new()),
            // Ids differ across restarts of a worker at one address.
            next_id: AtomicU64::new(seed_id()),
            model_id,
            layout,
            lease,
            stats: ServerStats::default(),
            faults,
            addr: advertise,
        });
        let s = server.clone();
        std::thread::Builder::new()
            .name("kv-accept".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    let Ok(conn) = conn else { continue };
                    let s = s.clone();
                    let _ = std::thread::Builder::new()
                        .name("kv-send".into())
                        .spawn(move || {
                            if let Err(e) = s.serve(conn) {
                                eprintln!("kv server: {e}");
                            }
                        });
                }
            })
            .ok();
        let s = server.clone();
        std::thread::Builder::new()
            .name("kv-lease".into())
            .spawn(move || loop {
                std::thread::sleep(Duration::from_millis(100));
                s.sweep(Instant::now());
            })
            .ok();
        server
    }

    /// Hold `kv` for a decode worker; its transfer id.
    pub fn hold(&self, kv: KvBuffer, prompt_hash: u64, meta: Vec<u8>) -> u64 {
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        let bytes = kv.data.len() * 4;
        let held = Held {
            kv: Arc::new(kv),
            prompt_hash,
            meta,
            expires: Instant::now() + self.lease,
        };
        self.lock().insert(id, held);
        self.stats.held.fetch_add(1, Ordering::SeqCst);
        self.stats.held_bytes.fetch_add(bytes, Ordering::SeqCst);
        id
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Held>> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn release(&self, id: u64) -> Option<Held> {
        let h = self.lock().remove(&id)?;
        self.stats.held.fetch_sub(1, Ordering::SeqCst);
        self.stats
            .held_bytes
            .fetch_sub(h.kv.data.len() * 4, Ordering::SeqCst);
        Some(h)
    }

    /// Drop every transfer whose lease has passed.
    pub fn sweep(&self, now: Instant) {
        let gone: Vec<u64> = self
            .lock()
            .iter()
            .filter(|(_, h)| h.expires <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            if self.release(id).is_some() {
                self.stats.expired.fetch_add(1, Ordering::SeqCst);
            }
        }
    }

    /// One decode worker's pull: hello, accept, frames, ack.
    fn serve(&self, conn: TcpStream) -> Result<(), ProtocolError> {
        conn.set_nodelay(true)?;
        // A peer that stops mid-transfer is given up on, not waited for.
        conn.set_read_timeout(Some(self.lease.max(Duration::from_secs(5))))?;
        conn.set_write_timeout(Some(self.lease.max(Duration::from_secs(5))))?;
        let mut r = BufReader::new(conn.try_clone()?);
        let mut w = BufWriter::with_capacity(1 << 20, conn);
        let mut hello = [0u8; HELLO_LEN];
        std::io::Read::read_exact(&mut r, &mut hello)?;
        let hello = match Hello::decode(&hello) {
            Ok(h) => h,
            Err(e) => {
                self.stats.refused.fetch_add(1, Ordering::SeqCst);
                return Err(e);
            }
        };
        let id = hello.transfer_id;
        // Checked under the lock, sent without it: the entry stays held
        // (and its lease runs) while it is being sent.
        let (status, tokens, meta) = {
            let held = self.lock();
            match held.get(&id) {
                None => (Status::Unknown, 0, Vec::new()),
                Some(h) => {
                    let s = hello.check(self.model_id, &self.layout, h.prompt_hash);
                    (s, h.kv.tokens, h.meta.clone())
                }
            }
        };
        if status != Status::Ok {
            self.stats.refused.fetch_add(1, Ordering::SeqCst);
            protocol::write_accept(&mut w, status, 0, &[])?;
            w.flush()?;
            return Err(ProtocolError::Refused(status));
        }
        protocol::write_accept(&mut w, Status::Ok, tokens, &meta)?;
        // The buffer is shared out so the lock is not held across sends.
        let kv = match self.lock().get(&id) {
            Some(h) => Arc::clone(&h.kv),
            None => return Err(ProtocolError::Refused(Status::Unknown)),
        };
        let layers = match self.faults.die_after_layers {
            Some(n) => 0..n.min(kv.layout.n_layer),
            None => 0..kv.layout.n_layer,
        };
        let sent = protocol::write_layers(&mut w, id, &kv, layers, self.faults.corrupt_layer)?;
        w.flush()?;
        if self.faults.die_after_layers.is_some() {
            eprintln!("kv server: dying mid-transfer (fault injection)");
            std::process::exit(17);
        }
        self.stats
            .sent_bytes
            .fetch_add(sent as u64, Ordering::SeqCst);
        let ack = protocol::read_ack(&mut r, id)?;
        // Freed on any ack: a receiver that refused a frame recomputes or
        // fails; it never asks for the same bytes again.
        if self.release(id).is_some() {
            self.stats.acked.fetch_add(1, Ordering::SeqCst);
        }
        match ack {
            Status::Ok => Ok(()),
            s => Err(ProtocolError::Refused(s)),
        }
    }
}

fn seed_id() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    (t ^ (std::process::id() as u64) << 32) & 0x7fff_ffff_ffff_ffff
}

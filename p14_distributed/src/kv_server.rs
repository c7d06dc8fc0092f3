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

use crate::frames;
use crate::live::{End, Live};
use crate::protocol::{self, Hello, ProtocolError, Status, HELLO_LEN};

/// What a held transfer sends.
#[derive(Clone, Debug)]
enum Body {
    /// A finished prompt's K/V, shared with the senders (no copy per
    /// pull), and the sequence's state for the decode worker (JSON, see
    /// `SeqMeta`).
    Ready(Arc<KvBuffer>, Arc<Vec<u8>>),
    /// A prompt still being prefilled, streamed as its layers are written.
    Live(Arc<Live>),
}

/// A prompt's K/V waiting to be pulled.
#[derive(Debug)]
struct Held {
    body: Body,
    tokens: usize,
    bytes: usize,
    prompt_hash: u64,
    /// A live transfer's lease starts when its prefill ends.
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
    /// Freed because their request's client left.
    pub cancelled: AtomicU64,
    pub refused: AtomicU64,
    /// Pulls being served now, each on a thread of its own.
    pub connections: AtomicUsize,
    /// Connections closed at once because [`MAX_CONNECTIONS`] were open.
    pub turned_away: AtomicU64,
}

/// Pulls served at once: a pull is a thread and a socket, and a decode
/// worker makes one per prompt, so more than this many at once is a storm
/// (or an attack), not a load; the one over it is closed at once and its
/// puller fails over to its policy (recompute or fail).
pub const MAX_CONNECTIONS: usize = 64;

/// Counts a connection open until its thread ends.
struct Open<'a>(&'a AtomicUsize);

impl Drop for Open<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Fault injection for the fault tests (off in normal runs).
#[derive(Clone, Copy, Debug, Default)]
pub struct Faults {
    /// Flip a bit in this layer's (first) frame.
    pub corrupt_layer: Option<usize>,
    /// Exit the process after sending this many layers (frames, when
    /// streamed).
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
                    let open = s.stats.connections.fetch_add(1, Ordering::SeqCst);
                    if open >= MAX_CONNECTIONS {
                        s.stats.connections.fetch_sub(1, Ordering::SeqCst);
                        s.stats.turned_away.fetch_add(1, Ordering::SeqCst);
                        drop(conn);
                        continue;
                    }
                    let mine = s.clone();
                    let spawned =
                        std::thread::Builder::new()
                            .name("kv-send".into())
                            .spawn(move || {
                                let _open = Open(&mine.stats.connections);
                                if let Err(e) = mine.serve(conn) {
                                    eprintln!("kv server: {e}");
                                }
                            });
                    if spawned.is_err() {
                        // The closure (and its count) never ran.
                        s.stats.connections.fetch_sub(1, Ordering::SeqCst);
                    }
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
        let (tokens, bytes) = (kv.tokens, kv.data.len() * 4);
        let body = Body::Ready(Arc::new(kv), Arc::new(meta));
        self.insert(body, tokens, bytes, prompt_hash)
    }

    /// Open a transfer of `tokens` positions to be filled while its prompt
    /// is prefilled; its id and what the forward pass writes into.
    pub fn open_live(&self, tokens: usize, prompt_hash: u64) -> (u64, Arc<Live>) {
        let live = Arc::new(Live::new(self.layout, tokens));
        let bytes = live.bytes();
        let id = self.insert(Body::Live(live.clone()), tokens, bytes, prompt_hash);
        (id, live)
    }

    fn insert(&self, body: Body, tokens: usize, bytes: usize, prompt_hash: u64) -> u64 {
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        let held = Held {
            body,
            tokens,
            bytes,
            prompt_hash,
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
        self.stats.held_bytes.fetch_sub(h.bytes, Ordering::SeqCst);
        Some(h)
    }

    /// Free a transfer whose request is gone (its client left); a live one
    /// is failed too, so its prefill stops and a decode worker pulling it
    /// hears so. False if it was not held (acknowledged, expired, never).
    pub fn cancel(&self, id: u64) -> bool {
        let Some(h) = self.release(id) else {
            return false;
        };
        if let Body::Live(l) = &h.body {
            l.fail("the request was cancelled (its client left)".into());
        }
        self.stats.cancelled.fetch_add(1, Ordering::SeqCst);
        true
    }

    /// Drop every transfer whose lease has passed.
    pub fn sweep(&self, now: Instant) {
        let gone: Vec<u64> = {
            let mut held = self.lock();
            for h in held.values_mut() {
                if let Body::Live(l) = &h.body {
                    if !l.ended() {
                        h.expires = now + self.lease;
                    }
                }
            }
            held.iter()
                .filter(|(_, h)| h.expires <= now)
                .map(|(id, _)| *id)
                .collect()
        };
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
        let (status, tokens, body) = {
            let held = self.lock();
            match held.get(&id) {
                None => (Status::Unknown, 0, None),
                Some(h) => {
                    let s = hello.check(self.model_id, &self.layout, h.prompt_hash);
                    (s, h.tokens, Some(h.body.clone()))
                }
            }
        };
        let (Status::Ok, Some(body)) = (status, body) else {
            self.stats.refused.fetch_add(1, Ordering::SeqCst);
            protocol::write_accept(&mut w, status, 0)?;
            w.flush()?;
            return Err(ProtocolError::Refused(status));
        };
        protocol::write_accept(&mut w, Status::Ok, tokens)?;
        let sent = match body {
            Body::Ready(kv, meta) => {
                let layers = match self.faults.die_after_layers {
                    Some(n) => 0..n.min(kv.layout.n_layer),
                    None => 0..kv.layout.n_layer,
                };
                let sent =
                    frames::write_layers(&mut w, id, &kv, layers, self.faults.corrupt_layer)?;
                self.die_if_told(&mut w)?;
                frames::write_trailer(&mut w, &meta)?;
                sent
            }
            Body::Live(live) => self.stream(&mut w, id, &live)?,
        };
        w.flush()?;
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

impl KvServer {
    /// A live transfer's frames as its layers are written, heartbeats
    /// while nothing is new, then the trailer; the payload bytes sent.
    fn stream(&self, w: &mut impl Write, id: u64, live: &Live) -> Result<usize, ProtocolError> {
        let n_layer = self.layout.n_layer;
        let (mut sent, mut frames, mut bytes) = (vec![0usize; n_layer], 0usize, 0usize);
        let mut payload = Vec::new();
        loop {
            let (runs, end) = live.next(&sent, Duration::from_secs(1));
            if runs.is_empty() && end.is_none() {
                frames::write_heartbeat(w)?;
                w.flush()?;
                continue;
            }
            for (layer, p0, p1) in runs {
                live.with_kv(|kv| frames::layer_payload(kv, layer, p0, p1, &mut payload));
                let bad = self.faults.corrupt_layer == Some(layer) && p0 == 0;
                let h = frames::frame_header(id, layer, (p0, p1), &mut payload, bad)?;
                w.write_all(&h)?;
                w.write_all(&payload)?;
                (sent[layer], frames, bytes) = (p1, frames + 1, bytes + payload.len());
                if self.faults.die_after_layers == Some(frames) {
                    self.die_if_told(w)?;
                }
            }
            w.flush()?;
            match end {
                Some(End::Done(meta)) if sent.iter().all(|&s| s == live.tokens) => {
                    frames::write_trailer(w, &meta)?;
                    return Ok(bytes);
                }
                // The prefill failed: the decode worker's read ends and its
                // policy decides.
                Some(End::Failed(why)) => {
                    frames::write_abort(w, &why)?;
                    w.flush()?;
                    return Err(ProtocolError::Aborted(why));
                }
                // Ended, nothing new, and a layer short: nothing more will
                // come (not a spin): say which.
                Some(End::Done(_)) if live.next(&sent, Duration::ZERO).0.is_empty() => {
                    let (layer, &got) = sent
                        .iter()
                        .enumerate()
                        .find(|(_, &s)| s != live.tokens)
                        .unwrap_or((0, &0));
                    let e = ProtocolError::Order {
                        layer: layer as u32,
                        got: got as u64,
                        want: live.tokens as u64,
                    };
                    frames::write_abort(w, &e.to_string())?;
                    w.flush()?;
                    return Err(e);
                }
                _ => {}
            }
        }
    }

    /// The fault tests' prefill worker dying mid-transfer.
    fn die_if_told(&self, w: &mut impl Write) -> Result<(), ProtocolError> {
        if self.faults.die_after_layers.is_some() {
            w.flush()?;
            eprintln!("kv server: dying mid-transfer (fault injection)");
            std::process::exit(17);
        }
        Ok(())
    }
}

fn seed_id() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    (t ^ (std::process::id() as u64) << 32) & 0x7fff_ffff_ffff_ffff
}

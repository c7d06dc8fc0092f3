//! Ranks as processes (on one host or several), a TCP connection between
//! every pair of ranks.
//!
//! Setting up: rank r listens on its own address, connects to every rank
//! below it and accepts every rank above it (so each pair makes one
//! connection, whoever starts first: a connect is retried until the setup
//! deadline). Both ends of a new connection send a [`Hello`] first and
//! check the other's: another job, world size, protocol or model layout
//! is refused on both ends.
//!
//! Moving frames: sockets are non-blocking and one `poll(2)` loop writes
//! every outgoing frame and reads every expected one at once, so two ranks
//! that send each other megabytes never both wait in `write`. A receive
//! reads exactly its frame (the next collective's bytes stay in the
//! socket), checks the header the moment its 20 bytes are in, and gives up
//! when a peer shows no progress within the deadline.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use crate::comm::CommError;
use crate::frame::{Expected, Header, Hello, Outgoing, HEADER_BYTES, HELLO_BYTES};
use crate::mesh::Transport;

/// One rank's connections, `links[p]` to rank p.
#[derive(Debug)]
pub struct TcpLinks {
    rank: usize,
    world: usize,
    links: Vec<Option<TcpStream>>,
}

fn io(what: String) -> impl FnOnce(std::io::Error) -> CommError {
    move |source| CommError::Io { what, source }
}

/// Connect rank `hello.rank` to every other rank of `addrs` (rank p at
/// `addrs[p]`; this rank's own listener is `listener`), within `setup`.
pub fn connect(
    listener: &TcpListener,
    addrs: &[SocketAddr],
    hello: Hello,
    setup: Duration,
) -> Result<TcpLinks, CommError> {
    let (rank, world) = (hello.rank as usize, addrs.len());
    if hello.world as usize != world || rank >= world {
        return Err(CommError::Usage {
            rank,
            what: format!(
                "rank {rank} of a world of {} with {world} addresses",
                hello.world
            ),
        });
    }
    let until = Instant::now() + setup;
    let mut links: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    // Ranks below: connect (retrying while they start).
    for (p, addr) in addrs.iter().enumerate().take(rank) {
        let s = loop {
            match TcpStream::connect_timeout(addr, Duration::from_millis(500)) {
                Ok(s) => break s,
                Err(e) if Instant::now() >= until => {
                    return Err(io(format!("rank {rank}: connecting to rank {p} at {addr}"))(e))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        let there = greet(&s, &hello, &addr.to_string(), until)?;
        if there.rank as usize != p {
            return Err(CommError::Handshake {
                peer: addr.to_string(),
                reason: format!("expected rank {p} there, it says it is rank {}", there.rank),
            });
        }
        links[p] = Some(s);
    }
    // Ranks above: accept them, in whatever order they come.
    listener
        .set_nonblocking(true)
        .map_err(io("listener".into()))?;
    while links.iter().skip(rank + 1).any(Option::is_none) {
        let (s, from) = match listener.accept() {
            Ok(c) => c,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if Instant::now() >= until {
                    let missing: Vec<usize> =
                        (rank + 1..world).filter(|&p| links[p].is_none()).collect();
                    return Err(CommError::Handshake {
                        peer: format!("ranks {missing:?}"),
                        reason: format!("rank {rank}: not connected within {setup:?}"),
                    });
                }
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            Err(e) => return Err(io(format!("rank {rank}: accepting"))(e)),
        };
        s.set_nonblocking(false).map_err(io("socket".into()))?;
        let there = greet(&s, &hello, &from.to_string(), until)?;
        let p = there.rank as usize;
        if p <= rank || links[p].is_some() {
            return Err(CommError::Handshake {
                peer: from.to_string(),
                reason: format!(
                    "rank {p} connected to rank {rank}, which expects ranks above it, once each"
                ),
            });
        }
        links[p] = Some(s);
    }
    for s in links.iter().flatten() {
        s.set_nodelay(true).map_err(io("TCP_NODELAY".into()))?;
        s.set_nonblocking(true).map_err(io("socket".into()))?;
    }
    Ok(TcpLinks { rank, world, links })
}

/// Send our hello, read theirs, check they agree.
fn greet(s: &TcpStream, hello: &Hello, peer: &str, until: Instant) -> Result<Hello, CommError> {
    let left = until
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(100));
    let setup = io(format!("handshake with {peer}"));
    s.set_read_timeout(Some(left)).map_err(setup)?;
    let mut s = s;
    s.write_all(&hello.encode())
        .map_err(io(format!("handshake with {peer}")))?;
    let mut b = [0u8; HELLO_BYTES];
    s.read_exact(&mut b)
        .map_err(io(format!("handshake with {peer}: reading its hello")))?;
    let there = Hello::decode(&b, peer)?;
    hello.agree(&there, peer)?;
    Ok(there)
}

/// An outgoing frame in flight: header then payload, `pos` bytes written.
struct Writing<'a> {
    peer: usize,
    op: crate::comm::Op,
    seq: u64,
    head: [u8; HEADER_BYTES],
    payload: &'a [u8],
    pos: usize,
}

/// An expected frame in flight.
struct Reading {
    idx: usize,
    head: [u8; HEADER_BYTES],
    got: usize,
    len: Option<usize>,
    pos: usize,
}

impl TcpLinks {
    fn link(&self, peer: usize, op: crate::comm::Op, seq: u64) -> Result<&TcpStream, CommError> {
        self.links[peer].as_ref().ok_or(CommError::PeerGone {
            rank: self.rank,
            peer,
            op,
            seq,
            detail: "this rank's link is closed".into(),
        })
    }
}

impl Transport for TcpLinks {
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
        let rank = self.rank;
        let mut writing: Vec<Writing<'_>> = sends
            .iter()
            .map(|s| Writing {
                peer: s.peer,
                op: s.op,
                seq: s.seq,
                head: Header {
                    op: s.op as u8,
                    seq: s.seq,
                    len: s.payload.len() as u64,
                }
                .encode(),
                payload: s.payload,
                pos: 0,
            })
            .collect();
        let mut reading: Vec<Reading> = (0..recvs.len())
            .map(|idx| Reading {
                idx,
                head: [0; HEADER_BYTES],
                got: 0,
                len: None,
                pos: 0,
            })
            .collect();
        for s in sends {
            self.link(s.peer, s.op, s.seq)?;
        }
        for e in recvs.iter() {
            self.link(e.peer, e.op, e.seq)?;
        }
        let mut last_progress = Instant::now();
        let mut fds: Vec<libc::pollfd> = Vec::new();
        while !writing.is_empty() || !reading.is_empty() {
            fds.clear();
            for w in &writing {
                fds.push(pollfd(self.links[w.peer].as_ref(), libc::POLLOUT));
            }
            for r in &reading {
                fds.push(pollfd(self.links[recvs[r.idx].peer].as_ref(), libc::POLLIN));
            }
            let left = deadline.saturating_sub(last_progress.elapsed());
            let ms = left.as_millis().min(i32::MAX as u128) as i32;
            // SAFETY: `fds` is a live, initialised array of fds.len() pollfds.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == ErrorKind::Interrupted {
                    continue;
                }
                return Err(io(format!("rank {rank}: poll"))(e));
            }
            if n == 0 {
                // Nothing moved for a whole deadline: blame a peer we wait for.
                let (peer, op, seq) = match reading.first() {
                    Some(r) => (recvs[r.idx].peer, recvs[r.idx].op, recvs[r.idx].seq),
                    None => (writing[0].peer, writing[0].op, writing[0].seq),
                };
                return Err(CommError::Timeout {
                    rank,
                    peer,
                    op,
                    seq,
                    deadline,
                });
            }
            let nw = writing.len();
            let mut moved = false;
            // Writes: as much of each frame as the socket takes.
            let mut k = 0;
            writing.retain_mut(|w| {
                let ready = fds[k].revents != 0;
                k += 1;
                !ready || write_some(w, self.links[w.peer].as_ref(), &mut moved)
            });
            if let Some(w) = writing.iter().find(|w| w.pos == usize::MAX) {
                return Err(CommError::PeerGone {
                    rank,
                    peer: w.peer,
                    op: w.op,
                    seq: w.seq,
                    detail: "writing to it failed (it closed the connection)".into(),
                });
            }
            // Reads: exactly the expected frame's bytes.
            let mut failure = None;
            let mut k = nw;
            reading.retain_mut(|r| {
                let ready = fds[k].revents != 0;
                k += 1;
                if !ready || failure.is_some() {
                    return true;
                }
                let e = &mut recvs[r.idx];
                let mut s = self.links[e.peer].as_ref().expect("checked above");
                match read_frame(rank, &mut s, r, e) {
                    Ok((done, progressed)) => {
                        moved |= progressed;
                        !done
                    }
                    Err(err) => {
                        failure = Some(err);
                        true
                    }
                }
            });
            if let Some(err) = failure {
                return Err(err);
            }
            if moved {
                last_progress = Instant::now();
            }
        }
        Ok(())
    }

    fn shutdown(&mut self) {
        for s in self.links.iter_mut() {
            if let Some(s) = s.take() {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
        }
    }
}

fn pollfd(s: Option<&TcpStream>, events: libc::c_short) -> libc::pollfd {
    libc::pollfd {
        fd: s.map_or(-1, |s| s.as_raw_fd()),
        events,
        revents: 0,
    }
}

/// Write what the socket takes of `w`; false once the whole frame is out.
/// A failed write marks `w.pos = usize::MAX` (kept, to be reported).
fn write_some(w: &mut Writing<'_>, s: Option<&TcpStream>, moved: &mut bool) -> bool {
    let Some(mut s) = s else {
        w.pos = usize::MAX;
        return true;
    };
    let total = HEADER_BYTES + w.payload.len();
    while w.pos < total {
        let chunk = if w.pos < HEADER_BYTES {
            &w.head[w.pos..]
        } else {
            &w.payload[w.pos - HEADER_BYTES..]
        };
        match s.write(chunk) {
            Ok(0) => {
                w.pos = usize::MAX;
                return true;
            }
            Ok(n) => {
                w.pos += n;
                *moved = true;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => return true,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => {
                w.pos = usize::MAX;
                return true;
            }
        }
    }
    false
}

/// Read what the socket has of `r`'s frame. Ok((done, progressed)).
fn read_frame(
    rank: usize,
    s: &mut &TcpStream,
    r: &mut Reading,
    e: &mut Expected<'_>,
) -> Result<(bool, bool), CommError> {
    let mut progressed = false;
    let gone = |detail: String| CommError::PeerGone {
        rank,
        peer: e.peer,
        op: e.op,
        seq: e.seq,
        detail,
    };
    loop {
        let buf: &mut [u8] = match r.len {
            None => &mut r.head[r.got..],
            Some(len) if r.pos < len => &mut e.into[r.pos..len],
            Some(_) => return Ok((true, progressed)),
        };
        match s.read(buf) {
            Ok(0) => return Err(gone("it closed the connection".into())),
            Ok(n) => {
                progressed = true;
                match r.len {
                    None => {
                        r.got += n;
                        if r.got == HEADER_BYTES {
                            let h = Header::decode(&r.head);
                            e.check(rank, &h)?;
                            // Checked against MAX_PAYLOAD, so it fits.
                            let len = h.len as usize;
                            e.into.clear();
                            e.into.resize(len, 0);
                            r.len = Some(len);
                        }
                    }
                    Some(_) => r.pos += n,
                }
            }
            Err(err) if err.kind() == ErrorKind::WouldBlock => return Ok((false, progressed)),
            Err(err) if err.kind() == ErrorKind::Interrupted => {}
            Err(err) => return Err(gone(err.to_string())),
        }
    }
}

/// `world` ranks of this process joined over loopback TCP, one thread
/// each while they connect (the collectives' tests and bench; ranks as
/// processes connect the same way, each calling [`connect`]).
pub fn loopback_group(
    world: usize,
    deadline: Duration,
    algorithm: crate::mesh::Algorithm,
) -> Result<Vec<crate::mesh::Mesh<TcpLinks>>, CommError> {
    let listeners = (0..world)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<Result<Vec<_>, _>>()
        .map_err(io("binding a loopback port".into()))?;
    let addrs = listeners
        .iter()
        .map(TcpListener::local_addr)
        .collect::<Result<Vec<_>, _>>()
        .map_err(io("a loopback port".into()))?;
    let token = std::process::id() as u64 ^ 0x5eed;
    let links = std::thread::scope(|s| {
        let joins: Vec<_> = listeners
            .iter()
            .enumerate()
            .map(|(rank, l)| {
                let hello = Hello {
                    version: crate::frame::PROTOCOL_VERSION,
                    world: world as u32,
                    rank: rank as u32,
                    token,
                    layout: 0,
                };
                let addrs = &addrs;
                s.spawn(move || connect(l, addrs, hello, Duration::from_secs(10)))
            })
            .collect();
        joins
            .into_iter()
            .map(|j| j.join().expect("a connecting thread panicked"))
            .collect::<Result<Vec<_>, _>>()
    })?;
    Ok(links
        .into_iter()
        .map(|l| crate::mesh::Mesh::new(l, deadline, algorithm))
        .collect())
}

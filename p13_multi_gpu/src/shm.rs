//! Ranks on one host over one shared-memory segment (the shape of vLLM's
//! CPU communicator and its shared-memory broadcast): no sockets, no
//! system calls on the fast path.
//!
//! ```text
//! segment: header | control[rank] (written, read, pid) | slot[rank] (op, seq, len, payload ≤ slot_bytes)
//! a round: wait until every rank has read the previous round (read ≥ k−1)
//!          write my payload into my slot, then written ← k   (release)
//!          wait until every rank's written ≥ k             (acquire), check its (op, seq, len)
//!          sum (or copy) the slots in the reference order, then read ← k
//! ```
//!
//! A collective larger than a slot runs as several rounds. A wait spins
//! briefly, then sleeps on the word (a futex the publisher wakes); it ends
//! in a timeout at the deadline, or within a millisecond when a rank's
//! process has died (its pid is in the segment).

use std::fs::OpenOptions;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use memmap2::MmapMut;

use crate::comm::{reference_sum_from, CommError, CommStats, Communicator, Op, Seen};

const MAGIC: u64 = u64::from_le_bytes(*b"ILSHM\0\0\x01");
const HEADER: usize = 64;
const CONTROL: usize = 64;
const SLOT_HEADER: usize = 64;
/// Payload bytes per rank per round: a decode step's all-reduce (a few KiB)
/// is one round; 64 MiB is 64.
pub const SLOT_BYTES: usize = 1 << 20;
// The futex calls wait on the low half of a 64-bit word: little-endian only.
const _: () = assert!(cfg!(target_endian = "little"));

/// Busy polls of a shared word before a wait sleeps on it. Short: with
/// fewer cores than ranks (this machine: 3 ranks on 2) a spinning rank
/// takes the core from the rank it waits for; measured on a decode step
/// at TP = 3, 200 polls gave 15.8 ms, 2,000 20.5 ms and 20,000 52 ms. With a
/// core per rank, longer spins would win.
const SPINS: u32 = 200;

/// One rank's view of the segment.
#[derive(Debug)]
pub struct ShmComm {
    rank: usize,
    world: usize,
    deadline: Duration,
    state: Mutex<State>,
    seen: Seen,
}

#[derive(Debug)]
struct State {
    map: MmapMut,
    /// Rounds done (every collective takes one or more).
    round: u64,
    seq: u64,
    broken: Option<String>,
    stats: CommStats,
    vals: Vec<Vec<f32>>,
}

fn path_of(token: u64) -> PathBuf {
    PathBuf::from(format!("/dev/shm/inference-lab-p13-{token:016x}"))
}

fn segment_bytes(world: usize) -> usize {
    HEADER + world * CONTROL + world * (SLOT_HEADER + SLOT_BYTES)
}

/// `world` ranks of this process on one segment (tests and the bench).
pub fn group(world: usize, deadline: Duration) -> Result<Vec<ShmComm>, CommError> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let token = (u64::from(std::process::id()) << 40) ^ now ^ next_group();
    // Each join ends at a barrier: the ranks join at once, a thread each.
    std::thread::scope(|s| {
        let joins: Vec<_> = (0..world)
            .map(|r| s.spawn(move || join(r, world, token, deadline, Duration::from_secs(10))))
            .collect();
        joins
            .into_iter()
            .map(|j| j.join().expect("a joining thread panicked"))
            .collect()
    })
}

fn next_group() -> u64 {
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// Rank `rank` of `world` joins the segment of job `token` (rank 0 makes
/// it; the others wait for it within `setup`). The file is unlinked once
/// every rank has mapped it.
pub fn join(
    rank: usize,
    world: usize,
    token: u64,
    deadline: Duration,
    setup: Duration,
) -> Result<ShmComm, CommError> {
    let path = path_of(token);
    let size = segment_bytes(world);
    let io = |what: &str| {
        let what = format!("rank {rank}: {what} {}", path.display());
        move |source| CommError::Io { what, source }
    };
    let until = Instant::now() + setup;
    let map = if rank == 0 {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(io("creating"))?;
        f.set_len(size as u64).map_err(io("sizing"))?;
        // SAFETY: the file is ours, sized above; the ranks access it only
        // through the atomics and the round protocol of this module.
        let mut map = unsafe { MmapMut::map_mut(&f) }.map_err(io("mapping"))?;
        map[8..16].copy_from_slice(&(world as u64).to_le_bytes());
        let m = &map;
        atomic(m, 0).store(MAGIC, Ordering::Release);
        map
    } else {
        loop {
            let opened = OpenOptions::new().read(true).write(true).open(&path);
            if let Ok(f) = opened {
                if f.metadata().map(|m| m.len()).unwrap_or(0) == size as u64 {
                    // SAFETY: as above; rank 0 sized it.
                    let map = unsafe { MmapMut::map_mut(&f) }.map_err(io("mapping"))?;
                    if atomic(&map, 0).load(Ordering::Acquire) == MAGIC {
                        break map;
                    }
                }
            }
            if Instant::now() >= until {
                return Err(CommError::Handshake {
                    peer: path.display().to_string(),
                    reason: format!(
                        "rank {rank}: rank 0's segment did not appear within {setup:?}"
                    ),
                });
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    };
    let got_world = u64::from_le_bytes(map[8..16].try_into().expect("8 bytes"));
    if got_world != world as u64 {
        return Err(CommError::Handshake {
            peer: path.display().to_string(),
            reason: format!("world size {world} here, {got_world} in the segment"),
        });
    }
    control(&map, rank, 2).store(u64::from(std::process::id()), Ordering::Release);
    let c = ShmComm {
        rank,
        world,
        deadline,
        state: Mutex::new(State {
            map,
            round: 0,
            seq: 0,
            broken: None,
            stats: CommStats::default(),
            vals: vec![Vec::new(); world],
        }),
        seen: Seen::default(),
    };
    // Everyone mapped: the name can go (the mappings stay).
    c.barrier()?;
    if rank == 0 {
        let _ = std::fs::remove_file(&path);
    }
    Ok(c)
}

/// Sleep while the low 32 bits of `word` equal `seen`, at most `timeout`
/// (or until its owner wakes it). Not FUTEX_PRIVATE: the word is in a
/// mapping shared between processes.
fn futex_wait(word: &AtomicU64, seen: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: timeout.as_nanos().min(999_999_999) as libc::c_long,
    };
    // SAFETY: the address is a live, aligned word of the mapping (its low
    // half on this little-endian target); FUTEX_WAIT only reads it.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr() as *const u32,
            libc::FUTEX_WAIT,
            seen,
            &ts as *const libc::timespec,
        );
    }
}

/// Wake every rank sleeping on `word`.
fn futex_wake(word: &AtomicU64) {
    // SAFETY: as in `futex_wait`; FUTEX_WAKE does not touch the word.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr() as *const u32,
            libc::FUTEX_WAKE,
            i32::MAX,
        );
    }
}

fn atomic(map: &MmapMut, offset: usize) -> &AtomicU64 {
    assert!(offset.is_multiple_of(8) && offset + 8 <= map.len());
    // SAFETY: in bounds and 8-aligned (the mapping is page-aligned); every
    // rank touches these words only atomically.
    unsafe { &*(map.as_ptr().add(offset) as *const AtomicU64) }
}

/// Control word `i` (0 written, 1 read, 2 pid) of `rank`.
fn control(map: &MmapMut, rank: usize, i: usize) -> &AtomicU64 {
    atomic(map, HEADER + rank * CONTROL + i * 8)
}

fn slot_offset(world: usize, rank: usize) -> usize {
    HEADER + world * CONTROL + rank * (SLOT_HEADER + SLOT_BYTES)
}

impl ShmComm {
    /// Wait until control word `i` of every rank reaches `k`, or fail: the
    /// deadline, or a rank whose process is gone. A wait spins a little,
    /// then sleeps on the word (a futex: the kernel wakes it when the
    /// word's owner publishes), so a rank that waits gives its core to the
    /// one it waits for.
    fn wait_all(&self, map: &MmapMut, what: (Op, u64), i: usize, k: u64) -> Result<(), CommError> {
        let t0 = Instant::now();
        let mut spins = 0u32;
        for p in 0..self.world {
            let word = control(map, p, i);
            loop {
                let v = word.load(Ordering::Acquire);
                if v >= k {
                    break;
                }
                spins += 1;
                if spins < SPINS {
                    std::hint::spin_loop();
                    continue;
                }
                futex_wait(word, v as u32, Duration::from_millis(1));
                let pid = control(map, p, 2).load(Ordering::Acquire) as i32;
                // SAFETY: kill with signal 0 only checks that the process exists.
                if pid > 0 && unsafe { libc::kill(pid, 0) } != 0 {
                    return Err(CommError::PeerGone {
                        rank: self.rank,
                        peer: p,
                        op: what.0,
                        seq: what.1,
                        detail: format!("its process {pid} is gone"),
                    });
                }
                if t0.elapsed() > self.deadline {
                    return Err(CommError::Timeout {
                        rank: self.rank,
                        peer: p,
                        op: what.0,
                        seq: what.1,
                        deadline: self.deadline,
                    });
                }
            }
        }
        Ok(())
    }

    /// One round: publish `mine` (≤ SLOT_BYTES) and, once every rank has,
    /// hand `take` each rank's (op, seq, payload); `want_len` checks each
    /// payload's length (None: any, e.g. a broadcast's non-roots publish none).
    fn round(
        &self,
        st: &mut State,
        op: Op,
        seq: u64,
        mine: &[u8],
        mut take: impl FnMut(usize, &[u8]) -> Result<(), CommError>,
    ) -> Result<(), CommError> {
        st.round += 1;
        let k = st.round;
        let (w, r) = (self.world, self.rank);
        let map = &st.map;
        // 1. My slot is free once every rank has read round k − 1.
        self.wait_all(map, (op, seq), 1, k - 1)?;
        // 2. Write it, then publish.
        let at = slot_offset(w, r);
        // SAFETY: this rank alone writes its slot, and only between the
        // wait above (no reader left) and the release store below.
        unsafe {
            let base = map.as_ptr().add(at) as *mut u8;
            for (i, v) in [op as u64, seq, mine.len() as u64].iter().enumerate() {
                std::ptr::copy_nonoverlapping(v.to_le_bytes().as_ptr(), base.add(i * 8), 8);
            }
            std::ptr::copy_nonoverlapping(mine.as_ptr(), base.add(SLOT_HEADER), mine.len());
        }
        control(map, r, 0).store(k, Ordering::Release);
        futex_wake(control(map, r, 0));
        // 3. Wait for everyone's, check and read them.
        self.wait_all(map, (op, seq), 0, k)?;
        for p in 0..w {
            let at = slot_offset(w, p);
            let word = |i: usize| {
                u64::from_le_bytes(map[at + i * 8..at + i * 8 + 8].try_into().expect("8"))
            };
            let (pop, pseq, len) = (word(0), word(1), word(2) as usize);
            if pop != op as u64 || pseq != seq {
                let got = match Op::from_u8(pop as u8) {
                    Some(o) => format!("{o:?} #{pseq}"),
                    None => format!("operation {pop} #{pseq}"),
                };
                return Err(CommError::OutOfOrder {
                    rank: r,
                    peer: p,
                    op,
                    seq,
                    got,
                });
            }
            if len > SLOT_BYTES {
                return Err(CommError::Length {
                    rank: r,
                    peer: p,
                    op,
                    seq,
                    got: len as u64,
                    want: SLOT_BYTES as u64,
                });
            }
            take(p, &map[at + SLOT_HEADER..at + SLOT_HEADER + len])?;
        }
        control(map, r, 1).store(k, Ordering::Release);
        futex_wake(control(map, r, 1));
        Ok(())
    }

    fn call<R>(
        &self,
        bytes: u64,
        f: impl FnOnce(&mut State) -> Result<R, CommError>,
    ) -> Result<R, CommError> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(first) = &st.broken {
            return Err(CommError::Broken {
                rank: self.rank,
                first: first.clone(),
            });
        }
        let t0 = Instant::now();
        st.seq += 1;
        let r = f(&mut st);
        st.stats.seconds += t0.elapsed().as_secs_f64();
        match &r {
            Ok(_) => {
                st.stats.calls += 1;
                st.stats.bytes_sent += bytes;
            }
            Err(e) => st.broken = Some(e.to_string()),
        }
        self.seen.publish(st.stats, &st.broken);
        r
    }

    fn length(&self, p: usize, op: Op, seq: u64, got: usize, want: usize) -> CommError {
        CommError::Length {
            rank: self.rank,
            peer: p,
            op,
            seq,
            got: got as u64,
            want: want as u64,
        }
    }
}

fn as_bytes(v: &[f32]) -> Vec<u8> {
    let mut b = Vec::with_capacity(v.len() * 4);
    crate::comm::f32_bytes(v, &mut b);
    b
}

impl Communicator for ShmComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CommError> {
        let per = SLOT_BYTES / 4;
        // Pieces of one slot each, each element summed in the reference order.
        self.call((buf.len() * 4) as u64, |st| {
            let seq = st.seq;
            let n = buf.len();
            let mut start = 0;
            loop {
                let end = (start + per).min(n);
                let mine = as_bytes(&buf[start..end]);
                let mut vals = std::mem::take(&mut st.vals);
                self.round(st, Op::AllReduce, seq, &mine, |p, b| {
                    if b.len() != mine.len() {
                        return Err(self.length(p, Op::AllReduce, seq, b.len(), mine.len()));
                    }
                    vals[p].resize(b.len() / 4, 0.0);
                    crate::comm::bytes_f32(b, &mut vals[p]);
                    Ok(())
                })?;
                // Element i summed from rank i mod W on (the reference order).
                let pieces: Vec<&[f32]> = vals.iter().map(Vec::as_slice).collect();
                reference_sum_from(&pieces, start, &mut buf[start..end]);
                st.vals = vals;
                start = end;
                if start >= n {
                    return Ok(());
                }
            }
        })
    }

    fn all_gather(&self, mine: &[f32], all: &mut [f32]) -> Result<(), CommError> {
        let (w, n) = (self.world, mine.len());
        if Some(all.len()) != n.checked_mul(w) || n * 4 > SLOT_BYTES {
            return Err(CommError::Usage {
                rank: self.rank,
                what: format!(
                    "all_gather of {n} values into {} (at most {} per rank on shm)",
                    all.len(),
                    SLOT_BYTES / 4
                ),
            });
        }
        self.call((n * 4) as u64, |st| {
            let seq = st.seq;
            let bytes = as_bytes(mine);
            self.round(st, Op::AllGather, seq, &bytes, |p, b| {
                if b.len() != bytes.len() {
                    return Err(self.length(p, Op::AllGather, seq, b.len(), bytes.len()));
                }
                crate::comm::bytes_f32(b, &mut all[p * n..(p + 1) * n]);
                Ok(())
            })
        })
    }

    fn broadcast(&self, root: usize, bytes: &mut Vec<u8>) -> Result<(), CommError> {
        self.broadcast_wait(root, bytes, Some(self.deadline))
    }

    /// Rounds of one slot each until the root's last piece (shorter than a
    /// slot) has been read. `wait` is not honoured beyond the deadline
    /// here: a shared-memory rank waiting idle spins, so ranks that wait
    /// for long use TCP for their commands.
    fn broadcast_wait(
        &self,
        root: usize,
        bytes: &mut Vec<u8>,
        _wait: Option<Duration>,
    ) -> Result<(), CommError> {
        if root >= self.world {
            return Err(CommError::Usage {
                rank: self.rank,
                what: format!("broadcast from rank {root} in a world of {}", self.world),
            });
        }
        let is_root = self.rank == root;
        let sent = if is_root { bytes.len() as u64 } else { 0 };
        self.call(sent, |st| {
            let seq = st.seq;
            let mut out = Vec::new();
            let mut at = 0;
            loop {
                let piece: Vec<u8> = if is_root {
                    bytes[at..(at + SLOT_BYTES).min(bytes.len())].to_vec()
                } else {
                    Vec::new()
                };
                let mut last = false;
                self.round(st, Op::Broadcast, seq, &piece, |p, b| {
                    if p == root {
                        last = b.len() < SLOT_BYTES;
                        if !is_root {
                            out.extend_from_slice(b);
                        }
                    }
                    Ok(())
                })?;
                at += piece.len();
                if last {
                    break;
                }
            }
            if !is_root {
                *bytes = out;
            }
            Ok(())
        })
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.call(0, |st| {
            let seq = st.seq;
            self.round(st, Op::Barrier, seq, &[], |_, _| Ok(()))
        })
    }

    fn send(&self, to: usize, _: &[u8]) -> Result<(), CommError> {
        Err(CommError::Usage {
            rank: self.rank,
            what: format!("send to rank {to}: the shared-memory backend has collectives only (pipeline stages use tcp or threads)"),
        })
    }

    fn recv(&self, from: usize, _: &mut Vec<u8>) -> Result<(), CommError> {
        Err(CommError::Usage {
            rank: self.rank,
            what: format!("recv from rank {from}: the shared-memory backend has collectives only (pipeline stages use tcp or threads)"),
        })
    }

    fn stats(&self) -> CommStats {
        self.seen.stats()
    }

    fn broken(&self) -> Option<String> {
        self.seen.broken()
    }
}

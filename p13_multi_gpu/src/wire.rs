//! The wire between simulated hosts: one thread reads every IP packet a
//! host's TUN interface sends, holds it for the link's one-way delay, and
//! writes it into the TUN interface of the host it is addressed to. What
//! `tc netem delay` does inside the kernel, for kernels built without it.
//!
//! A bandwidth cap is serialization, as netem's `rate`: a host's packets
//! leave one after another, each taking its length over the rate, then
//! travel the delay; no burst allowance (a token bucket's would let the
//! small messages of a decode step through uncapped).
//!
//! Each host's packets queue in the order they were sent, and their due
//! times only grow (the host's link is busy until its last packet left;
//! the delay is one for all). The thread sleeps in `ppoll(2)` until
//! a packet arrives or the next one is due, with a 1 ns timer slack (a
//! thread's default is 50 µs, more than the smallest delay asked for),
//! and spins for the last few µs of a wait.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::hosts::HostsError;

/// Below this, a wait spins instead of sleeping.
const SPIN: Duration = Duration::from_micros(20);
/// The largest packet a TUN device hands over.
const PACKET: usize = 65_536;
const PR_SET_TIMERSLACK: libc::c_int = 29;

#[derive(Debug, Default)]
struct Shared {
    stop: AtomicBool,
    delay_ns: AtomicU64,
    /// Bits per second; 0: no cap.
    rate_bps: AtomicU64,
    carried: AtomicU64,
    dropped: AtomicU64,
}

/// The running wire; dropping it stops the thread and closes the devices.
#[derive(Debug)]
pub struct Wire {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Wire {
    /// Carry packets between `tuns` (host r's is `tuns[r]`, its address
    /// `subnet.(r + 1)`).
    pub fn start(tuns: Vec<OwnedFd>, subnet: [u8; 3]) -> Result<Wire, HostsError> {
        let shared = Arc::new(Shared::default());
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("wire".into())
            .spawn(move || carry(&tuns, subnet, &s))
            .map_err(|source| HostsError::Io {
                what: "starting the wire's thread".into(),
                source,
            })?;
        Ok(Wire {
            shared,
            thread: Some(thread),
        })
    }

    /// Every host's one-way delay and egress rate (bits per second, None:
    /// no cap) from now on.
    pub fn set(&self, delay: Duration, rate_bps: Option<u64>) {
        let ns = u64::try_from(delay.as_nanos()).unwrap_or(u64::MAX);
        self.shared.delay_ns.store(ns, Ordering::Relaxed);
        self.shared
            .rate_bps
            .store(rate_bps.unwrap_or(0), Ordering::Relaxed);
    }

    /// (packets carried, packets dropped as not for any host).
    pub fn counts(&self) -> (u64, u64) {
        (
            self.shared.carried.load(Ordering::Relaxed),
            self.shared.dropped.load(Ordering::Relaxed),
        )
    }
}

impl Drop for Wire {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Which host an IPv4 packet is for (None: not IPv4, or not a host's).
pub fn destination(packet: &[u8], subnet: [u8; 3], hosts: usize) -> Option<usize> {
    if packet.len() < 20 || packet[0] >> 4 != 4 {
        return None;
    }
    let dst = &packet[16..20];
    let last = dst[3] as usize;
    (dst[..3] == subnet && (1..=hosts).contains(&last)).then(|| last - 1)
}

fn carry(tuns: &[OwnedFd], subnet: [u8; 3], shared: &Shared) {
    // SAFETY: prctl on this thread only.
    unsafe { libc::prctl(PR_SET_TIMERSLACK, 1 as libc::c_ulong) };
    let n = tuns.len();
    // queues[src]: (due, destination, packet), due times growing.
    let mut queues: Vec<VecDeque<(Instant, usize, Vec<u8>)>> =
        (0..n).map(|_| VecDeque::new()).collect();
    // When each host's link has sent its last queued packet.
    let mut busy: Vec<Instant> = vec![Instant::now(); n];
    let mut spare: Vec<Vec<u8>> = Vec::new();
    let mut fds: Vec<libc::pollfd> = tuns
        .iter()
        .map(|t| libc::pollfd {
            fd: t.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    while !shared.stop.load(Ordering::Relaxed) {
        // Deliver what is due.
        let now = Instant::now();
        for q in &mut queues {
            while q.front().is_some_and(|(due, _, _)| *due <= now) {
                let Some((_, dst, p)) = q.pop_front() else {
                    break;
                };
                // SAFETY: writing p's bytes to a TUN descriptor we own; a
                // packet the kernel refuses is lost, as on a wire.
                unsafe { libc::write(tuns[dst].as_raw_fd(), p.as_ptr().cast(), p.len()) };
                shared.carried.fetch_add(1, Ordering::Relaxed);
                spare.push(p);
            }
        }
        // Wait for a packet or the next due time (100 ms at most, to see
        // the stop flag).
        let next = queues.iter().filter_map(|q| q.front().map(|x| x.0)).min();
        let wait = next.map_or(Duration::from_millis(100), |t| {
            t.saturating_duration_since(now)
        });
        let wait = if wait < SPIN {
            Duration::ZERO
        } else {
            wait - SPIN / 2
        };
        let ts = libc::timespec {
            tv_sec: wait.as_secs() as libc::time_t,
            tv_nsec: wait.subsec_nanos() as libc::c_long,
        };
        // SAFETY: fds is a live array of n pollfd.
        let ready =
            unsafe { libc::ppoll(fds.as_mut_ptr(), n as libc::nfds_t, &ts, std::ptr::null()) };
        if ready <= 0 {
            continue;
        }
        let delay = Duration::from_nanos(shared.delay_ns.load(Ordering::Relaxed));
        let rate = shared.rate_bps.load(Ordering::Relaxed);
        for (src, pfd) in fds.iter_mut().enumerate() {
            if pfd.revents & libc::POLLIN == 0 {
                continue;
            }
            loop {
                let mut p = spare.pop().unwrap_or_default();
                p.resize(PACKET, 0);
                // SAFETY: reading at most PACKET bytes into p.
                let got =
                    unsafe { libc::read(tuns[src].as_raw_fd(), p.as_mut_ptr().cast(), PACKET) };
                if got <= 0 {
                    spare.push(p);
                    break;
                }
                p.truncate(got as usize);
                match destination(&p, subnet, n) {
                    Some(dst) => {
                        // Serialized after the host's earlier packets, then
                        // the delay.
                        let now = Instant::now();
                        let mut sent = now;
                        let bits = (p.len() as u64 * 8).saturating_mul(1_000_000_000);
                        if let Some(ns) = bits.checked_div(rate) {
                            sent = busy[src].max(now) + Duration::from_nanos(ns);
                            busy[src] = sent;
                        }
                        queues[src].push_back((sent + delay, dst, p));
                    }
                    None => {
                        shared.dropped.fetch_add(1, Ordering::Relaxed);
                        spare.push(p);
                    }
                }
            }
        }
    }
}

//! Several hosts on one machine: a network namespace per rank, each with
//! one interface, joined by a link whose delay and bandwidth can be set.
//!
//! ```text
//!   namespace il13-<pid>-<set>-0:  il0  10.13.0.1/24 ─┐
//!   namespace il13-<pid>-<set>-1:  il0  10.13.0.2/24 ─┼─ the wire (a thread of this process)
//!   namespace il13-<pid>-<set>-2:  il0  10.13.0.3/24 ─┘
//! ```
//!
//! Each `il0` is a TUN device: what a namespace's kernel sends out of it,
//! this process reads as an IP packet; the [`crate::wire`] holds it for
//! the link's delay and writes it into the destination namespace's `il0`,
//! whose kernel receives it as from a cable. Where the kernel has `tc
//! netem` (`CONFIG_NET_SCH_NETEM`), the delay is set with netem on every
//! `il0` instead and the wire forwards at once. A bandwidth cap is each
//! host's egress rate (netem's `rate`, or the wire's, which works alike).
//!
//! The addresses exist only inside these namespaces: nothing outside them
//! is reachable from them. Dropping [`Hosts`] deletes the namespaces (and
//! with them the interfaces); namespaces left by a killed process are
//! deleted by the next [`Hosts::new`].

use std::fs::File;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::Command;
use std::time::Duration;

use thiserror::Error;

use crate::comm::CommError;
use crate::frame::{Hello, PROTOCOL_VERSION};
use crate::mesh::{Algorithm, Mesh};
use crate::tcp::{connect, TcpLinks};
use crate::wire::Wire;

/// The first three octets of every host's address; host r is .(r + 1).
pub const SUBNET: [u8; 3] = [10, 13, 0];
/// The port every rank listens on (each namespace has its own ports).
pub const PORT: u16 = 29_500;
/// The interface MTU (Ethernet's).
pub const MTU: usize = 1500;

const PREFIX: &str = "il13-";

#[derive(Debug, Error)]
pub enum HostsError {
    #[error("`{command}` failed: {reason} (simulated hosts need root, the kernel's network namespaces and TUN devices, and iproute2's `ip` and `tc`: apt-get install iproute2)")]
    Command { command: String, reason: String },
    #[error("{what}: {source} (simulated hosts need root and /dev/net/tun)")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Comm(#[from] CommError),
}

/// What every host's link does to a packet it sends.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Link {
    /// One-way delay added to every packet.
    pub delay: Duration,
    /// Egress bandwidth cap, megabits per second.
    pub rate_mbit: Option<u32>,
}

impl Link {
    pub fn name(&self) -> String {
        let d = self.delay.as_secs_f64() * 1e6;
        let delay = if d >= 1000.0 {
            format!("{} ms", d / 1000.0)
        } else {
            format!("{d} µs")
        };
        match self.rate_mbit {
            Some(m) => format!("{delay}, {m} Mbit/s"),
            None => delay,
        }
    }
}

/// How the delay is made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DelayBy {
    Netem,
    Wire,
}

impl DelayBy {
    pub fn name(self) -> &'static str {
        match self {
            DelayBy::Netem => "tc netem",
            DelayBy::Wire => "the wire (this kernel has no tc netem)",
        }
    }
}

/// `n` namespaces, their TUN interfaces and the wire between them.
#[derive(Debug)]
pub struct Hosts {
    names: Vec<String>,
    wire: Option<Wire>,
    delay_by: DelayBy,
}

/// Run a command (`ip`, `tc`), its stderr as the error.
pub fn run(args: &[&str]) -> Result<(), HostsError> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| HostsError::Command {
            command: args.join(" "),
            reason: e.to_string(),
        })?;
    if out.status.success() {
        return Ok(());
    }
    Err(HostsError::Command {
        command: args.join(" "),
        reason: String::from_utf8_lossy(&out.stderr).trim().to_string(),
    })
}

/// Delete namespaces named `<prefix><pid>-...` whose process is gone.
pub fn sweep(prefix: &str) {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(rest) = name.strip_prefix(prefix) else {
            continue;
        };
        let pid = rest.split('-').next().and_then(|p| p.parse::<u32>().ok());
        if let Some(pid) = pid {
            if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
                let _ = run(&["ip", "netns", "del", name]);
            }
        }
    }
}

/// This thread into namespace `name` (its sockets and devices from now
/// on are that namespace's).
pub fn enter_ns(name: &str) -> Result<(), HostsError> {
    let path = format!("/run/netns/{name}");
    let f = File::open(&path).map_err(|source| HostsError::Io {
        what: format!("opening {path}"),
        source,
    })?;
    // SAFETY: setns on a namespace file we hold open.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(HostsError::Io {
            what: format!("entering network namespace {name}"),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

// From <linux/if_tun.h>.
const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const IFF_TUN: libc::c_short = 0x0001;
const IFF_NO_PI: libc::c_short = 0x1000;

/// A TUN device `il0` in namespace `name` (made from a thread that
/// enters it), non-blocking; it lives while the descriptor is open.
fn tun_in(name: &str) -> Result<OwnedFd, HostsError> {
    let name = name.to_string();
    std::thread::spawn(move || -> Result<OwnedFd, HostsError> {
        enter_ns(&name)?;
        let path = c"/dev/net/tun";
        // SAFETY: open(2) on a constant path; the result is checked.
        let fd = unsafe {
            libc::open(
                path.as_ptr(),
                libc::O_RDWR | libc::O_NONBLOCK | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(HostsError::Io {
                what: "opening /dev/net/tun".into(),
                source: std::io::Error::last_os_error(),
            });
        }
        // SAFETY: fd is a new descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // struct ifreq: the name (16 bytes), then the flags (a short).
        let mut ifr = [0u8; 40];
        ifr[..3].copy_from_slice(b"il0");
        ifr[16..18].copy_from_slice(&(IFF_TUN | IFF_NO_PI).to_ne_bytes());
        // SAFETY: TUNSETIFF reads and writes a struct ifreq, 40 bytes.
        if unsafe { libc::ioctl(fd.as_raw_fd(), TUNSETIFF, ifr.as_mut_ptr()) } != 0 {
            return Err(HostsError::Io {
                what: format!("creating TUN device il0 in {name}"),
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(fd)
    })
    .join()
    .map_err(|_| HostsError::Command {
        command: "creating a TUN device".into(),
        reason: "its thread panicked".into(),
    })?
}

impl Hosts {
    /// `n` hosts (1 ≤ n ≤ 200), links with no delay and no cap.
    pub fn new(n: usize) -> Result<Hosts, HostsError> {
        if n == 0 || n > 200 {
            return Err(HostsError::Command {
                command: format!("Hosts::new({n})"),
                reason: "between 1 and 200 hosts".into(),
            });
        }
        sweep(PREFIX);
        // Several sets may live in one process (tests run in parallel).
        static SETS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let set = SETS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let pid = std::process::id();
        let mut hosts = Hosts {
            names: Vec::new(),
            wire: None,
            delay_by: DelayBy::Wire,
        };
        let mut tuns = Vec::new();
        for r in 0..n {
            let name = format!("{PREFIX}{pid}-{set}-{r}");
            run(&["ip", "netns", "add", &name])?;
            hosts.names.push(name.clone());
            tuns.push(tun_in(&name)?);
            let addr = format!("{}/24", hosts.addr(r));
            let mtu = MTU.to_string();
            run(&["ip", "-n", &name, "link", "set", "dev", "lo", "up"])?;
            run(&["ip", "-n", &name, "addr", "add", &addr, "dev", "il0"])?;
            run(&[
                "ip", "-n", &name, "link", "set", "dev", "il0", "mtu", &mtu, "up",
            ])?;
        }
        let netem = [
            "tc",
            "-n",
            &hosts.names[0],
            "qdisc",
            "replace",
            "dev",
            "il0",
            "root",
        ];
        if run(&[&netem[..], &["netem", "delay", "0us"]].concat()).is_ok() {
            hosts.delay_by = DelayBy::Netem;
        }
        hosts.wire = Some(Wire::start(tuns, SUBNET)?);
        hosts.set_link(Link::default())?;
        Ok(hosts)
    }

    pub fn len(&self) -> usize {
        self.names.len()
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    pub fn addr(&self, r: usize) -> Ipv4Addr {
        Ipv4Addr::new(SUBNET[0], SUBNET[1], SUBNET[2], (r + 1) as u8)
    }

    /// Host r's namespace (for `ip netns exec NAME ...`).
    pub fn name(&self, r: usize) -> &str {
        &self.names[r]
    }

    pub fn delay_by(&self) -> DelayBy {
        self.delay_by
    }

    /// Move the calling thread into host r's namespace.
    pub fn enter(&self, r: usize) -> Result<(), HostsError> {
        enter_ns(&self.names[r])
    }

    /// Every host's link from now on.
    pub fn set_link(&self, link: Link) -> Result<(), HostsError> {
        match self.delay_by {
            DelayBy::Netem => {
                let us = link.delay.as_micros().to_string() + "us";
                let rate = link.rate_mbit.map(|m| format!("{m}mbit"));
                for name in &self.names {
                    let mut args = vec!["tc", "-n", name, "qdisc", "replace", "dev", "il0", "root"];
                    args.extend(["netem", "delay", &us]);
                    if let Some(rate) = &rate {
                        args.extend(["rate", rate]);
                    }
                    run(&args)?;
                }
            }
            DelayBy::Wire => {
                if let Some(w) = &self.wire {
                    w.set(link.delay, link.rate_mbit.map(|m| u64::from(m) * 1_000_000));
                }
            }
        }
        Ok(())
    }

    /// One TCP communicator per host, rank r's sockets in host r's
    /// namespace (made from a thread that enters it; the sockets stay
    /// there whichever thread then uses them).
    pub fn tcp_group(
        &self,
        deadline: Duration,
        algorithm: Algorithm,
    ) -> Result<Vec<Mesh<TcpLinks>>, HostsError> {
        let world = self.len();
        let addrs: Vec<SocketAddr> = (0..world)
            .map(|r| SocketAddr::from((self.addr(r), PORT)))
            .collect();
        let token = u64::from(std::process::id()) ^ 0x1213;
        let links = std::thread::scope(|s| {
            let joins: Vec<_> = (0..world)
                .map(|rank| {
                    let addrs = &addrs;
                    s.spawn(move || -> Result<TcpLinks, HostsError> {
                        self.enter(rank)?;
                        let l =
                            TcpListener::bind(addrs[rank]).map_err(|source| HostsError::Io {
                                what: format!("binding {} in {}", addrs[rank], self.names[rank]),
                                source,
                            })?;
                        let hello = Hello {
                            version: PROTOCOL_VERSION,
                            world: world as u32,
                            rank: rank as u32,
                            token,
                            layout: 0,
                        };
                        Ok(connect(&l, addrs, hello, Duration::from_secs(10))?)
                    })
                })
                .collect();
            joins
                .into_iter()
                .map(|j| {
                    j.join().map_err(|_| HostsError::Command {
                        command: "connecting the hosts' ranks".into(),
                        reason: "a thread panicked".into(),
                    })?
                })
                .collect::<Result<Vec<_>, _>>()
        })?;
        Ok(links
            .into_iter()
            .map(|l| Mesh::new(l, deadline, algorithm))
            .collect())
    }

    /// Packets the wire has carried and dropped (not for a host).
    pub fn wire_counts(&self) -> (u64, u64) {
        self.wire.as_ref().map_or((0, 0), Wire::counts)
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        // The wire closes the TUN descriptors; then the namespaces go.
        self.wire.take();
        for name in &self.names {
            let _ = run(&["ip", "netns", "del", name]);
        }
    }
}

//! Two hosts on one machine: a prefill host and a decode host, each a
//! network namespace, joined by a veth pair (a virtual cable) whose
//! bandwidth is set by the kernel's own shaper.
//!
//! ```text
//!   namespace il14-<pid>-<set>-p           namespace il14-<pid>-<set>-d
//!   il0  10.14.0.1/24  ════ veth pair ════  il0  10.14.0.2/24
//!        tbf rate R (+ netem delay D)            tbf rate R (+ netem delay D)
//! ```
//!
//! Each end's egress is shaped alike: a token bucket (`tc tbf`) at the
//! link's rate, and, where the kernel has `tc netem`, a one-way delay
//! below it. Unlike Project 13's TUN wire (a thread of ours moving every
//! packet), the packets never leave the kernel, so the link reaches
//! 10 Gbit/s and more: what limits it is the CPU, and the bench measures
//! that ceiling in the same run.
//!
//! The addresses exist only inside these namespaces. Dropping [`TwoHosts`]
//! deletes the namespaces (the veth pair goes with them); namespaces left
//! by a killed process are deleted by the next [`TwoHosts::new`].

use std::net::Ipv4Addr;
use std::time::Duration;

use p13_multi_gpu::hosts::{enter_ns, run, sweep, HostsError};

const PREFIX: &str = "il14-";
/// The first three octets of both addresses; host h is .(h + 1).
pub const SUBNET: [u8; 3] = [10, 14, 0];

/// Which end of the cable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Host {
    Prefill = 0,
    Decode = 1,
}

/// What the link does: a rate and a one-way delay (both directions).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Shape {
    /// Megabits per second; None: as fast as the CPUs move packets.
    pub rate_mbit: Option<u64>,
    pub delay: Duration,
}

impl Shape {
    pub fn rate(mbit: u64) -> Shape {
        Shape {
            rate_mbit: Some(mbit),
            delay: Duration::ZERO,
        }
    }

    /// A bench's `--links` entry: `loopback` (None: no hosts), `veth` (two
    /// hosts, unshaped) or a rate in Mbit/s.
    pub fn parse_link(s: &str) -> Result<Option<Shape>, String> {
        Ok(match s.trim() {
            "loopback" => None,
            "veth" => Some(Shape::default()),
            m => Some(Shape::rate(m.parse().map_err(|_| {
                format!("--links: `{m}` is not loopback, veth or a rate in Mbit/s")
            })?)),
        })
    }

    /// "10 Gbit/s", "1 Gbit/s, 50 µs", "unshaped".
    pub fn name(&self) -> String {
        let rate = match self.rate_mbit {
            Some(m) if m % 1000 == 0 => format!("{} Gbit/s", m / 1000),
            Some(m) => format!("{m} Mbit/s"),
            None => "unshaped".into(),
        };
        if self.delay.is_zero() {
            rate
        } else {
            format!("{rate}, {} µs", self.delay.as_micros())
        }
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// The two namespaces and the cable between them, and a thread living in
/// each for as long as they do: child processes started from it die with
/// it (PR_SET_PDEATHSIG fires when the thread that started a child ends,
/// so a short-lived thread cannot start one).
#[derive(Debug)]
pub struct TwoHosts {
    names: [String; 2],
    kept: Vec<(std::sync::mpsc::Sender<Job>, std::thread::JoinHandle<()>)>,
}

impl TwoHosts {
    pub fn new() -> Result<TwoHosts, HostsError> {
        sweep(PREFIX);
        static SETS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let set = SETS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let pid = std::process::id();
        let names = [
            format!("{PREFIX}{pid}-{set}-p"),
            format!("{PREFIX}{pid}-{set}-d"),
        ];
        run(&["ip", "netns", "add", &names[0]])?;
        let mut hosts = TwoHosts {
            names,
            kept: Vec::new(),
        };
        run(&["ip", "netns", "add", &hosts.names[1]])?;
        let [p, d] = [&hosts.names[0], &hosts.names[1]];
        run(&[
            "ip", "link", "add", "il0", "netns", p, "type", "veth", "peer", "name", "il0", "netns",
            d,
        ])?;
        for h in [Host::Prefill, Host::Decode] {
            let name = hosts.name(h);
            let addr = format!("{}/24", hosts.addr(h));
            run(&["ip", "-n", name, "link", "set", "dev", "lo", "up"])?;
            run(&["ip", "-n", name, "addr", "add", &addr, "dev", "il0"])?;
            run(&["ip", "-n", name, "link", "set", "dev", "il0", "up"])?;
        }
        for name in hosts.names.clone() {
            let (tx, rx) = std::sync::mpsc::channel::<Job>();
            let (ok_tx, ok_rx) = std::sync::mpsc::channel();
            let join = std::thread::spawn(move || {
                let entered = enter_ns(&name);
                let ok = entered.is_ok();
                let _ = ok_tx.send(entered);
                if ok {
                    for job in rx {
                        job();
                    }
                }
            });
            ok_rx.recv().map_err(|_| HostsError::Command {
                command: "a host's thread".into(),
                reason: "it ended at once".into(),
            })??;
            hosts.kept.push((tx, join));
        }
        Ok(hosts)
    }

    /// Run `f` on host `h`'s kept thread: what it starts (child processes
    /// above all) lives until these hosts are dropped.
    pub fn on_kept<T: Send + 'static>(
        &self,
        h: Host,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, HostsError> {
        let (tx, rx) = std::sync::mpsc::channel();
        let gone = || HostsError::Command {
            command: format!("the thread of {}", self.name(h)),
            reason: "it is gone".into(),
        };
        self.kept[h as usize]
            .0
            .send(Box::new(move || {
                let _ = tx.send(f());
            }))
            .map_err(|_| gone())?;
        rx.recv().map_err(|_| gone())
    }

    pub fn addr(&self, h: Host) -> Ipv4Addr {
        Ipv4Addr::new(SUBNET[0], SUBNET[1], SUBNET[2], h as u8 + 1)
    }

    /// The host's namespace (for `ip netns exec NAME ...`).
    pub fn name(&self, h: Host) -> &str {
        &self.names[h as usize]
    }

    /// Shape both ends' egress from now on.
    pub fn set_link(&self, s: Shape) -> Result<(), HostsError> {
        for name in &self.names {
            // Start from no qdisc (the veth default); a missing one is fine.
            let _ = run(&["tc", "-n", name, "qdisc", "del", "dev", "il0", "root"]);
            let Some(mbit) = s.rate_mbit else {
                if !s.delay.is_zero() {
                    let d = format!("{}us", s.delay.as_micros());
                    run(&[
                        "tc", "-n", name, "qdisc", "add", "dev", "il0", "root", "netem", "delay",
                        &d,
                    ])
                    .map_err(netem_missing)?;
                }
                continue;
            };
            // The bucket holds 200 µs at the rate (at least two 64 KiB
            // segments: veth hands tbf whole GSO super-packets).
            let burst = (mbit * 1_000_000 / 8 / 5_000).max(128 << 10);
            let (rate, burst) = (format!("{mbit}mbit"), burst.to_string());
            run(&[
                "tc", "-n", name, "qdisc", "add", "dev", "il0", "root", "handle", "1:", "tbf",
                "rate", &rate, "burst", &burst, "latency", "20ms",
            ])?;
            if !s.delay.is_zero() {
                let d = format!("{}us", s.delay.as_micros());
                run(&[
                    "tc", "-n", name, "qdisc", "add", "dev", "il0", "parent", "1:1", "handle",
                    "10:", "netem", "delay", &d,
                ])
                .map_err(netem_missing)?;
            }
        }
        Ok(())
    }

    /// Run `f` on a new thread inside host `h`'s namespace: the sockets it
    /// makes belong to that host, whichever thread then uses them (threads
    /// it starts inherit the namespace). Not for child processes: see
    /// [`TwoHosts::on_kept`].
    pub fn in_host<T: Send>(&self, h: Host, f: impl FnOnce() -> T + Send) -> Result<T, HostsError> {
        let name = self.name(h);
        std::thread::scope(|s| {
            s.spawn(|| -> Result<T, HostsError> {
                enter_ns(name)?;
                Ok(f())
            })
            .join()
            .map_err(|_| HostsError::Command {
                command: format!("a thread in {name}"),
                reason: "it panicked".into(),
            })?
        })
    }
}

fn netem_missing(e: HostsError) -> HostsError {
    match e {
        HostsError::Command { command, reason } => HostsError::Command {
            command,
            reason: format!("{reason} (a delay needs tc netem, CONFIG_NET_SCH_NETEM; rates alone need only tbf)"),
        },
        e => e,
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        // The kept threads end (their children get SIGKILL), then the
        // namespaces go.
        for (tx, join) in self.kept.drain(..) {
            drop(tx);
            let _ = join.join();
        }
        for name in &self.names {
            let _ = run(&["ip", "netns", "del", name]);
        }
    }
}

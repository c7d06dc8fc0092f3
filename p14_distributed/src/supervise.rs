//! `up`'s supervisor: the workers it started, kept running. A worker that
//! exits (killed, crashed, out of memory) is started again with the same
//! role, id and arguments, at once the first time and then with a backoff
//! that doubles (0.5 s up to 30 s) while it keeps dying within a minute of
//! its start: what a Kubernetes Deployment's restart policy does for a
//! pod. The replacement registers in etcd like any new worker; the proxy
//! migrates the requests the dead one held (see `proxy.rs`) and holds new
//! ones for a decode worker up to its `--worker-wait-s`.
//!
//! The children die with the thread that spawned them (PR_SET_PDEATHSIG),
//! so one thread spawns them all, first and again, and lives as long as
//! the supervisor.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::cluster::{self, Proc};
use crate::registry::Role;

/// One worker to keep running.
#[derive(Clone, Debug)]
pub struct WorkerSpec {
    pub role: Role,
    pub id: String,
    /// Everything after the role on its command line.
    pub args: Vec<String>,
}

/// A worker's state under supervision.
struct Slot {
    spec: WorkerSpec,
    proc: Option<Proc>,
    started: Instant,
    /// Deaths in a row, each within [`STABLE`] of its start.
    quick_deaths: u32,
    next_try: Instant,
}

/// A worker that ran this long before dying starts its backoff afresh.
const STABLE: Duration = Duration::from_secs(60);
const POLL: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(30);

/// The wait before restarting a worker that died `quick_deaths` times in
/// a row soon after starting: none, then 0.5 s, 1 s, 2 s … up to 30 s.
pub fn backoff(quick_deaths: u32) -> Duration {
    match quick_deaths {
        0 | 1 => Duration::ZERO,
        n => (Duration::from_millis(500) * 2u32.saturating_pow(n - 2)).min(BACKOFF_MAX),
    }
}

/// Counters for the log and the tests.
#[derive(Debug, Default)]
pub struct SupervisorStats {
    pub restarts: AtomicU64,
    pub failed_starts: AtomicU64,
}

#[derive(Debug)]
pub struct Supervisor {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    pub stats: Arc<SupervisorStats>,
}

impl Supervisor {
    /// Start every worker of `specs` (this binary at `exe`), each waited
    /// for until it is ready; then watch them until dropped.
    pub fn start(exe: PathBuf, specs: Vec<WorkerSpec>) -> anyhow::Result<Supervisor> {
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(SupervisorStats::default());
        let (ready, started) = std::sync::mpsc::channel::<anyhow::Result<()>>();
        let (s, st) = (stop.clone(), stats.clone());
        let thread = std::thread::Builder::new()
            .name("supervisor".into())
            .spawn(move || {
                let mut slots = Vec::new();
                for spec in specs {
                    match cluster::start_worker(&exe, spec.role.as_str(), &spec.args) {
                        Ok((p, url)) => {
                            eprintln!("{} worker {} at {url}", spec.role.as_str(), spec.id);
                            slots.push(Slot {
                                spec,
                                proc: Some(p),
                                started: Instant::now(),
                                quick_deaths: 0,
                                next_try: Instant::now(),
                            });
                        }
                        Err(e) => {
                            let _ = ready.send(Err(e.context(format!("starting {}", spec.id))));
                            return;
                        }
                    }
                }
                let _ = ready.send(Ok(()));
                watch(&exe, &mut slots, &s, &st);
            })
            .context("starting the supervisor thread")?;
        started
            .recv()
            .context("the supervisor thread ended before the workers started")??;
        Ok(Supervisor {
            stop,
            thread: Some(thread),
            stats,
        })
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Until `stop`: restart whichever worker has exited.
fn watch(exe: &std::path::Path, slots: &mut [Slot], stop: &AtomicBool, stats: &SupervisorStats) {
    while !stop.load(Ordering::SeqCst) {
        for slot in slots.iter_mut() {
            if let Some(p) = &mut slot.proc {
                let Ok(Some(status)) = p.child.try_wait() else {
                    continue;
                };
                slot.proc = None;
                slot.quick_deaths = match slot.started.elapsed() < STABLE {
                    true => slot.quick_deaths + 1,
                    false => 1,
                };
                let wait = backoff(slot.quick_deaths);
                slot.next_try = Instant::now() + wait;
                eprintln!(
                    "up: {} worker {} exited ({status}); restarting in {wait:?}",
                    slot.spec.role.as_str(),
                    slot.spec.id
                );
            }
            if slot.proc.is_none() && Instant::now() >= slot.next_try {
                let s = &slot.spec;
                match cluster::start_worker(exe, s.role.as_str(), &s.args) {
                    Ok((p, url)) => {
                        eprintln!("up: {} worker {} back at {url}", s.role.as_str(), s.id);
                        stats.restarts.fetch_add(1, Ordering::SeqCst);
                        slot.proc = Some(p);
                        slot.started = Instant::now();
                    }
                    Err(e) => {
                        eprintln!("up: restarting {} failed: {e:#}", s.id);
                        stats.failed_starts.fetch_add(1, Ordering::SeqCst);
                        slot.quick_deaths += 1;
                        slot.next_try = Instant::now() + backoff(slot.quick_deaths);
                    }
                }
            }
        }
        std::thread::sleep(POLL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backoff_starts_at_once_then_doubles_to_its_cap() {
        let ms: Vec<u128> = (0..10).map(|n| backoff(n).as_millis()).collect();
        assert_eq!(ms, [0, 0, 500, 1000, 2000, 4000, 8000, 16000, 30000, 30000]);
        assert_eq!(backoff(u32::MAX), BACKOFF_MAX);
    }
}

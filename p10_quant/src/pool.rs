//! A small thread pool for the ~200 matrix products of one decode token.
//!
//! A token of SmolLM2 in Q4_1 is ~210 products of 50–500 µs each. Waking a
//! sleeping thread costs a futex call and a scheduler round trip (tens of
//! µs on these VMs), paid per product with a fork-join pool that parks its
//! workers. Here the workers **spin** on an epoch counter for a while after
//! each job (`spin`, 200 µs by default), so the next product of the same
//! token finds them awake; only when the model thread is idle longer do
//! they sleep on a condition variable.
//!
//! `run(f)` calls `f(0)` on the calling thread and `f(1..n)` on the
//! workers, and returns when all have returned: like a scoped thread
//! spawn, which is what makes lending `f` (not `'static`) to them sound.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

type Job = dyn Fn(usize) + Sync;

#[derive(Default)]
struct Shared {
    /// Bumped once per job; a worker runs each epoch's job once.
    epoch: AtomicUsize,
    /// The current job: valid from its epoch's bump until `pending` is 0.
    job: Mutex<Option<JobPtr>>,
    /// Workers still running the current job.
    pending: AtomicUsize,
    /// A worker's panic in the current job.
    panicked: AtomicBool,
    stop: AtomicBool,
    /// Workers asleep (or about to be) on `wake`.
    sleepers: AtomicUsize,
    sleep: Mutex<()>,
    wake: Condvar,
}

/// A job lent to the workers for the length of one `run`.
#[derive(Clone, Copy)]
struct JobPtr(*const Job);

// SAFETY: the pointee is `Sync` (`Job: Sync`), and `run` keeps it alive
// until every worker is done with it.
unsafe impl Send for JobPtr {}

pub struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// One job at a time.
    running: Mutex<()>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("threads", &self.threads())
            .finish()
    }
}

impl Pool {
    /// A pool of `threads` participants (the caller and `threads - 1`
    /// workers) whose workers spin for `spin` after each job.
    pub fn new(threads: usize, spin: Duration) -> Pool {
        let shared = Arc::new(Shared::default());
        let workers = (1..threads.max(1))
            .map(|i| {
                let s = shared.clone();
                std::thread::Builder::new()
                    .name(format!("p10-pool-{i}"))
                    .spawn(move || worker(&s, i, spin))
                    .ok()
            })
            .take_while(Option::is_some)
            .flatten()
            .collect();
        Pool {
            shared,
            workers,
            running: Mutex::new(()),
        }
    }

    /// The process-wide pool: one participant per core.
    pub fn global() -> &'static Pool {
        static POOL: OnceLock<Pool> = OnceLock::new();
        POOL.get_or_init(|| {
            let n = std::thread::available_parallelism().map_or(1, |n| n.get());
            Pool::new(n, Duration::from_micros(200))
        })
    }

    /// Participants, the caller included.
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// `f(i)` for every participant i (0 on this thread); returns when all
    /// have returned. A panic in any is resumed here.
    pub fn run(&self, f: &(dyn Fn(usize) + Sync)) {
        let workers = self.workers.len();
        if workers == 0 {
            f(0);
            return;
        }
        let _one = self.running.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        // SAFETY: only the lifetime is erased. The pointer is published
        // below and read by workers only between the epoch bump and their
        // `pending` decrement; this function does not return before
        // `pending` is 0, so `f` outlives every use.
        let job: *const Job =
            unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync + '_), &'static Job>(f) };
        *s.job.lock().unwrap_or_else(|e| e.into_inner()) = Some(JobPtr(job));
        s.panicked.store(false, Ordering::Relaxed);
        s.pending.store(workers, Ordering::SeqCst);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = s.sleep.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        let mine = catch_unwind(AssertUnwindSafe(|| f(0)));
        while s.pending.load(Ordering::Acquire) != 0 {
            std::hint::spin_loop();
        }
        *s.job.lock().unwrap_or_else(|e| e.into_inner()) = None;
        if let Err(p) = mine {
            resume_unwind(p);
        }
        if s.panicked.load(Ordering::Relaxed) {
            panic!("a pool worker panicked");
        }
    }

    /// Split `0..n` into one contiguous range per participant and run
    /// `f(range)` on each (at most `parts` participants work).
    pub fn for_ranges(&self, n: usize, parts: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
        let parts = parts.clamp(1, self.threads());
        if parts == 1 || n < 2 {
            f(0..n);
            return;
        }
        let chunk = n.div_ceil(parts);
        self.run(&|i| {
            let lo = (i * chunk).min(n);
            let hi = ((i + 1) * chunk).min(n);
            if lo < hi {
                f(lo..hi);
            }
        });
    }
}

/// The process-wide pool as the engine's thread seam
/// (`common::par::ForRanges`): a native engine's attention rows run on the
/// same threads as its products, not on a second pool that would compete
/// with this one's spinning workers for the cores.
#[derive(Clone, Copy, Debug, Default)]
pub struct GlobalPool;

impl common::par::ForRanges for GlobalPool {
    fn threads(&self) -> usize {
        Pool::global().threads()
    }

    fn for_ranges(&self, n: usize, parts: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
        Pool::global().for_ranges(n, parts, f)
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        {
            let _g = self.shared.sleep.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

fn worker(s: &Shared, index: usize, spin: Duration) {
    // The epoch the pool was made with (not what it is when this thread
    // first runs: a job may already be waiting for it).
    let mut seen = 0;
    loop {
        // Wait for the next epoch: spin first, then sleep.
        let start = Instant::now();
        let mut spins = 0u32;
        while s.epoch.load(Ordering::SeqCst) == seen {
            if s.stop.load(Ordering::SeqCst) {
                return;
            }
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(64) || start.elapsed() < spin {
                std::hint::spin_loop();
                continue;
            }
            let mut g = s.sleep.lock().unwrap_or_else(|e| e.into_inner());
            s.sleepers.fetch_add(1, Ordering::SeqCst);
            while s.epoch.load(Ordering::SeqCst) == seen && !s.stop.load(Ordering::SeqCst) {
                g = s.wake.wait(g).unwrap_or_else(|e| e.into_inner());
            }
            s.sleepers.fetch_sub(1, Ordering::SeqCst);
        }
        if s.stop.load(Ordering::SeqCst) {
            return;
        }
        seen = s.epoch.load(Ordering::SeqCst);
        let job = *s.job.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(JobPtr(f)) = job {
            // SAFETY: `run` keeps the job alive until `pending` reaches 0,
            // which happens only after this call returns.
            let r = catch_unwind(AssertUnwindSafe(|| unsafe { (*f)(index) }));
            if r.is_err() {
                s.panicked.store(true, Ordering::Relaxed);
            }
        }
        s.pending.fetch_sub(1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_participant_runs_each_job_once_and_results_are_visible() {
        let pool = Pool::new(3, Duration::from_micros(50));
        for round in 0..2000 {
            let hits: Vec<AtomicUsize> = (0..3).map(|_| AtomicUsize::new(0)).collect();
            pool.run(&|i| {
                hits[i].fetch_add(round + 1, Ordering::Relaxed);
            });
            for h in &hits {
                assert_eq!(h.load(Ordering::Relaxed), round + 1);
            }
            if round % 500 == 0 {
                // Let the workers fall asleep: the wake-up path.
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }

    #[test]
    fn a_job_right_after_creation_reaches_every_worker() {
        // The workers may not have run yet when the first job is posted.
        for _ in 0..200 {
            let pool = Pool::new(3, Duration::from_micros(50));
            let n = AtomicUsize::new(0);
            pool.run(&|_| {
                n.fetch_add(1, Ordering::Relaxed);
            });
            assert_eq!(n.load(Ordering::Relaxed), 3);
        }
    }

    #[test]
    fn ranges_cover_everything_once() {
        let pool = Pool::new(2, Duration::from_micros(50));
        for n in [0, 1, 2, 7, 100] {
            let seen: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.for_ranges(n, 2, &|r| {
                for i in r {
                    seen[i].fetch_add(1, Ordering::Relaxed);
                }
            });
            assert!(
                seen.iter().all(|s| s.load(Ordering::Relaxed) == 1),
                "n = {n}"
            );
        }
    }

    #[test]
    fn a_worker_panic_reaches_the_caller_and_the_pool_goes_on() {
        let pool = Pool::new(2, Duration::from_micros(50));
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(&|i| assert_ne!(i, 1, "worker fails"));
        }));
        assert!(r.is_err());
        let n = AtomicUsize::new(0);
        pool.run(&|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 2);
    }
}

//! The proxy's choice of workers. Prefill: the worker holding the longest
//! cached prefix of the prompt (from the K/V events), then the least
//! loaded. Decode: the most free K/V blocks. Load comes from the NATS
//! reports while they are fresh (under a second old); without them
//! (NATS down) from the requests this proxy has in flight on each worker.
//! A worker that refused a connection is passed over for a few seconds,
//! ahead of etcd noticing its lease.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::events::LoadReport;
use crate::registry::WorkerRecord;

const FRESH: Duration = Duration::from_secs(1);
const SUSPECT: Duration = Duration::from_secs(3);

/// One worker's cached block hashes, oldest first (bounded by its pool).
#[derive(Debug, Default)]
struct Cached {
    set: HashSet<u64>,
    order: VecDeque<u64>,
}

#[derive(Debug, Default)]
pub struct Board {
    reports: Mutex<HashMap<String, (LoadReport, Instant)>>,
    cached: Mutex<HashMap<String, Cached>>,
    inflight: Mutex<HashMap<String, usize>>,
    suspect: Mutex<HashMap<String, Instant>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Why a worker was picked (the proxy's routing counters).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Basis {
    Prefix,
    Reported,
    InFlight,
}

impl Board {
    pub fn report(&self, r: LoadReport) {
        lock(&self.reports).insert(r.id.clone(), (r, Instant::now()));
    }

    pub fn stored(&self, id: &str, hashes: &[u64]) {
        let cap = lock(&self.reports)
            .get(id)
            .map_or(4096, |(r, _)| r.kv_total_blocks.max(1));
        let mut all = lock(&self.cached);
        let c = all.entry(id.to_string()).or_default();
        for &h in hashes {
            if c.set.insert(h) {
                c.order.push_back(h);
            }
        }
        while c.order.len() > cap {
            if let Some(h) = c.order.pop_front() {
                c.set.remove(&h);
            }
        }
    }

    fn fresh(&self, id: &str) -> Option<LoadReport> {
        lock(&self.reports)
            .get(id)
            .filter(|(_, t)| t.elapsed() < FRESH)
            .map(|(r, _)| r.clone())
    }

    /// Workers whose last report is fresh enough to route by.
    pub fn fresh_reports(&self) -> usize {
        lock(&self.reports)
            .values()
            .filter(|(_, t)| t.elapsed() < FRESH)
            .count()
    }

    pub fn begin(&self, id: &str) {
        *lock(&self.inflight).entry(id.to_string()).or_default() += 1;
    }

    pub fn end(&self, id: &str) {
        if let Some(n) = lock(&self.inflight).get_mut(id) {
            *n = n.saturating_sub(1);
        }
    }

    fn inflight(&self, id: &str) -> usize {
        lock(&self.inflight).get(id).copied().unwrap_or(0)
    }

    /// A worker that failed a request is tried last for a while; by
    /// instance, so that its replacement under the same id is not.
    pub fn mark_suspect(&self, w: &WorkerRecord) {
        let mut m = lock(&self.suspect);
        m.retain(|_, t| t.elapsed() < SUSPECT);
        m.insert(w.instance(), Instant::now());
    }

    fn is_suspect(&self, w: &WorkerRecord) -> bool {
        lock(&self.suspect)
            .get(&w.instance())
            .is_some_and(|t| t.elapsed() < SUSPECT)
    }

    fn prefix_len(&self, id: &str, hashes: &[u64]) -> usize {
        let all = lock(&self.cached);
        let Some(c) = all.get(id) else { return 0 };
        hashes.iter().take_while(|h| c.set.contains(h)).count()
    }

    /// Healthy candidates first, suspects after (tried only when nothing
    /// else is left), excluding `tried`.
    fn candidates<'a>(&self, all: &'a [WorkerRecord], tried: &[String]) -> Vec<&'a WorkerRecord> {
        let (healthy, suspect): (Vec<&WorkerRecord>, Vec<&WorkerRecord>) = all
            .iter()
            .filter(|w| !tried.contains(&w.id))
            .partition(|w| !self.is_suspect(w));
        match healthy.is_empty() {
            true => suspect,
            false => healthy,
        }
    }

    /// The prefill worker for a prompt whose full blocks hash to `hashes`.
    pub fn pick_prefill(
        &self,
        all: &[WorkerRecord],
        hashes: &[u64],
        tried: &[String],
    ) -> Option<(WorkerRecord, Basis)> {
        let c = self.candidates(all, tried);
        let best = c.iter().min_by_key(|w| {
            let queue = match self.fresh(&w.id) {
                Some(r) => r.running + r.waiting + self.inflight(&w.id),
                None => self.inflight(&w.id),
            };
            (std::cmp::Reverse(self.prefix_len(&w.id, hashes)), queue)
        })?;
        let basis = if self.prefix_len(&best.id, hashes) > 0 {
            Basis::Prefix
        } else if self.fresh(&best.id).is_some() {
            Basis::Reported
        } else {
            Basis::InFlight
        };
        Some(((*best).clone(), basis))
    }

    /// The decode worker with the most free K/V.
    pub fn pick_decode(
        &self,
        all: &[WorkerRecord],
        tried: &[String],
    ) -> Option<(WorkerRecord, Basis)> {
        let c = self.candidates(all, tried);
        let reported = c.iter().all(|w| self.fresh(&w.id).is_some());
        let best = c.iter().max_by_key(|w| {
            let inflight = self.inflight(&w.id);
            match (reported, self.fresh(&w.id)) {
                (true, Some(r)) => (
                    r.kv_total_blocks.saturating_sub(r.kv_used_blocks) as i64,
                    -(inflight as i64),
                ),
                _ => (0, -(inflight as i64)),
            }
        })?;
        let basis = if reported {
            Basis::Reported
        } else {
            Basis::InFlight
        };
        Some(((*best).clone(), basis))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::Role;

    fn worker(id: &str, port: u16, pid: u32) -> WorkerRecord {
        WorkerRecord {
            id: id.into(),
            role: Role::Prefill,
            model: "m".into(),
            model_id: 1,
            http: format!("http://127.0.0.1:{port}"),
            kv_addr: None,
            layout_hash: 1,
            block_size: 16,
            kv_blocks: 64,
            context_length: 2048,
            pid,
        }
    }

    /// A worker that failed is passed over while another is healthy; its
    /// replacement under the same id (another process) is not.
    #[test]
    fn a_suspect_is_passed_over_but_not_its_replacement_under_its_id() {
        let b = Board::default();
        let (dead, other) = (worker("p0", 1000, 10), worker("p1", 1001, 11));
        b.mark_suspect(&dead);
        let pick = b.pick_prefill(&[dead.clone(), other.clone()], &[], &[]);
        assert_eq!(pick.map(|p| p.0.id), Some("p1".to_string()));
        // Busy the other so that a healthy p0 would win on load.
        b.begin("p1");
        let back = worker("p0", 1002, 12);
        let pick = b.pick_prefill(&[back, other], &[], &[]);
        assert_eq!(pick.map(|p| p.0.pid), Some(12));
    }
}

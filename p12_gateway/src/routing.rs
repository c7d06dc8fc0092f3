//! Which backend serves a request: per model, a pool of backends and a
//! policy that orders them (the first is tried first; the rest are the
//! retries' fallbacks, in order).
//!
//! - round-robin: each request starts one further along;
//! - least outstanding: fewest requests in flight first (ties in order);
//! - prefix affinity: requests whose prompts share their leading
//!   `affinity_prefix_tokens` tokens go to the same backend, so its prefix
//!   cache (Project 09) is hit. The prefix is hashed as p09 hashes KV blocks
//!   (a chain over full blocks of token ids) and the backends are ranked by
//!   rendezvous hashing: when a backend leaves, only its prefixes move.
//!   A choice this many requests busier than the least-loaded backend gives
//!   way to it, so one hot prefix cannot pile onto one backend;
//! - scored: llm-d's filter -> score -> pick over what each server reports
//!   (queue, K/V usage) and the prefixes sent to it (see `score`).
//!
//! Ejected backends (failed health checks) are left out; open breakers
//! are skipped when a request is sent (see `proxy`).

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use p09_kv_manager::prefix_hash::{block_hashes, Xxh3BlockHasher};

use crate::breaker::{Breaker, BreakerConfig};
use crate::config::{Policy, Scoring};
use crate::score::{BlockIndex, Reported};

/// One backend server and what the gateway knows of it.
#[derive(Debug)]
pub struct Backend {
    /// Base URL, no trailing slash.
    pub url: String,
    /// Requests sent and not yet finished.
    pub outstanding: AtomicUsize,
    /// False once health checks have ejected it.
    pub healthy: AtomicBool,
    /// Consecutive failed health checks.
    pub health_failures: AtomicU32,
    pub breaker: Mutex<Breaker>,
    /// Its server's last `/metrics` report (scored pools scrape it).
    pub reported: Mutex<Option<Reported>>,
    /// Block hashes of the prompts sent to it (scored pools).
    pub blocks: Mutex<BlockIndex>,
}

impl Backend {
    pub fn new(url: &str, breaker: BreakerConfig) -> Backend {
        Backend {
            url: url.trim_end_matches('/').to_string(),
            outstanding: AtomicUsize::new(0),
            healthy: AtomicBool::new(true),
            health_failures: AtomicU32::new(0),
            breaker: Mutex::new(Breaker::new(breaker)),
            reported: Mutex::new(None),
            blocks: Mutex::new(BlockIndex::default()),
        }
    }

    pub fn breaker(&self) -> std::sync::MutexGuard<'_, Breaker> {
        self.breaker.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// How prefix affinity reads a prompt.
#[derive(Clone, Copy, Debug)]
pub struct Affinity {
    pub block_tokens: usize,
    pub prefix_tokens: usize,
    pub max_imbalance: usize,
}

/// One model's backends and policy. The backends can change while the
/// gateway runs (a platform's discovery sets them: [`Pool::set_urls`]).
#[derive(Debug)]
pub struct Pool {
    backends: RwLock<Vec<Arc<Backend>>>,
    pub policy: Policy,
    pub affinity: Affinity,
    pub scoring: Scoring,
    next: AtomicUsize,
    /// Requests waiting for a first backend (the activator's hold).
    pub held: AtomicUsize,
}

/// The affinity key of a prompt: the chained hash of the full blocks within
/// its first `prefix_tokens` tokens (`None` when it has no full block).
pub fn prefix_key(prompt: &[u32], a: Affinity) -> Option<u64> {
    let head = &prompt[..prompt.len().min(a.prefix_tokens)];
    block_hashes(&Xxh3BlockHasher, head, a.block_tokens, b"")
        .last()
        .copied()
}

/// Rendezvous weight of a backend for a key: XXH3 of the key's 8 bytes
/// and the URL, so every gateway replica ranks backends alike.
fn rendezvous(key: u64, url: &str) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(&key.to_le_bytes());
    h.update(url.as_bytes());
    h.digest()
}

impl Pool {
    pub fn new(backends: Vec<Arc<Backend>>, policy: Policy, affinity: Affinity) -> Pool {
        Pool {
            backends: RwLock::new(backends),
            policy,
            affinity,
            scoring: Scoring::default(),
            next: AtomicUsize::new(0),
            held: AtomicUsize::new(0),
        }
    }

    pub fn with_scoring(mut self, scoring: Scoring) -> Pool {
        self.scoring = scoring;
        self
    }

    /// The backends now.
    pub fn backends(&self) -> Vec<Arc<Backend>> {
        self.backends
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Serve through exactly `urls`: a backend already here keeps its
    /// counters and breaker, a new one starts healthy, a missing one is
    /// dropped (requests in flight to it finish). Whether anything changed.
    pub fn set_urls(&self, urls: &[String], breaker: BreakerConfig) -> bool {
        let mut b = self.backends.write().unwrap_or_else(|p| p.into_inner());
        let want: Vec<String> = urls
            .iter()
            .map(|u| u.trim_end_matches('/').to_string())
            .collect();
        if b.iter().map(|x| &x.url).eq(want.iter()) {
            return false;
        }
        let next: Vec<Arc<Backend>> = want
            .iter()
            .map(|u| match b.iter().find(|x| &x.url == u) {
                Some(x) => x.clone(),
                None => Arc::new(Backend::new(u, breaker)),
            })
            .collect();
        *b = next;
        true
    }

    /// Healthy backends in the order to try them for a prompt of `prompt`
    /// token ids. Empty when every backend is ejected.
    pub fn order(&self, prompt: &[u32]) -> Vec<Arc<Backend>> {
        let backends = self.backends();
        self.order_indices(&backends, prompt)
            .into_iter()
            .map(|i| backends[i].clone())
            .collect()
    }

    fn order_indices(&self, backends: &[Arc<Backend>], prompt: &[u32]) -> Vec<usize> {
        let n = backends.len();
        let healthy: Vec<usize> = (0..n)
            .filter(|&i| backends[i].healthy.load(Ordering::Relaxed))
            .collect();
        if healthy.is_empty() {
            return healthy;
        }
        // Rotated one further per call, so that ties spread out.
        let rotated = |v: Vec<usize>| -> Vec<usize> {
            let start = self.next.fetch_add(1, Ordering::Relaxed) % v.len();
            v[start..].iter().chain(&v[..start]).copied().collect()
        };
        let load = |i: usize| backends[i].outstanding.load(Ordering::Relaxed);
        let by_load = |mut v: Vec<usize>| {
            v.sort_by_key(|&i| load(i)); // stable: ties keep their order
            v
        };
        match self.policy {
            Policy::RoundRobin => rotated(healthy),
            Policy::LeastOutstanding => by_load(rotated(healthy)),
            Policy::Scored => crate::score::order(
                backends,
                &rotated(healthy),
                prompt,
                self.affinity.block_tokens,
                &self.scoring,
            ),
            Policy::PrefixAffinity => {
                let Some(key) = prefix_key(prompt, self.affinity) else {
                    return by_load(rotated(healthy));
                };
                let mut ranked = healthy;
                ranked.sort_by_key(|&i| std::cmp::Reverse(rendezvous(key, &backends[i].url)));
                let least = ranked.iter().map(|&i| load(i)).min().unwrap_or(0);
                if load(ranked[0]) >= least + self.affinity.max_imbalance.max(1) {
                    return by_load(ranked);
                }
                ranked
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The order as indices into the pool's backends.
    fn order(p: &Pool, prompt: &[u32]) -> Vec<usize> {
        let b = p.backends();
        p.order(prompt)
            .iter()
            .map(|x| b.iter().position(|y| Arc::ptr_eq(x, y)).unwrap())
            .collect()
    }

    fn idx(p: &Pool, prompt: &[u32]) -> usize {
        order(p, prompt)[0]
    }

    fn pool(policy: Policy, n: usize) -> Pool {
        let backends = (0..n)
            .map(|i| {
                Arc::new(Backend::new(
                    &format!("http://b{i}"),
                    BreakerConfig::default(),
                ))
            })
            .collect();
        Pool::new(
            backends,
            policy,
            Affinity {
                block_tokens: 4,
                prefix_tokens: 8,
                max_imbalance: 3,
            },
        )
    }

    #[test]
    fn round_robin_rotates_and_skips_the_ejected() {
        let p = pool(Policy::RoundRobin, 3);
        let firsts: Vec<usize> = (0..6).map(|_| idx(&p, &[])).collect();
        assert_eq!(firsts, [0, 1, 2, 0, 1, 2]);
        p.backends()[1].healthy.store(false, Ordering::Relaxed);
        let o = order(&p, &[]);
        assert_eq!(o.len(), 2);
        assert!(!o.contains(&1));
    }

    #[test]
    fn least_outstanding_goes_to_the_idlest() {
        let p = pool(Policy::LeastOutstanding, 3);
        p.backends()[0].outstanding.store(5, Ordering::Relaxed);
        p.backends()[1].outstanding.store(1, Ordering::Relaxed);
        p.backends()[2].outstanding.store(3, Ordering::Relaxed);
        assert_eq!(order(&p, &[]), [1, 2, 0]);
    }

    #[test]
    fn a_shared_prefix_sticks_to_one_backend_and_spreads_across_prefixes() {
        let p = pool(Policy::PrefixAffinity, 4);
        let with = |head: u32, tail: u32| [head, head, head, head, 7, 7, 7, 7, tail, tail];
        let first = idx(&p, &with(1, 0));
        for tail in 1..20 {
            assert_eq!(
                idx(&p, &with(1, tail)),
                first,
                "the tail past 8 tokens is ignored"
            );
        }
        let used: std::collections::HashSet<usize> =
            (0..64).map(|h| idx(&p, &with(h, 0))).collect();
        assert!(
            used.len() >= 3,
            "64 prefixes over 4 backends used only {used:?}"
        );
        // A busy choice gives way.
        p.backends()[first].outstanding.store(3, Ordering::Relaxed);
        assert_ne!(idx(&p, &with(1, 0)), first);
    }

    #[test]
    fn set_urls_keeps_the_backends_it_had_and_their_counters() {
        let p = pool(Policy::RoundRobin, 2);
        p.backends()[1].outstanding.store(4, Ordering::Relaxed);
        let urls = ["http://b1".to_string(), "http://b9".to_string()];
        assert!(p.set_urls(&urls, BreakerConfig::default()));
        let b = p.backends();
        assert_eq!(
            b.iter().map(|x| x.url.as_str()).collect::<Vec<_>>(),
            ["http://b1", "http://b9"]
        );
        assert_eq!(
            b[0].outstanding.load(Ordering::Relaxed),
            4,
            "b1 kept its count"
        );
        assert!(
            !p.set_urls(&urls, BreakerConfig::default()),
            "no change the second time"
        );
        assert!(p.set_urls(&[], BreakerConfig::default()));
        assert!(p.order(&[]).is_empty());
    }

    #[test]
    fn an_ejected_backend_moves_only_its_own_prefixes() {
        let p = pool(Policy::PrefixAffinity, 4);
        let prompt = |h: u32| vec![h; 8];
        let before: Vec<usize> = (0..64).map(|h| idx(&p, &prompt(h))).collect();
        p.backends()[2].healthy.store(false, Ordering::Relaxed);
        for (h, &b) in before.iter().enumerate() {
            let now = idx(&p, &prompt(h as u32));
            if b != 2 {
                assert_eq!(now, b, "prefix {h} moved though its backend stayed");
            } else {
                assert_ne!(now, 2);
            }
        }
    }
}

//! Scored routing, as llm-d's inference scheduler does it: **filter** the
//! backends, **score** each survivor on what its server reports, **pick**
//! the best (the rest, best first, are the retries' fallbacks).
//!
//! ```text
//! filter   healthy, and K/V usage below `kv_full` (unless none is)
//! score    prefix  weight x (leading prompt blocks this backend has seen)
//!                           / (the prompt's full blocks)
//!        + queue   weight x (q_max - q) / (q_max - q_min)     (1 if all equal)
//!        + kv      weight x (1 - K/V usage)
//!          q = max(requests this gateway has in flight there,
//!                  the server's running + waiting)
//! pick     highest total (ties rotate); the prompt's blocks are then
//!          remembered for the picked backend
//! ```
//!
//! The server's figures come from its Prometheus page (`/metrics`:
//! `vllm:num_requests_running`, `vllm:num_requests_waiting`,
//! `vllm:kv_cache_usage_perc`), scraped every `scrape_ms` ([`scrape_all`]).
//! A report older than five scrapes is not trusted (the in-flight count
//! alone stands for the queue, usage reads 0).
//!
//! Which blocks a server holds is estimated, as llm-d's approximate prefix
//! scorer does: the gateway remembers the block hashes of the prompts it
//! sent there (the same chained hashes Project 09's prefix cache keys
//! blocks by), the last `index_blocks` of them per backend. It is wrong
//! when the server evicts, and it is what a router knows without the
//! server's own cache events.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use p09_kv_manager::prefix_hash::{block_hashes, Xxh3BlockHasher};

use crate::config::Scoring;
use crate::routing::Backend;
use crate::state::Gateway;

/// What a backend's server last said about itself.
#[derive(Clone, Copy, Debug)]
pub struct Reported {
    pub running: f64,
    pub waiting: f64,
    /// Fraction of the K/V pool held by sequences, 0 to 1.
    pub kv_usage: f64,
    pub at: Instant,
}

/// The latest distinct block hashes routed to one backend.
#[derive(Debug, Default)]
pub struct BlockIndex {
    stamp: u64,
    /// hash -> stamp of its latest insertion.
    seen: HashMap<u64, u64>,
    order: VecDeque<(u64, u64)>,
}

impl BlockIndex {
    /// Remember `h`, keeping the latest `cap` hashes.
    pub fn insert(&mut self, h: u64, cap: usize) {
        self.stamp += 1;
        self.seen.insert(h, self.stamp);
        self.order.push_back((h, self.stamp));
        while self.seen.len() > cap {
            let Some((old, stamp)) = self.order.pop_front() else {
                break;
            };
            if self.seen.get(&old) == Some(&stamp) {
                self.seen.remove(&old);
            }
        }
        // Stale entries (re-inserted hashes) would let `order` grow.
        if self.order.len() > 2 * cap.max(1) {
            let seen = &self.seen;
            self.order.retain(|(h, s)| seen.get(h) == Some(s));
        }
    }

    /// How many of `hashes`, from the first, are here.
    pub fn leading(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.seen.contains_key(h))
            .count()
    }

    pub fn len(&self) -> usize {
        self.seen.len()
    }

    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }
}

/// One backend's scores, for a test or a log line.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Scores {
    pub prefix: f64,
    pub queue: f64,
    pub kv: f64,
    pub total: f64,
}

/// The chained hashes of every full block of `prompt`.
pub fn prompt_blocks(prompt: &[u32], block_tokens: usize) -> Vec<u64> {
    block_hashes(&Xxh3BlockHasher, prompt, block_tokens.max(1), b"")
}

/// The backend's report, if recent enough to trust.
fn fresh(b: &Backend, s: &Scoring, now: Instant) -> Option<Reported> {
    let r = (*b.reported.lock().unwrap_or_else(|p| p.into_inner()))?;
    let stale = Duration::from_millis(s.scrape_ms.max(1) * 5);
    (now.saturating_duration_since(r.at) <= stale).then_some(r)
}

/// Filter and score `healthy` (indices into `backends`); the survivors
/// with their scores, in the order given.
pub fn score(
    backends: &[Arc<Backend>],
    healthy: &[usize],
    blocks: &[u64],
    s: &Scoring,
    now: Instant,
) -> Vec<(usize, Scores)> {
    let seen: Vec<(usize, Option<Reported>)> = healthy
        .iter()
        .map(|&i| (i, fresh(&backends[i], s, now)))
        .collect();
    let usage = |r: &Option<Reported>| r.map_or(0.0, |r| r.kv_usage.clamp(0.0, 1.0));
    let mut kept: Vec<(usize, Option<Reported>)> = seen
        .iter()
        .filter(|(_, r)| usage(r) < s.kv_full)
        .copied()
        .collect();
    if kept.is_empty() {
        kept = seen;
    }
    let queue = |i: usize, r: &Option<Reported>| {
        let mine = backends[i].outstanding.load(Ordering::Relaxed) as f64;
        r.map_or(mine, |r| mine.max(r.running + r.waiting))
    };
    let qs: Vec<f64> = kept.iter().map(|(i, r)| queue(*i, r)).collect();
    let q_min = qs.iter().copied().fold(f64::INFINITY, f64::min);
    let q_max = qs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    kept.iter()
        .zip(&qs)
        .map(|(&(i, r), &q)| {
            let prefix = match blocks.len() {
                0 => 0.0,
                n => {
                    let idx = backends[i].blocks.lock().unwrap_or_else(|p| p.into_inner());
                    idx.leading(blocks) as f64 / n as f64
                }
            };
            let queue = if q_max > q_min {
                (q_max - q) / (q_max - q_min)
            } else {
                1.0
            };
            let kv = 1.0 - usage(&r);
            let total = s.prefix_weight * prefix + s.queue_weight * queue + s.kv_weight * kv;
            (
                i,
                Scores {
                    prefix,
                    queue,
                    kv,
                    total,
                },
            )
        })
        .collect()
}

/// The order to try: the scored survivors, best first (`healthy` comes
/// rotated, so ties spread); the prompt's blocks are remembered for the
/// first.
pub fn order(
    backends: &[Arc<Backend>],
    healthy: &[usize],
    prompt: &[u32],
    block_tokens: usize,
    s: &Scoring,
) -> Vec<usize> {
    let blocks = prompt_blocks(prompt, block_tokens);
    let mut scored = score(backends, healthy, &blocks, s, Instant::now());
    // Stable: equal totals keep the rotated order.
    scored.sort_by(|a, b| b.1.total.total_cmp(&a.1.total));
    if let Some(&(first, _)) = scored.first() {
        let mut idx = backends[first]
            .blocks
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        for &h in &blocks {
            idx.insert(h, s.index_blocks);
        }
    }
    scored.into_iter().map(|(i, _)| i).collect()
}

/// The sum of a metric's samples on a Prometheus text page (every label
/// set), 0 when absent.
pub fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A report from a `/metrics` page.
pub fn parse_report(text: &str, at: Instant) -> Reported {
    Reported {
        running: metric_sum(text, "vllm:num_requests_running"),
        waiting: metric_sum(text, "vllm:num_requests_waiting"),
        kv_usage: metric_sum(text, "vllm:kv_cache_usage_perc"),
        at,
    }
}

/// One scrape of every scored pool's backends.
pub async fn scrape_all(g: &Gateway) {
    let timeout = Duration::from_millis(g.cfg.scoring.scrape_ms.max(50));
    let backends: Vec<Arc<Backend>> = g
        .routes
        .values()
        .filter(|r| r.pool.policy == crate::config::Policy::Scored)
        .flat_map(|r| r.pool.backends())
        .collect();
    let scrapes = backends.iter().map(|b| async move {
        let got = tokio::time::timeout(timeout, async {
            let r = g.http.get(format!("{}/metrics", b.url)).send().await?;
            r.error_for_status()?.text().await
        })
        .await;
        if let Ok(Ok(text)) = got {
            *b.reported.lock().unwrap_or_else(|p| p.into_inner()) =
                Some(parse_report(&text, Instant::now()));
        }
    });
    futures_util::future::join_all(scrapes).await;
}

/// Scrape forever (spawn it); nothing to do without a scored pool.
pub async fn run(g: Arc<Gateway>) {
    let any = g
        .routes
        .values()
        .any(|r| r.pool.policy == crate::config::Policy::Scored);
    if !any {
        return;
    }
    let every = Duration::from_millis(g.cfg.scoring.scrape_ms.max(10));
    loop {
        scrape_all(&g).await;
        tokio::time::sleep(every).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::breaker::BreakerConfig;

    fn backends(n: usize) -> Vec<Arc<Backend>> {
        (0..n)
            .map(|i| {
                Arc::new(Backend::new(
                    &format!("http://b{i}"),
                    BreakerConfig::default(),
                ))
            })
            .collect()
    }

    fn report(b: &Backend, running: f64, waiting: f64, kv_usage: f64, at: Instant) {
        *b.reported.lock().unwrap() = Some(Reported {
            running,
            waiting,
            kv_usage,
            at,
        });
    }

    const S: Scoring = Scoring {
        prefix_weight: 3.0,
        queue_weight: 2.0,
        kv_weight: 1.0,
        kv_full: 0.95,
        scrape_ms: 100,
        index_blocks: 64,
    };

    #[test]
    fn a_prompt_goes_back_where_its_prefix_went_and_others_to_the_idlest() {
        let b = backends(3);
        let all = [0, 1, 2];
        let system: Vec<u32> = (0..64).collect();
        let first = order(&b, &all, &system, 16, &S)[0];
        // Same 64-token head, another tail: the prefix scores 4/5 there.
        let mut again = system.clone();
        again.extend(100..116);
        for rotation in [[1, 2, 0], [2, 0, 1]] {
            assert_eq!(order(&b, &rotation, &again, 16, &S)[0], first);
        }
        // The prefix's home is now busy (queue score 0) and the others idle:
        // 3 x 0.8 + 0 + 1 = 3.4 still beats 0 + 2 + 1 = 3.
        b[first].outstanding.store(6, Ordering::Relaxed);
        assert_eq!(order(&b, &all, &again, 16, &S)[0], first);
        // An unseen prompt goes to an idle backend.
        let other: Vec<u32> = (500..564).collect();
        assert_ne!(order(&b, &all, &other, 16, &S)[0], first);
    }

    #[test]
    fn the_server_queue_and_kv_usage_decide_when_no_prefix_is_known() {
        let b = backends(3);
        let now = Instant::now();
        report(&b[0], 4.0, 3.0, 0.2, now);
        report(&b[1], 1.0, 0.0, 0.5, now);
        report(&b[2], 1.0, 0.0, 0.1, now);
        let blocks = prompt_blocks(&[1; 32], 16);
        let s = score(&b, &[0, 1, 2], &blocks, &S, now);
        let total = |i: usize| s.iter().find(|x| x.0 == i).unwrap().1;
        assert_eq!(total(0).queue, 0.0);
        assert_eq!(total(1).queue, 1.0);
        assert!(
            (total(2).total - (2.0 + 0.9)).abs() < 1e-12,
            "{:?}",
            total(2)
        );
        assert_eq!(order(&b, &[0, 1, 2], &[1; 32], 16, &S), [2, 1, 0]);
    }

    #[test]
    fn a_full_kv_pool_is_filtered_out_unless_all_are_full() {
        let b = backends(2);
        let now = Instant::now();
        report(&b[0], 0.0, 0.0, 0.97, now);
        report(&b[1], 9.0, 9.0, 0.5, now);
        assert_eq!(order(&b, &[0, 1], &[], 16, &S), [1]);
        report(&b[1], 9.0, 9.0, 0.99, now);
        assert_eq!(order(&b, &[0, 1], &[], 16, &S), [0, 1]);
    }

    #[test]
    fn a_stale_report_is_not_trusted() {
        let b = backends(2);
        let old = Instant::now() - Duration::from_secs(5);
        report(&b[0], 50.0, 50.0, 0.99, old);
        b[1].outstanding.store(2, Ordering::Relaxed);
        // b0's report is 5 s old: its queue is its in-flight count (0).
        assert_eq!(order(&b, &[0, 1], &[], 16, &S), [0, 1]);
    }

    #[test]
    fn the_block_index_forgets_the_oldest_past_its_size() {
        let mut idx = BlockIndex::default();
        for h in 0..10 {
            idx.insert(h, 4);
        }
        assert_eq!(idx.len(), 4);
        assert_eq!(idx.leading(&[6, 7, 8, 9]), 4);
        assert_eq!(idx.leading(&[5, 6]), 0);
        // Touching 6 again keeps it past later insertions.
        idx.insert(6, 4);
        for h in 10..13 {
            idx.insert(h, 4);
        }
        assert_eq!(idx.leading(&[6]), 1);
        assert_eq!(idx.leading(&[7]), 0);
    }

    #[test]
    fn metric_sum_reads_whole_names_over_label_sets() {
        let text = "# TYPE vllm:num_requests_running gauge\n\
                    vllm:num_requests_running{model=\"a\"} 2\n\
                    vllm:num_requests_running{model=\"b\"} 3\n\
                    vllm:num_requests_running_total 100\n\
                    vllm:kv_cache_usage_perc 0.25\n";
        assert_eq!(metric_sum(text, "vllm:num_requests_running"), 5.0);
        let r = parse_report(text, Instant::now());
        assert_eq!((r.running, r.waiting, r.kv_usage), (5.0, 0.0, 0.25));
    }
}

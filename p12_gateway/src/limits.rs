//! Per-key limits that hold under concurrency: requests per minute and
//! tokens per minute as token buckets, and a cap on requests in flight.
//!
//! Admission *reserves* what a request may cost (its prompt tokens, counted
//! with the model's tokenizer, plus `n * max_tokens`) before it is sent, so
//! twenty requests racing on one key cannot all pass a check made before
//! their tokens are known. When the response ends the reservation is
//! *settled* at the tokens actually used (the backend's `usage`) and the rest
//! refunded. A bucket may go into debt when a backend reports more than was
//! reserved, so the accounting stays exact.
//!
//! Every check and take for one key happens under one lock: the three
//! limits are all passed, or nothing is taken.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::clock::Clock;

/// Holds up to `capacity`; refills at `rate` per second; starts full.
#[derive(Clone, Debug)]
pub struct TokenBucket {
    capacity: f64,
    /// Per second.
    rate: f64,
    /// May be negative: debt from usage above a reservation.
    level: f64,
    last: Duration,
}

/// Why a bucket said no.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Shortfall {
    /// Enough will have refilled after this long.
    RetryAfter(Duration),
    /// More than the bucket can ever hold.
    Never,
}

impl TokenBucket {
    /// `limit` per minute: capacity `limit`, refilled at `limit / 60` per second.
    pub fn per_minute(limit: u64, now: Duration) -> TokenBucket {
        TokenBucket {
            capacity: limit as f64,
            rate: limit as f64 / 60.0,
            level: limit as f64,
            last: now,
        }
    }

    fn refill(&mut self, now: Duration) {
        let dt = now.saturating_sub(self.last).as_secs_f64();
        self.level = (self.level + dt * self.rate).min(self.capacity);
        self.last = self.last.max(now);
    }

    /// Can `n` be taken now? (Refills first; takes nothing.)
    pub fn check(&mut self, n: f64, now: Duration) -> Result<(), Shortfall> {
        self.refill(now);
        if n > self.capacity {
            return Err(Shortfall::Never);
        }
        if n <= self.level {
            return Ok(());
        }
        let wait = if self.rate > 0.0 {
            (n - self.level) / self.rate
        } else {
            f64::INFINITY
        };
        Err(if wait.is_finite() {
            Shortfall::RetryAfter(Duration::from_secs_f64(wait))
        } else {
            Shortfall::Never
        })
    }

    /// Take `n` (after a successful [`check`](Self::check), or as a charge
    /// that may leave the bucket in debt).
    pub fn take(&mut self, n: f64, now: Duration) {
        self.refill(now);
        self.level -= n;
    }

    /// Give `n` back, never above capacity.
    pub fn give_back(&mut self, n: f64, now: Duration) {
        self.refill(now);
        self.level = (self.level + n).min(self.capacity);
    }

    pub fn level(&mut self, now: Duration) -> f64 {
        self.refill(now);
        self.level
    }
}

/// One key's limits (`None`: unlimited).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KeyLimits {
    pub requests_per_minute: Option<u64>,
    pub tokens_per_minute: Option<u64>,
    pub max_concurrent: Option<usize>,
}

/// Why a request was not admitted.
#[derive(Clone, Debug, PartialEq)]
pub enum Refusal {
    Requests {
        retry_after: Duration,
    },
    Tokens {
        retry_after: Duration,
    },
    /// `need` tokens is more than the key's whole per-minute budget.
    TooLarge {
        need: u64,
        limit: u64,
    },
    Concurrency {
        limit: usize,
    },
}

#[derive(Debug)]
struct KeyState {
    requests: Option<TokenBucket>,
    tokens: Option<TokenBucket>,
    max_concurrent: Option<usize>,
    running: usize,
}

impl KeyState {
    /// The limits that need no token count: requests in flight, and a
    /// request left this minute. Takes nothing.
    fn check_count_free(&mut self, now: Duration) -> Result<(), Refusal> {
        if let Some(limit) = self.max_concurrent {
            if self.running >= limit {
                return Err(Refusal::Concurrency { limit });
            }
        }
        if let Some(b) = &mut self.requests {
            match b.check(1.0, now) {
                Ok(()) => {}
                Err(Shortfall::RetryAfter(retry_after)) => {
                    return Err(Refusal::Requests { retry_after })
                }
                Err(Shortfall::Never) => {
                    return Err(Refusal::Requests {
                        retry_after: Duration::from_secs(60),
                    })
                }
            }
        }
        Ok(())
    }
}

#[derive(Debug)]
struct Inner {
    clock: Arc<dyn Clock>,
    keys: Mutex<HashMap<String, KeyState>>,
}

/// Every key's buckets.
#[derive(Clone, Debug)]
pub struct Limiter {
    inner: Arc<Inner>,
}

impl Limiter {
    pub fn new(
        clock: Arc<dyn Clock>,
        keys: impl IntoIterator<Item = (String, KeyLimits)>,
    ) -> Limiter {
        let now = clock.now();
        let keys = keys
            .into_iter()
            .map(|(name, l)| {
                let state = KeyState {
                    requests: l
                        .requests_per_minute
                        .map(|r| TokenBucket::per_minute(r, now)),
                    tokens: l.tokens_per_minute.map(|t| TokenBucket::per_minute(t, now)),
                    max_concurrent: l.max_concurrent,
                    running: 0,
                };
                (name, state)
            })
            .collect();
        Limiter {
            inner: Arc::new(Inner {
                clock,
                keys: Mutex::new(keys),
            }),
        }
    }

    /// Admit one request of up to `tokens` tokens on `key`, or say why not.
    /// A key with no entry is unlimited.
    pub fn admit(&self, key: &str, tokens: u64) -> Result<Reservation, Refusal> {
        let now = self.inner.clock.now();
        let mut keys = self.inner.keys.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(k) = keys.get_mut(key) {
            k.check_count_free(now)?;
            if let Some(b) = &mut k.tokens {
                match b.check(tokens as f64, now) {
                    Ok(()) => {}
                    Err(Shortfall::RetryAfter(retry_after)) => {
                        return Err(Refusal::Tokens { retry_after })
                    }
                    Err(Shortfall::Never) => {
                        return Err(Refusal::TooLarge {
                            need: tokens,
                            limit: b.capacity as u64,
                        })
                    }
                }
            }
            // Every check passed: take all of it under the same lock.
            if let Some(b) = &mut k.requests {
                b.take(1.0, now);
            }
            if let Some(b) = &mut k.tokens {
                b.take(tokens as f64, now);
            }
            k.running += 1;
        }
        Ok(Reservation {
            limiter: self.clone(),
            key: key.to_string(),
            reserved: tokens,
            settled: false,
        })
    }

    /// Would a request be refused before its tokens are known (too many in
    /// flight, or no request left this minute)? Takes nothing: checked
    /// before the prompt is counted, so a key over its limits cannot make
    /// the gateway tokenize for it.
    pub fn precheck(&self, key: &str) -> Result<(), Refusal> {
        let now = self.inner.clock.now();
        let mut keys = self.inner.keys.lock().unwrap_or_else(|p| p.into_inner());
        match keys.get_mut(key) {
            Some(k) => k.check_count_free(now),
            None => Ok(()),
        }
    }

    /// The key's token bucket level now (`None`: no token limit).
    pub fn tokens_left(&self, key: &str) -> Option<f64> {
        let now = self.inner.clock.now();
        let mut keys = self.inner.keys.lock().unwrap_or_else(|p| p.into_inner());
        keys.get_mut(key)?.tokens.as_mut().map(|b| b.level(now))
    }

    /// Requests of `key` in flight.
    pub fn running(&self, key: &str) -> usize {
        let keys = self.inner.keys.lock().unwrap_or_else(|p| p.into_inner());
        keys.get(key).map_or(0, |k| k.running)
    }

    fn settle(&self, key: &str, reserved: u64, used: u64) {
        let now = self.inner.clock.now();
        let mut keys = self.inner.keys.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(k) = keys.get_mut(key) {
            if let Some(b) = &mut k.tokens {
                if used <= reserved {
                    b.give_back((reserved - used) as f64, now);
                } else {
                    b.take((used - reserved) as f64, now);
                }
            }
            k.running = k.running.saturating_sub(1);
        }
    }
}

/// Tokens held for one admitted request until it is settled. Dropped
/// unsettled (a handler that ended early), it is charged in full: the safe
/// side of a limit.
#[derive(Debug)]
pub struct Reservation {
    limiter: Limiter,
    key: String,
    reserved: u64,
    settled: bool,
}

impl Reservation {
    pub fn reserved(&self) -> u64 {
        self.reserved
    }

    /// Charge `used` tokens (refunding or adding to the reservation).
    pub fn settle(mut self, used: u64) {
        self.settled = true;
        self.limiter.settle(&self.key, self.reserved, used);
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.settled {
            self.limiter.settle(&self.key, self.reserved, self.reserved);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::FakeClock;

    fn limiter(l: KeyLimits) -> (FakeClock, Limiter) {
        let clock = FakeClock::default();
        let lim = Limiter::new(Arc::new(clock.clone()), [("k".to_string(), l)]);
        (clock, lim)
    }

    #[test]
    fn a_bucket_refills_at_its_rate_and_caps_at_capacity() {
        let mut b = TokenBucket::per_minute(600, Duration::ZERO);
        assert_eq!(b.check(600.0, Duration::ZERO), Ok(()));
        b.take(600.0, Duration::ZERO);
        // 10 per second: 50 after 5 s; 100 needs 5 s more.
        let t5 = Duration::from_secs(5);
        assert_eq!(
            b.check(100.0, t5),
            Err(Shortfall::RetryAfter(Duration::from_secs(5)))
        );
        assert_eq!(b.check(601.0, t5), Err(Shortfall::Never));
        assert_eq!(b.level(Duration::from_secs(3600)), 600.0);
    }

    #[test]
    fn tokens_are_reserved_then_settled_at_usage() {
        let (_, lim) = limiter(KeyLimits {
            tokens_per_minute: Some(1000),
            ..KeyLimits::default()
        });
        let r = lim.admit("k", 700).unwrap();
        assert_eq!(lim.tokens_left("k"), Some(300.0));
        // A second request that would need 400 waits for 100 to refill: 6 s.
        assert_eq!(
            lim.admit("k", 400).unwrap_err(),
            Refusal::Tokens {
                retry_after: Duration::from_secs(6)
            }
        );
        r.settle(250);
        assert_eq!(lim.tokens_left("k"), Some(750.0));
        assert!(lim.admit("k", 400).is_ok());
    }

    #[test]
    fn usage_above_the_reservation_is_debt_and_a_dropped_one_is_charged_in_full() {
        let (_, lim) = limiter(KeyLimits {
            tokens_per_minute: Some(100),
            ..KeyLimits::default()
        });
        lim.admit("k", 60).unwrap().settle(130);
        assert_eq!(lim.tokens_left("k"), Some(-30.0));
        let (_, lim) = limiter(KeyLimits {
            tokens_per_minute: Some(100),
            ..KeyLimits::default()
        });
        drop(lim.admit("k", 60).unwrap());
        assert_eq!(lim.tokens_left("k"), Some(40.0));
    }

    #[test]
    fn a_refusal_takes_nothing_from_any_limit() {
        let (_, lim) = limiter(KeyLimits {
            requests_per_minute: Some(2),
            tokens_per_minute: Some(100),
            max_concurrent: Some(5),
        });
        let a = lim.admit("k", 90).unwrap();
        // Tokens refuse: the request bucket and the running count are untouched.
        assert!(matches!(lim.admit("k", 50), Err(Refusal::Tokens { .. })));
        assert_eq!(lim.running("k"), 1);
        let b = lim.admit("k", 10).unwrap();
        assert!(matches!(lim.admit("k", 0), Err(Refusal::Requests { .. })));
        assert_eq!(
            lim.admit("k", 101).unwrap_err(),
            Refusal::Requests {
                retry_after: Duration::from_secs(30)
            },
            "the request bucket is checked before the token bucket"
        );
        a.settle(90);
        b.settle(10);
        assert_eq!(lim.running("k"), 0);
    }

    #[test]
    fn concurrency_is_capped_and_released_on_settle() {
        let (_, lim) = limiter(KeyLimits {
            max_concurrent: Some(1),
            ..KeyLimits::default()
        });
        let a = lim.admit("k", 1).unwrap();
        assert_eq!(
            lim.admit("k", 1).unwrap_err(),
            Refusal::Concurrency { limit: 1 }
        );
        a.settle(1);
        assert!(lim.admit("k", 1).is_ok());
    }

    #[test]
    fn a_request_larger_than_the_budget_is_never_admitted() {
        let (clock, lim) = limiter(KeyLimits {
            tokens_per_minute: Some(100),
            ..KeyLimits::default()
        });
        clock.advance(Duration::from_secs(3600));
        assert_eq!(
            lim.admit("k", 101).unwrap_err(),
            Refusal::TooLarge {
                need: 101,
                limit: 100
            }
        );
    }

    #[test]
    fn racing_admissions_never_take_more_than_the_bucket_holds() {
        let (_, lim) = limiter(KeyLimits {
            tokens_per_minute: Some(1000),
            ..KeyLimits::default()
        });
        let admitted = std::sync::atomic::AtomicU64::new(0);
        std::thread::scope(|s| {
            for _ in 0..20 {
                s.spawn(|| {
                    for _ in 0..50 {
                        if let Ok(r) = lim.admit("k", 37) {
                            admitted.fetch_add(37, std::sync::atomic::Ordering::Relaxed);
                            std::mem::forget(r);
                        }
                    }
                });
            }
        });
        let total = admitted.into_inner();
        assert_eq!(total, 27 * 37, "floor(1000 / 37) requests of 37 fit");
    }
}

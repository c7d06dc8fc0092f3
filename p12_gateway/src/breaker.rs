//! A per-backend circuit breaker: closed (requests flow; consecutive
//! failures counted) → open after `failures_to_open` of them (requests go
//! elsewhere at once instead of waiting on a dead backend) → half-open after
//! `cooldown` (one probe request at a time) → closed after
//! `successes_to_close` probe successes, or open again on a probe failure.
//!
//! What it protects: the clients (no timeout spent on a backend known to be
//! failing) and the backend (no retry storm while it recovers).

use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BreakerConfig {
    pub failures_to_open: u32,
    pub cooldown: Duration,
    pub successes_to_close: u32,
}

impl Default for BreakerConfig {
    fn default() -> BreakerConfig {
        BreakerConfig {
            failures_to_open: 5,
            cooldown: Duration::from_secs(10),
            successes_to_close: 2,
        }
    }
}

/// The state as metrics show it (0, 1, 2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BreakerState {
    Closed = 0,
    Open = 1,
    HalfOpen = 2,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Inner {
    Closed { failures: u32 },
    Open { until: Duration },
    HalfOpen { successes: u32, probing: bool },
}

#[derive(Debug)]
pub struct Breaker {
    cfg: BreakerConfig,
    inner: Inner,
}

impl Breaker {
    pub fn new(cfg: BreakerConfig) -> Breaker {
        Breaker {
            cfg,
            inner: Inner::Closed { failures: 0 },
        }
    }

    pub fn state(&self) -> BreakerState {
        match self.inner {
            Inner::Closed { .. } => BreakerState::Closed,
            Inner::Open { .. } => BreakerState::Open,
            Inner::HalfOpen { .. } => BreakerState::HalfOpen,
        }
    }

    /// May a request go to this backend now? In half-open, `true` hands out
    /// the one probe slot: the caller must then report `success`, `failure`
    /// or `release`.
    pub fn allow(&mut self, now: Duration) -> bool {
        match self.inner {
            Inner::Closed { .. } => true,
            Inner::Open { until } if now >= until => {
                self.inner = Inner::HalfOpen {
                    successes: 0,
                    probing: true,
                };
                true
            }
            Inner::Open { .. } => false,
            Inner::HalfOpen { probing: true, .. } => false,
            Inner::HalfOpen {
                successes,
                probing: false,
            } => {
                self.inner = Inner::HalfOpen {
                    successes,
                    probing: true,
                };
                true
            }
        }
    }

    pub fn success(&mut self) {
        self.inner = match self.inner {
            Inner::Closed { .. } => Inner::Closed { failures: 0 },
            Inner::HalfOpen { successes, .. } if successes + 1 >= self.cfg.successes_to_close => {
                Inner::Closed { failures: 0 }
            }
            Inner::HalfOpen { successes, .. } => Inner::HalfOpen {
                successes: successes + 1,
                probing: false,
            },
            open @ Inner::Open { .. } => open,
        };
    }

    pub fn failure(&mut self, now: Duration) {
        let open = Inner::Open {
            until: now.saturating_add(self.cfg.cooldown),
        };
        self.inner = match self.inner {
            Inner::Closed { failures } if failures + 1 >= self.cfg.failures_to_open => open,
            Inner::Closed { failures } => Inner::Closed {
                failures: failures + 1,
            },
            Inner::HalfOpen { .. } => open,
            o @ Inner::Open { .. } => o,
        };
    }

    /// A request ended with neither verdict (its client went away, or the
    /// backend refused it as a 4xx): free the probe slot.
    pub fn release(&mut self) {
        if let Inner::HalfOpen { successes, .. } = self.inner {
            self.inner = Inner::HalfOpen {
                successes,
                probing: false,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    fn breaker() -> Breaker {
        Breaker::new(BreakerConfig {
            failures_to_open: 3,
            cooldown: 10 * S,
            successes_to_close: 2,
        })
    }

    #[test]
    fn opens_after_consecutive_failures_only() {
        let mut b = breaker();
        b.failure(S);
        b.failure(S);
        b.success();
        b.failure(S);
        b.failure(S);
        assert_eq!(
            b.state(),
            BreakerState::Closed,
            "a success resets the count"
        );
        b.failure(2 * S);
        assert_eq!(b.state(), BreakerState::Open);
        assert!(!b.allow(11 * S), "cool-down runs to 12 s");
    }

    #[test]
    fn half_open_probes_one_at_a_time_then_closes() {
        let mut b = breaker();
        (0..3).for_each(|_| b.failure(S));
        assert!(b.allow(11 * S));
        assert_eq!(b.state(), BreakerState::HalfOpen);
        assert!(!b.allow(11 * S), "one probe in flight");
        b.success();
        assert_eq!(b.state(), BreakerState::HalfOpen);
        assert!(b.allow(11 * S));
        b.release();
        assert!(b.allow(11 * S), "a released probe frees the slot");
        b.success();
        assert_eq!(b.state(), BreakerState::Closed);
    }

    #[test]
    fn a_failed_probe_opens_again_for_a_full_cool_down() {
        let mut b = breaker();
        (0..3).for_each(|_| b.failure(S));
        assert!(b.allow(20 * S));
        b.failure(20 * S);
        assert_eq!(b.state(), BreakerState::Open);
        assert!(!b.allow(29 * S));
        assert!(b.allow(30 * S));
    }
}

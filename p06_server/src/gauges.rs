//! What every local engine counts and shares with the HTTP side: requests
//! waiting and running, K/V bytes held, whether it is closing, and the
//! smoothed service time that sets a 429's `Retry-After`.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use common::engine::{EngineError, EngineLoad};

#[derive(Debug, Default)]
pub struct EngineGauges {
    pub waiting: AtomicUsize,
    pub running: AtomicUsize,
    pub kv_cache_bytes: AtomicUsize,
    /// Set by `abort_all`: refuse new work, end what is running.
    pub closing: AtomicBool,
    /// Seconds per unit of service (a request, a batch), smoothed (f64 bits).
    service_s: AtomicU64,
}

impl EngineGauges {
    pub fn load(&self) -> EngineLoad {
        EngineLoad {
            running: self.running.load(Ordering::SeqCst),
            waiting: self.waiting.load(Ordering::SeqCst),
            kv_cache_bytes: self.kv_cache_bytes.load(Ordering::SeqCst),
        }
    }

    pub fn is_closing(&self) -> bool {
        self.closing.load(Ordering::SeqCst)
    }

    /// 503 once closing.
    pub fn check_open(&self) -> Result<(), EngineError> {
        if self.is_closing() {
            return Err(EngineError::Unavailable(
                "the server is shutting down".into(),
            ));
        }
        Ok(())
    }

    /// Fold one unit of service (seconds) into the smoothed mean.
    pub fn observe_service(&self, s: f64) {
        let old = f64::from_bits(self.service_s.load(Ordering::Relaxed));
        let new = if old == 0.0 { s } else { 0.8 * old + 0.2 * s };
        self.service_s.store(new.to_bits(), Ordering::Relaxed);
    }

    /// The 429 for a full queue: `units_ahead` units of service must pass
    /// before a retry can be served.
    pub fn queue_full(&self, waiting: usize, units_ahead: f64) -> EngineError {
        let per = f64::from_bits(self.service_s.load(Ordering::Relaxed));
        EngineError::QueueFull {
            waiting,
            retry_after_s: (units_ahead * per).ceil().max(1.0) as u64,
        }
    }
}

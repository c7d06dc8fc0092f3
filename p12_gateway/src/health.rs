//! Active health checks: every backend's `/health` polled on an interval;
//! `failures_to_eject` failures in a row take it out of routing, one
//! success brings it back. (The breaker reacts to live traffic faster; the
//! checks find a dead backend that no request has tried, and see it
//! recover.)

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crate::routing::Backend;
use crate::state::Gateway;

/// One round of checks over every backend.
pub async fn check_all(g: &Gateway) {
    let h = g.cfg.health;
    let backends: Vec<Arc<Backend>> = g.routes.values().flat_map(|r| r.pool.backends()).collect();
    let checks = backends.iter().map(|b| async move {
        let ok = matches!(
            tokio::time::timeout(
                Duration::from_millis(h.timeout_ms),
                g.http.get(format!("{}/health", b.url)).send(),
            )
            .await,
            Ok(Ok(r)) if r.status().is_success()
        );
        if ok {
            b.health_failures.store(0, Ordering::Relaxed);
            b.healthy.store(true, Ordering::Relaxed);
        } else if b.health_failures.fetch_add(1, Ordering::Relaxed) + 1 >= h.failures_to_eject {
            b.healthy.store(false, Ordering::Relaxed);
        }
    });
    futures_util::future::join_all(checks).await;
}

/// Poll forever (spawn it); an interval of 0 disables the checks.
pub async fn run(g: Arc<Gateway>) {
    let every = Duration::from_millis(g.cfg.health.interval_ms);
    if every.is_zero() {
        return;
    }
    loop {
        check_all(&g).await;
        tokio::time::sleep(every).await;
    }
}

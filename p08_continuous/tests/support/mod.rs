//! p06's test harness (SmolLM2 loaded once, servers on real sockets), with
//! the p08 continuous batcher as the engine behind the server.

#![allow(dead_code)]

/// The server binary the shutdown test runs.
pub const SERVER_BIN: &str = env!("CARGO_BIN_EXE_p08_continuous");

include!("../../../p06_server/tests/support/harness.rs");

/// The engine these tests serve: the continuous batcher. A server with one
/// waiting place also gets one running slot, so that p06's full-queue test
/// can fill the queue (a continuous batcher admits at once while it has
/// slots).
pub fn test_engine(s: &Shared, max_waiting: usize) -> Arc<dyn Engine> {
    let config = p08_continuous::ContinuousConfig {
        max_num_seqs: if max_waiting <= 1 { 1 } else { 8 },
        max_waiting,
        ..Default::default()
    };
    Arc::new(
        p08_continuous::ContinuousEngine::start(
            s.engine.clone(),
            s.tokenizer.clone(),
            MODEL,
            config,
        )
        .unwrap(),
    )
}

//! p06's test harness (SmolLM2 loaded once, servers on real sockets), with
//! the p07 batcher as the engine behind the server.

#![allow(dead_code)]

/// The server binary the shutdown test runs.
pub const SERVER_BIN: &str = env!("CARGO_BIN_EXE_p07_batching");

include!("../../../p06_server/tests/support/harness.rs");

/// The engine these tests serve: the dynamic batcher.
pub fn test_engine(s: &Shared, max_waiting: usize) -> Arc<dyn Engine> {
    let config = p07_batching::BatchConfig {
        max_batch: 8,
        max_wait: Duration::from_millis(5),
        max_waiting,
    };
    Arc::new(
        p07_batching::BatchingEngine::start(s.engine.clone(), s.tokenizer.clone(), MODEL, config)
            .unwrap(),
    )
}

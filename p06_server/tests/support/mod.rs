//! Shared by the integration tests: SmolLM2 loaded once per test binary, and
//! servers on real sockets (127.0.0.1, a free port) in front of it.

#![allow(dead_code)]

/// The server binary the shutdown test runs.
pub const SERVER_BIN: &str = env!("CARGO_BIN_EXE_p06_server");

include!("harness.rs");

/// The engine these tests serve: p06's serial engine.
pub fn test_engine(s: &Shared, max_waiting: usize) -> Arc<dyn Engine> {
    Arc::new(
        p06_server::SerialEngine::start(s.engine.clone(), s.tokenizer.clone(), MODEL, max_waiting)
            .unwrap(),
    )
}

//! p06's test harness (SmolLM2 loaded once, servers on real sockets), with
//! p08's continuous batcher on p09's paged K/V behind the server.

#![allow(dead_code)]

/// The server binary the shutdown test runs.
pub const SERVER_BIN: &str = env!("CARGO_BIN_EXE_p09_kv_manager");

include!("../../../p06_server/tests/support/harness.rs");

/// The engine these tests serve. A server with one waiting place also gets
/// one running slot, so that p06's full-queue test can fill the queue.
pub fn test_engine(s: &Shared, max_waiting: usize) -> Arc<dyn Engine> {
    use common::batch::BatchModel;
    let config = p08_continuous::ContinuousConfig {
        max_num_seqs: if max_waiting <= 1 { 1 } else { 8 },
        max_waiting,
        kv_cache_bytes: 1 << 30,
        ..Default::default()
    };
    let kv =
        p09_kv_manager::PagedKv::new(s.engine.kv_shape(), 16, config.kv_cache_bytes, true).unwrap();
    Arc::new(
        p08_continuous::ContinuousEngine::start_with_backend(
            s.engine.clone(),
            s.tokenizer.clone(),
            MODEL,
            config,
            kv,
        )
        .unwrap(),
    )
}

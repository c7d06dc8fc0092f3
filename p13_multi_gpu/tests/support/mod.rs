//! p06's test harness (SmolLM2 loaded once, servers on real sockets), with
//! a tensor-parallel engine behind the server: three ranks over loopback
//! TCP, as threads of the test process (ranks 1 and 2 follow rank 0's
//! plans), f32 weights, Project 08/09's scheduler and paged K/V on rank 0.

#![allow(dead_code)]

include!("../../../p06_server/tests/support/harness.rs");

pub const TP: usize = 3;

/// The engine these tests serve. A server with one waiting place also gets
/// one running slot, so that p06's full-queue test can fill the queue.
pub fn test_engine(s: &Shared, max_waiting: usize) -> Arc<dyn Engine> {
    use common::batch::BatchModel;
    use p08_continuous::kv_backend::KvBackend;
    use p08_continuous::LocalRunner;
    use p13_multi_gpu::runner::{follow, TpRunner};
    use p13_multi_gpu::tp::{load_rank, Weights};
    use p13_multi_gpu::Communicator;

    let config = p08_continuous::ContinuousConfig {
        max_num_seqs: if max_waiting <= 1 { 1 } else { 8 },
        max_waiting,
        kv_cache_bytes: 1 << 28,
        ..Default::default()
    };
    let path =
        common::assets::ensure(common::assets::Asset::SmolLm2).unwrap_or_else(|e| panic!("{e}"));
    let head = p04_transformer::HeadSplit::Replicated;
    let mut comms: Vec<Arc<dyn Communicator>> = p13_multi_gpu::tcp::loopback_group(
        TP,
        Duration::from_secs(60),
        p13_multi_gpu::Algorithm::default(),
    )
    .unwrap()
    .into_iter()
    .map(|c| Arc::new(c) as Arc<dyn Communicator>)
    .collect();
    let bytes = config.kv_cache_bytes;
    for c in comms.split_off(1) {
        let path = path.clone();
        std::thread::spawn(move || {
            let l = load_rank(&path, Weights::F32, head, c.clone(), 1).unwrap();
            let kv = p09_kv_manager::PagedKv::new(l.engine.kv_shape(), 16, bytes, false).unwrap();
            let mut runner = LocalRunner::new(&l.engine, kv.new_storage());
            c.barrier().unwrap();
            // Ends when rank 0's runner says stop (its engine is dropped).
            follow(&*c, &mut runner).unwrap();
        });
    }
    let c = comms.remove(0);
    let l = load_rank(&path, Weights::F32, head, c.clone(), 1).unwrap();
    let kv = p09_kv_manager::PagedKv::new(l.engine.kv_shape(), 16, bytes, true).unwrap();
    c.barrier().unwrap();
    let info = common::Model::info(&l.engine).clone();
    let engine = Arc::new(l.engine);
    Arc::new(
        p08_continuous::ContinuousEngine::start_with_runner(
            &info,
            s.tokenizer.clone(),
            MODEL,
            config,
            kv,
            move |storage| TpRunner::new(LocalRunner::new(engine, storage), c),
        )
        .unwrap(),
    )
}

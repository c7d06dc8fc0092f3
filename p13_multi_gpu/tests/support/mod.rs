//! p06's test harness (SmolLM2 loaded once, servers on real sockets), with
//! a split engine behind the server: three ranks over loopback TCP, as
//! threads of the test process (ranks 1 and 2 follow rank 0's plans), f32
//! weights, Project 08/09's scheduler and paged K/V on rank 0. The test
//! file that includes it says which split in `KIND`.

#![allow(dead_code)]

include!("../../../p06_server/tests/support/harness.rs");

/// Ranks of the split.
pub const WORLD: usize = 3;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Tensor parallelism (replicated head).
    Tp,
    /// Pipeline stages.
    Pp,
}

/// The engine p06's cases serve: the including file's `KIND`.
pub fn test_engine(s: &Shared, max_waiting: usize) -> Arc<dyn Engine> {
    split_engine(s, max_waiting, super::KIND)
}

/// A split engine. A server with one waiting place also gets one running
/// slot, so that p06's full-queue test can fill the queue.
pub fn split_engine(s: &Shared, max_waiting: usize, kind: Kind) -> Arc<dyn Engine> {
    use common::batch::BatchModel;
    use p04_transformer::{HeadSplit, Split};
    use p08_continuous::kv_backend::KvBackend;
    use p08_continuous::LocalRunner;
    use p10_quant::Weights;
    use p13_multi_gpu::pp::{follow_stage, PpRunner, Stage};
    use p13_multi_gpu::runner::{follow, TpRunner};
    use p13_multi_gpu::tp::{load_part, load_rank};
    use p13_multi_gpu::Communicator;

    let config = p08_continuous::ContinuousConfig {
        max_num_seqs: if max_waiting <= 1 { 1 } else { 8 },
        max_waiting,
        kv_cache_bytes: 1 << 28,
        ..Default::default()
    };
    let path =
        common::assets::ensure(common::assets::Asset::SmolLm2).unwrap_or_else(|e| panic!("{e}"));
    let load = move |path: &std::path::Path, c: &Arc<dyn Communicator>| {
        match kind {
            Kind::Tp => load_rank(path, Weights::F32, HeadSplit::Replicated, c.clone(), 1),
            Kind::Pp => load_part(
                path,
                Weights::F32,
                Split::stage(c.rank(), WORLD).unwrap(),
                1,
            ),
        }
        .unwrap()
    };
    let mut comms: Vec<Arc<dyn Communicator>> = p13_multi_gpu::tcp::loopback_group(
        WORLD,
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
            let l = load(&path, &c);
            let kv = p09_kv_manager::PagedKv::new(l.engine.kv_shape(), 16, bytes, false).unwrap();
            let storage = kv.new_storage();
            c.barrier().unwrap();
            // Ends when rank 0's runner says stop (its engine is dropped).
            match kind {
                Kind::Tp => follow(&*c, &mut LocalRunner::new(&l.engine, storage)).unwrap(),
                Kind::Pp => follow_stage(&*c, &mut Stage::new(&l.engine, storage), WORLD).unwrap(),
            }
        });
    }
    let c = comms.remove(0);
    let l = load(&path, &c);
    let kv = p09_kv_manager::PagedKv::new(l.engine.kv_shape(), 16, bytes, true).unwrap();
    c.barrier().unwrap();
    let info = common::Model::info(&l.engine).clone();
    let engine = Arc::new(l.engine);
    let (tok, name) = (s.tokenizer.clone(), MODEL);
    Arc::new(
        match kind {
            Kind::Tp => p08_continuous::ContinuousEngine::start_with_runner(
                &info,
                tok,
                name,
                config,
                kv,
                move |st| TpRunner::new(LocalRunner::new(engine, st), c),
            ),
            Kind::Pp => p08_continuous::ContinuousEngine::start_with_runner(
                &info,
                tok,
                name,
                config,
                kv,
                move |st| PpRunner::new(Stage::new(engine, st), c, WORLD),
            ),
        }
        .unwrap(),
    )
}
/// `p13_multi_gpu serve` on SmolLM2 with `args`, on a free port; returns
/// the process and its URL once it has printed `ready`.
pub fn spawn_server(args: &[&str]) -> (std::process::Child, String) {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let path =
        common::assets::ensure(common::assets::Asset::SmolLm2).unwrap_or_else(|e| panic!("{e}"));
    let mut child = Command::new(env!("CARGO_BIN_EXE_p13_multi_gpu"))
        .args(["serve", "--model", path.to_str().unwrap(), "--port", "0"])
        .args(["--served-model-name", MODEL, "--shutdown-grace-s", "1"])
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut url = None;
    for line in lines.by_ref() {
        let line = line.unwrap();
        if let Some(rest) = line.strip_prefix("listening on ") {
            url = rest.split_whitespace().next().map(str::to_string);
        }
        if line.starts_with("ready") {
            break;
        }
    }
    // Keep reading: a closed pipe would fail the server's next print.
    std::thread::spawn(move || lines.for_each(drop));
    (child, url.expect("the server printed its address"))
}

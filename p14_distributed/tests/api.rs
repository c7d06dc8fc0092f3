//! p06's HTTP API tests, unchanged, against the proxy: every endpoint over
//! a real socket must answer exactly what the one-process p05 engine
//! generates, with the request prefilled on one worker process and
//! decoded on another (1P1D, f32 weights, etcd and NATS as children).
//! The cluster is started once for the file; each case gets a proxy of
//! its own (its own metrics), following the same workers.

mod support {
    #![allow(dead_code)]

    include!("../../p06_server/tests/support/harness.rs");

    use p14_distributed::cluster::{self, EtcdCluster, Nats};
    use p14_distributed::registry::Role;
    use p14_distributed::wire::LoadFailurePolicy;

    struct Cluster {
        etcd: Vec<String>,
        nats: String,
        /// The proxies' tasks (view, events, requests) run here, not on a
        /// case's own runtime, which the case may block.
        rt: tokio::runtime::Runtime,
    }

    /// Remove this process's etcd data directory when the tests exit (the
    /// children die with the thread that started them, below).
    extern "C" fn remove_temp_dirs() {
        let tag = format!("-{}-", std::process::id());
        if let Ok(dir) = std::fs::read_dir(std::env::temp_dir()) {
            for e in dir.flatten() {
                let name = e.file_name().to_string_lossy().to_string();
                if name.starts_with("inference-lab-p14-") && name.contains(&tag) {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
    }

    fn cluster() -> &'static Cluster {
        static C: OnceLock<Cluster> = OnceLock::new();
        C.get_or_init(|| {
            let (tx, rx) = std::sync::mpsc::channel();
            // A thread that lives as long as the test process: the
            // children it starts (PR_SET_PDEATHSIG) live as long.
            std::thread::spawn(move || {
                let etcd = EtcdCluster::start(1, "127.0.0.1")
                    .expect("etcd (install it: apt-get install -y etcd-server)");
                let nats = Nats::start("127.0.0.1")
                    .expect("NATS (install it: apt-get install -y nats-server)");
                let exe = std::path::Path::new(env!("CARGO_BIN_EXE_p14_distributed"));
                let mut procs = Vec::new();
                for role in [Role::Prefill, Role::Decode] {
                    let args: Vec<String> = [
                        "--model",
                        "smollm2",
                        "--weights",
                        "f32",
                        "--etcd",
                        &etcd.urls[0],
                        "--nats",
                        &nats.url,
                        "--id",
                        role.as_str(),
                        "--kv-cache-mib",
                        "96",
                    ]
                    .iter()
                    .map(|s| s.to_string())
                    .collect();
                    let (p, _) = cluster::start_worker(exe, role.as_str(), &args)
                        .expect("starting a worker");
                    procs.push(p);
                }
                tx.send((etcd.urls.clone(), nats.url.clone())).unwrap();
                let _keep = (etcd, nats, procs);
                loop {
                    std::thread::park();
                }
            });
            let (etcd, nats) = rx.recv().expect("the cluster started");
            // SAFETY: registering a function that takes nothing and
            // returns nothing, to run at exit.
            unsafe {
                libc::atexit(remove_temp_dirs);
            }
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            Cluster { etcd, nats, rt }
        })
    }

    /// The engine p06's cases serve: a proxy in front of the cluster's
    /// two workers, once it sees both.
    pub fn test_engine(_s: &Shared, _max_waiting: usize) -> Arc<dyn Engine> {
        let c = cluster();
        let (proxy, view) = p14_distributed::proxy_serve::in_process(
            "smollm2",
            MODEL.to_string(),
            (c.etcd.clone(), None),
            Some(c.nats.clone()),
            LoadFailurePolicy::Fail,
            c.rt.handle(),
        )
        .unwrap();
        let t0 = Instant::now();
        while view.workers(Role::Prefill).is_empty() || view.workers(Role::Decode).is_empty() {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "the proxy does not see both workers after 30 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Arc::new(proxy)
    }
}

include!("../../p06_server/tests/shared/api_cases.rs");

//! A platform on loopback for the tests: a real etcd (a child process
//! with a temporary data directory; `apt-get install -y etcd-server` if it
//! is missing), node agents, controllers and a router as child processes
//! of this crate's binary, and the model servers the agents start
//! (SmolLM2, fetched by `bash scripts/fetch_assets.sh smollm2` on first
//! use).

#![allow(dead_code)]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use p14_distributed::cluster::{spawn, temp_dir, EtcdCluster, Proc};
use p14_distributed::etcd::Etcd;
use p15_platform::spec::ModelDeployment;
use p15_platform::state::Snapshot;
use p15_platform::store::Store;

pub const EXE: &str = env!("CARGO_BIN_EXE_p15_platform");
pub const KEY: &str = "sk-platform-test";

pub struct Platform {
    pub etcd: EtcdCluster,
    pub agents: Vec<(String, Proc)>,
    pub controllers: Vec<(String, Proc)>,
    pub router: Option<(Proc, String)>,
    pub rt: tokio::runtime::Runtime,
    dir: std::path::PathBuf,
}

/// A deployment of SmolLM2 named `name` (a YAML fragment overrides the
/// defaults line by line: `replicas: {min: 0, max: 1}`).
pub fn deployment(name: &str, extra: &str) -> ModelDeployment {
    let mut fields = vec![
        ("name", name.to_string()),
        ("model", "smollm2".into()),
        ("weights", "native".into()),
        ("replicas", "{min: 1, max: 1}".into()),
        ("autoscaling", "{metric: concurrency, target: 4, stable_window: 6s, panic_window: 2s, scale_to_zero_grace: 0s}".into()),
        ("rollout", "{max_surge: 1, max_unavailable: 0}".into()),
    ];
    for line in extra.lines().filter(|l| !l.trim().is_empty()) {
        let (k, v) = line.split_once(':').expect("key: value");
        let k = k.trim();
        match fields.iter_mut().find(|(f, _)| *f == k) {
            Some(f) => f.1 = v.trim().to_string(),
            None => fields.push((
                Box::leak(k.to_string().into_boxed_str()),
                v.trim().to_string(),
            )),
        }
    }
    let yaml: String = fields.iter().map(|(k, v)| format!("{k}: {v}\n")).collect();
    ModelDeployment::from_yaml(&yaml, "test").expect("a valid test deployment")
}

impl Platform {
    pub fn start() -> Platform {
        let etcd = EtcdCluster::start(1, "127.0.0.1")
            .expect("etcd (install it: apt-get install -y etcd-server)");
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        Platform {
            etcd,
            agents: Vec::new(),
            controllers: Vec::new(),
            router: None,
            rt,
            dir: temp_dir("p15-test").unwrap(),
        }
    }

    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(EXE);
        c.arg("--etcd")
            .arg(self.etcd.urls.join(","))
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        c
    }

    pub fn agent(&mut self, node: &str, capacity: u32) {
        let logs = self.dir.join(node);
        let cap = capacity.to_string();
        let c = self.cmd(&[
            "agent",
            "--node",
            node,
            "--capacity",
            &cap,
            "--ttl-s",
            "2",
            "--drain-delay-ms",
            "400",
            "--log-dir",
            logs.to_str().unwrap(),
        ]);
        self.agents
            .push((node.into(), spawn(node, c, None).unwrap()));
    }

    pub fn controller(&mut self, id: &str) {
        let c = self.cmd(&["controller", "--id", id, "--ttl-s", "2"]);
        self.controllers
            .push((id.into(), spawn(id, c, None).unwrap()));
    }

    /// The router in front of `models`, holding requests `hold_ms` for a
    /// first backend; its base URL.
    pub fn router(&mut self, models: &[&str], hold_ms: u64) -> String {
        let port = p14_distributed::cluster::free_port("127.0.0.1").unwrap();
        let list: Vec<String> = models.iter().map(|m| format!("\"{m}\"")).collect();
        let mut toml = format!(
            "listen = \"127.0.0.1:{port}\"\n[activator]\nhold_ms = {hold_ms}\nretry_after_s = 2\n\
             [health]\ninterval_ms = 500\n[retry]\nmax_attempts = 4\n\
             [[tenants]]\nname = \"t\"\nmodels = [{}]\n\
             [[keys]]\nname = \"k\"\ntenant = \"t\"\nsha256 = \"{}\"\nmax_concurrent = 64\n",
            list.join(", "),
            p12_gateway::auth::hash_key(KEY)
        );
        for m in models {
            toml += &format!("[[models]]\nname = \"{m}\"\nbackends = []\nrouting = \"least-outstanding\"\ncontext_length = 2048\n");
        }
        let path = self.dir.join("router.toml");
        std::fs::write(&path, toml).unwrap();
        let c = self.cmd(&["router", "--config", path.to_str().unwrap(), "--ttl-s", "2"]);
        let mut p = spawn("router", c, None).unwrap();
        let addr = format!("127.0.0.1:{port}");
        p14_distributed::cluster::wait_tcp(&addr, Duration::from_secs(30), &mut p).unwrap();
        self.router = Some((p, format!("http://{addr}")));
        format!("http://{addr}")
    }

    pub fn etcd_client(&self) -> Etcd {
        Etcd::new(self.etcd.urls.clone(), Duration::from_secs(5))
    }

    pub fn apply(&self, d: &ModelDeployment) {
        let store = Store::new(self.etcd.urls.clone());
        self.rt.block_on(store.apply(d)).unwrap();
    }

    pub fn snapshot(&self) -> Snapshot {
        self.rt
            .block_on(Snapshot::read(&self.etcd_client()))
            .unwrap()
    }

    /// Poll the state until `ok` holds; the snapshot that made it hold.
    pub fn wait_for(
        &self,
        what: &str,
        timeout: Duration,
        ok: impl Fn(&Snapshot) -> bool,
    ) -> Snapshot {
        let t0 = Instant::now();
        loop {
            let s = self.snapshot();
            if ok(&s) {
                return s;
            }
            if t0.elapsed() > timeout {
                panic!(
                    "{what}: not within {timeout:?}; the state:\n{}",
                    p15_platform::state::servers_table(&s)
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// The servers of `deployment` that the controller has published as
/// endpoints (what routers route to), in a snapshot.
pub fn ready(s: &Snapshot, deployment: &str) -> Vec<String> {
    s.endpoints
        .get(deployment)
        .map(|v| v.iter().map(|(id, _)| id.clone()).collect())
        .unwrap_or_default()
}

/// Routers read the endpoints every 200 ms: wait that and a margin.
pub fn let_routers_see() {
    std::thread::sleep(Duration::from_millis(500));
}

/// One completion through `url` (a fresh client: no connection reuse
/// across a server's restart); (HTTP status, body, Retry-After).
pub fn complete(
    rt: &tokio::runtime::Runtime,
    url: &str,
    model: &str,
    max_tokens: u32,
) -> (u16, String, Option<String>) {
    let body = serde_json::json!({
        "model": model, "prompt": "The capital of France is",
        "max_tokens": max_tokens, "temperature": 0.0,
    });
    rt.block_on(async {
        let r = reqwest::Client::new()
            .post(format!("{url}/v1/completions"))
            .bearer_auth(KEY)
            .json(&body)
            .timeout(Duration::from_secs(120))
            .send()
            .await;
        match r {
            Ok(r) => {
                let status = r.status().as_u16();
                let retry = r
                    .headers()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string);
                (status, r.text().await.unwrap_or_default(), retry)
            }
            Err(e) => (0, e.to_string(), None),
        }
    })
}

//! The whole platform on one machine, as child processes: etcd (one
//! member or a cluster), NATS, node agents, controllers and the router,
//! all of them this crate's binary (`exe`) but etcd and NATS. What the
//! demo and the tests start; every process dies with its parent and every
//! data directory is removed on drop.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use p14_distributed::cluster::{free_port, spawn, temp_dir, wait_tcp, EtcdCluster, Nats, Proc};
use p14_distributed::etcd::Etcd;

use crate::spec::ModelDeployment;
use crate::state::Snapshot;
use crate::store::Store;

/// A process of the platform and what it is.
#[derive(Debug)]
pub struct Member {
    pub id: String,
    pub proc: Proc,
    /// Its HTTP address where it has one (controllers, the router).
    pub url: Option<String>,
}

#[derive(Debug)]
pub struct Local {
    pub exe: PathBuf,
    pub etcd: EtcdCluster,
    pub nats: Option<Nats>,
    pub agents: Vec<Member>,
    pub controllers: Vec<Member>,
    pub router: Option<Member>,
    pub dir: PathBuf,
    /// Where the children's output goes (None: inherited).
    pub quiet: bool,
    /// Environment the platform's processes (and the servers the agents
    /// start) get beside this one's.
    pub env: Vec<(String, String)>,
}

/// Project 12's gateway config for a router in front of `models` (their
/// backends filled in from etcd), one key (`key`), holding requests for a
/// model at zero `hold_ms`.
pub fn router_config(port: u16, models: &[&str], key: &str, hold_ms: u64) -> String {
    let list: Vec<String> = models.iter().map(|m| format!("\"{m}\"")).collect();
    let mut toml = format!(
        "listen = \"127.0.0.1:{port}\"\n[activator]\nhold_ms = {hold_ms}\nretry_after_s = 2\n\
         [health]\ninterval_ms = 500\n[retry]\nmax_attempts = 4\n\
         [[tenants]]\nname = \"t\"\nmodels = [{}]\n\
         [[keys]]\nname = \"k\"\ntenant = \"t\"\nsha256 = \"{}\"\nmax_concurrent = 256\n",
        list.join(", "),
        p12_gateway::auth::hash_key(key)
    );
    for m in models {
        toml += &format!(
            "[[models]]\nname = \"{m}\"\nbackends = []\nrouting = \"least-outstanding\"\ncontext_length = 2048\n"
        );
    }
    toml
}

impl Local {
    /// etcd with `members` members (and NATS if asked), nothing else yet.
    pub fn start(exe: &Path, members: usize, nats: bool) -> anyhow::Result<Local> {
        // Its ports are picked free and released before etcd binds them,
        // so a process starting beside it (another test's etcd) can take
        // one first: start again, on new ports, up to three times.
        let mut tries = 0;
        let etcd = loop {
            tries += 1;
            match EtcdCluster::start(members, "127.0.0.1") {
                Ok(c) => break c,
                Err(e) if tries >= 3 => {
                    return Err(
                        e.context("starting etcd (install it: apt-get install -y etcd-server)")
                    )
                }
                Err(_) => continue,
            }
        };
        let nats = match nats {
            true => Some(
                Nats::start("127.0.0.1")
                    .context("starting NATS (install it: apt-get install -y nats-server)")?,
            ),
            false => None,
        };
        Ok(Local {
            exe: exe.to_path_buf(),
            etcd,
            nats,
            agents: Vec::new(),
            controllers: Vec::new(),
            router: None,
            dir: temp_dir("p15")?,
            quiet: true,
            env: Vec::new(),
        })
    }

    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(&self.exe);
        c.arg("--etcd").arg(self.etcd.urls.join(",")).args(args);
        c.envs(self.env.iter().map(|(k, v)| (k, v)));
        c.stdin(Stdio::null()).stdout(Stdio::null());
        if self.quiet {
            c.stderr(Stdio::null());
        }
        c
    }

    /// Start node agent `node` hosting `capacity` servers.
    pub fn agent(&mut self, node: &str, capacity: u32) -> anyhow::Result<()> {
        let logs = self.dir.join(node);
        let cap = capacity.to_string();
        let mut args = vec![
            "agent",
            "--node",
            node,
            "--capacity",
            &cap,
            "--ttl-s",
            "2",
            "--drain-delay-ms",
            "400",
        ];
        let logs_s = logs.to_string_lossy().to_string();
        args.extend(["--log-dir", &logs_s]);
        let nats_url = self.nats.as_ref().map(|n| n.url.clone());
        if let Some(u) = &nats_url {
            args.extend(["--nats", u]);
        }
        let c = self.cmd(&args);
        self.agents.retain(|m| m.id != node);
        self.agents.push(Member {
            id: node.into(),
            proc: spawn(node, c, None)?,
            url: None,
        });
        Ok(())
    }

    /// Start controller `id` (lease TTL 2 s); its `/metrics` URL is kept.
    pub fn controller(&mut self, id: &str) -> anyhow::Result<()> {
        let port = free_port("127.0.0.1")?;
        let listen = format!("127.0.0.1:{port}");
        let c = self.cmd(&[
            "controller",
            "--id",
            id,
            "--ttl-s",
            "2",
            "--listen",
            &listen,
        ]);
        let mut proc = spawn(id, c, None)?;
        wait_tcp(&listen, Duration::from_secs(30), &mut proc)?;
        self.controllers.retain(|m| m.id != id);
        self.controllers.push(Member {
            id: id.into(),
            proc,
            url: Some(format!("http://{listen}")),
        });
        Ok(())
    }

    /// Start the router in front of `models` (key `key`, hold `hold_ms`);
    /// its base URL.
    pub fn router(&mut self, models: &[&str], key: &str, hold_ms: u64) -> anyhow::Result<String> {
        self.router = None; // the old one (if any) stops first
        let port = free_port("127.0.0.1")?;
        let path = self.dir.join("router.toml");
        std::fs::write(&path, router_config(port, models, key, hold_ms))?;
        let cfg = path.to_string_lossy().to_string();
        let c = self.cmd(&["router", "--config", &cfg, "--ttl-s", "2"]);
        let mut proc = spawn("router", c, None)?;
        let addr = format!("127.0.0.1:{port}");
        wait_tcp(&addr, Duration::from_secs(60), &mut proc)?;
        let url = format!("http://{addr}");
        self.router = Some(Member {
            id: "router".into(),
            proc,
            url: Some(url.clone()),
        });
        Ok(url)
    }

    pub fn etcd_client(&self) -> Etcd {
        Etcd::new(self.etcd.urls.clone(), Duration::from_secs(5))
    }

    pub async fn apply(&self, d: &ModelDeployment) -> anyhow::Result<()> {
        Store::new(self.etcd.urls.clone()).apply(d).await?;
        Ok(())
    }

    pub async fn snapshot(&self) -> anyhow::Result<Snapshot> {
        Ok(Snapshot::read(&self.etcd_client()).await?)
    }

    /// Poll the state until `ok` holds; the snapshot that made it hold.
    pub async fn wait_for(
        &self,
        what: &str,
        timeout: Duration,
        ok: impl Fn(&Snapshot) -> bool,
    ) -> anyhow::Result<Snapshot> {
        let t0 = Instant::now();
        loop {
            if let Ok(s) = self.snapshot().await {
                if ok(&s) {
                    return Ok(s);
                }
                if t0.elapsed() > timeout {
                    anyhow::bail!(
                        "{what}: not within {timeout:?}; the state:\n{}",
                        crate::state::servers_table(&s)
                    );
                }
            } else if t0.elapsed() > timeout {
                anyhow::bail!("{what}: etcd unreadable for {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Send `sig` to process `pid` (a server an agent started).
pub fn signal_pid(pid: u32, sig: i32) {
    // SAFETY: kill(2) on a pid the platform started; no memory is touched.
    unsafe {
        libc::kill(pid as i32, sig);
    }
}

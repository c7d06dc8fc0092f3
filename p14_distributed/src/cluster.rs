//! Child processes: etcd (one member or a cluster), NATS, and this
//! binary's own workers, each with a temporary data directory removed on
//! drop and a death signal so none outlives its parent. What `up`, the
//! tests and the benches start.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// A free TCP port on `host` (bound and released: another process could
/// take it first, which the child's start then reports).
pub fn free_port(host: &str) -> anyhow::Result<u16> {
    Ok(TcpListener::bind((host, 0))?.local_addr()?.port())
}

/// A child killed (and reaped) on drop.
#[derive(Debug)]
pub struct Proc {
    pub name: String,
    pub child: Child,
    dir: Option<PathBuf>,
}

impl Proc {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid; no memory is touched.
        unsafe {
            libc::kill(self.child.id() as i32, sig);
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.signal(libc::SIGCONT);
        self.kill();
        if let Some(d) = &self.dir {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// Spawn `cmd` so that it dies with this process (PR_SET_PDEATHSIG). The
/// signal comes when the *thread* that spawned it ends: call this from a
/// thread that lives as long as the child (not a blocking-pool thread).
pub fn spawn(name: &str, mut cmd: Command, dir: Option<PathBuf>) -> anyhow::Result<Proc> {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl in the child between fork and exec; it touches no
    // memory of the parent's.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    let child = cmd
        .spawn()
        .with_context(|| format!("starting {name} ({:?})", cmd.get_program()))?;
    Ok(Proc {
        name: name.into(),
        child,
        dir,
    })
}

pub fn temp_dir(what: &str) -> anyhow::Result<PathBuf> {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let d = std::env::temp_dir().join(format!(
        "inference-lab-p14-{what}-{}-{n}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
    Ok(d)
}

fn which(bin: &str, package: &str) -> anyhow::Result<PathBuf> {
    for dir in std::env::var("PATH")
        .unwrap_or_default()
        .split(':')
        .chain(["/usr/sbin", "/usr/bin"])
    {
        let p = PathBuf::from(dir).join(bin);
        if p.is_file() {
            return Ok(p);
        }
    }
    bail!("`{bin}` not found: install it with `apt-get install -y {package}`")
}

/// Wait until `addr` accepts TCP connections.
pub fn wait_tcp(addr: &str, timeout: Duration, p: &mut Proc) -> anyhow::Result<()> {
    let t0 = Instant::now();
    loop {
        if std::net::TcpStream::connect(addr).is_ok() {
            return Ok(());
        }
        if let Ok(Some(status)) = p.child.try_wait() {
            bail!("{} exited ({status}) before listening on {addr}", p.name);
        }
        if t0.elapsed() > timeout {
            bail!("{} did not listen on {addr} within {timeout:?}", p.name);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// An etcd cluster of `n` members on `host`.
#[derive(Debug)]
pub struct EtcdCluster {
    pub members: Vec<Proc>,
    /// Client URL of each member.
    pub urls: Vec<String>,
}

impl EtcdCluster {
    pub fn start(n: usize, host: &str) -> anyhow::Result<EtcdCluster> {
        let bin = which("etcd", "etcd-server")?;
        let ports: Vec<(u16, u16)> = (0..n)
            .map(|_| Ok((free_port(host)?, free_port(host)?)))
            .collect::<anyhow::Result<_>>()?;
        let initial: Vec<String> = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("m{i}=http://{host}:{peer}"))
            .collect();
        let mut members = Vec::new();
        let mut urls = Vec::new();
        for (i, (client, peer)) in ports.iter().enumerate() {
            let dir = temp_dir("etcd")?;
            let url = format!("http://{host}:{client}");
            let mut cmd = Command::new(&bin);
            cmd.args(["--name", &format!("m{i}")])
                .arg("--data-dir")
                .arg(&dir)
                .args([
                    "--listen-client-urls",
                    &url,
                    "--advertise-client-urls",
                    &url,
                ])
                .args(["--listen-peer-urls", &format!("http://{host}:{peer}")])
                .args([
                    "--initial-advertise-peer-urls",
                    &format!("http://{host}:{peer}"),
                ])
                .args(["--initial-cluster", &initial.join(",")])
                .args(["--initial-cluster-state", "new"])
                .args(["--heartbeat-interval", "100", "--election-timeout", "1000"])
                .env("ETCD_UNSUPPORTED_ARCH", std::env::consts::ARCH)
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            members.push(spawn(&format!("etcd m{i}"), cmd, Some(dir))?);
            urls.push(url);
        }
        let c = EtcdCluster { members, urls };
        c.wait_ready(Duration::from_secs(30))?;
        Ok(c)
    }

    /// Until a member answers a read through the JSON gateway (a leader
    /// is elected).
    pub fn wait_ready(&self, timeout: Duration) -> anyhow::Result<()> {
        let t0 = Instant::now();
        loop {
            for u in &self.urls {
                if post_ok(&format!("{u}/v3/kv/range"), r#"{"key":"AA=="}"#) {
                    return Ok(());
                }
            }
            if t0.elapsed() > timeout {
                bail!("etcd at {:?} did not answer within {timeout:?}", self.urls);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// A NATS server on `host`.
#[derive(Debug)]
pub struct Nats {
    pub proc: Proc,
    pub url: String,
    pub port: u16,
}

impl Nats {
    pub fn start(host: &str) -> anyhow::Result<Nats> {
        Nats::start_on(host, free_port(host)?)
    }

    pub fn start_on(host: &str, port: u16) -> anyhow::Result<Nats> {
        let bin = which("nats-server", "nats-server")?;
        let mut cmd = Command::new(bin);
        cmd.args(["-a", host, "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let mut proc = spawn("nats-server", cmd, None)?;
        wait_tcp(
            &format!("{host}:{port}"),
            Duration::from_secs(10),
            &mut proc,
        )?;
        Ok(Nats {
            proc,
            url: format!("nats://{host}:{port}"),
            port,
        })
    }
}

/// Start this binary as a worker (`prefill` or `decode`) with `args`, and
/// wait for its `ready <port>` line; the control URL.
pub fn start_worker(
    exe: &std::path::Path,
    role: &str,
    args: &[String],
) -> anyhow::Result<(Proc, String)> {
    let mut cmd = Command::new(exe);
    cmd.arg(role)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut p = spawn(role, cmd, None)?;
    let out = p.child.stdout.take().context("worker stdout")?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(out).lines();
        while let Some(Ok(l)) = lines.next() {
            if let Some(port) = l.strip_prefix("ready ") {
                let _ = tx.send(port.trim().to_string());
            }
        }
    });
    match rx.recv_timeout(Duration::from_secs(300)) {
        Ok(port) => {
            let host = args
                .iter()
                .position(|a| a == "--host")
                .and_then(|i| args.get(i + 1))
                .cloned()
                .unwrap_or_else(|| "127.0.0.1".into());
            Ok((p, format!("http://{host}:{port}")))
        }
        Err(_) => {
            let status = p.child.try_wait().ok().flatten();
            bail!("the {role} worker did not get ready within 300 s (exit status {status:?})")
        }
    }
}

/// Whether a POST of `body` to `url` (`http://host:port/path`) answers
/// 2xx within a second or two: one HTTP/1.1 exchange over std's TCP, for
/// readiness checks outside any runtime.
pub fn post_ok(url: &str, body: &str) -> bool {
    use std::io::{Read, Write};
    let rest = url.trim_start_matches("http://");
    let (hostport, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let Some(addr) = std::net::ToSocketAddrs::to_socket_addrs(hostport)
        .ok()
        .and_then(|mut a| a.next())
    else {
        return false;
    };
    let Ok(mut s) = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: {hostport}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut head = [0u8; 12];
    if s.write_all(req.as_bytes()).is_err() || s.read_exact(&mut head).is_err() {
        return false;
    }
    head[9] == b'2'
}

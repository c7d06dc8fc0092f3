//! The peer `bench-transfer` runs beside the protocol: Mooncake's transfer
//! engine (its TCP transport, peer-to-peer handshake, no metadata server)
//! moving the same bytes between two processes on the same link, driven by
//! `scripts/mooncake_transfer.py`. The receiver registers a buffer and
//! prints its session; the sender times `transfer_sync_write`s into it
//! (after one warm-up, on an engine whose connection is already open) and
//! reads the buffer back to check every byte arrived.
//!
//! Setup (once):
//! ```text
//! apt-get install -y libibverbs1
//! python3 -m venv .venv-mooncake
//! .venv-mooncake/bin/pip install -r scripts/requirements-mooncake.txt
//! ```

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

/// A child killed and reaped when dropped (an early return leaves none).
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Where the Python with Mooncake lives, and the script.
#[derive(Clone, Debug)]
pub struct Peer {
    pub python: PathBuf,
    pub script: PathBuf,
}

impl Peer {
    /// The workspace's `.venv-mooncake`, or the setup commands as the error.
    pub fn find() -> Result<Peer> {
        let root = common::assets::workspace_root();
        let python = root.join(".venv-mooncake/bin/python");
        let script = root.join("scripts/mooncake_transfer.py");
        if !python.exists() {
            bail!(
                "Mooncake's transfer engine is not installed ({} is missing); set it up with\n  \
                 apt-get install -y libibverbs1\n  python3 -m venv .venv-mooncake\n  \
                 .venv-mooncake/bin/pip install -r scripts/requirements-mooncake.txt\n\
                 or pass --no-mooncake",
                python.display()
            );
        }
        Ok(Peer { python, script })
    }

    fn command(&self, netns: Option<&str>) -> Command {
        let mut c = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&self.python);
                c
            }
            None => Command::new(&self.python),
        };
        c.arg(&self.script);
        c
    }

    /// Seconds per timed write of each size in `sizes` (bytes), `reps`
    /// each, receiver at `recv_ip` (in namespace `recv_ns`), sender at
    /// `send_ip` (in `send_ns`). The version installed comes back too.
    pub fn measure(
        &self,
        (recv_ns, recv_ip): (Option<&str>, &str),
        (send_ns, send_ip): (Option<&str>, &str),
        sizes: &[usize],
        reps: usize,
    ) -> Result<(Vec<Vec<f64>>, String)> {
        let list = sizes
            .iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(",");
        let mut rx = Reaped(
            self.command(recv_ns)
                .args([
                    "--role",
                    "receiver",
                    "--local-host",
                    recv_ip,
                    "--bytes",
                    &list,
                ])
                .args(["--deadline", "600"])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .context("starting Mooncake's receiver")?,
        );
        let out = rx.0.stdout.take().context("receiver stdout")?;
        let mut lines = BufReader::new(out).lines();
        let ready = lines.next().transpose()?.unwrap_or_default();
        let f: Vec<&str> = ready.split_whitespace().collect();
        if f.len() != 4 || f[0] != "ready" {
            bail!("Mooncake's receiver did not get ready (said {ready:?})");
        }
        let sent = self
            .command(send_ns)
            .args(["--role", "sender", "--local-host", send_ip, "--peer", f[1]])
            .args(["--remote-addr", f[2], "--bytes", &list, "--reps"])
            .arg(reps.to_string())
            .args(["--deadline", "600"])
            .stderr(Stdio::null())
            .output()
            .context("running Mooncake's sender")?;
        drop(rx.0.stdin.take());
        let _ = rx.0.wait();
        if !sent.status.success() {
            bail!(
                "Mooncake's sender failed ({}); run the script by hand to see why: {} {} --reps 1",
                sent.status,
                self.python.display(),
                self.script.display()
            );
        }
        let mut secs = Vec::new();
        let mut version = String::new();
        for line in String::from_utf8_lossy(&sent.stdout).lines() {
            let v: serde_json::Value = serde_json::from_str(line)
                .with_context(|| format!("Mooncake's sender printed {line:?}"))?;
            let s: Vec<f64> = v["seconds"]
                .as_array()
                .context("no seconds")?
                .iter()
                .filter_map(serde_json::Value::as_f64)
                .collect();
            version = v["mooncake_version"].as_str().unwrap_or("").to_string();
            secs.push(s);
        }
        if secs.len() != sizes.len() || secs.iter().any(|s| s.len() != reps) {
            bail!(
                "Mooncake's sender answered {} sizes, want {}",
                secs.len(),
                sizes.len()
            );
        }
        Ok((secs, version))
    }
}

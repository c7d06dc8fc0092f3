//! The peer: Ray Serve's autoscaler scaling our model server, driven as
//! a child process (`scripts/ray_serve_peer.py`, in the venv that
//! `scripts/setup_ray_venv.sh` makes). Its stdout says when the first
//! replica serves, then every half second how many replicas Ray runs in
//! each state; they become this run's samples.

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt as _;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use super::Observed;

/// Which of Ray Serve's autoscaling configurations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RayConfig {
    /// Its documented defaults (but the bounds and the target).
    Default,
    /// Our windows mapped onto its fields.
    Ours,
}

/// A running Ray Serve with our server behind it. Dropping it closes the
/// peer's stdin (Serve drains and shuts down, Ray with it), then kills
/// its process group if it has not exited within 60 s.
pub struct RayPeer {
    child: Child,
    pub url: String,
    stderr: PathBuf,
}

fn root() -> PathBuf {
    common::assets::workspace_root()
}

/// Replica counts by state from one status line; None for other lines.
pub fn parse_states(line: &str) -> Option<(usize, usize)> {
    let v: serde_json::Value = serde_json::from_str(line).ok()?;
    let states = v.get("states")?.as_object()?;
    let n = |k: &str| states.get(k).and_then(|x| x.as_u64()).unwrap_or(0) as usize;
    let all: usize = states.values().filter_map(|x| x.as_u64()).sum::<u64>() as usize;
    Some((all, n("RUNNING")))
}

impl RayPeer {
    /// Start Ray Serve on `port` scaling `exe server` between `min` and
    /// `max` replicas at `target` ongoing requests each; returns once its
    /// first replica serves (within `deadline`). `out` gets the samples,
    /// `env` goes to every process it starts.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        exe: &std::path::Path,
        config: RayConfig,
        port: u16,
        (min, max, target): (usize, usize, f64),
        (panic_s, stable_s): (f64, f64),
        env: &[(String, String)],
        out: Arc<Mutex<Vec<Observed>>>,
        log_dir: &std::path::Path,
    ) -> anyhow::Result<RayPeer> {
        let setup = Command::new("bash")
            .arg(root().join("scripts/setup_ray_venv.sh"))
            .status()
            .context("running scripts/setup_ray_venv.sh")?;
        if !setup.success() {
            bail!("Ray Serve could not be set up: bash scripts/setup_ray_venv.sh failed");
        }
        let python = root().join(".venv-ray/bin/python");
        let stderr = log_dir.join(format!("ray-{port}.log"));
        let err = std::fs::File::create(&stderr)?;
        let mut cmd = Command::new(&python);
        cmd.arg(root().join("scripts/ray_serve_peer.py"))
            .arg("--exe")
            .arg(exe)
            .args(["--port", &port.to_string()])
            .args([
                "--config",
                if config == RayConfig::Ours {
                    "ours"
                } else {
                    "default"
                },
            ])
            .args(["--name", super::NAME])
            .args(["--min", &min.to_string(), "--max", &max.to_string()])
            .args(["--target", &target.to_string()])
            .args(["--panic-window-s", &panic_s.to_string()])
            .args(["--stable-window-s", &stable_s.to_string()])
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(err)
            .process_group(0);
        // No PR_SET_PDEATHSIG here: it fires when the spawning *thread*
        // ends (a blocking-pool thread, soon). Should this process die, the
        // peer's stdin closes, and it shuts down on that.
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting {}", python.display()))?;
        let stdout = child.stdout.take().context("the peer's stdout")?;
        let (ready_tx, ready_rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut ready = Some(ready_tx);
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if line.contains("\"ready\": true") {
                    if let Some(tx) = ready.take() {
                        let _ = tx.send(());
                    }
                } else if let Some((running, ready)) = parse_states(&line) {
                    out.lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(Observed {
                            at: Instant::now(),
                            running,
                            ready,
                            desired: None,
                        });
                }
            }
        });
        let peer = RayPeer {
            child,
            url: format!("http://127.0.0.1:{port}"),
            stderr,
        };
        match ready_rx.recv_timeout(Duration::from_secs(240)) {
            Ok(()) => Ok(peer),
            Err(_) => bail!(
                "Ray Serve's first replica was not serving within 240 s; its log, {}:\n{}",
                peer.stderr.display(),
                peer.log_tail()
            ),
        }
    }

    fn log_tail(&self) -> String {
        let s = std::fs::read_to_string(&self.stderr).unwrap_or_default();
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

impl Drop for RayPeer {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(60) {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        // Whatever is left of Ray's processes (they share the group).
        // SAFETY: kill(2) on the process group this peer leads.
        unsafe {
            libc::kill(-(self.child.id() as i32), libc::SIGKILL);
        }
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::parse_states;

    #[test]
    fn status_lines() {
        let l = r#"{"t": 1.5, "states": {"RUNNING": 2, "STARTING": 1, "STOPPING": 1}}"#;
        assert_eq!(parse_states(l), Some((4, 2)));
        assert_eq!(parse_states(r#"{"t": 1.0, "error": "busy"}"#), None);
        assert_eq!(parse_states("Token authentication is enabled"), None);
    }
}

//! `p15_platform scale-bench`: our autoscaler (Knative's KPA rules, in
//! the platform's controller) against Ray Serve's, each scaling the same
//! model server on the same load, in the same run.
//!
//! ```text
//! profiles  step  2 clients for 20 s, 8 (4x) for 60 s, none for 30 s
//!           ramp  1 client, one more every 8 s up to 8 (at 56 s), held to
//!                 80 s, none for 30 s
//! systems   kpa          the platform: etcd, two node agents (two servers
//!                        each), a controller (stable window 20 s, panic
//!                        window 4 s), the router
//!           ray-default  Ray Serve with its documented autoscaling defaults
//!                        (upscale delay 30 s, downscale delay 600 s,
//!                        look-back 30 s, metrics every 10 s)
//!           ray-ours     Ray Serve with our windows (look-back 4 s, upscale
//!                        delay 0, downscale delay 20 s, metrics every 1 s)
//! all       1..4 replicas, target 2 streams each; a replica is one
//!           `p15_platform server` (native weights, one thread); closed-
//!           loop streaming clients, 16 tokens each
//! order     for each round: step (kpa, ray-default, ray-ours), then ramp
//!           (the same three); every system started fresh for each
//! measured  SLO attainment (requests whose TTFT met the SLO, 1 s), goodput
//!           (those per second), TTFT p50/p99, failed requests;
//!           replica-seconds against the ideal max(1, ceil(clients / 2)),
//!           over the 110 s window or, with `--settle-s S`, on until the
//!           system is back at one replica (at most S s past the window:
//!           a downscale delay's replicas cost what they cost);
//!           the step's reaction (the step to one more replica serving);
//!           flaps (the count turning back while the load holds)
//! ```

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;

use crate::clients::{Clients, Record};
use crate::local::Local;
use crate::measure::Sample;
use crate::spec::ModelDeployment;
use crate::state::Snapshot;

mod ray;
mod report;

pub use ray::{parse_states, RayConfig};

const KEY: &str = "sk-scale";
/// The deployment's (and Ray's application's) served model name.
pub const NAME: &str = "bench";
/// Streams per replica.
pub const TARGET: f64 = 2.0;
pub const MIN: usize = 1;
pub const MAX: usize = 4;
const STABLE_S: f64 = 20.0;
const PANIC_S: f64 = 4.0;

#[derive(Clone, Debug, Args)]
pub struct ScaleBenchArgs {
    /// Rounds of every profile and system.
    #[arg(long, default_value_t = 1)]
    pub runs: usize,
    /// Systems to run (kpa, ray-default, ray-ours), comma-separated.
    #[arg(
        long,
        default_value = "kpa,ray-default,ray-ours",
        value_delimiter = ','
    )]
    pub systems: Vec<String>,
    /// Load profiles to run (step, ramp), comma-separated.
    #[arg(long, default_value = "step,ramp", value_delimiter = ',')]
    pub profiles: Vec<String>,
    /// The TTFT objective, seconds.
    #[arg(long, default_value_t = 1.0)]
    pub slo_ttft_s: f64,
    /// Where the plots go.
    #[arg(long, default_value = "p15_platform/plots")]
    pub plots: std::path::PathBuf,
    /// Print only; append nothing to numbers.md.
    #[arg(long)]
    pub no_rows: bool,
    /// After the load's window, keep counting replica-seconds until the
    /// system is back at one replica, for at most this many seconds (0:
    /// the window only).
    #[arg(long, default_value_t = 0.0)]
    pub settle_s: f64,
}

/// A load profile: the number of clients over time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Profile {
    Step,
    Ramp,
}

impl Profile {
    pub fn parse(s: &str) -> anyhow::Result<Profile> {
        match s {
            "step" => Ok(Profile::Step),
            "ramp" => Ok(Profile::Ramp),
            _ => anyhow::bail!("--profiles: {s:?}: expected step or ramp"),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Profile::Step => "step",
            Profile::Ramp => "ramp",
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Profile::Step => "step 2 -> 8 clients",
            Profile::Ramp => "ramp 1 -> 8 clients",
        }
    }

    /// When the number of clients changes, and to what.
    pub fn changes(self) -> Vec<(f64, usize)> {
        match self {
            Profile::Step => vec![(0.0, 2), (20.0, 8), (80.0, 0)],
            Profile::Ramp => {
                let mut v: Vec<(f64, usize)> = (1..=8).map(|n| ((n - 1) as f64 * 8.0, n)).collect();
                v.push((80.0, 0));
                v
            }
        }
    }

    pub fn end(self) -> f64 {
        110.0
    }

    pub fn clients_at(self, t: f64) -> usize {
        self.changes()
            .iter()
            .take_while(|&&(at, _)| at <= t)
            .last()
            .map_or(0, |&(_, n)| n)
    }

    /// The step's time, where there is one.
    pub fn step_at(self) -> Option<f64> {
        (self == Profile::Step).then_some(20.0)
    }

    /// Stretches of constant load at least 20 s long: where the replica
    /// count must not turn back.
    pub fn steady(self) -> Vec<(f64, f64)> {
        let ch = self.changes();
        let mut v = Vec::new();
        for (i, &(t, _)) in ch.iter().enumerate() {
            let next = ch.get(i + 1).map_or(self.end(), |c| c.0);
            if next - t >= 20.0 {
                v.push((t, next));
            }
        }
        v
    }
}

/// Who scales.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum System {
    Kpa,
    Ray(RayConfig),
}

impl System {
    pub fn parse(s: &str) -> anyhow::Result<System> {
        match s {
            "kpa" => Ok(System::Kpa),
            "ray-default" => Ok(System::Ray(RayConfig::Default)),
            "ray-ours" => Ok(System::Ray(RayConfig::Ours)),
            _ => anyhow::bail!("--systems: {s:?}: expected kpa, ray-default or ray-ours"),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            System::Kpa => "kpa",
            System::Ray(RayConfig::Default) => "ray-default",
            System::Ray(RayConfig::Ours) => "ray-ours",
        }
    }
}

/// The fleet as one system reported it, at a moment.
#[derive(Clone, Debug)]
pub struct Observed {
    pub at: Instant,
    pub running: usize,
    pub ready: usize,
    pub desired: Option<f64>,
}

/// One system through one profile.
#[derive(Clone, Debug)]
pub struct Trial {
    pub system: System,
    pub profile: Profile,
    pub records: Vec<Record>,
    pub samples: Vec<Sample>,
    /// Seconds from the start to the last sample counted: the window's
    /// end, or later with `--settle-s`.
    pub end: f64,
}

/// Everything environment the servers get (both systems alike): one
/// thread each, so that replicas are what adds capacity.
fn server_env() -> Vec<(String, String)> {
    vec![("RAYON_NUM_THREADS".into(), "1".into())]
}

fn deployment() -> ModelDeployment {
    let yaml = format!(
        "name: {NAME}\nmodel: smollm2\nweights: native\nreplicas: {{min: {MIN}, max: {MAX}}}\n\
         autoscaling: {{metric: concurrency, target: {TARGET}, stable_window: {STABLE_S}s, \
         panic_window: {PANIC_S}s,\n  scale_down_delay: 0s, max_scale_up_rate: 1000, \
         max_scale_down_rate: 2, scale_to_zero_grace: 30s}}\n\
         roles: colocated\nrollout: {{max_surge: 1, max_unavailable: 0}}\n"
    );
    ModelDeployment::from_yaml(&yaml, "the bench deployment").expect("a valid deployment")
}

/// A started system: where clients go, and what keeps it running.
enum Fleet {
    Kpa(Box<Local>, tokio::task::JoinHandle<()>),
    Ray(Box<ray::RayPeer>),
}

async fn start(system: System, out: Arc<Mutex<Vec<Observed>>>) -> anyhow::Result<(Fleet, String)> {
    let exe = std::env::current_exe()?;
    match system {
        System::Kpa => {
            let mut l = Local::start(&exe, 1, false)?;
            l.env = server_env();
            l.agent("n1", 2)?;
            l.agent("n2", 2)?;
            l.controller("c1")?;
            let url = l.router(&[NAME], KEY, 120_000)?;
            l.apply(&deployment()).await?;
            l.wait_for("a first server", Duration::from_secs(120), |s| {
                s.ready(NAME) >= 1
            })
            .await?;
            let (etcd, http) = (l.etcd_client(), reqwest::Client::new());
            let ctl: Vec<String> = l.controllers.iter().filter_map(|m| m.url.clone()).collect();
            let sampler = tokio::spawn(async move {
                loop {
                    if let Ok(s) = Snapshot::read(&etcd).await {
                        let o = Observed {
                            at: Instant::now(),
                            running: s.running(),
                            ready: s.ready(NAME),
                            desired: crate::demo::desired(&http, &ctl, NAME).await,
                        };
                        out.lock().unwrap_or_else(|p| p.into_inner()).push(o);
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            });
            Ok((Fleet::Kpa(Box::new(l), sampler), url))
        }
        System::Ray(cfg) => {
            let port = p14_distributed::cluster::free_port("127.0.0.1")?;
            let dir = p14_distributed::cluster::temp_dir("p15-ray")?;
            let peer = tokio::task::spawn_blocking(move || {
                ray::RayPeer::start(
                    &exe,
                    cfg,
                    port,
                    (MIN, MAX, TARGET),
                    (PANIC_S, STABLE_S),
                    &server_env(),
                    out,
                    &dir,
                )
            })
            .await??;
            let url = peer.url.clone();
            Ok((Fleet::Ray(Box::new(peer)), url))
        }
    }
}

/// Run `system` through `profile` from a fresh start; with `settle_s`,
/// observe on past the window until it is back at `MIN` replicas running
/// (at most `settle_s` more).
async fn trial(system: System, profile: Profile, settle_s: f64) -> anyhow::Result<Trial> {
    let observed: Arc<Mutex<Vec<Observed>>> = Arc::new(Mutex::new(Vec::new()));
    let (fleet, url) = start(system, observed.clone())
        .await
        .with_context(|| format!("starting {}", system.name()))?;
    let t0 = Instant::now();
    let clients = Clients::start(&url, NAME, KEY, 8, 16, t0);
    for (at, n) in profile.changes() {
        tokio::time::sleep_until((t0 + Duration::from_secs_f64(at)).into()).await;
        clients.set(n);
        println!("  {:6.1} s  {} clients", at, n);
    }
    tokio::time::sleep_until((t0 + Duration::from_secs_f64(profile.end())).into()).await;
    let records = clients.records();
    let mut end = profile.end();
    if settle_s > 0.0 {
        let floor = |o: &Observed| o.running <= MIN;
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            end = t0.elapsed().as_secs_f64();
            let last = observed
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .last()
                .cloned();
            if last.as_ref().is_some_and(floor) || end >= profile.end() + settle_s {
                break;
            }
        }
        println!("  {end:6.1} s  counted to here (settled or capped)");
    }
    let samples = observed
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .filter_map(|o| {
            let t = o.at.checked_duration_since(t0)?.as_secs_f64();
            (t <= end).then(|| Sample {
                t,
                clients: profile.clients_at(t),
                running: o.running,
                ready: o.ready,
                desired: o.desired,
            })
        })
        .collect();
    match fleet {
        Fleet::Kpa(l, sampler) => {
            sampler.abort();
            drop(l);
        }
        Fleet::Ray(peer) => tokio::task::spawn_blocking(move || drop(peer)).await?,
    }
    Ok(Trial {
        system,
        profile,
        records,
        samples,
        end,
    })
}

pub fn run(a: &ScaleBenchArgs) -> anyhow::Result<()> {
    let systems: Vec<System> = a
        .systems
        .iter()
        .map(|s| System::parse(s))
        .collect::<Result<_, _>>()?;
    let profiles: Vec<Profile> = a
        .profiles
        .iter()
        .map(|s| Profile::parse(s))
        .collect::<Result<_, _>>()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let mut trials = Vec::new();
    for round in 0..a.runs.max(1) {
        for &p in &profiles {
            for &s in &systems {
                println!(
                    "round {} of {}: {} under {}",
                    round + 1,
                    a.runs.max(1),
                    s.name(),
                    p.describe()
                );
                let t = rt.block_on(trial(s, p, a.settle_s))?;
                report::print(a, &t);
                trials.push(t);
            }
        }
    }
    report::plot(a, &trials)?;
    if !a.no_rows {
        report::record(a, &trials)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiles() {
        assert_eq!(Profile::Step.clients_at(0.0), 2);
        assert_eq!(Profile::Step.clients_at(25.0), 8);
        assert_eq!(Profile::Step.clients_at(100.0), 0);
        assert_eq!(Profile::Ramp.clients_at(8.5), 2);
        assert_eq!(Profile::Ramp.clients_at(60.0), 8);
        assert_eq!(
            Profile::Step.steady(),
            vec![(0.0, 20.0), (20.0, 80.0), (80.0, 110.0)]
        );
        assert_eq!(Profile::Ramp.steady(), vec![(56.0, 80.0), (80.0, 110.0)]);
    }
}

//! `bench-allreduce`: all-reduce latency and bandwidth from 4 B to 64 MiB,
//! three ranks, over threads, shared memory and TCP (ranks as threads of
//! this process; TCP on loopback), beside torch's gloo backend (three processes, the same
//! sizes) in the same run, rounds interleaved (ours, gloo, ours, gloo…).

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use common::numbers::{command_line, Recorder, Row};
use common::plot::{line_chart, Labels, Scale, Series};
use common::stats::summarize;

use crate::mesh::Algorithm;
use crate::{shm, tcp, threads, Communicator};

#[derive(Clone, Debug, Args)]
pub struct AllReduceArgs {
    /// Ranks.
    #[arg(long, default_value_t = 3)]
    pub world: usize,
    /// Rounds of every backend (samples per size per backend = rounds ×
    /// samples).
    #[arg(long, default_value_t = 2)]
    pub rounds: usize,
    #[arg(long, default_value_t = 5)]
    pub samples: usize,
    /// The Python with torch for the gloo peer (scripts/requirements.txt).
    #[arg(long, default_value = ".venv-ref/bin/python")]
    pub python: PathBuf,
    /// Measure without appending to numbers.md.
    #[arg(long)]
    pub no_record: bool,
}

/// Payload sizes in bytes: 4 B, one f32 hidden row of SmolLM2 (2,304 B),
/// a 16-token step's (36 KiB), then 1, 16 and 64 MiB.
pub const SIZES: [usize; 6] = [4, 2304, 36_864, 1 << 20, 16 << 20, 64 << 20];

/// Seconds per byte (1/β) from a ring all-reduce of `bytes` over `world`
/// ranks that took `ring` seconds, given the per-message latency `alpha`:
/// its 2 (W − 1) rounds each cost α plus 1/W of the bytes over β.
pub(crate) fn ring_per_byte(alpha: f64, ring: f64, world: usize, bytes: usize) -> f64 {
    let rounds = 2.0 * (world as f64 - 1.0);
    ((ring / rounds - alpha) * world as f64 / bytes as f64).max(0.0)
}

/// Back-to-back calls per sample: enough to last ~20 ms on loopback.
fn reps_for(bytes: usize) -> usize {
    (20_000_000 / (bytes + 20_000)).clamp(1, 2000)
}

/// Seconds per all-reduce of `bytes` on rank 0, each sample the mean of
/// `reps` back-to-back calls.
pub(crate) fn time_world<C: Communicator>(
    comms: &[C],
    bytes: usize,
    samples: usize,
    reps: usize,
) -> Vec<f64> {
    let n = bytes / 4;
    std::thread::scope(|s| {
        let joins: Vec<_> = comms
            .iter()
            .map(|c| {
                s.spawn(move || {
                    let mut buf = vec![1.0f32; n];
                    for _ in 0..reps.min(20) {
                        c.all_reduce_sum(&mut buf).expect("warm-up all-reduce");
                    }
                    (0..samples)
                        .map(|_| {
                            c.barrier().expect("barrier");
                            let t0 = Instant::now();
                            for _ in 0..reps {
                                c.all_reduce_sum(&mut buf).expect("all-reduce");
                            }
                            t0.elapsed().as_secs_f64() / reps as f64
                        })
                        .collect::<Vec<f64>>()
                })
            })
            .collect();
        let mut out: Vec<Vec<f64>> = joins.into_iter().map(|j| j.join().unwrap()).collect();
        out.swap_remove(0)
    })
}

/// torch.distributed's gloo all-reduce at every size: seconds per call,
/// per sample, per size (scripts/bench_p13_gloo.py).
fn gloo(a: &AllReduceArgs) -> Result<Vec<Vec<f64>>> {
    let root = common::assets::workspace_root();
    let python = root.join(&a.python);
    if !python.exists() {
        bail!(
            "{} not found: python3 -m venv .venv-ref && .venv-ref/bin/pip install -r scripts/requirements.txt",
            python.display()
        );
    }
    let sizes: Vec<String> = SIZES.iter().map(|s| s.to_string()).collect();
    let out = Command::new(&python)
        .arg(root.join("scripts/bench_p13_gloo.py"))
        .args([
            "--world",
            &a.world.to_string(),
            "--samples",
            &a.samples.to_string(),
        ])
        .args(["--sizes", &sizes.join(",")])
        .output()
        .context("running scripts/bench_p13_gloo.py")?;
    if !out.status.success() {
        bail!("gloo peer failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .rev()
        .find(|l| l.starts_with('['))
        .context("no JSON line from the gloo peer")?;
    let v: Vec<Vec<f64>> = serde_json::from_str(line).context("the gloo peer's JSON")?;
    if v.len() != SIZES.len() {
        bail!(
            "the gloo peer measured {} sizes, not {}",
            v.len(),
            SIZES.len()
        );
    }
    Ok(v)
}

pub fn all_reduce(a: &AllReduceArgs) -> Result<()> {
    let deadline = Duration::from_secs(60);
    let names = ["threads", "shm", "tcp", "gloo"];
    // samples[backend][size]
    let mut samples = vec![vec![Vec::<f64>::new(); SIZES.len()]; names.len()];
    for round in 0..a.rounds {
        eprintln!("round {} of {}", round + 1, a.rounds);
        let t = threads::group(a.world, deadline, Algorithm::default());
        let m = shm::group(a.world, deadline)?;
        let c = tcp::loopback_group(a.world, deadline, Algorithm::default())?;
        for (i, &bytes) in SIZES.iter().enumerate() {
            samples[0][i].extend(time_world(&t, bytes, a.samples, reps_for(bytes)));
            samples[1][i].extend(time_world(&m, bytes, a.samples, reps_for(bytes)));
            samples[2][i].extend(time_world(&c, bytes, a.samples, reps_for(bytes)));
        }
        drop((t, m, c));
        for (i, s) in gloo(a)?.into_iter().enumerate() {
            samples[3][i].extend(s);
        }
    }
    let mut rows = Vec::new();
    println!("| bytes | backend | median µs | p95 µs | algbw GB/s at median |");
    println!("|---|---|---|---|---|");
    for (i, &bytes) in SIZES.iter().enumerate() {
        for (b, name) in names.iter().enumerate() {
            let s = summarize(&samples[b][i]);
            let us = |x: f64| x * 1e6;
            println!(
                "| {bytes} | {name} | {:.1} | {:.1} | {:.3} |",
                us(s.median),
                us(s.p95),
                bytes as f64 / s.median / 1e9
            );
            let metric = format!("all-reduce {name}, {} ranks, {bytes} B, latency", a.world);
            let prediction = match (*name, bytes) {
                ("shm", 2304) => "≤ 10 µs (two spins on shared words)",
                ("tcp", 2304) => "≤ gloo's median (one round of messages)",
                _ => "",
            };
            rows.extend(Row::median_p95(
                metric,
                us(s.median),
                us(s.p95),
                "µs",
                prediction,
            ));
            rows.push(Row::new(
                format!(
                    "all-reduce {name}, {} ranks, {bytes} B, algbw at median",
                    a.world
                ),
                bytes as f64 / s.median / 1e9,
                "GB/s",
            ));
        }
    }
    // Latency (median and p95) and bandwidth against the size, per backend.
    let at = |b: usize, f: &dyn Fn(&common::stats::Summary, usize) -> f64| -> Vec<(f64, f64)> {
        (SIZES.iter().enumerate())
            .map(|(i, &bytes)| (bytes as f64, f(&summarize(&samples[b][i]), bytes)))
            .collect()
    };
    let mut latency = Vec::new();
    let mut bandwidth = Vec::new();
    for (b, name) in names.iter().enumerate() {
        latency.push(Series::new(
            format!("{name} median"),
            at(b, &|s, _| s.median * 1e6),
        ));
        latency.push(Series::new(
            format!("{name} p95"),
            at(b, &|s, _| s.p95 * 1e6),
        ));
        bandwidth.push(Series::new(
            format!("{name} (at median)"),
            at(b, &|s, bytes| bytes as f64 / s.median / 1e9),
        ));
    }
    let dir = common::assets::workspace_root().join("p13_multi_gpu/plots");
    let title = format!("all-reduce over {} ranks (this machine: 2 cores)", a.world);
    line_chart(
        &dir.join("allreduce_latency.png"),
        Labels {
            title: &title,
            x: "bytes",
            y: "latency (µs)",
        },
        &latency,
        Scale::LogLog,
    )
    .map_err(anyhow::Error::msg)?;
    line_chart(
        &dir.join("allreduce_bandwidth.png"),
        Labels {
            title: &title,
            x: "bytes",
            y: "algorithm bandwidth (GB/s)",
        },
        &bandwidth,
        Scale::LogLog,
    )
    .map_err(anyhow::Error::msg)?;
    if !a.no_record {
        Recorder::for_workspace(command_line("p13_multi_gpu")).append(&rows)?;
    }
    Ok(())
}

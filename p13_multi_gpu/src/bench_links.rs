//! `bench-links`: TP = 3 and PP = 3 decode with every rank on a host of
//! its own (a network namespace each, see [`crate::hosts`]), the links
//! carrying 0, 10 µs, 100 µs and 1 ms of one-way delay and one cell with a
//! bandwidth cap; beside it an α–β model of each cell's decode step.
//!
//! The model: a step costs what it costs on an undelayed link, plus, for
//! every message round on its critical path, the link's extra per-message
//! latency, plus, for every byte on that path, the extra time per byte:
//!
//!   T(cell) = T(0) + R · (α(cell) − α(0)) + B · (1/β(cell) − 1/β(0))
//!
//! α is measured in each cell as the median 4-byte all-reduce across the
//! three hosts (one round), β from a 1 MiB ring all-reduce (2 (W − 1)
//! rounds, each α plus 1/W of the bytes over β). R and B are counted from
//! the step's own calls: under TP every collective rank 0 makes is one
//! round (the plan's broadcast, two all-reduces per layer) and B is the
//! bytes it sends; under PP the rounds are the stages' hand-offs (the plan's
//! broadcast overlaps stage 0's compute) and B their bytes, the last
//! stage's logits included.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use common::numbers::{command_line, Recorder, Row};
use common::plot::{line_chart, Labels, Scale, Series};
use common::stats::summarize;

use p04_transformer::HeadSplit;

use crate::bench::{ring_per_byte, time_world};
use crate::bench_decode::{with_world, Drive};
use crate::hosts::{Hosts, Link};
use crate::{Algorithm, CommStats, Communicator};

#[derive(Clone, Debug, Args)]
pub struct LinksArgs {
    #[arg(long, default_value = "smollm2")]
    pub model: String,
    /// Prompt tokens (one prefill step, not timed).
    #[arg(long, default_value_t = 32)]
    pub prompt: usize,
    /// Decode steps timed per round.
    #[arg(long, default_value_t = 16)]
    pub decode: usize,
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// The capped cell's bandwidth, Mbit/s (its delay is 100 µs).
    #[arg(long, default_value_t = 100)]
    pub rate_mbit: u32,
    #[arg(long)]
    pub no_record: bool,
}

const WORLD: usize = 3;
const BIG: usize = 1 << 20;

fn cells(rate: u32) -> [Link; 5] {
    let us = Duration::from_micros;
    [
        Link {
            delay: us(0),
            rate_mbit: None,
        },
        Link {
            delay: us(10),
            rate_mbit: None,
        },
        Link {
            delay: us(100),
            rate_mbit: None,
        },
        Link {
            delay: us(1000),
            rate_mbit: None,
        },
        Link {
            delay: us(100),
            rate_mbit: Some(rate),
        },
    ]
}

/// Rounds and bytes on a step's critical path (see the module's note).
fn critical_path(pp: bool, stats: &[CommStats], steps: usize) -> (f64, f64) {
    let n = steps.max(1) as f64;
    if pp {
        let sends: u64 = stats.iter().map(|s| s.sends).sum();
        let bytes: u64 = stats.iter().map(|s| s.send_bytes).sum();
        (sends as f64 / n, bytes as f64 / n)
    } else {
        (stats[0].calls as f64 / n, stats[0].bytes_sent as f64 / n)
    }
}

/// α (s) and 1/β (s per byte) of one cell from its probes' medians.
fn alpha_beta(alpha: &[f64], ring: &[f64]) -> (f64, f64) {
    let a = summarize(alpha).median;
    (a, ring_per_byte(a, summarize(ring).median, WORLD, BIG))
}

pub fn run(a: &LinksArgs) -> Result<()> {
    let path = p06_server::load::resolve_model(&a.model)?;
    let tok =
        p04_transformer::Tokenizer::from_gguf(&p04_transformer::GgufFile::open(&path)?.header)?;
    let mut prompt = tok.encode(&"The history of the harbour town is a long one. ".repeat(16));
    prompt.truncate(a.prompt);
    anyhow::ensure!(
        prompt.len() == a.prompt,
        "the prompt is shorter than {} tokens",
        a.prompt
    );
    let hosts = Hosts::new(WORLD).context("making the simulated hosts")?;
    eprintln!("{WORLD} hosts; delay by {}", hosts.delay_by().name());
    let cells = cells(a.rate_mbit);
    let deadline = Duration::from_secs(120);

    // Decode steps per setup per cell, and the counted critical path.
    let mut steps = vec![vec![Vec::new(); cells.len()]; 2];
    let mut paths = vec![vec![(0.0, 0.0); cells.len()]; 2];
    for (si, pp) in [false, true].into_iter().enumerate() {
        let comms: Vec<Arc<dyn Communicator>> = hosts
            .tcp_group(deadline, Algorithm::default())?
            .into_iter()
            .map(|c| Arc::new(c) as Arc<dyn Communicator>)
            .collect();
        let name = if pp { "PP=3" } else { "TP=3" };
        with_world(
            pp,
            HeadSplit::Replicated,
            &path,
            prompt.len(),
            comms,
            |drive| {
                drive(&prompt, 4)?; // warm-up
                for r in 0..a.rounds {
                    for (ci, cell) in cells.iter().enumerate() {
                        eprintln!("{name}, round {} of {}: {}", r + 1, a.rounds, cell.name());
                        hosts.set_link(*cell)?;
                        let d: Drive = drive(&prompt, a.decode)?;
                        paths[si][ci] = critical_path(pp, &d.stats, d.decode_s.len());
                        steps[si][ci].extend(d.decode_s);
                    }
                }
                Ok(())
            },
        )
        .with_context(|| name)?;
    }

    // α and β in every cell, rounds interleaved.
    let probe = hosts.tcp_group(deadline, Algorithm::default())?;
    let mut alpha = vec![Vec::new(); cells.len()];
    let mut ring = vec![Vec::new(); cells.len()];
    for _ in 0..a.rounds {
        for (ci, cell) in cells.iter().enumerate() {
            hosts.set_link(*cell)?;
            alpha[ci].extend(time_world(&probe, 4, 5, 20));
            ring[ci].extend(time_world(&probe, BIG, 2, 1));
        }
    }
    hosts.set_link(Link::default())?;
    let ab: Vec<(f64, f64)> = (0..cells.len())
        .map(|c| alpha_beta(&alpha[c], &ring[c]))
        .collect();

    let mut rows = Vec::new();
    let note = hosts.delay_by().name();
    println!("3 hosts, delay by {note}");
    println!("| link | α µs | β MB/s | TP=3 step ms (p95) | model ms | error | PP=3 step ms (p95) | model ms | error |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for (ci, cell) in cells.iter().enumerate() {
        let (al, pb) = ab[ci];
        let link = cell.name();
        rows.extend(Row::median_p95(
            format!("p13 link α (4 B all-reduce, 3 hosts), {link}"),
            summarize(&alpha[ci]).median * 1e6,
            summarize(&alpha[ci]).p95 * 1e6,
            "µs",
            format!("{} µs more than the undelayed link", cell.delay.as_micros()),
        ));
        rows.push(Row::new(
            format!(
                "p13 link β (from the medians of a 1 MiB ring all-reduce and α, 3 hosts), {link}"
            ),
            if pb > 0.0 { 1e-6 / pb } else { f64::INFINITY },
            "MB/s",
        ));
        let mut line = format!("| {link} | {:.1} | {:.1} |", al * 1e6, 1e-6 / pb);
        for (si, name) in ["TP=3", "PP=3"].iter().enumerate() {
            let s = summarize(&steps[si][ci]);
            let base = summarize(&steps[si][0]).median;
            let (r, b) = paths[si][ci];
            let model = base + r * (al - ab[0].0) + b * (pb - ab[0].1);
            let err = 100.0 * (model - s.median) / s.median;
            line += &format!(
                " {:.2} ({:.2}) | {:.2} | {err:+.1}% |",
                s.median * 1e3,
                s.p95 * 1e3,
                model * 1e3
            );
            let m = format!("p13 decode step over 3 hosts, batch 1, native, {name} tcp, {link}");
            rows.extend(Row::median_p95(&m, s.median * 1e3, s.p95 * 1e3, "ms", ""));
            rows.extend(Row::rate_median_p95(
                format!("p13 decode over 3 hosts, batch 1, native, {name} tcp, {link}"),
                1.0,
                &s,
                "tok/s",
                "",
            ));
            rows.push(
                Row::new(
                    format!("p13 α–β model of that step, {name}, {link}"),
                    model * 1e3,
                    "ms",
                )
                .predicted(format!(
                    "{r:.0} rounds and {b:.0} B per step on the critical path"
                )),
            );
            rows.push(Row::new(
                format!("p13 α–β model error, {name}, {link}"),
                err,
                "%",
            ));
        }
        println!("{line}");
    }
    // Step time against the added delay (the capped cell apart), measured
    // and modelled; log axes, so the undelayed cell is the table's.
    let mut series = Vec::new();
    for (si, name) in ["TP=3", "PP=3"].iter().enumerate() {
        let base = summarize(&steps[si][0]).median;
        let (r, b) = paths[si][0];
        let (mut meas, mut model) = (Vec::new(), Vec::new());
        for (ci, cell) in cells.iter().enumerate().skip(1) {
            if cell.rate_mbit.is_some() {
                continue;
            }
            let x = cell.delay.as_secs_f64() * 1e6;
            let (al, pb) = ab[ci];
            meas.push((x, summarize(&steps[si][ci]).median * 1e3));
            model.push((x, (base + r * (al - ab[0].0) + b * (pb - ab[0].1)) * 1e3));
        }
        series.push(Series::new(format!("{name} measured (median)"), meas));
        series.push(Series::new(format!("{name} α–β model"), model));
    }
    line_chart(
        &common::assets::workspace_root().join("p13_multi_gpu/plots/decode_step_vs_link_delay.png"),
        Labels {
            title: "SmolLM2 decode step, 3 ranks on 3 simulated hosts",
            x: "one-way link delay (µs)",
            y: "decode step (ms)",
        },
        &series,
        Scale::LogLog,
    )
    .map_err(anyhow::Error::msg)?;
    if !a.no_record {
        Recorder::for_workspace(command_line("p13_multi_gpu"))
            .machine_note(&format!("3 hosts as network namespaces, delay by {note}"))
            .append(&rows)?;
    }
    Ok(())
}

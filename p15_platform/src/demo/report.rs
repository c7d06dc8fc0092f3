//! The demo's figures: printed for each run, plotted for the last, and
//! appended to numbers.md over all of them (medians and p95s of each
//! event's time from 5 runs or more).

use std::collections::BTreeMap;

use common::numbers::Row;
use common::plot::{line_chart, Labels, Scale, Series};
use common::stats::percentile_sorted;

use crate::measure::{flaps, pct, replica_seconds, rows_of, sorted};

use super::{DemoArgs, Run, TARGET};
use crate::clients::Record;

/// One run's figures.
#[derive(Clone, Debug, Default)]
pub struct Figures {
    pub requests: usize,
    /// Failed or cut, in flight on a server or node killed outright.
    pub at_kill: usize,
    /// Failed or cut otherwise.
    pub other: usize,
    pub replica_seconds: f64,
    pub ideal: f64,
    pub flaps: usize,
}

pub fn figures(run: &Run) -> Figures {
    let failed: Vec<&Record> = run.records.iter().filter(|r| !r.ok).collect();
    // In flight when a server or its node was killed: cut with it.
    let at_kill = |r: &Record| run.kills.iter().any(|&k| r.start <= k && k <= r.end + 0.5);
    let n_kill = failed.iter().filter(|r| at_kill(r)).count();
    // Replica-seconds: servers running against ceil(clients / target).
    let (actual, ideal) = replica_seconds(&run.samples, TARGET, 0);
    // Flaps: the desired count changing direction while the load holds.
    let flaps = flaps(&run.samples, &run.steady, |s| s.desired);
    Figures {
        requests: run.records.len(),
        at_kill: n_kill,
        other: failed.len() - n_kill,
        replica_seconds: actual,
        ideal,
        flaps,
    }
}

/// The fault matrix's cells: key, what was done, the pause predicted.
pub const CELLS: [(&str, &str, &str); 5] = [
    (
        "server",
        "a server SIGKILLed",
        "under 1 s: the router's retry + a prefill of the prompt and text so far",
    ),
    (
        "node",
        "a node agent SIGKILLed (its servers with it)",
        "as a server's",
    ),
    (
        "leader",
        "the leading controller SIGKILLed",
        "no longer than unfaulted (a TTFT under load): requests do not pass through it",
    ),
    (
        "etcd",
        "etcd's leader SIGKILLed (3 members)",
        "no longer than unfaulted: the router serves from its last view",
    ),
    (
        "decode",
        "a split deployment's decode worker SIGKILLed",
        "under 1 s: the lease's expiry is not waited for; a prefill of prompt and tokens so far",
    ),
];

/// One cell of one run: the requests in flight at its fault.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Cell {
    pub requests: usize,
    /// Failed or cut.
    pub lost: usize,
    /// Answered, with another text than the same prompt's answer before
    /// any fault (a split deployment's longer answers must start with it).
    pub changed: usize,
    /// The longest wait for a token among them (s).
    pub pause: f64,
}

/// The answer to each prompt before the first fault: what the
/// single-process server (every replica runs one) gives, unfaulted.
fn unfaulted(run: &Run) -> BTreeMap<&str, &str> {
    let first = run.faults.iter().map(|f| f.1).fold(f64::INFINITY, f64::min);
    let mut m = BTreeMap::new();
    for r in run.records.iter().filter(|r| r.ok && r.end < first) {
        m.entry(r.prompt.as_str()).or_insert(r.text.as_str());
    }
    m
}

/// Each cell's figures in one run.
pub fn matrix(run: &Run) -> BTreeMap<&'static str, Cell> {
    let want = unfaulted(run);
    let mut out = BTreeMap::new();
    for &(key, t) in &run.faults {
        let (records, longer) = match key {
            "decode" => (&run.split, true),
            _ => (&run.records, false),
        };
        let mut c = Cell::default();
        for r in records.iter().filter(|r| r.start <= t && t <= r.end) {
            c.requests += 1;
            c.pause = c.pause.max(r.max_gap);
            let agrees = want.get(r.prompt.as_str()).is_some_and(|w| match longer {
                true => r.text.starts_with(w),
                false => r.text == *w,
            });
            if !r.ok {
                c.lost += 1;
            } else if !agrees {
                c.changed += 1;
            }
        }
        out.insert(key, c);
    }
    out
}

/// One run's figures, as text.
pub fn print(a: &DemoArgs, run: &Run) {
    let f = figures(run);
    let ttft = sorted(run.records.iter().filter_map(|r| r.ttft).collect());
    let within = ttft.iter().filter(|&&t| t <= a.slo_ttft_s).count();
    println!(
        "\n{} requests: {} failed or cut in flight on a killed server or node, {} otherwise",
        f.requests, f.at_kill, f.other
    );
    for r in run.records.iter().filter(|r| !r.ok).take(5) {
        println!("  at {:.1} s: {}", r.start, r.error);
    }
    println!(
        "TTFT p50 {:.3} s, p99 {:.3} s; {:.1}% within {} s",
        pct(&ttft, 50.0),
        pct(&ttft, 99.0),
        100.0 * within as f64 / ttft.len().max(1) as f64,
        a.slo_ttft_s
    );
    let cold = sorted(run.cold.clone());
    println!(
        "cold start (spawn to ready) median {:.2} s, p95 {:.2} s over {}",
        pct(&cold, 50.0),
        pct(&cold, 95.0),
        cold.len()
    );
    let split_failed: Vec<&Record> = run.split.iter().filter(|r| !r.ok).collect();
    println!(
        "split deployment: {} requests, {} failed or cut with its decode worker killed under them",
        run.split.len(),
        split_failed.len()
    );
    for r in split_failed.iter().take(5) {
        println!("  at {:.1} s: {}", r.start, r.error);
    }
    for (k, v) in &run.marks {
        println!("{k:>12}: {v:.2} s");
    }
    println!("fault matrix (requests in flight at the fault):");
    for (k, c) in matrix(run) {
        println!(
            "{k:>12}: {} requests, {} lost, {} changed, longest wait {:.2} s",
            c.requests, c.lost, c.changed, c.pause
        );
    }
    println!(
        "replica-seconds {:.0}, ideal {:.0} (ratio {:.2}); flaps {}",
        f.replica_seconds,
        f.ideal,
        f.replica_seconds / f.ideal.max(1e-9),
        f.flaps
    );
}

/// What each event's row says it is, and what was predicted.
const EVENTS: [(&str, &str, &str); 10] = [
    (
        "from zero",
        "first request to a first server ready (scale from zero)",
        "cold start + 1 s",
    ),
    (
        "step first",
        "4x step to a new replica serving",
        "about 3 s (target: panic window 4 s + one cold start)",
    ),
    ("step all", "4x step to all four serving", ""),
    (
        "heal server",
        "a killed server to four serving again",
        "cold start + 1 s",
    ),
    (
        "heal node",
        "a killed node agent to its servers re-placed",
        "lease TTL 2 s + cold start",
    ),
    (
        "heal leader",
        "a killed leading controller to the standby leading",
        "under the 2 s TTL + 0.5 s",
    ),
    (
        "heal etcd",
        "etcd's leader killed to a write through the others",
        "under 2 s",
    ),
    (
        "rollout",
        "rolling update of four replicas (native to f32)",
        "4 x (cold start + drain)",
    ),
    (
        "to zero",
        "load stopped to zero replicas",
        "stable window 20 s + grace 4 s",
    ),
    (
        "heal decode",
        "a split deployment's decode worker killed under load to a new one serving",
        "lease TTL 2 s + cold start",
    ),
];

/// Append the runs' rows to numbers.md.
pub fn record(a: &DemoArgs, runs: &[Run]) -> anyhow::Result<()> {
    let fs: Vec<Figures> = runs.iter().map(figures).collect();
    let n: usize = fs.iter().map(|f| f.requests).sum();
    let nr = runs.len();
    let all: Vec<&Record> = runs.iter().flat_map(|r| &r.records).collect();
    let ttft = sorted(all.iter().filter_map(|r| r.ttft).collect());
    let within = ttft.iter().filter(|&&t| t <= a.slo_ttft_s).count();
    let cold = sorted(runs.iter().flat_map(|r| r.cold.clone()).collect());
    let runs_s = if nr == 1 {
        "one run".to_string()
    } else {
        format!("{nr} runs")
    };
    let mut rows = vec![
        Row::new(
            format!("p15 demo: requests failed or cut, of {n} over {runs_s}, other than those in flight on a killed server or node"),
            fs.iter().map(|f| f.other).sum::<usize>() as f64,
            "requests",
        )
        .predicted("0"),
        Row::new(
            format!("p15 demo: requests cut in flight on a killed server or node, of {n} over {runs_s}"),
            fs.iter().map(|f| f.at_kill).sum::<usize>() as f64,
            "requests",
        )
        .predicted("the streams the victims held (no mid-stream resume)"),
        Row::new(
            format!(
                "p15 demo: requests of a 1P1D deployment failed or cut with its decode worker SIGKILLed under 4 streaming clients, of {} over {runs_s}",
                runs.iter().map(|r| r.split.len()).sum::<usize>()
            ),
            runs.iter()
                .flat_map(|r| &r.split)
                .filter(|r| !r.ok)
                .count() as f64,
            "requests",
        )
        .predicted("0 (the proxy moves each stream on to the replacement)"),
        Row::new(
            format!("p15 demo: flaps of the desired count under steady load (two steady windows), over {runs_s}"),
            fs.iter().map(|f| f.flaps).sum::<usize>() as f64,
            "flaps",
        )
        .predicted("0"),
        Row::new(
            format!("p15 demo: TTFT within {} s, fraction of {}", a.slo_ttft_s, ttft.len()),
            within as f64 / ttft.len().max(1) as f64,
            "fraction",
        ),
        Row::new(format!("p15 demo: TTFT, p50 of {}", ttft.len()), pct(&ttft, 50.0), "s"),
        Row::new(format!("p15 demo: TTFT, p99 of {}", ttft.len()), pct(&ttft, 99.0), "s"),
    ];
    let ratios = fs
        .iter()
        .map(|f| f.replica_seconds / f.ideal.max(1e-9))
        .collect();
    rows.extend(rows_of(
        "p15 demo: replica-seconds, ratio to the ideal ceil(clients / target)",
        ratios,
        "x",
        "1.15 (target <= 1.3)",
    ));
    rows.extend(Row::median_p95(
        format!("p15 demo: cold start, spawn to ready, of {}", cold.len()),
        pct(&cold, 50.0),
        pct(&cold, 95.0),
        "s",
        "about 1 s (native weights)",
    ));
    for (k, metric, pred) in EVENTS {
        let v: Vec<f64> = runs
            .iter()
            .filter_map(|r| r.marks.get(k).copied())
            .collect();
        rows.extend(rows_of(&format!("p15 demo: {metric}"), v, "s", pred));
    }
    let ms: Vec<_> = runs.iter().map(matrix).collect();
    for (key, what, pause) in CELLS {
        let cells: Vec<&Cell> = ms.iter().filter_map(|m| m.get(key)).collect();
        let sum = |f: fn(&Cell) -> usize| cells.iter().map(|c| f(c)).sum::<usize>() as f64;
        let name = format!("p15 fault matrix: {what}");
        rows.push(Row::new(
            format!("{name}: requests in flight, over {runs_s}"),
            sum(|c| c.requests),
            "requests",
        ));
        rows.push(Row::new(format!("{name}: lost"), sum(|c| c.lost), "requests").predicted("0"));
        rows.push(
            Row::new(
                format!("{name}: answers other than the unfaulted answer"),
                sum(|c| c.changed),
                "requests",
            )
            .predicted("0"),
        );
        let pauses = cells.iter().map(|c| c.pause).collect();
        rows.extend(rows_of(
            &format!("{name}: longest wait for a token in flight"),
            pauses,
            "s",
            pause,
        ));
    }
    crate::measure::append(&rows, "")
}

/// The last run's plots: replicas against load, TTFT p99 per 5 s.
pub fn plot(a: &DemoArgs, run: &Run) -> anyhow::Result<()> {
    let (samples, records) = (&run.samples, &run.records);
    let pts = |f: &dyn Fn(&super::Sample) -> Option<f64>| -> Vec<(f64, f64)> {
        samples.iter().filter_map(|s| Some((s.t, f(s)?))).collect()
    };
    let series = vec![
        Series::new(
            "offered load: clients / target",
            pts(&|s| Some(s.clients as f64 / TARGET)),
        ),
        Series::new("desired (autoscaler)", pts(&|s| s.desired)),
        Series::new("servers running", pts(&|s| Some(s.running as f64))),
        Series::new("ready (routed to)", pts(&|s| Some(s.ready as f64))),
    ];
    let path = a.plots.join("demo.png");
    line_chart(
        &path,
        Labels {
            title: "p15 demo: replicas against load",
            x: "time (s)",
            y: "replicas",
        },
        &series,
        Scale::Linear,
    )?;
    // TTFT p99 per 5 s of request starts.
    let mut by: BTreeMap<i64, Vec<f64>> = BTreeMap::new();
    for r in records {
        if let Some(t) = r.ttft {
            by.entry((r.start / 5.0).floor() as i64)
                .or_default()
                .push(t);
        }
    }
    let p99: Vec<(f64, f64)> = by
        .into_iter()
        .map(|(k, mut v)| {
            v.sort_by(f64::total_cmp);
            (k as f64 * 5.0 + 2.5, percentile_sorted(&v, 99.0))
        })
        .collect();
    let path2 = a.plots.join("demo_ttft.png");
    line_chart(
        &path2,
        Labels {
            title: "p15 demo: TTFT p99 per 5 s",
            x: "time (s)",
            y: "seconds",
        },
        &[Series::new("TTFT p99", p99)],
        Scale::Linear,
    )?;
    println!("plots: {} {}", path.display(), path2.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(prompt: &str, start: f64, end: f64, ok: bool, text: &str, gap: f64) -> Record {
        Record {
            prompt: prompt.into(),
            start,
            end,
            ok,
            text: text.into(),
            max_gap: gap,
            ..Record::default()
        }
    }

    /// A cell counts what was in flight at its fault: lost, changed
    /// against the answer before the first fault, and the longest wait.
    #[test]
    fn a_cell_counts_the_requests_in_flight_at_its_fault() {
        let run = Run {
            records: vec![
                rec("a", 0.0, 1.0, true, " one", 0.1), // before: the reference
                rec("a", 4.0, 6.0, true, " one", 0.9), // in flight, equal
                rec("a", 4.5, 5.5, true, " two", 0.2), // in flight, changed
                rec("a", 4.8, 5.1, false, " o", 0.3),  // in flight, lost
                rec("a", 6.0, 7.0, false, "", 0.0),    // after: not counted
            ],
            split: vec![
                rec("a", 9.0, 11.0, true, " one more", 0.5), // longer: agrees
                rec("a", 9.5, 10.5, true, " on", 0.4),       // shorter: changed
            ],
            faults: vec![("server", 5.0), ("decode", 10.0)],
            ..Run::default()
        };
        let m = matrix(&run);
        let want = Cell {
            requests: 3,
            lost: 1,
            changed: 1,
            pause: 0.9,
        };
        assert_eq!(m["server"], want);
        let want = Cell {
            requests: 2,
            lost: 0,
            changed: 1,
            pause: 0.5,
        };
        assert_eq!(m["decode"], want);
    }
}

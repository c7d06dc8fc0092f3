//! `scale-bench`'s figures: a table per trial, plots of replicas against
//! the ideal per profile (the last round), rows over all rounds.

use common::numbers::Row;
use common::plot::{line_chart, Labels, Scale, Series};

use super::{Profile, ScaleBenchArgs, System, Trial, MIN, TARGET};
use crate::measure::{flaps, pct, replica_seconds, rows_of, sorted};

/// One trial's figures.
#[derive(Clone, Debug)]
pub struct Figures {
    pub requests: usize,
    pub failed: usize,
    /// Served whole with TTFT within the SLO.
    pub attained: usize,
    pub replica_seconds: f64,
    pub ideal: f64,
    /// The step to one more replica serving than at the step.
    pub reaction: Option<f64>,
    pub flaps: usize,
}

pub fn figures(t: &Trial, slo: f64) -> Figures {
    let (actual, ideal) = replica_seconds(&t.samples, TARGET, MIN);
    let reaction = t.profile.step_at().and_then(|at| {
        let before = t.samples.iter().rfind(|s| s.t <= at).map_or(0, |s| s.ready);
        t.samples
            .iter()
            .find(|s| s.t >= at && s.ready > before)
            .map(|s| s.t - at)
    });
    Figures {
        requests: t.records.len(),
        failed: t.records.iter().filter(|r| !r.ok).count(),
        attained: t
            .records
            .iter()
            .filter(|r| r.ok && r.ttft.is_some_and(|x| x <= slo))
            .count(),
        replica_seconds: actual,
        ideal,
        reaction,
        flaps: flaps(&t.samples, &t.profile.steady(), |s| Some(s.running as f64)),
    }
}

fn ttfts<'a>(ts: impl Iterator<Item = &'a Trial>) -> Vec<f64> {
    sorted(
        ts.flat_map(|t| t.records.iter().filter_map(|r| r.ttft))
            .collect(),
    )
}

pub fn print(a: &ScaleBenchArgs, t: &Trial) {
    let f = figures(t, a.slo_ttft_s);
    let ttft = ttfts(std::iter::once(t));
    println!(
        "  {} {}: {} requests, {} failed; TTFT p50 {:.3} s p99 {:.3} s; SLO attainment {:.1}%, \
         goodput {:.2}/s; replica-seconds {:.0} over {:.0} s (ideal {:.0}, {:.2}x); reaction {}; \
         flaps {}",
        t.system.name(),
        t.profile.name(),
        f.requests,
        f.failed,
        pct(&ttft, 50.0),
        pct(&ttft, 99.0),
        100.0 * f.attained as f64 / f.requests.max(1) as f64,
        f.attained as f64 / t.profile.end(),
        f.replica_seconds,
        t.end,
        f.ideal,
        f.replica_seconds / f.ideal.max(1e-9),
        f.reaction.map_or("none".into(), |r| format!("{r:.1} s")),
        f.flaps
    );
    // Why requests failed, the commonest first (at most three reasons).
    let mut why: Vec<(usize, &str)> = Vec::new();
    for r in t.records.iter().filter(|r| !r.ok) {
        match why.iter_mut().find(|(_, e)| *e == r.error) {
            Some((n, _)) => *n += 1,
            None => why.push((1, &r.error)),
        }
    }
    why.sort_by_key(|w| std::cmp::Reverse(w.0));
    for (n, e) in why.iter().take(3) {
        println!("  failed x{n}: {e}");
    }
    // The replica count's changes: "t:running(ready)".
    let mut changes = Vec::new();
    let mut last = None;
    for s in &t.samples {
        if last != Some((s.running, s.ready)) {
            changes.push(format!("{:.1}:{}({})", s.t, s.running, s.ready));
            last = Some((s.running, s.ready));
        }
    }
    println!(
        "  replicas running(ready) from t s on: {}",
        changes.join(" ")
    );
}

/// Each profile's replicas against the ideal, for the last round's
/// trials: `plots/scale_<profile>.png`.
pub fn plot(a: &ScaleBenchArgs, trials: &[Trial]) -> anyhow::Result<()> {
    let mut profiles: Vec<Profile> = trials.iter().map(|t| t.profile).collect();
    profiles.dedup();
    for p in profiles {
        let last: Vec<&Trial> = {
            let mut v: Vec<&Trial> = Vec::new();
            for t in trials.iter().rev().filter(|t| t.profile == p) {
                if !v.iter().any(|u| u.system == t.system) {
                    v.push(t);
                }
            }
            v.reverse();
            v
        };
        let ideal: Vec<(f64, f64)> = (0..=(p.end() * 2.0) as usize)
            .map(|i| {
                let t = i as f64 / 2.0;
                (t, (p.clients_at(t) as f64 / TARGET).ceil().max(MIN as f64))
            })
            .collect();
        let mut series = vec![Series::new("ideal max(1, ceil(clients / 2))", ideal)];
        for t in &last {
            let pts = t.samples.iter().map(|s| (s.t, s.running as f64)).collect();
            series.push(Series::new(
                format!("{}: replicas running", t.system.name()),
                pts,
            ));
        }
        std::fs::create_dir_all(&a.plots)?;
        // A run of fewer systems than all three draws its own file, so
        // that it does not replace the comparison's plot.
        let mut systems: Vec<&str> = last.iter().map(|t| t.system.name()).collect();
        systems.sort_unstable();
        let name = match systems[..] {
            ["kpa", "ray-default", "ray-ours"] => format!("scale_{}.png", p.name()),
            _ => format!("scale_{}_{}.png", p.name(), systems.join("_")),
        };
        let path = a.plots.join(name);
        line_chart(
            &path,
            Labels {
                title: &format!("p15 scale-bench: replicas under a {}", p.describe()),
                x: "time (s)",
                y: "replicas",
            },
            &series,
            Scale::Linear,
        )?;
        println!("plot: {}", path.display());
    }
    Ok(())
}

/// What was predicted for each system (written before the first run).
fn predicted(s: System, p: Profile, what: &str) -> &'static str {
    use super::RayConfig::*;
    match (s, p, what) {
        (System::Kpa, _, "attain") => "the highest of the three",
        (System::Ray(Default), Profile::Step, "attain") => {
            "the lowest: 1 replica for 8 clients ~40 s"
        }
        (System::Ray(Ours), _, "attain") => "near kpa's, less the Python proxy's cost",
        (System::Kpa, Profile::Step, "ratio") => "1.2",
        (System::Ray(Default), Profile::Step, "ratio") => "0.9 (late up, never down)",
        (System::Ray(Ours), Profile::Step, "ratio") => "1.15",
        (System::Kpa, Profile::Step, "reaction") => "about 2 s (target: 4 s + a cold start)",
        (System::Ray(Default), Profile::Step, "reaction") => "35-45 s (30 s delay + 10 s metrics)",
        (System::Ray(Ours), Profile::Step, "reaction") => "about 5 s",
        (_, _, "flaps") => "0",
        _ => "",
    }
}

/// Rows for every (profile, system), pooled over the rounds.
pub fn record(a: &ScaleBenchArgs, trials: &[Trial]) -> anyhow::Result<()> {
    let mut keys: Vec<(Profile, System)> = Vec::new();
    for t in trials {
        if !keys.contains(&(t.profile, t.system)) {
            keys.push((t.profile, t.system));
        }
    }
    let slo = a.slo_ttft_s;
    let mut rows = Vec::new();
    for (p, s) in keys {
        let mine: Vec<&Trial> = trials
            .iter()
            .filter(|t| t.profile == p && t.system == s)
            .collect();
        let fs: Vec<Figures> = mine.iter().map(|t| figures(t, slo)).collect();
        let n: usize = fs.iter().map(|f| f.requests).sum();
        let attained: usize = fs.iter().map(|f| f.attained).sum();
        let ttft = ttfts(mine.iter().copied());
        let k = mine.len();
        let m = format!(
            "p15 scale, {}, 1..4 replicas, target 2, {}",
            p.describe(),
            s.name()
        );
        let whole = format!("whole run of {k} x {:.0} s", p.end());
        rows.push(
            Row::new(
                format!("{m}: SLO attainment (whole stream, TTFT <= {slo} s), fraction of {n}"),
                attained as f64 / n.max(1) as f64,
                "fraction",
            )
            .predicted(predicted(s, p, "attain")),
        );
        rows.push(Row::new(
            format!("{m}: goodput (TTFT <= {slo} s), {whole}"),
            attained as f64 / (k as f64 * p.end()),
            "req/s",
        ));
        rows.push(Row::new(
            format!("{m}: TTFT, p50 of {}", ttft.len()),
            pct(&ttft, 50.0),
            "s",
        ));
        rows.push(Row::new(
            format!("{m}: TTFT, p99 of {}", ttft.len()),
            pct(&ttft, 99.0),
            "s",
        ));
        rows.push(
            Row::new(
                format!("{m}: requests failed, of {n}"),
                fs.iter().map(|f| f.failed).sum::<usize>() as f64,
                "requests",
            )
            .predicted("0"),
        );
        // Past the window, replica-seconds are counted until the system
        // is back at one replica: the rows say so.
        let until = match a.settle_s > 0.0 {
            true => format!(
                ", until back at 1 replica (at most {:.0} s more)",
                a.settle_s
            ),
            false => String::new(),
        };
        rows.extend(rows_of(
            &format!("{m}: replica-seconds{until}"),
            fs.iter().map(|f| f.replica_seconds).collect(),
            "replica-s",
            "",
        ));
        rows.extend(rows_of(
            &format!("{m}: replica-seconds{until}, ratio to the ideal max(1, ceil(clients / 2))"),
            fs.iter()
                .map(|f| f.replica_seconds / f.ideal.max(1e-9))
                .collect(),
            "x",
            predicted(s, p, "ratio"),
        ));
        if p.step_at().is_some() {
            rows.extend(rows_of(
                &format!(
                    "{m}: the step to one more replica serving (none: {:.0} s)",
                    p.end()
                ),
                fs.iter().map(|f| f.reaction.unwrap_or(p.end())).collect(),
                "s",
                predicted(s, p, "reaction"),
            ));
        }
        rows.push(
            Row::new(
                format!("{m}: flaps under steady load, over {k} runs"),
                fs.iter().map(|f| f.flaps).sum::<usize>() as f64,
                "flaps",
            )
            .predicted(predicted(s, p, "flaps")),
        );
    }
    crate::measure::append(&rows, ", one thread per server")
}

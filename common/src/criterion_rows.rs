//! `cargo bench` into numbers.md: after criterion has run, read what it
//! wrote for each benchmark (`target/criterion/<id>/new/`) and append rows
//! for it, so micro-benchmarks follow the same rule as the bench commands.
//!
//! Per benchmark, three rows:
//! - the median and the p95 of the per-iteration time over criterion's
//!   samples (each sample is `times[i] / iters[i]`), computed here with the
//!   same percentile rule as every other row;
//! - criterion's own bootstrap estimate of the median, with its 95%
//!   confidence interval, named as criterion's.
//!
//! A bench's `main` calls [`record_cargo_bench`] after its groups have run;
//! it records nothing unless cargo ran it as a benchmark (`--bench`), so
//! `cargo test --benches` (criterion's quick test mode) leaves numbers.md
//! alone.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde_json::Value;

use crate::numbers::{Recorder, Row};
use crate::stats::percentile_sorted;

/// What criterion measured for one benchmark, in seconds per iteration.
#[derive(Clone, Debug, PartialEq)]
pub struct CriterionResult {
    /// e.g. `linear_784x256/naive/1`.
    pub id: String,
    /// Per-iteration seconds, one per sample, sorted.
    pub sample_s: Vec<f64>,
    /// Criterion's bootstrap estimate of the median: (point, lower, upper), s.
    pub median_estimate_s: (f64, f64, f64),
}

impl CriterionResult {
    pub fn median_s(&self) -> f64 {
        percentile_sorted(&self.sample_s, 50.0)
    }

    pub fn p95_s(&self) -> f64 {
        percentile_sorted(&self.sample_s, 95.0)
    }

    /// The rows numbers.md gets for it (see the module docs).
    pub fn rows(&self) -> Vec<Row> {
        let (scale, unit) = time_unit(self.median_s());
        let (m, lo, hi) = self.median_estimate_s;
        vec![
            Row::new(
                format!(
                    "{}: time per iteration, median of {} samples",
                    self.id,
                    self.sample_s.len()
                ),
                self.median_s() * scale,
                unit,
            ),
            Row::new(
                format!(
                    "{}: time per iteration, p95 of {} samples",
                    self.id,
                    self.sample_s.len()
                ),
                self.p95_s() * scale,
                unit,
            ),
            Row::new(
                format!(
                    "{}: criterion's median estimate (95% CI {:.4}-{:.4} {unit})",
                    self.id,
                    lo * scale,
                    hi * scale
                ),
                m * scale,
                unit,
            ),
        ]
    }
}

/// Seconds to a readable unit: (multiplier, name).
fn time_unit(s: f64) -> (f64, &'static str) {
    if s >= 1.0 {
        (1.0, "s")
    } else if s >= 1e-3 {
        (1e3, "ms")
    } else if s >= 1e-6 {
        (1e6, "us")
    } else {
        (1e9, "ns")
    }
}

/// Criterion's output folder: `$CRITERION_HOME`, else
/// `$CARGO_TARGET_DIR/criterion`, else the workspace's `target/criterion`.
pub fn criterion_dir() -> PathBuf {
    if let Some(home) = std::env::var_os("CRITERION_HOME") {
        return PathBuf::from(home);
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::assets::workspace_root().join("target"));
    target.join("criterion")
}

/// Every benchmark under `dir` whose results were written at or after
/// `since` (this run's), sorted by id. Folders criterion did not write
/// (or half-written ones) are skipped.
pub fn read_results(dir: &Path, since: SystemTime) -> Vec<CriterionResult> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if !p.is_dir() {
                continue;
            }
            let bench = p.join("new").join("benchmark.json");
            let fresh = std::fs::metadata(&bench)
                .and_then(|m| m.modified())
                .is_ok_and(|t| t >= since);
            if fresh {
                if let Some(r) = read_one(&p.join("new")) {
                    found.push(r);
                }
            }
            if p.file_name()
                .is_some_and(|n| n != "new" && n != "base" && n != "report")
            {
                stack.push(p);
            }
        }
    }
    found.sort_by(|a, b| a.id.cmp(&b.id));
    found
}

fn read_json(p: &Path) -> Option<Value> {
    serde_json::from_str(&std::fs::read_to_string(p).ok()?).ok()
}

fn read_one(new: &Path) -> Option<CriterionResult> {
    let bench = read_json(&new.join("benchmark.json"))?;
    let est = read_json(&new.join("estimates.json"))?;
    let sample = read_json(&new.join("sample.json"))?;
    let id = bench["full_id"].as_str()?.to_string();
    let nums =
        |v: &Value| -> Option<Vec<f64>> { v.as_array()?.iter().map(Value::as_f64).collect() };
    let (iters, times) = (nums(&sample["iters"])?, nums(&sample["times"])?);
    if iters.len() != times.len() || iters.is_empty() {
        return None;
    }
    // Criterion's times are nanoseconds per sample of `iters` iterations.
    let mut sample_s: Vec<f64> = times
        .iter()
        .zip(&iters)
        .filter(|(_, &n)| n > 0.0)
        .map(|(t, n)| t / n * 1e-9)
        .collect();
    sample_s.sort_by(f64::total_cmp);
    let med = &est["median"];
    let ci = &med["confidence_interval"];
    let median_estimate_s = (
        med["point_estimate"].as_f64()? * 1e-9,
        ci["lower_bound"].as_f64()? * 1e-9,
        ci["upper_bound"].as_f64()? * 1e-9,
    );
    (!sample_s.is_empty()).then_some(CriterionResult {
        id,
        sample_s,
        median_estimate_s,
    })
}

/// Append rows for every benchmark this run wrote, if cargo ran this binary
/// as a benchmark (`cargo bench -p CRATE`); prints what it appended.
pub fn record_cargo_bench(crate_name: &str, since: SystemTime) {
    let args: Vec<String> = std::env::args().collect();
    if !args.iter().any(|a| a == "--bench") || args.iter().any(|a| a == "--list") {
        return;
    }
    let results = read_results(&criterion_dir(), since);
    if results.is_empty() {
        eprintln!(
            "numbers.md: no criterion results from this run under {}",
            criterion_dir().display()
        );
        return;
    }
    let filter: Vec<&String> = args
        .iter()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let command = std::iter::once(format!("cargo bench -p {crate_name}"))
        .chain(filter.iter().map(|f| format!("-- {f}")))
        .collect::<Vec<_>>()
        .join(" ");
    let rows: Vec<Row> = results.iter().flat_map(CriterionResult::rows).collect();
    let rec = Recorder::for_workspace(command);
    match rec.append(&rows) {
        Ok(()) => println!(
            "numbers.md: {} rows from {} benchmarks",
            rows.len(),
            results.len()
        ),
        Err(e) => eprintln!("numbers.md: could not append: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A folder laid out as criterion writes it; the numbers are made up
    /// for the parser, not measurements.
    #[test]
    fn reads_samples_and_the_median_estimate() {
        let root = std::env::temp_dir().join(format!("common-criterion-{}", std::process::id()));
        let new = root.join("grp").join("f").join("7").join("new");
        std::fs::create_dir_all(&new).unwrap();
        let since = SystemTime::now() - std::time::Duration::from_secs(5);
        std::fs::write(
            new.join("benchmark.json"),
            r#"{"group_id":"grp","function_id":"f","value_str":"7","full_id":"grp/f/7","directory_name":"grp/f/7"}"#,
        )
        .unwrap();
        std::fs::write(
            new.join("sample.json"),
            r#"{"sampling_mode":"Linear","iters":[1.0,2.0,4.0,0.0],"times":[3000.0,4000.0,40000.0,5.0]}"#,
        )
        .unwrap();
        std::fs::write(
            new.join("estimates.json"),
            r#"{"median":{"confidence_interval":{"confidence_level":0.95,"lower_bound":1900.0,"upper_bound":3100.0},"point_estimate":2500.0,"standard_error":1.0}}"#,
        )
        .unwrap();
        // A stale benchmark from an earlier run is not reported.
        let old = root.join("grp").join("old").join("new");
        std::fs::create_dir_all(&old).unwrap();
        let r = read_results(&root, since);
        assert_eq!(r.len(), 1, "{r:?}");
        let r = &r[0];
        assert_eq!(r.id, "grp/f/7");
        // Per-iteration: 3 us, 2 us, 10 us (the 0-iteration sample dropped).
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.abs().max(1e-6);
        assert_eq!(r.sample_s.len(), 3);
        for (got, want) in r.sample_s.iter().zip([2e-6, 3e-6, 10e-6]) {
            assert!(close(*got, want), "{:?}", r.sample_s);
        }
        assert!(close(r.median_s(), 3e-6));
        assert!(r.p95_s() > 9e-6 && r.p95_s() <= 10e-6, "{}", r.p95_s());
        let rows = r.rows();
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[0].unit, "us");
        assert!((rows[0].value - 3.0).abs() < 1e-9, "{}", rows[0].value);
        assert!(rows[2]
            .metric
            .contains("criterion's median estimate (95% CI 1.9000-3.1000 us)"));
        assert!((rows[2].value - 2.5).abs() < 1e-9);
        assert!(read_results(
            &root,
            SystemTime::now() + std::time::Duration::from_secs(60)
        )
        .is_empty());
        std::fs::remove_dir_all(&root).ok();
    }
}

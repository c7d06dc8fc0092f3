//! The `numbers.md` recorder: bench commands append one table row per metric,
//! stamped with the date, the machine (from /proc/cpuinfo), the git commit and
//! the command that produced it. Rows are never typed by hand.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

const HEADER: &str =
    "| date (UTC) | machine | commit | command | metric | value | unit | prediction |\n\
|---|---|---|---|---|---|---|---|\n";

/// One measured figure.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    pub metric: String,
    pub value: f64,
    pub unit: String,
    /// What was predicted before measuring (free text, may be empty).
    pub prediction: String,
}

impl Row {
    pub fn new(metric: impl Into<String>, value: f64, unit: impl Into<String>) -> Self {
        Self {
            metric: metric.into(),
            value,
            unit: unit.into(),
            prediction: String::new(),
        }
    }

    pub fn predicted(mut self, prediction: impl Into<String>) -> Self {
        self.prediction = prediction.into();
        self
    }

    /// A timing as the two rows the measurement rule asks for:
    /// "<metric>, median" and "<metric>, p95" (never one of them alone).
    /// `prediction` goes on the median row.
    pub fn median_p95(
        metric: impl AsRef<str>,
        median: f64,
        p95: f64,
        unit: &str,
        prediction: impl Into<String>,
    ) -> [Row; 2] {
        let m = metric.as_ref();
        [
            Row::new(format!("{m}, median"), median, unit).predicted(prediction),
            Row::new(format!("{m}, p95"), p95, unit),
        ]
    }

    /// A rate (`work` per second, e.g. tokens or FLOPs) from repeated
    /// timings: the rate at the median time and at the p95 time (the slow
    /// tail, so the lower rate), as two rows.
    pub fn rate_median_p95(
        metric: impl AsRef<str>,
        work: f64,
        seconds: &crate::stats::Summary,
        unit: &str,
        prediction: impl Into<String>,
    ) -> [Row; 2] {
        let m = metric.as_ref();
        [
            Row::new(format!("{m}, at median time"), work / seconds.median, unit)
                .predicted(prediction),
            Row::new(format!("{m}, at p95 time"), work / seconds.p95, unit),
        ]
    }

    /// Rates measured directly (one per run, e.g. tok/s of each run): their
    /// median and their 5th percentile (the slow tail of a rate, the
    /// counterpart of a time's p95), as two rows.
    pub fn rates_median_p5(
        metric: impl AsRef<str>,
        rates: &[f64],
        unit: &str,
        prediction: impl Into<String>,
    ) -> [Row; 2] {
        let mut r = rates.to_vec();
        r.sort_by(f64::total_cmp);
        let m = metric.as_ref();
        [
            Row::new(
                format!("{m}, median of {}", r.len()),
                crate::stats::percentile_sorted(&r, 50.0),
                unit,
            )
            .predicted(prediction),
            Row::new(
                format!("{m}, p5 of {} (slow tail)", r.len()),
                crate::stats::percentile_sorted(&r, 5.0),
                unit,
            ),
        ]
    }
}

/// Appends rows for one command run.
#[derive(Clone, Debug)]
pub struct Recorder {
    path: PathBuf,
    date: String,
    machine: String,
    commit: String,
    command: String,
}

impl Recorder {
    /// A recorder writing to `path`, for `command` (what the user typed).
    pub fn new(path: PathBuf, command: impl Into<String>) -> Self {
        let root = path.parent().map(Path::to_path_buf).unwrap_or_default();
        Self {
            path,
            date: utc_date_time(),
            machine: machine_description(),
            commit: git_commit(&root),
            command: command.into(),
        }
    }

    /// Add to the machine column (e.g. which kernel path ran).
    pub fn machine_note(mut self, note: &str) -> Self {
        self.machine = format!("{}, {note}", self.machine);
        self
    }

    /// Name the commit the rows measure, for rows made where the tree has
    /// no git (the GPU machine gets binaries built here, at this commit).
    pub fn with_commit(mut self, commit: impl Into<String>) -> Self {
        self.commit = commit.into();
        self
    }

    /// The workspace's `numbers.md`.
    pub fn for_workspace(command: impl Into<String>) -> Self {
        Self::new(crate::assets::workspace_root().join("numbers.md"), command)
    }

    /// Format rows as markdown table lines (no header).
    pub fn format(&self, rows: &[Row]) -> String {
        let mut s = String::new();
        for r in rows {
            let _ = writeln!(
                s,
                "| {} | {} | {} | `{}` | {} | {} | {} | {} |",
                self.date,
                cell(&self.machine),
                self.commit,
                self.command.replace('`', "'"),
                cell(&r.metric),
                format_value(r.value),
                cell(&r.unit),
                cell(&r.prediction)
            );
        }
        s
    }

    /// Append rows, writing the table header first if the file has none.
    /// Refuses (and writes nothing) when a timing row does not say which
    /// statistic it is (see [`statistic_problem`]).
    pub fn append(&self, rows: &[Row]) -> std::io::Result<()> {
        let bad: Vec<String> = rows
            .iter()
            .filter_map(|r| statistic_problem(r).map(|why| format!("`{}` ({why})", r.metric)))
            .collect();
        if !bad.is_empty() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "numbers.md takes no timing row without its statistic; nothing was written. Rows: {}",
                    bad.join("; ")
                ),
            ));
        }
        let existing = std::fs::read_to_string(&self.path).unwrap_or_default();
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)?;
        if !existing.contains("| date (UTC) | machine |") {
            if existing.is_empty() {
                f.write_all(b"# numbers\n\nEvery row below was appended by a bench command; none is typed by hand.\n\n")?;
            } else if !existing.ends_with("\n\n") {
                f.write_all(b"\n")?;
            }
            f.write_all(HEADER.as_bytes())?;
        }
        f.write_all(self.format(rows).as_bytes())
    }
}

/// Units of a time, or of work per unit of time: rows in these units are
/// timings, and a timing must say which statistic of its samples it is.
const TIMING_UNITS: [&str; 15] = [
    "s", "ms", "us", "µs", "ns", "ms/token", "tok/s", "req/s", "GB/s", "MB/s", "GFLOP/s",
    "TFLOP/s", "FLOP/s", "GMAC/s", "GiB/s",
];

/// What a timing row's metric may say it is: a statistic of several
/// samples (median, p95, ...), a ceiling (best of N), a fit or a model, a
/// ratio or difference of medians, an extreme (maximum, minimum), a
/// prediction, or a figure of the whole run (requests completed over its
/// wall time).
const STATISTICS: [&str; 20] = [
    "median",
    "p95",
    "p99",
    "p90",
    "p50",
    "p5 of",
    "mean",
    "best of",
    "fit",
    "model",
    "ratio",
    "difference",
    "slope",
    "intercept",
    "whole run",
    "one run",
    "at p95 time",
    "maximum",
    "minimum",
    "predicted",
];

/// Whether `phrase` occurs in `text` as whole words ("ratio" in "ratio of
/// medians", not in "generation").
fn contains_words(text: &str, phrase: &str) -> bool {
    let word = |c: Option<char>| c.is_some_and(char::is_alphanumeric);
    text.match_indices(phrase).any(|(i, _)| {
        !word(text[..i].chars().next_back()) && !word(text[i + phrase.len()..].chars().next())
    })
}

/// Fewest samples a median or a percentile may be taken over.
pub const MIN_SAMPLES: usize = 5;

/// Why `row` may not be recorded, if it may not: a timing (its unit is a
/// time or a rate) whose metric names no statistic, or a median or
/// percentile "of N" samples with N below [`MIN_SAMPLES`].
pub fn statistic_problem(row: &Row) -> Option<String> {
    if !TIMING_UNITS.contains(&row.unit.as_str()) {
        return None;
    }
    let m = row.metric.to_lowercase();
    if !STATISTICS.iter().any(|s| contains_words(&m, s)) {
        return Some(format!(
            "a timing in {} that names no statistic: say median, p95, best of N, whole run, ratio of medians, ...",
            row.unit
        ));
    }
    // "median of 3", "p5 of 3 (slow tail)", "p95 of 4": too few samples.
    for stat in ["median of ", "p5 of ", "p95 of ", "p99 of ", "p50 of "] {
        let mut rest = m.as_str();
        while let Some(i) = rest.find(stat) {
            rest = &rest[i + stat.len()..];
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            if let Ok(n) = digits.parse::<usize>() {
                if n < MIN_SAMPLES {
                    return Some(format!(
                        "a {}over {n} samples; take at least {MIN_SAMPLES}",
                        stat.trim_end_matches("of ")
                    ));
                }
            }
        }
    }
    None
}

fn cell(s: &str) -> String {
    s.replace('|', "/").replace('\n', " ")
}

fn format_value(v: f64) -> String {
    if v == 0.0 || (1e-3..1e7).contains(&v.abs()) {
        let s = format!("{v:.4}");
        let s = s.trim_end_matches('0').trim_end_matches('.');
        s.to_string()
    } else {
        format!("{v:.4e}")
    }
}

/// The command a user typed, for numbers.md: `cargo run --release -p CRATE -- ARGS`.
pub fn command_line(crate_name: &str) -> String {
    std::iter::once(format!("cargo run --release -p {crate_name} --"))
        .chain(std::env::args().skip(1))
        .collect::<Vec<_>>()
        .join(" ")
}

/// "YYYY-MM-DD HH:MM" in UTC, from the system clock.
pub fn utc_date_time() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (y, m, d) = civil_from_days((secs / 86_400) as i64);
    let rem = secs % 86_400;
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}",
        rem / 3600,
        (rem % 3600) / 60
    )
}

/// Days since 1970-01-01 to (year, month, day) in the proleptic Gregorian
/// calendar (Howard Hinnant's algorithm).
pub fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// CPU model and logical CPU count, e.g. "AMD EPYC, 2 CPUs".
pub fn machine_description() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = info
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim() == "model name").then(|| v.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let simd = crate::assets::simd_description();
    format!("{model}, {cpus} CPUs, {simd}")
}

/// Short commit hash, with "-dirty" when tracked files other than bench
/// outputs have changes.
pub fn git_commit(dir: &Path) -> String {
    let run = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(dir)
            .output()
            .ok()
            .filter(|o| o.status.success())
    };
    let Some(out) = run(&["rev-parse", "--short=10", "HEAD"]) else {
        return "unknown".into();
    };
    let hash = String::from_utf8_lossy(&out.stdout).trim().to_string();
    // Bench outputs (numbers.md, plots) do not make the code dirty.
    let dirty = run(&[
        "status",
        "--porcelain",
        "--untracked-files=no",
        "--",
        ".",
        ":!numbers.md",
        ":!*/plots/*",
    ])
    .map(|o| !o.stdout.is_empty())
    .unwrap_or(false);
    if dirty {
        format!("{hash}-dirty")
    } else {
        hash
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(20_786), (2026, 11, 29));
    }

    #[test]
    fn timings_come_as_median_and_p95() {
        let [m, p] = Row::median_p95("step", 10.0, 12.5, "ms", "~10 ms");
        assert_eq!(
            (m.metric.as_str(), m.value, m.prediction.as_str()),
            ("step, median", 10.0, "~10 ms")
        );
        assert_eq!(
            (p.metric.as_str(), p.value, p.prediction.as_str()),
            ("step, p95", 12.5, "")
        );
        let s = crate::stats::summarize(&[0.5, 0.25, 1.0]);
        let [m, p] = Row::rate_median_p95("decode", 100.0, &s, "tok/s", "");
        assert_eq!(
            (m.metric.as_str(), m.value),
            ("decode, at median time", 200.0)
        );
        assert!(
            p.metric.ends_with("at p95 time") && p.value > 100.0 && p.value < 200.0,
            "{p:?}"
        );
        let [m, p] = Row::rates_median_p5("tok/s", &[30.0, 10.0, 20.0, 50.0, 40.0], "tok/s", "");
        assert_eq!((m.metric.as_str(), m.value), ("tok/s, median of 5", 30.0));
        assert_eq!(p.metric, "tok/s, p5 of 5 (slow tail)");
        assert!((p.value - 12.0).abs() < 1e-9, "{}", p.value);
    }

    #[test]
    fn a_timing_without_its_statistic_is_refused_and_nothing_is_written() {
        let dir = std::env::temp_dir().join(format!("common-numbers-stat-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("numbers.md");
        std::fs::remove_file(&p).ok();
        let r = Recorder::new(p.clone(), "cargo run -p x -- bench");
        // Not timings: any name will do.
        assert_eq!(statistic_problem(&Row::new("hit rate", 90.0, "%")), None);
        assert_eq!(
            statistic_problem(&Row::new("agreement", 12.0, "tokens")),
            None
        );
        // Timings that say what they are.
        for m in [
            "step, median",
            "step, p95",
            "peak FMA (best of 3)",
            "decode, at median time",
            "requests over the whole run",
            "TTFT p99",
            "tok/s, median of 5",
        ] {
            assert_eq!(statistic_problem(&Row::new(m, 1.0, "ms")), None, "{m}");
        }
        // A bare timing (a statistic's name inside a word does not count),
        // and a median of too few samples.
        let inside = Row::new("naive generation", 12.0, "tok/s");
        assert!(statistic_problem(&inside).is_some());
        let bare = Row::new("p04 forward seq=16", 4.0, "ms");
        assert!(statistic_problem(&bare)
            .unwrap()
            .contains("names no statistic"));
        let [few, tail] = Row::rates_median_p5("decode", &[1.0, 2.0, 3.0], "tok/s", "");
        assert!(statistic_problem(&few).unwrap().contains("over 3 samples"));
        assert!(statistic_problem(&tail).unwrap().contains("over 3 samples"));
        // A batch with one bad row writes nothing at all.
        let good = Row::new("step, median", 1.0, "ms");
        let err = r.append(&[good.clone(), bare]).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
        assert!(err.to_string().contains("p04 forward seq=16"), "{err}");
        assert!(
            !p.exists(),
            "a refused batch must not create or touch the file"
        );
        r.append(&[good]).unwrap();
        assert!(std::fs::read_to_string(&p)
            .unwrap()
            .contains("| step, median | 1 | ms |"));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn appends_header_once_then_rows() {
        let dir = std::env::temp_dir().join(format!("common-numbers-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("numbers.md");
        std::fs::remove_file(&p).ok();
        let r = Recorder::new(p.clone(), "cargo run -p x -- bench");
        r.append(&[Row::new("latency b=1, median", 41.5, "us").predicted("~40 us")])
            .unwrap();
        r.append(&[Row::new("a|b, best of 5", 1.0e9, "FLOP/s")])
            .unwrap();
        let s = std::fs::read_to_string(&p).unwrap();
        assert_eq!(s.matches("| date (UTC) |").count(), 1, "{s}");
        assert!(
            s.contains("| latency b=1, median | 41.5 | us | ~40 us |"),
            "{s}"
        );
        assert!(s.contains("| a/b, best of 5 | 1.0000e9 | FLOP/s |"), "{s}");
        std::fs::remove_dir_all(&dir).ok();
    }
}

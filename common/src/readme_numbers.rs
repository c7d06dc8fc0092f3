//! README figures rendered from `numbers.md`, never typed. A README marks
//! a block
//!
//! ```text
//! <!-- numbers: command="bench-seam" metric="p10 seam; p10 decode step" -->
//! (rendered: the run's date, commit, command and machine, then a table)
//! <!-- /numbers -->
//! ```
//!
//! and `cargo run -p common --bin numbers -- render` rewrites what is
//! between the markers from the rows whose command contains `command` and
//! whose metric contains one of the `;`-separated `metric` parts: the
//! newest run from a clean tree by default, or the run at `commit` (a
//! prefix) when the block names one. `numbers -- check` (and the workspace
//! test `common/tests/readme_numbers.rs`) fails when a block differs from
//! what `numbers.md` renders, or selects no run.

use thiserror::Error;

/// One row of `numbers.md`, its cells as written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NumRow {
    pub date: String,
    pub machine: String,
    pub commit: String,
    pub command: String,
    pub metric: String,
    pub value: String,
    pub unit: String,
    pub prediction: String,
}

/// Every data row of a `numbers.md` text (header and separator lines, and
/// lines that are not 8-cell rows, are skipped).
pub fn parse_numbers(text: &str) -> Vec<NumRow> {
    text.lines()
        .filter_map(|l| {
            let inner = l.strip_prefix("| ")?.strip_suffix(" |")?;
            let c: Vec<&str> = inner.split(" | ").collect();
            if c.len() != 8 || c[0] == "date (UTC)" || c[0].starts_with("---") {
                return None;
            }
            Some(NumRow {
                date: c[0].to_string(),
                machine: c[1].to_string(),
                commit: c[2].to_string(),
                command: c[3].trim_matches('`').to_string(),
                metric: c[4].to_string(),
                value: c[5].to_string(),
                unit: c[6].to_string(),
                prediction: c[7].to_string(),
            })
        })
        .collect()
}

#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum RenderError {
    #[error("line {line}: a `<!-- numbers: ... -->` block without its `<!-- /numbers -->`")]
    Unclosed { line: usize },
    #[error("line {line}: cannot read the block's settings `{spec}` (want key=\"value\" pairs: command, metric, optional commit)")]
    Spec { line: usize, spec: String },
    #[error("line {line}: no run in numbers.md has rows for command ~ {command:?}, metric ~ {metric:?}{}", commit.as_ref().map(|c| format!(", commit {c}")).unwrap_or_default())]
    NoRun {
        line: usize,
        command: String,
        metric: String,
        commit: Option<String>,
    },
}

/// What a block selects.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Spec {
    command: String,
    metrics: Vec<String>,
    commit: Option<String>,
}

const OPEN: &str = "<!-- numbers:";
const CLOSE: &str = "<!-- /numbers -->";

fn parse_spec(s: &str, line: usize) -> Result<Spec, RenderError> {
    let bad = || RenderError::Spec {
        line,
        spec: s.to_string(),
    };
    let (mut command, mut metric, mut commit) = (None, None, None);
    let mut rest = s.trim();
    while !rest.is_empty() {
        let (key, after) = rest.split_once("=\"").ok_or_else(bad)?;
        let (value, tail) = after.split_once('"').ok_or_else(bad)?;
        match key.trim() {
            "command" => command = Some(value.to_string()),
            "metric" => metric = Some(value.to_string()),
            "commit" => commit = Some(value.to_string()),
            _ => return Err(bad()),
        }
        rest = tail.trim_start();
    }
    let metrics: Vec<String> = metric
        .ok_or_else(bad)?
        .split(';')
        .map(|m| m.trim().to_string())
        .filter(|m| !m.is_empty())
        .collect();
    if metrics.is_empty() {
        return Err(bad());
    }
    Ok(Spec {
        command: command.ok_or_else(bad)?,
        metrics,
        commit,
    })
}

/// The block's body: the chosen run's rows as a table.
fn render_block(spec: &Spec, rows: &[NumRow], line: usize) -> Result<String, RenderError> {
    let wanted = |r: &NumRow| {
        r.command.contains(&spec.command) && spec.metrics.iter().any(|m| r.metric.contains(m))
    };
    let run_ok = |r: &NumRow| match &spec.commit {
        Some(c) => r.commit.starts_with(c.as_str()),
        None => !r.commit.ends_with("-dirty"),
    };
    // A run: one command invocation (its date, commit and command).
    let newest = rows
        .iter()
        .filter(|r| wanted(r) && run_ok(r))
        .max_by(|a, b| a.date.cmp(&b.date))
        .ok_or_else(|| RenderError::NoRun {
            line,
            command: spec.command.clone(),
            metric: spec.metrics.join("; "),
            commit: spec.commit.clone(),
        })?;
    let same_run = |r: &&NumRow| {
        r.date == newest.date && r.commit == newest.commit && r.command == newest.command
    };
    let mut out = format!(
        "Rendered from `numbers.md`: the run of {} at {} (`{}`; {}).\n\n| metric | value | unit |\n|---|---|---|\n",
        newest.date, newest.commit, newest.command, newest.machine
    );
    for r in rows.iter().filter(|r| wanted(r)).filter(same_run) {
        out.push_str(&format!("| {} | {} | {} |\n", r.metric, r.value, r.unit));
    }
    Ok(out)
}

/// `text` with every block re-rendered from `rows`.
pub fn render_file(text: &str, rows: &[NumRow]) -> Result<String, RenderError> {
    let mut out = String::with_capacity(text.len());
    let mut lines = text.split_inclusive('\n').enumerate();
    while let Some((i, l)) = lines.next() {
        out.push_str(l);
        let Some(spec) = l.trim().strip_prefix(OPEN) else {
            continue;
        };
        let spec = spec
            .trim()
            .strip_suffix("-->")
            .ok_or_else(|| RenderError::Spec {
                line: i + 1,
                spec: spec.to_string(),
            })?;
        let spec = parse_spec(spec, i + 1)?;
        out.push_str(&render_block(&spec, rows, i + 1)?);
        // Skip the old body up to the closing marker, and keep the marker.
        loop {
            match lines.next() {
                Some((_, c)) if c.trim() == CLOSE => {
                    out.push_str(c);
                    break;
                }
                Some(_) => {}
                None => return Err(RenderError::Unclosed { line: i + 1 }),
            }
        }
    }
    Ok(out)
}

/// The workspace's READMEs: the root's, `RESULTS.md`, and each crate's.
pub fn readme_files(root: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut files: Vec<std::path::PathBuf> = ["README.md", "RESULTS.md"]
        .iter()
        .map(|f| root.join(f))
        .collect();
    if let Ok(dirs) = std::fs::read_dir(root) {
        let mut crates: Vec<_> = dirs
            .flatten()
            .map(|d| d.path().join("README.md"))
            .filter(|p| {
                p.parent()
                    .and_then(|d| d.join("Cargo.toml").exists().then_some(()))
                    .is_some()
            })
            .collect();
        crates.sort();
        files.extend(crates);
    }
    files.retain(|f| f.exists());
    files
}

/// Each README whose blocks differ from what `numbers.md` renders (with
/// the reason), after writing the rendered text when `write` is set.
pub fn render_workspace(root: &std::path::Path, write: bool) -> std::io::Result<Vec<String>> {
    let rows = parse_numbers(&std::fs::read_to_string(root.join("numbers.md"))?);
    let mut stale = Vec::new();
    for f in readme_files(root) {
        let text = std::fs::read_to_string(&f)?;
        match render_file(&text, &rows) {
            Ok(new) if new == text => {}
            Ok(new) if write => std::fs::write(&f, new)?,
            Ok(_) => stale.push(format!(
                "{}: a numbers block differs from numbers.md",
                f.display()
            )),
            Err(e) => stale.push(format!("{}: {e}", f.display())),
        }
    }
    Ok(stale)
}

#[cfg(test)]
mod tests {
    use super::*;

    const NUMBERS: &str = "\
| date (UTC) | machine | commit | command | metric | value | unit | prediction |
|---|---|---|---|---|---|---|---|
| 2026-12-01 10:00 | m | aaa1111 | `cargo run -p x -- bench` | x step, median | 1.5 | ms |  |
| 2026-12-02 10:00 | m | bbb2222-dirty | `cargo run -p x -- bench` | x step, median | 9.9 | ms |  |
| 2026-12-02 11:00 | m | ccc3333 | `cargo run -p x -- bench` | x step, median | 1.4 | ms | ~1.5 |
| 2026-12-02 11:00 | m | ccc3333 | `cargo run -p x -- bench` | x other | 7 | % |  |
";

    #[test]
    fn a_block_renders_the_newest_clean_run_or_the_pinned_one() {
        let rows = parse_numbers(NUMBERS);
        assert_eq!(rows.len(), 4);
        let readme =
            "a\n<!-- numbers: command=\"-p x\" metric=\"x step\" -->\nold\n<!-- /numbers -->\nb\n";
        let got = render_file(readme, &rows).unwrap();
        assert!(got.contains("at ccc3333"), "{got}");
        assert!(got.contains("| x step, median | 1.4 | ms |"), "{got}");
        assert!(!got.contains("x other") && !got.contains("old") && !got.contains("9.9"));
        assert!(got.starts_with("a\n") && got.ends_with("<!-- /numbers -->\nb\n"));
        assert_eq!(
            render_file(&got, &rows).unwrap(),
            got,
            "rendering is idempotent"
        );
        let pinned = readme.replace("metric=", "commit=\"aaa\" metric=");
        assert!(render_file(&pinned, &rows)
            .unwrap()
            .contains("| 1.5 | ms |"));
    }

    #[test]
    fn a_block_without_a_run_or_an_end_is_an_error() {
        let rows = parse_numbers(NUMBERS);
        let none = "<!-- numbers: command=\"-p y\" metric=\"x\" -->\n<!-- /numbers -->\n";
        assert!(matches!(
            render_file(none, &rows),
            Err(RenderError::NoRun { line: 1, .. })
        ));
        let open = "<!-- numbers: command=\"-p x\" metric=\"x\" -->\nbody\n";
        assert_eq!(
            render_file(open, &rows),
            Err(RenderError::Unclosed { line: 1 })
        );
        let bad = "<!-- numbers: command=-p metric=\"x\" -->\n<!-- /numbers -->\n";
        assert!(matches!(
            render_file(bad, &rows),
            Err(RenderError::Spec { .. })
        ));
    }
}

//! The controller's live page: replicas (desired, running, ready) against
//! the offered load, the servers' TTFT p50 and p99, and each node's
//! servers, drawn on the server as SVG (plotters) and refreshed every two
//! seconds.
//!
//! TTFT comes from the servers' own histograms ([`crate::ttft`]).

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write;

use plotters::prelude::*;

use crate::state::Snapshot;

/// One second of one deployment.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Point {
    pub t: f64,
    pub desired: f64,
    pub running: f64,
    pub ready: f64,
    /// The autoscaler's metric over the target: the replicas the load asks for.
    pub load: f64,
    pub ttft_p50: Option<f64>,
    pub ttft_p99: Option<f64>,
}

/// One line of a chart: its legend, colour and value at each point.
struct Line {
    label: &'static str,
    color: RGBColor,
    value: fn(&Point) -> Option<f64>,
}

/// One chart of `lines` over the history `h` into `area`.
fn chart<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    caption: &str,
    y: &str,
    h: &VecDeque<Point>,
    lines: &[Line],
) {
    let t0 = h.front().map_or(0.0, |p| p.t);
    let t1 = h.back().map_or(1.0, |p| p.t).max(t0 + 1.0);
    let ymax = h
        .iter()
        .flat_map(|p| lines.iter().filter_map(move |l| (l.value)(p)))
        .fold(0.1f64, f64::max)
        * 1.15;
    let Ok(mut c) = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 18))
        .margin(8)
        .x_label_area_size(28)
        .y_label_area_size(40)
        .build_cartesian_2d(t0..t1, 0.0..ymax)
    else {
        return;
    };
    let _ = c.configure_mesh().x_desc("time (s)").y_desc(y).draw();
    for l in lines {
        let color = l.color;
        let pts = h.iter().filter_map(|p| Some((p.t, (l.value)(p)?)));
        if let Ok(s) = c.draw_series(LineSeries::new(pts, color.stroke_width(2))) {
            s.label(l.label).legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2))
            });
        }
    }
    let _ = c
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw();
}

/// The deployment's history as one SVG: replicas above, TTFT below.
pub fn svg(name: &str, h: &VecDeque<Point>) -> String {
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (900, 560)).into_drawing_area();
        let _ = root.fill(&WHITE);
        let (top, bottom) = root.split_vertically(300);
        let replicas = [
            Line {
                label: "load / target",
                color: RGBColor(127, 127, 127),
                value: |p| Some(p.load),
            },
            Line {
                label: "desired",
                color: RGBColor(31, 119, 180),
                value: |p| Some(p.desired),
            },
            Line {
                label: "running",
                color: RGBColor(255, 127, 14),
                value: |p| Some(p.running),
            },
            Line {
                label: "ready",
                color: RGBColor(44, 160, 44),
                value: |p| Some(p.ready),
            },
        ];
        chart(
            &top,
            &format!("{name}: replicas and offered load"),
            "replicas",
            h,
            &replicas,
        );
        let ttft = [
            Line {
                label: "p50",
                color: RGBColor(148, 103, 189),
                value: |p| p.ttft_p50,
            },
            Line {
                label: "p99",
                color: RGBColor(214, 39, 40),
                value: |p| p.ttft_p99,
            },
        ];
        chart(
            &bottom,
            &format!("{name}: TTFT at the servers, last 10 s"),
            "seconds",
            h,
            &ttft,
        );
        let _ = root.present();
    }
    out
}

/// A screenshot of `url` by Debian's headless Chromium, into `png`,
/// within a minute.
pub fn screenshot(url: &str, png: &std::path::Path, size: (u32, u32)) -> anyhow::Result<()> {
    use anyhow::Context;
    let bin = ["/usr/bin/chromium", "/usr/bin/chromium-browser"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .context("no chromium: install it with `apt-get install -y chromium`")?;
    let mut child = std::process::Command::new(bin)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
        ])
        .arg(format!("--window-size={},{}", size.0, size.1))
        .arg(format!("--screenshot={}", png.display()))
        .arg(url)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .context("starting chromium")?;
    let t0 = std::time::Instant::now();
    loop {
        if let Some(status) = child.try_wait()? {
            anyhow::ensure!(
                status.success() && png.exists(),
                "chromium failed ({status}) on {url}"
            );
            return Ok(());
        }
        if t0.elapsed() > std::time::Duration::from_secs(60) {
            let _ = child.kill();
            let _ = child.wait();
            anyhow::bail!("chromium took over 60 s on {url}");
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The history `h` as JSON safe inside a `<script>` element.
fn data(h: &VecDeque<Point>) -> String {
    serde_json::to_string(h)
        .unwrap_or_else(|_| "[]".into())
        .replace("</", "<\\/")
}

/// The series the page plots for `deployment`, read back from `page`
/// (`None` when the page has no such deployment).
pub fn page_data(page: &str, deployment: &str) -> Option<Vec<Point>> {
    let open = format!(
        "<script type=\"application/json\" id=\"data-{}\">",
        esc(deployment)
    );
    let rest = &page[page.find(&open)? + open.len()..];
    serde_json::from_str(&rest[..rest.find("</script>")?]).ok()
}

/// The page: each deployment's plots, and each node's servers.
pub fn html(
    controller: &str,
    leader: bool,
    history: &BTreeMap<String, VecDeque<Point>>,
    snap: Option<&Snapshot>,
) -> String {
    let mut o = String::new();
    let _ = write!(
        o,
        "<!doctype html><html><head><meta charset=\"utf-8\"><meta http-equiv=\"refresh\" content=\"2\">\
         <title>inference-lab platform</title><style>body{{font-family:sans-serif;margin:16px}}\
         table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:2px 8px}}</style></head><body>\
         <h1>inference-lab platform</h1><p>controller {} ({})</p>",
        esc(controller),
        if leader { "leader" } else { "standby: figures come from the leader" }
    );
    for (name, h) in history {
        let last = h.back().cloned().unwrap_or_default();
        let _ = write!(
            o,
            "<h2>{}</h2><p>desired {} &middot; running {} &middot; ready {} &middot; load {:.2} replicas</p><div class=\"plot\">{}</div>",
            esc(name),
            last.desired,
            last.running,
            last.ready,
            last.load,
            svg(name, h)
        );
        // The plotted series as data, for scripts and tests to read.
        let _ = write!(
            o,
            "<script type=\"application/json\" id=\"data-{}\">{}</script>",
            esc(name),
            data(h)
        );
    }
    if let Some(s) = snap {
        let _ = write!(o, "<h2>nodes</h2>");
        for n in &s.nodes {
            let _ = write!(o, "<h3>{} (capacity {}, {})</h3><table><tr><th>server</th><th>deployment</th><th>phase</th><th>cold start</th><th>URL</th></tr>", esc(&n.id), n.capacity, esc(&n.host));
            for a in s.assignments.iter().filter(|a| a.node == n.id) {
                let (phase, cold, url) = s.shown(a);
                let _ = write!(
                    o,
                    "<tr><td>{}</td><td>{}</td><td>{phase}</td><td>{cold}</td><td>{}</td></tr>",
                    esc(&a.id),
                    esc(&a.deployment),
                    esc(&url)
                );
            }
            let _ = write!(o, "</table>");
        }
    }
    o.push_str("</body></html>");
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_draws_both_plots_and_lists_servers() {
        let mut h = VecDeque::new();
        for t in 0..5 {
            h.push_back(Point {
                t: t as f64,
                desired: 1.0,
                running: 1.0,
                ready: 1.0,
                load: 0.5,
                ttft_p50: Some(0.1),
                ttft_p99: Some(0.2),
            });
        }
        let hist = BTreeMap::from([("smollm2".to_string(), h)]);
        let page = html("c1", true, &hist, None);
        assert_eq!(page.matches("<svg").count(), 1);
        assert!(page.contains("TTFT at the servers") && page.contains("replicas and offered load"));
        assert!(page.matches("<polyline").count() >= 6, "six lines drawn");
        assert_eq!(
            page_data(&page, "smollm2").as_ref(),
            hist.get("smollm2")
                .map(|h| h.iter().cloned().collect::<Vec<_>>())
                .as_ref()
        );
        assert_eq!(page_data(&page, "other"), None);
    }
}

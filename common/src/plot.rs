//! Line and log-log charts to PNG, on `plotters`. A logarithmic axis gets
//! ticks at 1, 2 and 5 of each decade (decades alone when the axis spans
//! many), labelled in plain numbers; a series may carry a spread (each
//! point's median to p95, say) drawn as a bar.

use std::path::Path;

use plotters::prelude::*;
use thiserror::Error;

/// Why a chart was not written.
#[derive(Debug, Error)]
pub enum PlotError {
    #[error("plot {path}: no finite points to draw")]
    Empty { path: std::path::PathBuf },
    #[error("plot {path}: {source}")]
    Io {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    /// The drawing backend's own error, as text (its type is generic over
    /// the backend and not `Send`).
    #[error("plot {path}: {msg}")]
    Draw {
        path: std::path::PathBuf,
        msg: String,
    },
}

/// One named line of (x, y) points.
#[derive(Clone, Debug)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
    /// (x, low, high): a vertical bar per point, e.g. from the median to
    /// the p95 of its samples. Empty: no bars.
    pub spread: Vec<(f64, f64, f64)>,
}

impl Series {
    pub fn new(name: impl Into<String>, points: Vec<(f64, f64)>) -> Self {
        Self {
            name: name.into(),
            points,
            spread: Vec::new(),
        }
    }

    /// Draw a bar from `low` to `high` at each `x` (the series' colour).
    pub fn with_spread(mut self, spread: Vec<(f64, f64, f64)>) -> Self {
        self.spread = spread;
        self
    }
}

/// Tick values for a logarithmic axis over [lo, hi]: 1, 2 and 5 of each
/// decade; 1 to 9 when that gives fewer than four; decades alone (every
/// other, then every third, ...) when it gives more than twelve.
pub fn log_ticks(lo: f64, hi: f64) -> Vec<f64> {
    if !(lo > 0.0 && hi > lo && lo.is_finite() && hi.is_finite()) {
        return Vec::new();
    }
    let (d0, d1) = (lo.log10().floor() as i32, hi.log10().ceil() as i32);
    let within = |mults: &[f64], step: i32| -> Vec<f64> {
        (d0..=d1)
            .filter(|d| (d - d0) % step == 0)
            .flat_map(|d| mults.iter().map(move |m| m * 10f64.powi(d)))
            .filter(|v| *v >= lo * (1.0 - 1e-9) && *v <= hi * (1.0 + 1e-9))
            .collect()
    };
    let t = within(&[1.0, 2.0, 5.0], 1);
    if t.len() < 4 {
        return within(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0], 1);
    }
    if t.len() <= 12 {
        return t;
    }
    let mut step = 1;
    loop {
        let t = within(&[1.0], step);
        if t.len() <= 12 {
            return t;
        }
        step += 1;
    }
}

/// A tick label in plain digits: 0.002, 0.5, 20, 5000, 2e6 (exponent form
/// only past a million or under a thousandth).
pub fn tick_label(v: f64) -> String {
    let a = v.abs();
    if v == 0.0 {
        "0".into()
    } else if !(1e-3..1e6).contains(&a) {
        format!("{v:.0e}")
    } else {
        let s = format!("{v:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

/// Axis scales.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scale {
    Linear,
    /// Both axes logarithmic; points with x <= 0 or y <= 0 are dropped.
    LogLog,
    /// Logarithmic x, linear y.
    LogX,
}

/// A chart's title and axis labels.
#[derive(Clone, Copy, Debug)]
pub struct Labels<'a> {
    pub title: &'a str,
    pub x: &'a str,
    pub y: &'a str,
}

/// Twelve distinguishable colours (matplotlib's tab10 plus two), so a chart
/// of a dozen series never repeats one.
const COLORS: [RGBColor; 12] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
    RGBColor(0, 0, 0),
    RGBColor(255, 215, 0),
];

fn bounds(series: &[Series], scale: Scale) -> Option<((f64, f64), (f64, f64))> {
    let pts = series
        .iter()
        .flat_map(|s| s.points.iter())
        .filter(|(x, y)| {
            x.is_finite()
                && y.is_finite()
                && match scale {
                    Scale::Linear => true,
                    Scale::LogLog => *x > 0.0 && *y > 0.0,
                    Scale::LogX => *x > 0.0,
                }
        });
    let mut b: Option<((f64, f64), (f64, f64))> = None;
    for &(x, y) in pts {
        let ((x0, x1), (y0, y1)) = b.unwrap_or(((x, x), (y, y)));
        b = Some(((x0.min(x), x1.max(x)), (y0.min(y), y1.max(y))));
    }
    b.map(|((x0, x1), (y0, y1))| {
        let pad = |lo: f64, hi: f64, log: bool| {
            if log {
                (lo / 1.3, hi * 1.3)
            } else {
                let span = (hi - lo).max(hi.abs() * 1e-3).max(1e-12);
                (
                    (lo - 0.05 * span).min(if lo >= 0.0 { 0.0 } else { lo }),
                    hi + 0.05 * span,
                )
            }
        };
        let xlog = scale != Scale::Linear;
        (pad(x0, x1, xlog), pad(y0, y1, scale == Scale::LogLog))
    })
}

/// Draw `series` as lines with point markers into a PNG at `path`.
pub fn line_chart(
    path: &Path,
    labels: Labels<'_>,
    series: &[Series],
    scale: Scale,
) -> Result<(), PlotError> {
    let err = |e: &dyn std::fmt::Display| PlotError::Draw {
        path: path.to_path_buf(),
        msg: e.to_string(),
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|source| PlotError::Io {
            path: path.to_path_buf(),
            source,
        })?;
    }
    let ((x0, x1), (y0, y1)) = bounds(series, scale).ok_or_else(|| PlotError::Empty {
        path: path.to_path_buf(),
    })?;
    let root = BitMapBackend::new(path, (900, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;

    // One generic body for the three coordinate kinds.
    let fmt = |v: &f64| tick_label(*v);
    macro_rules! draw {
        ($xr:expr, $yr:expr) => {{
            let mut chart = ChartBuilder::on(&root)
                .caption(labels.title, ("sans-serif", 24))
                .margin(15)
                .x_label_area_size(45)
                .y_label_area_size(70)
                .build_cartesian_2d($xr, $yr)
                .map_err(|e| err(&e))?;
            chart
                .configure_mesh()
                .x_desc(labels.x)
                .y_desc(labels.y)
                .x_label_formatter(&fmt)
                .y_label_formatter(&fmt)
                .label_style(("sans-serif", 15))
                .draw()
                .map_err(|e| err(&e))?;
            for (i, s) in series.iter().enumerate() {
                let c = COLORS[i % COLORS.len()];
                let pts: Vec<(f64, f64)> = s
                    .points
                    .iter()
                    .copied()
                    .filter(|&(x, y)| x >= x0 && y >= y0 && x.is_finite() && y.is_finite())
                    .collect();
                chart
                    .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
                    .map_err(|e| err(&e))?
                    .label(s.name.as_str())
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
                    });
                chart
                    .draw_series(pts.iter().map(|&p| Circle::new(p, 3, c.filled())))
                    .map_err(|e| err(&e))?;
                // A ring around each point of every series after the
                // first, a size per series, so a point that two series
                // share shows both (not on dense series: a CDF's hundreds
                // of points would become a smear).
                if i > 0 && pts.len() <= 40 {
                    let r = 4 + 2 * ((i - 1) % 4) as i32;
                    chart
                        .draw_series(
                            pts.into_iter()
                                .map(|p| Circle::new(p, r, c.stroke_width(2))),
                        )
                        .map_err(|e| err(&e))?;
                }
                let bars = s.spread.iter().filter(|&&(x, lo, hi)| {
                    x >= x0 && lo >= y0 && [x, lo, hi].iter().all(|v| v.is_finite())
                });
                chart
                    .draw_series(bars.map(|&(x, lo, hi)| {
                        PathElement::new(vec![(x, lo), (x, hi)], c.stroke_width(1))
                    }))
                    .map_err(|e| err(&e))?;
            }
            chart
                .configure_series_labels()
                .label_font(("sans-serif", 16))
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .position(SeriesLabelPosition::UpperLeft)
                .draw()
                .map_err(|e| err(&e))?;
        }};
    }
    let (xt, yt) = (log_ticks(x0, x1), log_ticks(y0, y1));
    match scale {
        Scale::Linear => draw!(x0..x1, y0..y1),
        Scale::LogLog => draw!(
            (x0..x1).log_scale().with_key_points(xt),
            (y0..y1).log_scale().with_key_points(yt)
        ),
        Scale::LogX => draw!((x0..x1).log_scale().with_key_points(xt), y0..y1),
    }
    root.present().map_err(|e| err(&e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_png_and_rejects_empty() {
        let dir = std::env::temp_dir().join(format!("common-plot-{}", std::process::id()));
        let p = dir.join("chart.png");
        let s = vec![
            Series::new("a", vec![(1.0, 10.0), (2.0, 20.0), (1024.0, 5e4)])
                .with_spread(vec![(2.0, 20.0, 30.0)]),
            Series::new(
                "naive_ijk, pjqy",
                vec![(1.0, 3.0), (1024.0, 4e4), (2.0, 20.0)],
            ),
        ];
        let labels = Labels {
            title: "t",
            x: "batch",
            y: "images/s",
        };
        line_chart(&p, labels, &s, Scale::LogLog).unwrap();
        let bytes = std::fs::read(&p).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
        assert!(matches!(
            line_chart(&p, labels, &[], Scale::Linear),
            Err(PlotError::Empty { .. })
        ));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn log_ticks_label_every_decade_and_more_when_few() {
        // Three decades: 1, 2, 5 of each (the p07 step plot's 20..2000 ms).
        assert_eq!(
            log_ticks(20.0, 2000.0),
            vec![20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0]
        );
        // Under a decade: 1..9.
        assert_eq!(log_ticks(2.5, 9.5), vec![3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]);
        // Many decades: decades only, at most twelve.
        let t = log_ticks(1e-3, 1e9);
        assert!(t.len() <= 12 && t.len() >= 6, "{t:?}");
        assert!(t
            .iter()
            .all(|v| (v.log10() - v.log10().round()).abs() < 1e-9));
        assert!(log_ticks(0.0, 10.0).is_empty());
        assert_eq!(tick_label(0.5), "0.5");
        assert_eq!(tick_label(2000.0), "2000");
        assert_eq!(tick_label(0.002), "0.002");
        assert_eq!(tick_label(2e6), "2e6");
    }
}

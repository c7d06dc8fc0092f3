//! The roofline: attainable FLOP/s = min(peak compute, intensity x memory
//! bandwidth), drawn from the *measured* ceilings of this run (best GEMM per
//! precision, best HBM copy at sizes beyond L2), with every measured kernel
//! placed at its intensity.

use std::path::Path;

use common::plot::{line_chart, Labels, PlotError, Scale, Series};
use serde::Serialize;

/// The roofs.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct Roofline {
    /// Bytes per second from HBM (measured copy, arrays far beyond L2).
    pub memory_bps: f64,
    /// Peak FLOP/s per named compute roof ("fp32 (cuBLAS best)", ...).
    pub compute: Vec<(String, f64)>,
}

/// A kernel placed on it.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct Point {
    pub name: String,
    /// FLOPs per byte of minimum HBM traffic.
    pub intensity: f64,
    pub flops: f64,
}

impl Roofline {
    /// The attainable FLOP/s at `intensity` under the roof named `roof`.
    pub fn attainable(&self, intensity: f64, roof: usize) -> f64 {
        (intensity * self.memory_bps).min(self.compute[roof].1)
    }

    /// Where the bandwidth slope meets roof `roof`: kernels left of it are
    /// memory-bound.
    pub fn ridge(&self, roof: usize) -> f64 {
        self.compute[roof].1 / self.memory_bps
    }

    /// `p`'s FLOP/s as a fraction of what the roof allows at its intensity.
    pub fn efficiency(&self, p: &Point, roof: usize) -> f64 {
        p.flops / self.attainable(p.intensity, roof)
    }

    /// Draw roofs and points, log-log, GFLOP/s against FLOP/byte.
    pub fn plot(&self, points: &[Point], path: &Path, title: &str) -> Result<(), PlotError> {
        let lo = points.iter().map(|p| p.intensity).fold(0.05f64, f64::min) / 2.0;
        let hi = points.iter().map(|p| p.intensity).fold(1e4f64, f64::max) * 2.0;
        let mut series = Vec::new();
        for (i, (name, peak)) in self.compute.iter().enumerate() {
            let ridge = self.ridge(i);
            series.push(Series::new(
                format!(
                    "roof: {name} {:.1} TFLOP/s, HBM {:.2} TB/s",
                    peak / 1e12,
                    self.memory_bps / 1e12
                ),
                vec![
                    (lo, lo * self.memory_bps / 1e9),
                    (ridge, peak / 1e9),
                    (hi, peak / 1e9),
                ],
            ));
        }
        for p in points {
            series.push(Series::new(
                p.name.clone(),
                vec![(p.intensity, p.flops / 1e9)],
            ));
        }
        line_chart(
            path,
            Labels {
                title,
                x: "arithmetic intensity (FLOP per byte of HBM traffic)",
                y: "GFLOP/s",
            },
            &series,
            Scale::LogLog,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h200ish() -> Roofline {
        Roofline {
            memory_bps: 4.0e12,
            compute: vec![("fp32".into(), 50e12), ("bf16".into(), 700e12)],
        }
    }

    #[test]
    fn the_roof_is_the_lower_of_bandwidth_and_peak() {
        let r = h200ish();
        assert_eq!(r.ridge(0), 12.5);
        assert_eq!(r.attainable(1.0, 0), 4.0e12);
        assert_eq!(r.attainable(1000.0, 0), 50e12);
        // Vector add: 1 FLOP per 12 bytes, at 3.6 TB/s = 0.3 TFLOP/s = 90%.
        let add = Point {
            name: "add".into(),
            intensity: 1.0 / 12.0,
            flops: 3.6e12 / 12.0,
        };
        assert!((r.efficiency(&add, 0) - 0.9).abs() < 1e-12);
    }

    #[test]
    fn the_plot_is_written() {
        let dir = std::env::temp_dir().join(format!("p11-roofline-{}", std::process::id()));
        let path = dir.join("roofline.png");
        let pts = [Point {
            name: "k".into(),
            intensity: 2.0,
            flops: 1e12,
        }];
        h200ish().plot(&pts, &path, "test").unwrap();
        assert!(std::fs::metadata(&path).unwrap().len() > 1000);
        std::fs::remove_dir_all(dir).unwrap();
    }
}

//! The suite's outputs: suite.json (everything), the rows numbers.md
//! keeps, and the four plots, which `p11_gpu_bench plot` can redraw from
//! suite.json on a machine with fonts.

use std::path::Path;

use common::numbers::{Recorder, Row};
use common::plot::{line_chart, Labels, Scale, Series};
use serde::{Deserialize, Serialize};

use crate::gemm::{GemmPoint, Precision};
use crate::memory::{BandwidthPoint, Kernel, Transfer, TransferPoint};
use crate::roofline::{Point, Roofline};
use crate::spread::Spread;
use crate::suite::SuiteArgs;

/// Everything measured, as written to suite.json.
#[derive(Debug, Serialize, Deserialize)]
pub struct Report {
    pub device: String,
    pub l2_bytes: i32,
    pub launch_back_to_back_s: f64,
    pub launch_synced_s: f64,
    pub hbm: Vec<BandwidthPoint>,
    pub transfers: Vec<TransferPoint>,
    pub gemm: Vec<GemmPoint>,
    pub kernels: Vec<Point>,
    pub roofline: Roofline,
    pub spread: Vec<Spread>,
}

/// suite.json, then the rows, then the plots (a machine without fonts loses
/// the pictures, which `p11_gpu_bench plot` redraws from suite.json, not the
/// measurements).
pub(crate) fn write_outputs(args: &SuiteArgs, r: &Report, points: &[Point]) -> anyhow::Result<()> {
    std::fs::create_dir_all(&args.out)?;
    let saved = Saved { report: r, points };
    std::fs::write(
        args.out.join("suite.json"),
        serde_json::to_string_pretty(&saved)?,
    )?;
    if let Some(path) = &args.rows {
        let mut rec = Recorder::new(path.clone(), &args.command).machine_note(&r.device);
        if let Some(c) = &args.commit {
            rec = rec.with_commit(c);
        }
        rec.append(&rows(r, points))?;
    }
    if let Err(e) = plot(r, points, &args.out.join("plots")) {
        eprintln!("warning: {e}");
    }
    Ok(())
}

/// What suite.json holds: the report and the roofline's points.
#[derive(Debug, Serialize)]
struct Saved<'a> {
    report: &'a Report,
    points: &'a [Point],
}

/// Redraw the plots from a suite.json (`p11_gpu_bench plot --from DIR`).
pub fn replot(dir: &Path, plots: &Path) -> anyhow::Result<()> {
    #[derive(Deserialize)]
    struct Loaded {
        report: Report,
        points: Vec<Point>,
    }
    let path = dir.join("suite.json");
    let text =
        std::fs::read_to_string(&path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    let l: Loaded =
        serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    plot(&l.report, &l.points, plots)
}

/// The four plots: bandwidth vs size, transfers, skinny GEMM, roofline.
pub fn plot(r: &Report, points: &[Point], plots: &Path) -> anyhow::Result<()> {
    let name = r.device.split(',').next().unwrap_or("GPU");

    let hbm: Vec<Series> = Kernel::ALL
        .iter()
        .map(|&k| {
            Series::new(
                k.label(),
                r.hbm
                    .iter()
                    .filter(|p| p.kernel == k)
                    .map(|p| (p.array_bytes as f64 / (1 << 20) as f64, p.median_bps / 1e9))
                    .collect(),
            )
        })
        .collect();
    let title = format!(
        "{name}: bandwidth vs array size (L2 {} MiB)",
        r.l2_bytes >> 20
    );
    line_chart(
        &plots.join("hbm.png"),
        Labels {
            title: &title,
            x: "MiB per array",
            y: "GB/s (bytes read + written)",
        },
        &hbm,
        Scale::LogX,
    )?;

    let tr: Vec<Series> = Transfer::ALL
        .iter()
        .map(|&k| {
            Series::new(
                k.label(),
                r.transfers
                    .iter()
                    .filter(|p| p.kind == k)
                    .map(|p| (p.bytes as f64 / 1024.0, p.median_bps / 1e9))
                    .collect(),
            )
        })
        .collect();
    let title = format!("{name}: host <-> device copies");
    line_chart(
        &plots.join("transfers.png"),
        Labels {
            title: &title,
            x: "KiB",
            y: "GB/s (host-timed, copy + sync)",
        },
        &tr,
        Scale::LogLog,
    )?;

    let skinny: Vec<Series> = Precision::ALL
        .iter()
        .map(|&p| {
            Series::new(
                format!("cuBLAS {}", p.label()),
                r.gemm
                    .iter()
                    .filter(|g| g.precision == p && g.shape.m != g.shape.n)
                    .map(|g| (g.shape.m as f64, g.median_bps / 1e9))
                    .collect(),
            )
        })
        .collect();
    let title = format!("{name}: decode-like GEMM (M x 4096 x 4096)");
    line_chart(
        &plots.join("gemm_skinny.png"),
        Labels {
            title: &title,
            x: "M (rows of activations)",
            y: "GB/s of minimum traffic",
        },
        &skinny,
        Scale::LogX,
    )?;

    r.roofline.plot(
        points,
        &plots.join("roofline.png"),
        &format!("{name}: roofline from this run's ceilings"),
    )?;
    Ok(())
}

/// The rows numbers.md keeps (suite.json has every point).
fn rows(r: &Report, points: &[Point]) -> Vec<Row> {
    let mut rows = vec![
        Row::new(
            "empty kernel launch, back to back, median",
            r.launch_back_to_back_s,
            "s",
        )
        .predicted("~2.5e-6"),
        Row::new(
            "empty kernel launch + synchronise, median",
            r.launch_synced_s,
            "s",
        )
        .predicted("~8e-6"),
    ];
    let largest = r.hbm.iter().map(|p| p.array_bytes).max().unwrap_or(0);
    for k in Kernel::ALL {
        let of_k: Vec<&BandwidthPoint> = r.hbm.iter().filter(|p| p.kernel == k).collect();
        if let Some(big) = of_k.iter().find(|p| p.array_bytes == largest) {
            let pred = if k == Kernel::Copy {
                "~4.0e12 (0.83 of 4.8 TB/s)"
            } else {
                ""
            };
            rows.push(
                Row::new(
                    format!("HBM {} {} MiB/array, median", k.label(), largest >> 20),
                    big.median_bps,
                    "B/s",
                )
                .predicted(pred),
            );
            rows.push(Row::new(
                format!("HBM {} {} MiB/array, at p95 time", k.label(), largest >> 20),
                big.p95_bps,
                "B/s",
            ));
        }
        if let Some(peak) = of_k
            .iter()
            .max_by(|a, b| a.median_bps.total_cmp(&b.median_bps))
        {
            rows.push(
                Row::new(
                    format!(
                        "{} best over sizes (at {} KiB/array, inside L2), median",
                        k.label(),
                        peak.array_bytes >> 10
                    ),
                    peak.median_bps,
                    "B/s",
                )
                .predicted("~2-3x HBM: L2 bandwidth"),
            );
        }
    }
    for t in r
        .transfers
        .iter()
        .filter(|t| t.bytes == 4096 || t.bytes == 256 << 20)
    {
        let pred = match (t.bytes, t.kind) {
            (4096, _) => "~10e-6 s: latency, not bandwidth",
            (_, Transfer::HostToDevicePinned | Transfer::DeviceToHostPinned) => {
                "~50e9 (PCIe 5.0 x16)"
            }
            _ => "~half of pinned",
        };
        rows.push(
            Row::new(
                format!("{} {} KiB, median", t.kind.label(), t.bytes >> 10),
                t.median_bps,
                "B/s",
            )
            .predicted(pred),
        );
    }
    for g in &r.gemm {
        let sh = g.shape;
        let what = format!("cuBLAS {} {}x{}x{}", g.precision.label(), sh.m, sh.n, sh.k);
        if sh.m == sh.n {
            let pred = match (g.precision, sh.m) {
                (Precision::F32, 4096) => "~48e12",
                (Precision::Bf16 | Precision::F16, 8192) => "~750e12 (0.76 of 989 dense)",
                _ => "",
            };
            rows.push(
                Row::new(format!("{what}, median"), g.median_flops, "FLOP/s").predicted(pred),
            );
        } else if g.precision == Precision::Bf16 {
            rows.push(
                Row::new(
                    format!("{what} / HBM copy bandwidth (min traffic / time)"),
                    g.median_bps / r.roofline.memory_bps,
                    "ratio",
                )
                .predicted(if sh.m == 1 {
                    "~0.7 (a GEMV reads the weight once)"
                } else {
                    ""
                }),
            );
        }
    }
    for p in points.iter().filter(|p| p.name.starts_with("p03")) {
        rows.push(Row::new(
            format!("{} / roofline (fp32 roof) at its intensity", p.name),
            r.roofline.efficiency(p, 0),
            "ratio",
        ));
    }
    for s in &r.spread {
        rows.push(
            Row::new(
                format!(
                    "spread over {} runs: {} (max-min)/median",
                    s.runs.len(),
                    s.name
                ),
                s.range_over_median,
                "ratio",
            )
            .predicted("< 0.03"),
        );
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{gemm, memory};

    /// A report with made-up numbers, only to exercise the outputs.
    fn synthetic() -> (Report, Vec<Point>) {
        let mut hbm = Vec::new();
        for bytes in memory::sizes(64 << 20) {
            for k in Kernel::ALL {
                let bw = if bytes <= 16 << 20 { 8e12 } else { 4e12 };
                hbm.push(BandwidthPoint {
                    kernel: k,
                    array_bytes: bytes,
                    passes: memory::passes_for(k, bytes),
                    median_bps: bw,
                    p95_bps: bw * 0.98,
                });
            }
        }
        let transfers = memory::transfer_sizes(1 << 30)
            .into_iter()
            .flat_map(|b| {
                Transfer::ALL.map(|kind| TransferPoint {
                    kind,
                    bytes: b,
                    median_bps: 5e10,
                    p95_bps: 4e10,
                    median_s: b as f64 / 5e10,
                })
            })
            .collect();
        let (sq, sk) = gemm::shapes(&[1024, 4096], 4096, 4096);
        let gemm = sq
            .iter()
            .chain(&sk)
            .flat_map(|&shape| {
                Precision::ALL.map(|precision| GemmPoint {
                    precision,
                    shape,
                    median_s: 1e-3,
                    p95_s: 1.1e-3,
                    median_flops: shape.flops() / 1e-3,
                    median_bps: shape.min_bytes(precision) / 1e-3,
                })
            })
            .collect();
        let kernels = vec![Point {
            name: "p03 vector add (float4)".into(),
            intensity: 1.0 / 12.0,
            flops: 3e11,
        }];
        let report = Report {
            device: "Test GPU, sm_90, 132 SMs, CUDA driver 13.0".into(),
            l2_bytes: 50 << 20,
            launch_back_to_back_s: 2e-6,
            launch_synced_s: 8e-6,
            hbm,
            transfers,
            gemm,
            kernels: kernels.clone(),
            roofline: Roofline {
                memory_bps: 4e12,
                compute: vec![("fp32".into(), 5e13), ("bf16".into(), 7e14)],
            },
            spread: vec![Spread::of("copy", vec![1.0, 1.01, 0.99])],
        };
        (report, kernels)
    }

    #[test]
    fn outputs_round_trip_through_suite_json_and_rows_name_the_commit() {
        let dir = std::env::temp_dir().join(format!("p11-suite-{}", std::process::id()));
        let rows_path = dir.join("rows.md");
        let (report, points) = synthetic();
        let args = SuiteArgs {
            quick: true,
            out: dir.clone(),
            rows: Some(rows_path.clone()),
            commit: Some("abc1234567".into()),
            runs: 3,
            command: "p11_gpu_bench run".into(),
        };
        write_outputs(&args, &report, &points).unwrap();
        let rows = std::fs::read_to_string(&rows_path).unwrap();
        assert!(rows.contains("| abc1234567 |"), "{rows}");
        assert!(rows.contains("Test GPU, sm_90"), "{rows}");
        assert!(
            rows.contains("HBM copy 64 MiB/array, median | 4.0000e12 |"),
            "{rows}"
        );
        // Vector add at 3e11 FLOP/s under a 4e12 B/s x 1/12 roof = 0.9.
        assert!(
            rows.contains(
                "p03 vector add (float4) / roofline (fp32 roof) at its intensity | 0.9 |"
            ),
            "{rows}"
        );
        let again = dir.join("again");
        replot(&dir, &again).unwrap();
        for png in [
            "hbm.png",
            "transfers.png",
            "gemm_skinny.png",
            "roofline.png",
        ] {
            assert!(
                std::fs::metadata(again.join(png)).unwrap().len() > 1000,
                "{png}"
            );
        }
        std::fs::remove_dir_all(dir).unwrap();
    }
}

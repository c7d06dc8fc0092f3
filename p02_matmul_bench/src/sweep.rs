//! `p02_matmul_bench sweep`: every variant at every size beside the peers,
//! the measured ceilings, the SmolLM2 shapes, the MNIST MLP; a table, two
//! plots (GFLOP/s vs N, roofline) and numbers.md rows.

use std::path::PathBuf;

use anyhow::Result;
use common::numbers::{Recorder, Row};
use common::plot::{line_chart, Labels, Scale, Series};
use common::stats::{time_it, BenchConfig, Summary};
use std::time::Duration;

use crate::ceilings::{bandwidth, peak_gflops, Bandwidth};
use crate::gemm::gemm_packed;
use crate::mat::{MatMut, MatRef};
use crate::peers::{python_peers, PyPeers};
use crate::variants::{b_transposed, blocked, ikj, naive_ijk};
use crate::{sgemm, GemmOpts, MicroKernel};

/// SmolLM2-135M's linear layers as (name, in = K, out = N).
pub const SMOLLM2_LINEARS: [(&str, usize, usize); 5] = [
    ("q_proj/o_proj", 576, 576),
    ("k_proj/v_proj", 576, 192),
    ("gate_proj/up_proj", 576, 1536),
    ("down_proj", 1536, 576),
    ("lm_head", 576, 49152),
];

/// L3 size of this machine's CPU (32 MB): working sets above it stream from DRAM.
const L3_BYTES: usize = 32 << 20;

#[derive(Clone, Debug)]
pub struct SweepArgs {
    pub sizes: Vec<usize>,
    /// The thread count of the "threaded" rows (1 is always measured too).
    pub threads: usize,
    pub python: bool,
    pub record: bool,
    pub command: String,
    /// Only the MNIST MLP section (quick check; records nothing).
    pub mlp_only: bool,
}

/// One measured (variant, threads, size) point.
#[derive(Clone, Debug)]
struct Point {
    name: String,
    n: usize,
    /// At the median time.
    gflops: f64,
    /// Seconds per call (median and p95 for the numbers.md rows).
    secs: Summary,
}

/// Seconds per call (median, p95, ...), with fewer samples for long calls.
fn time_s(flops: f64, f: impl FnMut()) -> Summary {
    let cfg = if flops > 1e10 {
        BenchConfig {
            warmup_iters: 1,
            min_samples: 3,
            min_time: Duration::ZERO,
            max_samples: 3,
        }
    } else if flops > 1e9 {
        BenchConfig {
            warmup_iters: 1,
            min_samples: 5,
            min_time: Duration::ZERO,
            max_samples: 5,
        }
    } else {
        BenchConfig {
            warmup_iters: 3,
            min_samples: 10,
            min_time: Duration::from_millis(200),
            max_samples: 2000,
        }
    };
    time_it(cfg, f)
}

/// Largest N each slow variant is run at (they would take minutes beyond).
fn cap(name: &str) -> usize {
    match name {
        "naive_ijk" => 512,
        "ikj" | "b_transposed" => 1024,
        "blocked" => 2048,
        _ => usize::MAX,
    }
}

fn square_sweep(sizes: &[usize], threads: usize) -> Vec<Point> {
    let kernel = MicroKernel::best();
    let mut pts = Vec::new();
    for &n in sizes {
        let a = common::testdata::uniform(n * n, 1);
        let b = common::testdata::uniform(n * n, 2);
        let mut c = vec![0.0f32; n * n];
        let flops = 2.0 * (n as f64).powi(3);
        let av = MatRef::row_major(&a, n, n).expect("sized");
        let bv = MatRef::row_major(&b, n, n).expect("sized");
        let mut run = |name: &str, f: &mut dyn FnMut(&mut [f32])| {
            if n <= cap(name) {
                let s = time_s(flops, || f(&mut c));
                eprintln!(
                    "  n {n:>5} {name:<26} {:>8.2} GFLOP/s",
                    flops / s.median / 1e9
                );
                pts.push(Point {
                    name: name.to_string(),
                    n,
                    gflops: flops / s.median / 1e9,
                    secs: s,
                });
            }
        };
        type V = fn(MatRef, MatRef, &mut MatMut);
        let ladder: [(&str, V); 4] = [
            ("naive_ijk", naive_ijk),
            ("ikj", ikj),
            ("b_transposed", b_transposed),
            ("blocked", blocked),
        ];
        for (name, v) in ladder {
            run(name, &mut |c| {
                v(av, bv, &mut MatMut::row_major(c, n, n).expect("sized"))
            });
        }
        run("packed 1t", &mut |c| {
            gemm_packed(
                1.0,
                av,
                bv,
                0.0,
                &mut MatMut::row_major(c, n, n).expect("sized"),
                kernel,
                1,
            )
            .expect("shapes chain")
        });
        run(&format!("packed {threads}t (sgemm)"), &mut |c| {
            sgemm(
                av,
                bv,
                &mut MatMut::row_major(c, n, n).expect("sized"),
                GemmOpts {
                    threads,
                    ..GemmOpts::default()
                },
            )
            .expect("shapes");
        });
        #[cfg(feature = "peers")]
        {
            run("matrixmultiply 1t", &mut |c| {
                crate::peers::matrixmultiply_sgemm(n, n, n, &a, &b, c)
            });
            run("gemm crate 1t", &mut |c| {
                crate::peers::gemm_crate_sgemm(n, n, n, &a, &b, c, 1)
            });
            run(&format!("gemm crate {threads}t"), &mut |c| {
                crate::peers::gemm_crate_sgemm(n, n, n, &a, &b, c, threads)
            });
        }
    }
    pts
}

/// (name, m, k, n, threads, seconds per call) for y = x W^T at the SmolLM2 shapes.
fn transformer_shapes(threads: usize) -> Vec<(String, usize, usize, usize, usize, Summary)> {
    let mut out = Vec::new();
    for (name, k, n) in SMOLLM2_LINEARS {
        let w = common::testdata::uniform(n * k, 3);
        for m in [1usize, 256] {
            let x = common::testdata::uniform(m * k, 4);
            let mut y = vec![0.0f32; m * n];
            for t in [1, threads] {
                let flops = 2.0 * (m * k * n) as f64;
                let s = time_s(flops, || {
                    crate::linear(&x, m, &w, n, None, &mut y, t).expect("shapes")
                });
                out.push((name.to_string(), m, k, n, t, s));
            }
        }
    }
    out
}

fn bw_for(bws: &[Bandwidth], bytes: usize, threads: usize) -> f64 {
    let level = if bytes > L3_BYTES {
        256usize << 20
    } else {
        8 << 20
    };
    bws.iter()
        .find(|b| b.kind == "read" && b.threads == threads && b.bytes_per_array == level)
        .map_or(f64::NAN, |b| b.gbs)
}

/// Run the whole sweep.
pub fn run(args: &SweepArgs) -> Result<()> {
    let t = args.threads.max(1);
    if args.mlp_only {
        crate::sweep_mlp::run_mlp(t, args.python)?;
        return Ok(());
    }
    let kernel = MicroKernel::best();
    println!(
        "micro-kernel: {} (mr {} nr {} kc {} mc {} nc {})",
        kernel.name(),
        kernel.mr,
        kernel.nr,
        kernel.kc,
        kernel.mc,
        kernel.nc
    );

    // 1. Ceilings.
    let (peak1, isa) = peak_gflops(1);
    let (peak_t, _) = peak_gflops(t);
    let mut bws = Vec::new();
    for threads in [1, t] {
        for bytes in [8usize << 20, 256 << 20] {
            bws.extend(bandwidth(bytes, threads, 5));
        }
    }
    println!("\nceilings: peak {peak1:.1} GFLOP/s on 1 thread, {peak_t:.1} on {t} ({isa}, independent FMA chains)");
    for b in &bws {
        println!(
            "  {:<5} {:>4} MB/array {}t: {:>6.1} GB/s",
            b.kind,
            b.bytes_per_array >> 20,
            b.threads,
            b.gbs
        );
    }

    // 2. Square sweep, ours and the Rust peers.
    eprintln!("\nsquare sweep:");
    let pts = square_sweep(&args.sizes, t);

    // 3. SmolLM2 shapes.
    eprintln!("SmolLM2 linear shapes ...");
    let shapes = transformer_shapes(t);

    // 4. Python peers (numpy/OpenBLAS, PyTorch), 1 and t threads.
    let lin_shapes: Vec<(usize, usize, usize)> = SMOLLM2_LINEARS
        .iter()
        .flat_map(|&(_, k, n)| [(1, k, n), (256, k, n)])
        .collect();
    let mut py: Vec<PyPeers> = Vec::new();
    if args.python {
        for threads in [1, t] {
            eprintln!("python peers, {threads} thread(s) ...");
            py.push(python_peers(&args.sizes, &lin_shapes, threads)?);
        }
    }

    // 5. The MNIST MLP through sgemm vs p01's engine vs PyTorch.
    let mlp_rows = crate::sweep_mlp::run_mlp(t, args.python)?;

    // ---- Report ----
    let point = |name: &str, n: usize| pts.iter().find(|p| p.name == name && p.n == n);
    let gf = |name: &str, n: usize| point(name, n).map(|p| p.gflops);
    let sg = format!("packed {t}t (sgemm)");
    let mut names: Vec<String> = Vec::new();
    for p in &pts {
        if !names.contains(&p.name) {
            names.push(p.name.clone());
        }
    }
    let py_gf = |threads: usize, n: usize, torch: bool| {
        py.iter()
            .find(|p| p.threads == threads)
            .and_then(|p| p.square.iter().find(|s| s.0 == n))
            .map(|s| 2.0 * (n as f64).powi(3) / if torch { s.2 } else { s.1 } / 1e9)
    };
    println!("\nsquare C = A B, GFLOP/s (median); % = of the measured peak at that thread count");
    print!("{:>26}", "variant \\ N");
    for n in &args.sizes {
        print!(" {n:>8}");
    }
    println!();
    for name in &names {
        print!("{name:>26}");
        for &n in &args.sizes {
            print!(
                " {:>8}",
                gf(name, n).map_or("-".into(), |g| format!("{g:.1}"))
            );
        }
        println!();
    }
    for threads in [1, t] {
        for (torch, label) in [(false, "numpy"), (true, "torch")] {
            if py.iter().any(|p| p.threads == threads) {
                print!("{:>26}", format!("{label} {threads}t"));
                for &n in &args.sizes {
                    print!(
                        " {:>8}",
                        py_gf(threads, n, torch).map_or("-".into(), |g| format!("{g:.1}"))
                    );
                }
                println!();
            }
        }
    }
    println!("\nbest variant vs ceilings and peers:");
    // Ceilings are best-of-N by design (STREAM's convention): see ceilings.rs.
    let mut rows: Vec<Row> = vec![
        Row::new("p02 peak FMA 1 thread (best of 3)", peak1, "GFLOP/s")
            .predicted("~96 (2 FMA x 8 lanes x 2 x ~3 GHz)"),
        Row::new(
            format!("p02 peak FMA {t} threads (best of 3)"),
            peak_t,
            "GFLOP/s",
        )
        .predicted("2x one thread"),
    ];
    for b in &bws {
        rows.push(Row::new(
            format!(
                "p02 {} bandwidth {} MB {}t (best of 5)",
                b.kind,
                b.bytes_per_array >> 20,
                b.threads
            ),
            b.gbs,
            "GB/s",
        ));
    }
    for &n in &args.sizes {
        let (Some(p1), Some(pt)) = (point("packed 1t", n), point(&sg, n)) else {
            continue;
        };
        let (one, two) = (p1.gflops, pt.gflops);
        let gflop = 2.0 * (n as f64).powi(3) / 1e9;
        let mut peers: Vec<(String, f64)> = Vec::new();
        for (name, g) in pts
            .iter()
            .filter(|p| {
                p.n == n
                    && (p.name.starts_with("gemm crate") || p.name.starts_with("matrixmultiply"))
            })
            .map(|p| (p.name.clone(), p.gflops))
        {
            peers.push((name, g));
        }
        for threads in [1, t] {
            for (torch, label) in [(false, "numpy"), (true, "torch")] {
                if let Some(g) = py_gf(threads, n, torch) {
                    peers.push((format!("{label} {threads}t"), g));
                }
            }
        }
        let best_peer_t = peers
            .iter()
            .filter(|p| p.0.ends_with(&format!("{t}t")))
            .max_by(|a, b| a.1.total_cmp(&b.1));
        println!(
            "  N {n:>4}: 1t {one:.1} ({:.0}% of peak), {t}t {two:.1} ({:.0}% of peak, {:.2}x 1t){}",
            100.0 * one / peak1,
            100.0 * two / peak_t,
            two / one,
            best_peer_t.map_or(String::new(), |p| format!(
                "; best {t}t peer {} {:.1} -> ours/peer {:.2}",
                p.0,
                p.1,
                two / p.1
            ))
        );
        rows.extend(Row::rate_median_p95(
            format!("p02 sgemm N={n} 1t"),
            gflop,
            &p1.secs,
            "GFLOP/s",
            if n >= 1024 { ">= 85% of 1t peak" } else { "" },
        ));
        rows.push(Row::new(
            format!("p02 sgemm N={n} 1t % of peak"),
            100.0 * one / peak1,
            "%",
        ));
        rows.extend(Row::rate_median_p95(
            format!("p02 sgemm N={n} {t}t"),
            gflop,
            &pt.secs,
            "GFLOP/s",
            if n >= 1024 { ">= 1.8x 1t" } else { "" },
        ));
        rows.push(Row::new(
            format!("p02 sgemm N={n} {t}t/1t (ratio of medians)"),
            two / one,
            "x",
        ));
        for (name, g) in &peers {
            let ours = if name.ends_with(" 1t") { one } else { two };
            rows.push(
                Row::new(
                    format!("p02 sgemm N={n} ours/{name} (ratio of medians)"),
                    ours / g,
                    "x",
                )
                .predicted(if name == &format!("torch {t}t") && n >= 1024 {
                    ">= 1"
                } else {
                    ""
                }),
            );
        }
    }

    println!("\nSmolLM2 shapes, y = x W^T (W stored (out, in)); M = 1: GB/s of weights and % of the read bandwidth measured at the same size and threads; M = 256: GFLOP/s");
    for (name, m, k, n, threads, secs) in &shapes {
        let s = secs.median;
        let bytes = k * n * 4;
        let py_s = py.iter().find(|p| p.threads == *threads).and_then(|p| {
            p.linear
                .iter()
                .find(|l| l.0 == *m && l.1 == *k && l.2 == *n)
        });
        let peer = py_s.map_or(String::new(), |l| {
            format!(
                "; numpy {:.1} us, torch {:.1} us -> torch/ours {:.2}",
                l.3 * 1e6,
                l.4 * 1e6,
                l.4 / s
            )
        });
        if *m == 1 {
            let gbs = bytes as f64 / s / 1e9;
            // The ceiling for this GEMV: read bandwidth at the same working-set size.
            let bw = crate::ceilings::read_bandwidth(bytes, *threads);
            println!("  {name:<18} M=1   {k:>5}x{n:<6} {threads}t {:>9.1} us {gbs:>6.1} GB/s ({:.0}% of {bw:.1}){peer}", s * 1e6, 100.0 * gbs / bw);
            rows.push(
                Row::new(
                    format!("p02 gemv {name} {k}x{n} {threads}t % of read bw"),
                    100.0 * gbs / bw,
                    "%",
                )
                .predicted(if bytes > 512 << 10 { ">= 80%" } else { "" }),
            );
        } else {
            let gflop = 2.0 * (m * k * n) as f64 / 1e9;
            let g = gflop / s;
            println!(
                "  {name:<18} M=256 {k:>5}x{n:<6} {threads}t {:>9.1} us {g:>6.1} GFLOP/s{peer}",
                s * 1e6
            );
            rows.extend(Row::rate_median_p95(
                format!("p02 linear M=256 {name} {k}x{n} {threads}t"),
                gflop,
                secs,
                "GFLOP/s",
                "",
            ));
            if let Some(l) = py_s {
                rows.push(Row::new(
                    format!(
                        "p02 linear M=256 {name} {threads}t torch/ours time (ratio of medians)"
                    ),
                    l.4 / s,
                    "x",
                ));
            }
        }
    }
    rows.extend(mlp_rows);

    // ---- Plots ----
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("plots");
    let mut series: Vec<Series> = names
        .iter()
        .map(|name| {
            Series::new(
                name.clone(),
                pts.iter()
                    .filter(|p| &p.name == name)
                    .map(|p| (p.n as f64, p.gflops))
                    .collect(),
            )
        })
        .collect();
    for threads in [1, t] {
        if py.iter().any(|p| p.threads == threads) {
            series.push(Series::new(
                format!("torch {threads}t"),
                args.sizes
                    .iter()
                    .filter_map(|&n| py_gf(threads, n, true).map(|g| (n as f64, g)))
                    .collect(),
            ));
        }
    }
    series.push(Series::new(
        format!("peak {t}t (measured)"),
        args.sizes.iter().map(|&n| (n as f64, peak_t)).collect(),
    ));
    line_chart(
        &dir.join("gflops_vs_n.png"),
        Labels {
            title: "sgemm: GFLOP/s vs N (square, f32)",
            x: "N",
            y: "GFLOP/s",
        },
        &series,
        Scale::LogLog,
    )
    .map_err(anyhow::Error::msg)?;
    roofline(&dir, &bws, peak1, peak_t, t, &pts, &sg, &shapes)?;
    println!("\nplots: {}/gflops_vs_n.png, roofline.png", dir.display());

    if args.record {
        Recorder::for_workspace(&args.command).append(&rows)?;
        println!("appended {} rows to numbers.md", rows.len());
    }
    Ok(())
}

#[allow(clippy::too_many_arguments, clippy::type_complexity)]
fn roofline(
    dir: &std::path::Path,
    bws: &[Bandwidth],
    peak1: f64,
    peak_t: f64,
    t: usize,
    pts: &[Point],
    sg: &str,
    shapes: &[(String, usize, usize, usize, usize, Summary)],
) -> Result<()> {
    let xs: Vec<f64> = (0..=40)
        .map(|i| 10f64.powf(-1.5 + i as f64 * 0.125))
        .collect();
    let dram = bw_for(bws, usize::MAX, t);
    let l3 = bw_for(bws, 1, t);
    let dram1 = bw_for(bws, usize::MAX, 1);
    let roof = |peak: f64, bw: f64| {
        xs.iter()
            .map(|&x| (x, peak.min(bw * x)))
            .collect::<Vec<_>>()
    };
    let mut s = vec![
        Series::new(
            format!("roof {t}t, DRAM {dram:.0} GB/s"),
            roof(peak_t, dram),
        ),
        Series::new(format!("roof {t}t, L3 {l3:.0} GB/s"), roof(peak_t, l3)),
        Series::new(format!("roof 1t, DRAM {dram1:.0} GB/s"), roof(peak1, dram1)),
    ];
    // Square: compulsory traffic 3 N^2 floats for 2 N^3 FLOPs -> N/6 FLOP/byte.
    s.push(Series::new(
        format!("sgemm square {t}t (AI = N/6)"),
        pts.iter()
            .filter(|p| p.name == sg)
            .map(|p| (p.n as f64 / 6.0, p.gflops))
            .collect(),
    ));
    let ai = |m: usize, k: usize, n: usize| {
        2.0 * (m * k * n) as f64 / (4.0 * (m * k + k * n + m * n) as f64)
    };
    let lin = |m: usize| -> Vec<(f64, f64)> {
        shapes
            .iter()
            .filter(|x| x.1 == m && x.4 == t)
            .map(|(_, m, k, n, _, sec)| {
                (ai(*m, *k, *n), 2.0 * (m * k * n) as f64 / sec.median / 1e9)
            })
            .collect()
    };
    s.push(Series::new(format!("SmolLM2 linears M=256 {t}t"), lin(256)));
    s.push(Series::new(format!("SmolLM2 linears M=1 {t}t"), lin(1)));
    line_chart(
        &dir.join("roofline.png"),
        Labels {
            title: "roofline: measured ceilings and sgemm",
            x: "arithmetic intensity (FLOP / byte of compulsory traffic)",
            y: "GFLOP/s",
        },
        &s,
        Scale::LogLog,
    )
    .map_err(anyhow::Error::msg)
}

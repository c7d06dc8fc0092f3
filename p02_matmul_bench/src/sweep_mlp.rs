//! The sweep's Project 01 section: the MNIST MLP through sgemm, beside p01's
//! own engine and PyTorch, batch 1 ... 1024.

use anyhow::Result;
use common::numbers::Row;
use common::stats::{time_it, BenchConfig};

use crate::mlp::{Mlp, MlpBuffers};

/// Print the comparison and return numbers.md rows.
pub fn run_mlp(threads: usize, python: bool) -> Result<Vec<Row>> {
    let fixtures = p01_engine::fixtures_dir();
    let model_dir = fixtures.join("mlp");
    let images_path = fixtures.join("mnist_test.safetensors");
    let batches = vec![1usize, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024];
    let f = common::st::load(&images_path)?;
    let pool: Vec<f32> = f
        .tensor("images")?
        .data()
        .iter()
        .copied()
        .cycle()
        .take(1024 * 784)
        .collect();

    let mlp = Mlp::load(&model_dir.join("weights.safetensors"))?;
    let mut bufs = MlpBuffers::default();
    let mut ours = Vec::new();
    for &b in &batches {
        let x = &pool[..b * 784];
        let s = time_it(BenchConfig::default(), || {
            std::hint::black_box(mlp.forward(x, b, &mut bufs, threads).expect("shapes"));
        });
        ours.push(s);
    }
    let engine = p01_engine::Graph::load_with(
        &model_dir,
        p01_engine::LoadOptions {
            threads,
            ..Default::default()
        },
    )?;
    let p01 = p01_engine::bench::sweep_ours(&engine, &pool, &batches)?;
    let torch = if python {
        let args = p01_engine::bench::BenchArgs {
            model_dir,
            images: images_path,
            batches: batches.clone(),
            threads,
            rounds: 1,
            peer: true,
            record: false,
            command: String::new(),
        };
        Some(p01_engine::bench::sweep_torch(&args)?.0)
    } else {
        None
    };
    println!("\nMNIST MLP (p01 fixtures), latency per call (median), {threads} threads; ratio = PyTorch / p02 sgemm (>1: we are faster)");
    println!(
        "{:>6} {:>12} {:>12} {:>12} {:>7}",
        "batch", "p02 sgemm", "p01 engine", "PyTorch", "ratio"
    );
    let mut rows = Vec::new();
    for (i, &b) in batches.iter().enumerate() {
        let t = torch.as_ref().map(|t| t[i].median_s);
        println!(
            "{b:>6} {:>9.1} us {:>9.1} us {:>12} {:>7}",
            ours[i].median * 1e6,
            p01[i].median_s * 1e6,
            t.map_or("-".into(), |t| format!("{:.1} us", t * 1e6)),
            t.map_or("-".into(), |t| format!("{:.2}", t / ours[i].median))
        );
        if let Some(t) = t {
            if b == 1 || b == 256 || b == 1024 {
                let goal = if b >= 256 {
                    "target > 1 (faster than PyTorch)"
                } else {
                    ""
                };
                rows.push(
                    Row::new(
                        format!("p02 mnist mlp b={b} PyTorch/sgemm time (ratio of medians)"),
                        t / ours[i].median,
                        "x",
                    )
                    .predicted(goal),
                );
            }
        }
        if b == 1 || b == 256 || b == 1024 {
            rows.extend(Row::median_p95(
                format!("p02 mnist mlp b={b} sgemm latency"),
                ours[i].median * 1e6,
                ours[i].p95 * 1e6,
                "us",
                "",
            ));
        }
    }
    Ok(rows)
}

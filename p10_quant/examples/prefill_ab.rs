//! Prefill speed, f32 vs native (panels expanded in p02's loop, straight
//! into slivers where the kernels can or as rows then transposed, or W
//! prepacked whole first), interleaved (for profiling the prefill path):
//! `cargo run --release -p p10_quant --example prefill_ab [tokens] [rounds]`.
fn main() -> anyhow::Result<()> {
    let path =
        common::assets::ensure(common::assets::Asset::SmolLm2).map_err(anyhow::Error::msg)?;
    let n: usize = std::env::args().nth(1).map_or(Ok(256), |s| s.parse())?;
    let rounds: usize = std::env::args().nth(2).map_or(Ok(3), |s| s.parse())?;
    let f = p10_quant::loader::load(&path, p10_quant::Weights::F32)?;
    let q = p10_quant::loader::load(&path, p10_quant::Weights::Native)?;
    // PREFILL_INT=1: also the integer path for every product (8-bit
    // activations, the decode kernels one weight row at a time), the option
    // of not expanding at all.
    if std::env::var("PREFILL_INT").is_ok() {
        let w = p10_quant::NativeWeights {
            f32_rows: usize::MAX,
            ..p10_quant::NativeWeights::detect()
        };
        let int = p10_quant::loader::load_native(&path, w)?;
        for _ in 0..rounds {
            let a = p05_kv_cache::bench::prefill_speed(&f.engine, n)?;
            let b = p05_kv_cache::bench::prefill_speed(&q.engine, n)?;
            let c = p05_kv_cache::bench::prefill_speed(&int.engine, n)?;
            println!(
                "prefill {n}: f32 {a:.0} tok/s, native expanded {b:.0} ({:.2}x), native integer {c:.0} ({:.2}x)",
                b / a,
                c / a
            );
        }
        return Ok(());
    }
    // PREFILL_ONLY=native|f32: one path alone (for a profiler).
    if let Ok(only) = std::env::var("PREFILL_ONLY") {
        let e = if only == "f32" { &f.engine } else { &q.engine };
        for _ in 0..rounds {
            let s = p05_kv_cache::bench::prefill_speed(e, n)?;
            println!("prefill {n}: {only} {s:.0} tok/s");
        }
        return Ok(());
    }
    use p10_quant::matrix::{set_panel_expansion, PanelExpansion};
    let native = |how| {
        set_panel_expansion(how);
        p05_kv_cache::bench::prefill_speed(&q.engine, n)
    };
    let ways = [
        PanelExpansion::InLoop,
        PanelExpansion::InLoopRows,
        PanelExpansion::Prepacked,
    ];
    let mut ratios = vec![Vec::new(); ways.len()];
    for round in 0..rounds {
        let a = p05_kv_cache::bench::prefill_speed(&f.engine, n)?;
        // The native ways take turns going first.
        let mut line = format!("prefill {n}: f32 {a:.0} tok/s");
        let mut speeds = [0.0; 3];
        for t in 0..ways.len() {
            let w = (round + t) % ways.len();
            speeds[w] = native(ways[w])?;
        }
        for (w, s) in speeds.iter().enumerate() {
            line += &format!(", {:?} {s:.0} ({:.2}x)", ways[w], s / a);
            ratios[w].push(s / a);
        }
        println!("{line}");
    }
    set_panel_expansion(PanelExpansion::InLoop);
    for (w, r) in ways.iter().zip(&ratios) {
        println!(
            "{w:?} / f32: median {:.3} of {rounds}",
            common::stats::summarize(r).median
        );
    }
    Ok(())
}

//! Decode tok/s, before vs after, interleaved in one process (this VM's
//! noise moves runs by 10–30%):
//! `cargo run --release -p p10_quant --example decode_ab [rounds] [fused|quantiser]`.
//! `fused` (the default): q/k/v and gate/up fused into groups vs one by one.
//! `quantiser`: activations quantised by the SIMD quantiser vs the scalar one.
//! `isa NARROW WIDE` (e.g. `isa avx2 avx512vnni`): the same weights on two
//! kernel paths (two engines over one mapped file).
fn main() -> anyhow::Result<()> {
    let path =
        common::assets::ensure(common::assets::Asset::SmolLm2).map_err(anyhow::Error::msg)?;
    let rounds: usize = std::env::args().nth(1).map_or(Ok(5), |s| s.parse())?;
    let what = std::env::args().nth(2).unwrap_or_else(|| "fused".into());
    if what == "isa" {
        return isa_ab(&path, rounds);
    }
    let set: fn(bool) = match what.as_str() {
        "fused" => p10_quant::matrix::set_fused_groups,
        "quantiser" => |on| p10_quant::int_path::set_scalar_quantiser(!on),
        other => anyhow::bail!("unknown comparison `{other}` (fused|quantiser|isa)"),
    };
    let (before, after) = match what.as_str() {
        "fused" => ("one by one", "fused"),
        _ => ("scalar quantiser", "SIMD quantiser"),
    };
    let loaded = p10_quant::loader::load(&path, p10_quant::Weights::Native)?;
    let (mut fused, mut single) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        for (on, out) in [(false, &mut single), (true, &mut fused)] {
            set(on);
            let (runs, _) = p05_kv_cache::bench::decode_profile(&loaded.engine, 3)?;
            let decode = common::stats::summarize(&runs).median;
            out.push(decode);
        }
        println!(
            "decode tok/s: {before} {:.1}, {after} {:.1}",
            single.last().unwrap_or(&0.0),
            fused.last().unwrap_or(&0.0)
        );
    }
    let (s, f) = (
        common::stats::summarize(&single),
        common::stats::summarize(&fused),
    );
    println!(
        "median: {before} {:.1}, {after} {:.1} ({:.2}x); p95 of per-round tok/s: {:.1} / {:.1}",
        s.median,
        f.median,
        f.median / s.median,
        s.p95,
        f.p95
    );
    Ok(())
}

/// Decode tok/s on two kernel paths, interleaved.
fn isa_ab(path: &std::path::Path, rounds: usize) -> anyhow::Result<()> {
    use p10_quant::{Dot, Isa, NativeWeights};
    let arg = |i: usize, default: &str| std::env::args().nth(i).unwrap_or_else(|| default.into());
    let mut engines = Vec::new();
    for name in [arg(3, "avx2"), arg(4, &Isa::detect().to_string())] {
        let isa = Isa::from_name(&name).ok_or_else(|| anyhow::anyhow!("unknown path `{name}`"))?;
        let w = NativeWeights {
            dot: Dot::new(isa)?,
            ..NativeWeights::detect()
        };
        engines.push((isa, p10_quant::loader::load_native(path, w)?, Vec::new()));
    }
    for _ in 0..rounds {
        for (isa, loaded, out) in engines.iter_mut() {
            let (runs, _) = p05_kv_cache::bench::decode_profile(&loaded.engine, 3)?;
            out.push(common::stats::summarize(&runs).median);
            print!("{isa} {:.1}  ", out.last().unwrap_or(&0.0));
        }
        println!();
    }
    let med: Vec<f64> = engines
        .iter()
        .map(|(_, _, v)| common::stats::summarize(v).median)
        .collect();
    println!(
        "median decode tok/s: {} {:.1}, {} {:.1} ({:.2}x)",
        engines[0].0,
        med[0],
        engines[1].0,
        med[1],
        med[1] / med[0]
    );
    Ok(())
}

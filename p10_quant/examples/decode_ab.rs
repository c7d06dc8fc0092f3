//! Decode tok/s, before vs after, interleaved in one process (this VM's
//! noise moves runs by 10–30%):
//! `cargo run --release -p p10_quant --example decode_ab [rounds] [fused|quantiser]`.
//! `fused` (the default): q/k/v and gate/up fused into groups vs one by one.
//! `quantiser`: activations quantised by the SIMD quantiser vs the scalar one.
fn main() -> anyhow::Result<()> {
    let path =
        common::assets::ensure(common::assets::Asset::SmolLm2).map_err(anyhow::Error::msg)?;
    let rounds: usize = std::env::args().nth(1).map_or(Ok(5), |s| s.parse())?;
    let what = std::env::args().nth(2).unwrap_or_else(|| "fused".into());
    let set: fn(bool) = match what.as_str() {
        "fused" => p10_quant::matrix::set_fused_groups,
        "quantiser" => |on| p10_quant::int_path::set_scalar_quantiser(!on),
        other => anyhow::bail!("unknown comparison `{other}` (fused|quantiser)"),
    };
    let (before, after) = if what == "fused" {
        ("one by one", "fused")
    } else {
        ("scalar quantiser", "SIMD quantiser")
    };
    let loaded = p10_quant::loader::load(&path, true)?;
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

//! Decode steps in a loop (for profilers): `cargo run --release -p p10_quant --example decode_loop`.
fn main() -> anyhow::Result<()> {
    let path =
        common::assets::ensure(common::assets::Asset::SmolLm2).map_err(anyhow::Error::msg)?;
    let weights = match std::env::args().nth(1).as_deref() {
        Some("f32") => p10_quant::Weights::F32,
        _ => p10_quant::Weights::Native,
    };
    let loaded = p10_quant::loader::load(&path, weights)?;
    let t = std::time::Instant::now();
    let mut n = 0;
    while t.elapsed().as_secs_f64() < 8.0 {
        p05_kv_cache::bench::decode_latency(&loaded.engine, 80)?;
        n += 1;
    }
    println!("{n} rounds");
    Ok(())
}

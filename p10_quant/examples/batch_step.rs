//! Batched decode tok/s at batch 1..64 (one token for each of B sequences
//! at one position), native weights: a quick look before the bench command.
//! `cargo run --release -p p10_quant --example batch_step [pos] [samples]`.
fn main() -> anyhow::Result<()> {
    let path =
        common::assets::ensure(common::assets::Asset::SmolLm2).map_err(anyhow::Error::msg)?;
    let arg = |i: usize, d: usize| std::env::args().nth(i).map_or(Ok(d), |s| s.parse());
    let (pos, samples) = (arg(1, 64)?, arg(2, 7)?);
    let loaded = if std::env::var("F32").is_ok() {
        p10_quant::loader::load(&path, p10_quant::Weights::F32)?
    } else {
        let f32_rows = std::env::var("F32_ROWS").map_or(Ok(usize::MAX), |s| s.parse())?;
        let w = p10_quant::NativeWeights {
            f32_rows,
            ..p10_quant::NativeWeights::detect()
        };
        p10_quant::loader::load_native(&path, w)?
    };
    let mut base = 0.0;
    let batches: Vec<usize> = match std::env::var("BATCHES") {
        Ok(s) => s.split(',').map(|b| b.parse()).collect::<Result<_, _>>()?,
        Err(_) => vec![1, 2, 4, 8, 16, 32, 64],
    };
    for b in batches {
        let p = p07_batching::bench::measure(&loaded.engine, b, pos, samples)?;
        let t = p.batched_tok_per_s();
        if b == 1 {
            base = t;
        }
        println!(
            "batch {b:2} pos {pos}: {t:7.1} tok/s (p95 step {:.2} ms), {:.2}x batch 1",
            p.batched.p95 * 1e3,
            t / base
        );
    }
    Ok(())
}

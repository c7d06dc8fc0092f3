//! KL(f32 ‖ native) and top-1 agreement on the bench's three prompts, for
//! every kernel path this CPU has (the integer path at every position):
//! `cargo run --release -p p10_quant --example kl_paths`. The paths differ
//! only in the order they sum in, so this shows how much of the measured
//! KL is rounding rather than quantisation.
fn main() -> anyhow::Result<()> {
    use p10_quant::{Dot, Isa, NativeWeights};
    let path =
        common::assets::ensure(common::assets::Asset::SmolLm2).map_err(anyhow::Error::msg)?;
    let f = p10_quant::loader::load(&path, p10_quant::Weights::F32)?;
    let tok = f
        .tokenizer
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("the model has no tokenizer"))?;
    let prompts: Vec<Vec<u32>> = p10_quant::bench::ACCURACY_PROMPTS
        .iter()
        .map(|t| tok.encode(t))
        .collect();
    for isa in Isa::available() {
        let w = NativeWeights {
            dot: Dot::new(isa)?,
            f32_rows: usize::MAX,
        };
        let n = p10_quant::loader::load_native(&path, w)?;
        let (kl, top1) = p10_quant::bench::accuracy(&f.engine, &n.engine, &prompts)?;
        println!("{isa}: KL {kl:.5}, top-1 {top1:.3}");
    }
    Ok(())
}

//! KL(f32 ‖ native) and top-1 agreement on the bench's three prompts, for
//! every kernel path this CPU has (the integer path at every position):
//! `cargo run --release -p p10_quant --example kl_paths`. The paths differ
//! only in the order they sum in, so this shows how much of the measured
//! KL is rounding rather than quantisation.
fn main() -> anyhow::Result<()> {
    use p10_quant::{Dot, Isa, NativeWeights};
    let path =
        common::assets::ensure(common::assets::Asset::SmolLm2).map_err(anyhow::Error::msg)?;
    let f = p10_quant::loader::load(&path, false)?;
    let tok = f.tokenizer.as_ref().unwrap();
    let prompts: Vec<Vec<u32>> = [
        "The keeper of the lighthouse wrote in his log every evening: the wind, the ships that passed, the colour of the sea.",
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
        "Photosynthesis is the process by which green plants use sunlight to make food from carbon dioxide and water.",
    ]
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

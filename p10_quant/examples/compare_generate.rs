//! Greedy text from the f32 and native paths side by side:
//! `cargo run --release -p p10_quant --example compare_generate -- "prompt"`.
use p05_kv_cache::generate::{generate, GenerateParams};

fn main() -> anyhow::Result<()> {
    let path =
        common::assets::ensure(common::assets::Asset::SmolLm2).map_err(anyhow::Error::msg)?;
    let q = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "What is the capital of France?".into());
    for (name, native, f32_rows) in [
        ("f32", false, 0),
        ("native", true, 16),
        ("native int-only", true, usize::MAX),
    ] {
        let l = if native {
            p10_quant::loader::load_native(
                &path,
                p10_quant::NativeWeights {
                    f32_rows,
                    ..p10_quant::NativeWeights::detect()
                },
            )?
        } else {
            p10_quant::loader::load(&path, p10_quant::Weights::F32)?
        };
        let tok = std::sync::Arc::new(l.tokenizer.unwrap());
        let ids = p04_transformer::PromptBuilder::new(tok.clone())?
            .encode_chat(&[("user", q.as_str())])?;
        let g = generate(&l.engine, &tok, &ids, &GenerateParams::greedy(24), |_| {})?;
        println!("{name}: {:?}", g.text);
    }
    Ok(())
}

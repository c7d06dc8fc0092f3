//! The perplexity harness against transformers: the f32 path's scores on
//! the first two chunks of the perplexity text (Moby-Dick, 512 tokens per
//! chunk, the second half scored) equal transformers' f32 scores on the
//! same token ids (`scripts/export_p10_ppl_reference.py`), and the native
//! path's KL divergence from f32 over them stays inside the bound
//! `native_engine.rs` states.

use p10_quant::perplexity::compare;
use p10_quant::NativeWeights;

#[derive(serde::Deserialize)]
struct Chunk {
    ids: Vec<u32>,
    nll_sum: f64,
    scored: usize,
}

#[derive(serde::Deserialize)]
struct Reference {
    ctx: usize,
    first_scored: usize,
    chunks: Vec<Chunk>,
}

#[test]
fn f32_scores_match_transformers_and_native_stays_close() {
    let fx = p10_quant_fixture("ppl_reference.json");
    let r: Reference = serde_json::from_str(&std::fs::read_to_string(&fx).unwrap()).unwrap();
    assert_eq!(
        r.first_scored,
        r.ctx / 2,
        "the harness scores the second half"
    );
    let path =
        common::assets::ensure(common::assets::Asset::SmolLm2).unwrap_or_else(|e| panic!("{e}"));
    let f32e = p05_kv_cache::load::load(&path).unwrap();
    let nat = p10_quant::loader::load_native(
        &path,
        NativeWeights {
            f32_rows: usize::MAX,
            ..NativeWeights::detect()
        },
    )
    .unwrap();
    let ids: Vec<u32> = r.chunks.iter().flat_map(|c| c.ids.clone()).collect();
    let mut per_chunk = Vec::new();
    let c = compare(
        &f32e.engine,
        &[&nat.engine],
        &ids,
        r.ctx,
        None,
        |done, _, c| per_chunk.push((done, c[0].base.nll.mean())),
    )
    .unwrap()
    .remove(0);
    let scored: usize = r.chunks.iter().map(|c| c.scored).sum();
    assert_eq!(c.base.nll.count() as usize, scored);
    assert_eq!(c.chunks, r.chunks.len());
    // Mean NLL over the scored tokens, ours vs transformers'. Both are f32
    // forwards of the same weights, summed in different orders: logits
    // differ by ~1e-5 of their scale (measured: the means agree to 1e-6
    // nats). A scoring bug (an off-by-one
    // position, a wrong chunk start) moves the mean by a nat or more.
    let want = r.chunks.iter().map(|c| c.nll_sum).sum::<f64>() / scored as f64;
    let got = c.base.nll.mean();
    eprintln!(
        "mean NLL: ours {got:.6}, transformers {want:.6}; PPL {:.4} ± {:.4}",
        c.base.ppl(),
        c.base.ppl_err()
    );
    assert!((got - want).abs() < 1e-4, "mean NLL {got} vs {want}");
    // The first chunk alone, too (the running mean after chunk 1).
    let want0 = r.chunks[0].nll_sum / r.chunks[0].scored as f64;
    assert!(
        (per_chunk[0].1 - want0).abs() < 1e-4,
        "{per_chunk:?} vs {want0}"
    );
    // The native path (8-bit activations) over the same tokens.
    eprintln!(
        "native: KL {:.5} ± {:.5}, top-1 {:.1}%",
        c.kl.mean(),
        c.kl.stderr(),
        c.top1.mean() * 100.0
    );
    assert!(c.kl.mean() < 0.01 && c.top1.mean() >= 0.90);
}

fn p10_quant_fixture(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
}

//! The prefill worker's tap: a sequence whose first positions were
//! already in its store (a prefix-cache hit) still streams every position
//! from 0, the cached ones read back from the store before the first new
//! write of each layer, and each exactly once.

use std::sync::Arc;

use common::batch::KvStore;
use p05_kv_cache::kv_cache::KvCache;
use p08_continuous::kv_transfer::{KvDtype, KvLayout};
use p14_distributed::live::Live;
use p14_distributed::tap::TapStore;

const LAYOUT: KvLayout = KvLayout {
    n_layer: 2,
    n_kv_head: 2,
    head_start: 0,
    head_dim: 4,
    block_size: 4,
    dtype: KvDtype::F32,
};

/// Rows (n, n_kv_head * head_dim) of positions `p0..p1`, distinct values.
fn rows(layer: usize, p0: usize, p1: usize, v: bool) -> Vec<f32> {
    (p0..p1)
        .flat_map(|p| {
            (0..8).map(move |j| (layer * 1000 + p * 10 + j) as f32 + v as u8 as f32 * 0.5)
        })
        .collect()
}

#[test]
fn a_cached_prefix_is_backfilled_from_the_store_then_new_positions_follow() {
    let (cached, tokens) = (6, 10);
    let mut cache = KvCache::new(2, 2, 4, 16);
    for layer in 0..2 {
        let (k, v) = (rows(layer, 0, cached, false), rows(layer, 0, cached, true));
        cache.write(layer, &k, &v, cached);
    }
    cache.advance(cached);
    let live = Arc::new(Live::new(LAYOUT, tokens));
    let mut tapped = TapStore::tapped(&mut cache, Some(live.clone()));
    for layer in 0..2 {
        let (k, v) = (
            rows(layer, cached, tokens, false),
            rows(layer, cached, tokens, true),
        );
        tapped.write(layer, &k, &v, tokens - cached);
        assert_eq!(live.filled(layer), tokens, "layer {layer}");
    }
    tapped.advance(tokens - cached);
    // What a tap on an uncached prompt would have written.
    let want = Live::new(LAYOUT, tokens);
    for layer in 0..2 {
        let (k, v) = (rows(layer, 0, tokens, false), rows(layer, 0, tokens, true));
        want.write_rows(layer, 0, tokens, &k, &v);
    }
    let same = live.with_kv(|a| want.with_kv(|b| a == b));
    assert!(same, "the streamed buffer differs from the uncached one");
}

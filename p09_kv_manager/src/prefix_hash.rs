//! Block hashes for prefix caching. A full block's hash chains its
//! parent's: h_i = H(h_{i-1}, tokens of block i, extra keys), so equal
//! hashes mean (barring collisions) equal *prefixes*, not just equal
//! blocks. Extra keys (a per-request `cache_salt`) keep tenants apart. A
//! hit is always confirmed by comparing tokens (see `BlockPool::lookup`),
//! so a collision costs a miss, never wrong keys.

use std::hash::{DefaultHasher, Hash, Hasher};

/// How block hashes are made; a test swaps in one that always collides.
pub trait BlockHasher: Send + Sync + std::fmt::Debug {
    fn hash(&self, parent: Option<u64>, tokens: &[u32], extra: &[u8]) -> u64;
}

/// SipHash with fixed keys (std's `DefaultHasher::new()`): the same
/// prefix hashes the same in every process run.
#[derive(Clone, Copy, Debug, Default)]
pub struct SipBlockHasher;

impl BlockHasher for SipBlockHasher {
    fn hash(&self, parent: Option<u64>, tokens: &[u32], extra: &[u8]) -> u64 {
        let mut h = DefaultHasher::new();
        parent.hash(&mut h);
        tokens.hash(&mut h);
        extra.hash(&mut h);
        h.finish()
    }
}

/// The chained hashes of the full blocks of `tokens`.
pub fn block_hashes(
    hasher: &dyn BlockHasher,
    tokens: &[u32],
    block_size: usize,
    extra: &[u8],
) -> Vec<u64> {
    let mut parent = None;
    tokens
        .chunks_exact(block_size.max(1))
        .map(|block| {
            let h = hasher.hash(parent, block, extra);
            parent = Some(h);
            h
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_chain_over_the_prefix_and_the_salt() {
        let h = SipBlockHasher;
        let a = block_hashes(&h, &[1, 2, 3, 4, 5, 6, 7], 2, b"");
        assert_eq!(a.len(), 3, "only full blocks");
        // Same block tokens after a different prefix: a different hash.
        let b = block_hashes(&h, &[9, 9, 3, 4], 2, b"");
        assert_ne!(a[1], b[1]);
        assert_eq!(a[..2], block_hashes(&h, &[1, 2, 3, 4], 2, b"")[..]);
        assert_ne!(a[0], block_hashes(&h, &[1, 2], 2, b"tenant-b")[0]);
    }
}

//! Block hashes for prefix caching. A full block's hash chains its
//! parent's: h_i = H(h_{i-1}, tokens of block i, extra keys), so equal
//! hashes mean (barring collisions) equal *prefixes*, not just equal
//! blocks. Extra keys (a per-request `cache_salt`) keep tenants apart. A
//! hit is always confirmed by comparing tokens (see `BlockPool::lookup`),
//! so a collision costs a miss, never wrong keys. The hash is the same in
//! every process (see [`Xxh3BlockHasher`]): Project 14's workers publish
//! block hashes and the router compares them across hosts.

use xxhash_rust::xxh3::Xxh3;

/// How block hashes are made; a test swaps in one that always collides.
pub trait BlockHasher: Send + Sync + std::fmt::Debug {
    fn hash(&self, parent: Option<u64>, tokens: &[u32], extra: &[u8]) -> u64;
}

/// XXH3-64 (seed 0) of an explicit little-endian encoding:
///
/// ```text
/// 0:u8 | 1:u8 parent:u64    the parent block's hash, if any
/// n:u32 token:u32*n          the block's tokens
/// m:u32 byte*m               the extra keys (salt)
/// ```
///
/// XXH3 is a specified algorithm and the bytes are spelled out, so every
/// process and build (and another language's XXH3 over the same bytes)
/// gives the same hash: two workers agree on which prefix a block holds.
/// (std's `DefaultHasher` promises no such thing across releases.)
#[derive(Clone, Copy, Debug, Default)]
pub struct Xxh3BlockHasher;

impl BlockHasher for Xxh3BlockHasher {
    fn hash(&self, parent: Option<u64>, tokens: &[u32], extra: &[u8]) -> u64 {
        let mut h = Xxh3::new();
        match parent {
            Some(p) => {
                h.update(&[1]);
                h.update(&p.to_le_bytes());
            }
            None => h.update(&[0]),
        }
        // Lengths above u32::MAX cannot occur (a block, a salt); saturate.
        h.update(
            &u32::try_from(tokens.len())
                .unwrap_or(u32::MAX)
                .to_le_bytes(),
        );
        for t in tokens {
            h.update(&t.to_le_bytes());
        }
        h.update(&u32::try_from(extra.len()).unwrap_or(u32::MAX).to_le_bytes());
        h.update(extra);
        h.digest()
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
        let h = Xxh3BlockHasher;
        let a = block_hashes(&h, &[1, 2, 3, 4, 5, 6, 7], 2, b"");
        assert_eq!(a.len(), 3, "only full blocks");
        // Same block tokens after a different prefix: a different hash.
        let b = block_hashes(&h, &[9, 9, 3, 4], 2, b"");
        assert_ne!(a[1], b[1]);
        assert_eq!(a[..2], block_hashes(&h, &[1, 2, 3, 4], 2, b"")[..]);
        assert_ne!(a[0], block_hashes(&h, &[1, 2], 2, b"tenant-b")[0]);
    }

    /// The hash is XXH3 of the documented bytes, nothing else (no process
    /// state): the one-shot function over the encoding built by hand gives
    /// the same value.
    #[test]
    fn the_hash_is_xxh3_of_the_documented_encoding() {
        let mut bytes = vec![1u8];
        bytes.extend_from_slice(&42u64.to_le_bytes());
        bytes.extend_from_slice(&2u32.to_le_bytes());
        bytes.extend_from_slice(&7u32.to_le_bytes());
        bytes.extend_from_slice(&9u32.to_le_bytes());
        bytes.extend_from_slice(&1u32.to_le_bytes());
        bytes.push(b's');
        let want = xxhash_rust::xxh3::xxh3_64(&bytes);
        assert_eq!(Xxh3BlockHasher.hash(Some(42), &[7, 9], b"s"), want);
    }

    /// A hash does not depend on the process: this test runs itself again
    /// as a child process and compares the child's hash with its own.
    #[test]
    fn two_processes_agree_on_a_hash() {
        let h = Xxh3BlockHasher.hash(Some(3), &[10, 20, 30], b"tenant");
        if std::env::var_os("INFERENCE_LAB_HASH_CHILD").is_some() {
            println!("hash={h}");
            return;
        }
        let exe = std::env::current_exe().unwrap();
        let out = std::process::Command::new(exe)
            .args([
                "--exact",
                "prefix_hash::tests::two_processes_agree_on_a_hash",
            ])
            .args(["--nocapture", "--test-threads=1"])
            .env("INFERENCE_LAB_HASH_CHILD", "1")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        // The harness may print its own words on the same line.
        let child: u64 = text
            .split("hash=")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .unwrap_or_else(|| panic!("the child printed no hash: {text}"))
            .parse()
            .unwrap();
        assert_eq!(child, h);
    }
}

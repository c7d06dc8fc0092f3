//! The block manager on a small pool: allocation, prefix hits confirmed by
//! tokens (even under a hasher that always collides), eviction order,
//! copy-on-write after a fork, and failure without side effects.

use super::*;
use crate::paged_store::PagedStore;
use crate::prefix_hash::BlockHasher;
use common::batch::{KvShape, KvStore};
use p08_continuous::runner::{KvStorage, PlannedSeq, SeqKv};
use std::collections::HashMap;

/// The step's stores as a runner makes them: the recorded copies first,
/// then each (id, K/V length, new tokens) through its block table.
fn stores<'s>(
    m: &mut KvManager,
    st: &'s mut BlockStorage,
    chunks: &[(SeqId, usize, usize)],
) -> Vec<PagedStore<'s>> {
    let mut ops = Vec::new();
    m.take_ops(&mut ops);
    for op in &ops {
        st.apply(op).unwrap();
    }
    let seqs: Vec<PlannedSeq> = chunks
        .iter()
        .map(|&(id, start, n)| PlannedSeq {
            id,
            start,
            tokens: vec![0; n],
            kv: SeqKv::Blocks(m.table(id).unwrap().to_vec()),
            logits: true,
        })
        .collect();
    st.stores(&seqs).unwrap()
}

const SHAPE: KvShape = KvShape {
    n_layer: 2,
    n_kv_head: 1,
    head_dim: 2,
};

fn manager(blocks: usize, hasher: Option<Box<dyn BlockHasher>>) -> KvManager {
    let pool = BlockPool::new(SHAPE, 4, blocks).unwrap();
    match hasher {
        Some(h) => KvManager::with_hasher(pool, true, h),
        None => KvManager::new(pool, true),
    }
}

/// Every hash is 7: only the token comparison tells prefixes apart.
#[derive(Debug)]
struct Colliding;

impl BlockHasher for Colliding {
    fn hash(&self, _: Option<u64>, _: &[u32], _: &[u8]) -> u64 {
        7
    }
}

#[test]
fn admission_reserves_blocks_and_fails_without_side_effects() {
    let mut m = manager(4, None);
    assert_eq!(m.admit(1, &[1, 2, 3, 4, 5], b"", 9), Some(0));
    assert_eq!(m.table(1).unwrap().len(), 3);
    assert_eq!(m.pool().num_free(), 1);
    assert_eq!(m.admit(2, &[9; 5], b"", 5), None, "2 blocks needed, 1 free");
    assert_eq!(m.pool().num_free(), 1);
    assert!(m.table(2).is_none());
    assert!(m.grow(1, 9, 13));
    assert!(!m.grow(1, 13, 17), "no block left");
    assert_eq!(m.table(1).unwrap().len(), 4);
    m.free(1);
    assert_eq!(m.pool().num_free(), 4);
}

#[test]
fn a_cached_prefix_is_reused_but_the_last_token_is_always_computed() {
    let mut m = manager(8, None);
    let prompt: Vec<u32> = (0..10).collect();
    m.admit(1, &prompt, b"", 11).unwrap();
    m.commit(1, &prompt, b"", 10); // blocks 0 and 1 are full: cached
    let first = m.table(1).unwrap()[..2].to_vec();
    m.free(1);
    // Same 8-token prefix: two blocks hit, positions 8.. computed.
    let mut other: Vec<u32> = (0..8).collect();
    other.extend([77, 78]);
    assert_eq!(m.admit(2, &other, b"", 11), Some(8));
    assert_eq!(m.table(2).unwrap()[..2], first[..]);
    // A prompt that is exactly the cached blocks keeps its last block to compute.
    let exact: Vec<u32> = (0..8).collect();
    assert_eq!(m.admit(3, &exact, b"", 9), Some(4));
    // A different salt shares nothing.
    assert_eq!(m.admit(4, &other, b"tenant", 11), Some(0));
    let s = m.prefix_stats();
    assert_eq!((s.queries, s.hits), (10 + 10 + 8 + 10, 8 + 4));
}

#[test]
fn a_colliding_hash_never_serves_another_prefixs_blocks() {
    let mut m = manager(8, Some(Box::new(Colliding)));
    let a: Vec<u32> = (0..9).collect();
    m.admit(1, &a, b"", 9).unwrap();
    m.commit(1, &a, b"", 9);
    m.free(1);
    // Same hash (7) for every block, different tokens: no hit.
    let b: Vec<u32> = (100..109).collect();
    assert_eq!(m.admit(2, &b, b"", 9), Some(0));
    // The same tokens still hit (the first block; the second's hash is
    // taken by the first block, so it is not cached twice).
    assert_eq!(m.admit(3, &a, b"", 9), Some(4));
    // A prompt whose two blocks are equal: block 0 hits; block 1 has the
    // same hash and tokens as a cached block, but not the same prefix
    // before it (it would be position 0's keys served at positions 4..8).
    let mut m = manager(8, Some(Box::new(Colliding)));
    let twice = [5, 5, 5, 5, 5, 5, 5, 5, 5];
    m.admit(4, &twice, b"", 9).unwrap();
    m.commit(4, &twice, b"", 9);
    m.free(4);
    assert_eq!(m.admit(5, &twice, b"", 9), Some(4));
    let t = m.table(5).unwrap();
    assert_ne!(t[0], t[1], "one block twice in a table");
}

#[test]
fn free_blocks_stay_cached_until_evicted_tail_first() {
    let mut m = manager(3, None);
    let p: Vec<u32> = (0..12).collect();
    m.admit(1, &p, b"", 12).unwrap();
    m.commit(1, &p, b"", 12);
    let table = m.table(1).unwrap().to_vec();
    m.free(1);
    assert_eq!(m.pool().num_cached_free(), 3);
    // One new block evicts the tail (block 2) first.
    m.admit(2, &[500], b"", 1).unwrap();
    assert_eq!(m.table(2).unwrap(), &table[2..3]);
    assert!(!m.pool().is_cached(table[2]));
    assert!(m.pool().is_cached(table[0]) && m.pool().is_cached(table[1]));
    // The prefix is still served.
    m.free(2);
    assert_eq!(m.admit(3, &p[..9], b"", 9), Some(8));
}

#[test]
fn a_fork_shares_blocks_and_copies_a_shared_block_before_writing_it() {
    let mut m = manager(6, None);
    let p: Vec<u32> = (0..6).collect();
    m.admit(1, &p, b"", 7).unwrap();
    let mut st = m.new_storage();
    {
        // Write something into the parent's partial block 1 (positions 4, 5).
        let mut s = stores(&mut m, &mut st, &[(1, 0, 6)]);
        let rows: Vec<f32> = (0..6 * 2).map(|x| x as f32).collect();
        for l in 0..2 {
            s[0].write(l, &rows, &rows, 6);
        }
    }
    assert!(m.fork(1, 2));
    let shared = m.table(1).unwrap().to_vec();
    assert_eq!(m.table(2).unwrap(), &shared[..]);
    assert_eq!(m.pool().ref_count(shared[1]), 2);
    // The child appends at position 6: block 1 is copied first.
    assert!(m.grow(2, 6, 7));
    let child = m.table(2).unwrap().to_vec();
    assert_eq!(child[0], shared[0], "the full block stays shared");
    assert_ne!(child[1], shared[1]);
    assert_eq!(m.pool().ref_count(shared[1]), 1);
    // The copy carries the parent's positions 4 and 5.
    let stores = stores(&mut m, &mut st, &[(2, 6, 1)]);
    let mut seen = Vec::new();
    stores[0].for_each_run(1, 0, 6, &mut |p0, k, _| seen.push((p0, k.to_vec())));
    assert_eq!(seen[1], (4, vec![8.0, 9.0, 10.0, 11.0]));
}

/// Block conservation under a random workload of admit / grow / commit /
/// fork / free (evictions happen as allocations take cached free blocks):
/// every block is either free or held, and held blocks' reference counts
/// are exactly the number of tables that hold them.
#[test]
fn blocks_are_conserved_under_a_random_workload() {
    let mut rng = common::rng::Rng::new(9);
    let mut m = manager(24, None);
    // Live sequences: id → known tokens.
    let mut live: Vec<(SeqId, Vec<u32>)> = Vec::new();
    let mut next: SeqId = 0;
    for round in 0..3000 {
        match rng.below(5) {
            0 => {
                // A prompt from a small alphabet, so prefixes repeat.
                let n = 1 + rng.below(20) as usize;
                let tokens: Vec<u32> = (0..n).map(|_| rng.below(3) as u32).collect();
                if m.admit(next, &tokens, b"", n + 1).is_some() {
                    live.push((next, tokens));
                }
                next += 1;
            }
            1 if !live.is_empty() => {
                let i = rng.below(live.len() as u64) as usize;
                let (id, tokens) = &mut live[i];
                let len = tokens.len();
                if m.grow(*id, len, len + 1) {
                    tokens.push(rng.below(3) as u32);
                    m.commit(*id, tokens, b"", tokens.len());
                }
            }
            2 if !live.is_empty() => {
                let i = rng.below(live.len() as u64) as usize;
                let (id, _) = live.swap_remove(i);
                m.free(id);
            }
            3 if !live.is_empty() => {
                let i = rng.below(live.len() as u64) as usize;
                let parent = live[i].clone();
                if m.fork(parent.0, next) {
                    live.push((next, parent.1));
                }
                next += 1;
            }
            _ => {}
        }
        // Conservation.
        let pool = m.pool();
        let mut held: HashMap<BlockId, u32> = HashMap::new();
        for (id, tokens) in &live {
            let table = m.table(*id).unwrap();
            assert!(
                table.len() * 4 >= tokens.len(),
                "round {round}: table too short"
            );
            for &b in table {
                *held.entry(b).or_default() += 1;
            }
        }
        for b in 0..pool.num_blocks() as BlockId {
            assert_eq!(
                pool.ref_count(b),
                held.get(&b).copied().unwrap_or(0),
                "round {round}, block {b}"
            );
        }
        assert_eq!(
            pool.num_free() + held.len(),
            pool.num_blocks(),
            "round {round}"
        );
        assert!(pool.num_cached_free() <= pool.num_free());
        assert_eq!(
            pool.num_cached_free(),
            pool.count_cached_free(),
            "round {round}"
        );
        assert!(pool.cache_is_consistent(), "round {round}");
    }
}

//! Paged blocks as Project 08's K/V backend: the continuous scheduler now
//! admits and preempts on free blocks, an admitted request starts with the
//! tokens its cached prefix already covers, and each step's plan carries
//! the block tables the runner reads and writes through.

use common::batch::KvShape;
use p08_continuous::kv_backend::{KvAllocator, KvBackend, KvMetric};
use p08_continuous::runner::{KvOp, SeqKv};
use p08_continuous::scheduler::SeqId;

use crate::block_pool::{BlockPool, PoolError};
use crate::block_storage::BlockStorage;
use crate::manager::KvManager;

/// The core's side of paged K/V: the block manager. The blocks' memory
/// is the runner's [`BlockStorage`].
#[derive(Debug)]
pub struct PagedKv {
    m: KvManager,
}

impl PagedKv {
    /// A pool of `bytes` in blocks of `block_size` positions.
    pub fn new(
        shape: KvShape,
        block_size: usize,
        bytes: usize,
        prefix_caching: bool,
    ) -> Result<PagedKv, PoolError> {
        let pool = BlockPool::with_bytes(shape, block_size, bytes)?;
        Ok(PagedKv::from_manager(KvManager::new(pool, prefix_caching)))
    }

    pub fn from_manager(m: KvManager) -> PagedKv {
        PagedKv { m }
    }

    pub fn manager(&self) -> &KvManager {
        &self.m
    }
}

impl KvAllocator for PagedKv {
    fn admit(&mut self, id: SeqId, tokens: &[u32], salt: &[u8], max_len: usize) -> Option<usize> {
        // Room for the known tokens and the first decode (one block at a time after).
        let reserve = (tokens.len() + 1).min(max_len.max(tokens.len()));
        self.m.admit(id, tokens, salt, reserve)
    }

    fn grow(&mut self, id: SeqId, start: usize, end: usize, _max_len: usize) -> bool {
        self.m.grow(id, start, end)
    }

    fn free(&mut self, id: SeqId) {
        self.m.free(id);
    }

    /// The child shares every block; the partial last one is copied when
    /// either writes into it.
    fn fork(&mut self, parent: SeqId, child: SeqId) -> bool {
        self.m.fork(parent, child)
    }

    fn capacity_positions(&self) -> usize {
        self.m.pool().num_blocks() * self.m.block_size()
    }
}

impl KvBackend for PagedKv {
    type Storage = BlockStorage;

    fn new_storage(&self) -> BlockStorage {
        self.m.new_storage()
    }

    fn seq_kv(&self, id: SeqId) -> Option<SeqKv> {
        self.m.table(id).map(|t| SeqKv::Blocks(t.to_vec()))
    }

    fn forget_cached(&mut self) {
        self.m.forget_cached();
    }

    fn take_ops(&mut self, into: &mut Vec<KvOp>) {
        self.m.take_ops(into);
    }

    fn admit_computed(&mut self, id: SeqId, tokens: &[u32], max_len: usize) -> bool {
        let reserve = (tokens.len() + 1).min(max_len.max(tokens.len()));
        self.m.admit_fresh(id, tokens, reserve)
    }

    fn commit(&mut self, id: SeqId, tokens: &[u32], salt: &[u8], computed: usize) {
        self.m.commit(id, tokens, salt, computed);
    }

    fn used_bytes(&self) -> usize {
        self.m.used_blocks() * self.m.pool().block_bytes()
    }

    fn capacity_bytes(&self) -> usize {
        self.m.pool().num_blocks() * self.m.pool().block_bytes()
    }

    fn metrics(&self) -> Vec<KvMetric> {
        let p = self.m.prefix_stats();
        let pool = self.m.pool();
        vec![
            KvMetric {
                name: "vllm:prefix_cache_queries",
                help: "Prompt tokens looked up in the prefix cache.",
                kind: "counter",
                value: p.queries as f64,
                rank: None,
            },
            KvMetric {
                name: "vllm:prefix_cache_hits",
                help: "Prompt tokens served from the prefix cache.",
                kind: "counter",
                value: p.hits as f64,
                rank: None,
            },
            KvMetric {
                name: "vllm:kv_cache_usage_perc",
                help: "Fraction of the K/V pool held by sequences (0 to 1).",
                kind: "gauge",
                value: pool.num_blocks().saturating_sub(pool.num_free()) as f64
                    / pool.num_blocks().max(1) as f64,
                rank: None,
            },
            KvMetric {
                name: "inference_lab:kv_blocks_total",
                help: "Blocks in the K/V pool.",
                kind: "gauge",
                value: pool.num_blocks() as f64,
                rank: None,
            },
            KvMetric {
                name: "inference_lab:kv_blocks_free",
                help: "Blocks no sequence holds (cached ones included).",
                kind: "gauge",
                value: pool.num_free() as f64,
                rank: None,
            },
            KvMetric {
                name: "inference_lab:kv_blocks_cached_free",
                help: "Free blocks that still hold a cached prefix.",
                kind: "gauge",
                value: pool.num_cached_free() as f64,
                rank: None,
            },
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(kv: &PagedKv) -> f64 {
        kv.metrics()
            .iter()
            .find(|m| m.name == "vllm:kv_cache_usage_perc")
            .map(|m| m.value)
            .expect("the usage gauge")
    }

    #[test]
    fn kv_usage_counts_the_blocks_sequences_hold_not_the_cached_free_ones() {
        let shape = KvShape {
            n_layer: 1,
            n_kv_head: 1,
            head_dim: 2,
        };
        // 8 blocks of 4 positions.
        let bytes = 8 * 4 * shape.bytes_per_position();
        let mut kv = PagedKv::new(shape, 4, bytes, true).unwrap();
        assert_eq!(usage(&kv), 0.0);
        let prompt: Vec<u32> = (0..8).collect();
        assert_eq!(kv.admit(1, &prompt, b"", 16), Some(0));
        // 8 tokens + the first decode: 3 blocks of 8.
        assert_eq!(usage(&kv), 3.0 / 8.0);
        kv.commit(1, &prompt, b"", 8);
        kv.free(1);
        assert_eq!(usage(&kv), 0.0, "cached blocks are free to take");
    }
}

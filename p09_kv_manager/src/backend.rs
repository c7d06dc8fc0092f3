//! Paged blocks as Project 08's K/V backend: the continuous scheduler now
//! admits and preempts on free blocks, an admitted request starts with the
//! tokens its cached prefix already covers, and each step reads and writes
//! through block tables.

use std::collections::HashMap;

use common::batch::KvShape;
use p08_continuous::kv_backend::{Chunk, KvAllocator, KvBackend, KvMetric};
use p08_continuous::scheduler::SeqId;

use crate::block_pool::{BlockPool, PoolError};
use crate::manager::KvManager;
use crate::paged_store::PagedStore;

#[derive(Debug)]
pub struct PagedKv {
    m: KvManager,
    /// Requests' `cache_salt`s, kept across preemptions.
    salts: HashMap<SeqId, Vec<u8>>,
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
        PagedKv {
            m,
            salts: HashMap::new(),
        }
    }

    pub fn manager(&self) -> &KvManager {
        &self.m
    }
}

impl KvAllocator for PagedKv {
    fn admit(&mut self, id: SeqId, tokens: &[u32], max_len: usize) -> Option<usize> {
        // Room for the known tokens and the first decode (one block at a time after).
        let reserve = (tokens.len() + 1).min(max_len.max(tokens.len()));
        let salt = self.salts.get(&id).map_or(&[][..], Vec::as_slice);
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
    type Store<'s> = PagedStore<'s>;
    type Error = PoolError;

    fn stores(&mut self, chunks: &[Chunk]) -> Result<Vec<PagedStore<'_>>, PoolError> {
        let chunks: Vec<(SeqId, usize, usize)> =
            chunks.iter().map(|c| (c.id, c.start, c.len)).collect();
        self.m.stores(&chunks)
    }

    fn commit(&mut self, id: SeqId, tokens: &[u32], computed: usize) {
        self.m.commit(id, tokens, computed);
    }

    fn set_salt(&mut self, id: SeqId, salt: &[u8]) {
        if !salt.is_empty() {
            self.salts.insert(id, salt.to_vec());
        }
    }

    fn release(&mut self, id: SeqId) {
        self.salts.remove(&id);
        self.m.free(id);
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
            },
            KvMetric {
                name: "vllm:prefix_cache_hits",
                help: "Prompt tokens served from the prefix cache.",
                kind: "counter",
                value: p.hits as f64,
            },
            KvMetric {
                name: "inference_lab:kv_blocks_total",
                help: "Blocks in the K/V pool.",
                kind: "gauge",
                value: pool.num_blocks() as f64,
            },
            KvMetric {
                name: "inference_lab:kv_blocks_free",
                help: "Blocks no sequence holds (cached ones included).",
                kind: "gauge",
                value: pool.num_free() as f64,
            },
            KvMetric {
                name: "inference_lab:kv_blocks_cached_free",
                help: "Free blocks that still hold a cached prefix.",
                kind: "gauge",
                value: pool.num_cached_free() as f64,
            },
        ]
    }
}

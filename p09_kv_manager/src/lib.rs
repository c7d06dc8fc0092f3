//! Project 09: paged KV memory. The bookkeeping of a pool of fixed-size
//! blocks ([`block_pool`]), per-sequence block tables with prefix caching,
//! copy-on-write and forks ([`manager`]), all on the engine core's side;
//! the blocks' memory on the runner's ([`block_storage`]), and each
//! sequence's table as the `KvStore` the batched step reads through
//! ([`paged_store`]): the attention walks one run per block, no copy. [`backend`] puts it under
//! Project 08's scheduler: admission and preemption on free blocks,
//! admitted requests starting after their cached prefix.

pub mod backend;
#[cfg(feature = "bench")]
pub mod bench;
pub mod block_pool;
pub mod block_storage;
pub mod manager;
pub mod paged_store;
pub mod prefix_hash;
#[cfg(feature = "http")]
pub mod serve;

pub use backend::PagedKv;
pub use block_pool::{BlockId, BlockPool, PoolError};
pub use block_storage::BlockStorage;
pub use manager::{KvManager, PrefixStats};
pub use paged_store::PagedStore;

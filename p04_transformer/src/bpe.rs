//! The BPE merge loop on token ids: merge the adjacent pair of lowest rank
//! (leftmost on ties) until none applies.
//!
//! ```text
//! ids      a  a  a  a          one symbol per byte of the pre-token
//! heap     (rank(a,a), 0) (rank(a,a), 1) (rank(a,a), 2)
//! pop 0 -> aa  a  a            merge right into left, unlink the right
//!          push the new pairs (prev, aa) and (aa, next); entries whose
//!          symbols changed since they were pushed are skipped when popped
//! ```
//!
//! Each merge removes a symbol and pushes at most two pairs, so a pre-token
//! of n bytes costs O(n log n): a 1 MiB run of one letter is one pre-token,
//! and the naive loop ([`merge_naive`], rescanning every pair after every
//! merge) takes O(n²) on it (13 s for 12,500 characters when it also
//! cloned strings).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

/// Ranked merges over token ids: (left, right) → (rank, merged id).
#[derive(Debug, Default)]
pub struct Merges {
    /// Keyed by left << 32 | right.
    table: HashMap<u64, (u32, u32), BuildHasherDefault<PairHash>>,
}

/// A multiplicative hash for the packed id pair (SipHash, the default, was
/// half of the merge loop's time; the keys are not attacker-chosen: they
/// come from the vocabulary, and lookups of absent pairs cost the same).
#[derive(Debug, Default)]
pub struct PairHash(u64);

impl Hasher for PairHash {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_u64(&mut self, v: u64) {
        // Fibonacci hashing: the high bits the table uses depend on all of v.
        self.0 = (self.0 ^ v)
            .wrapping_mul(0x9e37_79b9_7f4a_7c15)
            .rotate_left(26);
    }
}

/// "No neighbour" in the linked list of symbols.
const NONE: u32 = u32::MAX;

fn key(l: u32, r: u32) -> u64 {
    u64::from(l) << 32 | u64::from(r)
}

impl Merges {
    /// From merges in rank order, as (left, right, merged) ids; a pair seen
    /// twice keeps its first (lowest) rank.
    pub fn new(ranked: impl IntoIterator<Item = (u32, u32, u32)>) -> Merges {
        let mut table = HashMap::default();
        for (rank, (l, r, m)) in (0u32..).zip(ranked) {
            table.entry(key(l, r)).or_insert((rank, m));
        }
        Merges { table }
    }

    pub fn len(&self) -> usize {
        self.table.len()
    }

    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    fn get(&self, l: u32, r: u32) -> Option<(u32, u32)> {
        self.table.get(&key(l, r)).copied()
    }

    /// Merge `ids` in place (the fast path): a heap of candidate pairs
    /// keyed by (rank, position), over a linked list of live symbols.
    pub fn merge(&self, ids: &mut Vec<u32>) {
        let n = ids.len();
        if n < 2 {
            return;
        }
        // Positions as u32 keep a heap entry at 16 bytes; no pre-token
        // reaches 4 Gi bytes (request bodies are capped far below), and one
        // that did would take the naive loop rather than a panic.
        if u32::try_from(n).is_err() {
            return self.merge_naive(ids);
        }
        let at = |i: u32| i as usize;
        let mut next: Vec<u32> = (1..=n as u32)
            .map(|j| if at(j) == n { NONE } else { j })
            .collect();
        let mut prev: Vec<u32> = (0..n as u32)
            .map(|i| i.checked_sub(1).unwrap_or(NONE))
            .collect();
        let mut alive = vec![true; n];
        // Reverse((rank, left position, left id, right id)): a min-heap,
        // built in one O(n) heapify.
        let first: Vec<_> = (0..n as u32 - 1)
            .filter_map(|i| {
                let (l, r) = (ids[at(i)], ids[at(i) + 1]);
                let (rank, _) = self.get(l, r)?;
                Some(Reverse((rank, i, l, r)))
            })
            .collect();
        let mut heap = BinaryHeap::from(first);
        while let Some(Reverse((_, i, l, r))) = heap.pop() {
            let j = next[at(i)];
            // Stale: the left symbol was merged away or changed, or its
            // right neighbour is no longer the one this pair was made with.
            if !alive[at(i)] || ids[at(i)] != l || j == NONE || ids[at(j)] != r {
                continue;
            }
            let Some((_, merged)) = self.get(l, r) else {
                continue;
            };
            ids[at(i)] = merged;
            alive[at(j)] = false;
            let after = next[at(j)];
            next[at(i)] = after;
            if after != NONE {
                prev[at(after)] = i;
            }
            let p = prev[at(i)];
            if p != NONE {
                if let Some((rank, _)) = self.get(ids[at(p)], merged) {
                    heap.push(Reverse((rank, p, ids[at(p)], merged)));
                }
            }
            if after != NONE {
                if let Some((rank, _)) = self.get(merged, ids[at(after)]) {
                    heap.push(Reverse((rank, i, merged, ids[at(after)])));
                }
            }
        }
        let mut out = Vec::with_capacity(n);
        let mut k = 0;
        while k != NONE {
            out.push(ids[at(k)]);
            k = next[at(k)];
        }
        *ids = out;
    }

    /// The reference: find the lowest-ranked adjacent pair (leftmost on
    /// ties) by scanning them all, merge it, repeat. O(n²).
    pub fn merge_naive(&self, ids: &mut Vec<u32>) {
        loop {
            let best = ids
                .windows(2)
                .enumerate()
                .filter_map(|(i, w)| self.get(w[0], w[1]).map(|(rank, m)| (rank, i, m)))
                .min();
            let Some((_, i, merged)) = best else { break };
            ids[i] = merged;
            ids.remove(i + 1);
        }
    }
}

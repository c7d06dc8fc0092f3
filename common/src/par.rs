//! The seam for splitting a step's work across threads: whoever runs the
//! heavy products (Project 10's spinning pool) can run the rest of the
//! step (attention) on the same threads, so one forward never has two
//! thread pools competing for the same cores.

use std::ops::Range;

/// Runs `f` over a split of `0..n` into at most `parts` contiguous ranges,
/// in parallel, and returns when every range is done.
pub trait ForRanges: Send + Sync + std::fmt::Debug {
    /// Threads a split can use (the caller's included).
    fn threads(&self) -> usize;

    fn for_ranges(&self, n: usize, parts: usize, f: &(dyn Fn(Range<usize>) + Sync));
}

/// Everything on the calling thread, in order.
#[derive(Clone, Copy, Debug, Default)]
pub struct Serial;

impl ForRanges for Serial {
    fn threads(&self) -> usize {
        1
    }

    fn for_ranges(&self, n: usize, _parts: usize, f: &(dyn Fn(Range<usize>) + Sync)) {
        f(0..n)
    }
}

/// Part `i` of `n` split into `parts` contiguous ranges as evenly as whole
/// items allow (the first ranges one longer; some empty when parts > n).
pub fn part(n: usize, parts: usize, i: usize) -> Range<usize> {
    let parts = parts.max(1);
    let (q, r) = (n / parts, n % parts);
    let lo = i * q + i.min(r);
    lo..lo + q + usize::from(i < r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_everything_once_in_order() {
        for n in [0usize, 1, 2, 7, 64, 65] {
            for parts in [0usize, 1, 2, 3, 8, 100] {
                let flat: Vec<usize> = (0..parts.max(1)).flat_map(|i| part(n, parts, i)).collect();
                assert_eq!(flat, (0..n).collect::<Vec<_>>(), "n {n} parts {parts}");
            }
        }
    }
}

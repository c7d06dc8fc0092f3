//! A counting global allocator for tests that prove a path allocates nothing
//! (or nothing large). Counts are per thread, so the test harness's own
//! threads cannot make a test fail. In a test binary:
//!
//! ```ignore
//! #[global_allocator]
//! static GLOBAL: common::alloc_count::Counting = common::alloc_count::Counting;
//! ```

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// Forwards to the system allocator, recording calls and sizes per thread.
#[derive(Debug)]
pub struct Counting;

thread_local! {
    static COUNT: Cell<usize> = const { Cell::new(0) };
    static MAX: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    // try_with: during thread teardown the slots may be gone; those are not ours.
    let _ = COUNT.try_with(|c| c.set(c.get() + 1));
    let _ = MAX.try_with(|m| m.set(m.get().max(size)));
}

/// Allocations (and reallocations) made by this thread so far.
pub fn count() -> usize {
    COUNT.with(Cell::get)
}

/// Largest single request by this thread since the last [`reset_max`].
pub fn max_request() -> usize {
    MAX.with(Cell::get)
}

pub fn reset_max() {
    MAX.with(|m| m.set(0));
}

// SAFETY: every call is forwarded unchanged to the system allocator; only
// thread-local counters (const-initialised, no allocation) are touched.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        note(l.size());
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        note(n);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(p, l, n) }
    }
}

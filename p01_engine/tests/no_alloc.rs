//! After one warm-up call, a single-threaded forward pass makes zero heap
//! allocations: proved by counting every allocation in this test binary.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use p01_engine::graph::CompileOptions;
use p01_engine::{Engine, LoadOptions, Workspace};

struct Counting;

thread_local! {
    /// Allocations made by this thread. Counted per thread so that the test
    /// harness's own threads (which may allocate at any time) cannot make the
    /// test fail; the engine runs on the calling thread (threads = 1).
    static ALLOCS: Cell<usize> = const { Cell::new(0) };
}

fn count() {
    // try_with: during thread teardown the slot may be gone; those are not ours.
    let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
}

fn allocs() -> usize {
    ALLOCS.with(Cell::get)
}

// SAFETY: forwards to the system allocator unchanged, only counting calls.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        count();
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        count();
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn forward_into_allocates_nothing_after_warmup() {
    for (model, fuse) in [("mlp", true), ("mlp", false), ("every_op", true)] {
        let opts = LoadOptions {
            threads: 1,
            compile: CompileOptions {
                fuse_linear_relu: fuse,
            },
            ..LoadOptions::default()
        };
        let engine = Engine::load_with(p01_engine::fixtures_dir().join(model), opts).unwrap();
        let per: usize = engine.input_shape().iter().product();
        // Small integers: valid MNIST-like pixels scaled up and valid embedding ids.
        let input: Vec<f32> = (0..64 * per).map(|i| (i % 7) as f32).collect();
        let mut ws = Workspace::default();
        engine.forward_into(&mut ws, &input, 64).unwrap(); // warm-up at the largest batch
        let before = allocs();
        let mut checksum = 0.0f32;
        for batch in [1, 64, 7, 64, 1] {
            let y = engine
                .forward_into(&mut ws, &input[..batch * per], batch)
                .unwrap();
            checksum += y[0];
        }
        let after = allocs();
        assert!(checksum.is_finite());
        assert_eq!(
            after - before,
            0,
            "{model} (fuse {fuse}): forward_into allocated {} times",
            after - before
        );

        // The counter works: the allocating API is seen.
        let t = common::Tensor::new(vec![1, per], input[..per].to_vec()).unwrap();
        let before = allocs();
        engine.forward(&t).unwrap();
        assert!(allocs() > before);
    }
}

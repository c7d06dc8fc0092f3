//! After one warm-up call, a single-threaded forward pass makes zero heap
//! allocations: proved by counting every allocation in this test binary.

use common::alloc_count::count as allocs;
use p01_engine::graph::CompileOptions;
use p01_engine::{Graph, LoadOptions, Workspace};

#[global_allocator]
static GLOBAL: common::alloc_count::Counting = common::alloc_count::Counting;

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
        let engine = Graph::load_with(p01_engine::fixtures_dir().join(model), opts).unwrap();
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

//! Project 03's kernels run on the CPU (see `p03_gpu_kernel::emulate`):
//! `src/kernels.cu`, unchanged, under `tests/emulate/p03_kernels.cpp`, each
//! case against a double-precision reference with the GPU tests'
//! tolerances, under AddressSanitizer.

use std::path::Path;

use p03_gpu_kernel::emulate::{build_and_run, shim_dir};

#[test]
fn the_kernels_agree_with_their_references_when_emulated_on_the_cpu() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let exe = Path::new(env!("CARGO_TARGET_TMPDIR")).join("p03_kernels_emulated");
    let out = build_and_run(
        &shim_dir().join("p03_kernels.cpp"),
        &[root.join("src")],
        &exe,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(!out.contains("FAIL"), "{out}");
    // 8 vector adds, 15 matmuls (5 shapes x 3 kernels), 4 softmax, 4 RMSNorm.
    let passed = out.lines().filter(|l| l.starts_with("PASS ")).count();
    assert_eq!(passed, 31, "{out}");
}

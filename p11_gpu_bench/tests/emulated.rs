//! The STREAM kernels run on the CPU (Project 03's emulation): each one
//! touches every element, for every pass, and nothing outside its arrays.

use std::path::Path;

use p03_gpu_kernel::emulate::build_and_run;

#[test]
fn the_stream_kernels_touch_every_element_when_emulated_on_the_cpu() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let exe = Path::new(env!("CARGO_TARGET_TMPDIR")).join("p11_stream_emulated");
    let out = build_and_run(
        &root.join("tests/emulate_stream.cpp"),
        &[root.join("src")],
        &exe,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(!out.contains("FAIL"), "{out}");
    assert_eq!(
        out.lines().filter(|l| l.starts_with("PASS ")).count(),
        4,
        "{out}"
    );
}

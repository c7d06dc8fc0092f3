//! The kernel sources compile: NVRTC (fetched from its pip wheel, no GPU
//! needed) turns them into PTX for the H200's architecture on every test
//! run, so a typo in the CUDA C fails here and not on the one machine with a
//! GPU.

use common::assets::{ensure, Asset};
use p03_gpu_kernel::gpu::compile;
use p03_gpu_kernel::kernels::{virtual_arch, NAMES};
use p03_gpu_kernel::probe;

fn nvrtc() {
    let dir = ensure(Asset::Nvrtc).unwrap_or_else(|e| panic!("{e}"));
    probe::preload_nvrtc_from(&dir).unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn every_kernel_compiles_to_ptx_for_sm_90() {
    nvrtc();
    let ptx = compile(virtual_arch(9, 0))
        .unwrap_or_else(|e| panic!("{e}"))
        .to_src();
    assert!(
        ptx.contains(".target sm_90"),
        "PTX target:\n{}",
        &ptx[..ptx.len().min(600)]
    );
    for name in NAMES {
        // extern "C" keeps the names unmangled, as `load_function` asks them.
        assert!(
            ptx.contains(&format!(".entry {name}(")),
            "{name} missing from the PTX"
        );
    }
    // The register-blocked kernel keeps its 8x8 accumulator in registers:
    // no local-memory (stack) array in its body.
    let body = ptx.split(".entry matmul_regblock(").nth(1).unwrap();
    let body = body.split(".entry ").next().unwrap();
    assert!(
        !body.contains(".local"),
        "matmul_regblock spills its accumulators to local memory"
    );
}

#[test]
fn a_kernel_with_an_error_is_refused_with_the_compilers_log() {
    nvrtc();
    let opts = cudarc::nvrtc::CompileOptions {
        arch: virtual_arch(9, 0),
        ..Default::default()
    };
    let err = cudarc::nvrtc::compile_ptx_with_opts(
        "extern \"C\" __global__ void broken(float* x) { x[0] = undefined_name; }",
        opts,
    )
    .unwrap_err();
    assert!(format!("{err:?}").contains("undefined_name"), "{err:?}");
}

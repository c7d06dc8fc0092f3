//! The suite's kernels compile (NVRTC from its pip wheel, no GPU), and each
//! pass really touches memory: the compiler has not hoisted the loads or
//! stores out of the pass loop (that would measure registers, not HBM).

use common::assets::{ensure, Asset};
use p03_gpu_kernel::gpu::compile_source;
use p03_gpu_kernel::kernels::virtual_arch;
use p03_gpu_kernel::probe;
use p11_gpu_bench::memory::{NAMES, SOURCE};

fn ptx() -> String {
    let dir = ensure(Asset::Nvrtc).unwrap_or_else(|e| panic!("{e}"));
    probe::preload_nvrtc_from(&dir).unwrap_or_else(|e| panic!("{e}"));
    compile_source("p11_stream.cu", SOURCE, virtual_arch(9, 0))
        .unwrap_or_else(|e| panic!("{e}"))
        .to_src()
}

/// The PTX body of `name`.
fn body<'a>(ptx: &'a str, name: &str) -> &'a str {
    let start = ptx
        .find(&format!(".entry {name}("))
        .unwrap_or_else(|| panic!("{name} missing"));
    let rest = &ptx[start + 1..];
    &ptx[start..start + 1 + rest.find(".entry ").unwrap_or(rest.len())]
}

#[test]
fn every_stream_kernel_compiles_and_keeps_its_memory_traffic_in_the_pass_loop() {
    let ptx = ptx();
    if std::env::var_os("P11_PRINT_PTX").is_some() {
        println!("{ptx}");
    }
    for name in NAMES {
        let b = body(&ptx, name);
        // The pass loop around the unrolled element loop and its tail.
        let branches = b.matches("bra.uni").count() + b.matches("@%p").count();
        assert!(branches >= 3, "{name}: expected nested loops:\n{b}");
        // 16-byte accesses (float4): .v4 loads or stores.
        assert!(
            b.contains(".v4."),
            "{name}: no float4 (16-byte) access:\n{b}"
        );
        if name != "hbm_write" {
            // L2-cached loads (.cg), not L1: every pass re-reads the same
            // elements, and L1 would answer for small arrays.
            assert!(
                b.contains("ld.global.cg"),
                "{name}: no L2-only global load:\n{b}"
            );
            assert!(
                !b.contains("ld.global.nc"),
                "{name}: an L1-cached load:\n{b}"
            );
        }
        if name != "hbm_read" {
            assert!(b.contains("st.global"), "{name}: no global store:\n{b}");
        }
    }
}

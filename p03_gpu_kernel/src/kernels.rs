//! The kernels, as CUDA C that NVRTC compiles at run time for the device in
//! hand, and the launch geometry each one expects.
//!
//! Every matrix is row-major f32; `C[M,N] = A[M,K] · B[K,N]`. Sizes need not
//! be multiples of any tile: every load outside the matrix reads 0 and every
//! store outside it is skipped, so ragged shapes are tested like square ones.

use cudarc::driver::LaunchConfig;

/// Threads per block for the one-dimensional kernels.
pub const BLOCK_1D: u32 = 256;
/// The naive matmul's block: one thread per output, 16 x 16 of them.
pub const NAIVE_TILE: u32 = 16;
/// The shared-memory tiled matmul's tile: TILE x TILE outputs per block,
/// TILE x TILE threads, K walked TILE at a time.
pub const TILE: u32 = 32;
/// The register-blocked matmul: a block computes BM x BN outputs with 256
/// threads, each thread TM x TN of them from registers; K walked BK at a time.
pub const RB_BM: u32 = 128;
pub const RB_BN: u32 = 128;
pub const RB_TM: u32 = 8;
pub const RB_TN: u32 = 8;
/// Threads of the reduction kernels (softmax, RMSNorm): one block per row.
/// Their block reductions shuffle with a full warp mask, so whole warps.
pub const ROW_BLOCK: u32 = 256;
const _: () = assert!(ROW_BLOCK.is_multiple_of(32) && ROW_BLOCK <= 1024);

/// The kernel functions `SOURCE` defines, in the order they appear.
pub const NAMES: [&str; 8] = [
    "empty",
    "vector_add",
    "vector_add4",
    "matmul_naive",
    "matmul_tiled",
    "matmul_regblock",
    "softmax_rows",
    "rmsnorm_rows",
];

/// All of Project 03's kernels in one translation unit.
pub const SOURCE: &str = include_str!("kernels.cu");

/// `ceil(a / b)` for launch geometry.
pub fn div_ceil(a: usize, b: u32) -> usize {
    a.div_ceil(b as usize)
}

fn dim(n: usize, what: &str) -> Result<u32, String> {
    u32::try_from(n).map_err(|_| format!("{what} {n} exceeds a CUDA grid dimension"))
}

/// A grid-stride launch for `n` elements handled `per_thread` at a time: one
/// thread per unit of work up to `max_blocks` blocks (a few per SM keeps all
/// of them busy; more only adds scheduling), at least one block.
pub fn grid_stride(n: usize, per_thread: usize, max_blocks: u32) -> LaunchConfig {
    let units = n.div_ceil(per_thread.max(1));
    let blocks = div_ceil(units, BLOCK_1D).clamp(1, max_blocks.max(1) as usize) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK_1D, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The three matmul kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Matmul {
    Naive,
    Tiled,
    RegBlock,
}

impl Matmul {
    pub const ALL: [Matmul; 3] = [Matmul::Naive, Matmul::Tiled, Matmul::RegBlock];

    /// The kernel's name in [`SOURCE`].
    pub fn kernel(self) -> &'static str {
        match self {
            Matmul::Naive => "matmul_naive",
            Matmul::Tiled => "matmul_tiled",
            Matmul::RegBlock => "matmul_regblock",
        }
    }

    /// Short name for rows and plots.
    pub fn label(self) -> &'static str {
        match self {
            Matmul::Naive => "naive",
            Matmul::Tiled => "tiled 32x32 (shared memory)",
            Matmul::RegBlock => "register-blocked 128x128/8x8",
        }
    }

    /// The launch covering an M x N output.
    pub fn launch(self, m: usize, n: usize) -> Result<LaunchConfig, String> {
        let (gx, gy, block) = match self {
            Matmul::Naive => (
                div_ceil(n, NAIVE_TILE),
                div_ceil(m, NAIVE_TILE),
                (NAIVE_TILE, NAIVE_TILE, 1),
            ),
            Matmul::Tiled => (div_ceil(n, TILE), div_ceil(m, TILE), (TILE, TILE, 1)),
            Matmul::RegBlock => (
                div_ceil(n, RB_BN),
                div_ceil(m, RB_BM),
                ((RB_BM / RB_TM) * (RB_BN / RB_TN), 1, 1),
            ),
        };
        // gridDim.y is limited to 65,535.
        let gy = dim(gy, "grid rows")?;
        if gy > 65_535 {
            return Err(format!("{m} rows need {gy} blocks in y (at most 65,535)"));
        }
        Ok(LaunchConfig {
            grid_dim: (dim(gx.max(1), "grid columns")?, gy.max(1), 1),
            block_dim: block,
            shared_mem_bytes: 0,
        })
    }
}

/// One block of [`ROW_BLOCK`] threads per row.
pub fn per_row(rows: usize) -> Result<LaunchConfig, String> {
    Ok(LaunchConfig {
        grid_dim: (dim(rows.max(1), "rows")?, 1, 1),
        block_dim: (ROW_BLOCK, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// `compute_XY` for a compute capability, as NVRTC's `--gpu-architecture`
/// wants it (PTX for the virtual architecture; the driver finishes it for the
/// exact chip). `None` for a capability this list does not know: NVRTC then
/// uses its default.
pub fn virtual_arch(major: i32, minor: i32) -> Option<&'static str> {
    Some(match (major, minor) {
        (7, 5) => "compute_75",
        (8, 0) => "compute_80",
        (8, 6) => "compute_86",
        (8, 7) => "compute_87",
        (8, 9) => "compute_89",
        (9, 0) => "compute_90",
        (10, 0) => "compute_100",
        (10, 3) => "compute_103",
        (12, 0) => "compute_120",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_named_kernel_is_defined_once_as_extern_c() {
        for name in NAMES {
            // `__global__ void name(` or, after a `__launch_bounds__(..)`
            // line, `name(` at the start of the next.
            let plain = format!("__global__ void {name}(");
            let bounded = format!("\n{name}(");
            let n = SOURCE.matches(&plain).count() + SOURCE.matches(&bounded).count();
            assert_eq!(n, 1, "{name} defined {n} times");
        }
        assert_eq!(
            SOURCE.matches("extern \"C\" __global__").count(),
            NAMES.len()
        );
    }

    #[test]
    fn the_source_tiles_match_the_launch_constants() {
        for (def, v) in [
            ("#define TILE ", TILE),
            ("#define RB_BM ", RB_BM),
            ("#define RB_BN ", RB_BN),
            ("#define RB_TM ", RB_TM),
            ("#define RB_TN ", RB_TN),
        ] {
            assert!(SOURCE.contains(&format!("{def}{v}\n")), "{def}{v}");
        }
        // The register-blocked kernel's loads assume 256 threads: one float4
        // of the 128x8 A panel and one of the 8x128 B panel each.
        assert_eq!((RB_BM / RB_TM) * (RB_BN / RB_TN), 256);
        assert_eq!(RB_BM * 8 / 4, 256);
        assert_eq!(RB_BN * 8 / 4, 256);
    }

    #[test]
    fn a_grid_stride_launch_covers_n_or_strides_over_it() {
        for n in [0usize, 1, 255, 256, 257, 1 << 20, (1 << 30) + 3] {
            let cfg = grid_stride(n, 1, 1024);
            let threads = cfg.grid_dim.0 as usize * cfg.block_dim.0 as usize;
            assert!(cfg.grid_dim.0 >= 1 && cfg.grid_dim.0 <= 1024);
            // Either every element has its own thread, or the grid is capped
            // and the kernel's loop strides over the rest.
            assert!(threads >= n || cfg.grid_dim.0 == 1024, "n={n}");
        }
        // float4: a quarter of the threads.
        assert_eq!(grid_stride(4096, 4, 1 << 20).grid_dim.0, 4);
    }

    #[test]
    fn matmul_grids_cover_ragged_outputs() {
        for (m, n) in [(1, 1), (17, 33), (128, 128), (129, 257), (4096, 4096)] {
            for mm in Matmul::ALL {
                let cfg = mm.launch(m, n).unwrap();
                let (tile_x, tile_y) = match mm {
                    Matmul::Naive => (NAIVE_TILE, NAIVE_TILE),
                    Matmul::Tiled => (TILE, TILE),
                    Matmul::RegBlock => (RB_BN, RB_BM),
                };
                assert!(
                    cfg.grid_dim.0 as usize * tile_x as usize >= n,
                    "{mm:?} {m}x{n}"
                );
                assert!(
                    cfg.grid_dim.1 as usize * tile_y as usize >= m,
                    "{mm:?} {m}x{n}"
                );
                // No block is wholly outside the output.
                assert!((cfg.grid_dim.0 as usize - 1) * (tile_x as usize) < n.max(1));
            }
        }
        assert!(Matmul::Naive.launch(16 * 70_000, 16).is_err());
    }

    #[test]
    fn the_h200_gets_its_own_ptx_target() {
        assert_eq!(virtual_arch(9, 0), Some("compute_90"));
        assert_eq!(virtual_arch(1, 0), None);
    }
}

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
pub const ROW_BLOCK: u32 = 256;

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
pub const SOURCE: &str = r#"
// ---- helpers ---------------------------------------------------------------
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
// Block-wide reductions: each warp reduces with shuffles, warp 0 reduces the
// per-warp results, every thread gets the answer. The trailing barrier lets
// the next call reuse the shared scratch.
__device__ float block_max(float v) {
    __shared__ float scratch[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    const int nwarps = (blockDim.x + 31) >> 5;
    v = (threadIdx.x < nwarps) ? scratch[threadIdx.x] : NEG_INF;
    if (warp == 0) v = warp_max(v);
    if (threadIdx.x == 0) scratch[0] = v;
    __syncthreads();
    const float r = scratch[0];
    __syncthreads();
    return r;
}
__device__ float block_sum(float v) {
    __shared__ float scratch[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    const int nwarps = (blockDim.x + 31) >> 5;
    v = (threadIdx.x < nwarps) ? scratch[threadIdx.x] : 0.0f;
    if (warp == 0) v = warp_sum(v);
    if (threadIdx.x == 0) scratch[0] = v;
    __syncthreads();
    const float r = scratch[0];
    __syncthreads();
    return r;
}

// ---- launch latency ----------------------------------------------------------
extern "C" __global__ void empty() {}

// ---- vector add: c = a + b ---------------------------------------------------
// Grid-stride: any grid covers any n; consecutive threads touch consecutive
// floats, so each warp's 32 loads are one 128-byte transaction (coalesced).
extern "C" __global__ void vector_add(const float* __restrict__ a,
                                      const float* __restrict__ b,
                                      float* __restrict__ c,
                                      unsigned long long n) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < n; i += stride)
        c[i] = a[i] + b[i];
}

// The same with 16-byte loads and stores (float4): a quarter of the memory
// instructions for the same bytes. n4 = n / 4 vectors; the last n % 4 floats
// are done one at a time by the first threads. Needs 16-byte-aligned
// pointers, which cuMemAlloc gives (256 bytes).
extern "C" __global__ void vector_add4(const float4* __restrict__ a,
                                       const float4* __restrict__ b,
                                       float4* __restrict__ c,
                                       unsigned long long n) {
    const unsigned long long n4 = n / 4;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long t = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (unsigned long long i = t; i < n4; i += stride) {
        const float4 x = a[i], y = b[i];
        c[i] = make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w);
    }
    const unsigned long long tail = n4 * 4 + t;
    if (tail < n) {
        ((float*)c)[tail] = ((const float*)a)[tail] + ((const float*)b)[tail];
    }
}

// ---- matmul 1: naive ---------------------------------------------------------
// One thread per output C[row, col]; threadIdx.x runs along a row of C so a
// warp reads one row of B coalesced and broadcasts A[row, k]. Every operand
// comes from global memory (L1/L2 catch some reuse): 2 loads per FMA.
extern "C" __global__ void matmul_naive(const float* __restrict__ A,
                                        const float* __restrict__ B,
                                        float* __restrict__ C,
                                        int M, int N, int K) {
    const int row = blockIdx.y * blockDim.y + threadIdx.y;
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= M || col >= N) return;
    float acc = 0.0f;
    for (int k = 0; k < K; ++k) acc += A[(size_t)row * K + k] * B[(size_t)k * N + col];
    C[(size_t)row * N + col] = acc;
}

// ---- matmul 2: shared-memory tiles -------------------------------------------
// A block of 32x32 threads computes a 32x32 tile of C. K is walked 32 at a
// time: the block loads one 32x32 tile of A and of B into shared memory
// (each thread one element of each, coalesced), syncs, and every thread does
// 32 FMAs from shared memory. Each global load is reused 32 times.
#define TILE 32
extern "C" __global__ void matmul_tiled(const float* __restrict__ A,
                                        const float* __restrict__ B,
                                        float* __restrict__ C,
                                        int M, int N, int K) {
    __shared__ float As[TILE][TILE];
    __shared__ float Bs[TILE][TILE + 1];  // +1: no bank conflicts on the column walk
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int row = blockIdx.y * TILE + ty;
    const int col = blockIdx.x * TILE + tx;
    float acc = 0.0f;
    for (int k0 = 0; k0 < K; k0 += TILE) {
        As[ty][tx] = (row < M && k0 + tx < K) ? A[(size_t)row * K + k0 + tx] : 0.0f;
        Bs[ty][tx] = (k0 + ty < K && col < N) ? B[(size_t)(k0 + ty) * N + col] : 0.0f;
        __syncthreads();
#pragma unroll
        for (int k = 0; k < TILE; ++k) acc += As[ty][k] * Bs[k][tx];
        __syncthreads();
    }
    if (row < M && col < N) C[(size_t)row * N + col] = acc;
}

// ---- matmul 3: register blocking ---------------------------------------------
// A block of 256 threads computes a 128x128 tile of C; each thread an 8x8
// sub-tile held in 64 registers. Per step of K (8 at a time) the block stages
// a 128x8 panel of A (transposed, so a thread's 8 rows are contiguous) and an
// 8x128 panel of B in shared memory; each thread then reads 8 values of A and
// 8 of B per k and does 64 FMAs with them: 4 FMAs per shared-memory load
// instead of the tiled kernel's 1/2. Loads are float4 where the row is
// 16-byte aligned and inside the matrix, one float at a time otherwise.
#define RB_BM 128
#define RB_BN 128
#define RB_BK 8
#define RB_TM 8
#define RB_TN 8
extern "C" __global__ void __launch_bounds__(256)
matmul_regblock(const float* __restrict__ A,
                const float* __restrict__ B,
                float* __restrict__ C,
                int M, int N, int K) {
    __shared__ float As[RB_BK][RB_BM];
    __shared__ float Bs[RB_BK][RB_BN];
    const int tid = threadIdx.x;
    const int trow = tid / (RB_BN / RB_TN);  // 0..15: which 8 rows of the tile
    const int tcol = tid % (RB_BN / RB_TN);  // 0..15: which 8 columns
    const int row0 = blockIdx.y * RB_BM, col0 = blockIdx.x * RB_BN;
    const bool a_vec = (K % 4) == 0, b_vec = (N % 4) == 0;

    float acc[RB_TM][RB_TN];
#pragma unroll
    for (int i = 0; i < RB_TM; ++i)
#pragma unroll
        for (int j = 0; j < RB_TN; ++j) acc[i][j] = 0.0f;
    float ra[RB_TM], rb[RB_TN];

    // This thread's share of the panels: one float4 of A, one of B.
    const int a_r = tid / 2, a_c = (tid % 2) * 4;    // A panel: 128 rows x 8
    const int b_r = tid / 32, b_c = (tid % 32) * 4;  // B panel: 8 rows x 128

    for (int k0 = 0; k0 < K; k0 += RB_BK) {
        {
            const int gr = row0 + a_r, gc = k0 + a_c;
            float4 v;
            if (a_vec && gr < M && gc + 3 < K) {
                v = *reinterpret_cast<const float4*>(&A[(size_t)gr * K + gc]);
            } else {
                v.x = (gr < M && gc + 0 < K) ? A[(size_t)gr * K + gc + 0] : 0.0f;
                v.y = (gr < M && gc + 1 < K) ? A[(size_t)gr * K + gc + 1] : 0.0f;
                v.z = (gr < M && gc + 2 < K) ? A[(size_t)gr * K + gc + 2] : 0.0f;
                v.w = (gr < M && gc + 3 < K) ? A[(size_t)gr * K + gc + 3] : 0.0f;
            }
            As[a_c + 0][a_r] = v.x;
            As[a_c + 1][a_r] = v.y;
            As[a_c + 2][a_r] = v.z;
            As[a_c + 3][a_r] = v.w;
        }
        {
            const int gr = k0 + b_r, gc = col0 + b_c;
            float4 v;
            if (b_vec && gr < K && gc + 3 < N) {
                v = *reinterpret_cast<const float4*>(&B[(size_t)gr * N + gc]);
            } else {
                v.x = (gr < K && gc + 0 < N) ? B[(size_t)gr * N + gc + 0] : 0.0f;
                v.y = (gr < K && gc + 1 < N) ? B[(size_t)gr * N + gc + 1] : 0.0f;
                v.z = (gr < K && gc + 2 < N) ? B[(size_t)gr * N + gc + 2] : 0.0f;
                v.w = (gr < K && gc + 3 < N) ? B[(size_t)gr * N + gc + 3] : 0.0f;
            }
            *reinterpret_cast<float4*>(&Bs[b_r][b_c]) = v;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < RB_BK; ++kk) {
#pragma unroll
            for (int i = 0; i < RB_TM; ++i) ra[i] = As[kk][trow * RB_TM + i];
#pragma unroll
            for (int j = 0; j < RB_TN; ++j) rb[j] = Bs[kk][tcol * RB_TN + j];
#pragma unroll
            for (int i = 0; i < RB_TM; ++i)
#pragma unroll
                for (int j = 0; j < RB_TN; ++j) acc[i][j] += ra[i] * rb[j];
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < RB_TM; ++i) {
        const int r = row0 + trow * RB_TM + i;
        if (r >= M) break;
#pragma unroll
        for (int j = 0; j < RB_TN; ++j) {
            const int c = col0 + tcol * RB_TN + j;
            if (c < N) C[(size_t)r * N + c] = acc[i][j];
        }
    }
}

// ---- softmax over rows -------------------------------------------------------
// One block per row: the row max (so exp never overflows), the sum of
// exp(x - max), then the write. Three passes over a row that stays in L1/L2.
extern "C" __global__ void softmax_rows(const float* __restrict__ x,
                                        float* __restrict__ y,
                                        int rows, int width) {
    const int r = blockIdx.x;
    if (r >= rows) return;
    const float* xr = x + (size_t)r * width;
    float* yr = y + (size_t)r * width;
    float m = NEG_INF;
    for (int i = threadIdx.x; i < width; i += blockDim.x) m = fmaxf(m, xr[i]);
    m = block_max(m);
    float s = 0.0f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) s += expf(xr[i] - m);
    s = block_sum(s);
    const float inv = 1.0f / s;
    for (int i = threadIdx.x; i < width; i += blockDim.x) yr[i] = expf(xr[i] - m) * inv;
}

// ---- RMSNorm over rows: y = w * (x / sqrt(mean(x^2) + eps)) -----------------
extern "C" __global__ void rmsnorm_rows(const float* __restrict__ x,
                                        const float* __restrict__ w,
                                        float* __restrict__ y,
                                        int rows, int width, float eps) {
    const int r = blockIdx.x;
    if (r >= rows) return;
    const float* xr = x + (size_t)r * width;
    float* yr = y + (size_t)r * width;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss);
    const float inv = rsqrtf(ss / (float)width + eps);
    for (int i = threadIdx.x; i < width; i += blockDim.x) yr[i] = w[i] * (xr[i] * inv);
}
"#;

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
            let plain = format!("__global__ void {name}(");
            let bounded = format!("__launch_bounds__(256)\n{name}(");
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

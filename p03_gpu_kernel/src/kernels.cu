// Project 03's kernels: CUDA C compiled at run time by NVRTC (see kernels.rs).
// Every matrix is row-major f32. tests/emulated.rs also compiles this file
// as C++ on the CPU against tests/emulate/cuda_shim.h.
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
    v = ((int)threadIdx.x < nwarps) ? scratch[threadIdx.x] : NEG_INF;
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
    v = ((int)threadIdx.x < nwarps) ? scratch[threadIdx.x] : 0.0f;
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
// pointers: the host checks (Gpu::vector_add) before choosing this kernel.
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
extern "C" __global__ void __launch_bounds__(TILE * TILE)
matmul_tiled(const float* __restrict__ A,
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
    // 16-byte aligned: Bs is stored to as float4.
    __shared__ __align__(16) float As[RB_BK][RB_BM];
    __shared__ __align__(16) float Bs[RB_BK][RB_BN];
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

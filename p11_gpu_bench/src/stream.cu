// Project 11's STREAM kernels (see memory.rs), compiled at run time by NVRTC.
#define GRID_STRIDE(i, n) \
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; \
         i < (n); i += (unsigned long long)gridDim.x * blockDim.x)

// Read: every element summed; one partial sum per thread written out, so the
// loads are live (the sums are also what the GPU test checks).
extern "C" __global__ void hbm_read(const float4* __restrict__ a, float* __restrict__ partial,
                                    unsigned long long n4, int passes) {
    float acc = 0.0f;
    for (int p = 0; p < passes; ++p) {
        GRID_STRIDE(i, n4) {
            const float4 v = a[i];
            acc += (v.x + v.y) + (v.z + v.w);
        }
    }
    partial[(unsigned long long)blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

// Write: each pass stores a different value, so no pass is dead.
extern "C" __global__ void hbm_write(float4* __restrict__ a, unsigned long long n4, int passes, float v) {
    for (int p = 0; p < passes; ++p) {
        const float x = v + (float)p;
        GRID_STRIDE(i, n4) a[i] = make_float4(x, x, x, x);
    }
}

extern "C" __global__ void hbm_copy(const float4* __restrict__ a, float4* __restrict__ b,
                                    unsigned long long n4, int passes) {
    for (int p = 0; p < passes; ++p) {
        GRID_STRIDE(i, n4) b[i] = a[i];
    }
}

// Triad: a = b + s * c.
extern "C" __global__ void hbm_triad(float4* __restrict__ a, const float4* __restrict__ b,
                                     const float4* __restrict__ c, unsigned long long n4,
                                     int passes, float s) {
    for (int p = 0; p < passes; ++p) {
        GRID_STRIDE(i, n4) {
            const float4 x = b[i], y = c[i];
            a[i] = make_float4(x.x + s * y.x, x.y + s * y.y, x.z + s * y.z, x.w + s * y.w);
        }
    }
}

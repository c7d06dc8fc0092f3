// cuda_shim.h: just enough of CUDA's execution model to run the lab's
// kernels on a CPU, as C++, so their index arithmetic, bounds guards,
// barriers and warp reductions are checked on every test run and not only
// on the one machine with a GPU.
//
// The model: blocks run one after another; the threads of a block are real
// OS threads; __syncthreads is a barrier over the block; __shfl_xor_sync is
// an exchange through a per-warp buffer between two barriers over the warp;
// __shared__ variables are function statics (one block at a time, so one
// copy suffices). A thread that returns early drops out of its barriers, as
// an exited CUDA thread no longer counts.
//
// What it does not model: timing, memory coalescing, occupancy, and any
// race a real GPU would show but a CPU schedule hides. It is a logic check.
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>
#include <math.h>

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
inline thread_local dim3 threadIdx{0, 0, 0};
inline thread_local dim3 blockIdx{0, 0, 0};
inline dim3 blockDim{1, 1, 1};
inline dim3 gridDim{1, 1, 1};

struct alignas(16) float4 {
    float x, y, z, w;
};
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
// Cache-hinted loads are plain loads on a CPU.
#define __ldcg(p) (*(p))

inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, sizeof f);
    return f;
}
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

struct BlockSync {
    std::barrier<> block;
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    std::vector<float> lanes;
    explicit BlockSync(unsigned n) : block(n), lanes(n) {
        for (unsigned w = 0; w < n; w += 32)
            warps.push_back(std::make_unique<std::barrier<>>(std::min(32u, n - w)));
    }
};
inline BlockSync* g_sync = nullptr;
inline thread_local unsigned t_linear = 0;

inline void __syncthreads() { g_sync->block.arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned, float v, int offset) {
    const unsigned warp = t_linear >> 5, lane = t_linear & 31;
    auto& b = *g_sync->warps[warp];
    g_sync->lanes[t_linear] = v;
    b.arrive_and_wait();
    const float r = g_sync->lanes[(warp << 5) | (lane ^ unsigned(offset))];
    b.arrive_and_wait();
    return r;
}

// Run `kernel()` over grid x block, blocks in order. One OS thread per
// thread of a block, reused for every block: after a block, all of them
// meet at a barrier whose completion step gives the next block fresh
// barriers (so a thread that returned early only drops out of its own
// block's).
template <class F>
void launch(dim3 grid, dim3 block, F kernel) {
    gridDim = grid;
    blockDim = block;
    const unsigned nt = block.x * block.y * block.z;
    const unsigned long long nblocks = 1ull * grid.x * grid.y * grid.z;
    auto sync = std::make_unique<BlockSync>(nt);
    g_sync = sync.get();
    auto next_block = [&]() noexcept {
        sync = std::make_unique<BlockSync>(nt);
        g_sync = sync.get();
    };
    std::barrier between(nt, next_block);
    std::vector<std::thread> threads;
    threads.reserve(nt);
    for (unsigned t = 0; t < nt; ++t)
        threads.emplace_back([&, t] {
            t_linear = t;
            threadIdx = dim3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
            for (unsigned long long b = 0; b < nblocks; ++b) {
                blockIdx = dim3{unsigned(b % grid.x), unsigned((b / grid.x) % grid.y),
                                unsigned(b / (1ull * grid.x * grid.y))};
                kernel();
                g_sync->block.arrive_and_drop();
                g_sync->warps[t >> 5]->arrive_and_drop();
                between.arrive_and_wait();
            }
        });
    for (auto& th : threads) th.join();
    g_sync = nullptr;
}

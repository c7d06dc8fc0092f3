// Project 03's kernels (src/kernels.cu, unchanged) run on the CPU through
// cuda_shim.h, each against a double-precision reference with the same
// tolerances as the GPU tests. Prints PASS/FAIL per case; the exit status
// is the number of failures. Built and run by tests/emulated.rs.
#include "cuda_shim.h"
#include "kernels.cu"

#include <cstdio>
#include <random>

static int failures = 0;
static const double EPS = 1.1920928955078125e-07;  // f32 machine epsilon

static std::vector<float> random_vec(size_t n, unsigned seed, float scale) {
    std::mt19937 g(seed);
    std::uniform_real_distribution<float> d(-scale, scale);
    std::vector<float> v(n);
    for (auto& x : v) x = d(g);
    return v;
}

static void report(bool ok, const char* what, const char* detail) {
    std::printf("%s %s%s%s\n", ok ? "PASS" : "FAIL", what, ok ? "" : ": ", ok ? "" : detail);
    if (!ok) ++failures;
}

static unsigned ceil_div(size_t a, unsigned b) { return unsigned((a + b - 1) / b); }

static void test_vector_add() {
    for (size_t n : {1u, 3u, 1000u, 4099u}) {
        auto a = random_vec(n, 1, 10), b = random_vec(n, 2, 10);
        for (int vec4 = 0; vec4 < 2; ++vec4) {
            std::vector<float> c(n, -1.0f);
            // A grid smaller than n / 256 exercises the grid-stride loop.
            const unsigned per = vec4 ? 4 : 1;
            const dim3 grid{std::max(1u, std::min(3u, ceil_div(ceil_div(n, per), 256)))};
            const unsigned long long nn = n;
            if (vec4)
                launch(grid, dim3{256}, [&] {
                    vector_add4((const float4*)a.data(), (const float4*)b.data(), (float4*)c.data(), nn);
                });
            else
                launch(grid, dim3{256}, [&] { vector_add(a.data(), b.data(), c.data(), nn); });
            bool ok = true;
            for (size_t i = 0; i < n; ++i) ok &= c[i] == a[i] + b[i];
            char name[96];
            std::snprintf(name, sizeof name, "vector_add%s n=%zu", vec4 ? "4" : "", n);
            report(ok, name, "differs from a + b");
        }
    }
}

static void test_matmul() {
    struct S { int m, n, k; };
    for (S s : {S{1, 1, 1}, S{17, 33, 9}, S{129, 257, 67}, S{130, 128, 12}, S{64, 64, 128}}) {
        const int M = s.m, N = s.n, K = s.k;
        auto A = random_vec(size_t(M) * K, 3, 1), B = random_vec(size_t(K) * N, 4, 1);
        std::vector<double> ref(size_t(M) * N), scale(size_t(M) * N);
        for (int i = 0; i < M; ++i)
            for (int j = 0; j < N; ++j) {
                double acc = 0, abs = 0;
                for (int p = 0; p < K; ++p) {
                    const double t = double(A[size_t(i) * K + p]) * B[size_t(p) * N + j];
                    acc += t;
                    abs += std::fabs(t);
                }
                ref[size_t(i) * N + j] = acc;
                scale[size_t(i) * N + j] = abs;
            }
        for (int kind = 0; kind < 3; ++kind) {
            std::vector<float> C(size_t(M) * N, NAN);
            const char* name = kind == 0 ? "matmul_naive" : kind == 1 ? "matmul_tiled" : "matmul_regblock";
            if (kind == 0)
                launch(dim3{ceil_div(N, 16), ceil_div(M, 16)}, dim3{16, 16},
                       [&] { matmul_naive(A.data(), B.data(), C.data(), M, N, K); });
            else if (kind == 1)
                launch(dim3{ceil_div(N, TILE), ceil_div(M, TILE)}, dim3{TILE, TILE},
                       [&] { matmul_tiled(A.data(), B.data(), C.data(), M, N, K); });
            else
                launch(dim3{ceil_div(N, RB_BN), ceil_div(M, RB_BM)}, dim3{256},
                       [&] { matmul_regblock(A.data(), B.data(), C.data(), M, N, K); });
            char detail[160] = "";
            bool ok = true;
            for (size_t i = 0; i < C.size() && ok; ++i) {
                const double bound = 2.0 * (K + 2) * EPS * scale[i] + 1e-30;
                if (!(std::fabs(C[i] - ref[i]) <= bound)) {
                    ok = false;
                    std::snprintf(detail, sizeof detail, "C[%zu,%zu] = %g, reference %g", i / N, i % N, C[i], ref[i]);
                }
            }
            char what[96];
            std::snprintf(what, sizeof what, "%s %dx%dx%d", name, M, N, K);
            report(ok, what, detail);
        }
    }
}

static void test_rows() {
    struct S { int rows, width; float scale; };
    for (S s : {S{3, 1, 1}, S{5, 7, 1}, S{4, 300, 30}, S{2, 1000, 100}}) {
        const int R = s.rows, W = s.width;
        auto x = random_vec(size_t(R) * W, 5, s.scale), w = random_vec(W, 6, 1);
        std::vector<float> y(x.size(), NAN), z(x.size(), NAN);
        launch(dim3{unsigned(R)}, dim3{256}, [&] { softmax_rows(x.data(), y.data(), R, W); });
        launch(dim3{unsigned(R)}, dim3{256}, [&] { rmsnorm_rows(x.data(), w.data(), z.data(), R, W, 1e-5f); });
        bool ok_s = true, ok_r = true;
        char ds[160] = "", dr[160] = "";
        for (int r = 0; r < R; ++r) {
            const float* xr = &x[size_t(r) * W];
            float mx = -INFINITY;
            for (int i = 0; i < W; ++i) mx = std::fmax(mx, xr[i]);
            double sum = 0, ss = 0;
            for (int i = 0; i < W; ++i) {
                sum += std::exp(double(xr[i] - mx));
                ss += double(xr[i]) * xr[i];
            }
            const double inv = 1.0 / std::sqrt(ss / W + 1e-5);
            for (int i = 0; i < W; ++i) {
                const double ws = std::exp(double(xr[i] - mx)) / sum;
                const double wr = double(w[i]) * (xr[i] * inv);
                const double bs = (W + 8) * EPS * std::fabs(ws) + 1e-30;
                const double br = (W + 8) * EPS * std::fabs(wr) + 1e-30;
                const float gs = y[size_t(r) * W + i], gr = z[size_t(r) * W + i];
                if (ok_s && !(std::fabs(gs - ws) <= bs)) {
                    ok_s = false;
                    std::snprintf(ds, sizeof ds, "y[%d,%d] = %g, reference %g", r, i, gs, ws);
                }
                if (ok_r && !(std::fabs(gr - wr) <= br)) {
                    ok_r = false;
                    std::snprintf(dr, sizeof dr, "y[%d,%d] = %g, reference %g", r, i, gr, wr);
                }
            }
        }
        char what[96];
        std::snprintf(what, sizeof what, "softmax_rows %dx%d", R, W);
        report(ok_s, what, ds);
        std::snprintf(what, sizeof what, "rmsnorm_rows %dx%d", R, W);
        report(ok_r, what, dr);
    }
}

int main() {
    launch(dim3{1}, dim3{1}, [] { empty(); });
    test_vector_add();
    test_matmul();
    test_rows();
    std::printf("%d failure(s)\n", failures);
    return failures;
}

// Project 11's STREAM kernels (src/stream.cu, unchanged) on the CPU through
// Project 03's cuda_shim.h: every element read, written, copied and
// triad-ed, over several passes and a grid smaller than the array (the
// grid-stride loop), under AddressSanitizer. Exit status = failures.
#include "cuda_shim.h"
#include "stream.cu"

#include <cstdio>

static int failures = 0;
static void report(bool ok, const char* what) {
    std::printf("%s %s\n", ok ? "PASS" : "FAIL", what);
    if (!ok) ++failures;
}

int main() {
    // 1,613 float4s over 384 threads: the unrolled loop (4 per thread) and
    // its tail both run.
    const unsigned long long n = 4 * 1613;
    const unsigned long long n4 = n / 4;
    std::vector<float4> a(n4), b(n4), c(n4);
    float* fa = &a[0].x;
    float* fb = &b[0].x;
    float* fc = &c[0].x;
    for (unsigned long long i = 0; i < n; ++i) {
        fa[i] = float(i % 7);
        fb[i] = float(i % 5);
        fc[i] = float(i % 3);
    }
    const dim3 grid{3}, block{128};  // 384 threads for 1003 vectors
    std::vector<float> partial(3 * 128, -1.0f);

    launch(grid, block, [&] { hbm_read(a.data(), partial.data(), n4, 3); });
    double total = 0, want = 0;
    for (float p : partial) total += p;
    for (unsigned long long i = 0; i < n; ++i) want += 3.0 * fa[i];
    report(total == want, "hbm_read: partial sums = passes x sum");

    launch(grid, block, [&] { hbm_copy(a.data(), b.data(), n4, 2); });
    bool ok = true;
    for (unsigned long long i = 0; i < n; ++i) ok &= fb[i] == fa[i];
    report(ok, "hbm_copy: b == a");

    launch(grid, block, [&] { hbm_triad(a.data(), b.data(), c.data(), n4, 1, 3.0f); });
    ok = true;
    for (unsigned long long i = 0; i < n; ++i) ok &= fa[i] == fb[i] + 3.0f * fc[i];
    report(ok, "hbm_triad: a == b + 3c");

    launch(grid, block, [&] { hbm_write(a.data(), n4, 4, 1.0f); });
    ok = true;
    for (unsigned long long i = 0; i < n; ++i) ok &= fa[i] == 4.0f;
    report(ok, "hbm_write: last pass's value everywhere");

    std::printf("%d failure(s)\n", failures);
    return failures;
}

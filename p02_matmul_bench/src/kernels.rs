//! Micro-kernels: C[MR x NR] = alpha * (A sliver . B sliver) + beta * C, with
//! the whole MR x NR block of C held in vector registers across the k loop.
//!
//! Per k step a kernel loads NR values of packed B (2 vectors), broadcasts
//! MR values of packed A, and issues 2*MR fused multiply-adds into 2*MR
//! independent accumulators: enough chains to cover the FMA latency (4
//! cycles x 2 units = 8 in flight) and few enough loads per FMA that the
//! load ports are not the limit.
//!
//! The AVX2 and AVX-512 kernels are one body instantiated twice by a macro
//! (only the vector type and intrinsic names differ); the portable kernel is
//! plain Rust with const dimensions and is instantiated at both geometries so
//! the packing for the AVX-512 shape is tested on any machine.

/// A micro-kernel function: (kc, A, A's row stride, A's k stride, packed B
/// sliver, C, ldc, alpha, beta). A element (i, p) is at a + i*rsa + p*csa: a
/// packed sliver has (1, MR); a row-major A read in place has (lda, 1).
/// beta == 0 means C is write-only (never read, so NaN in C is ignored, as
/// BLAS specifies).
pub(crate) type KernelFn =
    unsafe fn(usize, *const f32, usize, usize, *const f32, *mut f32, usize, f32, f32);

/// The instruction set a kernel needs; the only way `supported` decides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Isa {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2Fma,
    #[cfg(target_arch = "x86_64")]
    Avx512F,
}

/// A micro-kernel with its register-tile shape and the cache blocking that
/// suits it. All block sizes live here, one place.
///
/// A closed set: the fields are private, so the only kernels are the
/// constants below, each paired with the instruction set it needs. Safe
/// code cannot hand the driver a function pointer of its own or a tile
/// shape its buffers were not sized for:
///
/// ```compile_fail,E0616
/// let mut k = p02_matmul_bench::MicroKernel::PORTABLE;
/// k.mr = 64; // private: the driver's edge-tile buffer holds 8 x 32
/// ```
///
/// ```compile_fail,E0451
/// unsafe fn forged(_: usize, _: *const f32, _: usize, _: usize, _: *const f32,
///                  _: *mut f32, _: usize, _: f32, _: f32) {}
/// let k = p02_matmul_bench::MicroKernel { func: forged, ..p02_matmul_bench::MicroKernel::PORTABLE };
/// ```
#[derive(Clone, Copy, Debug)]
pub struct MicroKernel {
    name: &'static str,
    isa: Isa,
    /// Rows of the register tile.
    pub(crate) mr: usize,
    /// Columns of the register tile.
    pub(crate) nr: usize,
    /// K block: a B sliver (kc x nr) plus an A sliver (mr x kc) fit in L1d
    /// (AVX2: 256 * (6 + 16) * 4 B = 22.5 KB of 32 KB).
    pub(crate) kc: usize,
    /// M block: a packed A block (mc x kc) fills about half of L2
    /// (AVX2: 144 * 256 * 4 B = 147 KB of 512 KB, leaving room for B slivers and C).
    pub(crate) mc: usize,
    /// N block: a packed B panel (kc x nc) lives in L3 (4096 * 256 * 4 B = 4 MB).
    pub(crate) nc: usize,
    pub(crate) func: KernelFn,
    /// The same kernel for a single row of A (1 x nr): M = 1 (decode) would
    /// otherwise pay for mr rows of FMAs to produce one.
    pub(crate) func1: KernelFn,
    /// Pack a row-major A whose row stride is a multiple of 1 KB instead of
    /// reading it in place (its rows then share L1 sets: 4K aliasing).
    /// Measured per kernel: the 6x16 loop at N = 1024, one thread, read
    /// 60 GFLOP/s in place vs ~75 packed; the 8x32 AVX-512 loop on a Xeon
    /// (2 threads, interleaved, medians of 8–30) was faster in place at
    /// every stride tried, aliasing ones included: 1024³ 214 vs 204
    /// GFLOP/s, 2048³ 174 vs 170, 256 × 1024 × 576 143 vs 136, 256 × 1536 ×
    /// 576 (SmolLM2's down projection at a 256-token prompt) 157 vs 147.
    pub(crate) pack_aliased_a: bool,
}

/// The largest register tile any kernel has (mr * nr): the driver's
/// edge-tile buffer is this big, and every kernel is checked against it
/// when the crate compiles.
pub(crate) const MAX_TILE: usize = 8 * 32;

const _: () = {
    assert!(MicroKernel::PORTABLE.mr * MicroKernel::PORTABLE.nr <= MAX_TILE);
    assert!(MicroKernel::PORTABLE_8X32.mr * MicroKernel::PORTABLE_8X32.nr <= MAX_TILE);
    #[cfg(target_arch = "x86_64")]
    assert!(MicroKernel::AVX2.mr * MicroKernel::AVX2.nr <= MAX_TILE);
    #[cfg(target_arch = "x86_64")]
    assert!(MicroKernel::AVX512.mr * MicroKernel::AVX512.nr <= MAX_TILE);
};

impl MicroKernel {
    /// Plain Rust, 6 x 16.
    pub const PORTABLE: MicroKernel = MicroKernel {
        name: "portable 6x16",
        isa: Isa::Portable,
        mr: 6,
        nr: 16,
        kc: 256,
        mc: 144,
        nc: 4096,
        func: portable::<6, 16>,
        func1: portable::<1, 16>,
        pack_aliased_a: true,
    };
    /// Plain Rust at the AVX-512 geometry, 8 x 32 (tests the packing for it).
    pub const PORTABLE_8X32: MicroKernel = MicroKernel {
        name: "portable 8x32",
        isa: Isa::Portable,
        mr: 8,
        nr: 32,
        kc: 256,
        mc: 192,
        nc: 4096,
        func: portable::<8, 32>,
        func1: portable::<1, 32>,
        pack_aliased_a: false,
    };
    #[cfg(target_arch = "x86_64")]
    pub const AVX2: MicroKernel = MicroKernel {
        name: "avx2+fma 6x16",
        isa: Isa::Avx2Fma,
        mr: 6,
        nr: 16,
        kc: 256,
        mc: 144,
        nc: 4096,
        func: x86::avx2_6x16,
        func1: x86::avx2_1x16,
        pack_aliased_a: true,
    };
    /// 8 x 32: 16 zmm accumulators of 32; B sliver + A sliver = 256 * 40 * 4 B = 40 KB
    /// (L1d is 48 KB on the AVX-512 Xeons this targets).
    #[cfg(target_arch = "x86_64")]
    pub const AVX512: MicroKernel = MicroKernel {
        name: "avx512f 8x32",
        isa: Isa::Avx512F,
        mr: 8,
        nr: 32,
        kc: 256,
        mc: 192,
        nc: 4096,
        func: x86::avx512_8x32,
        func1: x86::avx512_1x32,
        pack_aliased_a: false,
    };

    /// Whether this CPU can run the kernel.
    pub fn supported(&self) -> bool {
        match self.isa {
            Isa::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2Fma => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512F => is_x86_feature_detected!("avx512f"),
        }
    }

    /// Its name, e.g. "avx2+fma 6x16" (what numbers.md's machine column shows).
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Register tile rows.
    pub fn mr(&self) -> usize {
        self.mr
    }

    /// Register tile columns.
    pub fn nr(&self) -> usize {
        self.nr
    }

    /// (kc, mc, nc): the K, M and N cache blocks.
    pub fn blocking(&self) -> (usize, usize, usize) {
        (self.kc, self.mc, self.nc)
    }

    /// Every kernel this CPU can run, fastest first.
    pub fn available() -> Vec<MicroKernel> {
        let mut all = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            all.push(Self::AVX512);
            all.push(Self::AVX2);
        }
        all.push(Self::PORTABLE);
        all.push(Self::PORTABLE_8X32);
        all.into_iter().filter(MicroKernel::supported).collect()
    }

    /// The fastest supported kernel, detected once. `P02_KERNEL=avx2` or
    /// `=portable` forces a slower one (for comparisons and debugging).
    pub fn best() -> MicroKernel {
        use std::sync::OnceLock;
        static BEST: OnceLock<MicroKernel> = OnceLock::new();
        *BEST.get_or_init(|| {
            let avail = Self::available();
            let forced = std::env::var("P02_KERNEL").ok();
            forced
                .and_then(|f| {
                    avail
                        .iter()
                        .find(|k| k.name.starts_with(f.as_str()))
                        .copied()
                })
                .unwrap_or(avail[0])
        })
    }
}

/// Portable micro-kernel: A (MR rows, strides rsa/csa), B packed (kc, NR).
///
/// # Safety
/// A's MR x kc elements are readable through the strides, `b` holds kc*NR
/// floats, `c` MR rows of NR writable floats at stride ldc.
#[allow(clippy::too_many_arguments)]
unsafe fn portable<const MR: usize, const NR: usize>(
    kc: usize,
    a: *const f32,
    rsa: usize,
    csa: usize,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    alpha: f32,
    beta: f32,
) {
    // SAFETY: lengths per the contract above.
    let b = unsafe { std::slice::from_raw_parts(b, kc * NR) };
    let mut acc = [[0.0f32; NR]; MR];
    for (p, bp) in b.chunks_exact(NR).enumerate() {
        for (i, row) in acc.iter_mut().enumerate() {
            // SAFETY: (i, p) is inside A per the contract.
            let ai = unsafe { *a.add(i * rsa + p * csa) };
            for (x, &bj) in row.iter_mut().zip(bp) {
                *x += ai * bj;
            }
        }
    }
    for (i, row) in acc.iter().enumerate() {
        // SAFETY: row i of C has NR writable floats.
        let ci = unsafe { std::slice::from_raw_parts_mut(c.add(i * ldc), NR) };
        for (cv, &x) in ci.iter_mut().zip(row) {
            *cv = if beta == 0.0 {
                alpha * x
            } else {
                alpha * x + beta * *cv
            };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// One kernel body for both ISAs: 2 vectors of B per k, MR broadcasts of A.
    macro_rules! micro_kernel {
        ($wrapper:ident, $name:ident, $feature:literal, $mr:literal, $lanes:literal,
         $zero:ident, $loadu:ident, $storeu:ident, $set1:ident, $fmadd:ident, $mul:ident) => {
            /// The kernel as a plain `unsafe fn` (a [`super::KernelFn`]).
            ///
            /// # Safety
            /// As the body below; only selected when the CPU has the feature.
            #[allow(clippy::too_many_arguments)]
            pub unsafe fn $wrapper(
                kc: usize,
                a: *const f32,
                rsa: usize,
                csa: usize,
                b: *const f32,
                c: *mut f32,
                ldc: usize,
                alpha: f32,
                beta: f32,
            ) {
                // SAFETY: forwarded contract.
                unsafe { $name(kc, a, rsa, csa, b, c, ldc, alpha, beta) }
            }

            /// # Safety
            /// CPU supports the target feature; A's MR x kc elements are
            /// readable at a + i*rsa + p*csa, `b` holds kc*NR floats (NR = 2
            /// vectors), `c` MR rows of NR writable floats at stride ldc.
            #[allow(clippy::too_many_arguments)]
            #[target_feature(enable = $feature)]
            pub unsafe fn $name(
                kc: usize,
                a: *const f32,
                rsa: usize,
                csa: usize,
                b: *const f32,
                c: *mut f32,
                ldc: usize,
                alpha: f32,
                beta: f32,
            ) {
                // SAFETY: every offset stays inside the ranges the contract gives.
                unsafe {
                    let mut acc = [[$zero(); 2]; $mr];
                    // One base pointer per row and one shared k offset: every
                    // broadcast is [base_i + off*4], independent of the others
                    // (a running pointer would chain MR dependent adds per k).
                    let rows: [*const f32; $mr] = std::array::from_fn(|i| a.add(i * rsa));
                    let mut off = 0usize;
                    let mut b = b;
                    for _ in 0..kc {
                        let b0 = $loadu(b);
                        let b1 = $loadu(b.add($lanes));
                        for (row, &ar) in acc.iter_mut().zip(&rows) {
                            let ai = $set1(*ar.add(off));
                            row[0] = $fmadd(ai, b0, row[0]);
                            row[1] = $fmadd(ai, b1, row[1]);
                        }
                        off += csa;
                        b = b.add(2 * $lanes);
                    }
                    let va = $set1(alpha);
                    for (i, row) in acc.iter().enumerate() {
                        let ci = c.add(i * ldc);
                        let mut r0 = $mul(row[0], va);
                        let mut r1 = $mul(row[1], va);
                        if beta != 0.0 {
                            let vb = $set1(beta);
                            r0 = $fmadd(vb, $loadu(ci), r0);
                            r1 = $fmadd(vb, $loadu(ci.add($lanes)), r1);
                        }
                        $storeu(ci, r0);
                        $storeu(ci.add($lanes), r1);
                    }
                }
            }
        };
    }

    micro_kernel!(
        avx2_6x16,
        avx2_6x16_impl,
        "avx2,fma",
        6,
        8,
        _mm256_setzero_ps,
        _mm256_loadu_ps,
        _mm256_storeu_ps,
        _mm256_set1_ps,
        _mm256_fmadd_ps,
        _mm256_mul_ps
    );
    micro_kernel!(
        avx512_8x32,
        avx512_8x32_impl,
        "avx512f",
        8,
        16,
        _mm512_setzero_ps,
        _mm512_loadu_ps,
        _mm512_storeu_ps,
        _mm512_set1_ps,
        _mm512_fmadd_ps,
        _mm512_mul_ps
    );

    micro_kernel!(
        avx2_1x16,
        avx2_1x16_impl,
        "avx2,fma",
        1,
        8,
        _mm256_setzero_ps,
        _mm256_loadu_ps,
        _mm256_storeu_ps,
        _mm256_set1_ps,
        _mm256_fmadd_ps,
        _mm256_mul_ps
    );
    micro_kernel!(
        avx512_1x32,
        avx512_1x32_impl,
        "avx512f",
        1,
        16,
        _mm512_setzero_ps,
        _mm512_loadu_ps,
        _mm512_storeu_ps,
        _mm512_set1_ps,
        _mm512_fmadd_ps,
        _mm512_mul_ps
    );
}

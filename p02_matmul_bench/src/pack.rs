//! Packing: copy a block of an operand (any strides) into the order the
//! micro-kernel reads it, so its k loop walks memory with unit stride and
//! every sliver is zero-padded to a full MR or NR.

use crate::mat::MatRef;

/// Pack A[i0..i0+mc, p0..p0+kc] into ceil(mc/mr) slivers, each (kc, mr):
/// out[(s*kc + p)*mr + r] = A[i0 + s*mr + r, p0 + p], zero past row mc.
pub fn pack_a(a: &MatRef, i0: usize, mc: usize, p0: usize, kc: usize, mr: usize, out: &mut [f32]) {
    let slivers = mc.div_ceil(mr);
    debug_assert!(out.len() >= slivers * kc * mr);
    for s in 0..slivers {
        let dst = &mut out[s * kc * mr..(s + 1) * kc * mr];
        let rows = mr.min(mc - s * mr);
        let ib = i0 + s * mr;
        if a.rs == 1 && a.cs != 1 {
            // A stored transposed: the mr values of one k are contiguous.
            for (p, d) in dst.chunks_exact_mut(mr).enumerate() {
                let start = (p0 + p) * a.cs + ib;
                d[..rows].copy_from_slice(&a.data[start..start + rows]);
                d[rows..].fill(0.0);
            }
            continue;
        }
        for r in 0..mr {
            if r < rows {
                let i = ib + r;
                if a.cs == 1 {
                    // Row-major A: read the row once, contiguously.
                    let src = &a.data[i * a.rs + p0..i * a.rs + p0 + kc];
                    for (d, &v) in dst.chunks_exact_mut(mr).zip(src) {
                        d[r] = v;
                    }
                } else {
                    for (p, d) in dst.chunks_exact_mut(mr).enumerate() {
                        d[r] = a.at(i, p0 + p);
                    }
                }
            } else {
                for d in dst.chunks_exact_mut(mr) {
                    d[r] = 0.0;
                }
            }
        }
    }
}

/// Pack B[p0..p0+kc, j0..j0+nc] into ceil(nc/nr) slivers, each (kc, nr):
/// out[(s*kc + p)*nr + j] = B[p0 + p, j0 + s*nr + j], zero past column nc.
/// `slivers` selects which slivers to write (for parallel packing).
#[allow(clippy::too_many_arguments)]
pub fn pack_b(
    b: &MatRef,
    p0: usize,
    kc: usize,
    j0: usize,
    nc: usize,
    nr: usize,
    slivers: std::ops::Range<usize>,
    out: &mut [f32],
) {
    let first = slivers.start;
    for s in slivers {
        let dst = &mut out[(s - first) * kc * nr..(s - first + 1) * kc * nr];
        let cols = nr.min(nc - s * nr);
        let jb = j0 + s * nr;
        if b.rs == 1 && b.cs != 1 {
            // B = W^T with W rows contiguous (PyTorch weights): read each W row
            // once, contiguously, and scatter into the L1-resident sliver.
            for j in 0..cols {
                let start = (jb + j) * b.cs + p0;
                for (d, &v) in dst.chunks_exact_mut(nr).zip(&b.data[start..start + kc]) {
                    d[j] = v;
                }
            }
            for p in 0..kc {
                dst[p * nr + cols..(p + 1) * nr].fill(0.0);
            }
            continue;
        }
        for p in 0..kc {
            let d = &mut dst[p * nr..(p + 1) * nr];
            if b.cs == 1 {
                let start = (p0 + p) * b.rs + jb;
                d[..cols].copy_from_slice(&b.data[start..start + cols]);
            } else {
                for (j, v) in d[..cols].iter_mut().enumerate() {
                    *v = b.at(p0 + p, jb + j);
                }
            }
            d[cols..].fill(0.0);
        }
    }
}

//! Project 02: CPU matmul from naive to near peak, measured.
//!
//! - [`variants`]: naive i-j-k, i-k-j, B transposed, cache-blocked.
//! - [`pack`] + [`kernels`] + [`gemm`]: packed panels and a register-blocked
//!   SIMD micro-kernel (AVX2+FMA, AVX-512F, portable; chosen at run time),
//!   threaded over rayon. [`sgemm`] is the kernel later crates call.
//! - [`gemv`]: the M = 1 (decode) fast path.
//! - [`reference`]: the f64 reference and error bound the tests hold them to.
//! - [`ceilings`]: measured peak FLOP/s and memory bandwidth (the roofline).
//! - [`sweep`]: the `sweep` command (peers, plots, numbers.md).

pub mod ceilings;
pub mod gemm;
pub mod gemv;
pub mod kernels;
pub mod mat;
pub mod mlp;
pub mod pack;
pub mod peers;
pub mod reference;
#[cfg(feature = "bench")]
pub mod sweep;
#[cfg(feature = "bench")]
pub mod sweep_mlp;
pub mod variants;
pub mod weight_rows;

pub use gemm::{linear, sgemm, sgemm_prepacked, sgemm_with, AlignedBuf, GemmOpts, PackedB};
pub use kernels::MicroKernel;
pub use mat::{MatMut, MatRef};
pub use weight_rows::{sgemm_weight_rows, sgemm_weight_slivers};

use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum GemmError {
    #[error("sgemm shapes do not chain: A {a:?} x B {b:?} -> C {c:?}")]
    Shape {
        a: (usize, usize),
        b: (usize, usize),
        c: (usize, usize),
    },
    #[error("{what} ({rows} x {cols}) needs {needed:?} elements of its buffer, which has {len}")]
    Buffer {
        what: &'static str,
        rows: usize,
        cols: usize,
        needed: Option<usize>,
        len: usize,
    },
    #[error("weight producer: K = {k} is not a multiple of its block of {k_unit} values")]
    KUnit { k: usize, k_unit: usize },
    #[error("bias has {len} elements, C has {n} columns")]
    Bias { len: usize, n: usize },
    #[error("linear: x has {x} elements, W {w}, y {y}; expected rows={rows} x in, out={out_f} x in, rows x out")]
    Linear {
        x: usize,
        w: usize,
        y: usize,
        rows: usize,
        out_f: usize,
    },
}

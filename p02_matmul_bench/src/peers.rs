//! Peers measured in the same run: the `matrixmultiply` and `gemm` crates
//! (feature `peers`, on by default for this crate only) and numpy/OpenBLAS and
//! PyTorch through `scripts/bench_p02_peers.py`.

use std::process::Command;

use anyhow::{bail, Context, Result};

/// C = A B with the `matrixmultiply` crate (single-threaded build).
#[cfg(feature = "peers")]
pub fn matrixmultiply_sgemm(m: usize, k: usize, n: usize, a: &[f32], b: &[f32], c: &mut [f32]) {
    assert!(a.len() >= m * k && b.len() >= k * n && c.len() >= m * n);
    // SAFETY: row-major buffers of the asserted sizes; strides describe them.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            k as isize,
            1,
            b.as_ptr(),
            n as isize,
            1,
            0.0,
            c.as_mut_ptr(),
            n as isize,
            1,
        );
    }
}

/// C = A B with the `gemm` crate on `threads` threads (its own rayon split).
#[cfg(feature = "peers")]
pub fn gemm_crate_sgemm(
    m: usize,
    k: usize,
    n: usize,
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
    threads: usize,
) {
    assert!(a.len() >= m * k && b.len() >= k * n && c.len() >= m * n);
    let par = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: row-major buffers of the asserted sizes; (cs, rs) strides describe them.
    // With read_dst = false the crate computes dst = beta * lhs * rhs.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr(),
            1,
            k as isize,
            b.as_ptr(),
            1,
            n as isize,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            par,
        );
    }
}

/// Median seconds per call from the Python peers at one thread count.
#[derive(Clone, Debug, Default)]
pub struct PyPeers {
    pub threads: usize,
    pub versions: String,
    /// (n, numpy_s, torch_s)
    pub square: Vec<(usize, f64, f64)>,
    /// (m, k, n, numpy_s, torch_s)
    pub linear: Vec<(usize, usize, usize, f64, f64)>,
}

/// Run `scripts/bench_p02_peers.py` with `threads` threads.
pub fn python_peers(
    sizes: &[usize],
    linear: &[(usize, usize, usize)],
    threads: usize,
) -> Result<PyPeers> {
    let root = common::assets::workspace_root();
    let python = root.join(".venv-ref/bin/python");
    if !python.exists() {
        bail!(
            "numpy/PyTorch peers not installed: {} is missing. Run `python3 -m venv .venv-ref && \
             .venv-ref/bin/pip install -r scripts/requirements.txt`, or pass --no-python",
            python.display()
        );
    }
    let sizes: Vec<String> = sizes.iter().map(usize::to_string).collect();
    let shapes: Vec<String> = linear
        .iter()
        .map(|(m, k, n)| format!("{m}:{k}:{n}"))
        .collect();
    let t = threads.to_string();
    let out = Command::new(&python)
        .arg(root.join("scripts/bench_p02_peers.py"))
        .args([
            "--sizes",
            &sizes.join(","),
            "--linear",
            &shapes.join(","),
            "--threads",
            &t,
        ])
        .env("OPENBLAS_NUM_THREADS", &t)
        .env("OMP_NUM_THREADS", &t)
        .env("MKL_NUM_THREADS", &t)
        .output()
        .context("running scripts/bench_p02_peers.py")?;
    if !out.status.success() {
        bail!(
            "bench_p02_peers.py failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("parsing the peers' JSON")?;
    let f = |x: &serde_json::Value| x.as_f64().unwrap_or(f64::NAN);
    let u = |x: &serde_json::Value| x.as_u64().unwrap_or(0) as usize;
    Ok(PyPeers {
        threads,
        versions: format!(
            "numpy {} ({}), torch {}",
            v["numpy"].as_str().unwrap_or("?"),
            v["blas"].as_str().unwrap_or("?"),
            v["torch"].as_str().unwrap_or("?")
        ),
        square: v["square"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|p| (u(&p["n"]), f(&p["numpy_s"]), f(&p["torch_s"])))
            .collect(),
        linear: v["linear"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|p| {
                (
                    u(&p["m"]),
                    u(&p["k"]),
                    u(&p["n"]),
                    f(&p["numpy_s"]),
                    f(&p["torch_s"]),
                )
            })
            .collect(),
    })
}

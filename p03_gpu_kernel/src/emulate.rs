//! Run CUDA C on the CPU, for tests: a `.cu` file, unchanged, compiled as
//! C++20 against `tests/emulate/cuda_shim.h` (blocks in turn, a block's
//! threads as OS threads, real barriers and warp exchanges), with
//! AddressSanitizer and UBSan, by the machine's C++ compiler.
//!
//! It checks the logic a kernel is made of (index arithmetic, bounds
//! guards, tails, barriers, reductions; an out-of-bounds access fails it) on
//! every test run. What it cannot check (speed, coalescing, races that a CPU
//! schedule hides) is left to the GPU run (`scripts/gpu_check.sh`).

use std::path::{Path, PathBuf};
use std::process::Command;

/// The directory holding `cuda_shim.h`.
pub fn shim_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/emulate")
}

/// Why an emulated run did not pass.
#[derive(Debug, thiserror::Error)]
pub enum EmulateError {
    #[error("{cxx} not runnable ({source}): install a C++ compiler (Debian: apt-get install g++)")]
    NoCompiler { cxx: String, source: std::io::Error },
    #[error("{cxx} refused {source_file}:\n{stderr}")]
    Compile {
        cxx: String,
        source_file: PathBuf,
        stderr: String,
    },
    #[error("the emulated program failed ({status}):\n{stdout}\n{stderr}")]
    Run {
        status: String,
        stdout: String,
        stderr: String,
    },
}

/// Compile `source` (a C++ harness that includes the shim and a `.cu`
/// file from `includes`) into `exe`, run it, and return its standard output.
pub fn build_and_run(
    source: &Path,
    includes: &[PathBuf],
    exe: &Path,
) -> Result<String, EmulateError> {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let mut cmd = Command::new(&cxx);
    cmd.args([
        "-std=c++20",
        "-O1",
        "-g",
        "-pthread",
        "-fno-strict-aliasing",
    ])
    .args([
        "-fsanitize=address,undefined",
        "-fno-sanitize-recover=undefined",
    ])
    .args(["-Wall", "-Wno-unknown-pragmas", "-Werror"])
    .arg("-I")
    .arg(shim_dir());
    for dir in includes {
        cmd.arg("-I").arg(dir);
    }
    let out = cmd
        .arg(source)
        .arg("-o")
        .arg(exe)
        .output()
        .map_err(|source| EmulateError::NoCompiler {
            cxx: cxx.clone(),
            source,
        })?;
    if !out.status.success() {
        return Err(EmulateError::Compile {
            cxx,
            source_file: source.to_path_buf(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        });
    }
    let run = Command::new(exe)
        .output()
        .map_err(|source| EmulateError::NoCompiler {
            cxx: exe.display().to_string(),
            source,
        })?;
    let stdout = String::from_utf8_lossy(&run.stdout).into_owned();
    if !run.status.success() {
        return Err(EmulateError::Run {
            status: run.status.to_string(),
            stdout,
            stderr: String::from_utf8_lossy(&run.stderr).into_owned(),
        });
    }
    Ok(stdout)
}

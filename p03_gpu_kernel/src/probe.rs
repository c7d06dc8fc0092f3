//! Find the CUDA libraries before cudarc touches them.
//!
//! cudarc's `dynamic-loading` opens `libcuda`, `libnvrtc` and `libcublas` on
//! first use and *panics* when one is missing. A lab that must build and test
//! on machines with no GPU asks first: [`driver`] and [`nvrtc`] try the same
//! names cudarc will, and answer with [`GpuError::NoLibrary`] instead.
//!
//! NVRTC (the run-time compiler) needs no GPU. `scripts/fetch_assets.sh
//! nvrtc` puts NVIDIA's pip wheel of it under `assets/nvrtc/lib`, and
//! [`preload_nvrtc_from`] loads it by path, so the kernel sources are
//! compiled to PTX by every CI run, not only on the GPU machine.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::error::GpuError;

/// The file names cudarc tries for `lib` ("cuda", "nvrtc", "cublas"), in
/// its order (`libcuda.so`, `libcuda.so.1`, `libnvrtc.so.13`, ...).
pub fn candidates(lib: &str) -> Vec<String> {
    let mut names = cudarc::get_lib_name_candidates(lib);
    // cudarc's list repeats some names; each is tried (and reported) once.
    let mut seen = std::collections::HashSet::new();
    names.retain(|n| seen.insert(n.clone()));
    names
}

/// The first of `names` the dynamic loader can open, if any. The handle is
/// dropped: this only asks.
pub fn first_loadable(names: &[String]) -> Option<String> {
    names.iter().find_map(|n| {
        // SAFETY: opening a shared library runs its initialisers. These are
        // NVIDIA's CUDA libraries (or absent); their initialisers do not touch
        // this process's state beyond registering themselves.
        unsafe { libloading::Library::new(n) }
            .ok()
            .map(|_| n.clone())
    })
}

fn require(
    library: &'static str,
    names: Vec<String>,
    hint: &'static str,
) -> Result<String, GpuError> {
    first_loadable(&names).ok_or_else(|| GpuError::NoLibrary {
        library,
        tried: names.join(", "),
        hint,
    })
}

/// The driver library, or why not.
pub fn driver() -> Result<String, GpuError> {
    require(
        "driver",
        candidates("cuda"),
        "this machine has no NVIDIA driver; GPU tests run on the device machine (scripts/gpu_check.sh)",
    )
}

/// The NVRTC library, or why not.
pub fn nvrtc() -> Result<String, GpuError> {
    preload_default_nvrtc();
    require(
        "NVRTC",
        candidates("nvrtc"),
        "put the CUDA libraries on LD_LIBRARY_PATH, or run `bash scripts/fetch_assets.sh nvrtc`",
    )
}

/// The cuBLAS library, or why not.
pub fn cublas() -> Result<String, GpuError> {
    require(
        "cuBLAS",
        candidates("cublas"),
        "put the CUDA libraries (libcublas.so.13, libcublasLt.so.13) on LD_LIBRARY_PATH",
    )
}

/// Where `scripts/fetch_assets.sh nvrtc` puts the NVRTC wheel's libraries.
pub fn fetched_nvrtc_dir() -> PathBuf {
    common::assets::workspace_root().join("assets/nvrtc/lib")
}

/// The NVRTC libraries in `dir`, opened by path and kept open for the
/// process. Once open, the loader resolves the bare sonames cudarc asks for
/// (`libnvrtc.so.13`) and NVRTC's own `dlopen` of its builtins to these
/// copies, with no LD_LIBRARY_PATH.
pub fn preload_nvrtc_from(dir: &Path) -> Result<(), GpuError> {
    static KEPT: OnceLock<Vec<libloading::Library>> = OnceLock::new();
    const FILES: [&str; 2] = ["libnvrtc-builtins.so.13.0", "libnvrtc.so.13"];
    if let Some(missing) = FILES.iter().map(|f| dir.join(f)).find(|p| !p.is_file()) {
        return Err(GpuError::NoLibrary {
            library: "NVRTC",
            tried: missing.display().to_string(),
            hint: "run `bash scripts/fetch_assets.sh nvrtc`",
        });
    }
    if KEPT.get().is_some() {
        return Ok(());
    }
    let mut libs = Vec::new();
    for name in FILES {
        let path = dir.join(name);
        // SAFETY: as in `first_loadable`: NVIDIA's NVRTC, which registers
        // itself and nothing else when loaded.
        let lib = unsafe { libloading::Library::new(&path) }.map_err(|e| GpuError::NoLibrary {
            library: "NVRTC",
            tried: format!("{} ({e})", path.display()),
            hint: "run `bash scripts/fetch_assets.sh nvrtc`",
        })?;
        libs.push(lib);
    }
    let _ = KEPT.set(libs);
    Ok(())
}

/// Preload the fetched NVRTC if it is there (quietly nothing otherwise:
/// the system's may be on the loader path).
fn preload_default_nvrtc() {
    let dir = fetched_nvrtc_dir();
    if dir.join("libnvrtc.so.13").exists() {
        let _ = preload_nvrtc_from(&dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_names_tried_are_cudas_sonames() {
        let c = candidates("cuda");
        assert!(c.iter().any(|n| n == "libcuda.so.1"), "{c:?}");
        // The version feature (cuda-13000) picks the major version tried.
        let r = candidates("nvrtc");
        assert!(r.iter().any(|n| n == "libnvrtc.so.13"), "{r:?}");
    }

    #[test]
    fn a_library_that_is_not_there_is_an_error_naming_what_was_tried() {
        let names = vec!["libno-such-cuda-lib.so.99".to_string()];
        assert_eq!(first_loadable(&names), None);
        let e = require("driver", names, "hint").unwrap_err();
        let text = e.to_string();
        assert!(text.contains("libno-such-cuda-lib.so.99"), "{text}");
        assert!(matches!(
            e,
            GpuError::NoLibrary {
                library: "driver",
                ..
            }
        ));
    }

    #[test]
    fn a_library_that_is_there_is_found() {
        // libc is on every Linux machine: the probe itself works.
        let names = vec!["libno-such.so".to_string(), "libc.so.6".to_string()];
        assert_eq!(first_loadable(&names).as_deref(), Some("libc.so.6"));
    }

    #[test]
    fn a_missing_nvrtc_dir_is_an_error_not_a_panic() {
        let e = preload_nvrtc_from(Path::new("/nonexistent/nvrtc")).unwrap_err();
        assert!(e.to_string().contains("fetch_assets.sh nvrtc"), "{e}");
    }
}

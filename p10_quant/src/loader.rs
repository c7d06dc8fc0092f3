//! Project 04's GGUF loader with native weights: every projection whose
//! tensor is Q4_0, Q4_1 or Q8_0 stays in its blocks (a [`QuantMatrix`]);
//! anything else falls back to f32. [`Requantize`] instead reads every
//! projection as f32 and quantises it again with this crate's quantisers
//! (the weight-quantisation study).

use std::path::Path;

use anyhow::{Context, Result};
use p05_kv_cache::load::LoadedEngine;

use p04_transformer::{GgufFile, Keep, ModelError, Proj, ProjLoader, TensorInfo};

use crate::dot::Dot;
use crate::matrix::{Format, MatrixError, QuantMatrix};

/// Keep the file's quantised blocks, with `dot`'s kernels.
#[derive(Clone, Copy, Debug)]
pub struct NativeWeights {
    pub dot: Dot,
    /// Products of this many rows or more dequantise to f32; `usize::MAX`
    /// (the default) keeps every product on the integer path, so a row's
    /// result never depends on how many rows share its step. A threshold
    /// (e.g. [`crate::matrix::F32_GEMM_ROWS`]) is faster for long prompts
    /// on some machines but not batch-invariant.
    pub f32_rows: usize,
}

impl NativeWeights {
    /// The widest kernels, every product on the integer path.
    pub fn detect() -> NativeWeights {
        NativeWeights {
            dot: Dot::detect(),
            f32_rows: usize::MAX,
        }
    }

    /// [`NativeWeights::detect`] with products of `F32_GEMM_ROWS` rows or
    /// more on the f32 path: not batch-invariant (a token's logits change
    /// with the number of rows in its step).
    pub fn batch_variant() -> NativeWeights {
        NativeWeights {
            f32_rows: crate::matrix::F32_GEMM_ROWS,
            ..NativeWeights::detect()
        }
    }
}

impl ProjLoader for NativeWeights {
    fn load(
        &self,
        f: &GgufFile,
        name: &str,
        [out, inp]: [usize; 2],
        keep: &Keep,
    ) -> Result<Option<Proj>, ModelError> {
        let info = tensor_of_shape(f, name, [out, inp])?;
        let m = match QuantMatrix::from_gguf(info.ty, f.tensor_bytes(info), out, inp, self.dot) {
            Ok(m) => m,
            Err(MatrixError::Type(_)) => return Ok(None),
            Err(e) => return Err(matrix_err(f, name)(e)),
        };
        self.kept(m, keep).map_err(matrix_err(f, name))
    }
}

impl NativeWeights {
    /// The part `keep` names of `m`, on this loader's row threshold.
    fn kept(&self, m: QuantMatrix, keep: &Keep) -> Result<Option<Proj>, MatrixError> {
        let m = match keep.is_whole() {
            true => m,
            false => m.select(keep.rows.as_deref(), keep.cols.clone())?,
        };
        Ok(Some(Proj::from_weights(Box::new(
            m.with_f32_rows(self.f32_rows),
        ))))
    }
}

fn tensor_of_shape<'f>(
    f: &'f GgufFile,
    name: &str,
    shape: [usize; 2],
) -> Result<&'f TensorInfo, ModelError> {
    let info = f.header.tensor(name)?;
    if info.shape() != shape {
        return Err(ModelError::Shape {
            path: f.path.clone(),
            name: name.to_string(),
            expected: shape.to_vec(),
            found: info.shape(),
        });
    }
    Ok(info)
}

fn matrix_err<'a>(f: &'a GgufFile, name: &'a str) -> impl Fn(MatrixError) -> ModelError + 'a {
    move |e| ModelError::Weights {
        name: format!("{}: {name}", f.path.display()),
        source: Box::new(e),
    }
}

/// Every projection of the blocks read as f32, whatever the file holds,
/// and quantised to `format` by this crate: what each format costs in
/// accuracy, measured from the same f32 weights. The LM head (tied to the
/// embedding table) keeps the file's blocks, so the study varies the
/// blocks' format alone (llama.cpp, too, keeps the output tensor at 6 bits
/// or more in its 4-bit mixes).
#[derive(Clone, Copy, Debug)]
pub struct Requantize {
    pub format: Format,
    pub weights: NativeWeights,
}

impl ProjLoader for Requantize {
    fn load(
        &self,
        f: &GgufFile,
        name: &str,
        [out, inp]: [usize; 2],
        keep: &Keep,
    ) -> Result<Option<Proj>, ModelError> {
        if !name.starts_with("blk.") {
            return self.weights.load(f, name, [out, inp], keep);
        }
        let info = tensor_of_shape(f, name, [out, inp])?;
        let n = out.checked_mul(inp).ok_or_else(|| ModelError::Shape {
            path: f.path.clone(),
            name: name.to_string(),
            expected: vec![out, inp],
            found: info.shape(),
        })?;
        let mut w = vec![0.0f32; n];
        p04_transformer::dequantize(info.ty, f.tensor_bytes(info), &mut w).map_err(|e| {
            ModelError::Weights {
                name: format!("{}: {name}", f.path.display()),
                source: Box::new(e),
            }
        })?;
        let m = QuantMatrix::quantize(&w, out, inp, self.format, self.weights.dot)
            .map_err(matrix_err(f, name))?;
        self.weights.kept(m, keep).map_err(matrix_err(f, name))
    }
}

/// Which weights a server keeps its projections in.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    Hash,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Weights {
    /// Dequantise everything to f32 at load (Projects 04–09).
    F32,
    /// Keep the GGUF's Q4_0 / Q4_1 / Q8_0 blocks.
    #[default]
    Native,
}

impl Weights {
    /// The flag's and the spec's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Weights::F32 => "f32",
            Weights::Native => "native",
        }
    }
}

impl std::fmt::Display for Weights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A model ready to serve: the GGUF's blocks kept native (on this CPU's
/// batch-invariant kernels), or everything dequantised to f32 at load as
/// Projects 04–09 do. [`crate::serve::LoadArgs::load`] with no other flag.
pub fn load(path: &Path, weights: Weights) -> Result<LoadedEngine> {
    crate::serve::LoadArgs::of(weights).load(path)
}

/// Everything dequantised to f32 at load (Projects 04–09's model).
pub fn load_f32(path: &Path) -> Result<LoadedEngine> {
    p05_kv_cache::load::load(path).with_context(|| format!("loading {}", path.display()))
}

/// A model with its projections in the file's blocks, through `w`'s kernels.
/// Its attention runs on the same pool as its products.
pub fn load_native(path: &Path, w: NativeWeights) -> Result<LoadedEngine> {
    let mut loaded = p05_kv_cache::load::load_with(path, &w)
        .with_context(|| format!("loading {}", path.display()))?;
    loaded
        .engine
        .set_parallel(std::sync::Arc::new(crate::pool::GlobalPool));
    Ok(loaded)
}

/// This process's resident set, in bytes (0 where /proc is missing).
pub fn rss_bytes() -> usize {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<usize>().ok())
        .map_or(0, |pages| pages * 4096)
}

//! Project 04's GGUF loader with native weights: every projection whose
//! tensor is Q4_0, Q4_1 or Q8_0 stays in its blocks (a [`QuantMatrix`]);
//! anything else falls back to f32.

use p04_transformer::{GgufFile, ModelError, Proj, ProjLoader};

use crate::dot::Dot;
use crate::matrix::{MatrixError, QuantMatrix};

/// Keep the file's quantised blocks, with `dot`'s kernels.
#[derive(Clone, Copy, Debug)]
pub struct NativeWeights {
    pub dot: Dot,
    /// Products of this many rows or more dequantise to f32 (prefill);
    /// `usize::MAX` keeps every product on the integer path.
    pub f32_rows: usize,
}

impl NativeWeights {
    /// The widest kernels, the default prefill threshold.
    pub fn detect() -> NativeWeights {
        NativeWeights {
            dot: Dot::detect(),
            f32_rows: crate::matrix::F32_GEMM_ROWS,
        }
    }
}

impl ProjLoader for NativeWeights {
    fn load(
        &self,
        f: &GgufFile,
        name: &str,
        [out, inp]: [usize; 2],
        rows: Option<&[usize]>,
    ) -> Result<Option<Proj>, ModelError> {
        let info = f.header.tensor(name)?;
        if info.shape() != [out, inp] {
            return Err(ModelError::Shape {
                path: f.path.clone(),
                name: name.to_string(),
                expected: vec![out, inp],
                found: info.shape(),
            });
        }
        let err = |e: MatrixError| ModelError::Weights {
            name: format!("{}: {name}", f.path.display()),
            msg: e.to_string(),
        };
        let m = match QuantMatrix::from_gguf(info.ty, f.tensor_bytes(info), out, inp, self.dot) {
            Ok(m) => m,
            Err(MatrixError::Type(_)) => return Ok(None),
            Err(e) => return Err(err(e)),
        };
        let m = match rows {
            Some(src) => m.permute_rows(src).map_err(err)?,
            None => m,
        }
        .with_f32_rows(self.f32_rows);
        Ok(Some(Proj::from_weights(Box::new(m))))
    }
}

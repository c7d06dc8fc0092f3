//! safetensors load and save on top of the `safetensors` crate.
//!
//! The crate validates the header (offsets inside the file, no overlaps, sizes
//! matching dtype x shape); this module turns what it yields into [`Tensor`]s
//! and turns every failure into an error that names the file and the tensor.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use thiserror::Error;

use crate::{Tensor, TensorError};

#[derive(Debug, Error)]
pub enum StError {
    #[error("{path}: cannot read: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not a valid safetensors file: {source}")]
    Format {
        path: PathBuf,
        source: safetensors::SafeTensorError,
    },
    #[error(
        "{path}: tensor `{name}` has dtype {dtype}; supported: F32 (and I64 for integer data)"
    )]
    Dtype {
        path: PathBuf,
        name: String,
        dtype: String,
    },
    #[error("{path}: tensor `{name}` is missing")]
    Missing { path: PathBuf, name: String },
    #[error("{path}: tensor `{name}`: {source}")]
    Tensor {
        path: PathBuf,
        name: String,
        source: TensorError,
    },
}

/// Everything in one safetensors file, decoded.
#[derive(Clone, Debug, Default)]
pub struct StFile {
    pub path: PathBuf,
    /// F32 tensors by name.
    pub tensors: BTreeMap<String, Tensor>,
    /// I64 tensors by name, as (shape, values).
    pub ints: BTreeMap<String, (Vec<usize>, Vec<i64>)>,
}

impl StFile {
    /// The F32 tensor `name`, or an error naming the file and tensor.
    pub fn tensor(&self, name: &str) -> Result<&Tensor, StError> {
        self.tensors.get(name).ok_or_else(|| StError::Missing {
            path: self.path.clone(),
            name: name.to_string(),
        })
    }

    /// Remove and return the F32 tensor `name`.
    pub fn take(&mut self, name: &str) -> Result<Tensor, StError> {
        self.tensors.remove(name).ok_or_else(|| StError::Missing {
            path: self.path.clone(),
            name: name.to_string(),
        })
    }

    /// The I64 tensor `name` as (shape, values).
    pub fn ints(&self, name: &str) -> Result<&(Vec<usize>, Vec<i64>), StError> {
        self.ints.get(name).ok_or_else(|| StError::Missing {
            path: self.path.clone(),
            name: name.to_string(),
        })
    }
}

/// Read and decode `path`.
pub fn load(path: &Path) -> Result<StFile, StError> {
    let bytes = std::fs::read(path).map_err(|source| StError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    parse(&bytes, path)
}

/// Decode safetensors `bytes` (from a read or a memory map); `path` is only
/// used in error messages.
pub fn parse(bytes: &[u8], path: &Path) -> Result<StFile, StError> {
    let st = SafeTensors::deserialize(bytes).map_err(|source| StError::Format {
        path: path.to_path_buf(),
        source,
    })?;
    let mut out = StFile {
        path: path.to_path_buf(),
        ..StFile::default()
    };
    for (name, view) in st.tensors() {
        let shape = view.shape().to_vec();
        match view.dtype() {
            Dtype::F32 => {
                let data: Vec<f32> = view
                    .data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                let t = Tensor::new(shape, data).map_err(|source| StError::Tensor {
                    path: path.to_path_buf(),
                    name: name.clone(),
                    source,
                })?;
                out.tensors.insert(name, t);
            }
            Dtype::I64 => {
                let data: Vec<i64> = view
                    .data()
                    .chunks_exact(8)
                    .map(|b| i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
                    .collect();
                out.ints.insert(name, (shape, data));
            }
            other => {
                return Err(StError::Dtype {
                    path: path.to_path_buf(),
                    name,
                    dtype: format!("{other:?}"),
                })
            }
        }
    }
    Ok(out)
}

/// Write F32 tensors to `path` in safetensors format.
pub fn save(path: &Path, tensors: &[(&str, &Tensor)]) -> Result<(), StError> {
    let bytes: Vec<(String, Vec<u8>, Vec<usize>)> = tensors
        .iter()
        .map(|(name, t)| {
            let b: Vec<u8> = t.data().iter().flat_map(|v| v.to_le_bytes()).collect();
            (name.to_string(), b, t.shape().to_vec())
        })
        .collect();
    let mut views = Vec::with_capacity(bytes.len());
    for (name, b, shape) in &bytes {
        let view =
            TensorView::new(Dtype::F32, shape.clone(), b).map_err(|source| StError::Format {
                path: path.to_path_buf(),
                source,
            })?;
        views.push((name.clone(), view));
    }
    safetensors::serialize_to_file(views, None, path).map_err(|source| StError::Format {
        path: path.to_path_buf(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_errors() {
        let dir = std::env::temp_dir().join(format!("common-st-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("t.safetensors");
        let a = Tensor::new(vec![2, 3], vec![1.0, -2.0, 3.5, 0.0, 1e-7, 9.0]).unwrap();
        let b = Tensor::new(vec![4], vec![0.25; 4]).unwrap();
        save(&p, &[("a", &a), ("b", &b)]).unwrap();
        let f = load(&p).unwrap();
        assert_eq!(f.tensor("a").unwrap(), &a);
        assert_eq!(f.tensor("b").unwrap(), &b);
        let missing = f.tensor("c").unwrap_err().to_string();
        assert!(
            missing.contains("t.safetensors") && missing.contains("`c`"),
            "{missing}"
        );

        // Truncations at every length must give a typed error, never a panic.
        let bytes = std::fs::read(&p).unwrap();
        for cut in 0..bytes.len() {
            assert!(
                parse(&bytes[..cut], &p).is_err(),
                "truncated at {cut} parsed"
            );
        }
        let err = load(&dir.join("nope.safetensors")).unwrap_err().to_string();
        assert!(err.contains("nope.safetensors"), "{err}");
        std::fs::remove_dir_all(&dir).ok();
    }
}

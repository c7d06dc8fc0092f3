//! A GGUF file opened for use: memory-mapped, header validated, tensors
//! dequantised to f32 on request.

use std::path::{Path, PathBuf};

use common::Tensor;

use crate::dequant::dequantize;
use crate::gguf::{parse, GgufError, GgufHeader, TensorInfo};

/// A memory-mapped GGUF file.
#[derive(Debug)]
pub struct GgufFile {
    pub path: PathBuf,
    map: memmap2::Mmap,
    pub header: GgufHeader,
}

impl GgufFile {
    /// Map and parse `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
        let path = path.as_ref();
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the map is read-only. Like every mmap-based loader, it
        // assumes no other process truncates the file while it is open.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        let header = parse(&map, path)?;
        Ok(GgufFile {
            path: path.to_path_buf(),
            map,
            header,
        })
    }

    /// The raw bytes of a tensor (inside the file: checked at parse). An
    /// info from another file whose range lies outside this one gives an
    /// empty slice, which every format's length check then refuses.
    pub fn tensor_bytes(&self, info: &TensorInfo) -> &[u8] {
        info.start
            .checked_add(info.n_bytes)
            .and_then(|end| self.map.get(info.start..end))
            .unwrap_or(&[])
    }

    /// Tensor `name` dequantised to f32, shape row-major (ggml dims reversed).
    pub fn tensor_f32(&self, name: &str) -> Result<Tensor, GgufError> {
        let info = self.header.tensor(name)?;
        let mut data = vec![0.0f32; info.numel()];
        dequantize(info.ty, self.tensor_bytes(info), &mut data).map_err(|e| GgufError::Tensor {
            path: self.path.clone(),
            tensor: name.to_string(),
            problem: e.into(),
        })?;
        Tensor::new(info.shape(), data).map_err(|e| GgufError::Tensor {
            path: self.path.clone(),
            tensor: name.to_string(),
            problem: e.into(),
        })
    }
}

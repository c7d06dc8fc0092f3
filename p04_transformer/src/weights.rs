//! Where weights come from: a GGUF file (dequantised) or a Hugging Face
//! directory (`config.json` + `model.safetensors`). Every tensor is checked
//! against the shape the architecture expects, with an error naming both.

use std::path::{Path, PathBuf};

use common::st::StFile;
use serde_json::Value as Json;

use crate::error::ModelError;
use crate::model_file::GgufFile;

/// A Hugging Face model directory.
#[derive(Debug)]
pub struct HfDir {
    pub config_path: PathBuf,
    pub config: Json,
    pub weights: StFile,
}

impl HfDir {
    pub fn open(dir: &Path) -> Result<HfDir, ModelError> {
        let config_path = dir.join("config.json");
        let text = std::fs::read_to_string(&config_path).map_err(|source| ModelError::Io {
            path: config_path.clone(),
            source,
        })?;
        let config: Json = serde_json::from_str(&text).map_err(|source| ModelError::Json {
            path: config_path.clone(),
            source,
        })?;
        let weights = common::st::load(&dir.join("model.safetensors"))?;
        Ok(HfDir {
            config_path,
            config,
            weights,
        })
    }

    /// A non-negative integer config field.
    pub fn usize(&self, key: &str) -> Result<usize, ModelError> {
        self.config[key]
            .as_u64()
            .map(|v| v as usize)
            .ok_or_else(|| ModelError::Config {
                path: self.config_path.clone(),
                msg: format!(
                    "`{key}` must be a non-negative integer, found {}",
                    self.config[key]
                ),
            })
    }

    pub fn has(&self, name: &str) -> bool {
        self.weights.tensors.contains_key(name)
    }
}

/// A tensor source for the loaders.
#[derive(Clone, Copy, Debug)]
pub enum Source<'a> {
    Gguf(&'a GgufFile),
    Hf(&'a HfDir),
}

impl Source<'_> {
    /// Tensor `name` as f32, checked to have row-major `shape`.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        let (t, path) = match self {
            Source::Gguf(f) => (f.tensor_f32(name)?, f.path.clone()),
            Source::Hf(h) => (h.weights.tensor(name)?.clone(), h.weights.path.clone()),
        };
        if t.shape() != shape {
            return Err(ModelError::Shape {
                path,
                name: name.to_string(),
                expected: shape.to_vec(),
                found: t.shape().to_vec(),
            });
        }
        Ok(t.into_data())
    }
}

//! From `--model` to a started engine, apart from HTTP: what names a
//! model, how it loads (weights and tokenizer), and the errors of loading
//! and starting. Every serving binary goes through here.

use std::path::{Path, PathBuf};

use p04_transformer::Tokenizer;
use p05_kv_cache::llama_engine::LlamaEngine;
use p05_kv_cache::load::LoadedEngine;

/// The name clients use for `--model`: SmolLM2's for `smollm2`, else the file stem.
pub fn served_name(spec: &str) -> String {
    if spec.eq_ignore_ascii_case("smollm2") {
        return "SmolLM2-135M-Instruct".to_string();
    }
    Path::new(spec)
        .file_stem()
        .map_or_else(|| spec.to_string(), |s| s.to_string_lossy().into_owned())
}

/// `--model`: `smollm2` (fetched on first use) or a path.
pub fn resolve_model(spec: &str) -> Result<PathBuf, ResolveError> {
    if spec.eq_ignore_ascii_case("smollm2") {
        return Ok(common::assets::ensure(common::assets::Asset::SmolLm2)?);
    }
    let path = PathBuf::from(spec);
    if !path.exists() {
        return Err(ResolveError::NotFound {
            spec: spec.to_string(),
        });
    }
    Ok(path)
}

/// A model loaded with every weight f32 (Project 05's loader), its
/// failure naming the path.
pub fn load_f32(path: &Path) -> Result<LoadedEngine, LoadError> {
    p05_kv_cache::load::load(path).map_err(|source| LoadError::Model {
        path: path.to_path_buf(),
        source: Box::new(source),
    })
}

/// A model and its tokenizer, loaded (every weight f32).
pub fn load_local(path: &Path) -> Result<(LlamaEngine, Tokenizer), LoadError> {
    with_tokenizer(path, load_f32(path)?)
}

/// A loaded model's parts, or the error a model without a tokenizer is to
/// a text server.
pub fn with_tokenizer(
    path: &Path,
    loaded: LoadedEngine,
) -> Result<(LlamaEngine, Tokenizer), LoadError> {
    let tokenizer = loaded.tokenizer.ok_or_else(|| LoadError::NoTokenizer {
        path: path.to_path_buf(),
    })?;
    Ok((loaded.engine, tokenizer))
}

/// Why an engine did not start (before it takes any request).
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("the model's chat template: {0}")]
    Prompt(#[from] p04_transformer::PromptError),
    #[error("cannot start the model thread: {0}")]
    Thread(#[source] std::io::Error),
    /// A later engine's own settings (the scheduler's knobs, the K/V pool),
    /// which this crate cannot name.
    #[error("{0}")]
    Config(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// Why `--model` did not name a model.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error(transparent)]
    Asset(#[from] common::assets::AssetError),
    #[error("--model {spec}: no such file or directory (use `smollm2`, a .gguf file or an HF Llama directory)")]
    NotFound { spec: String },
}

/// Why a model could not be loaded and served.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: {source}")]
    Model {
        path: std::path::PathBuf,
        /// Boxed: the loader's error is large beside the others.
        source: Box<p05_kv_cache::LocalModelError>,
    },
    #[error("{path} has no tokenizer to serve text with")]
    NoTokenizer { path: std::path::PathBuf },
    #[error(transparent)]
    Start(#[from] StartError),
}

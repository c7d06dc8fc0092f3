//! Any supported model behind one type: a GGUF file (Llama family) or a
//! Hugging Face directory (`model_type` llama or gpt2).

use std::path::Path;

use common::Tensor;

use crate::error::ModelError;
use crate::gpt2::Gpt2;
use crate::llama::Llama;
use crate::model_file::GgufFile;
use crate::tokenizer::Tokenizer;

/// A loaded transformer of either architecture (named `Transformer`, not
/// `Model`: `common::Model` is the logits-level seam that Project 05's
/// engines implement).
#[derive(Debug)]
pub enum Transformer {
    Llama(Llama),
    Gpt2(Gpt2),
}

/// A model with its tokenizer (when the files carry one we can read).
#[derive(Debug)]
pub struct LoadedTransformer {
    pub model: Transformer,
    pub tokenizer: Option<Tokenizer>,
}

impl Transformer {
    /// Load a `.gguf` file or an HF directory.
    pub fn load(path: &Path) -> Result<LoadedTransformer, ModelError> {
        if path.is_dir() {
            let cfg_path = path.join("config.json");
            let text = std::fs::read_to_string(&cfg_path).map_err(|source| ModelError::Io {
                path: cfg_path.clone(),
                source,
            })?;
            let cfg: serde_json::Value =
                serde_json::from_str(&text).map_err(|source| ModelError::Json {
                    path: cfg_path.clone(),
                    source,
                })?;
            let model = match cfg["model_type"].as_str() {
                Some("llama") => Transformer::Llama(Llama::from_hf_dir(path)?),
                Some("gpt2") => Transformer::Gpt2(Gpt2::from_hf_dir(path)?),
                other => {
                    return Err(ModelError::Arch {
                        path: cfg_path,
                        found: other.unwrap_or("(none)").to_string(),
                        supported: "llama, gpt2",
                    })
                }
            };
            let tok_path = path.join("tokenizer.json");
            let tokenizer = if tok_path.exists() {
                Some(Tokenizer::from_tokenizer_json(&tok_path)?)
            } else {
                None
            };
            Ok(LoadedTransformer { model, tokenizer })
        } else {
            let f = GgufFile::open(path)?;
            let model = Transformer::Llama(Llama::from_gguf(&f)?);
            let tokenizer = Some(Tokenizer::from_gguf(&f.header)?);
            Ok(LoadedTransformer { model, tokenizer })
        }
    }

    pub fn forward(&self, ids: &[u32], batch: usize, seq: usize) -> Result<Tensor, ModelError> {
        match self {
            Transformer::Llama(m) => m.forward(ids, batch, seq),
            Transformer::Gpt2(m) => m.forward(ids, batch, seq),
        }
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            Transformer::Llama(m) => m.cfg.vocab_size,
            Transformer::Gpt2(m) => m.cfg.vocab_size,
        }
    }

    pub fn context(&self) -> usize {
        match self {
            Transformer::Llama(m) => m.cfg.max_seq,
            Transformer::Gpt2(m) => m.cfg.n_positions,
        }
    }
}

/// Index of the largest logit in the last position of a (1, seq, vocab) output.
pub fn argmax_last(logits: &Tensor) -> u32 {
    let v = *logits.shape().last().unwrap_or(&1);
    // An empty output (no positions) has no last row: token 0, never a panic.
    common::argmax(&logits.data()[logits.numel().saturating_sub(v)..])
}

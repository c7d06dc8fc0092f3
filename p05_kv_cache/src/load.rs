//! Open a model for serving: a GGUF file (Llama family, with its tokenizer)
//! or an HF Llama directory (tokenizer.json if present).

use std::path::Path;

use common::ModelInfo;
use p04_transformer::llama::F32Weights;
use p04_transformer::{GgufFile, Llama, ProjLoader, Split, Tokenizer};

use crate::llama_engine::LlamaEngine;
use crate::LocalModelError;

/// An engine and its tokenizer.
#[derive(Debug)]
pub struct LoadedEngine {
    pub engine: LlamaEngine,
    pub tokenizer: Option<Tokenizer>,
}

/// Every weight in f32.
pub fn load(path: &Path) -> Result<LoadedEngine, LocalModelError> {
    load_with(path, &F32Weights)
}

/// A GGUF file's projections in the format `loader` chooses (Project 10:
/// the file's own quantised blocks); a directory is always f32.
pub fn load_with(path: &Path, loader: &dyn ProjLoader) -> Result<LoadedEngine, LocalModelError> {
    load_split(path, loader, Split::whole())
}

/// [`load_with`] keeping `split`'s part of each projection (a
/// tensor-parallel rank's, Project 13).
pub fn load_split(
    path: &Path,
    loader: &dyn ProjLoader,
    split: Split,
) -> Result<LoadedEngine, LocalModelError> {
    let (model, tokenizer, name) = if path.is_dir() {
        let tok = path.join("tokenizer.json");
        let tokenizer = if tok.exists() {
            Some(Tokenizer::from_tokenizer_json(&tok)?)
        } else {
            None
        };
        (
            Llama::from_hf_dir_split(path, split)?,
            tokenizer,
            path.display().to_string(),
        )
    } else {
        let f = GgufFile::open(path).map_err(p04_transformer::ModelError::from)?;
        let name = f
            .header
            .get_str("general.name")
            .unwrap_or("gguf model")
            .to_string();
        (
            Llama::from_gguf_split(&f, loader, split)?,
            Some(Tokenizer::from_gguf(&f.header)?),
            name,
        )
    };
    let info = model_info(
        name,
        model.cfg.vocab_size,
        model.cfg.max_seq,
        tokenizer.as_ref(),
    );
    Ok(LoadedEngine {
        engine: LlamaEngine::new(model, info),
        tokenizer,
    })
}

/// What callers know of a model apart from its weights: its name, sizes
/// and stop tokens (the tokenizer's end of sequence and the chat
/// template's end of turn). A front end that only tokenizes (Project 14's
/// proxy) builds the same record as the engine behind it.
pub fn model_info(
    name: String,
    vocab_size: usize,
    context_length: usize,
    tokenizer: Option<&Tokenizer>,
) -> ModelInfo {
    let mut stop_ids: Vec<u32> = Vec::new();
    if let Some(t) = tokenizer {
        stop_ids.extend(t.eos_id);
        for s in ["<|im_end|>", "<|endoftext|>"] {
            if let Some(id) = t.id(s) {
                if !stop_ids.contains(&id) {
                    stop_ids.push(id);
                }
            }
        }
    }
    ModelInfo {
        name,
        vocab_size,
        context_length,
        bos_id: tokenizer.and_then(|t| t.bos_id),
        stop_ids,
    }
}

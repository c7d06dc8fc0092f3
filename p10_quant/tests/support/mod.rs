//! SmolLM2 loaded once per test binary, with native and with f32 weights.

#![allow(dead_code)]

use std::sync::OnceLock;

use p04_transformer::Tokenizer;
use p05_kv_cache::llama_engine::LlamaEngine;

pub struct Model {
    pub engine: LlamaEngine,
    pub tok: Tokenizer,
}

fn load(native: bool) -> Model {
    let path =
        common::assets::ensure(common::assets::Asset::SmolLm2).unwrap_or_else(|e| panic!("{e}"));
    let loaded = match native {
        true => p10_quant::loader::load_native(&path, p10_quant::NativeWeights::detect()),
        false => p10_quant::loader::load(&path, p10_quant::Weights::F32),
    }
    .unwrap();
    Model {
        engine: loaded.engine,
        tok: loaded.tokenizer.unwrap(),
    }
}

pub fn native() -> &'static Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| load(true))
}

pub fn f32_model() -> &'static Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| load(false))
}

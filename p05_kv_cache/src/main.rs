//! `cargo run --release -p p05_kv_cache -- generate | bench`: a thin front.

use std::io::Write as _;
use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::{Parser, Subcommand};
use p05_kv_cache::generate::{generate, GenerateParams};
use p05_kv_cache::sampling::SamplingParams;

#[derive(Parser, Debug)]
#[command(about = "Project 05: KV cache, sampling, generation")]
struct Cli {
    /// A .gguf file or an HF Llama directory (default: the fetched SmolLM2-135M-Instruct).
    #[arg(long, global = true)]
    model: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Stream a completion; report prefill and decode tokens/s.
    Generate {
        #[arg(long)]
        prompt: String,
        #[arg(long)]
        chat: bool,
        #[arg(short = 'n', long = "max-tokens", default_value_t = 256)]
        max_tokens: usize,
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        #[arg(long)]
        top_k: Option<usize>,
        #[arg(long, default_value_t = 1.0)]
        top_p: f32,
        #[arg(long, default_value_t = 0.0)]
        min_p: f32,
        #[arg(long, default_value_t = 1.0)]
        repetition_penalty: f32,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Stop strings (repeatable).
        #[arg(long)]
        stop: Vec<String>,
    },
    /// Decode latency vs position with and without the cache, prefill and decode speed, peers.
    Bench {
        #[arg(long)]
        no_peers: bool,
        #[arg(long)]
        no_record: bool,
    },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let path = match cli.model {
        Some(p) => p,
        None => {
            common::assets::ensure(common::assets::Asset::SmolLm2).map_err(anyhow::Error::msg)?
        }
    };
    let mut loaded = p05_kv_cache::load::load(&path)?;
    match cli.cmd {
        Cmd::Generate {
            prompt,
            chat,
            max_tokens,
            temperature,
            top_k,
            top_p,
            min_p,
            repetition_penalty,
            seed,
            stop,
        } => {
            let Some(tok) = loaded.tokenizer.take() else {
                bail!("{} has no tokenizer", path.display())
            };
            // The one input path: the model's chat template and BOS policy.
            let prompts = p04_transformer::PromptBuilder::new(std::sync::Arc::new(tok))?;
            let ids = if chat {
                prompts.encode_chat(&[("user", prompt.as_str())])?
            } else {
                prompts.encode_text(&prompt)
            };
            let params = GenerateParams {
                max_tokens,
                sampling: SamplingParams {
                    temperature,
                    top_k,
                    top_p,
                    min_p,
                    repetition_penalty,
                    seed: Some(seed),
                },
                stop_ids: vec![],
                stop_strings: stop,
                ignore_eos: false,
                min_tokens: 0,
                logprobs: None,
            };
            if !chat {
                print!("{prompt}");
            }
            let g = generate(
                &loaded.engine,
                prompts.tokenizer(),
                &ids,
                &params,
                |piece| {
                    print!("{piece}");
                    let _ = std::io::stdout().flush();
                },
            )?;
            let why = g.finish.as_str();
            println!(
                "\n\n[prefill {} tokens: {:.1} tok/s | decode {} tokens: {:.1} tok/s | finish: {why}]",
                g.prompt_tokens,
                g.prefill_tok_per_s(),
                g.tokens.len(),
                g.decode_tok_per_s()
            );
        }
        Cmd::Bench {
            no_peers,
            no_record,
        } => {
            let command = common::numbers::command_line("p05_kv_cache");
            p05_kv_cache::bench::run(&loaded.engine, &path, !no_peers, !no_record, &command)?;
        }
    }
    Ok(())
}

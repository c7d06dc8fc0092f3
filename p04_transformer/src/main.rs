//! `cargo run --release -p p04_transformer -- generate | trace | inspect | bench`: a thin front.

use std::io::Write as _;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use p04_transformer::generate::{greedy, Utf8Stream};
use p04_transformer::model::{LoadedTransformer, Transformer};

#[derive(Parser, Debug)]
#[command(about = "Project 04: a transformer engine (GPT-2, Llama family) from GGUF or HF files")]
struct Cli {
    /// A .gguf file or an HF directory (default: the fetched SmolLM2-135M-Instruct).
    #[arg(long, global = true)]
    model: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Greedy continuation, recomputing the whole sequence each step (no KV cache).
    Generate {
        #[arg(long)]
        prompt: String,
        /// Tokens to generate.
        #[arg(short = 'n', long, default_value_t = 32)]
        n: usize,
        /// Wrap the prompt in the model's chat template (ChatML for SmolLM2).
        #[arg(long)]
        chat: bool,
    },
    /// Each stage's shape with named axes, and causality checked with real forwards.
    Trace {
        #[arg(long, default_value = "The capital of France is")]
        prompt: String,
    },
    /// Architecture, parameter count, bytes by dtype, FLOPs per token.
    Inspect,
    /// Forward time vs sequence length, attention share, naive generation speed.
    Bench {
        #[arg(
            long,
            default_value = "16,32,64,128,256,512,1024",
            value_delimiter = ','
        )]
        seqs: Vec<usize>,
        #[arg(long)]
        no_record: bool,
    },
    /// Tokenize hostile prompts (one letter repeated, up to 1 MiB): the heap
    /// merge loop, and the naive one where it finishes.
    TokenizeBench {
        #[arg(long)]
        no_record: bool,
    },
}

fn model_path(p: Option<PathBuf>) -> Result<PathBuf> {
    match p {
        Some(p) => Ok(p),
        None => common::assets::ensure(common::assets::Asset::SmolLm2).map_err(anyhow::Error::msg),
    }
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let path = model_path(cli.model)?;
    if let Cmd::Inspect = cli.cmd {
        let f =
            p04_transformer::GgufFile::open(&path).with_context(|| "inspect reads GGUF files")?;
        print!("{}", p04_transformer::inspect::summary(&f.header)?);
        return Ok(());
    }
    if let Cmd::TokenizeBench { no_record } = cli.cmd {
        let f = p04_transformer::GgufFile::open(&path)
            .with_context(|| "tokenize-bench reads a GGUF's tokenizer")?;
        let tok = p04_transformer::Tokenizer::from_gguf(&f.header)?;
        let command = common::numbers::command_line("p04_transformer");
        return p04_transformer::tokenize_bench::run(&tok, !no_record, &command);
    }
    let LoadedTransformer { model, tokenizer } = Transformer::load(&path)?;
    match cli.cmd {
        Cmd::Generate { prompt, n, chat } => {
            let Some(tok) = tokenizer else {
                bail!(
                    "{} has no tokenizer (a GGUF file, or tokenizer.json beside config.json)",
                    path.display()
                )
            };
            // The one input path: the model's chat template and BOS policy.
            let tok = std::sync::Arc::new(tok);
            let prompts = p04_transformer::PromptBuilder::new(tok.clone())?;
            let ids = if chat {
                prompts.encode_chat(&[("user", prompt.as_str())])?
            } else {
                prompts.encode_text(&prompt)
            };
            let stop = if chat {
                tok.id("<|im_end|>")
            } else {
                tok.eos_id
            };
            print!("{prompt}");
            let mut stream = Utf8Stream::default();
            let (_, stats) = greedy(&model, &ids, n, stop, |id| {
                if Some(id) != stop {
                    print!("{}", stream.push(&tok.decode_bytes(&[id])));
                    let _ = std::io::stdout().flush();
                }
            })?;
            println!(
                "\n\n[{} prompt tokens, {} new tokens in {:.2} s: {:.2} tok/s, no KV cache]",
                stats.prompt_tokens,
                stats.new_tokens,
                stats.seconds,
                stats.tok_per_s()
            );
        }
        Cmd::Trace { prompt } => {
            let ids = match &tokenizer {
                Some(tok) => tok.encode(&prompt),
                None => (1..=8).collect(),
            };
            if ids.len() < 2 {
                bail!("trace needs a prompt of at least 2 tokens");
            }
            print!("{}", p04_transformer::trace::shapes(&model, ids.len()));
            let (earlier, last) = p04_transformer::trace::causality(&model, &ids)?;
            println!("\ncausality: changing the last token moved earlier positions' logits by at most {earlier:e} (must be 0);");
            println!("           changing the first token moved the last position's logits by up to {last:.4} (must be > 0)");
        }
        Cmd::Bench { seqs, no_record } => {
            let command = common::numbers::command_line("p04_transformer");
            p04_transformer::bench::run(&model, &seqs, !no_record, &command)?;
        }
        Cmd::Inspect | Cmd::TokenizeBench { .. } => unreachable!("handled above"),
    }
    Ok(())
}

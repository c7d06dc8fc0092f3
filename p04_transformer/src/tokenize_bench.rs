//! `p04_transformer tokenize-bench`: how long hostile prompts take to
//! tokenize. A run of one letter is one pre-token, the worst case for the
//! merge loop: the naive loop ([`Tokenizer::encode_naive`]) is quadratic in
//! it, the heap ([`crate::bpe`]) n log n. Rows (median and p95) go to
//! numbers.md.

use std::time::Duration;

use anyhow::Result;
use common::numbers::{Recorder, Row};
use common::stats::{time_it, BenchConfig, Summary};

use crate::tokenizer::Tokenizer;

/// Lengths of the one-letter prompt: the two measured ones and the
/// server's whole body limit (1 MiB).
pub const LENGTHS: [usize; 3] = [12_500, 100_000, 1 << 20];

/// The naive loop only at the shortest (quadratic: ~0.6 s at 12,500
/// letters, so about a minute at 100,000; the string version before it
/// took 13 s and 200 s).
pub const NAIVE_LENGTHS: [usize; 1] = [12_500];

fn timed(samples: usize, mut f: impl FnMut()) -> Summary {
    time_it(
        BenchConfig {
            warmup_iters: 1,
            min_samples: samples,
            min_time: Duration::ZERO,
            max_samples: samples,
        },
        &mut f,
    )
}

pub fn run(tok: &Tokenizer, record: bool, command: &str) -> Result<()> {
    let mut rows = Vec::new();
    let mut push = |what: &str, n: usize, s: &Summary, predicted: &str| {
        println!(
            "{what:>6} 'a' x {n:>9}: median {:9.2} ms, p95 {:9.2} ms ({} samples)",
            s.median * 1e3,
            s.p95 * 1e3,
            s.n
        );
        let metric = format!("p04 tokenize 'a' x {n}, {what}");
        rows.push(Row::new(format!("{metric}, median"), s.median * 1e3, "ms").predicted(predicted));
        rows.push(Row::new(format!("{metric}, p95"), s.p95 * 1e3, "ms"));
    };
    for n in LENGTHS {
        let text = "a".repeat(n);
        let mut ids = 0;
        let s = timed(5, || ids = tok.encode(&text).len());
        push("heap", n, &s, "n log n: well under 1 s at 1 MiB");
        println!("        ({ids} tokens)");
    }
    for n in NAIVE_LENGTHS {
        let text = "a".repeat(n);
        let s = timed(3, || {
            std::hint::black_box(tok.encode_naive(&text));
        });
        push("naive", n, &s, "n²: seconds");
    }
    if record {
        Recorder::for_workspace(command).append(&rows)?;
        println!("rows appended to numbers.md");
    }
    Ok(())
}

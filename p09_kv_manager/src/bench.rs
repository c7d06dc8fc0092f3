//! `p09_kv_manager bench`: what pages buy, measured.
//!
//! 1. internal fragmentation on a length mix: (slots allocated − tokens
//!    stored) / slots allocated, paged (block 16) vs a contiguous cache that
//!    reserves prompt + `max_tokens` (Project 07) and one that grows by
//!    doubling (Project 08);
//! 2. sequences that fit in a fixed budget at once, paged vs contiguous;
//! 3. TTFT of a request that shares a 512-token system prompt, cold vs
//!    warm (SmolLM2 through Project 08's engine core on pages);
//! 4. the prefix-cache hit rate of a multi-user chat workload;
//! 5. decode step time through block tables vs contiguous caches, nothing
//!    shared (the cost of the indirection);
//! 6. blocks held by `n = 4` samples of one prompt (forks, copy-on-write)
//!    vs four separate requests.

use std::time::{Duration, Instant};

use anyhow::Result;
use clap::Args;
use common::batch::{Batch, BatchModel, KvShape};
use common::numbers::{command_line, Recorder, Row};
use common::plot::{line_chart, Labels, Scale, Series};
use common::rng::Rng;
use common::stats::{summarize, time_it, BenchConfig, Summary};
use p05_kv_cache::generate::GenerateParams;
use p05_kv_cache::kv_cache::KvCache;
use p05_kv_cache::llama_engine::LlamaEngine;
use p07_batching::bench::decode_stores;
use p07_batching::bench_cmd::load_model;
use p08_continuous::runner::{KvStorage, PlannedSeq, SeqKv};
use p08_continuous::{ContinuousConfig, EngineCore, LocalCore};

use crate::{BlockPool, KvManager, PagedKv};

#[derive(Clone, Debug, Args)]
pub struct BenchArgs {
    #[arg(long, default_value = "smollm2")]
    pub model: String,
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Requests in the length mix.
    #[arg(long, default_value_t = 2000)]
    pub mix: usize,
    /// The requests' `max_tokens` (what a contiguous cache reserves beyond the prompt).
    #[arg(long, default_value_t = 512)]
    pub max_tokens: usize,
    /// The fixed budget of the concurrency comparison, in MiB.
    #[arg(long, default_value_t = 1024)]
    pub budget_mib: usize,
    /// Shared system-prompt length of the cold/warm TTFT test.
    #[arg(long, default_value_t = 512)]
    pub system_prompt: usize,
    /// Users and turns of the chat workload.
    #[arg(long, default_value_t = 6)]
    pub users: usize,
    #[arg(long, default_value_t = 3)]
    pub turns: usize,
    /// Decode batch and position of the indirection test.
    #[arg(long, default_value_t = 8)]
    pub decode_batch: usize,
    #[arg(long, default_value_t = 512)]
    pub decode_pos: usize,
    #[arg(long, default_value_t = 15)]
    pub samples: usize,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    #[arg(long)]
    pub no_record: bool,
}

/// A request of the mix: (prompt, output) lengths. Prompts log-uniform in
/// 16..2048, outputs log-uniform in 8..max_tokens (chat-like: most short,
/// a few long).
fn length_mix(n: usize, max_tokens: usize, rng: &mut Rng) -> Vec<(usize, usize)> {
    let log_uniform = |lo: f64, hi: f64, rng: &mut Rng| {
        (lo.ln() + rng.next_f64() * (hi.ln() - lo.ln())).exp() as usize
    };
    (0..n)
        .map(|_| {
            (
                log_uniform(16.0, 2048.0, rng),
                log_uniform(8.0, max_tokens as f64, rng),
            )
        })
        .collect()
}

pub fn run(a: &BenchArgs) -> Result<()> {
    let mut rows = Vec::new();
    let mut rng = Rng::new(a.seed);
    let bs = a.block_size;
    let mix = length_mix(a.mix, a.max_tokens, &mut rng);
    let stored: usize = mix.iter().map(|(p, o)| p + o).sum();

    // 1. Fragmentation: slots allocated for the same stored tokens.
    let paged: usize = mix.iter().map(|(p, o)| (p + o).div_ceil(bs) * bs).sum();
    let reserved: usize = mix.iter().map(|(p, _)| p + a.max_tokens).sum();
    let doubled: usize = mix
        .iter()
        .map(|(p, o)| {
            // p08: prompt + 1 rounded to 16, then doubling (capped at prompt + max_tokens).
            let (cap_max, need) = (p + a.max_tokens, p + o);
            let mut cap = (p + 1).div_ceil(16) * 16;
            while cap < need {
                cap = (2 * cap).min(cap_max).max(need.div_ceil(16) * 16);
            }
            cap.min(cap_max.max(need))
        })
        .sum();
    let frag = |alloc: usize| (alloc - stored) as f64 / alloc as f64 * 100.0;
    println!(
        "1. internal fragmentation, {} requests (prompts 16..2048, outputs 8..{}, log-uniform):",
        a.mix, a.max_tokens
    );
    for (name, alloc, pred) in [
        (
            format!("paged, block {bs}"),
            paged,
            format!("< 4% (about {bs}/2 slots per sequence)"),
        ),
        (
            "contiguous, reserve prompt + max_tokens (p07)".to_string(),
            reserved,
            "most of it".into(),
        ),
        (
            "contiguous, doubling (p08)".to_string(),
            doubled,
            "up to ~half".into(),
        ),
    ] {
        println!("   {name:<48} {:>6.1}%", frag(alloc));
        rows.push(Row::new(format!("p09 fragmentation, {name}"), frag(alloc), "%").predicted(pred));
    }

    // 2. Sequences that fit in a fixed budget, at the mix's mean lengths.
    let (engine, tok) = load_model(&a.model)?;
    let shape = engine.kv_shape();
    let per_pos = shape.bytes_per_position();
    plots(&mix, a.max_tokens, per_pos)?;
    let budget_pos = (a.budget_mib << 20) / per_pos;
    let fit = |alloc: usize| budget_pos as f64 / (alloc as f64 / a.mix as f64);
    // A static slot per sequence, sized for the longest the workload allows
    // (the longest prompt + max_tokens): what a cache that cannot grow must
    // reserve, and the baseline of the PagedAttention paper.
    let slot = mix.iter().map(|(p, _)| p + a.max_tokens).max().unwrap_or(0);
    let (f_paged, f_reserved) = (fit(paged), fit(reserved));
    let f_slot = fit(slot * a.mix);
    println!(
        "2. sequences that fit in {} MiB ({budget_pos} positions): paged {f_paged:.0}, contiguous reserving prompt + max_tokens {f_reserved:.0} ({:.1}x), static {slot}-position slots {f_slot:.0} ({:.1}x)",
        a.budget_mib,
        f_paged / f_reserved,
        f_paged / f_slot,
    );
    rows.push(Row::new(
        format!("p09 sequences in {} MiB, paged", a.budget_mib),
        f_paged,
        "seqs",
    ));
    rows.push(Row::new(
        format!(
            "p09 sequences in {} MiB, contiguous reserving",
            a.budget_mib
        ),
        f_reserved,
        "seqs",
    ));
    rows.push(
        Row::new(
            "p09 concurrent sequences paged / contiguous",
            f_paged / f_reserved,
            "x",
        )
        .predicted(">= 4x (target)"),
    );
    rows.push(
        Row::new(
            format!("p09 concurrent sequences paged / static {slot}-position slots"),
            f_paged / f_slot,
            "x",
        )
        .predicted("~4.7x (longest / mean of the mix)"),
    );

    // 3. Cold vs warm TTFT with a shared system prompt.
    let system: Vec<u32> = {
        let mut ids = Vec::new();
        while ids.len() < a.system_prompt {
            ids.extend(tok.encode(
                "You are a helpful assistant for the harbour office. Answer briefly and politely. ",
            ));
        }
        ids.truncate(a.system_prompt);
        ids
    };
    let config = ContinuousConfig {
        max_num_batched_tokens: 2048,
        step_cost: None,
        ..ContinuousConfig::default()
    };
    let kv = PagedKv::new(shape, bs, 1 << 30, true)?;
    let mut core = EngineCore::with_backend(&engine, &tok, &config, kv)?;
    let ttft = |core: &mut LocalCore<'_, LlamaEngine, PagedKv>, id: u64, q: &str| -> Result<f64> {
        let mut p = system.clone();
        p.extend(tok.encode(q));
        let t0 = Instant::now();
        core.add(id, &p, &GenerateParams::greedy(1))?;
        while core.has_work() {
            core.step();
        }
        Ok(t0.elapsed().as_secs_f64() * 1e3)
    };
    // Cold three times, each on a fresh pool (nothing cached), so the cold
    // figure is a median and p95 like every timing.
    let ferry = " When does the ferry leave?";
    let mut colds = vec![ttft(&mut core, 0, ferry)?];
    for r in 1..3 {
        let fresh = PagedKv::new(shape, bs, 1 << 30, true)?;
        let mut other = EngineCore::with_backend(&engine, &tok, &config, fresh)?;
        colds.push(ttft(&mut other, r, ferry)?);
    }
    let cold_s = summarize(&colds);
    let cold = cold_s.median;
    let warm: Vec<f64> = (1..4)
        .map(|i| {
            ttft(
                &mut core,
                i,
                &format!(" Question {i}: where is the fuel dock?"),
            )
        })
        .collect::<Result<_>>()?;
    let warm_s = summarize(&warm);
    let warm_med = warm_s.median;
    println!(
        "3. TTFT with a shared {}-token system prompt: cold {cold:.0} ms, warm {warm_med:.0} ms ({:.0}% of cold)",
        a.system_prompt,
        warm_med / cold * 100.0
    );
    rows.extend(Row::median_p95(
        format!(
            "p09 TTFT cold, shared system prompt ({} fresh pools)",
            colds.len()
        ),
        cold,
        cold_s.p95,
        "ms",
        "",
    ));
    rows.extend(Row::median_p95(
        format!(
            "p09 TTFT warm, shared system prompt ({} requests)",
            warm.len()
        ),
        warm_med,
        warm_s.p95,
        "ms",
        "",
    ));
    rows.push(
        Row::new(
            "p09 TTFT warm / cold (ratio of medians)",
            warm_med / cold * 100.0,
            "%",
        )
        .predicted("<= 20% (target)"),
    );

    // 4. Multi-user chat: every user shares the system prompt; each turn
    // re-sends the conversation so far.
    let kv = PagedKv::new(shape, bs, 1 << 30, true)?;
    let mut core = EngineCore::with_backend(&engine, &tok, &config, kv)?;
    let mut convs: Vec<Vec<u32>> = (0..a.users).map(|_| system.clone()).collect();
    let mut id = 0;
    for turn in 0..a.turns {
        for (u, conv) in convs.iter_mut().enumerate() {
            conv.extend(tok.encode(&format!(
                " User {u}, turn {turn}: tell me about berth {}.",
                u + turn
            )));
            core.add(id, conv, &GenerateParams::greedy(8))?;
            let mut answer = Vec::new();
            while core.has_work() {
                for o in core.step().outputs {
                    if o.id == id && o.is_token {
                        answer.push(o.step.token);
                    }
                }
            }
            conv.extend(answer);
            id += 1;
        }
    }
    let s = core.kv().manager().prefix_stats();
    let hit_rate = s.hits as f64 / s.queries.max(1) as f64 * 100.0;
    println!("4. chat workload ({} users x {} turns): prefix-cache hit rate {hit_rate:.1}% of prompt tokens", a.users, a.turns);
    rows.push(Row::new(
        format!("p09 prefix hit rate, {} users x {} turns", a.users, a.turns),
        hit_rate,
        "%",
    ));

    // 5. The indirection: decode steps through block tables vs contiguous.
    let st = decode_step_times(&engine, shape, bs, a.decode_batch, a.decode_pos, a.samples)?;
    // Paged tok/s as % of contiguous, per round (each round runs both, A B).
    let ratio = summarize(&st.ratios_pct);
    println!(
        "5. decode step, batch {} at position {}: contiguous {:.2} ms (p95 {:.2}), paged {:.2} ms (p95 {:.2}) -> paged tok/s {:.1}% of contiguous (median of rounds)",
        a.decode_batch,
        a.decode_pos,
        st.contiguous_ms,
        st.contiguous_p95_ms,
        st.paged_ms,
        st.paged_p95_ms,
        ratio.median
    );
    rows.extend(Row::median_p95(
        format!("p09 decode step contiguous, batch {}", a.decode_batch),
        st.contiguous_ms,
        st.contiguous_p95_ms,
        "ms",
        "",
    ));
    rows.extend(Row::median_p95(
        format!("p09 decode step paged, batch {}", a.decode_batch),
        st.paged_ms,
        st.paged_p95_ms,
        "ms",
        "",
    ));
    rows.extend(Row::median_p95(
        "p09 paged decode tok/s / contiguous, per-pair ratio",
        ratio.median,
        ratio.p95,
        "%",
        ">= 98% (target)",
    ));

    // 6. n = 4 samples: forks of one prompt vs four requests.
    let prompt_len = 300;
    let out_len = 40;
    let pool = BlockPool::new(shape, bs, 4096)?;
    let mut m = KvManager::new(pool, false);
    let prompt: Vec<u32> = (0..prompt_len as u32).collect();
    m.admit(0, &prompt, b"", prompt_len + 1);
    for child in 1..4 {
        m.fork(0, child);
    }
    for id in 0..4 {
        m.grow(id, prompt_len, prompt_len + out_len);
    }
    let forked = m.used_blocks();
    let separate = 4 * (prompt_len + out_len).div_ceil(bs);
    println!("6. n = 4 samples of a {prompt_len}-token prompt, {out_len} tokens each: {forked} blocks forked vs {separate} as four requests ({:.0}%)", forked as f64 / separate as f64 * 100.0);
    rows.push(Row::new(
        "p09 n=4 blocks, forked (copy-on-write)",
        forked as f64,
        "blocks",
    ));
    rows.push(Row::new(
        "p09 n=4 blocks, four separate requests",
        separate as f64,
        "blocks",
    ));

    if !a.no_record {
        Recorder::for_workspace(command_line("p09_kv_manager")).append(&rows)?;
    }
    Ok(())
}

/// Decode step times in ms, contiguous caches vs block tables: the median
/// over rounds of each round's median and of each round's p95, and each
/// round's paged tok/s as % of contiguous (contiguous / paged time).
#[derive(Clone, Debug)]
struct StepTimes {
    contiguous_ms: f64,
    contiguous_p95_ms: f64,
    paged_ms: f64,
    paged_p95_ms: f64,
    ratios_pct: Vec<f64>,
}

/// One decode step of `batch` sequences at `pos`, through contiguous caches
/// and through block tables (A B A B, several rounds).
fn decode_step_times(
    engine: &LlamaEngine,
    shape: KvShape,
    bs: usize,
    batch: usize,
    pos: usize,
    samples: usize,
) -> Result<StepTimes> {
    let vocab = engine.model.cfg.vocab_size;
    let mut ws = engine.new_workspace();
    let mut b = Batch::new();
    for i in 0..batch {
        b.push(&[100 + i as u32], pos)?;
    }
    let mut logits = vec![0.0f32; batch * vocab];
    let mut kv = decode_stores(engine, batch, pos);
    let mut m = KvManager::new(
        BlockPool::new(shape, bs, batch * (pos + 1).div_ceil(bs))?,
        false,
    );
    let zeros = vec![0u32; pos];
    for i in 0..batch as u64 {
        m.admit(i, &zeros, b"", pos + 1);
    }
    // The step's plan as the runner gets it: block tables, no copies.
    let mut storage = m.new_storage();
    let seqs: Vec<PlannedSeq> = (0..batch as u64)
        .map(|i| PlannedSeq {
            id: i,
            start: pos,
            tokens: vec![100 + i as u32],
            kv: SeqKv::Blocks(m.table(i).unwrap_or_default().to_vec()),
            logits: true,
        })
        .collect();
    let cfg = BenchConfig {
        warmup_iters: 2,
        min_samples: samples,
        min_time: Duration::ZERO,
        max_samples: samples,
    };
    let mut failed = None;
    let (mut ca, mut pa) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        let c = time_it(cfg, || {
            let mut refs: Vec<&mut KvCache> = kv.iter_mut().collect();
            if let Err(e) = engine.forward_batch(&b, &mut refs, &mut ws, &mut logits) {
                failed = Some(e.to_string());
            }
            kv.iter_mut()
                .for_each(|c| c.set_len(pos).expect("each store was made with room"));
        });
        let p = time_it(cfg, || match storage.stores(&seqs) {
            Ok(mut stores) => {
                let mut refs: Vec<&mut _> = stores.iter_mut().collect();
                if let Err(e) = engine.forward_batch(&b, &mut refs, &mut ws, &mut logits) {
                    failed = Some(e.to_string());
                }
            }
            Err(e) => failed = Some(e.to_string()),
        });
        ca.push(c);
        pa.push(p);
    }
    if let Some(e) = failed {
        anyhow::bail!(e);
    }
    let med = |v: &[Summary], f: fn(&Summary) -> f64| {
        summarize(&v.iter().map(f).collect::<Vec<_>>()).median * 1e3
    };
    Ok(StepTimes {
        contiguous_ms: med(&ca, |s| s.median),
        contiguous_p95_ms: med(&ca, |s| s.p95),
        paged_ms: med(&pa, |s| s.median),
        paged_p95_ms: med(&pa, |s| s.p95),
        ratios_pct: ca
            .iter()
            .zip(&pa)
            .map(|(c, p)| c.median / p.median * 100.0)
            .collect(),
    })
}

/// Two plots from the length mix alone: K/V memory held as sequences are
/// admitted (paged, reserving, static slots), and fragmentation against the
/// block size (small blocks waste less, but each is a run the attention
/// reads and a table entry).
fn plots(mix: &[(usize, usize)], max_tokens: usize, per_pos: usize) -> Result<()> {
    let dir = common::assets::workspace_root().join("p09_kv_manager/plots");
    std::fs::create_dir_all(&dir)?;
    let gib = per_pos as f64 / (1u64 << 30) as f64;
    let slot = mix.iter().map(|(p, _)| p + max_tokens).max().unwrap_or(0);
    let cumulative = |name: &str, each: &dyn Fn(usize, usize) -> usize| {
        let mut sum = 0;
        let pts = mix
            .iter()
            .take(200)
            .enumerate()
            .map(|(i, &(p, o))| {
                sum += each(p, o);
                ((i + 1) as f64, sum as f64 * gib)
            })
            .collect();
        Series::new(name, pts)
    };
    line_chart(
        &dir.join("memory_vs_sequences.png"),
        Labels {
            title: "K/V memory held vs sequences admitted (SmolLM2 f32, the length mix)",
            x: "sequences",
            y: "GiB",
        },
        &[
            cumulative("paged, block 16", &|p, o| (p + o).div_ceil(16) * 16),
            cumulative("contiguous, prompt + max_tokens", &|p, _| p + max_tokens),
            cumulative(&format!("static {slot}-position slots"), &|_, _| slot),
            cumulative("tokens stored", &|p, o| p + o),
        ],
        Scale::Linear,
    )
    .map_err(anyhow::Error::msg)?;
    let stored: usize = mix.iter().map(|(p, o)| p + o).sum();
    let frag: Vec<(f64, f64)> = [1usize, 4, 8, 16, 32, 64, 128, 256]
        .iter()
        .map(|&bs| {
            let alloc: usize = mix.iter().map(|(p, o)| (p + o).div_ceil(bs) * bs).sum();
            (bs as f64, (alloc - stored) as f64 / alloc as f64 * 100.0)
        })
        .collect();
    line_chart(
        &dir.join("fragmentation_vs_block_size.png"),
        Labels {
            title: "Internal fragmentation vs block size (the length mix)",
            x: "block size (positions)",
            y: "% of allocated slots empty",
        },
        &[Series::new("paged", frag)],
        Scale::LogX,
    )
    .map_err(anyhow::Error::msg)?;
    println!("   plots: {}", dir.display());
    Ok(())
}

//! `bench-decode`: one sequence's prefill and decode steps through the
//! engine core, at TP = 1 and 3 and PP = 3, ranks as threads of this
//! process (TP over shared memory and over TCP, PP over TCP), one thread
//! per rank; communication's share of rank 0's decode step; weight and
//! K/V bytes per rank. Configurations interleave, round by round.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Args;
use common::batch::BatchModel;
use common::numbers::{command_line, Recorder, Row};
use common::stats::summarize;
use p04_transformer::{HeadSplit, Split};
use p05_kv_cache::generate::GenerateParams;
use p08_continuous::kv_backend::KvBackend;
use p08_continuous::{ContinuousConfig, EngineCore, LocalRunner, ModelRunner};
use p09_kv_manager::PagedKv;

use crate::pp::{follow_stage, PpRunner, Stage};
use crate::runner::{follow, TpRunner};
use crate::tp::{load_part, load_rank, weight_bytes};
use crate::{shm, tcp, Algorithm, CommStats, Communicator};
use p10_quant::Weights;

#[derive(Clone, Debug, Args)]
pub struct DecodeArgs {
    #[arg(long, default_value = "smollm2")]
    pub model: String,
    /// Prompt tokens (one prefill step).
    #[arg(long, default_value_t = 256)]
    pub prompt: usize,
    /// Decode steps timed per round.
    #[arg(long, default_value_t = 32)]
    pub decode: usize,
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    #[arg(long)]
    pub no_record: bool,
}

const KV_BYTES: usize = 1 << 28;

/// How the ranks are joined.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Setup {
    One,
    TpShm,
    TpTcp,
    /// TP = 3 over TCP with the LM head split by vocabulary rows.
    TpTcpVocab,
    PpTcp,
}

impl Setup {
    fn name(self) -> &'static str {
        match self {
            Setup::One => "TP=1",
            Setup::TpShm => "TP=3 shm",
            Setup::TpTcp => "TP=3 tcp",
            Setup::TpTcpVocab => "TP=3 tcp vocab-parallel head",
            Setup::PpTcp => "PP=3 tcp",
        }
    }
}

/// One round: seconds of the prefill step and of each decode step; rank
/// 0's communication seconds over the decode steps; per-rank (projection
/// and replicated weight bytes, K/V bytes per position).
struct Round {
    prefill_s: f64,
    decode_s: Vec<f64>,
    comm_s: f64,
    ranks: Vec<(usize, usize, usize)>,
    /// Rank 0's calls and bytes sent per decode step.
    calls: f64,
    bytes: f64,
}

fn config(prompt: usize) -> ContinuousConfig {
    ContinuousConfig {
        max_num_batched_tokens: prompt.max(64),
        max_num_seqs: 8,
        kv_cache_bytes: KV_BYTES,
        ..ContinuousConfig::default()
    }
}

/// One request's timings: the prefill step, each decode step, rank 0's
/// communication seconds over the decode steps, and every rank's
/// communicator counts over the decode steps.
pub(crate) struct Drive {
    pub prefill_s: f64,
    pub decode_s: Vec<f64>,
    pub comm_s: f64,
    pub stats: Vec<CommStats>,
}

/// Every rank's counts (the others' settle within a few µs of rank 0's
/// step; the pause lets a delayed link's last frames land).
fn snapshot(comms: &[Arc<dyn Communicator>]) -> Vec<CommStats> {
    std::thread::sleep(Duration::from_millis(3));
    comms.iter().map(|c| c.stats()).collect()
}

fn delta(a: &[CommStats], b: &[CommStats]) -> Vec<CommStats> {
    a.iter()
        .zip(b)
        .map(|(a, b)| CommStats {
            calls: b.calls - a.calls,
            bytes_sent: b.bytes_sent - a.bytes_sent,
            sends: b.sends - a.sends,
            send_bytes: b.send_bytes - a.send_bytes,
            seconds: b.seconds - a.seconds,
        })
        .collect()
}

/// Step one request to its end on `core`, timing each step.
fn drive<B: KvBackend, R: ModelRunner>(
    core: &mut EngineCore<'_, B, R, ()>,
    prompt: &[u32],
    decode: usize,
    comms: &[Arc<dyn Communicator>],
) -> Result<Drive> {
    if !core.add(0, prompt, &GenerateParams::greedy(decode + 1))? {
        anyhow::bail!("the request finished before it started");
    }
    let t0 = Instant::now();
    let out = core.step();
    let prefill_s = t0.elapsed().as_secs_f64();
    anyhow::ensure!(out.failed.is_empty(), "prefill failed: {:?}", out.failed);
    let s0 = snapshot(comms);
    let mut decode_s = Vec::new();
    while core.has_work() {
        let t = Instant::now();
        let out = core.step();
        decode_s.push(t.elapsed().as_secs_f64());
        anyhow::ensure!(out.failed.is_empty(), "decode failed: {:?}", out.failed);
    }
    let stats = delta(&s0, &snapshot(comms));
    Ok(Drive {
        prefill_s,
        decode_s,
        comm_s: stats.first().map_or(0.0, |s| s.seconds),
        stats,
    })
}

fn sizes(m: &p04_transformer::Llama, kv: usize) -> (usize, usize, usize) {
    let (proj, replicated) = weight_bytes(m);
    (proj, replicated, kv)
}

/// Each rank's (projection bytes, replicated bytes, K/V bytes per
/// position).
pub(crate) type RankBytes = Vec<(usize, usize, usize)>;

/// A driver: one request through the engine core, timed.
pub(crate) type Driver<'a> = dyn FnMut(&[u32], usize) -> Result<Drive> + 'a;

/// SmolLM2 (native weights) split over `comms` (TP, or PP stages when
/// `pp`), ranks as threads of this process, one thread each; `body` gets
/// a driver for rank 0's engine core. Returns its result and each rank's
/// (projection bytes, replicated bytes, K/V bytes per position).
pub(crate) fn with_world<T>(
    pp: bool,
    head: HeadSplit,
    path: &std::path::Path,
    prompt_len: usize,
    comms: Vec<Arc<dyn Communicator>>,
    body: impl FnOnce(&mut Driver<'_>) -> Result<T>,
) -> Result<(T, RankBytes)> {
    let tok =
        p04_transformer::Tokenizer::from_gguf(&p04_transformer::GgufFile::open(path)?.header)?;
    let cfg = config(prompt_len);
    let world = comms.len();
    let all = comms.clone();
    std::thread::scope(|s| {
        let mut comms = comms;
        let followers: Vec<_> = comms
            .split_off(1)
            .into_iter()
            .map(|c| {
                s.spawn(move || -> Result<(usize, usize, usize)> {
                    let l = match pp {
                        true => {
                            load_part(path, Weights::Native, Split::stage(c.rank(), world)?, 1)?
                        }
                        false => load_rank(path, Weights::Native, head, c.clone(), 1)?,
                    };
                    let kv = PagedKv::new(l.engine.kv_shape(), 16, KV_BYTES, false)?;
                    let size = sizes(&l.engine.model, l.engine.kv_shape().bytes_per_position());
                    c.barrier()?;
                    if pp {
                        follow_stage(&*c, &mut Stage::new(&l.engine, kv.new_storage()), world)?;
                    } else {
                        follow(&*c, &mut LocalRunner::new(&l.engine, kv.new_storage()))?;
                    }
                    Ok(size)
                })
            })
            .collect();
        let c = comms.remove(0);
        let l = match pp {
            true => load_part(path, Weights::Native, Split::stage(0, world)?, 1)?,
            false => load_rank(path, Weights::Native, head, c.clone(), 1)?,
        };
        let kv = PagedKv::new(l.engine.kv_shape(), 16, KV_BYTES, false)?;
        let mut ranks = vec![sizes(
            &l.engine.model,
            l.engine.kv_shape().bytes_per_position(),
        )];
        c.barrier()?;
        let info = common::Model::info(&l.engine).clone();
        let storage = kv.new_storage();
        let out = if pp {
            let runner = PpRunner::new(Stage::new(&l.engine, storage), c.clone(), world);
            let mut core = EngineCore::with_runner(&info, &tok, &cfg, kv, runner)?;
            body(&mut |p: &[u32], n: usize| drive(&mut core, p, n, &all))
        } else {
            let runner = TpRunner::new(LocalRunner::new(&l.engine, storage), c.clone());
            let mut core = EngineCore::with_runner(&info, &tok, &cfg, kv, runner)?;
            body(&mut |p: &[u32], n: usize| drive(&mut core, p, n, &all))
        }; // the core drops here: its runner tells the others to stop
        for f in followers {
            ranks.push(f.join().map_err(|_| anyhow::anyhow!("a rank panicked"))??);
        }
        Ok((out?, ranks))
    })
}

fn round(setup: Setup, path: &std::path::Path, prompt: &[u32], decode: usize) -> Result<Round> {
    if setup == Setup::One {
        let tok =
            p04_transformer::Tokenizer::from_gguf(&p04_transformer::GgufFile::open(path)?.header)?;
        let cfg = config(prompt.len());
        let l = load_part(path, Weights::Native, Split::whole(), 1)?;
        let kv = PagedKv::new(l.engine.kv_shape(), 16, KV_BYTES, false)?;
        let mut core = EngineCore::with_backend(&l.engine, &tok, &cfg, kv)?;
        let d = drive(&mut core, prompt, decode, &[])?;
        let s = sizes(&l.engine.model, l.engine.kv_shape().bytes_per_position());
        return Ok(Round {
            prefill_s: d.prefill_s,
            decode_s: d.decode_s,
            comm_s: 0.0,
            ranks: vec![s],
            calls: 0.0,
            bytes: 0.0,
        });
    }
    let deadline = Duration::from_secs(120);
    let comms: Vec<Arc<dyn Communicator>> = match setup {
        Setup::TpShm => shm::group(3, deadline)?
            .into_iter()
            .map(|c| Arc::new(c) as Arc<dyn Communicator>)
            .collect(),
        _ => tcp::loopback_group(3, deadline, Algorithm::default())?
            .into_iter()
            .map(|c| Arc::new(c) as Arc<dyn Communicator>)
            .collect(),
    };
    let head = match setup {
        Setup::TpTcpVocab => HeadSplit::VocabParallel,
        _ => HeadSplit::Replicated,
    };
    let pp = setup == Setup::PpTcp;
    let (d, ranks) = with_world(pp, head, path, prompt.len(), comms, |drive| {
        drive(prompt, decode)
    })?;
    let steps = d.decode_s.len().max(1) as f64;
    Ok(Round {
        prefill_s: d.prefill_s,
        calls: d.stats[0].calls as f64 / steps,
        bytes: d.stats[0].bytes_sent as f64 / steps,
        decode_s: d.decode_s,
        comm_s: d.comm_s,
        ranks,
    })
}

pub fn run(a: &DecodeArgs) -> Result<()> {
    let path = p06_server::load::resolve_model(&a.model)?;
    let text = "The history of the harbour town is a long one. ".repeat(64);
    let tok =
        p04_transformer::Tokenizer::from_gguf(&p04_transformer::GgufFile::open(&path)?.header)?;
    let mut prompt = tok.encode(&text);
    prompt.truncate(a.prompt);
    anyhow::ensure!(
        prompt.len() == a.prompt,
        "the prompt text is shorter than {} tokens",
        a.prompt
    );
    let setups = [
        Setup::One,
        Setup::TpShm,
        Setup::TpTcp,
        Setup::TpTcpVocab,
        Setup::PpTcp,
    ];
    let mut rounds: Vec<Vec<Round>> = setups.iter().map(|_| Vec::new()).collect();
    for r in 0..a.rounds {
        for (i, &s) in setups.iter().enumerate() {
            eprintln!("round {} of {}: {}", r + 1, a.rounds, s.name());
            rounds[i].push(round(s, &path, &prompt, a.decode).with_context(|| s.name())?);
        }
    }
    let mut rows = Vec::new();
    println!("| setup | decode step median ms | p95 ms | comm share of decode % | prefill {} tok/s (median) | rank 0 weights MB (proj + replicated) | K/V bytes/position/rank |", a.prompt);
    println!("|---|---|---|---|---|---|---|");
    for (i, &s) in setups.iter().enumerate() {
        let steps: Vec<f64> = rounds[i]
            .iter()
            .flat_map(|r| r.decode_s.iter().copied())
            .collect();
        let d = summarize(&steps);
        let total: f64 = rounds[i]
            .iter()
            .map(|r| r.decode_s.iter().sum::<f64>())
            .sum();
        let comm: f64 = rounds[i].iter().map(|r| r.comm_s).sum();
        let share = 100.0 * comm / total;
        let prefill: Vec<f64> = rounds[i]
            .iter()
            .map(|r| a.prompt as f64 / r.prefill_s)
            .collect();
        let (proj, repl, kv) = rounds[i][0].ranks[0];
        let n = s.name();
        println!(
            "| {n} | {:.2} | {:.2} | {share:.1} | {:.0} | {:.1} + {:.1} | {kv} |",
            d.median * 1e3,
            d.p95 * 1e3,
            summarize(&prefill).median,
            proj as f64 / 1e6,
            repl as f64 / 1e6,
        );
        let prediction = match s {
            Setup::One => "one core: ~60 ms per token at 1 thread",
            Setup::TpShm | Setup::TpTcp | Setup::TpTcpVocab => {
                "slower than TP=1 here: 3 ranks on 2 cores, 60 all-reduces per token"
            }
            Setup::PpTcp => "≈ TP=1 plus 2 hand-offs: one sequence never overlaps stages",
        };
        rows.extend(Row::median_p95(
            format!("p13 decode step, batch 1, native, {n}, 1 thread/rank"),
            d.median * 1e3,
            d.p95 * 1e3,
            "ms",
            prediction,
        ));
        if s != Setup::One {
            rows.push(Row::new(
                format!("p13 communication share of rank 0's decode time, {n}"),
                share,
                "%",
            ));
        }
        rows.extend(Row::rates_median_p5(
            format!("p13 prefill {} tokens, native, {n}", a.prompt),
            &prefill,
            "tok/s",
            "",
        ));
        for (r, &(proj, repl, kv)) in rounds[i][0].ranks.iter().enumerate() {
            rows.push(Row::new(
                format!("p13 rank {r} projection weights, {n}"),
                proj as f64 / 1e6,
                "MB",
            ));
            rows.push(Row::new(
                format!("p13 rank {r} replicated weights (embedding, norms), {n}"),
                repl as f64 / 1e6,
                "MB",
            ));
            rows.push(Row::new(
                format!("p13 rank {r} K/V per position, {n}"),
                kv as f64,
                "B",
            ));
        }
    }
    rows.extend(core_per_rank(&setups, &rounds)?);
    if !a.no_record {
        Recorder::for_workspace(command_line("p13_multi_gpu")).append(&rows)?;
    }
    Ok(())
}

/// What TP = 3 would give with a core per rank, from this run: rank 0's
/// compute as TP = 1's step scaled by its share of the projection bytes
/// (decode streams the weights: its time goes with the bytes), plus each
/// counted collective at loopback TCP's α and β measured now (4-byte and
/// 1 MiB all-reduces over three ranks). A model, not a measurement: this
/// machine has two cores for three ranks.
fn core_per_rank(setups: &[Setup], rounds: &[Vec<Round>]) -> Result<Vec<Row>> {
    let tcp = tcp::loopback_group(3, Duration::from_secs(60), Algorithm::default())?;
    let alpha = summarize(&crate::bench::time_world(&tcp, 4, 5, 200)).median;
    let ring = summarize(&crate::bench::time_world(&tcp, 1 << 20, 5, 2)).median;
    let per_byte = crate::bench::ring_per_byte(alpha, ring, 3, 1 << 20);
    let step = |i: usize| {
        let v: Vec<f64> = rounds[i]
            .iter()
            .flat_map(|r| r.decode_s.iter().copied())
            .collect();
        summarize(&v).median
    };
    let one = setups
        .iter()
        .position(|&s| s == Setup::One)
        .context("no TP=1 setup")?;
    let (t1, proj1) = (step(one), rounds[one][0].ranks[0].0 as f64);
    let mut rows = vec![
        Row::new(
            "p13 loopback TCP α (4 B all-reduce, 3 ranks), median",
            alpha * 1e6,
            "µs",
        ),
        Row::new(
            "p13 loopback TCP β (from the medians of a 1 MiB ring all-reduce and α, 3 ranks)",
            1e-6 / per_byte.max(1e-18),
            "MB/s",
        ),
    ];
    for (i, &s) in setups.iter().enumerate() {
        if !matches!(s, Setup::TpTcp | Setup::TpTcpVocab) {
            continue;
        }
        let r = &rounds[i][0];
        let share = r.ranks[0].0 as f64 / proj1;
        let model = t1 * share + r.calls * alpha + r.bytes * per_byte;
        let n = s.name();
        rows.push(
            Row::new(format!("p13 predicted decode step with a core per rank, {n}"), model * 1e3, "ms")
                .predicted(format!(
                    "TP=1's step × {share:.2} of the projection bytes + {:.0} collectives, {:.0} B per step",
                    r.calls, r.bytes
                )),
        );
        rows.push(Row::new(
            format!("p13 predicted speedup over TP=1 with a core per rank, {n}"),
            t1 / model,
            "×",
        ));
        println!(
            "{n}, a core per rank (model): {:.2} ms = {:.2} × {share:.2} + {:.0} × {:.1} µs + {:.0} B / {:.0} MB/s, {:.2}× TP=1",
            model * 1e3,
            t1 * 1e3,
            r.calls,
            alpha * 1e6,
            r.bytes,
            1e-6 / per_byte.max(1e-18),
            t1 / model
        );
    }
    Ok(rows)
}

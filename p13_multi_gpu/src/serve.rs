//! The tensor- or pipeline-parallel server: rank 0 serves the OpenAI API
//! (Project 06) on Project 08/09's scheduler and paged block manager, and
//! every step runs on all ranks ([`crate::runner`], [`crate::pp`]).
//!
//! ```text
//! p13_multi_gpu serve --tp 3          rank 0; starts ranks 1 and 2 as child processes
//! p13_multi_gpu serve --pp 3          the same with pipeline stages
//! p13_multi_gpu serve --tp 3 --peers A0,A1,A2 --token T
//!                                      rank 0 of ranks started elsewhere, each with
//! p13_multi_gpu rank --rank r --peers A0,A1,A2 --token T --model FILE
//! ```
//!
//! Every rank first joins the others (a TCP connection per pair, a
//! handshake that checks the job token and a hash of the model file and
//! the split), then loads its slice, then waits at a barrier; rank 0 then
//! serves, the others follow its plans until it stops or its link breaks.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use common::batch::BatchModel;
use p04_transformer::{HeadSplit, Split};
use p05_kv_cache::load::LoadedEngine;
use p08_continuous::kv_backend::KvBackend;
use p08_continuous::{ContinuousEngine, LocalRunner};
use p09_kv_manager::serve::ServeArgs;
use p09_kv_manager::PagedKv;

use crate::comm::Communicator;
use crate::frame::{Hello, PROTOCOL_VERSION};
use crate::mesh::{Algorithm, Mesh};
use crate::pp::{follow_stage, PpRunner, Stage};
use crate::runner::{follow, RankError, Recovery, Restart, TpRunner};
use crate::swap::SwapComm;
use crate::tcp::{self, TcpLinks};
use crate::tp::{load_part, load_rank};

/// What every rank must agree on.
#[derive(Clone, Debug, Args)]
pub struct SplitArgs {
    /// Tensor-parallel ranks (must divide the query heads, the K/V heads
    /// and the MLP width: 1 or 3 for SmolLM2).
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Pipeline stages (must divide the layers: 1, 2, 3, 5, ... for
    /// SmolLM2's 30); one of --tp and --pp may exceed 1.
    #[arg(long, default_value_t = 1)]
    pub pp: usize,
    /// Project 10's flags: the weights and the kernels.
    #[command(flatten)]
    pub load: p10_quant::serve::LoadArgs,
    /// Split the LM head by vocabulary rows (logits all-gathered) instead
    /// of every rank holding all of it.
    #[arg(long)]
    pub vocab_parallel_head: bool,
    /// Threads per rank for its products (1: a core per rank).
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Seconds a rank waits for another inside a collective before it
    /// calls it dead.
    #[arg(long, default_value_t = 60)]
    pub collective_timeout_s: u64,
    /// Every rank's address, rank 0's first (`host:port,host:port,...`);
    /// without it, `serve` starts the other ranks itself on loopback.
    #[arg(long, value_delimiter = ',')]
    pub peers: Vec<SocketAddr>,
    /// The job's token: ranks with another refuse to join.
    #[arg(long)]
    pub token: Option<u64>,
    /// With --peers: when a rank is lost, how long every other rank waits
    /// for it to be started again (by hand, or by systemd or a platform)
    /// and to rejoin; rank 0 then recomputes its running requests, which
    /// pause meanwhile. 0: no rejoin, the running requests fail.
    #[arg(long, default_value_t = 120)]
    pub rejoin_timeout_s: u64,
}

#[derive(Clone, Debug, Args)]
pub struct TpServeArgs {
    #[command(flatten)]
    pub serve: ServeArgs,
    #[command(flatten)]
    pub split: SplitArgs,
}

/// A rank other than 0.
#[derive(Clone, Debug, Args)]
pub struct RankArgs {
    #[arg(long)]
    pub rank: usize,
    /// A .gguf file or an HF Llama directory (the same as rank 0's).
    #[arg(long)]
    pub model: PathBuf,
    #[command(flatten)]
    pub split: SplitArgs,
    /// Rank 0's block size and K/V budget (the storage must match its).
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    #[arg(long)]
    pub kv_cache_mib: usize,
}

impl SplitArgs {
    /// Ranks in all: tensor-parallel ranks or pipeline stages.
    fn world(&self) -> usize {
        self.tp.max(1) * self.pp.max(1)
    }

    fn check(&self) -> Result<()> {
        if self.load.batch_variant_f32_prefill {
            bail!("--batch-variant-f32-prefill: not built for tensor- or pipeline-parallel ranks (their products stay on the integer kernels, batch-invariant)");
        }
        if self.tp == 0 || self.pp == 0 || (self.tp > 1 && self.pp > 1) {
            bail!("--tp {} --pp {}: each at least 1, and one of them 1 (tensor and pipeline parallelism together are not built yet)", self.tp, self.pp);
        }
        Ok(())
    }

    /// This rank's part of the model, its collectives in place.
    fn load(&self, rank: usize, path: &Path, comm: Arc<dyn Communicator>) -> Result<LoadedEngine> {
        let what = || format!("rank {rank} loading {}", path.display());
        if self.pp > 1 {
            let split = Split::stage(rank, self.pp)?;
            return load_part(path, self.load.weights, split, self.threads).with_context(what);
        }
        load_rank(path, self.load.weights, self.head(), comm, self.threads).with_context(what)
    }

    fn head(&self) -> HeadSplit {
        match self.vocab_parallel_head {
            true => HeadSplit::VocabParallel,
            false => HeadSplit::Replicated,
        }
    }

    fn deadline(&self) -> Duration {
        Duration::from_secs(self.collective_timeout_s.max(1))
    }

    /// A hash of the model file (its size and first MiB: the GGUF header
    /// and metadata) and of everything that shapes a rank's slice and K/V.
    fn layout_hash(&self, model: &Path, block_size: usize, kv_mib: usize) -> Result<u64> {
        use std::io::Read;
        let mut text = format!(
            "tp {} pp {} {:?} {:?} block {block_size} kv {kv_mib}",
            self.tp,
            self.pp,
            self.load.weights,
            self.head()
        );
        if model.is_file() {
            let f = std::fs::File::open(model).with_context(|| format!("{}", model.display()))?;
            let len = f.metadata()?.len();
            let mut head = Vec::new();
            f.take(1 << 20).read_to_end(&mut head)?;
            text.push_str(&format!(
                " file {len} {:016x}",
                xxhash_rust::xxh3::xxh3_64(&head)
            ));
        } else {
            text.push_str(&format!(" dir {}", model.display()));
        }
        Ok(xxhash_rust::xxh3::xxh3_64(text.as_bytes()))
    }

    /// Join the other ranks as `rank`, within two minutes (they may still
    /// be starting).
    fn join(&self, rank: usize, listener: &TcpListener, layout: u64) -> Result<Mesh<TcpLinks>> {
        self.join_within(rank, listener, layout, Duration::from_secs(120))
    }

    fn join_within(
        &self,
        rank: usize,
        listener: &TcpListener,
        layout: u64,
        setup: Duration,
    ) -> Result<Mesh<TcpLinks>> {
        let hello = Hello {
            version: PROTOCOL_VERSION,
            world: self.world() as u32,
            rank: rank as u32,
            token: self.token.unwrap_or(0),
            layout,
        };
        let links = tcp::connect(listener, &self.peers, hello, setup)
            .with_context(|| format!("rank {rank} joining {:?}", self.peers))?;
        Ok(Mesh::new(links, self.deadline(), Algorithm::default()))
    }
}

/// Rank 0: start (or join) the other ranks, load its slice, serve.
pub async fn serve(mut a: TpServeArgs) -> Result<()> {
    a.split.check()?;
    let world = a.split.world();
    let config = a.serve.sched.config();
    let paged = a.serve.paged.clone();
    let kv_mib = a.serve.sched.kv_cache_mib;
    // Rank 0's own listener is bound now (its port is in every rank's
    // list); without --peers it picks the other ranks' ports too.
    let spawn = a.split.peers.is_empty();
    let listener = if spawn {
        let ls = (0..world)
            .map(|_| TcpListener::bind("127.0.0.1:0"))
            .collect::<std::io::Result<Vec<_>>>()?;
        a.split.peers = ls
            .iter()
            .map(|l| l.local_addr())
            .collect::<std::io::Result<_>>()?;
        a.split.token.get_or_insert_with(job_token);
        ls.into_iter().next().expect("world >= 1")
    } else if a.split.peers.len() != world {
        bail!(
            "--peers names {} ranks for a world of {world} (--tp {} --pp {})",
            a.split.peers.len(),
            a.split.tp,
            a.split.pp
        );
    } else {
        TcpListener::bind(a.split.peers[0])
            .with_context(|| format!("binding rank 0's address {}", a.split.peers[0]))?
    };
    let split = a.split.clone();
    p06_server::server::serve_model(&a.serve.listen, move |path, name| {
        let layout = split.layout_hash(path, paged.block_size, kv_mib)?;
        let children = match spawn && split.world() > 1 {
            true => start_ranks(&split, path, paged.block_size, kv_mib)?,
            false => Vec::new(),
        };
        let joined: Arc<dyn Communicator> = Arc::new(split.join(0, &listener, layout)?);
        // Rank 0's projections call the world through `swap`, so that a
        // rebuilt world can replace it.
        let swap = Arc::new(SwapComm::new(joined));
        let comm: Arc<dyn Communicator> = swap.clone();
        let (engine, tokenizer) =
            p06_server::load::with_tokenizer(path, split.load(0, path, comm.clone())?)?;
        let kv = PagedKv::new(
            engine.kv_shape(),
            paged.block_size,
            config.kv_cache_bytes,
            !paged.no_prefix_caching,
        )?;
        comm.barrier().context("waiting for every rank to load")?;
        let info = common::Model::info(&engine).clone();
        let (engine, tokenizer) = (Arc::new(engine), Arc::new(tokenizer));
        let restart = match spawn {
            true => Some(restarter(
                split.clone(),
                path.to_path_buf(),
                paged.block_size,
                kv_mib,
                layout,
                children,
            )),
            false if split.rejoin_timeout_s > 0 && split.world() > 1 => {
                Some(rejoiner(split.clone(), 0, listener.try_clone()?, layout))
            }
            false => None,
        };
        let recovery = restart.map(|restart| Recovery {
            swap,
            restarts: 0,
            restart,
        });
        let engine = match split.pp > 1 {
            true => {
                let micro = split.pp;
                ContinuousEngine::start_with_runner(
                    &info,
                    tokenizer,
                    name,
                    config,
                    kv,
                    move |storage| {
                        let stage = Stage::new(engine, storage);
                        match recovery {
                            Some(r) => PpRunner::with_recovery(stage, r, micro),
                            None => PpRunner::new(stage, comm, micro),
                        }
                    },
                )?
            }
            false => ContinuousEngine::start_with_runner(
                &info,
                tokenizer,
                name,
                config,
                kv,
                move |storage| {
                    let local = LocalRunner::new(engine, storage);
                    match recovery {
                        Some(r) => TpRunner::with_recovery(local, r),
                        None => TpRunner::new(local, comm),
                    }
                },
            )?,
        };
        Ok(Arc::new(engine))
    })
    .await
}

/// A token no other job on this host picks (time and process id).
fn job_token() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    xxhash_rust::xxh3::xxh3_64(
        &[t.to_le_bytes(), u64::from(std::process::id()).to_le_bytes()].concat(),
    )
}

/// How rank 0 rebuilds a world it started itself when a rank is lost: the
/// old ranks are stopped and reaped (a survivor would leave anyway, its
/// links broken), new ones start on new ports under a new token, join and
/// load their slices; rank 0 keeps its own.
fn restarter(
    split: SplitArgs,
    model: PathBuf,
    block_size: usize,
    kv_mib: usize,
    layout: u64,
    mut children: Vec<Child>,
) -> Restart {
    Box::new(move || {
        for c in children.iter_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let mut next = split.clone();
        let ls = (0..split.world())
            .map(|_| TcpListener::bind("127.0.0.1:0"))
            .collect::<std::io::Result<Vec<_>>>()?;
        next.peers = ls
            .iter()
            .map(|l| l.local_addr())
            .collect::<std::io::Result<_>>()?;
        next.token = Some(job_token());
        let listener = ls.into_iter().next().ok_or("no listener")?;
        children = start_ranks(&next, &model, block_size, kv_mib)?;
        let comm = next.join(0, &listener, layout)?;
        comm.barrier()?;
        Ok(Arc::new(comm) as Arc<dyn Communicator>)
    })
}

/// How a rank of a world joined with `--peers` rebuilds it when a rank
/// is lost: it cannot start the lost rank (another host's), so it waits
/// up to `--rejoin-timeout-s` for it to be started again and for every
/// rank to join on the same addresses, then meets them at a barrier
/// (the restarted rank's comes after it has loaded its slice).
fn rejoiner(split: SplitArgs, rank: usize, listener: TcpListener, layout: u64) -> Restart {
    Box::new(move || {
        let wait = Duration::from_secs(split.rejoin_timeout_s);
        eprintln!("rank {rank}: waiting up to {wait:?} for every rank to rejoin");
        let comm = split.join_within(rank, &listener, layout, wait)?;
        comm.barrier()?;
        Ok(Arc::new(comm) as Arc<dyn Communicator>)
    })
}

/// Ranks 1.. as child processes of this one.
fn start_ranks(
    split: &SplitArgs,
    model: &Path,
    block_size: usize,
    kv_mib: usize,
) -> Result<Vec<Child>> {
    let exe = std::env::current_exe().context("finding this program to start the ranks")?;
    let peers: Vec<String> = split.peers.iter().map(|p| p.to_string()).collect();
    let mut children = Vec::new();
    for rank in 1..split.world() {
        let mut cmd = std::process::Command::new(&exe);
        cmd.arg("rank")
            .args(["--rank", &rank.to_string()])
            .arg("--model")
            .arg(model)
            .args(["--tp", &split.tp.to_string()])
            .args(["--pp", &split.pp.to_string()])
            .args(split.load.to_args())
            .args(["--threads", &split.threads.to_string()])
            .args([
                "--collective-timeout-s",
                &split.collective_timeout_s.to_string(),
            ])
            .args(["--peers", &peers.join(",")])
            .args(["--token", &split.token.unwrap_or(0).to_string()])
            // Rank 0 restarts them all itself (`restarter`).
            .args(["--rejoin-timeout-s", "0"])
            .args(["--block-size", &block_size.to_string()])
            .args(["--kv-cache-mib", &kv_mib.to_string()]);
        if split.vocab_parallel_head {
            cmd.arg("--vocab-parallel-head");
        }
        children.push(
            cmd.spawn()
                .with_context(|| format!("starting rank {rank} ({})", exe.display()))?,
        );
    }
    Ok(children)
}

/// A rank other than 0: join, load, follow rank 0's plans.
pub fn rank(a: RankArgs) -> Result<()> {
    // A rank started by rank 0 goes when rank 0 does: its links break and
    // `follow` returns the error (not PR_SET_PDEATHSIG, which fires when
    // the *thread* that spawned it ends, and rank 0's loading thread does).
    let s = &a.split;
    s.check()?;
    if a.rank == 0 || a.rank >= s.world() || s.peers.len() != s.world() {
        bail!(
            "rank {} of a world of {} with {} --peers",
            a.rank,
            s.world(),
            s.peers.len()
        );
    }
    let listener = TcpListener::bind(s.peers[a.rank])
        .with_context(|| format!("rank {} binding {}", a.rank, s.peers[a.rank]))?;
    let layout = s.layout_hash(&a.model, a.block_size, a.kv_cache_mib)?;
    // The model's collectives call the world through `swap`, so that a
    // rejoined world can replace it under the loaded slice.
    let swap = Arc::new(SwapComm::new(Arc::new(s.join(a.rank, &listener, layout)?)));
    let comm: Arc<dyn Communicator> = swap.clone();
    let loaded = s.load(a.rank, &a.model, comm.clone())?;
    let kv = PagedKv::new(
        loaded.engine.kv_shape(),
        a.block_size,
        a.kv_cache_mib.saturating_mul(1 << 20),
        false,
    )?;
    let storage = kv.new_storage();
    comm.barrier().context("waiting for every rank to load")?;
    let what = || format!("rank {}", a.rank);
    let mut rejoin =
        (s.rejoin_timeout_s > 0).then(|| rejoiner(s.clone(), a.rank, listener, layout));
    // After a failed follow: if this rank's links broke (a rank was lost)
    // and rejoining is on, rejoin the rebuilt world keeping the loaded
    // slice (rank 0 recomputes the K/V); else the error.
    let mut recover = |e: RankError| -> Result<()> {
        match (&mut rejoin, comm.broken()) {
            (Some(restart), Some(why)) => {
                eprintln!("rank {}: {why}", a.rank);
                let next = restart()
                    .map_err(|re| anyhow::anyhow!("{re}"))
                    .with_context(what)?;
                swap.replace(next);
                eprintln!("rank {}: rejoined", a.rank);
                Ok(())
            }
            _ => Err(anyhow::Error::new(e).context(what())),
        }
    };
    if s.pp > 1 {
        let mut stage = Stage::new(&loaded.engine, storage);
        while let Err(e) = follow_stage(&*comm, &mut stage, s.pp) {
            recover(e)?;
        }
    } else {
        let mut runner = LocalRunner::new(&loaded.engine, storage);
        while let Err(e) = follow(&*comm, &mut runner) {
            recover(e)?;
        }
    }
    Ok(())
}

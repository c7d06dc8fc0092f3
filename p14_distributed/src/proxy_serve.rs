//! The proxy as a process, and `up`: a whole local cluster in one
//! command (etcd and NATS as children unless endpoints are given, the
//! prefill and decode workers as children, the proxy in this process).

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use p04_transformer::model_file::GgufFile;
use p04_transformer::Tokenizer;
use p06_server::input::InputProcessor;
use p06_server::routes::AppState;
use p06_server::server::{self, ListenArgs};
use p10_quant::serve::LoadArgs;

use crate::cluster::{self, EtcdCluster, Nats, Proc};
use crate::etcd::Etcd;
use crate::proxy::Proxy;
use crate::registry::{self, Role, View};
use crate::routing::Board;
use crate::supervise::{Supervisor, WorkerSpec};
use crate::wire::LoadFailurePolicy;

#[derive(Clone, Debug, Args)]
pub struct ProxyArgs {
    #[command(flatten)]
    pub listen: ListenArgs,
    /// etcd client URLs, comma separated.
    #[arg(long, value_delimiter = ',', required = true)]
    pub etcd: Vec<String>,
    /// NATS URL; none: route by the proxy's own in-flight counts.
    #[arg(long)]
    pub nats: Option<String>,
    /// Follow only the workers registered in this namespace (the
    /// workers' `--namespace`); none: the shared pool.
    #[arg(long, value_parser = registry::parse_namespace)]
    pub namespace: Option<String>,
    /// When a decode worker cannot load a prompt's K/V.
    #[arg(long, value_enum, default_value = "recompute")]
    pub kv_load_failure_policy: LoadFailurePolicy,
    /// Stream each prompt's K/V layer by layer while it is prefilled.
    #[arg(long)]
    pub layerwise: bool,
    /// Seconds a request waits for a decode worker when none is
    /// registered (one being replaced) before it fails with 503.
    #[arg(long, default_value_t = 30)]
    pub worker_wait_s: u64,
}

/// The model's name, context and tokenizer from a GGUF file's header
/// (no weights are read).
pub fn front_of(path: &Path, served: &str) -> anyhow::Result<(common::ModelInfo, Tokenizer)> {
    if path.is_dir() {
        let loaded = p06_server::load::load_f32(path)?;
        let (engine, tok) = p06_server::load::with_tokenizer(path, loaded)?;
        return Ok((common::Model::info(&engine).clone(), tok));
    }
    let f = GgufFile::open(path).with_context(|| format!("reading {}", path.display()))?;
    let h = &f.header;
    let tok = Tokenizer::from_gguf(h)?;
    let vocab = match h.get_u64("llama.vocab_size") {
        Ok(v) => v as usize,
        Err(_) => h.tensor("token_embd.weight")?.shape()[0],
    };
    let context = h.get_u64("llama.context_length")? as usize;
    let info = p05_kv_cache::load::model_info(served.to_string(), vocab, context, Some(&tok));
    Ok((info, tok))
}

/// A proxy for model `spec` following the workers of `namespace` in etcd
/// at `etcd` (and NATS at `nats`), its tasks on `rt`; and its view of the
/// workers.
pub fn in_process(
    spec: &str,
    name: String,
    (etcd, namespace): (Vec<String>, Option<&str>),
    nats: Option<String>,
    policy: LoadFailurePolicy,
    rt: &tokio::runtime::Handle,
) -> anyhow::Result<(Proxy, Arc<View>)> {
    let path = p06_server::load::resolve_model(spec)?;
    let (info, tok) = front_of(&path, &name)?;
    let input = InputProcessor::new(Arc::new(tok), &info)?;
    let view = Arc::new(View::default());
    rt.spawn(registry::follow(
        Etcd::new(etcd, Duration::from_secs(2)),
        registry::prefix(namespace),
        view.clone(),
    ));
    let board = Arc::new(Board::default());
    if let Some(url) = nats {
        rt.spawn(crate::events::subscribe(url, board.clone()));
    }
    let proxy = Proxy::new(
        name,
        info.context_length,
        input,
        view.clone(),
        board,
        policy,
        rt.clone(),
    );
    Ok((proxy, view))
}

/// [`in_process`] on SmolLM2 with its served name, once its view holds
/// `prefill` and `decode` workers (benches: every worker is up).
pub fn ready_proxy(
    (etcd, nats): (&[String], &str),
    policy: LoadFailurePolicy,
    (prefill, decode): (usize, usize),
    rt: &tokio::runtime::Handle,
) -> anyhow::Result<Proxy> {
    let (proxy, view) = in_process(
        "smollm2",
        p06_server::load::served_name("smollm2"),
        (etcd.to_vec(), None),
        Some(nats.to_string()),
        policy,
        rt,
    )?;
    let t0 = Instant::now();
    while view.workers(Role::Prefill).len() < prefill || view.workers(Role::Decode).len() < decode {
        if t0.elapsed() > Duration::from_secs(30) {
            bail!(
                "the proxy does not see {prefill} prefill and {decode} decode workers after 30 s"
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(proxy)
}

/// Serve the proxy until SIGINT/SIGTERM.
pub async fn run(a: ProxyArgs) -> anyhow::Result<()> {
    let (proxy, _) = in_process(
        &a.listen.model,
        a.listen.name(),
        (a.etcd.clone(), a.namespace.as_deref()),
        a.nats.clone(),
        a.kv_load_failure_policy,
        &tokio::runtime::Handle::current(),
    )?;
    let proxy = proxy
        .layerwise(a.layerwise)
        .worker_wait(Duration::from_secs(a.worker_wait_s));
    let listener = a.listen.bind().await?;
    let state = AppState::new(Arc::new(proxy), a.listen.max_body_bytes);
    Ok(server::run_until_signal(listener, state, a.listen.grace()).await?)
}

#[derive(Clone, Debug, Args)]
pub struct UpArgs {
    #[arg(long, default_value_t = 1)]
    pub prefill: usize,
    #[arg(long, default_value_t = 1)]
    pub decode: usize,
    #[command(flatten)]
    pub listen: ListenArgs,
    /// Project 10's flags, passed to every worker.
    #[command(flatten)]
    pub load: LoadArgs,
    /// etcd client URLs; none: start one etcd member here.
    #[arg(long, value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// NATS URL; none: start a NATS server here.
    #[arg(long)]
    pub nats: Option<String>,
    #[arg(long, value_enum, default_value = "recompute")]
    pub kv_load_failure_policy: LoadFailurePolicy,
    /// K/V cache per worker, MiB.
    #[arg(long, default_value_t = 256)]
    pub kv_cache_mib: usize,
    /// Extra arguments for every worker (e.g. "--block-size 32").
    #[arg(long, allow_hyphen_values = true, default_value = "")]
    pub worker_args: String,
    /// Stream each prompt's K/V layer by layer while it is prefilled.
    #[arg(long)]
    pub layerwise: bool,
    /// Extra arguments for the prefill workers only (e.g. "--cpu 0").
    #[arg(long, allow_hyphen_values = true, default_value = "")]
    pub prefill_args: String,
    /// Extra arguments for the decode workers only (e.g. "--cpu 1").
    #[arg(long, allow_hyphen_values = true, default_value = "")]
    pub decode_args: String,
    /// Seconds a request waits for a decode worker when none is
    /// registered (the only one being restarted) before it fails with 503.
    #[arg(long, default_value_t = 30)]
    pub worker_wait_s: u64,
}

/// What `up` started (kept alive while it serves; its workers restarted
/// when they die).
#[derive(Debug)]
pub struct Cluster {
    pub etcd: Option<EtcdCluster>,
    pub nats: Option<Nats>,
    pub workers: Supervisor,
    pub etcd_urls: Vec<String>,
    pub nats_url: String,
}

/// Start etcd and NATS (unless given) and the workers; wait until every
/// worker is registered in etcd.
pub fn start_cluster(a: &UpArgs) -> anyhow::Result<Cluster> {
    let host = "127.0.0.1";
    let (etcd, etcd_urls) = match a.etcd.is_empty() {
        true => {
            let c = EtcdCluster::start(1, host)?;
            let urls = c.urls.clone();
            (Some(c), urls)
        }
        false => (None, a.etcd.clone()),
    };
    let (nats, nats_url) = match &a.nats {
        None => {
            let n = Nats::start(host)?;
            let url = n.url.clone();
            (Some(n), url)
        }
        Some(u) => (None, u.clone()),
    };
    let mut spec = Vec::new();
    for (role, n, own) in [
        (Role::Prefill, a.prefill, &a.prefill_args),
        (Role::Decode, a.decode, &a.decode_args),
    ] {
        for i in 0..n {
            let mut args: Vec<String> =
                a.worker_args.split_whitespace().map(String::from).collect();
            args.extend(own.split_whitespace().map(String::from));
            spec.push((role, format!("{}-{i}", role.as_str()), args));
        }
    }
    let specs = worker_specs(
        &a.listen.model,
        a.load,
        (&etcd_urls, &nats_url),
        a.kv_cache_mib,
        &spec,
    );
    let workers = Supervisor::start(std::env::current_exe()?, specs)?;
    let c = Cluster {
        etcd,
        nats,
        workers,
        etcd_urls,
        nats_url,
    };
    wait_registered(&c.etcd_urls, a.prefill + a.decode, Duration::from_secs(60))?;
    Ok(c)
}

/// The command lines of workers of this binary: for each of `spec`, its
/// role, id and extra arguments; all on `model` loaded as `load` says, following
/// etcd at `urls.0` and NATS at `urls.1`.
pub fn worker_specs(
    model: &str,
    load: LoadArgs,
    (etcd, nats): (&[String], &str),
    kv_cache_mib: usize,
    spec: &[(Role, String, Vec<String>)],
) -> Vec<WorkerSpec> {
    spec.iter()
        .map(|(role, id, extra)| {
            let mut args: Vec<String> = vec![
                "--model".into(),
                model.into(),
                "--etcd".into(),
                etcd.join(","),
                "--nats".into(),
                nats.into(),
                "--id".into(),
                id.clone(),
                "--kv-cache-mib".into(),
                kv_cache_mib.to_string(),
            ];
            args.extend(load.to_args());
            args.extend(extra.iter().cloned());
            WorkerSpec {
                role: *role,
                id: id.clone(),
                args,
            }
        })
        .collect()
}

/// Start the workers of [`worker_specs`] once, unsupervised (the benches:
/// a worker that dies there is a failed run).
pub fn start_workers(
    model: &str,
    load: LoadArgs,
    urls: (&[String], &str),
    kv_cache_mib: usize,
    spec: &[(Role, String, Vec<String>)],
) -> anyhow::Result<Vec<Proc>> {
    let exe = std::env::current_exe()?;
    let mut workers = Vec::new();
    for w in worker_specs(model, load, urls, kv_cache_mib, spec) {
        let (p, url) = cluster::start_worker(&exe, w.role.as_str(), &w.args)?;
        eprintln!("{} worker {} at {url}", w.role.as_str(), w.id);
        workers.push(p);
    }
    Ok(workers)
}

/// Until `n` workers are registered.
pub fn wait_registered(urls: &[String], n: usize, timeout: Duration) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let etcd = Etcd::new(urls.to_vec(), Duration::from_secs(2));
    let t0 = Instant::now();
    loop {
        let got = rt
            .block_on(etcd.get_prefix(registry::PREFIX))
            .map_or(0, |(kvs, _)| kvs.len());
        if got >= n {
            return Ok(());
        }
        if t0.elapsed() > timeout {
            bail!("{got} of {n} workers registered in etcd within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

pub fn up(a: UpArgs) -> anyhow::Result<()> {
    let cluster = start_cluster(&a)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let proxy = ProxyArgs {
        listen: a.listen.clone(),
        etcd: cluster.etcd_urls.clone(),
        nats: Some(cluster.nats_url.clone()),
        namespace: None,
        kv_load_failure_policy: a.kv_load_failure_policy,
        layerwise: a.layerwise,
        worker_wait_s: a.worker_wait_s,
    };
    eprintln!(
        "up: {} prefill, {} decode; etcd {:?}, NATS {}; proxy on {}:{}",
        a.prefill, a.decode, cluster.etcd_urls, cluster.nats_url, a.listen.host, a.listen.port
    );
    let r = rt.block_on(run(proxy));
    drop(cluster);
    r
}

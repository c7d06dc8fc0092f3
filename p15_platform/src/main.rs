//! `p15_platform`: the platform's command line.
//!
//!   p15_platform apply -f deploy.yaml     write a deployment (desired state) to etcd
//!   p15_platform get [NAME] [-o yaml]     read it back
//!   p15_platform delete NAME
//!   p15_platform status                   every deployment, as a table, and where its servers run
//!   p15_platform agent --node n1          a node agent (one per host)
//!   p15_platform controller --id c1       a controller (several: one leads)
//!   p15_platform router --config r.toml   the router (Project 12's gateway fed from etcd)
//!   p15_platform server ...               the model server node agents start
//!   p15_platform prefill|decode|proxy -- ...   Project 14's, for deployments split into roles
//!   p15_platform demo                     all of it on this machine: step, chaos, rollout
//!   p15_platform route-bench              the router's policies on one shared-prefix load
//!   p15_platform crd                      the ModelDeployment CustomResourceDefinition (YAML)
//!   p15_platform operator --image IMG     the Kubernetes operator (needs a cluster)

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use p15_platform::ops::{self, Format};
use p15_platform::store::Store;
use p15_platform::{agent, controller, router};

#[derive(Parser)]
#[command(about = "Project 15: declared model deployments in etcd, autoscaled")]
struct Cli {
    /// etcd endpoints, comma-separated.
    #[arg(long, global = true, default_value = "http://127.0.0.1:2379")]
    etcd: String,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Write a deployment (YAML) to etcd as the desired state.
    Apply {
        #[arg(short = 'f', long = "file")]
        file: std::path::PathBuf,
    },
    /// Print one deployment, or all.
    Get {
        name: Option<String>,
        #[arg(short = 'o', long, value_enum, default_value_t = Format::Yaml)]
        output: Format,
    },
    /// Remove a deployment.
    Delete { name: String },
    /// Every deployment, as a table, and each node's servers.
    Status,
    /// A node agent: registers the node, runs the servers assigned to it.
    Agent {
        #[arg(long)]
        node: String,
        /// Servers it hosts at once.
        #[arg(long, default_value_t = 2)]
        capacity: u32,
        /// The address its servers listen on.
        #[arg(long, default_value = "127.0.0.1")]
        host: String,
        /// Seconds without renewal before its node and servers are gone.
        #[arg(long, default_value_t = 3)]
        ttl_s: i64,
        /// Between a drain and SIGTERM (routers' time to drop the endpoint).
        #[arg(long, default_value_t = 500)]
        drain_delay_ms: u64,
        #[arg(long, default_value_t = 30)]
        shutdown_grace_s: u64,
        /// Where each server's log goes (default: a temporary directory).
        #[arg(long)]
        log_dir: Option<PathBuf>,
        /// Publish server phase changes here (NATS URL).
        #[arg(long)]
        nats: Option<String>,
    },
    /// A controller; several elect one leader through an etcd lease.
    Controller {
        #[arg(long)]
        id: String,
        /// Lease TTL: a dead leader is replaced within it.
        #[arg(long, default_value_t = 3)]
        ttl_s: i64,
        /// `/metrics` and `/status` here.
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: String,
    },
    /// The router: Project 12's gateway, backends from etcd.
    Router {
        #[arg(long, default_value = "router")]
        id: String,
        /// A Project 12 gateway config; its models are deployments.
        #[arg(long)]
        config: PathBuf,
        #[arg(long)]
        listen: Option<String>,
        #[arg(long, default_value_t = 3)]
        ttl_s: i64,
    },
    /// The model server a node agent runs (Project 10's `serve`).
    Server(p10_quant::serve::ServeArgs),
    /// Project 14's prefill worker, for a deployment split into roles;
    /// its own arguments after `--` (`prefill -- --help`).
    Prefill {
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Project 14's decode worker; its arguments after `--`.
    Decode {
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Project 14's proxy in front of one generation's workers (the
    /// deployment's endpoint); its arguments after `--`.
    Proxy {
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Print the Kubernetes CustomResourceDefinition of ModelDeployment
    /// (`p15_platform crd | kubectl apply -f -`).
    Crd,
    /// Reconcile ModelDeployments on the Kubernetes cluster the
    /// environment names (kubeconfig, or in-cluster) into Deployments and
    /// Services of `IMAGE` (which holds p15_platform and the model).
    Operator {
        #[arg(long)]
        image: String,
    },
    /// The whole platform on this machine through a step, chaos and a
    /// rollout: a timeline, a plot and numbers.md rows.
    #[cfg(feature = "bench")]
    Demo(p15_platform::demo::DemoArgs),
    /// Routing quality: each router policy over three servers on one
    /// skewed shared-prefix load (hit rate, queue imbalance, TTFT).
    #[cfg(feature = "bench")]
    RouteBench(p15_platform::route_bench::RouteBenchArgs),
    /// The autoscaler against Ray Serve's on a step and a ramp: SLO
    /// attainment, goodput, replica-seconds, reaction, flaps.
    #[cfg(feature = "bench")]
    ScaleBench(p15_platform::scale_bench::ScaleBenchArgs),
}

/// Project 14's worker arguments, parsed after `--`.
#[derive(Parser)]
struct WorkerCli {
    #[command(flatten)]
    a: p14_distributed::worker_serve::WorkerArgs,
}

/// Project 14's proxy arguments, parsed after `--`.
#[derive(Parser)]
struct ProxyCli {
    #[command(flatten)]
    a: p14_distributed::proxy_serve::ProxyArgs,
}

fn after_dashes<'a>(name: &'a str, args: &'a [String]) -> impl Iterator<Item = String> + 'a {
    std::iter::once(format!("p15_platform {name} --")).chain(args.iter().cloned())
}

fn main() -> Result<()> {
    use p14_distributed::registry::Role as WorkerRole;
    let cli = Cli::parse();
    // These run their own runtimes.
    match &cli.cmd {
        Cmd::Server(a) => return p10_quant::serve::run(a.clone()),
        Cmd::Prefill { args } => {
            let w = WorkerCli::parse_from(after_dashes("prefill", args));
            return p14_distributed::worker_serve::run(WorkerRole::Prefill, w.a);
        }
        Cmd::Decode { args } => {
            let w = WorkerCli::parse_from(after_dashes("decode", args));
            return p14_distributed::worker_serve::run(WorkerRole::Decode, w.a);
        }
        Cmd::Proxy { args } => {
            let p = ProxyCli::parse_from(after_dashes("proxy", args));
            return tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?
                .block_on(p14_distributed::proxy_serve::run(p.a));
        }
        _ => {}
    }
    #[cfg(feature = "bench")]
    if let Cmd::Demo(a) = &cli.cmd {
        return p15_platform::demo::run(a);
    }
    #[cfg(feature = "bench")]
    if let Cmd::RouteBench(a) = &cli.cmd {
        return p15_platform::route_bench::run(a);
    }
    #[cfg(feature = "bench")]
    if let Cmd::ScaleBench(a) = &cli.cmd {
        return p15_platform::scale_bench::run(a);
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(run(cli))
}

async fn run(cli: Cli) -> Result<()> {
    let endpoints: Vec<String> = cli.etcd.split(',').map(|s| s.trim().to_string()).collect();
    let store = Store::new(endpoints.clone());
    match cli.cmd {
        Cmd::Apply { file } => print!("{}", ops::apply(&store, &file).await?),
        Cmd::Get { name, output } => print!("{}", ops::get(&store, name.as_deref(), output).await?),
        Cmd::Delete { name } => print!("{}", ops::delete(&store, &name).await?),
        Cmd::Status => print!("{}", ops::status(&endpoints).await?),
        Cmd::Agent {
            node,
            capacity,
            host,
            ttl_s,
            drain_delay_ms,
            shutdown_grace_s,
            log_dir,
            nats,
        } => {
            let log_dir =
                log_dir.unwrap_or_else(|| std::env::temp_dir().join(format!("p15-agent-{node}")));
            let cfg = agent::AgentConfig {
                node,
                capacity,
                host,
                etcd: endpoints,
                ttl_s,
                exe: std::env::current_exe()?,
                drain_delay: Duration::from_millis(drain_delay_ms),
                shutdown_grace_s,
                log_dir,
                nats,
            };
            agent::Agent::new(cfg).run().await?;
        }
        Cmd::Controller { id, ttl_s, listen } => {
            let listener = tokio::net::TcpListener::bind(&listen)
                .await
                .with_context(|| format!("bind {listen}"))?;
            println!("controller {id} http on http://{}", listener.local_addr()?);
            let id_http = id.clone();
            let c = controller::Controller::new(controller::ControllerConfig {
                id,
                etcd: endpoints,
                ttl_s,
            });
            tokio::spawn(controller::serve_http(id_http, c.report.clone(), listener));
            c.run().await?;
        }
        Cmd::Router {
            id,
            config,
            listen,
            ttl_s,
        } => {
            let rc = router::RouterConfig {
                id,
                etcd: endpoints,
                ttl_s,
            };
            router::run(rc, &config, listen).await?;
        }
        Cmd::Server(_) | Cmd::Prefill { .. } | Cmd::Decode { .. } | Cmd::Proxy { .. } => {
            unreachable!("handled before the runtime starts")
        }
        Cmd::Crd => print!("{}", p15_platform::crd::crd_yaml()),
        Cmd::Operator { image } => p15_platform::operator::run(image).await?,
        #[cfg(feature = "bench")]
        Cmd::Demo(_) => unreachable!("handled before the runtime starts"),
        #[cfg(feature = "bench")]
        Cmd::RouteBench(_) => unreachable!("handled before the runtime starts"),
        #[cfg(feature = "bench")]
        Cmd::ScaleBench(_) => unreachable!("handled before the runtime starts"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    /// clap's own checks of every subcommand's flags (unique names and
    /// groups): a clash panics only when the binary starts.
    #[test]
    fn the_command_line_is_well_formed() {
        use clap::CommandFactory;
        super::Cli::command().debug_assert();
    }
}

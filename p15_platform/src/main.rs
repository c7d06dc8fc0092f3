//! `p15_platform`: the platform's command line.
//!
//!   p15_platform apply -f deploy.yaml     write a deployment (desired state) to etcd
//!   p15_platform get [NAME] [-o yaml]     read it back
//!   p15_platform delete NAME
//!   p15_platform status                   every deployment, as a table

use anyhow::{Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use p15_platform::spec::{ModelDeployment, Roles};
use p15_platform::store::{Applied, Store};

#[derive(Parser)]
#[command(about = "Project 15: declared model deployments in etcd, autoscaled")]
struct Cli {
    /// etcd endpoints, comma-separated.
    #[arg(long, global = true, default_value = "http://127.0.0.1:2379")]
    etcd: String,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, ValueEnum)]
enum Format {
    Yaml,
    Json,
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
    /// Every deployment, as a table.
    Status,
}

fn roles(r: &Roles) -> String {
    match r {
        Roles::Colocated => "colocated".into(),
        Roles::Disaggregated { prefill, decode } => format!("{prefill}P{decode}D"),
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    let store = Store::new(cli.etcd.split(',').map(|s| s.trim().to_string()).collect());
    match cli.cmd {
        Cmd::Apply { file } => {
            let name = file.display().to_string();
            let text = std::fs::read_to_string(&file).with_context(|| format!("reading {name}"))?;
            let d = ModelDeployment::from_yaml(&text, &name)?;
            let what = match store.apply(&d).await? {
                Applied::Created => "created",
                Applied::Updated => "updated",
                Applied::Unchanged => "unchanged",
            };
            println!("deployment {} {what}", d.name);
        }
        Cmd::Get { name, output } => {
            let all = match name {
                Some(n) => vec![store
                    .get(&n)
                    .await?
                    .with_context(|| format!("no deployment named {n}"))?],
                None => store.list().await?.0,
            };
            for s in all {
                match output {
                    Format::Yaml => print!("---\n{}", s.deployment.to_yaml()),
                    Format::Json => println!("{}", serde_json::to_string_pretty(&s.deployment)?),
                }
            }
        }
        Cmd::Delete { name } => match store.delete(&name).await? {
            true => println!("deployment {name} deleted"),
            false => anyhow::bail!("no deployment named {name}"),
        },
        Cmd::Status => {
            let (all, rev) = store.list().await?;
            println!(
                "{:<20} {:<12} {:<7} {:>8} {:<10} {:<12} {:>7} {:>9}",
                "NAME", "MODEL", "WEIGHTS", "REPLICAS", "ROLES", "METRIC", "TARGET", "REVISION"
            );
            for s in &all {
                let d = &s.deployment;
                println!(
                    "{:<20} {:<12} {:<7} {:>8} {:<10} {:<12} {:>7} {:>9}",
                    d.name,
                    d.model,
                    d.weights.as_str(),
                    format!("{}-{}", d.replicas.min, d.replicas.max),
                    roles(&d.roles),
                    d.autoscaling.metric.as_str(),
                    d.autoscaling.target,
                    s.mod_revision
                );
            }
            println!("{} deployment(s) at etcd revision {rev}", all.len());
        }
    }
    Ok(())
}

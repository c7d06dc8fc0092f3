//! What `p15_platform apply | get | delete | status` do, as functions
//! that return the text the command prints (the binary only parses flags
//! and prints): the kubectl of this platform.
//!
//! ```text
//! apply -f d.yaml   parse and check the spec, write it   "deployment smollm2 created"
//! get [NAME]        the stored spec(s) as YAML or JSON
//! delete NAME       remove the desired state (the controller drains its servers)
//! status            a table of deployments, then each node's servers
//! ```

use std::fmt::Write;
use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use p14_distributed::etcd::Etcd;

use crate::spec::{ModelDeployment, Roles};
use crate::state::Snapshot;
use crate::store::{Applied, Store};

/// How `get` prints a deployment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Yaml,
    Json,
}

/// `apply -f FILE`: refused with the field and the reason when the spec
/// is invalid; nothing is written then.
pub async fn apply(store: &Store, file: &Path) -> anyhow::Result<String> {
    let name = file.display().to_string();
    let text = std::fs::read_to_string(file).with_context(|| format!("reading {name}"))?;
    let d = ModelDeployment::from_yaml(&text, &name)?;
    let what = match store.apply(&d).await? {
        Applied::Created => "created",
        Applied::Updated => "updated",
        Applied::Unchanged => "unchanged",
    };
    Ok(format!("deployment {} {what}\n", d.name))
}

/// `get [NAME]`: one deployment (an error when there is none by that
/// name), or every one.
pub async fn get(store: &Store, name: Option<&str>, format: Format) -> anyhow::Result<String> {
    let all = match name {
        Some(n) => vec![store
            .get(n)
            .await?
            .with_context(|| format!("no deployment named {n}"))?],
        None => store.list().await?.0,
    };
    let mut out = String::new();
    for s in all {
        match format {
            Format::Yaml => write!(out, "---\n{}", s.deployment.to_yaml())?,
            Format::Json => writeln!(out, "{}", serde_json::to_string_pretty(&s.deployment)?)?,
        }
    }
    Ok(out)
}

/// `delete NAME`: an error when there is none by that name.
pub async fn delete(store: &Store, name: &str) -> anyhow::Result<String> {
    match store.delete(name).await? {
        true => Ok(format!("deployment {name} deleted\n")),
        false => anyhow::bail!("no deployment named {name}"),
    }
}

fn roles(r: &Roles) -> String {
    match r {
        Roles::Colocated => "colocated".into(),
        Roles::Disaggregated { prefill, decode } => format!("{prefill}P{decode}D"),
    }
}

/// `status`: every deployment as a row, then each node's servers.
pub async fn status(endpoints: &[String]) -> anyhow::Result<String> {
    let store = Store::new(endpoints.to_vec());
    let (all, rev) = store.list().await?;
    let mut out = String::new();
    let row = |o: &mut String, c: [&str; 8]| {
        let _ = writeln!(
            o,
            "{:<20} {:<12} {:<7} {:>8} {:<10} {:<12} {:>7} {:>9}",
            c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]
        );
    };
    row(
        &mut out,
        [
            "NAME", "MODEL", "WEIGHTS", "REPLICAS", "ROLES", "METRIC", "TARGET", "REVISION",
        ],
    );
    for s in &all {
        let d = &s.deployment;
        row(
            &mut out,
            [
                &d.name,
                &d.model,
                d.weights.as_str(),
                &format!("{}-{}", d.replicas.min, d.replicas.max),
                &roles(&d.roles),
                d.autoscaling.metric.as_str(),
                &d.autoscaling.target.to_string(),
                &s.mod_revision.to_string(),
            ],
        );
    }
    writeln!(out, "{} deployment(s) at etcd revision {rev}", all.len())?;
    let etcd = Etcd::new(endpoints.to_vec(), Duration::from_secs(5));
    let snap = Snapshot::read(&etcd).await?;
    out.push_str(&crate::state::servers_table(&snap));
    Ok(out)
}

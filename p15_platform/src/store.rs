//! The desired state in etcd: one key per deployment,
//! `/inference-lab/p15/deployments/<name>`, its value the deployment as
//! JSON. `apply` writes it, `get`/`list` read it back (checked again: a
//! value written by another tool is refused with its key named),
//! `delete` removes it. The controller reads the same keys.

use std::time::Duration;

use p14_distributed::etcd::{Compare, Etcd, EtcdError, Op};
use thiserror::Error;

use crate::spec::{ModelDeployment, SpecError, MAX_DEPLOYMENTS};

pub const PREFIX: &str = "/inference-lab/p15/deployments/";
/// Everything of the platform's in etcd is under this (one range read
/// over it is a consistent snapshot: see [`crate::state`]).
pub const ROOT: &str = "/inference-lab/p15/";

#[derive(Debug, Error)]
pub enum StoreError {
    #[error(transparent)]
    Etcd(#[from] EtcdError),
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error("etcd key {key}: not a deployment: {message}")]
    Stored { key: String, message: String },
    #[error(
        "deployment {name}: the platform holds {held} deployments, at most {max}; delete one first"
    )]
    Full {
        name: String,
        held: usize,
        max: usize,
    },
    #[error("deployment {name}: other applies kept changing the deployments ({tries} tries); apply again")]
    Contended { name: String, tries: usize },
}

/// Creates raced by other applies before one is refused as contended.
const TRIES: usize = 8;

/// What `apply` did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    Created,
    Updated,
    Unchanged,
}

/// A deployment as stored, with the etcd revision that last changed it.
#[derive(Clone, Debug, PartialEq)]
pub struct Stored {
    pub deployment: ModelDeployment,
    pub mod_revision: i64,
}

#[derive(Clone, Debug)]
pub struct Store {
    etcd: Etcd,
}

pub fn key(name: &str) -> String {
    format!("{PREFIX}{name}")
}

impl Store {
    pub fn new(endpoints: Vec<String>) -> Store {
        Store {
            etcd: Etcd::new(endpoints, Duration::from_secs(5)),
        }
    }

    /// Create or update `d`. A create counts the deployments held and
    /// writes only if none was created or changed since the count (one
    /// etcd transaction), so concurrent applies cannot pass the bound
    /// together; one that lost the race counts again.
    pub async fn apply(&self, d: &ModelDeployment) -> Result<Applied, StoreError> {
        d.validate("the deployment")?;
        let k = key(&d.name);
        let value = serde_json::to_vec(d).map_err(|e| StoreError::Stored {
            key: k.clone(),
            message: e.to_string(),
        })?;
        for _ in 0..TRIES {
            let (all, rev) = self.list().await?;
            match all.iter().find(|s| s.deployment.name == d.name) {
                Some(s) if s.deployment == *d => return Ok(Applied::Unchanged),
                Some(_) => {
                    self.etcd.put(&k, &value, None).await?;
                    return Ok(Applied::Updated);
                }
                None if all.len() >= MAX_DEPLOYMENTS => {
                    return Err(StoreError::Full {
                        name: d.name.clone(),
                        held: all.len(),
                        max: MAX_DEPLOYMENTS,
                    })
                }
                None => {
                    let unchanged = [
                        Compare::CreateRevision(k.clone(), 0),
                        Compare::PrefixUnchangedSince(PREFIX.to_string(), rev),
                    ];
                    let put = [Op::Put {
                        key: k.clone(),
                        value: value.clone(),
                        lease: None,
                    }];
                    if self.etcd.txn(&unchanged, &put).await?.0 {
                        return Ok(Applied::Created);
                    }
                }
            }
        }
        Err(StoreError::Contended {
            name: d.name.clone(),
            tries: TRIES,
        })
    }

    pub async fn get(&self, name: &str) -> Result<Option<Stored>, StoreError> {
        let k = key(name);
        let (kvs, _) = self.etcd.get_prefix(&k).await?;
        kvs.into_iter()
            .find(|kv| kv.key == k)
            .map(|kv| decode(&kv.key, &kv.value, kv.mod_revision))
            .transpose()
    }

    /// Every deployment, by name, and the store's revision.
    pub async fn list(&self) -> Result<(Vec<Stored>, i64), StoreError> {
        let (kvs, rev) = self.etcd.get_prefix(PREFIX).await?;
        let mut out = kvs
            .iter()
            .map(|kv| decode(&kv.key, &kv.value, kv.mod_revision))
            .collect::<Result<Vec<_>, _>>()?;
        out.sort_by(|a, b| a.deployment.name.cmp(&b.deployment.name));
        Ok((out, rev))
    }

    /// Whether it existed.
    pub async fn delete(&self, name: &str) -> Result<bool, StoreError> {
        Ok(self.etcd.delete(&key(name)).await?)
    }
}

pub(crate) fn decode(key: &str, value: &[u8], mod_revision: i64) -> Result<Stored, StoreError> {
    let stored = |message: String| StoreError::Stored {
        key: key.to_string(),
        message,
    };
    let mut de = serde_json::Deserializer::from_slice(value);
    let d: ModelDeployment = serde_path_to_error::deserialize(&mut de)
        .map_err(|e| stored(format!("{}: {}", e.path(), e.inner())))?;
    d.validate(key).map_err(|e| stored(e.to_string()))?;
    if key.strip_prefix(PREFIX) != Some(d.name.as_str()) {
        return Err(stored(format!("holds the deployment `{}`", d.name)));
    }
    Ok(Stored {
        deployment: d,
        mod_revision,
    })
}

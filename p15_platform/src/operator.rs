//! `p15_platform operator`: the platform's reconcile on Kubernetes. For
//! each `ModelDeployment` ([`crate::crd`]) it applies
//!
//! ```text
//! Deployment <name>   replicas = max(replicas.min, 1) pods of
//!                     `p15_platform server --model M --weights W` (port
//!                     8000), ready on GET /health, a preStop pause so the
//!                     Service stops sending before SIGTERM (the server
//!                     then finishes its streams), RollingUpdate with the
//!                     spec's max_surge / max_unavailable
//! Service <name>      port 80 -> 8000 over those pods
//! status              valid, message (a spec error names its field)
//! ```
//!
//! by server-side apply (field manager `p15-operator`, so reconciling an
//! unchanged resource changes nothing), both owned by the resource (a
//! deleted ModelDeployment takes them with it). Kubernetes' own
//! controllers then do what the platform's controller does here: place
//! pods, replace crashed ones, roll out. Scaling with load is not this
//! operator's: the replica count it sets is the floor, for an autoscaler
//! (Knative's KPA, KEDA) to raise. Disaggregated roles are accepted and
//! reported, not placed.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Service;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::{watcher, Controller};
use kube::{Api, Client, Resource, ResourceExt};
use serde_json::json;
use thiserror::Error;

use crate::crd::{ModelDeployment, ModelDeploymentStatus};
use crate::spec::{self, Roles};

pub const FIELD_MANAGER: &str = "p15-operator";
/// The server's port in the pod.
pub const PORT: i32 = 8000;

#[derive(Debug, Error)]
pub enum OperatorError {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("building the {what} for {name}: {source}")]
    Build {
        what: &'static str,
        name: String,
        source: serde_json::Error,
    },
    #[error("{0} has no namespace")]
    NoNamespace(String),
}

/// What reconcile needs besides the resource.
#[derive(Clone)]
pub struct Context {
    pub client: Client,
    /// The container image holding `p15_platform` and the model files.
    pub image: String,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("image", &self.image)
            .finish()
    }
}

/// The pods' labels (the Service selects on them).
fn labels(name: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app.kubernetes.io/name".into(), "p15-server".into()),
        ("app.kubernetes.io/managed-by".into(), FIELD_MANAGER.into()),
        ("inference-lab.dev/deployment".into(), name.into()),
    ])
}

/// An owned object's metadata: the resource's name and namespace, the
/// labels, and the resource as its controlling owner (deleting the
/// resource deletes the object).
fn metadata(md: &ModelDeployment) -> serde_json::Value {
    let name = md.name_any();
    let owner = md.controller_owner_ref(&());
    json!({
        "name": name,
        "namespace": md.namespace(),
        "labels": labels(&name),
        "ownerReferences": owner.into_iter().collect::<Vec<_>>(),
    })
}

/// The Deployment for a checked spec.
pub fn deployment(
    md: &ModelDeployment,
    d: &spec::ModelDeployment,
    image: &str,
) -> Result<Deployment, OperatorError> {
    let name = md.name_any();
    let v = json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(md),
        "spec": {
            "replicas": d.replicas.min.max(1),
            "selector": {"matchLabels": labels(&name)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {
                    "maxSurge": d.rollout.max_surge,
                    "maxUnavailable": d.rollout.max_unavailable,
                },
            },
            "template": {
                "metadata": {"labels": labels(&name)},
                "spec": {
                    // The preStop pause plus the longest stream.
                    "terminationGracePeriodSeconds": 60,
                    "containers": [{
                        "name": "server",
                        "image": image,
                        "args": [
                            "server",
                            "--model", d.model,
                            "--weights", d.weights.as_str(),
                            "--served-model-name", name,
                            "--host", "0.0.0.0",
                            "--port", PORT.to_string(),
                        ],
                        "ports": [{"name": "http", "containerPort": PORT}],
                        "readinessProbe": {
                            "httpGet": {"path": "/health", "port": PORT},
                            "periodSeconds": 1,
                            "failureThreshold": 2,
                        },
                        // Endpoints drop a terminating pod asynchronously:
                        // keep serving a few seconds before SIGTERM.
                        "lifecycle": {"preStop": {"sleep": {"seconds": 5}}},
                    }],
                },
            },
        },
    });
    serde_json::from_value(v).map_err(|source| OperatorError::Build {
        what: "Deployment",
        name,
        source,
    })
}

/// The Service in front of the Deployment's pods.
pub fn service(md: &ModelDeployment) -> Result<Service, OperatorError> {
    let name = md.name_any();
    let v = json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(md),
        "spec": {
            "selector": labels(&name),
            "ports": [{"name": "http", "port": 80, "targetPort": PORT}],
        },
    });
    serde_json::from_value(v).map_err(|source| OperatorError::Build {
        what: "Service",
        name,
        source,
    })
}

async fn set_status(
    api: &Api<ModelDeployment>,
    md: &ModelDeployment,
    status: ModelDeploymentStatus,
) -> Result<(), OperatorError> {
    let patch = json!({"status": status});
    api.patch_status(
        &md.name_any(),
        &PatchParams::default(),
        &Patch::Merge(&patch),
    )
    .await?;
    Ok(())
}

/// One reconcile: check the spec, apply the Deployment and the Service,
/// report. The same resource twice sends the same requests (nothing
/// remembered between calls).
pub async fn reconcile(
    md: Arc<ModelDeployment>,
    ctx: Arc<Context>,
) -> Result<Action, OperatorError> {
    let name = md.name_any();
    let ns = md
        .namespace()
        .ok_or_else(|| OperatorError::NoNamespace(name.clone()))?;
    let mds: Api<ModelDeployment> = Api::namespaced(ctx.client.clone(), &ns);
    let source = format!("ModelDeployment {ns}/{name}");
    let d = match md.spec.to_deployment(&name, &source) {
        Ok(d) => d,
        Err(e) => {
            let status = ModelDeploymentStatus {
                valid: false,
                message: e.to_string(),
                observed_generation: md.metadata.generation,
            };
            set_status(&mds, &md, status).await?;
            // Nothing to do until the user edits it.
            return Ok(Action::await_change());
        }
    };
    let apply = PatchParams::apply(FIELD_MANAGER).force();
    let dep = deployment(&md, &d, &ctx.image)?;
    Api::<Deployment>::namespaced(ctx.client.clone(), &ns)
        .patch(&name, &apply, &Patch::Apply(&dep))
        .await?;
    let svc = service(&md)?;
    Api::<Service>::namespaced(ctx.client.clone(), &ns)
        .patch(&name, &apply, &Patch::Apply(&svc))
        .await?;
    let roles = match d.roles {
        Roles::Colocated => String::new(),
        Roles::Disaggregated { .. } => {
            "; prefill/decode roles are not placed on Kubernetes: all pods are colocated servers"
                .into()
        }
    };
    let status = ModelDeploymentStatus {
        valid: true,
        message: format!(
            "applied Deployment and Service {name} ({} replica floor){roles}",
            d.replicas.min.max(1)
        ),
        observed_generation: md.metadata.generation,
    };
    set_status(&mds, &md, status).await?;
    // Level-triggered: look again even if no event comes.
    Ok(Action::requeue(Duration::from_secs(300)))
}

pub fn error_policy(_md: Arc<ModelDeployment>, e: &OperatorError, _ctx: Arc<Context>) -> Action {
    eprintln!("operator: {e}");
    Action::requeue(Duration::from_secs(10))
}

/// Run against the cluster the environment names (kubeconfig or the
/// in-cluster service account) until stopped.
pub async fn run(image: String) -> anyhow::Result<()> {
    let client = Client::try_default().await?;
    let ctx = Arc::new(Context {
        client: client.clone(),
        image,
    });
    Controller::new(
        Api::<ModelDeployment>::all(client.clone()),
        watcher::Config::default(),
    )
    .owns(
        Api::<Deployment>::all(client.clone()),
        watcher::Config::default(),
    )
    .owns(Api::<Service>::all(client), watcher::Config::default())
    .shutdown_on_signal()
    .run(reconcile, error_policy, ctx)
    .for_each(|r| async move {
        match r {
            Ok((obj, _)) => println!(
                "reconciled {}/{}",
                obj.namespace.unwrap_or_default(),
                obj.name
            ),
            Err(e) => eprintln!("operator: {e}"),
        }
    })
    .await;
    Ok(())
}

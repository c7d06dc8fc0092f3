//! The declared deployment as a Kubernetes custom resource, for users who
//! run a cluster: `kind: ModelDeployment` in group `inference-lab.dev`.
//!
//! ```yaml
//! apiVersion: inference-lab.dev/v1alpha1
//! kind: ModelDeployment
//! metadata: {name: smollm2, namespace: default}
//! spec:                      # the YAML `apply -f` takes, less `name`
//!   model: smollm2
//!   weights: native
//!   replicas: {min: 1, max: 4}
//!   autoscaling: {metric: concurrency, target: 4, stable_window: 60s}
//!   rollout: {max_surge: 1, max_unavailable: 0}
//! ```
//!
//! The field names are the platform's own (snake_case), so one document
//! body serves both. The schema the API server validates against is
//! generated from these types (`p15_platform crd`); what a schema cannot
//! say (a duration's syntax, min <= max, a target > 0) is checked by the
//! same parser `apply` uses ([`ModelDeploymentSpec::to_deployment`]), and
//! a failure lands in the resource's status with the field named.

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::spec::{self, SpecError, Weights};

#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "inference-lab.dev",
    version = "v1alpha1",
    kind = "ModelDeployment",
    namespaced,
    status = "ModelDeploymentStatus",
    shortname = "mdep",
    printcolumn = r#"{"name":"Model","type":"string","jsonPath":".spec.model"}"#,
    printcolumn = r#"{"name":"Weights","type":"string","jsonPath":".spec.weights"}"#,
    printcolumn = r#"{"name":"Valid","type":"boolean","jsonPath":".status.valid"}"#
)]
#[serde(deny_unknown_fields)]
pub struct ModelDeploymentSpec {
    /// A model name the servers resolve (`smollm2`) or a model file.
    pub model: String,
    #[schemars(schema_with = "weights_schema")]
    pub weights: Weights,
    pub replicas: Replicas,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling: Option<Autoscaling>,
    /// Absent: colocated (one server does prefill and decode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub roles: Option<Split>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<Rollout>,
}

/// Project 10's weights choice, as the schema's string enum.
fn weights_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    use clap::ValueEnum;
    let names: Vec<&str> = Weights::value_variants()
        .iter()
        .map(|w| w.as_str())
        .collect();
    schemars::json_schema!({"type": "string", "enum": names})
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Replicas {
    pub min: u32,
    pub max: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    Concurrency,
    Queue,
    KvUsage,
}

/// Durations as `500ms`, `6s`, `2m`; absent fields take the platform's
/// defaults (Knative's: 60 s stable, 6 s panic).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Autoscaling {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metric: Option<Metric>,
    pub target: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stable_window: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub panic_window: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_down_delay: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_scale_up_rate: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_scale_down_rate: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_to_zero_grace: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Split {
    pub prefill: u32,
    pub decode: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Rollout {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_surge: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_unavailable: Option<u32>,
}

/// What the operator last made of the resource.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ModelDeploymentStatus {
    /// The spec passed the platform's checks.
    pub valid: bool,
    /// Why not, with the field named; or what was applied.
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

impl ModelDeploymentSpec {
    /// The platform's deployment named `name`, through the parser and
    /// checks `apply -f` uses (`source_name` names the resource in
    /// errors).
    pub fn to_deployment(
        &self,
        name: &str,
        source_name: &str,
    ) -> Result<spec::ModelDeployment, SpecError> {
        let mut doc = serde_json::to_value(self).map_err(|e| SpecError::Parse {
            source_name: source_name.to_string(),
            field: ".".into(),
            message: e.to_string(),
        })?;
        if let Some(m) = doc.as_object_mut() {
            m.insert("name".into(), name.into());
        }
        // JSON is YAML: one parser, one set of messages.
        spec::ModelDeployment::from_yaml(&doc.to_string(), source_name)
    }
}

/// The CustomResourceDefinition, as YAML for `kubectl apply -f -`.
pub fn crd_yaml() -> String {
    use kube::CustomResourceExt;
    serde_yaml_ng::to_string(&ModelDeployment::crd()).unwrap_or_default()
}

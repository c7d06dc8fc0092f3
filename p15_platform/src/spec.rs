//! The declared deployment: what the user wants true, as YAML.
//!
//! ```yaml
//! name: smollm2
//! model: smollm2
//! weights: native            # f32 | native
//! replicas: {min: 0, max: 4}
//! autoscaling:
//!   metric: concurrency      # concurrency | queue | kv_usage
//!   target: 4                # per replica (kv_usage: a fraction, 0 to 1)
//!   stable_window: 60s
//!   panic_window: 6s
//!   scale_down_delay: 0s
//!   max_scale_up_rate: 1000
//!   max_scale_down_rate: 2
//!   scale_to_zero_grace: 30s
//! roles: colocated           # or {prefill: 1, decode: 2}
//! rollout: {max_surge: 1, max_unavailable: 0}
//! ```
//!
//! Unknown fields are refused, and every error names its field
//! (`autoscaling.target: ...`), as Kubernetes' validation does. Durations
//! are written `500ms`, `6s`, `2m`.

use std::time::Duration;

pub use p10_quant::Weights;
use serde::{Deserialize, Serialize};
use thiserror::Error;

#[derive(Debug, Error, PartialEq)]
pub enum SpecError {
    /// Not YAML, an unknown field, a wrong type: serde's message, at `field`.
    #[error("{source_name}: {field}: {message}")]
    Parse {
        source_name: String,
        field: String,
        message: String,
    },
    /// Parsed, but a value out of range.
    #[error("{source_name}: {field}: {message}")]
    Invalid {
        source_name: String,
        field: String,
        message: String,
    },
}

impl SpecError {
    /// The field the error is about (`.` for the document).
    pub fn field(&self) -> &str {
        match self {
            SpecError::Parse { field, .. } | SpecError::Invalid { field, .. } => field,
        }
    }
}

/// The most replicas one deployment may ask for: a controller tick plans
/// every replica, so the bound keeps a tick short whatever a spec says
/// (a node holds a few replicas of this model; 256 is past any cluster
/// this platform drives).
pub const MAX_REPLICAS: u32 = 256;

/// The most processes one deployment may ask for at `replicas.max`
/// (a split replica is its proxy and its workers).
pub const MAX_PROCESSES: u32 = 256;

/// The most deployments one platform holds (`apply` refuses another):
/// with [`MAX_PROCESSES`] this bounds what one controller tick plans.
pub const MAX_DEPLOYMENTS: usize = 64;

/// The most prefill or decode workers one replica of a split deployment
/// may ask for.
pub const MAX_WORKERS_PER_ROLE: u32 = 16;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Replicas {
    pub min: u32,
    pub max: u32,
}

/// What the autoscaler scales on, per replica.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    /// Requests in flight (waiting or running).
    Concurrency,
    /// Requests waiting for a slot.
    Queue,
    /// The fraction of K/V memory in use.
    KvUsage,
}

impl Metric {
    pub fn as_str(&self) -> &'static str {
        match self {
            Metric::Concurrency => "concurrency",
            Metric::Queue => "queue",
            Metric::KvUsage => "kv_usage",
        }
    }
}

/// A duration as `500ms`, `6s` or `2m`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Span(pub Duration);

impl Span {
    pub fn secs(s: u64) -> Span {
        Span(Duration::from_secs(s))
    }

    pub fn parse(s: &str) -> Result<Span, String> {
        let s = s.trim();
        let at = s
            .find(|c: char| !c.is_ascii_digit())
            .ok_or_else(|| format!("`{s}` has no unit (write 500ms, 6s or 2m)"))?;
        let (n, unit) = s.split_at(at);
        let n: u64 = n
            .parse()
            .map_err(|_| format!("`{s}`: a whole number before the unit"))?;
        let ms = match unit {
            "ms" => Some(n),
            "s" => n.checked_mul(1000),
            "m" => n.checked_mul(60_000),
            "h" => n.checked_mul(3_600_000),
            _ => return Err(format!("`{s}`: unit `{unit}` (write ms, s, m or h)")),
        };
        ms.map(|ms| Span(Duration::from_millis(ms)))
            .ok_or_else(|| format!("`{s}` is too long"))
    }
}

impl Serialize for Span {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let ms = self.0.as_millis();
        match ms % 1000 {
            0 => s.serialize_str(&format!("{}s", ms / 1000)),
            _ => s.serialize_str(&format!("{ms}ms")),
        }
    }
}

impl<'de> Deserialize<'de> for Span {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Span, D::Error> {
        let s = String::deserialize(d)?;
        Span::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// Knative KPA's settings ([`crate::kpa`]), with its defaults.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Autoscaling {
    #[serde(default = "default_metric")]
    pub metric: Metric,
    /// Per replica: requests (concurrency, queue) or a fraction (kv_usage).
    pub target: f64,
    #[serde(default = "default_stable")]
    pub stable_window: Span,
    #[serde(default = "default_panic")]
    pub panic_window: Span,
    #[serde(default = "default_zero")]
    pub scale_down_delay: Span,
    /// At most this many times the ready replicas in one decision.
    #[serde(default = "default_up_rate")]
    pub max_scale_up_rate: f64,
    /// At least the ready replicas divided by this after one decision.
    #[serde(default = "default_down_rate")]
    pub max_scale_down_rate: f64,
    #[serde(default = "default_grace")]
    pub scale_to_zero_grace: Span,
}

fn default_metric() -> Metric {
    Metric::Concurrency
}
fn default_stable() -> Span {
    Span::secs(60)
}
fn default_panic() -> Span {
    Span::secs(6)
}
fn default_zero() -> Span {
    Span::secs(0)
}
fn default_up_rate() -> f64 {
    1000.0
}
fn default_down_rate() -> f64 {
    2.0
}
fn default_grace() -> Span {
    Span::secs(30)
}

impl Default for Autoscaling {
    fn default() -> Autoscaling {
        Autoscaling {
            metric: default_metric(),
            target: 4.0,
            stable_window: default_stable(),
            panic_window: default_panic(),
            scale_down_delay: default_zero(),
            max_scale_up_rate: default_up_rate(),
            max_scale_down_rate: default_down_rate(),
            scale_to_zero_grace: default_grace(),
        }
    }
}

/// Servers of each replica: one co-located server, or Project 14's
/// prefill and decode workers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RolesRepr", into = "RolesRepr")]
pub enum Roles {
    Colocated,
    Disaggregated { prefill: u32, decode: u32 },
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(untagged, expecting = "`colocated`, or a map {prefill: n, decode: m}")]
enum RolesRepr {
    Name(String),
    Split(Split),
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Split {
    prefill: u32,
    decode: u32,
}

impl TryFrom<RolesRepr> for Roles {
    type Error = String;
    fn try_from(r: RolesRepr) -> Result<Roles, String> {
        match r {
            RolesRepr::Name(n) if n == "colocated" => Ok(Roles::Colocated),
            RolesRepr::Name(n) => Err(format!(
                "`{n}`: write `colocated` or a map {{prefill: n, decode: m}}"
            )),
            RolesRepr::Split(s) => Ok(Roles::Disaggregated {
                prefill: s.prefill,
                decode: s.decode,
            }),
        }
    }
}

impl From<Roles> for RolesRepr {
    fn from(r: Roles) -> RolesRepr {
        match r {
            Roles::Colocated => RolesRepr::Name("colocated".into()),
            Roles::Disaggregated { prefill, decode } => RolesRepr::Split(Split { prefill, decode }),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rollout {
    /// Replicas above the desired count while replacing.
    #[serde(default = "one")]
    pub max_surge: u32,
    /// Replicas below it while replacing.
    #[serde(default)]
    pub max_unavailable: u32,
}

fn one() -> u32 {
    1
}

impl Default for Rollout {
    fn default() -> Rollout {
        Rollout {
            max_surge: 1,
            max_unavailable: 0,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelDeployment {
    pub name: String,
    /// A model name the servers resolve (`smollm2`) or a model file.
    pub model: String,
    pub weights: Weights,
    pub replicas: Replicas,
    #[serde(default)]
    pub autoscaling: Autoscaling,
    #[serde(default = "colocated")]
    pub roles: Roles,
    #[serde(default)]
    pub rollout: Rollout,
}

fn colocated() -> Roles {
    Roles::Colocated
}

impl ModelDeployment {
    /// Parse and check YAML from `source_name` (a file's name, for errors).
    pub fn from_yaml(text: &str, source_name: &str) -> Result<ModelDeployment, SpecError> {
        let de = serde_yaml_ng::Deserializer::from_str(text);
        let d: ModelDeployment = serde_path_to_error::deserialize(de).map_err(|e| {
            let field = e.path().to_string();
            let mut message = e.into_inner().to_string();
            // The YAML library prefixes its own (sometimes shorter) path.
            if let Some((head, rest)) = message.split_once(": ") {
                if !head.contains(' ') && field.starts_with(head) {
                    message = rest.to_string();
                }
            }
            SpecError::Parse {
                source_name: source_name.to_string(),
                field,
                message,
            }
        })?;
        d.validate(source_name)?;
        Ok(d)
    }

    pub fn to_yaml(&self) -> String {
        serde_yaml_ng::to_string(self).unwrap_or_default()
    }

    /// Every range the types cannot say, with the field named.
    pub fn validate(&self, source_name: &str) -> Result<(), SpecError> {
        let bad = |field: &str, message: String| {
            Err(SpecError::Invalid {
                source_name: source_name.to_string(),
                field: field.to_string(),
                message,
            })
        };
        let n = &self.name;
        let dns = !n.is_empty()
            && n.len() <= 63
            && n.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !n.starts_with('-')
            && !n.ends_with('-');
        if !dns {
            return bad(
                "name",
                format!("`{n}`: 1 to 63 lowercase letters, digits and `-`, not starting or ending with `-`"),
            );
        }
        if self.model.trim().is_empty() {
            return bad("model", "empty".into());
        }
        let r = self.replicas;
        if r.max == 0 {
            return bad("replicas.max", "must be at least 1".into());
        }
        if r.max > MAX_REPLICAS {
            return bad("replicas.max", format!("{}: at most {MAX_REPLICAS}", r.max));
        }
        if r.min > r.max {
            return bad(
                "replicas.min",
                format!("{} is above replicas.max ({})", r.min, r.max),
            );
        }
        let a = &self.autoscaling;
        let t = a.target;
        if !t.is_finite() || t <= 0.0 {
            return bad("autoscaling.target", format!("{t}: must be above 0"));
        }
        if a.metric == Metric::KvUsage && t > 1.0 {
            return bad(
                "autoscaling.target",
                format!("{t}: kv_usage is a fraction, at most 1"),
            );
        }
        let (stable, panic) = (a.stable_window.0, a.panic_window.0);
        if !(Duration::from_secs(6)..=Duration::from_secs(3600)).contains(&stable) {
            return bad("autoscaling.stable_window", format!("{stable:?}: 6s to 1h"));
        }
        if panic < Duration::from_secs(1) || panic > stable {
            return bad(
                "autoscaling.panic_window",
                format!("{panic:?}: from 1s to the stable window ({stable:?})"),
            );
        }
        if !(a.max_scale_up_rate > 1.0 && a.max_scale_up_rate.is_finite()) {
            return bad(
                "autoscaling.max_scale_up_rate",
                format!("{}: above 1", a.max_scale_up_rate),
            );
        }
        if !(a.max_scale_down_rate > 1.0 && a.max_scale_down_rate.is_finite()) {
            return bad(
                "autoscaling.max_scale_down_rate",
                format!("{}: above 1", a.max_scale_down_rate),
            );
        }
        if a.scale_down_delay.0 > Duration::from_secs(3600) {
            return bad("autoscaling.scale_down_delay", "at most 1h".into());
        }
        if let Roles::Disaggregated { prefill, decode } = self.roles {
            if prefill == 0 {
                return bad("roles.prefill", "must be at least 1".into());
            }
            if decode == 0 {
                return bad("roles.decode", "must be at least 1".into());
            }
            for (field, n) in [("roles.prefill", prefill), ("roles.decode", decode)] {
                if n > MAX_WORKERS_PER_ROLE {
                    return bad(field, format!("{n}: at most {MAX_WORKERS_PER_ROLE}"));
                }
            }
            let per = 1 + prefill + decode;
            if r.max.saturating_mul(per) > MAX_PROCESSES {
                return bad(
                    "replicas.max",
                    format!(
                        "{}: {} replicas of {per} processes each (a proxy, {prefill} prefill and {decode} decode workers) is above {MAX_PROCESSES} processes",
                        r.max, r.max
                    ),
                );
            }
            if self.autoscaling.metric != Metric::Concurrency {
                return bad(
                    "autoscaling.metric",
                    format!(
                        "{}: a prefill/decode deployment's endpoints (Project 14's proxies) report the requests in flight only; use concurrency",
                        self.autoscaling.metric.as_str()
                    ),
                );
            }
        }
        if self.rollout.max_surge == 0 && self.rollout.max_unavailable == 0 {
            return bad(
                "rollout.max_surge",
                "max_surge and max_unavailable are both 0: a rollout could never start".into(),
            );
        }
        Ok(())
    }
}

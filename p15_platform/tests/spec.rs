//! The deployment's YAML: the example parses with its values and round
//! trips; defaults fill what is left out; unknown fields, wrong types and
//! values out of range are refused with the field named.

use std::time::Duration;

use p15_platform::spec::{Metric, ModelDeployment, Roles, Span, SpecError, Weights};

const EXAMPLE: &str = include_str!("../examples/smollm2.yaml");

fn parse(y: &str) -> Result<ModelDeployment, SpecError> {
    ModelDeployment::from_yaml(y, "deploy.yaml")
}

/// The example with one line replaced (`key:` at the line's start).
fn with(key: &str, line: &str) -> String {
    let mut out = String::new();
    let mut done = false;
    for l in EXAMPLE.lines() {
        if !done && l.trim_start().starts_with(key) {
            out.push_str(line);
            done = true;
        } else {
            out.push_str(l);
        }
        out.push('\n');
    }
    assert!(done, "{key} is in the example");
    out
}

#[test]
fn the_example_parses_and_round_trips() {
    let d = parse(EXAMPLE).unwrap();
    assert_eq!(d.name, "smollm2");
    assert_eq!(d.weights, Weights::Native);
    assert_eq!((d.replicas.min, d.replicas.max), (0, 4));
    assert_eq!(d.autoscaling.metric, Metric::Concurrency);
    assert_eq!(d.autoscaling.target, 4.0);
    assert_eq!(d.autoscaling.stable_window, Span::secs(60));
    assert_eq!(d.autoscaling.panic_window, Span::secs(6));
    assert_eq!(d.roles, Roles::Colocated);
    assert_eq!((d.rollout.max_surge, d.rollout.max_unavailable), (1, 0));
    assert_eq!(parse(&d.to_yaml()).unwrap(), d);
    let json = serde_json::to_string(&d).unwrap();
    assert_eq!(serde_json::from_str::<ModelDeployment>(&json).unwrap(), d);
}

#[test]
fn left_out_fields_take_knatives_defaults() {
    let d = parse("name: a\nmodel: smollm2\nweights: f32\nreplicas: {min: 1, max: 2}\n").unwrap();
    assert_eq!(d.autoscaling.stable_window.0, Duration::from_secs(60));
    assert_eq!(d.autoscaling.panic_window.0, Duration::from_secs(6));
    assert_eq!(d.autoscaling.max_scale_up_rate, 1000.0);
    assert_eq!(d.autoscaling.max_scale_down_rate, 2.0);
    assert_eq!(d.autoscaling.scale_to_zero_grace.0, Duration::from_secs(30));
    assert_eq!(d.roles, Roles::Colocated);
    let d = parse(&with("roles:", "roles: {prefill: 1, decode: 2}")).unwrap();
    assert_eq!(
        d.roles,
        Roles::Disaggregated {
            prefill: 1,
            decode: 2
        }
    );
    let d = parse(&with("panic_window:", "  panic_window: 1500ms")).unwrap();
    assert_eq!(d.autoscaling.panic_window.0, Duration::from_millis(1500));
}

#[test]
fn unknown_fields_and_wrong_types_are_refused_with_the_field_named() {
    for (yaml, field, says) in [
        (
            with("target:", "  targte: 4"),
            "autoscaling.targte",
            "unknown field",
        ),
        (format!("{EXAMPLE}replica: 3\n"), "replica", "unknown field"),
        (
            with("replicas:", "replicas: {min: 0, max: 4, mx: 5}"),
            "replicas.mx",
            "expected `min` or `max`",
        ),
        (with("weights:", "weights: int8"), "weights", "int8"),
        (
            with("metric:", "  metric: cpu"),
            "autoscaling.metric",
            "cpu",
        ),
        (
            with("target:", "  target: four"),
            "autoscaling.target",
            "four",
        ),
        (
            with("stable_window:", "  stable_window: 60 seconds"),
            "autoscaling.stable_window",
            "unit",
        ),
        (
            with("stable_window:", "  stable_window: 60"),
            "autoscaling.stable_window",
            "",
        ),
        (with("roles:", "roles: split"), "roles", "colocated"),
        (
            with("roles:", "roles: {prefill: 1, decode: 1, router: 1}"),
            "roles",
            "colocated",
        ),
        (
            with("replicas:", "replicas: {min: -1, max: 4}"),
            "replicas.min",
            "",
        ),
        ("name: [".to_string(), "name", "expected a string"),
        ("name: 'open".to_string(), "name", "line 1"),
    ] {
        let e = parse(&yaml).unwrap_err();
        assert!(matches!(e, SpecError::Parse { .. }), "{yaml}: {e}");
        assert_eq!(e.field(), field, "{e}");
        assert!(e.to_string().contains(says), "{e} should say {says}");
        assert!(e.to_string().starts_with("deploy.yaml: "), "{e}");
    }
}

#[test]
fn values_out_of_range_are_refused_with_the_field_named() {
    for (yaml, field) in [
        (with("name:", "name: Bad_Name"), "name"),
        (with("name:", "name: -a"), "name"),
        (with("model:", "model: ''"), "model"),
        (
            with("replicas:", "replicas: {min: 0, max: 0}"),
            "replicas.max",
        ),
        (
            with("replicas:", "replicas: {min: 5, max: 4}"),
            "replicas.min",
        ),
        (
            with("replicas:", "replicas: {min: 0, max: 257}"),
            "replicas.max",
        ),
        (
            with("replicas:", "replicas: {min: 4000000000, max: 4000000000}"),
            "replicas.max",
        ),
        (with("target:", "  target: 0"), "autoscaling.target"),
        (with("target:", "  target: -2"), "autoscaling.target"),
        (with("target:", "  target: .nan"), "autoscaling.target"),
        (
            with("metric:", "  metric: kv_usage").replace("target: 4", "target: 1.5"),
            "autoscaling.target",
        ),
        (
            with("stable_window:", "  stable_window: 5s"),
            "autoscaling.stable_window",
        ),
        (
            with("stable_window:", "  stable_window: 2h"),
            "autoscaling.stable_window",
        ),
        (
            with("panic_window:", "  panic_window: 61s"),
            "autoscaling.panic_window",
        ),
        (
            with("panic_window:", "  panic_window: 500ms"),
            "autoscaling.panic_window",
        ),
        (
            with("max_scale_up_rate:", "  max_scale_up_rate: 1"),
            "autoscaling.max_scale_up_rate",
        ),
        (
            with("max_scale_down_rate:", "  max_scale_down_rate: 0.5"),
            "autoscaling.max_scale_down_rate",
        ),
        (
            with("scale_down_delay:", "  scale_down_delay: 2h"),
            "autoscaling.scale_down_delay",
        ),
        (
            with("roles:", "roles: {prefill: 0, decode: 1}"),
            "roles.prefill",
        ),
        (
            with("roles:", "roles: {prefill: 1, decode: 0}"),
            "roles.decode",
        ),
        (
            with("roles:", "roles: {prefill: 17, decode: 1}"),
            "roles.prefill",
        ),
        (
            // 8 replicas of a proxy and 32 workers: 264 processes.
            with("roles:", "roles: {prefill: 16, decode: 16}")
                .replace("replicas: {min: 0, max: 4}", "replicas: {min: 0, max: 8}"),
            "replicas.max",
        ),
        (
            // A split deployment's proxies report requests in flight only.
            with("roles:", "roles: {prefill: 1, decode: 1}")
                .replace("metric: concurrency", "metric: queue"),
            "autoscaling.metric",
        ),
        (
            with("rollout:", "rollout: {max_surge: 0, max_unavailable: 0}"),
            "rollout.max_surge",
        ),
    ] {
        let e = parse(&yaml).unwrap_err();
        assert!(matches!(e, SpecError::Invalid { .. }), "{yaml}: {e}");
        assert_eq!(e.field(), field, "{e}");
    }
}

#[test]
fn the_example_router_config_is_a_gateway_config_with_a_hold() {
    let text = include_str!("../examples/router.toml");
    let c = p12_gateway::Config::parse(text, "router.toml").unwrap();
    assert!(
        c.activator.hold_ms > 0,
        "a deployment at zero needs the hold"
    );
    assert!(
        c.models.iter().all(|m| m.backends.is_empty()),
        "backends come from etcd"
    );
    let d = ModelDeployment::from_yaml(include_str!("../examples/smollm2.yaml"), "smollm2.yaml")
        .unwrap();
    assert!(
        c.models.iter().any(|m| m.name == d.name),
        "the router serves the example deployment"
    );
}

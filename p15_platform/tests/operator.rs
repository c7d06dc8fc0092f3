//! The Kubernetes operator against a mocked API server (tower-test): no
//! cluster runs here, so these check the requests reconcile sends and
//! what it does with the answers, not Kubernetes' side of them.

use std::sync::{Arc, Mutex};

use http::{Request, Response};
use kube::client::Body;
use kube::Client;
use p15_platform::crd::{self, ModelDeployment};
use p15_platform::operator::{self, Context};
use p15_platform::spec;
use serde_json::{json, Value};

/// One request the mock API server got.
#[derive(Clone, Debug, PartialEq)]
struct Seen {
    method: String,
    uri: String,
    body: Value,
}

/// A client whose API server records every request and answers 200 with
/// the request's own body (what a server-side apply returns, near enough)
/// or, for a status patch, the resource.
fn mock(md: &ModelDeployment) -> (Client, Arc<Mutex<Vec<Seen>>>) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (seen2, md) = (seen.clone(), serde_json::to_value(md).unwrap());
    tokio::spawn(async move {
        let mut handle = std::pin::pin!(handle);
        while let Some((req, send)) = handle.next_request().await {
            let method = req.method().to_string();
            let uri = req.uri().to_string();
            let bytes = req.into_body().collect_bytes().await.unwrap();
            let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            let answer = if uri.contains("/status") {
                md.clone()
            } else {
                body.clone()
            };
            seen2.lock().unwrap().push(Seen { method, uri, body });
            send.send_response(
                Response::builder()
                    .body(Body::from(serde_json::to_vec(&answer).unwrap()))
                    .unwrap(),
            );
        }
    });
    (Client::new(service, "default"), seen)
}

fn resource(text: &str) -> ModelDeployment {
    let mut md: ModelDeployment = serde_yaml_ng::from_str(text).unwrap();
    md.metadata.uid = Some("uid-1".into());
    md.metadata.generation = Some(3);
    md
}

const EXAMPLE: &str = include_str!("../examples/k8s/smollm2.yaml");

async fn reconcile(md: &ModelDeployment) -> (kube::runtime::controller::Action, Vec<Seen>) {
    let (client, seen) = mock(md);
    let ctx = Arc::new(Context {
        client,
        image: "inference-lab/p15:test".into(),
    });
    let action = operator::reconcile(Arc::new(md.clone()), ctx)
        .await
        .unwrap();
    let seen = seen.lock().unwrap().clone();
    (action, seen)
}

#[tokio::test]
async fn reconcile_applies_a_deployment_and_a_service_owned_by_the_resource() {
    let md = resource(EXAMPLE);
    let (action, seen) = reconcile(&md).await;
    assert_eq!(seen.len(), 3, "{seen:#?}");

    let dep = &seen[0];
    assert_eq!(dep.method, "PATCH");
    assert!(
        dep.uri
            .starts_with("/apis/apps/v1/namespaces/default/deployments/smollm2?"),
        "{}",
        dep.uri
    );
    assert!(
        dep.uri.contains("fieldManager=p15-operator") && dep.uri.contains("force=true"),
        "server-side apply: {}",
        dep.uri
    );
    let b = &dep.body;
    assert_eq!(b["spec"]["replicas"], 1, "min 0 is floored at 1");
    assert_eq!(b["spec"]["strategy"]["rollingUpdate"]["maxSurge"], 1);
    assert_eq!(b["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"], 0);
    let owner = &b["metadata"]["ownerReferences"][0];
    assert_eq!(
        (
            owner["kind"].as_str(),
            owner["uid"].as_str(),
            owner["controller"].as_bool()
        ),
        (Some("ModelDeployment"), Some("uid-1"), Some(true))
    );
    let c = &b["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(c["image"], "inference-lab/p15:test");
    let args: Vec<&str> = c["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(
        args,
        [
            "server",
            "--model",
            "smollm2",
            "--weights",
            "native",
            "--served-model-name",
            "smollm2",
            "--host",
            "0.0.0.0",
            "--port",
            "8000"
        ]
    );
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/health");
    assert_eq!(c["lifecycle"]["preStop"]["sleep"]["seconds"], 5);
    let pod_labels = &b["spec"]["template"]["metadata"]["labels"];
    assert_eq!(&b["spec"]["selector"]["matchLabels"], pod_labels);

    let svc = &seen[1];
    assert!(
        svc.uri
            .starts_with("/api/v1/namespaces/default/services/smollm2?"),
        "{}",
        svc.uri
    );
    assert_eq!(
        &svc.body["spec"]["selector"], pod_labels,
        "the Service selects the pods"
    );
    assert_eq!(svc.body["spec"]["ports"][0]["targetPort"], 8000);

    let st = &seen[2];
    assert!(
        st.uri.starts_with(
            "/apis/inference-lab.dev/v1alpha1/namespaces/default/modeldeployments/smollm2/status"
        ),
        "{}",
        st.uri
    );
    assert_eq!(st.body["status"]["valid"], true);
    assert_eq!(st.body["status"]["observed_generation"], 3);
    assert_eq!(
        action,
        kube::runtime::controller::Action::requeue(std::time::Duration::from_secs(300))
    );
}

#[tokio::test]
async fn reconcile_is_idempotent_the_same_resource_sends_the_same_requests() {
    let md = resource(EXAMPLE);
    let (_, first) = reconcile(&md).await;
    let (_, second) = reconcile(&md).await;
    assert_eq!(first, second);
}

#[tokio::test]
async fn an_invalid_spec_creates_nothing_and_its_status_names_the_field() {
    let md = resource(&EXAMPLE.replace("target: 4", "target: 0"));
    let (action, seen) = reconcile(&md).await;
    assert_eq!(seen.len(), 1, "only the status: {seen:#?}");
    assert!(seen[0].uri.contains("/modeldeployments/smollm2/status"));
    assert_eq!(seen[0].body["status"]["valid"], false);
    let msg = seen[0].body["status"]["message"].as_str().unwrap();
    assert!(msg.contains("autoscaling.target"), "{msg}");
    assert!(msg.contains("ModelDeployment default/smollm2"), "{msg}");
    assert_eq!(action, kube::runtime::controller::Action::await_change());
}

#[test]
fn the_custom_resource_is_the_same_deployment_as_the_platform_yaml() {
    let md = resource(EXAMPLE);
    let from_crd = md.spec.to_deployment("smollm2", "test").unwrap();
    let plain =
        spec::ModelDeployment::from_yaml(include_str!("../examples/smollm2.yaml"), "smollm2.yaml")
            .unwrap();
    assert_eq!(from_crd, plain);
    // Unknown fields are refused here too.
    let bad = EXAMPLE.replace("weights: native", "weights: native\n  wieghts: f32");
    let e = serde_yaml_ng::from_str::<ModelDeployment>(&bad).unwrap_err();
    assert!(e.to_string().contains("wieghts"), "{e}");
}

#[test]
fn the_generated_definition_carries_the_schema() {
    let text = crd::crd_yaml();
    let v: Value = serde_yaml_ng::from_str(&text).unwrap();
    assert_eq!(v["kind"], "CustomResourceDefinition");
    assert_eq!(v["metadata"]["name"], "modeldeployments.inference-lab.dev");
    assert_eq!(v["spec"]["scope"], "Namespaced");
    let ver = &v["spec"]["versions"][0];
    assert_eq!(ver["name"], "v1alpha1");
    assert_eq!(ver["subresources"]["status"], json!({}));
    let spec = &ver["schema"]["openAPIV3Schema"]["properties"]["spec"];
    let required: Vec<&str> = spec["required"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap())
        .collect();
    assert_eq!(required, ["model", "replicas", "weights"]);
    assert_eq!(
        spec["properties"]["weights"]["enum"],
        json!(["f32", "native"])
    );
    // An optional enum: its values, and null (absent) allowed.
    let metric = &spec["properties"]["autoscaling"]["properties"]["metric"];
    assert_eq!(
        metric["enum"],
        json!(["concurrency", "queue", "kv_usage", null]),
        "{metric}"
    );
    assert_eq!(metric["nullable"], true, "{metric}");
}

//! The desired state in a real etcd (started here, in a temporary data
//! directory; `apt-get install -y etcd-server` if it is missing): apply
//! creates, re-applying the same is unchanged, a change updates; get,
//! list and delete read back what was written; a foreign value under
//! the prefix is refused with its key named; a deployment past the
//! platform's bound is refused, an update of a held one is not; the
//! command line does the same and names the bad field of a file.

use p14_distributed::cluster::EtcdCluster;
use p14_distributed::etcd::Etcd;
use p15_platform::spec::{ModelDeployment, MAX_DEPLOYMENTS};
use p15_platform::store::{key, Applied, Store, StoreError};

const EXAMPLE: &str = include_str!("../examples/smollm2.yaml");

fn etcd() -> EtcdCluster {
    EtcdCluster::start(1, "127.0.0.1").expect("etcd (install it: apt-get install -y etcd-server)")
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn apply_get_list_delete_round_trip_through_etcd() {
    let cluster = etcd();
    let rt = runtime();
    rt.block_on(async {
        let store = Store::new(cluster.urls.clone());
        let d = ModelDeployment::from_yaml(EXAMPLE, "smollm2.yaml").unwrap();
        assert_eq!(store.apply(&d).await.unwrap(), Applied::Created);
        assert_eq!(store.apply(&d).await.unwrap(), Applied::Unchanged);
        let mut bigger = d.clone();
        bigger.replicas.max = 8;
        assert_eq!(store.apply(&bigger).await.unwrap(), Applied::Updated);
        let got = store.get("smollm2").await.unwrap().unwrap();
        assert_eq!(got.deployment, bigger);
        assert!(got.mod_revision > 0);
        let mut other = d.clone();
        other.name = "another".into();
        store.apply(&other).await.unwrap();
        let (all, rev) = store.list().await.unwrap();
        let names: Vec<_> = all.iter().map(|s| s.deployment.name.as_str()).collect();
        assert_eq!(names, ["another", "smollm2"]);
        assert!(rev >= got.mod_revision);
        assert!(store.delete("another").await.unwrap());
        assert!(!store.delete("another").await.unwrap());
        assert!(store.get("another").await.unwrap().is_none());
        // A value no deployment: refused, the key named.
        let raw = Etcd::new(cluster.urls.clone(), std::time::Duration::from_secs(5));
        raw.put(&key("broken"), br#"{"name":"broken","model":"m"}"#, None)
            .await
            .unwrap();
        match store.list().await {
            Err(StoreError::Stored { key: k, message }) => {
                assert_eq!(k, key("broken"));
                assert!(message.contains("weights"), "{message}");
            }
            other => panic!("a broken value was accepted: {other:?}"),
        }
    });
}

#[test]
fn apply_refuses_a_deployment_past_the_platforms_bound() {
    let cluster = etcd();
    let rt = runtime();
    rt.block_on(async {
        let store = Store::new(cluster.urls.clone());
        let mut d = ModelDeployment::from_yaml(EXAMPLE, "smollm2.yaml").unwrap();
        for i in 0..MAX_DEPLOYMENTS {
            d.name = format!("m{i}");
            assert_eq!(store.apply(&d).await.unwrap(), Applied::Created);
        }
        d.name = "one-more".into();
        match store.apply(&d).await {
            Err(e @ StoreError::Full { .. }) => {
                let text = e.to_string();
                assert!(
                    text.contains("one-more") && text.contains(&MAX_DEPLOYMENTS.to_string()),
                    "{text}"
                );
            }
            other => panic!(
                "deployment {} of {MAX_DEPLOYMENTS} accepted: {other:?}",
                MAX_DEPLOYMENTS + 1
            ),
        }
        assert!(store.get("one-more").await.unwrap().is_none());
        // A held one still updates.
        d.name = "m0".into();
        d.replicas.max = 8;
        assert_eq!(store.apply(&d).await.unwrap(), Applied::Updated);
    });
}

/// Eight applies at once with room for two: the count and the write are
/// one transaction, so exactly two are created and six refused (each of
/// them counted 62 and would have written).
#[test]
fn concurrent_applies_do_not_pass_the_bound_together() {
    let cluster = etcd();
    let rt = runtime();
    rt.block_on(async {
        let store = Store::new(cluster.urls.clone());
        let mut d = ModelDeployment::from_yaml(EXAMPLE, "smollm2.yaml").unwrap();
        for i in 0..MAX_DEPLOYMENTS - 2 {
            d.name = format!("m{i}");
            assert_eq!(store.apply(&d).await.unwrap(), Applied::Created);
        }
        let racing: Vec<_> = (0..8)
            .map(|i| {
                let (store, mut d) = (store.clone(), d.clone());
                d.name = format!("race{i}");
                tokio::spawn(async move { store.apply(&d).await })
            })
            .collect();
        let (mut created, mut full) = (0, 0);
        for r in racing {
            match r.await.unwrap() {
                Ok(Applied::Created) => created += 1,
                Err(StoreError::Full { .. }) => full += 1,
                other => panic!("{other:?}"),
            }
        }
        assert_eq!((created, full), (2, 6));
        assert_eq!(store.list().await.unwrap().0.len(), MAX_DEPLOYMENTS);
    });
}

#[test]
fn the_command_line_applies_reports_and_names_a_bad_field() {
    let cluster = etcd();
    let exe = env!("CARGO_BIN_EXE_p15_platform");
    let run = |args: &[&str]| {
        let out = std::process::Command::new(exe)
            .args(["--etcd", &cluster.urls.join(",")])
            .args(args)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/smollm2.yaml");
    let (ok, out, err) = run(&["apply", "-f", example]);
    assert!(ok, "{err}");
    assert_eq!(out.trim(), "deployment smollm2 created");
    let (ok, out, _) = run(&["apply", "-f", example]);
    assert!(ok && out.contains("unchanged"), "{out}");
    let (ok, out, _) = run(&["status"]);
    assert!(ok);
    let row = out.lines().find(|l| l.starts_with("smollm2")).expect(&out);
    for cell in ["native", "0-4", "colocated", "concurrency"] {
        assert!(row.contains(cell), "{row}");
    }
    let (ok, out, _) = run(&["get", "smollm2"]);
    assert!(ok);
    let back = ModelDeployment::from_yaml(out.trim_start_matches("---\n"), "get").unwrap();
    assert_eq!(
        back,
        ModelDeployment::from_yaml(EXAMPLE, "example").unwrap()
    );
    // A bad file: nothing written, the field named.
    let dir = std::env::temp_dir().join(format!("p15-spec-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.yaml");
    std::fs::write(&bad, EXAMPLE.replace("target: 4", "target: 0")).unwrap();
    let (ok, _, err) = run(&["apply", "-f", bad.to_str().unwrap()]);
    assert!(!ok);
    assert!(err.contains("autoscaling.target"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
    let (ok, _, _) = run(&["delete", "smollm2"]);
    assert!(ok);
    let (ok, _, err) = run(&["delete", "smollm2"]);
    assert!(!ok && err.contains("no deployment named smollm2"), "{err}");
}

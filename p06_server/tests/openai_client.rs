//! The official `openai` Python package against our server over a real
//! socket (scripts/openai_client_check.py). The client's venv is created by
//! scripts/setup_client_venv.sh when missing (pip, pinned version).

mod support;

use std::process::Command;

use support::{TestServer, MODEL};

#[tokio::test]
async fn the_official_openai_python_client_works_against_the_server() {
    let root = common::assets::workspace_root();
    let setup = Command::new("bash")
        .arg(root.join("scripts/setup_client_venv.sh"))
        .status()
        .expect("running scripts/setup_client_venv.sh");
    assert!(
        setup.success(),
        "could not create .venv-client; run `bash scripts/setup_client_venv.sh` and read its error"
    );
    let srv = TestServer::default().await;
    let script = root.join("scripts/openai_client_check.py");
    let python = root.join(".venv-client/bin/python");
    let base = format!("{}/v1", srv.url);
    let out = tokio::process::Command::new(python)
        .args([
            script.to_str().unwrap(),
            "--base-url",
            &base,
            "--model",
            MODEL,
        ])
        .output()
        .await
        .expect("running the openai client script");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}{stderr}");
    assert!(
        out.status.success(),
        "openai client checks failed:\n{stdout}{stderr}"
    );
    assert!(stdout.contains("all checks passed"));
}

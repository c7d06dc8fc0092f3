//! p06's HTTP API tests, unchanged, against the tensor-parallel server
//! (TP = 3): every endpoint over a real socket must return exactly what
//! the one-process p05 engine generates. Then the server as the README
//! starts it, at TP = 3 and at PP = 3: rank 0 spawning ranks 1 and 2 as
//! processes.

mod support;

include!("../../p06_server/tests/shared/api_cases.rs");

#[test]
fn the_served_binary_with_ranks_as_processes_answers_as_one_process() {
    served(&["--tp", "3"]);
    served(&["--pp", "3"]);
}

/// `p13_multi_gpu serve` with `split` (f32), one greedy chat request.
fn served(split: &[&str]) {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let path =
        common::assets::ensure(common::assets::Asset::SmolLm2).unwrap_or_else(|e| panic!("{e}"));
    let mut child = Command::new(env!("CARGO_BIN_EXE_p13_multi_gpu"))
        .args(["serve", "--model", path.to_str().unwrap(), "--port", "0"])
        .args(split)
        .args([
            "--weights",
            "f32",
            "--kv-cache-mib",
            "256",
            "--shutdown-grace-s",
            "1",
        ])
        .args(["--served-model-name", MODEL])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut url = None;
    for line in lines.by_ref() {
        let line = line.unwrap();
        if let Some(rest) = line.strip_prefix("listening on ") {
            url = rest.split_whitespace().next().map(str::to_string);
        }
        if line.starts_with("ready") {
            break;
        }
    }
    let url = url.expect("the server printed its address");
    let (_, want, _) = reference(24);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let got: Value = rt.block_on(async {
        post(&url, "/v1/chat/completions", &chat_body(json!({})))
            .await
            .json()
            .await
            .unwrap()
    });
    // SAFETY: kill(2) on our own child's pid.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let status = child.wait().unwrap();
    assert_eq!(
        got["choices"][0]["message"]["content"], want,
        "{split:?}: {got}"
    );
    assert!(status.success(), "{split:?}: rank 0 exited with {status}");
}

//! p06's HTTP API tests, unchanged, against the tensor-parallel server
//! (TP = 3): every endpoint over a real socket must return exactly what
//! the one-process p05 engine generates. Then the server as the README
//! starts it, at TP = 3 and at PP = 3: rank 0 spawning ranks 1 and 2 as
//! processes.

mod support;

const KIND: support::Kind = support::Kind::Tp;

include!("../../p06_server/tests/shared/api_cases.rs");

#[test]
fn the_served_binary_with_ranks_as_processes_answers_as_one_process() {
    served(&["--tp", "3"]);
    served(&["--pp", "3"]);
}

/// `p13_multi_gpu serve` with `split` (f32), one greedy chat request.
fn served(split: &[&str]) {
    let mut args = vec!["--weights", "f32", "--kv-cache-mib", "256"];
    args.extend_from_slice(split);
    let (mut child, url) = support::spawn_server(&args);
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

//! Every endpoint over a real socket, against SmolLM2: the HTTP layer must
//! return exactly what the p05 engine generates, in OpenAI's shapes.

mod support;

include!("shared/api_cases.rs");

#[tokio::test]
async fn n_above_one_is_refused_by_a_one_choice_engine() {
    let srv = TestServer::default().await;
    let (s, e) = error_of(&srv, "/v1/chat/completions", &chat_body(json!({"n": 2}))).await;
    assert_eq!((s, e["param"].as_str()), (400, Some("n")));
}

//! p06's HTTP API tests, unchanged, against the pipeline-parallel server
//! (PP = 3, stages over loopback TCP): every endpoint over a real socket
//! must return exactly what the one-process p05 engine generates.

mod support;

const KIND: support::Kind = support::Kind::Pp;

include!("../../p06_server/tests/shared/api_cases.rs");

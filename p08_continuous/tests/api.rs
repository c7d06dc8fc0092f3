//! p06's HTTP API tests, unchanged, against the p08 continuous batcher:
//! every endpoint over a real socket must return exactly what the p05
//! engine generates.

mod support;

include!("../../p06_server/tests/shared/api_cases.rs");

//! p06's HTTP API tests, unchanged, against the paged server: every
//! endpoint over a real socket must return exactly what the p05 engine
//! generates (prefix caching on: the tests repeat prompts).

mod support;

include!("../../p06_server/tests/shared/api_cases.rs");

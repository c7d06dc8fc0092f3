//! p06's lifecycle tests (client disconnect, full queue, drain, SIGTERM)
//! against the p08 continuous batcher.

mod support;

include!("../../p06_server/tests/shared/lifecycle_cases.rs");

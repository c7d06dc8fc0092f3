//! p06's lifecycle tests (client disconnect frees the blocks, full queue,
//! drain, SIGTERM) against the paged server.

mod support;

include!("../../p06_server/tests/shared/lifecycle_cases.rs");

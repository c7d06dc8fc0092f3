//! p06's load-shedding, cancellation and shutdown tests, unchanged, against
//! the p07 batcher.

mod support;

include!("../../p06_server/tests/shared/lifecycle_cases.rs");

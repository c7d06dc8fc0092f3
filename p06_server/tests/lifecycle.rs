//! Load shedding, cancellation and shutdown over real sockets.

mod support;

include!("shared/lifecycle_cases.rs");

//! bench (next)

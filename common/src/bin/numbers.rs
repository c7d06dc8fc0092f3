//! `numbers`: README figures rendered from `numbers.md`.
//!
//!   cargo run -p common --bin numbers -- render   # rewrite every `<!-- numbers: ... -->` block
//!   cargo run -p common --bin numbers -- check    # exit 1 when a block is stale (what the test runs)

use std::process::ExitCode;

fn main() -> ExitCode {
    let write = match std::env::args().nth(1).as_deref() {
        Some("render") => true,
        Some("check") => false,
        _ => {
            eprintln!("usage: numbers render | check");
            return ExitCode::from(2);
        }
    };
    let root = common::assets::workspace_root();
    match common::readme_numbers::render_workspace(&root, write) {
        Ok(stale) if stale.is_empty() => ExitCode::SUCCESS,
        Ok(stale) => {
            for s in stale {
                eprintln!("{s}");
            }
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

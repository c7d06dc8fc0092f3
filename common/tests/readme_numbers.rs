//! Every README figure block is what `numbers.md` renders, and names a run
//! that `numbers.md` holds.

#[test]
fn readme_number_blocks_match_numbers_md() {
    let root = common::assets::workspace_root();
    let stale = common::readme_numbers::render_workspace(&root, false).unwrap();
    assert!(
        stale.is_empty(),
        "{}\nrun `cargo run -p common --bin numbers -- render` (after the bench that records the rows)",
        stale.join("\n")
    );
}

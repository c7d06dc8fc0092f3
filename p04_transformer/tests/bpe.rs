//! The heap-driven merge loop against the naive one (rescan every pair
//! after every merge) on random merge tables and random id sequences: runs
//! of one symbol, ties between equal pairs, merges that create pairs of
//! lower rank than ones already waiting.

use common::rng::Rng;
use p04_transformer::bpe::Merges;

#[test]
fn heap_merges_equal_the_naive_loop() {
    let mut rng = Rng::new(3);
    for table in 0..40 {
        // Symbols 0..alphabet; each merge makes a new id above them all.
        let alphabet = 2 + rng.below(5) as u32;
        let mut ranked = Vec::new();
        let count = 5 + rng.below(40) as u32;
        for new_id in alphabet..alphabet + count {
            let (l, r) = (
                rng.below(u64::from(new_id)) as u32,
                rng.below(u64::from(new_id)) as u32,
            );
            ranked.push((l, r, new_id));
        }
        let merges = Merges::new(ranked);
        for case in 0..50 {
            let len = if case % 10 == 0 {
                300
            } else {
                rng.below(40) as usize
            };
            let single = case % 7 == 0;
            let mut fast: Vec<u32> = (0..len)
                .map(|_| {
                    if single {
                        0
                    } else {
                        rng.below(alphabet as u64) as u32
                    }
                })
                .collect();
            let mut naive = fast.clone();
            merges.merge(&mut fast);
            merges.merge_naive(&mut naive);
            assert_eq!(fast, naive, "table {table}, case {case}");
        }
    }
}

#[test]
fn a_pair_listed_twice_keeps_its_first_rank() {
    // (0, 0) -> 5 at rank 0 and -> 6 at rank 2; (0, 1) -> 7 at rank 1.
    let m = Merges::new([(0, 0, 5), (0, 1, 7), (0, 0, 6)]);
    assert_eq!(m.len(), 2);
    let mut ids = vec![0, 0, 1];
    m.merge(&mut ids);
    assert_eq!(ids, vec![5, 1]);
}

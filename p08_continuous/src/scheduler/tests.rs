//! The scheduler's policy on its own: no model, a simulated engine that
//! computes what it is given and samples one token when a chunk reaches
//! the end of a sequence.

use super::*;

fn config(budget: usize, seqs: usize, kv_positions: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_num_batched_tokens: budget,
        max_num_seqs: seqs,
        kv_positions,
        max_passed_over: 4,
        step_cost: None,
    }
}

/// Run one planned step; sequences that reach `max_len` tokens finish.
/// Returns the plan.
fn step(s: &mut Scheduler) -> StepPlan {
    let plan = s.schedule();
    check_plan(s, &plan);
    for sc in &plan.seqs {
        s.on_step(sc.id, sc.len, sc.samples);
        let e = s.find(sc.id).unwrap().clone();
        if sc.samples && e.num_tokens >= e.max_len {
            s.remove(sc.id);
        }
    }
    plan
}

/// Invariants of every plan: within the token budget and the sequence cap,
/// memory within the budget, each sequence once, chunks contiguous.
fn check_plan(s: &Scheduler, plan: &StepPlan) {
    let c = s.config();
    assert!(plan.num_tokens() <= c.max_num_batched_tokens, "{plan:?}");
    assert!(plan.seqs.len() <= c.max_num_seqs);
    assert!(s.used_positions() <= c.kv_positions);
    for (i, a) in plan.seqs.iter().enumerate() {
        assert!(a.len > 0);
        assert!(plan.seqs[i + 1..].iter().all(|b| b.id != a.id), "{plan:?}");
        let e = s.find(a.id).unwrap();
        assert_eq!(a.start, e.computed, "chunks start where the K/V ends");
        assert!(a.start + a.len <= e.allocated);
        assert_eq!(a.samples, a.start + a.len == e.num_tokens);
    }
}

#[test]
fn config_is_checked() {
    assert_eq!(
        Scheduler::new(config(4, 8, 100)).unwrap_err(),
        SchedulerError::BudgetBelowSeqs { tokens: 4, seqs: 8 }
    );
    assert_eq!(
        Scheduler::new(config(4, 0, 100)).unwrap_err(),
        SchedulerError::NoSeqs
    );
    let mut s = Scheduler::new(config(64, 4, 100)).unwrap();
    assert!(matches!(
        s.add(1, 50, 101),
        Err(SchedulerError::TooLong { .. })
    ));
    s.add(1, 50, 100).unwrap();
    assert_eq!(s.add(1, 5, 10), Err(SchedulerError::Duplicate(1)));
}

#[test]
fn a_long_prompt_is_chunked_to_the_budget_and_samples_only_at_its_end() {
    let mut s = Scheduler::new(config(32, 4, 1000)).unwrap();
    s.add(7, 100, 110).unwrap();
    let mut chunks = Vec::new();
    for _ in 0..4 {
        let plan = step(&mut s);
        assert_eq!(plan.seqs.len(), 1);
        chunks.push((plan.seqs[0].start, plan.seqs[0].len, plan.seqs[0].samples));
    }
    assert_eq!(
        chunks,
        [
            (0, 32, false),
            (32, 32, false),
            (64, 32, false),
            (96, 4, true)
        ]
    );
    // Then one decode token per step.
    let plan = step(&mut s);
    assert_eq!((plan.seqs[0].start, plan.seqs[0].len), (100, 1));
}

#[test]
fn running_streams_decode_every_step_while_a_long_prompt_is_prefilled() {
    let mut s = Scheduler::new(config(64, 8, 100_000)).unwrap();
    for id in 0..4 {
        s.add(id, 10, 10_000).unwrap();
    }
    step(&mut s); // four prompts in one step
    s.add(99, 2048, 2100).unwrap();
    let mut steps = 0;
    loop {
        let plan = step(&mut s);
        steps += 1;
        let decodes: Vec<SeqId> = plan
            .seqs
            .iter()
            .filter(|c| c.len == 1)
            .map(|c| c.id)
            .collect();
        assert_eq!(decodes[..4], [0, 1, 2, 3], "step {steps}: {plan:?}");
        let long = plan.seqs.iter().find(|c| c.id == 99).unwrap();
        assert_eq!(
            long.len,
            if long.samples {
                2048 - 60 * (steps - 1)
            } else {
                60
            }
        );
        if long.samples {
            break;
        }
    }
    assert_eq!(steps, 2048usize.div_ceil(60));
}

#[test]
fn the_sequence_cap_holds_and_freed_slots_are_filled_next_step() {
    let mut s = Scheduler::new(config(64, 2, 10_000)).unwrap();
    s.add(0, 4, 6).unwrap(); // finishes after 2 samples
    s.add(1, 4, 100).unwrap();
    s.add(2, 4, 100).unwrap();
    let p = step(&mut s);
    assert_eq!(p.admitted, [0, 1]);
    assert_eq!(s.num_waiting(), 1);
    step(&mut s); // 0 samples its second token and finishes
    assert!(s.find(0).is_none());
    let p = step(&mut s);
    assert_eq!(p.admitted, [2]);
}

#[test]
fn memory_shortage_preempts_the_least_computed_and_it_recomputes_everything() {
    // 96 positions: two sequences of 40-token prompts fit (48 each), but
    // not their growth.
    let mut s = Scheduler::new(config(128, 4, 96)).unwrap();
    s.add(0, 40, 90).unwrap();
    step(&mut s);
    s.add(1, 40, 90).unwrap();
    let p = step(&mut s);
    assert_eq!(p.admitted, [1]);
    // Decode until 0 needs more than 48 positions: 1 has computed less.
    let mut preempted = None;
    for _ in 0..20 {
        let p = step(&mut s);
        if let Some(&v) = p.preempted.first() {
            preempted = Some((v, p));
            break;
        }
    }
    let (victim, plan) = preempted.expect("no preemption");
    assert_eq!(victim, 1, "the one with less computed work goes");
    assert!(plan.seqs.iter().all(|c| c.id != 1));
    assert!(
        plan.admitted.is_empty(),
        "no admission in a step that preempted"
    );
    let e = s.find(1).unwrap().clone();
    assert_eq!((e.computed, e.allocated, e.preemptions), (0, 0, 1));
    assert!(e.num_tokens > 40, "it keeps its sampled tokens");
    assert_eq!(s.preemptions(), 1);
    // Once 0 finishes, 1 comes back and recomputes prompt + sampled tokens at once.
    for _ in 0..100 {
        let p = step(&mut s);
        if p.admitted == [1] {
            assert!(s.find(0).is_none(), "0 finished first");
            let c = p.seqs.iter().find(|c| c.id == 1).unwrap();
            assert_eq!((c.start, c.len, c.samples), (0, e.num_tokens, true));
            return;
        }
    }
    panic!("the preempted sequence never came back");
}

#[test]
fn a_sequence_that_is_itself_the_cheapest_victim_preempts_itself() {
    let mut s = Scheduler::new(config(128, 4, 64)).unwrap();
    s.add(0, 30, 64).unwrap();
    s.add(1, 2, 64).unwrap();
    step(&mut s); // 0: 32 positions, 1: 16
                  // 1 decodes to 16 positions, then asks for 32 while 0 holds 32 and
                  // has computed more: it preempts itself.
    for _ in 0..40 {
        let p = step(&mut s);
        if !p.preempted.is_empty() {
            assert_eq!(p.preempted, [1]);
            assert!(s.find(0).unwrap().computed > 0);
            return;
        }
    }
    panic!("no preemption");
}

/// The adversarial pattern: a request that does not fit sits at the head
/// while small ones keep arriving behind it. It is passed over at most
/// `max_passed_over` times, then nothing behind it is admitted until it is.
#[test]
fn a_big_request_is_passed_over_a_bounded_number_of_times() {
    let mut s = Scheduler::new(config(64, 16, 400)).unwrap();
    s.add(0, 8, 300).unwrap(); // running, holds 16 and grows towards 300
    step(&mut s);
    for _ in 0..130 {
        step(&mut s); // 0 grows to 256 positions: 144 stay free
    }
    assert_eq!(s.used_positions(), 256);
    s.add(1, 250, 260).unwrap(); // the big one: needs 256, fits only once 0 is done
    let mut admitted_behind_after_bound = 0;
    let mut passes = 0;
    for next in 2..402 {
        s.add(next, 4, 8).unwrap(); // small ones: fit, finish quickly
        let p = step(&mut s);
        if p.admitted.contains(&1) {
            break;
        }
        let e = s.find(1).unwrap();
        if e.passed_over > passes {
            passes = e.passed_over;
        } else if e.passed_over >= 4 {
            admitted_behind_after_bound += p.admitted.iter().filter(|&&id| id > 1).count();
        }
        assert!(e.passed_over <= 4);
    }
    assert_eq!(
        passes, 4,
        "small requests went ahead while it could not fit"
    );
    assert_eq!(admitted_behind_after_bound, 0);
    assert!(
        s.find(1).is_none_or(|e| e.computed > 0 || e.allocated > 0),
        "it was admitted"
    );
}

#[test]
fn the_step_cost_model_caps_prefill_while_streams_decode() {
    let cost = StepCost {
        itl_factor: 2.0,
        fixed_tokens: 14.0,
        decode_tokens: 1.5,
    };
    assert_eq!(cost.prefill_allowance(4), 20); // 1.0 x (14 + 6)
    let mut s = Scheduler::new(SchedulerConfig {
        step_cost: Some(cost),
        ..config(512, 8, 100_000)
    })
    .unwrap();
    // Nobody decodes: the whole budget goes to the prompt.
    s.add(0, 600, 700).unwrap();
    let p = step(&mut s);
    assert_eq!(p.seqs[0].len, 512);
    let p = step(&mut s);
    assert_eq!(p.seqs[0].len, 88);
    // One stream decodes: a new prompt gets 14 + 1.5 tokens per step.
    s.add(1, 100, 200).unwrap();
    let p = step(&mut s);
    assert_eq!(
        p.seqs.iter().map(|c| (c.id, c.len)).collect::<Vec<_>>(),
        [(0, 1), (1, 15)]
    );
    // A second prompt shares the same allowance, oldest first.
    s.add(2, 100, 200).unwrap();
    let p = step(&mut s);
    assert_eq!(
        p.seqs.iter().map(|c| (c.id, c.len)).collect::<Vec<_>>(),
        [(0, 1), (1, 15)]
    );
    // More decodes, more room: 14 + 1.5 x 16 = 38.
    assert_eq!(cost.prefill_allowance(16), 38);
}

//! The scheduler's policy on its own: no model, a simulated engine that
//! computes what it is given and samples one token when a chunk reaches
//! the end of a sequence.

use super::*;
use crate::kv_backend::ContiguousAllocator;

/// A scheduler with contiguous-cache accounting; token ids do not matter
/// to it, so every sequence's tokens are zeros.
struct Sim {
    s: Scheduler<Zeros>,
    kv: ContiguousAllocator,
}

/// A sequence record whose tokens are all zeros.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Zeros;

static ZEROS: [u32; 100_000] = [0; 100_000];

impl SeqTokens for Zeros {
    fn tokens(&self) -> &[u32] {
        &ZEROS
    }
}

impl Sim {
    fn add(&mut self, id: SeqId, num_tokens: usize, max_len: usize) -> Result<(), SchedulerError> {
        self.s
            .add(id, num_tokens, max_len, self.kv.capacity_positions(), Zeros)
    }

    fn find(&self, id: SeqId) -> Option<&Entry<Zeros>> {
        self.s.find(id)
    }
}

fn sim(budget: usize, seqs: usize, kv_positions: usize) -> Sim {
    Sim {
        s: Scheduler::new(config(budget, seqs)).unwrap(),
        kv: ContiguousAllocator::new(kv_positions),
    }
}

fn config(budget: usize, seqs: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_num_batched_tokens: budget,
        max_num_seqs: seqs,
        max_passed_over: 4,
        step_cost: None,
    }
}

/// Run one planned step; sequences that reach `max_len` tokens finish.
/// Returns the plan.
fn step(sim: &mut Sim) -> Schedule {
    let plan = sim.s.schedule(&mut sim.kv);
    check_plan(sim, &plan);
    for sc in &plan.seqs {
        sim.s.on_step(sc.id, sc.len, sc.samples);
        let e = sim.s.find(sc.id).unwrap().clone();
        if sc.samples && e.num_tokens >= e.max_len {
            sim.s.remove(sc.id);
            sim.kv.free(sc.id);
        }
    }
    plan
}

/// Invariants of every plan: within the token budget and the sequence cap,
/// memory within the budget, each sequence once, chunks contiguous.
fn check_plan(sim: &Sim, plan: &Schedule) {
    let c = sim.s.config();
    assert!(plan.num_tokens() <= c.max_num_batched_tokens, "{plan:?}");
    assert!(plan.seqs.len() <= c.max_num_seqs);
    assert!(sim.kv.used() <= sim.kv.capacity_positions());
    for (i, a) in plan.seqs.iter().enumerate() {
        assert!(a.len > 0);
        assert!(plan.seqs[i + 1..].iter().all(|b| b.id != a.id), "{plan:?}");
        let e = sim.s.find(a.id).unwrap();
        assert_eq!(a.start, e.computed, "chunks start where the K/V ends");
        assert!(a.start + a.len <= sim.kv.allocated(a.id));
        assert_eq!(a.samples, a.start + a.len == e.num_tokens);
        if a.decode {
            assert!(a.len == 1 && e.num_tokens - e.computed == 1, "{a:?}");
        }
    }
    for id in &plan.preempted {
        assert_eq!(
            sim.kv.allocated(*id),
            0,
            "a preempted sequence holds nothing"
        );
    }
}

#[test]
fn config_is_checked() {
    assert_eq!(
        Scheduler::<Zeros>::new(config(4, 8)).unwrap_err(),
        SchedulerError::BudgetBelowSeqs { tokens: 4, seqs: 8 }
    );
    assert_eq!(
        Scheduler::<Zeros>::new(config(4, 0)).unwrap_err(),
        SchedulerError::NoSeqs
    );
    let mut s = sim(64, 4, 100);
    assert!(matches!(
        s.add(1, 50, 101),
        Err(SchedulerError::TooLong { .. })
    ));
    assert_eq!(s.add(2, 0, 10), Err(SchedulerError::Empty(2)));
    s.add(1, 50, 100).unwrap();
    assert_eq!(s.add(1, 5, 10), Err(SchedulerError::Duplicate(1)));
}

#[test]
fn a_long_prompt_is_chunked_to_the_budget_and_samples_only_at_its_end() {
    let mut s = sim(32, 4, 1000);
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
    let mut s = sim(64, 8, 100_000);
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
    let mut s = sim(64, 2, 10_000);
    s.add(0, 4, 6).unwrap(); // finishes after 2 samples
    s.add(1, 4, 100).unwrap();
    s.add(2, 4, 100).unwrap();
    let p = step(&mut s);
    assert_eq!(p.admitted, [0, 1]);
    assert_eq!(s.s.num_waiting(), 1);
    step(&mut s); // 0 samples its second token and finishes
    assert!(s.find(0).is_none());
    let p = step(&mut s);
    assert_eq!(p.admitted, [2]);
}

#[test]
fn memory_shortage_preempts_the_least_computed_and_it_recomputes_everything() {
    // 96 positions: two sequences of 40-token prompts fit (48 each), but
    // not their growth.
    let mut s = sim(128, 4, 96);
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
    assert_eq!((e.computed, s.kv.allocated(1), e.preemptions), (0, 0, 1));
    assert!(e.num_tokens > 40, "it keeps its sampled tokens");
    assert_eq!(s.s.preemptions(), 1);
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
    let mut s = sim(128, 4, 64);
    s.add(0, 30, 64).unwrap();
    s.add(1, 2, 64).unwrap();
    // Admitted with 32 and 16 positions. 0 grows to 48 (exactly: doubling
    // does not fit), leaving nothing free; 1 then asks for a 17th position
    // while 0 has computed more: 1 is the cheapest victim, itself.
    step(&mut s);
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
    let mut s = sim(64, 16, 400);
    s.add(0, 8, 300).unwrap(); // running, holds 16 and grows towards 300
    step(&mut s);
    for _ in 0..130 {
        step(&mut s); // 0 grows to 256 positions: 144 stay free
    }
    assert_eq!(s.kv.used(), 256);
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
    assert!(s.kv.allocated(1) > 0, "it was admitted");
}

#[test]
fn the_step_cost_model_caps_prefill_while_streams_decode() {
    let cost = StepCost {
        itl_factor: 2.0,
        fixed_tokens: 14.0,
        decode_tokens: 1.5,
        attn_positions: f64::INFINITY,
    };
    assert_eq!(cost.prefill_units(4), 20.0); // 1.0 x (14 + 6)
    assert_eq!(cost.chunk_tokens(0, 20.0), 20);
    // With attention: at position 1000, a prompt token costs ~2 units.
    let late = StepCost {
        attn_positions: 1000.0,
        ..cost
    };
    assert_eq!(late.chunk_tokens(1000, 20.0), 9);
    assert!(late.chunk_units(1000, 9) <= 20.0 && late.chunk_units(1000, 10) > 20.0);
    assert_eq!(late.chunk_tokens(0, 20.0), 19);
    let mut s = Sim {
        s: Scheduler::new(SchedulerConfig {
            step_cost: Some(cost),
            ..config(512, 8)
        })
        .unwrap(),
        kv: ContiguousAllocator::new(100_000),
    };
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
    assert_eq!(cost.chunk_tokens(0, cost.prefill_units(16)), 38);
}

//! The autoscaler on a fake clock against scripted loads (one sample a
//! second): a steady load, a 4× step, a one-second spike, an oscillating
//! load, a ramp under a rate limit, a scale-down delay, scale to zero and
//! back. Each decision is checked against the KPA formulas computed here
//! from the load itself (not from the autoscaler's state), and the counts
//! against what the rules promise: panic within the panic window, no
//! scale-down in panic, no flapping under a load that does not change.

use std::time::Duration;

use p15_platform::kpa::{Decision, Kpa, KpaSpec};

fn spec() -> KpaSpec {
    KpaSpec {
        target: 4.0,
        stable_window: Duration::from_secs(60),
        panic_window: Duration::from_secs(6),
        panic_threshold: 2.0,
        max_scale_up_rate: 1000.0,
        max_scale_down_rate: 2.0,
        scale_down_delay: Duration::ZERO,
        scale_to_zero_grace: Duration::from_secs(30),
        min: 0,
        max: 20,
    }
}

/// Run `seconds` of `load(t)`; replicas become ready `cold` seconds after
/// they are asked for (and leave at once). Every second's (ready replicas
/// the decision was made with, decision).
fn drive(
    spec: KpaSpec,
    load: impl Fn(u64) -> f64,
    cold: u64,
    seconds: u64,
    ready0: u32,
) -> Vec<(u32, Decision)> {
    let mut kpa = Kpa::new(spec);
    let mut ready = ready0;
    // (time it becomes ready)
    let mut starting: Vec<u64> = Vec::new();
    let mut out = Vec::new();
    for t in 0..seconds {
        ready += starting.iter().filter(|&&at| at == t).count() as u32;
        starting.retain(|&at| at > t);
        let now = Duration::from_secs(t);
        kpa.record(now, load(t));
        let d = kpa.decide(now, ready).expect("a sample was recorded");
        out.push((ready, d.clone()));
        let have = ready + starting.len() as u32;
        if d.desired > have {
            starting.extend(std::iter::repeat_n(
                t + cold.max(1),
                (d.desired - have) as usize,
            ));
        } else if d.desired < ready {
            ready = d.desired; // scale down at once
        }
    }
    out
}

/// The mean of the load over the `window` seconds up to `t` (the first
/// seconds: over what there is).
fn mean(load: &impl Fn(u64) -> f64, t: u64, window: u64) -> f64 {
    let from = (t + 1).saturating_sub(window);
    let n = t + 1 - from;
    (from..=t).map(load).sum::<f64>() / n as f64
}

/// Check every decision's inputs and per-window counts against the
/// formulas.
fn check_formulas(spec: &KpaSpec, load: &impl Fn(u64) -> f64, run: &[(u32, Decision)]) {
    for (t, &(ready, ref d)) in run.iter().enumerate() {
        let t = t as u64;
        let (stable, panic) = (mean(load, t, 60), mean(load, t, 6));
        assert!((d.stable_value - stable).abs() < 1e-9, "t={t}: stable mean");
        assert!((d.panic_value - panic).abs() < 1e-9, "t={t}: panic mean");
        let r = ready.max(1) as f64;
        let up = (spec.max_scale_up_rate * r).ceil() as u32;
        let down = if ready == 0 {
            0
        } else {
            (r / spec.max_scale_down_rate).floor() as u32
        };
        let want = |v: f64| ((v / spec.target).ceil() as u32).clamp(down, up.max(down));
        assert_eq!(
            d.stable_desired,
            want(stable),
            "t={t}: ceil(stable / target), clamped"
        );
        assert_eq!(
            d.panic_desired,
            want(panic),
            "t={t}: ceil(panic / target), clamped"
        );
        let over = panic / spec.target / r >= spec.panic_threshold;
        if over {
            assert!(d.panicking, "t={t}: over the panic threshold");
        }
    }
}

fn changes(run: &[(u32, Decision)], from: usize) -> usize {
    run[from..]
        .windows(2)
        .filter(|w| w[0].1.desired != w[1].1.desired)
        .count()
}

#[test]
fn a_steady_load_runs_ceil_load_over_target_and_never_changes() {
    let load = |_| 10.0;
    let run = drive(spec(), load, 0, 300, 3);
    check_formulas(&spec(), &load, &run);
    assert!(run.iter().all(|(_, d)| d.desired == 3 && !d.panicking));
}

#[test]
fn a_4x_step_panics_inside_the_panic_window_and_never_scales_down_in_panic() {
    // 4 in flight (one replica's target), then 16 from t = 120.
    let load = |t| if t < 120 { 4.0 } else { 16.0 };
    let cold = 5;
    let run = drive(spec(), load, cold, 400, 1);
    check_formulas(&spec(), &load, &run);
    assert!(run[..120].iter().all(|(r, d)| d.desired == 1 && *r == 1));
    // The stable mean goes past one replica's target at once (4.2: two);
    // the panic mean after k seconds of 16 is 4 + 2k: twice one ready
    // replica's target at k = 2 (t = 121), and 16 (four) by k = 6.
    assert_eq!(run[120].1.desired, 2);
    assert!(!run[120].1.panicking);
    assert!(run[121].1.panicking, "panic two seconds into the step");
    assert_eq!(
        run[125].1.desired, 4,
        "all four asked for within the panic window"
    );
    // The first new replica serves within the panic window plus one cold start.
    let served = run[120..].iter().position(|(r, _)| *r > 1).unwrap() as u64;
    assert!(
        served <= 6 + cold,
        "first new replica ready {served} s into the step"
    );
    // In panic the count never goes down; it stays at 4 afterwards.
    let in_panic: Vec<_> = run[122..].iter().take_while(|(_, d)| d.panicking).collect();
    assert!(in_panic
        .windows(2)
        .all(|w| w[1].1.desired >= w[0].1.desired));
    assert!(run[130..].iter().all(|(_, d)| d.desired == 4));
    assert_eq!(changes(&run, 130), 0);
}

#[test]
fn a_one_second_spike_holds_its_count_for_a_stable_window_then_halves_down() {
    let load = |t| if t == 100 { 80.0 } else { 4.0 };
    let run = drive(spec(), load, 0, 300, 1);
    check_formulas(&spec(), &load, &run);
    // Panic mean (5·4 + 80)/6 = 16.7: 5 replicas, held while panicking.
    let peak = run[100].1.desired;
    assert_eq!(peak, 5);
    assert!(run[100..160]
        .iter()
        .all(|(_, d)| d.desired == peak && d.panicking));
    assert!(
        !run[160].1.panicking,
        "panic ends a stable window after its last extension"
    );
    // Then down by at most half per decision, to one.
    for (ready, d) in &run[160..] {
        assert!(
            d.desired >= ready / 2,
            "{ready} -> {}: faster than max_scale_down_rate",
            d.desired
        );
    }
    assert_eq!(run[160].1.desired, 2);
    assert_eq!(run.last().unwrap().1.desired, 1);
}

#[test]
fn an_oscillating_load_does_not_flap() {
    // 8 and 24 in turn every 5 s: a stable mean of 16 (four replicas);
    // the panic window sees at most 21.3, under twice four replicas.
    let load = |t: u64| if (t / 5).is_multiple_of(2) { 8.0 } else { 24.0 };
    let run = drive(spec(), load, 3, 600, 4);
    check_formulas(&spec(), &load, &run);
    assert!(run[120..]
        .iter()
        .all(|(_, d)| d.desired == 4 && !d.panicking));
    assert_eq!(changes(&run, 120), 0, "flaps after warm-up");
}

#[test]
fn a_rate_limit_bounds_every_scale_up() {
    let s = KpaSpec {
        max_scale_up_rate: 2.0,
        ..spec()
    };
    let load = |t| if t < 60 { 4.0 } else { 64.0 };
    let run = drive(s.clone(), load, 0, 120, 1);
    check_formulas(&s, &load, &run);
    for (ready, d) in &run {
        assert!(
            d.desired <= 2 * ready.max(&1),
            "{ready} ready, asked {}",
            d.desired
        );
    }
    assert_eq!(run[60].1.desired, 2);
    assert_eq!(run[61].1.desired, 4);
    assert_eq!(run[62].1.desired, 8);
    assert_eq!(run.last().unwrap().1.desired, 16);
}

#[test]
fn a_scale_down_delay_keeps_the_most_asked_in_its_window() {
    let s = KpaSpec {
        scale_down_delay: Duration::from_secs(30),
        ..spec()
    };
    let load = |t| if t < 200 { 16.0 } else { 4.0 };
    let run = drive(s.clone(), load, 0, 400, 4);
    check_formulas(&s, &load, &run);
    let plain = drive(spec(), load, 0, 400, 4);
    assert!(run[200..]
        .windows(2)
        .all(|w| w[1].1.desired <= w[0].1.desired));
    assert_eq!(run.last().unwrap().1.desired, 1);
    // Undelayed, three replicas once the stable mean is 12 (t = 219).
    let first_down =
        |r: &[(u32, Decision)]| r[200..].iter().position(|(_, d)| d.desired < 4).unwrap();
    assert!(
        first_down(&run) >= first_down(&plain) + 29,
        "held at least the delay"
    );
}

#[test]
fn zero_comes_after_a_quiet_stable_window_and_the_grace_and_load_brings_one_back() {
    let load = |t| if (100..400).contains(&t) { 0.0 } else { 4.0 };
    let run = drive(spec(), load, 0, 460, 1);
    check_formulas(&spec(), &load, &run);
    // The window is quiet from t = 159 (samples 100..=159); zero 30 s later.
    assert!(run[..189].iter().all(|(_, d)| d.desired == 1));
    assert!(run[189..400].iter().all(|(_, d)| d.desired == 0));
    assert!(run[190..=400].iter().all(|(r, _)| *r == 0));
    assert_eq!(run[400].1.desired, 1, "the first request brings one back");
    // With a minimum of one, never zero.
    let s = KpaSpec { min: 1, ..spec() };
    let run = drive(s, load, 0, 460, 1);
    assert!(run.iter().all(|(_, d)| d.desired == 1));
}

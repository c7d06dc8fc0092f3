//! What the demo and `scale-bench` measure of a fleet over time: the
//! replicas it ran against the ideal for the load, and flaps (the count
//! turning back while the load held). One sample every half second.

use anyhow::Context;
use common::numbers::{command_line, Recorder, Row};
use common::stats::percentile_sorted;

/// The fleet at one moment (seconds from the run's start).
#[derive(Clone, Debug, Default)]
pub struct Sample {
    pub t: f64,
    pub clients: usize,
    /// Servers running (starting, ready or draining): what they cost.
    pub running: usize,
    /// Servers routed to.
    pub ready: usize,
    /// The autoscaler's desired count, where it can be read.
    pub desired: Option<f64>,
}

/// Replica-seconds run and the ideal's: `max(min, ceil(clients /
/// target))` replicas at every moment (a fleet that scales instantly and
/// never starts cold).
pub fn replica_seconds(samples: &[Sample], target: f64, min: usize) -> (f64, f64) {
    let (mut actual, mut ideal) = (0.0, 0.0);
    for w in samples.windows(2) {
        let dt = w[1].t - w[0].t;
        actual += w[0].running as f64 * dt;
        ideal += (w[0].clients as f64 / target).ceil().max(min as f64) * dt;
    }
    (actual, ideal)
}

/// Flaps: `count` changing direction (up then down, or down then up)
/// inside one of the `steady` windows while the number of clients holds.
pub fn flaps(
    samples: &[Sample],
    steady: &[(f64, f64)],
    count: impl Fn(&Sample) -> Option<f64>,
) -> usize {
    let mut flaps = 0;
    let mut last_dir = 0i32;
    let in_steady = |t: f64| steady.iter().any(|&(a, b)| a <= t && t <= b);
    for w in samples.windows(2) {
        let (Some(d0), Some(d1)) = (count(&w[0]), count(&w[1])) else {
            continue;
        };
        if w[0].clients != w[1].clients || !in_steady(w[0].t) || !in_steady(w[1].t) {
            last_dir = 0;
            continue;
        }
        // Not f64::signum: it is 1 for 0, which would make a hold count as
        // a rise and the first fall after it a flap.
        let dir = match d1.partial_cmp(&d0) {
            Some(std::cmp::Ordering::Greater) => 1,
            Some(std::cmp::Ordering::Less) => -1,
            _ => 0,
        };
        if dir != 0 {
            if last_dir != 0 && dir != last_dir {
                flaps += 1;
            }
            last_dir = dir;
        }
    }
    flaps
}

/// The `q` percentile of sorted `v` (NaN when empty).
pub fn pct(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        f64::NAN
    } else {
        percentile_sorted(v, q)
    }
}

pub fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(f64::total_cmp);
    v
}

/// Rows of `values` (one per run): median and p95 from 5 runs, the one
/// value from one, the maximum from 2 to 4.
pub fn rows_of(metric: &str, values: Vec<f64>, unit: &str, pred: &str) -> Vec<Row> {
    let v = sorted(values);
    match v.len() {
        0 => Vec::new(),
        1 => vec![Row::new(format!("{metric}, one run"), v[0], unit).predicted(pred)],
        n if n < common::numbers::MIN_SAMPLES => {
            vec![Row::new(format!("{metric}, maximum of {n} runs"), v[n - 1], unit).predicted(pred)]
        }
        n => Row::median_p95(
            format!("{metric}, of {n} runs"),
            pct(&v, 50.0),
            pct(&v, 95.0),
            unit,
            pred,
        )
        .into(),
    }
}

/// Append `rows` to numbers.md, the machine noted with the native kernels
/// the servers run and `note` (if any).
pub fn append(rows: &[Row], note: &str) -> anyhow::Result<()> {
    let isa = p10_quant::NativeWeights::detect().dot.isa();
    Recorder::for_workspace(command_line("p15_platform"))
        .machine_note(&format!("native kernels {isa}{note}"))
        .append(rows)
        .context("appending to numbers.md")?;
    println!("rows appended to numbers.md");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(t: f64, clients: usize, running: usize) -> Sample {
        Sample {
            t,
            clients,
            running,
            ready: running,
            desired: Some(running as f64),
        }
    }

    #[test]
    fn replica_seconds_against_the_ideal() {
        // 2 clients (ideal 1) for 2 s on 2 replicas, then 8 (ideal 4) for 1 s on 3.
        let v = [s(0.0, 2, 2), s(2.0, 8, 3), s(3.0, 8, 3)];
        assert_eq!(replica_seconds(&v, 2.0, 1), (7.0, 6.0));
        // 0 clients: the ideal is the minimum.
        let z = [s(0.0, 0, 1), s(4.0, 0, 1)];
        assert_eq!(replica_seconds(&z, 2.0, 1), (4.0, 4.0));
        assert_eq!(replica_seconds(&z, 2.0, 0), (4.0, 0.0));
    }

    #[test]
    fn a_flap_is_a_turn_inside_a_steady_window() {
        let up_down = [s(0.0, 4, 1), s(1.0, 4, 2), s(2.0, 4, 1), s(3.0, 4, 2)];
        let count = |x: &Sample| x.desired;
        assert_eq!(flaps(&up_down, &[(0.0, 3.0)], count), 2);
        // Outside the window, or across a change of load, it is no flap.
        assert_eq!(flaps(&up_down, &[(2.5, 3.0)], count), 0);
        let step = [s(0.0, 2, 1), s(1.0, 8, 4), s(2.0, 2, 1)];
        assert_eq!(flaps(&step, &[(0.0, 2.0)], count), 0);
        // Monotone is no flap, also with holds between the moves.
        let mono = [s(0.0, 8, 1), s(1.0, 8, 2), s(2.0, 8, 4)];
        assert_eq!(flaps(&mono, &[(0.0, 2.0)], count), 0);
        let down = [
            s(0.0, 0, 4),
            s(1.0, 0, 4),
            s(2.0, 0, 3),
            s(3.0, 0, 3),
            s(4.0, 0, 2),
        ];
        assert_eq!(flaps(&down, &[(0.0, 4.0)], count), 0);
        // A hold between a rise and a fall does not hide the turn.
        let turn = [s(0.0, 8, 1), s(1.0, 8, 2), s(2.0, 8, 2), s(3.0, 8, 1)];
        assert_eq!(flaps(&turn, &[(0.0, 3.0)], count), 1);
    }
}

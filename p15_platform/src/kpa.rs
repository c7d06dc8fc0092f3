//! The autoscaler: Knative's KPA (Knative Pod Autoscaler) rules, on a
//! clock the caller passes in (so tests drive it through an hour in no
//! time).
//!
//! Every second the caller records the metric summed over the ready
//! replicas (requests in flight, requests waiting, or K/V fractions);
//! every decision:
//!
//! ```text
//! stable  = mean of the samples in the last stable_window (60 s)
//! panic   = mean of the samples in the last panic_window  (6 s)
//! ready'  = max(1, ready)
//! up      = ceil(max_scale_up_rate · ready')          (at most, per decision)
//! down    = floor(ready' / max_scale_down_rate)        (at least; 0 when none ready)
//! dspc    = clamp(ceil(stable / target), down, up)     desired, stable
//! dppc    = clamp(ceil(panic  / target), down, up)     desired, panic
//! panic mode starts (or is extended) when panic / target / ready' >= 2,
//!   ends one stable window after it was last extended;
//!   in it, desired = the most dppc seen since it started (never down)
//! otherwise desired = dspc
//! desired = max over the last scale_down_delay of desired   (slow down)
//! 0 only when min is 0, the stable mean is 0 (a quiet window) and has
//!   been for scale_to_zero_grace; then clamp to [min, max]
//! ```
//!
//! The decision is a count of replicas, not a step: replicas still
//! starting (a cold start: weights loading, warm-up) are part of what the
//! controller already has, so a slow start does not make the autoscaler
//! ask again; while they start, `ready` lags and panic mode's no-scale-down
//! rule holds the count until the stable window has seen them serve.

use std::collections::VecDeque;
use std::time::Duration;

use crate::spec::ModelDeployment;

/// The rules' settings (a deployment's `autoscaling` and `replicas`).
#[derive(Clone, Debug, PartialEq)]
pub struct KpaSpec {
    pub target: f64,
    pub stable_window: Duration,
    pub panic_window: Duration,
    /// Panic when the panic window asks for this many times the ready
    /// replicas (Knative: 200%).
    pub panic_threshold: f64,
    pub max_scale_up_rate: f64,
    pub max_scale_down_rate: f64,
    pub scale_down_delay: Duration,
    pub scale_to_zero_grace: Duration,
    pub min: u32,
    pub max: u32,
}

impl KpaSpec {
    pub fn of(d: &ModelDeployment) -> KpaSpec {
        let a = &d.autoscaling;
        KpaSpec {
            target: a.target,
            stable_window: a.stable_window.0,
            panic_window: a.panic_window.0,
            panic_threshold: 2.0,
            max_scale_up_rate: a.max_scale_up_rate,
            max_scale_down_rate: a.max_scale_down_rate,
            scale_down_delay: a.scale_down_delay.0,
            scale_to_zero_grace: a.scale_to_zero_grace.0,
            min: d.replicas.min,
            max: d.replicas.max,
        }
    }
}

/// One decision and what it was made from (for `/metrics` and the
/// timeline).
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    pub desired: u32,
    pub stable_value: f64,
    pub panic_value: f64,
    pub stable_desired: u32,
    pub panic_desired: u32,
    pub panicking: bool,
}

#[derive(Debug)]
pub struct Kpa {
    spec: KpaSpec,
    /// (time, metric summed over the ready replicas), oldest first.
    samples: VecDeque<(Duration, f64)>,
    /// When panic mode was last started or extended.
    panic_since: Option<Duration>,
    max_panic_pods: u32,
    /// Recent desired counts, for the scale-down delay.
    recent: VecDeque<(Duration, u32)>,
    /// Since when the stable window has been quiet.
    quiet_since: Option<Duration>,
}

fn ceil_pods(value: f64, target: f64) -> u32 {
    let n = (value / target).ceil();
    if n.is_finite() && n > 0.0 {
        n.min(u32::MAX as f64) as u32
    } else {
        0
    }
}

impl Kpa {
    pub fn new(spec: KpaSpec) -> Kpa {
        Kpa {
            spec,
            samples: VecDeque::new(),
            panic_since: None,
            max_panic_pods: 0,
            recent: VecDeque::new(),
            quiet_since: None,
        }
    }

    pub fn spec(&self) -> &KpaSpec {
        &self.spec
    }

    /// The metric at `now`, summed over the ready replicas.
    pub fn record(&mut self, now: Duration, value: f64) {
        let v = if value.is_finite() {
            value.max(0.0)
        } else {
            0.0
        };
        self.samples.push_back((now, v));
        while let Some(&(t, _)) = self.samples.front() {
            if now.saturating_sub(t) >= self.spec.stable_window {
                self.samples.pop_front();
            } else {
                break;
            }
        }
    }

    /// Mean of the samples newer than `window` before `now`.
    fn mean(&self, now: Duration, window: Duration) -> Option<f64> {
        let (mut sum, mut n) = (0.0, 0usize);
        for &(t, v) in self.samples.iter().rev() {
            if now.saturating_sub(t) >= window {
                break;
            }
            sum += v;
            n += 1;
        }
        (n > 0).then(|| sum / n as f64)
    }

    /// The replica count to run, given `ready` replicas serving now.
    /// None: no sample in the stable window (keep what runs).
    pub fn decide(&mut self, now: Duration, ready: u32) -> Option<Decision> {
        let s = self.spec.clone();
        let stable = self.mean(now, s.stable_window)?;
        let panic = self.mean(now, s.panic_window).unwrap_or(0.0);
        let ready_f = ready.max(1) as f64;
        let up = (s.max_scale_up_rate * ready_f).ceil().min(u32::MAX as f64) as u32;
        let down = match ready {
            0 => 0,
            _ => (ready_f / s.max_scale_down_rate).floor() as u32,
        };
        let dspc = ceil_pods(stable, s.target).clamp(down, up.max(down));
        let dppc = ceil_pods(panic, s.target).clamp(down, up.max(down));
        let over = panic / s.target / ready_f >= s.panic_threshold;
        match self.panic_since {
            _ if over => self.panic_since = Some(now),
            Some(p) if now >= p + s.stable_window => {
                self.panic_since = None;
                self.max_panic_pods = 0;
            }
            _ => {}
        }
        let mut desired = match self.panic_since {
            Some(_) => {
                self.max_panic_pods = self.max_panic_pods.max(dppc);
                self.max_panic_pods
            }
            None => dspc,
        };
        if !s.scale_down_delay.is_zero() {
            self.recent.push_back((now, desired));
            while let Some(&(t, _)) = self.recent.front() {
                if now.saturating_sub(t) >= s.scale_down_delay {
                    self.recent.pop_front();
                } else {
                    break;
                }
            }
            desired = self.recent.iter().map(|r| r.1).max().unwrap_or(desired);
        }
        if desired == 0 {
            let since = *self.quiet_since.get_or_insert(now);
            let grace_over = now.saturating_sub(since) >= s.scale_to_zero_grace;
            if !grace_over && ready > 0 {
                // Keep one until the grace period has passed (none running:
                // nothing to keep).
                desired = 1;
            }
        } else {
            self.quiet_since = None;
        }
        Some(Decision {
            desired: desired.clamp(s.min, s.max),
            stable_value: stable,
            panic_value: panic,
            stable_desired: dspc,
            panic_desired: dppc,
            panicking: self.panic_since.is_some(),
        })
    }
}

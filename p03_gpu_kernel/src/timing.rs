//! Timing work on a GPU: why and how.
//!
//! A launch returns before the kernel runs, so `Instant` around a launch
//! measures the launch, not the kernel. Two honest ways:
//! - **CUDA events** recorded on the stream before and after the work: the
//!   GPU stamps them as it reaches them, so their difference is the device
//!   time of what ran between ("kernel-only").
//! - **Host time around work plus a synchronise**: what a caller waits for,
//!   copies and launch overhead included ("end to end").
//!
//! Both start after warm-up calls (the first launch of a module pays for
//! loading it; the first touch of memory pays for mapping it).

use cudarc::driver::sys::CUevent_flags;

use crate::error::GpuError;
use crate::gpu::Gpu;

/// Per-call device times in milliseconds: `warmup` untimed calls of `work`,
/// then `reps` calls each between its own pair of timing events.
pub fn time_events(
    gpu: &Gpu,
    warmup: usize,
    reps: usize,
    mut work: impl FnMut() -> Result<(), GpuError>,
) -> Result<Vec<f64>, GpuError> {
    for _ in 0..warmup {
        work()?;
    }
    gpu.sync()?;
    let ctx = gpu.context();
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let mut pairs = Vec::with_capacity(reps);
    for _ in 0..reps {
        let start = ctx.new_event(flags)?;
        let end = ctx.new_event(flags)?;
        start.record(gpu.stream())?;
        work()?;
        end.record(gpu.stream())?;
        pairs.push((start, end));
    }
    gpu.sync()?;
    pairs
        .iter()
        .map(|(s, e)| Ok(f64::from(s.elapsed_ms(e)?)))
        .collect()
}

/// Per-call host times in milliseconds of `work` followed by a synchronise.
pub fn time_host(
    gpu: &Gpu,
    warmup: usize,
    reps: usize,
    mut work: impl FnMut() -> Result<(), GpuError>,
) -> Result<Vec<f64>, GpuError> {
    for _ in 0..warmup {
        work()?;
    }
    gpu.sync()?;
    let mut out = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = std::time::Instant::now();
        work()?;
        gpu.sync()?;
        out.push(t.elapsed().as_secs_f64() * 1e3);
    }
    Ok(out)
}

/// Enough repetitions to fill about `budget_ms` given one call's estimate,
/// between `lo` and `hi`.
pub fn reps_for(one_ms: f64, budget_ms: f64, lo: usize, hi: usize) -> usize {
    if one_ms.is_nan() || one_ms <= 0.0 {
        return hi;
    }
    ((budget_ms / one_ms) as usize).clamp(lo, hi)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repetitions_fill_the_budget_within_bounds() {
        assert_eq!(reps_for(1.0, 100.0, 5, 50), 50);
        assert_eq!(reps_for(10.0, 100.0, 5, 50), 10);
        assert_eq!(reps_for(100.0, 100.0, 5, 50), 5);
        assert_eq!(reps_for(0.0, 100.0, 5, 50), 50);
        assert_eq!(reps_for(f64::NAN, 100.0, 5, 50), 50);
    }
}

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
/// then `reps` calls each between its own pair of timing events (created
/// before the first is recorded, so no event creation sits between them).
///
/// Right for work that keeps the GPU busy longer than the host takes to
/// queue the next call (about 10 µs); shorter work lets the queue drain,
/// and the gap is timed with it: use [`time_batched`] or [`time_auto`].
pub fn time_events(
    gpu: &Gpu,
    warmup: usize,
    reps: usize,
    work: impl FnMut() -> Result<(), GpuError>,
) -> Result<Vec<f64>, GpuError> {
    time_batched(gpu, warmup, reps, 1, work)
}

/// Per-call device times in milliseconds of `batch` calls back to back
/// between one pair of events, `reps` times: the queue stays ahead of the
/// GPU, so the time is the work's, not the host's.
pub fn time_batched(
    gpu: &Gpu,
    warmup: usize,
    reps: usize,
    batch: usize,
    mut work: impl FnMut() -> Result<(), GpuError>,
) -> Result<Vec<f64>, GpuError> {
    let batch = batch.max(1);
    for _ in 0..warmup {
        work()?;
    }
    gpu.sync()?;
    let ctx = gpu.context();
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let mut pairs = Vec::with_capacity(reps);
    for _ in 0..reps {
        pairs.push((ctx.new_event(flags)?, ctx.new_event(flags)?));
    }
    for (start, end) in &pairs {
        start.record(gpu.stream())?;
        for _ in 0..batch {
            work()?;
        }
        end.record(gpu.stream())?;
    }
    gpu.sync()?;
    pairs
        .iter()
        .map(|(s, e)| Ok(f64::from(s.elapsed_ms(e)?) / batch as f64))
        .collect()
}

/// Time `work` within about `budget_ms` of device time: one probe call
/// sets a batch of at least [`MIN_BATCH_MS`] of work between events and
/// the repetitions (5 to 30); per-call milliseconds.
pub fn time_auto(
    gpu: &Gpu,
    budget_ms: f64,
    mut work: impl FnMut() -> Result<(), GpuError>,
) -> Result<Vec<f64>, GpuError> {
    let probe = time_batched(gpu, 1, 1, 1, &mut work)?[0];
    let batch = if probe > 0.0 {
        ((MIN_BATCH_MS / probe).ceil() as usize).clamp(1, 1000)
    } else {
        1000
    };
    let reps = reps_for(probe * batch as f64, budget_ms, 5, 30);
    time_batched(gpu, 1, reps, batch, work)
}

/// The least device time between a pair of events in [`time_auto`].
pub const MIN_BATCH_MS: f64 = 1.0;

/// Bring the clocks up before measuring: an idle GPU sits far below its top clock and
/// takes a moment of load to reach its 1,980 MHz. `work` (a heavy kernel)
/// runs until `seconds` of host time have passed.
pub fn warm_clocks(
    gpu: &Gpu,
    seconds: f64,
    mut work: impl FnMut() -> Result<(), GpuError>,
) -> Result<(), GpuError> {
    let t = std::time::Instant::now();
    while t.elapsed().as_secs_f64() < seconds {
        for _ in 0..10 {
            work()?;
        }
        gpu.sync()?;
    }
    Ok(())
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

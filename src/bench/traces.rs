//! The trace runs: every (allocator, trace) as an observed pass on one fresh allocator and the
//! timed passes on another, written as a [`TraceRun`] and printed as one line.

use std::path::Path;
use std::sync::Arc;

use cachalot::cuda::CudaBackend;
use cachalot::cuda::cudarc::driver::CudaContext;
use cachalot::{Backend, Settings};

use super::allocators::{BenchTarget, SIM_CAPACITY, cuda_cachalot, sim_cachalot};
use super::baselines::{MallocTarget, PoolTarget};
use super::error::{Failure, fail, run_err};
use super::interpret::{observed_pass, timed_passes};
use super::options::Options;
use super::record::{RunFile, TraceRun, downsample};
use crate::ops::OpsProgram;

/// A trace to run: its program and its name (the file's stem, which names its results).
#[derive(Debug, Clone)]
pub struct Workload {
    /// The trace's name.
    pub name: String,
    /// Its program.
    pub program: OpsProgram,
}

impl Workload {
    /// Reads and parses an ops file; the trace's name is the file's stem.
    pub fn read(path: &Path) -> Result<Workload, Failure> {
        let program = OpsProgram::read(path).map_err(|e| Failure::Input(e.to_string()))?;
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .map(|n| n.strip_suffix(".ops").unwrap_or(n))
            .filter(|n| !n.is_empty())
            .ok_or_else(|| Failure::Input(format!("{}: no usable file name", path.display())))?;
        Ok(Workload {
            name: name.to_string(),
            program,
        })
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / (1u64 << 20) as f64)
}

/// Runs one (allocator, trace): the observed pass on one fresh target, the timed passes on
/// another; writes the result and prints its line.
fn run_trace<T: BenchTarget>(
    o: &Options,
    key: &str,
    w: &Workload,
    lines: usize,
    notes: String,
    make: &mut dyn FnMut() -> Result<T, Failure>,
) -> Result<TraceRun, Failure> {
    let program = &w.program;
    let observed = {
        let mut target = make()?;
        observed_pass(&mut target, program, lines)?
    };
    let timed = {
        let mut target = make()?;
        timed_passes(&mut target, program, lines, o.passes as usize)?
    };
    let (driver_calls, detail) = match observed.driver_calls {
        Some((n, d)) => (Some(n), Some(d)),
        None => (None, None),
    };
    let run = TraceRun {
        allocator: key.into(),
        trace: w.name.clone(),
        lines: lines as u64,
        total_lines: program.trace.len() as u64,
        allocs: observed.allocs,
        ooms: observed.ooms,
        peak_requested: observed.peak_requested,
        peak_reserved: observed.peak_reserved,
        peak_allocated: observed.peak_allocated,
        ratio: (observed.peak_requested > 0)
            .then(|| observed.peak_reserved as f64 / observed.peak_requested as f64),
        driver_calls,
        driver_calls_detail: detail,
        driver_calls_steady: timed.steady_calls,
        reserved_changes: Some(observed.reserved_changes),
        cache_hits: Some(observed.cache_hits),
        hit_rate: (observed.allocs > 0)
            .then(|| observed.cache_hits as f64 / observed.allocs as f64),
        passes: o.passes,
        ns_per_op_first: Some(timed.first_ns),
        ns_per_op_steady: timed.steady_ns,
        steady_passes_driver_calls: timed.passes_calls.clone(),
        steady_passes_ns_per_op: (!timed.passes_ns.is_empty()).then(|| timed.passes_ns.clone()),
        timeline: Some(downsample(&observed.timeline)),
        notes: Some(notes),
        error: None,
    };
    RunFile::trace(&run)
        .write(&o.out, &format!("{key}__{}.json", w.name))
        .map_err(run_err)?;
    println!(
        "{:<22} {:<20} {:>10} {:>7} {:>8} {:>7} {:>9} {:>9}{}",
        w.name,
        key,
        mib(run.peak_reserved),
        run.ratio.map_or("-".into(), |r| format!("{r:.3}")),
        run.driver_calls.map_or("-".into(), |n| n.to_string()),
        run.hit_rate
            .map_or("-".into(), |h| format!("{:.1}%", h * 100.0)),
        format!("{:.0}", timed.first_ns),
        timed.steady_ns.map_or("-".into(), |s| format!("{s:.0}")),
        if run.ooms > 0 {
            format!("  ({} ooms)", run.ooms)
        } else {
            String::new()
        },
    );
    Ok(run)
}

/// Runs every allocator of `o.only` on every trace: on the GPU (`ctx`), or cachalot's three on
/// the simulated device.
pub fn run_traces(
    o: &Options,
    workloads: &[Workload],
    ctx: Option<&Arc<CudaContext>>,
) -> Result<(), Failure> {
    println!(
        "{:<22} {:<20} {:>10} {:>7} {:>8} {:>7} {:>9} {:>9}",
        "trace", "allocator", "peak MiB", "ratio", "drv calls", "hits", "ns first", "ns steady"
    );
    for w in workloads {
        let program = &w.program;
        for &key in &o.only.0 {
            let full = program.trace.len();
            match (key, ctx) {
                (_, None) if o.cachalot_settings(key).is_some() => {
                    let settings = o.cachalot_settings(key).unwrap_or_else(Settings::pytorch);
                    let mut notes =
                        format!("simulated device ({} GiB), not a GPU", SIM_CAPACITY >> 30);
                    if let (Some(conf), "cachalot") = (&o.cachalot_config, key) {
                        notes.push_str(&format!("; --cachalot-config {conf}"));
                    }
                    run_trace(o, key, w, full, notes, &mut || {
                        sim_cachalot(settings.clone(), program)
                    })?;
                }
                (_, None) => {}
                (_, Some(ctx)) if o.cachalot_settings(key).is_some() => {
                    let settings = o.cachalot_settings(key).unwrap_or_else(Settings::pytorch);
                    let mut notes = String::new();
                    if settings == Settings::cachalot() {
                        let probe = CudaBackend::new(Arc::clone(ctx))
                            .map_err(|e| fail("the CUDA backend", e))?;
                        if !probe.virtual_memory() {
                            notes = "no virtual memory on this GPU: segments instead of \
                                     expandable segments"
                                .into();
                        }
                    }
                    if let (Some(conf), "cachalot") = (&o.cachalot_config, key) {
                        notes.push_str(&format!("--cachalot-config {conf}"));
                    }
                    run_trace(o, key, w, full, notes, &mut || {
                        cuda_cachalot(ctx, settings.clone(), program)
                    })?;
                }
                ("cuda-pool", Some(ctx)) => {
                    run_trace(o, key, w, full, String::new(), &mut || {
                        PoolTarget::new(ctx, program)
                    })?;
                }
                (_, Some(ctx)) => {
                    let lines = full.min(o.malloc_prefix as usize);
                    let notes = if lines < full {
                        format!(
                            "cuMemAlloc on a prefix: the first {lines} of {full} lines after `s` \
                             (--malloc-prefix); handles still live after it are freed untimed"
                        )
                    } else {
                        String::new()
                    };
                    run_trace(o, key, w, lines, notes, &mut || MallocTarget::new(ctx))?;
                }
            }
        }
    }
    Ok(())
}

//! `cachalot._native`: the native half of the `cachalot` Python package.
//!
//! One shared library is three things at once:
//!
//! - the Python extension module `cachalot._native` (pyo3, abi3: one build for every CPython
//!   from 3.9), whose functions `cachalot.torch` wraps: configuration, statistics, snapshots,
//!   `empty_cache`, the memory history, a device-memory sampler, and the `cachalot` command line;
//! - PyTorch's pluggable allocator: the C functions of [`ffi`] (`cachalot_torch_alloc`,
//!   `cachalot_torch_free`, and the hooks), which `torch.cuda.memory.CUDAPluggableAllocator`
//!   loads from this very file, so that PyTorch's allocations and Python's questions reach the
//!   same allocators ([`plugin`]);
//! - the `cachalot` program: [`cli`] runs `cachalot_tools::run_cli`.
//!
//! Why pyo3 and not a plain C ABI for the Python side: typed Python exceptions, bytes and
//! strings without hand-written marshalling, the interpreter lock released around long calls,
//! and a wheel maturin builds without Python headers; the C functions PyTorch needs are
//! exported from the same library anyway.

pub mod ffi;
pub mod plugin;
pub mod sampler;

use std::time::Duration;

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use cachalot::HistoryOptions;
use cachalot::Stats;
use cachalot::snapshot::{DeviceTrace, Snapshot, StackId};

use plugin::{ConfigError, plugin};

fn runtime(e: impl std::fmt::Display) -> PyErr {
    PyRuntimeError::new_err(e.to_string())
}

/// Sets the settings the plug-in's allocators are made with: `config` in
/// `PYTORCH_CUDA_ALLOC_CONF` syntax over cachalot's defaults, or over PyTorch's when `pytorch`
/// is true (as `cachalot replay --config C [--pytorch]`). Returns the settings, described.
/// Raises ValueError for a string that does not parse and RuntimeError once allocators exist
/// with other settings.
#[pyfunction]
#[pyo3(signature = (config, pytorch=false))]
fn configure(config: &str, pytorch: bool) -> PyResult<String> {
    plugin().configure(config, pytorch).map_err(|e| match e {
        ConfigError::Parse(_) => PyValueError::new_err(e.to_string()),
        ConfigError::Started { .. } => runtime(e),
    })
}

/// The settings in force (or that will be at the first allocation): `(described, config
/// string, over PyTorch's defaults)`.
#[pyfunction]
fn settings() -> PyResult<(String, String, bool)> {
    plugin()
        .settings()
        .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// The number of CUDA devices; RuntimeError without a usable CUDA driver (never a crash).
#[pyfunction]
fn device_count() -> PyResult<usize> {
    cachalot::cuda::device_count().map_err(runtime)
}

/// The devices whose allocator exists (those that served an allocation or a setting).
#[pyfunction]
fn devices() -> Vec<usize> {
    plugin().devices().map(|(i, _)| i).collect()
}

/// The addresses of the C entry points, by the name of the `CUDAPluggableAllocator` setter
/// that takes each (`alloc` and `free` for the allocator itself).
#[pyfunction]
fn entry_points<'py>(py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (name, address) in ffi::entry_points() {
        d.set_item(name, address)?;
    }
    Ok(d)
}

/// The statistics of `device` as JSON, PyTorch's `memory_stats()` names nested as
/// `memory_stats_as_nested_dict()` nests them (`{"allocated_bytes": {"all": {"current": ..}}}`),
/// with `max_split_size` (-1: unlimited). A device that served nothing has all zeros.
#[pyfunction]
fn stats_json(device: usize) -> PyResult<String> {
    let p = plugin();
    let (stats, max_split) = match p.devices().find(|(i, _)| *i == device) {
        Some((_, d)) => (d.alloc.stats(), d.alloc.settings().max_split_size),
        None => {
            let (settings, ..) = p.current_settings().map_err(runtime)?;
            (Stats::default(), settings.max_split_size)
        }
    };
    let mut value = serde_json::to_value(&stats).map_err(runtime)?;
    value["max_split_size"] = if max_split == u64::MAX {
        serde_json::json!(-1)
    } else {
        serde_json::json!(max_split)
    };
    serde_json::to_string(&value).map_err(runtime)
}

/// `torch.cuda.memory_summary()`'s table for `device`.
#[pyfunction]
fn memory_summary(device: usize) -> String {
    let (stats, segments) = plugin()
        .devices()
        .find(|(i, _)| *i == device)
        .map(|(_, d)| (d.alloc.stats(), d.alloc.segments()))
        .unwrap_or_default();
    cachalot::cuda::memory_summary(&stats, &segments, device)
}

/// Sets every peak statistic of `device` to its current value.
#[pyfunction]
fn reset_peak_stats(device: usize) {
    if let Some((_, d)) = plugin().devices().find(|(i, _)| *i == device) {
        d.alloc.reset_peak_stats();
    }
}

/// Returns the calling thread's kept blocks (rule 17's thread cache) on every device to the
/// shared pools, so that the statistics count only the program's tensors.
#[pyfunction]
fn flush_thread_cache() {
    for (_, d) in plugin().devices() {
        d.alloc.flush_thread_cache();
    }
}

/// Gives every device's cached memory that holds no tensor back to the driver.
#[pyfunction]
fn empty_cache(py: Python<'_>) -> PyResult<()> {
    py.detach(|| plugin().empty_cache()).map_err(runtime)
}

/// Caps `device`'s reserved memory at `fraction` of its capacity (makes the device's allocator
/// if it has none yet).
#[pyfunction]
fn set_memory_fraction(fraction: f64, device: i32) -> PyResult<()> {
    let d = plugin().device(device).map_err(runtime)?;
    let _keep = cachalot::cuda::CurrentContext::save().map_err(runtime)?;
    d.alloc.set_memory_fraction(fraction).map_err(|e| {
        if fraction.is_finite() && (0.0..=1.0).contains(&fraction) {
            runtime(e)
        } else {
            PyValueError::new_err(e.to_string())
        }
    })
}

/// Starts (or resizes) the memory history on every device, keeping the last `max_entries`
/// entries; `None` or 0 stops and drops it. `backtraces` records a Rust backtrace with each
/// entry (slow; PyTorch's Python stacks are not visible from the allocator).
#[pyfunction]
#[pyo3(signature = (max_entries, backtraces=false))]
fn record_history(max_entries: Option<usize>, backtraces: bool) {
    let options = max_entries
        .filter(|&n| n > 0)
        .map(|n| HistoryOptions::new(n).with_backtraces(backtraces));
    plugin().record_history(options);
}

/// The snapshot of `device` (every device when `None`) in PyTorch's pickle format, as
/// `torch.cuda.memory._dump_snapshot` writes it.
#[pyfunction]
#[pyo3(signature = (device=None))]
fn snapshot<'py>(py: Python<'py>, device: Option<usize>) -> PyResult<Bound<'py, PyBytes>> {
    let snap = merged_snapshot(device)?;
    let mut bytes = Vec::new();
    cachalot::snapshot::write_snapshot(&snap, &mut bytes).map_err(runtime)?;
    Ok(PyBytes::new(py, &bytes))
}

/// The snapshots of the chosen devices as one: segments of all, one trace per device, the
/// stacks of each re-numbered into one frame table.
fn merged_snapshot(device: Option<usize>) -> PyResult<Snapshot> {
    let p = plugin();
    let (settings, ..) = p.current_settings().map_err(runtime)?;
    let mut out = Snapshot {
        allocator_settings: Some(cachalot::snapshot::allocator_settings(&settings)),
        ..Snapshot::default()
    };
    for (i, d) in p
        .devices()
        .filter(|(i, _)| device.is_none_or(|want| want == *i))
    {
        let snap = d.alloc.snapshot();
        let frames = &snap.frames;
        let remap = |id: StackId, into: &mut cachalot::snapshot::FrameTable| {
            if id == StackId::EMPTY {
                id
            } else {
                into.intern_stack(frames.stack(id).cloned().collect::<Vec<_>>())
            }
        };
        for mut seg in snap.segments.clone() {
            seg.stack = remap(seg.stack, &mut out.frames);
            for b in &mut seg.blocks {
                b.stack = remap(b.stack, &mut out.frames);
            }
            out.segments.push(seg);
        }
        while out.traces.len() <= i {
            let n = out.traces.len();
            out.traces.push(DeviceTrace {
                device: n,
                entries: Vec::new(),
            });
        }
        for t in &snap.traces {
            for e in &t.entries {
                let mut e = e.clone();
                e.stack = remap(e.stack, &mut out.frames);
                out.traces[i].entries.push(e);
            }
        }
    }
    Ok(out)
}

/// Marks the live allocation at `ptr` as used on the stream whose `cudaStream_t` is `stream`
/// (what `tensor.record_stream(s)` asks): after its free, the block is not reused until the
/// work queued on the stream by then has completed. RuntimeError for a pointer that is not a
/// live allocation start of any device's allocator.
#[pyfunction]
fn record_stream(ptr: usize, stream: usize) -> PyResult<()> {
    ffi::record_stream_from_python(ptr, stream).map_err(runtime)
}

/// How often PyTorch called each hook since the process started: `{"record_stream": n,
/// "empty_cache": n, "memory_fraction": n}` (whether PyTorch reaches them at all).
#[pyfunction]
fn hook_calls<'py>(py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (name, n) in ffi::hook_calls() {
        d.set_item(name, n)?;
    }
    Ok(d)
}

/// How many frees PyTorch asked for failed (a free cannot raise; the first few are printed).
#[pyfunction]
fn free_errors() -> u64 {
    ffi::free_errors()
}

/// Runs the `cachalot` command line on `argv` (the program's name first) and returns its exit
/// code; the interpreter lock is released meanwhile.
#[pyfunction]
fn cli(py: Python<'_>, argv: Vec<String>) -> u8 {
    py.detach(|| cachalot_tools::run_cli(argv))
}

/// A thread that reads the device's memory in use (`cuMemGetInfo`, what
/// `torch.cuda.mem_get_info()` reads) every `interval_us` microseconds without the
/// interpreter lock, and keeps the highest reading: the device's own peak, whichever
/// allocator serves the job.
#[pyclass(module = "cachalot._native")]
struct MemorySampler {
    inner: std::sync::Mutex<Option<sampler::Sampler>>,
}

#[pymethods]
impl MemorySampler {
    /// Starts sampling device `device`; RuntimeError when it cannot be opened.
    #[new]
    #[pyo3(signature = (device=0, interval_us=200))]
    fn new(py: Python<'_>, device: usize, interval_us: u64) -> PyResult<Self> {
        let s = py
            .detach(|| sampler::Sampler::start(device, Duration::from_micros(interval_us.max(1))))
            .map_err(runtime)?;
        Ok(MemorySampler {
            inner: std::sync::Mutex::new(Some(s)),
        })
    }

    /// Stops sampling and returns `{"peak_used", "min_used", "last_used", "total", "samples",
    /// "seconds"}` (bytes, a count, seconds).
    fn stop<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let taken = self
            .inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        let Some(mut s) = taken else {
            return Err(runtime("the sampler was stopped already"));
        };
        let r = py.detach(move || s.stop()).map_err(runtime)?;
        let d = PyDict::new(py);
        d.set_item("peak_used", r.peak_used)?;
        d.set_item("min_used", r.min_used)?;
        d.set_item("last_used", r.last_used)?;
        d.set_item("total", r.total)?;
        d.set_item("samples", r.samples)?;
        d.set_item("seconds", r.seconds)?;
        Ok(d)
    }
}

/// The module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("ALLOC_CONF_ENV", plugin::ALLOC_CONF_ENV)?;
    m.add_function(wrap_pyfunction!(configure, m)?)?;
    m.add_function(wrap_pyfunction!(settings, m)?)?;
    m.add_function(wrap_pyfunction!(device_count, m)?)?;
    m.add_function(wrap_pyfunction!(devices, m)?)?;
    m.add_function(wrap_pyfunction!(entry_points, m)?)?;
    m.add_function(wrap_pyfunction!(stats_json, m)?)?;
    m.add_function(wrap_pyfunction!(memory_summary, m)?)?;
    m.add_function(wrap_pyfunction!(reset_peak_stats, m)?)?;
    m.add_function(wrap_pyfunction!(flush_thread_cache, m)?)?;
    m.add_function(wrap_pyfunction!(empty_cache, m)?)?;
    m.add_function(wrap_pyfunction!(set_memory_fraction, m)?)?;
    m.add_function(wrap_pyfunction!(record_history, m)?)?;
    m.add_function(wrap_pyfunction!(snapshot, m)?)?;
    m.add_function(wrap_pyfunction!(record_stream, m)?)?;
    m.add_function(wrap_pyfunction!(free_errors, m)?)?;
    m.add_function(wrap_pyfunction!(hook_calls, m)?)?;
    m.add_function(wrap_pyfunction!(cli, m)?)?;
    m.add_class::<MemorySampler>()?;
    Ok(())
}

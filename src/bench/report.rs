//! `cachalot bench-report`'s reading: the run files of one benchmark run (`OUT/runs/*.json`,
//! [`super::record`]), its `machine.json` and its ops files, gathered into [`Results`] in
//! table order.
//!
//! The one rule: the report computes nothing about an allocator that its run did not measure.
//! A figure a run lacks (an allocator that does not count driver calls, a failed run) is shown
//! as missing, never filled in.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::record::{HotLoop, SCHEMA, TraceRun};
use crate::ops::{OpsError, OpsProgram};

/// The allocators in the order the tables show them, with their column labels.
pub const ALLOCATORS: [(&str, &str); 7] = [
    ("pytorch", "PyTorch"),
    ("pytorch-expandable", "PyTorch expandable"),
    ("cuda-pool", "CUDA pool"),
    ("cumemalloc", "cuMemAlloc"),
    ("cachalot-pytorch", "cachalot, PyTorch's policy"),
    ("cachalot-expandable", "cachalot, expandable"),
    ("cachalot", "cachalot's policy"),
];

/// The allocators whose peak reserved memory is compared over the whole trace (not
/// `cumemalloc`, which runs a prefix only).
pub const WHOLE_TRACE: [&str; 6] = [
    "pytorch",
    "pytorch-expandable",
    "cuda-pool",
    "cachalot-pytorch",
    "cachalot-expandable",
    "cachalot",
];

/// A reading or format failure, naming the file.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A file or directory could not be read or written.
    #[error("{path}: {message}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// A run file is not a `cachalot gpu-bench v1` object.
    #[error("{path}: not a `cachalot gpu-bench v1` run: {message}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// An ops file beside the runs (`ops/TRACE.ops`) is not a `cachalot ops v1` program.
    #[error(transparent)]
    Ops(#[from] OpsError),
    /// The directory holds no runs.
    #[error("{0}: no run files (runs/*.json)")]
    Empty(PathBuf),
}

/// Everything one benchmark run produced.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Results {
    /// `machine.json` as written on the GPU machine (null when absent).
    pub machine: serde_json::Value,
    /// Trace runs, sorted by trace then allocator order.
    pub traces: Vec<TraceRun>,
    /// Hot loops.
    pub hot: Vec<HotLoop>,
    /// Per trace, from its ops file (`DIR/ops/TRACE.ops`) where present: the most bytes in
    /// use at once, live allocations and held-back frees (until their side stream completes)
    /// together — the least any allocator must hold.
    pub in_use: BTreeMap<String, u64>,
    /// The trace runs of further repetitions (`DIR/repeats/NAME/runs/*.json`, one folder per
    /// repetition, as `scripts/gpu_bench.sh` writes them with `REPEATS`), in folder order:
    /// only the steady-speed target reads them, as the median of paired ratios (one run
    /// cannot judge 1.2×: docs/GPU_BENCH.md). Not in the tables, nor in results.json.
    #[serde(skip)]
    pub repeats: Vec<Vec<TraceRun>>,
}

fn io(path: &Path, e: impl std::fmt::Display) -> BenchError {
    BenchError::Io {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

/// Where `key` sorts among the allocators (unknown keys last, by name).
pub fn allocator_rank(key: &str) -> usize {
    ALLOCATORS
        .iter()
        .position(|(k, _)| *k == key)
        .unwrap_or(ALLOCATORS.len())
}

/// The column label of allocator `key`.
pub fn allocator_label(key: &str) -> String {
    ALLOCATORS
        .iter()
        .find(|(k, _)| *k == key)
        .map_or_else(|| key.to_string(), |(_, l)| (*l).to_string())
}

/// The run files in `runs` (a `runs/` folder): trace runs and hot loops, in file-name order.
fn read_runs(runs: &Path) -> Result<(Vec<TraceRun>, Vec<HotLoop>), BenchError> {
    let entries = std::fs::read_dir(runs).map_err(|e| io(runs, e))?;
    let mut paths: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    paths.sort();
    let (mut traces, mut hots) = (Vec::new(), Vec::new());
    for path in paths {
        let text = std::fs::read_to_string(&path).map_err(|e| io(&path, e))?;
        let value: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| BenchError::Format {
                path: path.clone(),
                message: e.to_string(),
            })?;
        let format = |message: &str| BenchError::Format {
            path: path.clone(),
            message: message.to_string(),
        };
        if value.get("schema").and_then(|s| s.as_str()) != Some(SCHEMA) {
            return Err(format("its `schema` is not \"cachalot gpu-bench v1\""));
        }
        if value
            .get("allocator")
            .and_then(|s| s.as_str())
            .is_none_or(str::is_empty)
        {
            return Err(format("it names no `allocator`"));
        }
        match value.get("kind").and_then(|k| k.as_str()) {
            Some("trace") => {
                let run: TraceRun =
                    serde_json::from_value(value).map_err(|e| format(&e.to_string()))?;
                if run.trace.is_empty() {
                    return Err(format("a trace run without a `trace`"));
                }
                traces.push(run);
            }
            Some("hot_loop") => {
                let hot: HotLoop =
                    serde_json::from_value(value).map_err(|e| format(&e.to_string()))?;
                let n = hot.threads.len();
                if hot.error.is_none()
                    && (hot.wall_ns_per_pair.len() != n || hot.pairs_per_thread.len() != n)
                {
                    return Err(format(
                        "`threads`, `pairs_per_thread` and `wall_ns_per_pair` differ in length",
                    ));
                }
                hots.push(hot);
            }
            _ => return Err(format("its `kind` is neither \"trace\" nor \"hot_loop\"")),
        }
    }
    Ok((traces, hots))
}

/// Reads `dir/runs/*.json`, `dir/machine.json` and the repetitions in `dir/repeats/`.
pub fn load(dir: &Path) -> Result<Results, BenchError> {
    let (traces, hot) = read_runs(&dir.join("runs"))?;
    let mut results = Results {
        traces,
        hot,
        ..Results::default()
    };
    let repeats = dir.join("repeats");
    if repeats.is_dir() {
        let entries = std::fs::read_dir(&repeats).map_err(|e| io(&repeats, e))?;
        let mut folders: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.join("runs").is_dir())
            .collect();
        folders.sort();
        for folder in folders {
            results.repeats.push(read_runs(&folder.join("runs"))?.0);
        }
    }
    if results.traces.is_empty() && results.hot.is_empty() {
        return Err(BenchError::Empty(dir.to_path_buf()));
    }
    let machine = dir.join("machine.json");
    if machine.exists() {
        let text = std::fs::read_to_string(&machine).map_err(|e| io(&machine, e))?;
        results.machine = serde_json::from_str(&text).map_err(|e| BenchError::Format {
            path: machine.clone(),
            message: e.to_string(),
        })?;
    }
    for trace in results.trace_names() {
        let ops = dir.join("ops").join(format!("{trace}.ops"));
        if let Ok(text) = std::fs::read_to_string(&ops) {
            let program = OpsProgram::parse(&ops.display().to_string(), &text)?;
            results.in_use.insert(trace, program.peak_in_use());
        }
    }
    results.traces.sort_by(|a, b| {
        (
            trace_rank(&a.trace),
            allocator_rank(&a.allocator),
            &a.allocator,
        )
            .cmp(&(
                trace_rank(&b.trace),
                allocator_rank(&b.allocator),
                &b.allocator,
            ))
    });
    results.hot.sort_by(|a, b| {
        (allocator_rank(&a.allocator), &a.allocator, &a.path).cmp(&(
            allocator_rank(&b.allocator),
            &b.allocator,
            &b.path,
        ))
    });
    Ok(results)
}

/// The successful run of `allocator` on `trace` among `runs`.
fn find_run<'a>(runs: &'a [TraceRun], trace: &str, allocator: &str) -> Option<&'a TraceRun> {
    runs.iter()
        .find(|r| r.trace == trace && r.allocator == allocator && r.error.is_none())
}

/// Synthetic workloads after the recorded traces.
fn trace_rank(trace: &str) -> (bool, String) {
    (trace.starts_with("synthetic"), trace.to_string())
}

impl Results {
    /// The traces, in table order.
    pub fn trace_names(&self) -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        for r in &self.traces {
            if !names.contains(&r.trace) {
                names.push(r.trace.clone());
            }
        }
        names
    }

    /// The allocators that ran any trace, in table order.
    pub fn trace_allocators(&self) -> Vec<String> {
        let mut keys: Vec<String> = self.traces.iter().map(|r| r.allocator.clone()).collect();
        keys.sort_by_key(|k| (allocator_rank(k), k.clone()));
        keys.dedup();
        keys
    }

    /// The successful run of `allocator` on `trace`.
    pub fn run(&self, trace: &str, allocator: &str) -> Option<&TraceRun> {
        find_run(&self.traces, trace, allocator)
    }

    /// The successful runs of `allocator` on `trace` in the main run and in each repetition
    /// (`None` where that repetition lacks it), main run first.
    pub fn repeated_runs(&self, trace: &str, allocator: &str) -> Vec<Option<&TraceRun>> {
        std::iter::once(self.traces.as_slice())
            .chain(self.repeats.iter().map(Vec::as_slice))
            .map(|runs| find_run(runs, trace, allocator))
            .collect()
    }

    /// Peak reserved ÷ peak in use (live plus held-back frees, from the ops file) of
    /// `allocator` on `trace`; ÷ peak requested where the ops file is absent, and always for
    /// `cumemalloc`, which runs a prefix.
    pub fn memory_ratio(&self, trace: &str, allocator: &str) -> Option<f64> {
        let r = self.run(trace, allocator)?;
        match self.in_use.get(trace) {
            Some(&b) if allocator != "cumemalloc" && b > 0 => {
                Some(r.peak_reserved as f64 / b as f64)
            }
            _ => r.ratio,
        }
    }

    /// The successful hot loop of `allocator` through `path`.
    pub fn hot_loop(&self, allocator: &str, path: &str) -> Option<&HotLoop> {
        self.hot
            .iter()
            .find(|h| h.allocator == allocator && h.path == path && h.error.is_none())
    }
}

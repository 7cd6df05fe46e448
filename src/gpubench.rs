//! The side-by-side GPU benchmark's results (`docs/GPU_BENCH.md`): reading the per-run files
//! (`cachalot gpu-bench v1`) that `benches/gpu_compare.rs` and
//! `scripts/pytorch_bench.py` write, and turning them into one results file, a CSV, Markdown
//! tables and the targets, each met or missed by a stated margin.
//!
//! The one rule: the report computes nothing about an allocator that its run did not measure.
//! A figure a run lacks (an allocator that does not count driver calls, a failed run) is shown
//! as missing, never filled in.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::ops::{OpsError, OpsProgram};

/// The format name every run file carries.
pub const SCHEMA: &str = "cachalot gpu-bench v1";

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

/// The memory timeline of a run's observed pass, downsampled (each point its bucket's maximum).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Timeline {
    /// The first operation line of each bucket (0 = the first line after `s`).
    pub line: Vec<u64>,
    /// Live requested bytes.
    pub requested: Vec<u64>,
    /// Reserved bytes.
    pub reserved: Vec<u64>,
}

/// One allocator on one trace.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct TraceRun {
    /// The allocator's key ([`ALLOCATORS`]).
    pub allocator: String,
    /// The trace (the ops file's stem).
    pub trace: String,
    /// Operation lines run in each pass.
    pub lines: u64,
    /// Operation lines in the file.
    pub total_lines: u64,
    /// Allocations in one pass.
    pub allocs: u64,
    /// Failed allocations in the observed pass.
    pub ooms: u64,
    /// The most live requested bytes.
    pub peak_requested: u64,
    /// The most reserved bytes.
    pub peak_reserved: u64,
    /// The most allocated bytes, where the allocator tells.
    pub peak_allocated: Option<u64>,
    /// `peak_reserved / peak_requested`.
    pub ratio: Option<f64>,
    /// Memory calls to the driver, as the allocator counts them.
    pub driver_calls: Option<u64>,
    /// What `driver_calls` counts.
    pub driver_calls_detail: Option<String>,
    /// Driver calls per timed pass after the first (the steady state), where counted.
    pub driver_calls_steady: Option<f64>,
    /// Operation lines after which reserved memory differed from before.
    pub reserved_changes: Option<u64>,
    /// Allocations that neither grew reserved memory nor made a device allocation.
    pub cache_hits: Option<u64>,
    /// `cache_hits / allocs`.
    pub hit_rate: Option<f64>,
    /// Timed passes.
    pub passes: u64,
    /// ns per operation line, first pass.
    pub ns_per_op_first: Option<f64>,
    /// ns per operation line, mean of the later passes.
    pub ns_per_op_steady: Option<f64>,
    /// The observed pass's memory timeline.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeline: Option<Timeline>,
    /// What the reader must know about this run.
    pub notes: Option<String>,
    /// Why the run failed, if it did.
    pub error: Option<String>,
}

/// A hot loop of alloc+free pairs of one size at several thread counts.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct HotLoop {
    /// The allocator's key.
    pub allocator: String,
    /// Through what: `allocator`, `buffer` (cachalot) or `raw`.
    pub path: String,
    /// Bytes per allocation.
    pub size: u64,
    /// Thread counts.
    pub threads: Vec<u64>,
    /// Pairs each thread ran, per thread count.
    pub pairs_per_thread: Vec<u64>,
    /// Wall time over all threads' pairs, per thread count.
    pub wall_ns_per_pair: Vec<f64>,
    /// Wall time over one thread's pairs, per thread count.
    pub ns_per_pair_per_thread: Vec<f64>,
    /// Why the run failed, if it did.
    pub error: Option<String>,
}

impl HotLoop {
    /// Wall ns per pair at `threads` threads.
    pub fn wall_at(&self, threads: u64) -> Option<f64> {
        let i = self.threads.iter().position(|&t| t == threads)?;
        self.wall_ns_per_pair.get(i).copied().filter(|v| *v > 0.0)
    }
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

/// Reads `dir/runs/*.json` and `dir/machine.json`.
pub fn load(dir: &Path) -> Result<Results, BenchError> {
    let runs = dir.join("runs");
    let entries = std::fs::read_dir(&runs).map_err(|e| io(&runs, e))?;
    let mut paths: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    paths.sort();
    let mut results = Results::default();
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
                results.traces.push(run);
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
                results.hot.push(hot);
            }
            _ => return Err(format("its `kind` is neither \"trace\" nor \"hot_loop\"")),
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
        self.traces
            .iter()
            .find(|r| r.trace == trace && r.allocator == allocator && r.error.is_none())
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

/// One of the targets, evaluated on the results.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Target {
    /// What is asked.
    pub target: String,
    /// Whether every case met it (`None`: no run measured it).
    pub met: Option<bool>,
    /// The figures: how far each case is from the target.
    pub detail: String,
}

fn geomean(values: &[f64]) -> Option<f64> {
    let v: Vec<f64> = values
        .iter()
        .copied()
        .filter(|x| x.is_finite() && *x > 0.0)
        .collect();
    (!v.is_empty()).then(|| (v.iter().map(|x| x.ln()).sum::<f64>() / v.len() as f64).exp())
}

/// The targets, each checked on every case the results hold.
pub fn targets(results: &Results) -> Vec<Target> {
    let mut out = Vec::new();
    // Hot pair: one thread (≥ 10× faster) and eight threads' aggregate throughput (≥ 25×).
    for (threads, want, what) in [
        (
            1u64,
            10.0,
            "hot 1 MiB pair on 1 thread ≥ 10× faster than PyTorch's",
        ),
        (
            8,
            25.0,
            "hot 1 MiB pairs, 8 threads: aggregate throughput ≥ 25× PyTorch's",
        ),
    ] {
        let base = results
            .hot_loop("pytorch", "raw")
            .and_then(|h| h.wall_at(threads));
        let mut cases = Vec::new();
        for path in ["allocator", "buffer"] {
            if let (Some(base), Some(ours)) = (
                base,
                results
                    .hot_loop("cachalot", path)
                    .and_then(|h| h.wall_at(threads)),
            ) {
                cases.push((path, base / ours, base, ours));
            }
        }
        out.push(Target {
            target: what.to_string(),
            met: (!cases.is_empty()).then(|| cases.iter().all(|c| c.1 >= want)),
            detail: if cases.is_empty() {
                "not measured (no PyTorch or cachalot hot loop)".into()
            } else {
                cases
                    .iter()
                    .map(|(path, x, base, ours)| {
                        format!(
                            "through {path}: {x:.1}× ({ours:.1} vs {base:.1} ns wall per pair){}",
                            if *x >= want {
                                String::new()
                            } else {
                                format!(", missed by {:.0}%", (1.0 - x / want) * 100.0)
                            }
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("; ")
            },
        });
    }
    // Trace replay speed: ≥ 8× PyTorch's steady ns/op on every trace, for cachalot's policy
    // against PyTorch's defaults, and for the same policy on both sides.
    for (ours, theirs) in [("cachalot", "pytorch"), ("cachalot-pytorch", "pytorch")] {
        let mut cases: Vec<(String, f64)> = Vec::new();
        for trace in results.trace_names() {
            let steady = |a: &str| {
                results
                    .run(&trace, a)
                    .and_then(|r| r.ns_per_op_steady)
                    .filter(|v| *v > 0.0)
            };
            if let (Some(o), Some(t)) = (steady(ours), steady(theirs)) {
                cases.push((trace.clone(), t / o));
            }
        }
        let want = 8.0;
        let worst = cases
            .iter()
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(t, x)| format!("worst {t} {x:.2}×"));
        let below = cases.iter().filter(|c| c.1 < want).count();
        out.push(Target {
            target: format!(
                "trace replay, steady ns/op: {} ≥ 8× faster than {} on every trace",
                allocator_label(ours),
                allocator_label(theirs)
            ),
            met: (!cases.is_empty()).then_some(below == 0),
            detail: if cases.is_empty() {
                "not measured".into()
            } else {
                format!(
                    "{} of {} traces reach 8×; speed-up geometric mean {:.2}×, {}",
                    cases.len() - below,
                    cases.len(),
                    geomean(&cases.iter().map(|c| c.1).collect::<Vec<_>>()).unwrap_or(0.0),
                    worst.unwrap_or_default()
                )
            },
        });
    }
    // Same policy, same memory.
    let mut equal = 0;
    let mut differ = Vec::new();
    for trace in results.trace_names() {
        if let (Some(o), Some(t)) = (
            results.run(&trace, "cachalot-pytorch"),
            results.run(&trace, "pytorch"),
        ) {
            if o.peak_reserved == t.peak_reserved {
                equal += 1;
            } else {
                differ.push(format!(
                    "{trace}: {} vs {} bytes ({:+.2}%)",
                    o.peak_reserved,
                    t.peak_reserved,
                    (o.peak_reserved as f64 / t.peak_reserved.max(1) as f64 - 1.0) * 100.0
                ));
            }
        }
    }
    let n = equal + differ.len();
    out.push(Target {
        target: "with PyTorch's settings, cachalot's peak reserved equals PyTorch's on every trace"
            .into(),
        met: (n > 0).then_some(differ.is_empty()),
        detail: if n == 0 {
            "not measured".into()
        } else if differ.is_empty() {
            format!("equal on all {n} traces")
        } else {
            format!("equal on {equal} of {n}; differ: {}", differ.join("; "))
        },
    });
    // Own policy below the best of the others.
    let mut below = 0;
    let mut tied = Vec::new();
    let mut above = Vec::new();
    for trace in results.trace_names() {
        let Some(ours) = results.run(&trace, "cachalot") else {
            continue;
        };
        let best = WHOLE_TRACE
            .iter()
            .filter(|a| **a != "cachalot")
            .filter_map(|a| results.run(&trace, a).map(|r| (r.peak_reserved, *a)))
            .min();
        let Some((best, who)) = best else { continue };
        match ours.peak_reserved.cmp(&best) {
            std::cmp::Ordering::Less => below += 1,
            std::cmp::Ordering::Equal => tied.push(format!("{trace} (= {})", allocator_label(who))),
            std::cmp::Ordering::Greater => above.push(format!(
                "{trace}: {:+.2}% above {}",
                (ours.peak_reserved as f64 / best as f64 - 1.0) * 100.0,
                allocator_label(who)
            )),
        }
    }
    let n = below + tied.len() + above.len();
    let mut detail = format!("below on {below} of {n}");
    if !tied.is_empty() {
        let _ = write!(detail, "; equal on {}", tied.join(", "));
    }
    if !above.is_empty() {
        let _ = write!(detail, "; above: {}", above.join("; "));
    }
    out.push(Target {
        target: "cachalot's policy holds less than the best of the others on every trace".into(),
        met: (n > 0).then_some(tied.is_empty() && above.is_empty()),
        detail: if n == 0 {
            "not measured".into()
        } else {
            detail
        },
    });
    out
}

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "–".to_string(), |v| v.to_string())
}

fn ns(v: Option<f64>) -> String {
    v.map_or_else(|| "–".into(), |v| format!("{v:.0}"))
}

/// The Markdown report: machine, the tables, the targets.
pub fn markdown(results: &Results) -> String {
    let mut s = String::new();
    let traces = results.trace_names();
    let allocators = results.trace_allocators();
    let _ = writeln!(s, "# cachalot beside PyTorch, CUDA's pool and cuMemAlloc\n");
    if let Some(m) = results.machine.as_object() {
        for (k, v) in m {
            let v = v.as_str().map_or_else(|| v.to_string(), str::to_string);
            let _ = writeln!(s, "- {k}: {v}");
        }
        s.push('\n');
    }
    let header = |s: &mut String, first: &[&str]| {
        let mut cols: Vec<String> = first.iter().map(|c| (*c).to_string()).collect();
        cols.extend(allocators.iter().map(|a| allocator_label(a)));
        let _ = writeln!(s, "| {} |", cols.join(" | "));
        let _ = writeln!(
            s,
            "|{}",
            cols.iter()
                .enumerate()
                .map(|(i, _)| if i == 0 { "---|" } else { "---:|" })
                .collect::<String>()
        );
    };
    // Memory.
    let _ = writeln!(
        s,
        "## Memory: peak reserved ÷ peak in use (peak reserved)\n\n*In use*: live allocations \
         plus frees held back until their side stream completes, the least any allocator must \
         hold (from the ops file; without it, peak requested, which leaves the held-back frees \
         out). Bold: the least memory among the allocators that ran the whole trace. \
         cuMemAlloc runs a prefix of each trace: its peak reserved there. The results \
         files' `ratio` is peak reserved ÷ peak requested.\n"
    );
    header(&mut s, &["trace", "peak requested", "in use"]);
    let mut ratios: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for trace in &traces {
        let requested = allocators
            .iter()
            .filter(|a| a.as_str() != "cumemalloc")
            .find_map(|a| results.run(trace, a))
            .map_or_else(|| "–".into(), |r| crate::units::human(r.peak_requested));
        let best = allocators
            .iter()
            .filter(|a| WHOLE_TRACE.contains(&a.as_str()))
            .filter_map(|a| results.run(trace, a).map(|r| r.peak_reserved))
            .min();
        let in_use = results
            .in_use
            .get(trace)
            .map_or_else(|| "–".into(), |b| crate::units::human(*b));
        let _ = write!(s, "| {trace} | {requested} | {in_use} |");
        for a in &allocators {
            match results.run(trace, a) {
                Some(r) => {
                    let ratio = results.memory_ratio(trace, a).unwrap_or(f64::NAN);
                    if a != "cumemalloc" {
                        ratios.entry(a.clone()).or_default().push(ratio);
                    }
                    let cell = if a == "cumemalloc" {
                        format!("prefix: {}", crate::units::human(r.peak_reserved))
                    } else {
                        format!("{ratio:.3} ({})", crate::units::human(r.peak_reserved))
                    };
                    if Some(r.peak_reserved) == best && WHOLE_TRACE.contains(&a.as_str()) {
                        let _ = write!(s, " **{cell}** |");
                    } else {
                        let _ = write!(s, " {cell} |");
                    }
                }
                None => s.push_str(" – |"),
            }
        }
        s.push('\n');
    }
    let _ = write!(s, "| geometric mean (of the traces each ran) | | |");
    for a in &allocators {
        let _ = write!(
            s,
            " {} |",
            ratios
                .get(a)
                .and_then(|v| geomean(v))
                .map_or_else(|| "–".into(), |g| format!("{g:.3}"))
        );
    }
    s.push_str("\n\n");
    // Speed.
    let _ = writeln!(
        s,
        "## Speed: ns per operation line, steady state (first pass)\n"
    );
    header(&mut s, &["trace", "lines"]);
    for trace in &traces {
        let lines = results
            .traces
            .iter()
            .find(|r| &r.trace == trace)
            .map_or(0, |r| r.total_lines);
        let _ = write!(s, "| {trace} | {lines} |");
        for a in &allocators {
            match results.run(trace, a) {
                Some(r) => {
                    let _ = write!(
                        s,
                        " {} ({}) |",
                        ns(r.ns_per_op_steady),
                        ns(r.ns_per_op_first)
                    );
                }
                None => s.push_str(" – |"),
            }
        }
        s.push('\n');
    }
    s.push('\n');
    // Driver calls and cache hits.
    let _ = writeln!(
        s,
        "## Driver: memory calls (first pass; per steady pass) / reserved-memory changes / \
         cache-hit rate (first pass)\n"
    );
    header(&mut s, &["trace", "allocations"]);
    for trace in &traces {
        let allocs = results
            .traces
            .iter()
            .find(|r| &r.trace == trace && r.allocator != "cumemalloc")
            .map_or(0, |r| r.allocs);
        let _ = write!(s, "| {trace} | {allocs} |");
        for a in &allocators {
            match results.run(trace, a) {
                Some(r) => {
                    let steady = r
                        .driver_calls_steady
                        .map_or_else(String::new, |c| format!(" ({c:.0})"));
                    let _ = write!(
                        s,
                        " {}{steady} / {} / {} |",
                        opt(r.driver_calls),
                        opt(r.reserved_changes),
                        r.hit_rate
                            .map_or_else(|| "–".into(), |h| format!("{:.1}%", h * 100.0))
                    );
                }
                None => s.push_str(" – |"),
            }
        }
        s.push('\n');
    }
    s.push('\n');
    // Hot loops.
    if !results.hot.is_empty() {
        let mut threads: Vec<u64> = results
            .hot
            .iter()
            .flat_map(|h| h.threads.iter().copied())
            .collect();
        threads.sort_unstable();
        threads.dedup();
        let size = results.hot.first().map_or(0, |h| h.size);
        let _ = writeln!(
            s,
            "## Hot loop: wall ns per alloc+free pair of {} (all threads' pairs)\n",
            crate::units::human(size)
        );
        let _ = write!(s, "| allocator | through |");
        for t in &threads {
            let _ = write!(s, " {t} thread{} |", if *t == 1 { "" } else { "s" });
        }
        let _ = writeln!(s, "\n|---|---|{}", "---:|".repeat(threads.len()));
        for h in &results.hot {
            let _ = write!(s, "| {} | {} |", allocator_label(&h.allocator), h.path);
            for t in &threads {
                let cell = match (&h.error, h.wall_at(*t)) {
                    (Some(_), _) => "failed".into(),
                    (None, Some(v)) if v >= 10_000.0 => format!("{:.1} µs", v / 1000.0),
                    (None, Some(v)) => format!("{v:.1}"),
                    (None, None) => "–".into(),
                };
                let _ = write!(s, " {cell} |");
            }
            s.push('\n');
        }
        s.push('\n');
    }
    // Targets.
    let _ = writeln!(s, "## Targets\n\n| target | met | figures |\n|---|:-:|---|");
    for t in targets(results) {
        let met = match t.met {
            Some(true) => "yes",
            Some(false) => "**no**",
            None => "–",
        };
        let _ = writeln!(s, "| {} | {met} | {} |", t.target, t.detail);
    }
    // Notes and failures: each distinct note once, with the traces it applies to.
    let mut grouped: Vec<(String, Vec<String>)> = Vec::new();
    let mut add = |text: String, trace: &str| match grouped.iter_mut().find(|(t, _)| *t == text) {
        Some((_, traces)) => traces.push(trace.to_string()),
        None => grouped.push((text, vec![trace.to_string()])),
    };
    for r in &results.traces {
        let label = allocator_label(&r.allocator);
        if let Some(e) = &r.error {
            add(format!("{label}: failed: {e}"), &r.trace);
        } else if let Some(n) = r.notes.as_ref().filter(|n| !n.is_empty()) {
            add(format!("{label}: {n}"), &r.trace);
        }
    }
    for h in &results.hot {
        if let Some(e) = &h.error {
            add(
                format!(
                    "{} hot loop ({}): failed: {e}",
                    allocator_label(&h.allocator),
                    h.path
                ),
                "hot loop",
            );
        }
    }
    if !grouped.is_empty() {
        let _ = writeln!(s, "\n## Notes\n");
        let all = traces.len();
        for (text, on) in grouped {
            let on = if on.len() == all && all > 1 {
                "every trace".to_string()
            } else {
                on.join(", ")
            };
            let _ = writeln!(s, "- {text} ({on})");
        }
    }
    s
}

fn csv_field(v: &str) -> String {
    if v.contains([',', '"', '\n']) {
        format!("\"{}\"", v.replace('"', "\"\""))
    } else {
        v.to_string()
    }
}

/// One line per trace run (without timelines).
pub fn csv(results: &Results) -> String {
    let mut s = String::from(
        "trace,allocator,lines,total_lines,allocs,ooms,peak_requested,peak_reserved,\
         peak_allocated,ratio,driver_calls,driver_calls_steady,reserved_changes,cache_hits,\
         hit_rate,passes,\
         ns_per_op_first,ns_per_op_steady,notes,error\n",
    );
    let f = |v: Option<f64>| v.map_or_else(String::new, |v| format!("{v}"));
    let u = |v: Option<u64>| v.map_or_else(String::new, |v| v.to_string());
    for r in &results.traces {
        let fields = [
            csv_field(&r.trace),
            csv_field(&r.allocator),
            r.lines.to_string(),
            r.total_lines.to_string(),
            r.allocs.to_string(),
            r.ooms.to_string(),
            r.peak_requested.to_string(),
            r.peak_reserved.to_string(),
            u(r.peak_allocated),
            f(r.ratio),
            u(r.driver_calls),
            f(r.driver_calls_steady),
            u(r.reserved_changes),
            u(r.cache_hits),
            f(r.hit_rate),
            r.passes.to_string(),
            f(r.ns_per_op_first),
            f(r.ns_per_op_steady),
            csv_field(r.notes.as_deref().unwrap_or("")),
            csv_field(r.error.as_deref().unwrap_or("")),
        ];
        s.push_str(&fields.join(","));
        s.push('\n');
    }
    s
}

/// The results file: machine, runs without timelines, hot loops and targets.
pub fn results_json(results: &Results) -> serde_json::Value {
    let traces: Vec<TraceRun> = results
        .traces
        .iter()
        .map(|r| TraceRun {
            timeline: None,
            ..r.clone()
        })
        .collect();
    serde_json::json!({
        "schema": "cachalot gpu-bench results v1",
        "machine": results.machine,
        "traces": traces,
        "hot_loops": results.hot,
        "targets": targets(results),
    })
}

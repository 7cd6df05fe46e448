//! The `cachalot gpu-bench v1` records: one JSON object per (allocator, trace) run or hot loop
//! under `OUT/runs/`, written by `benches/gpu_compare.rs` ([`RunFile`]) and by
//! `scripts/pytorch_bench.py`, read by `cachalot bench-report`
//! ([`load`](super::report::load)). One set of types for both sides.
//!
//! A file is `{"schema": "cachalot gpu-bench v1", "kind": "trace" | "hot_loop", ...}` with the
//! record's fields after those two. Byte counts and counts are `u64`. Every field but
//! `allocator` (and `trace` for a trace run) may be missing or null in a file that is read —
//! older files lack `reserved_changes` and `cache_hits`, and a failed run of
//! `pytorch_bench.py` carries only its `error` — and reads as its default; a figure a run did
//! not measure stays `None`, never filled in. `error` is written only by a run that failed.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// The format name every run file carries.
pub const SCHEMA: &str = "cachalot gpu-bench v1";

/// The most points of a [`Timeline`] (see [`downsample`]).
pub const TIMELINE_POINTS: usize = 1000;

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
    /// The allocator's key ([`ALLOCATORS`](super::report::ALLOCATORS)).
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
    /// Each timed pass after the first, in order: its driver calls (where counted). The
    /// steady mean hides whether the calls fall in pass 2 (views made once) or recur.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub steady_passes_driver_calls: Option<Vec<u64>>,
    /// Each timed pass after the first, in order: its ns per operation line.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub steady_passes_ns_per_op: Option<Vec<f64>>,
    /// The observed pass's memory timeline.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeline: Option<Timeline>,
    /// What the reader must know about this run.
    pub notes: Option<String>,
    /// Why the run failed, if it did (written only then).
    #[serde(skip_serializing_if = "Option::is_none")]
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
    /// Why the run failed, if it did (written only then).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl HotLoop {
    /// Wall ns per pair at `threads` threads.
    pub fn wall_at(&self, threads: u64) -> Option<f64> {
        let i = self.threads.iter().position(|&t| t == threads)?;
        self.wall_ns_per_pair.get(i).copied().filter(|v| *v > 0.0)
    }
}

impl TraceRun {
    /// The `kind` of its files.
    pub const KIND: &str = "trace";
}

impl HotLoop {
    /// The `kind` of its files.
    pub const KIND: &str = "hot_loop";
}

/// A run file as written: the schema and the record's kind, then the record's fields.
#[derive(Debug, Serialize)]
pub struct RunFile<'a, T> {
    /// [`SCHEMA`].
    pub schema: &'static str,
    /// [`TraceRun::KIND`] or [`HotLoop::KIND`].
    pub kind: &'static str,
    /// The record.
    #[serde(flatten)]
    pub record: &'a T,
}

impl<T: Serialize> RunFile<'_, T> {
    /// Writes the file as `out/runs/NAME`: pretty JSON and a newline (`out/runs` made if need
    /// be). Errors say what failed, naming the path.
    pub fn write(&self, out: &Path, name: &str) -> Result<(), String> {
        let dir = out.join("runs");
        std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        let path = dir.join(name);
        let text = serde_json::to_string_pretty(self).map_err(|e| format!("writing JSON: {e}"))?;
        std::fs::write(&path, text + "\n").map_err(|e| format!("writing {}: {e}", path.display()))
    }
}

impl<'a> RunFile<'a, TraceRun> {
    /// The file of a trace run.
    pub fn trace(record: &'a TraceRun) -> Self {
        RunFile {
            schema: SCHEMA,
            kind: TraceRun::KIND,
            record,
        }
    }
}

impl<'a> RunFile<'a, HotLoop> {
    /// The file of a hot loop.
    pub fn hot_loop(record: &'a HotLoop) -> Self {
        RunFile {
            schema: SCHEMA,
            kind: HotLoop::KIND,
            record,
        }
    }
}

/// At most [`TIMELINE_POINTS`] points of `(line, requested, reserved)`: consecutive points in
/// buckets of equal size (the last may be shorter), each bucket giving its first line and its
/// largest requested and reserved.
pub fn downsample(points: &[(u64, u64, u64)]) -> Timeline {
    let per = points.len().div_ceil(TIMELINE_POINTS).max(1);
    let mut t = Timeline::default();
    for bucket in points.chunks(per) {
        t.line.push(bucket[0].0);
        t.requested
            .push(bucket.iter().map(|p| p.1).max().unwrap_or(0));
        t.reserved
            .push(bucket.iter().map(|p| p.2).max().unwrap_or(0));
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_written_record_reads_back_as_itself() {
        let run = TraceRun {
            allocator: "cachalot".into(),
            trace: "t".into(),
            lines: 3,
            total_lines: 3,
            allocs: 2,
            peak_requested: 1 << 40,
            peak_reserved: u64::MAX,
            reserved_changes: Some(1),
            cache_hits: Some(1),
            ns_per_op_first: Some(12.5),
            timeline: Some(downsample(&[(0, 0, 0), (1, 5, 7)])),
            notes: Some(String::new()),
            ..TraceRun::default()
        };
        let text = serde_json::to_string_pretty(&RunFile::trace(&run)).unwrap();
        assert!(
            text.starts_with("{\n  \"schema\": \"cachalot gpu-bench v1\",\n  \"kind\": \"trace\",\n  \"allocator\": \"cachalot\",")
        );
        assert!(!text.contains("\"error\""));
        assert_eq!(serde_json::from_str::<TraceRun>(&text).unwrap(), run);
        let hot = HotLoop {
            allocator: "cachalot".into(),
            path: "allocator".into(),
            size: 1 << 20,
            threads: vec![1, 2],
            pairs_per_thread: vec![4, 2],
            wall_ns_per_pair: vec![1.5, 0.75],
            ns_per_pair_per_thread: vec![1.5, 1.5],
            error: None,
        };
        let text = serde_json::to_string(&RunFile::hot_loop(&hot)).unwrap();
        assert!(text.starts_with(
            "{\"schema\":\"cachalot gpu-bench v1\",\"kind\":\"hot_loop\",\"allocator\""
        ));
        assert_eq!(serde_json::from_str::<HotLoop>(&text).unwrap(), hot);
    }
}

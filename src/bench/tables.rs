//! The report's files: `results.md` (the tables, the targets, the notes), `results.csv` and
//! `results.json`.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use super::record::{HotLoop, TraceRun};
use super::report::{Results, WHOLE_TRACE, allocator_label};
use super::targets::{geomean, targets};
use crate::units::human;

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
            .map_or_else(|| "–".into(), |r| human(r.peak_requested));
        let best = allocators
            .iter()
            .filter(|a| WHOLE_TRACE.contains(&a.as_str()))
            .filter_map(|a| results.run(trace, a).map(|r| r.peak_reserved))
            .min();
        let in_use = results
            .in_use
            .get(trace)
            .map_or_else(|| "–".into(), |b| human(*b));
        let _ = write!(s, "| {trace} | {requested} | {in_use} |");
        for a in &allocators {
            match results.run(trace, a) {
                Some(r) => {
                    let ratio = results.memory_ratio(trace, a).unwrap_or(f64::NAN);
                    if a != "cumemalloc" {
                        ratios.entry(a.clone()).or_default().push(ratio);
                    }
                    let cell = if a == "cumemalloc" {
                        format!("prefix: {}", human(r.peak_reserved))
                    } else {
                        format!("{ratio:.3} ({})", human(r.peak_reserved))
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
            human(size)
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

/// A run as `results.json` lists it: every field of its record, and `error` always (null for
/// a run that did not fail), where a run file carries `error` only when the run failed.
#[derive(Serialize)]
struct Listed<'a, T> {
    #[serde(flatten)]
    record: &'a T,
    /// `Some(())` (written as null) when the record has no error of its own to write.
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<()>,
}

impl<'a, T> Listed<'a, T> {
    fn new(record: &'a T, error: &Option<String>) -> Self {
        Listed {
            record,
            error: error.is_none().then_some(()),
        }
    }
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
    let traces: Vec<Listed<'_, TraceRun>> =
        traces.iter().map(|r| Listed::new(r, &r.error)).collect();
    let hot: Vec<Listed<'_, HotLoop>> = results
        .hot
        .iter()
        .map(|h| Listed::new(h, &h.error))
        .collect();
    serde_json::json!({
        "schema": "cachalot gpu-bench results v1",
        "machine": results.machine,
        "traces": traces,
        "hot_loops": hot,
        "targets": targets(results),
    })
}

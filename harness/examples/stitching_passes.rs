//! Does rule 23 (stitched views) reach a steady state with no driver call on real traces?
//!
//! Each committed trace's replay program (`tests/fixtures/traces/`, `user/`, every device) runs
//! 5 passes in a row on one model, under cachalot's policy — expandable segments with 2 MiB
//! pages in both pools, `reclaim_headroom:0.025`, no thread caches — on top of the settings
//! it was recorded with, on its recorded device, three ways: neither rule 22 nor 23 ("off"),
//! page aliasing (rule 22), stitched views (rule 23). The table: per trace and setting, the
//! device calls (`num_device_alloc` + `num_device_free`) of pass 1 and of each of passes 2–5,
//! peak reserved ÷ peak requested after pass 5, and (rule 23) the views and their MiB of
//! address space after pass 5.
//!
//! ```text
//! cargo run --release -p cachalot-harness --example stitching_passes \
//!     [-- [--check] [--calls] [NAME_FILTER ...]]
//! ```
//!
//! `--check` checks the model's invariants after every operation (slow); `--calls` prints,
//! under rule 23, each operation of passes 2–5 that made device calls; the filters keep the
//! traces whose file name contains one of them.

use std::path::Path;

use cachalot_harness::fixtures::{committed_snapshots, recorded_programs};
use cachalot_harness::replay::{Pass, model_passes_logged};
use cachalot_harness::scenario::Knobs;
use cachalot_tools::replay::ReplayProgram;

const MIB: u64 = 1 << 20;
const PASSES: usize = 5;

/// One trace device's passes under the three settings.
struct Row {
    name: String,
    ops: usize,
    off: Vec<Pass>,
    aliasing: Vec<Pass>,
    stitching: Vec<Pass>,
    program: ReplayProgram,
}

fn run(pickle: &Path, check: bool, log: bool) -> Result<Vec<Row>, String> {
    let mut rows = Vec::new();
    for recorded in recorded_programs(pickle)? {
        let (name, program) = (recorded.name, recorded.program);
        // Rule 21's policy, thread caches aside.
        let knobs = |page_aliasing: bool, page_stitching: bool| Knobs {
            expandable_segments: true,
            expandable_page: 2 * MIB,
            reclaim_headroom: Some(0.025),
            thread_cache_blocks: 0,
            page_aliasing,
            page_stitching,
            ..recorded.knobs.clone()
        };
        let off = model_passes_logged(&program, &knobs(false, false), PASSES, check, false)
            .map_err(|e| format!("{name}, off: {e}"))?;
        let aliasing = model_passes_logged(&program, &knobs(true, false), PASSES, check, false)
            .map_err(|e| format!("{name}, rule 22: {e}"))?;
        let stitching = model_passes_logged(&program, &knobs(false, true), PASSES, check, log)
            .map_err(|e| format!("{name}, rule 23: {e}"))?;
        rows.push(Row {
            name,
            ops: program.ops.len() + program.initial.len(),
            off,
            aliasing,
            stitching,
            program,
        });
    }
    Ok(rows)
}

/// Device calls of one pass.
fn calls(p: &Pass) -> u64 {
    p.device_allocs + p.device_frees
}

/// `peak reserved / peak requested` after `p`.
fn ratio(p: &Pass) -> String {
    if p.peak_requested == 0 {
        "–".into()
    } else {
        format!("{:.3}", p.peak_reserved as f64 / p.peak_requested as f64)
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let check = args.iter().any(|a| a == "--check");
    let log = args.iter().any(|a| a == "--calls");
    let filters: Vec<&String> = args.iter().filter(|a| !a.starts_with("--")).collect();
    let filters: Vec<String> = filters.into_iter().cloned().collect();
    let paths = committed_snapshots(&filters);
    println!(
        "{PASSES} passes on one model: expandable segments, 2 MiB pages, reclaim_headroom 0.025, \
         no thread caches; device calls = num_device_alloc + num_device_free per pass; \
         ratio = peak reserved / peak requested after pass {PASSES}; views after pass {PASSES}"
    );
    println!();
    println!(
        "| trace | ops | off: pass 1; 2–{PASSES} | ratio | rule 22: pass 1; 2–{PASSES} | ratio | rule 23: pass 1; 2–{PASSES} | ratio | views (MiB) | OOMs off/22/23 |"
    );
    println!("|---|---:|---|---:|---|---:|---|---:|---:|---|");
    let mut failures = Vec::new();
    let mut logs = Vec::new();
    for path in &paths {
        let started = std::time::Instant::now();
        match run(path, check, log) {
            Ok(rows) => {
                for row in rows {
                    let cell = |passes: &[Pass]| {
                        let later: Vec<String> =
                            passes[1..].iter().map(|p| calls(p).to_string()).collect();
                        format!("{}; {}", calls(&passes[0]), later.join(" "))
                    };
                    let ooms =
                        |passes: &[Pass]| -> usize { passes.iter().map(|p| p.out_of_memory).sum() };
                    let last = &row.stitching[PASSES - 1];
                    println!(
                        "| {} | {} | {} | {} | {} | {} | {} | {} | {} ({}) | {}/{}/{} |",
                        row.name,
                        row.ops,
                        cell(&row.off),
                        ratio(&row.off[PASSES - 1]),
                        cell(&row.aliasing),
                        ratio(&row.aliasing[PASSES - 1]),
                        cell(&row.stitching),
                        ratio(last),
                        last.views,
                        last.view_bytes / MIB,
                        ooms(&row.off),
                        ooms(&row.aliasing),
                        ooms(&row.stitching),
                    );
                    if log {
                        for (pass, p) in row.stitching.iter().enumerate().skip(1) {
                            for &(i, a, f, views, reserved) in &p.calls_at {
                                logs.push(format!(
                                    "{} pass {}: op {i} {:?}: {a} alloc, {f} free; {views} views, \
                                     {} MiB reserved",
                                    row.name,
                                    pass + 1,
                                    row.program.ops[i],
                                    reserved / MIB
                                ));
                            }
                        }
                    }
                }
            }
            Err(e) => failures.push(format!("{}: {e}", path.display())),
        }
        eprintln!(
            "{}: {:.1} s",
            path.display(),
            started.elapsed().as_secs_f64()
        );
    }
    if log {
        println!();
        for line in logs {
            println!("{line}");
        }
    }
    if !failures.is_empty() {
        eprintln!("{} traces failed:\n{}", failures.len(), failures.join("\n"));
        std::process::exit(1);
    }
}

//! What does rule 19j (one handle per large map step) buy and cost on real traces?
//!
//! Each committed trace's replay program (`tests/fixtures/traces/`, `user/`, every device) runs
//! 5 passes in a row on one model under rule 21's policy (expandable segments, 2 MiB pages,
//! `reclaim_headroom:0.025`, stitched views; no thread caches) on top of the settings it was
//! recorded with, on its recorded device: with one handle per page (today's), and with
//! `expandable_handle_mb` at each threshold given (default 2, 8 and 32 MiB). Per trace and
//! setting: the handles made in pass 1 (each a `cuMemCreate` + `cuMemMap` + `cuMemSetAccess`,
//! about 45 µs on an H200 whatever its size: the first pass's price), the device calls
//! (`num_device_alloc` + `num_device_free`) of pass 1 and of each of passes 2–5, the handles
//! made in passes 2–5, and peak reserved ÷ peak requested after pass 5.
//!
//! ```text
//! cargo run --release -p cachalot-harness --example handle_passes \
//!     [-- [--check] [--thresholds 2,8,32] [NAME_FILTER ...]]
//! ```

use std::path::Path;

use cachalot_harness::fixtures::{committed_snapshots, recorded_programs};
use cachalot_harness::replay::{Pass, model_passes_logged};
use cachalot_harness::scenario::Knobs;

const MIB: u64 = 1 << 20;
const PASSES: usize = 5;

/// One trace device's passes, per setting (per page first, then each threshold).
struct Row {
    name: String,
    runs: Vec<Vec<Pass>>,
}

fn run(pickle: &Path, thresholds: &[u64], check: bool) -> Result<Vec<Row>, String> {
    let mut rows = Vec::new();
    for recorded in recorded_programs(pickle)? {
        let mut runs = Vec::new();
        for handle in std::iter::once(None).chain(thresholds.iter().map(|&t| Some(t * MIB))) {
            // Rule 21's policy, thread caches aside, with or without rule 19j.
            let knobs = Knobs {
                expandable_segments: true,
                expandable_page: 2 * MIB,
                reclaim_headroom: Some(0.025),
                thread_cache_blocks: 0,
                page_aliasing: false,
                page_stitching: true,
                expandable_handle: handle,
                ..recorded.knobs.clone()
            };
            runs.push(
                model_passes_logged(&recorded.program, &knobs, PASSES, check, false)
                    .map_err(|e| format!("{}, handles {handle:?}: {e}", recorded.name))?,
            );
        }
        rows.push(Row {
            name: recorded.name,
            runs,
        });
    }
    Ok(rows)
}

/// Device calls of one pass.
fn calls(p: &Pass) -> u64 {
    p.device_allocs + p.device_frees
}

/// One setting's cell: pass 1's handles; calls by pass; later handles; ratio after pass 5.
fn cell(passes: &[Pass]) -> String {
    let later: Vec<String> = passes[1..].iter().map(|p| calls(p).to_string()).collect();
    let later_handles: u64 = passes[1..].iter().map(|p| p.handles).sum();
    let last = &passes[PASSES - 1];
    let ratio = if last.peak_requested == 0 {
        "–".to_string()
    } else {
        format!(
            "{:.3}",
            last.peak_reserved as f64 / last.peak_requested as f64
        )
    };
    format!(
        "{} | {}; {} | {} | {}",
        passes[0].handles,
        calls(&passes[0]),
        later.join(" "),
        later_handles,
        ratio
    )
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let check = args.iter().any(|a| a == "--check");
    let mut thresholds: Vec<u64> = vec![2, 8, 32];
    let mut filters: Vec<String> = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--thresholds" {
            let list = it.next().expect("--thresholds takes a list such as 2,8,32");
            thresholds = list
                .split(',')
                .map(|t| t.parse().expect("a threshold in MiB"))
                .collect();
        } else if !a.starts_with("--") {
            filters.push(a.clone());
        }
    }
    let paths = committed_snapshots(&filters);
    println!(
        "{PASSES} passes on one model: rule 21's policy without thread caches; per setting: \
         handles made in pass 1 | device calls, pass 1; passes 2–{PASSES} | handles made in \
         passes 2–{PASSES} | peak reserved ÷ peak requested after pass {PASSES}"
    );
    println!();
    let mut header = String::from("| trace | per page: h1 | calls | h2–5 | ratio |");
    let mut rule = String::from("|---|---:|---|---:|---:|");
    for t in &thresholds {
        header.push_str(&format!(" ≥ {t} MiB: h1 | calls | h2–5 | ratio |"));
        rule.push_str("---:|---|---:|---:|");
    }
    println!("{header}");
    println!("{rule}");
    let mut failures = Vec::new();
    let mut totals = vec![(0u64, 0u64, 0u64); thresholds.len() + 1];
    for path in &paths {
        match run(path, &thresholds, check) {
            Ok(rows) => {
                for row in rows {
                    let cells: Vec<String> = row.runs.iter().map(|r| cell(r)).collect();
                    println!("| {} | {} |", row.name, cells.join(" | "));
                    for (total, r) in totals.iter_mut().zip(&row.runs) {
                        total.0 += r[0].handles;
                        total.1 += r[1..].iter().map(calls).sum::<u64>();
                        total.2 += r[2..].iter().map(calls).sum::<u64>();
                    }
                }
            }
            Err(e) => failures.push(format!("{}: {e}", path.display())),
        }
    }
    println!();
    for (i, total) in totals.iter().enumerate() {
        let name = if i == 0 {
            "per page".to_string()
        } else {
            format!("≥ {} MiB", thresholds[i - 1])
        };
        println!(
            "{name}: pass-1 handles {}, calls in passes 2–{PASSES} {}, in passes 3–{PASSES} {}",
            total.0, total.1, total.2
        );
    }
    if !failures.is_empty() {
        eprintln!("{} traces failed:\n{}", failures.len(), failures.join("\n"));
        std::process::exit(1);
    }
}

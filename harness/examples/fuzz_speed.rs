//! How fast is each fuzz harness? Runs a target's harness over its committed seeds
//! (`fuzz/seeds/<target>/`), pass after pass, for a given time, and prints executions per
//! second: the figure to profile (`perf record -g`, `valgrind --tool=callgrind`) without
//! cargo-fuzz, and to compare before and after a change. A seed that fails is reported and the
//! run stops with exit status 1.
//!
//! ```text
//! cargo run --release -p cachalot-harness --example fuzz_speed -- TARGET [SECONDS] [DIR]
//! ```
//!
//! `DIR` replaces the seed folder (a working corpus, `fuzz/corpus/<target>/`). With
//! `CHECK_EVERY=k` in the environment, `differential` runs its scenarios with both sides'
//! invariant checks every `k` steps (`run_scenario_checked_every`) instead of the target's own
//! choice: to measure what the checks cost.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cachalot_harness::driver::run_scenario_checked_every;
use cachalot_harness::fuzzing::{Harness, TARGETS, scenario_from_bytes};

/// `CHECK_EVERY`, read once.
fn check_every() -> usize {
    static K: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *K.get_or_init(|| {
        std::env::var("CHECK_EVERY")
            .ok()
            .and_then(|v| v.parse().ok())
            .expect("CHECK_EVERY")
    })
}

/// `differential` with the invariant checks every `CHECK_EVERY` steps.
fn differential_checked(data: &[u8]) -> Result<(), String> {
    run_scenario_checked_every(&scenario_from_bytes(data), check_every())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(target) = args.first() else {
        eprintln!("usage: fuzz_speed TARGET [SECONDS] [DIR]");
        std::process::exit(2);
    };
    let seconds: f64 = args.get(1).map_or(5.0, |s| s.parse().expect("SECONDS"));
    let Some(&(_, mut harness)) = TARGETS.iter().find(|(t, _)| t == target) else {
        eprintln!("unknown target {target}");
        std::process::exit(2);
    };
    if target == "differential" && std::env::var_os("CHECK_EVERY").is_some() {
        check_every();
        harness = differential_checked as Harness;
    }
    let dir = args.get(2).map_or_else(
        || {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../fuzz/seeds")
                .join(target)
        },
        PathBuf::from,
    );
    let mut inputs: Vec<(PathBuf, Vec<u8>)> = std::fs::read_dir(&dir)
        .expect("reading the corpus folder")
        .map(|e| e.expect("a corpus entry").path())
        .filter(|p| p.is_file())
        .map(|p| {
            let data = std::fs::read(&p).expect("reading a corpus file");
            (p, data)
        })
        .collect();
    inputs.sort();
    let bytes: usize = inputs.iter().map(|(_, d)| d.len()).sum();
    let limit = Duration::from_secs_f64(seconds);
    let start = Instant::now();
    let (mut runs, mut passes) = (0u64, 0u64);
    while start.elapsed() < limit {
        for (path, data) in &inputs {
            if let Err(e) = harness(data) {
                eprintln!("{}: {e}", path.display());
                std::process::exit(1);
            }
            runs += 1;
        }
        passes += 1;
    }
    let elapsed = start.elapsed().as_secs_f64();
    println!(
        "{target}: {} inputs ({bytes} B), {passes} passes, {runs} runs in {elapsed:.2} s: {:.0} exec/s",
        inputs.len(),
        runs as f64 / elapsed
    );
}

//! The fuzz targets' committed inputs, replayed on stable Rust: every file of
//! `fuzz/seeds/<target>/` (the seed corpus) and `fuzz/regressions/<target>/` (inputs that once
//! crashed a target) goes through the same harness the fuzz target runs
//! (`cachalot_harness::fuzzing`), so a crash found once stays a regression test.
//!
//! To keep a crash: copy the artifact libFuzzer wrote (`fuzz/artifacts/<target>/crash-…`) to
//! `fuzz/regressions/<target>/`, fix the bug, and commit both.

use std::path::{Path, PathBuf};

use cachalot_harness::fuzzing::{Harness, TARGETS};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

/// The repository's `fuzz/` folder (this crate is `harness/`).
fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz")
}

/// The files of `fuzz/<kind>/<target>/`, sorted (none when the folder does not exist).
fn inputs(kind: &str, target: &str) -> Vec<PathBuf> {
    let dir = fuzz_dir().join(kind).join(target);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .map(|e| e.expect("reading a corpus folder").path())
        .filter(|p| {
            p.is_file()
                && !p
                    .file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with('.'))
        })
        .collect();
    files.sort();
    files
}

fn replay(kind: &str) -> usize {
    let mut failures = Vec::new();
    let mut count = 0;
    for &(target, harness) in TARGETS {
        for path in inputs(kind, target) {
            let data = std::fs::read(&path).expect("reading a corpus file");
            count += 1;
            if let Err(e) = run(harness, &data) {
                failures.push(format!(
                    "{}: {e}\n  reproduce: cd fuzz && cargo fuzz run {target} {} (see fuzz/README.md)",
                    path.display(),
                    path.strip_prefix(fuzz_dir()).unwrap_or(&path).display()
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {count} {kind} inputs fail:\n{}",
        failures.len(),
        failures.join("\n")
    );
    count
}

/// Runs a harness, turning a panic in the code under test into an error naming it.
fn run(harness: Harness, data: &[u8]) -> Result<(), String> {
    match std::panic::catch_unwind(|| harness(data)) {
        Ok(r) => r,
        Err(p) => Err(format!(
            "panicked: {}",
            p.downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default()
        )),
    }
}

#[test]
fn every_target_has_committed_seeds() {
    for &(target, _) in TARGETS {
        assert!(
            !inputs("seeds", target).is_empty(),
            "fuzz/seeds/{target}/ is empty or missing"
        );
        assert!(
            fuzz_dir()
                .join("fuzz_targets")
                .join(format!("{target}.rs"))
                .is_file(),
            "fuzz/fuzz_targets/{target}.rs is missing"
        );
    }
}

#[test]
fn committed_seed_corpora_pass_every_target() {
    replay("seeds");
}

#[test]
fn committed_regression_inputs_pass_every_target() {
    replay("regressions");
}

/// A few hundred pseudo-random inputs per target, so the harnesses themselves are exercised on
/// stable even where cargo-fuzz is not installed.
#[test]
fn pseudo_random_inputs_pass_every_target() {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(0x9e37_79b9_7f4a_7c15);
    for &(target, harness) in TARGETS {
        for i in 0..200 {
            let len = rng.random_range(0..600);
            let data: Vec<u8> = (0..len).map(|_| rng.random()).collect();
            if let Err(e) = run(harness, &data) {
                panic!("{target}, input {i} ({data:?}): {e}");
            }
        }
    }
}

//! The simulation predicts the GPU, to the byte (issue 4): for every committed PyTorch trace,
//! the replay on a real GPU (`cachalot replay --backend cuda --snapshot-out`, run by
//! `scripts/gpu_agreement.sh`) and the simulated replay of the snapshot it wrote — on which the
//! simulated device hands out the GPU's own segment addresses — reach the same peak reserved
//! and allocated bytes, the same peak segment count, the same device allocations and frees,
//! and the same final layout of every segment and block.
//!
//! The GPU results are read from the folder named by `CACHALOT_GPU_RESULTS`, else from the
//! results committed under `tests/fixtures/gpu/`; per trace NAME, `gpu_NAME.pickle.gz` (the
//! GPU replay's snapshot) and `gpu_NAME.result.json` (its `--json` report). Without either
//! folder the test is skipped with a printed reason.

use std::path::{Path, PathBuf};

use cachalot::Settings;
use cachalot_tools::export::segment_states;
use cachalot_tools::replay::{ReplayConfig, ReplayOptions, replay, replay_ops_with};
use cachalot_tools::snapshot::read_snapshot;

fn repo(rel: &str) -> PathBuf {
    let local = Path::new(rel);
    if local.exists() {
        local.to_path_buf()
    } else {
        Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
    }
}

fn results_folder() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("CACHALOT_GPU_RESULTS") {
        return Some(PathBuf::from(dir));
    }
    let committed = repo("tests/fixtures/gpu");
    committed.is_dir().then_some(committed)
}

fn fixture_names() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(repo("tests/fixtures/traces"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "pickle"))
        .map(|p| p.file_stem().unwrap().to_string_lossy().to_string())
        .collect();
    names.sort();
    names
}

fn u64_of(j: &serde_json::Value, key: &str) -> u64 {
    j[key]
        .as_u64()
        .unwrap_or_else(|| panic!("no {key} in the GPU report"))
}

#[test]
fn the_simulated_replay_of_each_gpu_snapshot_agrees_with_the_gpu_to_the_byte() {
    let Some(dir) = results_folder() else {
        println!(
            "skipped: no GPU results (set CACHALOT_GPU_RESULTS to the output folder of \
             scripts/gpu_agreement.sh, or commit one under tests/fixtures/gpu/)"
        );
        return;
    };
    check_folder(&dir);
}

/// The same under expandable segments (rule 19): `CONFIG=expandable_segments:True
/// scripts/gpu_agreement.sh` on the H200 (CUDA's virtual memory), committed under
/// `tests/fixtures/gpu-expandable/`.
#[test]
fn under_expandable_segments_the_gpu_and_the_simulation_agree_to_the_byte() {
    let dir = repo("tests/fixtures/gpu-expandable");
    check_folder(&dir);
}

fn check_folder(dir: &Path) {
    let mut failures = Vec::new();
    let mut checked = 0;
    for name in fixture_names() {
        let snap_path = dir.join(format!("gpu_{name}.pickle.gz"));
        let json_path = dir.join(format!("gpu_{name}.result.json"));
        if !snap_path.is_file() || !json_path.is_file() {
            failures.push(format!("{name}: no GPU result in {}", dir.display()));
            continue;
        }
        let gpu: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&json_path).unwrap()).unwrap();
        assert_eq!(gpu["backend"], "cuda", "{name}: not a GPU replay");
        let snapshot = read_snapshot(&snap_path).unwrap();
        let recorded = snapshot
            .allocator_settings
            .as_ref()
            .expect("cachalot writes its settings");
        let settings = Settings::pytorch()
            .apply(&recorded.alloc_conf)
            .unwrap_or_else(|e| panic!("{name}: the recorded settings: {e}"));
        let device = gpu["device"].as_u64().unwrap() as usize;
        let trace = snapshot
            .traces
            .iter()
            .find(|t| t.device == device)
            .expect("the replayed device's trace");
        let program = replay_ops_with(trace, &ReplayOptions::from_settings(Some(recorded))).0;
        let sim = replay(
            &program,
            &ReplayConfig {
                settings,
                capacity: u64_of(&gpu, "device_total_bytes"),
                ..ReplayConfig::pytorch()
            },
        )
        .unwrap();
        let pairs = [
            ("peak_reserved_bytes", sim.peak_reserved_bytes),
            ("peak_allocated_bytes", sim.peak_allocated_bytes),
            ("peak_segments", sim.peak_segments),
            ("device_allocs", sim.device_allocs),
            ("device_frees", sim.device_frees),
            ("ooms", sim.ooms),
            ("final_segments", sim.final_layout.len() as u64),
        ];
        for (key, ours) in pairs {
            let theirs = u64_of(&gpu, key);
            if ours != theirs {
                failures.push(format!("{name}: {key}: GPU {theirs}, simulation {ours}"));
            }
        }
        let failures_before = failures.len();
        let layout = segment_states(&sim.final_layout, device);
        let gpu_layout: Vec<_> = snapshot
            .segments
            .iter()
            .filter(|s| s.device == device)
            .cloned()
            .collect();
        if layout != gpu_layout {
            let at = layout
                .iter()
                .zip(&gpu_layout)
                .position(|(a, b)| a != b)
                .unwrap_or(layout.len().min(gpu_layout.len()));
            failures.push(format!(
                "{name}: final layout differs at segment {at} ({} segments simulated, {} on the GPU)",
                layout.len(),
                gpu_layout.len()
            ));
        }
        if failures.len() == failures_before {
            println!(
                "{name:22} GPU and simulation agree: peak reserved {} B, {} segments, {} device allocs",
                sim.peak_reserved_bytes, sim.peak_segments, sim.device_allocs
            );
        }
        checked += 1;
    }
    assert!(
        failures.is_empty(),
        "{} disagreements:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert!(checked >= 8, "only {checked} GPU results checked");
}

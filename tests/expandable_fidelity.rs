//! Expandable segments (rule 19) against PyTorch's own figures, on every committed trace:
//!
//! - the traces recorded under `expandable_segments:True` (`tests/fixtures/expandable/`, fresh
//!   processes) replay under their recorded settings to PyTorch's `max_memory_reserved()` to
//!   the byte, and end in PyTorch's dumped layout block for block (the self-check);
//! - every other trace, replayed with `--pytorch --config expandable_segments:True`, peaks at
//!   what PyTorch's own allocator reserved under expandable segments for the same program
//!   (`results/pytorch-replay-2026-12-01/results.json`, measured on an H200 by
//!   `scripts/pytorch_replay.py`).

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn replay(args: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_cachalot"))
        .arg("replay")
        .args(args)
        .arg("--json")
        .current_dir(root())
        .output()
        .expect("run cachalot");
    assert!(
        out.status.success(),
        "cachalot replay {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON report")
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn traces_recorded_under_expandable_segments_replay_to_pytorchs_figures_and_layout() {
    let dir = root().join("tests/fixtures/expandable");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        if !name.contains(".pickle") {
            continue;
        }
        let stem = name.split(".pickle").next().unwrap();
        let figures = read_json(&dir.join(format!("{stem}.json")));
        // Recorded from the process start: PyTorch's peak covers the whole trace.
        let Some(want) = figures["max_memory_reserved"].as_u64() else {
            continue;
        };
        let j = replay(&[path.to_str().unwrap(), "--pytorch"]);
        assert_eq!(j["peak_reserved_bytes"].as_u64(), Some(want), "{name}");
        assert_eq!(
            j["self_check"]["matches"],
            Value::Bool(true),
            "{name}: {}",
            j["self_check"]
        );
        assert_eq!(j["start"]["state"], "fresh", "{name}");
        checked += 1;
    }
    assert!(
        checked >= 10,
        "only {checked} expandable recordings checked"
    );
}

/// The user-style recordings under expandable segments that began mid-run (after a warm-up, or
/// a wrapped ring): the ranges held then are rebuilt from the dump and adopted (rule 18f), and
/// the replay gets PyTorch's peaks over the window and ends in the dump block for block.
#[test]
fn mid_run_recordings_under_expandable_segments_start_from_their_rebuilt_ranges() {
    let dir = root().join("tests/fixtures/expandable");
    let mut checked = 0;
    for stem in ["resnet50_warm_expandable", "unet_wrapped_expandable"] {
        let figures = read_json(&dir.join(format!("{stem}.json")));
        let dev = &figures["devices"][0];
        let path = dir.join(format!("{stem}.pickle.gz"));
        let j = replay(&[path.to_str().unwrap(), "--pytorch"]);
        assert_eq!(
            j["start"]["state"], "reconstructed",
            "{stem}: {}",
            j["start"]
        );
        assert_eq!(
            j["start"]["replayed_from"], "exact",
            "{stem}: {}",
            j["start"]
        );
        assert_eq!(
            j["self_check"]["matches"],
            Value::Bool(true),
            "{stem}: {}",
            j["self_check"]
        );
        assert_eq!(
            j["peak_reserved_bytes"], dev["max_memory_reserved"],
            "{stem}"
        );
        assert_eq!(
            j["peak_allocated_bytes"], dev["max_memory_allocated"],
            "{stem}"
        );
        checked += 1;
    }
    assert_eq!(checked, 2);
}

#[test]
fn every_trace_replays_under_expandable_segments_to_pytorchs_own_peak() {
    let results = read_json(&root().join("results/pytorch-replay-2026-12-01/results.json"));
    let mut checked = 0;
    for row in results["rows"].as_array().unwrap() {
        let trace = row["trace"].as_str().unwrap();
        if trace.starts_with("rec__") {
            continue; // checked against their own recordings above
        }
        // PyTorch under the trace's own settings plus expandable segments when the trace had
        // settings of its own, else PyTorch's defaults plus expandable segments.
        // A derived fixture (same operations as another trace) carries no sidecar, so no
        // memory fraction: it replays under the defaults plus expandable segments.
        let own_settings = row["same_operations_as"].is_null()
            && (row["recorded_conf"].as_str().is_some_and(|c| !c.is_empty())
                || !row["recorded_memory_fraction"].is_null());
        let column = if own_settings {
            "pytorch_recorded_expandable_max_reserved"
        } else {
            "pytorch_expandable_max_reserved"
        };
        let want = row[column]
            .as_u64()
            .unwrap_or_else(|| panic!("{trace}: no PyTorch figure in {column}"));
        let device = row["device"].as_u64().unwrap().to_string();
        let snapshot = row["snapshot"].as_str().unwrap();
        let mut args = vec![
            snapshot,
            "--pytorch",
            "--config",
            "expandable_segments:True",
            "--device",
            &device,
        ];
        if row["start"].as_str() != Some("fresh") {
            args.extend(["--start", "live-tensors"]);
        }
        let j = replay(&args);
        assert_eq!(j["peak_reserved_bytes"].as_u64(), Some(want), "{trace}");
        checked += 1;
    }
    assert!(checked >= 20, "only {checked} traces checked");
}

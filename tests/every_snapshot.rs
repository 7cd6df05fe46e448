//! Issue 23's snapshots (`tests/fixtures/user/`, recorded by `scripts/record_user_snapshots.py`
//! with PyTorch 2.11 on an H200 the way users record them): wrapped rings with frames, a
//! mid-run start under expandable segments, CUDA graphs' and MemPool's private pools, a memory
//! fraction set in the program under a garbage-collection threshold, settings changed at run
//! time.

use std::path::PathBuf;

use cachalot::Settings;
use cachalot_tools::replay::{ReplayConfig, ReplayOptions, SnapshotExt, replay, replay_ops_from};
use cachalot_tools::selfcheck::check_final_state;
use cachalot_tools::snapshot::{Snapshot, read_figures_for, read_snapshot};

mod common;
use common::fixtures_root;

fn user(name: &str) -> PathBuf {
    fixtures_root()
        .join("user")
        .join(format!("{name}.pickle.gz"))
}

fn sidecar(name: &str) -> serde_json::Value {
    let path = fixtures_root().join("user").join(format!("{name}.json"));
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn config(snapshot: &Snapshot, fraction: Option<f64>, capacity: u64) -> ReplayConfig {
    let conf = snapshot
        .allocator_settings
        .as_ref()
        .map(|s| s.alloc_conf.clone())
        .unwrap_or_default();
    let mut settings = Settings::pytorch().apply(&conf).unwrap();
    settings.per_process_memory_fraction = fraction;
    ReplayConfig {
        settings,
        capacity,
        timeline: true,
        ..ReplayConfig::pytorch()
    }
}

#[test]
fn a_fraction_set_in_the_program_reproduces_the_garbage_collectors_frees() {
    let name = "resnet50_fraction";
    let snapshot = read_snapshot(&user(name)).unwrap();
    let side = sidecar(name);
    let figures = read_figures_for(
        &fixtures_root().join("user").join(format!("{name}.json")),
        0,
    )
    .unwrap();
    let fraction = side["memory_fraction"].as_f64().unwrap();
    let options = ReplayOptions::from_settings(snapshot.allocator_settings.as_ref());
    let start = snapshot.start_of(0).unwrap();
    let (program, report) = replay_ops_from(&snapshot.traces[0], &options, &start);
    eprintln!("{report:?}");
    let out = replay(
        &program,
        &config(&snapshot, Some(fraction), figures.device_total_memory),
    )
    .unwrap();
    let check = check_final_state(&out.final_layout, &snapshot, 0);
    eprintln!(
        "reserved {} allocated {} frees {} allocs {} check {:?}",
        out.peak_reserved_bytes,
        out.peak_allocated_bytes,
        out.stats.num_device_free,
        out.stats.num_device_alloc,
        check.first_difference
    );
    assert_eq!(out.peak_reserved_bytes, figures.max_memory_reserved);
    assert_eq!(out.peak_allocated_bytes, figures.max_memory_allocated);
    assert!(check.matches, "{:?}", check.first_difference);
}

/// Replays `name`'s trace of device 0 under its recorded settings (and `fraction`), from the
/// state rebuilt at its first entry.
fn replay_user(
    name: &str,
    fraction: Option<f64>,
) -> (Snapshot, cachalot_tools::replay::ReplayOutcome) {
    let snapshot = read_snapshot(&user(name)).unwrap();
    let figures = read_figures_for(
        &fixtures_root().join("user").join(format!("{name}.json")),
        0,
    )
    .unwrap();
    let options = ReplayOptions::from_settings(snapshot.allocator_settings.as_ref());
    let start = snapshot
        .start_of(0)
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let (program, _) = replay_ops_from(&snapshot.traces[0], &options, &start);
    let out = replay(
        &program,
        &config(&snapshot, fraction, figures.device_total_memory),
    )
    .unwrap();
    (snapshot, out)
}

#[test]
fn cuda_graph_and_compiled_graph_private_pools_replay_to_pytorchs_figures_and_dump() {
    for name in ["cuda_graph_mlp", "compile_reduce_overhead"] {
        let (snapshot, out) = replay_user(name, None);
        let figures = read_figures_for(
            &fixtures_root().join("user").join(format!("{name}.json")),
            0,
        )
        .unwrap();
        assert!(
            snapshot.segments.iter().any(|s| s.pool_id != (0, 0)),
            "{name}: the dump names private pools"
        );
        let check = check_final_state(&out.final_layout, &snapshot, 0);
        assert!(check.matches, "{name}: {:?}", check.first_difference);
        assert_eq!(
            out.peak_reserved_bytes, figures.max_memory_reserved,
            "{name}"
        );
        assert_eq!(
            out.peak_allocated_bytes, figures.max_memory_allocated,
            "{name}"
        );
        assert_eq!(
            out.stats.num_device_alloc as i64,
            figures.stat("num_device_alloc").unwrap(),
            "{name}"
        );
        assert_eq!(
            out.stats.num_device_free as i64,
            figures.stat("num_device_free").unwrap(),
            "{name}"
        );
    }
}

/// Recorded under `expandable_segments:True` after three warm-up steps: the ranges held when
/// recording began are rebuilt from the dump (rule 18f) and the replay starts from them.
#[test]
fn a_mid_run_start_under_expandable_segments_replays_to_pytorchs_figures_and_dump() {
    let name = "lstm_expandable_warm";
    let side = sidecar(name);
    let at_start = &side["stats_at_start"][0];
    let snapshot = read_snapshot(&user(name)).unwrap();
    let start = snapshot.start_of(0).unwrap();
    // The state PyTorch's own figures give when recording began: its reserved bytes (the
    // mapped runs of the ranges) and its allocated bytes (the live blocks).
    assert!(
        start.segments.iter().all(|s| s.range.is_some()),
        "{start:?}"
    );
    assert_eq!(
        Some(start.reserved_bytes()),
        at_start["memory_reserved"].as_u64()
    );
    let live: u64 = start.live_blocks().map(|(_, b)| b.size).sum();
    assert_eq!(Some(live), at_start["memory_allocated"].as_u64());
    let (snapshot, out) = replay_user(name, None);
    let figures = read_figures_for(
        &fixtures_root().join("user").join(format!("{name}.json")),
        0,
    )
    .unwrap();
    let check = check_final_state(&out.final_layout, &snapshot, 0);
    assert!(check.matches, "{:?}", check.first_difference);
    assert_eq!(out.peak_reserved_bytes, figures.max_memory_reserved);
    assert_eq!(out.peak_allocated_bytes, figures.max_memory_allocated);
    // The pages mapped during the trace: PyTorch's counter at the dump less at the start.
    let before = at_start["memory_stats"]["num_device_alloc"]
        .as_i64()
        .unwrap();
    assert_eq!(
        out.stats.num_device_alloc as i64,
        figures.stat("num_device_alloc").unwrap() - before
    );
}

#[test]
fn wrapped_rings_with_frames_replay_to_pytorchs_window_and_dump() {
    for name in [
        "diffusion_wrapped",
        "diffusion_multires_wrapped",
        "gpt2_bf16_wrapped",
    ] {
        let (snapshot, out) = replay_user(name, None);
        let check = check_final_state(&out.final_layout, &snapshot, 0);
        assert!(check.matches, "{name}: {:?}", check.first_difference);
        let side = sidecar(name);
        assert_eq!(
            side["reset_after_in_trace"][0], true,
            "{name}: the reset is in the window"
        );
    }
}

#[test]
fn the_fraction_a_program_set_is_found_from_its_trace() {
    use cachalot_tools::find_fraction::find_cap;
    let name = "resnet50_fraction";
    let snapshot = read_snapshot(&user(name)).unwrap();
    let side = sidecar(name);
    let figures = read_figures_for(
        &fixtures_root().join("user").join(format!("{name}.json")),
        0,
    )
    .unwrap();
    let options = ReplayOptions::from_settings(snapshot.allocator_settings.as_ref());
    let start = snapshot.start_of(0).unwrap();
    let (program, _) = replay_ops_from(&snapshot.traces[0], &options, &start);
    let cfg = config(&snapshot, None, figures.device_total_memory);
    let found = find_cap(&program, &snapshot, 0, &cfg).expect("a cap reproduces the trace");
    let set = side["memory_fraction_bytes"].as_u64().unwrap();
    eprintln!("found {found:?}, the program set {set}");
    assert_eq!(found.device_frees, 32);
    assert!(found.cap_bytes <= set, "{found:?} > {set}");
    // Under the cap found, the replay is PyTorch's to the byte.
    let mut at = config(&snapshot, None, figures.device_total_memory);
    at.settings.per_process_memory_fraction =
        Some(found.cap_bytes as f64 / figures.device_total_memory as f64);
    let out = replay(&program, &at).unwrap();
    assert_eq!(out.peak_reserved_bytes, figures.max_memory_reserved);
    assert_eq!(out.peak_allocated_bytes, figures.max_memory_allocated);
}

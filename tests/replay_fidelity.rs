//! Byte-exact fidelity: every committed PyTorch trace, replayed through cachalot's allocator on
//! the simulated device with the settings it was recorded with, gives PyTorch's own figures.

use cachalot_tools::replay::{replay, replay_ops};
use cachalot_tools::snapshot::{read_figures, read_snapshot};

mod common;
use common::recorded_config as config_for;
use common::traces as fixtures;

#[test]
fn every_fixture_replays_to_pytorchs_own_figures() {
    let mut checked = 0;
    let mut failures = Vec::new();
    let mut entries: Vec<_> = std::fs::read_dir(fixtures())
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for pickle in entries
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "pickle"))
    {
        let figures = read_figures(&pickle.with_extension("json")).unwrap();
        let snapshot = read_snapshot(pickle).unwrap();
        let trace = snapshot
            .traces
            .iter()
            .find(|t| !t.entries.is_empty())
            .expect("a device trace");
        let program = replay_ops(trace);
        let out = replay(&program, &config_for(&figures)).unwrap();
        let name = pickle.file_stem().unwrap().to_string_lossy().to_string();
        let checks = [
            (
                "max_memory_reserved",
                out.peak_reserved_bytes as i64,
                figures.max_memory_reserved as i64,
            ),
            (
                "max_memory_allocated",
                out.peak_allocated_bytes as i64,
                figures.max_memory_allocated as i64,
            ),
            (
                "segment.all.peak",
                out.peak_segments as i64,
                figures.stat("segment.all.peak").unwrap(),
            ),
            (
                "num_device_alloc",
                out.device_allocs as i64,
                figures.stat("num_device_alloc").unwrap(),
            ),
            (
                "num_device_free",
                out.device_frees as i64,
                figures.stat("num_device_free").unwrap(),
            ),
            (
                "num_ooms",
                out.ooms as i64,
                figures.stat("num_ooms").unwrap(),
            ),
            (
                "num_alloc_retries",
                out.stats.num_alloc_retries as i64,
                figures.stat("num_alloc_retries").unwrap(),
            ),
            (
                "num_sync_all_streams",
                out.stats.num_sync_all_streams as i64,
                figures.stat("num_sync_all_streams").unwrap(),
            ),
            (
                "inactive_split_bytes.all.peak",
                out.stats.inactive_split_bytes.all.peak,
                figures.stat("inactive_split_bytes.all.peak").unwrap(),
            ),
            (
                "requested_bytes.all.peak",
                out.stats.requested_bytes.all.peak,
                figures.stat("requested_bytes.all.peak").unwrap(),
            ),
            (
                "active_bytes.all.peak",
                out.stats.active_bytes.all.peak,
                figures.stat("active_bytes.all.peak").unwrap(),
            ),
        ];
        for (what, ours, theirs) in checks {
            if ours != theirs {
                failures.push(format!("{name}: {what}: cachalot {ours}, PyTorch {theirs}"));
            }
        }
        checked += 1;
    }
    assert!(checked >= 8, "only {checked} fixtures found");
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

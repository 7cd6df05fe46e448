//! Export (`cachalot replay --snapshot-out` underneath): the allocator's state and history,
//! written as a PyTorch snapshot, read back and replayed on the simulated device with its own
//! segment addresses, reproduce the replay that wrote them — on every committed trace.

use std::path::PathBuf;

use cachalot::Settings;
use cachalot_tools::export::{segment_states, snapshot_of};
use cachalot_tools::replay::{ReplayConfig, ReplayOptions, replay, replay_ops_with};
use cachalot_tools::snapshot::{parse_snapshot, read_figures, read_snapshot, write_snapshot};

mod common;
use common::recorded_config as config_for;
use common::traces as fixtures;

#[test]
fn every_fixture_replays_from_its_cachalot_snapshot_to_the_same_peak_and_layout() {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(fixtures())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "pickle"))
        .collect();
    entries.sort();
    assert!(entries.len() >= 8);
    for pickle in entries {
        let name = pickle.file_stem().unwrap().to_string_lossy().to_string();
        let figures = read_figures(&pickle.with_extension("json")).unwrap();
        let original = read_snapshot(&pickle).unwrap();
        let options = ReplayOptions::from_settings(original.allocator_settings.as_ref());
        let trace = original
            .traces
            .iter()
            .find(|t| !t.entries.is_empty())
            .unwrap();
        let program = replay_ops_with(trace, &options).0;
        let config = ReplayConfig {
            record_history: true,
            ..config_for(&figures)
        };
        let first = replay(&program, &config).unwrap();
        assert_eq!(
            first.peak_reserved_bytes, figures.max_memory_reserved,
            "{name}"
        );

        let snapshot = snapshot_of(&first.final_layout, &first.history, &config.settings, 0);
        let mut bytes = Vec::new();
        write_snapshot(&snapshot, &mut bytes).unwrap();
        let back = parse_snapshot(&bytes).unwrap();
        assert_eq!(back, snapshot, "{name}: the snapshot reads back as written");

        let recorded = back.allocator_settings.as_ref().unwrap();
        let settings = Settings::pytorch().apply(&recorded.alloc_conf).unwrap();
        assert_eq!(settings, config.settings, "{name}: settings round-trip");
        let program2 = replay_ops_with(
            &back.traces[0],
            &ReplayOptions::from_settings(Some(recorded)),
        )
        .0;
        let second = replay(
            &program2,
            &ReplayConfig {
                settings,
                capacity: figures.device_total_memory,
                record_history: true,
                ..ReplayConfig::pytorch()
            },
        )
        .unwrap();
        assert_eq!(
            second.peak_reserved_bytes, first.peak_reserved_bytes,
            "{name}"
        );
        assert_eq!(
            second.peak_allocated_bytes, first.peak_allocated_bytes,
            "{name}"
        );
        assert_eq!(second.peak_segments, first.peak_segments, "{name}");
        assert_eq!(second.device_allocs, first.device_allocs, "{name}");
        assert_eq!(second.device_frees, first.device_frees, "{name}");
        assert_eq!(second.ooms, first.ooms, "{name}");
        assert_eq!(second.final_layout, first.final_layout, "{name}");
        assert_eq!(
            segment_states(&second.final_layout, 0),
            back.segments,
            "{name}"
        );
        // A fixed point: cachalot's trace of its own trace is that trace.
        assert_eq!(second.history, first.history, "{name}: history");
    }
}

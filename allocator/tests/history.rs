//! The history recorder's switch on the front end (`Allocator::record_history`): `Some(n)`
//! with n > 0 records, `Some(0)` and `None` stop. Guards the mutant that turned the `n > 0`
//! filter into `n < 0` (never recording), which only the doc test caught before.
#![cfg(not(loom))]

use cachalot::{Allocator, HistoryOptions, Settings, SimDevice, StreamId};

#[test]
fn record_history_some_positive_records_and_zero_or_none_stops() {
    let alloc = Allocator::new(SimDevice::new(1 << 30), Settings::default()).unwrap();
    alloc.record_history(Some(100_000));
    let p = alloc.malloc(4096, StreamId(0)).unwrap();
    alloc.free(p).unwrap();
    let recorded = alloc.history().len();
    assert!(
        recorded >= 2,
        "a malloc and a free while recording left {recorded} entries"
    );
    alloc.record_history(Some(0));
    assert!(
        alloc.history().is_empty(),
        "Some(0) must stop recording and clear the history"
    );
    let q = alloc.malloc(4096, StreamId(0)).unwrap();
    alloc.free(q).unwrap();
    assert!(
        alloc.history().is_empty(),
        "nothing is recorded after Some(0)"
    );
    alloc.record_history(Some(10));
    alloc.record_history(None);
    assert!(alloc.history().is_empty());
}

/// `Allocator::history_options` says how the front end records: what the last
/// `record_history_with` or `record_history` asked for, and `None` when it does not record.
#[test]
fn history_options_report_what_the_last_switch_asked_for() {
    let alloc = Allocator::new(SimDevice::new(1 << 30), Settings::default()).unwrap();
    assert_eq!(alloc.history_options(), None);
    let traced = HistoryOptions::new(7).with_backtraces(true);
    alloc.record_history_with(Some(traced));
    assert_eq!(alloc.history_options(), Some(traced));
    alloc.record_history(Some(3));
    assert_eq!(alloc.history_options(), Some(HistoryOptions::new(3)));
    alloc.record_history(None);
    assert_eq!(alloc.history_options(), None);
}

#[test]
fn the_front_ends_snapshot_shows_its_device_and_segments_and_dumps_as_pytorchs_pickle() {
    // What a user of `Allocator` on device 2 gets from `settings`, `snapshot` and
    // `dump_snapshot`: the settings given, the segment held and the recorded trace, both on
    // device 2, and a pickle file `torch.cuda.memory._memory_viz` reads.
    use cachalot::CachingCore;
    let settings = Settings::pytorch();
    assert_ne!(settings, Settings::default());
    let core = CachingCore::new(SimDevice::new(1 << 30), settings.clone())
        .unwrap()
        .with_device_index(2);
    let alloc = Allocator::from_core(core);
    assert_eq!(alloc.settings(), settings);
    alloc.record_history(Some(100));
    let _p = alloc.malloc(4096, StreamId(0)).unwrap();
    let snapshot = alloc.snapshot();
    assert_eq!(snapshot.segments.len(), 1);
    assert_eq!(snapshot.segments[0].device, 2);
    assert!(
        snapshot
            .traces
            .iter()
            .any(|t| t.device == 2 && !t.entries.is_empty()),
        "{:?}",
        snapshot.traces
    );
    let path = std::env::temp_dir().join(format!(
        "cachalot-front-end-snapshot-{}.pickle",
        std::process::id()
    ));
    alloc.dump_snapshot(&path).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(bytes.first(), Some(&0x80), "a pickle starts with PROTO");
    assert_eq!(bytes.last(), Some(&b'.'), "and ends with STOP");
    assert!(bytes.len() > 200, "{} bytes", bytes.len());
}

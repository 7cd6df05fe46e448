//! write_snapshot → parse_snapshot gives back the same snapshot; the protocol 2, 3 and 5 and
//! gzip forms of a recorded snapshot read the same as the protocol 4 original.
//!
//! With `CACHALOT_WRITE_ROUNDTRIP_DIR=DIR`, the tests also leave what they wrote in DIR (each
//! re-written fixture under its own name, and `hand_built.pickle`), for
//! `scripts/check_memory_viz.sh` on a machine with PyTorch.

use std::io::Write;
use std::path::PathBuf;

use cachalot_tools::snapshot::{
    Action, AllocatorSettings, BlockState, BlockStatus, DeviceTrace, FrameTable, SegmentState,
    SegmentType, Snapshot, StackId, TraceEntry, parse_snapshot, read_snapshot, write_snapshot,
};

mod common;
use common::fixtures_root as fixtures;

fn write(s: &Snapshot) -> Vec<u8> {
    let mut out = Vec::new();
    write_snapshot(s, &mut out).unwrap();
    out
}

fn tiny() -> Snapshot {
    let mib = 1u64 << 20;
    let base = 0x7f00_0000_0000u64;
    let entry = |action: Action, addr: u64, size: u64, stream: u64, time_us: i64| TraceEntry {
        action,
        addr,
        size,
        stream,
        time_us,
        stack: StackId::EMPTY,
    };
    Snapshot {
        segments: vec![
            SegmentState {
                device: 0,
                address: base,
                total_size: 20 * mib,
                allocated_size: 4 * mib,
                active_size: 7 * mib,
                requested_size: 4 * mib - 100,
                stream: 0,
                segment_type: SegmentType::Large,
                is_expandable: false,
                pool_id: (0, 0),
                stack: StackId::EMPTY,
                blocks: vec![
                    BlockState {
                        address: base,
                        size: 4 * mib,
                        requested_size: 4 * mib - 100,
                        state: BlockStatus::ActiveAllocated,
                        stack: StackId::EMPTY,
                    },
                    BlockState {
                        address: base + 4 * mib,
                        size: 3 * mib,
                        requested_size: 3 * mib,
                        state: BlockStatus::ActivePendingFree,
                        stack: StackId::EMPTY,
                    },
                    BlockState {
                        address: base + 7 * mib,
                        size: 13 * mib,
                        requested_size: 0,
                        state: BlockStatus::Inactive,
                        stack: StackId::EMPTY,
                    },
                ],
            },
            SegmentState {
                device: 1,
                address: base + (1 << 40),
                total_size: 2 * mib,
                allocated_size: 0,
                active_size: 0,
                requested_size: 0,
                stream: 94_000_000_123,
                segment_type: SegmentType::Small,
                is_expandable: true,
                pool_id: (0, 0),
                stack: StackId::EMPTY,
                blocks: vec![BlockState {
                    address: base + (1 << 40),
                    size: 2 * mib,
                    requested_size: 0,
                    state: BlockStatus::Inactive,
                    stack: StackId::EMPTY,
                }],
            },
        ],
        traces: vec![
            DeviceTrace {
                device: 0,
                entries: vec![
                    entry(
                        Action::SegmentAlloc,
                        base,
                        20 * mib,
                        0,
                        1_700_000_000_000_000,
                    ),
                    entry(Action::Alloc, base, 4 * mib - 100, 0, 1_700_000_000_000_001),
                    entry(
                        Action::Alloc,
                        base + 4 * mib,
                        3 * mib,
                        0,
                        1_700_000_000_000_002,
                    ),
                    entry(Action::FreeRequested, base + 4 * mib, 3 * mib, 0, -3),
                    entry(Action::Oom, 123_456_789, 80 << 30, 0, 4),
                    entry(Action::Snapshot, 0, 7 * mib, 0, 5),
                    entry(Action::Other("annotate".into()), base, 0, 0, 6),
                    entry(Action::SegmentMap, base, 2 * mib, 0, 7),
                    entry(Action::SegmentUnmap, base, 2 * mib, 0, 8),
                    entry(Action::UserDefined, 0, 0, 0, 9),
                    entry(Action::FreeCompleted, base, 1, 0, 10),
                    entry(Action::SegmentFree, base, 20 * mib, 0, 11),
                ],
            },
            DeviceTrace {
                device: 1,
                entries: vec![entry(
                    Action::SegmentAlloc,
                    base + (1 << 40),
                    2 * mib,
                    94_000_000_123,
                    0,
                )],
            },
            DeviceTrace {
                device: 2,
                entries: vec![],
            },
        ],
        allocator_settings: Some(AllocatorSettings {
            alloc_conf: "max_split_size_mb:64,roundup_power2_divisions:[256:1,>:4]".into(),
            max_split_size: Some(64 * mib),
            garbage_collection_threshold: 0.5,
            expandable_segments: true,
            roundup_power2_divisions: (0..16).map(|i| if i < 8 { 1 } else { 4 }).collect(),
        }),
        frames: FrameTable::default(),
    }
}

#[test]
fn a_hand_built_snapshot_round_trips() {
    let snap = tiny();
    let bytes = write(&snap);
    assert!(
        bytes.starts_with(b"\x80\x04"),
        "the writer writes protocol 4"
    );
    if let Some(out) = std::env::var_os("CACHALOT_WRITE_ROUNDTRIP_DIR").map(PathBuf::from) {
        std::fs::create_dir_all(&out).unwrap();
        std::fs::write(out.join("hand_built.pickle"), &bytes).unwrap();
    }
    let back = parse_snapshot(&bytes).unwrap();
    assert_eq!(back, snap);
    assert_eq!(write(&back), bytes, "writing is deterministic");

    let mut without = snap.clone();
    without.allocator_settings = None;
    assert_eq!(parse_snapshot(&write(&without)).unwrap(), without);
    let empty = Snapshot::default();
    assert_eq!(parse_snapshot(&write(&empty)).unwrap(), empty);
}

#[test]
fn a_changed_field_does_not_round_trip_to_the_original() {
    // guards the round-trip test itself: equality sees every field
    let snap = tiny();
    let mut other = snap.clone();
    other.traces[0].entries[4].addr += 1; // device_free of the OOM entry
    assert_ne!(parse_snapshot(&write(&other)).unwrap(), snap);
    let mut other = snap.clone();
    other.segments[1].is_expandable = false;
    assert_ne!(parse_snapshot(&write(&other)).unwrap(), snap);
}

#[test]
fn every_fixture_round_trips() {
    let out_dir = std::env::var_os("CACHALOT_WRITE_ROUNDTRIP_DIR").map(PathBuf::from);
    let dir = fixtures().join("traces");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|x| x != "pickle") {
            continue;
        }
        let snap = read_snapshot(&path).unwrap();
        let bytes = write(&snap);
        let back = parse_snapshot(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert_eq!(back, snap, "{}", path.display());
        if let Some(out) = &out_dir {
            std::fs::create_dir_all(out).unwrap();
            std::fs::write(out.join(path.file_name().unwrap()), &bytes).unwrap();
        }
        n += 1;
    }
    assert!(n >= 10);
}

#[test]
fn other_protocols_and_gzip_read_the_same() {
    let traces = fixtures().join("traces");
    let derived = fixtures().join("derived");
    for (name, protocols) in [
        ("seed_experiment", &[2, 3, 5][..]),
        ("fraction_oom_retry", &[5]),
        ("two_stream", &[5]),
    ] {
        let original = read_snapshot(&traces.join(format!("{name}.pickle"))).unwrap();
        for p in protocols {
            let path = derived.join(format!("{name}.proto{p}.pickle"));
            let bytes = std::fs::read(&path).unwrap();
            assert_eq!(bytes[..2], [0x80, *p as u8], "{}", path.display());
            assert_eq!(
                read_snapshot(&path).unwrap(),
                original,
                "{}",
                path.display()
            );
        }
        let raw = std::fs::read(traces.join(format!("{name}.pickle"))).unwrap();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        gz.write_all(&raw).unwrap();
        assert_eq!(
            parse_snapshot(&gz.finish().unwrap()).unwrap(),
            original,
            "{name} gzip"
        );
    }
}

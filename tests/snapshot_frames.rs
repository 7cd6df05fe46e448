//! Snapshots recorded the way users record them (`_record_memory_history()` at its defaults:
//! stack frames on every entry, block and segment) read, keep their frames interned, read the
//! same in every protocol, and write back to themselves.
//!
//! The expected figures were read with Python's own `pickle` (Python 3.12):
//! `d = pickle.load(gzip.open(PATH))`, distinct frames as the set of
//! `(name, filename, line)` over every `frames` list of segments, blocks and trace entries,
//! distinct stacks as the set of those tuples per list (the empty stack included where one
//! occurs), references as the sum of the lists' lengths.

use std::io::Write;

use cachalot_tools::snapshot::{
    Action, AllocatorSettings, BlockState, BlockStatus, DeviceTrace, Frame, FrameTable,
    SegmentState, SegmentType, Snapshot, SnapshotError, StackId, TraceEntry, parse_snapshot,
    read_snapshot, write_snapshot,
};

mod common;
use common::fixtures_root as fixtures;

fn user(name: &str) -> Snapshot {
    read_snapshot(&fixtures().join("user").join(format!("{name}.pickle.gz")))
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Frame references of a snapshot (what the pickle's lists hold, counted with repeats).
fn references(s: &Snapshot) -> usize {
    let n = |id: StackId| s.frames.stack(id).len();
    s.segments
        .iter()
        .map(|seg| n(seg.stack) + seg.blocks.iter().map(|b| n(b.stack)).sum::<usize>())
        .sum::<usize>()
        + s.traces
            .iter()
            .flat_map(|t| &t.entries)
            .map(|e| n(e.stack))
            .sum::<usize>()
}

fn frame(name: &str, filename: &str, line: u64) -> Frame {
    Frame {
        name: name.into(),
        filename: filename.into(),
        line,
    }
}

const SCRIPT: &str = "/work/main/scripts/record_user_snapshots.py";

#[test]
fn user_fixtures_read_with_their_frames() {
    // (name, entries per device, distinct frames, distinct stacks, references), from Python
    for (name, entries, frames, stacks, refs) in [
        ("gpt2_train_frames", &[3572, 0][..], 576, 119, 147_811),
        ("resnet50_warm", &[3957, 0], 334, 117, 140_728),
        ("unet_wrapped", &[1500, 1], 341, 74, 57_014),
        ("two_devices", &[211, 290], 266, 40, 17_986),
    ] {
        let s = user(name);
        let lens: Vec<usize> = s.traces.iter().map(|t| t.entries.len()).collect();
        assert_eq!(lens, entries, "{name}");
        assert_eq!(s.frames.num_frames(), frames, "{name}");
        // Python's set counts the empty stack only where one occurs; the table always has it
        let python_stacks = s.frames.num_stacks() - usize::from(!uses_empty(&s));
        assert_eq!(python_stacks, stacks, "{name}");
        assert_eq!(references(&s), refs, "{name}");
        assert!(s.frames.num_stacks() * 100 < refs, "{name}");
    }
}

fn uses_empty(s: &Snapshot) -> bool {
    s.segments
        .iter()
        .any(|seg| seg.stack == StackId::EMPTY || seg.blocks.iter().any(|b| b.stack.0 == 0))
        || s.traces
            .iter()
            .flat_map(|t| &t.entries)
            .any(|e| e.stack == StackId::EMPTY)
}

#[test]
fn known_entries_have_the_frames_python_reads() {
    // d['device_traces'][0][100]: an alloc with 106 frames, innermost
    // torch::unwind::unwind() (??:0), outermost <module> of the recording script, line 338
    let s = user("gpt2_train_frames");
    let e = &s.traces[0].entries[100];
    assert_eq!(e.action, Action::Alloc);
    let stack: Vec<&Frame> = s.frames.stack(e.stack).collect();
    assert_eq!(stack.len(), 106);
    assert_eq!(*stack[0], frame("torch::unwind::unwind()", "??", 0));
    assert_eq!(*stack[105], frame("<module>", SCRIPT, 338));
    // unet_wrapped d['device_traces'][0][10]: an alloc with 28 frames ending in __clone
    let s = user("unet_wrapped");
    let e = &s.traces[0].entries[10];
    assert_eq!(e.action, Action::Alloc);
    let stack: Vec<&Frame> = s.frames.stack(e.stack).collect();
    assert_eq!(stack.len(), 28);
    assert_eq!(*stack[27], frame("__clone", "??", 0));
}

#[test]
fn the_large_generation_snapshot_reads_with_few_stacks() {
    // 39.3 MB uncompressed, 128,897 entries; Python: 277 distinct frames, 102 distinct stacks,
    // 11,138,572 frame references; d['device_traces'][0][100] is a segment_alloc with 110
    // frames
    let s = user("gpt2_generate_large");
    assert_eq!(s.traces[0].entries.len(), 128_897);
    assert_eq!(s.frames.num_frames(), 277);
    assert_eq!(s.frames.num_stacks() - usize::from(!uses_empty(&s)), 102);
    assert_eq!(references(&s), 11_138_572);
    let e = &s.traces[0].entries[100];
    assert_eq!(e.action, Action::SegmentAlloc);
    assert_eq!(s.frames.stack(e.stack).len(), 110);
    assert_eq!(
        s.frames.stack(e.stack).last(),
        Some(&frame("<module>", SCRIPT, 338))
    );
}

#[test]
fn protocols_and_gzip_of_a_frame_bearing_snapshot_read_the_same() {
    // two_devices_tiny: two_devices cut to its first 2 segments and 3 entries per device,
    // dumped by Python's pickle in protocols 2-5 (tests/fixtures/README.md); Python: 74
    // distinct frames, 4 distinct stacks; d['device_traces'][1][2] is a segment_alloc of 50
    // frames whose second is torch::CapturedTraceback::gather(bool, bool, bool)
    let derived = fixtures().join("derived");
    let path = |p: u8| derived.join(format!("two_devices_tiny.proto{p}.pickle"));
    let original = read_snapshot(&path(4)).unwrap();
    assert_eq!(original.frames.num_frames(), 74);
    assert_eq!(
        original.frames.num_stacks() - usize::from(!uses_empty(&original)),
        4
    );
    let e = &original.traces[1].entries[2];
    assert_eq!(e.action, Action::SegmentAlloc);
    let stack: Vec<&Frame> = original.frames.stack(e.stack).collect();
    assert_eq!(stack.len(), 50);
    assert_eq!(
        stack[1].name,
        "torch::CapturedTraceback::gather(bool, bool, bool)"
    );
    for p in [2u8, 3, 5] {
        let bytes = std::fs::read(path(p)).unwrap();
        assert_eq!(bytes[..2], [0x80, p]);
        assert_eq!(read_snapshot(&path(p)).unwrap(), original, "protocol {p}");
    }
    let raw = std::fs::read(path(4)).unwrap();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(&raw).unwrap();
    assert_eq!(parse_snapshot(&gz.finish().unwrap()).unwrap(), original);
}

#[test]
fn every_prefix_of_a_frame_bearing_snapshot_is_truncated() {
    let bytes = std::fs::read(fixtures().join("derived/two_devices_tiny.proto4.pickle")).unwrap();
    for n in 1..bytes.len() {
        match parse_snapshot(&bytes[..n]) {
            Err(SnapshotError::Truncated { .. }) => {}
            other => panic!("prefix of {n} bytes: {other:?}"),
        }
    }
}

#[test]
fn frame_bearing_snapshots_write_back_to_themselves() {
    for name in ["two_devices", "unet_wrapped", "gpt2_train_frames"] {
        let s = user(name);
        let mut bytes = Vec::new();
        write_snapshot(&s, &mut bytes).unwrap();
        let back = parse_snapshot(&bytes).unwrap();
        assert_eq!(back, s, "{name}");
        // the writer memoises shared stacks and strings as PyTorch's pickler does: its output
        // is no larger than PyTorch's (which also holds compile_context and user_metadata)
        let mut python = Vec::new();
        let gz = std::fs::read(fixtures().join("user").join(format!("{name}.pickle.gz"))).unwrap();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&gz[..]), &mut python)
            .unwrap();
        assert!(
            bytes.len() < python.len(),
            "{name}: {} bytes, Python's {}",
            bytes.len(),
            python.len()
        );
    }
}

fn hand_built() -> Snapshot {
    let mut frames = FrameTable::default();
    let a = frames.intern_stack([frame("malloc", "alloc.cpp", 10), frame("main", "m.py", 3)]);
    let b = frames.intern_stack([frame("main", "m.py", 3)]);
    let c = frames.intern_stack([frame("free", "free.cpp", 1), frame("main", "m.py", 4)]);
    assert_eq!(frames.intern_stack([frame("main", "m.py", 3)]), b);
    assert_eq!((frames.num_frames(), frames.num_stacks()), (4, 4));
    let entry = |action, addr, stack| TraceEntry {
        action,
        addr,
        size: 512,
        stream: 0,
        time_us: 1,
        stack,
    };
    Snapshot {
        segments: vec![SegmentState {
            device: 0,
            address: 1 << 20,
            total_size: 2 << 20,
            allocated_size: 512,
            active_size: 512,
            requested_size: 512,
            stream: 0,
            segment_type: SegmentType::Small,
            is_expandable: false,
            pool_id: (0, 0),
            stack: a,
            blocks: vec![
                BlockState {
                    address: 1 << 20,
                    size: 512,
                    requested_size: 512,
                    state: BlockStatus::ActiveAllocated,
                    stack: b,
                },
                BlockState {
                    address: (1 << 20) + 512,
                    size: (2 << 20) - 512,
                    requested_size: 0,
                    state: BlockStatus::Inactive,
                    stack: StackId::EMPTY,
                },
            ],
        }],
        traces: vec![DeviceTrace {
            device: 0,
            entries: vec![
                entry(Action::Alloc, 1 << 20, b),
                entry(Action::FreeRequested, 1 << 20, c),
                entry(Action::Alloc, 1 << 20, b),
                entry(Action::Alloc, 1 << 20, StackId::EMPTY),
            ],
        }],
        allocator_settings: Some(AllocatorSettings::default()),
        frames,
    }
}

#[test]
fn a_hand_built_frame_bearing_snapshot_round_trips() {
    let s = hand_built();
    let mut bytes = Vec::new();
    write_snapshot(&s, &mut bytes).unwrap();
    assert_eq!(parse_snapshot(&bytes).unwrap(), s);
    // a different frame is seen
    let mut other = s.clone();
    other.traces[0].entries[1].stack = a_stack_of(&mut other.frames, "elsewhere");
    let mut bytes = Vec::new();
    write_snapshot(&other, &mut bytes).unwrap();
    assert_ne!(parse_snapshot(&bytes).unwrap(), s);
    // a stack id the table does not have is a write error, not a panic
    let mut bad = s.clone();
    bad.traces[0].entries[0].stack = StackId(99);
    assert!(matches!(
        write_snapshot(&bad, Vec::new()),
        Err(SnapshotError::Write { .. })
    ));
}

fn a_stack_of(table: &mut FrameTable, name: &str) -> StackId {
    table.intern_stack([frame(name, "x.py", 1)])
}

#[test]
fn python_reads_what_the_writer_writes() {
    // Needs python3; skipped (passing) without it.
    if std::process::Command::new("python3")
        .arg("--version")
        .output()
        .is_err()
    {
        return;
    }
    let s = hand_built();
    let mut bytes = Vec::new();
    write_snapshot(&s, &mut bytes).unwrap();
    let dir = std::env::temp_dir().join(format!("cachalot-frames-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("hand_built.pickle");
    std::fs::write(&path, &bytes).unwrap();
    let script = "import pickle,sys\n\
        d = pickle.load(open(sys.argv[1], 'rb'))\n\
        e = d['device_traces'][0]\n\
        assert [f['name'] for f in e[1]['frames']] == ['free', 'main'], e[1]\n\
        assert e[0]['frames'] is e[2]['frames']\n\
        assert e[3]['frames'] == []\n\
        s = d['segments'][0]\n\
        assert s['frames'][0] == {'name': 'malloc', 'filename': 'alloc.cpp', 'line': 10}\n\
        assert s['frames'][1] is s['blocks'][0]['frames'][0]\n\
        assert s['segment_pool_id'] == (0, 0)\n\
        print('ok')";
    let out = std::process::Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success() && out.stdout.starts_with(b"ok"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_list_equal_to_an_earlier_one_can_still_grow() {
    // entry 0's frames: [F]; entry 1's frames: [F] (equal to entry 0's, so shared while it
    // is), then G appended: [F, G]
    let mut p = b"\x80\x04}(\x8c\x08segments]\x8c\x0ddevice_traces]](".to_vec();
    let head = b"}(\x8c\x06action\x8c\x05alloc\x8c\x04addrK\x01\x8c\x04sizeK\x01\x8c\x06frames";
    p.extend_from_slice(head);
    p.extend_from_slice(
        b"](}(\x8c\x04name\x8c\x01f\x8c\x08filename\x8c\x01x\x8c\x04lineK\x07u\x94eu",
    );
    p.extend_from_slice(head);
    p.extend_from_slice(
        b"](h\x00e}(\x8c\x04name\x8c\x01g\x8c\x08filename\x8c\x01x\x8c\x04lineK\x08uau",
    );
    p.extend_from_slice(b"eau.");
    let s = parse_snapshot(&p).unwrap();
    let names = |i: usize| -> Vec<String> {
        s.frames
            .stack(s.traces[0].entries[i].stack)
            .map(|f| f.name.clone())
            .collect()
    };
    assert_eq!(names(0), ["f"]);
    assert_eq!(names(1), ["f", "g"]);
}

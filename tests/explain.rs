//! `cachalot explain` on the committed snapshots: at the peak of reserved memory, the peak of
//! allocated memory and operations along the way, every live byte falls in exactly one group
//! (the groups sum to the allocator's `allocated_bytes`), the frame-bearing snapshots attribute
//! every tensor allocated during the trace to a recorded stack, the reserved bytes split into
//! live, pending, releasable and stranded without a byte left over, and what the breakdown
//! calls releasable is what `empty_cache()` then gives back.

use std::path::{Path, PathBuf};
use std::process::Command;

use cachalot::Settings;
use cachalot_tools::explain::stacks::{BEFORE_RECORDING, NO_STACK, NOT_A_TENSOR};
use cachalot_tools::explain::{At, Breakdown, breakdown, origins, survey};
use cachalot_tools::replay::{
    H200_MEMORY, ReplayOp, ReplayOptions, SnapshotExt, StartMode, Stepper, replay_ops_from,
};
use cachalot_tools::snapshot::{Snapshot, read_snapshot};

mod common;
use common::fixtures_root;

/// Every snapshot with frames: `user/` and the two user-style recordings under expandable
/// segments.
fn frame_bearing() -> Vec<PathBuf> {
    let root = fixtures_root();
    let mut v: Vec<PathBuf> = [
        "gpt2_train_frames",
        "resnet50_warm",
        "unet_wrapped",
        "two_devices",
        "gpt2_generate_large",
    ]
    .iter()
    .map(|n| root.join("user").join(format!("{n}.pickle.gz")))
    .collect();
    v.push(root.join("expandable/resnet50_warm_expandable.pickle.gz"));
    v.push(root.join("expandable/unet_wrapped_expandable.pickle.gz"));
    v
}

fn settings(snapshot: &Snapshot) -> Settings {
    let conf = snapshot
        .allocator_settings
        .as_ref()
        .map(|s| s.alloc_conf.clone())
        .unwrap_or_default();
    Settings::pytorch().apply(&conf).unwrap()
}

/// Checks one breakdown's accounting against the allocator it was read from.
fn check_accounting(what: &str, b: &Breakdown, s: &Stepper) {
    let stats = s.stats();
    let sum: u64 = b.groups.iter().map(|g| g.bytes).sum();
    assert_eq!(sum, b.live_bytes, "{what}: groups sum to live_bytes");
    assert_eq!(
        b.live_bytes, stats.allocated_bytes.all.current as u64,
        "{what}: live_bytes is the allocator's allocated_bytes"
    );
    assert_eq!(
        b.groups.iter().map(|g| g.count).sum::<usize>(),
        b.live_tensors,
        "{what}: counts"
    );
    assert_eq!(b.live_tensors, s.live_handles().count(), "{what}: tensors");
    assert_eq!(
        b.reserved_bytes, stats.reserved_bytes.all.current as u64,
        "{what}: reserved"
    );
    assert_eq!(
        b.live_bytes + b.pending_bytes + b.free_bytes,
        b.reserved_bytes,
        "{what}: live + pending + free = reserved"
    );
    assert_eq!(
        b.releasable_bytes + b.stranded_bytes,
        b.free_bytes,
        "{what}: releasable + stranded = free"
    );
    let by_size: u64 = b.free_by_segment_size.iter().map(|f| f.free_bytes).sum();
    assert_eq!(by_size, b.free_bytes, "{what}: free by segment size");
    assert!(
        b.groups.iter().all(|g| g.label != NOT_A_TENSOR),
        "{what}: an allocated block that is no tensor of the program"
    );
    for w in b.groups.windows(2) {
        assert!(w[0].bytes >= w[1].bytes, "{what}: largest first");
    }
}

#[test]
fn every_live_byte_is_grouped_at_the_peaks_and_along_the_way_on_the_frame_bearing_snapshots() {
    let mut checked = 0;
    for path in frame_bearing() {
        let snapshot = read_snapshot(&path).unwrap();
        let options = ReplayOptions::from_settings(snapshot.allocator_settings.as_ref());
        let settings = settings(&snapshot);
        for trace in snapshot.traces.iter().filter(|t| !t.entries.is_empty()) {
            let name = format!("{} device {}", path.display(), trace.device);
            let start = snapshot.start_of(trace.device);
            let mode = if start.is_ok() {
                StartMode::Exact
            } else {
                StartMode::Empty
            };
            let start = start.unwrap_or_default();
            // Under expandable segments a mid-run start is replayed from its live tensors.
            let mode = if settings.expandable_segments && !start.is_fresh() {
                StartMode::LiveTensors
            } else {
                mode
            };
            let program = replay_ops_from(trace, &options, &start).0;
            let origins = origins(&snapshot, trace.device, &program);
            assert_eq!(origins.len(), program.num_handles(), "{name}");
            // Two independent mappings from operations back to the trace agree: every
            // allocation's entry, and the operation's own entry.
            assert_eq!(program.op_entries.len(), program.ops.len(), "{name}");
            assert!(
                program.op_entries.windows(2).all(|w| w[0] <= w[1]),
                "{name}"
            );
            for (i, op) in program.ops.iter().enumerate() {
                if let ReplayOp::Alloc { id, .. } = *op {
                    assert_eq!(
                        origins[id].entry,
                        Some(program.op_entries[i]),
                        "{name} op {i}"
                    );
                }
            }
            let sv = survey(&program, &settings, H200_MEMORY, mode).unwrap();
            let n = program.ops.len();
            if n == 0 {
                continue; // a device whose trace holds only a `snapshot` entry
            }
            let moments = [
                sv.ops_before(At::PeakReserved, &program),
                sv.ops_before(At::PeakAllocated, &program),
                sv.ops_before(At::Op(n / 3), &program),
                sv.ops_before(At::Entry(trace.entries.len() / 2), &program),
                sv.ops_before(At::Op(n - 1), &program),
            ];
            let mut user_frames = false;
            for ops in moments {
                let mut s = Stepper::new(&program, settings.clone(), H200_MEMORY, mode).unwrap();
                s.run_to(ops).unwrap();
                let b = breakdown(&s, &origins, &snapshot.frames);
                let what = format!("{name} after {ops} operations");
                check_accounting(&what, &b, &s);
                assert_eq!(
                    b.reserved_bytes, sv.timeline[ops].reserved,
                    "{what}: the survey's timeline"
                );
                // Frames were recorded: only tensors from before the recording lack a stack.
                for g in &b.groups {
                    assert_ne!(g.label, NO_STACK, "{what}");
                    if g.label == BEFORE_RECORDING {
                        assert_eq!(g.before_recording, g.count, "{what}");
                    } else {
                        assert!(!g.frames.is_empty(), "{what}: {}", g.label);
                    }
                }
                user_frames |= b.groups.iter().any(|g| !g.stack.user_frames.is_empty());
                // What the breakdown calls releasable is what empty_cache() gives back, when no
                // free is waiting for another stream (empty_cache() would wait for it first).
                if b.pending_bytes == 0 {
                    let before = s.stats().reserved_bytes.all.current as u64;
                    s.core_mut().empty_cache().unwrap();
                    let after = s.stats().reserved_bytes.all.current as u64;
                    assert_eq!(before - after, b.releasable_bytes, "{what}: empty_cache()");
                }
                checked += 1;
            }
            assert!(user_frames, "{name}: no group names the user's own frames");
        }
    }
    assert!(checked >= 30, "{checked} moments checked");
}

#[test]
fn the_peaks_are_the_replays_peaks() {
    let path = fixtures_root().join("user/gpt2_train_frames.pickle.gz");
    let snapshot = read_snapshot(&path).unwrap();
    let trace = &snapshot.traces[0];
    let program = replay_ops_from(trace, &ReplayOptions::default(), &Default::default()).0;
    let sv = survey(
        &program,
        &Settings::pytorch(),
        H200_MEMORY,
        StartMode::Exact,
    )
    .unwrap();
    let max_reserved = sv.timeline.iter().map(|x| x.reserved).max().unwrap();
    let max_allocated = sv.timeline.iter().map(|x| x.allocated).max().unwrap();
    // PyTorch's max_memory_reserved() and max_memory_allocated() for this run.
    assert_eq!(max_reserved, 2_122_317_824);
    assert_eq!(sv.timeline[sv.peak_reserved_after].reserved, max_reserved);
    assert_eq!(
        sv.timeline[sv.peak_allocated_after].allocated,
        max_allocated
    );
    assert!(
        sv.timeline[..sv.peak_reserved_after]
            .iter()
            .all(|x| x.reserved < max_reserved),
        "the first time the peak is reached"
    );
}

fn cachalot() -> Command {
    Command::new(env!("CARGO_BIN_EXE_cachalot"))
}

fn json(args: &[&str]) -> serde_json::Value {
    let out = cachalot().args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn fixture(rel: &str) -> String {
    fixtures_root().join(rel).display().to_string()
}

#[test]
fn the_json_report_has_live_bytes_and_groups_that_sum_to_it() {
    for (rel, at) in [
        ("user/resnet50_warm.pickle.gz", "peak-reserved"),
        ("user/gpt2_train_frames.pickle.gz", "peak-allocated"),
        ("user/two_devices.pickle.gz", "op:100"),
        ("traces/two_stream.pickle", "peak-reserved"),
    ] {
        let v = json(&["explain", &fixture(rel), "--at", at, "--json"]);
        let live = v["live_bytes"].as_u64().unwrap();
        let groups = v["groups"].as_array().unwrap();
        let sum: u64 = groups.iter().map(|g| g["bytes"].as_u64().unwrap()).sum();
        assert!(live > 0, "{rel}");
        assert_eq!(sum, live, "{rel} at {at}");
        assert!(!v["advice"].as_array().unwrap().is_empty(), "{rel}");
        let kinds: Vec<&str> = v["advice"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a["kind"].as_str().unwrap())
            .collect();
        assert!(kinds.contains(&"expandable_segments"), "{rel}: {kinds:?}");
        assert!(kinds.contains(&"max_split_size_mb"), "{rel}: {kinds:?}");
    }
    // A trace recorded without stacks says so instead of inventing groups.
    let v = json(&["explain", &fixture("traces/two_stream.pickle"), "--json"]);
    let groups = v["groups"].as_array().unwrap();
    assert_eq!(groups.len(), 1);
    assert_eq!(groups[0]["label"], NO_STACK);
}

#[test]
fn the_advice_is_backed_by_replays_it_names() {
    // bert_infer: expandable segments reserve 446.0 MiB where the defaults reserve 538.0 MiB
    // (tests/expandable_fidelity.rs, PyTorch's own allocator on the H200 agrees).
    let v = json(&["explain", &fixture("traces/bert_infer.pickle"), "--json"]);
    let advice = v["advice"].as_array().unwrap();
    let exp = advice
        .iter()
        .find(|a| a["kind"] == "expandable_segments")
        .unwrap();
    assert_eq!(exp["baseline_peak_bytes"], 564_133_888u64);
    assert_eq!(exp["peak_bytes"], 467_664_896u64);
    assert!(
        exp["text"]
            .as_str()
            .unwrap()
            .starts_with("expandable segments would save 92.00 MiB"),
        "{}",
        exp["text"]
    );
    // oversize_max_split was recorded under max_split_size_mb:64; dropping it helps.
    let v = json(&[
        "explain",
        &fixture("traces/oversize_max_split.pickle"),
        "--json",
    ]);
    let ms = v["advice"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["kind"] == "max_split_size_mb")
        .unwrap()
        .clone();
    assert!(
        ms["peak_bytes"].as_u64().unwrap() < ms["baseline_peak_bytes"].as_u64().unwrap(),
        "{ms}"
    );
}

#[test]
fn bad_moments_and_settings_are_refused_with_a_message() {
    let out = cachalot()
        .args([
            "explain",
            &fixture("traces/two_stream.pickle"),
            "--at",
            "soon",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("operation index"));
    let out = cachalot()
        .args([
            "explain",
            &fixture("traces/two_stream.pickle"),
            "--config",
            "max_split_size_mb:1",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("max_split_size_mb"));
    let missing = Path::new("tests/fixtures/no-such.pickle");
    let out = cachalot()
        .args(["explain", &missing.display().to_string()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

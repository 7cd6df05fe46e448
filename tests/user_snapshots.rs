//! Snapshots recorded the way users record them (`tests/fixtures/user/`, made by
//! `scripts/record_user_snapshots.py` with PyTorch 2.11 on H200s): stack frames at
//! `_record_memory_history()`'s defaults, recording started after a warm-up step with the peaks
//! reset, a ring buffer that wrapped, two devices. For every device of every one: the state
//! when recording began is rebuilt from the dump, the replay starts from it, its peaks over the
//! window PyTorch measured equal PyTorch's `max_memory_reserved()` / `max_memory_allocated()`
//! to the byte, and it ends in the state PyTorch dumped, block for block.

use std::path::{Path, PathBuf};
use std::process::Command;

use cachalot::Settings;
use cachalot_tools::replay::{
    ReplayConfig, ReplayOptions, SnapshotExt, StartMode, StartState, replay, replay_ops_from,
};
use cachalot_tools::selfcheck::check_final_state;
use cachalot_tools::snapshot::{
    Action, BlockStatus, DeviceTrace, Snapshot, read_figures_for, read_snapshot, write_snapshot,
};

mod common;
use common::fixtures_root;

fn user(name: &str) -> PathBuf {
    fixtures_root()
        .join("user")
        .join(format!("{name}.pickle.gz"))
}

const USER: [&str; 10] = [
    "gpt2_train_frames",
    "resnet50_warm",
    "unet_wrapped",
    "two_devices",
    // Issue 23: wrapped rings with frames (fp16 / bf16 autocast), private pools, a memory
    // fraction under a garbage-collection threshold (the sidecar says the fraction).
    "diffusion_wrapped",
    "diffusion_multires_wrapped",
    "gpt2_bf16_wrapped",
    "cuda_graph_mlp",
    "compile_reduce_overhead",
    "resnet50_fraction",
];

fn sidecar(name: &str) -> serde_json::Value {
    let path = fixtures_root().join("user").join(format!("{name}.json"));
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn config(snapshot: &Snapshot, timeline: bool) -> ReplayConfig {
    let conf = snapshot
        .allocator_settings
        .as_ref()
        .map(|s| s.alloc_conf.clone())
        .unwrap_or_default();
    ReplayConfig {
        settings: Settings::pytorch().apply(&conf).unwrap(),
        timeline,
        ..ReplayConfig::pytorch()
    }
}

/// The index of the trace entry PyTorch's peaks were reset after (the sidecar's `reset_after`).
fn reset_entry(trace: &DeviceTrace, marker: &serde_json::Value) -> usize {
    trace
        .entries
        .iter()
        .rposition(|e| {
            e.action.name() == marker["action"].as_str().unwrap()
                && e.addr == marker["addr"].as_u64().unwrap()
                && e.size == marker["size"].as_u64().unwrap()
                && e.time_us == marker["time_us"].as_i64().unwrap()
        })
        .expect("the reset marker is in the trace")
}

#[test]
fn every_user_snapshot_replays_to_pytorchs_peaks_and_ends_in_its_dump() {
    let mut devices_checked = 0;
    let mut mid_run = 0;
    for name in USER {
        let snapshot = read_snapshot(&user(name)).unwrap();
        let side = sidecar(name);
        let options = ReplayOptions::from_settings(snapshot.allocator_settings.as_ref());
        for trace in snapshot.traces.iter().filter(|t| {
            t.entries
                .iter()
                .any(|e| matches!(e.action, Action::Alloc | Action::FreeCompleted))
        }) {
            let d = trace.device;
            let figures = read_figures_for(
                &fixtures_root().join("user").join(format!("{name}.json")),
                d,
            )
            .unwrap();
            let start = snapshot
                .start_of(d)
                .unwrap_or_else(|e| panic!("{name}/{d}: {e}"));
            if !start.is_fresh() {
                mid_run += 1;
            }
            let (program, conversion) = replay_ops_from(trace, &options, &start);
            assert_eq!(
                conversion.unmatched_frees, 0,
                "{name}/{d}: every free is matched"
            );
            let mut cfg = config(&snapshot, true);
            cfg.settings.per_process_memory_fraction = figures.memory_fraction;
            cfg.capacity = figures.device_total_memory;
            let out = replay(&program, &cfg).unwrap();

            // The final state is PyTorch's dump, block for block.
            let check = check_final_state(&out.final_layout, &snapshot, d);
            assert!(check.matches, "{name}/{d}: {:?}", check.first_difference);
            assert!(check.dump_segments > 0);

            // Peaks over the window PyTorch measured.
            let (reserved, allocated) = match &figures.reset_after {
                None => (out.peak_reserved_bytes, out.peak_allocated_bytes),
                Some(marker) => {
                    // Reset inside the trace: PyTorch's peaks count from the state right after
                    // the marker entry. The ops made from the entries up to it are a prefix.
                    let k = reset_entry(trace, marker);
                    let prefix = DeviceTrace {
                        device: d,
                        entries: trace.entries[..=k].to_vec(),
                    };
                    let prefix_ops = replay_ops_from(&prefix, &options, &start).0.ops;
                    let m = prefix_ops.len();
                    assert_eq!(program.ops[..m], prefix_ops[..]);
                    let window = &out.timeline[m.saturating_sub(1)..];
                    // PyTorch's figures at the reset agree with the replay's there.
                    let at_reset = &side["stats_at_reset"][d];
                    assert_eq!(
                        window[0].reserved,
                        at_reset["memory_reserved"].as_u64().unwrap(),
                        "{name}/{d}: reserved at the reset"
                    );
                    assert_eq!(
                        window[0].allocated,
                        at_reset["memory_allocated"].as_u64().unwrap(),
                        "{name}/{d}: allocated at the reset"
                    );
                    (
                        window.iter().map(|s| s.reserved).max().unwrap(),
                        window.iter().map(|s| s.allocated).max().unwrap(),
                    )
                }
            };
            assert_eq!(
                reserved, figures.max_memory_reserved,
                "{name}/{d}: peak reserved"
            );
            assert_eq!(
                allocated, figures.max_memory_allocated,
                "{name}/{d}: peak allocated"
            );
            assert_eq!(
                out.final_layout.iter().map(|s| s.size).sum::<u64>(),
                figures.memory_reserved,
                "{name}/{d}: reserved at the dump"
            );
            assert_eq!(
                out.stats.allocated_bytes.all.current as u64, figures.memory_allocated,
                "{name}/{d}: allocated at the dump"
            );

            // Where PyTorch's figures at the start of recording were taken, the rebuilt start
            // holds exactly that.
            if let Some(at_start) = side.get("stats_at_start") {
                let at_start = &at_start[d];
                assert_eq!(
                    start.reserved_bytes(),
                    at_start["memory_reserved"].as_u64().unwrap()
                );
                let allocated: u64 = start
                    .live_blocks()
                    .filter(|(_, b)| b.state == BlockStatus::ActiveAllocated)
                    .map(|(_, b)| b.size)
                    .sum();
                assert_eq!(allocated, at_start["memory_allocated"].as_u64().unwrap());
                assert_eq!(
                    start.segments.len() as u64,
                    at_start["memory_stats"]["segment.all.current"]
                        .as_u64()
                        .unwrap()
                );
            }
            devices_checked += 1;
        }
    }
    assert_eq!(
        devices_checked, 11,
        "ten snapshots, one of them on two devices"
    );
    assert_eq!(
        mid_run, 5,
        "the warm-up and the four wrapped rings began mid-run"
    );
}

#[test]
fn the_committed_traces_end_in_their_dumps() {
    let dir = fixtures_root().join("traces");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "pickle") {
            continue;
        }
        let snapshot = read_snapshot(&path).unwrap();
        let figures = read_figures_for(&path.with_extension("json"), 0).unwrap();
        let start = snapshot.start_of(0).unwrap();
        assert!(
            start.is_fresh(),
            "{}: recorded from the process's start",
            path.display()
        );
        let program = snapshot.replay_programs().remove(0).1;
        let out = replay(&program, &common::recorded_config(&figures)).unwrap();
        let check = check_final_state(&out.final_layout, &snapshot, 0);
        assert!(
            check.matches,
            "{}: {:?}",
            path.display(),
            check.first_difference
        );
        n += 1;
    }
    assert_eq!(n, 10);
}

#[test]
fn the_self_check_finds_a_dump_the_replay_does_not_reach() {
    let mut snapshot = read_snapshot(&user("gpt2_train_frames")).unwrap();
    let program = snapshot.replay_programs().remove(0).1;
    let out = replay(&program, &config(&snapshot, false)).unwrap();
    assert!(check_final_state(&out.final_layout, &snapshot, 0).matches);
    // One allocated block's requested size differs.
    let (s, b) = snapshot
        .segments
        .iter()
        .enumerate()
        .find_map(|(i, s)| {
            s.blocks
                .iter()
                .position(|b| b.state == BlockStatus::ActiveAllocated)
                .map(|j| (i, j))
        })
        .unwrap();
    snapshot.segments[s].blocks[b].requested_size += 1;
    let check = check_final_state(&out.final_layout, &snapshot, 0);
    assert!(!check.matches);
    let address = snapshot.segments[s].blocks[b].address;
    assert!(
        check
            .first_difference
            .as_deref()
            .unwrap()
            .contains(&format!("block {address:#x}")),
        "{check:?}"
    );
    // A segment missing from the dump.
    snapshot.segments.pop();
    assert!(!check_final_state(&out.final_layout, &snapshot, 0).matches);
}

#[test]
fn the_start_of_a_warm_run_is_not_a_fresh_process() {
    // Replayed from an empty allocator (the old behaviour), the warm-up run misses what the
    // process held: the rebuilt start is what makes the figures PyTorch's.
    let snapshot = read_snapshot(&user("resnet50_warm")).unwrap();
    let trace = &snapshot.traces[0];
    let options = ReplayOptions::from_settings(snapshot.allocator_settings.as_ref());
    let start = snapshot.start_of(0).unwrap();
    assert!(start.segments.len() > 50 && start.live_blocks().count() > 100);
    let (empty, report) = replay_ops_from(trace, &options, &StartState::default());
    assert!(report.unmatched_frees > 0);
    let from_empty = replay(&empty, &config(&snapshot, false)).unwrap();
    let (program, _) = replay_ops_from(trace, &options, &start);
    let exact = replay(&program, &config(&snapshot, false)).unwrap();
    let figures = read_figures_for(&fixtures_root().join("user/resnet50_warm.json"), 0).unwrap();
    assert_eq!(exact.peak_reserved_bytes, figures.max_memory_reserved);
    assert_ne!(from_empty.peak_reserved_bytes, figures.max_memory_reserved);
    // Under StartMode::Empty the same program drops the start as well.
    let dropped = replay(
        &program,
        &ReplayConfig {
            start: StartMode::Empty,
            ..config(&snapshot, false)
        },
    )
    .unwrap();
    assert_eq!(dropped.peak_reserved_bytes, from_empty.peak_reserved_bytes);
}

#[test]
fn other_settings_start_from_the_live_tensors_placed_by_their_policy() {
    let snapshot = read_snapshot(&user("unet_wrapped")).unwrap();
    let start = snapshot.start_of(0).unwrap();
    let options = ReplayOptions::from_settings(snapshot.allocator_settings.as_ref());
    let (program, _) = replay_ops_from(&snapshot.traces[0], &options, &start);
    let mut settings = Settings::pytorch();
    settings.set_max_split_size_mb(64).unwrap();
    let out = replay(
        &program,
        &ReplayConfig {
            settings,
            start: StartMode::LiveTensors,
            timeline: true,
            ..ReplayConfig::pytorch()
        },
    )
    .unwrap();
    // The tensors live at the start are held from the first operation on.
    let live: u64 = start
        .live_blocks()
        .filter(|(_, b)| b.state == BlockStatus::ActiveAllocated)
        .map(|(_, b)| b.requested)
        .sum();
    assert!(live > 0);
    assert!(out.peak_requested_bytes >= live);
    // Without them (an empty start) the same program holds less at its peak.
    let mut settings = Settings::pytorch();
    settings.set_max_split_size_mb(64).unwrap();
    let empty = replay(
        &program,
        &ReplayConfig {
            settings,
            start: StartMode::Empty,
            ..ReplayConfig::pytorch()
        },
    )
    .unwrap();
    assert!(empty.peak_requested_bytes < out.peak_requested_bytes);
    assert!(empty.peak_reserved_bytes < out.peak_reserved_bytes);
}

fn cachalot(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_cachalot"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn the_report_says_how_the_recording_began_and_checks_itself() {
    let path = user("resnet50_warm");
    let out = cachalot(&["replay", path.to_str().unwrap(), "--pytorch"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("start      recording began mid-run: 74 segments"),
        "{text}"
    );
    assert!(
        text.contains("self-check the replay ends in the state PyTorch dumped: 77 segments"),
        "{text}"
    );
    let out = cachalot(&["replay", path.to_str().unwrap(), "--pytorch", "--json"]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["start"]["state"], "reconstructed");
    assert_eq!(json["start"]["replayed_from"], "exact");
    assert_eq!(json["self_check"]["matches"], true);
    assert_eq!(json["self_check"]["applies"], true);
    // Other settings: the live tensors only, and the check does not apply.
    let out = cachalot(&[
        "replay",
        path.to_str().unwrap(),
        "--pytorch",
        "--config",
        "max_split_size_mb:64",
        "--json",
    ]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["start"]["replayed_from"], "live_tensors");
    assert_eq!(json["self_check"]["applies"], false);
}

#[test]
fn a_start_that_cannot_be_rebuilt_is_said_plainly() {
    // The warm-up snapshot without its dumped segments: nothing to walk back from.
    let mut snapshot = read_snapshot(&user("resnet50_warm")).unwrap();
    snapshot.segments.clear();
    assert!(snapshot.start_of(0).is_err());
    let dir = std::env::temp_dir().join(format!("cachalot-user-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path: &Path = &dir.join("no_segments.pickle");
    write_snapshot(&snapshot, std::fs::File::create(path).unwrap()).unwrap();
    let out = cachalot(&["replay", path.to_str().unwrap(), "--pytorch"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("UNKNOWN"), "{text}");
    assert!(text.contains("the snapshot holds no segments"), "{text}");
    assert!(text.contains("frees of earlier blocks dropped"), "{text}");
    let out = cachalot(&["replay", path.to_str().unwrap(), "--pytorch", "--json"]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["start"]["state"], "unknown");
    assert_eq!(json["start"]["replayed_from"], "empty");
    assert!(json["start"]["dropped_frees"].as_u64().unwrap() > 0);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn trace_addresses_go_to_the_operation_that_made_them() {
    use cachalot_tools::replay::{ReplayOp, ReplayProgram};
    // The trace made one device allocation, at 0x4000_0000, for its second request; the
    // replay (say, under other settings) needs one for the first request too. The first gets
    // an address of the device's own, the second the trace's.
    const MIB: u64 = 1 << 20;
    let program = ReplayProgram {
        ops: vec![
            ReplayOp::Alloc {
                id: 0,
                size: 30 * MIB,
                stream: 0,
            },
            ReplayOp::Alloc {
                id: 1,
                size: 40 * MIB,
                stream: 0,
            },
        ],
        segment_addresses: vec![0x4000_0000],
        segment_at: vec![(1, 0x4000_0000)],
        ..ReplayProgram::default()
    };
    let out = replay(&program, &ReplayConfig::pytorch()).unwrap();
    let addresses: Vec<u64> = out.final_layout.iter().map(|s| s.address).collect();
    assert_eq!(addresses.len(), 2);
    assert!(addresses.contains(&0x4000_0000));
    let own = *addresses.iter().find(|&&a| a != 0x4000_0000).unwrap();
    assert!(own >= 0x7f00_0000_0000, "{own:#x}");
    // The address went to the second request (40 MiB), not to the first device allocation.
    let requested_at = |a: u64| {
        out.final_layout
            .iter()
            .find(|s| s.address == a)
            .unwrap()
            .blocks[0]
            .requested
    };
    assert_eq!(requested_at(own), 30 * MIB);
    assert_eq!(requested_at(0x4000_0000), 40 * MIB);
}

#[test]
fn the_large_snapshot_reads_with_its_frames_and_replays_to_pytorchs_figures() {
    // 39 MB of pickle, 128,897 entries with 86 frames each (PyTorch memoises the frames; a
    // reader that copies each reference would build 75 million values).
    let snapshot = read_snapshot(&user("gpt2_generate_large")).unwrap();
    assert_eq!(snapshot.traces[0].entries.len(), 128_897);
    assert!(
        snapshot.frames.num_stacks() < 1_000,
        "stacks are stored once each"
    );
    let figures =
        read_figures_for(&fixtures_root().join("user/gpt2_generate_large.json"), 0).unwrap();
    let program = snapshot.replay_programs().remove(0).1;
    let out = replay(&program, &config(&snapshot, false)).unwrap();
    assert_eq!(out.peak_reserved_bytes, figures.max_memory_reserved);
    assert_eq!(out.peak_allocated_bytes, figures.max_memory_allocated);
    let check = check_final_state(&out.final_layout, &snapshot, 0);
    assert!(check.matches, "{:?}", check.first_difference);
}

//! The recorded PyTorch traces in tests/fixtures/traces/: each parses, agrees with the counts
//! and figures PyTorch itself reported (the JSON sidecar), and converts to a sound replay
//! program.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;

use cachalot_tools::replay::{ReplayOp, ReplayOptions, SnapshotExt, replay_ops, replay_ops_with};
use cachalot_tools::snapshot::{
    Action, BlockStatus, Figures, Snapshot, read_figures, read_snapshot,
};

mod common;
use common::fixtures_root as fixtures;

struct Recorded {
    name: String,
    snapshot: Snapshot,
    figures: Figures,
}

fn recorded() -> Vec<Recorded> {
    let dir = fixtures().join("traces");
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "pickle"))
        .collect();
    paths.sort();
    assert!(
        paths.len() >= 10,
        "expected the 10 recorded workloads in {}",
        dir.display()
    );
    paths
        .into_iter()
        .map(|p| {
            let name = p.file_stem().unwrap().to_string_lossy().into_owned();
            let snapshot = read_snapshot(&p).unwrap_or_else(|e| panic!("{e}"));
            let figures = read_figures(&p.with_extension("json")).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(figures.workload, name);
            Recorded {
                name,
                snapshot,
                figures,
            }
        })
        .collect()
}

fn stat(r: &Recorded, key: &str) -> i64 {
    r.figures
        .stat(key)
        .unwrap_or_else(|| panic!("{}: no memory_stats[{key:?}]", r.name))
}

fn action_counts(s: &Snapshot) -> BTreeMap<String, u64> {
    let mut counts = BTreeMap::new();
    for t in &s.traces {
        for e in &t.entries {
            *counts.entry(e.action.name().to_string()).or_insert(0) += 1;
        }
    }
    counts
}

#[test]
fn every_fixture_parses_with_the_counts_python_saw() {
    for r in recorded() {
        assert_eq!(
            action_counts(&r.snapshot),
            r.figures.trace_action_counts,
            "{}",
            r.name
        );
        assert!(!r.figures.trace_may_be_truncated, "{}", r.name);
        assert_eq!(r.snapshot.traces.len(), 1, "{}: one GPU", r.name);
        assert_eq!(r.snapshot.traces[0].device, 0);
        let settings = r
            .snapshot
            .allocator_settings
            .as_ref()
            .expect("PyTorch 2.11 records settings");
        assert_eq!(
            settings.alloc_conf,
            r.figures
                .pytorch_cuda_alloc_conf
                .clone()
                .unwrap_or_default(),
            "{}",
            r.name
        );
        assert_eq!(settings.roundup_power2_divisions.len(), 16, "{}", r.name);
        let max_split = stat(&r, "max_split_size");
        match settings.max_split_size {
            Some(v) => assert_eq!(v as i64, max_split, "{}", r.name),
            None => assert!(max_split < 0 || max_split as u64 >= 1 << 60, "{}", r.name),
        }
        for seg in &r.snapshot.segments {
            assert_eq!(
                seg.blocks.iter().map(|b| b.size).sum::<u64>(),
                seg.total_size
            );
            assert_eq!(seg.blocks.first().map(|b| b.address), Some(seg.address));
        }
    }
}

#[test]
fn allocator_settings_reflect_the_alloc_conf() {
    for r in recorded() {
        let s = r.snapshot.allocator_settings.unwrap();
        match r.name.as_str() {
            "oversize_max_split" => assert_eq!(s.max_split_size, Some(64 << 20)),
            "bert_infer_roundup4" => {
                assert_eq!(s.max_split_size, None);
                assert!(s.roundup_power2_divisions.iter().all(|&d| d == 4), "{s:?}");
            }
            _ => {
                assert_eq!(s.max_split_size, None, "{}", r.name);
                assert!(
                    s.roundup_power2_divisions.iter().all(|&d| d == 0),
                    "{}",
                    r.name
                );
            }
        }
    }
}

/// The trace alone reproduces PyTorch's own statistics: reserved bytes (peak and final),
/// requested bytes, device allocations and frees, allocation counts, and the final state.
#[test]
fn traces_reproduce_pytorchs_figures() {
    for r in recorded() {
        let name = &r.name;
        let trace = &r.snapshot.traces[0].entries;
        let (mut reserved, mut reserved_peak) = (0i64, 0i64);
        let (mut requested, mut requested_peak) = (0i64, 0i64);
        let mut live: HashMap<u64, u64> = HashMap::new();
        for e in trace {
            match e.action {
                Action::SegmentAlloc => reserved += e.size as i64,
                Action::SegmentFree => reserved -= e.size as i64,
                Action::Alloc => {
                    requested += e.size as i64;
                    live.insert(e.addr, e.size);
                }
                Action::FreeCompleted => {
                    let size = live
                        .remove(&e.addr)
                        .expect("recording starts with the process");
                    assert_eq!(
                        size, e.size,
                        "{name}: free_completed carries the requested size"
                    );
                    requested -= size as i64;
                }
                _ => {}
            }
            reserved_peak = reserved_peak.max(reserved);
            requested_peak = requested_peak.max(requested);
        }
        assert_eq!(
            reserved_peak as u64, r.figures.max_memory_reserved,
            "{name}"
        );
        assert_eq!(reserved, stat(&r, "reserved_bytes.all.current"), "{name}");
        assert_eq!(reserved as u64, r.figures.memory_reserved, "{name}");
        assert_eq!(
            requested_peak,
            stat(&r, "requested_bytes.all.peak"),
            "{name}"
        );
        assert_eq!(requested, stat(&r, "requested_bytes.all.current"), "{name}");

        let count = |a: Action| trace.iter().filter(|e| e.action == a).count() as i64;
        assert_eq!(
            count(Action::SegmentAlloc),
            stat(&r, "num_device_alloc"),
            "{name}"
        );
        assert_eq!(
            count(Action::SegmentFree),
            stat(&r, "num_device_free"),
            "{name}"
        );
        assert_eq!(
            count(Action::Alloc),
            stat(&r, "allocation.all.allocated"),
            "{name}"
        );
        assert_eq!(
            count(Action::FreeRequested),
            stat(&r, "allocation.all.freed"),
            "{name}"
        );
        assert_eq!(count(Action::Oom), stat(&r, "num_ooms"), "{name}");

        // The final state agrees with the trace.
        let segs = &r.snapshot.segments;
        assert_eq!(
            segs.iter().map(|s| s.total_size as i64).sum::<i64>(),
            reserved,
            "{name}"
        );
        assert_eq!(segs.len() as i64, stat(&r, "segment.all.current"), "{name}");
        let blocks = || segs.iter().flat_map(|s| s.blocks.iter());
        let allocated = blocks()
            .filter(|b| b.state == BlockStatus::ActiveAllocated)
            .count();
        let pending = blocks()
            .filter(|b| b.state == BlockStatus::ActivePendingFree)
            .count();
        assert_eq!(
            allocated as i64,
            stat(&r, "allocation.all.current"),
            "{name}"
        );
        assert_eq!(
            allocated as i64,
            count(Action::Alloc) - count(Action::FreeRequested),
            "{name}"
        );
        assert_eq!(
            pending as i64,
            count(Action::FreeRequested) - count(Action::FreeCompleted),
            "{name}"
        );
        let allocated_bytes: u64 = segs.iter().map(|s| s.allocated_size).sum();
        assert_eq!(allocated_bytes, r.figures.memory_allocated, "{name}");
        let requested_live: u64 = blocks()
            .filter(|b| b.state != BlockStatus::Inactive)
            .map(|b| b.requested_size)
            .sum();
        assert_eq!(requested_live as i64, requested, "{name}");
    }
}

#[test]
fn replay_programs_are_sound() {
    for r in recorded() {
        let name = &r.name;
        let trace = &r.snapshot.traces[0];
        let options = ReplayOptions::from_settings(r.snapshot.allocator_settings.as_ref());
        let (program, report) = replay_ops_with(trace, &options);
        let count = |a: Action| trace.entries.iter().filter(|e| e.action == a).count();

        assert_eq!(report.allocs, count(Action::Alloc), "{name}");
        assert_eq!(
            report.frees_requested,
            count(Action::FreeRequested),
            "{name}"
        );
        assert_eq!(
            report.frees_completed,
            count(Action::FreeCompleted),
            "{name}"
        );
        assert_eq!(
            report.unmatched_frees, 0,
            "{name}: recording began with the process"
        );
        assert_eq!(report.reused_live_addresses, 0, "{name}");
        assert_eq!(
            report.live_at_end,
            count(Action::Alloc) - count(Action::FreeCompleted)
        );
        assert_eq!(report.ignored_entries, 0, "{name}");
        assert_eq!(report.failed_allocs, count(Action::Oom), "{name}");
        assert_eq!(program.num_handles(), report.allocs + report.failed_allocs);

        let segment_allocs: Vec<u64> = trace
            .entries
            .iter()
            .filter(|e| e.action == Action::SegmentAlloc)
            .map(|e| e.addr)
            .collect();
        assert_eq!(program.segment_addresses, segment_allocs, "{name}");

        // Ids are dense, in order; each handle is requested and completed at most once, in
        // that order.
        let mut next = 0;
        let mut requested = HashSet::new();
        let mut completed = HashSet::new();
        for (i, op) in program.ops.iter().enumerate() {
            match *op {
                ReplayOp::Alloc { id, .. } => {
                    assert_eq!(id, next, "{name}: op {i}");
                    next += 1;
                }
                ReplayOp::FreeRequested { id } => {
                    assert!(id < next && requested.insert(id), "{name}: op {i}");
                }
                ReplayOp::FreeCompleted { id } => {
                    assert!(
                        requested.contains(&id) && completed.insert(id),
                        "{name}: op {i}"
                    );
                }
                ReplayOp::EmptyCache
                | ReplayOp::SetSettings { .. }
                | ReplayOp::ReleaseStream { .. } => {}
            }
        }

        // Every run of segment_free entries is accounted for, and only the workload that made
        // PyTorch retry allocations has releases the allocator made by itself.
        let runs = trace
            .entries
            .iter()
            .zip(std::iter::once(None).chain(trace.entries.iter().map(Some)))
            .filter(|(e, prev)| {
                e.action == Action::SegmentFree
                    && prev.is_none_or(|p| p.action != Action::SegmentFree)
            })
            .count();
        assert_eq!(
            report.empty_caches + report.internal_releases,
            runs,
            "{name}"
        );
        let retries = stat(&r, "num_alloc_retries");
        if retries == 0 {
            assert_eq!(report.internal_releases, 0, "{name}");
        }
        match name.as_str() {
            "fraction_oom_retry" => {
                assert_eq!(retries, 2, "one retry served, one ended in the OOM");
                assert_eq!((report.internal_releases, report.empty_caches), (1, 0));
            }
            "empty_cache_loop" => {
                assert_eq!((report.internal_releases, report.empty_caches), (0, 8));
            }
            _ => assert_eq!(report.empty_caches, 0, "{name}"),
        }
        // Only the two-stream pipeline frees blocks that other streams still use.
        assert_eq!(
            report.deferred_frees > 0,
            name == "two_stream",
            "{name}: {report:?}"
        );

        assert_eq!(replay_ops(trace), program, "{name}: default options agree");
        let programs = r.snapshot.replay_programs();
        assert_eq!(programs.len(), 1);
        assert_eq!(programs[0], (0, program));
    }
}

#[test]
fn the_seed_experiment_converts_exactly() {
    let path = fixtures().join("traces/seed_experiment.pickle");
    let snapshot = read_snapshot(&path).unwrap();
    let program = replay_ops(&snapshot.traces[0]);
    let gib = 1u64 << 30;
    use ReplayOp::*;
    let alloc = |id| Alloc {
        id,
        size: gib,
        stream: 0,
    };
    assert_eq!(
        program.ops,
        vec![
            alloc(0),                // a
            alloc(1),                // b
            FreeRequested { id: 1 }, // b = b.to('cpu')
            FreeCompleted { id: 1 },
            alloc(2), // c
            alloc(3), // c again, while the first c is alive
            FreeRequested { id: 2 },
            FreeCompleted { id: 2 },
            alloc(4),                // d
            FreeRequested { id: 4 }, // del d
            FreeCompleted { id: 4 },
            alloc(5), // e = e.to('cuda')
        ]
    );
    assert_eq!(program.segment_addresses.len(), 3);
    // b's segment is reused by c, d and e; the second c needs the third segment.
    let addr_of = |i: usize| {
        snapshot.traces[0]
            .entries
            .iter()
            .filter(|e| e.action == Action::Alloc)
            .nth(i)
            .unwrap()
            .addr
    };
    assert_eq!(addr_of(0), program.segment_addresses[0]);
    assert_eq!(addr_of(1), program.segment_addresses[1]);
    assert_eq!(addr_of(2), program.segment_addresses[1]);
    assert_eq!(addr_of(3), program.segment_addresses[2]);
    assert_eq!(addr_of(5), program.segment_addresses[1]);
}

#[test]
fn the_allocators_own_release_is_not_an_empty_cache() {
    let path = fixtures().join("traces/fraction_oom_retry.pickle");
    let snapshot = read_snapshot(&path).unwrap();
    let trace = &snapshot.traces[0];
    let program = replay_ops(trace);
    assert!(
        !program.ops.contains(&ReplayOp::EmptyCache),
        "{:?}",
        program.ops
    );

    let (_, report) = replay_ops_with(trace, &ReplayOptions::default());
    assert_eq!(
        (report.empty_caches, report.internal_releases),
        (0, 1),
        "{report:?}"
    );
}

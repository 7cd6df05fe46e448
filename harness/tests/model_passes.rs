//! Committed traces run several passes in a row through the model alone (no allocator side),
//! under cachalot's policy with page aliasing (rule 22): where a trace's loop repeats its
//! allocations, the passes after the first make no device call; the model's invariants hold
//! after every operation. The measurement over every trace is the `stitching_passes` example.

use std::path::{Path, PathBuf};

use cachalot_harness::replay::{Pass, model_passes};
use cachalot_harness::scenario::Knobs;
use cachalot_tools::replay::H200_MEMORY;
use cachalot_tools::replay::SnapshotExt;
use cachalot_tools::snapshot::read_snapshot;

const MIB: u64 = 1 << 20;

fn trace(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../tests/fixtures/traces/{name}.pickle"))
}

/// Rule 21's policy without thread caches, page aliasing as given, on an H200.
fn knobs(page_aliasing: bool) -> Knobs {
    Knobs {
        expandable_segments: true,
        expandable_page: 2 * MIB,
        reclaim_headroom: Some(0.025),
        page_aliasing,
        ..Knobs::pytorch(H200_MEMORY)
    }
}

/// The passes of the trace's only device.
fn passes(name: &str, page_aliasing: bool) -> Vec<Pass> {
    let snapshot = read_snapshot(&trace(name)).unwrap();
    let programs = snapshot.replay_programs();
    assert_eq!(programs.len(), 1);
    model_passes(&programs[0].1, &knobs(page_aliasing), 4, true).unwrap()
}

fn calls(p: &Pass) -> u64 {
    p.device_allocs + p.device_frees
}

#[test]
fn two_streams_prefetch_loop_makes_no_device_call_after_its_first_pass_under_page_aliasing() {
    let on = passes("two_stream", true);
    assert!(calls(&on[0]) > 0);
    assert!(on[1..].iter().all(|p| calls(p) == 0), "{on:?}");
    // Without aliasing, rule 20 unmaps and maps again on every pass.
    let off = passes("two_stream", false);
    assert!(off[1..].iter().all(|p| calls(p) > 0), "{off:?}");
    // Memory stays within the headroom's reach: reserved ≤ 1.05 × requested at peak.
    let last = on.last().unwrap();
    assert!(
        last.peak_reserved * 100 <= last.peak_requested * 105,
        "{last:?}"
    );
}

#[test]
fn resnet18s_training_steps_make_no_device_call_after_the_first_pass_under_page_aliasing() {
    let on = passes("resnet18_train", true);
    assert!(on[1..].iter().all(|p| calls(p) == 0), "{on:?}");
    assert!(
        on.iter()
            .all(|p| p.device_frees == 0 && p.out_of_memory == 0)
    );
}

//! Rules 24 (settings changed at run time) and 25 (one stream's cache released): the allocator
//! and the reference model agree on hand-made sequences through each part — later requests
//! rounded and refused oversize blocks under the new settings, the oversize counters recounted,
//! only the stream's whole free segments given back. Random sequences with both operations run
//! in `differential.rs` (the operation table draws them).

use cachalot_harness::driver::run_scenario_observed;
use cachalot_harness::op::Op;
use cachalot_harness::scenario::{Knobs, Scenario};
use cachalot_harness::side::Observation;

const MIB: u64 = 1 << 20;

fn run(ops: Vec<Op>) -> Observation {
    let knobs = Knobs::pytorch(1 << 34);
    let scenario = Scenario {
        knobs: knobs.clone(),
        ops: ops.clone(),
    };
    run_scenario_observed(&scenario).unwrap_or_else(|e| panic!("{e}\nops: {ops:?}"))
}

fn stat(o: &Observation, path: &str) -> i128 {
    o.stat(path)
        .unwrap_or_else(|| panic!("no statistic {path}"))
}

fn malloc(size: u64, stream: u8) -> Op {
    Op::Malloc { size, stream }
}

/// `max_split_size_mb:32,roundup_power2_divisions:4` (indexes into the op's tables).
const SPLIT_32_DIVISIONS_4: Op = Op::SetRuntimeSettings {
    max_split: 2,
    divisions: 3,
    gc: 0,
};

#[test]
fn later_requests_round_and_split_under_the_new_settings_alike() {
    let o = run(vec![
        // Under the defaults: 40 MiB + 1.5 KiB, rounded to 512 B; freed, cached whole.
        malloc(40 * MIB + 1536, 0),
        Op::Free { pick: 0 },
        SPLIT_32_DIVISIONS_4,
        // Rounded by 4 divisions: 10 MiB + 512 B -> 12 MiB; below max_split_size, so the
        // cached 40 MiB block (above it) is refused and a new segment made.
        malloc(10 * MIB + 512, 0),
    ]);
    assert_eq!(stat(&o, "num_device_alloc"), 2);
    assert!(
        o.layout
            .iter()
            .flat_map(|s| &s.blocks)
            .any(|b| b.size == 12 * MIB),
        "{:?}",
        o.layout
    );
    // The 40 MiB segment is at or above the new max_split_size: counted as oversize now.
    assert_eq!(stat(&o, "oversize_segments.current"), 1);
    assert_eq!(stat(&o, "oversize_allocations.current"), 0);
}

#[test]
fn an_allocation_live_across_the_change_is_recounted_as_oversize() {
    let o = run(vec![malloc(48 * MIB, 0), SPLIT_32_DIVISIONS_4]);
    assert_eq!(stat(&o, "oversize_allocations.current"), 1);
    let o = run(vec![
        malloc(48 * MIB, 0),
        SPLIT_32_DIVISIONS_4,
        Op::SetRuntimeSettings {
            max_split: 0,
            divisions: 0,
            gc: 0,
        },
        Op::Free { pick: 0 },
    ]);
    assert_eq!(stat(&o, "oversize_allocations.current"), 0);
    assert_eq!(stat(&o, "oversize_segments.current"), 0);
}

#[test]
fn releasing_a_stream_gives_back_its_whole_free_segments_only() {
    let o = run(vec![
        malloc(4 * MIB, 0),
        Op::Free { pick: 0 },
        malloc(4 * MIB, 1),
        malloc(4 * MIB, 1),
        Op::Free { pick: 0 },
        // Stream 0's segment is one free block: given back. Stream 1's is split: kept.
        Op::ReleaseStream { stream: 0 },
        Op::ReleaseStream { stream: 1 },
    ]);
    assert_eq!(stat(&o, "num_device_free"), 1);
    assert_eq!(o.layout.len(), 1);
    assert_eq!(stat(&o, "num_sync_all_streams"), 2);
    let o = run(vec![
        malloc(4 * MIB, 1),
        Op::Free { pick: 0 },
        malloc(4 * MIB, 2),
        Op::Free { pick: 0 },
        Op::ReleaseStream { stream: 1 },
    ]);
    assert_eq!(stat(&o, "num_device_free"), 1);
    assert_eq!(o.layout.len(), 1, "stream 2's cached segment stays");
}

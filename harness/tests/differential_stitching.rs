//! Rule 23 (stitched views): the allocator and the reference model — each written from the
//! text alone — agree on a loop that makes a view in one pass and reuses it in every later
//! pass with no device call, and on `empty_cache` destroying it. Every step is compared
//! (addresses, statistics, the layout with its held pieces, both invariant checkers, the
//! device's page table). Random sequences with the knob run in `differential.rs` and
//! `differential_threads.rs` (the knob tables draw it with expandable segments and a headroom,
//! where page aliasing is off).
//!
//! The expected figures below are derived from the rule text in each test's comment, not read
//! off a run.

use cachalot_harness::driver::run_scenario_observed;
use cachalot_harness::op::Op;
use cachalot_harness::scenario::{Knobs, Scenario};
use cachalot_harness::side::Observation;

const MIB: u64 = 1 << 20;

/// cachalot's policy with stitched views: expandable segments with 2 MiB pages, reclaim at
/// `headroom`.
fn knobs(headroom: f64) -> Knobs {
    Knobs {
        expandable_segments: true,
        expandable_page: 2 * MIB,
        reclaim_headroom: Some(headroom),
        page_stitching: true,
        ..Knobs::pytorch(1 << 30)
    }
}

fn malloc(size: u64) -> Op {
    Op::Malloc { size, stream: 0 }
}

/// Frees the live block `pick` (index among the live blocks, in allocation order).
fn free(pick: u16) -> Op {
    Op::Free { pick }
}

fn run(knobs: Knobs, ops: Vec<Op>) -> Observation {
    let scenario = Scenario {
        knobs: knobs.clone(),
        ops: ops.clone(),
    };
    run_scenario_observed(&scenario)
        .unwrap_or_else(|e| panic!("{e}\nknobs: {knobs:?}\nops: {ops:?}"))
}

fn stat(o: &Observation, path: &str) -> u64 {
    o.stat(path)
        .unwrap_or_else(|| panic!("no statistic {path}"))
}

/// A (10 MiB), B (4 MiB), free A, C (12 MiB), free B, free C — `passes` times.
fn example_passes(passes: usize) -> Vec<Op> {
    let mut ops = Vec::new();
    for _ in 0..passes {
        ops.extend([malloc(10 * MIB), malloc(4 * MIB), free(0), malloc(12 * MIB)]);
        ops.extend([free(0), free(0)]);
    }
    ops
}

/// Pass 1: A and B grow the range (2 maps, reserved 14 MiB); C is over the limit
/// (W = 16 MiB, limit 16.4 MiB) with 5 free pages < 6: no view; rule 20 unmaps A's hole
/// (1 unmap, reserved 4) and the range grows 12 MiB (1 map): 16 MiB, one free block at the
/// end. Pass 2: A and B split that block; C finds no block and no view, is over the limit,
/// and the 5 pages of A's hole plus the 1 page after B make a view (2 aliases, one per
/// source block), 16 MiB reserved still. Pass 3 on: the same layout at C, the view usable:
/// no device call. So 3 + 2 allocations and 1 free in all, whatever the passes after 2.
#[test]
fn a_view_made_in_pass_two_is_reused_by_every_later_pass_alike() {
    let two = run(knobs(0.025), example_passes(2));
    let five = run(knobs(0.025), example_passes(5));
    assert_eq!(stat(&two, "num_device_alloc"), 5);
    assert_eq!(stat(&two, "num_device_free"), 1);
    for counter in ["num_device_alloc", "num_device_free"] {
        assert_eq!(
            stat(&two, counter),
            stat(&five, counter),
            "{counter}: passes 3-5 make no device call"
        );
    }
    assert_eq!(stat(&five, "reserved_bytes.all.peak"), 16 * MIB);
    assert_eq!(stat(&five, "reserved_bytes.all.current"), 16 * MIB);
    assert_eq!(stat(&five, "allocated_bytes.all.current"), 0);
}

/// After three passes, `empty_cache` destroys the free view first (1 unmap; its pages stay
/// mapped at their homes) and then rule 19e unmaps the one free block of 16 MiB (1 unmap):
/// nothing reserved, 1 + 1 + 1 frees in all.
#[test]
fn empty_cache_destroys_the_views_and_gives_every_page_back_alike() {
    let mut ops = example_passes(3);
    ops.push(Op::EmptyCache);
    let o = run(knobs(0.025), ops);
    assert_eq!(stat(&o, "reserved_bytes.all.current"), 0);
    assert_eq!(stat(&o, "num_device_free"), 3);
    assert_eq!(stat(&o, "num_device_alloc"), 5);
}

/// A view's allocation freed while another live block sits in its last page's rest: the tail
/// piece is `t` bytes, so a 5 MiB view over two whole pages and one of a third (1 MiB of it)
/// leaves the other 1 MiB to a small block, and both return cleanly.
#[test]
fn a_view_shares_its_last_page_with_a_block_at_home_alike() {
    // A 4, X 2, B 4, Y 2 MiB; A and B freed (two holes of 2 pages each); a 5 MiB request is
    // over the limit (reserved 12, W 12) with 4 free pages >= 3: a view of A's 2 pages and
    // B's first page (1 MiB held of it); then 1.5 MiB fits in B's rest (best fit).
    let o = run(
        knobs(0.0),
        vec![
            malloc(4 * MIB),
            malloc(2 * MIB),
            malloc(4 * MIB),
            malloc(2 * MIB),
            free(0),
            free(1),
            malloc(5 * MIB),
            malloc(3 * MIB / 2),
            free(2),
            free(2),
        ],
    );
    assert_eq!(stat(&o, "reserved_bytes.all.current"), 12 * MIB, "no page created");
    assert_eq!(stat(&o, "num_device_free"), 0, "nothing unmapped");
    assert_eq!(stat(&o, "num_device_alloc"), 4 + 2, "4 maps, then 2 aliases");
    assert_eq!(
        stat(&o, "allocated_bytes.all.current"),
        4 * MIB,
        "X and Y are left"
    );
}

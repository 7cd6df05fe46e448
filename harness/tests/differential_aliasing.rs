//! Rule 22 (page aliasing): the allocator and the reference model — each written from the text
//! alone — agree on hand-made sequences that reach its parts: borrowing instead of unmapping
//! (22f) and its order (the candidates with the most whole pages first), a lent block chosen by
//! best fit and re-homed (22c, 22d), a growth over a lent block (22e), and the release of lent
//! blocks (22g). Every step is compared (addresses, statistics, the layout, both invariant
//! checkers). Random sequences with the knob run in `differential.rs` and
//! `differential_threads.rs` (the knob tables draw it with expandable segments and a headroom).

use cachalot_harness::driver::run_scenario_observed;
use cachalot_harness::op::{ADOPT_REGION, AdoptBlockSpec, AdoptSpec, Op};
use cachalot_harness::scenario::{Knobs, Scenario};
use cachalot_harness::side::{BlockKind, Observation};

const MIB: u64 = 1 << 20;

/// cachalot's policy with page aliasing: expandable segments with 2 MiB pages, reclaim at
/// `headroom`.
fn knobs(headroom: f64) -> Knobs {
    Knobs {
        expandable_segments: true,
        expandable_page: 2 * MIB,
        reclaim_headroom: Some(headroom),
        page_aliasing: true,
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

/// Runs `ops` on both sides, checking agreement after every step, and returns the final
/// observation (both agree on it).
fn run(knobs: Knobs, ops: Vec<Op>) -> Observation {
    let scenario = Scenario {
        knobs: knobs.clone(),
        ops: ops.clone(),
    };
    run_scenario_observed(&scenario)
        .unwrap_or_else(|e| panic!("{e}\nknobs: {knobs:?}\nops: {ops:?}"))
}

fn stat(o: &Observation, path: &str) -> i64 {
    let value = o
        .stat(path)
        .unwrap_or_else(|| panic!("no statistic {path}"));
    i64::try_from(value).expect("a statistic fits i64")
}

/// Rule 22's example, five times: A (10 MiB), B (4 MiB), free A, C (12 MiB), free B, free C.
fn example_passes(passes: usize) -> Vec<Op> {
    let mut ops = Vec::new();
    for _ in 0..passes {
        // Live blocks are picked by index in allocation order among those live.
        ops.extend([malloc(10 * MIB), malloc(4 * MIB), free(0), malloc(12 * MIB)]);
        ops.extend([free(0), free(0)]);
    }
    ops
}

#[test]
fn the_example_makes_calls_in_its_first_pass_only_alike() {
    let one = run(knobs(0.025), example_passes(1));
    let five = run(knobs(0.025), example_passes(5));
    for counter in ["num_device_alloc", "num_device_free"] {
        assert_eq!(
            stat(&one, counter),
            stat(&five, counter),
            "{counter}: passes 2-5 make no device call"
        );
    }
    // A and B mapped, then C: an alias of A's five pages and one new page.
    assert_eq!(stat(&one, "num_device_alloc"), 4);
    assert_eq!(stat(&one, "reserved_bytes.all.current"), (16 * MIB) as i64);
    assert_eq!(stat(&five, "reserved_bytes.all.peak"), (16 * MIB) as i64);
}

#[test]
fn borrowing_takes_the_candidate_with_the_most_whole_pages_first_alike() {
    // Holes of 6 MiB (3 pages) and 10 MiB (5 pages) between live blocks; a 12 MiB request
    // over the limit borrows 6 pages: 5 from the larger hole, then 1 from the smaller. Taken
    // smallest first, 3 + 3, the lent blocks and the new home would lie elsewhere.
    let o = run(
        knobs(0.0),
        vec![
            malloc(6 * MIB),
            malloc(2 * MIB),
            malloc(10 * MIB),
            malloc(2 * MIB),
            free(0),
            free(1),
            malloc(12 * MIB),
        ],
    );
    assert_eq!(
        stat(&o, "reserved_bytes.all.current"),
        (20 * MIB) as i64,
        "every page borrowed, none created"
    );
    assert_eq!(stat(&o, "num_device_free"), 0, "nothing unmapped");
    // Four map steps, then two aliases (one per candidate).
    assert_eq!(stat(&o, "num_device_alloc"), 6);
}

#[test]
fn empty_cache_unmaps_lent_blocks_and_gives_every_page_back_alike() {
    let mut ops = example_passes(2);
    ops.push(Op::EmptyCache);
    let o = run(knobs(0.025), ops);
    assert_eq!(stat(&o, "reserved_bytes.all.current"), 0);
    assert!(
        stat(&o, "num_device_free") >= 2,
        "the lent block and the pages"
    );
}

/// The blocks of `kind` in the adopted range, as (offset, size) in MiB from its address.
fn adopted_blocks(o: &Observation, kind: BlockKind) -> Vec<(u64, u64)> {
    o.layout
        .iter()
        .flat_map(|s| s.blocks.iter())
        .filter(|b| b.kind == kind)
        .map(|b| ((b.address - ADOPT_REGION) / MIB, b.size / MIB))
        .collect()
}

/// A block of an adopted range: `state` 0 free, 1 allocated (all of it requested), 3 unmapped.
fn adopted(size: u64, state: u8) -> AdoptBlockSpec {
    AdoptBlockSpec {
        size,
        state,
        requested: if state == 1 { size } else { 0 },
        streams: vec![],
    }
}

#[test]
fn borrowing_passes_over_free_blocks_holding_homes_of_the_runs_lent_pages_alike() {
    // Found by the device_faults fuzz target (fuzz/regressions/device_faults/
    // alias_adopted_range*): the allocator borrowed from such a block and then asked the
    // device to alias over mapped slots. Offsets in MiB from the range's address, 2 MiB pages.
    // Adopted: [0, 20) unmapped, [20, 32) free, [32, 34) allocated, [34, 36) free, [36, 39)
    // allocated, [39, 40) free, and the same again from 40 (the 3 MiB and 1 MiB blocks leave
    // the slot [38, 40) half busy).
    let half = [(20, 3), (12, 0), (2, 1), (2, 0), (3, 1), (1, 0)];
    let blocks = half
        .iter()
        .chain(half.iter())
        .map(|&(mib, state)| adopted(mib * MIB, state))
        .collect();
    let range = AdoptSpec {
        address: ADOPT_REGION,
        size: 0,
        stream: 0,
        small: false,
        blocks,
    };
    let o = run(
        Knobs {
            max_split_size: 20 * MIB,
            max_non_split_rounding_size: 40 * MIB,
            capacity: 96 * MIB,
            ..knobs(0.25)
        },
        vec![
            Op::AdoptRange { range },
            // [20, 36) becomes one free block.
            free(0),
            // 20 MiB at 0, over the limit: 8 pages borrowed from [20, 36), 2 from [60, 64)
            // (lent blocks there, their pages' homes at [0, 16) and [16, 20)).
            malloc(20 * MIB),
            free(3),
            // 24 MiB: the growth starts at the free [39, 40) and runs over the unmapped [40,
            // 60) and the lent [60, 64), whose pages' homes lie in the free [0, 20): that block
            // is passed over (borrowing it would move those homes into the run); the pages come
            // from [64, 72) and [74, 76), the rest is new.
            malloc(24 * MIB),
        ],
    );
    let free_blocks = adopted_blocks(&o, BlockKind::Free);
    assert!(
        free_blocks.contains(&(0, 16)),
        "the lender of the run's lent pages keeps its pages: {free_blocks:?}"
    );
    let allocated = adopted_blocks(&o, BlockKind::Allocated);
    assert!(allocated.contains(&(39, 24)), "{allocated:?}");
}

#[test]
fn borrowing_passes_over_a_free_block_whose_first_page_is_the_home_of_a_lent_page_of_the_run_alike()
{
    // Rule 22f's lender list leaves out a free block holding the home of a page that a lent
    // slot of the growth's run maps, also when that home is the block's first page. Offsets in
    // MiB from the range's address, 2 MiB pages. Adopted: [0, 20) unmapped, [20, 22) allocated,
    // [22, 42) unmapped, [42, 44) free (one page), [44, 46) allocated, the rest unmapped.
    let layout = [(20, 3), (2, 1), (20, 3), (2, 0), (2, 1)];
    let range = AdoptSpec {
        address: ADOPT_REGION,
        size: 0,
        stream: 0,
        small: false,
        blocks: layout
            .iter()
            .map(|&(mib, state)| adopted(mib * MIB, state))
            .collect(),
    };
    let o = run(
        Knobs {
            max_split_size: 20 * MIB,
            max_non_split_rounding_size: 40 * MIB,
            capacity: 96 * MIB,
            ..knobs(0.05)
        },
        vec![
            Op::AdoptRange { range },
            // 20 MiB at 0: 6 MiB reserved + 20 passes the limit (24 MiB requested at most, +
            // 5 %) by less than a page: one page borrowed from [42, 44), which becomes lent,
            // its home the first slot of the new block; 9 pages new.
            malloc(20 * MIB),
            // The 20 MiB block freed: its first page is that home.
            free(2),
            // 21 MiB: the growth starts at the unmapped [22, 42) and runs over the lent
            // [42, 44). Its map step over the limit may not borrow from [0, 20) (that would
            // move the lent page's home into the run): 10 new pages, then the lent slot
            // re-homed, the home at 0 carved out of [0, 20).
            malloc(21 * MIB),
        ],
    );
    let allocated = adopted_blocks(&o, BlockKind::Allocated);
    assert!(allocated.contains(&(22, 21)), "{allocated:?}");
    let free_blocks = adopted_blocks(&o, BlockKind::Free);
    assert!(
        free_blocks.contains(&(2, 18)),
        "the lender keeps its pages but the carved home: {free_blocks:?}"
    );
    assert_eq!(stat(&o, "reserved_bytes.all.current"), (44 * MIB) as i64);
}

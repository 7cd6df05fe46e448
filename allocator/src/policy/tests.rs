//! Behaviour-named unit tests of the policy core on the simulated device: each test states one
//! rule of ARCHITECTURE.md in its name and asserts exactly that, beside the differential tests
//! that compare the core with the reference model operation by operation.

use super::*;
use crate::backend::sim::{SIM_BASE_ADDRESS, SimDevice};
use crate::block::Backing;
use crate::invariants::InvariantViolation;
use crate::policy::adopt::{AdoptedBlock, AdoptedRange, AdoptedState};

const MIB: u64 = 1 << 20;

fn core(capacity: u64) -> CachingCore<SimDevice> {
    CachingCore::new(SimDevice::new(capacity), Settings::pytorch()).unwrap()
}

fn core_with_max_split(capacity: u64, mb: u64) -> CachingCore<SimDevice> {
    let mut settings = Settings::pytorch();
    settings.set_max_split_size_mb(mb).unwrap();
    CachingCore::new(SimDevice::new(capacity), settings).unwrap()
}

/// The segment starting at `address`.
fn segment(c: &CachingCore<SimDevice>, address: u64) -> SegmentInfo {
    c.segments()
        .into_iter()
        .find(|s| s.address == address)
        .unwrap_or_else(|| panic!("no segment at {address:#x}"))
}

/// The segments released to the device, in order, as `(stream, size, address)`.
fn released(c: &CachingCore<SimDevice>) -> Vec<(u64, u64, u64)> {
    c.history()
        .iter()
        .filter(|e| e.action == TraceAction::SegmentFree)
        .map(|e| (e.stream.0, e.size, e.address))
        .collect()
}

// --- rule 6: best fit --------------------------------------------------------------------

#[test]
fn best_fit_takes_the_smallest_size_then_the_lowest_address_among_the_streams_free_blocks() {
    let mut c = core(1 << 30);
    let (s0, s1) = (StreamId(0), StreamId(1));
    // Whole free segments: stream 1's 12 MiB at the lowest address, then stream 0's 14, 12
    // and 12 MiB.
    let other_stream = c.malloc(12 * MIB, s1).unwrap();
    let big = c.malloc(14 * MIB, s0).unwrap();
    let first_12 = c.malloc(12 * MIB, s0).unwrap();
    let second_12 = c.malloc(12 * MIB, s0).unwrap();
    assert!(other_stream < big && big < first_12 && first_12 < second_12);
    for a in [other_stream, big, first_12, second_12] {
        c.free(a).unwrap();
    }
    // Smallest size that fits on the request's stream, then the lowest address; never the
    // other stream's block, though it is as small and lower.
    assert_eq!(c.malloc(11 * MIB, s0).unwrap(), first_12);
    assert_eq!(c.malloc(12 * MIB, s0).unwrap(), second_12);
    assert_eq!(c.malloc(12 * MIB, s0).unwrap(), big);
    assert_eq!(c.stats().num_device_alloc, 4);
    // Stream 0's only free block left (the 2 MiB rest of the 14 MiB one) is too small: a new
    // segment, not stream 1's free 12 MiB block, which comes next in the free set.
    let fresh = c.malloc(12 * MIB, s0).unwrap();
    assert_ne!(fresh, other_stream);
    assert_eq!(c.stats().num_device_alloc, 5);
    c.check_invariants().unwrap();
}

// --- rule 13: split ----------------------------------------------------------------------

#[test]
fn a_small_pool_block_is_split_when_at_least_512_bytes_remain() {
    let mut c = core(1 << 30);
    let s = StreamId(0);
    let a = c.malloc(MIB, s).unwrap();
    // 1 MiB of the 2 MiB segment remains: split.
    assert_eq!(segment(&c, a).blocks.len(), 2);
    // 1 MiB − 512 of the remaining 1 MiB: exactly 512 B remain, still split.
    let b = c.malloc(MIB - 512, s).unwrap();
    assert_eq!(b, a + MIB);
    let blocks = segment(&c, a).blocks;
    assert_eq!(blocks.len(), 3);
    assert_eq!((blocks[2].size, blocks[2].state), (512, BlockPhase::Free));
    // 512 B of the last 512 B: nothing remains, no split.
    let last = c.malloc(512, s).unwrap();
    assert_eq!(last, a + 2 * MIB - 512);
    let blocks = segment(&c, a).blocks;
    assert_eq!(blocks.len(), 3);
    assert!(blocks.iter().all(|b| b.state == BlockPhase::Allocated));
    c.check_invariants().unwrap();
}

#[test]
fn a_large_pool_block_is_split_only_when_more_than_1_mib_remains() {
    let s = StreamId(0);
    // 19 MiB of a 20 MiB segment: exactly 1 MiB would remain, no split.
    let mut c = core(1 << 30);
    let a = c.malloc(19 * MIB, s).unwrap();
    let seg = segment(&c, a);
    assert_eq!((seg.size, seg.blocks.len()), (20 * MIB, 1));
    assert_eq!(c.stats().allocated_bytes.all.current, (20 * MIB) as i64);
    // 512 B less: 1 MiB + 512 B remain, split.
    let mut c = core(1 << 30);
    let a = c.malloc(19 * MIB - 512, s).unwrap();
    let blocks = segment(&c, a).blocks;
    assert_eq!(blocks.len(), 2);
    assert_eq!(blocks[0].size, 19 * MIB - 512);
    assert_eq!(
        (blocks[1].size, blocks[1].state),
        (MIB + 512, BlockPhase::Free)
    );
    c.check_invariants().unwrap();
}

#[test]
fn a_large_pool_block_is_not_split_for_a_request_at_or_above_max_split_size() {
    let s = StreamId(0);
    let mut c = core_with_max_split(1 << 30, 20);
    let a = c.malloc(40 * MIB, s).unwrap();
    c.free(a).unwrap();
    // 25 MiB ≥ max_split_size (20 MiB), served by the cached 40 MiB block (within the 20 MiB
    // non-split rounding): handed out whole, 15 MiB stay with it.
    assert_eq!(c.malloc(25 * MIB, s).unwrap(), a);
    let seg = segment(&c, a);
    assert_eq!(seg.blocks.len(), 1);
    assert_eq!(c.stats().allocated_bytes.all.current, (40 * MIB) as i64);
    // Without max_split_size the same request splits the block.
    let mut c = core(1 << 30);
    let a = c.malloc(40 * MIB, s).unwrap();
    c.free(a).unwrap();
    assert_eq!(c.malloc(25 * MIB, s).unwrap(), a);
    assert_eq!(segment(&c, a).blocks.len(), 2);
    c.check_invariants().unwrap();
}

// --- rule 10: merge ----------------------------------------------------------------------

#[test]
fn a_freed_block_merges_with_both_free_neighbours() {
    let mut c = core(1 << 30);
    let s = StreamId(0);
    let a = c.malloc(512, s).unwrap();
    let b = c.malloc(512, s).unwrap();
    let d = c.malloc(512, s).unwrap();
    // [a][b][d][rest, free]
    assert_eq!(segment(&c, a).blocks.len(), 4);
    c.free(a).unwrap();
    // a has no free neighbour: 4 blocks.
    assert_eq!(segment(&c, a).blocks.len(), 4);
    c.free(d).unwrap();
    // d merges with the free rest after it: [a, free][b][d + rest, free].
    let blocks = segment(&c, a).blocks;
    assert_eq!(blocks.len(), 3);
    assert_eq!((blocks[2].address, blocks[2].size), (d, 2 * MIB - 1024));
    // b merges with both: one free block, the whole segment.
    c.free(b).unwrap();
    let blocks = segment(&c, a).blocks;
    assert_eq!(blocks.len(), 1);
    assert_eq!(
        (blocks[0].address, blocks[0].size, blocks[0].state),
        (a, 2 * MIB, BlockPhase::Free)
    );
    assert_eq!(c.stats().inactive_split.all.current, 0);
    assert_eq!(c.stats().inactive_split_bytes.all.current, 0);
    c.check_invariants().unwrap();
}

#[test]
fn a_pending_neighbour_is_not_merged_until_its_events_complete() {
    let mut c = core(1 << 30);
    let (s0, s1) = (StreamId(0), StreamId(1));
    let a = c.malloc(512, s0).unwrap();
    let b = c.malloc(512, s0).unwrap();
    c.record_stream(b, s1).unwrap();
    c.free(b).unwrap();
    c.free(a).unwrap();
    // b is pending: a stays apart from the free rest after b.
    let states: Vec<BlockPhase> = segment(&c, a).blocks.iter().map(|x| x.state).collect();
    assert_eq!(
        states,
        [BlockPhase::Free, BlockPhase::Pending, BlockPhase::Free]
    );
    // Stream 1 completes; the next request processes the event and b merges with both.
    c.backend_mut().complete_stream(s1);
    let big = c.malloc(4 * MIB, s0).unwrap();
    let blocks = segment(&c, a).blocks;
    assert_eq!(blocks.len(), 1);
    assert_eq!(blocks[0].state, BlockPhase::Free);
    c.free(big).unwrap();
    c.check_invariants().unwrap();
}

// --- rule 9: release order ---------------------------------------------------------------

#[test]
fn empty_cache_releases_the_large_pool_then_the_small_pool_each_in_free_set_order() {
    let mut c = core(1 << 30);
    let (s0, s1) = (StreamId(0), StreamId(1));
    // Allocated in an order that is neither the free-set order nor the address order reversed.
    let large_s1_12 = c.malloc(12 * MIB, s1).unwrap();
    let large_s0_14 = c.malloc(14 * MIB, s0).unwrap();
    let large_s0_12 = c.malloc(12 * MIB, s0).unwrap();
    let small_s1 = c.malloc(512, s1).unwrap();
    let small_s0 = c.malloc(512, s0).unwrap();
    for a in [large_s1_12, large_s0_14, large_s0_12, small_s1, small_s0] {
        c.free(a).unwrap();
    }
    c.record_history(Some(usize::MAX));
    c.empty_cache().unwrap();
    assert_eq!(
        released(&c),
        [
            (0, 12 * MIB, large_s0_12),
            (0, 14 * MIB, large_s0_14),
            (1, 12 * MIB, large_s1_12),
            (0, 2 * MIB, small_s0),
            (1, 2 * MIB, small_s1),
        ]
    );
    assert!(c.segments().is_empty());
    assert_eq!(c.backend().used(), 0);
}

#[test]
fn empty_cache_keeps_split_segments() {
    let mut c = core(1 << 30);
    let s = StreamId(0);
    let kept = c.malloc(512, s).unwrap();
    let gone = c.malloc(12 * MIB, s).unwrap();
    c.free(gone).unwrap();
    c.empty_cache().unwrap();
    let segments = c.segments();
    assert_eq!(segments.len(), 1);
    assert_eq!(segments[0].address, kept);
    c.check_invariants().unwrap();
}

// --- rule 11: oversize release -----------------------------------------------------------

/// A full 120 MiB device with max_split_size 20 MiB and whole free segments of 30, 40 and 50
/// MiB cached on stream 0 (all oversize); their addresses, smallest first.
fn full_of_oversize_blocks() -> (CachingCore<SimDevice>, [u64; 3]) {
    let mut c = core_with_max_split(120 * MIB, 20);
    let s = StreamId(0);
    let a30 = c.malloc(30 * MIB, s).unwrap();
    let a40 = c.malloc(40 * MIB, s).unwrap();
    let a50 = c.malloc(50 * MIB, s).unwrap();
    for a in [a30, a40, a50] {
        c.free(a).unwrap();
    }
    assert_eq!(c.backend().used(), 120 * MIB);
    c.record_history(Some(usize::MAX));
    (c, [a30, a40, a50])
}

#[test]
fn oversize_release_frees_the_first_cached_block_at_least_as_large_as_the_key() {
    let (mut c, [a30, a40, a50]) = full_of_oversize_blocks();
    // 12 MiB < max_split_size: no oversize block may serve it, the device is full; the key is
    // max(12 MiB, 20 MiB), and the first block of at least 20 MiB in free-set order is 30 MiB.
    let p = c.malloc(12 * MIB, StreamId(0)).unwrap();
    assert_eq!(released(&c), [(0, 30 * MIB, a30)]);
    assert_eq!(p, a30);
    let kept: Vec<u64> = c.segments().iter().map(|s| s.address).collect();
    assert_eq!(kept, [a30, a40, a50]);
    // Released by rule 11, not by releasing everything (rule 7d).
    assert_eq!(c.stats().num_alloc_retries, 0);
    c.check_invariants().unwrap();
}

#[test]
fn oversize_release_frees_the_largest_blocks_first_until_the_key_is_reached() {
    let (mut c, [a30, a40, a50]) = full_of_oversize_blocks();
    // 60 MiB: no cached block is that large; the largest ones go, 50 then 40 MiB (90 ≥ 60),
    // and the 30 MiB block stays.
    let p = c.malloc(60 * MIB, StreamId(0)).unwrap();
    assert_eq!(released(&c), [(0, 50 * MIB, a50), (0, 40 * MIB, a40)]);
    let kept: Vec<u64> = c.segments().iter().map(|s| s.address).collect();
    assert!(kept.contains(&a30) && kept.contains(&p) && kept.len() == 2);
    assert_eq!(c.stats().num_alloc_retries, 0);
    c.check_invariants().unwrap();
}

// --- rule 12: garbage collection -----------------------------------------------------------

/// A 1,000 MiB device, all of it allowed, collected above half of it (rule 12); blocks of
/// 21 MiB or more are not split for smaller requests (rule 6).
fn collected_above_half() -> CachingCore<SimDevice> {
    let mut settings = Settings::pytorch();
    settings.set_garbage_collection_threshold(0.5).unwrap();
    settings.set_max_split_size_mb(21).unwrap();
    let mut c = CachingCore::new(SimDevice::new(1000 * MIB), settings).unwrap();
    c.set_memory_fraction(1.0).unwrap();
    c
}

#[test]
fn rule_12_stops_once_exactly_the_target_is_reclaimed() {
    // The 12 MiB requests below make segments of their own (blocks of 21 MiB or more are not
    // split for them) and leave the old free segment whole.
    let mut c = collected_above_half();
    let s = StreamId(0);
    let old = c.malloc(40 * MIB, s).unwrap();
    let young = c.malloc(20 * MIB, s).unwrap();
    c.free(old).unwrap();
    // Three searches age the old free segment; the young one is freed after them.
    for _ in 0..3 {
        c.malloc(12 * MIB, s).unwrap();
    }
    c.free(young).unwrap();
    // 40 + 20 + 3 × 12 + 444 = 540 MiB reserved: 40 MiB above the threshold of 500.
    c.malloc(444 * MIB, s).unwrap();
    assert_eq!(c.stats().reserved_bytes.all.current, 540 * MIB as i64);
    // No cached block fits 60 MiB: the collection's first round releases the segments at
    // least as old as the mean (the old one, 40 MiB) and has then reclaimed exactly its
    // target, so it stops: the young segment stays cached.
    c.malloc(60 * MIB, s).unwrap();
    let left: Vec<u64> = c.segments().iter().map(|g| g.address).collect();
    assert!(!left.contains(&old), "the old free segment is collected");
    assert!(
        left.contains(&young),
        "a round past the target collected the young segment too"
    );
    assert_eq!(c.stats().reserved_bytes.all.current, 560 * MIB as i64);
}

// --- rule 15: record_stream on the null address -----------------------------------------

#[test]
fn recording_a_stream_on_the_null_address_is_a_no_op() {
    let mut c = core(1 << 30);
    let a = c.malloc(512, StreamId(0)).unwrap();
    let before = (c.stats().clone(), c.segments());
    assert_eq!(c.record_stream(0, StreamId(3)), Ok(()));
    assert_eq!((c.stats().clone(), c.segments()), before);
    // Any other address that is not a live allocation is an error.
    assert_eq!(
        c.record_stream(a + 512, StreamId(3)),
        Err(Error::UnknownPointer { address: a + 512 })
    );
    // The block was used on no other stream: freeing it records no event.
    c.free(a).unwrap();
    assert_eq!(c.backend().live_events(), 0);
}

// --- the invariant checker ---------------------------------------------------------------

#[test]
fn a_statistic_that_drifts_from_the_blocks_is_a_typed_violation() {
    let mut c = core(1 << 30);
    c.malloc(4096, StreamId(0)).unwrap();
    c.check_invariants().unwrap();
    c.stats.allocation.increase(Pool::Small, 1);
    let e = c.check_invariants().unwrap_err();
    assert_eq!(
        e,
        InvariantViolation::Statistic {
            name: "allocation",
            have: [2, 2, 0],
            want: [1, 1, 0],
        }
    );
    assert_eq!(
        e.to_string(),
        "allocation: counters say [2, 2, 0] (all, small, large), blocks add up to [1, 1, 0]"
    );
}

#[test]
fn a_block_missing_from_its_free_set_is_a_typed_violation() {
    let mut c = core(1 << 30);
    let a = c.malloc(512, StreamId(0)).unwrap();
    let rest = c.free[Pool::Small.index()].iter().next().unwrap();
    c.free[Pool::Small.index()].remove(&rest);
    assert_eq!(
        c.check_invariants(),
        Err(InvariantViolation::FreeSetMembership { address: a + 512 })
    );
    assert_eq!(SIM_BASE_ADDRESS, a);
}

// --- rule 22: page aliasing --------------------------------------------------------------

/// A core on a large simulated device under rule 22's example settings: 2 MiB pages in both
/// pools, 2.5 % reclaim headroom, page aliasing.
fn aliasing_core(capacity: u64) -> CachingCore<SimDevice> {
    let settings = Settings::pytorch()
        .apply(
            "expandable_segments:True,expandable_page_mb:2,reclaim_headroom:0.025,\
             page_aliasing:True",
        )
        .unwrap();
    CachingCore::new(SimDevice::new(capacity), settings).unwrap()
}

/// Every block of every range, lent and unmapped ones included, by address: `(address, size,
/// backing, state)`.
fn range_layout(c: &CachingCore<SimDevice>) -> Vec<(u64, u64, Backing, BlockPhase)> {
    let mut out: Vec<_> = c
        .blocks
        .iter()
        .filter(|(_, b)| b.range.is_some())
        .map(|(_, b)| (b.address, b.size, b.backing, b.state))
        .collect();
    out.sort_unstable_by_key(|b| b.0);
    out
}

/// Both checkers of rule 22i: the core's, and the device's own page table — the pages under
/// the live (allocated or pending) blocks' slots are pairwise distinct.
fn check_aliasing(c: &CachingCore<SimDevice>) {
    c.check_invariants().unwrap();
    let mut slots: Vec<u64> = Vec::new();
    for s in c.segments().iter().filter(|s| s.expandable) {
        for b in s.blocks.iter().filter(|b| b.state != BlockPhase::Free) {
            let first = b.address / (2 * MIB) * (2 * MIB);
            slots.extend((first..b.address + b.size).step_by(2 * MIB as usize));
        }
    }
    slots.sort_unstable();
    slots.dedup();
    let mut pages: Vec<_> = slots
        .iter()
        .map(|&s| {
            c.backend()
                .page_at(s)
                .expect("a live block's slot is mapped")
        })
        .collect();
    pages.sort_unstable();
    let n = pages.len();
    pages.dedup();
    assert_eq!(pages.len(), n, "a page lies under two live blocks");
}

const S: StreamId = StreamId(0);

/// Rule 22's example pass: alloc A (10 MiB), alloc B (4 MiB), free A, alloc C (12 MiB), free B,
/// free C.
fn example_pass(c: &mut CachingCore<SimDevice>) {
    let a = c.malloc(10 * MIB, S).unwrap();
    check_aliasing(c);
    let b = c.malloc(4 * MIB, S).unwrap();
    check_aliasing(c);
    c.free(a).unwrap();
    let cc = c.malloc(12 * MIB, S).unwrap();
    check_aliasing(c);
    c.free(b).unwrap();
    c.free(cc).unwrap();
    check_aliasing(c);
}

#[test]
fn a_loop_whose_allocations_repeat_reaches_a_steady_state_with_no_device_call() {
    let mut c = aliasing_core(1 << 36);
    let base = SIM_BASE_ADDRESS;
    c.record_history(Some(usize::MAX));
    example_pass(&mut c);
    // Pass 1: A and B are mapped (5 and 2 pages); C borrows A's five free pages by one alias
    // and maps one new page.
    let maps: Vec<(TraceAction, u64, u64)> = c
        .history()
        .iter()
        .filter(|e| {
            matches!(
                e.action,
                TraceAction::SegmentMap | TraceAction::SegmentUnmap
            )
        })
        .map(|e| (e.action, e.address - base, e.size / MIB))
        .collect();
    use TraceAction::{SegmentMap as Map, SegmentUnmap as Unmap};
    let mut want = vec![(Map, 0, 10), (Map, 10 * MIB, 4)];
    want.extend((0..5).map(|i| (Unmap, 2 * i * MIB, 2)));
    want.extend([(Map, 14 * MIB, 10), (Map, 24 * MIB, 2)]);
    assert_eq!(maps, want);
    assert_eq!(c.stats().num_device_alloc, 4);
    assert_eq!(c.stats().num_device_free, 0);
    assert_eq!(c.backend().call_counts(), (4, 0));
    // 16 MiB of memory (eight pages), though 26 MiB of the range is mapped: A's old place is
    // lent, B and C's free.
    assert_eq!(c.stats().reserved_bytes.all.current, 16 * MIB as i64);
    assert_eq!(c.backend().used(), 16 * MIB);
    let end_of_pass = range_layout(&c);
    assert_eq!(
        end_of_pass[..3],
        [
            (base, 10 * MIB, Backing::Lent, BlockPhase::Free),
            (base + 10 * MIB, 16 * MIB, Backing::Mapped, BlockPhase::Free),
            (
                base + 26 * MIB,
                end_of_pass[2].1,
                Backing::Unmapped,
                BlockPhase::Free
            ),
        ]
    );
    assert_eq!(end_of_pass.len(), 3);
    let segments = c.segments();
    for pass in 2..=5 {
        example_pass(&mut c);
        assert_eq!(c.stats().num_device_alloc, 4, "pass {pass}");
        assert_eq!(c.stats().num_device_free, 0, "pass {pass}");
        assert_eq!(c.backend().call_counts(), (4, 0), "pass {pass}");
        assert_eq!(range_layout(&c), end_of_pass, "pass {pass}");
        assert_eq!(c.segments(), segments, "pass {pass}");
        assert_eq!(c.stats().reserved_bytes.all.current, 16 * MIB as i64);
    }
    c.empty_cache().unwrap();
    assert_eq!(c.backend().used(), 0);
}

/// The map and unmap entries of the history since it was last cleared, relative to `base`, in
/// MiB: `(action, offset, size)`.
fn map_history(c: &CachingCore<SimDevice>, base: u64) -> Vec<(TraceAction, u64, u64)> {
    c.history()
        .iter()
        .filter(|e| {
            matches!(
                e.action,
                TraceAction::SegmentMap | TraceAction::SegmentUnmap
            )
        })
        .map(|e| (e.action, (e.address - base) / MIB, e.size / MIB))
        .collect()
}

/// What [`observed`] sees: the ranges' blocks, the statistics, device memory, the device's call
/// counts and the pages behind the mapped part of the ranges.
type Observed = (
    Vec<(u64, u64, Backing, BlockPhase)>,
    Stats,
    u64,
    (u64, u64),
    Vec<Option<crate::backend::sim::PageId>>,
);

/// Everything observable of a core and its device, to tell that a failed call changed nothing.
fn observed(c: &CachingCore<SimDevice>) -> Observed {
    let layout = range_layout(c);
    let pages = layout
        .iter()
        .filter(|b| b.1 < 1 << 30)
        .flat_map(|b| (b.0..b.0 + b.1).step_by(2 * MIB as usize))
        .map(|a| c.backend().page_at(a))
        .collect();
    (
        layout,
        c.stats().clone(),
        c.backend().used(),
        c.backend().call_counts(),
        pages,
    )
}

#[test]
fn re_homing_carves_each_home_out_of_its_free_block_and_changes_no_statistic() {
    // Rule 22c, through rule 22d: after the example's first pass A's old place [0, 10) MiB is
    // lent, its pages at home in the free [10, 26).
    let mut c = aliasing_core(1 << 36);
    let base = SIM_BASE_ADDRESS;
    example_pass(&mut c);
    let stats = c.stats().clone();
    c.record_history(Some(usize::MAX));
    assert_eq!(c.malloc(10 * MIB, S).unwrap(), base);
    // Each home is carved (unmapped there) in address order, then the lent slots are mapped as
    // the new homes; then the allocation.
    use TraceAction::{SegmentMap as Map, SegmentUnmap as Unmap};
    let mut want: Vec<_> = (0..5).map(|i| (Unmap, 14 + 2 * i, 2)).collect();
    want.push((Map, 0, 10));
    assert_eq!(map_history(&c, base), want);
    assert_eq!(c.history().last().unwrap().action, TraceAction::Alloc);
    // The homes became one lent block between the free parts before and after them.
    let layout = range_layout(&c);
    assert_eq!(
        layout[..5],
        [
            (base, 10 * MIB, Backing::Mapped, BlockPhase::Allocated),
            (base + 10 * MIB, 4 * MIB, Backing::Mapped, BlockPhase::Free),
            (base + 14 * MIB, 10 * MIB, Backing::Lent, BlockPhase::Free),
            (base + 24 * MIB, 2 * MIB, Backing::Mapped, BlockPhase::Free),
            (
                base + 26 * MIB,
                layout[4].1,
                Backing::Unmapped,
                BlockPhase::Free
            ),
        ]
    );
    // No driver call; reserved bytes, device memory and segment counts as before.
    assert_eq!(c.backend().call_counts(), (4, 0));
    assert_eq!(c.backend().used(), 16 * MIB);
    let s = c.stats();
    assert_eq!(s.reserved_bytes, stats.reserved_bytes);
    assert_eq!(s.segment, stats.segment);
    assert_eq!(s.inactive_split, stats.inactive_split);
    assert_eq!(
        (s.num_device_alloc, s.num_device_free),
        (stats.num_device_alloc, stats.num_device_free)
    );
    // The pages under A are the ones its lent slots mapped before.
    let page = c.backend().page_at(base).unwrap();
    assert_eq!(
        c.backend().mappings(page),
        [base, base + 14 * MIB],
        "home and the old home, now lent"
    );
    check_aliasing(&c);
}

#[test]
fn best_fit_takes_a_lent_block_whose_pages_are_usable_even_when_only_it_fits() {
    // Rule 22d and rule 17a's question: two lent pages whose homes lie in two free 2 MiB
    // blocks serve a 4 MiB request no free block can.
    let mut c = aliasing_core(1 << 36);
    let base = SIM_BASE_ADDRESS;
    let x: Vec<u64> = (0..4).map(|_| c.malloc(2 * MIB, S).unwrap()).collect();
    c.free(x[0]).unwrap();
    c.free(x[2]).unwrap();
    // Growing 4 MiB past the limit borrows both free pages (two candidates, two aliases).
    let y = c.malloc(4 * MIB, S).unwrap();
    assert_eq!(y, base + 8 * MIB);
    assert_eq!(c.stats().num_device_alloc, 6);
    assert_eq!(c.stats().reserved_bytes.all.current, 8 * MIB as i64);
    c.free(y).unwrap();
    // A lent block smaller by (size, address) than rule 19a's candidate wins: [0, 2) re-homes
    // into the free [8, 12), then [4, 6) (2 MiB at 4 MiB before the free 2 MiB at 10 MiB).
    assert_eq!(c.malloc(2 * MIB, S).unwrap(), base);
    assert_eq!(c.malloc(2 * MIB, S).unwrap(), base + 4 * MIB);
    check_aliasing(&c);
    c.free(base).unwrap();
    c.free(base + 4 * MIB).unwrap();
    // Now the free blocks are 2 MiB each, and the lent [8, 12) maps the pages at home in them.
    assert_eq!(
        range_layout(&c)[4],
        (base + 8 * MIB, 4 * MIB, Backing::Lent, BlockPhase::Free)
    );
    assert!(c.has_cached_block(4 * MIB, S).unwrap());
    assert!(!c.has_cached_block(6 * MIB, S).unwrap());
    let calls = c.backend().call_counts();
    assert_eq!(c.malloc(4 * MIB, S).unwrap(), base + 8 * MIB);
    assert_eq!(c.backend().call_counts(), calls);
    check_aliasing(&c);
}

#[test]
fn a_lent_block_whose_pages_are_busy_is_no_candidate() {
    // Rule 22b: a page is busy when its home overlaps an allocated block.
    let mut c = aliasing_core(1 << 36);
    let base = SIM_BASE_ADDRESS;
    example_pass(&mut c);
    // 12 MiB: the lent [0, 10) is too small; the free [10, 26) serves it, over the homes.
    assert_eq!(c.malloc(12 * MIB, S).unwrap(), base + 10 * MIB);
    // 4 MiB: the lent block is smaller than the free [22, 26) but its first pages are busy.
    assert!(c.has_cached_block(4 * MIB, S).unwrap());
    assert_eq!(c.malloc(4 * MIB, S).unwrap(), base + 22 * MIB);
    // Nothing free is left, and the lent pages are all busy: no cached block.
    assert!(!c.has_cached_block(2 * MIB, S).unwrap());
    check_aliasing(&c);
}

#[test]
fn a_re_homed_lent_candidate_is_handed_out_from_its_first_byte_and_its_remainder_merges() {
    // Rule 22d: 9 MiB re-homes five pages ([0, 10)); the 1 MiB left merges with the free
    // [10, 14) after it, not with what lies before.
    let mut c = aliasing_core(1 << 36);
    let base = SIM_BASE_ADDRESS;
    example_pass(&mut c);
    assert_eq!(c.malloc(9 * MIB, S).unwrap(), base);
    assert_eq!(
        range_layout(&c)[..3],
        [
            (base, 9 * MIB, Backing::Mapped, BlockPhase::Allocated),
            (base + 9 * MIB, 5 * MIB, Backing::Mapped, BlockPhase::Free),
            (base + 14 * MIB, 10 * MIB, Backing::Lent, BlockPhase::Free),
        ]
    );
    check_aliasing(&c);
}

#[test]
fn growth_re_homes_a_lent_block_whose_slots_are_all_usable_without_a_device_call() {
    // Rule 22e: the second pass's C grows from the lent block where the first pass's C was.
    let mut c = aliasing_core(1 << 36);
    let base = SIM_BASE_ADDRESS;
    example_pass(&mut c);
    let a = c.malloc(10 * MIB, S).unwrap();
    let b = c.malloc(4 * MIB, S).unwrap();
    assert_eq!((a, b), (base, base + 10 * MIB));
    c.free(a).unwrap();
    c.record_history(Some(usize::MAX));
    let calls = c.backend().call_counts();
    // The lent [14, 24) maps pages at home in the free [0, 10): a start; with the free
    // [24, 26) after it the run holds 12 MiB.
    assert_eq!(c.malloc(12 * MIB, S).unwrap(), base + 14 * MIB);
    use TraceAction::{SegmentMap as Map, SegmentUnmap as Unmap};
    let mut want: Vec<_> = (0..5).map(|i| (Unmap, 2 * i, 2)).collect();
    want.push((Map, 14, 10));
    assert_eq!(map_history(&c, base), want);
    assert_eq!(c.backend().call_counts(), calls);
    assert_eq!(c.stats().num_device_alloc, 4);
    assert_eq!(c.stats().reserved_bytes.all.current, 16 * MIB as i64);
    assert_eq!(
        range_layout(&c)[..3],
        [
            (base, 10 * MIB, Backing::Lent, BlockPhase::Free),
            (
                base + 10 * MIB,
                4 * MIB,
                Backing::Mapped,
                BlockPhase::Allocated
            ),
            (
                base + 14 * MIB,
                12 * MIB,
                Backing::Mapped,
                BlockPhase::Allocated
            ),
        ]
    );
    check_aliasing(&c);
}

#[test]
fn a_start_whose_run_holds_the_home_of_one_of_its_lent_slots_is_not_taken() {
    // Rule 22e: free [0, 14) then lent [14, 24) whose pages are at home in [0, 10): the run from
    // 0 would carve its own start. The growth starts at the free [24, 26) instead and borrows
    // [0, 14)'s seven pages (one alias), then maps two new ones.
    let mut c = aliasing_core(1 << 36);
    let base = SIM_BASE_ADDRESS;
    example_pass(&mut c);
    let a = c.malloc(10 * MIB, S).unwrap();
    c.free(a).unwrap();
    assert_eq!(
        range_layout(&c)[..3],
        [
            (base, 14 * MIB, Backing::Mapped, BlockPhase::Free),
            (base + 14 * MIB, 10 * MIB, Backing::Lent, BlockPhase::Free),
            (base + 24 * MIB, 2 * MIB, Backing::Mapped, BlockPhase::Free),
        ]
    );
    c.record_history(Some(usize::MAX));
    assert_eq!(c.malloc(20 * MIB, S).unwrap(), base + 24 * MIB);
    use TraceAction::{SegmentMap as Map, SegmentUnmap as Unmap};
    let mut want: Vec<_> = (0..7).map(|i| (Unmap, 2 * i, 2)).collect();
    want.extend([(Map, 26, 14), (Map, 40, 4)]);
    assert_eq!(map_history(&c, base), want);
    assert_eq!(c.stats().num_device_alloc, 6);
    assert_eq!(c.stats().reserved_bytes.all.current, 20 * MIB as i64);
    // The carved [0, 14) merged with the lent [14, 24).
    assert_eq!(
        range_layout(&c)[0],
        (base, 24 * MIB, Backing::Lent, BlockPhase::Free)
    );
    check_aliasing(&c);
}

/// Runs `op` on the core, then both checkers of rule 22i.
fn checked<T>(
    c: &mut CachingCore<SimDevice>,
    op: impl FnOnce(&mut CachingCore<SimDevice>) -> T,
) -> T {
    let out = op(c);
    check_aliasing(c);
    out
}

#[test]
fn rule_22c_rehoming_a_lent_block_whose_page_has_its_home_just_before_it_keeps_the_block_chain() {
    // Rule 22c through rule 22d: the lent [12, 14) maps a page at home in the slot [10, 12) just
    // before it, inside the free [6, 12). Carving that home turns [10, 12) into a lent slot that
    // merges with [12, 14); the re-homed slot [12, 14) then leaves the merged lent block from
    // its middle, and the lent [10, 12) left before it must stay linked between the free
    // [6, 10) and the new home. Both checkers run after every operation.
    let mut c = aliasing_core(1 << 36);
    let base = SIM_BASE_ADDRESS;
    // W [0, 4), X [4, 6), H [6, 12), Z [12, 14): fourteen MiB live, seven new pages.
    let [w, x, h, z] = [4, 2, 6, 2].map(|mb| checked(&mut c, |c| c.malloc(mb * MIB, S).unwrap()));
    assert_eq!([w, x, h, z].map(|a| (a - base) / MIB), [0, 4, 6, 12]);
    // H's pages are borrowed by G's growth (w = 16 MiB, limit 16.4 MiB: three pages, then one
    // new one): [6, 12) is lent, its pages at home in G [14, 22).
    checked(&mut c, |c| c.free(h).unwrap());
    let g = checked(&mut c, |c| c.malloc(8 * MIB, S).unwrap());
    assert_eq!(g, base + 14 * MIB);
    assert_eq!(
        range_layout(&c)[2],
        (base + 6 * MIB, 6 * MIB, Backing::Lent, BlockPhase::Free)
    );
    // Rule 22g: the lent [6, 12) is unmapped (its pages stay at home under G): a hole between
    // the allocated X and Z, and 16 MiB still reserved.
    checked(&mut c, |c| c.empty_cache().unwrap());
    assert_eq!(
        range_layout(&c)[2],
        (base + 6 * MIB, 6 * MIB, Backing::Unmapped, BlockPhase::Free)
    );
    assert_eq!(c.stats().reserved_bytes.all.current, 16 * MIB as i64);
    checked(&mut c, |c| c.free(w).unwrap());
    checked(&mut c, |c| c.free(z).unwrap());
    // R (6 MiB) fits no free block and grows into the hole: w = 16 MiB, 22 MiB would be
    // reserved, so it borrows three pages: W's two first (the larger candidate), then Z's one,
    // which lands in the hole's last slot [10, 12), just before its old place [12, 14).
    c.record_history(Some(usize::MAX));
    let r = checked(&mut c, |c| c.malloc(6 * MIB, S).unwrap());
    assert_eq!(r, base + 6 * MIB);
    use TraceAction::{SegmentMap as Map, SegmentUnmap as Unmap};
    assert_eq!(
        map_history(&c, base),
        [
            (Unmap, 0, 2),
            (Unmap, 2, 2),
            (Map, 6, 4),
            (Unmap, 12, 2),
            (Map, 10, 2)
        ]
    );
    assert_eq!(c.stats().reserved_bytes.all.current, 16 * MIB as i64);
    checked(&mut c, |c| c.free(r).unwrap());
    let layout = range_layout(&c);
    assert_eq!(
        layout[..6],
        [
            (base, 4 * MIB, Backing::Lent, BlockPhase::Free),
            (
                base + 4 * MIB,
                2 * MIB,
                Backing::Mapped,
                BlockPhase::Allocated
            ),
            (base + 6 * MIB, 6 * MIB, Backing::Mapped, BlockPhase::Free),
            (base + 12 * MIB, 2 * MIB, Backing::Lent, BlockPhase::Free),
            (
                base + 14 * MIB,
                8 * MIB,
                Backing::Mapped,
                BlockPhase::Allocated
            ),
            (
                base + 22 * MIB,
                layout[5].1,
                Backing::Unmapped,
                BlockPhase::Free
            ),
        ]
    );
    // 2 MiB: the lent [12, 14) (its page at home in the free [6, 12)) is smaller than the free
    // [6, 12) and wins; its home [10, 12) is carved and merges with it, then [12, 14) leaves
    // the merged lent block from its middle. No device call.
    c.record_history(None);
    c.record_history(Some(usize::MAX));
    let calls = c.backend().call_counts();
    let y = checked(&mut c, |c| c.malloc(2 * MIB, S).unwrap());
    assert_eq!(y, base + 12 * MIB);
    assert_eq!(map_history(&c, base), [(Unmap, 10, 2), (Map, 12, 2)]);
    assert_eq!(c.backend().call_counts(), calls);
    assert_eq!(c.stats().reserved_bytes.all.current, 16 * MIB as i64);
    assert_eq!(
        range_layout(&c)[..6],
        [
            (base, 4 * MIB, Backing::Lent, BlockPhase::Free),
            (
                base + 4 * MIB,
                2 * MIB,
                Backing::Mapped,
                BlockPhase::Allocated
            ),
            (base + 6 * MIB, 4 * MIB, Backing::Mapped, BlockPhase::Free),
            (base + 10 * MIB, 2 * MIB, Backing::Lent, BlockPhase::Free),
            (
                base + 12 * MIB,
                2 * MIB,
                Backing::Mapped,
                BlockPhase::Allocated
            ),
            (
                base + 14 * MIB,
                8 * MIB,
                Backing::Mapped,
                BlockPhase::Allocated
            ),
        ]
    );
    // The block chain links the free [6, 10), the lent [10, 12) and Y both ways.
    let at = |a: u64| {
        c.blocks
            .iter()
            .find(|(_, b)| b.address == a && b.range.is_some())
            .unwrap()
    };
    let ((free_id, free), (lent_id, lent), (y_id, yb)) =
        (at(base + 6 * MIB), at(base + 10 * MIB), at(y));
    assert_eq!((free.next, lent.prev), (Some(lent_id), Some(free_id)));
    assert_eq!((lent.next, yb.prev), (Some(y_id), Some(lent_id)));
    // The page under Y is Z's: at home in Y, lent at [10, 12).
    let page = c.backend().page_at(y).unwrap();
    let mut mappings = c.backend().mappings(page);
    mappings.sort_unstable();
    assert_eq!(mappings, [base + 10 * MIB, y]);
    // segments() lists the runs of mapped blocks (rule 19h): the lent [10, 12) ends one.
    let runs: Vec<(u64, Vec<u64>)> = c
        .segments()
        .iter()
        .map(|s| {
            (
                (s.address - base) / MIB,
                s.blocks.iter().map(|b| b.size / MIB).collect(),
            )
        })
        .collect();
    assert_eq!(runs, [(4, vec![2, 4]), (12, vec![2, 8])]);
    // Everything goes back.
    for a in [y, x, g] {
        checked(&mut c, |c| c.free(a).unwrap());
    }
    checked(&mut c, |c| c.empty_cache().unwrap());
    assert_eq!(c.backend().used(), 0);
    assert_eq!(c.stats().reserved_bytes.all.current, 0);
}

#[test]
fn borrowing_takes_the_streams_largest_free_pages_first_and_never_touches_other_streams_or_pools() {
    // Rule 22f.
    let mut c = aliasing_core(1 << 36);
    let base = SIM_BASE_ADDRESS;
    let x: Vec<u64> = [4, 4, 6, 2]
        .iter()
        .map(|&mb| c.malloc(mb * MIB, S).unwrap())
        .collect();
    // Stream 1's free 8 MiB and the small pool's free page: memory rule 20 would unmap.
    let y = c.malloc(8 * MIB, StreamId(1)).unwrap();
    let small = c.malloc(512, S).unwrap();
    c.free(y).unwrap();
    c.free(small).unwrap();
    c.free(x[0]).unwrap();
    c.free(x[2]).unwrap();
    assert_eq!(c.stats().reserved_bytes.all.current, 26 * MIB as i64);
    assert_eq!(c.stats().num_device_alloc, 6);
    c.record_history(Some(usize::MAX));
    // 20 MiB: W = 24 MiB + 512 B, w = 26 MiB (6 live + 20), limit = 26.65 MiB; 46 MiB would
    // be reserved: borrow min(10, ⌈19.35 / 2⌉) = 10 pages, but stream 0's free blocks hold five:
    // [8, 14) first (three pages), then [0, 4); then five new pages.
    assert_eq!(c.malloc(20 * MIB, S).unwrap(), base + 16 * MIB);
    use TraceAction::{SegmentMap as Map, SegmentUnmap as Unmap};
    assert_eq!(
        map_history(&c, base),
        [
            (Unmap, 8, 2),
            (Unmap, 10, 2),
            (Unmap, 12, 2),
            (Map, 16, 6),
            (Unmap, 0, 2),
            (Unmap, 2, 2),
            (Map, 22, 4),
            (Map, 26, 10),
        ]
    );
    assert_eq!(c.stats().num_device_alloc, 9);
    assert_eq!(c.stats().num_device_free, 0);
    assert_eq!(c.stats().reserved_bytes.all.current, 36 * MIB as i64);
    assert_eq!(c.stats().reserved_bytes.small_pool.current, 2 * MIB as i64);
    assert_eq!(c.backend().used(), 36 * MIB);
    // Stream 1's block is still mapped and free.
    assert!(c.segments().iter().any(|s| s.stream == StreamId(1)
        && s.size == 8 * MIB
        && s.blocks[0].state == BlockPhase::Free));
    check_aliasing(&c);
}

#[test]
fn empty_cache_unmaps_the_lent_blocks_then_the_free_pages_and_gives_every_byte_back() {
    // Rule 22g.
    let mut c = aliasing_core(1 << 36);
    let base = SIM_BASE_ADDRESS;
    example_pass(&mut c);
    let a = c.malloc(10 * MIB, S).unwrap();
    c.record_history(Some(usize::MAX));
    let frees = c.stats().num_device_free;
    c.empty_cache().unwrap();
    // The lent [14, 24) is unmapped (one call, no history, no reserved change); then the free
    // pages, in free-set order ([24, 26) before [10, 14)), whose memory goes back. A's pages
    // stay.
    assert_eq!(c.stats().num_device_free, frees + 3);
    assert_eq!(
        map_history(&c, base),
        [
            (TraceAction::SegmentUnmap, 24, 2),
            (TraceAction::SegmentUnmap, 10, 4)
        ]
    );
    assert_eq!(c.stats().reserved_bytes.all.current, 10 * MIB as i64);
    assert_eq!(c.backend().used(), 10 * MIB);
    assert_eq!(
        range_layout(&c)[..2],
        [
            (base, 10 * MIB, Backing::Mapped, BlockPhase::Allocated),
            (
                base + 10 * MIB,
                range_layout(&c)[1].1,
                Backing::Unmapped,
                BlockPhase::Free
            ),
        ]
    );
    check_aliasing(&c);
    c.free(a).unwrap();
    // With lent blocks again (a pass), and nothing live: every byte goes back.
    example_pass(&mut c);
    assert!(range_layout(&c).iter().any(|b| b.2 == Backing::Lent));
    c.empty_cache().unwrap();
    assert_eq!(c.backend().used(), 0);
    assert_eq!(c.backend().page_count(), 0);
    assert_eq!(c.backend().reservations().count(), 0);
    assert_eq!(c.stats().reserved_bytes.all.current, 0);
    assert!(c.segments().is_empty());
    check_aliasing(&c);
}

#[test]
fn a_fault_in_an_alias_changes_nothing_and_is_returned_at_once() {
    // Rule 22f/h: an injected fault in the alias is a device error other than out-of-memory.
    let mut c = aliasing_core(1 << 36);
    let a = c.malloc(10 * MIB, S).unwrap();
    let b = c.malloc(4 * MIB, S).unwrap();
    c.free(a).unwrap();
    let before = observed(&c);
    c.backend_mut().inject(crate::backend::sim::Faults {
        alloc_error: 1,
        ..crate::backend::sim::Faults::default()
    });
    assert_eq!(
        c.malloc(12 * MIB, S),
        Err(Error::Backend(BackendError::Injected {
            operation: "alias"
        }))
    );
    assert_eq!(observed(&c), before);
    check_aliasing(&c);
    // The same request then goes through as in the example.
    assert_eq!(c.malloc(12 * MIB, S).unwrap(), SIM_BASE_ADDRESS + 14 * MIB);
    assert_eq!(c.stats().num_device_alloc, 4);
    c.free(b).unwrap();
    check_aliasing(&c);
}

#[test]
fn an_alias_out_of_memory_fails_the_growth_and_rule_7_goes_on() {
    // Rule 22f: a failed alias is a failed map step; rule 7d releases and retries.
    let mut c = aliasing_core(1 << 36);
    let a = c.malloc(10 * MIB, S).unwrap();
    let _b = c.malloc(4 * MIB, S).unwrap();
    c.free(a).unwrap();
    c.backend_mut().fail_next_allocs(1);
    // The release unmaps A's free pages; the retry, within the limit, maps six new ones.
    assert_eq!(c.malloc(12 * MIB, S).unwrap(), SIM_BASE_ADDRESS + 14 * MIB);
    assert_eq!(c.stats().num_alloc_retries, 1);
    assert_eq!(c.stats().num_device_free, 1);
    assert_eq!(c.stats().reserved_bytes.all.current, 16 * MIB as i64);
    assert_eq!(c.backend().used(), 16 * MIB);
    check_aliasing(&c);
}

#[test]
fn without_a_reclaim_headroom_page_aliasing_never_acts() {
    let settings = Settings::pytorch()
        .apply("expandable_segments:True,expandable_page_mb:2,page_aliasing:True")
        .unwrap();
    let mut c = CachingCore::new(SimDevice::new(1 << 36), settings).unwrap();
    assert!(c.pages.is_none());
    example_pass(&mut c);
    // C grew by six new pages; nothing is lent.
    assert_eq!(c.stats().reserved_bytes.all.current, 26 * MIB as i64);
    assert!(range_layout(&c).iter().all(|b| b.2 != Backing::Lent));
}

#[test]
fn a_broken_page_table_is_a_typed_violation() {
    let mut c = aliasing_core(1 << 36);
    let base = SIM_BASE_ADDRESS;
    example_pass(&mut c);
    let a = c.malloc(10 * MIB, S).unwrap();
    check_aliasing(&c);
    // A busy count that drifts from the blocks over it.
    let t = c.pages.as_mut().unwrap();
    t.ranges.get_mut(&base).unwrap().busy[0] += 1;
    assert_eq!(
        c.check_invariants(),
        Err(InvariantViolation::BusyCount {
            address: base,
            have: 2,
            want: 1,
        })
    );
    c.pages
        .as_mut()
        .unwrap()
        .ranges
        .get_mut(&base)
        .unwrap()
        .busy[0] -= 1;
    // A page whose home the table puts elsewhere than the mapped slot that maps it.
    let id = c.pages.as_ref().unwrap().ranges[&base].slots[0] as usize;
    let info = c.pages.as_mut().unwrap().pages[id].as_mut().unwrap();
    let home = info.home;
    info.home = base + 14 * MIB;
    assert_eq!(
        c.check_invariants(),
        Err(InvariantViolation::PageHomes {
            page: id as u32,
            homes: 1,
            recorded: base + 14 * MIB,
        })
    );
    c.pages.as_mut().unwrap().pages[id].as_mut().unwrap().home = home;
    // A lent block missing from the lent sets.
    let key = *c.lent[Pool::Large.index()].iter().next().unwrap();
    c.lent[Pool::Large.index()].remove(&key);
    assert_eq!(
        c.check_invariants(),
        Err(InvariantViolation::LentBlock {
            address: base + 14 * MIB,
            what: "in the wrong state or index",
        })
    );
    c.lent[Pool::Large.index()].insert(key);
    c.free(a).unwrap();
    check_aliasing(&c);
}

#[test]
fn random_runs_under_page_aliasing_keep_every_invariant_and_no_page_under_two_live_blocks() {
    // Rule 22i on runs no example spells out: both checkers after every step.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move |n: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % n
    };
    const SIZES: [u64; 10] = [
        512,
        4096,
        MIB,
        2 * MIB,
        3 * MIB,
        4 * MIB,
        6 * MIB,
        10 * MIB,
        12 * MIB,
        22 * MIB,
    ];
    let mut lent_steps = 0;
    for run in 0..60 {
        let capacity = [96 * MIB, 200 * MIB, 1 << 30][run % 3];
        let mut c = aliasing_core(capacity);
        let mut live: Vec<u64> = Vec::new();
        for step in 0..250 {
            let stream = StreamId(next(2));
            match next(20) {
                0..=9 => {
                    if let Ok(a) = c.malloc(SIZES[next(SIZES.len() as u64) as usize], stream) {
                        live.push(a);
                    }
                }
                10..=15 if !live.is_empty() => {
                    let a = live.swap_remove(next(live.len() as u64) as usize);
                    c.free(a).unwrap();
                }
                16 if !live.is_empty() => {
                    let a = live[next(live.len() as u64) as usize];
                    c.record_stream(a, StreamId(5)).unwrap();
                }
                17 => c.backend_mut().complete_stream(StreamId(5)),
                18 => c.empty_cache().unwrap(),
                _ => c.backend_mut().fail_next_allocs(1),
            }
            check_aliasing(&c);
            if range_layout(&c).iter().any(|b| b.2 == Backing::Lent) {
                lent_steps += 1;
            }
            let _ = step;
        }
        for a in live.drain(..) {
            c.free(a).unwrap();
        }
        c.backend_mut().complete_stream(StreamId(5));
        c.empty_cache().unwrap();
        assert_eq!(c.backend().used(), 0, "run {run}");
        check_aliasing(&c);
    }
    // The runs do lend pages: a good share of the steps have lent blocks.
    assert!(
        lent_steps > 60 * 250 / 20,
        "{lent_steps} steps with lent blocks"
    );
}

#[test]
fn malloc_if_cached_is_the_cache_question_and_the_request_in_one_search() {
    // Rule 17a's probe and the request fused: on random sequences, under settings where the
    // search count matters (garbage collection) and where views serve requests, a core asked
    // `malloc_if_cached` (then, on `None`, `malloc`) and a core asked `has_cached_block` then
    // `malloc` make the same decisions, byte for byte.
    let confs = [
        "garbage_collection_threshold:0.3,max_split_size_mb:40",
        "expandable_segments:True,expandable_page_mb:2,reclaim_headroom:0.025,\
         page_stitching:True,garbage_collection_threshold:0.6",
    ];
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move |n: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % n
    };
    const SIZES: [u64; 7] = [512, 4096, MIB, 2 * MIB, 3 * MIB, 5 * MIB, 12 * MIB];
    let mut fused_hits = 0;
    let mut view_steps = 0;
    for conf in confs {
        for run in 0..6 {
            let mut settings = Settings::pytorch().apply(conf).unwrap();
            settings.per_process_memory_fraction = Some(0.8);
            let mut fused = CachingCore::new(SimDevice::new(96 * MIB), settings.clone()).unwrap();
            let mut probed = CachingCore::new(SimDevice::new(96 * MIB), settings).unwrap();
            // A loop: one random program of allocations and frees (by index into the live
            // list), run for four passes, so that views made in one pass serve the next.
            let program: Vec<(bool, u64)> =
                (0..250).map(|_| (next(10) < 6, next(1 << 20))).collect();
            for pass in 0..4 {
                let mut live: Vec<u64> = Vec::new();
                for (step, &(alloc, pick)) in program.iter().enumerate() {
                    if alloc || live.is_empty() {
                        let size = SIZES[(pick % SIZES.len() as u64) as usize];
                        let hit = fused.malloc_if_cached(size, S).unwrap();
                        let cached = probed.has_cached_block(size, S).unwrap();
                        let at = format!("{conf}, run {run}, pass {pass}, step {step}");
                        assert_eq!(hit.is_some(), cached, "{at}");
                        fused_hits += usize::from(cached);
                        let a = hit.map_or_else(|| fused.malloc(size, S), Ok);
                        let b = probed.malloc(size, S);
                        assert_eq!(a, b, "{at}");
                        if let Ok(a) = a {
                            live.push(a);
                        }
                    } else {
                        let a = live.swap_remove((pick % live.len() as u64) as usize);
                        fused.free(a).unwrap();
                        probed.free(a).unwrap();
                    }
                    assert_eq!(
                        fused.stats(),
                        probed.stats(),
                        "{conf}, run {run}, step {step}"
                    );
                    assert_eq!(fused.segments(), probed.segments());
                    assert_eq!(fused.view_allocations(), probed.view_allocations());
                    view_steps += usize::from(!fused.view_allocations().is_empty());
                }
                for a in live {
                    fused.free(a).unwrap();
                    probed.free(a).unwrap();
                }
            }
            fused.check_invariants().unwrap();
        }
    }
    assert!(
        fused_hits > 300,
        "{fused_hits} requests served by the fused search"
    );
    assert!(view_steps > 10, "{view_steps} steps with a view in use");
}

// --- rule 1: the size limit ----------------------------------------------------------------

#[test]
fn rule_1_a_request_of_exactly_2_pow_60_bytes_is_not_too_large_only_one_above_it_is() {
    let mut c = core(1 << 30);
    // 2^60 bytes is within the limit: the device cannot hold it, so it is out of memory.
    assert!(
        matches!(
            c.malloc(MAX_ALLOC_SIZE, StreamId(0)),
            Err(Error::OutOfMemory(_))
        ),
        "2^60 bytes must reach the device"
    );
    // One byte more is refused before anything is asked.
    assert!(matches!(
        c.malloc(MAX_ALLOC_SIZE + 1, StreamId(0)),
        Err(Error::TooLarge { requested }) if requested == MAX_ALLOC_SIZE + 1
    ));
}

// --- rule 18f: adopted ranges ---------------------------------------------------------------

#[test]
fn an_adopted_range_may_end_with_an_unmapped_block_reaching_its_end_but_none_before_an_unmapped_rest()
 {
    let capacity = 64 * MIB;
    let settings = Settings::pytorch()
        .apply("expandable_segments:True,expandable_page_mb:2")
        .unwrap();
    let page = 2 * MIB;
    let size = super::expandable::range_size(capacity, page);
    let address = 1 << 40;
    let range = |unmapped: u64| AdoptedRange {
        address,
        stream: StreamId(0),
        pool: Pool::Large,
        blocks: vec![
            AdoptedBlock {
                size: page,
                state: AdoptedState::Allocated { requested: page },
            },
            AdoptedBlock {
                size: unmapped,
                state: AdoptedState::Unmapped,
            },
        ],
    };
    // The blocks cover the whole range: no rest follows the unmapped block.
    let mut c = CachingCore::new(SimDevice::new(capacity), settings.clone()).unwrap();
    c.adopt_range(range(size - page)).unwrap();
    assert_eq!(c.stats().reserved_bytes.all.current, page as i64);
    c.free(address).unwrap();
    c.check_invariants().unwrap();
    // The unmapped block stops short of the end: it lies next to the unmapped rest.
    let mut c = CachingCore::new(SimDevice::new(capacity), settings).unwrap();
    let err = c.adopt_range(range(size - 2 * page)).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidAdoption { reason } if reason.contains("unmapped rest")),
        "{err}"
    );
    assert_eq!(c.stats().reserved_bytes.all.current, 0);
}

// --- the core's small queries --------------------------------------------------------------

#[test]
fn record_history_of_zero_entries_stops_recording() {
    let mut c = core(1 << 30);
    c.record_history(Some(10));
    assert!(c.history_options().is_some());
    c.record_history(Some(0));
    assert!(c.history_options().is_none(), "Some(0) is PyTorch's stop");
}

#[test]
fn live_allocations_counts_the_blocks_handed_out_and_not_freed() {
    let mut c = core(1 << 30);
    assert_eq!(c.live_allocations(), 0);
    let a = c.malloc(4096, StreamId(0)).unwrap();
    let b = c.malloc(8 << 20, StreamId(0)).unwrap();
    assert_eq!(c.live_allocations(), 2);
    c.free(a).unwrap();
    assert_eq!(c.live_allocations(), 1);
    c.free(b).unwrap();
    assert_eq!(c.live_allocations(), 0);
}

#[test]
fn rule_17a_has_cached_block_first_returns_the_blocks_whose_events_completed() {
    // A block freed after use on stream 1 is pending; once stream 1's work completes, rule 5
    // (run by the question itself) returns it, and a request it fits is served from the
    // cache.
    let mut c = core(1 << 30);
    let (s0, s1) = (StreamId(0), StreamId(1));
    let a = c.malloc(20 << 20, s0).unwrap(); // a whole 20 MiB segment
    c.record_stream(a, s1).unwrap();
    c.free(a).unwrap();
    assert_eq!(c.has_cached_block(20 << 20, s0), Ok(false), "pending");
    c.backend_mut().complete_stream(s1);
    assert_eq!(c.has_cached_block(20 << 20, s0), Ok(true));
}

#[test]
fn rule_12_counts_the_searches_of_rule_17as_served_requests_in_the_ages() {
    // The collection above, with the searches that age the old segment made by
    // `malloc_if_cached` (rule 17a's request served from the cache): each counts, so the old
    // segment is older than the young one and collected alone.
    let mut c = collected_above_half();
    let s = StreamId(0);
    let old = c.malloc(40 * MIB, s).unwrap();
    let young = c.malloc(20 * MIB, s).unwrap();
    let cached = c.malloc(12 * MIB, s).unwrap();
    c.free(cached).unwrap();
    c.free(old).unwrap();
    for _ in 0..3 {
        let b = c.malloc_if_cached(12 * MIB, s).unwrap();
        assert_eq!(b, Some(cached));
        c.free(cached).unwrap();
    }
    c.free(young).unwrap();
    // 40 + 20 + 12 + 468 = 540 MiB reserved: 40 MiB above the threshold of 500.
    c.malloc(468 * MIB, s).unwrap();
    c.malloc(60 * MIB, s).unwrap();
    let left: Vec<u64> = c.segments().iter().map(|g| g.address).collect();
    assert!(!left.contains(&old), "the old free segment is collected");
    assert!(left.contains(&young), "the young segment is not as old");
    assert!(
        left.contains(&cached),
        "nor is the one the three requests took"
    );
}

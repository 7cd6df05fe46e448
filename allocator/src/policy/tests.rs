//! Behaviour-named unit tests of the policy core on the simulated device: each test states one
//! rule of ARCHITECTURE.md in its name and asserts exactly that, beside the differential tests
//! that compare the core with the reference model operation by operation.

use super::*;
use crate::backend::sim::{SIM_BASE_ADDRESS, SimDevice};
use crate::invariants::InvariantViolation;

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
    let rest = *c.free[Pool::Small.index()].iter().next().unwrap();
    c.free[Pool::Small.index()].remove(&rest);
    assert_eq!(
        c.check_invariants(),
        Err(InvariantViolation::FreeSetMembership { address: a + 512 })
    );
    assert_eq!(SIM_BASE_ADDRESS, a);
}

//! Unit tests of `stitching.rs`: one or more per sub-rule of rule 23, expected outcomes
//! derived from the rule's text.
//!
//! Most tests use a small device (8 MiB: a range is 10 MiB, the cap 16 MiB) and
//! `max_split_size` 4 MiB with `max_non_split_rounding_size` 0, so that rule 6 never hands a
//! cached block to a request of 3 MiB or more once an 8 MiB block is free (below 4 MiB the
//! block is oversize; from 4 MiB on it is at least `r + 0`): every such request reaches
//! rule 23d's search, and rule 20's limit with a 0 headroom is the high-water itself.
use crate::device::DEVICE_BASE;
use crate::{BlockState, InvariantViolation, Model, ModelConfig};

const MIB: u64 = 1 << 20;
const BASE: u64 = DEVICE_BASE;
/// The first view's reservation: right after the 10 MiB range at the base.
const VIEW0: u64 = BASE + 10 * MIB;

/// Expandable segments, 2 MiB pages, reclaim at 0 %, page stitching, on `capacity` bytes,
/// with rule 6's oversize checks as above.
fn config(capacity: u64) -> ModelConfig {
    let mut c = ModelConfig::pytorch_defaults(capacity);
    c.expandable_segments = true;
    c.expandable_page = 2 * MIB;
    c.reclaim_headroom = Some(0.0);
    c.page_stitching = true;
    c.max_split_size = 4 * MIB;
    c.max_non_split_rounding_size = 0;
    c
}

fn check(m: &Model) {
    if let Err(e) = m.check_invariants() {
        panic!("{e}\n{:?}", blocks(m, 0));
    }
}

fn malloc_on(m: &mut Model, size: u64, stream: u64) -> u64 {
    let address = m.malloc(size, stream).unwrap();
    check(m);
    address
}

fn malloc(m: &mut Model, size: u64) -> u64 {
    malloc_on(m, size, 0)
}

fn free(m: &mut Model, address: u64) {
    m.free(address).unwrap();
    check(m);
}

/// The blocks of range `r` as (offset in half MiB, size in half MiB, kind).
fn blocks(m: &Model, r: usize) -> Vec<(u64, u64, &'static str)> {
    let half = MIB / 2;
    let Some(range) = m.segments.iter().filter(|s| s.expandable).nth(r) else {
        return Vec::new();
    };
    range
        .blocks
        .iter()
        .map(|b| {
            let kind = match (b.mapped, b.state) {
                (false, _) => "unmapped",
                (true, BlockState::Free) => "free",
                (true, BlockState::Allocated) => "alloc",
                (true, BlockState::Pending) => "pending",
                (true, BlockState::Held) => "held",
            };
            ((b.address - range.address) / half, b.size / half, kind)
        })
        .collect()
}

/// An 8 MiB device whose one range holds one free 8 MiB block (4 free pages): the
/// high-water is 8 MiB, nothing is requested, one map call was made.
fn all_free() -> Model {
    let mut m = Model::new(config(8 * MIB));
    let x = malloc(&mut m, 8 * MIB);
    free(&mut m, x);
    assert_eq!(blocks(&m, 0), vec![(0, 16, "free"), (16, 4, "unmapped")]);
    assert_eq!(m.stats().num_device_alloc, 1);
    m
}

fn calls(m: &Model) -> (u64, u64) {
    let st = m.stats();
    (st.num_device_alloc, st.num_device_free)
}

// ---- 23a: views are reservations of their own, counted nowhere ----

#[test]
fn a_view_is_a_reservation_of_its_own_that_no_statistic_or_segment_lists() {
    let mut m = all_free();
    let before = m.stats();
    let d = malloc(&mut m, 4 * MIB);
    // The view is reserved after the range; its allocation is its first byte.
    assert_eq!(d, VIEW0);
    assert_eq!(m.views(), vec![(VIEW0, 4 * MIB, true)]);
    assert_eq!(m.device.reservations().len(), 2);
    let st = m.stats();
    // reserved_bytes counts each page once, at its home; no segment is added.
    assert_eq!(st.reserved_bytes.all.current, (8 * MIB) as i64);
    assert_eq!(st.segment, before.segment);
    assert_eq!(m.device_used(), 8 * MIB);
    // The layout lists the range's run only (no view), 8 MiB.
    let layout = m.layout();
    assert_eq!(layout.len(), 1);
    assert_eq!((layout[0].address, layout[0].size), (BASE, 8 * MIB));
    // Its slots map the pages at their homes: the device's page table says so.
    assert_eq!(m.device.page_at(VIEW0), m.device.page_at(BASE));
    assert_eq!(
        m.device.page_at(VIEW0 + 2 * MIB),
        m.device.page_at(BASE + 2 * MIB)
    );
}

#[test]
fn the_binding_of_a_view_never_changes_and_views_are_numbered_in_the_order_made() {
    let mut m = all_free();
    let d = malloc(&mut m, 4 * MIB);
    let homes = m.views[0].homes.clone();
    free(&mut m, d);
    // A second view while the first is in use.
    let d = malloc(&mut m, 4 * MIB);
    let e = malloc(&mut m, 4 * MIB);
    assert_eq!((d, e), (VIEW0, VIEW0 + 4 * MIB));
    assert_eq!(m.views[0].homes, homes);
    assert_eq!(m.views[1].homes, vec![BASE + 4 * MIB, BASE + 6 * MIB]);
    assert_eq!((m.views[0].number, m.views[1].number), (0, 1));
}

// ---- 23b: held pieces ----

#[test]
fn a_view_in_use_holds_whole_pages_and_the_first_t_bytes_of_its_last() {
    let mut m = all_free();
    // r = 3 MiB: n = 2, t = 3 − 2 = 1 MiB.
    let d = malloc(&mut m, 3 * MIB);
    assert_eq!(d, VIEW0);
    assert_eq!(
        blocks(&m, 0),
        vec![(0, 6, "held"), (6, 10, "free"), (16, 4, "unmapped")]
    );
    // One piece: the two homes are consecutive in the range (23b). segments() lists it as
    // Held with requested size 0.
    let layout = m.layout();
    let held: Vec<(u64, u64, u64)> = layout[0]
        .blocks
        .iter()
        .filter(|b| b.state == BlockState::Held)
        .map(|b| (b.address - BASE, b.size, b.requested))
        .collect();
    assert_eq!(held, vec![(0, 3 * MIB, 0)]);
    // The allocation counts r (not the held bytes) in the large pool; held pieces count in
    // no statistic of their own: allocated + held = the view's r.
    let st = m.stats();
    assert_eq!(st.allocated_bytes.large_pool.current, (3 * MIB) as i64);
    assert_eq!(st.active_bytes.all.current, (3 * MIB) as i64);
    assert_eq!(st.requested_bytes.all.current, (3 * MIB) as i64);
    assert_eq!(st.allocation.all.current, 1);
    assert_eq!(st.active.all.current, 1);
    assert_eq!(st.inactive_split.all.current, 0);
}

#[test]
fn consecutive_homes_hold_one_piece_never_merged_with_its_free_neighbours() {
    let mut m = all_free();
    // r = 4 MiB: two whole slots side by side in the range, one held piece; the free rest
    // stays apart.
    malloc(&mut m, 4 * MIB);
    assert_eq!(
        blocks(&m, 0),
        vec![(0, 8, "held"), (8, 8, "free"), (16, 4, "unmapped")]
    );
}

// ---- 23c: usable ----

#[test]
fn a_view_is_usable_only_for_its_number_of_pages_and_when_its_pieces_are_free() {
    let mut m = all_free();
    let d = malloc(&mut m, 4 * MIB);
    free(&mut m, d);
    // 2 MiB: n = 1 ≠ 2, so view 0 is not usable; a view of one page is made from the
    // largest free block's first slot (page 0).
    let one = malloc(&mut m, 2 * MIB);
    assert_eq!(one, VIEW0 + 4 * MIB);
    assert_eq!(m.views[1].homes, vec![BASE]);
    // 4 MiB: view 0's first piece (page 0) is held by view 1: not usable; a third view is
    // made from the free block [2, 8) MiB: pages 1 and 2.
    let e = malloc(&mut m, 4 * MIB);
    assert_eq!(e, VIEW0 + 6 * MIB);
    assert_eq!(m.views[2].homes, vec![BASE + 2 * MIB, BASE + 4 * MIB]);
    assert_eq!(m.views().len(), 3);
}

#[test]
fn a_view_of_another_stream_is_not_usable() {
    let mut m = Model::new(config(16 * MIB));
    let x = malloc(&mut m, 8 * MIB);
    free(&mut m, x);
    let d = malloc(&mut m, 4 * MIB);
    free(&mut m, d);
    assert_eq!(m.views().len(), 1);
    // Stream 1 has no range; stream 0's view is not handed to it (23d); rule 23k makes it a
    // view of its own over stream 0's free pages (reserved 8 + 4 > w = 8).
    let e = malloc_on(&mut m, 4 * MIB, 1);
    assert_ne!(e, m.views[0].address);
    assert_eq!(m.views.iter().filter(|v| v.stream == 1).count(), 1);
}

// ---- 23k: views across streams ----

#[test]
fn rule_23k_a_view_takes_another_streams_free_pages_and_orders_the_streams() {
    let mut m = Model::new(config(16 * MIB));
    let x = malloc(&mut m, 8 * MIB);
    free(&mut m, x);
    let (allocs, frees) = calls(&m);
    // Stream 1's 4 MiB: no range of its own, over the limit (8 + 4 > 8): stream 0's free
    // 8 MiB block gives its first two pages, one alias; stream 1 waits for stream 0.
    let e = malloc_on(&mut m, 4 * MIB, 1);
    assert_eq!(m.views[0].stream, 1);
    assert_eq!(m.views[0].homes, vec![BASE, BASE + 2 * MIB]);
    assert_eq!(calls(&m), (allocs + 1, frees));
    assert_eq!(m.stream_waits(), &[(1, 0)]);
    assert_eq!(blocks(&m, 0)[0], (0, 8, "held"));
    // The free: stream 0 waits for stream 1 first; the pieces return at once.
    free(&mut m, e);
    assert_eq!(m.stream_waits(), &[(1, 0), (0, 1)]);
    assert_eq!(blocks(&m, 0)[0], (0, 16, "free"));
    // The next pass: the same view, no device call, the same two waits.
    let e2 = malloc_on(&mut m, 4 * MIB, 1);
    assert_eq!(e2, e);
    free(&mut m, e2);
    assert_eq!(calls(&m), (allocs + 1, frees));
    assert_eq!(m.stream_waits(), &[(1, 0), (0, 1), (1, 0), (0, 1)]);
}

#[test]
fn rule_23k_the_requests_own_streams_pages_come_first() {
    let mut m = Model::new(config(32 * MIB));
    // Stream 0: 8 MiB free; stream 1: 4 MiB free (its own range, after stream 0's).
    let x = malloc(&mut m, 8 * MIB);
    let y = malloc_on(&mut m, 4 * MIB, 1);
    free(&mut m, x);
    free(&mut m, y);
    // Stream 1's 6 MiB (k = 3) over the limit (12 + 6 > 12): its own block's two pages
    // first, though stream 0's block is larger, then stream 0's first page.
    let y_range = m.segments.iter().find(|r| r.stream == 1).unwrap().address;
    let e = malloc_on(&mut m, 6 * MIB, 1);
    let v = m.views.iter().find(|v| v.address == e).unwrap();
    assert_eq!(v.homes, vec![y_range, y_range + 2 * MIB, BASE]);
    assert_eq!(m.stream_waits(), &[(1, 0)]);
    // Without a foreign page, no wait: stream 0's 8 MiB request is its own block.
    free(&mut m, e);
    assert_eq!(m.stream_waits(), &[(1, 0), (0, 1)]);
}

// ---- 23d: the hand-out ----

#[test]
fn the_usable_view_made_first_is_handed_out_and_makes_no_device_call() {
    let mut m = all_free();
    let d = malloc(&mut m, 4 * MIB);
    let e = malloc(&mut m, 4 * MIB);
    assert_eq!((d, e), (VIEW0, VIEW0 + 4 * MIB));
    // Views 0 and 1 mapped pages 0–1 and 2–3: one alias each.
    assert_eq!(calls(&m), (3, 0));
    // Free in the order made... and in the other order: either way view 0 comes first.
    free(&mut m, e);
    free(&mut m, d);
    let again = malloc(&mut m, 4 * MIB);
    assert_eq!(again, VIEW0);
    let other = malloc(&mut m, 4 * MIB);
    assert_eq!(other, VIEW0 + 4 * MIB);
    assert_eq!(calls(&m), (3, 0));
}

#[test]
fn a_hand_out_carves_the_pieces_raises_the_statistics_by_r_and_counts_oversize() {
    let mut m = all_free();
    let d = malloc(&mut m, 4 * MIB);
    free(&mut m, d);
    let before = m.stats();
    let d = malloc(&mut m, 4 * MIB - 1000);
    assert_eq!(d, VIEW0);
    let st = m.stats();
    // Rounded to 4 MiB − 512: t = 2 MiB − 512.
    let r = 4 * MIB - 512;
    assert_eq!(
        st.allocated_bytes.all.allocated - before.allocated_bytes.all.allocated,
        r as i64
    );
    assert_eq!(st.requested_bytes.all.current, (4 * MIB - 1000) as i64);
    // r < max_split_size (4 MiB): not oversize; the first 4 MiB hand-out was (and the
    // 8 MiB block before it).
    assert_eq!(st.oversize_allocations.current, 0);
    assert_eq!(before.oversize_allocations.allocated, 2);
    let sizes: Vec<(u64, BlockState)> = m.segments[0]
        .blocks
        .iter()
        .map(|b| (b.size, b.state))
        .collect();
    assert_eq!(
        sizes,
        vec![
            (4 * MIB - 512, BlockState::Held),
            (4 * MIB + 512, BlockState::Free),
            (2 * MIB, BlockState::Free),
        ]
    );
    assert!(!m.segments[0].blocks[2].mapped);
    assert_eq!(calls(&m), (2, 0));
}

#[test]
fn rule_17a_sees_a_usable_view_as_a_cached_block() {
    let mut m = all_free();
    let d = malloc(&mut m, 4 * MIB);
    free(&mut m, d);
    assert!(m.has_cached_block(4 * MIB, 0));
    // Three pages: no view of three, and rule 6 finds nothing (oversize checks).
    assert!(!m.has_cached_block(6 * MIB, 0));
}

// ---- 23e: the return ----

#[test]
fn a_returned_view_gives_its_pieces_back_as_free_blocks_and_is_free_again() {
    let mut m = all_free();
    let d = malloc(&mut m, 3 * MIB);
    let before = m.stats();
    free(&mut m, d);
    assert_eq!(blocks(&m, 0), vec![(0, 16, "free"), (16, 4, "unmapped")]);
    assert_eq!(m.views(), vec![(VIEW0, 4 * MIB, false)]);
    let st = m.stats();
    assert_eq!(st.allocated_bytes.all.current, 0);
    assert_eq!(st.active_bytes.all.current, 0);
    assert_eq!(
        st.active_bytes.all.freed - before.active_bytes.all.freed,
        (3 * MIB) as i64
    );
    assert_eq!(st.requested_bytes.all.current, 0);
}

#[test]
fn a_view_used_on_another_stream_waits_for_its_events() {
    let mut m = all_free();
    let d = malloc(&mut m, 4 * MIB);
    m.record_stream(d, 1).unwrap();
    free(&mut m, d);
    // Pending: not allocated, still active; the pieces stay held.
    let st = m.stats();
    assert_eq!(st.allocated_bytes.all.current, 0);
    assert_eq!(st.active_bytes.all.current, (4 * MIB) as i64);
    assert_eq!(blocks(&m, 0)[0], (0, 8, "held"));
    assert_eq!(
        m.free(d),
        Err(crate::ModelError::UnknownAddress { address: d })
    );
    // Another 4 MiB: view 0 is in use (pending), so a second view is made.
    let e = malloc(&mut m, 4 * MIB);
    assert_eq!(e, VIEW0 + 4 * MIB);
    free(&mut m, e);
    m.complete_stream(1);
    // The next request processes the event: view 0 returns, and is the first usable.
    assert_eq!(malloc(&mut m, 4 * MIB), VIEW0);
    check(&m);
}

#[test]
fn a_view_allocation_is_never_parked() {
    // Rule 17b parks small-pool blocks only: a view's allocation freed on its own thread
    // returns its pieces at once.
    let mut c = config(8 * MIB);
    c.thread_cache_blocks = 2;
    let mut m = Model::new(c);
    let x = m.malloc_on(7, 8 * MIB, 0).unwrap();
    m.free_on(7, x).unwrap();
    assert_eq!(m.thread_cached_blocks(), 0);
    let d = m.malloc_on(7, 4 * MIB, 0).unwrap();
    assert_eq!(d, VIEW0);
    m.free_on(7, d).unwrap();
    check(&m);
    assert_eq!(m.thread_cached_blocks(), 0);
    assert_eq!(m.stats().allocated_bytes.all.current, 0);
    assert_eq!(m.views(), vec![(VIEW0, 4 * MIB, false)]);
    // The free view serves the next request of its size.
    assert_eq!(m.malloc_on(7, 4 * MIB, 0), Ok(VIEW0));
    m.free_on(7, d).unwrap();
    check(&m);
    assert_eq!(m.views(), vec![(VIEW0, 4 * MIB, false)]);
}

// ---- 23f: making a view ----

#[test]
fn a_view_is_made_from_the_largest_free_blocks_one_alias_per_run() {
    // [A 2][H1 4][X 2][H2 4][C 2] MiB on 1 GiB, H1 and H2 free: 14 MiB reserved, W 14.
    let mut c = config(1 << 30);
    c.max_split_size = u64::MAX;
    c.max_non_split_rounding_size = 20 * MIB;
    let mut m = Model::new(c);
    let sizes = [2, 4, 2, 4, 2];
    let live: Vec<u64> = sizes.iter().map(|&s| malloc(&mut m, s * MIB)).collect();
    free(&mut m, live[1]);
    free(&mut m, live[3]);
    assert_eq!(calls(&m), (5, 0));
    // 5 MiB: no free block fits; w = max(14, 6 + 5) = 14; 14 + 6 > 14: k = 3 of the four
    // free pages: H1's two (equal bytes, lower address first), then H2's first.
    let d = malloc(&mut m, 5 * MIB);
    let range = 1152 * MIB; // 1 GiB + 1/8, in 2 MiB pages
    assert_eq!(d, BASE + range);
    assert_eq!(
        m.views[0].homes,
        vec![BASE + 2 * MIB, BASE + 4 * MIB, BASE + 8 * MIB]
    );
    // Two runs: two aliases; reserved unchanged; nothing unmapped.
    assert_eq!(calls(&m), (7, 0));
    assert_eq!(m.stats().reserved_bytes.all.current, (14 * MIB) as i64);
    // t = 5 − 4 = 1 MiB of H2's first page.
    assert_eq!(
        blocks(&m, 0)[..6],
        [
            (0, 4, "alloc"),
            (4, 8, "held"),
            (12, 4, "alloc"),
            (16, 2, "held"),
            (18, 6, "free"),
            (24, 4, "alloc"),
        ]
    );
}

#[test]
fn with_fewer_free_pages_than_the_request_needs_rule_20_goes_on_as_written() {
    let mut m = all_free();
    // 10 MiB: k = 5 > 4 free pages. No view; rule 20: the free block is growth's start (the
    // unmapped tail follows it), so nothing is reclaimed; the growth maps 2 MiB more, past
    // the 8 MiB device: out of memory, and rule 7d releases everything.
    assert!(m.malloc(10 * MIB, 0).is_err());
    check(&m);
    assert!(m.views().is_empty());
}

#[test]
fn no_view_is_made_within_the_limit() {
    let mut c = config(8 * MIB);
    c.reclaim_headroom = Some(1.0);
    let mut m = Model::new(c);
    let x = malloc(&mut m, 4 * MIB);
    free(&mut m, x);
    // w = max(4, 6) = 6, limit 12: 4 + 6 ≤ 12, the range grows (its free block is the start).
    let d = malloc(&mut m, 6 * MIB);
    assert_eq!(d, BASE);
    assert!(m.views().is_empty());
}

#[test]
fn a_failed_alias_gives_the_reservation_back_and_rule_20_goes_on() {
    // The 1 GiB layout of the test above; the first alias is told to fail.
    let mut c = config(1 << 30);
    c.max_split_size = u64::MAX;
    c.max_non_split_rounding_size = 20 * MIB;
    let mut m = Model::new(c);
    let sizes = [2, 4, 2, 4, 2];
    let live: Vec<u64> = sizes.iter().map(|&s| malloc(&mut m, s * MIB)).collect();
    free(&mut m, live[1]);
    free(&mut m, live[3]);
    m.fail_next_device_allocs(1);
    let d = malloc(&mut m, 5 * MIB);
    assert!(m.views().is_empty());
    assert_eq!(m.device.reservations().len(), 1);
    // No alias made, nothing to unmap for the view. Rule 20: w = max(14, 6 + 5) = 14,
    // need 6: H1 (4 MiB, lower address) goes (10 + 6 > 14 still), then H2 (6 + 6 ≤ 14);
    // the holes (4 MiB each) are too short for 5 MiB: the range grows at its tail (14 MiB),
    // one map call.
    assert_eq!(d, BASE + 14 * MIB);
    assert_eq!(calls(&m), (6, 2));
}

#[test]
fn a_view_may_map_pages_of_the_small_pool_when_its_page_is_p() {
    let mut m = Model::new(config(1 << 30));
    // Small pool: two 1 MiB blocks and one of 512 B fill pages 0..2 of its range; the
    // 1 MiB blocks freed leave [512 B used][free 2 MiB − 512][...]: no whole free slot
    // yet. Instead: four 1 MiB blocks (pages 0 and 1), all freed: 4 MiB free, two pages.
    let small: Vec<u64> = (0..4).map(|_| malloc(&mut m, MIB)).collect();
    for a in small {
        free(&mut m, a);
    }
    assert_eq!(
        m.stats().reserved_bytes.small_pool.current,
        (4 * MIB) as i64
    );
    // Large: 4 MiB requested, W = 4 MiB; 0 + 4 reserved in the large pool... limit 4 MiB:
    // 4 + 4 > 4, and the small pool's two free pages make a view.
    let d = malloc(&mut m, 4 * MIB);
    let small_base = m.segments[0].address;
    assert_eq!(m.views[0].homes, vec![small_base, small_base + 2 * MIB]);
    // The allocation counts in the large pool; the pieces are held in the small one.
    let st = m.stats();
    assert_eq!(st.allocated_bytes.large_pool.current, (4 * MIB) as i64);
    assert_eq!(st.allocated_bytes.small_pool.current, 0);
    assert_eq!(st.reserved_bytes.large_pool.current, 0);
    free(&mut m, d);
}

#[test]
fn rule_23f_a_view_takes_the_large_pools_pages_before_the_small_pools() {
    let mut m = Model::new(config(1 << 30));
    // Small pool: four 1 MiB blocks (its pages 0 and 1), all freed: one free block of two
    // whole pages. Large pool: one page, freed: one free block of one whole page.
    let small: Vec<u64> = (0..4).map(|_| malloc(&mut m, MIB)).collect();
    let large = malloc(&mut m, 2 * MIB);
    for a in small {
        free(&mut m, a);
    }
    free(&mut m, large);
    let small_base = m.segments[0].address;
    let large_base = m.segments[1].address;
    assert_eq!(m.stats().reserved_bytes.all.current, (6 * MIB) as i64);
    // 4 MiB: no cached block fits; 6 + 4 MiB passes the limit; three free pages. The
    // small pool's block holds more such bytes (4 MiB against 2), but the large pool's
    // block comes first: its page, then the small pool's first.
    let d = malloc(&mut m, 4 * MIB);
    assert_eq!(d, m.views[0].address);
    assert_eq!(m.views[0].homes, vec![large_base, small_base]);
    free(&mut m, d);
}

// ---- 23g: the cap ----

#[test]
fn past_the_cap_the_free_view_handed_out_least_recently_is_destroyed() {
    let mut m = all_free();
    // Views of 2 and 3 pages (4 + 6 MiB of the 16 MiB cap).
    let a = malloc(&mut m, 4 * MIB);
    free(&mut m, a);
    let b = malloc(&mut m, 6 * MIB);
    free(&mut m, b);
    assert_eq!(m.views().len(), 2);
    // View 0 handed out again: view 1 is now the least recently used.
    let a = malloc(&mut m, 4 * MIB);
    assert_eq!(a, VIEW0);
    free(&mut m, a);
    let (allocs, frees) = calls(&m);
    // 8 MiB: 10 + 8 > 16: view 1 goes (4 + 8 ≤ 16), one device free; one alias for the new.
    let c = malloc(&mut m, 8 * MIB);
    assert_eq!(calls(&m), (allocs + 1, frees + 1));
    let sizes: Vec<(u64, bool)> = m.views().iter().map(|&(_, s, u)| (s, u)).collect();
    assert_eq!(sizes, vec![(4 * MIB, false), (8 * MIB, true)]);
    assert_eq!(m.views[1].number, 2);
    free(&mut m, c);
    // The views never pass 2 × capacity.
    assert!(m.views().iter().map(|&(_, s, _)| s).sum::<u64>() <= 16 * MIB);
}

#[test]
fn the_cap_destroys_free_views_least_recently_used_first_until_the_new_one_fits() {
    let mut m = all_free();
    // 16 MiB cap: two views of 2 pages (8 MiB), then one of 3 (6 MiB), all freed.
    let a = malloc(&mut m, 4 * MIB);
    let b = malloc(&mut m, 4 * MIB);
    free(&mut m, a);
    free(&mut m, b);
    let c = malloc(&mut m, 6 * MIB);
    // 8 + 6 ≤ 16: made, no destruction.
    assert_eq!(m.views().len(), 3);
    free(&mut m, c);
    let d = malloc(&mut m, 8 * MIB);
    // 14 + 8 > 16: the least recently used free view (view 0) goes: 10 + 8 > 16 still,
    // then view 1: 6 + 8 ≤ 16.
    let sizes: Vec<u64> = m.views().iter().map(|&(_, s, _)| s).collect();
    assert_eq!(sizes, vec![6 * MIB, 8 * MIB]);
    assert_eq!(m.views[1].address, d);
    check(&m);
}

#[test]
fn rule_23g_a_view_that_brings_the_views_to_the_cap_exactly_destroys_none() {
    let mut m = all_free();
    // Two views of 2 pages (8 MiB of the 16 MiB cap), both freed.
    let a = malloc(&mut m, 4 * MIB);
    let b = malloc(&mut m, 4 * MIB);
    free(&mut m, a);
    free(&mut m, b);
    let (allocs, frees) = calls(&m);
    // 8 + 8 = 16: the cap is not passed, so the new view is made beside them (one alias) and
    // no view goes (no device free).
    let c = malloc(&mut m, 8 * MIB);
    assert_eq!(calls(&m), (allocs + 1, frees));
    let sizes: Vec<u64> = m.views().iter().map(|&(_, s, _)| s).collect();
    assert_eq!(sizes, vec![4 * MIB, 4 * MIB, 8 * MIB]);
    assert_eq!(m.views[2].address, c);
    free(&mut m, c);
}

// ---- 23h: destroying views ----

#[test]
fn empty_cache_destroys_every_free_view_first_and_keeps_those_in_use() {
    let mut m = all_free();
    let a = malloc(&mut m, 4 * MIB);
    let b = malloc(&mut m, 4 * MIB);
    free(&mut m, a);
    let (allocs, frees) = calls(&m);
    m.empty_cache();
    check(&m);
    // View 0 destroyed (one free); view 1 in use keeps pages 2–3; pages 0–1 unmapped
    // (one free) — no page a view maps is unmapped.
    assert_eq!(m.views(), vec![(VIEW0 + 4 * MIB, 4 * MIB, true)]);
    assert_eq!(calls(&m), (allocs, frees + 2));
    assert_eq!(m.stats().reserved_bytes.all.current, (4 * MIB) as i64);
    assert_eq!(m.device.reservations().len(), 2);
    free(&mut m, b);
    m.empty_cache();
    check(&m);
    assert!(m.views().is_empty());
    assert!(m.device.reservations().is_empty());
    assert_eq!(m.device_used(), 0);
}

#[test]
fn a_view_mapping_a_home_rule_20_unmaps_is_destroyed_just_before() {
    let mut m = Model::new(config(16 * MIB));
    let x = malloc(&mut m, 8 * MIB);
    free(&mut m, x);
    // View 0 over pages 0–1, view 1 over pages 2–3 (a 4 MiB block is no fit for 4 MiB with
    // max_split 4 MiB); view 0 freed: pages 0–1 free.
    let a = malloc(&mut m, 4 * MIB);
    let b = malloc(&mut m, 4 * MIB);
    free(&mut m, a);
    assert_eq!(m.views.len(), 2);
    let (allocs, frees) = calls(&m);
    // Stream 1, 6 MiB: k = 3 > 2 free pages (of any stream, 23k): no view; rule 20 unmaps
    // stream 0's free block (pages 0–1) — view 0 maps them, so it goes first.
    let e = malloc_on(&mut m, 6 * MIB, 1);
    assert_eq!(m.views.len(), 1);
    assert_eq!(m.views[0].address, b);
    // One destruction and one unmap; one map for stream 1's range.
    assert_eq!(calls(&m), (allocs + 1, frees + 2));
    assert_eq!(m.stats().reserved_bytes.all.current, (10 * MIB) as i64);
    free(&mut m, e);
    free(&mut m, b);
}

// ---- 23j: the invariant ----

#[test]
fn the_checker_reports_a_held_piece_no_view_holds() {
    let mut m = all_free();
    malloc(&mut m, 4 * MIB);
    check(&m);
    // Corrupt: the view forgets its allocation (its pieces stay held).
    let mut broken = m.clone();
    broken.views[0].allocation = None;
    assert!(matches!(
        broken.check_invariants(),
        Err(InvariantViolation::StatsDisagree { .. } | InvariantViolation::View { .. })
    ));
    // Corrupt: a view binds the same page twice.
    let mut broken = m.clone();
    broken.views[0].homes[1] = broken.views[0].homes[0];
    assert!(matches!(
        broken.check_invariants(),
        Err(InvariantViolation::View { .. })
    ));
    // Corrupt: a held piece turned free while its view is in use.
    let mut broken = m;
    broken.segments[0].blocks[0].state = BlockState::Free;
    assert!(broken.check_invariants().is_err());
}

#[test]
fn rule_23j_a_view_whose_home_lies_in_an_unmapped_block_is_reported() {
    let mut m = all_free();
    malloc(&mut m, 4 * MIB);
    check(&m);
    // Corrupt: the block under the view's first home is marked unmapped while the device
    // still maps the page. The range's own check would see it first, so the view check is
    // asked directly.
    let home = m.views[0].homes[0];
    let mut broken = m;
    let block = broken.segments[0]
        .blocks
        .iter_mut()
        .find(|b| b.address <= home && home < b.address + b.size)
        .expect("the home's block");
    block.mapped = false;
    let error = broken.check_views().unwrap_err();
    assert!(error.to_string().contains("is not mapped"), "{error}");
}

#[test]
fn rule_23j_a_view_missing_one_mapping_on_the_device_is_reported() {
    let mut m = all_free();
    malloc(&mut m, 4 * MIB);
    check(&m);
    // Corrupt: the device unmaps the view's first slot (its page stays mapped at its home):
    // the reservation keeps its size, one slot fewer is mapped.
    let view = m.views[0].address;
    let mut broken = m;
    broken.device.unmap(view, 2 * MIB);
    let error = broken.check_views().unwrap_err();
    assert!(
        error
            .to_string()
            .contains("the reservation is not n whole mapped slots"),
        "{error}"
    );
}

// ---- The configuration ----

#[test]
#[should_panic(expected = "page_stitching")]
fn page_stitching_refuses_page_aliasing_beside_it() {
    let mut c = config(8 * MIB);
    c.page_aliasing = true;
    Model::new(c);
}

#[test]
fn without_a_headroom_no_view_is_ever_made() {
    let mut c = config(8 * MIB);
    c.reclaim_headroom = None;
    let mut m = Model::new(c);
    let x = malloc(&mut m, 4 * MIB);
    free(&mut m, x);
    malloc(&mut m, 4 * MIB);
    malloc(&mut m, 2 * MIB);
    assert!(m.views().is_empty());
}

// ---- A loop: views reused across passes ----

#[test]
fn a_repeating_loop_reuses_its_views_and_makes_no_device_call_after_the_first_pass() {
    let mut m = all_free();
    let mut per_pass = Vec::new();
    for _ in 0..4 {
        let before = calls(&m);
        let a = malloc(&mut m, 4 * MIB);
        let b = malloc(&mut m, 3 * MIB);
        free(&mut m, a);
        let c = malloc(&mut m, 4 * MIB);
        free(&mut m, b);
        free(&mut m, c);
        let after = calls(&m);
        per_pass.push((after.0 - before.0, after.1 - before.1));
        assert_eq!((a, b, c), (VIEW0, VIEW0 + 4 * MIB, VIEW0));
    }
    assert_eq!(per_pass, vec![(2, 0), (0, 0), (0, 0), (0, 0)]);
}

// ---- 23f: rule 20's reclaim takes only the request's pool ----

#[test]
fn while_stitching_rule_20_reclaims_only_the_requests_pool() {
    let mut m = Model::new(config(64 * MIB));
    // A small block grows the small pool by one page; freed, that page is free.
    let s = malloc(&mut m, 512 * 1024);
    free(&mut m, s);
    // 4 MiB over the limit (w = 4 MiB, 2 + 4 > 4) with one free page (the small pool's) for
    // the two it needs: no view; the small pool's page is not a candidate, so the large pool
    // grows on new pages and the small page stays.
    let l = malloc(&mut m, 4 * MIB);
    let stats = m.stats();
    assert_eq!(stats.reserved_bytes.all.current as u64, 6 * MIB);
    assert_eq!(stats.reserved_bytes.small_pool.current as u64, 2 * MIB);
    assert_eq!(stats.num_device_free, 0, "nothing unmapped");
    assert!(m.views().is_empty());
    free(&mut m, l);
    // Rule 23k: another stream's free large block gives its pages to stream 1's view (no
    // reclaim); the small page stays.
    let e = malloc_on(&mut m, 4 * MIB, 1);
    let stats = m.stats();
    assert_eq!(stats.reserved_bytes.small_pool.current as u64, 2 * MIB);
    assert_eq!(stats.reserved_bytes.all.current as u64, 6 * MIB);
    assert_eq!(stats.num_device_free, 0, "nothing unmapped");
    assert_eq!(m.views.len(), 1);
    free(&mut m, e);
}

#[test]
fn the_checker_catches_a_held_piece_that_is_unmapped_or_keeps_a_requested_size() {
    // Rule 23b: a held piece is mapped, with requested size 0 and no other stream's use; the
    // invariant checks (`check_views`) refuse one that is not mapped, or keeps a requested
    // size.
    let mut m = all_free();
    let _d = malloc(&mut m, 3 * MIB);
    check(&m);
    let i = m.segments[0]
        .blocks
        .iter()
        .position(|b| b.state == BlockState::Held)
        .expect("a held piece");
    let mut unmapped = m.clone();
    unmapped.segments[0].blocks[i].mapped = false;
    assert!(unmapped.check_invariants().is_err());
    m.segments[0].blocks[i].requested = 512;
    assert!(m.check_invariants().is_err());
}

#[test]
fn rule_23f_makes_no_view_when_the_growth_reaches_the_limit_exactly() {
    // Rule 20's test is `reserved + need > limit`: at equality the range grows and no view
    // is made. Blocks of 2 MiB a1, x, a2, z, then a1 and a2 freed: 8 MiB reserved, the
    // requested bytes' high water 8 MiB. A 4 MiB request (4 MiB live) has w = 8 MiB and the
    // limit 8 + ⌊8 × 0.5⌋ = 12 MiB, exactly reserved + need.
    let mut c = config(1 << 30);
    c.reclaim_headroom = Some(0.5);
    let mut m = Model::new(c);
    let a1 = malloc(&mut m, 2 * MIB);
    let _x = malloc(&mut m, 2 * MIB);
    let a2 = malloc(&mut m, 2 * MIB);
    let _z = malloc(&mut m, 2 * MIB);
    free(&mut m, a1);
    free(&mut m, a2);
    assert_eq!(m.stats().reserved_bytes.all.current, (8 * MIB) as i64);
    let b = malloc(&mut m, 4 * MIB);
    assert_eq!(b, a1 + 8 * MIB, "the range's tail");
    assert_eq!(m.stats().reserved_bytes.all.current, (12 * MIB) as i64);
    assert!(m.views.is_empty());
}

#[test]
fn rule_23f_a_view_over_one_page_handles_apart_maps_each_run_with_its_own_alias() {
    // Rule 19j: a 4 MiB map step is one handle of two pages, a 2 MiB step a handle of one.
    // Freed, the three steps are one free block whose free pages (rule 23f: one-page handles'
    // slots only) are its first and last slots, two apart: a view of both is two runs, two
    // aliases, not one over the handle between them.
    let mut c = config(1 << 30);
    c.expandable_handle = Some(4 * MIB);
    let mut m = Model::new(c);
    let p0 = malloc(&mut m, 2 * MIB);
    let p1 = malloc(&mut m, 4 * MIB);
    let p2 = malloc(&mut m, 2 * MIB);
    assert_eq!((p1, p2), (p0 + 2 * MIB, p0 + 6 * MIB));
    for p in [p0, p1, p2] {
        free(&mut m, p);
    }
    assert_eq!(m.stats().num_device_alloc, 3);
    // Stream 1 has no block: over the limit (no headroom), a view of 2 pages from stream 0's
    // free pages (rule 23k).
    let v = malloc_on(&mut m, 4 * MIB, 1);
    assert_eq!(m.views.len(), 1);
    assert!(v < p0 || v >= p0 + 8 * MIB, "a view's own address");
    assert_eq!(m.stats().num_device_alloc, 5, "one alias per run");
}

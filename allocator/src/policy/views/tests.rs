//! Rule 23's behaviour-named tests: each sub-rule a–j on hand-built sequences whose addresses,
//! device calls and statistics are worked out from ARCHITECTURE.md's text, and random runs
//! under both checkers.

use crate::backend::sim::{SIM_BASE_ADDRESS, SimDevice};
use crate::backend::{Backend, BackendError, EventId, MemInfo, StreamId};
use crate::block::BlockPhase;
use crate::error::Error;
use crate::history::TraceAction;
use crate::policy::CachingCore;
use crate::settings::Settings;

const MIB: u64 = 1 << 20;
const S: StreamId = StreamId(0);
const BASE: u64 = SIM_BASE_ADDRESS;
/// A 1 GiB device's ranges: 2 MiB × ⌈(1024 + 128) / 2⌉ MiB.
const RANGE: u64 = 1152 * MIB;
/// The first view's address on a 1 GiB device: right after the range.
const V0: u64 = BASE + RANGE;

/// Rule 23's example settings: 2 MiB pages in both pools, no headroom, stitched views.
fn stitching() -> Settings {
    Settings::pytorch()
        .apply(
            "expandable_segments:True,expandable_page_mb:2,reclaim_headroom:0,\
             page_stitching:True",
        )
        .unwrap()
}

fn core(capacity: u64) -> CachingCore<SimDevice> {
    CachingCore::new(SimDevice::new(capacity), stitching()).unwrap()
}

/// A simulated device that reports `total` as its capacity (the real one is 1 GiB), and fails
/// its `nth` alias call (0: the next) with `fault`.
#[derive(Debug)]
struct Rigged {
    sim: SimDevice,
    total: Option<u64>,
    fail_alias: Option<(u32, BackendError)>,
    /// Rule 23k: every stream wait fails while set.
    fail_wait: bool,
}

impl Rigged {
    fn new() -> Rigged {
        Rigged {
            sim: SimDevice::new(1 << 30),
            total: None,
            fail_alias: None,
            fail_wait: false,
        }
    }
}

impl Backend for Rigged {
    fn allocate(&mut self, size: u64) -> Result<u64, BackendError> {
        self.sim.allocate(size)
    }
    fn free(&mut self, address: u64, size: u64) -> Result<(), BackendError> {
        self.sim.free(address, size)
    }
    fn mem_info(&mut self) -> Result<MemInfo, BackendError> {
        let info = self.sim.mem_info()?;
        Ok(MemInfo {
            total: self.total.unwrap_or(info.total),
            ..info
        })
    }
    fn record_event(&mut self, stream: StreamId) -> Result<EventId, BackendError> {
        self.sim.record_event(stream)
    }
    fn query_event(&mut self, event: EventId) -> Result<bool, BackendError> {
        self.sim.query_event(event)
    }
    fn synchronize_event(&mut self, event: EventId) -> Result<(), BackendError> {
        self.sim.synchronize_event(event)
    }
    fn destroy_event(&mut self, event: EventId) {
        self.sim.destroy_event(event)
    }
    fn virtual_memory(&self) -> bool {
        true
    }
    fn reserve(&mut self, size: u64, page: u64) -> Result<u64, BackendError> {
        self.sim.reserve(size, page)
    }
    fn release_reservation(&mut self, address: u64, size: u64) -> Result<(), BackendError> {
        self.sim.release_reservation(address, size)
    }
    fn map(&mut self, address: u64, size: u64) -> Result<(), BackendError> {
        self.sim.map(address, size)
    }
    fn map_handle(&mut self, address: u64, size: u64) -> Result<(), BackendError> {
        self.sim.map_handle(address, size)
    }
    fn unmap(&mut self, address: u64, size: u64, stream: StreamId) -> Result<(), BackendError> {
        self.sim.unmap(address, size, stream)
    }
    fn alias(&mut self, address: u64, source: u64, size: u64) -> Result<(), BackendError> {
        match self.fail_alias.take() {
            Some((0, fault)) => return Err(fault),
            Some((n, fault)) => self.fail_alias = Some((n - 1, fault)),
            None => {}
        }
        self.sim.alias(address, source, size)
    }
    fn wait_stream(&mut self, waiter: StreamId, on: StreamId) -> Result<(), BackendError> {
        if self.fail_wait {
            return Err(BackendError::Injected {
                operation: "wait_stream",
            });
        }
        self.sim.wait_stream(waiter, on)
    }
}

/// Both checkers: the core's (rule 23j), and the device's own page table — the physical
/// `(page, byte range)` sets under live allocations (blocks at their homes, view allocations
/// through their views) are pairwise disjoint (rule 23i).
fn check(c: &CachingCore<SimDevice>) {
    c.check_invariants().unwrap();
    check_device(c.segments(), c.view_allocations(), c.backend());
}

fn check_device(
    segments: Vec<crate::policy::SegmentInfo>,
    views: Vec<(u64, u64, BlockPhase)>,
    d: &SimDevice,
) {
    let mut live: Vec<(u64, u64)> = views.iter().map(|v| (v.0, v.1)).collect();
    for s in segments.iter().filter(|s| s.expandable) {
        for b in &s.blocks {
            if matches!(b.state, BlockPhase::Allocated | BlockPhase::Pending) {
                live.push((b.address, b.size));
            }
        }
    }
    assert_eq!(d.physical_overlap(live), Ok(()));
}

/// The blocks of the range's first mapped run, as `(offset from BASE in 512 B units…)`:
/// `(offset MiB × 2, size MiB × 2, state)` — half-mebibyte units keep tail pieces exact.
fn layout(c: &CachingCore<SimDevice>) -> Vec<(u64, u64, BlockPhase)> {
    let segs = c.segments();
    let seg = segs
        .iter()
        .find(|s| s.address == BASE)
        .expect("a run at the range's start");
    seg.blocks
        .iter()
        .map(|b| ((b.address - BASE) * 2 / MIB, b.size * 2 / MIB, b.state))
        .collect()
}

/// The calls the device has seen: (allocations, frees) as the core counts them.
fn calls<B: Backend>(c: &CachingCore<B>) -> (u64, u64) {
    (c.stats().num_device_alloc, c.stats().num_device_free)
}

/// Four blocks mapped in order — A 4 MiB, X 2 MiB, B 4 MiB, Y 2 MiB, exactly as each request
/// asks (no headroom: reserved never passes the requested high-water) — then A and B freed:
/// two free 4 MiB holes at BASE and BASE + 6 MiB between live X and Y. Returns (X, Y).
fn holes<B: Backend>(c: &mut CachingCore<B>) -> (u64, u64) {
    let a = c.malloc(4 * MIB, S).unwrap();
    let x = c.malloc(2 * MIB, S).unwrap();
    let b = c.malloc(4 * MIB, S).unwrap();
    let y = c.malloc(2 * MIB, S).unwrap();
    assert_eq!(
        (a, x, b, y),
        (BASE, BASE + 4 * MIB, BASE + 6 * MIB, BASE + 10 * MIB)
    );
    c.free(a).unwrap();
    c.free(b).unwrap();
    assert_eq!(c.stats().num_device_alloc, 4);
    assert_eq!(c.stats().reserved_bytes.all.current, 12 * MIB as i64);
    (x, y)
}

use BlockPhase::{Allocated as A, Free as F, Held as H};

/// The holes' layout in half-MiB units: free 4, X, free 4, Y.
const HOLES: [(u64, u64, BlockPhase); 4] = [(0, 8, F), (8, 4, A), (12, 8, F), (20, 4, A)];

// --- 23a, 23b, 23f: making a view ------------------------------------------------------------

#[test]
fn over_the_limit_a_view_of_free_pages_is_made_and_its_first_byte_handed_out() {
    let mut c = core(1 << 30);
    c.record_history(Some(usize::MAX));
    holes(&mut c);
    // 5 MiB fits no hole. Rule 20: w = max(12, 4 + 5) = 12 MiB, reserved 12 + 6 > 12: a view
    // of k = 3 pages, taken from the holes (4 MiB each: by address) — BASE's two slots, then
    // BASE + 6 MiB's first — by one alias per hole: two calls, no new memory.
    let v = c.malloc(5 * MIB, S).unwrap();
    assert_eq!(v, V0);
    assert_eq!(calls(&c), (6, 0));
    assert_eq!(c.stats().reserved_bytes.all.current, 12 * MIB as i64);
    assert_eq!(c.stats().allocated_bytes.large_pool.current, 9 * MIB as i64);
    assert_eq!(c.stats().active_bytes.all.current, 9 * MIB as i64);
    assert_eq!(c.stats().requested_bytes.all.current, 9 * MIB as i64);
    assert_eq!(c.stats().allocation.all.current, 3);
    assert_eq!(c.view_counts(), (1, 1));
    assert_eq!(c.view_allocations(), [(V0, 5 * MIB, A)]);
    // 23b: the held bytes — two whole slots and the first t = 5 − 4 = 1 MiB of the third —
    // are one piece per run of consecutive homes: the first hole's two slots, one piece.
    assert_eq!(
        layout(&c),
        [(0, 8, H), (8, 4, A), (12, 2, H), (14, 6, F), (20, 4, A)]
    );
    assert!(
        c.segments()[0]
            .blocks
            .iter()
            .all(|b| b.state != H || b.requested == 0)
    );
    // 23a: the view's slots map the homes' pages; nothing in the history (one Alloc).
    let d = c.backend();
    for (slot, home) in [(0, 0), (2, 2), (4, 6)] {
        assert_eq!(d.page_at(V0 + slot * MIB), d.page_at(BASE + home * MIB));
    }
    assert_eq!(d.page_count(), 6);
    let last: Vec<TraceAction> = c.history().iter().rev().take(2).map(|e| e.action).collect();
    assert_eq!(last, [TraceAction::Alloc, TraceAction::FreeCompleted]);
    // Views are not segments: one run, its mapped bytes only.
    assert_eq!(c.segments().len(), 1);
    check(&c);
}

#[test]
fn rule_23f_a_view_takes_the_large_pools_pages_before_the_small_pools() {
    let mut c = core(1 << 30);
    // Small pool: four 1 MiB blocks (its range's pages 0 and 1), all freed: one free block of
    // two whole pages. Large pool: one page, freed: one free block of one whole page.
    let small: Vec<u64> = (0..4).map(|_| c.malloc(MIB, S).unwrap()).collect();
    let large = c.malloc(2 * MIB, S).unwrap();
    for &a in &small {
        c.free(a).unwrap();
    }
    c.free(large).unwrap();
    assert_eq!(c.stats().reserved_bytes.all.current, 6 * MIB as i64);
    let before = calls(&c);
    // 4 MiB: no cached block fits; 6 + 4 MiB passes the limit; three free pages. The small
    // pool's block holds more such bytes (4 MiB against 2), but the large pool's block comes
    // first: the view maps its page, then the small pool's first — one alias each.
    let v = c.malloc(4 * MIB, S).unwrap();
    assert_eq!(c.view_counts(), (1, 1));
    assert_eq!(calls(&c), (before.0 + 2, before.1));
    let d = c.backend();
    assert_eq!(d.page_at(v), d.page_at(large));
    assert_eq!(d.page_at(v + 2 * MIB), d.page_at(small[0]));
    check(&c);
    c.free(v).unwrap();
    check(&c);
}

#[test]
fn with_fewer_free_pages_than_the_request_needs_rule_20_goes_on_as_written() {
    let mut c = core(1 << 30);
    holes(&mut c);
    // 10 MiB needs 5 pages; the holes have 4: reclaim unmaps both holes (reserved 4 + 10 ≤
    // max(12, 4 + 10) = 14), then the range grows at its end.
    assert_eq!(c.malloc(10 * MIB, S).unwrap(), BASE + 12 * MIB);
    assert_eq!(c.view_counts(), (0, 0));
    assert_eq!(calls(&c), (5, 2));
    check(&c);
}

#[test]
fn under_the_limit_no_view_is_made() {
    let mut c = core(1 << 30);
    let a = c.malloc(4 * MIB, S).unwrap();
    let _x = c.malloc(2 * MIB, S).unwrap();
    c.free(a).unwrap();
    // 5 MiB: w = max(6, 2 + 5) = 7, reserved 6 + 6 > 7… but only two free pages: no view.
    // 1.5 MiB instead fits the hole (rule 6): no view either.
    assert_eq!(c.malloc(3 * MIB / 2, S).unwrap(), BASE);
    assert_eq!(c.view_counts(), (0, 0));
    check(&c);
}

#[test]
fn without_a_reclaim_headroom_stitching_never_acts() {
    let settings = Settings::pytorch()
        .apply("expandable_segments:True,expandable_page_mb:2,page_stitching:True")
        .unwrap();
    let mut c = CachingCore::new(SimDevice::new(1 << 30), settings).unwrap();
    holes(&mut c);
    assert_eq!(c.malloc(5 * MIB, S).unwrap(), BASE + 12 * MIB);
    assert_eq!(c.view_counts(), (0, 0));
    c.check_invariants().unwrap();
}

#[test]
fn stitching_beside_aliasing_is_refused_when_the_core_is_made() {
    let settings = Settings {
        page_aliasing: true,
        ..stitching()
    };
    let err = CachingCore::new(SimDevice::new(1 << 30), settings).unwrap_err();
    assert!(err.to_string().contains("page_stitching"), "{err}");
}

// --- 23e: return ------------------------------------------------------------------------------

#[test]
fn freeing_a_view_allocation_returns_its_pieces_which_merge_back() {
    let mut c = core(1 << 30);
    holes(&mut c);
    let v = c.malloc(5 * MIB, S).unwrap();
    c.free(v).unwrap();
    assert_eq!(layout(&c), HOLES);
    assert_eq!(c.stats().active_bytes.all.current, 4 * MIB as i64);
    assert_eq!(c.stats().allocated_bytes.all.current, 4 * MIB as i64);
    assert_eq!(c.stats().requested_bytes.all.current, 4 * MIB as i64);
    assert_eq!(c.view_counts(), (1, 0));
    assert!(c.view_allocations().is_empty());
    // Freeing it again is an error and changes nothing (rule 15).
    assert!(matches!(c.free(v), Err(Error::UnknownPointer { .. })));
    check(&c);
}

// --- 23c, 23d: hand-out from a view --------------------------------------------------------

#[test]
fn the_next_pass_reuses_the_view_with_no_device_call() {
    let mut c = core(1 << 30);
    holes(&mut c);
    let v = c.malloc(5 * MIB, S).unwrap();
    c.free(v).unwrap();
    let before = (calls(&c), c.backend().call_counts());
    for _ in 0..3 {
        let v = c.malloc(5 * MIB, S).unwrap();
        assert_eq!(v, V0);
        check(&c);
        c.free(v).unwrap();
    }
    assert_eq!((calls(&c), c.backend().call_counts()), before);
    assert_eq!(c.view_counts(), (1, 0));
}

#[test]
fn a_view_serves_every_size_of_its_page_count_holding_t_bytes_of_the_last_page() {
    let mut c = core(1 << 30);
    holes(&mut c);
    let v = c.malloc(5 * MIB, S).unwrap();
    c.free(v).unwrap();
    // 4.5 MiB: ⌈4.5 / 2⌉ = 3 pages: the view, holding 0.5 MiB of its last page.
    let v = c.malloc(9 * MIB / 2, S).unwrap();
    assert_eq!(v, V0);
    assert_eq!(
        layout(&c),
        [(0, 8, H), (8, 4, A), (12, 1, H), (13, 7, F), (20, 4, A)]
    );
    assert_eq!(
        c.stats().allocated_bytes.all.current,
        (4 * MIB + 9 * MIB / 2) as i64
    );
    check(&c);
    c.free(v).unwrap();
    // 7 MiB: four pages, not the view's three: a new view of the four free pages, made
    // after the first (6 MiB further on).
    let w = c.malloc(7 * MIB, S).unwrap();
    assert_eq!(w, V0 + 6 * MIB);
    assert_eq!(c.view_counts(), (2, 1));
    assert_eq!(calls(&c), (8, 0));
    check(&c);
    c.free(w).unwrap();
    // 3 MiB fits a hole: rule 6 first, no view.
    assert_eq!(c.malloc(3 * MIB, S).unwrap(), BASE);
    check(&c);
}

#[test]
fn a_view_whose_piece_is_not_free_is_not_usable_and_is_destroyed_before_its_home_is_reclaimed() {
    let mut c = core(1 << 30);
    holes(&mut c);
    let v = c.malloc(5 * MIB, S).unwrap();
    c.free(v).unwrap();
    // The first hole is taken by a 4 MiB block (best fit): the view's first piece is not free.
    assert_eq!(c.malloc(4 * MIB, S).unwrap(), BASE);
    // 5 MiB: the view is not usable; two free pages are too few for a new one; rule 20
    // (w = max(12, 8 + 5) = 13, reserved 12 + 6 > 13) reclaims the second hole — the view maps
    // its slot BASE + 6 MiB, so it is destroyed first (23h: one unmap) — then grows at the end.
    let at = c.malloc(5 * MIB, S).unwrap();
    assert_eq!(at, BASE + 12 * MIB);
    assert_eq!(c.view_counts(), (0, 0));
    assert_eq!(calls(&c), (7, 2));
    assert_eq!(c.backend().reservations().count(), 1);
    check(&c);
}

#[test]
fn the_usable_view_made_first_wins() {
    let mut c = core(1 << 30);
    // Four holes of 4 MiB between 2 MiB blocks.
    let mut big = Vec::new();
    for _ in 0..4 {
        big.push(c.malloc(4 * MIB, S).unwrap());
        c.malloc(2 * MIB, S).unwrap();
    }
    for a in big {
        c.free(a).unwrap();
    }
    // Two views of three pages: the first from the holes at 0 and 6 MiB, the second (the first
    // in use) from 12 and 18 MiB (the 3 MiB left at 7 MiB has one whole slot, and is last).
    let v0 = c.malloc(5 * MIB, S).unwrap();
    let v1 = c.malloc(5 * MIB, S).unwrap();
    assert_eq!((v0, v1), (V0, V0 + 6 * MIB));
    let d = c.backend();
    assert_eq!(d.page_at(v1), d.page_at(BASE + 12 * MIB));
    assert_eq!(d.page_at(v1 + 4 * MIB), d.page_at(BASE + 18 * MIB));
    check(&c);
    c.free(v1).unwrap();
    c.free(v0).unwrap();
    let before = calls(&c);
    // Both usable: the one made first, then the other.
    assert_eq!(c.malloc(5 * MIB, S).unwrap(), V0);
    assert_eq!(c.malloc(5 * MIB, S).unwrap(), V0 + 6 * MIB);
    assert_eq!(calls(&c), before);
    check(&c);
    c.free(V0).unwrap();
    c.free(V0 + 6 * MIB).unwrap();
    // The first not usable (its first hole taken): the second.
    assert_eq!(c.malloc(4 * MIB, S).unwrap(), BASE);
    assert_eq!(c.malloc(5 * MIB, S).unwrap(), V0 + 6 * MIB);
    assert_eq!(calls(&c), before);
    check(&c);
}

#[test]
fn has_cached_block_sees_a_usable_view() {
    // Rule 17a's search for a cached block is rule 23d's search too.
    let mut c = core(1 << 30);
    holes(&mut c);
    assert!(!c.has_cached_block(5 * MIB, S).unwrap());
    let v = c.malloc(5 * MIB, S).unwrap();
    assert!(!c.has_cached_block(5 * MIB, S).unwrap());
    c.free(v).unwrap();
    assert!(c.has_cached_block(5 * MIB, S).unwrap());
    assert!(!c.has_cached_block(5 * MIB, StreamId(1)).unwrap());
}

// --- rules 15 and 17 over view allocations -------------------------------------------------

#[test]
fn a_pending_view_allocation_holds_its_pieces_until_its_events_complete() {
    let mut c = core(1 << 30);
    holes(&mut c);
    let v = c.malloc(5 * MIB, S).unwrap();
    c.record_stream(v, StreamId(1)).unwrap();
    c.free(v).unwrap();
    // Pending: allocated bytes fell, active did not; the pieces stay held, the view in use.
    assert_eq!(c.stats().allocated_bytes.all.current, 4 * MIB as i64);
    assert_eq!(c.stats().active_bytes.all.current, 9 * MIB as i64);
    assert_eq!(c.view_counts(), (1, 1));
    assert_eq!(c.view_allocations(), [(V0, 5 * MIB, BlockPhase::Pending)]);
    assert_eq!(layout(&c)[0], (0, 8, H));
    check(&c);
    c.backend_mut().complete_stream(StreamId(1));
    // Rule 5 returns it before the search: the same view again, no device call.
    let before = calls(&c);
    assert_eq!(c.malloc(5 * MIB, S).unwrap(), V0);
    assert_eq!(calls(&c), before);
    check(&c);
}

// The front end under loom runs only inside loom models (the loom job runs these crates' lib
// tests with `--cfg loom`).
#[cfg(not(loom))]
#[test]
fn a_view_allocation_is_never_parked_and_its_view_serves_the_next_request() {
    // Rule 17b parks small-pool blocks only: a view's allocation (large pool) freed on the
    // thread that was handed it returns at once, so its pages are free for rules 20 and 23.
    let settings = Settings {
        thread_cache_blocks: 8,
        ..stitching()
    };
    let alloc = crate::frontend::Allocator::new(SimDevice::new(1 << 30), settings).unwrap();
    let a = alloc.malloc(4 * MIB, S).unwrap();
    let _x = alloc.malloc(2 * MIB, S).unwrap();
    let b = alloc.malloc(4 * MIB, S).unwrap();
    let _y = alloc.malloc(2 * MIB, S).unwrap();
    // Large blocks: freed, not parked.
    alloc.free(a).unwrap();
    alloc.free(b).unwrap();
    assert_eq!(alloc.thread_cached_blocks(), 0);
    // 5 MiB finds no cached block: the view is made from A's and B's holes.
    let v = alloc.malloc(5 * MIB, S).unwrap();
    assert_eq!(v, V0);
    alloc.free(v).unwrap();
    assert_eq!(alloc.thread_cached_blocks(), 0);
    // Not parked: the view is free, and the next request is handed it again.
    assert!(alloc.view_allocations().is_empty());
    alloc.check_invariants().unwrap();
    let before = alloc.stats().num_device_alloc;
    assert_eq!(alloc.malloc(5 * MIB, S).unwrap(), V0);
    assert_eq!(alloc.stats().num_device_alloc, before);
    // A small block is parked: the cache works beside the views.
    let small = alloc.malloc(4096, S).unwrap();
    alloc.free(small).unwrap();
    assert_eq!(alloc.thread_cached_blocks(), 1);
    assert_eq!(alloc.malloc(4096, S).unwrap(), small);
    alloc.free(small).unwrap();
    alloc.free(V0).unwrap();
    // empty_cache frees the parked block (17c) and destroys the free view (23h).
    alloc.empty_cache().unwrap();
    assert!(alloc.view_allocations().is_empty());
    assert_eq!(alloc.with_backend(|d| d.reservations().count()), 1);
    alloc.check_invariants().unwrap();
}

// --- 23g: the cap ----------------------------------------------------------------------------

#[test]
fn the_cap_destroys_the_least_recently_used_free_views() {
    // A device reporting 20 MiB: ranges of 24 MiB, views capped at 40 MiB.
    let mut d = Rigged::new();
    d.total = Some(20 * MIB);
    let mut c = CachingCore::new(d, stitching()).unwrap();
    // Four holes of 4 MiB between 2 MiB blocks: the whole range mapped.
    let mut big = Vec::new();
    for _ in 0..4 {
        big.push(c.malloc(4 * MIB, S).unwrap());
        c.malloc(2 * MIB, S).unwrap();
    }
    for a in big {
        c.free(a).unwrap();
    }
    let r = BASE + 24 * MIB;
    // Views of 3, 4, 5 and 6 pages: 6 + 8 + 10 + 12 = 36 MiB, each freed.
    for (size, at) in [(5, 0), (7, 6), (9, 14), (11, 24)] {
        let v = c.malloc(size * MIB, S).unwrap();
        assert_eq!(v, r + at * MIB);
        c.free(v).unwrap();
    }
    assert_eq!(c.view_counts(), (4, 0));
    // The 3-page view is handed out again: now the most recently used.
    let v = c.malloc(5 * MIB, S).unwrap();
    assert_eq!(v, r);
    c.free(v).unwrap();
    let (allocs, frees) = calls(&c);
    // 7 pages (14 MiB): 36 + 14 > 40: the 4-page view goes (42 > 40 still), then the 5-page
    // one (32 ≤ 40); the new view takes the address space they left.
    let v = c.malloc(13 * MIB, S).unwrap();
    assert_eq!(v, r + 6 * MIB);
    assert_eq!(c.view_counts(), (3, 1));
    assert_eq!(calls(&c), (allocs + 4, frees + 2));
    c.check_invariants().unwrap();
    c.free(v).unwrap();
    // The survivors are the 3-page and 6-page views, each usable in its turn.
    let v = c.malloc(5 * MIB, S).unwrap();
    assert_eq!(v, r);
    c.free(v).unwrap();
    assert_eq!(c.malloc(11 * MIB, S).unwrap(), r + 24 * MIB);
    assert_eq!(calls(&c), (allocs + 4, frees + 2));
    c.check_invariants().unwrap();
}

#[test]
fn views_in_use_are_never_destroyed_by_the_cap_and_then_no_view_is_made() {
    // Ranges of 24 MiB (20 MiB reported when the first is made), four holes of 4 MiB.
    let mut d = Rigged::new();
    d.total = Some(20 * MIB);
    let mut c = CachingCore::new(d, stitching()).unwrap();
    let mut big = Vec::new();
    for _ in 0..4 {
        big.push(c.malloc(4 * MIB, S).unwrap());
        c.malloc(2 * MIB, S).unwrap();
    }
    for a in big {
        c.free(a).unwrap();
    }
    let r = BASE + 24 * MIB;
    let v = c.malloc(5 * MIB, S).unwrap();
    assert_eq!(v, r);
    // Now 6 MiB reported: a cap of 12 MiB. 7 MiB (4 pages) finds five free pages, but the
    // view in use (6 MiB) plus 8 MiB passes the cap, and no free view is left to destroy: no
    // view; rule 20 unmaps the two whole holes (4 MiB each, by address; reserved 16 + 8 ≤ 24)
    // and, with no room in the range, a new range is reserved after the view.
    c.backend_mut().total = Some(6 * MIB);
    let (allocs, frees) = calls(&c);
    assert_eq!(c.malloc(7 * MIB, S).unwrap(), r + 6 * MIB);
    assert_eq!(c.view_counts(), (1, 1));
    assert_eq!(calls(&c), (allocs + 1, frees + 2));
    assert_eq!(c.backend().sim.reservations().count(), 3);
    c.check_invariants().unwrap();
}

// --- 23h: destruction -------------------------------------------------------------------------

#[test]
fn empty_cache_destroys_every_free_view_before_unmapping() {
    let mut c = core(1 << 30);
    holes(&mut c);
    let v = c.malloc(5 * MIB, S).unwrap();
    c.free(v).unwrap();
    c.empty_cache().unwrap();
    // The view (one unmap of its reservation), then the two holes (rule 19e).
    assert_eq!(calls(&c), (6, 3));
    assert_eq!(c.view_counts(), (0, 0));
    assert_eq!(c.backend().reservations().count(), 1);
    assert_eq!(c.stats().reserved_bytes.all.current, 4 * MIB as i64);
    assert_eq!(c.backend().used(), 4 * MIB);
    check(&c);
}

#[test]
fn empty_cache_keeps_a_view_in_use_and_unmaps_only_whole_free_pages() {
    let mut c = core(1 << 30);
    holes(&mut c);
    let v = c.malloc(5 * MIB, S).unwrap();
    c.empty_cache().unwrap();
    // Free pages: only [8, 10) MiB (the rest of the hole at 6 MiB holds the 1 MiB piece).
    assert_eq!(calls(&c), (6, 1));
    assert_eq!(c.view_counts(), (1, 1));
    assert_eq!(c.stats().reserved_bytes.all.current, 10 * MIB as i64);
    check(&c);
    c.free(v).unwrap();
    assert_eq!(layout(&c), [(0, 8, F), (8, 4, A), (12, 4, F)]);
    check(&c);
}

// --- 23f: failures ----------------------------------------------------------------------------

#[test]
fn an_out_of_memory_alias_rolls_the_view_back_and_rule_20_goes_on() {
    let mut c = core(1 << 30);
    holes(&mut c);
    // The first alias fails: nothing mapped, the reservation given back; rule 20 reclaims both
    // holes (reserved 4 + 6 ≤ 12) and grows at the range's end.
    c.backend_mut().fail_next_allocs(1);
    assert_eq!(c.malloc(5 * MIB, S).unwrap(), BASE + 12 * MIB);
    assert_eq!(calls(&c), (5, 2));
    assert_eq!(c.view_counts(), (0, 0));
    assert_eq!(c.backend().reservations().count(), 1);
    assert_eq!(c.stats().num_ooms, 0);
    check(&c);
}

#[test]
fn a_failed_second_alias_unmaps_the_first_in_one_call() {
    let mut d = Rigged::new();
    d.fail_alias = Some((1, BackendError::OutOfMemory));
    let mut c = CachingCore::new(d, stitching()).unwrap();
    holes(&mut c);
    // Alias one (+1 alloc), alias two fails: one unmap over the first (+1 free), the
    // reservation given back; then rule 20: two unmaps and a map.
    assert_eq!(c.malloc(5 * MIB, S).unwrap(), BASE + 12 * MIB);
    assert_eq!(calls(&c), (6, 3));
    assert_eq!(c.view_counts(), (0, 0));
    assert_eq!(c.backend().sim.reservations().count(), 1);
    c.check_invariants().unwrap();
}

#[test]
fn another_fault_while_making_a_view_is_returned_and_changes_nothing_else() {
    let mut d = Rigged::new();
    let fault = BackendError::Injected { operation: "alias" };
    d.fail_alias = Some((1, fault.clone()));
    let mut c = CachingCore::new(d, stitching()).unwrap();
    holes(&mut c);
    assert_eq!(c.malloc(5 * MIB, S), Err(Error::Backend(fault)));
    assert_eq!(calls(&c), (5, 1));
    assert_eq!(c.stats().num_ooms, 0);
    assert_eq!(c.view_counts(), (0, 0));
    assert_eq!(c.backend().sim.reservations().count(), 1);
    assert_eq!(c.stats().reserved_bytes.all.current, 12 * MIB as i64);
    c.check_invariants().unwrap();
    // The next request makes the view.
    assert_eq!(c.malloc(5 * MIB, S).unwrap(), V0);
    c.check_invariants().unwrap();
}

// --- 23j: the invariant -----------------------------------------------------------------------

#[test]
fn the_checker_catches_a_held_piece_of_no_view() {
    let mut c = core(1 << 30);
    holes(&mut c);
    let v = c.malloc(5 * MIB, S).unwrap();
    c.free(v).unwrap();
    // A free block marked held behind the views' back.
    let id = c.free_block_around(BASE, 1).unwrap();
    let b = c.blocks.get(id).clone();
    c.free_remove(b.pool.index(), &(b.stream, b.size, b.address, id));
    c.blocks.get_mut(id).state = H;
    assert!(matches!(
        c.check_invariants(),
        Err(crate::invariants::InvariantViolation::View { .. })
    ));
}

#[test]
fn random_runs_under_page_stitching_keep_every_invariant_and_no_byte_under_two_allocations() {
    let mut state = 0x2545_f491_4f6c_dd1du64;
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
        5 * MIB,
        7 * MIB,
        9 * MIB,
        13 * MIB,
    ];
    let mut view_steps = 0;
    for run in 0..60 {
        let capacity = [48 * MIB, 96 * MIB, 200 * MIB][run % 3];
        // 2 MiB pages in both pools (small ranges' pages stitched too), or 6 MiB large pages;
        // no headroom, or a quarter.
        let page = [2, 6][run / 3 % 2];
        let headroom = ["0", "0.25"][run / 6 % 2];
        let settings = Settings::pytorch()
            .apply(&format!(
                "expandable_segments:True,expandable_page_mb:{page},\
                 reclaim_headroom:{headroom},page_stitching:True"
            ))
            .unwrap();
        let mut c = CachingCore::new(SimDevice::new(capacity), settings).unwrap();
        let mut live: Vec<u64> = Vec::new();
        for _ in 0..250 {
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
            check(&c);
            if c.view_counts().1 > 0 {
                view_steps += 1;
            }
        }
        for a in live.drain(..) {
            c.free(a).unwrap();
        }
        c.backend_mut().complete_stream(StreamId(5));
        c.empty_cache().unwrap();
        assert_eq!(c.backend().used(), 0, "run {run}");
        assert_eq!(c.view_counts(), (0, 0));
        check(&c);
    }
    assert!(
        view_steps > 60 * 250 / 50,
        "{view_steps} steps with a view in use"
    );
}

/// The GPU test's example pass (`tests/gpu_stitching.rs`) through the front end under
/// cachalot's policy with stitching: A 4, X 2, B 4, Y 2 MiB; free B and A; C 5 MiB; 1.5 MiB;
/// everything freed in order. (Only the test below uses it, which loom builds leave out.)
#[cfg(not(loom))]
fn gpu_example_pass(alloc: &crate::frontend::Allocator<SimDevice>) {
    let mut live = Vec::new();
    for n in [4 * MIB, 2 * MIB, 4 * MIB, 2 * MIB] {
        live.push(alloc.malloc(n, S).unwrap());
    }
    alloc.free(live.remove(2)).unwrap();
    alloc.free(live.remove(0)).unwrap();
    live.push(alloc.malloc(5 * MIB, S).unwrap());
    live.push(alloc.malloc(3 * MIB / 2, S).unwrap());
    alloc.check_invariants().unwrap();
    let views = alloc.view_allocations();
    let segments = alloc.segments();
    alloc.with_backend(|d| check_device(segments, views, d));
    for a in live {
        alloc.free(a).unwrap();
    }
}

// The front end under loom runs only inside loom models (the loom job runs these crates' lib
// tests with `--cfg loom`).
#[cfg(not(loom))]
#[test]
fn the_gpu_tests_example_reaches_passes_with_no_device_call_under_cachalots_policy() {
    let settings = Settings::cachalot().apply("page_stitching:True").unwrap();
    let alloc = crate::frontend::Allocator::new(SimDevice::new(1 << 30), settings).unwrap();
    gpu_example_pass(&alloc);
    // C was freed, not parked (rule 17b: a large block): its view is free.
    assert!(alloc.view_allocations().is_empty());
    let mut per_pass = Vec::new();
    for _ in 0..5 {
        let s = alloc.stats();
        let before = s.num_device_alloc + s.num_device_free;
        gpu_example_pass(&alloc);
        let s = alloc.stats();
        per_pass.push(s.num_device_alloc + s.num_device_free - before);
    }
    assert_eq!(per_pass, [0, 0, 0, 0, 0]);
    // The range and one view, kept.
    assert_eq!(alloc.with_backend(|d| d.reservations().count()), 2);
}

// The front end under loom runs only inside loom models (the loom job runs these crates' lib
// tests with `--cfg loom`).
#[cfg(not(loom))]
#[test]
fn random_runs_through_thread_caches_keep_view_allocations_checked() {
    // Rule 17 beside view allocations: small blocks parked, views' allocations never.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move |n: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % n
    };
    const SIZES: [u64; 6] = [4096, 2 * MIB, 3 * MIB, 4 * MIB, 5 * MIB, 9 * MIB];
    let mut view_steps = 0;
    for run in 0..12 {
        let settings = Settings {
            thread_cache_blocks: [1, 2, 8][run % 3],
            ..Settings::cachalot().apply("page_stitching:True").unwrap()
        };
        let alloc = crate::frontend::Allocator::new(SimDevice::new(96 * MIB), settings).unwrap();
        let mut live: Vec<u64> = Vec::new();
        for _ in 0..200 {
            match next(12) {
                0..=5 => {
                    if let Ok(a) = alloc.malloc(SIZES[next(SIZES.len() as u64) as usize], S) {
                        live.push(a);
                    }
                }
                6..=10 if !live.is_empty() => {
                    let a = live.swap_remove(next(live.len() as u64) as usize);
                    alloc.free(a).unwrap();
                }
                _ => alloc.empty_cache().unwrap(),
            }
            alloc.check_invariants().unwrap();
            let views = alloc.view_allocations();
            view_steps += usize::from(!views.is_empty());
            let segments = alloc.segments();
            alloc.with_backend(|d| check_device(segments, views, d));
        }
        for a in live {
            alloc.free(a).unwrap();
        }
        alloc.empty_cache().unwrap();
        assert!(alloc.view_allocations().is_empty());
        assert_eq!(alloc.with_backend(|d| d.used()), 0, "run {run}");
    }
    assert!(
        view_steps > 12 * 200 / 20,
        "{view_steps} steps with a view allocation"
    );
}

// --- 23k: views across streams ----------------------------------------------------------------

const S1: StreamId = StreamId(1);

/// Stream 0's 8 MiB, freed: four free pages of stream 0's range, W = reserved = 8 MiB.
fn stream_zero_free<B: Backend>(c: &mut CachingCore<B>) {
    let x = c.malloc(8 * MIB, S).unwrap();
    c.free(x).unwrap();
    assert_eq!(calls(c), (1, 0));
}

#[test]
fn rule_23k_a_view_over_another_streams_pages_waits_at_hand_out_and_at_free() {
    let mut c = core(1 << 30);
    stream_zero_free(&mut c);
    // Stream 1's 4 MiB: no range of its own, over the limit (8 + 4 > 8): a view of stream 0's
    // first two pages (one alias), right after stream 0's range; stream 1 waits for 0.
    let e = c.malloc(4 * MIB, S1).unwrap();
    check(&c);
    assert_eq!(e, V0);
    assert_eq!(calls(&c), (2, 0));
    assert_eq!(c.backend().stream_waits(), [(S1, S)]);
    assert_eq!(layout(&c), [(0, 8, H), (8, 8, F)]);
    // The free: stream 0 waits for stream 1 first; the piece is free again at once.
    c.free(e).unwrap();
    check(&c);
    assert_eq!(c.backend().stream_waits(), [(S1, S), (S, S1)]);
    assert_eq!(layout(&c), [(0, 16, F)]);
    // Every later pass: the same view, no device call, the same two waits.
    for _ in 0..2 {
        let again = c.malloc(4 * MIB, S1).unwrap();
        assert_eq!(again, V0);
        c.free(again).unwrap();
    }
    check(&c);
    assert_eq!(calls(&c), (2, 0));
    assert_eq!(c.backend().stream_waits(), [(S1, S), (S, S1)].repeat(3));
    // Stream 0's own 8 MiB request is its block again: no wait.
    let x = c.malloc(8 * MIB, S).unwrap();
    assert_eq!(x, BASE);
    assert_eq!(c.backend().stream_waits().len(), 6);
}

#[test]
fn rule_23k_a_failing_wait_fails_the_free_and_the_hand_out_with_nothing_changed() {
    let mut c = CachingCore::new(Rigged::new(), stitching()).unwrap();
    stream_zero_free(&mut c);
    let e = c.malloc(4 * MIB, S1).unwrap();
    c.backend_mut().fail_wait = true;
    // The free fails: the allocation stays live, its piece held.
    assert!(matches!(c.free(e), Err(Error::Backend(_))));
    c.check_invariants().unwrap();
    assert_eq!(c.view_allocations(), [(V0, 4 * MIB, A)]);
    assert_eq!(c.stats().allocated_bytes.all.current, 4 * MIB as i64);
    c.backend_mut().fail_wait = false;
    c.free(e).unwrap();
    // The hand-out fails before anything is carved: the view stays free, nothing held.
    c.backend_mut().fail_wait = true;
    assert!(matches!(c.malloc(4 * MIB, S1), Err(Error::Backend(_))));
    c.check_invariants().unwrap();
    assert_eq!(c.view_counts(), (1, 0));
    assert_eq!(c.stats().allocated_bytes.all.current, 0);
    c.backend_mut().fail_wait = false;
    assert_eq!(c.malloc(4 * MIB, S1).unwrap(), V0);
    assert_eq!(c.backend().sim.stream_waits(), [(S1, S), (S, S1), (S1, S)]);
}

#[test]
fn rule_23k_an_injected_recording_fault_fails_the_wait_of_a_hand_out_on_the_simulated_device() {
    let mut c = core(1 << 30);
    stream_zero_free(&mut c);
    let e = c.malloc(4 * MIB, S1).unwrap();
    c.free(e).unwrap();
    c.backend_mut().inject(crate::backend::sim::Faults {
        record_error: 1,
        ..crate::backend::sim::Faults::default()
    });
    assert_eq!(
        c.malloc(4 * MIB, S1),
        Err(Error::Backend(BackendError::Injected {
            operation: "wait_stream"
        }))
    );
    check(&c);
    assert_eq!(c.view_counts(), (1, 0));
    assert_eq!(c.backend().stream_waits().len(), 2);
    assert_eq!(c.malloc(4 * MIB, S1).unwrap(), V0);
}

proptest::proptest! {
    /// The home slots of a range (rule 23's hot index: does a free block hold a slot some view
    /// maps?) agree with counting the views over every slot, as views are made and destroyed,
    /// for every window of slots, word boundaries included.
    #[test]
    fn the_home_slot_bits_answer_as_counting_every_slot(
        changes in proptest::collection::vec((0usize..200, proptest::bool::ANY), 0..60),
        windows in proptest::collection::vec((0usize..210, 0usize..80), 1..20),
    ) {
        let mut homes = super::RangeHomes::default();
        let mut counts = vec![0u32; 200];
        for (slot, add) in changes {
            if add {
                homes.add(slot);
                counts[slot] += 1;
            } else if counts[slot] > 0 {
                homes.remove(slot);
                counts[slot] -= 1;
            }
        }
        for (first, len) in windows {
            let end = first + len;
            let expected = (first..end.min(200)).any(|i| counts[i] > 0);
            proptest::prop_assert_eq!(homes.any(first, end), expected);
        }
        proptest::prop_assert_eq!(homes.is_empty(), counts.iter().all(|&c| c == 0));
    }

    /// Rule 23's address index (a sorted vector) answers as an ordered map: inserts replace a
    /// present end's block, removals take an end only while it names the block given, and the
    /// entries from an end on come in order.
    #[test]
    fn the_address_index_answers_as_an_ordered_map(
        ops in proptest::collection::vec((0u8..3, 0u64..40, 0u32..4), 1..200),
    ) {
        let mut index = super::EndIndex::default();
        let mut reference = std::collections::BTreeMap::new();
        for (kind, end, id) in ops {
            match kind {
                0 => {
                    index.insert(end, id);
                    reference.insert(end, id);
                }
                1 => {
                    index.remove_if(end, id);
                    if reference.get(&end) == Some(&id) {
                        reference.remove(&end);
                    }
                }
                _ => {
                    let expected: Vec<(u64, u32)> =
                        reference.range(end..).map(|(&e, &i)| (e, i)).collect();
                    proptest::prop_assert_eq!(index.from(end).collect::<Vec<_>>(), expected);
                }
            }
            proptest::prop_assert_eq!(index.get(end), reference.get(&end).copied());
        }
        let all: Vec<(u64, u32)> = reference.iter().map(|(&e, &i)| (e, i)).collect();
        proptest::prop_assert_eq!(index.from(0).collect::<Vec<_>>(), all);
    }
}

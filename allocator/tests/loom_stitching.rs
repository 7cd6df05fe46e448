//! loom: stitched views (rule 23) — one thread's request makes a view of free pages while
//! another thread frees into those pages, or takes part of them; and a view's allocation
//! freed by one thread while another's request could be handed the same view.
//!
//! Beside the shadow's check (no address handed out twice), every model checks what a view
//! could break and an address check cannot see: no physical byte of the simulated device lies
//! under two live allocations, whichever addresses map it.
#![cfg(loom)]

mod loom_common;

use cachalot::{Allocator, Settings, SimDevice};
use loom_common::{Shadow, model, settle};

const MIB: u64 = 1 << 20;

/// cachalot's policy with stitched views (expandable segments, 2 MiB pages, reclaim with
/// 2.5 % headroom) and thread caches of one block.
fn stitching() -> Settings {
    let mut s = Settings::cachalot().apply("page_stitching:True").unwrap();
    s.thread_cache_blocks = 1;
    s
}

/// 64 MiB, and the holes of rule 23's examples: [A 4][X 2][B 4][Y 2] MiB with A and B freed,
/// so that reserved memory (12 MiB) is at the requested high-water and a 5 MiB request is
/// served by a view of three free pages. Returns X and Y.
fn with_holes(a: &Allocator<SimDevice>, shadow: &Shadow) -> (u64, u64) {
    let first = shadow.malloc(a, 4 * MIB, 0);
    let x = shadow.malloc(a, 2 * MIB, 0);
    let second = shadow.malloc(a, 4 * MIB, 0);
    let y = shadow.malloc(a, 2 * MIB, 0);
    shadow.free(a, first);
    shadow.free(a, second);
    (x, y)
}

/// No physical byte under two live allocations: every live block's bytes, through whatever
/// addresses map them, land on distinct bytes of the device's pages.
fn physically_disjoint(a: &Allocator<SimDevice>, shadow: &Shadow) {
    let live = shadow.live();
    a.with_backend(|d| assert_eq!(d.physical_overlap(live), Ok(())));
}

#[test]
fn a_view_made_by_one_thread_while_another_frees_beside_its_pages_shares_no_byte() {
    model(|| {
        let a = Allocator::new(SimDevice::new(64 * MIB), stitching()).unwrap();
        let shadow = Shadow::default();
        let (x, _y) = with_holes(&a, &shadow);
        // X, between the two holes, is freed while the other thread's 5 MiB request makes a
        // view of the holes' pages (or, after the free, finds the merged hole).
        let (a1, sh1) = (a.clone(), shadow.clone());
        let freer = loom::thread::spawn(move || sh1.free(&a1, x));
        shadow.malloc(&a, 5 * MIB, 0);
        freer.join().unwrap();
        physically_disjoint(&a, &shadow);
        settle(&a, &shadow);
    });
}

#[test]
fn a_view_made_while_another_thread_takes_part_of_its_pages_shares_no_byte() {
    model(|| {
        let a = Allocator::new(SimDevice::new(64 * MIB), stitching()).unwrap();
        let shadow = Shadow::default();
        with_holes(&a, &shadow);
        // A 2 MiB request takes a page of a hole while the 5 MiB request makes its view.
        let (a1, sh1) = (a.clone(), shadow.clone());
        let taker = loom::thread::spawn(move || {
            sh1.malloc(&a1, 2 * MIB, 0);
        });
        shadow.malloc(&a, 5 * MIB, 0);
        taker.join().unwrap();
        physically_disjoint(&a, &shadow);
        settle(&a, &shadow);
    });
}

#[test]
fn a_view_freed_by_one_thread_while_another_asks_for_its_size_is_handed_out_once() {
    model(|| {
        let a = Allocator::new(SimDevice::new(64 * MIB), stitching()).unwrap();
        let shadow = Shadow::default();
        with_holes(&a, &shadow);
        let v = shadow.malloc(&a, 5 * MIB, 0);
        // The view's allocation is freed on one thread while another asks for 5 MiB: it gets
        // the view again (after the free) or memory of its own (before it).
        let (a1, sh1) = (a.clone(), shadow.clone());
        let freer = loom::thread::spawn(move || sh1.free(&a1, v));
        shadow.malloc(&a, 5 * MIB, 0);
        freer.join().unwrap();
        physically_disjoint(&a, &shadow);
        settle(&a, &shadow);
    });
}

/// Rule 23k: stream 1's request makes a view over stream 0's free pages while another thread
/// frees and takes memory on stream 0 beside them: no byte under two live allocations, and
/// every hand-out of a view across the streams (stream 1 waits for 0) is matched, once its
/// allocation is freed, by the free's wait (stream 0 waits for 1).
#[test]
fn a_view_across_streams_made_while_the_other_stream_frees_shares_no_byte_and_waits_both_ways() {
    model(|| {
        let a = Allocator::new(SimDevice::new(64 * MIB), stitching()).unwrap();
        let shadow = Shadow::default();
        let (x, y) = with_holes(&a, &shadow);
        shadow.free(&a, y);
        // Stream 0 frees X (merging the holes) and takes 4 MiB while stream 1's 5 MiB request,
        // with no range of its own, is served by a view of stream 0's free pages.
        let (a1, sh1) = (a.clone(), shadow.clone());
        let other = loom::thread::spawn(move || {
            sh1.free(&a1, x);
            sh1.malloc(&a1, 4 * MIB, 0);
        });
        let v = shadow.malloc(&a, 5 * MIB, 1);
        other.join().unwrap();
        physically_disjoint(&a, &shadow);
        shadow.free(&a, v);
        a.with_backend(|d| {
            let waits = d.stream_waits();
            let there = waits.iter().filter(|w| (w.0.0, w.1.0) == (1, 0)).count();
            let back = waits.iter().filter(|w| (w.0.0, w.1.0) == (0, 1)).count();
            assert_eq!(there, back, "{waits:?}");
            assert_eq!(there + back, waits.len(), "{waits:?}");
        });
        settle(&a, &shadow);
    });
}

//! Rule 17 through the thread-safe front end: parked blocks go back before the device grows
//! (17a), and a thread's own hit pair needs no shared lock.

#![cfg(not(loom))]

use std::sync::mpsc;
use std::time::Duration;

use cachalot::{Allocator, Settings, SimDevice, StreamId};

const MIB: u64 = 1 << 20;

fn allocator(expandable: bool) -> Allocator<SimDevice> {
    let mut settings = if expandable {
        Settings::cachalot()
    } else {
        Settings::pytorch()
    };
    settings.thread_cache_blocks = 8;
    Allocator::new(SimDevice::new(8 << 30), settings).unwrap()
}

#[test]
fn a_request_the_cache_cannot_serve_reuses_parked_blocks_instead_of_growing() {
    for expandable in [false, true] {
        let a = allocator(expandable);
        let s = StreamId(0);
        // One small-pool segment (2 MiB) filled by two 1 MiB blocks; one is parked.
        let first = a.malloc(MIB, s).unwrap();
        let _other = a.malloc(MIB, s).unwrap();
        a.free(first).unwrap();
        assert_eq!(a.thread_cached_blocks(), 1);
        let reserved = a.stats().reserved_bytes.all.current;
        // Another requested size: not a parked hit; nothing free fits; the parked block is
        // freed first and serves it.
        let second = a.malloc(MIB - 4096, s).unwrap();
        assert_eq!(second, first, "expandable {expandable}");
        assert_eq!(a.thread_cached_blocks(), 0);
        assert_eq!(
            a.stats().reserved_bytes.all.current,
            reserved,
            "expandable {expandable}"
        );
        a.free(second).unwrap();
    }
}

#[test]
fn large_blocks_are_freed_at_once_not_parked() {
    // Rule 17b: only small-pool blocks (requests of at most 1 MiB) are parked.
    for expandable in [false, true] {
        let a = allocator(expandable);
        let s = StreamId(0);
        let large = a.malloc(MIB + 512, s).unwrap();
        let small = a.malloc(MIB, s).unwrap();
        a.free(large).unwrap();
        a.free(small).unwrap();
        assert_eq!(a.thread_cached_blocks(), 1, "expandable {expandable}");
        assert_eq!(a.stats().allocation.all.current, 1);
        assert!(a.free(large).is_err(), "freed twice");
        assert_eq!(a.malloc(MIB, s).unwrap(), small);
        a.check_invariants().unwrap();
    }
}

#[test]
fn a_request_the_cache_can_serve_leaves_parked_blocks_parked() {
    let a = allocator(false);
    let s = StreamId(0);
    let small = a.malloc(4096, s).unwrap();
    a.free(small).unwrap();
    // The small segment's free rest serves 8 KiB: the parked 4 KiB block stays parked.
    let other = a.malloc(8192, s).unwrap();
    assert_ne!(other, small);
    assert_eq!(a.thread_cached_blocks(), 1);
    assert_eq!(a.malloc(4096, s).unwrap(), small);
}

/// Rule 17's fast paths: a thread's free of a block it was handed (parked) and its request of
/// the same size again (handed back) touch only its own cache. They complete while another
/// thread holds the allocator's shared lock; a free or request sent to the slow path would
/// wait for that lock until the holder gives up (10 s).
#[test]
fn a_hit_pair_completes_while_another_thread_holds_the_shared_lock() {
    let a = allocator(true);
    let s = StreamId(0);
    let (ready_tx, ready_rx) = mpsc::channel();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let (done_tx, done_rx) = mpsc::channel();
    let worker = a.clone();
    let t = std::thread::spawn(move || {
        let p = worker.malloc(4096, s).unwrap();
        ready_tx.send(()).unwrap();
        go_rx.recv().unwrap();
        worker.free(p).unwrap();
        let q = worker.malloc(4096, s).unwrap();
        // The holder may have given up waiting: then nobody listens.
        let _ = done_tx.send(q == p);
        worker.free(q).unwrap();
    });
    ready_rx.recv().unwrap();
    let outcome = a.with_backend(|_| {
        go_tx.send(()).unwrap();
        done_rx.recv_timeout(Duration::from_secs(10))
    });
    t.join().unwrap();
    assert_eq!(
        outcome,
        Ok(true),
        "the hit pair waited for the shared lock (or was not a hit)"
    );
    assert_eq!(
        a.thread_cached_blocks(),
        0,
        "the thread exited: its cache went back"
    );
}

#[test]
fn an_allocator_shows_its_thread_cache_size_when_debug_printed() {
    // Rule 17's one setting the front end holds: what a user printing the allocator sees.
    let shown = format!("{:?}", allocator(true));
    assert!(
        shown.starts_with("Allocator") && shown.contains("thread_cache_blocks: 8"),
        "{shown}"
    );
}

#[test]
fn rule_17a_a_request_of_exactly_the_largest_size_returns_parked_blocks_before_it_fails() {
    // 2^60 bytes is the largest request rule 1 admits: it goes past the thread cache like
    // any other, so parked blocks go back to the pool before the device is asked (and
    // refuses).
    let a = allocator(false);
    let p = a.malloc(4096, StreamId(0)).unwrap();
    a.free(p).unwrap();
    assert_eq!(
        a.stats().allocated_bytes.all.current,
        4096,
        "parked, still allocated"
    );
    assert!(a.malloc(1 << 60, StreamId(0)).is_err());
    assert_eq!(
        a.stats().allocated_bytes.all.current,
        0,
        "the parked block went back"
    );
}

#[test]
fn rule_17_while_the_history_is_recorded_a_block_handed_out_before_is_freed_not_parked() {
    // Recording sets the thread caches' size to 0: a block handed out before it started is
    // freed in the core when the program frees it, as the history has to show.
    let a = allocator(false);
    let p = a.malloc(4096, StreamId(0)).unwrap();
    a.record_history(Some(100));
    a.free(p).unwrap();
    assert_eq!(a.stats().allocated_bytes.all.current, 0);
}

#[test]
fn reset_peak_stats_sets_every_peak_to_its_current_value_through_the_front_end() {
    let a = allocator(false);
    let p = a.malloc(8 * MIB, StreamId(0)).unwrap();
    a.free(p).unwrap();
    assert_eq!(a.stats().allocated_bytes.all.peak, (8 * MIB) as i64);
    a.reset_peak_stats();
    let s = a.stats();
    assert_eq!(s.allocated_bytes.all.peak, s.allocated_bytes.all.current);
    assert_eq!(s.reserved_bytes.all.peak, s.reserved_bytes.all.current);
}

//! loom: statistics read on one thread while another thread changes them.
#![cfg(loom)]

mod loom_common;

use cachalot::Stats;
use loom_common::{Shadow, allocator, model, settings, settle};

/// What every snapshot must satisfy, whenever it is taken.
fn consistent(s: &Stats) {
    for a in [
        &s.allocation,
        &s.allocated_bytes,
        &s.active,
        &s.reserved_bytes,
        &s.segment,
    ] {
        assert_eq!(a.all.current, a.small_pool.current + a.large_pool.current);
        assert_eq!(a.all.allocated - a.all.freed, a.all.current);
        assert!(a.all.peak >= a.all.current);
    }
    assert!(s.allocated_bytes.all.current <= s.active_bytes.all.current);
    assert!(s.active_bytes.all.current <= s.reserved_bytes.all.current);
}

#[test]
fn statistics_read_while_they_change_are_consistent_snapshots() {
    for s in settings() {
        model(move || {
            let a = allocator(&s);
            let shadow = Shadow::default();
            let (a1, sh1) = (a.clone(), shadow.clone());
            let worker = loom::thread::spawn(move || {
                let p = sh1.malloc(&a1, 512, 0);
                let q = sh1.malloc(&a1, 2 << 20, 0);
                sh1.free(&a1, p);
                sh1.free(&a1, q);
            });
            let a2 = a.clone();
            let reader = loom::thread::spawn(move || {
                let before = a2.stats();
                consistent(&before);
                let after = a2.stats();
                consistent(&after);
                // Counters of events only grow.
                assert!(after.allocation.all.allocated >= before.allocation.all.allocated);
                assert!(after.num_device_alloc >= before.num_device_alloc);
            });
            worker.join().unwrap();
            reader.join().unwrap();
            let s = a.stats();
            consistent(&s);
            // Two blocks were handed out by the core, and one segment of each pool made.
            assert_eq!(s.allocation.all.allocated, 2);
            assert_eq!(s.num_device_alloc, 2);
            settle(&a, &shadow);
        });
    }
}

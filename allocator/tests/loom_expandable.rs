//! loom: expandable segments (rule 19) — one thread grows a range while another frees into it,
//! and a release unmaps pages while another thread allocates from the same range.
#![cfg(loom)]

mod loom_common;

use cachalot::{Allocator, Settings, SimDevice};
use loom_common::{Shadow, model, settle};

const MIB: u64 = 1 << 20;

/// PyTorch's front end and cachalot's (thread caches of one block), both with expandable
/// segments.
fn expandable_settings() -> [Settings; 2] {
    let mut pytorch = Settings::pytorch();
    pytorch.expandable_segments = true;
    let mut cachalot = Settings::cachalot();
    cachalot.thread_cache_blocks = 1;
    cachalot.expandable_segments = true;
    [pytorch, cachalot]
}

/// 64 MiB: a large-pool range of four 20 MiB pages, of which three fit the device.
fn allocator(settings: &Settings) -> Allocator<SimDevice> {
    Allocator::new(SimDevice::new(64 << 20), settings.clone()).unwrap()
}

#[test]
fn a_range_grown_by_one_thread_while_another_frees_into_it_hands_out_no_byte_twice() {
    for s in expandable_settings() {
        model(move || {
            let a = allocator(&s);
            let shadow = Shadow::default();
            // One page mapped; the block at its start is freed by another thread while this
            // thread needs the range to grow past the page.
            let p = shadow.malloc(&a, 3 * MIB, 0);
            let (a1, sh1) = (a.clone(), shadow.clone());
            let freer = loom::thread::spawn(move || sh1.free(&a1, p));
            shadow.malloc(&a, 25 * MIB, 0);
            freer.join().unwrap();
            settle(&a, &shadow);
        });
    }
}

#[test]
fn pages_unmapped_by_a_release_while_another_thread_allocates_are_never_handed_out() {
    for s in expandable_settings() {
        model(move || {
            let a = allocator(&s);
            let shadow = Shadow::default();
            let p = shadow.malloc(&a, 30 * MIB, 0);
            shadow.free(&a, p);
            let (a1, sh1) = (a.clone(), shadow.clone());
            let user = loom::thread::spawn(move || {
                let q = sh1.malloc(&a1, 8 * MIB, 0);
                sh1.free(&a1, q);
                sh1.malloc(&a1, 2 * MIB, 0);
            });
            a.empty_cache().unwrap();
            user.join().unwrap();
            settle(&a, &shadow);
        });
    }
}

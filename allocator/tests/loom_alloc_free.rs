//! loom: two threads allocate and free concurrently on one stream.
#![cfg(loom)]

mod loom_common;

use loom_common::{Shadow, allocator, model, settings, settle};

#[test]
fn two_threads_allocating_and_freeing_on_one_stream_never_share_a_block() {
    for s in settings() {
        model(move || {
            let a = allocator(&s);
            let shadow = Shadow::default();
            let threads: Vec<_> = [512u64, 1536]
                .into_iter()
                .map(|size| {
                    let (a, shadow) = (a.clone(), shadow.clone());
                    loom::thread::spawn(move || {
                        // Allocate, free (kept in the thread cache), allocate again (a hit),
                        // and keep the last block live.
                        let p = shadow.malloc(&a, size, 0);
                        shadow.free(&a, p);
                        shadow.malloc(&a, size, 0);
                    })
                })
                .collect();
            for t in threads {
                t.join().unwrap();
            }
            settle(&a, &shadow);
        });
    }
}

#[test]
fn a_block_freed_on_another_thread_while_its_owner_allocates_is_freed_once() {
    for s in settings() {
        model(move || {
            let a = allocator(&s);
            let shadow = Shadow::default();
            // Handed to this thread: it belongs to this thread's cache.
            let p = shadow.malloc(&a, 512, 0);
            let (a1, sh1) = (a.clone(), shadow.clone());
            let other = loom::thread::spawn(move || {
                // A free of another thread's block: the slow path, into the owner's cache lock.
                sh1.free(&a1, p);
            });
            // Meanwhile the owner's fast paths: park, then a hit.
            let q = shadow.malloc(&a, 512, 0);
            shadow.free(&a, q);
            shadow.malloc(&a, 512, 0);
            other.join().unwrap();
            settle(&a, &shadow);
        });
    }
}

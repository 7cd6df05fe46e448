//! loom: an event completes on one thread while another allocates (cross-stream reuse).
#![cfg(loom)]

mod loom_common;

use cachalot::StreamId;
use loom_common::{Shadow, allocator, model, settings, settle};

#[test]
fn an_event_completing_while_another_thread_allocates_reuses_safely() {
    for s in settings() {
        model(move || {
            let a = allocator(&s);
            let shadow = Shadow::default();
            // A block of stream 0 used on stream 1 and freed: pending until stream 1's event.
            let p = shadow.malloc(&a, 4096, 0);
            a.record_stream(p, StreamId(1)).unwrap();
            shadow.free(&a, p);
            assert_eq!(
                a.thread_cached_blocks(),
                0,
                "a cross-stream block is never kept"
            );
            let a1 = a.clone();
            let completer = loom::thread::spawn(move || {
                a1.with_backend(|d| d.complete_stream(StreamId(1)));
            });
            let (a2, sh2) = (a.clone(), shadow.clone());
            let allocator_thread = loom::thread::spawn(move || {
                // Either the event has completed and `p` comes back, or a fresh block does;
                // never `p` while the event is outstanding.
                let q = sh2.malloc(&a2, 4096, 0);
                let events = a2.with_backend(|d| d.live_events());
                assert!(
                    q != p || events == 0,
                    "{q:#x} reused before its event completed"
                );
            });
            completer.join().unwrap();
            allocator_thread.join().unwrap();
            settle(&a, &shadow);
        });
    }
}

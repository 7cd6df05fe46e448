//! loom: a free on one thread races `empty_cache` on another.
#![cfg(loom)]

mod loom_common;

use loom_common::{Shadow, allocator, model, settings, settle};

#[test]
fn a_free_racing_empty_cache_loses_nothing() {
    for s in settings() {
        model(move || {
            let a = allocator(&s);
            let shadow = Shadow::default();
            let (a1, sh1) = (a.clone(), shadow.clone());
            let freer = loom::thread::spawn(move || {
                let p = sh1.malloc(&a1, 4096, 0);
                let q = sh1.malloc(&a1, 8192, 0);
                sh1.free(&a1, p);
                // The cache holds one block: this free sends the oldest one back.
                sh1.free(&a1, q);
                // A hit, unless empty_cache took the block back first.
                let r = sh1.malloc(&a1, 8192, 0);
                sh1.free(&a1, r);
            });
            let a2 = a.clone();
            let emptier = loom::thread::spawn(move || {
                a2.empty_cache().unwrap();
            });
            freer.join().unwrap();
            emptier.join().unwrap();
            settle(&a, &shadow);
        });
    }
}

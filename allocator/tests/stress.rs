//! Stress without loom: 8 threads × many random operations on the simulated device, with both
//! front ends (PyTorch's single lock, cachalot's thread caches); a shadow of the live blocks
//! asserts no overlap and no double hand-out, and at the end the invariant check, the
//! statistics and the device must show nothing lost. A watchdog turns a deadlock into a
//! failure.
//!
//! Operations per thread: `CACHALOT_STRESS_OPS`, else 10^6 — the full run, in CI too (about 30 s
//! for both front ends in a debug build on 2 cores, 3 s in release).
#![cfg(not(loom))]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use cachalot::{Allocator, Error, Settings, SimDevice, StreamId};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

const THREADS: u64 = 8;
const MIB: u64 = 1 << 20;

fn ops_per_thread() -> u64 {
    std::env::var("CACHALOT_STRESS_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000)
}

/// A deterministic generator (`rand`'s xoshiro256++, seeded), one per thread.
struct Rng(Xoshiro256PlusPlus);

impl Rng {
    fn seeded(seed: u64) -> Rng {
        Rng(Xoshiro256PlusPlus::seed_from_u64(seed))
    }
    fn below(&mut self, n: u64) -> u64 {
        self.0.random_range(0..n)
    }
}

type Shadow = Arc<Mutex<BTreeMap<u64, u64>>>;

fn add(shadow: &Shadow, p: u64, size: u64) {
    let mut live = shadow.lock().unwrap();
    if let Some((&q, &qs)) = live.range(..p + size).next_back() {
        assert!(q + qs <= p, "{p:#x}+{size} overlaps live {q:#x}+{qs}");
    }
    live.insert(p, size);
}

fn remove(shadow: &Shadow, p: u64) {
    assert!(
        shadow.lock().unwrap().remove(&p).is_some(),
        "{p:#x} freed twice"
    );
}

fn worker(a: &Allocator<SimDevice>, shadow: &Shadow, exchange: &Mutex<Vec<u64>>, seed: u64) {
    let mut rng = Rng::seeded(seed);
    let mut live: Vec<u64> = Vec::new();
    let sizes = [512, 4096, 65536, MIB, 3 * MIB, 24 * MIB];
    for _ in 0..ops_per_thread() {
        let r = rng.below(1000);
        if r < 450 && live.len() < 64 {
            let size = if rng.below(4) == 0 {
                1 + rng.below(2 * MIB)
            } else {
                sizes[rng.below(sizes.len() as u64) as usize]
            };
            match a.malloc(size, StreamId(rng.below(3))) {
                Ok(p) => {
                    add(shadow, p, size);
                    live.push(p);
                }
                Err(Error::OutOfMemory(_)) => {}
                Err(e) => panic!("malloc: {e}"),
            }
        } else if r < 900 && !live.is_empty() {
            let p = live.swap_remove(rng.below(live.len() as u64) as usize);
            remove(shadow, p);
            a.free(p).unwrap();
        } else if r < 940 && !live.is_empty() {
            // Hand a block to whichever thread looks next: a free on another thread.
            let p = live.swap_remove(rng.below(live.len() as u64) as usize);
            exchange.lock().unwrap().push(p);
        } else if r < 970 {
            let taken = exchange.lock().unwrap().pop();
            if let Some(p) = taken {
                remove(shadow, p);
                a.free(p).unwrap();
            }
        } else if r < 980 && !live.is_empty() {
            let p = live[rng.below(live.len() as u64) as usize];
            a.record_stream(p, StreamId(rng.below(3))).unwrap();
        } else if r < 990 {
            let s = StreamId(rng.below(3));
            a.with_backend(|d| d.complete_stream(s));
        } else if r < 992 {
            a.empty_cache().unwrap();
        } else if r < 999 {
            let s = a.stats();
            assert_eq!(
                s.allocation.all.current,
                s.allocation.small_pool.current + s.allocation.large_pool.current
            );
            assert!(s.allocated_bytes.all.current <= s.reserved_bytes.all.current);
        } else {
            a.flush_thread_cache();
        }
    }
    for p in live {
        remove(shadow, p);
        a.free(p).unwrap();
    }
}

fn stress(settings: Settings) {
    let a = Allocator::new(SimDevice::new(16 << 30), settings.clone()).unwrap();
    let shadow: Shadow = Arc::default();
    let exchange = Arc::new(Mutex::new(Vec::new()));
    let (done_tx, done_rx) = mpsc::channel();
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let (a, shadow, exchange, done) =
                (a.clone(), shadow.clone(), exchange.clone(), done_tx.clone());
            std::thread::spawn(move || {
                worker(&a, &shadow, &exchange, t + 1);
                let _ = done.send(());
            })
        })
        .collect();
    for _ in 0..THREADS {
        // A deadlock (or a thread that panicked) fails here instead of hanging CI.
        done_rx
            .recv_timeout(Duration::from_secs(900))
            .expect("a worker neither finished nor answered within 15 minutes: deadlock?");
    }
    for h in handles {
        h.join().unwrap();
    }
    for p in exchange.lock().unwrap().drain(..) {
        remove(&shadow, p);
        a.free(p).unwrap();
    }
    assert!(shadow.lock().unwrap().is_empty());
    a.check_invariants().unwrap();
    // Nothing lost: every block came back, every segment can be released.
    for s in 0..3 {
        a.with_backend(|d| d.complete_stream(StreamId(s)));
    }
    a.empty_cache().unwrap();
    a.check_invariants().unwrap();
    let s = a.stats();
    assert_eq!(s.allocation.all.current, 0);
    assert_eq!(s.active.all.current, 0);
    assert_eq!(s.requested_bytes.all.current, 0);
    assert_eq!(s.segment.all.current, 0);
    assert_eq!(s.reserved_bytes.all.current, 0);
    if !settings.expandable_segments {
        // Segments pair one free with each allocation; map steps and unmaps need not pair.
        assert_eq!(s.num_device_alloc, s.num_device_free);
    }
    assert_eq!(a.thread_cached_blocks(), 0);
    a.with_backend(|d| {
        assert_eq!(d.used(), 0);
        assert_eq!(d.live_events(), 0);
    });
}

#[test]
fn eight_threads_with_thread_caches_lose_nothing_and_never_share_a_block() {
    stress(Settings::cachalot());
}

#[test]
fn eight_threads_on_pytorchs_single_lock_lose_nothing_and_never_share_a_block() {
    stress(Settings::pytorch());
}

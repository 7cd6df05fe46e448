//! Shared by the loom models: a model runner with a bounded preemption count, a small
//! allocator on the simulated device, and a shadow of the live blocks that asserts no two
//! overlap and no block is handed out twice.

use std::collections::BTreeMap;

use cachalot::{Allocator, Settings, SimDevice, StreamId};
use loom::sync::{Arc, Mutex};

/// Runs `f` under loom, exhaustively up to `LOOM_MAX_PREEMPTIONS` preemptions (2 when unset).
pub fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    if b.preemption_bound.is_none() {
        b.preemption_bound = Some(2);
    }
    b.check(f);
}

/// PyTorch's front end (one lock, no thread caches) and cachalot's (thread caches of 1 block,
/// so that the oldest block leaves the cache in the models too).
#[allow(dead_code)] // not every model asks
pub fn settings() -> [Settings; 2] {
    let mut cachalot = Settings::cachalot();
    cachalot.thread_cache_blocks = 1;
    [Settings::pytorch(), cachalot]
}

/// A small device: a few segments.
#[allow(dead_code)] // not every model asks
pub fn allocator(settings: &Settings) -> Allocator<SimDevice> {
    Allocator::new(SimDevice::new(64 << 20), settings.clone()).unwrap()
}

/// The live blocks as the users see them: `(address, size)`.
#[derive(Clone, Default)]
pub struct Shadow(Arc<Mutex<BTreeMap<u64, u64>>>);

impl Shadow {
    /// Allocates through `a` and records the block; panics if it overlaps a live one.
    pub fn malloc(&self, a: &Allocator<SimDevice>, size: u64, stream: u64) -> u64 {
        let p = a.malloc(size, StreamId(stream)).unwrap();
        let mut live = self.0.lock().unwrap();
        if let Some((&q, &qs)) = live.range(..p + size).next_back() {
            assert!(
                q + qs <= p,
                "{p:#x}+{size} overlaps live {q:#x}+{qs} (or is handed out twice)"
            );
        }
        live.insert(p, size);
        p
    }

    /// Forgets the block, then frees it through `a`.
    pub fn free(&self, a: &Allocator<SimDevice>, p: u64) {
        assert!(
            self.0.lock().unwrap().remove(&p).is_some(),
            "{p:#x} not live"
        );
        a.free(p).unwrap();
    }

    /// The live blocks, `(address, size)`, by address.
    #[allow(dead_code)] // not every model asks
    pub fn live(&self) -> Vec<(u64, u64)> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .map(|(&p, &s)| (p, s))
            .collect()
    }

    /// Number of live blocks.
    pub fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

/// Once the threads have joined: the invariants hold (the front end's cover the thread
/// caches), the statistics add up to the live blocks, and after freeing everything and
/// emptying the cache the device is empty and every counter is back to zero.
pub fn settle(a: &Allocator<SimDevice>, shadow: &Shadow) {
    a.check_invariants().unwrap();
    // A joined thread's cache may be handed back (its thread-local destructor) just after
    // join returns: read the kept blocks on both sides of the statistics.
    let kept_before = a.thread_cached_blocks() as i64;
    let s = a.stats();
    let kept_after = a.thread_cached_blocks() as i64;
    let users = shadow.len() as i64;
    assert!(
        s.allocation.all.current == users + kept_before
            || s.allocation.all.current == users + kept_after,
        "{} allocations, {users} live and {kept_before}/{kept_after} kept",
        s.allocation.all.current
    );
    assert_eq!(
        s.allocation.all.allocated - s.allocation.all.freed,
        s.allocation.all.current
    );
    assert!(s.allocated_bytes.all.current <= s.reserved_bytes.all.current);
    let live: Vec<u64> = shadow.0.lock().unwrap().keys().copied().collect();
    for p in live {
        shadow.free(a, p);
    }
    a.empty_cache().unwrap();
    a.check_invariants().unwrap();
    let s = a.stats();
    assert_eq!(s.allocation.all.current, 0);
    assert_eq!(s.active.all.current, 0);
    assert_eq!(s.reserved_bytes.all.current, 0);
    assert_eq!(a.with_backend(|d| d.used()), 0);
}

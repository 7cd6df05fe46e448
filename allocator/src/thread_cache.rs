//! Thread caches: the blocks each thread freed most recently, kept for that thread's own
//! requests (rule 17 of ARCHITECTURE.md; on in cachalot's defaults, off under PyTorch's).
//!
//! The one rule: a block in a thread cache is still *allocated* in the core. The core never
//! sees it freed, so its statistics, its layout and the model's stay exact; a cache hit is a
//! decision the core does not make, and the model makes it the same way (rule 17).
//!
//! Each thread that allocates through an [`Allocator`](crate::Allocator) gets one [`Local`]
//! per allocator: the blocks handed to it and not yet freed (`live`), and the blocks it freed
//! and kept (`parked`, oldest first). Only the thread itself adds to its `Local`; other threads
//! only take from it (a free of a block the thread was handed, a flush), always while holding
//! the allocator's shared lock first. A thread's own fast path takes only its `Local`'s lock,
//! which no other thread wants except in those slow operations, so threads do not contend.
//!
//! Lock order: the shared lock (core), then a `Local`, then the registry's `retired` list.

use std::cell::RefCell;

use rustc_hash::FxHashMap;

use crate::backend::StreamId;
use crate::sync::{Arc, AtomicBool, Mutex, Ordering, lock, thread_local};

/// What the front end remembers of a block it handed to a thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Meta {
    /// The stream it was allocated on.
    pub stream: StreamId,
    /// The size the user asked for (a cache hit needs the same stream and the same size).
    pub requested: u64,
    /// Whether another stream used it (`record_stream`): such a block is never parked.
    pub uses: bool,
}

/// One thread's blocks of one allocator.
#[derive(Debug, Default)]
pub(crate) struct LocalState {
    /// Blocks handed to this thread and not freed.
    pub live: FxHashMap<u64, Meta>,
    /// Blocks this thread freed and kept, oldest first. Still allocated in the core.
    pub parked: Vec<(u64, Meta)>,
}

/// One thread's cache for one allocator, on cache lines of its own (threads' caches must not
/// share one: the fast paths of different threads would then contend after all).
#[derive(Debug, Default)]
#[repr(align(128))]
pub(crate) struct Local {
    pub state: Mutex<LocalState>,
}

impl Local {
    /// The fast path of `malloc`: the most recently parked block of `stream` whose request was
    /// `size` bytes, now live again.
    #[inline]
    pub fn take(&self, size: u64, stream: StreamId) -> Option<u64> {
        let mut st = lock(&self.state);
        let i = st
            .parked
            .iter()
            .rposition(|(_, m)| m.requested == size && m.stream == stream)?;
        let (address, meta) = st.parked.remove(i);
        st.live.insert(address, meta);
        Some(address)
    }

    /// The fast path of `free`: parks `address` when this thread was handed it, no other
    /// stream used it and the cache has room. False sends the free to the slow path.
    #[inline]
    pub fn park(&self, address: u64, capacity: usize) -> bool {
        let mut st = lock(&self.state);
        if st.parked.len() >= capacity {
            return false;
        }
        match st.live.remove(&address) {
            Some(meta) if !meta.uses => {
                st.parked.push((address, meta));
                true
            }
            Some(meta) => {
                // Used on another stream: the slow path frees it (rule 15).
                st.live.insert(address, meta);
                false
            }
            None => false,
        }
    }
}

/// The part of an allocator that thread-local storage refers to (not generic over the
/// backend): where exiting threads leave their caches for the next holder of the shared lock.
#[derive(Debug)]
pub(crate) struct Registry {
    /// `Local`s of threads that exited, to be flushed and forgotten.
    retired: Mutex<Vec<Arc<Local>>>,
    /// Whether `retired` may be non-empty (read without its lock on every shared-lock taking).
    pending: AtomicBool,
    /// False once the allocator is dropped: exiting threads then leave nothing behind.
    alive: AtomicBool,
}

impl Registry {
    pub fn new() -> Registry {
        Registry {
            retired: Mutex::new(Vec::new()),
            pending: AtomicBool::new(false),
            alive: AtomicBool::new(true),
        }
    }

    /// Whether some thread exited with a cache not yet flushed.
    #[inline]
    pub fn has_retired(&self) -> bool {
        self.pending.load(Ordering::Acquire)
    }

    /// The caches of exited threads, in the order they exited.
    pub fn take_retired(&self) -> Vec<Arc<Local>> {
        let mut r = lock(&self.retired);
        self.pending.store(false, Ordering::Release);
        std::mem::take(&mut *r)
    }

    /// The allocator is being dropped.
    pub fn close(&self) {
        self.alive.store(false, Ordering::Release);
        lock(&self.retired).clear();
    }

    fn retire(&self, local: Arc<Local>) {
        if self.alive.load(Ordering::Acquire) {
            lock(&self.retired).push(local);
            self.pending.store(true, Ordering::Release);
        }
    }
}

struct Entry {
    registry: Arc<Registry>,
    local: Arc<Local>,
}

/// This thread's caches, one per allocator it used. Dropped when the thread exits: each cache
/// is handed to its allocator's registry, to be flushed under the shared lock.
struct Entries(RefCell<Vec<Entry>>);

impl Drop for Entries {
    fn drop(&mut self) {
        for e in self.0.get_mut().drain(..) {
            e.registry.retire(e.local);
        }
    }
}

#[cfg(not(loom))]
thread_local! {
    static ENTRIES: Entries = const { Entries(RefCell::new(Vec::new())) };
}

// loom's thread_local! takes no `const` initialiser.
#[cfg(loom)]
thread_local! {
    static ENTRIES: Entries = Entries(RefCell::new(Vec::new()));
}

/// Runs `f` on this thread's cache for `registry`'s allocator, if it has one (`None` also
/// while the thread's storage is being torn down).
#[inline]
pub(crate) fn with_local<R>(
    registry: &Arc<Registry>,
    f: impl FnOnce(&Arc<Local>) -> R,
) -> Option<R> {
    ENTRIES
        .try_with(|e| {
            let entries = e.0.borrow();
            entries
                .iter()
                .find(|x| Arc::ptr_eq(&x.registry, registry))
                .map(|x| f(&x.local))
        })
        .ok()
        .flatten()
}

/// This thread's cache for `registry`'s allocator, made on first use (then `true`: the caller,
/// holding the shared lock, registers it). `None` while the thread's storage is being torn
/// down: that thread then allocates without a cache.
pub(crate) fn register(registry: &Arc<Registry>) -> Option<(Arc<Local>, bool)> {
    ENTRIES
        .try_with(|e| {
            let mut entries = e.0.borrow_mut();
            // Forget the caches of dropped allocators.
            entries.retain(|x| x.registry.alive.load(Ordering::Acquire));
            if let Some(x) = entries.iter().find(|x| Arc::ptr_eq(&x.registry, registry)) {
                return (Arc::clone(&x.local), false);
            }
            let local = Arc::new(Local::default());
            entries.push(Entry {
                registry: Arc::clone(registry),
                local: Arc::clone(&local),
            });
            (local, true)
        })
        .ok()
}

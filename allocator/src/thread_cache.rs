//! Thread caches: the blocks each thread freed most recently, kept for that thread's own
//! requests (rule 17 of ARCHITECTURE.md; on in cachalot's defaults, off under PyTorch's).
//!
//! The one rule: a block in a thread cache is still *allocated* in the core. The core never
//! sees it freed, so its statistics, its layout and the model's stay exact; a cache hit is a
//! decision the core does not make, and the model makes it the same way (rule 17).
//!
//! Each thread that allocates through an [`Allocator`](crate::Allocator) gets one [`Local`]
//! per allocator: the blocks handed to it and not yet freed (*live*), and the blocks it freed
//! and kept (*parked*, oldest first). Only the thread itself adds to its `Local`; other threads
//! only take from it (a free of a block the thread was handed, a flush), always while holding
//! the allocator's shared lock first.
//!
//! **The hit path.** A `Local` holds two short arrays — its parked blocks, oldest first, and
//! the live blocks handed out most recently — as plain atomics guarded by one flag
//! ([`Local::hold`]): the owner's cache hit and its free of a recent block take the flag (one
//! compare-and-swap), look at the arrays from their newest end (a hit pair finds its block at
//! once) and release it (a store): no mutex, no hash map, no allocation. What every block
//! handed to a thread is (its thread, stream, requested size, other-stream use) is in the
//! front end's owner map, under the shared lock: a free of a block the recent array no longer
//! holds is decided there, with the core's lock already taken.
//!
//! **Atomic read-modify-writes are the price** (a locked instruction costs tens of cycles,
//! more than the scans), so the slow paths take no flag they do not need:
//! * on the owner's own slow path, under the shared lock, no other thread can touch the
//!   owner's `Local` (they too need the shared lock) and the owner is busy there: it reads and
//!   changes its arrays without the flag ([`Local::own`]);
//! * whether any thread has parked blocks (rule 17a's question, under the shared lock) is a
//!   read of each length without the flag: an owner parking at that moment is ordered after
//!   the question, as it could be with the flag.
//!
//! The fast paths take the flag first and scan once under it. A look without the flag before
//! it would spare a miss its compare-and-swap, but a hit would then pay for the look and a
//! check under the flag: measured on the simulated device's hot loop (callgrind, 2026-12-07),
//! 12 % more instructions a hit pair even with the look's position reused, against a hot path
//! that must not get slower.
//!
//! Lock order: the shared lock (core), then a `Local`'s flag, then the registry's `retired`
//! list.

use std::cell::RefCell;

use crate::backend::StreamId;
use crate::sync::{
    Arc, AtomicBool, AtomicU64, AtomicUsize, Mutex, Ordering, lock, spin_wait, thread_local,
};

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

/// The most live blocks a `Local` keeps in its array of recent ones (at least one).
const RECENT_LIVE: usize = 16;

/// A block in one of a `Local`'s arrays. Read and written only by a holder of the `Local`'s
/// flag, or by its owner under the shared lock ([`Local::own`]). All accesses are relaxed (the
/// flag and the shared lock order them): plain moves.
#[derive(Debug, Default)]
struct Kept {
    /// The block's address.
    address: AtomicU64,
    /// The size the user asked for.
    requested: AtomicU64,
    /// The stream (its id).
    stream: AtomicU64,
}

/// An array of blocks, oldest first, with its length: the `Local`'s parked blocks, or its
/// recent live ones.
#[derive(Debug)]
struct Blocks {
    entries: Box<[Kept]>,
    len: AtomicUsize,
}

const R: Ordering = Ordering::Relaxed;

impl Blocks {
    fn new(capacity: usize) -> Blocks {
        Blocks {
            entries: (0..capacity).map(|_| Kept::default()).collect(),
            len: AtomicUsize::new(0),
        }
    }

    #[inline]
    fn len(&self) -> usize {
        self.len.load(R)
    }

    #[inline]
    fn get(&self, i: usize) -> (u64, Meta) {
        let e = &self.entries[i];
        let meta = Meta {
            stream: StreamId(e.stream.load(R)),
            requested: e.requested.load(R),
            uses: false,
        };
        (e.address.load(R), meta)
    }

    #[inline]
    fn set(&self, i: usize, address: u64, meta: Meta) {
        let e = &self.entries[i];
        e.address.store(address, R);
        e.requested.store(meta.requested, R);
        e.stream.store(meta.stream.0, R);
    }

    /// Appends a block; the caller made room.
    #[inline]
    fn push(&self, address: u64, meta: Meta) {
        let n = self.len();
        debug_assert!(n < self.entries.len(), "a thread cache's array overflowed");
        self.set(n, address, meta);
        self.len.store(n + 1, R);
    }

    /// Takes block `i` out, keeping the others' order.
    #[inline]
    fn remove(&self, i: usize) -> (u64, Meta) {
        let out = self.get(i);
        let n = self.len();
        for j in i + 1..n {
            let (a, m) = self.get(j);
            self.set(j - 1, a, m);
        }
        self.len.store(n - 1, R);
        out
    }

    /// Takes block `i` out, the last block taking its place (the order is not kept).
    #[inline]
    fn swap_remove(&self, i: usize) -> (u64, Meta) {
        let out = self.get(i);
        let last = self.len() - 1;
        if i != last {
            let (a, m) = self.get(last);
            self.set(i, a, m);
        }
        self.len.store(last, R);
        out
    }

    /// Empties the array.
    #[inline]
    fn clear(&self) {
        self.len.store(0, R);
    }

    /// The position of block `address`, newest first.
    #[inline]
    fn find(&self, address: u64) -> Option<usize> {
        (0..self.len())
            .rev()
            .find(|&i| self.entries[i].address.load(R) == address)
    }

    /// The position of the newest block of `stream` whose request was `size` bytes.
    #[inline]
    fn find_request(&self, size: u64, stream: StreamId) -> Option<usize> {
        (0..self.len()).rev().find(|&i| {
            let e = &self.entries[i];
            e.requested.load(R) == size && e.stream.load(R) == stream.0
        })
    }

    fn all(&self) -> impl Iterator<Item = (u64, Meta)> + '_ {
        (0..self.len()).map(|i| self.get(i))
    }
}

/// One thread's cache for one allocator, on cache lines of its own (threads' caches must not
/// share one: the fast paths of different threads would then contend after all).
#[derive(Debug)]
#[repr(align(128))]
pub(crate) struct Local {
    /// Held by whoever reads or changes the fields below: the owner on its fast paths, another
    /// thread (holding the shared lock) for a flush or a free of one of this thread's blocks.
    busy: AtomicBool,
    /// This cache's name in the front end's owner map: unique among the allocator's caches.
    id: u64,
    /// Parked blocks, oldest first: at most the configured `N`.
    parked: Blocks,
    /// The live blocks handed out most recently (in no order), none used on another stream:
    /// the ones the fast path of `free` may park without the shared lock. The thread's other
    /// live blocks are known only to the owner map (under the shared lock).
    recent: Blocks,
    /// The recent array's next slot to replace when it is full.
    victim: AtomicUsize,
}

impl Local {
    /// A cache named `id` for a thread of an allocator whose threads keep up to `n` blocks.
    pub fn new(id: u64, n: usize) -> Local {
        Local {
            busy: AtomicBool::new(false),
            id,
            parked: Blocks::new(n),
            recent: Blocks::new(n.clamp(1, RECENT_LIVE)),
            victim: AtomicUsize::new(0),
        }
    }

    /// This cache's name in the owner map.
    #[inline]
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Takes the flag: the returned guard reads and changes the cache until it is dropped.
    /// The owner holds it only for a short scan; another thread may hold it across one core
    /// operation (under the shared lock), so waiting yields.
    #[inline]
    pub fn hold(&self) -> Held<'_> {
        while self
            .busy
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            spin_wait();
        }
        Held {
            local: self,
            flag: true,
        }
    }

    /// The owner's own cache on its slow path, *without* the flag. Only for the thread that
    /// owns this cache, while it holds the allocator's shared lock: every other thread that
    /// reads or changes a `Local` holds the shared lock first, and the owner is here, so
    /// nobody else is in the arrays (the shared lock's acquisition orders what others did).
    #[inline]
    pub fn own(&self) -> Held<'_> {
        debug_assert!(
            !self.busy.load(Ordering::Relaxed),
            "a thread's own cache was held by another thread under the shared lock"
        );
        Held {
            local: self,
            flag: false,
        }
    }

    /// Blocks parked now, read without the flag (under the shared lock, by rule 17a's
    /// question: the owner may be parking at that moment, and is then ordered after it).
    #[inline]
    pub fn parked_now(&self) -> usize {
        self.parked.len()
    }

    /// The fast path of `malloc`: the most recently parked block of `stream` whose request was
    /// `size` bytes, now live again.
    #[inline]
    pub fn take(&self, size: u64, stream: StreamId) -> Option<u64> {
        self.hold().take(size, stream)
    }

    /// The fast path of `free`: parks `address` when it is one of this thread's recent live
    /// blocks (so no other stream used it) and the cache has room. False sends the free to
    /// the slow path, which decides under the shared lock.
    #[inline]
    pub fn park(&self, address: u64, capacity: usize) -> bool {
        let h = self.hold();
        h.parked_len() < capacity && h.park_recent(address)
    }
}

/// A held [`Local`]: the cache's operations. Dropping it releases the flag, when it took it
/// ([`Local::hold`]; [`Local::own`] takes none).
pub(crate) struct Held<'a> {
    local: &'a Local,
    flag: bool,
}

impl Drop for Held<'_> {
    #[inline]
    fn drop(&mut self) {
        if self.flag {
            self.local.busy.store(false, Ordering::Release);
        }
    }
}

impl Held<'_> {
    /// Blocks parked now.
    #[inline]
    pub fn parked_len(&self) -> usize {
        self.local.parked.len()
    }

    #[inline]
    fn take(&self, size: u64, stream: StreamId) -> Option<u64> {
        let parked = &self.local.parked;
        let i = parked.find_request(size, stream)?;
        let (address, meta) = parked.remove(i);
        self.push_recent(address, meta);
        Some(address)
    }

    /// Notes a clean live block as a recent one; when the array is full the block in the
    /// slot after the last one replaced this way leaves it (round robin: the owner map still
    /// knows it, and a free of it is decided under the shared lock). The array keeps no order.
    #[inline]
    pub fn push_recent(&self, address: u64, meta: Meta) {
        let recent = &self.local.recent;
        let n = recent.len();
        if n < recent.entries.len() {
            recent.push(address, meta);
        } else {
            let victim = self.local.victim.load(R) % n;
            self.local.victim.store(victim + 1, R);
            recent.set(victim, address, meta);
        }
    }

    /// Parks `address` if it is one of the recent live blocks (the caller made room: fewer
    /// than `N` blocks are parked). False changes nothing.
    #[inline]
    fn park_recent(&self, address: u64) -> bool {
        let Some(i) = self.local.recent.find(address) else {
            return false;
        };
        let (a, m) = self.local.recent.swap_remove(i);
        self.local.parked.push(a, m);
        true
    }

    /// Parks live block `address` (`meta` from the owner map; the caller checked that no other
    /// stream used it and made room), taking it out of the recent array if it is there.
    pub fn park_live(&self, address: u64, meta: Meta) {
        self.forget_recent(address);
        self.local.parked.push(address, meta);
    }

    /// Whether `address` is parked here.
    pub fn is_parked(&self, address: u64) -> bool {
        self.local.parked.find(address).is_some()
    }

    /// Takes `address` out of the recent array if it is there (freed through the core, or
    /// used on another stream: the fast path must not park it).
    pub fn forget_recent(&self, address: u64) {
        if let Some(i) = self.local.recent.find(address) {
            self.local.recent.swap_remove(i);
        }
    }

    /// The parked blocks, oldest first.
    pub fn parked(&self) -> Vec<(u64, Meta)> {
        self.local.parked.all().collect()
    }

    /// The recent live blocks, oldest first.
    pub fn recent(&self) -> Vec<(u64, Meta)> {
        self.local.recent.all().collect()
    }

    /// Takes every parked block out, oldest first.
    pub fn drain_parked(&self) -> Vec<(u64, Meta)> {
        let v = self.parked();
        self.local.parked.clear();
        v
    }

    /// Takes the oldest parked block out.
    pub fn pop_oldest(&self) -> Option<(u64, Meta)> {
        (self.parked_len() > 0).then(|| self.local.parked.remove(0))
    }

    /// Forgets every recent live block (the thread exited).
    pub fn clear_recent(&self) {
        self.local.recent.clear();
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
    /// The blocks each thread may keep (`Settings::thread_cache_blocks`): the size of a new
    /// [`Local`].
    blocks: usize,
    /// The next [`Local`]'s name.
    next_id: AtomicU64,
}

impl Registry {
    pub fn new(blocks: usize) -> Registry {
        Registry {
            blocks,
            retired: Mutex::new(Vec::new()),
            pending: AtomicBool::new(false),
            alive: AtomicBool::new(true),
            next_id: AtomicU64::new(0),
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
            let id = registry.next_id.fetch_add(1, Ordering::Relaxed);
            let local = Arc::new(Local::new(id, registry.blocks));
            entries.push(Entry {
                registry: Arc::clone(registry),
                local: Arc::clone(&local),
            });
            (local, true)
        })
        .ok()
}

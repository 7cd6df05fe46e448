//! The thread-safe front end: one allocator per device, shared by every thread.
//!
//! The one rule: the front end adds sharing and, when [`Settings::thread_cache_blocks`] is not
//! zero, thread caches (rule 17 of ARCHITECTURE.md) — nothing else. Every other decision is
//! made by the [`CachingCore`] behind one lock, so each run is a sequence of the core's
//! operations and of rule-17 steps, which the reference model replays and checks.
//!
//! With thread caches off (PyTorch's settings) every method takes the shared lock and calls
//! the core: exactly PyTorch's single-mutex allocator. With them on, a thread's `malloc` that
//! finds a block it parked, and its `free` of a block it was handed, touch only the thread's own
//! cache ([`crate::thread_cache`]); everything else takes the shared lock.

use rustc_hash::FxHashMap;

use crate::backend::{Backend, StreamId};
use crate::error::Error;
use crate::history::HistoryOptions;
use crate::invariants::InvariantViolation;
use crate::policy::adopt::AdoptedSegment;
use crate::policy::{CachingCore, SegmentInfo};
use crate::settings::Settings;
use crate::sizes::{MAX_ALLOC_SIZE, SMALL_SIZE};
use crate::stats::Stats;
use crate::sync::{Arc, Mutex, MutexGuard, Ordering, SettingCell, lock};
use crate::thread_cache::{self, Local, Meta, Registry};

/// A caching allocator for one device: `Send + Sync`, and cheap to clone (clones share the
/// cache).
///
/// With [`Settings::thread_cache_blocks`] above zero (cachalot's defaults), each thread keeps
/// the last small-pool blocks (requests of at most 1 MiB) it freed, up to that many, and gets
/// them back for its own requests of the
/// same size on the same stream without taking the shared lock (rule 17 of ARCHITECTURE.md).
/// Kept blocks still count as allocated in [`Allocator::stats`]; [`Allocator::empty_cache`],
/// an out-of-memory retry, [`Allocator::flush_thread_cache`] and the thread's exit give them
/// back. With [`Settings::pytorch`] every call takes one lock around the policy core, as
/// PyTorch's allocator does. While the history is recorded ([`Allocator::record_history`]),
/// thread caches are flushed and bypassed, so that every allocation and free is recorded as
/// the program made it.
///
/// ```
/// # if cachalot::LOOM_BUILD { return; } // built for loom: an Allocator lives in a loom model only
/// use cachalot::{Allocator, Settings, SimDevice, StreamId};
///
/// let alloc = Allocator::new(SimDevice::new(1 << 30), Settings::default()).unwrap();
/// let worker = alloc.clone();
/// std::thread::spawn(move || {
///     let p = worker.malloc(4096, StreamId(0)).unwrap();
///     worker.free(p).unwrap();
///     // cachalot's defaults: the block stays in this thread's cache, and comes back here.
///     assert_eq!(worker.malloc(4096, StreamId(0)).unwrap(), p);
///     worker.free(p).unwrap();
/// })
/// .join()
/// .unwrap();
/// assert_eq!(alloc.stats().num_device_alloc, 1);
/// // The thread has exited: its cache went back to the shared pool.
/// assert_eq!(alloc.thread_cached_blocks(), 0);
/// assert_eq!(alloc.stats().allocation.all.current, 0);
/// ```
pub struct Allocator<B: Backend> {
    shared: Arc<Shared<B>>,
}

struct Shared<B: Backend> {
    inner: Mutex<Inner<B>>,
    registry: Arc<Registry>,
    /// `Settings::thread_cache_blocks`: blocks each thread may keep (0: no thread caches).
    configured: usize,
    /// Blocks each thread may keep now: `configured`, or 0 while the history is recorded
    /// (every allocation and free then reaches the core, which records it as the program made
    /// it). Changed only under the shared lock; read once per call on the fast paths.
    capacity: SettingCell,
}

impl<B: Backend> Drop for Shared<B> {
    fn drop(&mut self) {
        self.registry.close();
    }
}

/// Everything behind the shared lock.
struct Inner<B: Backend> {
    core: CachingCore<B>,
    /// Each thread's cache, in the order the threads first allocated (rule 17's flush order).
    threads: Vec<Arc<Local>>,
    /// For every small-pool block handed out to a registered thread, live or parked: that
    /// thread's cache (its name) and what the block is.
    owners: FxHashMap<u64, Owned>,
}

/// A block handed to a registered thread, as the owner map knows it.
#[derive(Clone, Copy, Debug)]
struct Owned {
    /// The [`Local`]'s name.
    thread: u64,
    /// Its stream, requested size and other-stream use.
    meta: Meta,
}

impl<B: Backend> Clone for Allocator<B> {
    fn clone(&self) -> Self {
        Allocator {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<B: Backend> std::fmt::Debug for Allocator<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Allocator")
            .field("thread_cache_blocks", &self.shared.configured)
            .finish_non_exhaustive()
    }
}

impl<B: Backend> Inner<B> {
    /// Rule 17: frees one thread's parked blocks, oldest first.
    fn flush(&mut self, local: &Local) {
        let parked = local.hold().drain_parked();
        for (address, _) in parked {
            self.owners.remove(&address);
            // A parked block had no other-stream uses: freeing it records no event and
            // cannot fail.
            let r = self.core.free(address);
            debug_assert!(r.is_ok(), "freeing a parked block failed: {r:?}");
        }
    }

    /// Rule 17: frees every thread's parked blocks, threads in registration order.
    fn flush_all(&mut self) {
        for local in self.threads.clone() {
            self.flush(&local);
        }
    }

    /// Rule 17a's question, without taking any thread's flag (see [`Local::parked_now`]).
    fn any_parked(&self) -> bool {
        self.threads.iter().any(|l| l.parked_now() > 0)
    }

    /// Rule 17: threads that exited — their parked blocks are freed, their live blocks no
    /// longer belong to a thread, and they leave the registration order.
    fn retire(&mut self, registry: &Registry) {
        for local in registry.take_retired() {
            self.flush(&local);
            local.hold().clear_recent();
            let id = local.id();
            self.owners.retain(|_, o| o.thread != id);
            self.threads.retain(|l| !Arc::ptr_eq(l, &local));
        }
    }

    /// The registered cache named `id`.
    fn thread(&self, id: u64) -> Option<&Arc<Local>> {
        find_thread(&self.threads, id)
    }
}

/// The cache named `id` among `threads` (a function of the field alone, so that the core and
/// the owner map stay free to change while it is held).
fn find_thread(threads: &[Arc<Local>], id: u64) -> Option<&Arc<Local>> {
    threads.iter().find(|l| l.id() == id)
}

impl<B: Backend> Allocator<B> {
    /// An allocator over `backend` with `settings`.
    pub fn new(backend: B, settings: Settings) -> Result<Self, Error> {
        Ok(Self::from_core(CachingCore::new(backend, settings)?))
    }

    /// Wraps an existing core; its settings' `thread_cache_blocks` turns thread caches on.
    pub fn from_core(core: CachingCore<B>) -> Self {
        let capacity = core.settings().thread_cache_blocks as usize;
        Allocator {
            shared: Arc::new(Shared {
                inner: Mutex::new(Inner {
                    core,
                    threads: Vec::new(),
                    owners: FxHashMap::default(),
                }),
                registry: Arc::new(Registry::new(capacity)),
                configured: capacity,
                capacity: SettingCell::new(capacity),
            }),
        }
    }

    /// The shared lock, after retiring the caches of threads that exited.
    #[inline]
    fn lock(&self) -> MutexGuard<'_, Inner<B>> {
        let mut g = lock(&self.shared.inner);
        if self.shared.registry.has_retired() {
            g.retire(&self.shared.registry);
        }
        g
    }

    /// Allocates `size` bytes for use on `stream`; see [`CachingCore::malloc`].
    ///
    /// With thread caches on, the most recent block this thread freed with the same size on
    /// the same stream comes back first, without the shared lock (rule 17).
    #[inline]
    pub fn malloc(&self, size: u64, stream: StreamId) -> Result<u64, Error> {
        let capacity = self.shared.capacity.load(Ordering::Relaxed);
        if capacity == 0 || size == 0 || size > MAX_ALLOC_SIZE {
            return self.lock().core.malloc(size, stream);
        }
        // Rule 17b parks small-pool blocks only: a larger request cannot hit.
        if size <= SMALL_SIZE {
            // A miss brings this thread's cache's name along, for the slow path.
            match thread_cache::with_local(&self.shared.registry, |l| {
                l.take(size, stream).ok_or(l.id())
            }) {
                Some(Ok(address)) => return Ok(address),
                Some(Err(id)) => return self.malloc_slow(size, stream, Some(id)),
                None => {}
            }
        }
        self.malloc_slow(size, stream, None)
    }

    /// `malloc` past the thread cache; `me` is this thread's cache's name when the caller
    /// already looked it up.
    #[cold]
    fn malloc_slow(&self, size: u64, stream: StreamId, me: Option<u64>) -> Result<u64, Error> {
        let mut g = self.lock();
        let inner = &mut *g;
        // This thread's cache (its name), registered at its first request.
        let local = match me.or_else(|| thread_cache::with_local(&self.shared.registry, |l| l.id()))
        {
            Some(id) => Some(id),
            None => thread_cache::register(&self.shared.registry).map(|(l, new)| {
                if new {
                    inner.threads.push(Arc::clone(&l));
                }
                l.id()
            }),
        };
        // Rule 17a: parked blocks go back before the device grows for a request the cache
        // cannot serve. One search: the request is made at once when the cache serves it.
        let mut r = if inner.any_parked() {
            match inner.core.malloc_if_cached(size, stream) {
                Ok(Some(address)) => Ok(address),
                Ok(None) => {
                    inner.flush_all();
                    inner.core.malloc(size, stream)
                }
                Err(e) => Err(e),
            }
        } else {
            inner.core.malloc(size, stream)
        };
        // Rule 17: before reporting out-of-memory, parked blocks go back and the request is
        // made once more.
        if matches!(r, Err(Error::OutOfMemory(_))) && inner.any_parked() {
            inner.flush_all();
            r = inner.core.malloc(size, stream);
        }
        // Rule 17b: only small-pool blocks are ever parked, so only they are tracked.
        if let (Ok(address), Some(id), true) = (&r, local, size <= SMALL_SIZE) {
            let meta = Meta {
                stream,
                requested: size,
                uses: false,
            };
            if let Some(l) = inner.thread(id) {
                // This thread's own cache, under the shared lock: no flag needed.
                l.own().push_recent(*address, meta);
                inner.owners.insert(*address, Owned { thread: id, meta });
            }
        }
        r
    }

    /// Frees the allocation at `address`; see [`CachingCore::free`].
    ///
    /// With thread caches on, a small-pool block (requested size at most 1 MiB) this thread was
    /// handed, that no other stream used, is kept in the thread's cache (still allocated in the core); the oldest kept block is freed
    /// when the cache is full (rule 17).
    #[inline]
    pub fn free(&self, address: u64) -> Result<(), Error> {
        let capacity = self.shared.capacity.load(Ordering::Relaxed);
        if capacity == 0 {
            let mut g = self.lock();
            // With thread caches configured but bypassed (history recording), a block handed
            // to a thread before is still in its books: the slow path takes it out.
            if g.owners.is_empty() {
                return g.core.free(address);
            }
            drop(g);
            let me = thread_cache::with_local(&self.shared.registry, |l| l.id());
            return self.free_slow(address, me);
        }
        if address == 0 {
            return Ok(());
        }
        // A block not parked brings this thread's cache's name along, for the slow path.
        match thread_cache::with_local(&self.shared.registry, |l| {
            if l.park(address, capacity) {
                None
            } else {
                Some(l.id())
            }
        }) {
            Some(None) => Ok(()),
            Some(me) => self.free_slow(address, me),
            None => self.free_slow(address, None),
        }
    }

    /// `free` past the thread cache; `me` is this thread's cache's name, if it has one.
    #[cold]
    fn free_slow(&self, address: u64, me: Option<u64>) -> Result<(), Error> {
        let mut g = self.lock();
        let Inner {
            core,
            threads,
            owners,
        } = &mut *g;
        let Some(&Owned { thread, meta }) = owners.get(&address) else {
            return core.free(address);
        };
        let Some(owner) = find_thread(threads, thread) else {
            debug_assert!(false, "an owned block names no registered thread");
            return core.free(address);
        };
        let mine = me == Some(thread);
        // This thread's own cache needs no flag under the shared lock; another's does.
        let h = if mine { owner.own() } else { owner.hold() };
        if h.is_parked(address) {
            // The user already freed it.
            return Err(Error::UnknownPointer { address });
        }
        // Read under the shared lock, which recording's start holds while it sets it to 0.
        let capacity = self.shared.capacity.load(Ordering::Relaxed);
        if mine && !meta.uses && capacity > 0 {
            // The cache is full (or was when the fast path looked): the oldest block leaves.
            if h.parked_len() >= capacity
                && let Some((oldest, _)) = h.pop_oldest()
            {
                owners.remove(&oldest);
                let r = core.free(oldest);
                debug_assert!(r.is_ok(), "freeing a parked block failed: {r:?}");
            }
            h.park_live(address, meta);
            return Ok(());
        }
        core.free(address)?;
        h.forget_recent(address);
        owners.remove(&address);
        Ok(())
    }

    /// Marks the allocation at `address` as used on `stream`; see
    /// [`CachingCore::record_stream`]. A block used on another stream is never kept in a
    /// thread cache.
    pub fn record_stream(&self, address: u64, stream: StreamId) -> Result<(), Error> {
        let mut g = self.lock();
        let Inner {
            core,
            threads,
            owners,
        } = &mut *g;
        let Some(&Owned { thread, meta }) = owners.get(&address) else {
            return core.record_stream(address, stream);
        };
        let Some(owner) = find_thread(threads, thread) else {
            debug_assert!(false, "an owned block names no registered thread");
            return core.record_stream(address, stream);
        };
        let h = owner.hold();
        if h.is_parked(address) {
            return Err(Error::UnknownPointer { address });
        }
        core.record_stream(address, stream)?;
        if stream != meta.stream {
            // Never parked from now on: out of the fast path's reach, marked in the map.
            h.forget_recent(address);
            if let Some(o) = owners.get_mut(&address) {
                o.meta.uses = true;
            }
        }
        Ok(())
    }

    /// Frees every block in every thread cache, then gives every whole free segment back to
    /// the device.
    pub fn empty_cache(&self) -> Result<(), Error> {
        let mut g = self.lock();
        g.flush_all();
        g.core.empty_cache()
    }

    /// Frees the blocks this thread's cache keeps (they return to the shared pool). A thread's
    /// cache is also flushed when the thread exits.
    pub fn flush_thread_cache(&self) {
        let mut g = self.lock();
        if let Some(local) = thread_cache::with_local(&self.shared.registry, Arc::clone) {
            g.flush(&local);
        }
    }

    /// Blocks kept in thread caches now, all threads together (they count as allocated in the
    /// statistics).
    pub fn thread_cached_blocks(&self) -> usize {
        let g = self.lock();
        g.threads.iter().map(|l| l.hold().parked_len()).sum()
    }

    /// Caps reserved memory at `fraction` of the device's capacity.
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<(), Error> {
        self.lock().core.set_memory_fraction(fraction)
    }

    /// A copy of the statistics. Blocks kept in thread caches count as allocated.
    pub fn stats(&self) -> Stats {
        self.lock().core.stats().clone()
    }

    /// Sets every peak statistic to its current value.
    pub fn reset_peak_stats(&self) {
        self.lock().core.reset_peak_stats()
    }

    /// The segments and their blocks (blocks kept in thread caches show as allocated).
    pub fn segments(&self) -> Vec<SegmentInfo> {
        self.lock().core.segments()
    }

    /// The live allocations made through stitched views (rule 23), as
    /// [`CachingCore::view_allocations`] lists them.
    pub fn view_allocations(&self) -> Vec<(u64, u64, crate::block::BlockPhase)> {
        self.lock().core.view_allocations()
    }

    /// Checks the core's invariants, and the thread caches': every block a thread holds is
    /// allocated in the core and belongs to exactly that thread; no cache is over capacity.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        let g = self.lock();
        g.core.check_invariants()?;
        let allocated: std::collections::HashSet<u64> = g
            .core
            .segments()
            .iter()
            .flat_map(|s| s.blocks.iter())
            .filter(|b| b.state == crate::block::BlockPhase::Allocated)
            .map(|b| b.address)
            // Rule 23: allocations through stitched views are in no segment.
            .chain(
                g.core
                    .view_allocations()
                    .into_iter()
                    .filter(|v| v.2 == crate::block::BlockPhase::Allocated)
                    .map(|v| v.0),
            )
            .collect();
        for (i, local) in g.threads.iter().enumerate() {
            let h = local.hold();
            let (recent, parked) = (h.recent(), h.parked());
            drop(h);
            if parked.len() > self.shared.configured {
                return Err(InvariantViolation::ThreadCacheOverfull {
                    thread: i,
                    kept: parked.len(),
                    capacity: self.shared.configured,
                });
            }
            // A recent block is one the fast path may park: this thread's, clean, in the map
            // with the same stream and size.
            for (a, m) in recent.iter().chain(parked.iter()) {
                let o = g.owners.get(a);
                let same = o.is_some_and(|o| {
                    o.thread == local.id()
                        && !o.meta.uses
                        && o.meta.stream == m.stream
                        && o.meta.requested == m.requested
                });
                if !same {
                    return Err(InvariantViolation::ThreadHoldsOthers {
                        thread: i,
                        address: *a,
                    });
                }
            }
            let recent: std::collections::HashSet<u64> = recent.iter().map(|(a, _)| *a).collect();
            if let Some((a, _)) = parked.iter().find(|(a, _)| recent.contains(a)) {
                return Err(InvariantViolation::LiveAndParked {
                    thread: i,
                    address: *a,
                });
            }
        }
        // Every block the owner map holds, live or parked, is allocated in the core and
        // belongs to a registered thread.
        let mut held = 0usize;
        for (a, o) in &g.owners {
            let Some(i) = g.threads.iter().position(|l| l.id() == o.thread) else {
                continue;
            };
            held += 1;
            if !allocated.contains(a) {
                return Err(InvariantViolation::ThreadHoldsUnallocated {
                    thread: i,
                    address: *a,
                });
            }
        }
        if held != g.owners.len() {
            return Err(InvariantViolation::OwnerCount {
                owned: g.owners.len(),
                held,
            });
        }
        Ok(())
    }

    /// The settings in force (a copy).
    pub fn settings(&self) -> Settings {
        self.lock().core.settings().clone()
    }

    /// Starts, resizes or stops recording the history, as PyTorch's
    /// `torch.cuda.memory._record_memory_history(max_entries=...)`: `Some(n)` keeps the last
    /// `n` entries in a ring (`usize::MAX`: everything); `None` or `Some(0)` stops and drops
    /// what was recorded. See [`CachingCore::record_history`].
    ///
    /// While recording, thread caches are flushed and bypassed (each allocation and free takes
    /// the shared lock, as under [`Settings::pytorch`]), so the history holds every allocation
    /// and free as the program made it, and the statistics and the layout are exactly what a
    /// replay of the history gives. A block a thread was freeing at the very moment recording
    /// began may stay in that thread's cache until the next flush (its free is then recorded
    /// when it is flushed).
    ///
    /// ```
    /// # if cachalot::LOOM_BUILD { return; }
    /// use cachalot::{Allocator, Settings, SimDevice, StreamId};
    ///
    /// let alloc = Allocator::new(SimDevice::new(1 << 30), Settings::default()).unwrap();
    /// alloc.record_history(Some(100_000));
    /// let p = alloc.malloc(4096, StreamId(0)).unwrap();
    /// alloc.free(p).unwrap();
    /// assert_eq!(alloc.history().len(), 4); // segment_map, alloc, free_requested, free_completed
    /// alloc.record_history(None);
    /// assert!(alloc.history().is_empty());
    /// ```
    pub fn record_history(&self, max_entries: Option<usize>) {
        self.record_history_with(max_entries.filter(|&n| n > 0).map(HistoryOptions::new));
    }

    /// [`Allocator::record_history`] with every option (Rust backtraces as each entry's
    /// frames: [`HistoryOptions::with_backtraces`]); `None` stops.
    pub fn record_history_with(&self, options: Option<HistoryOptions>) {
        let mut g = self.lock();
        if options.is_some() {
            // Bypass the caches first, then give back what they hold (not recorded: the
            // program freed those blocks before recording began).
            self.shared.capacity.store(0, Ordering::Relaxed);
            g.flush_all();
        } else {
            self.shared
                .capacity
                .store(self.shared.configured, Ordering::Relaxed);
        }
        g.core.record_history_with(options);
    }

    /// How the history is being recorded, or `None` when it is not.
    pub fn history_options(&self) -> Option<crate::history::HistoryOptions> {
        self.lock().core.history_options()
    }

    /// The events recorded so far, oldest first; see [`CachingCore::history`].
    pub fn history(&self) -> Vec<crate::history::TraceEvent> {
        self.lock().core.history()
    }

    /// The recorded history and the state now as a PyTorch memory snapshot (what
    /// `torch.cuda.memory._snapshot()` returns): the segments and blocks, the history as the
    /// device's trace with its clock times and, when recorded, backtraces as frames, and the
    /// settings. Backtraces are resolved after the lock is released.
    #[cfg(feature = "snapshot")]
    pub fn snapshot(&self) -> crate::snapshot::Snapshot {
        let (segments, recorded, settings, device) = {
            let g = self.lock();
            (
                g.core.segments(),
                g.core.recorded_history(),
                g.core.settings().clone(),
                g.core.device_index(),
            )
        };
        crate::snapshot::build::live_snapshot(&segments, &recorded, &settings, device)
    }

    /// Writes [`Allocator::snapshot`] to `path` in PyTorch's pickle format, as
    /// `torch.cuda.memory._dump_snapshot(path)` does: `python -m torch.cuda._memory_viz` and
    /// `cachalot replay` read it.
    #[cfg(feature = "snapshot")]
    pub fn dump_snapshot(&self, path: impl AsRef<std::path::Path>) -> std::io::Result<()> {
        let snapshot = self.snapshot();
        crate::snapshot::write::write_snapshot(&snapshot, std::fs::File::create(path)?)
    }

    /// Rule 18: takes over a segment the device already holds, with its layout; see
    /// [`CachingCore::adopt_segment`]. Its allocated blocks become live allocations of no
    /// thread: any thread may free them, and none keeps them in its cache.
    pub fn adopt_segment(&self, segment: AdoptedSegment) -> Result<(), Error> {
        self.lock().core.adopt_segment(segment)
    }

    /// Rule 18f: takes over a range of expandable segments the device already holds, with its
    /// layout; see [`CachingCore::adopt_range`]. Its allocated blocks become live allocations
    /// of no thread, as [`Allocator::adopt_segment`]'s do.
    pub fn adopt_range(&self, range: crate::policy::adopt::AdoptedRange) -> Result<(), Error> {
        self.lock().core.adopt_range(range)
    }

    /// Runs `f` on the device backend, under the shared lock: for tests and tools that drive
    /// the device itself — the simulated device's stream completions, injected faults and
    /// scripted addresses ([`crate::SimDevice`]), or reading its memory in use.
    ///
    /// The backend's memory is the allocator's: `f` must not free or allocate segments
    /// through it, or the allocator's segments and the device's disagree (the simulated device
    /// then reports errors; a real device may hand freed memory to someone else).
    pub fn with_backend<R>(&self, f: impl FnOnce(&mut B) -> R) -> R {
        f(self.lock().core.backend_mut())
    }
}

// Off under `--cfg loom`: the front end then runs on loom's primitives, which live only inside a
// loom model (allocator/tests/loom_*.rs are those).
#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::backend::sim::SimDevice;

    #[test]
    fn dropping_the_allocator_closes_its_thread_registry() {
        // A thread's cache outlives the thread in the registry until the allocator flushes
        // it; when the allocator goes first, its drop lets those caches go (and a thread
        // exiting later keeps none there).
        let mut settings = Settings::cachalot();
        settings.thread_cache_blocks = 8;
        let a = Allocator::new(SimDevice::new(1 << 30), settings).unwrap();
        let registry = Arc::clone(&a.shared.registry);
        let b = a.clone();
        std::thread::spawn(move || {
            let p = b.malloc(4096, StreamId(0)).unwrap();
            b.free(p).unwrap();
        })
        .join()
        .unwrap();
        assert!(registry.has_retired());
        drop(a);
        assert!(registry.take_retired().is_empty());
    }
}

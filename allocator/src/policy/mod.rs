//! The policy core: PyTorch's caching-allocator rules on efficient structures.
//!
//! The one rule: `CachingCore` decides, the backend executes. It is `&mut self`, holds no locks,
//! names no CUDA type and has no `unsafe`; every rule below cites the numbered rule of
//! ARCHITECTURE.md it implements, and the reference model (`cachalot-model`) implements the
//! same rules independently. Free blocks live in one free set per pool ordered by
//! `(stream, size, address)` (`crate::free_set`: size classes and a bitmap), so best fit is a
//! couple of bit scans and a binary search, logarithmic at worst.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use rustc_hash::FxHashMap;

use crate::backend::{Backend, BackendError, EventId, StreamId};
use crate::block::{Backing, Block, BlockId, BlockPhase, FreeKey, Range, Slab, UnmappedKey};
use crate::error::{Error, OutOfMemory};
use crate::free_set::FreeSet;
use crate::history::{History, HistoryOptions, RecordedEvent, TraceAction, TraceEvent};
use crate::invariants::{CoreParts, InvariantViolation};
use crate::settings::Settings;
use crate::sizes::{MAX_ALLOC_SIZE, MIN_BLOCK_SIZE, Pool, SMALL_SIZE, round_size, segment_size};
use crate::stats::Stats;

pub(crate) mod adopt;
pub(crate) mod alias;

use alias::PageTable;
mod expandable;
mod release;
mod runtime;
pub(crate) mod views;

use views::Views;
#[cfg(test)]
mod tests;

/// One block of a segment, as [`CachingCore::segments`] reports it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct BlockInfo {
    /// The block's device address.
    pub address: u64,
    /// Its size in bytes.
    pub size: u64,
    /// The size the user asked for (0 for free blocks).
    pub requested: u64,
    /// Allocated, pending (waiting for other streams) or free.
    pub state: BlockPhase,
}

/// One device segment and its blocks, as [`CachingCore::segments`] reports it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct SegmentInfo {
    /// The segment's device address.
    pub address: u64,
    /// Its size in bytes.
    pub size: u64,
    /// The stream its blocks serve.
    pub stream: StreamId,
    /// The pool it belongs to.
    pub pool: Pool,
    /// Whether it is a run of mapped memory in an expandable segment's range (rule 19h)
    /// rather than one device allocation.
    pub expandable: bool,
    /// Its blocks in address order; they tile the segment exactly.
    pub blocks: Vec<BlockInfo>,
}

/// What rule 6's search found (rules 19a, 22d): the free-set key of a free block, or the
/// lent-set key of a lent block whose first slots are usable.
#[derive(Clone, Copy, Debug)]
enum Found {
    Free(FreeKey),
    Lent(FreeKey),
    /// A usable free stitched view, by its number (rule 23d).
    View(u64),
}

/// A request that found no cached block (rule 7), as the steps after it need it.
#[derive(Clone, Copy, Debug)]
struct Request {
    pool: Pool,
    stream: StreamId,
    /// Rule 4's segment size.
    alloc_size: u64,
    /// Rule 2's rounded size.
    rounded: u64,
    /// The size asked for.
    size: u64,
}

/// The caching allocator's policy over one device backend.
#[derive(Debug)]
pub struct CachingCore<B: Backend> {
    backend: B,
    settings: Settings,
    device: usize,
    blocks: Slab,
    /// Per pool: the free mapped blocks by `(stream, size, address)` (rule 6's best fit).
    free: [FreeSet; 2],
    /// Per pool: the unmapped blocks of ranges (rule 19).
    unmapped: [BTreeSet<UnmappedKey>; 2],
    /// Per pool: the lent blocks of ranges (rule 22a) by `(stream, size, address)`, for best
    /// fit (rule 22d).
    lent: [BTreeSet<FreeKey>; 2],
    /// Per pool: the same lent blocks by `(stream, address)`, for the growth's start (rule 22e).
    lent_at: [BTreeSet<UnmappedKey>; 2],
    /// The page table (rule 22a): present only while page aliasing acts.
    pages: Option<PageTable>,
    /// The stitched views and their indexes (rule 23): present only while page stitching
    /// acts.
    views: Option<Views>,
    /// The ranges of expandable segments, by first address (rule 19).
    ranges: BTreeMap<u64, Range>,
    /// Rule 19j: the handles of more than one page, by first address: their bytes. Every
    /// other mapped page of a range is a handle of its own.
    handles: BTreeMap<u64, u64>,
    live: FxHashMap<u64, BlockId>,
    events: BTreeMap<StreamId, VecDeque<(EventId, BlockId)>>,
    stats: Stats,
    /// Device bytes held (PyTorch's `total_allocated_memory`).
    reserved: u64,
    /// The memory-fraction cap on `reserved`, when a fraction is set.
    allowed_max: Option<u64>,
    /// Per pool: best-fit searches made while garbage collection is on (rule 6, rule 12).
    searches: [u64; 2],
    /// The recorded history (a ring), when recording is on.
    history: Option<History>,
    /// Rule 20's requested high-water `W`: the most the all-pools `requested_bytes` has ever
    /// been (not lowered by `reset_peak_stats`).
    requested_high_water: u64,
}

impl<B: Backend> CachingCore<B> {
    /// A caching allocator over `backend` with `settings`.
    ///
    /// Fails when the settings ask for what the backend cannot do (expandable segments on a
    /// backend without virtual memory), for the `cudaMallocAsync` backend, or when a memory
    /// fraction is set and the device cannot report its capacity.
    pub fn new(backend: B, settings: Settings) -> Result<Self, Error> {
        if settings.expandable_segments && !backend.virtual_memory() {
            return Err(Error::Unsupported {
                key: "expandable_segments",
                reason: "this backend has no virtual memory to grow segments with",
            });
        }
        if settings.backend != crate::settings::AllocatorBackend::Native {
            return Err(Error::Unsupported {
                key: "backend",
                reason: "cachalot is itself a native caching allocator; backend:cudaMallocAsync is not offered",
            });
        }
        if settings.page_stitching && settings.page_aliasing {
            return Err(Error::Unsupported {
                key: "page_stitching",
                reason: "stitched views (rule 23) cannot be on together with page aliasing (rule 22)",
            });
        }
        let fraction = settings.per_process_memory_fraction;
        let stitching = settings.page_stitching
            && settings.expandable_segments
            && settings.reclaim_headroom.is_some();
        let stitch_page = expandable::page_size(Pool::Large, settings.expandable_page_size);
        let aliasing = settings.page_aliasing
            && settings.expandable_segments
            && settings.reclaim_headroom.is_some();
        let mut core = CachingCore {
            backend,
            settings,
            device: 0,
            blocks: Slab::default(),
            free: [FreeSet::default(), FreeSet::default()],
            unmapped: [BTreeSet::new(), BTreeSet::new()],
            lent: [BTreeSet::new(), BTreeSet::new()],
            lent_at: [BTreeSet::new(), BTreeSet::new()],
            pages: aliasing.then(PageTable::default),
            views: stitching.then(|| Views::new(stitch_page)),
            ranges: BTreeMap::new(),
            handles: BTreeMap::new(),
            live: FxHashMap::default(),
            events: BTreeMap::new(),
            stats: Stats::default(),
            reserved: 0,
            allowed_max: None,
            searches: [0; 2],
            history: None,
            requested_high_water: 0,
        };
        if let Some(f) = fraction {
            core.set_memory_fraction(f)?;
        }
        Ok(core)
    }

    /// Sets the device index this core reports in its errors.
    pub fn with_device_index(mut self, device: usize) -> Self {
        self.device = device;
        self
    }

    /// The device index this core reports (0 unless set by [`CachingCore::with_device_index`]).
    pub fn device_index(&self) -> usize {
        self.device
    }

    /// The settings in force.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// The statistics.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// Sets every peak statistic to its current value.
    pub fn reset_peak_stats(&mut self) {
        self.stats.reset_peaks();
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The backend, mutably (the simulated device takes faults and stream completions here).
    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    /// Starts, resizes or stops recording the history of allocations, frees and segment
    /// changes, as PyTorch's `_record_memory_history(max_entries=...)` does: `Some(n)` keeps
    /// the last `n` entries in a ring (the oldest leave when it is full; `usize::MAX` keeps
    /// everything); `None` or `Some(0)` stops and drops what was recorded. Turned on again
    /// while recording, the entries so far stay. No backtraces; see
    /// [`CachingCore::record_history_with`].
    ///
    /// ```
    /// use cachalot::{CachingCore, Settings, SimDevice, StreamId};
    ///
    /// let mut core = CachingCore::new(SimDevice::new(1 << 30), Settings::pytorch()).unwrap();
    /// core.record_history(Some(3));
    /// let a = core.malloc(4096, StreamId(0)).unwrap(); // segment_alloc, alloc
    /// core.free(a).unwrap(); // free_requested, free_completed
    /// let kept: Vec<_> = core.history().iter().map(|e| e.action).collect();
    /// use cachalot::TraceAction::*;
    /// assert_eq!(kept, [Alloc, FreeRequested, FreeCompleted]); // the ring kept the last 3
    /// ```
    pub fn record_history(&mut self, max_entries: Option<usize>) {
        self.record_history_with(max_entries.filter(|&n| n > 0).map(HistoryOptions::new));
    }

    /// [`CachingCore::record_history`] with every option (backtraces): `None` stops and drops
    /// what was recorded.
    pub fn record_history_with(&mut self, options: Option<HistoryOptions>) {
        match (options, &mut self.history) {
            (None, _) => self.history = None,
            (Some(o), Some(h)) => h.set_options(o),
            (Some(o), None) => self.history = Some(History::new(o)),
        }
    }

    /// How the history is being recorded, or `None` when it is not.
    pub fn history_options(&self) -> Option<HistoryOptions> {
        self.history.as_ref().map(History::options)
    }

    /// The events recorded so far, oldest first (empty when recording is off).
    pub fn history(&self) -> Vec<TraceEvent> {
        self.history
            .iter()
            .flat_map(History::events)
            .map(|e| e.event)
            .collect()
    }

    /// The entries recorded so far with their times and backtraces, oldest first (empty when
    /// recording is off).
    pub fn recorded_history(&self) -> Vec<RecordedEvent> {
        self.history
            .iter()
            .flat_map(History::events)
            .cloned()
            .collect()
    }

    #[inline]
    fn trace(&mut self, action: TraceAction, address: u64, size: u64, stream: StreamId) {
        if let Some(h) = &mut self.history {
            record(
                h,
                TraceEvent {
                    action,
                    address,
                    size,
                    stream,
                },
            );
        }
    }

    /// Number of live (allocated) blocks.
    pub fn live_allocations(&self) -> usize {
        self.live.len()
    }

    /// Rule 16: caps reserved bytes at ⌊fraction × device capacity⌋.
    pub fn set_memory_fraction(&mut self, fraction: f64) -> Result<(), Error> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(Error::InvalidFraction { fraction });
        }
        let total = self.backend.mem_info()?.total;
        self.allowed_max = Some((fraction * total as f64) as u64);
        Ok(())
    }

    fn gc_enabled(&self) -> bool {
        self.allowed_max.is_some() && self.settings.garbage_collection_threshold > 0.0
    }

    /// Allocates `size` bytes for use on `stream` and returns the block's address (0 for a
    /// zero-size request, which touches nothing: rule 1).
    pub fn malloc(&mut self, size: u64, stream: StreamId) -> Result<u64, Error> {
        if size == 0 {
            return Ok(0);
        }
        if size > MAX_ALLOC_SIZE {
            return Err(Error::TooLarge { requested: size });
        }
        // Rule 5: blocks whose cross-stream events completed go back to their pools first.
        if !self.events.is_empty() {
            self.process_events()?;
        }
        let rounded = round_size(size, &self.settings.roundup_power2_divisions);
        let pool = Pool::for_size(rounded);
        let alloc_size = segment_size(rounded);

        let (id, rehomed) = match self.get_free_block(pool, stream, rounded)? {
            Some(found) => found,
            None => match self.allocate_when_uncached(pool, stream, alloc_size, rounded, size)? {
                Some(id) => (id, false),
                None => return Err(self.out_of_memory(size, rounded, alloc_size, stream)),
            },
        };
        let address = self.hand_out(id, rounded, size);
        if rehomed {
            // Rule 22d: the remainder of a re-homed lent candidate merges with the block after.
            self.merge_remainder(id);
        }
        Ok(address)
    }

    /// Rule 7: garbage collection, a new segment, oversize release, full release and retry.
    /// Out of line and cold: a loop whose allocations repeat never comes here in its steady
    /// state, and its code would crowd the instruction cache of the path that does.
    #[cold]
    #[inline(never)]
    fn allocate_when_uncached(
        &mut self,
        pool: Pool,
        stream: StreamId,
        alloc_size: u64,
        rounded: u64,
        size: u64,
    ) -> Result<Option<BlockId>, Error> {
        if self.gc_enabled() {
            self.garbage_collect()?;
        }
        let request = Request {
            pool,
            stream,
            alloc_size,
            rounded,
            size,
        };
        if let Some(id) = self.new_memory(request, false)? {
            return Ok(Some(id));
        }
        if self.release_oversize(pool, stream, rounded)?
            && let Some(id) = self.new_memory(request, false)?
        {
            return Ok(Some(id));
        }
        self.release_cached()?;
        self.new_memory(request, true)
    }

    /// Rule 8, or rule 19b under expandable segments: a free block of at least `rounded`
    /// bytes, out of the free set, or `None` on out-of-memory. Both count the retry (rule 7d)
    /// and check the memory fraction with rule 4's segment size `alloc_size` first (PyTorch
    /// checks that size under expandable segments too).
    fn new_memory(&mut self, request: Request, is_retry: bool) -> Result<Option<BlockId>, Error> {
        let Request {
            pool,
            stream,
            alloc_size,
            rounded,
            size,
        } = request;
        if is_retry {
            self.stats.num_alloc_retries += 1;
        }
        if let Some(allowed) = self.allowed_max
            && self.reserved.saturating_add(alloc_size) > allowed
        {
            return Ok(None);
        }
        if self.settings.expandable_segments {
            if let Some(headroom) = self.aliasing() {
                // Rule 22f: borrowing replaces rule 20's unmapping, against rule 20's limit.
                let limit = self.reclaim_limit(size, headroom);
                return self.grow(pool, stream, rounded, Some(limit));
            }
            if let Some(headroom) = self.settings.reclaim_headroom {
                // Rule 23f: over the limit, a large request is served from a new view first.
                if pool == Pool::Large
                    && self.views.is_some()
                    && let Some(id) = self.stitch(stream, rounded, size, headroom)?
                {
                    return Ok(Some(id));
                }
                self.reclaim(pool, stream, rounded, size, headroom)?;
            }
            self.grow(pool, stream, rounded, None)
        } else {
            self.alloc_segment(pool, stream, alloc_size)
        }
    }

    #[cold]
    #[inline(never)]
    fn out_of_memory(
        &mut self,
        requested: u64,
        rounded: u64,
        alloc_size: u64,
        stream: StreamId,
    ) -> Error {
        let info = match self.backend.mem_info() {
            Ok(info) => info,
            Err(e) => return Error::Backend(e),
        };
        self.trace(TraceAction::Oom, info.free, rounded, stream);
        self.stats.num_ooms += 1;
        let allocated = self.stats.allocated_bytes.all.current as u64;
        Error::OutOfMemory(Box::new(OutOfMemory {
            device: self.device,
            requested,
            alloc_size,
            capacity: info.total,
            device_free: info.free,
            allowed: self.allowed_max,
            allocated,
            reserved_unallocated: self.reserved - allocated,
        }))
    }

    /// Whether a request of `size` bytes on `stream` would be served from the cache: rule 5
    /// runs (completed events return their blocks), then rule 6's search is asked, without
    /// counting it as a search and without taking the block. Rule 17a asks this before a
    /// thread-cache miss may grow the device. `size` must be in `1..=MAX_ALLOC_SIZE`.
    pub fn has_cached_block(&mut self, size: u64, stream: StreamId) -> Result<bool, Error> {
        if !self.events.is_empty() {
            self.process_events()?;
        }
        let rounded = round_size(size, &self.settings.roundup_power2_divisions);
        Ok(self
            .find_free_block(Pool::for_size(rounded), stream, rounded)
            .is_some())
    }

    /// Rule 17a's question and the request in one search: when a request of `size` bytes on
    /// `stream` would be served from the cache (rule 5, then rule 6's search, views included),
    /// it is made (rules 5–14: the search counted, the block handed out) and its address
    /// returned; otherwise nothing but rule 5 has happened (the search is not counted) and the
    /// answer is `None`. The same outcome as [`CachingCore::has_cached_block`] followed by
    /// [`CachingCore::malloc`] when it is `true`, at the price of one search. `size` must be in
    /// `1..=MAX_ALLOC_SIZE`.
    pub fn malloc_if_cached(&mut self, size: u64, stream: StreamId) -> Result<Option<u64>, Error> {
        if !self.events.is_empty() {
            self.process_events()?;
        }
        let rounded = round_size(size, &self.settings.roundup_power2_divisions);
        let pool = Pool::for_size(rounded);
        let Some(found) = self.find_free_block(pool, stream, rounded) else {
            return Ok(None);
        };
        if self.gc_enabled() {
            self.searches[pool.index()] += 1;
        }
        let (id, rehomed) = self.take_found(pool, rounded, found)?;
        let address = self.hand_out(id, rounded, size);
        if rehomed {
            self.merge_remainder(id);
        }
        Ok(Some(address))
    }

    /// Rule 6: the smallest `(size, address)` free block of the stream that fits, unless the
    /// oversize rules forbid it, out of the free set — or, under rule 22d, a lent block's
    /// first slots re-homed into a free block (then `true`). In no set.
    fn get_free_block(
        &mut self,
        pool: Pool,
        stream: StreamId,
        rounded: u64,
    ) -> Result<Option<(BlockId, bool)>, Error> {
        if self.gc_enabled() {
            self.searches[pool.index()] += 1;
        }
        let Some(found) = self.find_free_block(pool, stream, rounded) else {
            return Ok(None);
        };
        self.take_found(pool, rounded, found).map(Some)
    }

    /// Takes what rule 6's search found out of its set: the block to hand out, and whether it
    /// is a re-homed lent block (rule 22d).
    /// A view's hand-out first makes its stream wait for its foreign streams (rule 23k); a
    /// failing wait is returned before anything is taken.
    fn take_found(
        &mut self,
        pool: Pool,
        rounded: u64,
        found: Found,
    ) -> Result<(BlockId, bool), Error> {
        let p = pool.index();
        Ok(match found {
            Found::Free(key) => {
                self.free_remove(p, &key);
                (key.3, false)
            }
            Found::Lent(key) => {
                let k = rounded.div_ceil(self.page_of(pool));
                (self.rehome(key.3, k), true)
            }
            Found::View(seq) => {
                self.wait_for_foreign(seq, false)?;
                (self.take_view(seq, rounded), false)
            }
        })
    }

    /// Rule 6's search (with rule 19a's walk by reach, rule 22d's lent candidates and, when
    /// that finds nothing for a large-pool request, rule 23d's stitched views): the block to
    /// hand out, or `None`. Changes nothing.
    fn find_free_block(&self, pool: Pool, stream: StreamId, rounded: u64) -> Option<Found> {
        let found = self.find_cached_block(pool, stream, rounded);
        if found.is_none() && pool == Pool::Large && self.views.is_some() {
            return self.find_view(stream, rounded).map(Found::View);
        }
        found
    }

    /// Rule 6's search (with rule 19a's walk by reach and rule 22d's lent candidates),
    /// oversize checks included. Changes nothing.
    fn find_cached_block(&self, pool: Pool, stream: StreamId, rounded: u64) -> Option<Found> {
        let free = self.free_candidate(pool, stream, rounded);
        let found = if self.pages.is_some() {
            // Rule 22d: a lent block smaller by (size, address) than rule 19a's candidate wins.
            match (free, self.lent_candidate(pool, stream, rounded, free)) {
                (Some(f), Some(l)) if (l.1, l.2) < (f.1, f.2) => Found::Lent(l),
                (None, Some(l)) => Found::Lent(l),
                (Some(f), _) => Found::Free(f),
                (None, None) => return None,
            }
        } else {
            Found::Free(free?)
        };
        let size = match found {
            Found::Free(k) | Found::Lent(k) => k.1,
            Found::View(_) => return Some(found),
        };
        let max_split = self.settings.max_split_size;
        if rounded < max_split && size >= max_split {
            return None;
        }
        if rounded >= max_split
            && size >= rounded.saturating_add(self.settings.max_non_split_rounding_size)
        {
            return None;
        }
        Some(found)
    }

    /// Rule 6's candidate (with rule 19a's walk by reach), before the oversize checks.
    fn free_candidate(&self, pool: Pool, stream: StreamId, rounded: u64) -> Option<FreeKey> {
        let p = pool.index();
        let mut candidates = self.free[p].at_least(stream, rounded);
        let mut key = candidates.next()?;
        // Rule 19a: among blocks of ranges, walk on while the next fit reaches less far.
        if self.blocks.get(key.3).range.is_some() {
            let mut reach = self.reach(key.3);
            for next in candidates {
                if self.blocks.get(key.3).range.is_none() {
                    break;
                }
                // A block reaches at least its own size, which its key tells: the usual end of
                // the walk reads no other block.
                if next.1 >= reach {
                    break;
                }
                let r = self.reach(next.3);
                if r >= reach {
                    break;
                }
                key = next;
                reach = r;
            }
        }
        Some(key)
    }

    /// Rule 8: a new segment as one block (not in the free set), or `None` on out-of-memory.
    fn alloc_segment(
        &mut self,
        pool: Pool,
        stream: StreamId,
        size: u64,
    ) -> Result<Option<BlockId>, Error> {
        let address = match self.backend.allocate(size) {
            Ok(a) => a,
            Err(BackendError::OutOfMemory) => return Ok(None),
            Err(e) => return Err(Error::Backend(e)),
        };
        self.reserved += size;
        self.stats.segment.increase(pool, 1);
        self.stats.reserved_bytes.increase(pool, size);
        if size >= self.settings.max_split_size {
            self.stats.oversize_segments.increase(1);
        }
        self.stats.num_device_alloc += 1;
        self.trace(TraceAction::SegmentAlloc, address, size, stream);
        let id = self.blocks.insert(Block::free(
            address,
            size,
            stream,
            pool,
            self.searches[pool.index()],
            None,
        ));
        Ok(Some(id))
    }

    /// Rules 13 and 14: split the found block if worthwhile and hand out its lower part.
    fn hand_out(&mut self, id: BlockId, rounded: u64, requested: u64) -> u64 {
        let max_split = self.settings.max_split_size;
        let gc_base;
        let (pool, already_split, remaining, stream, address, next) = {
            let b = self.blocks.get(id);
            gc_base = self.searches[b.pool.index()];
            (
                b.pool,
                b.is_split(),
                b.size - rounded,
                b.stream,
                b.address,
                b.next,
            )
        };
        let in_range = self.blocks.get(id).range;
        let split = match pool {
            // Rule 19c: under expandable segments every pool splits like the small one.
            _ if self.settings.expandable_segments => remaining >= MIN_BLOCK_SIZE,
            Pool::Small => remaining >= MIN_BLOCK_SIZE,
            Pool::Large => rounded < max_split && remaining > SMALL_SIZE,
        };
        if split {
            let rest = self.blocks.insert(Block {
                prev: Some(id),
                next,
                ..Block::free(
                    address + rounded,
                    remaining,
                    stream,
                    pool,
                    gc_base,
                    in_range,
                )
            });
            if let Some(n) = next {
                self.blocks.get_mut(n).prev = Some(rest);
            }
            let b = self.blocks.get_mut(id);
            b.next = Some(rest);
            b.size = rounded;
            self.free_insert(pool.index(), (stream, remaining, address + rounded, rest));
            if in_range.is_some() {
                // Rule 19d: blocks of ranges never count as inactive split.
            } else if already_split {
                // An inactive split block shrinks by the part handed out.
                self.stats.inactive_split_bytes.decrease(pool, rounded);
            } else {
                // A whole segment becomes split: its remainder is a new inactive split block.
                self.stats.inactive_split_bytes.increase(pool, remaining);
                self.stats.inactive_split.increase(pool, 1);
            }
        } else if already_split && in_range.is_none() {
            let size = self.blocks.get(id).size;
            self.stats.inactive_split_bytes.decrease(pool, size);
            self.stats.inactive_split.decrease(pool, 1);
        }
        let b = self.blocks.get_mut(id);
        b.state = BlockPhase::Allocated;
        b.requested = requested;
        let size = b.size;
        // Rule 22b: the pages under the block are busy from now until it returns to the pool.
        self.track_busy(in_range, address, size, 1);
        self.live.insert(address, id);
        self.trace(TraceAction::Alloc, address, requested, stream);
        let s = &mut self.stats;
        s.allocation.increase(pool, 1);
        s.allocated_bytes.increase(pool, size);
        s.active.increase(pool, 1);
        s.active_bytes.increase(pool, size);
        s.requested_bytes.increase(pool, requested);
        self.requested_high_water = self
            .requested_high_water
            .max(s.requested_bytes.all.current.max(0) as u64);
        if size >= max_split {
            s.oversize_allocations.increase(1);
        }
        address
    }

    /// Rule 15: the user frees the block at `address`. Address 0 is a no-op; an address that
    /// is not a live allocation is an error and changes nothing.
    pub fn free(&mut self, address: u64) -> Result<(), Error> {
        if address == 0 {
            return Ok(());
        }
        let Some(id) = self.live.remove(&address) else {
            return Err(Error::UnknownPointer { address });
        };
        let b = self.blocks.get(id);
        let recorded = if b.backing != Backing::View && b.stream_uses.is_empty() {
            Vec::new()
        } else {
            match self.record_uses(id) {
                Ok(recorded) => recorded,
                Err(e) => {
                    // Nothing changed: the block stays live.
                    self.live.insert(address, id);
                    return Err(e);
                }
            }
        };
        let (pool, size, requested, stream) = {
            let b = self.blocks.get(id);
            (b.pool, b.size, b.requested, b.stream)
        };
        self.trace(TraceAction::FreeRequested, address, requested, stream);
        self.stats.allocation.decrease(pool, 1);
        self.stats.allocated_bytes.decrease(pool, size);
        if size >= self.settings.max_split_size {
            self.stats.oversize_allocations.decrease(1);
        }
        if recorded.is_empty() {
            self.return_to_pool(id);
        } else {
            let b = self.blocks.get_mut(id);
            b.state = BlockPhase::Pending;
            b.event_count = recorded.len() as u32;
            for (s, e) in recorded {
                self.events.entry(s).or_default().push_back((e, id));
            }
        }
        Ok(())
    }

    /// Rules 15 and 23k, before a free: a view holding pieces of other streams' ranges orders
    /// those streams after its own's work, then an event is recorded on every other stream the
    /// block was used on. On a failure nothing has changed (the events recorded so far are
    /// destroyed, the block keeps its uses).
    fn record_uses(&mut self, id: BlockId) -> Result<Vec<(StreamId, EventId)>, Error> {
        if self.blocks.get(id).backing == Backing::View
            && let Some(seq) = self.view_of_allocation(id)
        {
            self.wait_for_foreign(seq, true)?;
        }
        let mut uses = std::mem::take(&mut self.blocks.get_mut(id).stream_uses);
        uses.sort_unstable();
        uses.dedup();
        let mut recorded = Vec::with_capacity(uses.len());
        for &s in &uses {
            match self.backend.record_event(s) {
                Ok(e) => recorded.push((s, e)),
                Err(err) => {
                    for (_, e) in recorded {
                        self.backend.destroy_event(e);
                    }
                    self.blocks.get_mut(id).stream_uses = uses;
                    return Err(Error::Backend(err));
                }
            }
        }
        Ok(recorded)
    }

    /// Marks the allocated block at `address` as used on `stream`: when freed, it is not reused
    /// until the work queued on `stream` by then has completed. Address 0 (a zero-size
    /// allocation's) is a no-op, as PyTorch's `recordStream` of a null pointer; an address that
    /// is not a live allocation is an error and changes nothing (rule 15).
    pub fn record_stream(&mut self, address: u64, stream: StreamId) -> Result<(), Error> {
        if address == 0 {
            return Ok(());
        }
        let Some(&id) = self.live.get(&address) else {
            return Err(Error::UnknownPointer { address });
        };
        let b = self.blocks.get_mut(id);
        if b.stream != stream && !b.stream_uses.contains(&stream) {
            b.stream_uses.push(stream);
        }
        Ok(())
    }

    /// Rule 10: merge with free neighbours and enter the free set.
    fn return_to_pool(&mut self, id: BlockId) {
        if self.views.is_some() && self.blocks.get(id).backing == Backing::View {
            return self.return_view(id);
        }
        let (pool, original_size, requested, prev, next) = {
            let b = self.blocks.get(id);
            (b.pool, b.size, b.requested, b.prev, b.next)
        };
        if self.pages.is_some() {
            let b = self.blocks.get(id);
            self.track_busy(b.range, b.address, b.size, -1);
        }
        if self.history.is_some() {
            let b = self.blocks.get(id);
            let (address, stream) = (b.address, b.stream);
            self.trace(TraceAction::FreeCompleted, address, requested, stream);
        }
        let p = pool.index();
        let (mut net_blocks, mut net_bytes) =
            self.absorb_neighbours(id, prev, next, Backing::Mapped);
        let gc_base = self.searches[p];
        let b = self.blocks.get_mut(id);
        b.state = BlockPhase::Free;
        b.requested = 0;
        b.event_count = 0;
        b.stream_uses.clear();
        b.gc_base = gc_base;
        if b.is_split() {
            net_blocks += 1;
            net_bytes += b.size as i64;
        }
        let in_range = b.range.is_some();
        let key = (b.stream, b.size, b.address, id);
        self.free_insert(p, key);
        let s = &mut self.stats;
        // Rule 19d: blocks of ranges never count as inactive split.
        if !in_range {
            apply_net(&mut s.inactive_split, pool, net_blocks);
            apply_net(&mut s.inactive_split_bytes, pool, net_bytes);
        }
        s.active.decrease(pool, 1);
        s.active_bytes.decrease(pool, original_size);
        s.requested_bytes.decrease(pool, requested);
    }

    /// Rules 10, 19 and 22: block `id` (whose neighbours were `prev` and `next`) takes in each
    /// neighbour that is free and backed like it (`kind`: mapped, unmapped or lent); the
    /// neighbours leave their free, unmapped or lent sets. Returns the change in free split
    /// blocks and bytes this made (each neighbour taken in was one), for the inactive-split
    /// statistics.
    fn absorb_neighbours(
        &mut self,
        id: BlockId,
        prev: Option<BlockId>,
        next: Option<BlockId>,
        kind: Backing,
    ) -> (i64, i64) {
        let mut net_blocks: i64 = 0;
        let mut net_bytes: i64 = 0;
        let mergeable = |core: &Self, n: BlockId| {
            let b = core.blocks.get(n);
            b.state == BlockPhase::Free && b.backing == kind
        };
        if let Some(pid) = prev.filter(|&n| mergeable(self, n)) {
            let src = self.blocks.remove(pid);
            self.forget_free(&src, pid);
            let b = self.blocks.get_mut(id);
            b.address = src.address;
            b.size += src.size;
            b.prev = src.prev;
            if let Some(pp) = src.prev {
                self.blocks.get_mut(pp).next = Some(id);
            }
            net_blocks -= 1;
            net_bytes -= src.size as i64;
        }
        if let Some(nid) = next.filter(|&n| mergeable(self, n)) {
            let src = self.blocks.remove(nid);
            self.forget_free(&src, nid);
            let b = self.blocks.get_mut(id);
            b.size += src.size;
            b.next = src.next;
            if let Some(nn) = src.next {
                self.blocks.get_mut(nn).prev = Some(id);
            }
            net_blocks -= 1;
            net_bytes -= src.size as i64;
        }
        (net_blocks, net_bytes)
    }

    /// Takes the free block `b` (slab id `id`) out of its free, unmapped or lent sets.
    fn forget_free(&mut self, b: &Block, id: BlockId) {
        let p = b.pool.index();
        match b.backing {
            Backing::Mapped => self.free_remove(p, &(b.stream, b.size, b.address, id)),
            Backing::Unmapped => {
                self.unmapped[p].remove(&(b.stream, b.address, id));
            }
            Backing::Lent => self.unindex_lent(b, id),
            // A view's allocation has no neighbours (rule 23d): never taken in.
            Backing::View => {}
        }
    }

    /// Rule 5: return the blocks whose events have all completed.
    fn process_events(&mut self) -> Result<(), Error> {
        let streams: Vec<StreamId> = self.events.keys().copied().collect();
        for stream in streams {
            while let Some(&(event, id)) = self.events.get(&stream).and_then(|q| q.front()) {
                if !self.backend.query_event(event)? {
                    break;
                }
                self.retire_event(stream, event, id);
            }
        }
        Ok(())
    }

    fn retire_event(&mut self, stream: StreamId, event: EventId, id: BlockId) {
        if let Some(q) = self.events.get_mut(&stream) {
            q.pop_front();
            if q.is_empty() {
                self.events.remove(&stream);
            }
        }
        self.backend.destroy_event(event);
        let b = self.blocks.get_mut(id);
        b.event_count -= 1;
        if b.event_count == 0 {
            self.return_to_pool(id);
        }
    }

    /// The segments and their blocks, by address.
    pub fn segments(&self) -> Vec<SegmentInfo> {
        // A segment starts at a block with no mapped block before it: the head of a segment,
        // or of a run of mapped blocks in a range (rule 19h).
        // A lent block (rule 22a) ends a run like an unmapped one.
        let starts_run =
            |b: &Block| b.mapped() && b.prev.is_none_or(|p| !self.blocks.get(p).mapped());
        let mut out: Vec<SegmentInfo> = self
            .blocks
            .iter()
            .filter(|(_, b)| starts_run(b))
            .map(|(head, b)| {
                let mut blocks = Vec::new();
                let mut cur = Some(head);
                while let Some(id) = cur {
                    let x = self.blocks.get(id);
                    if !x.mapped() {
                        break;
                    }
                    blocks.push(BlockInfo {
                        address: x.address,
                        size: x.size,
                        requested: x.requested,
                        state: x.state,
                    });
                    cur = x.next;
                }
                SegmentInfo {
                    address: b.address,
                    size: blocks.iter().map(|x| x.size).sum(),
                    stream: b.stream,
                    pool: b.pool,
                    expandable: b.range.is_some(),
                    blocks,
                }
            })
            .collect();
        out.sort_by_key(|s| s.address);
        out
    }

    /// Checks every invariant of the state; an `Err` is the first one found broken.
    ///
    /// Blocks tile each segment exactly; free-set membership matches the free state; no two
    /// free neighbours are left unmerged; live blocks are 512-aligned and do not overlap;
    /// pending blocks have as many queued events as they wait for; and every statistic's
    /// current value equals its value recomputed from the blocks.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        crate::invariants::check(CoreParts {
            blocks: &self.blocks,
            free: &self.free,
            unmapped: &self.unmapped,
            lent: &self.lent,
            lent_at: &self.lent_at,
            pages: self.pages.as_ref(),
            views: self.views.as_ref(),
            ranges: &self.ranges,
            live: &self.live,
            events: &self.events,
            stats: &self.stats,
            reserved: self.reserved,
            max_split: self.settings.max_split_size,
        })
    }
}

fn apply_net(stat: &mut crate::stats::StatArray, pool: Pool, net: i64) {
    if net > 0 {
        stat.increase(pool, net as u64);
    } else if net < 0 {
        stat.decrease(pool, net.unsigned_abs());
    }
}

/// Records one event of the history (`record_history`): out of line, so that the
/// operations that call [`CachingCore::trace`] on every allocation and free keep only the
/// check for a recording in their code (recording reads the clock and may take a backtrace).
#[cold]
#[inline(never)]
fn record(history: &mut History, event: TraceEvent) {
    history.push(event);
}

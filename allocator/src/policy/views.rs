//! Stitched views (rule 23): pages kept at their homes and mapped a second time, into a view
//! made once for one large request and kept for the next time the same request comes.
//!
//! The one rule: a view never moves a page. Its slot `i` maps the page of the home slot
//! `h_i` of a range — of its stream or, by rule 23k, of another (its *foreign* streams, kept
//! with the view: its hand-out makes its stream wait for them and its free makes them wait
//! for its stream, [`Backend::wait_stream`]) — for the view's whole life; while the view is in use its
//! allocation's bytes are *held* at the homes — blocks of the ranges in state
//! [`BlockPhase::Held`], in no free set — so no physical byte lies under two live blocks.
//!
//! The structures, all in [`Views`] and present only while the rule acts (page stitching with
//! expandable segments and a reclaim headroom):
//!
//! * the views by creation number (`BTreeMap`), each with its homes and, in use, its
//!   allocation's block and its held pieces;
//! * the free views by `(stream, page count, number)`: the hand-out (rule 23d) is a range
//!   lookup, then a usability check of each candidate's pieces (one per run of consecutive
//!   homes, kept with the view), each an address lookup in the free blocks' address index:
//!   O(runs × log blocks) per view looked at;
//! * the home slots by `(slot, number)`: destroying the views that map a slot about to be
//!   unmapped (rule 23h) is a range query, not a scan of every view;
//! * the free views by `(last hand-out, number)` for the cap's least-recently-used eviction
//!   (rule 23g); the in-use views by their allocation's block, for the return (rule 23e);
//! * the free mapped blocks that hold a view's home (the only ones a piece can lie in) by
//!   their *end* address (`free_at`, a sorted vector: [`EndIndex`]), kept beside the free
//!   sets (every insert and removal goes through [`CachingCore::free_insert`] and
//!   [`CachingCore::free_remove`]), so whether a piece lies wholly inside one free block is
//!   one lookup. Keyed by the end, the two changes
//!   every steady pass makes most — a free block split for a request (its rest keeps its end)
//!   and a freed block merged with the free block after it (which takes that block's end) —
//!   replace one entry's value instead of removing a key and inserting another: a removal is
//!   *deferred* ([`Views::deferred`]) until the next removal, and an insert at the deferred
//!   end takes the entry over in place.
//!
//! A view's allocation is a block of the slab with [`Backing::View`]: no neighbours, in no
//! segment; it is a live allocation like any other (the live map, `record_stream`, events,
//! thread caches), and its return (rule 10) returns the held pieces.

use std::collections::{BTreeMap, BTreeSet};

use rustc_hash::FxHashMap;

use crate::backend::{Backend, BackendError, StreamId};
use crate::block::{Backing, Block, BlockId, BlockPhase, FreeKey};
use crate::error::Error;
use crate::history::TraceAction;
use crate::sizes::Pool;

use super::CachingCore;

/// One stitched view (rule 23a).
#[derive(Clone, Debug)]
pub(crate) struct View {
    /// Its reservation's first address (the allocation's address while in use).
    pub address: u64,
    /// The stream it serves.
    pub stream: StreamId,
    /// Per slot, in order: the range (first address) and home slot of the page it maps.
    pub homes: Vec<(u64, u64)>,
    /// The maximal runs of slots whose homes are consecutive in one range, in slot order:
    /// each run's first home and its number of slots (rule 23b: one held piece per run).
    pub runs: Vec<(u64, u64)>,
    /// Rule 23k: its foreign streams — those other than its own of the ranges its homes lie
    /// in — ascending, each once (fixed, as its homes are).
    pub foreign: Vec<StreamId>,
    /// When it was last handed out (or made): the cap's eviction order (rule 23g).
    pub stamp: u64,
    /// While in use: the allocation's block and the held pieces, in slot order.
    pub in_use: Option<InUse>,
}

/// What a view in use holds (rule 23b).
#[derive(Clone, Debug)]
pub(crate) struct InUse {
    /// The allocation's block ([`Backing::View`]).
    pub allocation: BlockId,
    /// The held pieces ([`BlockPhase::Held`]), one per run of the view, in slot order.
    pub pieces: Vec<BlockId>,
}

/// The home slots of one range (rule 23a): by slot number, `(slot − range start) / P`.
#[derive(Clone, Debug, Default)]
pub(crate) struct RangeHomes {
    /// How many views map each slot.
    pub counts: Vec<u32>,
    /// A bit per slot, set while its count is not zero.
    pub bits: Vec<u64>,
    /// The sum of the counts.
    pub total: u64,
}

impl RangeHomes {
    /// One more view maps slot `i`.
    fn add(&mut self, i: usize) {
        if i >= self.counts.len() {
            self.counts.resize(i + 1, 0);
            self.bits.resize(i / 64 + 1, 0);
        }
        self.counts[i] += 1;
        self.total += 1;
        self.bits[i / 64] |= 1 << (i % 64);
    }

    /// One view fewer maps slot `i` (which one maps).
    fn remove(&mut self, i: usize) {
        debug_assert!(
            self.counts.get(i).is_some_and(|&c| c > 0),
            "every home is listed"
        );
        self.counts[i] -= 1;
        self.total -= 1;
        if self.counts[i] == 0 {
            self.bits[i / 64] &= !(1 << (i % 64));
        }
    }

    /// Whether any of the slots `first..end` is mapped by a view.
    fn any(&self, first: usize, end: usize) -> bool {
        let end = end.min(self.counts.len());
        if first >= end {
            return false;
        }
        let (w0, w1) = (first / 64, (end - 1) / 64);
        (w0..=w1).any(|w| {
            let mut word = self.bits[w];
            if w == w0 {
                word &= u64::MAX << (first % 64);
            }
            if w == w1 && !end.is_multiple_of(64) {
                word &= u64::MAX >> (64 - end % 64);
            }
            word != 0
        })
    }

    /// Whether no slot is mapped by any view.
    pub fn is_empty(&self) -> bool {
        self.total == 0
    }
}

/// Rule 23's address index: `(end, block)` of the free blocks that hold a home, sorted by
/// end (ends are distinct: free blocks are disjoint). A sorted vector, not a B-tree: it holds a
/// handful of entries (measured over the benchmark's traces, 2-6 on average, 70 at most on
/// synthetic_many_sizes, 2026-12-07), and every insert into a free set that holds a home
/// writes it, so a binary search and a short move beat a B-tree's node walk and its
/// allocations (results/steady-gap-2026-12-06/ put the map's upkeep at about a tenth of the
/// default policy's steady cost on the programs that make many views).
#[derive(Clone, Debug, Default)]
pub(crate) struct EndIndex {
    entries: Vec<(u64, BlockId)>,
}

impl EndIndex {
    /// Where `end` is, or would go.
    #[inline]
    fn position(&self, end: u64) -> Result<usize, usize> {
        self.entries.binary_search_by_key(&end, |&(e, _)| e)
    }

    /// Block `id` ends at `end`; an entry at `end` takes the new block.
    #[inline]
    pub fn insert(&mut self, end: u64, id: BlockId) {
        match self.position(end) {
            Ok(i) => self.entries[i].1 = id,
            Err(i) => self.entries.insert(i, (end, id)),
        }
    }

    /// Removes the entry at `end` if it names block `id` (it may have been taken over since).
    #[inline]
    pub fn remove_if(&mut self, end: u64, id: BlockId) {
        if let Ok(i) = self.position(end)
            && self.entries[i].1 == id
        {
            self.entries.remove(i);
        }
    }

    /// The block of the entry at `end`.
    pub fn get(&self, end: u64) -> Option<BlockId> {
        self.position(end).ok().map(|i| self.entries[i].1)
    }

    /// The entries ending at or after `end`, in order.
    #[inline]
    pub fn from(&self, end: u64) -> impl Iterator<Item = (u64, BlockId)> + '_ {
        let i = self.entries.partition_point(|&(e, _)| e < end);
        self.entries[i..].iter().copied()
    }
}

/// Every view, and the indexes of rule 23 (the module's documentation says which and why).
#[derive(Clone, Debug, Default)]
pub(crate) struct Views {
    /// The large pool's page `P`.
    pub page: u64,
    /// By creation number.
    pub views: BTreeMap<u64, View>,
    /// The free views by `(stream, page count, number)`.
    pub free_by_size: BTreeSet<(StreamId, u64, u64)>,
    /// Every view's home slots: `(slot, number)`.
    pub by_home: BTreeSet<(u64, u64)>,
    /// The same homes by range (its first address): per page slot of the range, how many
    /// views map it, and a bit per slot set while any does. The hot question of
    /// [`CachingCore::free_insert`] (does a free block hold a home?) is a scan of the block's
    /// slots' bits, 64 at a time. Changed only when a view is made or destroyed.
    pub home_slots: FxHashMap<u64, RangeHomes>,
    /// The free views by `(stamp, number)`: least recently handed out first.
    pub lru: BTreeSet<(u64, u64)>,
    /// The views in use by their allocation's block.
    pub by_allocation: FxHashMap<BlockId, u64>,
    /// The free mapped blocks (of the free sets) that hold a home, by end address (one past
    /// their last byte; free blocks are disjoint, so the first entry at or after a piece's end
    /// names the only free block that can hold it). One entry may be stale: [`Views::deferred`].
    pub free_at: EndIndex,
    /// A removal from `free_at` not yet made: `(end, block)` of a block that left the free set.
    /// The next removal makes it first; an insert at the same end replaces its value in place.
    /// Lookups and the invariant checker skip this one entry while it is deferred.
    pub deferred: Option<(u64, BlockId)>,
    /// By block id: whether the block is in `free_at` (so that removing a block that holds no
    /// home asks nothing of the map).
    pub indexed: Vec<bool>,
    /// Address space all views hold: the sum of their `n × P`.
    pub bytes: u64,
    /// The cap (rule 23g) when the last view was made: `2 × capacity` then.
    pub cap: u64,
    next: u64,
    clock: u64,
}

impl Views {
    /// No views yet, for a large pool whose page is `page`.
    pub fn new(page: u64) -> Views {
        Views {
            page,
            ..Views::default()
        }
    }

    /// The number of the first slot at or after `offset` bytes into a range: `⌈offset / P⌉`
    /// (a shift when `P` is a power of two, as it is unless set otherwise); a home's own slot
    /// number, since homes start their slots.
    #[inline]
    fn slots_from(&self, offset: u64) -> usize {
        (if self.page.is_power_of_two() {
            (offset + self.page - 1) >> self.page.trailing_zeros()
        } else {
            offset.div_ceil(self.page)
        }) as usize
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Whether block `id` is in the address index.
    #[inline]
    fn is_indexed(&self, id: BlockId) -> bool {
        self.indexed.get(id as usize).copied().unwrap_or(false)
    }

    #[inline]
    fn set_indexed(&mut self, id: BlockId, on: bool) {
        let i = id as usize;
        if i >= self.indexed.len() {
            if !on {
                return;
            }
            self.indexed.resize(i + 1, false);
        }
        self.indexed[i] = on;
    }

    /// The free block `id`, ending at `end`, enters the address index: in place of the
    /// deferred entry when that one ends there too (the rest of a split, a merge with the block
    /// after), else as a new key.
    #[inline]
    pub(super) fn index(&mut self, end: u64, id: BlockId) {
        if matches!(self.deferred, Some((e, _)) if e == end) {
            // The deferred entry is still in the map: its value becomes this block (an insert
            // at a present key replaces the value, no node changes).
            self.deferred = None;
        }
        self.free_at.insert(end, id);
        self.set_indexed(id, true);
    }

    /// The free block `id`, ending at `end`, leaves the address index: its removal is
    /// deferred, and the one deferred before is made.
    #[inline]
    pub(super) fn unindex(&mut self, end: u64, id: BlockId) {
        if !self.is_indexed(id) {
            return;
        }
        self.set_indexed(id, false);
        self.flush_deferred();
        self.deferred = Some((end, id));
    }

    /// Makes the deferred removal, if any (its entry may have been taken over since).
    fn flush_deferred(&mut self) {
        if let Some((end, id)) = self.deferred.take() {
            self.free_at.remove_if(end, id);
        }
    }

    /// The address index's live entries: every entry but a deferred removal's.
    pub(crate) fn indexed_blocks(&self) -> impl Iterator<Item = (u64, BlockId)> + '_ {
        self.free_at
            .from(0)
            .filter(move |&e| Some(e) != self.deferred)
    }
}

impl<B: Backend> CachingCore<B> {
    /// A free mapped block enters its pool's free set (and, while views act, the address
    /// index when it can hold a view's piece).
    #[inline]
    pub(super) fn free_insert(&mut self, p: usize, key: FreeKey) {
        self.free[p].insert(key);
        if self.holds_a_home(&key)
            && let Some(v) = &mut self.views
        {
            v.index(key.2 + key.1, key.3);
        }
    }

    /// A free mapped block leaves its pool's free set (and the address index).
    #[inline]
    pub(super) fn free_remove(&mut self, p: usize, key: &FreeKey) {
        self.free[p].remove(key);
        // The block may already have left the slab (a neighbour absorbed by a merge): the
        // key says where it ended.
        if let Some(v) = &mut self.views {
            v.unindex(key.2 + key.1, key.3);
        }
    }

    /// Whether the free block `key` (its address and size as in the key) enters the address
    /// index: when it holds the first byte of a slot some view maps (a home, `by_home`). A
    /// view's piece starts at one of its homes (rule 23b), so the free block around a piece
    /// always holds a home, and the index holds every free block that does: a view's homes
    /// enter `by_home` before its first hand-out carves them, and every free block that
    /// enters the free set later is asked here. Blocks that held the homes of a view since
    /// destroyed may stay indexed until they leave the free set; the lookup stays exact (the
    /// first indexed block ending at or after a piece's end is the only one that can hold it).
    /// Without views nothing is indexed.
    #[inline]
    fn holds_a_home(&self, key: &FreeKey) -> bool {
        let Some(v) = &self.views else {
            return false;
        };
        // Homes are slots of ranges (whose page is P): a block of a range holds one when a
        // slot some view maps starts inside it. A block of a segment holds none.
        let Some(base) = self.blocks.get(key.3).range else {
            return false;
        };
        let Some(homes) = v.home_slots.get(&base) else {
            return false;
        };
        let offset = key.2 - base;
        homes.any(v.slots_from(offset), v.slots_from(offset + key.1))
    }

    /// The free block (of a free set) holding `[address, address + len)` wholly, if any.
    fn free_block_around(&self, address: u64, len: u64) -> Option<BlockId> {
        let v = self.views.as_ref()?;
        // Free blocks are disjoint: the first indexed one ending at or after the piece's end
        // is the only one that can hold it (the deferred removal's entry is not one).
        let (_, id) = v
            .free_at
            .from(address + len)
            .find(|&e| Some(e) != v.deferred)?;
        let b = self.blocks.get(id);
        (b.address <= address).then_some(id)
    }

    /// Rule 23b: the maximal runs of slots whose homes are consecutive in one range
    /// (`h_{m+1} = h_m + P`): each run's first home and its number of slots.
    pub(super) fn runs_of(page: u64, homes: &[(u64, u64)]) -> Vec<(u64, u64)> {
        let mut runs: Vec<(u64, u64)> = Vec::new();
        let mut last: Option<(u64, u64)> = None;
        for &(base, home) in homes {
            match (last, runs.last_mut()) {
                (Some((b, h)), Some(run)) if b == base && h + page == home => run.1 += 1,
                _ => runs.push((home, 1)),
            }
            last = Some((base, home));
        }
        runs
    }

    /// Rule 23b: the held pieces of a view with `runs` and `n` slots, for an allocation of
    /// `rounded` bytes: per run, from its first home, its whole slots, but for the view's last
    /// slot, of which only the first `t = rounded − (n − 1) × P` bytes.
    fn pieces_of(
        page: u64,
        runs: &[(u64, u64)],
        rounded: u64,
    ) -> impl Iterator<Item = (u64, u64)> + '_ {
        let n: u64 = runs.iter().map(|r| r.1).sum();
        let mut before = 0u64;
        runs.iter().map(move |&(home, count)| {
            before += count;
            let len = if before == n {
                rounded - (n - count) * page
            } else {
                count * page
            };
            (home, len)
        })
    }

    /// Rule 23c: whether the free view `seq` is usable for `rounded` bytes (its page count is
    /// the request's): each piece lies wholly inside one free block.
    fn view_usable(&self, seq: u64, rounded: u64) -> bool {
        let Some(v) = &self.views else { return false };
        let view = &v.views[&seq];
        Self::pieces_of(v.page, &view.runs, rounded)
            .all(|(home, len)| self.free_block_around(home, len).is_some())
    }

    /// Rule 23d's search: the usable free view of the stream with `⌈rounded / P⌉` slots that
    /// was made first. Changes nothing.
    pub(super) fn find_view(&self, stream: StreamId, rounded: u64) -> Option<u64> {
        let v = self.views.as_ref()?;
        let n = rounded.div_ceil(v.page);
        v.free_by_size
            .range((stream, n, 0)..=(stream, n, u64::MAX))
            .map(|&(_, _, seq)| seq)
            .find(|&seq| self.view_usable(seq, rounded))
    }

    /// Rule 23d: hand out the usable free view `seq` for `rounded` bytes: its pieces are carved
    /// out of their free blocks in slot order and held; the view is in use. Returns the
    /// allocation's block (free, in no set, of `rounded` bytes at the view's first byte), for
    /// rule 14's hand-out.
    pub(super) fn take_view(&mut self, seq: u64, rounded: u64) -> BlockId {
        let (page, runs, stream, address, n) = {
            let v = self.views.as_ref().expect("rule 23 acts");
            let view = &v.views[&seq];
            (
                v.page,
                view.runs.clone(),
                view.stream,
                view.address,
                view.homes.len(),
            )
        };
        let mut pieces = Vec::with_capacity(runs.len());
        for (home, len) in Self::pieces_of(page, &runs, rounded) {
            let id = self
                .free_block_around(home, len)
                .expect("rule 23c: a usable view's pieces lie inside free blocks");
            let _ = self.cut_out(id, home, len, Backing::Mapped);
            let b = self.blocks.get_mut(id);
            b.state = BlockPhase::Held;
            b.requested = 0;
            pieces.push(id);
        }
        let allocation = self.blocks.insert(Block {
            backing: Backing::View,
            ..Block::free(
                address,
                rounded,
                stream,
                Pool::Large,
                self.searches[Pool::Large.index()],
                None,
            )
        });
        let v = self.views.as_mut().expect("rule 23 acts");
        let stamp = v.tick();
        let view = v.views.get_mut(&seq).expect("the view exists");
        v.free_by_size.remove(&(stream, n as u64, seq));
        v.lru.remove(&(view.stamp, seq));
        view.stamp = stamp;
        view.in_use = Some(InUse { allocation, pieces });
        v.by_allocation.insert(allocation, seq);
        allocation
    }

    /// Rule 23e: the view allocation `id` returns to the pool (freed, or its events complete):
    /// its statistics fall as rule 10's; each held piece, in slot order, returns as a free
    /// block (merging with free neighbours); the view is free again.
    pub(super) fn return_view(&mut self, id: BlockId) {
        let b = self.blocks.remove(id);
        if self.history.is_some() {
            self.trace(TraceAction::FreeCompleted, b.address, b.requested, b.stream);
        }
        let s = &mut self.stats;
        s.active.decrease(b.pool, 1);
        s.active_bytes.decrease(b.pool, b.size);
        s.requested_bytes.decrease(b.pool, b.requested);
        let v = self.views.as_mut().expect("rule 23 acts");
        let seq = v
            .by_allocation
            .remove(&id)
            .expect("rule 23j: a view allocation belongs to a view in use");
        let view = v.views.get_mut(&seq).expect("the view exists");
        let in_use = view.in_use.take().expect("the view is in use");
        v.free_by_size
            .insert((view.stream, view.homes.len() as u64, seq));
        v.lru.insert((view.stamp, seq));
        for piece in in_use.pieces {
            let (prev, next) = {
                let b = self.blocks.get(piece);
                debug_assert_eq!(b.state, BlockPhase::Held);
                (b.prev, b.next)
            };
            // Blocks of ranges never count as inactive split (rule 19d): the net is not needed.
            let _ = self.absorb_neighbours(piece, prev, next, Backing::Mapped);
            let gc_base = self.searches[self.blocks.get(piece).pool.index()];
            let b = self.blocks.get_mut(piece);
            b.state = BlockPhase::Free;
            b.gc_base = gc_base;
            let key = (b.stream, b.size, b.address, piece);
            let p = b.pool.index();
            self.free_insert(p, key);
        }
    }

    /// Rule 23f: when rule 20 finds reserved memory plus the request's pages past its limit for
    /// a large-pool request of `rounded` bytes (`size` asked) on `stream`, make a view of
    /// `k = ⌈rounded / P⌉` free pages of the stream's ranges and take it (rule 23d). `None`
    /// when rule 20 should go on as written: under the limit, fewer than `k` free pages, the
    /// cap, or an out-of-memory while making the view (rolled back). Any other fault is
    /// returned.
    pub(super) fn stitch(
        &mut self,
        stream: StreamId,
        rounded: u64,
        size: u64,
        headroom: f64,
    ) -> Result<Option<BlockId>, Error> {
        let page = self.page_of(Pool::Large);
        let limit = self.reclaim_limit(size, headroom);
        let k = rounded.div_ceil(page);
        let need = k.saturating_mul(page);
        if self.reserved.saturating_add(need) <= limit {
            return Ok(None);
        }
        // The free pages: whole slots of the stream's ranges (the large pool's, and the small
        // pool's when its page is P) inside free blocks, by block: the large pool's first, then
        // most such bytes first, then by address.
        let mut pools = vec![Pool::Large];
        if self.page_of(Pool::Small) == page {
            pools.push(Pool::Small);
        }
        // Rule 23k: the ranges of every stream.
        let mut listed: Vec<(u64, u64, BlockId)> = Vec::new();
        for pool in pools {
            for k in self.free[pool.index()].iter().filter(|k| k.1 >= page) {
                if let Some((first, end)) = self.whole_pages(k.3) {
                    listed.push((end - first, first, k.3));
                }
            }
        }
        // Rule 19j: only the slots of one-page handles are free pages; without handles of
        // several pages every whole slot is.
        let mut parts: Vec<Vec<(u64, u64)>> = Vec::new();
        if !self.handles.is_empty() {
            for entry in &mut listed {
                let runs = self.one_page_runs(entry.1, entry.1 + entry.0, page);
                entry.0 = runs.iter().map(|r| r.1 * page).sum();
                parts.push(runs);
            }
        }
        let total: u64 = listed.iter().map(|l| l.0 / page).sum();
        if total < k {
            return Ok(None);
        }
        let mut order: Vec<usize> = (0..listed.len()).filter(|&i| listed[i].0 > 0).collect();
        // Rule 23k: the request's stream's blocks first, then the others'; rule 23f: in each,
        // the large pool's before the small pool's.
        order.sort_unstable_by_key(|&i| {
            let b = self.blocks.get(listed[i].2);
            (
                b.stream != stream,
                b.pool == Pool::Small,
                std::cmp::Reverse(listed[i].0),
                b.address,
            )
        });
        // The runs taken, in order: (range, first slot, slots, the free block holding them).
        let mut runs: Vec<(u64, u64, u64, BlockId)> = Vec::new();
        let mut taken = 0u64;
        for i in order {
            if taken == k {
                break;
            }
            let (bytes, first, id) = listed[i];
            let base = self.blocks.get(id).range.expect("a block of a range");
            let whole = [(first, bytes / page)];
            let block_runs: &[(u64, u64)] = if parts.is_empty() { &whole } else { &parts[i] };
            for &(at, slots) in block_runs {
                if taken == k {
                    break;
                }
                let m = (k - taken).min(slots);
                runs.push((base, at, m, id));
                taken += m;
            }
        }
        // Rule 23g: the cap, evicting the least recently used free views.
        let cap = self.backend.mem_info()?.total.saturating_mul(2);
        let view_bytes = need;
        loop {
            let v = self.views.as_ref().expect("rule 23 acts");
            if v.bytes.saturating_add(view_bytes) <= cap {
                break;
            }
            let Some(&(_, seq)) = v.lru.first() else {
                return Ok(None);
            };
            self.destroy_view(seq)?;
        }
        let address = match self.backend.reserve(view_bytes, page) {
            Ok(a) => a,
            Err(BackendError::OutOfMemory) => return Ok(None),
            Err(e) => return Err(Error::Backend(e)),
        };
        let mut mapped = 0u64;
        for &(_, first, m, _) in &runs {
            match self.backend.alias(address + mapped * page, first, m * page) {
                Ok(()) => {
                    self.stats.num_device_alloc += 1;
                    mapped += m;
                }
                Err(e) => {
                    if mapped > 0 {
                        self.backend.unmap(address, mapped * page, stream)?;
                        self.stats.num_device_free += 1;
                    }
                    self.backend.release_reservation(address, view_bytes)?;
                    return match e {
                        BackendError::OutOfMemory => Ok(None),
                        e => Err(Error::Backend(e)),
                    };
                }
            }
        }
        let homes: Vec<(u64, u64)> = runs
            .iter()
            .flat_map(|&(base, first, m, _)| (0..m).map(move |j| (base, first + j * page)))
            .collect();
        // The free blocks holding the new homes enter the address index (blocks that entered
        // the free set before the view existed may be missing from it).
        let sources: Vec<(u64, BlockId)> = runs
            .iter()
            .map(|&(_, _, _, id)| {
                let b = self.blocks.get(id);
                (b.address + b.size, id)
            })
            .collect();
        let mut foreign: Vec<StreamId> = runs
            .iter()
            .map(|&(_, _, _, id)| self.blocks.get(id).stream)
            .filter(|&t| t != stream)
            .collect();
        foreign.sort_unstable();
        foreign.dedup();
        let v = self.views.as_mut().expect("rule 23 acts");
        let seq = v.next;
        v.next += 1;
        let stamp = v.tick();
        for &(base, home) in &homes {
            v.by_home.insert((home, seq));
            let slot = v.slots_from(home - base);
            v.home_slots.entry(base).or_default().add(slot);
        }
        for (end, id) in sources {
            if !v.is_indexed(id) {
                v.index(end, id);
            }
        }
        v.free_by_size.insert((stream, k, seq));
        v.lru.insert((stamp, seq));
        v.bytes += view_bytes;
        // The cap the views were last made under: their bytes only fall until the next view.
        v.cap = cap;
        v.views.insert(
            seq,
            View {
                address,
                stream,
                runs: Self::runs_of(page, &homes),
                homes,
                foreign,
                stamp,
                in_use: None,
            },
        );
        self.wait_for_foreign(seq, false)?;
        Ok(Some(self.take_view(seq, rounded)))
    }

    /// Rule 23k: the waits of the view `seq`'s hand-out (`freeing` false: its stream waits for
    /// each foreign stream) or of its allocation's free (`freeing`: each foreign stream waits
    /// for its stream), foreign streams ascending. Nothing else changes; a failing wait is
    /// returned (the waits made stay: they only order work).
    pub(super) fn wait_for_foreign(&mut self, seq: u64, freeing: bool) -> Result<(), Error> {
        let Some(v) = &self.views else { return Ok(()) };
        let view = &v.views[&seq];
        if view.foreign.is_empty() {
            return Ok(());
        }
        let (stream, foreign) = (view.stream, view.foreign.clone());
        for t in foreign {
            let (waiter, on) = if freeing { (t, stream) } else { (stream, t) };
            self.backend
                .wait_stream(waiter, on)
                .map_err(Error::Backend)?;
        }
        Ok(())
    }

    /// Rule 23k, at a free: the view in use by the allocation `id`, if it is one.
    pub(super) fn view_of_allocation(&self, id: BlockId) -> Option<u64> {
        self.views.as_ref()?.by_allocation.get(&id).copied()
    }

    /// Rule 23h: destroy the free view `seq`: one unmap of its whole reservation (after its
    /// stream's work), then the reservation given back; `num_device_free` += 1.
    fn destroy_view(&mut self, seq: u64) -> Result<(), Error> {
        let (address, stream, n) = {
            let v = self.views.as_ref().expect("rule 23 acts");
            let view = &v.views[&seq];
            debug_assert!(
                view.in_use.is_none(),
                "rule 23h: only free views are destroyed"
            );
            (view.address, view.stream, view.homes.len() as u64)
        };
        let bytes = n * self.views.as_ref().expect("rule 23 acts").page;
        self.backend.unmap(address, bytes, stream)?;
        self.stats.num_device_free += 1;
        let v = self.views.as_mut().expect("rule 23 acts");
        let view = v.views.remove(&seq).expect("the view exists");
        v.free_by_size.remove(&(stream, n, seq));
        v.lru.remove(&(view.stamp, seq));
        for &(base, home) in &view.homes {
            v.by_home.remove(&(home, seq));
            let slot = v.slots_from(home - base);
            if let Some(homes) = v.home_slots.get_mut(&base) {
                homes.remove(slot);
                if homes.is_empty() {
                    v.home_slots.remove(&base);
                }
            }
        }
        v.bytes -= bytes;
        self.backend.release_reservation(address, bytes)?;
        Ok(())
    }

    /// Rule 23h: before rule 19e or rule 20 unmaps the home slots `[first, end)`, the views
    /// mapping any of them (free, since a view in use holds part of every page it maps) are
    /// destroyed, in the order made.
    pub(super) fn destroy_views_over(&mut self, first: u64, end: u64) -> Result<(), Error> {
        let Some(v) = &self.views else { return Ok(()) };
        let mut seqs: Vec<u64> = v
            .by_home
            .range((first, 0)..(end, 0))
            .map(|&(_, seq)| seq)
            .collect();
        if seqs.is_empty() {
            return Ok(());
        }
        seqs.sort_unstable();
        seqs.dedup();
        for seq in seqs {
            self.destroy_view(seq)?;
        }
        Ok(())
    }

    /// Rule 23h: the release of rule 9 (`empty_cache`, rule 7d) destroys every free view
    /// first, in the order made.
    pub(super) fn destroy_free_views(&mut self) -> Result<(), Error> {
        let Some(v) = &self.views else { return Ok(()) };
        let free: Vec<u64> = v
            .views
            .iter()
            .filter(|(_, view)| view.in_use.is_none())
            .map(|(&seq, _)| seq)
            .collect();
        for seq in free {
            self.destroy_view(seq)?;
        }
        Ok(())
    }

    /// Rule 23: the live allocations made through stitched views (which
    /// [`CachingCore::segments`] does not list), by address: each one's address, bytes
    /// (the rounded size) and state (allocated or pending).
    pub fn view_allocations(&self) -> Vec<(u64, u64, BlockPhase)> {
        let Some(v) = &self.views else {
            return Vec::new();
        };
        let mut out: Vec<(u64, u64, BlockPhase)> = v
            .by_allocation
            .keys()
            .map(|&id| {
                let b = self.blocks.get(id);
                (b.address, b.size, b.state)
            })
            .collect();
        out.sort_unstable_by_key(|v| v.0);
        out
    }

    /// Rule 23: how many stitched views exist, and how many of them are in use.
    pub fn view_counts(&self) -> (usize, usize) {
        self.views
            .as_ref()
            .map_or((0, 0), |v| (v.views.len(), v.by_allocation.len()))
    }
}

#[cfg(test)]
mod tests;

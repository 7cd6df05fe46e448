//! Page aliasing (rule 22): pages moved between places by mapping them a second time.
//!
//! The one rule: every page has exactly one *home* — a slot inside a mapped block, the only
//! place its memory is handed out from — and every other slot that maps it lies in a *lent*
//! block (`Backing::Lent`: `Free`, in its pool's lent sets, never handed out as it is). Pages
//! move by *re-homing* (no driver call: a lent slot becomes the home, the old home is carved
//! out of its free block and becomes lent) and by *borrowing* (one `Backend::alias` call maps
//! free pages a second time where a range grows, in place of rule 20's unmapping).
//!
//! The structures, all in [`PageTable`] and present only while the rule acts (page aliasing
//! with expandable segments and a reclaim headroom): per range a slot → page array and a
//! per-slot *busy* count (allocated or pending blocks overlapping the slot, kept at hand-out
//! and at the return to the pool), so whether a lent slot is usable is an array read; per page
//! its home and the number of its lent mappings. Lent blocks are indexed twice per pool:
//! `(stream, size, address)` for best fit (rule 22d) and `(stream, address)` for the growth's
//! start search (rule 22e).

use rustc_hash::FxHashMap;

use crate::backend::{Backend, BackendError, StreamId};
use crate::block::{Backing, Block, BlockId, FreeKey};
use crate::error::Error;
use crate::history::TraceAction;
use crate::sizes::Pool;

use super::CachingCore;

/// A slot that maps no page.
pub(crate) const NO_PAGE: u32 = u32::MAX;

/// One range's half of the page table.
#[derive(Clone, Debug)]
pub(crate) struct RangePages {
    /// The range's page (its slot size).
    pub page: u64,
    /// Per slot, in address order: the page it maps, or [`NO_PAGE`]. Grown on demand: slots
    /// past its end map nothing.
    pub slots: Vec<u32>,
    /// Per slot: allocated or pending blocks overlapping it (rule 22b). As long as `slots`.
    pub busy: Vec<u32>,
}

impl RangePages {
    /// The page slot `i` maps, or [`NO_PAGE`].
    #[inline]
    pub fn page_of(&self, i: usize) -> u32 {
        self.slots.get(i).copied().unwrap_or(NO_PAGE)
    }

    fn set(&mut self, i: usize, page: u32) {
        if i >= self.slots.len() {
            self.slots.resize(i + 1, NO_PAGE);
            self.busy.resize(i + 1, 0);
        }
        self.slots[i] = page;
    }
}

/// One page: where its home is and how many lent slots map it too.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PageInfo {
    /// The first address of the range its home lies in.
    pub home_range: u64,
    /// The home slot's address.
    pub home: u64,
    /// Lent slots mapping it (rule 22a).
    pub lent: u32,
}

/// The allocator's page table (rule 22a), while page aliasing acts.
#[derive(Clone, Debug, Default)]
pub(crate) struct PageTable {
    /// Per range, by first address.
    pub ranges: FxHashMap<u64, RangePages>,
    /// Per page id: the page, or `None` for an id free for reuse.
    pub pages: Vec<Option<PageInfo>>,
    vacant: Vec<u32>,
}

impl PageTable {
    fn new_page(&mut self, info: PageInfo) -> u32 {
        if let Some(id) = self.vacant.pop() {
            self.pages[id as usize] = Some(info);
            id
        } else {
            self.pages.push(Some(info));
            (self.pages.len() - 1) as u32
        }
    }

    fn info(&mut self, id: u32) -> &mut PageInfo {
        self.pages[id as usize]
            .as_mut()
            .expect("rule 22a: a mapped slot maps a page that exists")
    }

    /// The page behind the slot at `address` of the range at `base`.
    fn page_at(&self, base: u64, address: u64) -> u32 {
        let r = &self.ranges[&base];
        r.page_of(((address - base) / r.page) as usize)
    }

    /// Whether the `k` slots from `address` in the range at `base` map `k` distinct pages none
    /// of which is busy (rule 22b).
    fn usable(&self, base: u64, address: u64, k: u64) -> bool {
        let r = &self.ranges[&base];
        let first = ((address - base) / r.page) as usize;
        let slots = first..first + k as usize;
        // Busy first (the common reason to refuse), then distinct: on the stack for a few
        // pages, sorted beyond.
        for i in slots.clone() {
            let id = r.page_of(i);
            let Some(Some(info)) = self.pages.get(id as usize) else {
                return false;
            };
            // Most homes lie in the same range: no second lookup for those.
            let home = if info.home_range == base {
                r
            } else {
                &self.ranges[&info.home_range]
            };
            if home.busy[((info.home - info.home_range) / home.page) as usize] > 0 {
                return false;
            }
        }
        const FEW: usize = 16;
        if slots.len() <= FEW {
            let mut seen = [0u32; FEW];
            for (n, i) in slots.enumerate() {
                let id = r.page_of(i);
                if seen[..n].contains(&id) {
                    return false;
                }
                seen[n] = id;
            }
            return true;
        }
        let mut seen: Vec<u32> = slots.map(|i| r.page_of(i)).collect();
        distinct(&mut seen)
    }

    /// Adds `delta` to the busy count of every slot `[address, address + size)` overlaps.
    #[inline]
    pub(super) fn add_busy(&mut self, base: u64, address: u64, size: u64, delta: i32) {
        let r = self
            .ranges
            .get_mut(&base)
            .expect("every range has its page table");
        let first = ((address - base) / r.page) as usize;
        let last = ((address + size - 1 - base) / r.page) as usize;
        for b in &mut r.busy[first..=last] {
            *b = b.wrapping_add_signed(delta);
        }
    }
}

/// Whether the page ids are pairwise distinct (sorts them).
fn distinct(ids: &mut [u32]) -> bool {
    ids.sort_unstable();
    ids.windows(2).all(|w| w[0] != w[1])
}

impl<B: Backend> CachingCore<B> {
    /// Rule 22's headroom: `Some(H)` while page aliasing acts (it needs expandable segments and,
    /// to act, a reclaim headroom).
    pub(super) fn aliasing(&self) -> Option<f64> {
        let s = &self.settings;
        s.reclaim_headroom
            .filter(|_| s.page_aliasing && s.expandable_segments)
    }

    /// Rule 22: a new range's half of the page table.
    pub(super) fn add_range_pages(&mut self, base: u64, page: u64) {
        if let Some(t) = &mut self.pages {
            t.ranges.insert(
                base,
                RangePages {
                    page,
                    slots: Vec::new(),
                    busy: Vec::new(),
                },
            );
        }
    }

    /// Rule 22a: new pages mapped at `[address, address + bytes)` of the range at `base`, each
    /// with its home there.
    pub(super) fn pages_mapped(&mut self, base: u64, address: u64, bytes: u64) {
        let Some(t) = &mut self.pages else { return };
        let page = t.ranges[&base].page;
        for slot in (address..address + bytes).step_by(page as usize) {
            let id = t.new_page(PageInfo {
                home_range: base,
                home: slot,
                lent: 0,
            });
            let r = t.ranges.get_mut(&base).expect("the range's table");
            r.set(((slot - base) / page) as usize, id);
        }
    }

    /// Rule 22: the slots `[address, address + bytes)` of the range at `base` are unmapped;
    /// `homes` says whether they were the pages' homes (rule 19e: the pages are gone) or lent
    /// slots (rule 22g: the pages stay at home).
    pub(super) fn pages_unmapped(&mut self, base: u64, address: u64, bytes: u64, homes: bool) {
        let Some(t) = &mut self.pages else { return };
        let page = t.ranges[&base].page;
        for slot in (address..address + bytes).step_by(page as usize) {
            let i = ((slot - base) / page) as usize;
            let id = t.ranges[&base].page_of(i);
            debug_assert_ne!(id, NO_PAGE, "rule 22a: unmapping a slot that maps nothing");
            if homes {
                debug_assert_eq!(
                    t.pages[id as usize].map(|p| (p.home, p.lent)),
                    Some((slot, 0)),
                    "rule 22g: a home is unmapped after its lent slots"
                );
                t.pages[id as usize] = None;
                t.vacant.push(id);
            } else {
                t.info(id).lent -= 1;
            }
            t.ranges.get_mut(&base).expect("the range's table").slots[i] = NO_PAGE;
        }
    }

    /// Rule 22: a range gave its address space back.
    pub(super) fn drop_range_pages(&mut self, base: u64) {
        if let Some(t) = &mut self.pages {
            t.ranges.remove(&base);
        }
    }

    /// Rule 22b: whether the first `k` slots of the lent block `id` are usable.
    pub(super) fn lent_usable(&self, id: BlockId, k: u64) -> bool {
        let (Some(t), b) = (&self.pages, self.blocks.get(id)) else {
            return false;
        };
        let base = b.range.expect("rule 22a: lent blocks are blocks of ranges");
        t.usable(base, b.address, k)
    }

    /// Rule 22b: whether every slot of the lent block `id` is usable.
    pub(super) fn lent_all_usable(&self, id: BlockId) -> bool {
        let b = self.blocks.get(id);
        let page = self.ranges[&b.range.expect("a block of a range")].page;
        self.lent_usable(id, b.size / page)
    }

    /// Rule 22d: the smallest `(size, address)` lent block of the pool and stream with room for
    /// `rounded` bytes whose first `⌈rounded / page⌉` slots are usable — among those smaller by
    /// `(size, address)` than `below` (rule 19a's candidate), when there is one: only such a
    /// block can win, so a cache hit looks at no other.
    pub(super) fn lent_candidate(
        &self,
        pool: Pool,
        stream: StreamId,
        rounded: u64,
        below: Option<FreeKey>,
    ) -> Option<FreeKey> {
        let p = pool.index();
        if self.lent[p].is_empty() {
            return None;
        }
        let k = rounded.div_ceil(self.page_of(pool));
        let end = below.map_or((stream, u64::MAX, u64::MAX, BlockId::MAX), |f| {
            (stream, f.1, f.2, 0)
        });
        self.lent[p]
            .range((stream, rounded, 0, 0)..end)
            .find(|key| self.lent_usable(key.3, k))
            .copied()
    }

    /// Rule 22e: whether the growth's run `[start, end)` (from block `start`) is free of lent
    /// slots mapping one page twice and of lent slots whose page's home lies inside it.
    pub(super) fn run_is_clean(&self, start: BlockId, end: u64) -> bool {
        let Some(t) = &self.pages else { return true };
        let first = self.blocks.get(start).address;
        let mut pages: Vec<u32> = Vec::new();
        let mut cur = Some(start);
        while let Some(c) = cur {
            let b = self.blocks.get(c);
            if b.address >= end {
                break;
            }
            if b.backing == Backing::Lent {
                let base = b.range.expect("a block of a range");
                let page = t.ranges[&base].page;
                for slot in (b.address..b.address + b.size).step_by(page as usize) {
                    let id = t.page_at(base, slot);
                    let home = t.pages[id as usize]
                        .expect("a lent slot's page exists")
                        .home;
                    if (first..end).contains(&home) {
                        return false;
                    }
                    pages.push(id);
                }
            }
            cur = b.next;
        }
        distinct(&mut pages)
    }

    /// Rule 22f: the home slots of the pages that lent slots of the growth's run `[run.0,
    /// run.1)` map, found from the block `id` of the map step (the blocks from it on that
    /// overlap the run, only their slots inside it). The run's bytes before `id` need no
    /// look: rule 19b's steps go in address order and each leaves the bytes it covered in
    /// the growth's one free mapped block, which lends nothing.
    fn run_homes(&self, id: BlockId, run: (u64, u64)) -> Vec<u64> {
        let Some(t) = &self.pages else {
            return Vec::new();
        };
        debug_assert!(
            self.blocks
                .get(id)
                .prev
                .map(|p| self.blocks.get(p))
                .is_none_or(|p| { p.backing != Backing::Lent || p.address + p.size <= run.0 }),
            "rule 19b: the run's bytes before a map step lie in the growth's free block"
        );
        let mut homes = Vec::new();
        let mut cur = Some(id);
        while let Some(c) = cur {
            let b = self.blocks.get(c);
            if b.address >= run.1 {
                break;
            }
            if b.backing == Backing::Lent {
                let base = b.range.expect("a block of a range");
                let page = t.ranges[&base].page;
                // Only the slots inside the run: a lent block that carving merged with lent
                // slots past the run's end (or before its start) reaches beyond it, and the
                // homes of those slots do not bar a lender (rule 22f; the fuzz finding of
                // 2026-12-03, fuzz/regressions/differential/aliasing_reserved_12mib).
                let (from, to) = (b.address.max(run.0), (b.address + b.size).min(run.1));
                for slot in (from..to).step_by(page as usize) {
                    let id = t.page_at(base, slot);
                    homes.push(
                        t.pages[id as usize]
                            .expect("rule 22a: a lent slot's page exists")
                            .home,
                    );
                }
            }
            cur = b.next;
        }
        homes
    }

    /// Rule 22e: a map step on the lent block `id`: re-homes the slots covering its first `n`
    /// bytes; the new free block merges with free mapped neighbours and enters the free set.
    /// Returns it.
    pub(super) fn rehome_step(&mut self, id: BlockId, n: u64) -> BlockId {
        let page = self.ranges[&self.blocks.get(id).range.expect("a range")].page;
        let new = self.rehome(id, n.div_ceil(page));
        self.settle_free(new)
    }

    /// The new free mapped block `id` (in no set) merges with free mapped neighbours and enters
    /// the free set; returns the merged block.
    fn settle_free(&mut self, id: BlockId) -> BlockId {
        let (prev, next) = {
            let b = self.blocks.get(id);
            (b.prev, b.next)
        };
        // Blocks of ranges never count as inactive split (rule 19d): the net is not needed.
        let _ = self.absorb_neighbours(id, prev, next, Backing::Mapped);
        let gc_base = self.searches[self.blocks.get(id).pool.index()];
        let b = self.blocks.get_mut(id);
        b.gc_base = gc_base;
        let key = (b.stream, b.size, b.address, id);
        let p = b.pool.index();
        self.free_insert(p, key);
        id
    }

    /// Rule 22c: re-home the first `k` slots of the lent block `id` (their pages usable): each
    /// page's home slot is carved out of its free block, then the `k` slots become the homes, one
    /// free mapped block (returned; in no set, merged with nothing) out of the lent block. Rule
    /// 22d hands the block out as it is; rule 22e merges it ([`CachingCore::rehome_step`]).
    pub(super) fn rehome(&mut self, id: BlockId, k: u64) -> BlockId {
        let (address, pool, stream, base) = {
            let b = self.blocks.get(id);
            (
                b.address,
                b.pool,
                b.stream,
                b.range.expect("a lent block is a block of a range"),
            )
        };
        let page = self.ranges[&base].page;
        let bytes = k * page;
        let t = self.pages.as_ref().expect("rule 22 acts");
        let moved: Vec<(u32, PageInfo)> = (address..address + bytes)
            .step_by(page as usize)
            .map(|slot| {
                let page_id = t.page_at(base, slot);
                (
                    page_id,
                    t.pages[page_id as usize].expect("a lent slot's page"),
                )
            })
            .collect();
        // Carved run by run: homes in consecutive slots lie in one free block (two free blocks
        // are never adjacent), and carving a set of slots leaves the same blocks in any order.
        let mut i = 0;
        while i < moved.len() {
            let (range, first) = (moved[i].1.home_range, moved[i].1.home);
            let mut j = i;
            while j < moved.len()
                && moved[j].1.home_range == range
                && moved[j].1.home == first + (j - i) as u64 * page
            {
                j += 1;
            }
            let bytes = (j - i) as u64 * page;
            let home = self.free_block_holding(pool, stream, first, bytes);
            self.carve(home, first, bytes, false);
            i = j;
        }
        // The history in the rule's order: each home carved, lent slots in address order.
        for &(_, info) in &moved {
            self.trace(TraceAction::SegmentUnmap, info.home, page, stream);
        }
        // The k slots leave their lent block (found by address: carving may have merged it).
        let lent = self.lent_block_at(pool, stream, address);
        let new = self.split_lent(lent, address, bytes);
        let t = self.pages.as_mut().expect("rule 22 acts");
        for (j, &(page_id, _)) in moved.iter().enumerate() {
            let info = t.info(page_id);
            info.home_range = base;
            info.home = address + j as u64 * page;
            info.lent -= 1;
        }
        self.trace(TraceAction::SegmentMap, address, bytes, stream);
        new
    }

    /// The free mapped block of the pool and stream that holds `[slot, slot + bytes)` (rule 22b:
    /// a usable page's home lies wholly inside one).
    fn free_block_holding(&self, pool: Pool, stream: StreamId, slot: u64, bytes: u64) -> BlockId {
        self.free[pool.index()]
            .at_least(stream, bytes)
            .find(|k| k.2 <= slot && slot + bytes <= k.2 + k.1)
            .map(|k| k.3)
            .expect("rule 22b: a usable page's home lies inside a free block of its stream")
    }

    /// The lent block of the pool and stream holding `address`.
    fn lent_block_at(&self, pool: Pool, stream: StreamId, address: u64) -> BlockId {
        let &(s, at, id) = self.lent_at[pool.index()]
            .range(..=(stream, address, BlockId::MAX))
            .next_back()
            .expect("a lent block holds the address");
        debug_assert!(s == stream && at <= address);
        debug_assert!(address < at + self.blocks.get(id).size);
        id
    }

    /// Rule 22c: carve `[start, start + bytes)` (whole slots) out of the free mapped block `id`:
    /// the block leaves the free set, its parts before and after stay free blocks in the free
    /// set, the slots become lent (their pages gain a lent mapping) and merge with lent
    /// neighbours. With `trace`, the history records `segment_unmap` for each slot.
    fn carve(&mut self, id: BlockId, start: u64, bytes: u64, trace: bool) {
        let (stream, base) = {
            let b = self.blocks.get(id);
            (b.stream, b.range.expect("a range"))
        };
        let (prev, next) = self.cut_out(id, start, bytes, Backing::Lent);
        let end = start + bytes;
        let _ = self.absorb_neighbours(id, prev, next, Backing::Lent);
        self.index_lent(id);
        let t = self.pages.as_mut().expect("rule 22 acts");
        let page = t.ranges[&base].page;
        for slot in (start..end).step_by(page as usize) {
            let page_id = t.page_at(base, slot);
            t.info(page_id).lent += 1;
        }
        if trace {
            for slot in (start..end).step_by(page as usize) {
                self.trace(TraceAction::SegmentUnmap, slot, page, stream);
            }
        }
    }

    /// Puts the lent block `id` in its pool's lent sets.
    fn index_lent(&mut self, id: BlockId) {
        let b = self.blocks.get(id);
        let p = b.pool.index();
        let (stream, size, address) = (b.stream, b.size, b.address);
        self.lent[p].insert((stream, size, address, id));
        self.lent_at[p].insert((stream, address, id));
    }

    /// Takes the lent block `id` out of its pool's lent sets.
    pub(super) fn unindex_lent(&mut self, b: &Block, id: BlockId) {
        let p = b.pool.index();
        self.lent[p].remove(&(b.stream, b.size, b.address, id));
        self.lent_at[p].remove(&(b.stream, b.address, id));
    }

    /// Rule 22c: `[address, address + bytes)` (whole slots) leaves the lent block `id`, whose
    /// rest stays lent, and becomes a free mapped block (returned; in no set).
    fn split_lent(&mut self, id: BlockId, address: u64, bytes: u64) -> BlockId {
        let b = self.blocks.get(id).clone();
        self.unindex_lent(&b, id);
        let lent_piece = |address: u64, size: u64| Block {
            backing: Backing::Lent,
            ..Block::free(address, size, b.stream, b.pool, b.gc_base, b.range)
        };
        if address > b.address {
            let before = self.blocks.insert(Block {
                prev: b.prev,
                next: Some(id),
                ..lent_piece(b.address, address - b.address)
            });
            if let Some(pp) = b.prev {
                self.blocks.get_mut(pp).next = Some(before);
            }
            self.blocks.get_mut(id).prev = Some(before);
            self.index_lent(before);
        }
        let end = address + bytes;
        if b.address + b.size > end {
            let after = self.blocks.insert(Block {
                prev: Some(id),
                next: b.next,
                ..lent_piece(end, b.address + b.size - end)
            });
            if let Some(nn) = b.next {
                self.blocks.get_mut(nn).prev = Some(after);
            }
            self.blocks.get_mut(id).next = Some(after);
            self.index_lent(after);
        }
        let gc_base = self.searches[b.pool.index()];
        let m = self.blocks.get_mut(id);
        m.address = address;
        m.size = bytes;
        m.backing = Backing::Mapped;
        m.gc_base = gc_base;
        id
    }

    /// Rule 22f: the map step of `n` bytes into the unmapped block `id` when rule 22 acts (the
    /// growth's run is `run`, `limit` rule 20's): first, if the step would take reserved memory
    /// past the limit, pages borrowed from the stream's free blocks, one `Backend::alias` per
    /// candidate, then new pages for the rest. Returns the grown free block, or `None` when a
    /// step failed (the earlier ones stay).
    pub(super) fn borrow_and_map(
        &mut self,
        id: BlockId,
        n: u64,
        limit: u64,
        run: (u64, u64),
    ) -> Result<Option<BlockId>, Error> {
        let (size, pool, stream, base) = {
            let b = self.blocks.get(id);
            (b.size, b.pool, b.stream, b.range.expect("a range"))
        };
        let page = self.ranges[&base].page;
        let bytes = n.div_ceil(page).saturating_mul(page).min(size);
        let over = self.reserved.saturating_add(bytes).saturating_sub(limit);
        if over == 0 {
            return self.map_step(id, bytes);
        }
        let want = (bytes / page).min(over.div_ceil(page));
        // The candidates: free mapped blocks of the pool's ranges of the stream with a whole
        // page, outside the run and holding no home of a page a lent slot of the run maps
        // (borrowing it would move that home into the run), listed once: most whole-page
        // bytes first, then by address.
        let homes = self.run_homes(id, run);
        let mut listed: Vec<(u64, u64, u64, BlockId)> = self.free[pool.index()]
            .at_least(stream, page)
            .filter(|k| !(run.0..run.1).contains(&k.2))
            .filter(|k| {
                let end = k.2 + k.1;
                !homes.iter().any(|&h| h < end && k.2 < h + page)
            })
            .filter_map(|k| {
                let (first, end) = self.whole_pages(k.3)?;
                Some((end - first, k.2, first, k.3))
            })
            .collect();
        listed.sort_unstable_by_key(|&(bytes, address, _, _)| (std::cmp::Reverse(bytes), address));
        let mut plan: Vec<(BlockId, u64, u64)> = Vec::new();
        let mut taken = 0u64;
        for (whole, _, first, cid) in listed {
            if taken == want {
                break;
            }
            let m = (want - taken).min(whole / page);
            plan.push((cid, first, m));
            taken += m;
        }
        let mut target = id;
        let mut grown = None;
        for (cid, source, m) in plan {
            let bytes = m * page;
            let at = self.blocks.get(target).address;
            match self.backend.alias(at, source, bytes) {
                Ok(()) => {}
                Err(BackendError::OutOfMemory) => return Ok(None),
                Err(e) => return Err(Error::Backend(e)),
            }
            debug_assert!(self.blocks.get(cid).free_mapped());
            let moved: Vec<u32> = {
                let t = self.pages.as_ref().expect("rule 22 acts");
                (source..source + bytes)
                    .step_by(page as usize)
                    .map(|slot| t.page_at(self.blocks.get(cid).range.expect("a range"), slot))
                    .collect()
            };
            self.carve(cid, source, bytes, true);
            let t = self.pages.as_mut().expect("rule 22 acts");
            for (j, &page_id) in moved.iter().enumerate() {
                let slot = at + j as u64 * page;
                t.ranges
                    .get_mut(&base)
                    .expect("the range's table")
                    .set(((slot - base) / page) as usize, page_id);
                let info = t.info(page_id);
                info.home_range = base;
                info.home = slot;
            }
            let (merged, rest) = self.back_unmapped(target, bytes);
            self.stats.num_device_alloc += 1;
            self.trace(TraceAction::SegmentMap, at, bytes, stream);
            grown = Some(merged);
            match rest {
                Some(r) => target = r,
                None => return Ok(grown),
            }
        }
        let rest = bytes - taken * page;
        if rest == 0 {
            return Ok(grown);
        }
        self.map_step(target, rest)
    }

    /// Rule 22g: unmap every lent block of the pool's ranges, in `(stream, address)` order (one
    /// `Backend::unmap` each; the pages stay mapped at their homes).
    pub(super) fn unmap_lent(&mut self, pool: Pool) -> Result<(), Error> {
        let listed: Vec<BlockId> = self.lent_at[pool.index()].iter().map(|k| k.2).collect();
        for id in listed {
            let (address, size, stream, base) = {
                let b = self.blocks.get(id);
                debug_assert_eq!(b.backing, Backing::Lent);
                (b.address, b.size, b.stream, b.range.expect("a range"))
            };
            self.backend.unmap(address, size, stream)?;
            self.stats.num_device_free += 1;
            self.pages_unmapped(base, address, size, false);
            let b = self.blocks.get(id).clone();
            self.unindex_lent(&b, id);
            self.blocks.get_mut(id).backing = Backing::Unmapped;
            let _ = self.absorb_neighbours(id, b.prev, b.next, Backing::Unmapped);
            self.settle_unmapped(id)?;
        }
        Ok(())
    }

    /// Rule 22b's busy counts: a block `[address, address + size)` of the range at `range`
    /// (if any) is handed out (`delta` 1) or returns to the pool (`delta` −1). Nothing while
    /// rule 22 does not act.
    #[inline]
    pub(super) fn track_busy(&mut self, range: Option<u64>, address: u64, size: u64, delta: i32) {
        if let (Some(t), Some(base)) = (&mut self.pages, range) {
            t.add_busy(base, address, size, delta);
        }
    }

    /// After a lent candidate was handed out (rule 22d): the remainder of its new block, if any,
    /// merges with the block after it when that one is free.
    pub(super) fn merge_remainder(&mut self, id: BlockId) {
        let Some(rest) = self.blocks.get(id).next else {
            return;
        };
        let r = self.blocks.get(rest);
        if !r.free_mapped() {
            return;
        }
        let Some(next) = r.next.filter(|&n| self.blocks.get(n).free_mapped()) else {
            return;
        };
        let key = (r.stream, r.size, r.address, rest);
        let p = r.pool.index();
        self.free_remove(p, &key);
        let _ = self.absorb_neighbours(rest, None, Some(next), Backing::Mapped);
        let b = self.blocks.get(rest);
        let key = (b.stream, b.size, b.address, rest);
        self.free_insert(p, key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// A table of one range at `base` with 2 MiB slots mapping `slots` (page ids), each page at
    /// home in slot `10 + id`, with these busy counts there.
    fn table(base: u64, slots: &[u32], busy_homes: &[u32]) -> PageTable {
        let mut t = PageTable::default();
        let mut r = RangePages {
            page: 2 * MIB,
            slots: Vec::new(),
            busy: Vec::new(),
        };
        for (i, &id) in slots.iter().enumerate() {
            r.set(i, id);
        }
        for id in 0..4u32 {
            let home = 10 + id as usize;
            r.set(home, id);
            r.busy[home] = u32::from(busy_homes.contains(&id));
            t.new_page(PageInfo {
                home_range: base,
                home: base + home as u64 * 2 * MIB,
                lent: 1,
            });
        }
        t.ranges.insert(base, r);
        t
    }

    #[test]
    fn lent_slots_are_usable_when_they_map_distinct_pages_none_busy() {
        // Rule 22b.
        let base = 1 << 40;
        let t = table(base, &[0, 1, 2], &[]);
        assert!(t.usable(base, base, 3));
        // The same page twice in the first slots: not usable, though no page is busy.
        let t = table(base, &[0, 1, 0], &[]);
        assert!(t.usable(base, base, 2));
        assert!(!t.usable(base, base, 3));
        // A busy page among them.
        let t = table(base, &[0, 1, 2], &[1]);
        assert!(t.usable(base, base, 1));
        assert!(!t.usable(base, base, 2));
        // Slots past the table map nothing.
        assert!(!t.usable(base, base + 2 * MIB, 4));
    }

    #[test]
    fn distinct_pages_are_told_from_repeated_ones() {
        assert!(distinct(&mut [3, 1, 2]));
        assert!(!distinct(&mut [3, 1, 3]));
        assert!(distinct(&mut []));
    }
}

//! Expandable segments (rule 19): ranges of address space grown and shrunk page by page.
//!
//! The one rule: a range is tiled by blocks like a segment, and the only new kind of block is
//! the *unmapped* one — `Free`, not mapped, in its pool's unmapped set keyed `(stream, address)`
//! and in no other index. Growing maps pages into unmapped blocks (they become free blocks that
//! merge like any other, rule 10); releasing unmaps the whole pages inside free blocks (they
//! become unmapped blocks that merge with unmapped neighbours).

use crate::backend::{Backend, BackendError, StreamId};
use crate::block::{Backing, Block, BlockId, BlockPhase, Range};
use crate::error::Error;
use crate::history::TraceAction;
use crate::sizes::{Pool, SMALL_BUFFER};

use super::CachingCore;

/// The page of a range (rule 19): 2 MiB in the small pool, `large` (the setting
/// `expandable_page_mb`; PyTorch's 20 MiB unless set) in the large pool.
pub(crate) fn page_size(pool: Pool, large: u64) -> u64 {
    match pool {
        Pool::Small => SMALL_BUFFER,
        Pool::Large => large,
    }
}

/// The size of a new range (rule 19): whole pages covering 9/8 of the device's capacity.
pub(crate) fn range_size(capacity: u64, page: u64) -> u64 {
    capacity
        .saturating_add(capacity / 8)
        .div_ceil(page)
        .saturating_mul(page)
}

impl<B: Backend> CachingCore<B> {
    /// The page of the pool's ranges under these settings (rule 19).
    pub(super) fn page_of(&self, pool: Pool) -> u64 {
        page_size(pool, self.settings.expandable_page_size)
    }

    /// Rule 20: before growing for a request of `size` bytes (`rounded`, `pool`, `stream`),
    /// unmap free pages left between live blocks — largest first — until reserved memory plus
    /// the request's pages fits within `headroom` of the requested high-water.
    pub(super) fn reclaim(
        &mut self,
        pool: Pool,
        stream: StreamId,
        rounded: u64,
        size: u64,
        headroom: f64,
    ) -> Result<(), Error> {
        let limit = self.reclaim_limit(size, headroom);
        let page = self.page_of(pool);
        let need = rounded.div_ceil(page).saturating_mul(page);
        if self.reserved.saturating_add(need) <= limit {
            return Ok(());
        }
        // The free block where rule 19b's growth would start is kept: unmapping it would only
        // have the growth map it again.
        let start = self
            .grow_start(pool, stream, rounded)
            .map(|(id, _)| id)
            .filter(|&id| self.blocks.get(id).mapped());
        let mut listed: Vec<(u64, u64, BlockId)> = Vec::new();
        // Rule 23f: while stitching is on, only the request's pool (every stream; for a
        // small-pool request, its own stream) is reclaimed, so that pages do not move back and
        // forth between the pools, or between streams' small pools, every pass.
        let own_pool_only = self.views.is_some();
        let own_stream_only = own_pool_only && pool == Pool::Small;
        for (p, set) in self.free.iter().enumerate() {
            if own_pool_only && p != pool.index() {
                continue;
            }
            for (s, _, _, id) in set.iter() {
                if Some(id) == start || (own_stream_only && s != stream) {
                    continue;
                }
                if let Some((first, end)) = self.whole_handles(id) {
                    listed.push((end - first, self.blocks.get(id).address, id));
                }
            }
        }
        listed.sort_unstable_by_key(|&(bytes, address, _)| (std::cmp::Reverse(bytes), address));
        for (_, _, id) in listed {
            if self.reserved.saturating_add(need) <= limit {
                break;
            }
            self.unmap_block(id)?;
        }
        Ok(())
    }

    /// Rule 20's `limit` for a request of `size` bytes: `w + ⌊w × headroom⌋` with
    /// `w = max(W, requested_bytes + size)`.
    pub(super) fn reclaim_limit(&self, size: u64, headroom: f64) -> u64 {
        let current = self.stats.requested_bytes.all.current.max(0) as u64;
        let w = self.requested_high_water.max(current.saturating_add(size));
        w.saturating_add((w as f64 * headroom).floor() as u64)
    }

    /// The whole pages of its range inside the block `id`, as `(first, end)` addresses; `None`
    /// for a block of no range or one that holds no whole page.
    pub(super) fn whole_pages(&self, id: BlockId) -> Option<(u64, u64)> {
        let b = self.blocks.get(id);
        let base = b.range?;
        let page = self.ranges[&base].page;
        let first = base + (b.address - base).div_ceil(page) * page;
        let end = base + (b.address + b.size - base) / page * page;
        (first < end).then_some((first, end))
    }

    /// Rules 19e, 19j, 20: the whole handles inside the free block `id`, from the first lying
    /// wholly inside it to the end of the last, as `(first, end)` addresses; `None` when none
    /// does. Without handles of several pages these are its whole pages.
    pub(super) fn whole_handles(&self, id: BlockId) -> Option<(u64, u64)> {
        let (first, end) = self.whole_pages(id)?;
        if self.handles.is_empty() {
            return Some((first, end));
        }
        let b = self.blocks.get(id);
        let start = b.address;
        // A handle reaching into the block from before it, and one reaching out past its end,
        // are not inside: the whole handles lie between them.
        let from = match self.handles.range(..=first).next_back() {
            Some((&a, &bytes)) if a + bytes > first => {
                if a >= start {
                    a
                } else {
                    a + bytes
                }
            }
            _ => first,
        };
        let to = match self.handles.range(..end).next_back() {
            Some((&a, &bytes)) if a + bytes > end => a.max(from),
            _ => end,
        };
        (from < to).then_some((from, to))
    }

    /// Rule 23f (with 19j): the runs of one-page handles among the slots `[first, end)` of a
    /// range whose page is `page`, as `(first slot, slots)` in address order.
    pub(super) fn one_page_runs(&self, first: u64, end: u64, page: u64) -> Vec<(u64, u64)> {
        let mut runs = Vec::new();
        let mut cursor = first;
        let before = self
            .handles
            .range(..first)
            .next_back()
            .map(|(&a, &b)| (a, b));
        for (a, bytes) in before
            .into_iter()
            .chain(self.handles.range(first..end).map(|(&a, &b)| (a, b)))
        {
            if a + bytes <= cursor {
                continue;
            }
            if a > cursor {
                runs.push((cursor, (a - cursor) / page));
            }
            cursor = a + bytes;
        }
        if cursor < end {
            runs.push((cursor, (end - cursor) / page));
        }
        runs
    }

    /// Rule 19a: a block's reach — its size, plus the next block's when that one is unmapped.
    pub(super) fn reach(&self, id: BlockId) -> u64 {
        let b = self.blocks.get(id);
        let tail = b
            .next
            .map(|n| self.blocks.get(n))
            .filter(|n| n.backing == Backing::Unmapped)
            .map_or(0, |n| n.size);
        b.size + tail
    }

    /// Rule 19b: grow a range of the pool and stream until a free block of `rounded` bytes
    /// exists, and take it out of the free set; `None` when the device has no room (pages
    /// mapped by earlier steps stay mapped, as free memory). With rule 22 acting (`limit`:
    /// rule 20's), the growth also goes over lent blocks (re-homing them, rule 22e) and borrows
    /// free pages before mapping new ones (rule 22f).
    pub(super) fn grow(
        &mut self,
        pool: Pool,
        stream: StreamId,
        rounded: u64,
        limit: Option<u64>,
    ) -> Result<Option<BlockId>, Error> {
        let (mut start, run_end) = match self.grow_start(pool, stream, rounded) {
            Some(found) => found,
            None => match self.new_range(pool, stream)? {
                Some(id) => {
                    let b = self.blocks.get(id);
                    (id, b.address + b.size)
                }
                None => return Ok(None),
            },
        };
        let run = (self.blocks.get(start).address, run_end);
        if !self.blocks.get(start).mapped() {
            let n = self.blocks.get(start).size.min(rounded);
            match self.grow_step(start, n, limit, run)? {
                Some(id) => start = id,
                None => return Ok(None),
            }
        }
        while self.blocks.get(start).size < rounded {
            let b = self.blocks.get(start);
            let next = b
                .next
                .expect("rule 19b: the start's room goes on in the block after it");
            let n = (rounded - b.size).min(self.blocks.get(next).size);
            match self.grow_step(next, n, limit, run)? {
                Some(id) => start = id,
                None => return Ok(None),
            }
        }
        let b = self.blocks.get(start);
        let key = (b.stream, b.size, b.address, start);
        self.free_remove(pool.index(), &key);
        Ok(Some(start))
    }

    /// One step of rule 19b's growth on the unmapped or lent block `id`, for its first `n`
    /// bytes: a re-homing (rule 22e), a borrowing and mapping (rule 22f), or a plain map step.
    fn grow_step(
        &mut self,
        id: BlockId,
        n: u64,
        limit: Option<u64>,
        run: (u64, u64),
    ) -> Result<Option<BlockId>, Error> {
        match (self.blocks.get(id).backing, limit) {
            (Backing::Lent, _) => Ok(Some(self.rehome_step(id, n))),
            (_, Some(limit)) => self.borrow_and_map(id, n, limit, run),
            (_, None) => self.map_step(id, n),
        }
    }

    /// Rule 19b (and 22e): the first unmapped — or lent, with every slot usable — block of the
    /// pool and stream, in address order, or the free block before it, from which free,
    /// unmapped and such lent blocks reach `rounded` bytes (and whose run, under rule 22e, maps
    /// no page twice and holds no home of its lent slots' pages). Returns it and the end of its
    /// run.
    pub(super) fn grow_start(
        &self,
        pool: Pool,
        stream: StreamId,
        rounded: u64,
    ) -> Option<(BlockId, u64)> {
        let p = pool.index();
        let summable = |id: BlockId| {
            let b = self.blocks.get(id);
            match b.backing {
                Backing::Mapped => b.state == BlockPhase::Free,
                Backing::Unmapped => true,
                Backing::Lent => self.lent_all_usable(id),
                Backing::View => false,
            }
        };
        let unmapped = self.unmapped[p]
            .range((stream, 0, 0)..)
            .take_while(|k| k.0 == stream);
        let mut lent = self.lent_at[p]
            .range((stream, 0, 0)..)
            .take_while(|k| k.0 == stream)
            .peekable();
        let mut unmapped = unmapped.peekable();
        // The two sets merged in address order.
        let mut next = || match (unmapped.peek(), lent.peek()) {
            (Some(u), Some(l)) if l.1 < u.1 => lent.next(),
            (Some(_), _) => unmapped.next(),
            (None, _) => lent.next(),
        };
        while let Some(&(_, _, id)) = next() {
            let b = self.blocks.get(id);
            if b.backing == Backing::Lent && !self.lent_all_usable(id) {
                continue;
            }
            let start = match b.prev {
                Some(p) if self.blocks.get(p).free_mapped() => p,
                _ => id,
            };
            let mut room = 0u64;
            let mut end = 0u64;
            let mut cur = Some(start);
            while room < rounded
                && let Some(c) = cur.filter(|&c| summable(c))
            {
                let b = self.blocks.get(c);
                room += b.size;
                end = b.address + b.size;
                cur = b.next;
            }
            if room >= rounded && self.run_is_clean(start, end) {
                return Some((start, end));
            }
        }
        None
    }

    /// Rule 19b: reserve a new range for the pool and stream: one unmapped block (`None` on a
    /// device with no memory at all, where the range would be empty).
    fn new_range(&mut self, pool: Pool, stream: StreamId) -> Result<Option<BlockId>, Error> {
        let page = self.page_of(pool);
        let capacity = self.backend.mem_info()?.total;
        let size = range_size(capacity, page);
        if size == 0 {
            return Ok(None);
        }
        let base = self.backend.reserve(size, page)?;
        self.ranges.insert(base, Range { size, page });
        self.add_range_pages(base, page);
        let id = self.blocks.insert(Block {
            backing: Backing::Unmapped,
            ..Block::free(
                base,
                size,
                stream,
                pool,
                self.searches[pool.index()],
                Some(base),
            )
        });
        self.unmapped[pool.index()].insert((stream, base, id));
        Ok(Some(id))
    }

    /// Rule 19b: one map step — back the first `n` bytes of the unmapped block `id`, rounded up
    /// to whole pages, with memory. The mapped part becomes a free block that merges with free
    /// neighbours; returns the merged block, or `None` when the device had no room.
    pub(super) fn map_step(&mut self, id: BlockId, n: u64) -> Result<Option<BlockId>, Error> {
        let (address, size, pool, stream, range) = {
            let b = self.blocks.get(id);
            debug_assert!(b.backing == Backing::Unmapped && b.state == BlockPhase::Free);
            (b.address, b.size, b.pool, b.stream, b.range)
        };
        let page = range
            .and_then(|r| self.ranges.get(&r))
            .map_or(self.page_of(pool), |r| r.page);
        let bytes = n.div_ceil(page).saturating_mul(page).min(size);
        if bytes == 0 {
            return Ok(None);
        }
        // Rule 19j: a step of at least the handle threshold is one handle of all its bytes.
        let one_handle = self
            .settings
            .expandable_handle_size
            .is_some_and(|t| bytes >= t && bytes > page);
        let made = if one_handle {
            self.backend.map_handle(address, bytes)
        } else {
            self.backend.map(address, bytes)
        };
        match made {
            Ok(()) => {}
            Err(BackendError::OutOfMemory) => return Ok(None),
            Err(e) => return Err(Error::Backend(e)),
        }
        if one_handle {
            self.handles.insert(address, bytes);
        }
        if let Some(base) = range {
            self.pages_mapped(base, address, bytes);
        }
        let (id, _) = self.back_unmapped(id, bytes);
        self.reserved += bytes;
        self.stats.reserved_bytes.increase(pool, bytes);
        self.stats.num_device_alloc += 1;
        self.trace(TraceAction::SegmentMap, address, bytes, stream);
        Ok(Some(id))
    }

    /// Rules 19b and 22f: the first `bytes` (whole pages) of the unmapped block `id` now have
    /// memory behind them: they become a free block that merges with free mapped neighbours
    /// and enters the free set, the rest staying unmapped after it. Returns the merged block and
    /// the unmapped rest, if any. No device call, no statistic.
    pub(super) fn back_unmapped(&mut self, id: BlockId, bytes: u64) -> (BlockId, Option<BlockId>) {
        let (address, size, pool, stream, range) = {
            let b = self.blocks.get(id);
            (b.address, b.size, b.pool, b.stream, b.range)
        };
        let p = pool.index();
        self.unmapped[p].remove(&(stream, address, id));
        let mut rest = None;
        if bytes < size {
            let next = self.blocks.get(id).next;
            let r = self.blocks.insert(Block {
                prev: Some(id),
                next,
                backing: Backing::Unmapped,
                ..Block::free(
                    address + bytes,
                    size - bytes,
                    stream,
                    pool,
                    self.searches[p],
                    range,
                )
            });
            if let Some(nn) = next {
                self.blocks.get_mut(nn).prev = Some(r);
            }
            self.unmapped[p].insert((stream, address + bytes, r));
            let b = self.blocks.get_mut(id);
            b.next = Some(r);
            b.size = bytes;
            rest = Some(r);
        }
        let (prev, next) = {
            let b = self.blocks.get_mut(id);
            b.backing = Backing::Mapped;
            (b.prev, b.next)
        };
        // Blocks of ranges never count as inactive split (rule 19d): the net is not needed.
        let _ = self.absorb_neighbours(id, prev, next, Backing::Mapped);
        let gc_base = self.searches[p];
        let b = self.blocks.get_mut(id);
        b.gc_base = gc_base;
        let key = (b.stream, b.size, b.address, id);
        self.free_insert(p, key);
        (id, rest)
    }

    /// Rule 19e: unmap the whole pages inside every free mapped block of the pool's ranges, in
    /// free-set order as listed before any change.
    pub(super) fn unmap_free_pages(&mut self, pool: Pool) -> Result<(), Error> {
        if self.ranges.is_empty() {
            return Ok(());
        }
        let listed: Vec<BlockId> = self.free[pool.index()]
            .iter()
            .map(|k| k.3)
            .filter(|&id| self.blocks.get(id).range.is_some())
            .collect();
        for id in listed {
            self.unmap_block(id)?;
        }
        Ok(())
    }

    /// Rule 19e: unmap the whole pages inside the free block `id`; a range left as one unmapped
    /// block gives its address space back.
    /// Takes the free mapped block `id` out of the free set and narrows it to `[start, end)`
    /// (`end = start + bytes`), now of `backing`: the parts before and after, those of nonzero
    /// size, become free blocks in the free set. Returns its neighbours then. Rule 19e's
    /// unmapping and rule 22c's carving both cut a free block so.
    pub(super) fn cut_out(
        &mut self,
        id: BlockId,
        start: u64,
        bytes: u64,
        backing: Backing,
    ) -> (Option<BlockId>, Option<BlockId>) {
        let (address, size, pool, stream, base) = {
            let b = self.blocks.get(id);
            debug_assert!(b.free_mapped());
            (
                b.address,
                b.size,
                b.pool,
                b.stream,
                b.range.expect("only blocks of ranges are cut"),
            )
        };
        let p = pool.index();
        let end = start + bytes;
        self.free_remove(p, &(stream, size, address, id));
        let gc_base = self.searches[p];
        let piece =
            |address: u64, size: u64| Block::free(address, size, stream, pool, gc_base, Some(base));
        if start > address {
            let prev = self.blocks.get(id).prev;
            let before = self.blocks.insert(Block {
                prev,
                next: Some(id),
                ..piece(address, start - address)
            });
            if let Some(pp) = prev {
                self.blocks.get_mut(pp).next = Some(before);
            }
            self.blocks.get_mut(id).prev = Some(before);
            self.free_insert(p, (stream, start - address, address, before));
        }
        if address + size > end {
            let next = self.blocks.get(id).next;
            let after = self.blocks.insert(Block {
                prev: Some(id),
                next,
                ..piece(end, address + size - end)
            });
            if let Some(nn) = next {
                self.blocks.get_mut(nn).prev = Some(after);
            }
            self.blocks.get_mut(id).next = Some(after);
            self.free_insert(p, (stream, address + size - end, end, after));
        }
        {
            let b = self.blocks.get_mut(id);
            b.address = start;
            b.size = bytes;
            b.backing = backing;
            (b.prev, b.next)
        }
    }

    fn unmap_block(&mut self, id: BlockId) -> Result<(), Error> {
        let (pool, stream, base) = {
            let b = self.blocks.get(id);
            debug_assert!(b.free_mapped());
            let base = b
                .range
                .expect("rule 19e: only blocks of ranges are unmapped");
            (b.pool, b.stream, base)
        };
        let Some((first, end)) = self.whole_handles(id) else {
            return Ok(());
        };
        let bytes = end - first;
        // Rule 23h: the views mapping these home slots go first.
        if self.views.is_some() {
            self.destroy_views_over(first, end)?;
        }
        self.backend.unmap(first, bytes, stream)?;
        if !self.handles.is_empty() {
            let gone: Vec<u64> = self.handles.range(first..end).map(|(&a, _)| a).collect();
            for a in gone {
                self.handles.remove(&a);
            }
        }
        let (prev, next) = self.cut_out(id, first, bytes, Backing::Unmapped);
        self.pages_unmapped(base, first, bytes, true);
        let _ = self.absorb_neighbours(id, prev, next, Backing::Unmapped);
        self.reserved -= bytes;
        self.stats.reserved_bytes.decrease(pool, bytes);
        self.stats.num_device_free += 1;
        self.trace(TraceAction::SegmentUnmap, first, bytes, stream);
        self.settle_unmapped(id)
    }

    /// Rules 19e and 22g: the unmapped block `id` (merged with its unmapped neighbours) enters
    /// the unmapped set; a range it leaves as one unmapped block gives its address space back.
    pub(super) fn settle_unmapped(&mut self, id: BlockId) -> Result<(), Error> {
        let b = self.blocks.get(id);
        let (whole, at, stream, p) = (!b.is_split(), b.address, b.stream, b.pool.index());
        let base = b.range.expect("an unmapped block is a block of a range");
        self.unmapped[p].insert((stream, at, id));
        if whole {
            let range = self.ranges[&base];
            self.backend.release_reservation(base, range.size)?;
            self.unmapped[p].remove(&(stream, at, id));
            self.blocks.remove(id);
            self.ranges.remove(&base);
            self.drop_range_pages(base);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::backend::StreamId;
    use crate::backend::sim::{SIM_BASE_ADDRESS, SimDevice};
    use crate::block::BlockPhase;
    use crate::policy::CachingCore;
    use crate::settings::Settings;

    const MIB: u64 = 1 << 20;
    const S: StreamId = StreamId(0);

    fn core(capacity: u64) -> CachingCore<SimDevice> {
        let settings = Settings {
            expandable_segments: true,
            ..Settings::pytorch()
        };
        CachingCore::new(SimDevice::new(capacity), settings).unwrap()
    }

    #[test]
    fn a_range_grows_by_whole_pages_and_requests_tile_it() {
        let mut c = core(1 << 30);
        let base = SIM_BASE_ADDRESS;
        // One 20 MiB page is mapped at the range's start; the request takes its lower part.
        assert_eq!(c.malloc(3 * MIB, S).unwrap(), base);
        assert_eq!(c.stats().reserved_bytes.all.current, 20 * MIB as i64);
        assert_eq!(c.stats().num_device_alloc, 1);
        // The next request fits in the same page: no new mapping.
        assert_eq!(c.malloc(3 * MIB, S).unwrap(), base + 3 * MIB);
        assert_eq!(c.stats().num_device_alloc, 1);
        // 30 MiB: the free 14 MiB at the end grows by one more page, merged into one block.
        assert_eq!(c.malloc(30 * MIB, S).unwrap(), base + 6 * MIB);
        assert_eq!(c.stats().reserved_bytes.all.current, 40 * MIB as i64);
        assert_eq!(c.stats().num_device_alloc, 2);
        // No segment of rule 8 was made, and nothing counts as inactive split.
        assert_eq!(c.stats().segment.all.current, 0);
        assert_eq!(c.stats().inactive_split.all.current, 0);
        let segs = c.segments();
        assert_eq!(segs.len(), 1);
        assert!(segs[0].expandable);
        assert_eq!((segs[0].address, segs[0].size), (base, 40 * MIB));
        let sizes: Vec<u64> = segs[0].blocks.iter().map(|b| b.size).collect();
        assert_eq!(sizes, [3 * MIB, 3 * MIB, 30 * MIB, 4 * MIB]);
        assert_eq!(segs[0].blocks[3].state, BlockPhase::Free);
        c.check_invariants().unwrap();
    }

    #[test]
    fn empty_cache_unmaps_every_free_page_and_gives_the_range_back() {
        let mut c = core(1 << 30);
        let a = c.malloc(3 * MIB, S).unwrap();
        let b = c.malloc(30 * MIB, S).unwrap();
        c.free(a).unwrap();
        c.empty_cache().unwrap();
        // Only the page under the live block stays: [3, 40) MiB holds it, [0, 20) is partly free.
        assert_eq!(c.stats().reserved_bytes.all.current, 40 * MIB as i64);
        c.free(b).unwrap();
        c.empty_cache().unwrap();
        assert_eq!(c.stats().reserved_bytes.all.current, 0);
        assert_eq!(c.stats().num_device_free, 1);
        assert!(c.segments().is_empty());
        assert_eq!(c.backend().used(), 0);
        assert_eq!(c.backend().reservations().count(), 0);
        c.check_invariants().unwrap();
    }

    #[test]
    fn best_fit_prefers_a_hole_to_the_block_that_can_grow() {
        let mut c = core(1 << 30);
        let base = SIM_BASE_ADDRESS;
        let a = c.malloc(10 * MIB, S).unwrap();
        let _b = c.malloc(5 * MIB, S).unwrap();
        c.free(a).unwrap();
        // Free: a 10 MiB hole at the base and 5 MiB at the end of the mapped part. Rule 6 alone
        // would take the 5 MiB block; its reach (5 MiB + the unmapped rest) is larger.
        assert_eq!(c.malloc(4 * MIB, S).unwrap(), base);
        c.check_invariants().unwrap();
    }

    #[test]
    fn a_map_that_does_not_fit_fails_and_the_out_of_memory_path_unmaps_and_retries() {
        // 50 MiB: ranges of 60 MiB (three 20 MiB pages).
        let mut c = core(50 * MIB);
        let a = c.malloc(30 * MIB, S).unwrap();
        c.free(a).unwrap();
        // 45 MiB: growing the free 40 MiB by one page would need 60 MiB: the step fails; the
        // release unmaps the 40 MiB and gives the range back; the retry maps 60 MiB: fails too.
        assert!(c.malloc(45 * MIB, S).is_err());
        assert_eq!(c.stats().num_alloc_retries, 1);
        assert_eq!(c.stats().num_ooms, 1);
        assert_eq!(c.stats().reserved_bytes.all.current, 0);
        // 38 MiB fits after the release: two pages.
        c.malloc(38 * MIB, S).unwrap();
        assert_eq!(c.stats().reserved_bytes.all.current, 40 * MIB as i64);
        c.check_invariants().unwrap();
    }

    /// Rule 19j's settings: 2 MiB pages, map steps of at least `threshold` MiB one handle.
    fn handles_core(threshold: u64) -> CachingCore<SimDevice> {
        let settings = Settings {
            expandable_segments: true,
            expandable_page_size: 2 * MIB,
            expandable_handle_size: Some(threshold * MIB),
            ..Settings::pytorch()
        };
        CachingCore::new(SimDevice::new(1 << 30), settings).unwrap()
    }

    #[test]
    fn a_map_step_of_the_threshold_or_more_is_one_handle() {
        let mut c = handles_core(8);
        c.malloc(10 * MIB, S).unwrap();
        assert_eq!(c.backend().handles_created(), 1, "five pages, one handle");
        c.malloc(6 * MIB, S).unwrap();
        assert_eq!(
            c.backend().handles_created(),
            4,
            "under the threshold: one per page"
        );
        assert_eq!(
            c.stats().num_device_alloc,
            2,
            "the statistic counts map steps"
        );
        c.check_invariants().unwrap();
    }

    #[test]
    fn a_handle_of_several_pages_is_unmapped_only_whole() {
        let mut c = handles_core(8);
        let big = c.malloc(10 * MIB, S).unwrap();
        c.free(big).unwrap();
        let small = c.malloc(3 * MIB, S).unwrap();
        // [3, 10) MiB is free and holds whole pages, but no whole handle.
        c.empty_cache().unwrap();
        assert_eq!(c.stats().reserved_bytes.all.current, 10 * MIB as i64);
        assert_eq!(c.stats().num_device_free, 0);
        c.free(small).unwrap();
        c.empty_cache().unwrap();
        assert_eq!(c.stats().reserved_bytes.all.current, 0);
        assert_eq!(
            c.stats().num_device_free,
            1,
            "one unmap of the whole handle"
        );
        assert_eq!(c.backend().used(), 0);
        c.check_invariants().unwrap();
    }

    #[test]
    fn reclaim_takes_whole_handles_only() {
        let settings = Settings {
            expandable_segments: true,
            expandable_page_size: 2 * MIB,
            expandable_handle_size: Some(4 * MIB),
            reclaim_headroom: Some(0.0),
            ..Settings::pytorch()
        };
        let mut c = CachingCore::new(SimDevice::new(1 << 30), settings).unwrap();
        // [0, 8) one handle, [8, 16) another; a 2 MiB block keeps the first one in use.
        let a = c.malloc(8 * MIB, S).unwrap();
        let b = c.malloc(8 * MIB, S).unwrap();
        c.free(a).unwrap();
        let pin = c.malloc(2 * MIB, S).unwrap();
        c.free(b).unwrap();
        // 16 MiB reserved, 2 MiB in use, high-water 16 MiB: a 12 MiB request on stream 1 is
        // over the limit (16 + 12 > 16) and reclaim may only take the whole handle [8, 16).
        let before = c.stats().num_device_free;
        c.malloc(12 * MIB, StreamId(1)).unwrap();
        assert_eq!(c.stats().num_device_free, before + 1);
        assert_eq!(
            c.stats().reserved_bytes.all.current,
            (8 + 12) as i64 * MIB as i64
        );
        c.free(pin).unwrap();
        c.check_invariants().unwrap();
    }

    #[test]
    fn the_small_pool_grows_by_two_mebibyte_pages() {
        let mut c = core(1 << 30);
        c.malloc(4096, S).unwrap();
        assert_eq!(c.stats().reserved_bytes.small_pool.current, 2 * MIB as i64);
        c.check_invariants().unwrap();
    }

    #[test]
    fn a_backend_without_virtual_memory_refuses_the_setting() {
        #[derive(Debug)]
        struct NoVm(SimDevice);
        impl crate::backend::Backend for NoVm {
            fn allocate(&mut self, size: u64) -> Result<u64, crate::backend::BackendError> {
                self.0.allocate(size)
            }
            fn free(
                &mut self,
                address: u64,
                size: u64,
            ) -> Result<(), crate::backend::BackendError> {
                self.0.free(address, size)
            }
            fn mem_info(
                &mut self,
            ) -> Result<crate::backend::MemInfo, crate::backend::BackendError> {
                self.0.mem_info()
            }
            fn record_event(
                &mut self,
                s: StreamId,
            ) -> Result<crate::backend::EventId, crate::backend::BackendError> {
                self.0.record_event(s)
            }
            fn query_event(
                &mut self,
                e: crate::backend::EventId,
            ) -> Result<bool, crate::backend::BackendError> {
                self.0.query_event(e)
            }
            fn synchronize_event(
                &mut self,
                e: crate::backend::EventId,
            ) -> Result<(), crate::backend::BackendError> {
                self.0.synchronize_event(e)
            }
            fn destroy_event(&mut self, e: crate::backend::EventId) {
                self.0.destroy_event(e)
            }
        }
        let settings = Settings {
            expandable_segments: true,
            ..Settings::pytorch()
        };
        let err = CachingCore::new(NoVm(SimDevice::new(1 << 30)), settings).unwrap_err();
        assert!(err.to_string().contains("expandable_segments"), "{err}");
    }
}

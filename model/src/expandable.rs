//! Rule 19: expandable segments (PyTorch's `expandable_segments:True`).
//!
//! Memory comes from *ranges* instead of rule 8's segments. A range is address space reserved
//! once on the device for one pool and one stream, and kept in the model's list of segments
//! marked `expandable`. It is tiled, in address order, by *mapped* blocks (free, allocated or
//! pending, handled by rules 5–15 like any block) and *unmapped* blocks (`mapped == false`:
//! address space with no memory behind it, page-aligned at both ends, never two adjacent,
//! in no free set). Only mapped bytes count as reserved.
//!
//! This file holds what rule 19 changes: the best-fit walk by reach (19a), growing a range
//! block by map steps (19b), the split rule (19c), unmapping on release (19e), the layout
//! (19h) and the invariants of ranges. Rules 19d (no inactive split) and 19f (rules 11 and 12
//! release no range block) live where those statistics and free sets are computed
//! (`stats.rs`, `state.rs`).

use crate::rules::{self, MIN_BLOCK_SIZE, Pool};
use crate::state::{self, Block, BlockState, FreeEntry, Segment};
use crate::{Model, ModelSegment};

/// A range as the invariant checker compares it with the device: base, size, and the mapped
/// runs as `(address, bytes)`.
type RangeShape = (u64, u64, Vec<(u64, u64)>);

/// Rule 19: the page of a small-pool range (2 MiB, whatever `expandable_page_mb` says).
pub(crate) const SMALL_PAGE: u64 = 2 << 20;

/// Rule 19: the size of a range whose page is `page` on a device of `capacity` bytes:
/// `page × ⌈(capacity + ⌊capacity / 8⌋) / page⌉`. `None` when that is zero (a device without
/// memory) or does not fit in 64 bits; then no range is made and growing fails.
pub(crate) fn range_size(page: u64, capacity: u64) -> Option<u64> {
    let page = u128::from(page);
    let wanted = u128::from(capacity) + u128::from(capacity / 8);
    let size = wanted.div_ceil(page) * page;
    match u64::try_from(size) {
        Ok(0) | Err(_) => None,
        Ok(size) => Some(size),
    }
}

/// Rules 19e, 20: the whole pages inside `[start, end)` of a range based at `base` whose page
/// is `page` (pages counted from the base), as `(first, last)` with `first < last`; `None`
/// when the block holds no whole page.
pub(crate) fn whole_pages(base: u64, page: u64, start: u64, end: u64) -> Option<(u64, u64)> {
    let first = base + (start - base).div_ceil(page) * page;
    let last = base + (end - base) / page * page;
    (first < last).then_some((first, last))
}

/// Rule 19a: from the free-set entry at `index` (rule 6's candidate), while the candidate is
/// a block of a range and the next entry is of the same stream with a smaller reach, the next
/// entry becomes the candidate. The final candidate's index.
pub(crate) fn walk_by_reach(free: &[FreeEntry], index: usize) -> usize {
    let mut candidate = index;
    while free[candidate].expandable
        && candidate + 1 < free.len()
        && free[candidate + 1].stream == free[candidate].stream
        && free[candidate + 1].reach < free[candidate].reach
    {
        candidate += 1;
    }
    candidate
}

impl Model {
    /// Rule 19: the page of a range of `pool`: 2 MiB in the small pool, `expandable_page_mb`
    /// (20 MiB unless set) in the large pool.
    pub(crate) fn page_size(&self, pool: Pool) -> u64 {
        match pool {
            Pool::Small => SMALL_PAGE,
            Pool::Large => self.config.expandable_page,
        }
    }

    /// Rule 13, or rule 19c under expandable segments: whether a found block of `block_size`
    /// bytes is split to serve a request rounded to `rounded` bytes.
    pub(crate) fn splits(&self, pool: Pool, block_size: u64, rounded: u64) -> bool {
        if self.config.expandable_segments {
            // Rule 19c: whenever at least 512 B remain, in both pools, whatever
            // max_split_size says (PyTorch decides by the setting, so this holds for a block
            // of an adopted segment too).
            block_size - rounded >= MIN_BLOCK_SIZE
        } else {
            rules::should_split(pool, block_size, rounded, self.config.max_split_size)
        }
    }

    /// Rule 19b: grows a free block of a range of `pool` on `stream` to at least `rounded`
    /// bytes, mapping pages as needed: the block's address, or `None` when the memory
    /// fraction (checked with rule 4's `segment_size`) or the device refuses. Pages mapped by
    /// map steps before a refused one stay mapped, as free memory. Rule 20 (reclaim, for a
    /// request of `requested` bytes) comes between the memory-fraction check and the start.
    pub(crate) fn grow_range(
        &mut self,
        pool: Pool,
        stream: u64,
        rounded: u64,
        requested: u64,
        segment_size: u64,
    ) -> Option<crate::policy::Grown> {
        // Rule 19b keeps rule 8's memory fraction check, with rule 4's segment size (PyTorch:
        // `total_allocated_memory + alloc_size > allowed_memory_maximum`).
        if let Some(allowed) = self.allowed
            && u128::from(self.reserved()) + u128::from(segment_size) > u128::from(allowed)
        {
            return None;
        }
        if self.aliasing() {
            // Rule 22f: rule 20's limit, computed as written, once per request (at its first
            // growth); rule 20's unmapping never runs.
            if self.request_limit.is_none()
                && let Some(headroom) = self.config.reclaim_headroom
            {
                self.request_limit = Some(self.reclaim_limit(headroom, requested));
            }
        } else {
            // Rule 23f: over rule 20's limit, a view first (its request handed out).
            if let Some(address) = self.view_before_reclaim(pool, stream, rounded, requested) {
                return Some(crate::policy::Grown::View(address));
            }
            // Rule 20: before growing, reclaim free pages if reserved memory would otherwise
            // exceed the headroom over the requested high-water. Read as coming after the
            // memory fraction check, which decides whether rule 19b grows at all ("about to
            // grow"); the differential tests found the allocator reading it so too.
            self.reclaim_before_growing(pool, stream, rounded, requested);
        }
        // Rule 19b: the start, in an existing range or a new one; rule 22e: and its run.
        let (start, run) = match self.find_start_run(pool, stream, rounded) {
            Some(found) => found,
            None => {
                let base = self.reserve_range(pool, stream)?;
                let (s, _) = state::find_block(&self.segments, base).expect("the new range");
                (base, (base, base + self.segments[s].size))
            }
        };
        let page = self.page_size(pool);
        // Rule 19b: map steps until the start is a free block of at least `rounded` bytes.
        let mut before: Option<(bool, u64)> = None;
        loop {
            let (s, b) = state::find_block(&self.segments, start).expect("the start exists");
            let blocks = &self.segments[s].blocks;
            let block = &blocks[b];
            if block.mapped && block.size >= rounded {
                break;
            }
            // Every step grows the start (or maps it): the growth ends.
            assert!(
                before.is_none_or(|(mapped, size)| (!mapped && block.mapped)
                    || (mapped == block.mapped && block.size > size)),
                "growth from {start:#x} makes no progress: {:?} after {before:?}",
                (block.mapped, block.size)
            );
            before = Some((block.mapped, block.size));
            let (target, bytes) = if !block.mapped {
                // The start is unmapped (or lent): map its first bytes.
                (b, rounded.min(block.size))
            } else {
                // The start is free and mapped: map the first bytes of the unmapped (or lent)
                // block after it.
                let next = &blocks[b + 1];
                assert!(!next.mapped, "a free start is followed by unmapped space");
                (b + 1, (rounded - block.size).min(next.size))
            };
            let (lent, target) = {
                let target = &self.segments[s].blocks[target];
                (target.lent, target.address)
            };
            let mapped = if lent {
                // Rule 22e: a step on a lent block re-homes the slots covering its bytes, in
                // whole pages: no device call.
                self.rehome(target, bytes.div_ceil(page), true);
                true
            } else {
                // Rule 22f (borrowing first, when it is on), then rule 19b.
                self.map_into_unmapped(target, bytes, run)
            };
            if !mapped {
                return None;
            }
        }
        Some(crate::policy::Grown::Block(start))
    }

    /// Rule 19b's map step of `bytes` (rounded up to whole pages) at the first slots of the
    /// unmapped block at `address`, for a growth whose run is `run`: under page aliasing with
    /// a limit, first rule 22f's borrowing; then new pages for what is left. False when a
    /// device call failed (earlier steps stay).
    fn map_into_unmapped(&mut self, address: u64, bytes: u64, run: (u64, u64)) -> bool {
        let (s, _) = state::find_block(&self.segments, address).expect("the unmapped block");
        let page = self.page_size(self.segments[s].pool);
        let bytes = bytes.div_ceil(page) * page;
        let mut taken = 0;
        if self.aliasing()
            && let Some(limit) = self.request_limit
        {
            let reserved = u128::from(self.reserved());
            let wanted = u128::from(bytes);
            if reserved + wanted > limit {
                let over = (reserved + wanted - limit).div_ceil(u128::from(page));
                let n = (bytes / page).min(u64::try_from(over).unwrap_or(u64::MAX));
                match self.borrow(address, n, run) {
                    Some(pages) => taken = pages,
                    None => return false,
                }
            }
        }
        let rest = bytes - taken * page;
        if rest == 0 {
            return true;
        }
        let (s, b) =
            state::find_block(&self.segments, address + taken * page).expect("the unmapped rest");
        self.map_step(s, b, rest)
    }

    /// Rule 19b: the start for a request of `rounded` bytes on `stream` in `pool` (see
    /// [`Model::find_start_run`]).
    pub(crate) fn find_start(&self, pool: Pool, stream: u64, rounded: u64) -> Option<u64> {
        self.find_start_run(pool, stream, rounded)
            .map(|(start, _)| start)
    }

    /// Rule 19b: the start for a request of `rounded` bytes on `stream` in `pool`: among the
    /// unmapped blocks of the pool's ranges of that stream — and (rule 22e) the lent blocks
    /// all of whose slots are usable — in address order, the first that, or whose previous
    /// block when that one is free, begins a run of free, unmapped or such lent blocks of at
    /// least `rounded` bytes, and whose run (rule 22e) holds no two lent slots mapping the same
    /// page and no lent slot whose page's home lies inside it. The start and its run, as
    /// `(first byte, end)`.
    pub(crate) fn find_start_run(
        &self,
        pool: Pool,
        stream: u64,
        rounded: u64,
    ) -> Option<(u64, (u64, u64))> {
        // Rule 22e: a lent block counts when all its slots are usable.
        let usable_lent = |block: &Block| block.lent && self.usable(block.address, None);
        // The segments are sorted by address, so this visits unmapped blocks in address order.
        for segment in &self.segments {
            if !segment.expandable || segment.pool != pool || segment.stream != stream {
                continue;
            }
            let blocks = &segment.blocks;
            for b in 0..blocks.len() {
                if !(blocks[b].is_unmapped() || usable_lent(&blocks[b])) {
                    continue;
                }
                // Take the unmapped (or lent) block, or the free block before it.
                let from = if b > 0 && blocks[b - 1].in_free_set() {
                    b - 1
                } else {
                    b
                };
                // Sum the sizes from there on while each block is free, unmapped or lent
                // with all its slots usable.
                let mut sum: u64 = 0;
                let mut i = from;
                while sum < rounded
                    && i < blocks.len()
                    && (blocks[i].in_free_set()
                        || blocks[i].is_unmapped()
                        || usable_lent(&blocks[i]))
                {
                    sum += blocks[i].size;
                    i += 1;
                }
                if sum < rounded {
                    continue;
                }
                let run = (
                    blocks[from].address,
                    blocks[i - 1].address + blocks[i - 1].size,
                );
                // Rule 22e: a run whose lent slots map a page twice, or one whose home lies
                // inside the run, is not taken.
                if self.run_is_takeable(&blocks[from..i], run) {
                    return Some((blocks[from].address, run));
                }
            }
        }
        None
    }

    /// Rule 19b: reserves a new range for `pool` and `stream`, one unmapped block; its base.
    /// Reserving counts in no statistic. `None` when the range would be empty (a device of
    /// zero bytes).
    fn reserve_range(&mut self, pool: Pool, stream: u64) -> Option<u64> {
        // The capacity is asked of the device when the range is made.
        let page = self.page_size(pool);
        let size = range_size(page, self.device.capacity())?;
        let base = self.device.reserve(size, page);
        let range = Segment {
            address: base,
            size,
            stream,
            pool,
            blocks: vec![Block::unmapped(base, size)],
            expandable: true,
        };
        let index = self.segments.partition_point(|s| s.address < base);
        self.segments.insert(index, range);
        Some(base)
    }

    /// Rule 19b: one map step: the first `bytes` of the unmapped block at (`s`, `b`), rounded
    /// up to whole pages, are mapped and become one free block that merges with free mapped
    /// neighbours; the rest stays unmapped after it. False (and nothing changes) when the
    /// device has no room.
    fn map_step(&mut self, s: usize, b: usize, bytes: u64) -> bool {
        let pool = self.segments[s].pool;
        let page = self.page_size(pool);
        let unmapped = &self.segments[s].blocks[b];
        assert!(unmapped.is_unmapped() && bytes > 0 && bytes <= unmapped.size);
        let address = unmapped.address;
        // Whole pages; an unmapped block starts on a page boundary and ends on one.
        let mapped = bytes.div_ceil(page) * page;
        // Rule 19j: a step of at least the handle threshold is one handle of all its bytes;
        // a smaller one, one handle per page.
        let one_handle = self
            .config
            .expandable_handle
            .is_some_and(|t| mapped >= t && mapped > page);
        let made = if one_handle {
            self.device.map_handle(address, mapped)
        } else {
            self.device.map(address, mapped)
        };
        if !made {
            return false;
        }
        if one_handle {
            self.handles.insert(address, mapped);
            self.handles_made += 1;
        } else {
            self.handles_made += mapped / page;
        }
        // Rule 22a: each slot maps a new page, whose home it is.
        self.create_pages(address, mapped, page);
        self.install_free_block(s, b, mapped);
        // Statistics: reserved_bytes rises by the mapped bytes (settled from the state); one
        // device allocation; the segment statistic does not change.
        self.stats.num_device_alloc += 1;
        self.settle_stats();
        true
    }

    /// Rules 19b, 22f: the first `bytes` (whole pages) of the unmapped block at (`s`, `b`),
    /// just mapped, become one free block that merges with free mapped neighbours; the rest
    /// stays unmapped after it.
    pub(crate) fn install_free_block(&mut self, s: usize, b: usize, bytes: u64) {
        let now = self.search_counter(self.segments[s].pool);
        let blocks = &mut self.segments[s].blocks;
        let (address, size) = (blocks[b].address, blocks[b].size);
        assert!(blocks[b].is_unmapped() && bytes <= size);
        blocks[b] = Block::free(address, bytes, now);
        if bytes < size {
            blocks.insert(b + 1, Block::unmapped(address + bytes, size - bytes));
        }
        self.merge_free_neighbours(s, b);
    }

    /// Merges the free mapped block at (`s`, `b`) with its free mapped neighbours (as rule 10
    /// does); the merged block enters the free set now. Its index.
    pub(crate) fn merge_free_neighbours(&mut self, s: usize, b: usize) -> usize {
        let now = self.search_counter(self.segments[s].pool);
        let blocks = &mut self.segments[s].blocks;
        let mut b = b;
        if b > 0 && blocks[b - 1].in_free_set() {
            let this = blocks.remove(b);
            b -= 1;
            blocks[b].size += this.size;
        }
        if b + 1 < blocks.len() && blocks[b + 1].in_free_set() {
            let next = blocks.remove(b + 1);
            blocks[b].size += next.size;
        }
        blocks[b].free_since = now;
        b
    }

    /// Rule 19e: the free mapped blocks of `pool`'s ranges, listed in free-set order before
    /// any change, each unmap the whole pages inside them.
    pub(crate) fn unmap_free_range_blocks(&mut self, pool: Pool) {
        let listed: Vec<u64> = state::free_set(&self.segments, pool)
            .into_iter()
            .filter(|e| e.expandable)
            .map(|e| e.address)
            .collect();
        for address in listed {
            self.unmap_whole_pages(address);
        }
    }

    /// Rule 19e: the free block of a range at `address` unmaps the whole pages inside it:
    /// none → nothing; otherwise the parts before and after stay free mapped blocks, the
    /// unmapped part merges with unmapped neighbours, and a range left as one unmapped block
    /// is given back.
    pub(crate) fn unmap_whole_pages(&mut self, address: u64) {
        let (s, b) = state::find_block(&self.segments, address).expect("a listed block exists");
        let range = &self.segments[s];
        let (base, pool) = (range.address, range.pool);
        let page = self.page_size(pool);
        let block = &range.blocks[b];
        assert!(block.in_free_set(), "only free mapped blocks are unmapped");
        let (start, end) = (block.address, block.address + block.size);
        let Some((first, last)) = self.whole_handles(base, page, start, end) else {
            return;
        };
        // Rule 23h: the views mapping these home slots go first.
        self.destroy_views_mapping(first, last);
        self.device.unmap(first, last - first);
        // Their pages had no other mapping: they are gone, and (rule 19j) their handles.
        self.drop_pages(first, last - first, page);
        let gone: Vec<u64> = self.handles.range(first..last).map(|(&a, _)| a).collect();
        for a in gone {
            self.handles.remove(&a);
        }
        let now = self.search_counter(pool);
        let blocks = &mut self.segments[s].blocks;
        let mut pieces = Vec::new();
        if start < first {
            pieces.push(Block::free(start, first - start, now));
        }
        let mut u = b + pieces.len();
        pieces.push(Block::unmapped(first, last - first));
        if last < end {
            pieces.push(Block::free(last, end - last, now));
        }
        blocks.splice(b..=b, pieces);
        // The unmapped part merges with unmapped neighbours.
        if u > 0 && blocks[u - 1].is_unmapped() {
            let this = blocks.remove(u);
            u -= 1;
            blocks[u].size += this.size;
        }
        if u + 1 < blocks.len() && blocks[u + 1].is_unmapped() {
            let next = blocks.remove(u + 1);
            blocks[u].size += next.size;
        }
        // Statistics: reserved_bytes falls by the bytes (settled from the state); one device
        // free.
        self.stats.num_device_free += 1;
        // A range left as one unmapped block gives its address space back.
        if blocks.len() == 1 {
            self.segments.remove(s);
            self.device.release_reservation(base);
        }
        self.settle_stats();
    }

    /// Rule 19j: the handle holding the mapped page at `slot`, as `(first byte, bytes)`: a
    /// handle of several pages when one covers it, else the page itself.
    pub(crate) fn handle_at(&self, slot: u64, page: u64) -> (u64, u64) {
        match self.handles.range(..=slot).next_back() {
            Some((&a, &bytes)) if slot < a + bytes => (a, bytes),
            _ => (slot, page),
        }
    }

    /// Rule 19j: whether the page at `slot` is a handle of its own (not part of a handle of
    /// several pages).
    pub(crate) fn one_page_handle(&self, slot: u64, page: u64) -> bool {
        self.handle_at(slot, page) == (slot, page)
    }

    /// Rules 19e, 19j, 20: the whole handles inside `[start, end)` of the mapped part of a
    /// range based at `base` whose page is `page`: from the first handle lying wholly inside
    /// to the end of the last, as `(first, last)` with `first < last`; `None` when none lies
    /// inside. Without handles of several pages, the whole pages.
    pub(crate) fn whole_handles(
        &self,
        base: u64,
        page: u64,
        start: u64,
        end: u64,
    ) -> Option<(u64, u64)> {
        let (mut slot, last) = whole_pages(base, page, start, end)?;
        let mut found: Option<(u64, u64)> = None;
        while slot < last {
            let (a, bytes) = self.handle_at(slot, page);
            if a >= start && a + bytes <= end {
                found = Some((found.map_or(a, |f| f.0), a + bytes));
            } else if found.is_some() {
                break;
            }
            slot = a + bytes;
        }
        found
    }

    /// Rule 19j: how many handles map steps have made so far (each one
    /// `cuMemCreate` on a GPU: the price of growing, whatever the statistics count).
    pub fn handles_made(&self) -> u64 {
        self.handles_made
    }

    /// Rule 19h: the public view of a range: one expandable segment per maximal run of
    /// mapped blocks, at its first block's address, as large as its blocks together. Lent
    /// blocks are not listed and end a run (rule 22a).
    pub(crate) fn range_view(range: &Segment) -> Vec<ModelSegment> {
        let mut runs: Vec<ModelSegment> = Vec::new();
        let mut in_run = false;
        for block in &range.blocks {
            if !block.mapped {
                in_run = false;
                continue;
            }
            if !in_run {
                runs.push(ModelSegment {
                    address: block.address,
                    size: 0,
                    stream: range.stream,
                    small: range.pool == Pool::Small,
                    blocks: Vec::new(),
                    expandable: true,
                });
                in_run = true;
            }
            let run = runs.last_mut().expect("a run was started");
            run.size += block.size;
            run.blocks.push(block.view());
        }
        runs
    }

    /// The invariants of one range: its size is rule 19's; its blocks tile it exactly, are
    /// nonzero multiples of 512; unmapped blocks are page-aligned at both ends (relative to
    /// the base), never adjacent, and carry nothing; free mapped blocks are never adjacent;
    /// each mapped block's fields agree with its state.
    pub(crate) fn check_range(&self, range: &Segment) -> Result<(), String> {
        // Names built only when a message prints them (this check runs after every operation).
        let name = std::fmt::from_fn(|f| write!(f, "range {:#x}", range.address));
        let page = self.page_size(range.pool);
        if Some(range.size) != range_size(page, self.device.capacity()) {
            return Err(format!(
                "{name}: {} bytes is not rule 19's size",
                range.size
            ));
        }
        let mut expected_address = range.address;
        for (i, block) in range.blocks.iter().enumerate() {
            let here = std::fmt::from_fn(|f| write!(f, "{name}, block {:#x}", block.address));
            if block.address != expected_address {
                return Err(format!(
                    "{here}: expected at {expected_address:#x} (gap or overlap)"
                ));
            }
            if block.size < MIN_BLOCK_SIZE || !block.size.is_multiple_of(MIN_BLOCK_SIZE) {
                return Err(format!(
                    "{here}: size {} is not a multiple of 512",
                    block.size
                ));
            }
            expected_address += block.size;
            let next = range.blocks.get(i + 1);
            let events = self
                .events
                .iter()
                .filter(|e| e.block == block.address)
                .count();
            if block.lent {
                // Rule 22a: lent blocks are checked with the pages (`aliasing.rs`).
                continue;
            }
            if !block.mapped {
                let offset = block.address - range.address;
                if !offset.is_multiple_of(page) || !(offset + block.size).is_multiple_of(page) {
                    return Err(format!("{here}: unmapped block not aligned to the page"));
                }
                if next.is_some_and(Block::is_unmapped) {
                    return Err(format!("{here}: two adjacent unmapped blocks"));
                }
                let empty = block.state == BlockState::Free
                    && block.requested == 0
                    && block.stream_uses.is_empty()
                    && block.pending_events == 0
                    && events == 0;
                if !empty {
                    return Err(format!("{here}: unmapped block holds state: {block:?}"));
                }
                continue;
            }
            let fine = match block.state {
                BlockState::Free => {
                    !next.is_some_and(Block::in_free_set)
                        && block.requested == 0
                        && block.stream_uses.is_empty()
                        && block.pending_events == 0
                        && events == 0
                        && block.free_since <= self.search_counter(range.pool)
                }
                BlockState::Allocated => {
                    block.requested > 0
                        && block.requested <= block.size
                        && block.pending_events == 0
                        && events == 0
                        && block.stream_uses.windows(2).all(|w| w[0] < w[1])
                        && !block.stream_uses.contains(&range.stream)
                }
                BlockState::Pending => {
                    block.requested > 0
                        && block.requested <= block.size
                        && block.stream_uses.is_empty()
                        && block.pending_events > 0
                        && block.pending_events == events
                }
                // Rule 23b: a held piece carries nothing (its view is checked in
                // `stitching.rs`).
                BlockState::Held => {
                    block.requested == 0
                        && block.stream_uses.is_empty()
                        && block.pending_events == 0
                        && events == 0
                }
            };
            if !fine {
                return Err(format!(
                    "{here}: inconsistent {:?} block: {block:?}",
                    block.state
                ));
            }
        }
        if expected_address != range.address + range.size {
            return Err(format!(
                "{name}: blocks end at {expected_address:#x}, not at its end"
            ));
        }
        Ok(())
    }

    /// The device's reservations are exactly the ranges, each with exactly the range's
    /// mapped and lent blocks mapped; the device's used bytes are the mapped bytes (each page
    /// once, under its home) plus the classic segments' bytes.
    pub(crate) fn check_device_ranges(&self) -> Result<(), String> {
        let mut reservations: Vec<RangeShape> = self
            .device
            .reservations()
            .iter()
            // Rule 23a: views are reservations of their own (checked with the views).
            .filter(|r| !self.is_view(r.base))
            .map(|r| (r.base, r.size, r.mapped_runs()))
            .collect();
        reservations.sort_unstable();
        let mut ranges: Vec<RangeShape> = Vec::new();
        for range in self.segments.iter().filter(|s| s.expandable) {
            let mut runs: Vec<(u64, u64)> = Vec::new();
            let mut in_run = false;
            for block in &range.blocks {
                if block.is_unmapped() {
                    in_run = false;
                } else if in_run {
                    runs.last_mut().expect("a run was started").1 += block.size;
                } else {
                    runs.push((block.address, block.size));
                    in_run = true;
                }
            }
            ranges.push((range.address, range.size, runs));
        }
        if reservations != ranges {
            return Err(format!(
                "device reservations {reservations:x?} differ from ranges {ranges:x?}"
            ));
        }
        let mut bytes: u64 = 0;
        for segment in &self.segments {
            for block in segment.blocks.iter().filter(|b| b.mapped) {
                bytes += block.size;
            }
        }
        if self.device.used() != bytes {
            return Err(format!(
                "device used {} differs from the {bytes} mapped and segment bytes",
                self.device.used()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;

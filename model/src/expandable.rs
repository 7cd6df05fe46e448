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
    ) -> Option<u64> {
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
        Some(start)
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
        if !self.device.map(address, mapped) {
            return false;
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
        let Some((first, last)) = whole_pages(base, page, start, end) else {
            return;
        };
        self.device.unmap(first, last - first);
        // Their pages had no other mapping: they are gone.
        self.drop_pages(first, last - first, page);
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
        let name = format!("range {:#x}", range.address);
        let page = self.page_size(range.pool);
        if Some(range.size) != range_size(page, self.device.capacity()) {
            return Err(format!(
                "{name}: {} bytes is not rule 19's size",
                range.size
            ));
        }
        let mut expected_address = range.address;
        for (i, block) in range.blocks.iter().enumerate() {
            let here = format!("{name}, block {:#x}", block.address);
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
mod tests {
    use super::*;
    use crate::device::DEVICE_BASE;
    use crate::{AdoptedBlock, AdoptedSegment, AdoptedState, ModelBlock, ModelConfig, ModelError};

    const MIB: u64 = 1 << 20;
    const BASE: u64 = DEVICE_BASE;

    fn config(capacity: u64) -> ModelConfig {
        let mut config = ModelConfig::pytorch_defaults(capacity);
        config.expandable_segments = true;
        config
    }

    fn model(capacity: u64) -> Model {
        Model::new(config(capacity))
    }

    /// Every range's blocks as `(offset from the range's base, size, state)`, ranges in
    /// address order; the state is "alloc", "free", "pending" or "unmapped".
    fn ranges(m: &Model) -> Vec<Vec<(u64, u64, &'static str)>> {
        m.segments
            .iter()
            .filter(|s| s.expandable)
            .map(|range| {
                range
                    .blocks
                    .iter()
                    .map(|b| {
                        let state = match (b.mapped, b.state) {
                            (false, _) => "unmapped",
                            (true, BlockState::Free) => "free",
                            (true, BlockState::Allocated) => "alloc",
                            (true, BlockState::Pending) => "pending",
                        };
                        (b.address - range.address, b.size, state)
                    })
                    .collect()
            })
            .collect()
    }

    /// Every step keeps the invariants.
    fn malloc(m: &mut Model, size: u64, stream: u64) -> Result<u64, ModelError> {
        let result = m.malloc(size, stream);
        m.check_invariants().unwrap();
        result
    }

    fn free(m: &mut Model, address: u64) {
        m.free(address).unwrap();
        m.check_invariants().unwrap();
    }

    fn empty_cache(m: &mut Model) {
        m.empty_cache();
        m.check_invariants().unwrap();
    }

    #[test]
    fn ranges_are_sized_from_the_capacity_in_whole_pages() {
        // 1 GiB + 128 MiB = 1152 MiB: 57.6 large pages → 58, 576 small pages.
        assert_eq!(range_size(20 * MIB, 1 << 30), Some(1160 * MIB));
        assert_eq!(range_size(SMALL_PAGE, 1 << 30), Some(1152 * MIB));
        // 70 MiB + 8.75 MiB → 4 large pages of 20 MiB, 40 of 2 MiB.
        assert_eq!(range_size(20 * MIB, 70 * MIB), Some(80 * MIB));
        assert_eq!(range_size(2 * MIB, 70 * MIB), Some(80 * MIB));
        // 96 MiB + 12 MiB → 6 pages of 20 MiB, 54 of 2 MiB.
        assert_eq!(range_size(20 * MIB, 96 * MIB), Some(120 * MIB));
        assert_eq!(range_size(2 * MIB, 96 * MIB), Some(108 * MIB));
        assert_eq!(range_size(20 * MIB, 0), None);
    }

    #[test]
    fn a_first_request_maps_one_page_at_the_range_base_and_is_handed_its_start() {
        let mut m = model(1 << 30);
        assert_eq!(malloc(&mut m, 3 * MIB, 0), Ok(BASE));
        assert_eq!(
            ranges(&m),
            vec![vec![
                (0, 3 * MIB, "alloc"),
                (3 * MIB, 17 * MIB, "free"),
                (20 * MIB, 1140 * MIB, "unmapped"),
            ]]
        );
        let st = m.stats();
        assert_eq!(st.reserved_bytes.all.current, (20 * MIB) as i64);
        assert_eq!(st.reserved_bytes.large_pool.current, (20 * MIB) as i64);
        assert_eq!(st.num_device_alloc, 1);
        assert_eq!(st.segment.all.current, 0);
        assert_eq!(st.segment.all.allocated, 0);
        assert_eq!(st.allocation.all.current, 1);
        assert_eq!(m.device_used(), 20 * MIB);
        assert_eq!(
            m.layout(),
            vec![ModelSegment {
                address: BASE,
                size: 20 * MIB,
                stream: 0,
                small: false,
                blocks: vec![
                    ModelBlock {
                        address: BASE,
                        size: 3 * MIB,
                        requested: 3 * MIB,
                        state: BlockState::Allocated,
                    },
                    ModelBlock {
                        address: BASE + 3 * MIB,
                        size: 17 * MIB,
                        requested: 0,
                        state: BlockState::Free,
                    },
                ],
                expandable: true,
            }]
        );
    }

    #[test]
    fn a_second_request_goes_right_after_the_first_without_mapping() {
        let mut m = model(1 << 30);
        malloc(&mut m, 3 * MIB, 0).unwrap();
        assert_eq!(malloc(&mut m, 3 * MIB, 0), Ok(BASE + 3 * MIB));
        assert_eq!(m.stats().num_device_alloc, 1);
        assert_eq!(m.device_used(), 20 * MIB);
        assert_eq!(
            ranges(&m)[0],
            vec![
                (0, 3 * MIB, "alloc"),
                (3 * MIB, 3 * MIB, "alloc"),
                (6 * MIB, 14 * MIB, "free"),
                (20 * MIB, 1140 * MIB, "unmapped"),
            ]
        );
    }

    #[test]
    fn a_larger_request_maps_pages_after_the_free_tail_so_that_it_reaches_the_request() {
        let mut m = model(1 << 30);
        malloc(&mut m, 3 * MIB, 0).unwrap();
        malloc(&mut m, 3 * MIB, 0).unwrap();
        // The free 14 MiB at 6 MiB plus the unmapped space after it reach 30 MiB: one page
        // (16 MiB rounded up to 20) is mapped and merges with the tail.
        assert_eq!(malloc(&mut m, 30 * MIB, 0), Ok(BASE + 6 * MIB));
        assert_eq!(
            ranges(&m)[0],
            vec![
                (0, 3 * MIB, "alloc"),
                (3 * MIB, 3 * MIB, "alloc"),
                (6 * MIB, 30 * MIB, "alloc"),
                (36 * MIB, 4 * MIB, "free"),
                (40 * MIB, 1120 * MIB, "unmapped"),
            ]
        );
        let st = m.stats();
        assert_eq!(st.num_device_alloc, 2);
        assert_eq!(st.reserved_bytes.all.current, (40 * MIB) as i64);
        assert_eq!(m.layout().len(), 1);
        assert_eq!(m.layout()[0].size, 40 * MIB);
    }

    #[test]
    fn freeing_everything_and_emptying_the_cache_unmaps_it_all_and_releases_the_range() {
        let mut m = model(1 << 30);
        let a = malloc(&mut m, 3 * MIB, 0).unwrap();
        let b = malloc(&mut m, 3 * MIB, 0).unwrap();
        let c = malloc(&mut m, 30 * MIB, 0).unwrap();
        for address in [a, b, c] {
            free(&mut m, address);
        }
        assert_eq!(
            ranges(&m)[0],
            vec![(0, 40 * MIB, "free"), (40 * MIB, 1120 * MIB, "unmapped")]
        );
        empty_cache(&mut m);
        let st = m.stats();
        assert_eq!(st.num_device_free, 1);
        assert_eq!(st.num_device_alloc, 2);
        assert_eq!(st.reserved_bytes.all.current, 0);
        assert_eq!(st.reserved_bytes.all.freed, (40 * MIB) as i64);
        assert_eq!(st.reserved_bytes.all.peak, (40 * MIB) as i64);
        assert!(m.layout().is_empty());
        assert!(m.segments.is_empty());
        assert!(m.device.reservations().is_empty());
        assert_eq!(m.device_used(), 0);
    }

    #[test]
    fn unmapping_keeps_the_parts_of_a_free_block_outside_whole_pages() {
        let mut m = model(1 << 30);
        malloc(&mut m, 3 * MIB, 0).unwrap();
        let b = malloc(&mut m, 17 * MIB, 0).unwrap();
        let c = malloc(&mut m, 20 * MIB, 0).unwrap();
        assert_eq!(c, BASE + 20 * MIB);
        free(&mut m, b);
        free(&mut m, c);
        // Free [3, 40) MiB: only the page [20, 40) lies wholly inside it.
        empty_cache(&mut m);
        assert_eq!(
            ranges(&m)[0],
            vec![
                (0, 3 * MIB, "alloc"),
                (3 * MIB, 17 * MIB, "free"),
                (20 * MIB, 1140 * MIB, "unmapped"),
            ]
        );
        assert_eq!(m.stats().num_device_free, 1);
        assert_eq!(m.stats().reserved_bytes.all.current, (20 * MIB) as i64);
        // Nothing whole is left to unmap.
        empty_cache(&mut m);
        assert_eq!(m.stats().num_device_free, 1);
    }

    /// A range on 1 GiB of [A 20][unmapped 20][free 20][unmapped 1100] (MiB), A allocated.
    fn range_with_a_hole(m: &mut Model) {
        let a = malloc(m, 20 * MIB, 0).unwrap();
        let b = malloc(m, 20 * MIB, 0).unwrap();
        let c = malloc(m, 20 * MIB, 0).unwrap();
        assert_eq!((a, b, c), (BASE, BASE + 20 * MIB, BASE + 40 * MIB));
        free(m, b);
        empty_cache(m);
        // The layout lists one expandable segment per run of mapped blocks.
        let layout = m.layout();
        let runs: Vec<(u64, u64, bool)> = layout
            .iter()
            .map(|s| (s.address, s.size, s.expandable))
            .collect();
        assert_eq!(
            runs,
            vec![(BASE, 20 * MIB, true), (BASE + 40 * MIB, 20 * MIB, true)]
        );
        free(m, c);
    }

    #[test]
    fn one_request_may_take_two_map_steps_through_an_unmapped_hole() {
        let mut m = model(1 << 30);
        range_with_a_hole(&mut m);
        assert_eq!(
            ranges(&m)[0],
            vec![
                (0, 20 * MIB, "alloc"),
                (20 * MIB, 20 * MIB, "unmapped"),
                (40 * MIB, 20 * MIB, "free"),
                (60 * MIB, 1100 * MIB, "unmapped"),
            ]
        );
        assert_eq!(m.stats().num_device_alloc, 3);
        // The hole is the start (A before it is allocated): its page is mapped and merges
        // with the free block after it (40 MiB), then one page of the tail (10 MiB → 20).
        assert_eq!(malloc(&mut m, 50 * MIB, 0), Ok(BASE + 20 * MIB));
        assert_eq!(
            ranges(&m)[0],
            vec![
                (0, 20 * MIB, "alloc"),
                (20 * MIB, 50 * MIB, "alloc"),
                (70 * MIB, 10 * MIB, "free"),
                (80 * MIB, 1080 * MIB, "unmapped"),
            ]
        );
        assert_eq!(m.stats().num_device_alloc, 5);
        assert_eq!(m.stats().reserved_bytes.all.current, (80 * MIB) as i64);
        assert_eq!(m.layout().len(), 1);
    }

    #[test]
    fn a_map_step_that_does_not_fit_fails_and_earlier_steps_stay_mapped_until_released() {
        // 70 MiB: ranges of 80 MiB, four large pages.
        let mut m = model(70 * MIB);
        let a = malloc(&mut m, 20 * MIB, 0).unwrap();
        let b = malloc(&mut m, 20 * MIB, 0).unwrap();
        let c = malloc(&mut m, 20 * MIB, 0).unwrap();
        free(&mut m, b);
        empty_cache(&mut m);
        free(&mut m, c);
        assert_eq!(
            ranges(&m)[0],
            vec![
                (0, 20 * MIB, "alloc"),
                (20 * MIB, 20 * MIB, "unmapped"),
                (40 * MIB, 20 * MIB, "free"),
                (60 * MIB, 20 * MIB, "unmapped"),
            ]
        );
        // 50 MiB: the hole's page maps (60 MiB used), the tail's does not (80 > 70); rule 7d
        // unmaps the 40 MiB free block the first step made, and the retry's 60 MiB (three
        // pages) does not fit either.
        let error = malloc(&mut m, 50 * MIB, 0).unwrap_err();
        assert_eq!(
            error,
            ModelError::OutOfMemory {
                alloc_size: 50 * MIB,
                capacity: 70 * MIB,
                device_free: 50 * MIB,
                allowed: None,
                allocated: 20 * MIB,
                reserved_unallocated: 0,
            }
        );
        let st = m.stats();
        assert_eq!(st.num_device_alloc, 4);
        assert_eq!(st.num_device_free, 2);
        assert_eq!(st.num_alloc_retries, 1);
        assert_eq!(st.num_ooms, 1);
        // Mapped: 20 + 20 + 20 + 20 (the first step); unmapped: 20, then 40 at once.
        assert_eq!(st.reserved_bytes.all.allocated, (80 * MIB) as i64);
        assert_eq!(st.reserved_bytes.all.freed, (60 * MIB) as i64);
        assert_eq!(st.reserved_bytes.all.peak, (60 * MIB) as i64);
        assert_eq!(
            ranges(&m)[0],
            vec![(0, 20 * MIB, "alloc"), (20 * MIB, 60 * MIB, "unmapped")]
        );
        assert_eq!(a, BASE);
    }

    #[test]
    fn the_out_of_memory_path_unmaps_free_pages_and_grows_again() {
        let mut m = model(70 * MIB);
        let x = malloc(&mut m, 20 * MIB, 1).unwrap();
        free(&mut m, x);
        // Stream 0 reserves its own range after stream 1's; its 60 MiB do not fit next to
        // stream 1's cached page, so rule 7d unmaps that page (stream 1's range is then
        // released) and the retry maps in the range already reserved.
        assert_eq!(malloc(&mut m, 60 * MIB, 0), Ok(BASE + 80 * MIB));
        let st = m.stats();
        assert_eq!(st.num_device_alloc, 2);
        assert_eq!(st.num_device_free, 1);
        assert_eq!(st.num_alloc_retries, 1);
        assert_eq!(st.num_ooms, 0);
        let bases: Vec<u64> = m.device.reservations().iter().map(|r| r.base).collect();
        assert_eq!(bases, vec![BASE + 80 * MIB]);
        assert_eq!(
            ranges(&m),
            vec![vec![
                (0, 60 * MIB, "alloc"),
                (60 * MIB, 20 * MIB, "unmapped")
            ]]
        );
    }

    #[test]
    fn an_injected_failure_is_spent_by_one_map_step_and_the_retry_reuses_the_range() {
        let mut m = model(1 << 30);
        m.fail_next_device_allocs(1);
        assert_eq!(malloc(&mut m, 3 * MIB, 0), Ok(BASE));
        let st = m.stats();
        assert_eq!(st.num_device_alloc, 1);
        assert_eq!(st.num_device_free, 0);
        assert_eq!(st.num_alloc_retries, 1);
        assert_eq!(st.num_ooms, 0);
        assert_eq!(m.device.reservations().len(), 1);
    }

    #[test]
    fn best_fit_prefers_a_hole_over_the_growable_tail_block() {
        let mut m = model(1 << 30);
        malloc(&mut m, 4 * MIB, 0).unwrap();
        let b = malloc(&mut m, 8 * MIB, 0).unwrap();
        malloc(&mut m, 2 * MIB, 0).unwrap();
        free(&mut m, b);
        assert_eq!(
            ranges(&m)[0],
            vec![
                (0, 4 * MIB, "alloc"),
                (4 * MIB, 8 * MIB, "free"),
                (12 * MIB, 2 * MIB, "alloc"),
                (14 * MIB, 6 * MIB, "free"),
                (20 * MIB, 1140 * MIB, "unmapped"),
            ]
        );
        // Rule 6 alone takes the 6 MiB tail (reach 6 + 1140 MiB); the 8 MiB hole's reach is
        // smaller, so it is taken.
        assert_eq!(malloc(&mut m, 5 * MIB, 0), Ok(BASE + 4 * MIB));
        assert_eq!(ranges(&m)[0][2], (9 * MIB, 3 * MIB, "free"));
        assert_eq!(m.stats().num_device_alloc, 1);
    }

    #[test]
    fn the_small_pool_uses_two_mebibyte_pages_in_its_own_range() {
        let mut m = model(1 << 30);
        assert_eq!(malloc(&mut m, 1000, 0), Ok(BASE));
        assert_eq!(
            ranges(&m),
            vec![vec![
                (0, 1024, "alloc"),
                (1024, 2 * MIB - 1024, "free"),
                (2 * MIB, 1150 * MIB, "unmapped"),
            ]]
        );
        assert_eq!(
            m.stats().reserved_bytes.small_pool.current,
            (2 * MIB) as i64
        );
        // A large request reserves a large-pool range after the small one.
        assert_eq!(malloc(&mut m, 3 * MIB, 0), Ok(BASE + 1152 * MIB));
        // 1 MiB fits the small tail (2 MiB − 1 KiB); the next 1 MiB fits what is left of it
        // (1 MiB − 1 KiB) only with one more page.
        assert_eq!(malloc(&mut m, MIB, 0), Ok(BASE + 1024));
        assert_eq!(
            m.stats().reserved_bytes.small_pool.current,
            (2 * MIB) as i64
        );
        assert_eq!(malloc(&mut m, MIB, 0), Ok(BASE + MIB + 1024));
        let st = m.stats();
        assert_eq!(st.reserved_bytes.small_pool.current, (4 * MIB) as i64);
        assert_eq!(st.reserved_bytes.large_pool.current, (20 * MIB) as i64);
        assert_eq!(st.num_device_alloc, 3);
        let layout = m.layout();
        assert_eq!(layout.len(), 2);
        assert!(layout[0].small && layout[0].expandable && layout[0].size == 4 * MIB);
        assert!(!layout[1].small && layout[1].expandable && layout[1].size == 20 * MIB);
    }

    #[test]
    fn each_stream_grows_its_own_range() {
        let mut m = model(1 << 30);
        assert_eq!(malloc(&mut m, 3 * MIB, 0), Ok(BASE));
        assert_eq!(malloc(&mut m, 3 * MIB, 1), Ok(BASE + 1160 * MIB));
        let streams: Vec<u64> = m.layout().iter().map(|s| s.stream).collect();
        assert_eq!(streams, vec![0, 1]);
        assert_eq!(m.stats().num_device_alloc, 2);
    }

    #[test]
    fn found_blocks_split_whenever_512_bytes_remain_whatever_max_split_size_says() {
        let mut c = config(1 << 30);
        c.max_split_size = 20 * MIB;
        let mut m = Model::new(c);
        // At max_split_size: rule 13 would not split; rule 19c does (10 MiB remain).
        assert_eq!(malloc(&mut m, 30 * MIB, 0), Ok(BASE));
        // 512 B remain: rule 13 would keep them in the block (not more than 1 MiB).
        assert_eq!(malloc(&mut m, 10 * MIB - 512, 0), Ok(BASE + 30 * MIB));
        assert_eq!(
            ranges(&m)[0],
            vec![
                (0, 30 * MIB, "alloc"),
                (30 * MIB, 10 * MIB - 512, "alloc"),
                (40 * MIB - 512, 512, "free"),
                (40 * MIB, 1120 * MIB, "unmapped"),
            ]
        );
    }

    #[test]
    fn growing_may_hand_out_a_cached_block_that_best_fit_refused() {
        // max_split_size 20 MiB: a 10 MiB request may not take the cached 60 MiB block, but
        // that block begins the start's run, is already large enough, and no page is mapped.
        let mut c = config(100 * MIB);
        c.max_split_size = 20 * MIB;
        let mut m = Model::new(c);
        let a = malloc(&mut m, 60 * MIB, 0).unwrap();
        free(&mut m, a);
        assert_eq!(malloc(&mut m, 10 * MIB, 0), Ok(BASE));
        assert_eq!(m.stats().num_device_alloc, 1);
        assert_eq!(
            ranges(&m)[0],
            vec![
                (0, 10 * MIB, "alloc"),
                (10 * MIB, 50 * MIB, "free"),
                (60 * MIB, 60 * MIB, "unmapped"),
            ]
        );
    }

    #[test]
    fn blocks_of_a_range_never_count_as_inactive_split() {
        let mut m = model(1 << 30);
        let a = malloc(&mut m, 3 * MIB, 0).unwrap();
        let b = malloc(&mut m, 3 * MIB, 0).unwrap();
        let c = malloc(&mut m, 1000, 0).unwrap();
        malloc(&mut m, 3 * MIB, 0).unwrap();
        free(&mut m, b);
        free(&mut m, c);
        free(&mut m, a);
        let st = m.stats();
        for stat in [st.inactive_split, st.inactive_split_bytes] {
            assert_eq!(stat.all.current, 0);
            assert_eq!(stat.all.allocated, 0);
        }
    }

    #[test]
    fn the_memory_fraction_check_uses_rule_4s_segment_size() {
        let mut c = config(1 << 30);
        // Exactly 45 MiB allowed.
        c.memory_fraction = Some(45.0 / 1024.0);
        let mut m = Model::new(c);
        malloc(&mut m, 3 * MIB, 0).unwrap();
        // One more page would reserve 40 MiB, but 20 + 30 (rule 4's size) > 45: refused
        // without asking the device, twice (rule 7d unmaps nothing whole).
        let error = malloc(&mut m, 30 * MIB, 0).unwrap_err();
        assert_eq!(
            error,
            ModelError::OutOfMemory {
                alloc_size: 30 * MIB,
                capacity: 1 << 30,
                device_free: 1004 * MIB,
                allowed: Some(45 * MIB),
                allocated: 3 * MIB,
                reserved_unallocated: 17 * MIB,
            }
        );
        assert_eq!(m.stats().num_device_alloc, 1);
        assert_eq!(m.stats().num_alloc_retries, 1);
        // 20 + 24 ≤ 45: the same page is mapped.
        assert_eq!(malloc(&mut m, 24 * MIB, 0), Ok(BASE + 3 * MIB));
        assert_eq!(m.stats().reserved_bytes.all.current, (40 * MIB) as i64);
    }

    #[test]
    fn a_segment_overlapping_a_range_cannot_be_adopted() {
        let mut m = model(1 << 30);
        malloc(&mut m, 3 * MIB, 0).unwrap();
        // Inside the range's unmapped address space.
        let inside = AdoptedSegment {
            address: BASE + 100 * MIB,
            size: 20 * MIB,
            stream: 0,
            small: false,
            blocks: vec![AdoptedBlock {
                size: 20 * MIB,
                state: AdoptedState::Free,
            }],
        };
        assert!(matches!(
            m.adopt_segment(inside),
            Err(ModelError::InvalidAdoption { .. })
        ));
        m.check_invariants().unwrap();
    }

    #[test]
    fn a_device_without_memory_reserves_no_range() {
        let mut m = model(0);
        assert!(matches!(
            malloc(&mut m, 3 * MIB, 0),
            Err(ModelError::OutOfMemory { .. })
        ));
        assert!(m.device.reservations().is_empty());
        assert_eq!(m.stats().num_device_alloc, 0);
    }

    #[test]
    fn pending_blocks_are_neither_merged_nor_part_of_the_start() {
        let mut m = model(1 << 30);
        malloc(&mut m, 3 * MIB, 0).unwrap();
        let b = malloc(&mut m, 17 * MIB, 0).unwrap();
        m.record_stream(b, 1).unwrap();
        free(&mut m, b);
        // [A 3][B 17 pending][unmapped]: 18 MiB starts at the unmapped block.
        assert_eq!(malloc(&mut m, 18 * MIB, 0), Ok(BASE + 20 * MIB));
        m.complete_stream(1);
        malloc(&mut m, 512, 0).unwrap();
        assert_eq!(
            ranges(&m)[0][..3],
            [
                (0, 3 * MIB, "alloc"),
                (3 * MIB, 17 * MIB, "free"),
                (20 * MIB, 18 * MIB, "alloc"),
            ]
        );
    }

    #[test]
    fn a_corrupted_range_is_reported() {
        let mut m = model(1 << 30);
        malloc(&mut m, 3 * MIB, 0).unwrap();
        let good = m.clone();
        // Cut the unmapped tail in two at a page boundary.
        let blocks = &mut m.segments[0].blocks;
        let tail = blocks.pop().unwrap();
        blocks.push(Block::unmapped(tail.address, 20 * MIB));
        blocks.push(Block::unmapped(
            tail.address + 20 * MIB,
            tail.size - 20 * MIB,
        ));
        let error = m.check_invariants().unwrap_err();
        assert!(
            error.to_string().contains("two adjacent unmapped blocks"),
            "{error}"
        );
        // Move the tail's start off the page.
        let mut m = good.clone();
        let blocks = &mut m.segments[0].blocks;
        blocks[1].size -= 512;
        blocks[2].address -= 512;
        blocks[2].size += 512;
        let error = m.check_invariants().unwrap_err();
        assert!(
            error.to_string().contains("not aligned to the page"),
            "{error}"
        );
        // A mapped block the device does not know of.
        let mut m = good;
        let blocks = &mut m.segments[0].blocks;
        blocks[1].size += 20 * MIB;
        blocks[2].address += 20 * MIB;
        blocks[2].size -= 20 * MIB;
        assert!(m.check_invariants().is_err());
    }
}

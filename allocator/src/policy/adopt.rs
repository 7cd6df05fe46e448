//! Rule 18: adopting a segment the device already holds (the process's state when a trace's
//! recording began).
//!
//! The one rule: validate everything before touching anything. The checks run on the
//! description alone (plus one pass over the blocks held, for overlap); then the pending
//! blocks' events are recorded and the backend is told, each undone on failure; only then is
//! the layout linked into the slab, the free sets, the live map and the event queues, and the
//! statistics raised by what it holds.

use crate::backend::{Backend, EventId, StreamId};
use crate::block::{Backing, Block, BlockId, BlockPhase};
use crate::error::Error;
use crate::sizes::{MIN_BLOCK_SIZE, MIN_LARGE_ALLOC, Pool, ROUND_LARGE, SMALL_BUFFER, SMALL_SIZE};

use super::CachingCore;

/// A device segment that already exists, with its layout, for [`CachingCore::adopt_segment`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdoptedSegment {
    /// The segment's device address.
    pub address: u64,
    /// The segment's size in bytes.
    pub size: u64,
    /// The stream its blocks serve.
    pub stream: StreamId,
    /// The pool it belongs to.
    pub pool: Pool,
    /// Its blocks in address order, starting at `address`; they must tile the segment.
    pub blocks: Vec<AdoptedBlock>,
}

/// One block of an [`AdoptedSegment`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdoptedBlock {
    /// The block's size in bytes.
    pub size: u64,
    /// What the block is doing.
    pub state: AdoptedState,
}

/// What an adopted block is doing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AdoptedState {
    /// Cached in its pool, reusable on the segment's stream.
    Free,
    /// Held by the user (freeable by address).
    Allocated {
        /// The size the user asked for.
        requested: u64,
    },
    /// Freed by the user, still in use by other streams: reusable once their work completes.
    Pending {
        /// The size the user asked for.
        requested: u64,
        /// The streams it waits for; the segment's own stream and repeats are ignored.
        streams: Vec<StreamId>,
    },
    /// Address space of a range with no memory behind it (rule 18f): only a range
    /// ([`CachingCore::adopt_range`]) has such blocks.
    Unmapped,
}

/// A range of expandable segments that already exists (rule 18f), with its layout, for
/// [`CachingCore::adopt_range`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdoptedRange {
    /// The range's first address.
    pub address: u64,
    /// The stream its blocks serve.
    pub stream: StreamId,
    /// The pool it belongs to.
    pub pool: Pool,
    /// Its blocks in address order from `address`, mapped (free, allocated, pending) or
    /// [`AdoptedState::Unmapped`]; they cover the range's first bytes, and the rest of the
    /// range (its size is rule 19's) is one more unmapped block.
    pub blocks: Vec<AdoptedBlock>,
}

impl<B: Backend> CachingCore<B> {
    /// Rule 18: takes over a segment the device already holds, with its layout, as if this
    /// allocator had made it (a trace's starting state).
    ///
    /// Fails with [`Error::InvalidAdoption`] when the layout could not have been made by the
    /// policy or overlaps a segment held, and with [`Error::Backend`] when the backend refuses
    /// the range (the simulated device when it does not fit its capacity: out-of-memory; the
    /// CUDA backend always). On failure nothing changes. Allocated blocks become live
    /// allocations; pending blocks get one event on each stream they name; free blocks are
    /// cached. The statistics rise by the layout; `num_device_alloc` does not count.
    pub fn adopt_segment(&mut self, segment: AdoptedSegment) -> Result<(), Error> {
        self.check_adoption(&segment)
            .map_err(|reason| Error::InvalidAdoption { reason })?;
        let recorded = self.record_pending(segment.stream, &segment.blocks)?;
        // Rule 18b.
        if let Err(err) = self.backend.adopt(segment.address, segment.size) {
            self.forget_events(&recorded);
            return Err(Error::Backend(err));
        }
        self.install(&segment, &recorded);
        Ok(())
    }

    /// Rule 18c: one event per distinct stream other than `stream` for each pending block,
    /// blocks in address order, streams ascending; recorded before the backend is told so
    /// that a failure undoes cleanly. On a failure the events recorded so far are destroyed.
    fn record_pending(
        &mut self,
        stream: StreamId,
        blocks: &[AdoptedBlock],
    ) -> Result<Vec<(usize, StreamId, EventId)>, Error> {
        let mut recorded: Vec<(usize, StreamId, EventId)> = Vec::new();
        for (i, block) in blocks.iter().enumerate() {
            if let AdoptedState::Pending { streams, .. } = &block.state {
                let mut waits: Vec<StreamId> =
                    streams.iter().copied().filter(|&s| s != stream).collect();
                waits.sort_unstable();
                waits.dedup();
                for s in waits {
                    match self.backend.record_event(s) {
                        Ok(e) => recorded.push((i, s, e)),
                        Err(err) => {
                            self.forget_events(&recorded);
                            return Err(Error::Backend(err));
                        }
                    }
                }
            }
        }
        Ok(recorded)
    }

    /// Destroys the events of a failed adoption.
    fn forget_events(&mut self, recorded: &[(usize, StreamId, EventId)]) {
        for &(_, _, e) in recorded {
            self.backend.destroy_event(e);
        }
    }

    /// Rule 18f: takes over a range of expandable segments (rule 19) the device already holds,
    /// with its layout, as if this allocator had reserved and grown it (a trace's starting
    /// state under `expandable_segments:True`).
    ///
    /// The range's size is rule 19's for the pool (the device's capacity is asked now); the
    /// blocks cover its first bytes and the rest is unmapped. Fails with
    /// [`Error::InvalidAdoption`] when expandable segments are off or the layout could not
    /// have been made by the policy or overlaps memory held, and with [`Error::Backend`] when
    /// the backend refuses the range (the simulated device when the mapped bytes do not fit
    /// its capacity: out-of-memory; the CUDA backend always). On failure nothing changes.
    /// The statistics rise by the layout (no `segment`, no inactive split); `num_device_alloc`
    /// does not count.
    pub fn adopt_range(&mut self, range: AdoptedRange) -> Result<(), Error> {
        if !self.settings.expandable_segments {
            return Err(Error::InvalidAdoption {
                reason: "expandable segments are off: there are no ranges to adopt".into(),
            });
        }
        let page = self.page_of(range.pool);
        let capacity = self.backend.mem_info()?.total;
        let size = super::expandable::range_size(capacity, page);
        let covered = self
            .check_range_adoption(&range, size, page)
            .map_err(|reason| Error::InvalidAdoption { reason })?;
        let recorded = self.record_pending(range.stream, &range.blocks)?;
        let mut runs: Vec<(u64, u64)> = Vec::new();
        let mut at = range.address;
        for b in &range.blocks {
            if b.state != AdoptedState::Unmapped {
                match runs.last_mut() {
                    Some(last) if last.0 + last.1 == at => last.1 += b.size,
                    _ => runs.push((at, b.size)),
                }
            }
            at += b.size;
        }
        // Rule 18f: the device is told.
        if let Err(err) = self.backend.adopt_range(range.address, size, page, &runs) {
            self.forget_events(&recorded);
            return Err(Error::Backend(err));
        }
        self.install_range(&range, size, page, covered, &runs, &recorded);
        Ok(())
    }

    /// Rule 18f: links the validated range in (as rule 19b's reservation would have, then the
    /// layout as rule 18c) and raises the statistics (rule 18d, as rule 19 counts).
    fn install_range(
        &mut self,
        range: &AdoptedRange,
        size: u64,
        page: u64,
        covered: u64,
        runs: &[(u64, u64)],
        recorded: &[(usize, StreamId, EventId)],
    ) {
        let (pool, stream, base) = (range.pool, range.stream, range.address);
        let p = pool.index();
        let max_split = self.settings.max_split_size;
        let gc_base = self.searches[p];
        self.ranges.insert(base, crate::block::Range { size, page });
        self.add_range_pages(base, page);
        for &(a, n) in runs {
            self.pages_mapped(base, a, n);
        }
        let mut layout: Vec<(u64, AdoptedState)> = range
            .blocks
            .iter()
            .map(|b| (b.size, b.state.clone()))
            .collect();
        if covered < size {
            layout.push((size - covered, AdoptedState::Unmapped));
        }
        let mut ids: Vec<BlockId> = Vec::with_capacity(layout.len());
        let mut address = base;
        let mut mapped: u64 = 0;
        for (i, (block_size, adopted)) in layout.iter().enumerate() {
            let block_size = *block_size;
            let (state, requested, event_count, backing) = match adopted {
                AdoptedState::Free => (BlockPhase::Free, 0, 0, Backing::Mapped),
                AdoptedState::Unmapped => (BlockPhase::Free, 0, 0, Backing::Unmapped),
                AdoptedState::Allocated { requested } => {
                    (BlockPhase::Allocated, *requested, 0, Backing::Mapped)
                }
                AdoptedState::Pending { requested, .. } => (
                    BlockPhase::Pending,
                    *requested,
                    recorded.iter().filter(|r| r.0 == i).count() as u32,
                    Backing::Mapped,
                ),
            };
            let id = self.blocks.insert(Block {
                requested,
                prev: ids.last().copied(),
                state,
                event_count,
                backing,
                ..Block::free(address, block_size, stream, pool, gc_base, Some(base))
            });
            if let Some(&prev) = ids.last() {
                self.blocks.get_mut(prev).next = Some(id);
            }
            ids.push(id);
            let s = &mut self.stats;
            match (state, backing) {
                (BlockPhase::Free, Backing::Unmapped) => {
                    self.unmapped[p].insert((stream, address, id));
                }
                (BlockPhase::Free, _) => {
                    mapped += block_size;
                    self.free_insert(p, (stream, block_size, address, id));
                }
                (BlockPhase::Allocated, _) => {
                    mapped += block_size;
                    self.live.insert(address, id);
                    s.allocation.increase(pool, 1);
                    s.allocated_bytes.increase(pool, block_size);
                    if block_size >= max_split {
                        s.oversize_allocations.increase(1);
                    }
                }
                (_, _) => mapped += block_size,
            }
            if state != BlockPhase::Free {
                // Rule 22b: the pages under a block in use are busy.
                self.track_busy(Some(base), address, block_size, 1);
                let s = &mut self.stats;
                s.active.increase(pool, 1);
                s.active_bytes.increase(pool, block_size);
                s.requested_bytes.increase(pool, requested);
            }
            address += block_size;
            self.requested_high_water = self
                .requested_high_water
                .max(self.stats.requested_bytes.all.current.max(0) as u64);
        }
        for &(i, stream, event) in recorded {
            self.events
                .entry(stream)
                .or_default()
                .push_back((event, ids[i]));
        }
        self.reserved += mapped;
        self.stats.reserved_bytes.increase(pool, mapped);
    }

    /// Rule 18f's checks, in order, for a range of `size` bytes of `page`-byte pages: the
    /// reason of the first that fails, else the bytes the blocks cover.
    fn check_range_adoption(
        &self,
        range: &AdoptedRange,
        size: u64,
        page: u64,
    ) -> Result<u64, String> {
        let (address, pool) = (range.address, range.pool);
        if address == 0 {
            return Err("the range's address is 0".into());
        }
        if !address.is_multiple_of(SMALL_BUFFER) {
            return Err(format!(
                "the address {address:#x} is not a multiple of 2 MiB"
            ));
        }
        let Some(end) = address.checked_add(size) else {
            return Err(format!(
                "{address:#x} + {size} bytes (the range) overflows the address space"
            ));
        };
        if range.blocks.is_empty() {
            return Err("the range has no blocks".into());
        }
        if range
            .blocks
            .iter()
            .all(|b| b.state == AdoptedState::Unmapped)
        {
            return Err("nothing in the range is mapped".into());
        }
        if let Some(i) = range
            .blocks
            .iter()
            .position(|b| b.size == 0 || !b.size.is_multiple_of(MIN_BLOCK_SIZE))
        {
            return Err(format!(
                "block {i} has size {}, not a nonzero multiple of 512",
                range.blocks[i].size
            ));
        }
        let covered = range
            .blocks
            .iter()
            .try_fold(0u64, |sum, b| sum.checked_add(b.size))
            .filter(|&c| c <= size)
            .ok_or_else(|| format!("the blocks cover more than the range's {size} bytes"))?;
        let mut at: u64 = 0;
        for (i, b) in range.blocks.iter().enumerate() {
            if b.state == AdoptedState::Unmapped
                && (!at.is_multiple_of(page) || !b.size.is_multiple_of(page))
            {
                return Err(format!(
                    "unmapped block {i} (+{at}, {} bytes) is not whole {page}-byte pages",
                    b.size
                ));
            }
            at += b.size;
        }
        if !covered.is_multiple_of(page) {
            return Err(format!(
                "the blocks cover {covered} bytes, not whole {page}-byte pages"
            ));
        }
        let unmapped_last = range.blocks.last().map(|b| &b.state) == Some(&AdoptedState::Unmapped);
        if let Some(i) = range.blocks.windows(2).position(|w| {
            w[0].state == AdoptedState::Unmapped && w[1].state == AdoptedState::Unmapped
        }) {
            return Err(format!(
                "blocks {i} and {} are adjacent unmapped blocks",
                i + 1
            ));
        }
        if unmapped_last && covered < size {
            return Err("the last block is unmapped, next to the range's unmapped rest".into());
        }
        if let Some(i) = range
            .blocks
            .windows(2)
            .position(|w| w[0].state == AdoptedState::Free && w[1].state == AdoptedState::Free)
        {
            return Err(format!(
                "blocks {i} and {} are adjacent free blocks (they would have been merged)",
                i + 1
            ));
        }
        for (i, b) in range.blocks.iter().enumerate() {
            let requested = match &b.state {
                AdoptedState::Free | AdoptedState::Unmapped => continue,
                AdoptedState::Allocated { requested } => *requested,
                AdoptedState::Pending { requested, .. } => *requested,
            };
            match pool {
                Pool::Small if b.size > SMALL_SIZE => {
                    return Err(format!(
                        "block {i} of a small-pool range is in use with {} bytes (at most 1 MiB)",
                        b.size
                    ));
                }
                Pool::Large if b.size <= SMALL_SIZE => {
                    return Err(format!(
                        "block {i} of a large-pool range is in use with {} bytes (more than 1 MiB needed)",
                        b.size
                    ));
                }
                _ => {}
            }
            if let AdoptedState::Pending { streams, .. } = &b.state
                && !streams.iter().any(|&s| s != range.stream)
            {
                return Err(format!(
                    "pending block {i} waits for no stream other than the range's"
                ));
            }
            if requested == 0 || requested > b.size {
                return Err(format!(
                    "block {i}: {requested} bytes requested of a {}-byte block",
                    b.size
                ));
            }
        }
        self.check_unheld(address, end, "memory held")?;
        Ok(covered)
    }

    /// Rule 18c, d: links the validated layout in and raises the statistics.
    fn install(&mut self, segment: &AdoptedSegment, recorded: &[(usize, StreamId, EventId)]) {
        let pool = segment.pool;
        let p = pool.index();
        let split = segment.blocks.len() > 1;
        let max_split = self.settings.max_split_size;
        let gc_base = self.searches[p];
        let mut ids: Vec<BlockId> = Vec::with_capacity(segment.blocks.len());
        let mut address = segment.address;
        for (i, adopted) in segment.blocks.iter().enumerate() {
            let (state, requested, event_count) = match &adopted.state {
                // Refused by rule 18e before this point.
                AdoptedState::Free | AdoptedState::Unmapped => (BlockPhase::Free, 0, 0),
                AdoptedState::Allocated { requested } => (BlockPhase::Allocated, *requested, 0),
                AdoptedState::Pending { requested, .. } => (
                    BlockPhase::Pending,
                    *requested,
                    recorded.iter().filter(|r| r.0 == i).count() as u32,
                ),
            };
            let id = self.blocks.insert(Block {
                address,
                size: adopted.size,
                requested,
                stream: segment.stream,
                pool,
                prev: ids.last().copied(),
                next: None,
                state,
                event_count,
                stream_uses: Vec::new(),
                gc_base,
                backing: crate::block::Backing::Mapped,
                range: None,
            });
            if let Some(&prev) = ids.last() {
                self.blocks.get_mut(prev).next = Some(id);
            }
            ids.push(id);
            let size = adopted.size;
            if state == BlockPhase::Free {
                self.free_insert(p, (segment.stream, size, address, id));
            }
            let s = &mut self.stats;
            match state {
                BlockPhase::Free => {
                    if split {
                        s.inactive_split.increase(pool, 1);
                        s.inactive_split_bytes.increase(pool, size);
                    }
                }
                BlockPhase::Allocated => {
                    self.live.insert(address, id);
                    s.allocation.increase(pool, 1);
                    s.allocated_bytes.increase(pool, size);
                    if size >= max_split {
                        s.oversize_allocations.increase(1);
                    }
                }
                // Rule 18 adopts free, allocated and pending blocks only (a held piece, rule
                // 23b, is never adopted).
                BlockPhase::Pending | BlockPhase::Held => {}
            }
            if state != BlockPhase::Free {
                s.active.increase(pool, 1);
                s.active_bytes.increase(pool, size);
                s.requested_bytes.increase(pool, requested);
            }
            address += size;
            self.requested_high_water = self
                .requested_high_water
                .max(self.stats.requested_bytes.all.current.max(0) as u64);
        }
        for &(i, stream, event) in recorded {
            self.events
                .entry(stream)
                .or_default()
                .push_back((event, ids[i]));
        }
        self.reserved += segment.size;
        self.stats.segment.increase(pool, 1);
        self.stats.reserved_bytes.increase(pool, segment.size);
        if segment.size >= max_split {
            self.stats.oversize_segments.increase(1);
        }
    }

    /// Rule 18a: the reason of the first check that fails.
    fn check_adoption(&self, segment: &AdoptedSegment) -> Result<(), String> {
        let AdoptedSegment {
            address,
            size,
            pool,
            ..
        } = *segment;
        if address == 0 {
            return Err("the segment's address is 0".into());
        }
        if !address.is_multiple_of(MIN_BLOCK_SIZE) {
            return Err(format!("the address {address:#x} is not a multiple of 512"));
        }
        let Some(end) = address.checked_add(size) else {
            return Err(format!(
                "{address:#x} + {size} bytes overflows the address space"
            ));
        };
        match pool {
            Pool::Small if size != SMALL_BUFFER => {
                return Err(format!(
                    "a small-pool segment must be 2 MiB, not {size} bytes"
                ));
            }
            Pool::Large if !size.is_multiple_of(ROUND_LARGE) || size < MIN_LARGE_ALLOC => {
                return Err(format!(
                    "a large-pool segment must be a multiple of 2 MiB of at least 10 MiB, not {size} bytes"
                ));
            }
            _ => {}
        }
        if segment.blocks.is_empty() {
            return Err("the segment has no blocks".into());
        }
        let mut tiled: u64 = 0;
        for (i, b) in segment.blocks.iter().enumerate() {
            // Rule 18e: unmapped address space belongs to ranges only.
            if b.state == AdoptedState::Unmapped {
                return Err(format!(
                    "block {i} is unmapped, and only a range has unmapped blocks"
                ));
            }
            if b.size == 0 || !b.size.is_multiple_of(MIN_BLOCK_SIZE) {
                return Err(format!(
                    "block {i} has size {}, not a nonzero multiple of 512",
                    b.size
                ));
            }
            match pool {
                // A free block of the small pool can span its whole 2 MiB segment; one in use
                // served a request of at most 1 MiB (rules 3 and 13).
                Pool::Small if b.size > SMALL_SIZE && !matches!(b.state, AdoptedState::Free) => {
                    return Err(format!(
                        "block {i} of a small-pool segment is in use with {} bytes (at most 1 MiB)",
                        b.size
                    ));
                }
                Pool::Large if b.size <= SMALL_SIZE => {
                    return Err(format!(
                        "block {i} of a large-pool segment has {} bytes (more than 1 MiB needed)",
                        b.size
                    ));
                }
                _ => {}
            }
            tiled = tiled.saturating_add(b.size);
        }
        if tiled != size {
            return Err(format!(
                "the blocks cover {tiled} bytes of a {size}-byte segment"
            ));
        }
        if let Some(i) = segment
            .blocks
            .windows(2)
            .position(|w| w[0].state == AdoptedState::Free && w[1].state == AdoptedState::Free)
        {
            return Err(format!(
                "blocks {i} and {} are adjacent free blocks (they would have been merged)",
                i + 1
            ));
        }
        for (i, b) in segment.blocks.iter().enumerate() {
            let requested = match &b.state {
                AdoptedState::Free | AdoptedState::Unmapped => continue,
                AdoptedState::Allocated { requested } => *requested,
                AdoptedState::Pending { requested, streams } => {
                    if !streams.iter().any(|&s| s != segment.stream) {
                        return Err(format!(
                            "pending block {i} waits for no stream other than the segment's"
                        ));
                    }
                    *requested
                }
            };
            if requested == 0 || requested > b.size {
                return Err(format!(
                    "block {i}: {requested} bytes requested of a {}-byte block",
                    b.size
                ));
            }
        }
        self.check_unheld(address, end, "a segment held")
    }

    /// Rules 18a and 23a: `[address, end)` overlaps no block the allocator holds (`what`
    /// names them in the error) and no stitched view's reservation, free or in use.
    fn check_unheld(&self, address: u64, end: u64, what: &str) -> Result<(), String> {
        let size = end - address;
        if let Some((_, held)) = self
            .blocks
            .iter()
            .find(|(_, b)| b.address < end && address < b.address + b.size)
        {
            return Err(format!(
                "{address:#x} (+{size}) overlaps {what} (its block at {:#x})",
                held.address
            ));
        }
        if let Some(v) = &self.views
            && let Some(view) = v.views.values().find(|view| {
                let bytes = view.homes.len() as u64 * v.page;
                view.address < end && address < view.address + bytes
            })
        {
            return Err(format!(
                "{address:#x} (+{size}) overlaps a stitched view held at {:#x}",
                view.address
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::sim::SIM_BASE_ADDRESS;
    use crate::backend::sim::SimDevice;
    use crate::backend::{BackendError, MemInfo};
    use crate::block::BlockPhase;
    use crate::settings::Settings;

    const MIB: u64 = 1 << 20;
    const AT: u64 = 0x1000_0000;

    fn core() -> CachingCore<SimDevice> {
        CachingCore::new(SimDevice::new(1 << 30), Settings::pytorch()).unwrap()
    }

    fn block(size: u64, state: AdoptedState) -> AdoptedBlock {
        AdoptedBlock { size, state }
    }

    fn free(size: u64) -> AdoptedBlock {
        block(size, AdoptedState::Free)
    }

    fn allocated(size: u64, requested: u64) -> AdoptedBlock {
        block(size, AdoptedState::Allocated { requested })
    }

    fn pending(size: u64, requested: u64, streams: &[u64]) -> AdoptedBlock {
        block(
            size,
            AdoptedState::Pending {
                requested,
                streams: streams.iter().map(|&s| StreamId(s)).collect(),
            },
        )
    }

    fn small(blocks: Vec<AdoptedBlock>) -> AdoptedSegment {
        AdoptedSegment {
            address: AT,
            size: 2 * MIB,
            stream: StreamId(0),
            pool: Pool::Small,
            blocks,
        }
    }

    fn large(size: u64, blocks: Vec<AdoptedBlock>) -> AdoptedSegment {
        AdoptedSegment {
            address: AT,
            size,
            stream: StreamId(0),
            pool: Pool::Large,
            blocks,
        }
    }

    /// A refused adoption: the right error, and nothing changed (statistics, layout, device).
    fn refused(core: &mut CachingCore<SimDevice>, segment: AdoptedSegment, needle: &str) {
        let before = (core.segments(), core.stats().clone(), core.backend().used());
        match core.adopt_segment(segment) {
            Err(Error::InvalidAdoption { reason }) => {
                assert!(reason.contains(needle), "{reason:?} lacks {needle:?}")
            }
            other => panic!("expected InvalidAdoption ({needle}), got {other:?}"),
        }
        let after = (core.segments(), core.stats().clone(), core.backend().used());
        assert_eq!(before, after);
        core.check_invariants().unwrap();
    }

    #[test]
    fn each_validation_rule_refuses_and_changes_nothing() {
        let mut c = core();
        let half = free(MIB);
        let ok = || small(vec![allocated(MIB, 100), free(MIB)]);
        refused(
            &mut c,
            AdoptedSegment { address: 0, ..ok() },
            "address is 0",
        );
        refused(
            &mut c,
            AdoptedSegment {
                address: AT + 256,
                ..ok()
            },
            "multiple of 512",
        );
        refused(
            &mut c,
            AdoptedSegment {
                address: u64::MAX - MIB + 1,
                ..ok()
            },
            "overflows",
        );
        refused(
            &mut c,
            AdoptedSegment {
                size: 4 * MIB,
                ..ok()
            },
            "must be 2 MiB",
        );
        refused(
            &mut c,
            large(12 * MIB + 512, vec![free(12 * MIB + 512)]),
            "multiple of 2 MiB",
        );
        refused(
            &mut c,
            large(8 * MIB, vec![free(8 * MIB)]),
            "at least 10 MiB",
        );
        refused(&mut c, small(vec![]), "no blocks");
        refused(
            &mut c,
            small(vec![allocated(0, 1), half.clone(), allocated(MIB, 1)]),
            "nonzero multiple of 512",
        );
        refused(
            &mut c,
            small(vec![allocated(MIB - 100, 1), free(MIB + 100)]),
            "nonzero multiple of 512",
        );
        refused(
            &mut c,
            small(vec![allocated(MIB + 512, 1), free(MIB - 512)]),
            "at most 1 MiB",
        );
        refused(
            &mut c,
            large(20 * MIB, vec![allocated(MIB, 1), free(19 * MIB)]),
            "more than 1 MiB",
        );
        refused(
            &mut c,
            small(vec![allocated(MIB, 1), allocated(MIB - 512, 1)]),
            "cover",
        );
        refused(
            &mut c,
            small(vec![allocated(MIB, 1), half.clone(), allocated(512, 1)]),
            "cover",
        );
        refused(&mut c, small(vec![free(MIB), free(MIB)]), "adjacent free");
        refused(
            &mut c,
            small(vec![allocated(MIB, 0), free(MIB)]),
            "requested",
        );
        refused(
            &mut c,
            small(vec![allocated(MIB, MIB + 1), free(MIB)]),
            "requested",
        );
        refused(
            &mut c,
            small(vec![pending(MIB, MIB + 1, &[1]), free(MIB)]),
            "requested",
        );
        refused(
            &mut c,
            small(vec![pending(MIB, 10, &[0]), free(MIB)]),
            "no stream other",
        );
        refused(
            &mut c,
            small(vec![pending(MIB, 10, &[]), free(MIB)]),
            "no stream other",
        );
        // Overlap with a segment held: one adopted, one made by the policy.
        c.adopt_segment(ok()).unwrap();
        refused(&mut c, large(20 * MIB, vec![free(20 * MIB)]), "overlaps");
        let made = c.malloc(4096, StreamId(1)).unwrap();
        assert_eq!(made, SIM_BASE_ADDRESS);
        refused(
            &mut c,
            AdoptedSegment {
                address: SIM_BASE_ADDRESS + 2 * MIB - 512,
                ..ok()
            },
            "overlaps",
        );
        // Adjacent, not overlapping: fine.
        c.adopt_segment(AdoptedSegment {
            address: AT + 2 * MIB,
            ..ok()
        })
        .unwrap();
        c.check_invariants().unwrap();
    }

    #[test]
    fn a_wholly_free_small_segment_is_one_free_block_of_2_mib() {
        // What PyTorch dumps for a cached small segment nothing uses.
        let mut c = core();
        c.adopt_segment(small(vec![free(2 * MIB)])).unwrap();
        assert_eq!(c.stats().inactive_split_bytes.all.current, 0);
        assert_eq!(c.stats().reserved_bytes.all.current, (2 * MIB) as i64);
        // It serves a small request, and empty_cache gives it back.
        let a = c.malloc(512, StreamId(0)).unwrap();
        assert_eq!(a, AT);
        c.free(a).unwrap();
        c.empty_cache().unwrap();
        assert_eq!(c.stats().reserved_bytes.all.current, 0);
    }

    #[test]
    fn statistics_rise_by_the_layout_without_a_device_allocation() {
        let mut s = Settings::pytorch();
        s.max_split_size = 20 * MIB;
        let mut c = CachingCore::new(SimDevice::new(1 << 30), s).unwrap();
        c.adopt_segment(small(vec![
            allocated(4096, 1000),
            free(MIB - 4096),
            pending(MIB, 700, &[1, 2, 0, 1]),
        ]))
        .unwrap();
        c.adopt_segment(AdoptedSegment {
            address: AT + 64 * MIB,
            ..large(
                40 * MIB,
                vec![allocated(24 * MIB, 23 * MIB), free(16 * MIB)],
            )
        })
        .unwrap();
        let st = c.stats();
        let (sp, lp) = (Pool::Small, Pool::Large);
        assert_eq!(st.segment.pool(sp).current, 1);
        assert_eq!(st.segment.pool(lp).current, 1);
        assert_eq!(st.reserved_bytes.all.current, (42 * MIB) as i64);
        assert_eq!(st.reserved_bytes.all.peak, (42 * MIB) as i64);
        assert_eq!(st.allocation.all.current, 2);
        assert_eq!(st.allocated_bytes.pool(sp).current, 4096);
        assert_eq!(st.allocated_bytes.pool(lp).current, (24 * MIB) as i64);
        assert_eq!(st.active.pool(sp).current, 2);
        assert_eq!(st.active_bytes.pool(sp).current, (4096 + MIB) as i64);
        assert_eq!(st.requested_bytes.pool(sp).current, 1700);
        assert_eq!(st.requested_bytes.pool(lp).current, (23 * MIB) as i64);
        assert_eq!(st.inactive_split.all.current, 2);
        assert_eq!(
            st.inactive_split_bytes.pool(sp).current,
            (MIB - 4096) as i64
        );
        assert_eq!(st.inactive_split_bytes.pool(lp).current, (16 * MIB) as i64);
        assert_eq!(st.oversize_segments.current, 1);
        assert_eq!(st.oversize_allocations.current, 1);
        assert_eq!(st.num_device_alloc, 0);
        assert_eq!(c.backend().call_counts(), (0, 0));
        assert_eq!(c.backend().used(), 42 * MIB);
        // Two events, one per other stream (0 is the segment's own, 1 named twice).
        assert_eq!(c.backend().live_events(), 2);
        c.check_invariants().unwrap();
    }

    #[test]
    fn adopted_blocks_behave_like_made_ones() {
        let mut c = core();
        c.adopt_segment(small(vec![
            allocated(MIB, 10),
            pending(4096, 4000, &[1, 2]),
            free(MIB - 4096),
        ]))
        .unwrap();
        // The allocated block is live: record_stream and free work; its free waits for stream 2.
        c.record_stream(AT, StreamId(2)).unwrap();
        c.free(AT).unwrap();
        assert_eq!(c.free(AT), Err(Error::UnknownPointer { address: AT }));
        // The free remainder is reused first (best fit), on the segment's stream only.
        assert_eq!(c.malloc(8192, StreamId(0)).unwrap(), AT + MIB + 4096);
        assert_eq!(c.malloc(8192, StreamId(1)).unwrap(), SIM_BASE_ADDRESS);
        // The pending block returns once streams 1 and 2 complete; so does the freed one.
        c.backend_mut().complete_stream(StreamId(1));
        c.malloc(512, StreamId(1)).unwrap();
        let segs = c.segments();
        assert_eq!(segs[0].blocks[1].state, BlockPhase::Pending);
        c.backend_mut().complete_stream(StreamId(2));
        c.malloc(512, StreamId(1)).unwrap();
        let segs = c.segments();
        assert_eq!(segs[0].blocks[0].state, BlockPhase::Free);
        assert_eq!(segs[0].blocks[0].size, MIB + 4096);
        c.check_invariants().unwrap();
        // Freed whole, an adopted segment goes back to the device like any other.
        c.free(AT + MIB + 4096).unwrap();
        c.empty_cache().unwrap();
        assert!(c.segments().iter().all(|s| s.address != AT));
        assert_eq!(c.stats().num_device_free, 1);
        c.check_invariants().unwrap();
    }

    #[test]
    fn a_whole_free_adopted_segment_is_cached_and_released() {
        let mut c = core();
        c.adopt_segment(large(20 * MIB, vec![free(20 * MIB)]))
            .unwrap();
        assert_eq!(c.malloc(3 * MIB, StreamId(0)).unwrap(), AT);
        assert_eq!(c.stats().num_device_alloc, 0);
        c.free(AT).unwrap();
        c.empty_cache().unwrap();
        assert_eq!(c.backend().used(), 0);
        assert_eq!(c.stats().reserved_bytes.all.current, 0);
    }

    #[test]
    fn the_device_refuses_what_does_not_fit() {
        let mut c = CachingCore::new(SimDevice::new(16 * MIB), Settings::pytorch()).unwrap();
        let before = c.stats().clone();
        assert_eq!(
            c.adopt_segment(large(
                20 * MIB,
                vec![free(10 * MIB), pending(10 * MIB, 1, &[1])]
            )),
            Err(Error::Backend(BackendError::OutOfMemory))
        );
        assert_eq!(c.stats(), &before);
        assert_eq!(c.backend().live_events(), 0);
        assert!(c.segments().is_empty());
    }

    /// A backend that does not implement `adopt` (as the CUDA backend does not).
    struct NoAdopt(SimDevice);

    impl Backend for NoAdopt {
        fn allocate(&mut self, size: u64) -> Result<u64, BackendError> {
            self.0.allocate(size)
        }
        fn free(&mut self, address: u64, size: u64) -> Result<(), BackendError> {
            self.0.free(address, size)
        }
        fn mem_info(&mut self) -> Result<MemInfo, BackendError> {
            self.0.mem_info()
        }
        fn record_event(&mut self, stream: StreamId) -> Result<EventId, BackendError> {
            self.0.record_event(stream)
        }
        fn query_event(&mut self, event: EventId) -> Result<bool, BackendError> {
            self.0.query_event(event)
        }
        fn synchronize_event(&mut self, event: EventId) -> Result<(), BackendError> {
            self.0.synchronize_event(event)
        }
        fn destroy_event(&mut self, event: EventId) {
            self.0.destroy_event(event)
        }
    }

    #[test]
    fn a_backend_without_adoption_refuses_cleanly() {
        let mut c =
            CachingCore::new(NoAdopt(SimDevice::new(1 << 30)), Settings::pytorch()).unwrap();
        let e = c
            .adopt_segment(small(vec![pending(MIB, 1, &[1]), free(MIB)]))
            .unwrap_err();
        assert!(e.to_string().contains("not supported"), "{e}");
        assert!(c.segments().is_empty());
        assert_eq!(c.backend().0.live_events(), 0);
        assert_eq!(c.stats(), &crate::stats::Stats::default());
    }

    #[test]
    fn free_blocks_enter_the_free_set_at_age_zero() {
        let mut s = Settings::pytorch();
        s.garbage_collection_threshold = 0.5;
        s.per_process_memory_fraction = Some(1.0);
        let mut c = CachingCore::new(SimDevice::new(1 << 30), s).unwrap();
        c.malloc(3 * MIB, StreamId(0)).unwrap();
        c.adopt_segment(large(20 * MIB, vec![free(20 * MIB)]))
            .unwrap();
        let id = c.free[1].iter().find(|k| k.2 == AT).unwrap().3;
        assert_eq!(c.blocks.get(id).gc_base, c.searches[1]);
        assert!(c.searches[1] > 0);
    }
}

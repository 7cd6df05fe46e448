//! Rule 18: adopting a segment that already exists on the device (the process's state when a
//! trace's recording began), and the `set_next_address` hook of the simulated device.
//!
//! Validation is a list of plain checks in the order ARCHITECTURE.md writes them; the first
//! that fails is the error and nothing changes. Then the device is told, the segment is
//! inserted as given, one event per named stream is recorded for each pending block, and the
//! statistics are settled once from the new state, like every other sub-step of the model.

use crate::device::{AdoptRefusal, overlaps};
use crate::rules::{MIN_BLOCK_SIZE, MIN_LARGE_ALLOC, Pool, ROUND_LARGE, SMALL_BUFFER, SMALL_SIZE};
use crate::state::{Block, BlockState, Event, Segment};
use crate::{Model, ModelError};

/// A segment the process already holds, as the model is told it (rule 18).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdoptedSegment {
    /// The segment's device address.
    pub address: u64,
    /// The segment's size in bytes.
    pub size: u64,
    /// The stream its blocks serve.
    pub stream: u64,
    /// Whether the segment belongs to the small pool (else the large one).
    pub small: bool,
    /// Its blocks in address order, from the segment's address on.
    pub blocks: Vec<AdoptedBlock>,
}

/// One block of an [`AdoptedSegment`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdoptedBlock {
    /// The block's size in bytes.
    pub size: u64,
    /// What it is doing.
    pub state: AdoptedState,
}

/// What an adopted block is doing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AdoptedState {
    /// Cached: in its pool's free set.
    Free,
    /// Held by the user, who asked for `requested` bytes.
    Allocated {
        /// The size the user asked for.
        requested: u64,
    },
    /// Freed by the user, waiting for the work of `streams` (other than the segment's).
    Pending {
        /// The size the user asked for.
        requested: u64,
        /// The streams whose work the block waits for.
        streams: Vec<u64>,
    },
    /// Address space of a range with no memory behind it (rule 18f); a segment has none.
    Unmapped,
}

/// A range of expandable segments the process already holds, as the model is told it (rule
/// 18f).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdoptedRange {
    /// The range's first address.
    pub address: u64,
    /// The stream its blocks serve.
    pub stream: u64,
    /// Whether the range belongs to the small pool (else the large one).
    pub small: bool,
    /// Its first blocks in address order, from the range's address on; the rest of the range
    /// (rule 19's size) is unmapped.
    pub blocks: Vec<AdoptedBlock>,
}

impl Model {
    /// Rule 18: the device already holds `segment` with its blocks; the model takes it over as
    /// if it had made it. Fails with [`ModelError::InvalidAdoption`] when the layout could not
    /// have been made (or overlaps a segment held), or [`ModelError::AdoptionOutOfMemory`] when
    /// the device has no room for it; either way nothing changes.
    pub fn adopt_segment(&mut self, segment: AdoptedSegment) -> Result<(), ModelError> {
        self.check_adoption(&segment)
            .map_err(|reason| ModelError::InvalidAdoption { reason })?;
        // Rule 18b: the device is told.
        match self.device.adopt(segment.address, segment.size) {
            Ok(()) => {}
            Err(AdoptRefusal::OutOfMemory) => {
                return Err(ModelError::AdoptionOutOfMemory {
                    size: segment.size,
                    device_free: self.device.capacity() - self.device.used(),
                });
            }
            // Not reached after rule 18a, which refuses these ranges first (the device's live
            // ranges are exactly the segments).
            Err(AdoptRefusal::Unusable) => {
                return Err(ModelError::InvalidAdoption {
                    reason: "the device refuses the range: empty, overflowing or overlapping"
                        .into(),
                });
            }
        }
        // Rule 18c: the layout as given; free blocks entered the free set now.
        let pool = if segment.small {
            Pool::Small
        } else {
            Pool::Large
        };
        let now = self.search_counter(pool);
        let mut blocks = Vec::new();
        let mut address = segment.address;
        for adopted in &segment.blocks {
            let mut block = Block::free(address, adopted.size, now);
            match &adopted.state {
                // Refused by rule 18e.
                AdoptedState::Free | AdoptedState::Unmapped => {}
                AdoptedState::Allocated { requested } => {
                    block.state = BlockState::Allocated;
                    block.requested = *requested;
                    block.free_since = 0;
                }
                AdoptedState::Pending { requested, streams } => {
                    let mut waits: Vec<u64> = streams
                        .iter()
                        .copied()
                        .filter(|&s| s != segment.stream)
                        .collect();
                    waits.sort_unstable();
                    waits.dedup();
                    block.state = BlockState::Pending;
                    block.requested = *requested;
                    block.pending_events = waits.len();
                    block.free_since = 0;
                    for stream in waits {
                        self.events.push(Event {
                            stream,
                            block: address,
                            complete: false,
                        });
                    }
                }
            }
            blocks.push(block);
            address += adopted.size;
        }
        let index = self
            .segments
            .partition_point(|s| s.address < segment.address);
        self.segments.insert(
            index,
            Segment {
                address: segment.address,
                size: segment.size,
                stream: segment.stream,
                pool,
                blocks,
                expandable: false,
            },
        );
        // Rule 18d: the statistics rise by the layout; no device allocation is counted.
        self.settle_stats();
        Ok(())
    }

    /// Rule 18a, check by check: the reason of the first that fails.
    fn check_adoption(&self, segment: &AdoptedSegment) -> Result<(), String> {
        let (address, size) = (segment.address, segment.size);
        if address == 0 {
            return Err("the segment's address is 0".into());
        }
        if !address.is_multiple_of(MIN_BLOCK_SIZE) {
            return Err(format!("address {address:#x} is not a multiple of 512"));
        }
        if address.checked_add(size).is_none() {
            return Err(format!(
                "{address:#x} + {size} bytes overflows the address space"
            ));
        }
        if segment.small && size != SMALL_BUFFER {
            return Err(format!(
                "a small-pool segment of {size} bytes (must be 2 MiB)"
            ));
        }
        if !segment.small && (!size.is_multiple_of(ROUND_LARGE) || size < MIN_LARGE_ALLOC) {
            return Err(format!(
                "a large-pool segment of {size} bytes (must be a multiple of 2 MiB, at least 10 MiB)"
            ));
        }
        if segment.blocks.is_empty() {
            return Err("the segment has no blocks".into());
        }
        let mut total: u128 = 0;
        for (i, block) in segment.blocks.iter().enumerate() {
            // Rule 18e.
            if block.state == AdoptedState::Unmapped {
                return Err(format!(
                    "block {i}: unmapped, in a segment (only ranges have unmapped blocks)"
                ));
            }
            let n = block.size;
            if n == 0 || !n.is_multiple_of(MIN_BLOCK_SIZE) {
                return Err(format!(
                    "block {i}: size {n} is not a nonzero multiple of 512"
                ));
            }
            // Rules 3 and 13: a block in use in the small pool served at most 1 MiB; a free one
            // may span the whole segment.
            if segment.small && n > SMALL_SIZE && !matches!(block.state, AdoptedState::Free) {
                return Err(format!(
                    "block {i}: {n} bytes in use in a small-pool segment (at most 1 MiB)"
                ));
            }
            if !segment.small && n <= SMALL_SIZE {
                return Err(format!(
                    "block {i}: {n} bytes in a large-pool segment (must exceed 1 MiB)"
                ));
            }
            total += u128::from(n);
        }
        if total != u128::from(size) {
            return Err(format!(
                "the blocks add up to {total} bytes, the segment is {size}"
            ));
        }
        for (i, pair) in segment.blocks.windows(2).enumerate() {
            if pair[0].state == AdoptedState::Free && pair[1].state == AdoptedState::Free {
                return Err(format!(
                    "blocks {i} and {} are both free (they would have been merged)",
                    i + 1
                ));
            }
        }
        for (i, block) in segment.blocks.iter().enumerate() {
            let requested = match &block.state {
                AdoptedState::Free | AdoptedState::Unmapped => continue,
                AdoptedState::Allocated { requested } => *requested,
                AdoptedState::Pending { requested, streams } => {
                    if streams.iter().all(|&s| s == segment.stream) {
                        return Err(format!(
                            "block {i}: pending, but on no stream other than the segment's"
                        ));
                    }
                    *requested
                }
            };
            if requested == 0 || requested > block.size {
                return Err(format!(
                    "block {i}: requested {requested} bytes of a {}-byte block",
                    block.size
                ));
            }
        }
        self.address_space_free(address, size, "the segment")
    }

    /// Rules 18a and 23a: `[address, address + size)` overlaps no segment or range held
    /// (`what` names it in the error) and no stitched view's reservation, free or in use.
    fn address_space_free(&self, address: u64, size: u64, what: &str) -> Result<(), String> {
        if let Some(held) = self
            .segments
            .iter()
            .find(|s| overlaps(address, size, s.address, s.size))
        {
            return Err(format!(
                "{address:#x} (+{size}) overlaps {what} held at {:#x} (+{})",
                held.address, held.size
            ));
        }
        let page = self.config.expandable_page;
        if let Some(view) = self
            .views
            .iter()
            .find(|v| overlaps(address, size, v.address, v.homes.len() as u64 * page))
        {
            return Err(format!(
                "{address:#x} (+{size}) overlaps the stitched view at {:#x}",
                view.address
            ));
        }
        Ok(())
    }

    /// Rule 18f: the device already holds `range`, a range of expandable segments with its
    /// first blocks (the rest unmapped); the model takes it over as if it had reserved and
    /// grown it. Fails with [`ModelError::InvalidAdoption`] when expandable segments are off,
    /// or the layout could not have been made (or overlaps memory held), or
    /// [`ModelError::AdoptionOutOfMemory`] when the device has no room for its mapped bytes;
    /// either way nothing changes.
    pub fn adopt_range(&mut self, range: AdoptedRange) -> Result<(), ModelError> {
        let invalid = |reason: String| ModelError::InvalidAdoption { reason };
        if !self.config.expandable_segments {
            return Err(invalid("expandable segments are off".into()));
        }
        let pool = if range.small {
            Pool::Small
        } else {
            Pool::Large
        };
        let page = self.page_size(pool);
        let size = crate::expandable::range_size(page, self.device.capacity())
            .ok_or_else(|| invalid("a range on this device would be empty".into()))?;
        self.check_range_adoption(&range, size, page)
            .map_err(invalid)?;
        // The layout, the rest of the range included, and the mapped runs.
        let mut layout: Vec<(u64, u64, AdoptedState)> = Vec::new();
        let mut address = range.address;
        for b in &range.blocks {
            layout.push((address, b.size, b.state.clone()));
            address += b.size;
        }
        let end = range.address + size;
        if address < end {
            layout.push((address, end - address, AdoptedState::Unmapped));
        }
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for (a, n, state) in &layout {
            if *state == AdoptedState::Unmapped {
                continue;
            }
            if let Some(last) = runs.last_mut()
                && last.0 + last.1 == *a
            {
                last.1 += n;
                continue;
            }
            runs.push((*a, *n));
        }
        // Rule 18f: the device is told.
        match self.device.adopt_range(range.address, size, page, &runs) {
            Ok(()) => {}
            Err(AdoptRefusal::OutOfMemory) => {
                return Err(ModelError::AdoptionOutOfMemory {
                    size: runs.iter().map(|r| r.1).sum(),
                    device_free: self.device.capacity() - self.device.used(),
                });
            }
            Err(AdoptRefusal::Unusable) => {
                return Err(invalid(
                    "the device refuses the range: empty, overflowing or overlapping".into(),
                ));
            }
        }
        // Rule 22a: every mapped slot is the home of a new page.
        for &(a, n) in &runs {
            self.create_pages(a, n, page);
        }
        // Rule 18c as in a segment; unmapped blocks are address space only.
        let now = self.search_counter(pool);
        let mut blocks = Vec::new();
        for (a, n, state) in layout {
            let mut block = Block::free(a, n, now);
            match state {
                AdoptedState::Free => {}
                AdoptedState::Unmapped => block = Block::unmapped(a, n),
                AdoptedState::Allocated { requested } => {
                    block.state = BlockState::Allocated;
                    block.requested = requested;
                    block.free_since = 0;
                }
                AdoptedState::Pending { requested, streams } => {
                    let mut waits: Vec<u64> =
                        streams.into_iter().filter(|&s| s != range.stream).collect();
                    waits.sort_unstable();
                    waits.dedup();
                    block.state = BlockState::Pending;
                    block.requested = requested;
                    block.pending_events = waits.len();
                    block.free_since = 0;
                    for stream in waits {
                        self.events.push(Event {
                            stream,
                            block: a,
                            complete: false,
                        });
                    }
                }
            }
            blocks.push(block);
        }
        let index = self.segments.partition_point(|s| s.address < range.address);
        self.segments.insert(
            index,
            Segment {
                address: range.address,
                size,
                stream: range.stream,
                pool,
                blocks,
                expandable: true,
            },
        );
        // Rule 18f's statistics: settled from the state, which counts a range's mapped bytes
        // as reserved and neither a segment nor inactive split (rule 19).
        self.settle_stats();
        Ok(())
    }

    /// Rule 18f, check by check: the reason of the first that fails.
    fn check_range_adoption(
        &self,
        range: &AdoptedRange,
        size: u64,
        page: u64,
    ) -> Result<(), String> {
        let address = range.address;
        if address == 0 {
            return Err("the range's address is 0".into());
        }
        if !address.is_multiple_of(SMALL_BUFFER) {
            return Err(format!("address {address:#x} is not a multiple of 2 MiB"));
        }
        if address.checked_add(size).is_none() {
            return Err(format!(
                "{address:#x} + {size} bytes overflows the address space"
            ));
        }
        if range.blocks.is_empty() {
            return Err("the range has no blocks".into());
        }
        let unmapped = |b: &AdoptedBlock| b.state == AdoptedState::Unmapped;
        if range.blocks.iter().all(unmapped) {
            return Err("no block of the range is mapped".into());
        }
        for (i, block) in range.blocks.iter().enumerate() {
            if block.size == 0 || !block.size.is_multiple_of(MIN_BLOCK_SIZE) {
                return Err(format!(
                    "block {i}: size {} is not a nonzero multiple of 512",
                    block.size
                ));
            }
        }
        let covered: u128 = range.blocks.iter().map(|b| u128::from(b.size)).sum();
        if covered > u128::from(size) {
            return Err(format!(
                "the blocks add up to {covered} bytes, the range is {size}"
            ));
        }
        let mut offset: u64 = 0;
        for (i, block) in range.blocks.iter().enumerate() {
            if unmapped(block) && (!offset.is_multiple_of(page) || !block.size.is_multiple_of(page))
            {
                return Err(format!(
                    "block {i}: unmapped, but not whole pages of {page} bytes"
                ));
            }
            offset += block.size;
        }
        if !offset.is_multiple_of(page) {
            return Err(format!(
                "the blocks end {offset} bytes in, not on a page boundary"
            ));
        }
        // The rest of the range counts as one more unmapped block.
        let rest = u64::try_from(covered).is_ok_and(|c| c < size);
        for i in 0..range.blocks.len() {
            let next_unmapped = match range.blocks.get(i + 1) {
                Some(next) => unmapped(next),
                None => rest,
            };
            if unmapped(&range.blocks[i]) && next_unmapped {
                return Err(format!("block {i} and the next are both unmapped"));
            }
        }
        for (i, pair) in range.blocks.windows(2).enumerate() {
            if pair[0].state == AdoptedState::Free && pair[1].state == AdoptedState::Free {
                return Err(format!(
                    "blocks {i} and {} are both free (they would have been merged)",
                    i + 1
                ));
            }
        }
        for (i, block) in range.blocks.iter().enumerate() {
            let requested = match &block.state {
                AdoptedState::Free | AdoptedState::Unmapped => continue,
                AdoptedState::Allocated { requested } => *requested,
                AdoptedState::Pending { requested, .. } => *requested,
            };
            if range.small && block.size > SMALL_SIZE {
                return Err(format!(
                    "block {i}: {} bytes in use in a small-pool range (at most 1 MiB)",
                    block.size
                ));
            }
            if !range.small && block.size <= SMALL_SIZE {
                return Err(format!(
                    "block {i}: {} bytes in use in a large-pool range (must exceed 1 MiB)",
                    block.size
                ));
            }
            if let AdoptedState::Pending { streams, .. } = &block.state
                && streams.iter().all(|&s| s == range.stream)
            {
                return Err(format!(
                    "block {i}: pending, but on no stream other than the range's"
                ));
            }
            if requested == 0 || requested > block.size {
                return Err(format!(
                    "block {i}: requested {requested} bytes of a {}-byte block",
                    block.size
                ));
            }
        }
        self.address_space_free(address, size, "the segment or range")
    }

    /// The next successful device allocation takes `address` when it is usable (nonzero, a
    /// multiple of 512, no overflow, no overlap with a live range), else the device picks as
    /// usual; a successful allocation clears it, and so does `None`. Under expandable segments
    /// (rule 19) the next reservation of a range takes it likewise (usable also meaning no
    /// overlap with another reservation) and clears it.
    pub fn set_next_address(&mut self, address: Option<u64>) {
        self.device.set_next_address(address);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ModelConfig, Stats};

    const MIB: u64 = 1 << 20;
    const AT: u64 = 0x1000_0000;

    fn model() -> Model {
        Model::new(ModelConfig::pytorch_defaults(1 << 30))
    }

    fn free(size: u64) -> AdoptedBlock {
        AdoptedBlock {
            size,
            state: AdoptedState::Free,
        }
    }

    fn allocated(size: u64, requested: u64) -> AdoptedBlock {
        AdoptedBlock {
            size,
            state: AdoptedState::Allocated { requested },
        }
    }

    fn pending(size: u64, requested: u64, streams: &[u64]) -> AdoptedBlock {
        AdoptedBlock {
            size,
            state: AdoptedState::Pending {
                requested,
                streams: streams.to_vec(),
            },
        }
    }

    fn small(blocks: Vec<AdoptedBlock>) -> AdoptedSegment {
        AdoptedSegment {
            address: AT,
            size: 2 * MIB,
            stream: 0,
            small: true,
            blocks,
        }
    }

    fn large(size: u64, blocks: Vec<AdoptedBlock>) -> AdoptedSegment {
        AdoptedSegment {
            address: AT,
            size,
            stream: 0,
            small: false,
            blocks,
        }
    }

    /// Refused as invalid, and nothing changed.
    fn refused(model: &mut Model, segment: AdoptedSegment) {
        let before = model.clone();
        match model.adopt_segment(segment.clone()) {
            Err(ModelError::InvalidAdoption { .. }) => {}
            other => panic!("{segment:?} gave {other:?}"),
        }
        assert_eq!(model.layout(), before.layout());
        assert_eq!(model.stats(), before.stats());
        assert_eq!(model.events, before.events);
        assert_eq!(model.device_used(), before.device_used());
    }

    #[test]
    fn each_validation_rule_refuses_and_changes_nothing() {
        let mut m = model();
        let ok = || small(vec![allocated(MIB, 100), free(MIB)]);
        let cases = vec![
            AdoptedSegment { address: 0, ..ok() },
            AdoptedSegment {
                address: AT + 256,
                ..ok()
            },
            AdoptedSegment {
                address: u64::MAX - MIB + 1,
                ..ok()
            },
            AdoptedSegment {
                size: 4 * MIB,
                ..ok()
            },
            large(12 * MIB + 512, vec![free(12 * MIB + 512)]),
            large(8 * MIB, vec![free(8 * MIB)]),
            small(vec![]),
            small(vec![allocated(0, 1), free(MIB), allocated(MIB, 1)]),
            small(vec![allocated(MIB - 100, 1), free(MIB + 100)]),
            small(vec![allocated(MIB + 512, 1), free(MIB - 512)]),
            large(20 * MIB, vec![allocated(MIB, 1), free(19 * MIB)]),
            small(vec![allocated(MIB, 1), allocated(MIB - 512, 1)]),
            small(vec![allocated(MIB, 1), free(MIB), allocated(512, 1)]),
            small(vec![free(MIB), free(MIB)]),
            small(vec![allocated(MIB, 0), free(MIB)]),
            small(vec![allocated(MIB, MIB + 1), free(MIB)]),
            small(vec![pending(MIB, MIB + 1, &[1]), free(MIB)]),
            small(vec![pending(MIB, 10, &[0]), free(MIB)]),
            small(vec![pending(MIB, 10, &[]), free(MIB)]),
        ];
        for case in cases {
            refused(&mut m, case);
        }
        m.adopt_segment(ok()).unwrap();
        refused(&mut m, large(20 * MIB, vec![free(20 * MIB)]));
        let made = m.malloc(4096, 1).unwrap();
        refused(
            &mut m,
            AdoptedSegment {
                address: made + 2 * MIB - 512,
                ..ok()
            },
        );
        m.adopt_segment(AdoptedSegment {
            address: AT + 2 * MIB,
            ..ok()
        })
        .unwrap();
        m.check_invariants().unwrap();
    }

    #[test]
    fn statistics_rise_by_the_layout_without_a_device_allocation() {
        let mut config = ModelConfig::pytorch_defaults(1 << 30);
        config.max_split_size = 20 * MIB;
        let mut m = Model::new(config);
        m.adopt_segment(small(vec![
            allocated(4096, 1000),
            free(MIB - 4096),
            pending(MIB, 700, &[1, 2, 0, 1]),
        ]))
        .unwrap();
        m.adopt_segment(AdoptedSegment {
            address: AT + 64 * MIB,
            ..large(
                40 * MIB,
                vec![allocated(24 * MIB, 23 * MIB), free(16 * MIB)],
            )
        })
        .unwrap();
        let st: Stats = m.stats();
        assert_eq!(st.segment.small_pool.current, 1);
        assert_eq!(st.segment.large_pool.current, 1);
        assert_eq!(st.reserved_bytes.all.current, (42 * MIB) as i64);
        assert_eq!(st.reserved_bytes.all.peak, (42 * MIB) as i64);
        assert_eq!(st.allocation.all.current, 2);
        assert_eq!(st.allocated_bytes.small_pool.current, 4096);
        assert_eq!(st.allocated_bytes.large_pool.current, (24 * MIB) as i64);
        assert_eq!(st.active.small_pool.current, 2);
        assert_eq!(st.active_bytes.small_pool.current, (4096 + MIB) as i64);
        assert_eq!(st.requested_bytes.small_pool.current, 1700);
        assert_eq!(st.requested_bytes.large_pool.current, (23 * MIB) as i64);
        assert_eq!(st.inactive_split.all.current, 2);
        assert_eq!(
            st.inactive_split_bytes.small_pool.current,
            (MIB - 4096) as i64
        );
        assert_eq!(
            st.inactive_split_bytes.large_pool.current,
            (16 * MIB) as i64
        );
        assert_eq!(st.oversize_segments.current, 1);
        assert_eq!(st.oversize_allocations.current, 1);
        assert_eq!(st.num_device_alloc, 0);
        assert_eq!(m.device_used(), 42 * MIB);
        // One event per other stream: 0 is the segment's own, 1 is named twice.
        let streams: Vec<u64> = m.events.iter().map(|e| e.stream).collect();
        assert_eq!(streams, vec![1, 2]);
        m.check_invariants().unwrap();
    }

    #[test]
    fn adopted_blocks_behave_like_made_ones() {
        let mut m = model();
        m.adopt_segment(small(vec![
            allocated(MIB, 10),
            pending(4096, 4000, &[1, 2]),
            free(MIB - 4096),
        ]))
        .unwrap();
        m.record_stream(AT, 2).unwrap();
        m.free(AT).unwrap();
        assert_eq!(m.free(AT), Err(ModelError::UnknownAddress { address: AT }));
        assert_eq!(m.malloc(8192, 0), Ok(AT + MIB + 4096));
        assert_ne!(m.malloc(8192, 1).unwrap() & 0xffff_0000_0000, 0);
        m.complete_stream(1);
        m.malloc(512, 1).unwrap();
        assert_eq!(m.layout()[0].blocks[1].state, crate::BlockState::Pending);
        m.complete_stream(2);
        m.malloc(512, 1).unwrap();
        let seg = &m.layout()[0];
        assert_eq!(seg.blocks[0].state, crate::BlockState::Free);
        assert_eq!(seg.blocks[0].size, MIB + 4096);
        m.free(AT + MIB + 4096).unwrap();
        m.empty_cache();
        assert!(m.layout().iter().all(|s| s.address != AT));
        assert_eq!(m.stats().num_device_free, 1);
        m.check_invariants().unwrap();
    }

    #[test]
    fn the_device_refuses_what_does_not_fit() {
        let mut m = Model::new(ModelConfig::pytorch_defaults(16 * MIB));
        let r = m.adopt_segment(large(
            20 * MIB,
            vec![free(10 * MIB), pending(10 * MIB, 1, &[1])],
        ));
        assert!(
            matches!(r, Err(ModelError::AdoptionOutOfMemory { .. })),
            "{r:?}"
        );
        assert!(m.layout().is_empty());
        assert!(m.events.is_empty());
        assert_eq!(m.stats(), Stats::default());
    }

    #[test]
    fn rule_18b_an_adoption_the_device_cannot_hold_reports_the_bytes_still_free() {
        // A 64 MiB device holding one 20 MiB segment has 44 MiB free: a 50 MiB segment to
        // adopt does not fit, and the error says so with the device's free bytes, not its
        // capacity or more.
        let mut m = Model::new(ModelConfig::pytorch_defaults(64 * MIB));
        m.malloc(4 * MIB, 0).unwrap();
        assert_eq!(m.device.used(), 20 * MIB);
        let before = m.clone();
        assert_eq!(
            m.adopt_segment(large(50 * MIB, vec![free(50 * MIB)])),
            Err(ModelError::AdoptionOutOfMemory {
                size: 50 * MIB,
                device_free: 44 * MIB,
            })
        );
        assert_eq!(m.layout(), before.layout());
    }

    #[test]
    fn free_blocks_enter_the_free_set_at_age_zero() {
        let mut config = ModelConfig::pytorch_defaults(1 << 30);
        config.garbage_collection_threshold = 0.5;
        config.memory_fraction = Some(1.0);
        let mut m = Model::new(config);
        m.malloc(3 * MIB, 0).unwrap();
        m.adopt_segment(large(20 * MIB, vec![free(20 * MIB)]))
            .unwrap();
        let s = m.segments.iter().find(|s| s.address == AT).unwrap();
        assert!(m.large_searches > 0);
        assert_eq!(s.blocks[0].free_since, m.large_searches);
    }
}

//! The model's invariant checker: what must hold between any two operations, and the typed
//! answer when something does not ([`InvariantViolation`]).

use crate::Model;
use crate::device::overlaps;
use crate::rules::{MIN_BLOCK_SIZE, MIN_LARGE_ALLOC, Pool, ROUND_LARGE, SMALL_BUFFER};
use crate::state::{BlockState, Segment};
use crate::stats::{Gauges, Stat, StatArray, Stats};

/// The first invariant [`Model::check_invariants`] found broken. Each variant names the
/// segment, block, event, statistic or thread at fault; its message is the one a test failure
/// prints.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvariantViolation {
    /// Rule 23j broken: a stitched view, its pages or its held pieces; the detail names the
    /// view or piece and what is wrong.
    #[error("{detail}")]
    View {
        /// The view or piece and what is wrong with it.
        detail: String,
    },
    /// A range of expandable segments (rule 19), or the device's reservations, broken; the
    /// detail names the range and what is wrong.
    #[error("{detail}")]
    Range {
        /// The range and what is wrong with it.
        detail: String,
    },
    /// Two segments out of address order, or sharing addresses.
    #[error(
        "segments {first:#x} (+{first_size}) and {second:#x} (+{second_size}) are out of order or overlap"
    )]
    SegmentsOutOfOrder {
        /// The earlier segment in the model's list.
        first: u64,
        /// Its size.
        first_size: u64,
        /// The later one.
        second: u64,
        /// Its size.
        second_size: u64,
    },
    /// A small-pool segment that is not 2 MiB.
    #[error("segment {segment:#x}: small segment of {size} bytes")]
    SmallSegmentSize {
        /// The segment's address.
        segment: u64,
        /// Its size.
        size: u64,
    },
    /// A large-pool segment that is not a multiple of 2 MiB of at least 10 MiB.
    #[error("segment {segment:#x}: large segment of {size} bytes")]
    LargeSegmentSize {
        /// The segment's address.
        segment: u64,
        /// Its size.
        size: u64,
    },
    /// A block that does not start where the block before it ends.
    #[error("segment {segment:#x}, block {block:#x}: expected at {expected:#x} (gap or overlap)")]
    BlockMisplaced {
        /// The segment's address.
        segment: u64,
        /// The block's address.
        block: u64,
        /// Where the previous block ends.
        expected: u64,
    },
    /// A block whose size is not a nonzero multiple of 512.
    #[error("segment {segment:#x}, block {block:#x}: size {size} is not a multiple of 512")]
    BlockSize {
        /// The segment's address.
        segment: u64,
        /// The block's address.
        block: u64,
        /// Its size.
        size: u64,
    },
    /// A block whose fields do not fit its state (a free block next to a free one, an
    /// allocated one with events, a pending one without, ...).
    #[error("segment {segment:#x}, block {block:#x}: inconsistent {state:?} block: {detail}")]
    InconsistentBlock {
        /// The segment's address.
        segment: u64,
        /// The block's address.
        block: u64,
        /// Its state.
        state: BlockState,
        /// The whole block, as the model holds it.
        detail: String,
    },
    /// Blocks that do not reach the segment's end.
    #[error("segment {segment:#x}: blocks end at {end:#x}, not at its end")]
    TilingEnd {
        /// The segment's address.
        segment: u64,
        /// Where its last block ends.
        end: u64,
    },
    /// An event whose block is not pending.
    #[error("event on stream {stream} for block {block:#x} does not hold a pending block")]
    EventWithoutPendingBlock {
        /// The stream the event was recorded on.
        stream: u64,
        /// The block's address.
        block: u64,
    },
    /// Two events for one block on one stream.
    #[error("two events for block {block:#x} on one stream ({stream})")]
    DuplicateEvent {
        /// The block's address.
        block: u64,
        /// The stream.
        stream: u64,
    },
    /// Current values that differ from their recomputation from the state.
    #[error("statistics disagree with the state: {stats:?} vs {measured:?}")]
    StatsDisagree {
        /// The statistics the model holds.
        stats: Box<Stats>,
        /// The same statistics with their current values recomputed from the state.
        measured: Box<Stats>,
    },
    /// A statistic array whose `all` is not the sum of its pools.
    #[error("{name}: all is not the sum of the pools: {array:?}")]
    AllNotSumOfPools {
        /// The statistic's name.
        name: &'static str,
        /// Its values.
        array: StatArray,
    },
    /// A statistic that is not self-consistent (`current = allocated − freed`,
    /// `0 ≤ current ≤ peak`).
    #[error("{name}: inconsistent statistic {stat:?}")]
    InconsistentStat {
        /// The statistic's name.
        name: &'static str,
        /// Its values.
        stat: Stat,
    },
    /// Reserved bytes that are not the bytes of all blocks.
    #[error("reserved bytes {reserved} are not the {blocks} bytes of all blocks")]
    ReservedBytes {
        /// `reserved_bytes.all.current`.
        reserved: i64,
        /// The blocks' bytes.
        blocks: u64,
    },
    /// The device's bytes in use differ from the reserved bytes.
    #[error("device used {used} differs from reserved bytes {reserved}")]
    DeviceUsed {
        /// The device's bytes in use.
        used: u64,
        /// `reserved_bytes.all.current`.
        reserved: i64,
    },
    /// The device's live allocations are not exactly the segments.
    #[error("device allocations {device:x?} differ from segments {segments:x?}")]
    DeviceAllocations {
        /// The device's live allocations, `(address, size)` by address.
        device: Vec<(u64, u64)>,
        /// The segments, `(address, size)` by address.
        segments: Vec<(u64, u64)>,
    },
    /// A block that belongs to a thread but is not allocated (rule 17).
    #[error("{address:#x} belongs to a thread but is not allocated")]
    OwnedNotAllocated {
        /// The block's address.
        address: u64,
    },
    /// A thread that parks more blocks than `thread_cache_blocks` (rule 17).
    #[error("thread {thread} parks {parked} blocks")]
    ThreadCacheOverfull {
        /// The thread.
        thread: u32,
        /// How many blocks it parks.
        parked: usize,
    },
    /// A thread that parks a block belonging to another thread, or to none.
    #[error("thread {thread} parks {address:#x}, not its own")]
    ParkedNotOwn {
        /// The thread.
        thread: u32,
        /// The block's address.
        address: u64,
    },
    /// A block parked twice.
    #[error("a block is parked twice")]
    ParkedTwice,
    /// Rule 22a: a lent block that does not start and end on its range's page boundaries.
    #[error("range {range:#x}, lent block {block:#x}: not aligned to the page")]
    LentBlockUnaligned {
        /// The range's base.
        range: u64,
        /// The block's address.
        block: u64,
    },
    /// Rule 22a: two lent blocks side by side (they would have been merged).
    #[error("range {range:#x}, lent block {block:#x}: followed by another lent block")]
    AdjacentLentBlocks {
        /// The range's base.
        range: u64,
        /// The first block's address.
        block: u64,
    },
    /// Rule 22a: a lent block with a requested size, stream uses or events.
    #[error("range {range:#x}, lent block {block:#x}: holds state")]
    LentBlockHoldsState {
        /// The range's base.
        range: u64,
        /// The block's address.
        block: u64,
    },
    /// Rule 22i: a slot under mapped or lent blocks that maps no page.
    #[error("slot {slot:#x} is mapped but maps no page")]
    SlotWithoutPage {
        /// The slot's address.
        slot: u64,
    },
    /// Rule 22i: the page table maps a slot of unmapped address space.
    #[error("slot {slot:#x} is unmapped but maps page {page}")]
    PageOnUnmappedSlot {
        /// The slot's address.
        slot: u64,
        /// The page.
        page: u64,
    },
    /// Rule 22i: the slots and the pages disagree (a slot maps a page that does not list
    /// it as its home or as lent, or a page lists a slot twice or one mapping another page).
    #[error("slot {slot:#x} and page {page} disagree")]
    PageTableInconsistent {
        /// The slot's address.
        slot: u64,
        /// The page.
        page: u64,
    },
    /// Rule 22i: a page whose home does not lie in mapped blocks.
    #[error("page {page}: home {home:#x} is not in mapped blocks")]
    HomeNotMapped {
        /// The page.
        page: u64,
        /// Its home slot.
        home: u64,
    },
    /// Rule 22i: a slot lent a page that is not in a lent block.
    #[error("page {page}: lent slot {slot:#x} is not in a lent block")]
    LentSlotNotInLentBlock {
        /// The page.
        page: u64,
        /// The slot.
        slot: u64,
    },
    /// Rule 22i: a slot lent a page whose home is in a range of another pool or stream.
    #[error("page {page}: lent slot {slot:#x} is in a range of another pool or stream")]
    LentSlotOfOtherPoolOrStream {
        /// The page.
        page: u64,
        /// The slot.
        slot: u64,
    },
    /// Rule 22h: the device holds another number of pages than the model.
    #[error("the device holds {device} pages, the model {model}")]
    DevicePageCount {
        /// The device's pages.
        device: usize,
        /// The model's pages.
        model: usize,
    },
    /// Rule 22h: the device maps the page at this slot (or the slot) otherwise than the
    /// model says.
    #[error("the device maps slot {slot:#x} otherwise than the model")]
    DevicePageTable {
        /// A slot of the page at fault.
        slot: u64,
    },
    /// Rule 22i: one device page lies under live blocks at two slots.
    #[error("one page lies under live blocks at slots {first:#x} and {second:#x}")]
    PageUnderTwoLiveBlocks {
        /// The first slot.
        first: u64,
        /// The second slot.
        second: u64,
    },
}

impl Model {
    /// Checks every invariant of the state and the statistics; the first violation found is
    /// described in the error.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.check_segments()?;
        for segment in &self.segments {
            self.check_segment(segment)?;
        }
        self.check_events()?;
        self.check_stats()?;
        self.check_threads()?;
        self.check_device()?;
        // Rule 23j: views and held pieces (before the page table, which lists view slots).
        self.check_views()?;
        // Rule 22: pages, their homes and their mappings.
        self.check_pages()
    }

    /// Segments are sorted by address and do not overlap.
    fn check_segments(&self) -> Result<(), InvariantViolation> {
        for pair in self.segments.windows(2) {
            let (a, b) = (&pair[0], &pair[1]);
            if a.address >= b.address || overlaps(a.address, a.size, b.address, b.size) {
                return Err(InvariantViolation::SegmentsOutOfOrder {
                    first: a.address,
                    first_size: a.size,
                    second: b.address,
                    second_size: b.size,
                });
            }
        }
        Ok(())
    }

    /// One segment: its size fits its pool; its blocks tile it exactly, are multiples of
    /// 512 B, never two free side by side, and each state's fields are consistent.
    fn check_segment(&self, segment: &Segment) -> Result<(), InvariantViolation> {
        let (address, size) = (segment.address, segment.size);
        // Rule 19: a range has invariants of its own.
        if segment.expandable {
            return self
                .check_range(segment)
                .map_err(|detail| InvariantViolation::Range { detail });
        }
        match segment.pool {
            Pool::Small if size != SMALL_BUFFER => {
                return Err(InvariantViolation::SmallSegmentSize {
                    segment: address,
                    size,
                });
            }
            Pool::Large if !size.is_multiple_of(ROUND_LARGE) || size < MIN_LARGE_ALLOC => {
                return Err(InvariantViolation::LargeSegmentSize {
                    segment: address,
                    size,
                });
            }
            _ => {}
        }
        let mut expected_address = segment.address;
        for (i, block) in segment.blocks.iter().enumerate() {
            if block.address != expected_address {
                return Err(InvariantViolation::BlockMisplaced {
                    segment: address,
                    block: block.address,
                    expected: expected_address,
                });
            }
            if block.size < MIN_BLOCK_SIZE || !block.size.is_multiple_of(MIN_BLOCK_SIZE) {
                return Err(InvariantViolation::BlockSize {
                    segment: address,
                    block: block.address,
                    size: block.size,
                });
            }
            expected_address += block.size;
            let next_free = segment.blocks.get(i + 1).map(|n| n.state) == Some(BlockState::Free);
            let events = self
                .events
                .iter()
                .filter(|e| e.block == block.address)
                .count();
            let fine = match block.state {
                BlockState::Free => {
                    !next_free
                        && block.requested == 0
                        && block.stream_uses.is_empty()
                        && block.pending_events == 0
                        && events == 0
                        && block.free_since <= self.search_counter(segment.pool)
                }
                BlockState::Allocated => {
                    block.requested > 0
                        && block.requested <= block.size
                        && block.pending_events == 0
                        && events == 0
                        && block.stream_uses.windows(2).all(|w| w[0] < w[1])
                        && !block.stream_uses.contains(&segment.stream)
                }
                BlockState::Pending => {
                    block.requested > 0
                        && block.requested <= block.size
                        && block.stream_uses.is_empty()
                        && block.pending_events > 0
                        && block.pending_events == events
                }
                // Rule 23b: held pieces lie only in ranges.
                BlockState::Held => false,
            };
            if !fine {
                return Err(InvariantViolation::InconsistentBlock {
                    segment: address,
                    block: block.address,
                    state: block.state,
                    detail: format!("{block:?}"),
                });
            }
        }
        if expected_address != address + size {
            return Err(InvariantViolation::TilingEnd {
                segment: address,
                end: expected_address,
            });
        }
        Ok(())
    }

    /// Every event holds a pending block, and one block has at most one event per stream.
    fn check_events(&self) -> Result<(), InvariantViolation> {
        for (i, event) in self.events.iter().enumerate() {
            // Rule 23e: or a view's pending allocation.
            let view = self.views.iter().find(|v| v.address == event.block);
            let pending = match view {
                Some(v) => Some(
                    v.allocation
                        .as_ref()
                        .is_some_and(|a| a.state == BlockState::Pending),
                ),
                None => crate::state::find_block(&self.segments, event.block)
                    .map(|(s, b)| self.segments[s].blocks[b].state == BlockState::Pending),
            };
            if pending != Some(true) {
                return Err(InvariantViolation::EventWithoutPendingBlock {
                    stream: event.stream,
                    block: event.block,
                });
            }
            let twin = self.events[i + 1..]
                .iter()
                .any(|e| e.block == event.block && e.stream == event.stream);
            if twin {
                return Err(InvariantViolation::DuplicateEvent {
                    block: event.block,
                    stream: event.stream,
                });
            }
        }
        Ok(())
    }

    /// Every current value equals its recomputation; every statistic is self-consistent;
    /// reserved bytes are the bytes of all blocks.
    fn check_stats(&self) -> Result<(), InvariantViolation> {
        let mut gauges = Gauges::measure(&self.segments, self.config.max_split_size);
        self.add_view_gauges(&mut gauges);
        if !self.stats.agrees_with(&gauges) {
            let mut measured = self.stats.clone();
            measured.settle(&gauges);
            return Err(InvariantViolation::StatsDisagree {
                stats: Box::new(self.stats.clone()),
                measured: Box::new(measured),
            });
        }
        let s = &self.stats;
        let arrays = [
            ("allocation", &s.allocation),
            ("segment", &s.segment),
            ("active", &s.active),
            ("inactive_split", &s.inactive_split),
            ("allocated_bytes", &s.allocated_bytes),
            ("reserved_bytes", &s.reserved_bytes),
            ("active_bytes", &s.active_bytes),
            ("inactive_split_bytes", &s.inactive_split_bytes),
            ("requested_bytes", &s.requested_bytes),
        ];
        for (name, array) in arrays {
            check_array(name, array)?;
        }
        check_stat("oversize_allocations", &s.oversize_allocations)?;
        check_stat("oversize_segments", &s.oversize_segments)?;
        let block_bytes: u64 = self
            .segments
            .iter()
            .flat_map(|seg| seg.blocks.iter())
            .filter(|b| b.mapped)
            .map(|b| b.size)
            .sum();
        if s.reserved_bytes.all.current != block_bytes as i64 {
            return Err(InvariantViolation::ReservedBytes {
                reserved: s.reserved_bytes.all.current,
                blocks: block_bytes,
            });
        }
        Ok(())
    }

    /// The device's live allocations are exactly the segments.
    fn check_device(&self) -> Result<(), InvariantViolation> {
        let reserved = self.stats.reserved_bytes.all.current;
        if self.device.used() as i64 != reserved {
            return Err(InvariantViolation::DeviceUsed {
                used: self.device.used(),
                reserved,
            });
        }
        let mut live = self.device.live().to_vec();
        live.sort_unstable();
        let segments: Vec<(u64, u64)> = self
            .segments
            .iter()
            .filter(|s| !s.expandable)
            .map(|s| (s.address, s.size))
            .collect();
        if live != segments {
            return Err(InvariantViolation::DeviceAllocations {
                device: live,
                segments,
            });
        }
        // Rule 19: reservations and mapped bytes.
        self.check_device_ranges()
            .map_err(|detail| InvariantViolation::Range { detail })
    }
}

/// `all` is the sum of the pools, and each of the three is self-consistent.
fn check_array(name: &'static str, array: &StatArray) -> Result<(), InvariantViolation> {
    check_stat(name, &array.all)?;
    check_stat(name, &array.small_pool)?;
    check_stat(name, &array.large_pool)?;
    if array.all.current != array.small_pool.current + array.large_pool.current {
        return Err(InvariantViolation::AllNotSumOfPools {
            name,
            array: *array,
        });
    }
    Ok(())
}

/// `current = allocated − freed`, `0 ≤ current ≤ peak`.
fn check_stat(name: &'static str, stat: &Stat) -> Result<(), InvariantViolation> {
    let consistent = stat.current == stat.allocated - stat.freed
        && stat.current >= 0
        && stat.current <= stat.peak;
    if consistent {
        Ok(())
    } else {
        Err(InvariantViolation::InconsistentStat { name, stat: *stat })
    }
}

#[cfg(test)]
mod tests {
    use super::InvariantViolation;
    use crate::{BlockState, Model, ModelConfig};

    #[test]
    fn a_busy_model_satisfies_its_invariants() {
        let mut model = Model::new(ModelConfig::pytorch_defaults(1 << 30));
        let a = model.malloc(3 << 20, 0).unwrap();
        let b = model.malloc(1000, 0).unwrap();
        model.record_stream(b, 5).unwrap();
        model.free(b).unwrap();
        model.check_invariants().unwrap();
        model.free(a).unwrap();
        model.check_invariants().unwrap();
    }

    #[test]
    fn a_corrupted_state_is_reported() {
        let mut model = Model::new(ModelConfig::pytorch_defaults(1 << 30));
        let a = model.malloc(3 << 20, 0).unwrap();
        model.free(a).unwrap();
        model.check_invariants().unwrap();
        // Split the free segment into two free neighbours behind the model's back.
        let blocks = &mut model.segments[0].blocks;
        let mut second = blocks[0].clone();
        blocks[0].size -= 512;
        second.address += blocks[0].size;
        second.size = 512;
        blocks.push(second);
        let error = model.check_invariants().unwrap_err();
        assert!(
            matches!(
                error,
                InvariantViolation::InconsistentBlock {
                    state: BlockState::Free,
                    ..
                }
            ),
            "{error:?}"
        );
        assert!(
            error.to_string().contains("inconsistent Free block"),
            "{error}"
        );
    }

    #[test]
    fn a_small_segment_of_another_size_than_2_mib_is_reported() {
        let mut model = Model::new(ModelConfig::pytorch_defaults(1 << 30));
        model.malloc(4096, 0).unwrap();
        model.check_invariants().unwrap();
        // Grow the small segment and its last block to 4 MiB behind the model's back: the
        // blocks still tile it, so only the size rule (rule 4: small segments are 2 MiB) fails.
        let segment = &mut model.segments[0];
        segment.size += 2 << 20;
        segment.blocks.last_mut().unwrap().size += 2 << 20;
        let error = model.check_invariants().unwrap_err();
        assert!(
            matches!(error, InvariantViolation::SmallSegmentSize { size, .. } if size == 4 << 20),
            "{error:?}"
        );
    }

    #[test]
    fn statistics_that_drift_from_the_state_are_reported() {
        let mut model = Model::new(ModelConfig::pytorch_defaults(1 << 30));
        model.malloc(4096, 0).unwrap();
        model.stats.allocation.all.current += 1;
        let error = model.check_invariants().unwrap_err();
        let InvariantViolation::StatsDisagree { stats, measured } = &error else {
            panic!("expected StatsDisagree, got {error:?}");
        };
        assert_eq!(stats.allocation.all.current, 2);
        assert_eq!(measured.allocation.all.current, 1);
        assert!(
            error
                .to_string()
                .starts_with("statistics disagree with the state")
        );
    }
}

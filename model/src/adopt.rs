//! Rule 18: adopting a segment that already exists on the device (the process's state when a
//! trace's recording began), and the `set_next_address` hook of the simulated device.
//!
//! Validation is a list of plain checks in the order ARCHITECTURE.md writes them; the first
//! that fails is the error and nothing changes. Then the device is told, the segment is
//! inserted as given, one event per named stream is recorded for each pending block, and the
//! statistics are settled once from the new state, like every other sub-step of the model.

use crate::rules::{MIN_BLOCK_SIZE, MIN_LARGE_ALLOC, Pool, ROUND_LARGE, SMALL_BUFFER, SMALL_SIZE};
use crate::state::{Block, BlockState, Event, Segment};
use crate::{Model, ModelError, device::overlaps};

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
        if !self.device.adopt(segment.address, segment.size) {
            return Err(ModelError::AdoptionOutOfMemory {
                size: segment.size,
                device_free: self.device.capacity() - self.device.used(),
            });
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
                AdoptedState::Free => {}
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
        let index = self.segments.partition_point(|s| s.address < segment.address);
        self.segments.insert(
            index,
            Segment {
                address: segment.address,
                size: segment.size,
                stream: segment.stream,
                pool,
                blocks,
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
        if address % MIN_BLOCK_SIZE != 0 {
            return Err(format!("address {address:#x} is not a multiple of 512"));
        }
        if address.checked_add(size).is_none() {
            return Err(format!(
                "{address:#x} + {size} bytes overflows the address space"
            ));
        }
        if segment.small && size != SMALL_BUFFER {
            return Err(format!("a small-pool segment of {size} bytes (must be 2 MiB)"));
        }
        if !segment.small && (size % ROUND_LARGE != 0 || size < MIN_LARGE_ALLOC) {
            return Err(format!(
                "a large-pool segment of {size} bytes (must be a multiple of 2 MiB, at least 10 MiB)"
            ));
        }
        if segment.blocks.is_empty() {
            return Err("the segment has no blocks".into());
        }
        let mut total: u128 = 0;
        for (i, block) in segment.blocks.iter().enumerate() {
            let n = block.size;
            if n == 0 || n % MIN_BLOCK_SIZE != 0 {
                return Err(format!(
                    "block {i}: size {n} is not a nonzero multiple of 512"
                ));
            }
            if segment.small && n > SMALL_SIZE {
                return Err(format!(
                    "block {i}: {n} bytes in a small-pool segment (at most 1 MiB)"
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
                AdoptedState::Free => continue,
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
        if let Some(held) = self
            .segments
            .iter()
            .find(|s| overlaps(address, size, s.address, s.size))
        {
            return Err(format!(
                "{address:#x} (+{size}) overlaps the segment held at {:#x} (+{})",
                held.address, held.size
            ));
        }
        Ok(())
    }

    /// The next successful device allocation takes `address` when it is usable (nonzero, a
    /// multiple of 512, no overflow, no overlap with a live range), else the device picks as
    /// usual; a successful allocation clears it, and so does `None`.
    pub fn set_next_address(&mut self, address: Option<u64>) {
        self.device.set_next_address(address);
    }
}

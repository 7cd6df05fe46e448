//! Rule 18: adopting a segment the device already holds (the process's state when a trace's
//! recording began).
//!
//! The one rule: validate everything before touching anything. The checks run on the
//! description alone (plus one pass over the blocks held, for overlap); then the pending
//! blocks' events are recorded and the backend is told, each undone on failure; only then is
//! the layout linked into the slab, the free sets, the live map and the event queues, and the
//! statistics raised by what it holds.

use crate::backend::{Backend, EventId, StreamId};
use crate::block::{Block, BlockId, BlockState};
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
        // Rule 18c: one event per distinct other stream, blocks in address order, streams
        // ascending; recorded before the backend is told so that a failure undoes cleanly.
        let mut recorded: Vec<(usize, StreamId, EventId)> = Vec::new();
        let undo = |core: &mut Self, recorded: &[(usize, StreamId, EventId)]| {
            for &(_, _, e) in recorded {
                core.backend.destroy_event(e);
            }
        };
        for (i, block) in segment.blocks.iter().enumerate() {
            if let AdoptedState::Pending { streams, .. } = &block.state {
                let mut waits: Vec<StreamId> = streams
                    .iter()
                    .copied()
                    .filter(|&s| s != segment.stream)
                    .collect();
                waits.sort_unstable();
                waits.dedup();
                for s in waits {
                    match self.backend.record_event(s) {
                        Ok(e) => recorded.push((i, s, e)),
                        Err(err) => {
                            undo(self, &recorded);
                            return Err(Error::Backend(err));
                        }
                    }
                }
            }
        }
        // Rule 18b.
        if let Err(err) = self.backend.adopt(segment.address, segment.size) {
            undo(self, &recorded);
            return Err(Error::Backend(err));
        }
        self.install(&segment, &recorded);
        Ok(())
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
                AdoptedState::Free => (BlockState::Free, 0, 0),
                AdoptedState::Allocated { requested } => (BlockState::Allocated, *requested, 0),
                AdoptedState::Pending { requested, .. } => (
                    BlockState::Pending,
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
            });
            if let Some(&prev) = ids.last() {
                self.blocks.get_mut(prev).next = Some(id);
            }
            ids.push(id);
            let size = adopted.size;
            let s = &mut self.stats;
            match state {
                BlockState::Free => {
                    self.free[p].insert((segment.stream, size, address, id));
                    if split {
                        s.inactive_split.increase(pool, 1);
                        s.inactive_split_bytes.increase(pool, size);
                    }
                }
                BlockState::Allocated => {
                    self.live.insert(address, id);
                    s.allocation.increase(pool, 1);
                    s.allocated_bytes.increase(pool, size);
                    if size >= max_split {
                        s.oversize_allocations.increase(1);
                    }
                }
                BlockState::Pending => {}
            }
            if state != BlockState::Free {
                s.active.increase(pool, 1);
                s.active_bytes.increase(pool, size);
                s.requested_bytes.increase(pool, requested);
            }
            address += size;
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
            if b.size == 0 || !b.size.is_multiple_of(MIN_BLOCK_SIZE) {
                return Err(format!(
                    "block {i} has size {}, not a nonzero multiple of 512",
                    b.size
                ));
            }
            match pool {
                Pool::Small if b.size > SMALL_SIZE => {
                    return Err(format!(
                        "block {i} of a small-pool segment has {} bytes (at most 1 MiB)",
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
                AdoptedState::Free => continue,
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
        if let Some((_, held)) = self
            .blocks
            .iter()
            .find(|(_, b)| b.address < end && address < b.address + b.size)
        {
            return Err(format!(
                "{address:#x} (+{size}) overlaps a segment held (its block at {:#x})",
                held.address
            ));
        }
        Ok(())
    }
}

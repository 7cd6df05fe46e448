//! Finding, making, handing out and taking back blocks: rules 5, 6, 7, 8, 10, 13, 14 and 15.
//! Giving memory back to the device (rules 9, 11, 12) is in `release.rs`; expandable segments
//! (rule 19) are in `expandable.rs`.
//!
//! Every sub-step that changes what the statistics measure ends with `settle_stats`, which
//! recomputes the statistics from the state and records the difference.

use crate::expandable;
use crate::rules::{self, Pool};
use crate::state::{self, Block, BlockState, Event, Segment};
use crate::stats::Gauges;
use crate::{Model, ModelError};

/// What rule 6's search found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Found {
    /// A free block of the free set, at this address.
    Free(u64),
    /// Rule 22d: a lent block at `address`, whose first `slots` slots are re-homed.
    Lent {
        /// The lent block's first byte.
        address: u64,
        /// How many slots are re-homed.
        slots: u64,
    },
}

/// What rule 7's device step made: a free block to hand out, or (rule 23f) a view already
/// handed out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Grown {
    /// A free block at this address, to hand out (rules 13, 14).
    Block(u64),
    /// Rule 23f: a view made and handed out; its allocation's address.
    View(u64),
}

impl Model {
    /// Ends a sub-step: recomputes every statistic's current value from the state and turns
    /// the difference into increases and decreases.
    pub(crate) fn settle_stats(&mut self) {
        let mut gauges = Gauges::measure(&self.segments, self.config.max_split_size);
        // Rule 23b: the views' allocations.
        self.add_view_gauges(&mut gauges);
        self.stats.settle(&gauges);
        // Rule 20: the requested high-water follows every value the statistic reaches.
        let requested = self.stats.requested_bytes.all.current as u64;
        self.requested_high_water = self.requested_high_water.max(requested);
    }

    /// Bytes reserved: the sum of the segments' sizes, plus the mapped bytes of ranges
    /// (rule 19).
    pub(crate) fn reserved(&self) -> u64 {
        let mut reserved = 0;
        for segment in &self.segments {
            if segment.expandable {
                reserved += segment
                    .blocks
                    .iter()
                    .filter(|b| b.mapped)
                    .map(|b| b.size)
                    .sum::<u64>();
            } else {
                reserved += segment.size;
            }
        }
        reserved
    }

    /// Whether garbage collection is on: a memory fraction is set and the threshold is
    /// positive (rules 6, 7a).
    pub(crate) fn garbage_collection_on(&self) -> bool {
        self.allowed.is_some() && self.config.garbage_collection_threshold > 0.0
    }

    /// The search counter of `pool` (rule 6).
    pub(crate) fn search_counter(&self, pool: Pool) -> u64 {
        match pool {
            Pool::Small => self.small_searches,
            Pool::Large => self.large_searches,
        }
    }

    /// The streams with outstanding events, ascending, each once.
    pub(crate) fn streams_with_events(&self) -> Vec<u64> {
        let mut streams: Vec<u64> = self.events.iter().map(|e| e.stream).collect();
        streams.sort_unstable();
        streams.dedup();
        streams
    }

    /// Rule 5: for each stream with outstanding events, ascending, take its completed events
    /// in recorded order up to the first one not complete.
    pub(crate) fn process_events(&mut self) {
        for stream in self.streams_with_events() {
            while let Some(index) = self.events.iter().position(|e| e.stream == stream) {
                if !self.events[index].complete {
                    break;
                }
                let event = self.events.remove(index);
                self.event_done(event.block);
            }
        }
    }

    /// Rules 5, 9: one event of the pending block at `address` is done; the last one returns
    /// the block to the pool.
    pub(crate) fn event_done(&mut self, address: u64) {
        // Rule 23e: a view's allocation waits for its events as any block.
        if let Some(v) = self.view_in_use_at(address) {
            self.view_event_done(v);
            return;
        }
        let (s, b) = state::find_block(&self.segments, address).expect("an event holds a block");
        let block = &mut self.segments[s].blocks[b];
        block.pending_events -= 1;
        if block.pending_events == 0 {
            self.return_to_pool(s, b);
        }
    }

    /// Rule 6: the address of the best cached block for a request rounded to `rounded` bytes
    /// on `stream`, if it may be used.
    pub(crate) fn best_fit(&mut self, pool: Pool, stream: u64, rounded: u64) -> Option<u64> {
        // Rule 6: with garbage collection on, every search counts.
        if self.garbage_collection_on() {
            match pool {
                Pool::Small => self.small_searches += 1,
                Pool::Large => self.large_searches += 1,
            }
        }
        match self.search_free_set(pool, stream, rounded)? {
            Found::Free(address) => Some(address),
            Found::Lent { address, slots } => {
                // Rule 22d: a lent candidate is re-homed (its first `slots` slots) and the
                // new free block, not merged, is the found block.
                self.rehome(address, slots, false);
                Some(address)
            }
        }
    }

    /// Rule 17a's question: would a request of `size` bytes on `stream` be served from the
    /// cache? Rule 5 runs (it would run first anyway), then rule 6's search is asked without
    /// counting it.
    pub(crate) fn has_cached_block(&mut self, size: u64, stream: u64) -> bool {
        self.process_events();
        let rounded = rules::round_size(size, &self.config.roundup_power2_divisions);
        let pool = rules::pool_for(rounded);
        // Rule 23d: the search for a view is this search too.
        self.search_free_set(pool, stream, rounded).is_some()
            || self.view_candidate(pool, stream, rounded).is_some()
    }

    /// Rule 6's search itself (with rule 19a's walk and rule 22d's lent candidate): the
    /// block it would hand out, if any. Nothing changes.
    fn search_free_set(&self, pool: Pool, stream: u64, rounded: u64) -> Option<Found> {
        // The first entry of the free set at or after (stream, rounded, 0), of the stream (no
        // reuse across streams); rule 19a: a block of a range may give way to one of smaller
        // reach.
        let free = state::free_set(&self.segments, pool);
        let candidate = free
            .iter()
            .position(|e| e.key() >= (stream, rounded, 0))
            .filter(|&index| free[index].stream == stream)
            .map(|index| &free[expandable::walk_by_reach(&free, index)]);
        // Rule 22d: the smallest lent block whose first slots are usable, when smaller by
        // (size, address).
        let lent = self.lent_candidate(pool, stream, rounded);
        let (size, found) = match (candidate, lent) {
            (Some(best), Some((size, address, _)))
                if (size, address) >= (best.size, best.address) =>
            {
                (best.size, Found::Free(best.address))
            }
            (_, Some((size, address, slots))) => (size, Found::Lent { address, slots }),
            (Some(best), None) => (best.size, Found::Free(best.address)),
            (None, None) => return None,
        };
        let max_split = self.config.max_split_size;
        // A request below max_split_size does not take an oversize block.
        if rounded < max_split && size >= max_split {
            return None;
        }
        // An oversize request takes an oversize block only within the rounding allowance.
        let allowance = u128::from(self.config.max_non_split_rounding_size);
        if rounded >= max_split && u128::from(size) >= u128::from(rounded) + allowance {
            return None;
        }
        Some(found)
    }

    /// Rule 7: no cached block fits a request of `requested` bytes rounded to `rounded`;
    /// collect garbage, allocate a segment, release oversize blocks and retry, release
    /// everything and retry, or fail with out-of-memory.
    pub(crate) fn make_block(
        &mut self,
        pool: Pool,
        stream: u64,
        rounded: u64,
        requested: u64,
    ) -> Result<Grown, ModelError> {
        // Rule 4.
        let size = rules::segment_size(rounded);
        // Rule 7a.
        if self.garbage_collection_on() {
            self.collect_garbage();
        }
        // Rule 7b.
        if let Some(address) = self.grow(pool, stream, rounded, requested, size) {
            return Ok(address);
        }
        // Rule 7c.
        if self.release_oversize_blocks(pool, stream, rounded)
            && let Some(address) = self.grow(pool, stream, rounded, requested, size)
        {
            return Ok(address);
        }
        // Rule 7d.
        self.release_cached_segments();
        self.stats.num_alloc_retries += 1;
        if let Some(address) = self.grow(pool, stream, rounded, requested, size) {
            return Ok(address);
        }
        // Rule 7: everything failed.
        self.stats.num_ooms += 1;
        let allocated = self.stats.allocated_bytes.all.current as u64;
        let reserved = self.stats.reserved_bytes.all.current as u64;
        Err(ModelError::OutOfMemory {
            alloc_size: size,
            capacity: self.device.capacity(),
            device_free: self.device.capacity() - self.device.used(),
            allowed: self.allowed,
            allocated,
            reserved_unallocated: reserved - allocated,
        })
    }

    /// Rule 7's device step: a new segment of `size` bytes (rule 8), or, under expandable
    /// segments, a range block grown to `rounded` bytes (rule 19b, with `size` for the memory
    /// fraction check, after rule 20's reclaim — or rule 23f's view — for a request of
    /// `requested` bytes). What was made, or `None`.
    fn grow(
        &mut self,
        pool: Pool,
        stream: u64,
        rounded: u64,
        requested: u64,
        size: u64,
    ) -> Option<Grown> {
        if self.config.expandable_segments {
            self.grow_range(pool, stream, rounded, requested, size)
        } else {
            self.allocate_segment(pool, stream, size).map(Grown::Block)
        }
    }

    /// Rule 8: a new segment of `size` bytes on `stream`, one free block, or `None` when the
    /// memory fraction or the device refuses.
    fn allocate_segment(&mut self, pool: Pool, stream: u64, size: u64) -> Option<u64> {
        // Rule 8: the memory fraction stops the attempt before the device.
        if let Some(allowed) = self.allowed
            && u128::from(self.reserved()) + u128::from(size) > u128::from(allowed)
        {
            return None;
        }
        let address = self.device.allocate(size)?;
        let segment = Segment {
            address,
            size,
            stream,
            pool,
            blocks: vec![Block::free(address, size, self.search_counter(pool))],
            expandable: false,
        };
        let index = self.segments.partition_point(|s| s.address < address);
        self.segments.insert(index, segment);
        self.stats.num_device_alloc += 1;
        self.settle_stats();
        Some(address)
    }

    /// Rule 10: the block at position (`s`, `b`) returns to the pool, merging with free
    /// neighbours; the merged block enters the free set now.
    pub(crate) fn return_to_pool(&mut self, s: usize, b: usize) {
        let now = self.search_counter(self.segments[s].pool);
        let blocks = &mut self.segments[s].blocks;
        let block = &mut blocks[b];
        block.state = BlockState::Free;
        block.requested = 0;
        block.pending_events = 0;
        let mut b = b;
        // Merge with the previous block when it is free (and mapped, rule 19).
        if b > 0 && blocks[b - 1].in_free_set() {
            let this = blocks.remove(b);
            b -= 1;
            blocks[b].size += this.size;
        }
        // Merge with the next block when it is free (and mapped, rule 19).
        if b + 1 < blocks.len() && blocks[b + 1].in_free_set() {
            let next = blocks.remove(b + 1);
            blocks[b].size += next.size;
        }
        blocks[b].free_since = now;
        self.settle_stats();
    }

    /// Rules 13, 14: hands out the free block at `address` for a request of `requested` bytes
    /// rounded to `rounded`, splitting it when rule 13 says so.
    pub(crate) fn hand_out(&mut self, address: u64, rounded: u64, requested: u64) -> u64 {
        let (s, b) = state::find_block(&self.segments, address).expect("a found block exists");
        let pool = self.segments[s].pool;
        let now = self.search_counter(pool);
        let split = self.splits(pool, self.segments[s].blocks[b].size, rounded);
        let blocks = &mut self.segments[s].blocks;
        // Rule 13 (rule 19c under expandable segments): split; the allocated part takes the
        // lower addresses and the remainder enters the free set now.
        let size = blocks[b].size;
        if split {
            blocks[b].size = rounded;
            let remainder = Block::free(address + rounded, size - rounded, now);
            blocks.insert(b + 1, remainder);
            // Rule 22d: a re-homed block's remainder merges with the block after it when
            // that one is free (a found block of rules 6 and 19b never has a free block after
            // it: nothing merges then).
            if b + 2 < blocks.len() && blocks[b + 2].in_free_set() {
                let next = blocks.remove(b + 2);
                blocks[b + 1].size += next.size;
            }
        }
        // Rule 14.
        let block = &mut blocks[b];
        block.state = BlockState::Allocated;
        block.requested = requested;
        self.settle_stats();
        address
    }

    /// Rule 15: the user frees the allocated block at (`s`, `b`). It stops being an allocation
    /// at once; then it waits for one event per other stream that used it, or returns to the
    /// pool now.
    pub(crate) fn free_allocation(&mut self, s: usize, b: usize) {
        let block = &mut self.segments[s].blocks[b];
        // Freed by the user: no longer allocated, still active until it returns to the pool.
        block.state = BlockState::Pending;
        let streams = std::mem::take(&mut block.stream_uses);
        block.pending_events = streams.len();
        let address = block.address;
        self.settle_stats();
        if streams.is_empty() {
            // Rule 10.
            self.return_to_pool(s, b);
        } else {
            // One event per stream, ascending.
            for stream in streams {
                self.events.push(Event {
                    stream,
                    block: address,
                    complete: false,
                });
            }
        }
    }
}

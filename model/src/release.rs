//! Giving cached memory back to the device: releasing all cached segments (rule 9), releasing
//! oversize blocks (rule 11) and garbage collection (rule 12).
//!
//! Only a free block that is a whole segment can be given back. PyTorch never meets a free
//! block of at least `max_split_size` bytes that is not a whole segment when
//! `max_split_size > 20 MiB` (the only values it accepts); for smaller values the model treats
//! such a block in rule 11 as PyTorch treats a block it cannot release there (an expandable
//! segment's): it is passed over and counts nothing.
//!
//! Rule 19f: blocks of ranges are never whole segments, so rules 11 and 12 pass them over the
//! same way. (PyTorch 2.x's `release_available_cached_blocks` does not check: should it pick
//! a free range block, `release_block` fails its `!block->expandable_segment_` assertion.)

use crate::Model;
use crate::rules::Pool;
use crate::state::{self, FreeEntry};

impl Model {
    /// Gives the segment at `address`, one free block, back to the device.
    pub(crate) fn release_segment(&mut self, address: u64) {
        let index = self
            .segments
            .iter()
            .position(|s| s.address == address)
            .expect("a released segment exists");
        assert!(
            self.segments[index].is_one_free_block(),
            "release of a segment in use"
        );
        self.segments.remove(index);
        self.device.free(address);
        self.stats.num_device_free += 1;
        self.settle_stats();
    }

    /// Rule 9: wait for every outstanding event (streams ascending, each stream's events in
    /// recorded order), then give every free whole segment back to the device, large pool
    /// then small pool, in free-set order; in each pool, after its segments, unmap its lent
    /// blocks (rule 22g), then the whole pages of its free range blocks (rule 19e).
    pub(crate) fn release_cached_segments(&mut self) {
        self.stats.num_sync_all_streams += 1;
        for stream in self.streams_with_events() {
            while let Some(index) = self.events.iter().position(|e| e.stream == stream) {
                // Waiting on the event completes it.
                let event = self.events.remove(index);
                self.event_done(event.block);
            }
        }
        // Rule 23h: every free view, in the order made, before rule 19e's unmapping.
        self.destroy_free_views();
        for pool in [Pool::Large, Pool::Small] {
            for entry in state::free_set(&self.segments, pool) {
                if entry.whole {
                    self.release_segment(entry.address);
                }
            }
            // Rule 22g: the lent blocks, before the free mapped blocks.
            self.unmap_lent_blocks(pool);
            // Rule 19e.
            self.unmap_free_range_blocks(pool);
        }
    }

    /// Rule 11: release cached oversize blocks of `stream` so that a request rounded to
    /// `rounded` bytes may get a new segment. Whether enough was released.
    pub(crate) fn release_oversize_blocks(
        &mut self,
        pool: Pool,
        stream: u64,
        rounded: u64,
    ) -> bool {
        let max_split = self.config.max_split_size;
        if max_split == u64::MAX {
            return false;
        }
        let key = rounded.max(max_split);
        let free: Vec<FreeEntry> = state::free_set(&self.segments, pool);
        // The first entry at or after (stream, key, 0).
        let first = free
            .iter()
            .position(|e| e.key() >= (stream, key, 0))
            .unwrap_or(free.len());
        // One block of the stream is large enough: release it.
        if first < free.len() && free[first].stream == stream && free[first].whole {
            self.release_segment(free[first].address);
            return true;
        }
        // Otherwise release the largest oversize blocks of the stream, walking down from just
        // below the key, until `key` bytes are released.
        if first == 0 {
            return false;
        }
        let mut released = 0u64;
        let mut i = first - 1;
        while released < key && free[i].size >= max_split && free[i].stream == stream {
            if free[i].whole {
                self.release_segment(free[i].address);
                released += free[i].size;
            }
            if i == 0 {
                break;
            }
            i -= 1;
        }
        released >= key
    }

    /// Rule 12: release old free whole segments of the large pool until reserved bytes come
    /// down to the garbage collection threshold or nothing more can be released.
    pub(crate) fn collect_garbage(&mut self) {
        let allowed = self
            .allowed
            .expect("garbage collection needs a memory fraction");
        let threshold = (self.config.garbage_collection_threshold * allowed as f64) as u64;
        let reserved = self.reserved();
        if reserved <= threshold {
            return;
        }
        let target = reserved - threshold;
        let now = self.search_counter(Pool::Large);
        let age = |entry: &FreeEntry| now - entry.free_since;
        // The releasable blocks: free whole segments of the large pool.
        let releasable = |model: &Model| -> Vec<FreeEntry> {
            state::free_set(&model.segments, Pool::Large)
                .into_iter()
                .filter(|e| e.whole)
                .collect()
        };
        let mut total_age: u64 = releasable(self).iter().map(age).sum();
        let mut count = releasable(self).len() as u64;
        let mut reclaimed = 0u64;
        let mut released_any = true;
        while reclaimed < target && released_any && count > 0 {
            // Release every block at least as old as the mean age of those remaining.
            let mean = total_age as f64 / count as f64;
            released_any = false;
            for entry in releasable(self) {
                if age(&entry) as f64 >= mean {
                    self.release_segment(entry.address);
                    released_any = true;
                    reclaimed += entry.size;
                    total_age -= age(&entry);
                    count -= 1;
                }
            }
        }
    }
}

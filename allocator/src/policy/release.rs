//! Giving memory back: emptying the cache, releasing oversize blocks, garbage collection.
//!
//! The one rule: only a free block that is a whole segment is ever given back to the device,
//! and every release updates the statistics in the same step as the device call succeeds.

use crate::backend::{Backend, StreamId};
use crate::block::{Block, BlockId, BlockPhase};
use crate::error::Error;
use crate::history::TraceAction;
use crate::sizes::Pool;

use super::CachingCore;

impl<B: Backend> CachingCore<B> {
    /// Rule 9: wait for every outstanding event, then give every whole free segment back.
    pub fn empty_cache(&mut self) -> Result<(), Error> {
        self.release_cached()
    }

    pub(super) fn release_cached(&mut self) -> Result<(), Error> {
        self.stats.num_sync_all_streams += 1;
        let streams: Vec<StreamId> = self.events.keys().copied().collect();
        for stream in streams {
            while let Some(&(event, id)) = self.events.get(&stream).and_then(|q| q.front()) {
                self.backend.synchronize_event(event)?;
                self.retire_event(stream, event, id);
            }
        }
        // Rule 23h: every free view first, in the order made.
        if self.views.is_some() {
            self.destroy_free_views()?;
        }
        // Rule 19e: per pool, whole segments first, then (rule 22g) the lent blocks, then the
        // free pages of ranges.
        for pool in [Pool::Large, Pool::Small] {
            self.release_whole_segments(pool)?;
            if self.pages.is_some() {
                self.unmap_lent(pool)?;
            }
            self.unmap_free_pages(pool)?;
        }
        Ok(())
    }

    fn release_whole_segments(&mut self, pool: Pool) -> Result<(), Error> {
        let whole: Vec<BlockId> = self.free[pool.index()]
            .iter()
            .map(|k| k.3)
            .filter(|&id| self.is_whole_segment(id))
            .collect();
        for id in whole {
            self.release_segment(id)?;
        }
        Ok(())
    }

    /// Whether block `id` is a whole segment of rule 8 or 18 (never a block of a range: rule
    /// 19f).
    fn is_whole_segment(&self, id: BlockId) -> bool {
        let b = self.blocks.get(id);
        !b.is_split() && b.range.is_none()
    }

    /// Gives a free, whole-segment block back to the device.
    pub(super) fn release_segment(&mut self, id: BlockId) -> Result<(), Error> {
        let (address, size, pool, stream) = {
            let b = self.blocks.get(id);
            debug_assert!(!b.is_split() && b.state == BlockPhase::Free);
            (b.address, b.size, b.pool, b.stream)
        };
        self.backend.free(address, size)?;
        self.stats.num_device_free += 1;
        self.trace(TraceAction::SegmentFree, address, size, stream);
        self.free_remove(pool.index(), &(stream, size, address, id));
        self.blocks.remove(id);
        self.reserved -= size;
        self.stats.segment.decrease(pool, 1);
        self.stats.reserved_bytes.decrease(pool, size);
        if size >= self.settings.max_split_size {
            self.stats.oversize_segments.decrease(1);
        }
        Ok(())
    }

    /// Rule 11: release one oversize block that is large enough, or the largest ones until
    /// enough is released. True when that succeeded.
    pub(super) fn release_oversize(
        &mut self,
        pool: Pool,
        stream: StreamId,
        rounded: u64,
    ) -> Result<bool, Error> {
        let max_split = self.settings.max_split_size;
        if max_split == u64::MAX {
            return Ok(false);
        }
        let target = rounded.max(max_split);
        let first = self.free[pool.index()].at_least(stream, target).next();
        if let Some((s, _, _, id)) = first {
            // A block that is not a whole segment cannot be given back on its own; PyTorch
            // skips such blocks (expandable segments) the same way.
            if s == stream && self.is_whole_segment(id) {
                self.release_segment(id)?;
                return Ok(true);
            }
        }
        let mut chosen = Vec::new();
        let mut total = 0u64;
        for (s, size, _, id) in self.free[pool.index()].below(stream, target) {
            if total >= target || size < max_split || s != stream {
                break;
            }
            if self.is_whole_segment(id) {
                chosen.push(id);
                total += size;
            }
        }
        for id in chosen {
            self.release_segment(id)?;
        }
        Ok(total >= target)
    }

    /// Rule 12: release old whole free segments of the large pool until reserved memory is
    /// back under the garbage-collection threshold.
    pub(super) fn garbage_collect(&mut self) -> Result<(), Error> {
        let allowed = self.allowed_max.unwrap_or(0);
        let threshold = (self.settings.garbage_collection_threshold * allowed as f64) as u64;
        if self.reserved <= threshold {
            return Ok(());
        }
        let target = self.reserved - threshold;
        let now = self.searches[Pool::Large.index()];
        let age = |b: &Block| now - b.gc_base;
        let mut total_age = 0u64;
        let mut count = 0u64;
        for k in self.free[Pool::Large.index()].iter() {
            let b = self.blocks.get(k.3);
            if self.is_whole_segment(k.3) {
                total_age += age(b);
                count += 1;
            }
        }
        let mut reclaimed = 0u64;
        let mut freed_any = true;
        while reclaimed < target && freed_any && count > 0 {
            let mean = total_age as f64 / count as f64;
            freed_any = false;
            let old: Vec<(BlockId, u64, u64)> = self.free[Pool::Large.index()]
                .iter()
                .filter_map(|k| {
                    let b = self.blocks.get(k.3);
                    (self.is_whole_segment(k.3) && age(b) as f64 >= mean).then_some((
                        k.3,
                        b.size,
                        age(b),
                    ))
                })
                .collect();
            for (id, size, a) in old {
                self.release_segment(id)?;
                freed_any = true;
                reclaimed += size;
                total_age -= a;
                count -= 1;
            }
        }
        Ok(())
    }
}

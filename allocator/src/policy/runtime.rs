//! What a program changes while it runs (rules 24 and 25): the settings PyTorch's
//! `torch.cuda.memory._set_allocator_settings` changes, and the release of one stream's cached
//! segments (a private pool's, when `torch.cuda.MemPool` is deleted).

use crate::backend::{Backend, StreamId};
use crate::block::{Backing, BlockId, BlockPhase};
use crate::error::Error;
use crate::settings::Settings;
use crate::sizes::Pool;

use super::CachingCore;

impl<B: Backend> CachingCore<B> {
    /// Rule 24: puts `settings` in force from now on. They may differ from the settings in
    /// force only in `max_split_size`, `max_non_split_rounding_size`,
    /// `garbage_collection_threshold` and `roundup_power2_divisions` (what PyTorch reads on
    /// every call); any other difference is refused with [`Error::Unsupported`] and nothing
    /// changes. No block moves; the oversize counters are recounted under the new
    /// `max_split_size`.
    pub fn set_runtime_settings(&mut self, settings: Settings) -> Result<(), Error> {
        let same_rest = Settings {
            max_split_size: self.settings.max_split_size,
            max_non_split_rounding_size: self.settings.max_non_split_rounding_size,
            garbage_collection_threshold: self.settings.garbage_collection_threshold,
            roundup_power2_divisions: self.settings.roundup_power2_divisions,
            ..settings.clone()
        };
        if same_rest != self.settings {
            return Err(Error::Unsupported {
                key: "settings",
                reason: "only max_split_size_mb, max_non_split_rounding_mb, \
                         garbage_collection_threshold and roundup_power2_divisions change at run time",
            });
        }
        self.settings = settings;
        self.recount_oversize();
        Ok(())
    }

    /// Rule 24: the oversize counters' current values moved to what the blocks hold under the
    /// `max_split_size` now in force.
    fn recount_oversize(&mut self) {
        let max_split = self.settings.max_split_size;
        let (mut allocations, mut segments) = (0i64, 0i64);
        for (id, b) in self.blocks.iter() {
            if b.state == BlockPhase::Allocated && b.size >= max_split {
                allocations += 1;
            }
            // A segment's head: no block before it, not in a range, not a view's allocation.
            if b.prev.is_none() && b.range.is_none() && b.backing != Backing::View {
                let mut size = 0;
                let mut cur = Some(id);
                while let Some(c) = cur {
                    let x = self.blocks.get(c);
                    size += x.size;
                    cur = x.next;
                }
                if size >= max_split {
                    segments += 1;
                }
            }
        }
        move_to(&mut self.stats.oversize_allocations, allocations);
        move_to(&mut self.stats.oversize_segments, segments);
    }

    /// Rule 25: gives back every free block of `stream` that is a whole segment (rule 8 or
    /// 18), large pool then small pool, in free-set order, as rule 9 gives them back; no event
    /// is waited for, no range, view or parked block is touched. Counts one
    /// `num_sync_all_streams`, as PyTorch's release of a pool does.
    pub fn release_stream_cache(&mut self, stream: StreamId) -> Result<(), Error> {
        self.stats.num_sync_all_streams += 1;
        for pool in [Pool::Large, Pool::Small] {
            let whole: Vec<BlockId> = self.free[pool.index()]
                .iter()
                .filter(|k| k.0 == stream)
                .map(|k| k.3)
                .filter(|&id| {
                    let b = self.blocks.get(id);
                    !b.is_split() && b.range.is_none()
                })
                .collect();
            for id in whole {
                self.release_segment(id)?;
            }
        }
        Ok(())
    }
}

/// Moves a counter's current value to `value`: a rise counts as an increase, a fall as a
/// decrease.
fn move_to(stat: &mut crate::stats::Stat, value: i64) {
    let diff = value - stat.current;
    if diff > 0 {
        stat.increase(diff.unsigned_abs());
    } else if diff < 0 {
        stat.decrease(diff.unsigned_abs());
    }
}

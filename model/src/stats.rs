//! Statistics, with PyTorch's meaning, computed the model's way.
//!
//! PyTorch updates every counter incrementally inside each operation. The model does not:
//! after each sub-step of an operation (a device segment allocated or released, a block handed
//! out, a block freed by the user, a block returned to the pool) it recomputes the *current*
//! value of every statistic from its state (`Gauges::measure`) and turns the difference with
//! the previous current value into an increase or a decrease (`Stats::settle`).

use serde::Serialize;

use crate::rules::Pool;
use crate::state::{BlockState, Segment};

/// One statistic: its current value, its highest value, and the sums of its increases and
/// decreases.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Stat {
    /// The current value.
    pub current: i64,
    /// The highest value `current` has reached.
    pub peak: i64,
    /// The sum of all increases.
    pub allocated: i64,
    /// The sum of all decreases.
    pub freed: i64,
}

impl Stat {
    /// Moves `current` to `value`: a rise is an increase (`allocated` grows, `peak` follows),
    /// a fall is a decrease (`freed` grows).
    fn move_to(&mut self, value: i64) {
        let difference = value - self.current;
        if difference > 0 {
            self.current += difference;
            self.allocated += difference;
            self.peak = self.peak.max(self.current);
        } else if difference < 0 {
            self.current += difference;
            self.freed -= difference;
        }
    }
}

/// One statistic for both pools together and for each pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct StatArray {
    /// Both pools together.
    pub all: Stat,
    /// The small pool (rounded requests of at most 1 MiB).
    pub small_pool: Stat,
    /// The large pool.
    pub large_pool: Stat,
}

impl StatArray {
    /// Moves the pool statistics to `small` and `large`, and `all` to their sum.
    fn move_to(&mut self, small: u64, large: u64) {
        self.all.move_to(to_i64(small + large));
        self.small_pool.move_to(to_i64(small));
        self.large_pool.move_to(to_i64(large));
    }
}

/// Every statistic the model keeps, with the field names of the allocator's `Stats`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Stats {
    /// Blocks handed to the user.
    pub allocation: StatArray,
    /// Device allocations (segments). Ranges of expandable segments do not count (rule 19b).
    pub segment: StatArray,
    /// Blocks allocated or pending.
    pub active: StatArray,
    /// Free blocks whose segment has more than one block; never blocks of a range (rule 19d).
    pub inactive_split: StatArray,
    /// Bytes of blocks handed to the user.
    pub allocated_bytes: StatArray,
    /// Bytes of segments, plus the mapped bytes of ranges (rule 19).
    pub reserved_bytes: StatArray,
    /// Bytes of blocks allocated or pending.
    pub active_bytes: StatArray,
    /// Bytes of free blocks whose segment has more than one block; never blocks of a range
    /// (rule 19d).
    pub inactive_split_bytes: StatArray,
    /// Requested (unrounded) bytes of blocks allocated or pending.
    pub requested_bytes: StatArray,
    /// Allocated blocks of at least `max_split_size` bytes.
    pub oversize_allocations: Stat,
    /// Segments of at least `max_split_size` bytes.
    pub oversize_segments: Stat,
    /// Allocations that released every cached segment and tried again (rule 7d).
    pub num_alloc_retries: u64,
    /// Allocations that failed with out-of-memory (rule 7).
    pub num_ooms: u64,
    /// Waits for every outstanding event (rule 9).
    pub num_sync_all_streams: u64,
    /// Successful device allocations (rule 8) and map steps (rule 19b).
    pub num_device_alloc: u64,
    /// Device frees (rules 9, 11, 12) and unmaps (rule 19e).
    pub num_device_free: u64,
}

/// The current values of one pool's statistics, measured from the state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PoolGauges {
    pub(crate) allocation: u64,
    pub(crate) allocated_bytes: u64,
    pub(crate) active: u64,
    pub(crate) active_bytes: u64,
    pub(crate) requested_bytes: u64,
    pub(crate) segment: u64,
    pub(crate) reserved_bytes: u64,
    pub(crate) inactive_split: u64,
    pub(crate) inactive_split_bytes: u64,
}

/// The current value of every statistic, measured from the state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Gauges {
    pub(crate) small: PoolGauges,
    pub(crate) large: PoolGauges,
    pub(crate) oversize_allocations: u64,
    pub(crate) oversize_segments: u64,
}

impl Gauges {
    /// Measures every statistic's definition on `segments`.
    pub(crate) fn measure(segments: &[Segment], max_split_size: u64) -> Gauges {
        let mut gauges = Gauges::default();
        for segment in segments {
            // Rule 19d: blocks of a range never count as inactive split.
            let split = segment.blocks.len() > 1 && !segment.expandable;
            // Rule 19b: a range is no segment.
            if segment.size >= max_split_size && !segment.expandable {
                gauges.oversize_segments += 1;
            }
            let pool = match segment.pool {
                Pool::Small => &mut gauges.small,
                Pool::Large => &mut gauges.large,
            };
            if segment.expandable {
                // Rule 19: only mapped memory counts as reserved.
                for block in segment.blocks.iter().filter(|b| b.mapped) {
                    pool.reserved_bytes += block.size;
                }
            } else {
                pool.segment += 1;
                pool.reserved_bytes += segment.size;
            }
            // Unmapped blocks are neither free nor active: they count in nothing.
            for block in segment.blocks.iter().filter(|b| b.mapped) {
                match block.state {
                    BlockState::Allocated => {
                        pool.allocation += 1;
                        pool.allocated_bytes += block.size;
                        if block.size >= max_split_size {
                            gauges.oversize_allocations += 1;
                        }
                    }
                    // Rule 23b: held pieces count in no statistic of their own.
                    BlockState::Pending | BlockState::Held => {}
                    BlockState::Free => {
                        if split {
                            pool.inactive_split += 1;
                            pool.inactive_split_bytes += block.size;
                        }
                    }
                }
                if matches!(block.state, BlockState::Allocated | BlockState::Pending) {
                    pool.active += 1;
                    pool.active_bytes += block.size;
                    pool.requested_bytes += block.requested;
                }
            }
        }
        gauges
    }
}

impl Stats {
    /// Moves every statistic's current value to the one measured in `gauges`.
    pub(crate) fn settle(&mut self, gauges: &Gauges) {
        let (s, l) = (&gauges.small, &gauges.large);
        self.allocation.move_to(s.allocation, l.allocation);
        self.segment.move_to(s.segment, l.segment);
        self.active.move_to(s.active, l.active);
        self.inactive_split
            .move_to(s.inactive_split, l.inactive_split);
        self.allocated_bytes
            .move_to(s.allocated_bytes, l.allocated_bytes);
        self.reserved_bytes
            .move_to(s.reserved_bytes, l.reserved_bytes);
        self.active_bytes.move_to(s.active_bytes, l.active_bytes);
        self.inactive_split_bytes
            .move_to(s.inactive_split_bytes, l.inactive_split_bytes);
        self.requested_bytes
            .move_to(s.requested_bytes, l.requested_bytes);
        self.oversize_allocations
            .move_to(to_i64(gauges.oversize_allocations));
        self.oversize_segments
            .move_to(to_i64(gauges.oversize_segments));
    }

    /// PyTorch's `reset_peak_memory_stats`: every peak drops to its current value.
    pub(crate) fn reset_peaks(&mut self) {
        let arrays = [
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
        ];
        let mut stats: Vec<&mut Stat> = Vec::new();
        for array in arrays {
            stats.extend([&mut array.all, &mut array.small_pool, &mut array.large_pool]);
        }
        stats.extend([&mut self.oversize_allocations, &mut self.oversize_segments]);
        for stat in stats {
            stat.peak = stat.current;
        }
    }

    /// Whether every current value equals the one measured in `gauges`.
    pub(crate) fn agrees_with(&self, gauges: &Gauges) -> bool {
        let mut settled = self.clone();
        settled.settle(gauges);
        settled == *self
    }
}

/// A byte count or block count as a statistic value.
fn to_i64(value: u64) -> i64 {
    i64::try_from(value).expect("statistic exceeds i64::MAX")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rise_is_an_increase_that_moves_the_peak() {
        let mut stat = Stat::default();
        stat.move_to(10);
        stat.move_to(4);
        stat.move_to(7);
        assert_eq!(
            stat,
            Stat {
                current: 7,
                peak: 10,
                allocated: 13,
                freed: 6
            }
        );
    }

    #[test]
    fn moving_to_the_current_value_changes_nothing() {
        let mut stat = Stat {
            current: 3,
            peak: 5,
            allocated: 8,
            freed: 5,
        };
        let before = stat;
        stat.move_to(3);
        assert_eq!(stat, before);
    }

    #[test]
    fn a_stat_array_moves_all_to_the_sum_of_the_pools() {
        let mut array = StatArray::default();
        array.move_to(2, 5);
        array.move_to(1, 5);
        assert_eq!(array.all.current, 6);
        assert_eq!(array.all.peak, 7);
        assert_eq!(array.all.freed, 1);
        assert_eq!(array.small_pool.freed, 1);
        assert_eq!(array.large_pool.allocated, 5);
    }
}

//! Statistics with PyTorch's meaning (`torch.cuda.memory_stats()`).
//!
//! The one rule: a counter changes only through [`Stat::increase`] and [`Stat::decrease`], so
//! `current`, `peak`, `allocated` and `freed` always move together as PyTorch's do.

use crate::sizes::Pool;

/// One statistic: its current value, its peak, and the sums of all increases and decreases.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Stat {
    /// The value now.
    pub current: i64,
    /// The highest value `current` has had.
    pub peak: i64,
    /// The sum of all increases.
    pub allocated: i64,
    /// The sum of all decreases.
    pub freed: i64,
}

impl Stat {
    /// Raises the value by `amount`.
    #[inline]
    pub fn increase(&mut self, amount: u64) {
        let amount = amount as i64;
        self.current += amount;
        self.peak = self.peak.max(self.current);
        self.allocated += amount;
    }

    /// Lowers the value by `amount`.
    #[inline]
    pub fn decrease(&mut self, amount: u64) {
        let amount = amount as i64;
        self.current -= amount;
        debug_assert!(self.current >= 0, "statistic went negative");
        self.freed += amount;
    }

    /// Sets the peak to the current value (PyTorch's `reset_peak_memory_stats`).
    pub fn reset_peak(&mut self) {
        self.peak = self.current;
    }
}

/// A statistic kept for all memory and for each pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct StatArray {
    /// Both pools together (PyTorch's `all`).
    pub all: Stat,
    /// Requests of at most 1 MiB.
    pub small_pool: Stat,
    /// Requests above 1 MiB.
    pub large_pool: Stat,
}

impl StatArray {
    /// Raises the aggregate and `pool`'s statistic.
    #[inline]
    pub fn increase(&mut self, pool: Pool, amount: u64) {
        self.all.increase(amount);
        self.pool_mut(pool).increase(amount);
    }

    /// Lowers the aggregate and `pool`'s statistic.
    #[inline]
    pub fn decrease(&mut self, pool: Pool, amount: u64) {
        self.all.decrease(amount);
        self.pool_mut(pool).decrease(amount);
    }

    /// The statistic of one pool.
    pub fn pool(&self, pool: Pool) -> &Stat {
        match pool {
            Pool::Small => &self.small_pool,
            Pool::Large => &self.large_pool,
        }
    }

    fn pool_mut(&mut self, pool: Pool) -> &mut Stat {
        match pool {
            Pool::Small => &mut self.small_pool,
            Pool::Large => &mut self.large_pool,
        }
    }

    fn reset_peak(&mut self) {
        self.all.reset_peak();
        self.small_pool.reset_peak();
        self.large_pool.reset_peak();
    }
}

/// Every statistic the allocator keeps, named as in PyTorch's `memory_stats()`.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Stats {
    /// Blocks handed out to the user and not yet freed.
    pub allocation: StatArray,
    /// Device segments held.
    pub segment: StatArray,
    /// Blocks allocated or waiting for other streams' work before they can be reused.
    pub active: StatArray,
    /// Free blocks inside segments that also hold other blocks: memory `empty_cache` cannot
    /// give back.
    pub inactive_split: StatArray,
    /// Bytes in allocated blocks (rounded sizes).
    pub allocated_bytes: StatArray,
    /// Bytes of device memory held (PyTorch's "reserved").
    pub reserved_bytes: StatArray,
    /// Bytes in active blocks.
    pub active_bytes: StatArray,
    /// Bytes in inactive split blocks.
    pub inactive_split_bytes: StatArray,
    /// Bytes the user asked for in active blocks (before rounding).
    pub requested_bytes: StatArray,
    /// Allocated blocks of at least `max_split_size`.
    pub oversize_allocations: Stat,
    /// Segments of at least `max_split_size`.
    pub oversize_segments: Stat,
    /// Times the allocator released all cached segments to retry a device allocation.
    pub num_alloc_retries: u64,
    /// Out-of-memory errors returned.
    pub num_ooms: u64,
    /// Times the allocator waited for all outstanding cross-stream events.
    pub num_sync_all_streams: u64,
    /// Device allocations made (`cuMemAlloc` calls that succeeded).
    pub num_device_alloc: u64,
    /// Device frees made (`cuMemFree` calls that succeeded).
    pub num_device_free: u64,
}

impl Stats {
    /// Sets every peak to its current value.
    pub fn reset_peaks(&mut self) {
        for a in [
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
        ] {
            a.reset_peak();
        }
        self.oversize_allocations.reset_peak();
        self.oversize_segments.reset_peak();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_follows_increases_and_not_decreases() {
        let mut s = Stat::default();
        s.increase(10);
        s.decrease(4);
        s.increase(2);
        assert_eq!(
            s,
            Stat {
                current: 8,
                peak: 10,
                allocated: 12,
                freed: 4
            }
        );
    }

    #[test]
    fn a_pool_statistic_also_moves_the_aggregate() {
        let mut a = StatArray::default();
        a.increase(Pool::Small, 3);
        a.increase(Pool::Large, 5);
        a.decrease(Pool::Small, 1);
        assert_eq!(a.all.current, 7);
        assert_eq!(a.small_pool.current, 2);
        assert_eq!(a.large_pool.current, 5);
        assert_eq!(a.all.peak, 8);
    }
}

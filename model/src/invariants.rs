//! The model's invariant checker: what must hold between any two operations.

use crate::Model;
use crate::device::overlaps;
use crate::rules::{MIN_BLOCK_SIZE, MIN_LARGE_ALLOC, Pool, ROUND_LARGE, SMALL_BUFFER};
use crate::state::{BlockState, Segment};
use crate::stats::{Gauges, Stat, StatArray};

impl Model {
    /// Checks every invariant of the state and the statistics; the first violation found is
    /// described in the error.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.check_segments()?;
        for segment in &self.segments {
            self.check_segment(segment)?;
        }
        self.check_events()?;
        self.check_stats()?;
        self.check_threads()?;
        self.check_device()
    }

    /// Segments are sorted by address and do not overlap.
    fn check_segments(&self) -> Result<(), String> {
        for pair in self.segments.windows(2) {
            let (a, b) = (&pair[0], &pair[1]);
            if a.address >= b.address || overlaps(a.address, a.size, b.address, b.size) {
                return Err(format!(
                    "segments {:#x} (+{}) and {:#x} (+{}) are out of order or overlap",
                    a.address, a.size, b.address, b.size
                ));
            }
        }
        Ok(())
    }

    /// One segment: its size fits its pool; its blocks tile it exactly, are multiples of
    /// 512 B, never two free side by side, and each state's fields are consistent.
    fn check_segment(&self, segment: &Segment) -> Result<(), String> {
        // Rule 19: a range has invariants of its own.
        if segment.expandable {
            return self.check_range(segment);
        }
        let name = format!("segment {:#x}", segment.address);
        match segment.pool {
            Pool::Small if segment.size != SMALL_BUFFER => {
                return Err(format!("{name}: small segment of {} bytes", segment.size));
            }
            Pool::Large
                if !segment.size.is_multiple_of(ROUND_LARGE) || segment.size < MIN_LARGE_ALLOC =>
            {
                return Err(format!("{name}: large segment of {} bytes", segment.size));
            }
            _ => {}
        }
        let mut expected_address = segment.address;
        for (i, block) in segment.blocks.iter().enumerate() {
            let here = format!("{name}, block {:#x}", block.address);
            if block.address != expected_address {
                return Err(format!(
                    "{here}: expected at {expected_address:#x} (gap or overlap)"
                ));
            }
            if block.size < MIN_BLOCK_SIZE || !block.size.is_multiple_of(MIN_BLOCK_SIZE) {
                return Err(format!(
                    "{here}: size {} is not a multiple of 512",
                    block.size
                ));
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
            };
            if !fine {
                return Err(format!(
                    "{here}: inconsistent {:?} block: {block:?}",
                    block.state
                ));
            }
        }
        if expected_address != segment.address + segment.size {
            return Err(format!(
                "{name}: blocks end at {expected_address:#x}, not at its end"
            ));
        }
        Ok(())
    }

    /// Every event holds a pending block, and one block has at most one event per stream.
    fn check_events(&self) -> Result<(), String> {
        for (i, event) in self.events.iter().enumerate() {
            let pending = crate::state::find_block(&self.segments, event.block)
                .map(|(s, b)| self.segments[s].blocks[b].state == BlockState::Pending);
            if pending != Some(true) {
                return Err(format!("event {event:?} does not hold a pending block"));
            }
            let twin = self.events[i + 1..]
                .iter()
                .any(|e| e.block == event.block && e.stream == event.stream);
            if twin {
                return Err(format!(
                    "two events for block {:#x} on one stream",
                    event.block
                ));
            }
        }
        Ok(())
    }

    /// Every current value equals its recomputation; every statistic is self-consistent;
    /// reserved bytes are the bytes of all blocks.
    fn check_stats(&self) -> Result<(), String> {
        let gauges = Gauges::measure(&self.segments, self.config.max_split_size);
        if !self.stats.agrees_with(&gauges) {
            return Err(format!(
                "statistics disagree with the state: {:?} vs {gauges:?}",
                self.stats
            ));
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
            return Err(format!(
                "reserved bytes {} are not the {block_bytes} bytes of all blocks",
                s.reserved_bytes.all.current
            ));
        }
        Ok(())
    }

    /// The device's live allocations are exactly the segments.
    fn check_device(&self) -> Result<(), String> {
        let reserved = self.stats.reserved_bytes.all.current;
        if self.device.used() as i64 != reserved {
            return Err(format!(
                "device used {} differs from reserved bytes {reserved}",
                self.device.used()
            ));
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
            return Err(format!(
                "device allocations {live:x?} differ from segments {segments:x?}"
            ));
        }
        // Rule 19: reservations and mapped bytes.
        self.check_device_ranges()
    }
}

/// `all` is the sum of the pools, and each of the three is self-consistent.
fn check_array(name: &str, array: &StatArray) -> Result<(), String> {
    check_stat(name, &array.all)?;
    check_stat(name, &array.small_pool)?;
    check_stat(name, &array.large_pool)?;
    if array.all.current != array.small_pool.current + array.large_pool.current {
        return Err(format!(
            "{name}: all is not the sum of the pools: {array:?}"
        ));
    }
    Ok(())
}

/// `current = allocated − freed`, `0 ≤ current ≤ peak`.
fn check_stat(name: &str, stat: &Stat) -> Result<(), String> {
    let consistent = stat.current == stat.allocated - stat.freed
        && stat.current >= 0
        && stat.current <= stat.peak;
    if consistent {
        Ok(())
    } else {
        Err(format!("{name}: inconsistent statistic {stat:?}"))
    }
}

#[cfg(test)]
mod tests {
    use crate::{Model, ModelConfig};

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
        assert!(error.contains("inconsistent Free block"), "{error}");
    }

    #[test]
    fn statistics_that_drift_from_the_state_are_reported() {
        let mut model = Model::new(ModelConfig::pytorch_defaults(1 << 30));
        model.malloc(4096, 0).unwrap();
        model.stats.allocation.all.current += 1;
        assert!(model.check_invariants().is_err());
    }
}

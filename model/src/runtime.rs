//! Rules 24 and 25, written to be read: settings a program changes while it runs, and the
//! release of one stream's cached segments.

use crate::Model;
use crate::config::{ModelConfig, ModelError};
use crate::rules::Pool;
use crate::state;

impl Model {
    /// Rule 24: the new configuration is in force from now on. Only the four run-time values
    /// (`max_split_size`, `max_non_split_rounding_size`, `garbage_collection_threshold`,
    /// `roundup_power2_divisions`) may differ from the one in force; otherwise the change is
    /// refused and nothing changes. Statistics are measured again, so the oversize counters
    /// count the blocks at or above the new `max_split_size`.
    pub fn set_runtime_settings(&mut self, config: ModelConfig) -> Result<(), ModelError> {
        let mut rest = config.clone();
        rest.max_split_size = self.config.max_split_size;
        rest.max_non_split_rounding_size = self.config.max_non_split_rounding_size;
        rest.garbage_collection_threshold = self.config.garbage_collection_threshold;
        rest.roundup_power2_divisions = self.config.roundup_power2_divisions;
        if rest != self.config {
            return Err(ModelError::UnsupportedChange);
        }
        self.config = config;
        self.settle_stats();
        Ok(())
    }

    /// Rule 25: every free whole segment (never a range) of `stream` goes back to the device,
    /// large pool then small pool, in free-set order. No event is waited for; one
    /// `num_sync_all_streams` is counted.
    pub fn release_stream_cache(&mut self, stream: u64) {
        self.stats.num_sync_all_streams += 1;
        for pool in [Pool::Large, Pool::Small] {
            for entry in state::free_set(&self.segments, pool) {
                if entry.whole && entry.stream == stream {
                    self.release_segment(entry.address);
                }
            }
        }
    }
}

//! The printer: [`Settings`] as its canonical configuration string.

use std::fmt;

use super::parse::Key;
use super::*;

impl fmt::Display for Settings {
    /// The canonical configuration string: the keys whose value differs from the defaults that
    /// [`Settings::parse`] starts from (cachalot's, [`Settings::cachalot`]), in a fixed order,
    /// comma-separated without spaces (the empty string for the defaults). For any settings
    /// produced by [`Settings::parse`] (or the setters), `Settings::parse(&s.to_string()) ==
    /// Ok(s)`. `roundup_power2_divisions` is printed in the compact form when all intervals hold
    /// the same power of two, else as a list that sets every interval explicitly.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.config_over(&Settings::cachalot()))
    }
}

impl Settings {
    /// The configuration string that, applied over `base` ([`Settings::apply`]), gives these
    /// settings: the keys whose value differs from `base`'s, in [`Display`](fmt::Display)'s
    /// order. Over [`Settings::pytorch`] it is the string to record where PyTorch records its
    /// `PYTORCH_CUDA_ALLOC_CONF`: for PyTorch's own knobs it names PyTorch keys only.
    pub fn config_over(&self, base: &Settings) -> String {
        let d = base;
        let mut parts: Vec<String> = Vec::new();
        if self.max_split_size != d.max_split_size {
            parts.push(format!(
                "{}:{}",
                Key::MaxSplitSize.name(),
                self.max_split_size / MIB
            ));
        }
        if self.max_non_split_rounding_size != d.max_non_split_rounding_size {
            parts.push(format!(
                "{}:{}",
                Key::MaxNonSplitRounding.name(),
                self.max_non_split_rounding_size / MIB
            ));
        }
        if self.garbage_collection_threshold != d.garbage_collection_threshold {
            parts.push(format!(
                "{}:{}",
                Key::GcThreshold.name(),
                self.garbage_collection_threshold
            ));
        }
        if self.roundup_power2_divisions != d.roundup_power2_divisions {
            parts.push(format!(
                "{}:{}",
                Key::RoundupDivisions.name(),
                format_divisions(&self.roundup_power2_divisions)
            ));
        }
        if self.expandable_segments != d.expandable_segments {
            parts.push(format!(
                "{}:{}",
                Key::ExpandableSegments.name(),
                bool_word(self.expandable_segments)
            ));
        }
        if self.per_process_memory_fraction != d.per_process_memory_fraction
            && let Some(x) = self.per_process_memory_fraction
        {
            parts.push(format!("{}:{}", Key::MemoryFraction.name(), x));
        }
        if self.backend != d.backend {
            parts.push(format!("{}:{}", Key::Backend.name(), self.backend));
        }
        // cachalot's own keys.
        if self.expandable_page_size != d.expandable_page_size {
            parts.push(format!(
                "{}:{}",
                Key::ExpandablePage.name(),
                self.expandable_page_size / MIB
            ));
        }
        // Rule 19j: refused beside page aliasing, so named only without it.
        if self.expandable_handle_size != d.expandable_handle_size
            && (self.expandable_handle_size.is_some() || !self.page_aliasing)
        {
            parts.push(match self.expandable_handle_size {
                Some(t) => format!("{}:{}", Key::ExpandableHandle.name(), t / MIB),
                None => format!("{}:off", Key::ExpandableHandle.name()),
            });
        }
        if self.reclaim_headroom != d.reclaim_headroom {
            parts.push(match self.reclaim_headroom {
                Some(h) => format!("{}:{}", Key::ReclaimHeadroom.name(), h),
                None => format!("{}:off", Key::ReclaimHeadroom.name()),
            });
        }
        if self.thread_cache_blocks != d.thread_cache_blocks {
            parts.push(format!(
                "{}:{}",
                Key::ThreadCacheBlocks.name(),
                self.thread_cache_blocks
            ));
        }
        // Rule 22: page aliasing needs expandable segments. Without them the string gives
        // `false` whatever it says (turning expandable segments off turns the aliasing it
        // inherited off; asking for it is refused), so it is named only with them.
        if self.expandable_segments && self.page_aliasing != d.page_aliasing {
            parts.push(format!(
                "{}:{}",
                Key::PageAliasing.name(),
                bool_word(self.page_aliasing)
            ));
        }
        // Rule 23: stitched views need expandable segments too, and are named only with them;
        // page aliasing implies them off (a string asking for it turns inherited ones off).
        if self.expandable_segments
            && self.page_stitching != d.page_stitching
            && (self.page_stitching || !self.page_aliasing)
        {
            parts.push(format!(
                "{}:{}",
                Key::PageStitching.name(),
                bool_word(self.page_stitching)
            ));
        }
        parts.join(",")
    }
}

/// `True` or `False`, as the configuration string spells them.
fn bool_word(b: bool) -> &'static str {
    if b { "True" } else { "False" }
}

/// The value of `roundup_power2_divisions` for a table: `N` when every interval holds the
/// same power of two `N`, else a list that sets every interval regardless of the table it is
/// applied over: the first entry ends the first run of equal values (and fills the intervals
/// below it), each interval after it up to the last run is written out, and `>` fills the last
/// run.
fn format_divisions(table: &[u64; INTERVALS]) -> String {
    let first = table[0];
    let last = table[INTERVALS - 1];
    // Index of the last interval of the first run of equal values.
    let first_end = table
        .iter()
        .position(|&d| d != first)
        .map_or(INTERVALS - 1, |p| p - 1);
    if first_end == INTERVALS - 1 && first.is_power_of_two() {
        return first.to_string();
    }
    let mut entries = vec![format!("{}:{}", 1u64 << first_end, first)];
    if first_end < INTERVALS - 1 {
        // Start of the last run of equal values; it lies after the first run.
        let last_start = table
            .iter()
            .rposition(|&d| d != last)
            .map_or(0, |p| p + 1)
            .max(first_end + 1);
        for (i, d) in table
            .iter()
            .enumerate()
            .take(last_start)
            .skip(first_end + 1)
        {
            entries.push(format!("{}:{}", 1u64 << i, d));
        }
        entries.push(format!(">:{last}"));
    }
    format!("[{}]", entries.join(","))
}

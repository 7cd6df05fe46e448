//! The memory summary: the statistics as a table, in the manner of
//! `torch.cuda.memory_summary()`.
//!
//! The one rule: the table is a pure function of [`Stats`] and the layout ([`SegmentInfo`]s),
//! laid out and scaled exactly as PyTorch's (75 columns, sizes in B/KiB/MiB/GiB chosen by the
//! row's overall value, counts in units, K or M), so readers who know PyTorch's summary can
//! read this one.

use std::fmt::Write;

use crate::policy::SegmentInfo;
use crate::stats::{StatArray, Stats};

/// Formats `stats` as a readable table for device `device`: for each statistic (allocated,
/// active, requested, reserved and non-releasable memory; allocations, active allocations,
/// segments, non-releasable allocations; oversize allocations and segments) its current value,
/// peak, total allocated and total freed, for all memory and for the large and small pools.
///
/// `segments` is the layout at the same moment (`segments()`). It matters under expandable
/// segments only: the `segment` statistic counts device allocations, and mapping memory into
/// an expandable segment's range makes none (PyTorch's statistic, rule 19b), so alone it would
/// show no segment while memory is reserved. The "GPU reserved segments" rows therefore also
/// count the layout's expandable segments — one per contiguous run of mapped memory, as
/// `segments()` and PyTorch's snapshots report them — as if each had been allocated once: their
/// current value is the segments held now, their peak and total allocated at least that.
///
/// ```
/// use cachalot::{CachingCore, Settings, SimDevice, StreamId};
///
/// let mut core = CachingCore::new(SimDevice::new(1 << 30), Settings::default())?;
/// let p = core.malloc(3 << 20, StreamId(0))?;
/// let text = cachalot::cuda::memory_summary(core.stats(), &core.segments(), 0);
/// assert!(text.contains("cachalot CUDA memory summary, device ID 0"));
/// assert!(text.contains("| Allocated memory      |   3072 KiB |   3072 KiB |   3072 KiB |      0 B   |"));
/// // cachalot's defaults grow expandable segments: one segment holds the block.
/// assert!(text.contains("| GPU reserved segments |       1    |       1    |       1    |       0    |"));
/// # core.free(p)?;
/// # Ok::<(), cachalot::Error>(())
/// ```
pub fn memory_summary(stats: &Stats, segments: &[SegmentInfo], device: usize) -> String {
    let mut lines: Vec<String> = Vec::new();
    let rule = |c: char| c.to_string().repeat(75);
    lines.push(rule('='));
    lines.push(format!(
        " {:16} cachalot CUDA memory summary, device ID {:<16} ",
        "", device
    ));
    lines.push(rule('-'));
    lines.push(format!(
        "  {:9} CUDA OOMs: {:<12} | {:6} cuMemAlloc retries: {:<8}  ",
        "", stats.num_ooms, "", stats.num_alloc_retries
    ));
    lines.push(rule('='));
    lines.push(
        "        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  ".to_string(),
    );
    let sizes: [(&StatArray, &str); 5] = [
        (&stats.allocated_bytes, "Allocated memory"),
        (&stats.active_bytes, "Active memory"),
        (&stats.requested_bytes, "Requested memory"),
        (&stats.reserved_bytes, "GPU reserved memory"),
        (&stats.inactive_split_bytes, "Non-releasable memory"),
    ];
    let mut reserved_segments = stats.segment;
    for s in segments.iter().filter(|s| s.expandable) {
        reserved_segments.increase(s.pool, 1);
    }
    let counts: [(&StatArray, &str); 4] = [
        (&stats.allocation, "Allocations"),
        (&stats.active, "Active allocs"),
        (&reserved_segments, "GPU reserved segments"),
        (&stats.inactive_split, "Non-releasable allocs"),
    ];
    for (array, name) in sizes {
        lines.push(rule('-'));
        rows(&mut lines, array, name, format_size);
    }
    for (array, name) in counts {
        lines.push(rule('-'));
        rows(&mut lines, array, name, format_count);
    }
    lines.push(rule('-'));
    for (stat, name) in [
        (&stats.oversize_allocations, "Oversize allocations"),
        (&stats.oversize_segments, "Oversize GPU segments"),
    ] {
        lines.push(format!(
            " {:<21} | {} | {} | {} | {} ",
            name,
            format_count(stat.current, stat.current),
            format_count(stat.peak, stat.peak),
            format_count(stat.allocated, stat.allocated),
            format_count(stat.freed, stat.freed),
        ));
    }
    lines.push(rule('='));
    let mut out = String::new();
    for line in lines {
        let _ = writeln!(out, "|{line}|");
    }
    out
}

/// The three rows of one statistic: all memory, then the large and small pools, each figure
/// scaled by the corresponding figure of the first row (as PyTorch does).
fn rows(lines: &mut Vec<String>, array: &StatArray, name: &str, fmt: fn(i64, i64) -> String) {
    let all = &array.all;
    for (stat, label) in [
        (&array.all, name),
        (&array.large_pool, "      from large pool"),
        (&array.small_pool, "      from small pool"),
    ] {
        lines.push(format!(
            " {:<21} | {} | {} | {} | {} ",
            label,
            fmt(stat.current, all.current),
            fmt(stat.peak, all.peak),
            fmt(stat.allocated, all.allocated),
            fmt(stat.freed, all.freed),
        ));
    }
}

/// PyTorch's `_format_size`: divides by 1024 while the reference value is at least 768 KiB.
fn format_size(mut size: i64, reference: i64) -> String {
    let mut reference = reference as f64;
    let mut prefix = "B  ";
    for next in ["KiB", "MiB", "GiB", "TiB", "PiB"] {
        if reference < 768.0 * 1024.0 {
            break;
        }
        prefix = next;
        size /= 1024;
        reference /= 1024.0;
    }
    format!("{size:6} {prefix}")
}

/// PyTorch's `_format_count`: divides by 1000 while the reference value is at least 750 000.
fn format_count(mut count: i64, reference: i64) -> String {
    let mut reference = reference as f64;
    let mut prefix = " ";
    for next in ["K", "M"] {
        if reference < 750.0 * 1000.0 {
            break;
        }
        prefix = next;
        count /= 1000;
        reference /= 1000.0;
    }
    format!("{count:7} {prefix} ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_scale_by_the_reference_value_as_pytorch_does() {
        assert_eq!(format_size(0, 0), "     0 B  ");
        assert_eq!(format_size(512, 512), "   512 B  ");
        assert_eq!(format_size(3 << 20, 3 << 20), "  3072 KiB");
        assert_eq!(format_size(20 << 20, 20 << 20), " 20480 KiB");
        assert_eq!(format_size(1 << 30, 1 << 30), "  1024 MiB");
        // A pool's figure is scaled by the row for all memory.
        assert_eq!(format_size(512, 20 << 20), "     0 KiB");
        assert_eq!(format_count(5, 5), "      5   ");
        assert_eq!(format_count(2_000_000, 2_000_000), "   2000 K ");
    }

    #[test]
    fn every_line_is_75_columns_between_bars() {
        let mut stats = Stats::default();
        stats
            .allocated_bytes
            .increase(crate::sizes::Pool::Large, 123 << 30);
        stats.allocation.increase(crate::sizes::Pool::Small, 3);
        stats.num_ooms = 2;
        let text = memory_summary(&stats, &[], 1);
        assert!(text.contains("device ID 1"));
        assert!(text.contains("CUDA OOMs: 2"));
        for line in text.lines() {
            assert_eq!(line.chars().count(), 77, "{line:?}");
            assert!(line.starts_with('|') && line.ends_with('|'));
        }
        assert!(text.contains(
            "| Allocated memory      | 125952 MiB | 125952 MiB | 125952 MiB |      0 B   |"
        ));
    }

    use crate::backend::StreamId;
    use crate::backend::sim::SimDevice;
    use crate::policy::CachingCore;
    use crate::settings::Settings;

    /// The table's line that starts with `name` (its first column), once.
    fn line<'t>(text: &'t str, name: &str) -> &'t str {
        let mut found = text
            .lines()
            .filter(|l| l[1..].trim_start().starts_with(name));
        let first = found
            .next()
            .unwrap_or_else(|| panic!("no {name:?} line in\n{text}"));
        assert!(
            found.next().is_none(),
            "{name:?} is printed twice in\n{text}"
        );
        first
    }

    #[test]
    fn under_expandable_segments_the_reserved_segments_are_the_mapped_runs() {
        let mut core = CachingCore::new(SimDevice::new(1 << 30), Settings::cachalot()).unwrap();
        assert!(core.settings().expandable_segments);
        let large = core.malloc(3 << 20, StreamId(0)).unwrap();
        let small = core.malloc(4096, StreamId(0)).unwrap();
        let stats = core.stats().clone();
        // The statistic counts device allocations, which mapping into a range is not.
        assert_eq!(stats.segment.all.current, 0);
        assert!(stats.reserved_bytes.all.current > 0);
        let segments = core.segments();
        assert_eq!(segments.len(), 2);
        assert!(segments.iter().all(|s| s.expandable));
        let text = memory_summary(&stats, &segments, 0);
        assert_eq!(
            line(&text, "GPU reserved segments"),
            "| GPU reserved segments |       2    |       2    |       2    |       0    |"
        );
        assert!(text.contains(
            "|       from large pool |       1    |       1    |       1    |       0    |\n\
             |       from small pool |       1    |       1    |       1    |       0    |\n\
             |---------------------------------------------------------------------------|\n\
             | Non-releasable allocs |"
        ));
        core.free(large).unwrap();
        core.free(small).unwrap();
    }

    #[test]
    fn device_segments_are_counted_once_from_the_statistic() {
        let mut core = CachingCore::new(SimDevice::new(1 << 30), Settings::pytorch()).unwrap();
        let p = core.malloc(3 << 20, StreamId(0)).unwrap();
        core.free(p).unwrap();
        let q = core.malloc(4096, StreamId(0)).unwrap();
        let stats = core.stats().clone();
        assert_eq!(stats.segment.all.current, 2);
        let with_layout = memory_summary(&stats, &core.segments(), 0);
        assert_eq!(with_layout, memory_summary(&stats, &[], 0));
        assert_eq!(
            line(&with_layout, "GPU reserved segments"),
            "| GPU reserved segments |       2    |       2    |       2    |       0    |"
        );
        core.free(q).unwrap();
    }

    #[test]
    fn each_oversize_line_is_printed_once_at_the_end() {
        // Under expandable segments, with an oversize block of a range in the layout.
        let settings = Settings::cachalot().apply("max_split_size_mb:20").unwrap();
        let mut core = CachingCore::new(SimDevice::new(1 << 30), settings).unwrap();
        let p = core.malloc(64 << 20, StreamId(0)).unwrap();
        let text = memory_summary(core.stats(), &core.segments(), 0);
        assert_eq!(
            line(&text, "Oversize allocations"),
            "| Oversize allocations  |       1    |       1    |       1    |       0    |"
        );
        assert_eq!(
            line(&text, "Oversize GPU segments"),
            "| Oversize GPU segments |       0    |       0    |       0    |       0    |"
        );
        let last: Vec<&str> = text.lines().rev().take(3).collect();
        assert!(last[0].starts_with("|====="), "{text}");
        assert!(last[1].starts_with("| Oversize GPU segments |"), "{text}");
        assert!(last[2].starts_with("| Oversize allocations  |"), "{text}");
        core.free(p).unwrap();
    }
}

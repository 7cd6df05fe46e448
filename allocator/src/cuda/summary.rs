//! The memory summary: the statistics as a table, in the manner of
//! `torch.cuda.memory_summary()`.
//!
//! The one rule: the table is a pure function of [`Stats`], laid out and scaled exactly as
//! PyTorch's (75 columns, sizes in B/KiB/MiB/GiB chosen by the row's overall value, counts in
//! units, K or M), so readers who know PyTorch's summary can read this one.

use std::fmt::Write;

use crate::stats::{StatArray, Stats};

/// Formats `stats` as a readable table for device `device`: for each statistic (allocated,
/// active, requested, reserved and non-releasable memory; allocations, active allocations,
/// segments, non-releasable allocations; oversize allocations and segments) its current value,
/// peak, total allocated and total freed, for all memory and for the large and small pools.
///
/// ```
/// use cachalot::{CachingCore, Settings, SimDevice, StreamId};
///
/// let mut core = CachingCore::new(SimDevice::new(1 << 30), Settings::default())?;
/// let p = core.malloc(3 << 20, StreamId(0))?;
/// let text = cachalot::cuda::memory_summary(core.stats(), 0);
/// assert!(text.contains("cachalot CUDA memory summary, device ID 0"));
/// assert!(text.contains("| Allocated memory      |   3072 KiB |   3072 KiB |   3072 KiB |      0 B   |"));
/// # core.free(p)?;
/// # Ok::<(), cachalot::Error>(())
/// ```
pub fn memory_summary(stats: &Stats, device: usize) -> String {
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
    let counts: [(&StatArray, &str); 4] = [
        (&stats.allocation, "Allocations"),
        (&stats.active, "Active allocs"),
        (&stats.segment, "GPU reserved segments"),
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
        let text = memory_summary(&stats, 1);
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
}

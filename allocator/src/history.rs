//! Allocation history: the allocator's own trace, in the vocabulary of PyTorch's memory
//! snapshots (`alloc`, `free_requested`, `free_completed`, `segment_alloc`, `segment_free`,
//! `segment_map`, `segment_unmap`, `oom`), so PyTorch's tools can read what cachalot did.
//!
//! The one rule: an entry is recorded at the same point of the policy where PyTorch records
//! its own, with the same address and size, so a cachalot trace replays like a PyTorch one.
//!
//! The history is a ring of at most [`HistoryOptions::max_entries`] entries, as PyTorch's
//! `_record_memory_history(max_entries=...)` keeps: when it is full each new entry replaces the
//! oldest, so a long run keeps its last entries and the trace begins in the middle of the
//! program (which `cachalot replay` rebuilds from the dumped segments). Recording that is off
//! costs one branch per recorded point and stores nothing.

use std::backtrace::Backtrace;
use std::collections::VecDeque;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use crate::backend::StreamId;
use crate::sync::SharedBacktrace;

/// What happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum TraceAction {
    /// A block was handed out; `size` is the size asked for.
    Alloc,
    /// The user freed a block; `size` is the size asked for.
    FreeRequested,
    /// The block went back to its pool (at once, or once other streams' events completed).
    FreeCompleted,
    /// A device segment was allocated; `size` is its size.
    SegmentAlloc,
    /// A device segment was given back; `size` is its size.
    SegmentFree,
    /// Pages were mapped into an expandable segment's range (rule 19b); `size` is the bytes.
    SegmentMap,
    /// Pages of an expandable segment's range were unmapped (rule 19e); `size` is the bytes.
    SegmentUnmap,
    /// An allocation failed for lack of memory; `address` holds the device's free bytes and
    /// `size` the rounded request.
    Oom,
}

/// One entry of the history.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct TraceEvent {
    /// What happened.
    pub action: TraceAction,
    /// The block's or segment's address (device free bytes for [`TraceAction::Oom`]).
    pub address: u64,
    /// The size (see [`TraceAction`]).
    pub size: u64,
    /// The stream.
    pub stream: StreamId,
}

/// How the history is recorded (PyTorch's `_record_memory_history` arguments).
///
/// ```
/// use cachalot::HistoryOptions;
///
/// let ring = HistoryOptions::new(100_000).with_backtraces(true);
/// assert_eq!(ring.max_entries, 100_000);
/// assert!(ring.backtraces);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct HistoryOptions {
    /// The most entries kept (at least 1): when the ring is full, each new entry replaces the
    /// oldest. `usize::MAX` keeps everything (PyTorch's default, `sys.maxsize`).
    pub max_entries: usize,
    /// Whether each entry captures a Rust backtrace (`std::backtrace`), written as the entry's
    /// `frames` in a snapshot. Capturing costs microseconds per entry (symbols are resolved only
    /// when a snapshot is taken); off, nothing is captured.
    pub backtraces: bool,
}

impl HistoryOptions {
    /// A ring of `max_entries` entries (0 is taken as 1), without backtraces.
    pub fn new(max_entries: usize) -> Self {
        HistoryOptions {
            max_entries: max_entries.max(1),
            backtraces: false,
        }
    }

    /// The same, with backtraces captured (`true`) or not.
    pub fn with_backtraces(mut self, on: bool) -> Self {
        self.backtraces = on;
        self
    }
}

/// One entry of the history as recorded: the event, when, and where from.
#[derive(Clone, Debug)]
pub struct RecordedEvent {
    /// What happened.
    pub event: TraceEvent,
    /// When, in microseconds since the Unix epoch (PyTorch's `time_us`).
    pub time_us: i64,
    /// The backtrace captured with it, when [`HistoryOptions::backtraces`] was on.
    pub backtrace: Option<SharedBacktrace>,
}

/// The ring itself, kept by the policy core while recording is on.
#[derive(Debug)]
pub(crate) struct History {
    options: HistoryOptions,
    entries: VecDeque<RecordedEvent>,
    /// The clock: `time_us` is `epoch_us` plus the time elapsed since `start`.
    start: Instant,
    epoch_us: i64,
}

impl History {
    pub fn new(options: HistoryOptions) -> Self {
        let epoch_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
            .unwrap_or(0);
        History {
            options,
            entries: VecDeque::new(),
            start: Instant::now(),
            epoch_us,
        }
    }

    pub fn options(&self) -> HistoryOptions {
        self.options
    }

    /// New options for a history already recording: its entries stay (the oldest leave when
    /// the new ring is smaller), as PyTorch keeps its trace when recording is turned on again.
    pub fn set_options(&mut self, options: HistoryOptions) {
        self.options = options;
        self.trim(options.max_entries);
    }

    fn trim(&mut self, max: usize) {
        while self.entries.len() > max {
            self.entries.pop_front();
        }
    }

    pub fn push(&mut self, event: TraceEvent) {
        let elapsed = i64::try_from(self.start.elapsed().as_micros()).unwrap_or(i64::MAX);
        let backtrace = if self.options.backtraces {
            Some(capture())
        } else {
            None
        };
        // The ring: the oldest entry leaves to make room.
        self.trim(self.options.max_entries - 1);
        self.entries.push_back(RecordedEvent {
            event,
            time_us: self.epoch_us.saturating_add(elapsed),
            backtrace,
        });
    }

    pub fn events(&self) -> impl ExactSizeIterator<Item = &RecordedEvent> {
        self.entries.iter()
    }
}

/// A backtrace of the caller. Never inlined, so the snapshot finds where the capture ends
/// (this function and the frames above it are left out of a snapshot's frames).
#[inline(never)]
fn capture() -> SharedBacktrace {
    SharedBacktrace::new(Backtrace::force_capture())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(i: u64) -> TraceEvent {
        TraceEvent {
            action: TraceAction::Alloc,
            address: i,
            size: 512,
            stream: StreamId(0),
        }
    }

    #[test]
    fn a_full_ring_keeps_the_newest_entries_oldest_first() {
        let mut h = History::new(HistoryOptions::new(3));
        for i in 0..7 {
            h.push(event(i));
        }
        let kept: Vec<u64> = h.events().map(|e| e.event.address).collect();
        assert_eq!(kept, [4, 5, 6]);
        assert!(h.events().all(|e| e.backtrace.is_none()));
        let times: Vec<i64> = h.events().map(|e| e.time_us).collect();
        assert!(times.windows(2).all(|w| w[0] <= w[1]), "{times:?}");
    }

    #[test]
    fn a_smaller_ring_drops_the_oldest_and_zero_means_one() {
        let mut h = History::new(HistoryOptions::new(10));
        for i in 0..5 {
            h.push(event(i));
        }
        h.set_options(HistoryOptions::new(2));
        let kept: Vec<u64> = h.events().map(|e| e.event.address).collect();
        assert_eq!(kept, [3, 4]);
        assert_eq!(HistoryOptions::new(0).max_entries, 1);
    }

    #[test]
    fn backtraces_are_captured_only_when_asked() {
        let mut h = History::new(HistoryOptions::new(4).with_backtraces(true));
        h.push(event(1));
        let bt = h.events().next().unwrap().backtrace.as_ref().unwrap();
        assert_eq!(
            bt.status(),
            std::backtrace::BacktraceStatus::Captured,
            "force_capture captures whatever RUST_BACKTRACE says"
        );
    }
}

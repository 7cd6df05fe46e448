//! What holds the memory at a moment of a replay: the survey that finds the moment, and the
//! breakdown there — the live tensors grouped by where they were allocated, the memory
//! reserved but free (what `empty_cache()` would give back, what is stranded in split
//! segments).
//!
//! The one rule: every byte reserved at the moment is accounted for once — allocated to one
//! group ([`Breakdown::groups`] sum to [`Breakdown::live_bytes`], the allocator's
//! `allocated_bytes` then), pending on another stream, or free, and free bytes split into
//! [`Breakdown::releasable_bytes`] and [`Breakdown::stranded_bytes`] — read off the replayed
//! allocator's own layout, never estimated.

use std::collections::HashMap;

use cachalot::sizes::Pool;
use cachalot::snapshot::{FrameTable, Snapshot, StackId};
use cachalot::{BlockPhase, Settings};
use serde::Serialize;

use super::stacks::{self, Origin, StackSummary, origins, summarize};
use crate::replay::engine::{ReplayError, Sample};
use crate::replay::program::ReplayProgram;
use crate::replay::start::StartMode;
use crate::replay::step::Stepper;

/// The moment to explain.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum At {
    /// When reserved bytes first reach their peak.
    PeakReserved,
    /// When allocated bytes first reach their peak.
    PeakAllocated,
    /// Right after operation `n` of the program.
    Op(usize),
    /// Right after trace entry `n` (the operations made from entries `0..=n` have run).
    Entry(usize),
}

/// The first pass over a program: its timeline and where the peaks are.
#[derive(Clone, Debug)]
pub struct Survey {
    /// Requested, allocated and reserved bytes before the first operation (index 0) and after
    /// each operation (index `i + 1` after operation `i`).
    pub timeline: Vec<Sample>,
    /// Operations run before reserved bytes first reached their peak (0: at the start).
    pub peak_reserved_after: usize,
    /// Operations run before allocated bytes first reached their peak.
    pub peak_allocated_after: usize,
    /// Allocations that failed.
    pub ooms: u64,
}

/// Replays `program` once, recording its timeline and peaks.
pub fn survey(
    program: &ReplayProgram,
    settings: &Settings,
    capacity: u64,
    start: StartMode,
) -> Result<Survey, ReplayError> {
    let mut s = Stepper::new(program, settings.clone(), capacity, start)?;
    let sample = |s: &Stepper| {
        let st = s.stats();
        Sample {
            requested: s.requested(),
            allocated: st.allocated_bytes.all.current as u64,
            reserved: st.reserved_bytes.all.current as u64,
        }
    };
    let mut timeline = Vec::with_capacity(program.ops.len() + 1);
    timeline.push(sample(&s));
    while s.step()?.is_some() {
        timeline.push(sample(&s));
    }
    let first_max = |f: fn(&Sample) -> u64| {
        let max = timeline.iter().map(f).max().unwrap_or(0);
        timeline.iter().position(|x| f(x) == max).unwrap_or(0)
    };
    Ok(Survey {
        peak_reserved_after: first_max(|x| x.reserved),
        peak_allocated_after: first_max(|x| x.allocated),
        ooms: s.stats().num_ooms,
        timeline,
    })
}

impl Survey {
    /// Operations of `program` run before the moment `at` (clamped to the program's length).
    pub fn ops_before(&self, at: At, program: &ReplayProgram) -> usize {
        let n = self.timeline.len() - 1;
        match at {
            At::PeakReserved => self.peak_reserved_after,
            At::PeakAllocated => self.peak_allocated_after,
            At::Op(i) => (i + 1).min(n),
            At::Entry(e) => program.op_entries.partition_point(|&x| x <= e).min(n),
        }
    }
}

/// Live tensors that share an allocation stack ([`StackSummary::key`]).
#[derive(Clone, Debug, Serialize)]
pub struct Group {
    /// The stack, told for people.
    pub label: String,
    /// Tensors.
    pub count: usize,
    /// Their bytes as the allocator holds them (block sizes, after rounding): what counts in
    /// `allocated_bytes`.
    pub bytes: u64,
    /// The bytes the program asked for.
    pub requested_bytes: u64,
    /// The largest tensor's bytes.
    pub largest_bytes: u64,
    /// Of them, tensors allocated before recording began.
    pub before_recording: usize,
    /// The stack in detail.
    pub stack: StackSummary,
    /// The whole stack of the group's largest tensor, innermost first, as `file:line function`
    /// (C++ frames as their function alone), when frames were recorded.
    pub frames: Vec<String>,
}

/// Free memory in segments of one size.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FreeBySize {
    /// The segment size (for expandable segments: the size of a mapped run).
    pub segment_bytes: u64,
    /// The pool.
    pub pool: &'static str,
    /// Whether these are runs of an expandable segment.
    pub expandable: bool,
    /// Segments of this size.
    pub segments: usize,
    /// Their bytes.
    pub reserved_bytes: u64,
    /// Their free bytes.
    pub free_bytes: u64,
    /// Of which `empty_cache()` would give back.
    pub releasable_bytes: u64,
    /// Of which stranded (free blocks of split segments; free parts of expandable runs smaller
    /// than a page).
    pub stranded_bytes: u64,
}

/// What holds the memory at one moment.
#[derive(Clone, Debug, Serialize)]
pub struct Breakdown {
    /// Operations run before the moment.
    pub ops_before: usize,
    /// The operation that made the moment (`ops_before − 1`), `None` at the start.
    pub op: Option<usize>,
    /// The trace entry that operation came from.
    pub trace_entry: Option<usize>,
    /// Reserved bytes.
    pub reserved_bytes: u64,
    /// Allocated bytes (the allocator's `allocated_bytes`): the live tensors.
    pub live_bytes: u64,
    /// The bytes the program asked for, live.
    pub live_requested_bytes: u64,
    /// Live tensors.
    pub live_tensors: usize,
    /// Bytes freed by the program but waiting for other streams.
    pub pending_bytes: u64,
    /// Reserved bytes in free blocks.
    pub free_bytes: u64,
    /// What `empty_cache()` would give back now (whole free segments; whole free pages of
    /// expandable segments), pending frees left waiting.
    pub releasable_bytes: u64,
    /// Free bytes `empty_cache()` cannot give back: stranded in split segments.
    pub stranded_bytes: u64,
    /// Segments (mapped runs of expandable segments counted one each).
    pub segments: usize,
    /// The live tensors by allocation stack, largest first.
    pub groups: Vec<Group>,
    /// Free memory by segment size, most free first.
    pub free_by_segment_size: Vec<FreeBySize>,
}

/// The page of an expandable segment's range (rule 19): whole pages are what `empty_cache()`
/// unmaps.
fn page(pool: Pool) -> u64 {
    match pool {
        Pool::Small => cachalot::sizes::SMALL_BUFFER,
        Pool::Large => cachalot::sizes::LARGE_BUFFER,
    }
}

/// What holds the memory in `stepper`'s allocator now; `origins` and `frames` say where the
/// program's tensors were allocated ([`origins`], the snapshot's frame table).
pub fn breakdown(stepper: &Stepper, origins: &[Origin], frames: &FrameTable) -> Breakdown {
    let layout = stepper.core().segments();
    let handles: HashMap<u64, usize> = stepper.live_handles().map(|(h, a)| (a, h)).collect();
    let ops_before = stepper.position();
    let op = ops_before.checked_sub(1);
    let trace_entry = op.and_then(|i| stepper.program().op_entries.get(i).copied());
    let mut groups: Vec<Group> = Vec::new();
    let mut by_key: HashMap<String, usize> = HashMap::new();
    let mut summaries: HashMap<(Option<StackId>, bool), StackSummary> = HashMap::new();
    let mut largest_stack: Vec<StackId> = Vec::new();
    let mut free: HashMap<(u64, bool, bool), FreeBySize> = HashMap::new();
    let (mut live_bytes, mut live_requested, mut live_tensors) = (0u64, 0u64, 0usize);
    let (mut pending, mut free_bytes, mut releasable, mut stranded) = (0u64, 0u64, 0u64, 0u64);
    for seg in &layout {
        let small = seg.pool == Pool::Small;
        let row = free
            .entry((seg.size, small, seg.expandable))
            .or_insert_with(|| FreeBySize {
                segment_bytes: seg.size,
                pool: if small { "small" } else { "large" },
                expandable: seg.expandable,
                segments: 0,
                reserved_bytes: 0,
                free_bytes: 0,
                releasable_bytes: 0,
                stranded_bytes: 0,
            });
        row.segments += 1;
        row.reserved_bytes += seg.size;
        let whole_free = seg.blocks.len() == 1 && seg.blocks[0].state == BlockPhase::Free;
        for b in &seg.blocks {
            match b.state {
                BlockPhase::Allocated => {
                    live_bytes += b.size;
                    live_requested += b.requested;
                    live_tensors += 1;
                    let origin = handles.get(&b.address).and_then(|&h| origins.get(h));
                    let (stack, before) = match origin {
                        Some(o) => (Some(o.stack), o.entry.is_none()),
                        None => (None, false),
                    };
                    let summary = summaries
                        .entry((stack, before))
                        .or_insert_with(|| match stack {
                            Some(stack) => summarize(frames, stack, before),
                            None => stacks::unattributed(stacks::NOT_A_TENSOR),
                        });
                    let stack = stack.unwrap_or(StackId::EMPTY);
                    let g = *by_key.entry(summary.key.clone()).or_insert_with(|| {
                        groups.push(Group {
                            label: summary.label.clone(),
                            count: 0,
                            bytes: 0,
                            requested_bytes: 0,
                            largest_bytes: 0,
                            before_recording: 0,
                            stack: summary.clone(),
                            frames: Vec::new(),
                        });
                        largest_stack.push(stack);
                        groups.len() - 1
                    });
                    let group = &mut groups[g];
                    group.count += 1;
                    group.bytes += b.size;
                    group.requested_bytes += b.requested;
                    group.before_recording += usize::from(before);
                    if b.size > group.largest_bytes {
                        group.largest_bytes = b.size;
                        largest_stack[g] = stack;
                    }
                }
                BlockPhase::Pending => pending += b.size,
                // Held by a stitched view in use (rule 23b): memory in use, under the view's
                // allocation (which no segment lists), so no tensor of its own.
                BlockPhase::Held => live_bytes += b.size,
                BlockPhase::Free => {
                    free_bytes += b.size;
                    row.free_bytes += b.size;
                    let give_back = if seg.expandable {
                        whole_pages(seg.address, b.address, b.size, page(seg.pool))
                    } else if whole_free {
                        b.size
                    } else {
                        0
                    };
                    releasable += give_back;
                    row.releasable_bytes += give_back;
                    stranded += b.size - give_back;
                    row.stranded_bytes += b.size - give_back;
                }
            }
        }
    }
    for (g, stack) in groups.iter_mut().zip(largest_stack) {
        g.frames = stacks::frame_lines(frames, stack);
    }
    groups.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.label.cmp(&b.label)));
    let mut free_by_segment_size: Vec<FreeBySize> = free.into_values().collect();
    free_by_segment_size.sort_by(|a, b| {
        b.free_bytes
            .cmp(&a.free_bytes)
            .then(b.segment_bytes.cmp(&a.segment_bytes))
            .then(a.pool.cmp(b.pool))
            .then(a.expandable.cmp(&b.expandable))
    });
    Breakdown {
        ops_before,
        op,
        trace_entry,
        reserved_bytes: layout.iter().map(|s| s.size).sum(),
        live_bytes,
        live_requested_bytes: live_requested,
        live_tensors,
        pending_bytes: pending,
        free_bytes,
        releasable_bytes: releasable,
        stranded_bytes: stranded,
        segments: layout.len(),
        groups,
        free_by_segment_size,
    }
}

/// The bytes of whole pages (of `page` bytes, counted from `base`) inside `[start, start + size)`.
fn whole_pages(base: u64, start: u64, size: u64, page: u64) -> u64 {
    let first = base + (start - base).div_ceil(page) * page;
    let end = base + (start + size - base) / page * page;
    end.saturating_sub(first)
}

/// Replays `program` to the moment `at` and explains it: the survey (first pass) and the
/// breakdown (second pass, stopped there).
pub fn explain(
    program: &ReplayProgram,
    snapshot: &Snapshot,
    device: usize,
    settings: &Settings,
    capacity: u64,
    start: StartMode,
    at: At,
) -> Result<(Survey, Breakdown), ReplayError> {
    let survey = survey(program, settings, capacity, start)?;
    let mut s = Stepper::new(program, settings.clone(), capacity, start)?;
    s.run_to(survey.ops_before(at, program))?;
    let origins = origins(snapshot, device, program);
    let b = breakdown(&s, &origins, &snapshot.frames);
    Ok((survey, b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_pages_count_only_pages_entirely_inside() {
        let p = 20 << 20;
        assert_eq!(whole_pages(0, 0, p, p), p);
        assert_eq!(whole_pages(0, 1, p, p), 0);
        assert_eq!(whole_pages(0, 1 << 20, 3 * p, p), 2 * p);
        assert_eq!(whole_pages(1 << 30, (1 << 30) + p, p - 1, p), 0);
    }
}

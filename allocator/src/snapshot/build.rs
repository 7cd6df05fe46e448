//! The snapshot of an allocator: its state and history as a PyTorch memory snapshot.
//!
//! The one rule: what is written is what PyTorch would have written for the same allocator
//! state — a segment's sizes are summed from its blocks as PyTorch's `snapshot()` sums them,
//! block states use PyTorch's names, and the history keeps the allocator's own order — so that
//! [`write_snapshot`](super::write_snapshot) gives a file that PyTorch's
//! `torch.cuda._memory_viz` reads and that `cachalot replay` replays like a PyTorch trace.
//!
//! ```
//! use cachalot::{CachingCore, Settings, SimDevice, StreamId};
//! use cachalot::snapshot::snapshot_of;
//!
//! let mut core = CachingCore::new(SimDevice::new(1 << 30), Settings::pytorch()).unwrap();
//! core.record_history(Some(usize::MAX));
//! let a = core.malloc(4096, StreamId(0)).unwrap();
//! core.free(a).unwrap();
//! let snap = snapshot_of(&core.segments(), &core.history(), core.settings(), 0);
//! assert_eq!(snap.segments.len(), 1);
//! assert_eq!(snap.traces[0].entries.len(), 4); // segment_alloc, alloc, free_requested, free_completed
//! ```

use std::collections::HashMap;

use crate::history::{RecordedEvent, TraceAction, TraceEvent};
use crate::policy::SegmentInfo;
use crate::settings::Settings;
use crate::sizes::Pool;

use super::frames::{Frame, FrameTable, StackId};
use super::{
    Action, AllocatorSettings, BlockState as SnapBlock, BlockStatus, DeviceTrace, SegmentState,
    SegmentType, Snapshot, TraceEntry,
};

/// The snapshot of one device's allocator: its segments (`segments`, e.g. from
/// [`CachingCore::segments`](crate::CachingCore::segments)), its recorded history
/// (`history`, from [`CachingCore::history`](crate::CachingCore::history)) and its
/// settings, as device `device` (the traces of lower devices are left empty, as PyTorch
/// writes one list per device).
///
/// Trace entries get `time_us` equal to their index in the history (cachalot keeps no clock;
/// only the order matters to PyTorch's tools and to replay).
pub fn snapshot_of(
    segments: &[SegmentInfo],
    history: &[TraceEvent],
    settings: &Settings,
    device: usize,
) -> Snapshot {
    let mut traces: Vec<DeviceTrace> = (0..device)
        .map(|d| DeviceTrace {
            device: d,
            entries: Vec::new(),
        })
        .collect();
    traces.push(DeviceTrace {
        device,
        entries: trace_entries(history),
    });
    Snapshot {
        segments: segment_states(segments, device),
        traces,
        allocator_settings: Some(allocator_settings(settings)),
        frames: FrameTable::default(),
    }
}

/// The segments in PyTorch's form: sizes summed from the blocks as PyTorch's snapshot sums
/// them (`allocated_size` over allocated blocks; `active_size` and `requested_size` over
/// allocated and pending ones).
pub fn segment_states(segments: &[SegmentInfo], device: usize) -> Vec<SegmentState> {
    segments
        .iter()
        .map(|seg| {
            let blocks: Vec<SnapBlock> = seg
                .blocks
                .iter()
                .map(|b| SnapBlock {
                    address: b.address,
                    size: b.size,
                    requested_size: if b.state == crate::block::BlockPhase::Free {
                        0
                    } else {
                        b.requested
                    },
                    state: block_status(b.state),
                    stack: StackId::EMPTY,
                })
                .collect();
            let sum = |keep: &dyn Fn(&SnapBlock) -> bool, f: &dyn Fn(&SnapBlock) -> u64| {
                blocks.iter().filter(|b| keep(b)).map(f).sum::<u64>()
            };
            let allocated = |b: &SnapBlock| b.state == BlockStatus::ActiveAllocated;
            let active = |b: &SnapBlock| b.state != BlockStatus::Inactive;
            SegmentState {
                device,
                address: seg.address,
                total_size: seg.size,
                allocated_size: sum(&allocated, &|b| b.size),
                active_size: sum(&active, &|b| b.size),
                requested_size: sum(&active, &|b| b.requested_size),
                stream: seg.stream.0,
                segment_type: match seg.pool {
                    Pool::Small => SegmentType::Small,
                    Pool::Large => SegmentType::Large,
                },
                is_expandable: seg.expandable,
                pool_id: (0, 0),
                blocks,
                stack: StackId::EMPTY,
            }
        })
        .collect()
}

/// PyTorch's name for a block state.
pub fn block_status(state: crate::block::BlockPhase) -> BlockStatus {
    match state {
        crate::block::BlockPhase::Free => BlockStatus::Inactive,
        crate::block::BlockPhase::Allocated => BlockStatus::ActiveAllocated,
        crate::block::BlockPhase::Pending => BlockStatus::ActivePendingFree,
        // Held by a stitched view in use (rule 23b): memory in use.
        crate::block::BlockPhase::Held => BlockStatus::ActiveAllocated,
    }
}

/// The history as trace entries, in order.
pub fn trace_entries(history: &[TraceEvent]) -> Vec<TraceEntry> {
    history
        .iter()
        .enumerate()
        .map(|(i, e)| trace_entry(e, i64::try_from(i).unwrap_or(i64::MAX), StackId::EMPTY))
        .collect()
}

fn trace_entry(e: &TraceEvent, time_us: i64, stack: StackId) -> TraceEntry {
    TraceEntry {
        action: match e.action {
            TraceAction::Alloc => Action::Alloc,
            TraceAction::FreeRequested => Action::FreeRequested,
            TraceAction::FreeCompleted => Action::FreeCompleted,
            TraceAction::SegmentAlloc => Action::SegmentAlloc,
            TraceAction::SegmentFree => Action::SegmentFree,
            TraceAction::SegmentMap => Action::SegmentMap,
            TraceAction::SegmentUnmap => Action::SegmentUnmap,
            TraceAction::Oom => Action::Oom,
        },
        addr: e.address,
        size: e.size,
        stream: e.stream.0,
        time_us,
        stack,
    }
}

/// The snapshot of a live allocator on device `device`: its `segments`, the entries it
/// recorded (`recorded`, from [`CachingCore::recorded_history`](crate::CachingCore::recorded_history),
/// oldest first) with their clock times, and its settings — what
/// `torch.cuda.memory._snapshot()` gives for a PyTorch process.
///
/// Entries recorded with backtraces get them as `frames` (innermost first, as PyTorch lists
/// them, without the frames of the capture itself); an allocated or pending block gets the
/// frames of the last `alloc` at its address still in the history, and a segment those of the
/// last `segment_alloc` (or `segment_map`) at its address, as PyTorch keeps the context of
/// each block. Symbols are resolved here, once per distinct backtrace text.
pub fn live_snapshot(
    segments: &[SegmentInfo],
    recorded: &[RecordedEvent],
    settings: &Settings,
    device: usize,
) -> Snapshot {
    let mut frames = FrameTable::default();
    let mut resolved: HashMap<String, StackId> = HashMap::new();
    let mut entries = Vec::with_capacity(recorded.len());
    // The stack of the last alloc at each address, and of the last segment_alloc/map.
    let mut block_stack: HashMap<u64, StackId> = HashMap::new();
    let mut segment_stack: HashMap<u64, StackId> = HashMap::new();
    for r in recorded {
        let stack = match &r.backtrace {
            None => StackId::EMPTY,
            Some(bt) => {
                let text = bt.to_string();
                match resolved.get(&text) {
                    Some(&id) => id,
                    None => {
                        let id = frames.intern_stack(backtrace_frames(&text));
                        resolved.insert(text, id);
                        id
                    }
                }
            }
        };
        match r.event.action {
            TraceAction::Alloc => {
                block_stack.insert(r.event.address, stack);
            }
            TraceAction::SegmentAlloc | TraceAction::SegmentMap => {
                segment_stack.insert(r.event.address, stack);
            }
            _ => {}
        }
        entries.push(trace_entry(&r.event, r.time_us, stack));
    }
    let mut segments = segment_states(segments, device);
    for seg in &mut segments {
        seg.stack = segment_stack
            .get(&seg.address)
            .copied()
            .unwrap_or(StackId::EMPTY);
        for b in &mut seg.blocks {
            if b.state != BlockStatus::Inactive {
                b.stack = block_stack
                    .get(&b.address)
                    .copied()
                    .unwrap_or(StackId::EMPTY);
            }
        }
    }
    let mut traces: Vec<DeviceTrace> = (0..device)
        .map(|d| DeviceTrace {
            device: d,
            entries: Vec::new(),
        })
        .collect();
    traces.push(DeviceTrace { device, entries });
    Snapshot {
        segments,
        traces,
        allocator_settings: Some(allocator_settings(settings)),
        frames,
    }
}

/// The frames of a backtrace printed by `std::backtrace::Backtrace`'s `Display`, innermost
/// first, without the leading frames of the capture itself (the standard library's backtrace
/// code and the history's recording) and without the runtime's frames below
/// `__rust_begin_short_backtrace`, as Rust's short panic backtraces print them.
///
/// The printed form is one `N: function` line per frame (an inlined function on a line of its
/// own without `N:`), each followed by `at file:line:column` when the debug information has
/// it. A line of another form is kept as a frame's name, so nothing is lost if that form
/// changes.
pub(crate) fn backtrace_frames(text: &str) -> Vec<Frame> {
    let mut out: Vec<Frame> = Vec::new();
    for line in text.lines() {
        let t = line.trim();
        if t.is_empty() {
            continue;
        }
        if let Some(at) = t.strip_prefix("at ")
            && let Some(last) = out.last_mut()
            && last.filename == "??"
        {
            let (filename, line) = split_location(at);
            last.filename = filename;
            last.line = line;
            continue;
        }
        let name = match t.split_once(": ") {
            Some((n, rest)) if n.chars().all(|c| c.is_ascii_digit()) => rest,
            _ => t,
        };
        out.push(Frame {
            name: name.to_string(),
            filename: "??".to_string(),
            line: 0,
        });
    }
    // The runtime's frames below the program's `main` or its thread's closure, as Rust's
    // short panic backtraces leave them out.
    if let Some(end) = out
        .iter()
        .position(|f| f.name.contains("__rust_begin_short_backtrace"))
    {
        out.truncate(end);
    }
    // The capture: the history's own frames and the core's `trace`, which only ever sit at
    // the top of the stack.
    let capture = |f: &Frame| {
        f.name.starts_with("std::backtrace")
            || f.name.contains("cachalot::history::")
            || f.name.contains("CachingCore<B>::trace")
    };
    let skip = out.iter().rposition(capture).map_or(0, |i| i + 1);
    out.drain(..skip);
    out
}

/// `file:line:column` (or `file:line`) as the file and the line; the line is 0 when absent.
fn split_location(at: &str) -> (String, u64) {
    let mut parts = at.rsplitn(3, ':');
    let (a, b, c) = (parts.next(), parts.next(), parts.next());
    let num = |s: Option<&str>| s.and_then(|s| s.parse::<u64>().ok());
    match (num(a), num(b), c) {
        (Some(_), Some(line), Some(file)) => (file.to_string(), line),
        (Some(line), _, _) => {
            let file = at.rsplit_once(':').map_or(at, |(f, _)| f);
            (file.to_string(), line)
        }
        _ => (at.to_string(), 0),
    }
}

/// The settings as a snapshot records them: the configuration string over PyTorch's defaults
/// (which `Settings::pytorch().apply` reads back, memory fraction included; PyTorch keys only
/// for PyTorch's own knobs, cachalot's keys spelled out for cachalot's policy) and the parsed
/// values PyTorch also writes.
pub fn allocator_settings(settings: &Settings) -> AllocatorSettings {
    AllocatorSettings {
        alloc_conf: settings.config_over(&Settings::pytorch()),
        max_split_size: (settings.max_split_size != u64::MAX).then_some(settings.max_split_size),
        garbage_collection_threshold: settings.garbage_collection_threshold,
        expandable_segments: settings.expandable_segments,
        roundup_power2_divisions: settings.roundup_power2_divisions.to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::StreamId;
    use crate::backend::sim::SimDevice;
    use crate::policy::CachingCore;

    #[test]
    fn pending_and_free_blocks_are_summed_as_pytorch_sums_them() {
        let mut core = CachingCore::new(SimDevice::new(1 << 30), Settings::pytorch()).unwrap();
        let a = core.malloc(1000, StreamId(0)).unwrap();
        let b = core.malloc(3000, StreamId(0)).unwrap();
        let _c = core.malloc(700, StreamId(0)).unwrap();
        core.record_stream(b, StreamId(9)).unwrap();
        core.free(b).unwrap();
        core.free(a).unwrap();
        let segs = segment_states(&core.segments(), 0);
        assert_eq!(segs.len(), 1);
        let s = &segs[0];
        assert_eq!(s.total_size, 2 << 20);
        assert_eq!(s.allocated_size, 1024);
        assert_eq!(s.active_size, 1024 + 3072);
        assert_eq!(s.requested_size, 700 + 3000);
        assert_eq!(s.blocks[1].state, BlockStatus::ActivePendingFree);
        assert_eq!(s.blocks[0].state, BlockStatus::Inactive);
        assert_eq!(s.blocks[0].requested_size, 0);
    }

    #[test]
    fn backtrace_text_becomes_frames_without_the_capture() {
        let text = "   0: std::backtrace::Backtrace::force_capture
             at /rustc/abc/library/std/src/backtrace.rs:312:13
   1: cachalot::history::History::push
             at ./allocator/src/history.rs:140:30
   2: cachalot::policy::CachingCore<B>::malloc
             at ./allocator/src/policy/mod.rs:250:9
      my_app::inlined_helper
             at ./src/main.rs:7
   3: <unknown>
   4: std::sys::backtrace::__rust_begin_short_backtrace
             at /rustc/abc/library/std/src/sys/backtrace.rs:166:18
   5: std::rt::lang_start::{{closure}}
";
        let frames = backtrace_frames(text);
        let names: Vec<&str> = frames.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "cachalot::policy::CachingCore<B>::malloc",
                "my_app::inlined_helper",
                "<unknown>"
            ]
        );
        assert_eq!(frames[0].filename, "./allocator/src/policy/mod.rs");
        assert_eq!(frames[0].line, 250);
        assert_eq!(frames[1].filename, "./src/main.rs");
        assert_eq!(frames[1].line, 7);
        assert_eq!((frames[2].filename.as_str(), frames[2].line), ("??", 0));
    }

    #[test]
    fn a_live_snapshot_carries_times_backtraces_and_block_frames() {
        use crate::history::HistoryOptions;
        let mut core = CachingCore::new(SimDevice::new(1 << 30), Settings::pytorch()).unwrap();
        core.record_history_with(Some(HistoryOptions::new(100).with_backtraces(true)));
        let a = core.malloc(1000, StreamId(0)).unwrap();
        let b = core.malloc(5000, StreamId(0)).unwrap();
        core.free(b).unwrap();
        let snap = live_snapshot(
            &core.segments(),
            &core.recorded_history(),
            core.settings(),
            1,
        );
        assert_eq!(snap.traces.len(), 2);
        assert!(snap.traces[0].entries.is_empty());
        let entries = &snap.traces[1].entries;
        assert_eq!(entries.len(), 5);
        assert!(entries.iter().all(|e| e.stack != StackId::EMPTY));
        assert!(entries.windows(2).all(|w| w[0].time_us <= w[1].time_us));
        // The frames begin in the core (where the alloc is recorded), not in the capture
        // machinery, and reach the caller: this test.
        let stack: Vec<&Frame> = snap.frames.stack(entries[1].stack).collect();
        assert!(stack[0].name.contains("CachingCore"), "{stack:?}");
        assert!(
            stack.iter().all(
                |f| !f.name.contains("std::backtrace") && !f.name.contains("cachalot::history")
            ),
            "{stack:?}"
        );
        let reaches_this_test = stack.iter().any(|f| {
            f.name.contains("a_live_snapshot_carries")
                // Release builds without debug info (the loom run) know no file names.
                && ((f.filename.ends_with("build.rs") && f.line > 0)
                    || (f.filename == "??" && f.line == 0))
        });
        // A release build may also inline this test into the test harness's call: then the
        // frame after the core's is the harness's, with no file name either.
        let inlined_into_the_harness = cfg!(not(debug_assertions))
            && stack
                .iter()
                .skip_while(|f| f.name.contains("CachingCore"))
                .any(|f| f.name.contains("call_once") && f.filename == "??");
        assert!(reaches_this_test || inlined_into_the_harness, "{stack:?}");
        let seg = &snap.segments[0];
        assert_eq!(seg.stack, entries[0].stack);
        let live = seg.blocks.iter().find(|x| x.address == a).unwrap();
        assert_eq!(live.stack, entries[1].stack);
        assert!(
            seg.blocks
                .iter()
                .filter(|x| x.state == BlockStatus::Inactive)
                .all(|x| x.stack == StackId::EMPTY)
        );
    }

    #[test]
    fn settings_round_trip_through_the_recorded_string() {
        let s = Settings::pytorch()
            .apply(
                "max_split_size_mb:64,roundup_power2_divisions:4,per_process_memory_fraction:0.5",
            )
            .unwrap();
        let recorded = allocator_settings(&s);
        assert_eq!(recorded.max_split_size, Some(64 << 20));
        assert_eq!(Settings::pytorch().apply(&recorded.alloc_conf).unwrap(), s);
        assert_eq!(
            allocator_settings(&Settings::pytorch()).max_split_size,
            None
        );
    }
}

//! Export: the allocator's state and history as a PyTorch memory snapshot.
//!
//! The one rule: what is written is what PyTorch would have written for the same allocator
//! state — a segment's sizes are summed from its blocks as PyTorch's `snapshot()` sums them,
//! block states use PyTorch's names, and the history keeps the allocator's own order — so that
//! [`write_snapshot`](crate::snapshot::write_snapshot) gives a file that PyTorch's
//! `torch.cuda._memory_viz` reads and that cachalot's reader replays like a PyTorch trace.
//!
//! ```
//! use cachalot::{CachingCore, Settings, SimDevice, StreamId};
//! use cachalot_tools::export::snapshot_of;
//!
//! let mut core = CachingCore::new(SimDevice::new(1 << 30), Settings::pytorch()).unwrap();
//! core.record_history(true);
//! let a = core.malloc(4096, StreamId(0)).unwrap();
//! core.free(a).unwrap();
//! let snap = snapshot_of(&core.segments(), core.history(), core.settings(), 0);
//! assert_eq!(snap.segments.len(), 1);
//! assert_eq!(snap.traces[0].entries.len(), 4); // segment_alloc, alloc, free_requested, free_completed
//! ```

use cachalot::sizes::Pool;
use cachalot::{BlockState, SegmentInfo, Settings, TraceAction, TraceEvent};

use crate::snapshot::{
    Action, AllocatorSettings, BlockState as SnapBlock, BlockStatus, DeviceTrace, FrameTable,
    SegmentState, SegmentType, Snapshot, StackId, TraceEntry,
};

/// The snapshot of one device's allocator: its segments (`segments`, e.g. from
/// [`CachingCore::segments`](cachalot::CachingCore::segments)), its recorded history
/// (`history`, from [`CachingCore::history`](cachalot::CachingCore::history)) and its
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
                    requested_size: if b.state == BlockState::Free {
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
                blocks,
                stack: StackId::EMPTY,
            }
        })
        .collect()
}

/// PyTorch's name for a block state.
pub fn block_status(state: BlockState) -> BlockStatus {
    match state {
        BlockState::Free => BlockStatus::Inactive,
        BlockState::Allocated => BlockStatus::ActiveAllocated,
        BlockState::Pending => BlockStatus::ActivePendingFree,
    }
}

/// The history as trace entries, in order.
pub fn trace_entries(history: &[TraceEvent]) -> Vec<TraceEntry> {
    history
        .iter()
        .enumerate()
        .map(|(i, e)| TraceEntry {
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
            time_us: i64::try_from(i).unwrap_or(i64::MAX),
            stack: StackId::EMPTY,
        })
        .collect()
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
    use cachalot::{CachingCore, SimDevice, StreamId};

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

//! PyTorch memory snapshots, in the allocator crate: the snapshot's types, the one writer of
//! PyTorch's pickle format, and the snapshot of an allocator's own state and history (feature
//! `snapshot`, on by default).
//!
//! The one rule: what is written is what `torch.cuda.memory._dump_snapshot()` writes for the
//! same allocator state — the same keys, the same block-state names, a segment's sizes summed
//! from its blocks as PyTorch sums them, the history in the allocator's own order — so
//! PyTorch's tools (`python -m torch.cuda._memory_viz`, pytorch.org/memory_viz) read it, and
//! `cachalot replay` (crate `cachalot-tools`, which reads snapshots and re-exports these types)
//! replays it like a PyTorch trace.
//!
//! A snapshot is a dict with
//!
//! - `segments`: the allocator's state at the dump, one dict per segment (`device`, `address`,
//!   `total_size`, `allocated_size`, `active_size`, `requested_size`, `stream`, `segment_type`
//!   `'small'`/`'large'`, `segment_pool_id`, `is_expandable`, `frames`, `blocks`), each block a
//!   dict (`address`, `size`, `requested_size`, `state` `'active_allocated'` /
//!   `'active_pending_free'` / `'inactive'`, `frames`);
//! - `device_traces`: one list per device of trace entries (`action`, `addr` — or
//!   `device_free` for `oom` —, `size`, `stream`, `time_us`, `compile_context`,
//!   `user_metadata`, `frames`);
//! - `allocator_settings`: the `PYTORCH_CUDA_ALLOC_CONF` string and the parsed settings;
//! - `external_annotations` (empty).
//!
//! A Rust program records its allocator's history with `Allocator::record_history` (or
//! `CudaAllocator::record_history`) and writes it with `dump_snapshot`; [`snapshot_of`] and
//! [`write_snapshot`] are the pieces underneath, also used by `cachalot replay --snapshot-out`.

pub(crate) mod build;
mod frames;
pub(crate) mod write;

pub use build::{
    allocator_settings, block_status, live_snapshot, segment_states, snapshot_of, trace_entries,
};
pub use frames::{Frame, FrameId, FrameTable, StackId};
pub use write::write_snapshot;

/// A PyTorch memory snapshot: the allocator's segments at the moment of the dump and the
/// recorded trace of each device.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    /// Every segment the allocator held at the dump, all devices together, in PyTorch's order.
    pub segments: Vec<SegmentState>,
    /// One trace per device, in device order (`traces[i].device == i` when read from a file).
    pub traces: Vec<DeviceTrace>,
    /// The allocator settings PyTorch recorded (PyTorch 2.5+), if the snapshot has them.
    pub allocator_settings: Option<AllocatorSettings>,
    /// Every distinct stack frame and stack the segments, blocks and trace entries name.
    pub frames: FrameTable,
}

/// One segment (one device allocation) at the time of the dump.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentState {
    /// The device index.
    pub device: usize,
    /// The segment's device address.
    pub address: u64,
    /// The segment's size in bytes (what was asked of cudaMalloc).
    pub total_size: u64,
    /// Bytes of its blocks handed out to the program.
    pub allocated_size: u64,
    /// Bytes of its blocks allocated or waiting for other streams (pending free).
    pub active_size: u64,
    /// Bytes the program asked for in its allocated blocks (before rounding).
    pub requested_size: u64,
    /// The stream the segment belongs to (PyTorch's `cudaStream_t` as an integer; 0 is the
    /// default stream).
    pub stream: u64,
    /// The pool the segment belongs to.
    pub segment_type: SegmentType,
    /// Whether the segment is an expandable segment (`expandable_segments:True`).
    pub is_expandable: bool,
    /// `segment_pool_id`: the private pool the segment belongs to — a CUDA graph's
    /// (`torch.cuda.graph`, `torch.compile(mode="reduce-overhead")`) or a `torch.cuda.MemPool`'s
    /// — or `(0, 0)` for the allocator's default pools.
    pub pool_id: (u64, u64),
    /// The blocks tiling the segment, in address order.
    pub blocks: Vec<BlockState>,
    /// Where the segment was allocated ([`StackId::EMPTY`] when no stack was recorded).
    pub stack: StackId,
}

/// The pool a segment belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SegmentType {
    /// The small pool (requests up to 1 MiB, 2 MiB segments); PyTorch writes `'small'`.
    Small,
    /// The large pool; PyTorch writes `'large'`.
    Large,
}

impl SegmentType {
    /// PyTorch's name for the pool.
    pub fn as_str(self) -> &'static str {
        match self {
            SegmentType::Small => "small",
            SegmentType::Large => "large",
        }
    }
}

/// One block of a segment at the time of the dump.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockState {
    /// The block's device address.
    pub address: u64,
    /// The block's size in bytes (after rounding and splitting).
    pub size: u64,
    /// The size the program asked for (for a free block PyTorch writes whatever it last held,
    /// usually 0).
    pub requested_size: u64,
    /// Whether the block is allocated, waiting for other streams, or free.
    pub state: BlockStatus,
    /// Where the block was last allocated ([`StackId::EMPTY`] when no stack was recorded).
    pub stack: StackId,
}

/// The state of a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockStatus {
    /// Handed out to the program (`'active_allocated'`).
    ActiveAllocated,
    /// Freed by the program but still in use by other streams (`'active_pending_free'`;
    /// PyTorch's documentation also calls it `'active_awaiting_free'`, which is accepted too).
    ActivePendingFree,
    /// Free and cached (`'inactive'`).
    Inactive,
}

impl BlockStatus {
    /// PyTorch's name for the state.
    pub fn as_str(self) -> &'static str {
        match self {
            BlockStatus::ActiveAllocated => "active_allocated",
            BlockStatus::ActivePendingFree => "active_pending_free",
            BlockStatus::Inactive => "inactive",
        }
    }
}

/// The allocator settings a snapshot records (its `allocator_settings` dict).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AllocatorSettings {
    /// The `PYTORCH_CUDA_ALLOC_CONF` string the allocator last parsed (empty when unset).
    pub alloc_conf: String,
    /// `max_split_size` in bytes; `None` when unlimited (PyTorch writes -1).
    pub max_split_size: Option<u64>,
    /// `garbage_collection_threshold` (0 when off).
    pub garbage_collection_threshold: f64,
    /// Whether expandable segments are on.
    pub expandable_segments: bool,
    /// `roundup_power2_divisions` per size interval, in the order of PyTorch's keys `"1"`,
    /// `"2"`, `"4"`, … (0 means no power-of-two rounding for that interval).
    pub roundup_power2_divisions: Vec<u64>,
}

impl AllocatorSettings {
    /// `roundup_power2_divisions` as one count per size interval (rule 2), 0 where unset.
    pub fn divisions(&self) -> [u64; 16] {
        let mut out = [0; 16];
        for (slot, &d) in out.iter_mut().zip(&self.roundup_power2_divisions) {
            *slot = d;
        }
        out
    }
}

/// The recorded trace of one device.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceTrace {
    /// The device index (the position in the snapshot's `device_traces` list).
    pub device: usize,
    /// The entries, oldest first. When the recording's `max_entries` was reached PyTorch kept
    /// only the newest entries, so the trace can begin in the middle of the program.
    pub entries: Vec<TraceEntry>,
}

/// One entry of a device trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceEntry {
    /// What happened.
    pub action: Action,
    /// The block's or segment's address; for [`Action::Oom`] the bytes the device still had
    /// free (PyTorch's `device_free`, stored in the same field as in PyTorch's own `TraceEntry`).
    pub addr: u64,
    /// The size: requested bytes for allocations and frees, segment bytes for segment events.
    pub size: u64,
    /// The stream, as in [`SegmentState::stream`].
    pub stream: u64,
    /// When, in microseconds (PyTorch's clock; only differences mean anything).
    pub time_us: i64,
    /// The stack that did it ([`StackId::EMPTY`] when no stack was recorded).
    pub stack: StackId,
}

/// The action of a trace entry.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Action {
    /// `alloc`: a block was handed to the program.
    Alloc,
    /// `free_requested`: the program freed a block.
    FreeRequested,
    /// `free_completed`: the block went back to the pool (right after `free_requested`, or
    /// later when other streams had used it).
    FreeCompleted,
    /// `segment_alloc`: a new segment was taken from the device.
    SegmentAlloc,
    /// `segment_free`: a segment was given back to the device.
    SegmentFree,
    /// `segment_map`: pages were mapped into an expandable segment.
    SegmentMap,
    /// `segment_unmap`: pages were unmapped from an expandable segment.
    SegmentUnmap,
    /// `snapshot`: a snapshot was taken.
    Snapshot,
    /// `oom`: an allocation failed.
    Oom,
    /// `user_defined`: an annotation.
    UserDefined,
    /// An action this reader does not know (from a newer PyTorch), kept by name.
    Other(String),
}

impl Action {
    /// Parses PyTorch's name of an action; unknown names become [`Action::Other`].
    pub fn from_name(name: &str) -> Action {
        match name {
            "alloc" => Action::Alloc,
            "free_requested" => Action::FreeRequested,
            "free_completed" => Action::FreeCompleted,
            "segment_alloc" => Action::SegmentAlloc,
            "segment_free" => Action::SegmentFree,
            "segment_map" => Action::SegmentMap,
            "segment_unmap" => Action::SegmentUnmap,
            "snapshot" => Action::Snapshot,
            "oom" => Action::Oom,
            "user_defined" => Action::UserDefined,
            other => Action::Other(other.to_string()),
        }
    }

    /// PyTorch's name of the action.
    pub fn name(&self) -> &str {
        match self {
            Action::Alloc => "alloc",
            Action::FreeRequested => "free_requested",
            Action::FreeCompleted => "free_completed",
            Action::SegmentAlloc => "segment_alloc",
            Action::SegmentFree => "segment_free",
            Action::SegmentMap => "segment_map",
            Action::SegmentUnmap => "segment_unmap",
            Action::Snapshot => "snapshot",
            Action::Oom => "oom",
            Action::UserDefined => "user_defined",
            Action::Other(name) => name,
        }
    }
}

//! PyTorch memory snapshots: reading them, writing them, and turning their traces into replay
//! programs.
//!
//! A snapshot is what `torch.cuda.memory._dump_snapshot()` writes: a Python pickle (protocol 4
//! from Python 3.8–3.13, 5 from 3.14) of a dict with
//!
//! - `segments`: the allocator's state at the dump, one dict per segment (`device`, `address`,
//!   `total_size`, `allocated_size`, `active_size`, `requested_size`, `stream`, `segment_type`
//!   `'small'`/`'large'`, `segment_pool_id`, `is_expandable`, `frames`, `blocks`), each block a
//!   dict (`address`, `size`, `requested_size`, `state` `'active_allocated'` /
//!   `'active_pending_free'` / `'inactive'`, `frames`);
//! - `device_traces`: one list per device of trace entries (`action`, `addr` — or `device_free`
//!   for `oom` —, `size`, `stream`, `time_us`, and in PyTorch 2.11 `compile_context` and
//!   `user_metadata`; `frames` only when stacks were recorded);
//! - `allocator_settings` (PyTorch 2.5+): the `PYTORCH_CUDA_ALLOC_CONF` string and the parsed
//!   settings; `external_annotations` (2.11) and other keys are ignored.
//!
//! What the trace's sizes mean (read off PyTorch 2.11 traces, `tests/fixtures/traces/`): an
//! `alloc`, `free_requested` or `free_completed` carries the *requested* size (a 4-byte tensor
//! shows 4, not 512); a `segment_alloc` or `segment_free` carries the segment's size; an `oom`
//! carries the requested size and, in place of an address, the bytes the device still had free.
//!
//! [`read_snapshot`] / [`parse_snapshot`] give a [`Snapshot`] of plain Rust types;
//! [`write_snapshot`] writes one back in the same format (what `torch.cuda._memory_viz` reads);
//! [`replay_ops`] turns one device's trace into a [`ReplayProgram`]; [`read_figures`] reads the
//! JSON sidecar that `scripts/record_traces.py` writes next to each recorded snapshot.
//!
//! # Recording that began mid-run
//!
//! Users start recording after a warm-up, or let the ring buffer wrap: the process then held
//! segments, live tensors and cached blocks at the trace's first entry. [`Snapshot::start_of`]
//! rebuilds that state from the dumped segments by walking the trace backwards
//! ([`reconstruct_start`]), and [`replay_ops_from`] makes the blocks live then the program's
//! first handles ([`ReplayProgram::initial`], the state in [`ReplayProgram::start`]), so the
//! replay can start where PyTorch was (see `crate::replay::StartMode`).
//!
//! # Stack frames
//!
//! Recorded with `_record_memory_history()` at its defaults, every trace entry, block and
//! segment carries a `frames` list of `{'name', 'filename', 'line'}` dicts (86 per entry is
//! common). There are few distinct frames and stacks, and PyTorch's pickler shares them
//! through its memo; the reader keeps that sharing: [`Snapshot::frames`] is a [`FrameTable`]
//! holding every distinct frame and stack once, and each entry, block and segment names its
//! stack by a [`StackId`] ([`StackId::EMPTY`] when none was recorded).
//!
//! # Reading: a purpose-built pickle decoder
//!
//! Snapshots are read by this crate's own streaming decoder (module `pickle`) for the part of
//! the pickle format they use (protocols 2–5: containers, integers up to 64 bits, floats,
//! strings, the memo), not by a general unpickler. It builds an arena of nodes where a memo
//! reference shares the node it refers to instead of copying it, so memory follows the
//! distinct data: the 39 MB, 128,897-entry `gpt2_generate_large` fixture, whose frame
//! references would expand to 75 million values, stores about 2.9 million. The file is read
//! in pieces (gzip undone on the way, recognised by its magic bytes), and the decoded values
//! are converted along the snapshot's fixed shape into plain Rust types, frames interned.
//!
//! # Robustness
//!
//! Reading never panics, never recurses over input values, and its memory is bounded by
//! [`ReadLimits`]: input bytes, values stored (memo references are shared, so this counts
//! real memory, not an expansion), nesting depth and devices. Length prefixes are read as
//! the data arrives, so one that runs past the end costs nothing; opcodes no snapshot contains
//! (globals and class instances, persistent ids, extension codes, out-of-band buffers, sets)
//! are refused, and so is changing a container after it was put into another (what Python's
//! pickler never does; it rules out cycles). Decoding is one linear pass. Every failure is a
//! [`SnapshotError`] that names the file and what is wrong, with the path in the snapshot
//! (`device_traces[0][12].size`) for values of the wrong type or absurd size.
//!
//! # Writing
//!
//! [`write_snapshot`] is a small pickle writer of its own (protocol 4), memoising repeated
//! strings, frame dicts and frame lists as PyTorch's pickler does.

mod error;
mod figures;
mod frames;
mod pickle;
mod read;
mod replay;
mod start;
mod write;

pub use error::SnapshotError;
pub use figures::{Figures, read_figures, read_figures_for};
pub use frames::{Frame, FrameId, FrameTable, StackId};
pub use read::{
    ReadLimits, decode_stats, parse_snapshot, parse_snapshot_with_limits, read_snapshot,
    read_snapshot_with_limits,
};
pub use replay::{
    InitialHandle, ReplayOp, ReplayOptions, ReplayProgram, ReplayReport, replay_ops,
    replay_ops_from, replay_ops_with,
};
pub use start::{StartBlock, StartError, StartSegment, StartState, reconstruct_start};
pub use write::write_snapshot;

/// Largest size or address component a snapshot may carry: PyTorch refuses requests above
/// 2^60 bytes, so a larger size can only come from a corrupt or hostile file.
pub const MAX_SIZE: u64 = 1 << 60;

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

impl Snapshot {
    /// The replay program of every device whose trace is not empty, as `(device, program)`,
    /// with [`ReplayOptions`] taken from the snapshot's allocator settings.
    ///
    /// Each program starts from the state reconstructed by [`Snapshot::start_of`], or from an
    /// empty allocator where that fails.
    pub fn replay_programs(&self) -> Vec<(usize, ReplayProgram)> {
        let options = ReplayOptions::from_settings(self.allocator_settings.as_ref());
        self.traces
            .iter()
            .filter(|t| !t.entries.is_empty())
            .map(|t| {
                let start = self.start_of(t.device).unwrap_or_default();
                (t.device, replay_ops_from(t, &options, &start).0)
            })
            .collect()
    }

    /// The allocator's state on `device` when recording began, reconstructed from the dumped
    /// segments by walking that device's trace backwards ([`reconstruct_start`]).
    pub fn start_of(&self, device: usize) -> Result<StartState, StartError> {
        let empty = DeviceTrace {
            device,
            entries: Vec::new(),
        };
        let trace = self.traces.get(device).unwrap_or(&empty);
        let divisions = self
            .allocator_settings
            .as_ref()
            .map(AllocatorSettings::divisions)
            .unwrap_or([0; 16]);
        reconstruct_start(trace, &self.segments, &divisions)
    }
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

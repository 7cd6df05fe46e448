//! PyTorch memory snapshots: reading them and writing them (their traces become replay
//! programs in [`crate::replay`]).
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
//! [`read_figures`] reads the JSON sidecar that `scripts/record_traces.py` writes next to each
//! recorded snapshot. A trace that began mid-run (after a warm-up, or a wrapped ring buffer)
//! has its start rebuilt from the dumped segments by the replay
//! ([`crate::replay::reconstruct_start`]), which turns traces into programs
//! ([`crate::replay::replay_ops`]).
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
pub(crate) mod figures;
mod limits;
mod pickle;
mod read;

// The snapshot's types and its one writer live in the allocator crate (`cachalot::snapshot`,
// feature `snapshot`), so that a Rust program can dump a live snapshot without this crate;
// reading lives here.
pub use cachalot::snapshot::{
    Action, AllocatorSettings, BlockState, BlockStatus, DeviceTrace, Frame, FrameId, FrameTable,
    SegmentState, SegmentType, Snapshot, StackId, TraceEntry,
};
pub use error::SnapshotError;
pub use figures::{Figures, read_figures, read_figures_for};
pub use limits::{MAX_SIZE, ReadLimits};
pub use read::{
    decode_stats, parse_snapshot, parse_snapshot_with_limits, read_snapshot,
    read_snapshot_with_limits,
};

/// Writes `snapshot` as a pickle in the format of `torch.cuda.memory._dump_snapshot()`: the one
/// writer, [`cachalot::snapshot::write_snapshot`], with its failure as a [`SnapshotError`].
///
/// Fails with [`SnapshotError::Write`] when writing fails or when a [`StackId`] is not one of
/// the snapshot's stacks.
pub fn write_snapshot(snapshot: &Snapshot, w: impl std::io::Write) -> Result<(), SnapshotError> {
    cachalot::snapshot::write_snapshot(snapshot, w).map_err(|e| SnapshotError::Write {
        reason: e.to_string(),
    })
}

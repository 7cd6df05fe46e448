//! Allocation history: the allocator's own trace, in the vocabulary of PyTorch's memory
//! snapshots (`alloc`, `free_requested`, `free_completed`, `segment_alloc`, `segment_free`,
//! `oom`), so PyTorch's tools can read what cachalot did.
//!
//! The one rule: an entry is recorded at the same point of the policy where PyTorch records
//! its own, with the same address and size, so a cachalot trace replays like a PyTorch one.

use crate::backend::StreamId;

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

//! The replay's self-check: does it end in the state PyTorch dumped?
//!
//! A snapshot's `segments` are the allocator's layout at the dump, the moment the trace ends.
//! A replay that reproduced PyTorch's decisions ends in that layout too: the same segments
//! (address, size, stream, pool) tiled by the same blocks (address, size, state, and the
//! requested size of every block in use). Any difference means the replay took another
//! path somewhere — a start it could not reconstruct, a policy other than the one recorded,
//! or a rule it does not model — and its figures are not PyTorch's.

use cachalot::sizes::Pool;
use cachalot::{BlockPhase, SegmentInfo};
use serde::Serialize;

use cachalot::snapshot::{BlockStatus, SegmentState, SegmentType, Snapshot};

use crate::replay::program::recorded_stream;

/// The outcome of comparing a replay's final layout with the dump.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SelfCheck {
    /// Whether every segment and block equals the dump's.
    pub matches: bool,
    /// Segments in the dump (of the replayed device).
    pub dump_segments: usize,
    /// Blocks in the dump (of the replayed device).
    pub dump_blocks: usize,
    /// Segments the replay ended with.
    pub replay_segments: usize,
    /// The first difference, in words, when they differ.
    pub first_difference: Option<String>,
    /// Segments present in both with identical blocks.
    pub equal_segments: usize,
}

/// Compares `layout` (a replay's final segments) with the segments `snapshot` dumped for
/// `device`.
pub fn check_final_state(layout: &[SegmentInfo], snapshot: &Snapshot, device: usize) -> SelfCheck {
    let mut dump: Vec<_> = snapshot
        .segments
        .iter()
        .filter(|s| s.device == device)
        .collect();
    dump.sort_by_key(|s| s.address);
    let mut ours: Vec<&SegmentInfo> = layout.iter().collect();
    ours.sort_by_key(|s| s.address);
    let mut first: Option<String> = None;
    let mut equal = 0;
    let mut note = |d: String| {
        if first.is_none() {
            first = Some(d);
        }
    };
    let (mut i, mut j) = (0, 0);
    loop {
        match (dump.get(i), ours.get(j)) {
            (Some(d), Some(o)) if d.address == o.address => {
                let pool = match o.pool {
                    Pool::Small => SegmentType::Small,
                    Pool::Large => SegmentType::Large,
                };
                // A private pool's blocks are replayed on a stream of their own.
                let (stream, private) = recorded_stream(o.stream.0);
                let kind = |private: bool| if private { ", a private pool" } else { "" };
                if d.total_size != o.size
                    || d.stream != stream
                    || d.segment_type != pool
                    || (d.pool_id != (0, 0)) != private.is_some()
                {
                    note(format!(
                        "segment {:#x}: PyTorch {} bytes on stream {} ({}{}), replay {} bytes on \
                         stream {} ({}{})",
                        d.address,
                        d.total_size,
                        d.stream,
                        d.segment_type.as_str(),
                        kind(d.pool_id != (0, 0)),
                        o.size,
                        stream,
                        pool.as_str(),
                        kind(private.is_some())
                    ));
                } else if let Some(diff) = block_difference(d, o) {
                    note(diff);
                } else {
                    equal += 1;
                }
                i += 1;
                j += 1;
            }
            (Some(d), o) if o.is_none_or(|o| d.address < o.address) => {
                note(format!(
                    "segment {:#x} ({} bytes) is in the dump but not in the replay",
                    d.address, d.total_size
                ));
                i += 1;
            }
            (_, Some(o)) => {
                note(format!(
                    "segment {:#x} ({} bytes) is in the replay but not in the dump",
                    o.address, o.size
                ));
                j += 1;
            }
            (None, None) => break,
            // Unreachable: a dump segment with no replay segment after it took the arm above.
            (Some(_), None) => break,
        }
    }
    SelfCheck {
        matches: first.is_none(),
        dump_segments: dump.len(),
        dump_blocks: dump.iter().map(|s| s.blocks.len()).sum(),
        replay_segments: ours.len(),
        first_difference: first,
        equal_segments: equal,
    }
}

fn block_difference(d: &SegmentState, o: &SegmentInfo) -> Option<String> {
    let n = d.blocks.len().max(o.blocks.len());
    for k in 0..n {
        let (Some(db), Some(ob)) = (d.blocks.get(k), o.blocks.get(k)) else {
            return Some(format!(
                "segment {:#x}: PyTorch has {} blocks, the replay {}",
                d.address,
                d.blocks.len(),
                o.blocks.len()
            ));
        };
        let state = match ob.state {
            BlockPhase::Free => BlockStatus::Inactive,
            BlockPhase::Allocated => BlockStatus::ActiveAllocated,
            BlockPhase::Pending => BlockStatus::ActivePendingFree,
            // Held by a stitched view in use (rule 23b): memory in use.
            BlockPhase::Held => BlockStatus::ActiveAllocated,
        };
        let requested_differs =
            state == BlockStatus::ActiveAllocated && db.requested_size != ob.requested;
        if db.address != ob.address || db.size != ob.size || db.state != state || requested_differs
        {
            return Some(format!(
                "block {:#x}: PyTorch {} bytes at {:#x}, {} (requested {}); replay {} bytes at \
                 {:#x}, {} (requested {})",
                db.address,
                db.size,
                db.address,
                db.state.as_str(),
                db.requested_size,
                ob.size,
                ob.address,
                state.as_str(),
                ob.requested
            ));
        }
    }
    None
}

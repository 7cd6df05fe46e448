//! Writing snapshots in PyTorch's format.

use std::io::Write;

use serde::Serialize;
use serde::ser::{SerializeMap, SerializeSeq, Serializer};

use super::{Action, Snapshot, SnapshotError};

/// Writes `snapshot` as a pickle in the format of `torch.cuda.memory._dump_snapshot()`, so that
/// PyTorch's tools (`python -m torch.cuda._memory_viz stats|trace|segments|memory FILE`, the
/// memory viewer at pytorch.org/memory_viz) and [`read_snapshot`](super::read_snapshot) read it.
///
/// The pickle is protocol 3 (what `serde-pickle` writes; every Python 3 reads it). It holds:
///
/// - `segments`: per segment `device`, `address`, `total_size`, `allocated_size`,
///   `active_size`, `requested_size`, `stream`, `segment_type`, `segment_pool_id` (always
///   `(0, 0)`: private pools are not modelled), `is_expandable`, `frames` (empty) and `blocks`,
///   each block with `address`, `size`, `requested_size`, `state` and `frames` (empty).
///   `_memory_viz stats` asserts that the blocks of a segment add up to its `total_size`.
/// - `device_traces`: per device a list of entries with `action`, `addr` (or `device_free` for
///   `oom`), `size`, `stream`, `time_us` and `frames` (empty).
/// - `allocator_settings`, when the snapshot has them: `PYTORCH_CUDA_ALLOC_CONF`,
///   `max_split_size` (-1 when unlimited), `garbage_collection_threshold`,
///   `expandable_segments` and `roundup_power2_divisions` (keys `"1"`, `"2"`, `"4"`, …).
///
/// Stack frames, `compile_context`, `user_metadata` and other keys PyTorch may add are not
/// written. Reading the result back gives a snapshot equal to `snapshot`.
pub fn write_snapshot(snapshot: &Snapshot, mut w: impl Write) -> Result<(), SnapshotError> {
    let options = serde_pickle::SerOptions::new();
    serde_pickle::to_writer(&mut w, &Out(snapshot), options).map_err(|e| SnapshotError::Write {
        reason: e.to_string(),
    })?;
    w.flush().map_err(|e| SnapshotError::Write {
        reason: e.to_string(),
    })
}

/// An empty list (PyTorch's `frames` when no stacks were recorded).
struct EmptyList;

impl Serialize for EmptyList {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_seq(Some(0))?.end()
    }
}

/// A list of the items of a slice, each written through a wrapper.
struct Seq<'a, T, F>(&'a [T], F);

impl<'a, T, U: Serialize, F: Fn(&'a T) -> U> Serialize for Seq<'a, T, F> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().map(&self.1))
    }
}

struct Out<'a>(&'a Snapshot);

impl Serialize for Out<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let snap = self.0;
        let mut map = s.serialize_map(None)?;
        map.serialize_entry("segments", &Seq(&snap.segments, OutSegment))?;
        map.serialize_entry("device_traces", &Seq(&snap.traces, OutTrace))?;
        if let Some(settings) = &snap.allocator_settings {
            map.serialize_entry("allocator_settings", &OutSettings(settings))?;
        }
        map.end()
    }
}

struct OutSegment<'a>(&'a super::SegmentState);

impl Serialize for OutSegment<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let seg = self.0;
        let mut map = s.serialize_map(None)?;
        map.serialize_entry("device", &seg.device)?;
        map.serialize_entry("address", &seg.address)?;
        map.serialize_entry("total_size", &seg.total_size)?;
        map.serialize_entry("allocated_size", &seg.allocated_size)?;
        map.serialize_entry("active_size", &seg.active_size)?;
        map.serialize_entry("requested_size", &seg.requested_size)?;
        map.serialize_entry("stream", &seg.stream)?;
        map.serialize_entry("segment_type", seg.segment_type.as_str())?;
        map.serialize_entry("segment_pool_id", &(0i64, 0i64))?;
        map.serialize_entry("is_expandable", &seg.is_expandable)?;
        map.serialize_entry("frames", &EmptyList)?;
        map.serialize_entry("blocks", &Seq(&seg.blocks, OutBlock))?;
        map.end()
    }
}

struct OutBlock<'a>(&'a super::BlockState);

impl Serialize for OutBlock<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let b = self.0;
        let mut map = s.serialize_map(None)?;
        map.serialize_entry("address", &b.address)?;
        map.serialize_entry("size", &b.size)?;
        map.serialize_entry("requested_size", &b.requested_size)?;
        map.serialize_entry("state", b.state.as_str())?;
        map.serialize_entry("frames", &EmptyList)?;
        map.end()
    }
}

struct OutTrace<'a>(&'a super::DeviceTrace);

impl Serialize for OutTrace<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.entries.iter().map(OutEntry))
    }
}

struct OutEntry<'a>(&'a super::TraceEntry);

impl Serialize for OutEntry<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let e = self.0;
        let mut map = s.serialize_map(None)?;
        map.serialize_entry("action", e.action.name())?;
        let addr_key = if e.action == Action::Oom {
            "device_free"
        } else {
            "addr"
        };
        map.serialize_entry(addr_key, &e.addr)?;
        map.serialize_entry("size", &e.size)?;
        map.serialize_entry("stream", &e.stream)?;
        map.serialize_entry("time_us", &e.time_us)?;
        map.serialize_entry("frames", &EmptyList)?;
        map.end()
    }
}

struct OutSettings<'a>(&'a super::AllocatorSettings);

impl Serialize for OutSettings<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let st = self.0;
        let mut map = s.serialize_map(None)?;
        map.serialize_entry("PYTORCH_CUDA_ALLOC_CONF", &st.alloc_conf)?;
        let max_split: i64 = match st.max_split_size {
            Some(v) => i64::try_from(v).unwrap_or(i64::MAX),
            None => -1,
        };
        map.serialize_entry("max_split_size", &max_split)?;
        map.serialize_entry(
            "garbage_collection_threshold",
            &st.garbage_collection_threshold,
        )?;
        map.serialize_entry("expandable_segments", &st.expandable_segments)?;
        map.serialize_entry(
            "roundup_power2_divisions",
            &Divisions(&st.roundup_power2_divisions),
        )?;
        map.end()
    }
}

struct Divisions<'a>(&'a [u64]);

impl Serialize for Divisions<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (i, v) in self.0.iter().enumerate() {
            // PyTorch's keys: "1", "2", "4", ... (the interval's lower bound in MiB)
            let key = 1u128 << i.min(127);
            map.serialize_entry(&key.to_string(), v)?;
        }
        map.end()
    }
}

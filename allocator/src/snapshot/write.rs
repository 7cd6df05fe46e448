//! Writing snapshots in PyTorch's format, with a small pickle writer of this crate's own.
//!
//! The one rule: this is the project's only writer of the format; `cachalot-tools` writes
//! through it too.

use std::collections::HashMap;
use std::io::{self, Write};

use super::frames::{FrameTable, StackId};
use super::{
    Action, AllocatorSettings, BlockState, DeviceTrace, SegmentState, Snapshot, TraceEntry,
};

/// Writes `snapshot` as a pickle in the format of `torch.cuda.memory._dump_snapshot()`, so that
/// PyTorch's tools (`python -m torch.cuda._memory_viz stats|trace|segments|memory FILE`, the
/// memory viewer at pytorch.org/memory_viz) and `cachalot-tools`' `read_snapshot` read it.
///
/// The pickle is protocol 4 (Python 3.4+), without framing. Like PyTorch's pickler, it
/// memoises what repeats (`MEMOIZE`, then `BINGET`/`LONG_BINGET`): every string (dict keys,
/// action names, frame names and file names), every frame dict and every non-empty frames
/// list, so a stack shared by many entries is written once. It holds:
///
/// - `segments`: per segment `device`, `address`, `total_size`, `allocated_size`,
///   `active_size`, `requested_size`, `stream`, `segment_type`, `segment_pool_id` (the
///   segment's [`SegmentState::pool_id`]), `is_expandable`, `frames` and `blocks`, each
///   block with `address`, `size`, `requested_size`, `state` and `frames`.
///   `_memory_viz stats` asserts that the blocks of a segment add up to its `total_size`.
/// - `device_traces`: per device a list of entries with `action`, `addr` (or `device_free` for
///   `oom`), `size`, `stream`, `time_us`, `compile_context` (`'N/A'`), `user_metadata` (`''`)
///   and `frames`, as PyTorch 2.11 writes them.
/// - `allocator_settings`, when the snapshot has them: `PYTORCH_CUDA_ALLOC_CONF`,
///   `max_split_size` (-1 when unlimited), `garbage_collection_threshold`,
///   `expandable_segments`, PyTorch 2.11's pinned-memory and graph-capture keys at their
///   defaults (cachalot has neither), and `roundup_power2_divisions` (keys `"1"`, `"2"`, `"4"`, …).
/// - `external_annotations`: an empty list, as PyTorch 2.11 writes without annotations.
///
/// `frames` lists hold `{'name', 'filename', 'line'}` dicts from [`Snapshot::frames`]. Reading
/// the result back gives a snapshot equal to `snapshot` when its stacks and frames are numbered
/// in the order the snapshot first uses them (segments, their blocks, then the traces), which
/// is how the reader numbers them.
///
/// Fails when writing fails, or with [`io::ErrorKind::InvalidInput`] when a [`StackId`] is not
/// one of the snapshot's stacks.
pub fn write_snapshot(snapshot: &Snapshot, w: impl Write) -> io::Result<()> {
    let mut p = Pickler {
        out: io::BufWriter::with_capacity(64 << 10, w),
        table: &snapshot.frames,
        next_memo: 0,
        strings: HashMap::new(),
        frame_memo: vec![None; snapshot.frames.num_frames()],
        stack_memo: vec![None; snapshot.frames.num_stacks()],
    };
    p.snapshot(snapshot)?;
    p.out.flush()
}

// Opcodes written.
const PROTO: u8 = 0x80;
const STOP: u8 = b'.';
const MARK: u8 = b'(';
const EMPTY_DICT: u8 = b'}';
const EMPTY_LIST: u8 = b']';
const SETITEMS: u8 = b'u';
const APPENDS: u8 = b'e';
const BININT1: u8 = b'K';
const BININT2: u8 = b'M';
const BININT: u8 = b'J';
const LONG1: u8 = 0x8a;
const BINFLOAT: u8 = b'G';
const NEWTRUE: u8 = 0x88;
const NEWFALSE: u8 = 0x89;
const SHORT_BINUNICODE: u8 = 0x8c;
const BINUNICODE: u8 = b'X';
const BINUNICODE8: u8 = 0x8d;
const TUPLE2: u8 = 0x86;
const MEMOIZE: u8 = 0x94;
const BINGET: u8 = b'h';
const LONG_BINGET: u8 = b'j';

/// Items per `MARK … APPENDS` batch (what Python's pickler uses).
const BATCH: usize = 1000;

struct Pickler<'s, W: Write> {
    out: io::BufWriter<W>,
    table: &'s FrameTable,
    /// The memo index the next `MEMOIZE` gives.
    next_memo: u32,
    strings: HashMap<&'s str, u32>,
    frame_memo: Vec<Option<u32>>,
    stack_memo: Vec<Option<u32>>,
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

impl<'s, W: Write> Pickler<'s, W> {
    fn op(&mut self, op: u8) -> io::Result<()> {
        self.out.write_all(&[op])
    }

    fn memoize(&mut self) -> io::Result<u32> {
        self.op(MEMOIZE)?;
        let idx = self.next_memo;
        self.next_memo = self
            .next_memo
            .checked_add(1)
            .ok_or_else(|| invalid("more than 2^32 memoised values".into()))?;
        Ok(idx)
    }

    fn get(&mut self, idx: u32) -> io::Result<()> {
        if idx < 256 {
            self.out.write_all(&[BINGET, idx as u8])
        } else {
            self.op(LONG_BINGET)?;
            self.out.write_all(&idx.to_le_bytes())
        }
    }

    fn str(&mut self, s: &'s str) -> io::Result<()> {
        if let Some(&idx) = self.strings.get(s) {
            return self.get(idx);
        }
        let n = s.len();
        if n < 256 {
            self.out.write_all(&[SHORT_BINUNICODE, n as u8])?;
        } else if let Ok(n) = u32::try_from(n) {
            self.op(BINUNICODE)?;
            self.out.write_all(&n.to_le_bytes())?;
        } else {
            self.op(BINUNICODE8)?;
            self.out.write_all(&(n as u64).to_le_bytes())?;
        }
        self.out.write_all(s.as_bytes())?;
        let idx = self.memoize()?;
        self.strings.insert(s, idx);
        Ok(())
    }

    fn int(&mut self, v: i64) -> io::Result<()> {
        if (0..256).contains(&v) {
            self.out.write_all(&[BININT1, v as u8])
        } else if (0..65536).contains(&v) {
            self.op(BININT2)?;
            self.out.write_all(&(v as u16).to_le_bytes())
        } else if let Ok(v) = i32::try_from(v) {
            self.op(BININT)?;
            self.out.write_all(&v.to_le_bytes())
        } else {
            self.long(v as i128)
        }
    }

    fn uint(&mut self, v: u64) -> io::Result<()> {
        match i64::try_from(v) {
            Ok(v) => self.int(v),
            Err(_) => self.long(v as i128),
        }
    }

    /// `LONG1` with the fewest two's-complement bytes that hold `v`.
    fn long(&mut self, v: i128) -> io::Result<()> {
        let bytes = v.to_le_bytes();
        let mut n = 16;
        while n > 1 {
            let top = bytes[n - 1];
            let next_sign = bytes[n - 2] & 0x80;
            if (top == 0 && next_sign == 0) || (top == 0xff && next_sign != 0) {
                n -= 1;
            } else {
                break;
            }
        }
        self.out.write_all(&[LONG1, n as u8])?;
        self.out.write_all(&bytes[..n])
    }

    fn bool(&mut self, b: bool) -> io::Result<()> {
        self.op(if b { NEWTRUE } else { NEWFALSE })
    }

    fn key(&mut self, k: &'s str) -> io::Result<()> {
        self.str(k)
    }

    /// A `frames` list: empty, or the stack's memoised list.
    fn stack(&mut self, id: StackId) -> io::Result<()> {
        if !self.table.contains(id) {
            return Err(invalid(format!(
                "stack {} is not in the snapshot's frame table of {} stacks",
                id.0,
                self.table.num_stacks()
            )));
        }
        if let Some(idx) = self.stack_memo[id.0 as usize] {
            return self.get(idx);
        }
        self.op(EMPTY_LIST)?;
        let ids = self.table.stack_frame_ids(id);
        if ids.is_empty() {
            return Ok(());
        }
        let list_idx = self.memoize()?;
        let table = self.table;
        for batch in ids.chunks(BATCH) {
            self.op(MARK)?;
            for &f in batch {
                match self.frame_memo[f.0 as usize] {
                    Some(idx) => self.get(idx)?,
                    None => {
                        let frame = table
                            .frame(f)
                            .ok_or_else(|| invalid(format!("frame {} is not in the table", f.0)))?;
                        self.op(EMPTY_DICT)?;
                        let idx = self.memoize()?;
                        self.op(MARK)?;
                        self.key("name")?;
                        self.str(&frame.name)?;
                        self.key("filename")?;
                        self.str(&frame.filename)?;
                        self.key("line")?;
                        self.uint(frame.line)?;
                        self.op(SETITEMS)?;
                        self.frame_memo[f.0 as usize] = Some(idx);
                    }
                }
            }
            self.op(APPENDS)?;
        }
        self.stack_memo[id.0 as usize] = Some(list_idx);
        Ok(())
    }

    /// A list of `items`, each written by `item`.
    fn list<T>(
        &mut self,
        items: &'s [T],
        mut item: impl FnMut(&mut Self, &'s T) -> io::Result<()>,
    ) -> io::Result<()> {
        self.op(EMPTY_LIST)?;
        for batch in items.chunks(BATCH) {
            self.op(MARK)?;
            for x in batch {
                item(self, x)?;
            }
            self.op(APPENDS)?;
        }
        Ok(())
    }

    fn snapshot(&mut self, snap: &'s Snapshot) -> io::Result<()> {
        self.out.write_all(&[PROTO, 4])?;
        self.op(EMPTY_DICT)?;
        self.op(MARK)?;
        self.key("segments")?;
        self.list(&snap.segments, Self::segment)?;
        self.key("device_traces")?;
        self.list(&snap.traces, Self::trace)?;
        if let Some(settings) = &snap.allocator_settings {
            self.key("allocator_settings")?;
            self.settings(settings)?;
        }
        self.key("external_annotations")?;
        self.op(EMPTY_LIST)?;
        self.op(SETITEMS)?;
        self.op(STOP)
    }

    fn segment(&mut self, seg: &'s SegmentState) -> io::Result<()> {
        self.op(EMPTY_DICT)?;
        self.op(MARK)?;
        self.key("device")?;
        self.uint(seg.device as u64)?;
        self.key("address")?;
        self.uint(seg.address)?;
        self.key("total_size")?;
        self.uint(seg.total_size)?;
        self.key("allocated_size")?;
        self.uint(seg.allocated_size)?;
        self.key("active_size")?;
        self.uint(seg.active_size)?;
        self.key("requested_size")?;
        self.uint(seg.requested_size)?;
        self.key("stream")?;
        self.uint(seg.stream)?;
        self.key("segment_type")?;
        self.str(seg.segment_type.as_str())?;
        self.key("segment_pool_id")?;
        self.uint(seg.pool_id.0)?;
        self.uint(seg.pool_id.1)?;
        self.op(TUPLE2)?;
        self.key("is_expandable")?;
        self.bool(seg.is_expandable)?;
        self.key("frames")?;
        self.stack(seg.stack)?;
        self.key("blocks")?;
        self.list(&seg.blocks, Self::block)?;
        self.op(SETITEMS)
    }

    fn block(&mut self, b: &'s BlockState) -> io::Result<()> {
        self.op(EMPTY_DICT)?;
        self.op(MARK)?;
        self.key("address")?;
        self.uint(b.address)?;
        self.key("size")?;
        self.uint(b.size)?;
        self.key("requested_size")?;
        self.uint(b.requested_size)?;
        self.key("state")?;
        self.str(b.state.as_str())?;
        self.key("frames")?;
        self.stack(b.stack)?;
        self.op(SETITEMS)
    }

    fn trace(&mut self, t: &'s DeviceTrace) -> io::Result<()> {
        self.list(&t.entries, Self::entry)
    }

    fn entry(&mut self, e: &'s TraceEntry) -> io::Result<()> {
        self.op(EMPTY_DICT)?;
        self.op(MARK)?;
        self.key("action")?;
        self.str(e.action.name())?;
        self.key(if e.action == Action::Oom {
            "device_free"
        } else {
            "addr"
        })?;
        self.uint(e.addr)?;
        self.key("size")?;
        self.uint(e.size)?;
        self.key("stream")?;
        self.uint(e.stream)?;
        self.key("time_us")?;
        self.int(e.time_us)?;
        self.key("compile_context")?;
        self.str("N/A")?;
        self.key("user_metadata")?;
        self.str("")?;
        self.key("frames")?;
        self.stack(e.stack)?;
        self.op(SETITEMS)
    }

    fn settings(&mut self, st: &'s AllocatorSettings) -> io::Result<()> {
        self.op(EMPTY_DICT)?;
        self.op(MARK)?;
        self.key("PYTORCH_CUDA_ALLOC_CONF")?;
        self.str(&st.alloc_conf)?;
        self.key("max_split_size")?;
        match st.max_split_size {
            Some(v) => self.uint(v)?,
            None => self.int(-1)?,
        }
        self.key("garbage_collection_threshold")?;
        self.op(BINFLOAT)?;
        self.out
            .write_all(&st.garbage_collection_threshold.to_be_bytes())?;
        self.key("expandable_segments")?;
        self.bool(st.expandable_segments)?;
        // PyTorch 2.11's pinned-memory and graph-capture settings, at PyTorch's defaults.
        self.key("pinned_num_register_threads")?;
        self.int(1)?;
        self.key("release_lock_on_cudamalloc")?;
        self.bool(false)?;
        self.key("pinned_use_cuda_host_register")?;
        self.bool(false)?;
        self.key("graph_capture_record_stream_reuse")?;
        self.bool(false)?;
        self.key("roundup_power2_divisions")?;
        self.op(EMPTY_DICT)?;
        for batch in st.roundup_power2_divisions.chunks(BATCH).enumerate() {
            let (b, values) = batch;
            self.op(MARK)?;
            for (k, &v) in values.iter().enumerate() {
                // PyTorch's keys: "1", "2", "4", ... (the interval's lower bound in MiB)
                let i = b * BATCH + k;
                let key = (1u128 << i.min(127)).to_string();
                self.str_owned(&key)?;
                self.uint(v)?;
            }
            self.op(SETITEMS)?;
        }
        self.op(SETITEMS)
    }

    /// A string written without memoising (a key made on the fly).
    fn str_owned(&mut self, s: &str) -> io::Result<()> {
        let n = s.len();
        if n < 256 {
            self.out.write_all(&[SHORT_BINUNICODE, n as u8])?;
        } else {
            self.op(BINUNICODE)?;
            self.out.write_all(&(n as u32).to_le_bytes())?;
        }
        self.out.write_all(s.as_bytes())
    }
}

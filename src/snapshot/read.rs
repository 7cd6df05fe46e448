//! Reading snapshots: file → (gzip undone, streaming) → [`pickle`](super::pickle) decoder into
//! an arena of shared values → conversion and validation into a [`Snapshot`], frames interned
//! into its [`FrameTable`].
//!
//! The conversion walks the snapshot's fixed shape (root dict, segments, blocks, traces,
//! entries, frames) with plain loops, never recursing over the decoded values. A `frames` list
//! or frame dict that the pickle shares (one node referenced from many places) is converted
//! once: node id → [`StackId`] and node id → [`FrameId`] maps make every later reference a
//! lookup.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use cachalot::snapshot::{
    Action, AllocatorSettings, BlockState, BlockStatus, DeviceTrace, Frame, FrameId, FrameTable,
    SegmentState, SegmentType, Snapshot, StackId, TraceEntry,
};

use super::error::SnapshotError;
use super::limits::{MAX_SIZE, ReadLimits};
use super::pickle::arena::{DecodeError, Node, Pickle, Value};
use super::pickle::machine::decode;

/// Reads a snapshot file written by `torch.cuda.memory._dump_snapshot()` (or by
/// [`write_snapshot`](super::write_snapshot)), plain or gzip-compressed, with the default
/// [`ReadLimits`].
pub fn read_snapshot(path: &Path) -> Result<Snapshot, SnapshotError> {
    read_snapshot_with_limits(path, &ReadLimits::default())
}

/// [`read_snapshot`] with explicit limits. The file is read as it is decoded, never held whole.
pub fn read_snapshot_with_limits(
    path: &Path,
    limits: &ReadLimits,
) -> Result<Snapshot, SnapshotError> {
    let name = path.display().to_string();
    let io = |source| SnapshotError::Io {
        file: name.clone(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    if let Ok(meta) = file.metadata()
        && meta.is_file()
        && meta.len() > limits.max_input_bytes
    {
        return Err(SnapshotError::TooLarge {
            file: name,
            reason: format!("the file is larger than {} bytes", limits.max_input_bytes),
        });
    }
    let mut reader = BufReader::with_capacity(64 << 10, file);
    let gzip = reader.fill_buf().map_err(io)?.starts_with(&[0x1f, 0x8b]);
    parse_from(reader, gzip, None, &name, limits)
}

/// Parses a snapshot from bytes (a pickle, or a gzip-compressed pickle recognised by its magic
/// bytes) with the default [`ReadLimits`]; errors name the input `<bytes>`.
pub fn parse_snapshot(bytes: &[u8]) -> Result<Snapshot, SnapshotError> {
    parse_snapshot_with_limits(bytes, &ReadLimits::default())
}

/// [`parse_snapshot`] with explicit limits.
pub fn parse_snapshot_with_limits(
    bytes: &[u8],
    limits: &ReadLimits,
) -> Result<Snapshot, SnapshotError> {
    let gzip = bytes.starts_with(&[0x1f, 0x8b]);
    let hint = (!gzip).then_some(bytes.len());
    parse_from(bytes, gzip, hint, "<bytes>", limits)
}

fn parse_from(
    src: impl Read,
    gzip: bool,
    size_hint: Option<usize>,
    name: &str,
    limits: &ReadLimits,
) -> Result<Snapshot, SnapshotError> {
    let decoded = if gzip {
        decode(flate2::read::MultiGzDecoder::new(src), true, None, limits)
    } else {
        decode(src, false, size_hint, limits)
    };
    let file = || name.to_string();
    let pickle = decoded.map_err(|e| match e {
        DecodeError::NotPickle(reason) => SnapshotError::NotPickle {
            file: file(),
            reason,
        },
        DecodeError::Truncated(reason) => SnapshotError::Truncated {
            file: file(),
            reason,
        },
        DecodeError::TooLarge(reason) => SnapshotError::TooLarge {
            file: file(),
            reason,
        },
        DecodeError::Io(source) => SnapshotError::Io {
            file: file(),
            source,
        },
    })?;
    Converter::new(name, limits, &pickle).snapshot()
}

/// Decoding statistics of a snapshot file, for measurements: `(values stored, arena nodes)`.
#[doc(hidden)]
pub fn decode_stats(bytes: &[u8]) -> Result<(u64, usize), String> {
    let gzip = bytes.starts_with(&[0x1f, 0x8b]);
    let limits = ReadLimits::default();
    let p = if gzip {
        decode(
            flate2::read::MultiGzDecoder::new(bytes),
            true,
            None,
            &limits,
        )
    } else {
        decode(bytes, false, None, &limits)
    }
    .map_err(|e| format!("{e:?}"))?;
    Ok((p.stored_values(), p.num_nodes()))
}

// ---------------------------------------------------------------- conversion

type At<'x> = &'x dyn Fn() -> String;

struct Converter<'a> {
    file: &'a str,
    limits: &'a ReadLimits,
    p: &'a Pickle,
    frames: FrameTable,
    /// `frames` list node → its stack.
    stack_of: HashMap<u32, StackId>,
    /// Frame dict node → its frame.
    frame_of: HashMap<u32, FrameId>,
    /// Scratch for a stack's frame ids.
    ids: Vec<FrameId>,
}

fn kind(p: &Pickle, v: Value) -> &'static str {
    match v {
        Value::None => "None",
        Value::Bool(_) => "a bool",
        Value::Int(_) | Value::UInt(_) | Value::BigInt => "an integer",
        Value::Float(_) => "a float",
        Value::Node(id) => match p.node(id) {
            Node::Str(_) => "a string",
            Node::Bytes => "bytes",
            Node::List(_) => "a list",
            Node::Tuple(_) => "a tuple",
            Node::Dict(_) => "a dict",
            Node::Forward(_) | Node::SameAs(_) => "a forward",
        },
    }
}

/// The fields of a dict this reader looks at, by key; later keys win, as in Python.
fn fields<'p, const N: usize>(
    p: &'p Pickle,
    pairs: &'p [(Value, Value)],
    names: [&str; N],
) -> [Option<Value>; N] {
    let mut out = [None; N];
    for &(k, v) in pairs {
        let Value::Node(id) = k else { continue };
        let Node::Str(key) = p.node(id) else { continue };
        if let Some(i) = names.iter().position(|n| **n == **key) {
            // None reads as absent (an Option field PyTorch left empty).
            out[i] = if matches!(v, Value::None) {
                None
            } else {
                Some(v)
            };
        }
    }
    out
}

impl<'a> Converter<'a> {
    fn new(file: &'a str, limits: &'a ReadLimits, p: &'a Pickle) -> Self {
        Converter {
            file,
            limits,
            p,
            frames: FrameTable::default(),
            stack_of: HashMap::new(),
            frame_of: HashMap::new(),
            ids: Vec::new(),
        }
    }

    fn absurd(&self, at: impl Into<String>, reason: impl Into<String>) -> SnapshotError {
        SnapshotError::Absurd {
            file: self.file.to_string(),
            at: at.into(),
            reason: reason.into(),
        }
    }

    fn not_snapshot(&self, reason: impl Into<String>) -> SnapshotError {
        SnapshotError::NotSnapshot {
            file: self.file.to_string(),
            reason: reason.into(),
        }
    }

    fn wrong(&self, v: Value, expected: &str, at: At) -> SnapshotError {
        let place = at();
        let place = if place.is_empty() {
            "the top level".to_string()
        } else {
            place
        };
        self.not_snapshot(format!(
            "{place}: expected {expected}, found {}",
            kind(self.p, v)
        ))
    }

    fn missing(&self, at: At) -> SnapshotError {
        self.not_snapshot(format!("{}: missing", at()))
    }

    fn dict(&self, v: Value, at: At) -> Result<&'a [(Value, Value)], SnapshotError> {
        if let Value::Node(id) = v
            && let Node::Dict(pairs) = self.p.node(id)
        {
            return Ok(pairs);
        }
        Err(self.wrong(v, "a dict", at))
    }

    fn seq(&self, v: Value, at: At) -> Result<&'a [Value], SnapshotError> {
        if let Value::Node(id) = v {
            match self.p.node(id) {
                Node::List(items) => return Ok(items),
                Node::Tuple(items) => return Ok(items),
                _ => {}
            }
        }
        Err(self.wrong(v, "a list", at))
    }

    fn str(&self, v: Value, at: At) -> Result<&'a str, SnapshotError> {
        if let Value::Node(id) = v
            && let Node::Str(s) = self.p.node(id)
        {
            return Ok(s);
        }
        Err(self.wrong(v, "a string", at))
    }

    fn int(&self, v: Value, at: At) -> Result<i64, SnapshotError> {
        match v {
            Value::Int(i) => Ok(i),
            Value::UInt(_) | Value::BigInt => {
                Err(self.absurd(at(), "an integer wider than 64 bits"))
            }
            _ => Err(self.wrong(v, "an integer", at)),
        }
    }

    fn opt_int(&self, v: Option<Value>, at: At) -> Result<Option<i64>, SnapshotError> {
        v.map(|v| self.int(v, at)).transpose()
    }

    fn bool(&self, v: Option<Value>, at: At) -> Result<bool, SnapshotError> {
        match v {
            None => Ok(false),
            Some(Value::Bool(b)) => Ok(b),
            Some(Value::Int(i)) => Ok(i != 0),
            Some(v) => Err(self.wrong(v, "a bool", at)),
        }
    }

    /// A size: 0 ≤ v ≤ 2^60.
    fn size(&self, v: i64, at: At) -> Result<u64, SnapshotError> {
        if v < 0 {
            return Err(self.absurd(at(), format!("negative size {v}")));
        }
        let v = v as u64;
        if v > MAX_SIZE {
            return Err(self.absurd(at(), format!("size {v} is above 2^60 bytes")));
        }
        Ok(v)
    }

    /// An address or stream: non-negative.
    fn unsigned(&self, v: i64, what: &str, at: At) -> Result<u64, SnapshotError> {
        u64::try_from(v).map_err(|_| self.absurd(at(), format!("negative {what} {v}")))
    }

    fn device(&self, v: i64, at: At) -> Result<usize, SnapshotError> {
        match usize::try_from(v) {
            Ok(d) if d < self.limits.max_devices => Ok(d),
            _ => Err(self.absurd(
                at(),
                format!("device {v} is outside 0..{}", self.limits.max_devices),
            )),
        }
    }

    fn snapshot(mut self) -> Result<Snapshot, SnapshotError> {
        let root = self.dict(self.p.root(), &String::new)?;
        let [segments, traces, settings] = fields(
            self.p,
            root,
            ["segments", "device_traces", "allocator_settings"],
        );
        let segments_at = || "segments".to_string();
        let segments = segments.ok_or_else(|| self.missing(&segments_at))?;
        let segments = self.seq(segments, &segments_at)?;
        let traces_at = || "device_traces".to_string();
        let traces = traces.ok_or_else(|| self.missing(&traces_at))?;
        let traces = self.seq(traces, &traces_at)?;
        if traces.len() > self.limits.max_devices {
            return Err(self.absurd(
                "device_traces",
                format!(
                    "{} devices, more than the limit of {}",
                    traces.len(),
                    self.limits.max_devices
                ),
            ));
        }
        let mut out_segments = Vec::with_capacity(segments.len());
        for (i, &seg) in segments.iter().enumerate() {
            out_segments.push(self.segment(i, seg)?);
        }
        let mut out_traces = Vec::with_capacity(traces.len());
        for (device, &entries) in traces.iter().enumerate() {
            let entries = self.seq(entries, &|| format!("device_traces[{device}]"))?;
            let mut out = Vec::with_capacity(entries.len());
            for (j, &e) in entries.iter().enumerate() {
                out.push(self.entry(device, j, e)?);
            }
            out_traces.push(DeviceTrace {
                device,
                entries: out,
            });
        }
        let allocator_settings = match settings {
            Some(s) => Some(self.settings(s)?),
            None => None,
        };
        Ok(Snapshot {
            segments: out_segments,
            traces: out_traces,
            allocator_settings,
            frames: self.frames,
        })
    }

    /// The stack of a `frames` value (absent or None: the empty stack).
    fn stack(&mut self, v: Option<Value>, at: At) -> Result<StackId, SnapshotError> {
        let Some(v) = v else {
            return Ok(StackId::EMPTY);
        };
        let node = match v {
            Value::Node(id) => self.p.canonical(id),
            _ => return Err(self.wrong(v, "a list of frames", at)),
        };
        if let Some(&id) = self.stack_of.get(&node) {
            return Ok(id);
        }
        let items = self.seq(v, at)?;
        let mut ids = std::mem::take(&mut self.ids);
        ids.clear();
        for (k, &f) in items.iter().enumerate() {
            ids.push(self.frame(f, &|| format!("{}[{k}]", at()))?);
        }
        let id = self.frames.intern_stack_ids(&ids);
        self.ids = ids;
        self.stack_of.insert(node, id);
        Ok(id)
    }

    fn frame(&mut self, v: Value, at: At) -> Result<FrameId, SnapshotError> {
        let node = match v {
            Value::Node(id) => self.p.canonical(id),
            _ => return Err(self.wrong(v, "a frame dict", at)),
        };
        if let Some(&id) = self.frame_of.get(&node) {
            return Ok(id);
        }
        let pairs = self.dict(v, at)?;
        let [name, filename, line] = fields(self.p, pairs, ["name", "filename", "line"]);
        let field = |f: &'static str| move || format!("{}.{f}", at());
        let name = self.str(
            name.ok_or_else(|| self.missing(&field("name")))?,
            &field("name"),
        )?;
        let filename = self.str(
            filename.ok_or_else(|| self.missing(&field("filename")))?,
            &field("filename"),
        )?;
        let line = match line {
            // PyTorch 2.11 writes 2^64 - 1 for a frame whose line is unknown.
            Some(Value::UInt(l)) => l,
            line => match self.opt_int(line, &field("line"))? {
                Some(l) => self.unsigned(l, "line", &field("line"))?,
                None => 0,
            },
        };
        let id = self.frames.intern_frame(Frame {
            name: name.to_string(),
            filename: filename.to_string(),
            line,
        });
        self.frame_of.insert(node, id);
        Ok(id)
    }

    fn segment(&mut self, i: usize, v: Value) -> Result<SegmentState, SnapshotError> {
        let pairs = self.dict(v, &|| format!("segments[{i}]"))?;
        let [
            device,
            address,
            total_size,
            allocated_size,
            active_size,
            requested_size,
            stream,
            segment_type,
            is_expandable,
            frames,
            blocks,
            pool_id,
        ] = fields(
            self.p,
            pairs,
            [
                "device",
                "address",
                "total_size",
                "allocated_size",
                "active_size",
                "requested_size",
                "stream",
                "segment_type",
                "is_expandable",
                "frames",
                "blocks",
                "segment_pool_id",
            ],
        );
        let at = |field: &'static str| move || format!("segments[{i}].{field}");
        let req = |v: Option<Value>, field: &'static str| -> Result<Value, SnapshotError> {
            v.ok_or_else(|| self.missing(&at(field)))
        };
        let segment_type =
            match self.str(req(segment_type, "segment_type")?, &at("segment_type"))? {
                "small" => SegmentType::Small,
                "large" => SegmentType::Large,
                other => {
                    return Err(self.not_snapshot(format!(
                        "segments[{i}].segment_type: {other:?} is neither 'small' nor 'large'"
                    )));
                }
            };
        let address = self.int(req(address, "address")?, &at("address"))?;
        let address = self.unsigned(address, "address", &at("address"))?;
        let total_size = self.int(req(total_size, "total_size")?, &at("total_size"))?;
        let total_size = self.size(total_size, &at("total_size"))?;
        let opt_size = |v: Option<Value>, field: &'static str| -> Result<u64, SnapshotError> {
            match self.opt_int(v, &at(field))? {
                Some(v) => self.size(v, &at(field)),
                None => Ok(0),
            }
        };
        let allocated_size = opt_size(allocated_size, "allocated_size")?;
        let active_size = opt_size(active_size, "active_size")?;
        let requested_size = opt_size(requested_size, "requested_size")?;
        let device = match self.opt_int(device, &at("device"))? {
            Some(d) => self.device(d, &at("device"))?,
            None => 0,
        };
        let stream = self.int(req(stream, "stream")?, &at("stream"))?;
        let stream = self.unsigned(stream, "stream", &at("stream"))?;
        let is_expandable = self.bool(is_expandable, &at("is_expandable"))?;
        let pool_id = match pool_id {
            None | Some(Value::None) => (0, 0),
            Some(v) => {
                let parts = self.seq(v, &at("segment_pool_id"))?;
                let [a, b] = parts[..] else {
                    return Err(self.absurd(
                        at("segment_pool_id")(),
                        format!("a pool id of {} parts (two expected)", parts.len()),
                    ));
                };
                let part = |v: Value| -> Result<u64, SnapshotError> {
                    match v {
                        Value::UInt(u) => Ok(u),
                        v => {
                            let i = self.int(v, &at("segment_pool_id"))?;
                            self.unsigned(i, "segment_pool_id", &at("segment_pool_id"))
                        }
                    }
                };
                (part(a)?, part(b)?)
            }
        };
        let blocks = self.seq(req(blocks, "blocks")?, &at("blocks"))?;
        let stack = self.stack(frames, &at("frames"))?;
        let mut out_blocks = Vec::with_capacity(blocks.len());
        let mut offset: u64 = 0;
        for (j, &b) in blocks.iter().enumerate() {
            let block = self.block(i, j, b, address.saturating_add(offset))?;
            offset = offset.saturating_add(block.size);
            out_blocks.push(block);
        }
        if offset != total_size {
            return Err(self.absurd(
                at("blocks")(),
                format!("the blocks cover {offset} bytes of a {total_size}-byte segment"),
            ));
        }
        Ok(SegmentState {
            device,
            address,
            total_size,
            allocated_size,
            active_size,
            requested_size,
            stream,
            segment_type,
            is_expandable,
            pool_id,
            blocks: out_blocks,
            stack,
        })
    }

    fn block(
        &mut self,
        i: usize,
        j: usize,
        v: Value,
        default_address: u64,
    ) -> Result<BlockState, SnapshotError> {
        let pairs = self.dict(v, &|| format!("segments[{i}].blocks[{j}]"))?;
        let [address, size, requested_size, state, frames] = fields(
            self.p,
            pairs,
            ["address", "size", "requested_size", "state", "frames"],
        );
        let at = |field: &'static str| move || format!("segments[{i}].blocks[{j}].{field}");
        let size = self.int(size.ok_or_else(|| self.missing(&at("size")))?, &at("size"))?;
        let size = self.size(size, &at("size"))?;
        let requested_size = match self.opt_int(requested_size, &at("requested_size"))? {
            Some(v) => self.size(v, &at("requested_size"))?,
            None => size,
        };
        let address = match self.opt_int(address, &at("address"))? {
            Some(a) => self.unsigned(a, "address", &at("address"))?,
            None => default_address,
        };
        let state = self.str(
            state.ok_or_else(|| self.missing(&at("state")))?,
            &at("state"),
        )?;
        let state = match state {
            "active_allocated" => BlockStatus::ActiveAllocated,
            "active_pending_free" | "active_awaiting_free" => BlockStatus::ActivePendingFree,
            "inactive" => BlockStatus::Inactive,
            other => {
                return Err(self.not_snapshot(format!(
                    "segments[{i}].blocks[{j}].state: unknown block state {other:?}"
                )));
            }
        };
        let stack = self.stack(frames, &at("frames"))?;
        Ok(BlockState {
            address,
            size,
            requested_size,
            state,
            stack,
        })
    }

    fn entry(&mut self, device: usize, j: usize, v: Value) -> Result<TraceEntry, SnapshotError> {
        let pairs = self.dict(v, &|| format!("device_traces[{device}][{j}]"))?;
        let [action, addr, device_free, size, stream, time_us, frames] = fields(
            self.p,
            pairs,
            [
                "action",
                "addr",
                "device_free",
                "size",
                "stream",
                "time_us",
                "frames",
            ],
        );
        let at = |field: &'static str| move || format!("device_traces[{device}][{j}].{field}");
        let name = self.str(
            action.ok_or_else(|| self.missing(&at("action")))?,
            &at("action"),
        )?;
        let action = Action::from_name(name);
        // Memory events must say where and how much; the others may leave fields out.
        let needs_addr = matches!(
            action,
            Action::Alloc
                | Action::FreeRequested
                | Action::FreeCompleted
                | Action::SegmentAlloc
                | Action::SegmentFree
                | Action::SegmentMap
                | Action::SegmentUnmap
        );
        let needs_size = needs_addr || action == Action::Oom;
        let missing = |field: &'static str| {
            self.not_snapshot(format!("{}: missing in a '{name}' entry", at(field)()))
        };
        let addr = if action == Action::Oom {
            let free = self.opt_int(device_free, &at("device_free"))?;
            let free = match free {
                Some(v) => Some(v),
                None => self.opt_int(addr, &at("addr"))?,
            };
            match free {
                Some(v) => self.unsigned(v, "device_free", &at("device_free"))?,
                None => 0,
            }
        } else {
            match self.opt_int(addr, &at("addr"))? {
                Some(v) => self.unsigned(v, "address", &at("addr"))?,
                None if needs_addr => return Err(missing("addr")),
                None => 0,
            }
        };
        let size = match self.opt_int(size, &at("size"))? {
            Some(v) => self.size(v, &at("size"))?,
            None if needs_size => return Err(missing("size")),
            None => 0,
        };
        let stream = match self.opt_int(stream, &at("stream"))? {
            Some(v) => self.unsigned(v, "stream", &at("stream"))?,
            None => 0,
        };
        let time_us = self.opt_int(time_us, &at("time_us"))?.unwrap_or(0);
        let stack = self.stack(frames, &at("frames"))?;
        Ok(TraceEntry {
            action,
            addr,
            size,
            stream,
            time_us,
            stack,
        })
    }

    fn settings(&self, v: Value) -> Result<AllocatorSettings, SnapshotError> {
        let pairs = self.dict(v, &|| "allocator_settings".to_string())?;
        let [alloc_conf, max_split_size, gc, expandable, divisions] = fields(
            self.p,
            pairs,
            [
                "PYTORCH_CUDA_ALLOC_CONF",
                "max_split_size",
                "garbage_collection_threshold",
                "expandable_segments",
                "roundup_power2_divisions",
            ],
        );
        let at = |field: &'static str| move || format!("allocator_settings.{field}");
        let alloc_conf = match alloc_conf {
            Some(v) => self.str(v, &at("PYTORCH_CUDA_ALLOC_CONF"))?.to_string(),
            None => String::new(),
        };
        let max_split_size = match self.opt_int(max_split_size, &at("max_split_size"))? {
            None => None,
            Some(v) if v < 0 => None,
            Some(v) => Some(self.size(v, &at("max_split_size"))?),
        };
        let mut out: Vec<(u64, u64)> = Vec::new();
        if let Some(d) = divisions {
            let d = self.dict(d, &at("roundup_power2_divisions"))?;
            // Python dict keys are unique; a pickle can repeat one, and the last one wins.
            let mut by_key: std::collections::BTreeMap<&str, Value> = Default::default();
            for &(k, v) in d {
                let key = self.str(k, &|| {
                    "allocator_settings.roundup_power2_divisions key".into()
                })?;
                by_key.insert(key, v);
            }
            for (key, v) in by_key {
                let at = || format!("allocator_settings.roundup_power2_divisions[{key:?}]");
                let k: u64 = key
                    .parse()
                    .map_err(|_| self.not_snapshot(format!("{}: the key is not a number", at())))?;
                let v = self.int(v, &at)?;
                let v = self.unsigned(v, "division count", &at)?;
                out.push((k, v));
            }
        }
        out.sort_unstable();
        let garbage_collection_threshold = match gc {
            None => 0.0,
            Some(Value::Float(f)) => f,
            Some(Value::Int(i)) => i as f64,
            Some(v) => return Err(self.wrong(v, "a float", &at("garbage_collection_threshold"))),
        };
        // PyTorch accepts only 0 (off) or a value in (0, 1); anything else (a NaN included) is
        // not a snapshot PyTorch wrote.
        if !(0.0..1.0).contains(&garbage_collection_threshold) {
            return Err(self.absurd(
                "allocator_settings.garbage_collection_threshold",
                format!("{garbage_collection_threshold} is not in [0, 1)"),
            ));
        }
        Ok(AllocatorSettings {
            alloc_conf,
            max_split_size,
            garbage_collection_threshold,
            expandable_segments: self.bool(expandable, &at("expandable_segments"))?,
            roundup_power2_divisions: out.into_iter().map(|(_, v)| v).collect(),
        })
    }
}

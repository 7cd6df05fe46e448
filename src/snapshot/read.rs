//! Reading snapshots: file → bytes (gzip undone) → structural check → `serde-pickle` into raw
//! structs → validation into [`Snapshot`].

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

use serde::Deserialize;

use super::guard::{self, GuardError};
use super::{
    Action, AllocatorSettings, BlockState, BlockStatus, DeviceTrace, MAX_SIZE, SegmentState,
    SegmentType, Snapshot, SnapshotError, TraceEntry,
};

/// Bounds on what the reader accepts, so that a hostile or corrupt file costs bounded memory
/// and time. The defaults take real snapshots of a million trace entries without stacks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadLimits {
    /// Largest input in bytes, after gzip decompression (default 1 GiB).
    pub max_input_bytes: u64,
    /// Most pickle values decoding may build or reach, memo references expanded (default
    /// 2^25). Decoding costs about 100 bytes of memory per value at most; a snapshot without
    /// stack frames has about 15 values per trace entry, and one with frames many more (raise
    /// this limit for those).
    pub max_values: u64,
    /// Deepest nesting of values (default 32; a snapshot nests 7 deep).
    pub max_depth: u32,
    /// Most devices (`device_traces` entries, `device` of a segment) accepted (default 1024).
    pub max_devices: usize,
}

impl Default for ReadLimits {
    fn default() -> Self {
        ReadLimits {
            max_input_bytes: 1 << 30,
            max_values: 1 << 25,
            max_depth: 32,
            max_devices: 1024,
        }
    }
}

/// Reads a snapshot file written by `torch.cuda.memory._dump_snapshot()` (or by
/// [`write_snapshot`](super::write_snapshot)), plain or gzip-compressed, with the default
/// [`ReadLimits`].
pub fn read_snapshot(path: &Path) -> Result<Snapshot, SnapshotError> {
    read_snapshot_with_limits(path, &ReadLimits::default())
}

/// [`read_snapshot`] with explicit limits.
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
    let mut bytes = Vec::new();
    file.take(limits.max_input_bytes.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(io)?;
    if bytes.len() as u64 > limits.max_input_bytes {
        return Err(SnapshotError::TooLarge {
            file: name,
            reason: format!("the file is larger than {} bytes", limits.max_input_bytes),
        });
    }
    parse_named(&bytes, &name, limits)
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
    parse_named(bytes, "<bytes>", limits)
}

fn parse_named(bytes: &[u8], name: &str, limits: &ReadLimits) -> Result<Snapshot, SnapshotError> {
    let file = || name.to_string();
    let decompressed;
    let pickle = if bytes.starts_with(&[0x1f, 0x8b]) {
        decompressed = gunzip(bytes, name, limits)?;
        &decompressed[..]
    } else {
        bytes
    };
    if pickle.len() as u64 > limits.max_input_bytes {
        return Err(SnapshotError::TooLarge {
            file: file(),
            reason: format!("the input is larger than {} bytes", limits.max_input_bytes),
        });
    }
    guard::check(pickle, limits).map_err(|e| match e {
        GuardError::NotPickle(reason) => SnapshotError::NotPickle {
            file: file(),
            reason,
        },
        GuardError::Truncated(reason) => SnapshotError::Truncated {
            file: file(),
            reason,
        },
        GuardError::TooLarge(reason) => SnapshotError::TooLarge {
            file: file(),
            reason,
        },
    })?;
    let raw = decode(pickle, name)?;
    Validator { file: name, limits }.snapshot(raw)
}

fn gunzip(bytes: &[u8], name: &str, limits: &ReadLimits) -> Result<Vec<u8>, SnapshotError> {
    let mut out = Vec::new();
    let decoder = flate2::read::MultiGzDecoder::new(bytes);
    match decoder
        .take(limits.max_input_bytes.saturating_add(1))
        .read_to_end(&mut out)
    {
        Ok(_) if out.len() as u64 > limits.max_input_bytes => Err(SnapshotError::TooLarge {
            file: name.to_string(),
            reason: format!(
                "it decompresses to more than {} bytes",
                limits.max_input_bytes
            ),
        }),
        Ok(_) => Ok(out),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Err(SnapshotError::Truncated {
            file: name.to_string(),
            reason: "the gzip stream ends early".into(),
        }),
        Err(e) => Err(SnapshotError::NotPickle {
            file: name.to_string(),
            reason: format!("gzip magic bytes, but not a valid gzip stream: {e}"),
        }),
    }
}

fn decode(pickle: &[u8], name: &str) -> Result<RawSnapshot, SnapshotError> {
    let mut de = serde_pickle::Deserializer::new(pickle, serde_pickle::DeOptions::new());
    let raw: RawSnapshot = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        classify(inner, name, &path)
    })?;
    de.end().map_err(|e| classify(e, name, "."))?;
    Ok(raw)
}

fn classify(e: serde_pickle::Error, name: &str, path: &str) -> SnapshotError {
    use serde_pickle::ErrorCode;
    let file = name.to_string();
    let at = if path == "." {
        String::new()
    } else {
        format!("{path}: ")
    };
    match e {
        serde_pickle::Error::Io(source) => SnapshotError::Io { file, source },
        serde_pickle::Error::Eval(ErrorCode::EOFWhileParsing, _)
        | serde_pickle::Error::Syntax(ErrorCode::EOFWhileParsing) => SnapshotError::Truncated {
            file,
            reason: e.to_string(),
        },
        serde_pickle::Error::Syntax(ErrorCode::InvalidValue(ref v)) if v.contains("too large") => {
            SnapshotError::Absurd {
                file,
                at: if path == "." {
                    "top level".into()
                } else {
                    path.to_string()
                },
                reason: "an integer wider than 64 bits".into(),
            }
        }
        serde_pickle::Error::Syntax(ErrorCode::Structure(ref msg)) => SnapshotError::NotSnapshot {
            file,
            reason: format!("{at}{msg}"),
        },
        serde_pickle::Error::Syntax(ref code) | serde_pickle::Error::Eval(ref code, _) => {
            match code {
                ErrorCode::Structure(_) | ErrorCode::InvalidValue(_) => {
                    SnapshotError::NotSnapshot {
                        file,
                        reason: format!("{at}{e}"),
                    }
                }
                _ => SnapshotError::NotPickle {
                    file,
                    reason: format!("{at}{e}"),
                },
            }
        }
    }
}

// ---------------------------------------------------------------- raw (as pickled)

#[derive(Deserialize)]
struct RawSnapshot {
    segments: Vec<RawSegment>,
    device_traces: Vec<Vec<RawEntry>>,
    #[serde(default)]
    allocator_settings: Option<RawSettings>,
}

#[derive(Deserialize)]
struct RawSegment {
    #[serde(default)]
    device: Option<i64>,
    address: i64,
    total_size: i64,
    #[serde(default)]
    allocated_size: Option<i64>,
    #[serde(default)]
    active_size: Option<i64>,
    #[serde(default)]
    requested_size: Option<i64>,
    stream: i64,
    segment_type: String,
    #[serde(default)]
    is_expandable: Option<bool>,
    blocks: Vec<RawBlock>,
}

#[derive(Deserialize)]
struct RawBlock {
    #[serde(default)]
    address: Option<i64>,
    size: i64,
    #[serde(default)]
    requested_size: Option<i64>,
    state: String,
}

#[derive(Deserialize)]
struct RawEntry {
    action: String,
    #[serde(default)]
    addr: Option<i64>,
    #[serde(default)]
    device_free: Option<i64>,
    #[serde(default)]
    size: Option<i64>,
    #[serde(default)]
    stream: Option<i64>,
    #[serde(default)]
    time_us: Option<i64>,
}

#[derive(Deserialize)]
struct RawSettings {
    #[serde(rename = "PYTORCH_CUDA_ALLOC_CONF", default)]
    alloc_conf: Option<String>,
    #[serde(default)]
    max_split_size: Option<i64>,
    #[serde(default)]
    garbage_collection_threshold: Option<f64>,
    #[serde(default)]
    expandable_segments: Option<bool>,
    #[serde(default)]
    roundup_power2_divisions: Option<BTreeMap<String, i64>>,
}

// ---------------------------------------------------------------- validation

struct Validator<'a> {
    file: &'a str,
    limits: &'a ReadLimits,
}

impl Validator<'_> {
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

    /// A size: 0 ≤ v ≤ 2^60.
    fn size(&self, v: i64, at: impl Fn() -> String) -> Result<u64, SnapshotError> {
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
    fn unsigned(&self, v: i64, what: &str, at: impl Fn() -> String) -> Result<u64, SnapshotError> {
        u64::try_from(v).map_err(|_| self.absurd(at(), format!("negative {what} {v}")))
    }

    fn device(&self, v: i64, at: impl Fn() -> String) -> Result<usize, SnapshotError> {
        match usize::try_from(v) {
            Ok(d) if d < self.limits.max_devices => Ok(d),
            _ => Err(self.absurd(
                at(),
                format!("device {v} is outside 0..{}", self.limits.max_devices),
            )),
        }
    }

    fn snapshot(&self, raw: RawSnapshot) -> Result<Snapshot, SnapshotError> {
        if raw.device_traces.len() > self.limits.max_devices {
            return Err(self.absurd(
                "device_traces",
                format!(
                    "{} devices, more than the limit of {}",
                    raw.device_traces.len(),
                    self.limits.max_devices
                ),
            ));
        }
        let mut segments = Vec::with_capacity(raw.segments.len());
        for (i, seg) in raw.segments.into_iter().enumerate() {
            segments.push(self.segment(i, seg)?);
        }
        let mut traces = Vec::with_capacity(raw.device_traces.len());
        for (device, entries) in raw.device_traces.into_iter().enumerate() {
            let mut out = Vec::with_capacity(entries.len());
            for (j, e) in entries.into_iter().enumerate() {
                out.push(self.entry(device, j, e)?);
            }
            traces.push(DeviceTrace {
                device,
                entries: out,
            });
        }
        let allocator_settings = match raw.allocator_settings {
            Some(s) => Some(self.settings(s)?),
            None => None,
        };
        Ok(Snapshot {
            segments,
            traces,
            allocator_settings,
        })
    }

    fn segment(&self, i: usize, s: RawSegment) -> Result<SegmentState, SnapshotError> {
        let at = |field: &str| format!("segments[{i}].{field}");
        let segment_type = match s.segment_type.as_str() {
            "small" => SegmentType::Small,
            "large" => SegmentType::Large,
            other => {
                return Err(self.not_snapshot(format!(
                    "{}: {other:?} is neither 'small' nor 'large'",
                    at("segment_type")
                )));
            }
        };
        let address = self.unsigned(s.address, "address", || at("address"))?;
        let total_size = self.size(s.total_size, || at("total_size"))?;
        let opt_size = |v: Option<i64>, field: &str| match v {
            Some(v) => self.size(v, || at(field)),
            None => Ok(0),
        };
        let allocated_size = opt_size(s.allocated_size, "allocated_size")?;
        let active_size = opt_size(s.active_size, "active_size")?;
        let requested_size = opt_size(s.requested_size, "requested_size")?;
        let device = match s.device {
            Some(d) => self.device(d, || at("device"))?,
            None => 0,
        };
        let stream = self.unsigned(s.stream, "stream", || at("stream"))?;
        let mut blocks = Vec::with_capacity(s.blocks.len());
        let mut offset: u64 = 0;
        for (j, b) in s.blocks.into_iter().enumerate() {
            let bat = |field: &str| format!("segments[{i}].blocks[{j}].{field}");
            let size = self.size(b.size, || bat("size"))?;
            let requested_size = match b.requested_size {
                Some(v) => self.size(v, || bat("requested_size"))?,
                None => size,
            };
            let block_address = match b.address {
                Some(a) => self.unsigned(a, "address", || bat("address"))?,
                None => address.saturating_add(offset),
            };
            let state = match b.state.as_str() {
                "active_allocated" => BlockStatus::ActiveAllocated,
                "active_pending_free" | "active_awaiting_free" => BlockStatus::ActivePendingFree,
                "inactive" => BlockStatus::Inactive,
                other => {
                    return Err(self
                        .not_snapshot(format!("{}: unknown block state {other:?}", bat("state"))));
                }
            };
            offset = offset.saturating_add(size);
            blocks.push(BlockState {
                address: block_address,
                size,
                requested_size,
                state,
            });
        }
        if offset != total_size {
            return Err(self.absurd(
                at("blocks"),
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
            is_expandable: s.is_expandable.unwrap_or(false),
            blocks,
        })
    }

    fn entry(&self, device: usize, j: usize, e: RawEntry) -> Result<TraceEntry, SnapshotError> {
        let at = |field: &str| format!("device_traces[{device}][{j}].{field}");
        let action = Action::from_name(&e.action);
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
        let missing = |field: &str| {
            self.not_snapshot(format!("{}: missing in a '{}' entry", at(field), e.action))
        };
        let addr = if action == Action::Oom {
            match e.device_free.or(e.addr) {
                Some(v) => self.unsigned(v, "device_free", || at("device_free"))?,
                None => 0,
            }
        } else {
            match e.addr {
                Some(v) => self.unsigned(v, "address", || at("addr"))?,
                None if needs_addr => return Err(missing("addr")),
                None => 0,
            }
        };
        let size = match e.size {
            Some(v) => self.size(v, || at("size"))?,
            None if needs_size => return Err(missing("size")),
            None => 0,
        };
        let stream = match e.stream {
            Some(v) => self.unsigned(v, "stream", || at("stream"))?,
            None => 0,
        };
        Ok(TraceEntry {
            action,
            addr,
            size,
            stream,
            time_us: e.time_us.unwrap_or(0),
        })
    }

    fn settings(&self, s: RawSettings) -> Result<AllocatorSettings, SnapshotError> {
        let max_split_size = match s.max_split_size {
            None => None,
            Some(v) if v < 0 => None,
            Some(v) => Some(self.size(v, || "allocator_settings.max_split_size".into())?),
        };
        let mut divisions: Vec<(u64, u64)> = Vec::new();
        for (key, v) in s.roundup_power2_divisions.unwrap_or_default() {
            let at = || format!("allocator_settings.roundup_power2_divisions[{key:?}]");
            let k: u64 = key
                .parse()
                .map_err(|_| self.not_snapshot(format!("{}: the key is not a number", at())))?;
            let v = self.unsigned(v, "division count", at)?;
            divisions.push((k, v));
        }
        divisions.sort_unstable();
        let garbage_collection_threshold = s.garbage_collection_threshold.unwrap_or(0.0);
        // PyTorch accepts only 0 (off) or a value in (0, 1); anything else (a NaN included) is
        // not a snapshot PyTorch wrote.
        if !(0.0..1.0).contains(&garbage_collection_threshold) {
            return Err(self.absurd(
                "allocator_settings.garbage_collection_threshold",
                format!("{garbage_collection_threshold} is not in [0, 1)"),
            ));
        }
        Ok(AllocatorSettings {
            alloc_conf: s.alloc_conf.unwrap_or_default(),
            max_split_size,
            garbage_collection_threshold,
            expandable_segments: s.expandable_segments.unwrap_or(false),
            roundup_power2_divisions: divisions.into_iter().map(|(_, v)| v).collect(),
        })
    }
}

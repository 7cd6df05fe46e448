//! What `cachalot replay` reports beside the figures: the start it replayed from, the
//! self-check and the causes it names, the frees nothing in the replay explains, and PyTorch's
//! own figures from the snapshot's sidecar. `replay.rs` runs the replay and prints; this file
//! builds these parts of its report from the trace, the settings and the outcome.

use super::input::Trace;
use cachalot_tools::find_fraction::trace_device_frees;
use cachalot_tools::replay::{ReplayConfig, ReplayOutcome, StartMode};
use cachalot_tools::selfcheck::SelfCheck;
use cachalot_tools::snapshot::Figures;
use cachalot_tools::units::{grouped, human};
use serde::Serialize;

/// The state when the trace's recording began, as the report gives it.
#[derive(Debug, Serialize)]
pub struct StartReport {
    /// `fresh` (nothing held: recorded from the process's start, or from an empty cache),
    /// `reconstructed` (segments were held; rebuilt from the dump), or `unknown` (could not
    /// be rebuilt).
    pub state: &'static str,
    /// What the replay started from: `exact`, `live_tensors` or `empty`.
    pub replayed_from: StartMode,
    /// Segments held at the start.
    pub segments: usize,
    /// Reserved bytes at the start.
    pub reserved_bytes: u64,
    /// Tensors live (or pending on another stream) at the start.
    pub live_tensors: usize,
    /// Their requested bytes.
    pub live_requested_bytes: u64,
    /// Why the start could not be reconstructed (`unknown` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Frees in the trace of blocks the replay never saw allocated (dropped).
    pub dropped_frees: usize,
}

/// The self-check as the report gives it.
#[derive(Debug, Serialize)]
pub struct SelfCheckReport {
    /// Whether the check applies: the replay ran the recorded settings from the exact start
    /// (or a fresh one) on the simulated device.
    pub applies: bool,
    /// The comparison itself.
    #[serde(flatten)]
    pub check: SelfCheck,
    /// What in the trace or the dump the replay does not model, in a PyTorch user's words:
    /// the likely causes of a difference (empty when nothing is known to be missing).
    pub causes: Vec<String>,
    /// Whether the state when recording began was rebuilt (or nothing was held).
    pub start_rebuilt: bool,
    /// What the replay inferred from the trace that no entry records (a settings change, a
    /// private pool released before the dump), in a PyTorch user's words.
    pub inferred: Vec<String>,
}

/// What the replay of `trace` inferred that the trace does not record (see
/// [`SelfCheckReport::inferred`]).
pub(super) fn inferred(trace: &Trace) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(c) = &trace.settings_change {
        let conf = |s: &str| {
            if s.is_empty() {
                "PyTorch's defaults".to_string()
            } else {
                format!("\"{s}\"")
            }
        };
        let at = if c.first_entry == c.last_entry {
            format!("trace entry {}", c.first_entry)
        } else {
            format!(
                "trace entry ~{} (any of entries {}..={} reproduces the trace)",
                c.first_entry, c.first_entry, c.last_entry
            )
        };
        let how = if c.replays == 0 {
            "given with --settings-at".to_string()
        } else {
            format!("found in {} replays", c.replays)
        };
        out.push(format!(
            "settings changed at run time: at {at}, from {} to {} \
             (torch.cuda.memory._set_allocator_settings; {how})",
            conf(&c.from),
            conf(&c.to),
        ));
    }
    let mut dumped: Vec<(u64, u64)> = trace
        .snapshot
        .segments
        .iter()
        .filter(|s| s.device == trace.device && s.pool_id != (0, 0))
        .map(|s| s.pool_id)
        .collect();
    dumped.sort_unstable();
    dumped.dedup();
    for p in &trace.program.inferred_pools {
        let which = match dumped.get(p.pool) {
            Some(id) => format!("the dump's pool {id:?}, whose allocations they interleave with"),
            None => "a pool of its own".to_string(),
        };
        out.push(format!(
            "private pool released at trace entry {}: {} segments ({} B) given back with no \
             empty_cache() while a default segment stayed cached, as torch.cuda.MemPool's \
             deletion does; their {} allocations were replayed in {which}",
            p.entry,
            p.segments,
            grouped(p.bytes),
            p.allocations,
        ));
    }
    out
}

/// Device frees in the trace that the replay does not make.
#[derive(Debug, Serialize)]
pub struct UnexplainedFrees {
    /// `segment_free` / `segment_unmap` entries in the trace.
    pub trace_frees: u64,
    /// Segments the replay gave back.
    pub replay_frees: u64,
    /// The smallest memory-fraction cap (bytes) under which the replay gives back the same
    /// segments and ends in the dump, when the search found one.
    pub found_cap_bytes: Option<u64>,
    /// That cap as a fraction of the device's memory (`--memory-fraction`).
    pub found_fraction: Option<f64>,
    /// The device memory the fraction is of.
    pub device_total_bytes: u64,
}

/// PyTorch's figures for the recorded run, from the trace's NAME.json.
#[derive(Debug, Serialize)]
pub struct PytorchFigures {
    /// `torch.__version__`.
    pub pytorch_version: String,
    /// The recording GPU.
    pub pytorch_gpu_name: String,
    /// `max_memory_allocated()`.
    pub pytorch_peak_allocated_bytes: u64,
    /// `max_memory_reserved()`.
    pub pytorch_peak_reserved_bytes: u64,
    /// `segment.all.peak`.
    pub pytorch_peak_segments: Option<i64>,
    /// `num_device_alloc`.
    pub pytorch_device_allocs: Option<i64>,
    /// `num_device_free`.
    pub pytorch_device_frees: Option<i64>,
    /// `num_ooms`.
    pub pytorch_ooms: Option<i64>,
    /// Whether all of the above equal cachalot's.
    pub pytorch_matches: bool,
    /// The figures that differ, as "what: cachalot X, PyTorch Y".
    pub pytorch_differences: Vec<String>,
    /// The figures compared: PyTorch's peaks only when they count from the trace's start,
    /// its counters only when the recording began with the process.
    pub pytorch_compared: Vec<String>,
}

impl PytorchFigures {
    /// `value`, marked when PyTorch's figure covers another window than the trace.
    pub(super) fn mark(&self, what: &str, value: String) -> String {
        if self.pytorch_compared.iter().any(|c| c == what) {
            value
        } else {
            format!("{value} (another window)")
        }
    }

    pub(super) fn new(f: &Figures, out: &ReplayOutcome) -> PytorchFigures {
        let checks: [(&str, i128, Option<i64>); 6] = [
            (
                "peak reserved",
                out.peak_reserved_bytes.into(),
                i64::try_from(f.max_memory_reserved).ok(),
            ),
            (
                "peak allocated",
                out.peak_allocated_bytes.into(),
                i64::try_from(f.max_memory_allocated).ok(),
            ),
            (
                "peak segments",
                out.peak_segments.into(),
                f.stat("segment.all.peak"),
            ),
            (
                "device allocs",
                out.device_allocs.into(),
                f.stat("num_device_alloc"),
            ),
            (
                "device frees",
                out.device_frees.into(),
                f.stat("num_device_free"),
            ),
            ("ooms", out.ooms.into(), f.stat("num_ooms")),
        ];
        // PyTorch's cumulative counters count from the process's start, its peaks from their
        // last reset: compare only what covers the same window as the trace.
        let whole = f.recorded_from_the_start();
        let peaks = f.reset_after.is_none();
        let comparable = |what: &str| match what {
            "peak reserved" | "peak allocated" => peaks,
            _ => whole && peaks,
        };
        let compared: Vec<String> = checks
            .iter()
            .filter(|&&(what, _, theirs)| comparable(what) && theirs.is_some())
            .map(|&(what, _, _)| what.to_string())
            .collect();
        let differences: Vec<String> = checks
            .iter()
            .filter(|&&(what, _, _)| comparable(what))
            .filter_map(|&(what, ours, theirs)| {
                let theirs = theirs?;
                (ours != i128::from(theirs))
                    .then(|| format!("{what}: cachalot {ours}, PyTorch {theirs}"))
            })
            .collect();
        PytorchFigures {
            pytorch_version: f.torch_version.clone(),
            pytorch_gpu_name: f.gpu_name.clone(),
            pytorch_peak_allocated_bytes: f.max_memory_allocated,
            pytorch_peak_reserved_bytes: f.max_memory_reserved,
            pytorch_peak_segments: f.stat("segment.all.peak"),
            pytorch_device_allocs: f.stat("num_device_alloc"),
            pytorch_device_frees: f.stat("num_device_free"),
            pytorch_ooms: f.stat("num_ooms"),
            pytorch_matches: differences.is_empty(),
            pytorch_differences: differences,
            pytorch_compared: compared,
        }
    }
}

/// What the replay of `trace` is known not to model, in a PyTorch user's words (see
/// [`SelfCheckReport::causes`]).
pub(super) fn causes(trace: &Trace, config: &ReplayConfig, out: &ReplayOutcome) -> Vec<String> {
    let mut causes = Vec::new();
    let dump: Vec<_> = trace
        .snapshot
        .segments
        .iter()
        .filter(|s| s.device == trace.device)
        .collect();
    if let Err(e) = &trace.start {
        causes.push(format!(
            "the state when recording began was not rebuilt ({e}), so the replay started from \
             an empty allocator and misses what the process held then"
        ));
    }
    if let Some(hint) = &trace.settings_hint {
        causes.push(hint.clone());
    }
    let private = dump.iter().filter(|s| s.pool_id != (0, 0)).count();
    if private > 0 && !trace.program.inferred_pools.is_empty() {
        causes.push(format!(
            "private pools: {private} dumped segments belong to CUDA graphs' or \
             torch.cuda.MemPool's pools, and a pool released before the dump was inferred from \
             the trace; all are replayed in pools of their own; empty_cache() while a graph \
             lives keeps its pool in PyTorch but not in the replay"
        ));
    } else if private > 0 {
        causes.push(format!(
            "private pools: {private} dumped segments belong to CUDA graphs' or \
             torch.cuda.MemPool's pools. Their blocks are replayed in pools of their own, but a \
             private pool's segments freed before the dump (a MemPool deleted, a graph's pool \
             released) are in no dump, so the replay takes their allocations for the default \
             pools'; and empty_cache() while a graph lives keeps its pool in PyTorch"
        ));
    }
    let trace_frees = trace_device_frees(&trace.snapshot, trace.device);
    if trace_frees > out.device_frees && config.settings.per_process_memory_fraction.is_none() {
        causes.push(format!(
            "frees the replay cannot explain: the trace gives back {trace_frees} segments, the \
             replay {} — PyTorch released cached memory with no empty_cache() and no \
             out-of-memory the replay sees: a memory fraction set in the program \
             (torch.cuda.set_per_process_memory_fraction{}) or torch.cuda.empty_cache() called \
             by a library; give the fraction with --memory-fraction",
            out.device_frees,
            if config.settings.garbage_collection_threshold > 0.0 {
                format!(
                    ", whose cap makes garbage_collection_threshold:{} collect",
                    config.settings.garbage_collection_threshold
                )
            } else {
                String::new()
            }
        ));
    }
    if trace.start.as_ref().is_ok_and(|s| !s.is_fresh())
        && config.settings.per_process_memory_fraction.is_some()
        && config.settings.garbage_collection_threshold > 0.0
    {
        causes.push(
            "a garbage collector that started mid-run: it frees the cached segments that waited \
             longest, and how long those cached before recording began had waited is in no dump"
                .to_string(),
        );
    }
    if trace.start.as_ref().is_ok_and(|s| !s.is_fresh())
        && config.settings.max_split_size != u64::MAX
    {
        causes.push(
            "max_split_size_mb with a mid-run start: a tensor at least that large takes a whole \
             cached block, whose size the trace does not say when it was allocated before \
             recording began"
                .to_string(),
        );
    }
    causes
}

pub(super) fn start_report(trace: &Trace, config: &ReplayConfig) -> StartReport {
    let dropped_frees = trace.conversion.unmatched_frees;
    match &trace.start {
        Ok(start) => StartReport {
            state: if start.is_fresh() {
                "fresh"
            } else {
                "reconstructed"
            },
            replayed_from: config.start,
            segments: start.segments.len(),
            reserved_bytes: start.reserved_bytes(),
            live_tensors: start.live_blocks().count(),
            live_requested_bytes: start.live_requested_bytes(),
            reason: None,
            dropped_frees,
        },
        Err(e) => StartReport {
            state: "unknown",
            replayed_from: StartMode::Empty,
            segments: 0,
            reserved_bytes: 0,
            live_tensors: 0,
            live_requested_bytes: 0,
            reason: Some(if trace.snapshot.segments.is_empty() {
                format!("the snapshot holds no segments to walk back from ({e})")
            } else {
                e.to_string()
            }),
            dropped_frees,
        },
    }
}

impl StartReport {
    pub(super) fn human(&self) -> String {
        match self.state {
            "fresh" => {
                "nothing held when recording began (a fresh process or an empty cache)".to_string()
            }
            "reconstructed" => {
                let held = format!(
                    "recording began mid-run: {} segments ({}) held, {} tensors ({}) live; \
                     rebuilt from the dump",
                    grouped(self.segments as u64),
                    human(self.reserved_bytes),
                    grouped(self.live_tensors as u64),
                    human(self.live_requested_bytes)
                );
                match self.replayed_from {
                    StartMode::Exact => {
                        format!("{held}; replayed from that state, block for block")
                    }
                    StartMode::LiveTensors => format!(
                        "{held}; replayed from those tensors alone, placed by these settings \
                         (PyTorch's cached blocks are its own policy's)"
                    ),
                    StartMode::Empty => format!("{held}; replayed from an empty allocator"),
                }
            }
            _ => format!(
                "UNKNOWN — the state when recording began could not be rebuilt: {}. Replayed \
                 from an empty allocator: the figures miss whatever the process held before \
                 recording ({} frees of earlier blocks dropped)",
                self.reason.as_deref().unwrap_or("no reason"),
                grouped(self.dropped_frees as u64)
            ),
        }
    }
}

impl SelfCheckReport {
    pub(super) fn human(&self) -> String {
        let c = &self.check;
        let why = if self.causes.is_empty() {
            "no known cause (a policy difference: please report it)".to_string()
        } else {
            self.causes
                .iter()
                .map(|c| format!("\n             - {c}"))
                .collect::<String>()
        };
        if !self.applies {
            let known = if self.causes.is_empty() {
                String::new()
            } else {
                format!(" Besides:{why}")
            };
            let what = if self.start_rebuilt {
                "these settings or this start are not the recorded ones"
            } else {
                "the replay could not start from the state PyTorch held when recording began"
            };
            return format!(
                "not applicable: {what}, so the replay ends elsewhere ({} segments; PyTorch's \
                 dump: {}).{known}",
                grouped(c.replay_segments as u64),
                grouped(c.dump_segments as u64)
            );
        }
        if c.matches {
            let inferred: String = self
                .inferred
                .iter()
                .map(|i| format!("\n           inferred: {i}"))
                .collect();
            format!(
                "the replay ends in the state PyTorch dumped: {} segments, {} blocks, block for \
                 block{inferred}",
                grouped(c.dump_segments as u64),
                grouped(c.dump_blocks as u64)
            )
        } else {
            format!(
                "DIFFERS from PyTorch's dump ({} of {} segments equal). Likely because:{why}\n           \
                 first difference: {}",
                grouped(c.equal_segments as u64),
                grouped(c.dump_segments as u64),
                c.first_difference.as_deref().unwrap_or("?")
            )
        }
    }
}

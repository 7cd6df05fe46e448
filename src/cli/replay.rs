//! `cachalot replay`: one trace through the allocator, on the simulated device or a GPU, and
//! its report (human or JSON), plot and snapshot.
//!
//! The one rule: every figure printed comes from [`ReplayOutcome`]; the report only formats
//! it, and puts PyTorch's own figures (from the trace's sidecar) beside cachalot's.

use std::fs::File;
use std::io::{BufWriter, IsTerminal, Write};
use std::path::{Path, PathBuf};

use cachalot::Settings;
use cachalot_tools::export::snapshot_of;
use cachalot_tools::find_fraction::{find_cap, trace_device_frees};
use cachalot_tools::replay::recorded_stream;
use cachalot_tools::replay::{ReplayConfig, ReplayOutcome, StartMode, replay_with_progress};
use cachalot_tools::selfcheck::check_final_state;
use cachalot_tools::snapshot::{Snapshot, write_snapshot};
use cachalot_tools::units::{grouped, human};
use clap::ValueEnum;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;

use super::error::CliError;
use super::input::{self, Trace};
use super::replay_report::{
    PytorchFigures, SelfCheckReport, StartReport, UnexplainedFrees, causes, inferred, start_report,
};
use super::{cuda, ops, plot, units};
use cachalot_tools::find_settings::FoundChange;
use cachalot_tools::replay::InferredPool;

/// Where a replay runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendKind {
    /// The simulated device (no GPU needed); it hands out the trace's own segment addresses.
    Sim,
    /// A real CUDA GPU, through cachalot's cudarc backend.
    Cuda,
}

impl BackendKind {
    /// The name printed in reports.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Sim => "sim",
            BackendKind::Cuda => "cuda",
        }
    }
}

/// What a replay of a trace recorded mid-run starts from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum StartArg {
    /// PyTorch's state when recording began, block for block, when the settings are the
    /// recorded ones; the tensors live then, placed by the replayed policy, when they are not.
    #[default]
    Auto,
    /// The tensors live when recording began, allocated in address order before the trace
    /// (the form `--ops-out` writes for a mid-run recording).
    LiveTensors,
    /// An empty allocator (the trace's frees of earlier blocks do nothing).
    Empty,
}

/// `cachalot replay`.
#[derive(Debug, clap::Args)]
pub struct ReplayArgs {
    /// The snapshot: a pickle from `torch.cuda.memory._dump_snapshot()` (or written by
    /// cachalot), optionally gzip-compressed. PyTorch's figures are read from NAME.json beside
    /// it when present.
    pub trace: PathBuf,
    /// Start from PyTorch 2.x's default settings plus the PYTORCH_CUDA_ALLOC_CONF the trace was
    /// recorded with (from the snapshot or NAME.json): the replay then reproduces PyTorch.
    /// Without it, cachalot's own defaults.
    #[arg(long)]
    pub pytorch: bool,
    /// Settings in PYTORCH_CUDA_ALLOC_CONF syntax, applied on top (e.g.
    /// "max_split_size_mb:64,roundup_power2_divisions:4").
    #[arg(long, value_name = "CONF")]
    pub config: Option<String>,
    /// Where to replay.
    #[arg(long, value_enum, default_value_t = BackendKind::Sim)]
    pub backend: BackendKind,
    /// Passes over the trace; passes after the first measure steady-state speed.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub repeat: u32,
    /// Print one JSON object instead of the report.
    #[arg(long)]
    pub json: bool,
    /// Draw requested, allocated and reserved bytes against operation index as SVG.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
    /// Write the allocator's final state and its history over the replay as a PyTorch
    /// snapshot (gzip-compressed when FILE ends in .gz).
    #[arg(long, value_name = "FILE.pickle")]
    pub snapshot_out: Option<PathBuf>,
    /// Simulated device memory (bytes; K, M, G, T, KiB, MiB, GiB, TiB suffixes allowed).
    /// Default: the recording GPU's total from NAME.json, else an H200's.
    #[arg(long, value_name = "BYTES", value_parser = units::parse_bytes)]
    pub device_memory: Option<u64>,
    /// Which device's trace of a multi-GPU snapshot to replay (default: the first that has
    /// entries).
    #[arg(long, value_name = "N")]
    pub device: Option<usize>,
    /// The memory fraction the program set with torch.cuda.set_per_process_memory_fraction(F)
    /// (a call, so no snapshot records it): reserved bytes are capped at F × the device's
    /// memory, the garbage collection threshold counts from that cap, and an allocation over
    /// it releases the cache and retries, as in PyTorch.
    #[arg(long, value_name = "F", value_parser = parse_fraction)]
    pub memory_fraction: Option<f64>,
    /// The CUDA device to replay on with --backend cuda.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub gpu: usize,
    /// What the replay of a trace recorded mid-run starts from.
    #[arg(long, value_enum, default_value_t = StartArg::Auto)]
    pub start: StartArg,
    /// Write the program the replay runs, one operation a line (`a ID SIZE STREAM`, `f ID`,
    /// `r ID SIDE`, `c SIDE`, `e`, `s`; format in src/ops.rs), for replaying the same
    /// operations through another allocator (scripts/pytorch_replay.py). A trace recorded
    /// mid-run needs `--start live-tensors`: PyTorch's cached layout is no sequence of
    /// operations.
    #[arg(long, value_name = "FILE")]
    pub ops_out: Option<PathBuf>,
    /// The program called torch.cuda.memory._set_allocator_settings(CONF) just before trace
    /// entry ENTRY (PyTorch's defaults before; no trace entry records it). Without it, a trace
    /// that only fits such a change is searched for the entry.
    #[arg(long, value_name = "ENTRY:CONF", value_parser = input::parse_settings_at)]
    pub settings_at: Option<(usize, String)>,
}

/// A memory fraction: a number in [0, 1].
pub fn parse_fraction(s: &str) -> Result<f64, String> {
    let f: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number"))?;
    if (0.0..=1.0).contains(&f) {
        Ok(f)
    } else {
        Err(format!("{f} is not a memory fraction (between 0 and 1)"))
    }
}

/// Replays with at least this many operations in all (passes included) show a progress bar.
const PROGRESS_MIN_OPS: usize = 250_000;

/// Runs `cachalot replay`.
pub fn run(args: &ReplayArgs) -> Result<(), CliError> {
    let mut trace = input::load(&args.trace, args.device)?;
    trace.fraction = args.memory_fraction;
    if let Some((entry, conf)) = &args.settings_at {
        trace.settings_changed_at(*entry, conf)?;
    }
    let settings = trace.settings(args.pytorch, args.pytorch, args.config.as_deref())?;
    let config = ReplayConfig {
        settings,
        capacity: trace.capacity(args.device_memory),
        trace_addresses: true,
        repeat: args.repeat as usize,
        timeline: args.plot.is_some(),
        record_history: args.snapshot_out.is_some(),
        start: StartMode::Exact,
    };
    let mid_run = trace.start.as_ref().is_ok_and(|s| !s.is_fresh());
    let start = match (
        start_mode(&trace, &config.settings),
        args.backend,
        args.start,
    ) {
        // Nothing was held (or the start is unknown): --start changes nothing.
        (mode, _, _) if !mid_run => mode,
        (_, _, StartArg::Empty) => StartMode::Empty,
        (_, _, StartArg::LiveTensors) => StartMode::LiveTensors,
        // A GPU cannot adopt memory it never handed out: there a mid-run start replays from
        // the tensors live then, allocated for real.
        (StartMode::Exact, BackendKind::Cuda, StartArg::Auto) => StartMode::LiveTensors,
        (mode, _, StartArg::Auto) => mode,
    };
    let config = ReplayConfig { start, ..config };
    if let Some(path) = &args.ops_out {
        ops::check_exportable(&trace, config.start)?;
        ops::write(path, &trace, &config)?;
        if let Some(left_out) = ops::left_out(&trace) {
            eprintln!(
                "cachalot: {}: --ops-out left out {left_out}",
                path.display()
            );
        }
    }
    let run = execute(&trace, &config, args.backend, args.gpu)?;
    let mut report = Report::new(&trace, &config, &run);
    report.look_for_a_fraction(&trace, &config);
    if let Some(path) = &args.plot {
        let title = format!(
            "{} ({}, {})",
            file_name(&trace.path),
            config_label(&config.settings),
            args.backend.name()
        );
        plot::timeline(path, &run.outcome.timeline, &title)?;
    }
    if let Some(path) = &args.snapshot_out {
        let mut snapshot = snapshot_of(
            &run.outcome.final_layout,
            &run.outcome.history,
            &config.settings,
            trace.device,
        );
        recorded_streams(&mut snapshot, &trace.snapshot, trace.device);
        write_snapshot_file(path, &snapshot)?;
    }
    let text = if args.json {
        serde_json::to_string_pretty(&report)
            .map_err(|e| CliError::run(format!("cannot format the JSON report: {e}")))?
    } else {
        report.human(args.plot.as_deref(), args.snapshot_out.as_deref())
    };
    println!("{text}");
    Ok(())
}

/// Puts the streams a replay used for private pools' blocks ([`cachalot_tools::replay::private_stream`]) back to the
/// recorded streams, and those segments back in the private pools the dump `recorded` names.
fn recorded_streams(snapshot: &mut Snapshot, recorded: &Snapshot, device: usize) {
    let mut pools: Vec<(u64, u64)> = recorded
        .segments
        .iter()
        .filter(|s| s.device == device && s.pool_id != (0, 0))
        .map(|s| s.pool_id)
        .collect();
    pools.sort_unstable();
    pools.dedup();
    for s in &mut snapshot.segments {
        let (stream, pool) = recorded_stream(s.stream);
        s.stream = stream;
        if let Some(p) = pool {
            s.pool_id = pools.get(p).copied().unwrap_or((0, p as u64 + 1));
        }
    }
    for e in snapshot.traces.iter_mut().flat_map(|t| &mut t.entries) {
        e.stream = recorded_stream(e.stream).0;
    }
}

/// What a replay of `trace` under `settings` starts from: the state PyTorch held, block for
/// block, when the settings are the ones the trace was recorded under; only the tensors live
/// then, placed by the replayed policy, when they are not (PyTorch's cached layout is the
/// product of its own policy); nothing when the start could not be reconstructed.
pub fn start_mode(trace: &Trace, settings: &Settings) -> StartMode {
    match &trace.start {
        Err(_) => StartMode::Empty,
        Ok(_) if trace.recorded_start_settings().as_ref() == Some(settings) => StartMode::Exact,
        Ok(_) => StartMode::LiveTensors,
    }
}

/// A replay's outcome and the device it ran on.
pub struct Run {
    /// What the replay measured.
    pub outcome: ReplayOutcome,
    /// Where it ran.
    pub backend: BackendKind,
    /// The device's total memory in bytes.
    pub device_total: u64,
    /// The GPU's name (CUDA backend only).
    pub gpu_name: Option<String>,
}

/// Replays `trace` under `config` on `backend`, with a progress bar on long replays.
pub fn execute(
    trace: &Trace,
    config: &ReplayConfig,
    backend: BackendKind,
    gpu: usize,
) -> Result<Run, CliError> {
    let total = trace.program.ops.len().saturating_mul(config.repeat);
    let bar = progress_bar(total);
    let mut progress = |done: usize| {
        if let Some(bar) = &bar {
            bar.set_position(done as u64);
        }
    };
    let run = match backend {
        BackendKind::Sim => {
            let outcome = replay_with_progress(&trace.program, config, &mut progress)
                .map_err(|e| replay_error(trace, e))?;
            Run {
                outcome,
                backend,
                device_total: config.capacity,
                gpu_name: None,
            }
        }
        BackendKind::Cuda => {
            let (outcome, gpu) =
                cuda::replay(&trace.program, config, gpu, trace.device, &mut progress)?;
            Run {
                outcome,
                backend,
                device_total: gpu.total_memory,
                gpu_name: Some(gpu.name),
            }
        }
    };
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    Ok(run)
}

fn replay_error(trace: &Trace, e: cachalot_tools::replay::ReplayError) -> CliError {
    match e {
        cachalot_tools::replay::ReplayError::Setup(e) => CliError::input(format!(
            "{}: the settings cannot be used: {e}",
            trace.name()
        )),
        e => CliError::run(format!("{}: {e}", trace.name())),
    }
}

/// A progress bar on stderr, only when stderr is a terminal and the replay is long.
fn progress_bar(total: usize) -> Option<ProgressBar> {
    if total < PROGRESS_MIN_OPS || !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = ProgressBar::with_draw_target(Some(total as u64), ProgressDrawTarget::stderr());
    if let Ok(style) =
        ProgressStyle::with_template("replaying {bar:40} {human_pos}/{human_len} ops ({eta})")
    {
        bar.set_style(style);
    }
    Some(bar)
}

/// Writes a snapshot pickle (gzip-compressed when the name ends in `.gz`).
pub fn write_snapshot_file(
    path: &Path,
    snapshot: &cachalot_tools::snapshot::Snapshot,
) -> Result<(), CliError> {
    let fail = |e: &dyn std::fmt::Display| {
        CliError::run(format!(
            "{}: cannot write the snapshot: {e}",
            path.display()
        ))
    };
    let file = File::create(path).map_err(|e| fail(&e))?;
    let mut out = BufWriter::new(file);
    if path.extension().is_some_and(|e| e == "gz") {
        let mut gz = flate2::write::GzEncoder::new(out, flate2::Compression::best());
        write_snapshot(snapshot, &mut gz).map_err(|e| fail(&e))?;
        out = gz.finish().map_err(|e| fail(&e))?;
    } else {
        write_snapshot(snapshot, &mut out).map_err(|e| fail(&e))?;
    }
    out.flush().map_err(|e| fail(&e))
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_else(|| path.display().to_string())
}

/// The settings for people: "PyTorch's defaults", "cachalot's defaults", or the canonical
/// configuration string.
pub fn config_label(settings: &Settings) -> String {
    if *settings == Settings::pytorch() {
        "PyTorch's defaults".into()
    } else if *settings == Settings::cachalot() {
        "cachalot's defaults".into()
    } else {
        settings.to_string()
    }
}

/// The JSON report of `cachalot replay` (and one cell of `cachalot compare --json`).
#[derive(Debug, Serialize)]
pub struct Report {
    /// The trace file.
    pub trace: String,
    /// The device whose trace was replayed.
    pub device: usize,
    /// The settings: their canonical PYTORCH_CUDA_ALLOC_CONF string (the keys that differ
    /// from cachalot's defaults).
    pub config: String,
    /// The settings for people ("PyTorch's defaults", "cachalot's defaults" or `config`).
    #[serde(skip)]
    pub config_label: String,
    /// `sim` or `cuda`.
    pub backend: &'static str,
    /// The GPU (CUDA backend only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_name: Option<String>,
    /// The device's total memory in bytes.
    pub device_total_bytes: u64,
    /// The memory fraction in force, if any.
    pub memory_fraction: Option<f64>,
    /// Passes over the trace.
    pub repeat: usize,
    /// Operations in one pass.
    pub ops: usize,
    /// Allocations in one pass.
    pub allocs: usize,
    /// Frees in one pass.
    pub frees: usize,
    /// Peak of live requested bytes.
    pub peak_requested_bytes: u64,
    /// Peak allocated bytes.
    pub peak_allocated_bytes: u64,
    /// Peak reserved bytes.
    pub peak_reserved_bytes: u64,
    /// Peak reserved / peak requested.
    pub fragmentation: f64,
    /// Device allocations (`cudaMalloc` calls).
    pub device_allocs: u64,
    /// Device frees.
    pub device_frees: u64,
    /// Share of allocations served from the cache.
    pub cache_hit_rate: f64,
    /// Failed allocations.
    pub ooms: u64,
    /// Allocations that released the cache and retried.
    pub num_alloc_retries: u64,
    /// Waits for every stream (cache releases).
    pub num_sync_all_streams: u64,
    /// Allocator nanoseconds per operation (steady state when repeat > 1).
    pub ns_per_op: f64,
    /// Allocator nanoseconds per operation of the first pass.
    pub first_pass_ns_per_op: f64,
    /// Device calls (allocations and frees, or map and unmap steps) of each pass after the
    /// first (empty when repeat is 1): the steady state's price.
    pub steady_pass_device_calls: Vec<u64>,
    /// Peak number of segments.
    pub peak_segments: u64,
    /// Segments at the end of the first pass.
    pub final_segments: usize,
    /// Reserved bytes at the end of the first pass.
    pub final_reserved_bytes: u64,
    /// At the peak: bytes in wholly free segments (what `empty_cache` would have released).
    pub empty_cache_at_peak_bytes: u64,
    /// At the peak: free bytes stranded in split segments.
    pub stranded_at_peak_bytes: u64,
    /// The state when recording began, and what the replay started from.
    pub start: StartReport,
    /// Does the replay end in the state PyTorch dumped?
    pub self_check: SelfCheckReport,
    /// Segments the trace gives back that the replay does not, when there are such, and the
    /// memory-fraction cap that reproduces them if one was searched and found.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unexplained_frees: Option<UnexplainedFrees>,
    /// Where the program changed its settings at run time, when found.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub settings_change: Option<FoundChange>,
    /// Private pools released before the dump, inferred from the trace.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub inferred_pools: Vec<InferredPool>,
    /// PyTorch's own figures, when a sidecar was found.
    #[serde(flatten)]
    pub pytorch: Option<PytorchFigures>,
}

impl Report {
    /// The report of one replay.
    pub fn new(trace: &Trace, config: &ReplayConfig, run: &Run) -> Report {
        let out = &run.outcome;
        Report {
            trace: trace.name(),
            device: trace.device,
            config: config.settings.to_string(),
            config_label: config_label(&config.settings),
            backend: run.backend.name(),
            gpu_name: run.gpu_name.clone(),
            device_total_bytes: run.device_total,
            memory_fraction: config.settings.per_process_memory_fraction,
            repeat: config.repeat,
            ops: out.ops,
            allocs: out.allocs,
            frees: out.frees,
            peak_requested_bytes: out.peak_requested_bytes,
            peak_allocated_bytes: out.peak_allocated_bytes,
            peak_reserved_bytes: out.peak_reserved_bytes,
            fragmentation: out.fragmentation(),
            device_allocs: out.device_allocs,
            device_frees: out.device_frees,
            cache_hit_rate: out.cache_hit_rate,
            ooms: out.ooms,
            num_alloc_retries: out.stats.num_alloc_retries,
            num_sync_all_streams: out.stats.num_sync_all_streams,
            ns_per_op: out.ns_per_op,
            first_pass_ns_per_op: out.first_pass_ns_per_op,
            steady_pass_device_calls: out.steady_pass_device_calls.clone(),
            peak_segments: out.peak_segments,
            final_segments: out.final_layout.len(),
            final_reserved_bytes: out.final_layout.iter().map(|s| s.size).sum(),
            empty_cache_at_peak_bytes: out.empty_cache_at_peak_bytes,
            stranded_at_peak_bytes: out.stranded_at_peak_bytes,
            start: start_report(trace, config),
            self_check: SelfCheckReport {
                // The dump's addresses are the recording GPU's: only the simulated device,
                // which hands them out again, can end at them.
                applies: config.start == StartMode::Exact && run.backend == BackendKind::Sim,
                check: check_final_state(&out.final_layout, &trace.snapshot, trace.device),
                causes: causes(trace, config, out),
                start_rebuilt: trace.start.is_ok(),
                inferred: inferred(trace),
            },
            settings_change: trace.settings_change.clone(),
            inferred_pools: trace.program.inferred_pools.clone(),
            unexplained_frees: None,
            pytorch: trace.figures.as_ref().map(|f| PytorchFigures::new(f, out)),
        }
    }

    /// The human report.
    pub fn human(&self, plot: Option<&Path>, snapshot: Option<&Path>) -> String {
        let mut s = String::new();
        let mut line = |l: String| {
            s.push_str(l.trim_end());
            s.push('\n');
        };
        line(format!(
            "trace      {} (device {})",
            self.trace, self.device
        ));
        line(format!(
            "           {} operations: {} allocations, {} frees",
            grouped(self.ops as u64),
            grouped(self.allocs as u64),
            grouped(self.frees as u64)
        ));
        line(format!("settings   {}", self.config_label));
        let device = match (&self.gpu_name, self.backend) {
            (Some(name), _) => format!("{name} (CUDA), {}", human(self.device_total_bytes)),
            (None, _) => format!("simulated, {}", human(self.device_total_bytes)),
        };
        line(format!("device     {device}"));
        line(format!("start      {}", self.start.human()));
        if self.backend == "cuda" && self.start.replayed_from == StartMode::LiveTensors {
            line(
                "           (on a GPU the state cannot be adopted: the allocator never handed \
                 that memory out, so only the live tensors are allocated for real)"
                    .to_string(),
            );
        }
        line(String::new());
        let py = self.pytorch.as_ref();
        let col = |v: Option<String>| v.unwrap_or_default();
        line(format!(
            "{:<22}{:<30}{}",
            "",
            "cachalot",
            if py.is_some() { "PyTorch" } else { "" }
        ));
        line(format!(
            "{:<22}{}",
            "peak requested",
            human(self.peak_requested_bytes)
        ));
        line(format!(
            "{:<22}{:<30}{}",
            "peak allocated",
            human(self.peak_allocated_bytes),
            col(py.map(|p| human(p.pytorch_peak_allocated_bytes)))
        ));
        line(format!(
            "{:<22}{:<30}{}",
            "peak reserved",
            format!(
                "{} ({} B)",
                human(self.peak_reserved_bytes),
                grouped(self.peak_reserved_bytes)
            ),
            col(py.map(|p| format!(
                "{} ({} B)",
                human(p.pytorch_peak_reserved_bytes),
                grouped(p.pytorch_peak_reserved_bytes)
            )))
        ));
        let opt = |v: Option<i64>| v.map_or("?".to_string(), |v| v.to_string());
        line(format!(
            "{:<22}{:<30}{}",
            "peak segments",
            self.peak_segments,
            col(py.map(|p| p.mark("peak segments", opt(p.pytorch_peak_segments))))
        ));
        line(format!(
            "{:<22}{:<30}{}",
            "device allocs / frees",
            format!("{} / {}", self.device_allocs, self.device_frees),
            col(py.map(|p| p.mark(
                "device allocs",
                format!(
                    "{} / {}",
                    opt(p.pytorch_device_allocs),
                    opt(p.pytorch_device_frees)
                )
            )))
        ));
        line(format!(
            "{:<22}{:<30}{}",
            "out of memory",
            self.ooms,
            col(py.map(|p| opt(p.pytorch_ooms)))
        ));
        line(format!(
            "{:<22}{:.3}  (peak reserved / peak requested; 1.000 is the physical limit)",
            "fragmentation", self.fragmentation
        ));
        line(format!(
            "{:<22}{:.2}% of allocations served without a device call",
            "cache hit rate",
            self.cache_hit_rate * 100.0
        ));
        line(format!(
            "{:<22}empty_cache() would have given back {}; {} stranded in split segments",
            "at the peak",
            human(self.empty_cache_at_peak_bytes),
            human(self.stranded_at_peak_bytes)
        ));
        let passes = if self.repeat > 1 {
            format!("steady state over {} passes", self.repeat - 1)
        } else {
            "one pass".to_string()
        };
        line(format!(
            "{:<22}{:.0} ns per operation ({passes})",
            "allocator time", self.ns_per_op
        ));
        if self.repeat > 1 {
            let later = run_lengths(&self.steady_pass_device_calls);
            line(format!(
                "{:<22}{:.0} ns per operation, {} device calls; then {} calls a pass",
                "first pass",
                self.first_pass_ns_per_op,
                self.device_allocs + self.device_frees,
                later
            ));
        }
        if let Some(p) = py {
            line(String::new());
            if p.pytorch_compared.is_empty() {
                line(format!(
                    "PyTorch {}'s figures cover another window than the trace (peaks reset inside \
                     it, counters since the process began): not compared",
                    p.pytorch_version
                ));
            } else if p.pytorch_matches {
                line(format!(
                    "matches PyTorch {} on {} to the byte ({})",
                    p.pytorch_version,
                    p.pytorch_gpu_name,
                    p.pytorch_compared.join(", ")
                ));
            } else {
                line(format!(
                    "differs from PyTorch {} on {}:",
                    p.pytorch_version, p.pytorch_gpu_name
                ));
                for d in &p.pytorch_differences {
                    line(format!("  {d}"));
                }
            }
        }
        line(String::new());
        line(format!("self-check {}", self.self_check.human()));
        if let Some(u) = &self.unexplained_frees {
            match (u.found_cap_bytes, u.found_fraction) {
                (Some(cap), Some(f)) => line(format!(
                    "fraction   found: the replay capped at {} ({} B; --memory-fraction {:.6} of \
                     this {} device) gives back the trace's {} segments and ends in the dump \
                     block for block: the program likely called \
                     torch.cuda.set_per_process_memory_fraction with about that (the smallest \
                     such cap)",
                    human(cap),
                    grouped(cap),
                    f,
                    human(u.device_total_bytes),
                    u.trace_frees
                )),
                _ => line(format!(
                    "fraction   no memory-fraction cap makes the replay give back the trace's {} \
                     segments and end in the dump",
                    u.trace_frees
                )),
            }
        }
        if let Some(path) = plot {
            line(format!("plot       {}", path.display()));
        }
        if let Some(path) = snapshot {
            line(format!("snapshot   {}", path.display()));
        }
        s.pop();
        s
    }
}

impl Report {
    /// When the trace gives back segments that the replay does not and no memory fraction
    /// is set, says so and searches the fraction that reproduces them ([`find_cap`]).
    pub fn look_for_a_fraction(&mut self, trace: &Trace, config: &ReplayConfig) {
        let trace_frees = trace_device_frees(&trace.snapshot, trace.device);
        if trace_frees <= self.device_frees || config.settings.per_process_memory_fraction.is_some()
        {
            return;
        }
        let searchable = self.self_check.applies && !self.self_check.check.matches;
        let found = searchable
            .then(|| find_cap(&trace.program, &trace.snapshot, trace.device, config))
            .flatten();
        self.unexplained_frees = Some(UnexplainedFrees {
            trace_frees,
            replay_frees: self.device_frees,
            found_cap_bytes: found.as_ref().map(|f| f.cap_bytes),
            found_fraction: found
                .as_ref()
                .map(|f| f.cap_bytes as f64 / config.capacity.max(1) as f64),
            device_total_bytes: config.capacity,
        });
    }
}

/// Per-pass counts, space-separated, a run of three or more equal counts written once with
/// its length (`0×999`), so that `--repeat 1000` prints one short line.
fn run_lengths(values: &[u64]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < values.len() {
        let n = values[i..].iter().take_while(|&&v| v == values[i]).count();
        if n >= 3 {
            out.push(format!("{}×{n}", values[i]));
        } else {
            out.extend(std::iter::repeat_n(values[i].to_string(), n));
        }
        i += n;
    }
    out.join(" ")
}

#[cfg(test)]
mod tests {
    use super::run_lengths;

    #[test]
    fn per_pass_counts_write_runs_of_three_or_more_once_with_their_length() {
        assert_eq!(run_lengths(&[]), "");
        assert_eq!(run_lengths(&[4, 0, 0]), "4 0 0");
        assert_eq!(run_lengths(&[3, 1, 0, 0, 0, 0, 2, 2, 2]), "3 1 0×4 2×3");
    }
}

//! `cachalot explain`: what holds the memory at the peak (or at any operation) of a trace's
//! replay, as text, JSON or one self-contained HTML page.
//!
//! The one rule: the figures are [`cachalot_tools::explain`]'s, from the replay under the
//! trace's recorded settings (PyTorch's defaults plus the trace's PYTORCH_CUDA_ALLOC_CONF,
//! `--config` on top) from the state when recording began — what `cachalot replay --pytorch`
//! replays; this module formats them.

use std::path::PathBuf;

use cachalot_tools::explain::{self, Advice, At, Breakdown, advice::AdviceSetup, html};
use cachalot_tools::replay::StartMode;
use cachalot_tools::units::{grouped, human};
use serde::Serialize;

use super::error::CliError;
use super::input::{self, Trace};
use super::replay::{config_label, start_mode};
use super::units;

/// `cachalot explain`.
#[derive(Debug, clap::Args)]
pub struct ExplainArgs {
    /// The snapshot (a `torch.cuda.memory._dump_snapshot()` pickle, optionally gzipped).
    pub trace: PathBuf,
    /// The moment: `peak-reserved` (the default), `peak-allocated`, an operation index (`op:N`
    /// or `N`: right after operation N of the replay program) or a trace entry (`entry:N`:
    /// right after the trace's entry N, as memory_viz numbers them).
    #[arg(long, value_name = "WHEN", value_parser = parse_at, default_value = "peak-reserved")]
    pub at: At,
    /// Settings on top of the trace's recorded ones (PYTORCH_CUDA_ALLOC_CONF syntax).
    #[arg(long, value_name = "CONF")]
    pub config: Option<String>,
    /// Simulated device memory (default: the recording GPU's, else an H200's).
    #[arg(long, value_name = "BYTES", value_parser = units::parse_bytes)]
    pub device_memory: Option<u64>,
    /// Which device's trace of a multi-GPU snapshot.
    #[arg(long, value_name = "N")]
    pub device: Option<usize>,
    /// Groups the text report lists (the JSON and the page list all).
    #[arg(long, value_name = "N", default_value_t = 12)]
    pub top: usize,
    /// Print one JSON object instead of the report.
    #[arg(long)]
    pub json: bool,
    /// Also write one self-contained HTML page (timeline, clickable breakdown, advice).
    #[arg(long, value_name = "FILE.html")]
    pub html: Option<PathBuf>,
}

fn parse_at(s: &str) -> Result<At, String> {
    match s {
        "peak-reserved" | "reserved" => Ok(At::PeakReserved),
        "peak-allocated" | "allocated" => Ok(At::PeakAllocated),
        other if other.starts_with("entry:") => other["entry:".len()..]
            .replace('_', "")
            .parse::<usize>()
            .map(At::Entry)
            .map_err(|_| format!("\"{s}\": entry:N takes a trace entry index")),
        other => other
            .strip_prefix("op:")
            .unwrap_or(other)
            .replace('_', "")
            .parse::<usize>()
            .map(At::Op)
            .map_err(|_| {
                format!(
                    "\"{s}\": say peak-reserved, peak-allocated, an operation index (op:N) or a \
                     trace entry (entry:N)"
                )
            }),
    }
}

/// The moment explained, for the report.
#[derive(Debug, Serialize)]
pub struct Moment {
    /// `peak_reserved`, `peak_allocated`, `op` or `entry`.
    pub kind: &'static str,
    /// Operations run before it.
    pub ops_before: usize,
    /// The operation that made it (`None`: the start).
    pub op: Option<usize>,
    /// The trace entry that operation came from.
    pub trace_entry: Option<usize>,
    /// For people.
    pub description: String,
}

/// The JSON report.
#[derive(Debug, Serialize)]
pub struct ExplainReport {
    /// The trace file.
    pub trace: String,
    /// The device whose trace was replayed.
    pub device: usize,
    /// The settings (canonical PYTORCH_CUDA_ALLOC_CONF).
    pub settings: String,
    /// The settings for people.
    pub settings_label: String,
    /// What the replay started from: `exact`, `live_tensors` or `empty`.
    pub start: StartMode,
    /// The simulated device's memory.
    pub device_total_bytes: u64,
    /// Operations in the program.
    pub ops: usize,
    /// Peak reserved bytes over the replay.
    pub peak_reserved_bytes: u64,
    /// Peak allocated bytes over the replay.
    pub peak_allocated_bytes: u64,
    /// Allocations that failed in the replay.
    pub ooms: u64,
    /// The moment explained.
    pub at: Moment,
    /// What holds the memory then (`live_bytes`, `groups`, the free memory …).
    #[serde(flatten)]
    pub breakdown: Breakdown,
    /// What the advice replays started from.
    pub advice_start: StartMode,
    /// The advice.
    pub advice: Vec<Advice>,
}

/// Runs `cachalot explain`.
pub fn run(args: &ExplainArgs) -> Result<(), CliError> {
    let trace = input::load(&args.trace, args.device)?;
    let settings = trace.settings(true, true, args.config.as_deref())?;
    let capacity = trace.capacity(args.device_memory);
    let start = start_mode(&trace, &settings);
    let (survey, breakdown) = explain::explain(
        &trace.program,
        &trace.snapshot,
        trace.device,
        &settings,
        capacity,
        start,
        args.at,
    )
    .map_err(|e| run_error(&trace, e))?;
    let advice_start = advice_start(&trace);
    let advice = explain::advise(
        &AdviceSetup {
            program: &trace.program,
            settings: &settings,
            capacity,
            start: advice_start,
        },
        &breakdown,
    )
    .map_err(|e| run_error(&trace, e))?;
    let at = moment(args.at, &breakdown, &trace);
    let peak = |f: fn(&cachalot_tools::replay::Sample) -> u64| {
        survey.timeline.iter().map(f).max().unwrap_or(0)
    };
    let report = ExplainReport {
        trace: trace.name(),
        device: trace.device,
        settings: settings.to_string(),
        settings_label: config_label(&settings),
        start,
        device_total_bytes: capacity,
        ops: trace.program.ops.len(),
        peak_reserved_bytes: peak(|s| s.reserved),
        peak_allocated_bytes: peak(|s| s.allocated),
        ooms: survey.ooms,
        at,
        breakdown,
        advice_start,
        advice,
    };
    if let Some(path) = &args.html {
        let mut value = serde_json::to_value(&report)
            .map_err(|e| CliError::run(format!("cannot format the report: {e}")))?;
        value["timeline"] = serde_json::to_value(html::thin_timeline(&survey.timeline))
            .map_err(|e| CliError::run(format!("cannot format the timeline: {e}")))?;
        let title = format!("cachalot explain: {}", report.trace);
        std::fs::write(path, html::render(&value, &title)).map_err(|e| {
            CliError::run(format!("{}: cannot write the page: {e}", path.display()))
        })?;
    }
    let text = if args.json {
        serde_json::to_string_pretty(&report)
            .map_err(|e| CliError::run(format!("cannot format the JSON report: {e}")))?
    } else {
        human_report(&report, args.top, args.html.as_deref())
    };
    emit(&text)
}

/// Prints `text` and a newline on stdout; a reader that went away (`| head`) is no error.
pub fn emit(text: &str) -> Result<(), CliError> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{text}").and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(CliError::run(format!("cannot write the report: {e}")))
        }
        _ => Ok(()),
    }
}

fn run_error(trace: &Trace, e: cachalot_tools::replay::ReplayError) -> CliError {
    match e {
        cachalot_tools::replay::ReplayError::Setup(e) => CliError::input(format!(
            "{}: the settings cannot be used: {e}",
            trace.name()
        )),
        e => CliError::run(format!("{}: {e}", trace.name())),
    }
}

/// The start of the advice replays: the tensors live when recording began for a mid-run
/// trace (PyTorch's cached layout then belongs to the recorded settings alone), nothing for a
/// fresh one or one whose start is unknown.
fn advice_start(trace: &Trace) -> StartMode {
    match &trace.start {
        Ok(s) if !s.is_fresh() => StartMode::LiveTensors,
        Ok(_) => StartMode::Exact,
        Err(_) => StartMode::Empty,
    }
}

fn moment(at: At, b: &Breakdown, trace: &Trace) -> Moment {
    let kind = match at {
        At::PeakReserved => "peak_reserved",
        At::PeakAllocated => "peak_allocated",
        At::Op(_) => "op",
        At::Entry(_) => "entry",
    };
    let entry = b.trace_entry.and_then(|e| {
        trace
            .snapshot
            .traces
            .iter()
            .find(|t| t.device == trace.device)
            .and_then(|t| t.entries.get(e))
    });
    let what = match at {
        At::PeakReserved => "the peak of reserved memory",
        At::PeakAllocated => "the peak of allocated memory",
        At::Op(_) | At::Entry(_) => "the moment asked for",
    };
    let description = match (b.op, entry) {
        (None, _) => format!("{what}: when recording began, before the first operation"),
        (Some(op), Some(e)) => format!(
            "{what}: right after operation {} (trace entry {}, {} of {} on stream {})",
            grouped(op as u64),
            grouped(b.trace_entry.unwrap_or(0) as u64),
            e.action.name(),
            human(e.size),
            e.stream
        ),
        (Some(op), None) => format!("{what}: right after operation {}", grouped(op as u64)),
    };
    Moment {
        kind,
        ops_before: b.ops_before,
        op: b.op,
        trace_entry: b.trace_entry,
        description,
    }
}

fn human_report(r: &ExplainReport, top: usize, html: Option<&std::path::Path>) -> String {
    let mut s = String::new();
    let mut line = |l: String| {
        s.push_str(l.trim_end());
        s.push('\n');
    };
    let b = &r.breakdown;
    line(format!("trace      {} (device {})", r.trace, r.device));
    line(format!(
        "settings   {}; replayed from {}",
        r.settings_label,
        match r.start {
            StartMode::Exact => "the state when recording began, block for block",
            StartMode::LiveTensors => "the tensors live when recording began",
            StartMode::Empty => "nothing (the state when recording began is unknown)",
        }
    ));
    line(format!("at         {}", r.at.description));
    line(String::new());
    let pct = |x: u64| {
        if b.reserved_bytes == 0 {
            0.0
        } else {
            x as f64 / b.reserved_bytes as f64 * 100.0
        }
    };
    line(format!(
        "reserved   {} ({} B) in {} segments",
        human(b.reserved_bytes),
        grouped(b.reserved_bytes),
        grouped(b.segments as u64)
    ));
    line(format!(
        "  live tensors      {:>12}  {:>5.1}%  {} tensors ({} requested)",
        human(b.live_bytes),
        pct(b.live_bytes),
        grouped(b.live_tensors as u64),
        human(b.live_requested_bytes)
    ));
    if b.pending_bytes > 0 {
        line(format!(
            "  pending frees     {:>12}  {:>5.1}%  freed, waiting for other streams",
            human(b.pending_bytes),
            pct(b.pending_bytes)
        ));
    }
    line(format!(
        "  free, releasable  {:>12}  {:>5.1}%  empty_cache() would give it back",
        human(b.releasable_bytes),
        pct(b.releasable_bytes)
    ));
    line(format!(
        "  free, stranded    {:>12}  {:>5.1}%  in split segments: empty_cache() cannot",
        human(b.stranded_bytes),
        pct(b.stranded_bytes)
    ));
    line(String::new());
    line(format!(
        "live tensors by allocation stack ({} groups; your own Python frames first, library frames in [...]):",
        b.groups.len()
    ));
    for (i, g) in b.groups.iter().take(top).enumerate() {
        line(format!(
            "{:>3}. {:>11} {:>6} × {}",
            i + 1,
            human(g.bytes),
            grouped(g.count as u64),
            g.label
        ));
    }
    if b.groups.len() > top {
        let rest: u64 = b.groups[top..].iter().map(|g| g.bytes).sum();
        let count: usize = b.groups[top..].iter().map(|g| g.count).sum();
        line(format!(
            "     {:>11} {:>6} × in {} more groups (--top N, --json or --html for all)",
            human(rest),
            grouped(count as u64),
            b.groups.len() - top
        ));
    }
    if !b.free_by_segment_size.is_empty() && b.free_bytes > 0 {
        line(String::new());
        line("reserved but free, by segment size:".to_string());
        line(format!(
            "  {:>12} {:>6} {:>9} {:>12} {:>14} {:>12}",
            "segment", "pool", "segments", "free", "releasable", "stranded"
        ));
        for f in b.free_by_segment_size.iter().filter(|f| f.free_bytes > 0) {
            line(format!(
                "  {:>12} {:>6} {:>9} {:>12} {:>14} {:>12}{}",
                human(f.segment_bytes),
                f.pool,
                f.segments,
                human(f.free_bytes),
                human(f.releasable_bytes),
                human(f.stranded_bytes),
                if f.expandable { "  (expandable)" } else { "" }
            ));
        }
    }
    line(String::new());
    let baseline = r.advice.first().map_or(0, |a| a.baseline_peak_bytes);
    line(
        if r.advice_start == StartMode::LiveTensors && r.start != StartMode::LiveTensors {
            format!(
                "advice (each line replayed, all from the tensors live when recording began, where these \
             settings peak at {}; the recorded run's own state peaks at {}):",
                human(baseline),
                human(r.peak_reserved_bytes)
            )
        } else {
            "advice (each line replayed):".to_string()
        },
    );
    for a in &r.advice {
        line(format!("  - {}", a.text));
    }
    if let Some(path) = html {
        line(String::new());
        line(format!("page       {}", path.display()));
    }
    s.pop();
    s
}

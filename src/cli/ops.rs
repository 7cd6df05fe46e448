//! `cachalot replay --ops-out FILE`: the replay program written as text in the `cachalot ops
//! v1` format ([`cachalot_tools::ops`], where the format is described), exactly as the replay
//! runs it, for another allocator (PyTorch's own, through `scripts/pytorch_replay.py`) to
//! replay the same operations, with a header saying what was replayed.

use std::io::Write as _;
use std::path::Path;

use cachalot_tools::ops::OpsProgram;
use cachalot_tools::replay::{ReplayConfig, ReplayOp, StartMode};

use super::error::CliError;
use super::input::Trace;

/// The text of the program `config` replays, in the `cachalot ops v1` format.
pub fn render(trace: &Trace, config: &ReplayConfig) -> String {
    let program = &trace.program;
    let mut ops = OpsProgram::from_replay(program, config.start);
    let (start_allocs, allocs) = ops.allocs();
    let recorded = trace.recorded();
    let start = match (config.start, &trace.start) {
        (_, Err(_)) => "empty (the start could not be rebuilt)".to_string(),
        (_, Ok(s)) if s.is_fresh() => "fresh".to_string(),
        (StartMode::LiveTensors, Ok(s)) => format!(
            "live_tensors ({} tensors, {} bytes, live when recording began)",
            s.live_blocks().count(),
            s.live_requested_bytes()
        ),
        (StartMode::Empty, Ok(_)) => {
            "empty (what the process held before recording is left out)".to_string()
        }
        (StartMode::Exact, Ok(_)) => "exact".to_string(),
    };
    let header = [
        ("trace", trace.name()),
        ("device", trace.device.to_string()),
        ("start", start),
        (
            "recorded_conf",
            recorded
                .conf
                .filter(|c| !c.is_empty())
                .unwrap_or("-")
                .to_string(),
        ),
        (
            "recorded_memory_fraction",
            recorded
                .memory_fraction
                .map_or("-".to_string(), |f| f.to_string()),
        ),
        ("settings", config.settings.to_string()),
        ("handles", program.num_handles().to_string()),
        ("program_ops", program.ops.len().to_string()),
        ("start_allocs", start_allocs.to_string()),
        ("allocs", allocs.to_string()),
    ];
    let left_out = left_out(trace);
    ops.header = header
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .chain(left_out.map(|l| ("left_out".to_string(), l)))
        .collect();
    ops.render()
}

/// What the program holds that the ops format has no line for (one policy per run, no private
/// pools): a settings change at run time and a private pool's release are left out of the
/// written program, which then runs every allocation under one policy, in the default pools —
/// the same operations, for a benchmark, but not the replay that reproduces PyTorch's dump.
/// `None` when nothing is left out.
pub fn left_out(trace: &Trace) -> Option<String> {
    let count = |f: fn(&ReplayOp) -> bool| trace.program.ops.iter().filter(|op| f(op)).count();
    let settings = count(|op| matches!(op, ReplayOp::SetSettings { .. }));
    let pools = count(|op| matches!(op, ReplayOp::ReleaseStream { .. }));
    let mut parts = Vec::new();
    if settings > 0 {
        parts.push(format!("{settings} settings change(s) at run time"));
    }
    if pools > 0 {
        parts.push(format!("{pools} private pool release(s)"));
    }
    (!parts.is_empty()).then(|| {
        format!(
            "{} (the ops format has no line for them: every allocation runs under one policy, \
             in the default pools)",
            parts.join(", ")
        )
    })
}

/// Writes [`render`]'s text to `path`.
pub fn write(path: &Path, trace: &Trace, config: &ReplayConfig) -> Result<(), CliError> {
    let fail = |e: &dyn std::fmt::Display| {
        CliError::run(format!(
            "{}: cannot write the operations: {e}",
            path.display()
        ))
    };
    let mut file = std::fs::File::create(path).map_err(|e| fail(&e))?;
    file.write_all(render(trace, config).as_bytes())
        .map_err(|e| fail(&e))
}

/// Whether `--ops-out` can write the program replayed from `mode` (not PyTorch's adopted
/// layout of a mid-run recording).
pub fn check_exportable(trace: &Trace, mode: StartMode) -> Result<(), CliError> {
    let mid_run = trace.start.as_ref().is_ok_and(|s| !s.is_fresh());
    if mode == StartMode::Exact && mid_run {
        return Err(CliError::input(format!(
            "{}: --ops-out: recording began mid-run, and this replay starts from PyTorch's cached \
             layout at that moment (adopted segment by segment), which no sequence of \
             allocations can rebuild in another allocator; add --start live-tensors to export \
             (and replay) the program from the tensors live when recording began",
            trace.name()
        )));
    }
    Ok(())
}

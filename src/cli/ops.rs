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
    ops.header = header
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    ops.render()
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
    // The ops format replays one policy with no private pools: a settings change or a pool's
    // release would be left out, and the program replayed elsewhere would not be this one.
    let unexportable = trace.program.ops.iter().find_map(|op| match op {
        ReplayOp::SetSettings { .. } => Some("a settings change at run time"),
        ReplayOp::ReleaseStream { .. } => Some("a private pool's release"),
        _ => None,
    });
    if let Some(what) = unexportable {
        return Err(CliError::input(format!(
            "{}: --ops-out: the program holds {what}, which the ops format cannot say",
            trace.name()
        )));
    }
    Ok(())
}

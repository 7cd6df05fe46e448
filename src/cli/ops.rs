//! `cachalot replay --ops-out FILE`: the replay program written as text, one operation a line,
//! exactly as the replay runs it, for another allocator (PyTorch's own, through
//! `scripts/pytorch_replay.py`) to replay the same operations.
//!
//! The one rule: a replayer that follows the format below runs, call for call, what
//! [`cachalot_tools::replay`] runs on the simulated device — the start's live tensors first
//! (in `live_tensors` start mode), then the trace's program, with the same held-back frees.
//!
//! # Format (`cachalot ops v1`)
//!
//! Lines starting with `#` are comments; the first ones are a header of `# key: value` lines
//! (`trace`, `device`, `start`, `recorded_conf`, `recorded_memory_fraction`, `settings`,
//! `handles`, `program_ops`, `start_allocs`, `allocs`). Every other line is one operation,
//! fields separated by one space, numbers in decimal:
//!
//! | line | meaning |
//! |---|---|
//! | `a ID SIZE STREAM` | allocate `SIZE` bytes (the size the program asked for) on stream `STREAM` (the trace's stream handle, 0 the default stream) and keep it as handle `ID`; if the allocation fails (out of memory) the handle stays empty and the lines below that name it do nothing |
//! | `r ID SIDE` | record a use of handle `ID` on side stream `SIDE` (`record_stream`); the side stream's work is still running: it completes at `c SIDE` |
//! | `f ID` | free handle `ID` (the program dropped it); after an `r` line the free is held back until `c SIDE` |
//! | `c SIDE` | side stream `SIDE`'s work has completed (the trace reached the block's `free_completed`); nothing if no use is pending on it |
//! | `e` | `empty_cache()` |
//! | `s` | the start's set-up ends here: the lines before it put the allocator in the state the trace's recording began in, the lines after it are the trace (one line `s` in every file, the first operation line for a trace recorded from an empty allocator) |
//!
//! Handles are dense, `0..handles`. Each held-back free has a side stream of its own, numbered
//! by its handle (`r 7 7`, `f 7`, … `c 7`), as in cachalot's replay. A replayer that repeats
//! the program (steady state) runs the lines after `s` again, having freed every live handle
//! in id order and completed every pending side stream, without `empty_cache()` (cachalot's
//! `--repeat`); the frees of start handles then do nothing.
//!
//! The start: a trace recorded from the process's start (`start: fresh`) needs none. A trace
//! recorded mid-run starts from the tensors live when recording began, allocated in address
//! order before `s` (`start: live_tensors`); one that was pending on another stream is freed
//! at once with an `r` line, completing at the trace's `c`. PyTorch's cached layout (the
//! `exact` start, adopted segment by segment) cannot be written as operations: `--ops-out`
//! refuses it, and `--start live-tensors` exports (and replays) the live-tensors form.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::Path;

use cachalot_tools::replay::{ReplayConfig, StartMode};
use cachalot_tools::snapshot::{ReplayOp, ReplayProgram};

use super::CliError;
use super::input::Trace;

/// The text of the program `config` replays, in the format above.
pub fn render(trace: &Trace, config: &ReplayConfig) -> String {
    let program = &trace.program;
    let start_lines = start_ops(program, config.start);
    let trace_lines = trace_ops(program);
    let count_allocs = |lines: &[String]| lines.iter().filter(|l| l.starts_with("a ")).count();
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
    let mut s = String::new();
    let _ = writeln!(s, "# cachalot ops v1");
    let _ = writeln!(s, "# trace: {}", trace.name());
    let _ = writeln!(s, "# device: {}", trace.device);
    let _ = writeln!(s, "# start: {start}");
    let _ = writeln!(
        s,
        "# recorded_conf: {}",
        trace
            .recorded_conf()
            .filter(|c| !c.is_empty())
            .unwrap_or("-")
    );
    let _ = writeln!(
        s,
        "# recorded_memory_fraction: {}",
        trace
            .recorded_fraction()
            .map_or("-".to_string(), |f| f.to_string())
    );
    let _ = writeln!(s, "# settings: {}", config.settings);
    let _ = writeln!(s, "# handles: {}", program.num_handles());
    let _ = writeln!(s, "# program_ops: {}", program.ops.len());
    let _ = writeln!(s, "# start_allocs: {}", count_allocs(&start_lines));
    let _ = writeln!(s, "# allocs: {}", count_allocs(&trace_lines));
    for line in start_lines
        .iter()
        .chain(["s".to_string()].iter())
        .chain(&trace_lines)
    {
        s.push_str(line);
        s.push('\n');
    }
    s
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

/// The lines that set up `mode`'s start (before `s`), as `Pass::set_up_start` runs them.
fn start_ops(program: &ReplayProgram, mode: StartMode) -> Vec<String> {
    if mode != StartMode::LiveTensors {
        return Vec::new();
    }
    let mut lines = Vec::new();
    for h in &program.initial {
        lines.push(format!("a {} {} {}", h.id, h.requested, h.stream));
        if h.pending {
            lines.push(format!("r {} {}", h.id, h.id));
            lines.push(format!("f {}", h.id));
        }
    }
    lines
}

/// The trace's lines (after `s`), as `Pass::run` runs the program's operations.
fn trace_ops(program: &ReplayProgram) -> Vec<String> {
    let ops = &program.ops;
    let mut lines = Vec::with_capacity(ops.len());
    for (i, op) in ops.iter().enumerate() {
        match *op {
            ReplayOp::Alloc { id, size, stream } => lines.push(format!("a {id} {size} {stream}")),
            ReplayOp::FreeRequested { id } => {
                // Held back when its completion does not follow at once (see `Pass::run`).
                let deferred = !matches!(
                    ops.get(i + 1),
                    Some(ReplayOp::FreeCompleted { id: next }) if *next == id
                );
                if deferred {
                    lines.push(format!("r {id} {id}"));
                }
                lines.push(format!("f {id}"));
            }
            ReplayOp::FreeCompleted { id } => {
                // A plain free's completion follows it at once and has nothing to do.
                let plain = i > 0 && ops[i - 1] == ReplayOp::FreeRequested { id };
                if !plain {
                    lines.push(format!("c {id}"));
                }
            }
            ReplayOp::EmptyCache => lines.push("e".to_string()),
        }
    }
    lines
}

//! The `cachalot ops v1` format: a replay program as text, one operation a line, for another
//! allocator to replay the same operations — PyTorch's own (`scripts/pytorch_replay.py`,
//! `scripts/pytorch_bench.py`) and the side-by-side benchmark's (`benches/gpu_compare.rs`).
//! `cachalot replay --ops-out FILE` writes it ([`OpsProgram::from_replay`], then
//! [`OpsProgram::render`]); the benchmark and `cachalot bench-report` read it
//! ([`OpsProgram::parse`]). One type, its writer and its parser side by side:
//! `parse(render(p)) == p`.
//!
//! The one rule: a replayer that follows the format below runs, call for call, what
//! [`crate::replay`] runs on the simulated device — the start's live tensors first (in
//! `live_tensors` start mode), then the trace's program, with the same held-back frees.
//!
//! # Format (`cachalot ops v1`)
//!
//! The first line is `# cachalot ops v1`. Lines starting with `#` are comments; the first ones
//! are a header of `# key: value` lines (`cachalot replay --ops-out` writes `trace`, `device`,
//! `start`, `recorded_conf`, `recorded_memory_fraction`, `settings`, `handles`, `program_ops`,
//! `start_allocs`, `allocs`). Every other line is one operation, fields separated by one
//! space, numbers in decimal:
//!
//! | line | meaning |
//! |---|---|
//! | `a ID SIZE STREAM` | allocate `SIZE` bytes (the size the program asked for) on stream `STREAM` (the trace's stream handle, 0 the default stream) and keep it as handle `ID`; if the allocation fails (out of memory) the handle stays empty and the lines below that name it do nothing |
//! | `r ID SIDE` | record a use of handle `ID` on side stream `SIDE` (`record_stream`); the side stream's work is still running: it completes at `c SIDE`. Always directly followed by `f ID` |
//! | `f ID` | free handle `ID` (the program dropped it); after an `r` line the free is held back until `c SIDE` |
//! | `c SIDE` | side stream `SIDE`'s work has completed (the trace reached the block's `free_completed`); nothing if no use is pending on it |
//! | `e` | `empty_cache()` |
//! | `s` | the start's set-up ends here: the lines before it put the allocator in the state the trace's recording began in, the lines after it are the trace (one line `s` in every file, the first operation line for a trace recorded from an empty allocator) |
//!
//! `cachalot replay` writes dense handles, `0..handles`, and gives each held-back free a side
//! stream of its own, numbered by its handle (`r 7 7`, `f 7`, … `c 7`), as in cachalot's
//! replay; a reader takes any numbers. A replayer that repeats the program (steady state) runs
//! the lines after `s` again, having freed every live handle in id order and completed every
//! pending side stream, without `empty_cache()` (cachalot's `--repeat`); the frees of start
//! handles then do nothing.
//!
//! The start: a trace recorded from the process's start (`start: fresh`) needs none. A trace
//! recorded mid-run starts from the tensors live when recording began, allocated in address
//! order before `s` (`start: live_tensors`); one that was pending on another stream is freed
//! at once with an `r` line, completing at the trace's `c`. PyTorch's cached layout (the
//! `exact` start, adopted segment by segment) cannot be written as operations: `--ops-out`
//! refuses it, and `--start live-tensors` exports (and replays) the live-tensors form.
//! A settings change at run time and a private pool's release (found by `cachalot replay`)
//! have no line either: the program is written without them, under a `left_out` header line
//! that says so (its allocations then run under one policy, in the default pools).
//!
//! A file is refused, naming the file and the line, when its first line is not the format's,
//! a line is not one of the operations above with its numbers, a handle is allocated again
//! while live, an `r` line is not directly followed by the `f` of its handle, or it has no `s`
//! line or two. A free of a handle never allocated is allowed (an empty start).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::Path;

use crate::replay::program::{ReplayOp, ReplayProgram};
use crate::replay::start::StartMode;

/// The first line of every file.
pub const FIRST_LINE: &str = "# cachalot ops v1";

/// One operation line, with handles, streams and side streams as dense indices into
/// [`OpsProgram::handles`], [`OpsProgram::streams`] and [`OpsProgram::sides`] (numbered in the
/// order the file first names them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// `a ID SIZE STREAM`.
    Alloc {
        /// The handle.
        id: u32,
        /// Bytes asked for.
        size: u64,
        /// The stream.
        stream: u32,
    },
    /// `r ID SIDE` (always directly before `f ID`).
    Record {
        /// The handle.
        id: u32,
        /// The side stream.
        side: u32,
    },
    /// `f ID`.
    Free {
        /// The handle.
        id: u32,
    },
    /// `c SIDE`.
    Complete {
        /// The side stream.
        side: u32,
    },
    /// `e`.
    EmptyCache,
}

/// A `cachalot ops v1` program.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OpsProgram {
    /// The `# key: value` comment lines, in order (a writer puts them right after the first
    /// line).
    pub header: Vec<(String, String)>,
    /// The lines before `s`.
    pub start: Vec<Op>,
    /// The lines after `s`.
    pub trace: Vec<Op>,
    /// Handle index → the file's handle id.
    pub handles: Vec<u64>,
    /// Stream index → the file's stream handle (0: the default stream).
    pub streams: Vec<u64>,
    /// Side index → the file's side stream number.
    pub sides: Vec<u64>,
}

/// Why an ops file was refused: the file, the line (1-based) where known, and what is wrong.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{file}:{}{message}", line.map_or_else(|| " ".to_string(), |l| format!("{l}: ")))]
pub struct OpsError {
    /// The file, as named to [`OpsProgram::parse`].
    pub file: String,
    /// The line.
    pub line: Option<usize>,
    /// What is wrong.
    pub message: String,
}

/// Dense indices for the numbers a file uses.
#[derive(Default)]
struct Dense {
    index: HashMap<u64, u32>,
    values: Vec<u64>,
}

impl Dense {
    fn get(&mut self, value: u64) -> u32 {
        let next = self.values.len() as u32;
        *self.index.entry(value).or_insert_with(|| {
            self.values.push(value);
            next
        })
    }
}

/// An [`OpsProgram`] as it is built, line by line, numbers as the file writes them.
#[derive(Default)]
struct Builder {
    header: Vec<(String, String)>,
    handles: Dense,
    streams: Dense,
    sides: Dense,
    start: Vec<Op>,
    trace: Vec<Op>,
    /// Past the `s` line.
    in_trace: bool,
}

impl Builder {
    fn push(&mut self, op: Op) {
        if self.in_trace {
            self.trace.push(op);
        } else {
            self.start.push(op);
        }
    }

    fn alloc(&mut self, id: u64, size: u64, stream: u64) {
        let op = Op::Alloc {
            id: self.handles.get(id),
            size,
            stream: self.streams.get(stream),
        };
        self.push(op);
    }

    fn record(&mut self, id: u64, side: u64) {
        let op = Op::Record {
            id: self.handles.get(id),
            side: self.sides.get(side),
        };
        self.push(op);
    }

    fn free(&mut self, id: u64) {
        let op = Op::Free {
            id: self.handles.get(id),
        };
        self.push(op);
    }

    fn complete(&mut self, side: u64) {
        let op = Op::Complete {
            side: self.sides.get(side),
        };
        self.push(op);
    }

    fn finish(self) -> OpsProgram {
        OpsProgram {
            header: self.header,
            start: self.start,
            trace: self.trace,
            handles: self.handles.values,
            streams: self.streams.values,
            sides: self.sides.values,
        }
    }
}

impl OpsProgram {
    /// The program `cachalot replay` runs for `program` from start `mode`, as operation lines
    /// (no header): the start's live tensors before `s` in `live_tensors` mode (as
    /// `Interpreter::set_up_start` allocates them), then the program's operations (as
    /// `Interpreter::step` runs them). PyTorch's adopted layout (`exact`) is no sequence of
    /// operations: from it, as from `empty`, the lines before `s` are none.
    pub fn from_replay(program: &ReplayProgram, mode: StartMode) -> OpsProgram {
        let mut b = Builder::default();
        if mode == StartMode::LiveTensors {
            for h in &program.initial {
                b.alloc(h.id as u64, h.requested, h.stream);
                if h.pending {
                    b.record(h.id as u64, h.id as u64);
                    b.free(h.id as u64);
                }
            }
        }
        b.in_trace = true;
        let ops = &program.ops;
        for (i, op) in ops.iter().enumerate() {
            match *op {
                ReplayOp::Alloc { id, size, stream } => b.alloc(id as u64, size, stream),
                ReplayOp::FreeRequested { id } => {
                    // Held back when its completion does not follow at once (as the
                    // interpreter holds it back).
                    let deferred = !matches!(
                        ops.get(i + 1),
                        Some(ReplayOp::FreeCompleted { id: next }) if *next == id
                    );
                    if deferred {
                        b.record(id as u64, id as u64);
                    }
                    b.free(id as u64);
                }
                ReplayOp::FreeCompleted { id } => {
                    // A plain free's completion follows it at once and has nothing to do.
                    let plain = i > 0 && ops[i - 1] == ReplayOp::FreeRequested { id };
                    if !plain {
                        b.complete(id as u64);
                    }
                }
                ReplayOp::EmptyCache => b.push(Op::EmptyCache),
                // The ops format has no line for these (one policy per run; no private pools):
                // left out.
                ReplayOp::SetSettings { .. } | ReplayOp::ReleaseStream { .. } => {}
            }
        }
        b.finish()
    }

    /// The text of the program: the first line, the header, the lines before `s`, `s`, the
    /// lines after it.
    pub fn render(&self) -> String {
        let mut s = String::new();
        s.push_str(FIRST_LINE);
        s.push('\n');
        for (key, value) in &self.header {
            let _ = writeln!(s, "# {key}: {value}");
        }
        for op in &self.start {
            self.write_op(&mut s, op);
        }
        s.push_str("s\n");
        for op in &self.trace {
            self.write_op(&mut s, op);
        }
        s
    }

    fn write_op(&self, s: &mut String, op: &Op) {
        let _ = match *op {
            Op::Alloc { id, size, stream } => writeln!(
                s,
                "a {} {size} {}",
                self.handles[id as usize], self.streams[stream as usize]
            ),
            Op::Record { id, side } => writeln!(
                s,
                "r {} {}",
                self.handles[id as usize], self.sides[side as usize]
            ),
            Op::Free { id } => writeln!(s, "f {}", self.handles[id as usize]),
            Op::Complete { side } => writeln!(s, "c {}", self.sides[side as usize]),
            Op::EmptyCache => writeln!(s, "e"),
        };
    }

    /// Parses the text of an ops file; `file` names it in errors.
    pub fn parse(file: &str, text: &str) -> Result<OpsProgram, OpsError> {
        let bad = |line: usize, message: String| OpsError {
            file: file.to_string(),
            line: Some(line + 1),
            message,
        };
        let mut lines = text.lines().enumerate();
        match lines.next() {
            Some((_, first)) if first.trim_end() == FIRST_LINE => {}
            _ => {
                return Err(bad(
                    0,
                    "not a `cachalot ops v1` file (its first line must be `# cachalot ops v1`)"
                        .into(),
                ));
            }
        }
        let mut b = Builder::default();
        let mut seen_s = false;
        // Per handle: live (allocated and not freed) as the file reads, failures aside.
        let mut live: HashMap<u64, bool> = HashMap::new();
        // A `r ID` waiting for its `f ID`: (line, handle).
        let mut recorded: Option<(usize, u64)> = None;
        let unfollowed = |(at, id): (usize, u64)| {
            bad(
                at,
                format!(
                    "`r {id} ...` must be followed directly by `f {id}` (the free it holds back)"
                ),
            )
        };
        for (n, raw) in lines {
            let line = raw.trim_end();
            if let Some(comment) = line.strip_prefix('#') {
                if let Some((key, value)) = comment.trim_start().split_once(':')
                    && !key.is_empty()
                    && !key.contains(char::is_whitespace)
                {
                    b.header.push((key.to_string(), value.trim().to_string()));
                }
                continue;
            }
            if line.trim().is_empty() {
                continue;
            }
            let fields: Vec<&str> = line.split_ascii_whitespace().collect();
            let (kind, args) = (fields[0], &fields[1..]);
            let (arity, form) = match kind {
                "a" => (3, "a ID SIZE STREAM"),
                "r" => (2, "r ID SIDE"),
                "f" => (1, "f ID"),
                "c" => (1, "c SIDE"),
                "e" => (0, "e"),
                "s" => (0, "s"),
                other => {
                    return Err(bad(
                        n,
                        format!(
                            "unknown operation {other:?} (the operations are a, r, f, c, e, s)"
                        ),
                    ));
                }
            };
            if args.len() != arity {
                return Err(bad(
                    n,
                    format!(
                        "`{kind}` takes {arity} number(s) ({form}), found {}: {line:?}",
                        args.len()
                    ),
                ));
            }
            let mut nums = [0u64; 3];
            for (i, a) in args.iter().enumerate() {
                nums[i] = a.parse().map_err(|_| {
                    bad(
                        n,
                        format!("{a:?} is not a decimal number ({form}): {line:?}"),
                    )
                })?;
            }
            if let Some(r) = recorded
                && !(kind == "f" && nums[0] == r.1)
            {
                return Err(unfollowed(r));
            }
            match kind {
                "a" => {
                    if live.insert(nums[0], true) == Some(true) {
                        return Err(bad(
                            n,
                            format!("handle {} is allocated again while live", nums[0]),
                        ));
                    }
                    b.alloc(nums[0], nums[1], nums[2]);
                }
                "r" => {
                    recorded = Some((n, nums[0]));
                    b.record(nums[0], nums[1]);
                }
                "f" => {
                    live.insert(nums[0], false);
                    recorded = None;
                    b.free(nums[0]);
                }
                "c" => b.complete(nums[0]),
                "e" => b.push(Op::EmptyCache),
                _ => {
                    if seen_s {
                        return Err(bad(n, "a second `s` line (there is one per file)".into()));
                    }
                    seen_s = true;
                    b.in_trace = true;
                }
            }
        }
        if let Some(r) = recorded {
            return Err(unfollowed(r));
        }
        if !seen_s {
            return Err(OpsError {
                file: file.to_string(),
                line: None,
                message: "no `s` line (every ops file has one, where the trace begins)".into(),
            });
        }
        Ok(b.finish())
    }

    /// Reads and parses an ops file; errors name it as `path` displays.
    pub fn read(path: &Path) -> Result<OpsProgram, OpsError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| OpsError {
            file: file.clone(),
            line: None,
            message: format!("cannot read: {e}"),
        })?;
        OpsProgram::parse(&file, &text)
    }

    /// The value of the header's last `key` line.
    pub fn header_value(&self, key: &str) -> Option<&str> {
        self.header
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// `a` lines before `s` and after it.
    pub fn allocs(&self) -> (usize, usize) {
        let count = |ops: &[Op]| {
            ops.iter()
                .filter(|op| matches!(op, Op::Alloc { .. }))
                .count()
        };
        (count(&self.start), count(&self.trace))
    }

    /// The most bytes in use at once, the start included: live allocations plus frees held
    /// back behind a side stream (`r ID SIDE`, `f ID`, … `c SIDE`) — the least any allocator
    /// must hold.
    ///
    /// ```
    /// use cachalot_tools::ops::OpsProgram;
    /// // 10 live, then 10 more; the first is freed behind side stream 0, which completes last.
    /// let text = "# cachalot ops v1\ns\na 0 10 0\na 1 10 0\nr 0 0\nf 0\na 2 5 0\nc 0\n";
    /// assert_eq!(OpsProgram::parse("x.ops", text).unwrap().peak_in_use(), 25);
    /// ```
    pub fn peak_in_use(&self) -> u64 {
        let mut live: Vec<Option<u64>> = vec![None; self.handles.len()];
        let mut recorded: Vec<Option<u32>> = vec![None; self.handles.len()];
        let mut held: Vec<u64> = vec![0; self.sides.len()];
        let (mut now, mut peak) = (0u64, 0u64);
        for op in self.start.iter().chain(&self.trace) {
            match *op {
                Op::Alloc { id, size, .. } => {
                    live[id as usize] = Some(size);
                    now += size;
                    peak = peak.max(now);
                }
                Op::Record { id, side } => {
                    if live[id as usize].is_some() {
                        recorded[id as usize] = Some(side);
                    }
                }
                Op::Free { id } => {
                    if let Some(size) = live[id as usize].take() {
                        match recorded[id as usize].take() {
                            Some(side) => held[side as usize] += size,
                            None => now -= size,
                        }
                    }
                }
                Op::Complete { side } => now -= std::mem::take(&mut held[side as usize]),
                Op::EmptyCache => {}
            }
        }
        peak
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# cachalot ops v1\n# trace: t.pickle\n# settings: x:1,y:2\n\
                        a 5 100 0\nr 5 5\nf 5\na 7 3 9\ns\na 2 10 0\nr 2 11\nf 2\nf 7\n\
                        c 5\nc 11\ne\na 7 4 0\nf 9\n";

    #[test]
    fn a_program_renders_to_the_text_it_was_parsed_from_and_back() {
        let p = OpsProgram::parse("t.ops", TEXT).unwrap();
        assert_eq!(p.render(), TEXT);
        assert_eq!(OpsProgram::parse("t.ops", &p.render()).unwrap(), p);
        assert_eq!(p.handles, [5, 7, 2, 9]);
        assert_eq!(p.streams, [0, 9]);
        assert_eq!(p.sides, [5, 11]);
        assert_eq!(p.header_value("settings"), Some("x:1,y:2"));
        assert_eq!(p.allocs(), (2, 2));
        assert_eq!(
            p.trace[..3],
            [
                Op::Alloc {
                    id: 2,
                    size: 10,
                    stream: 0
                },
                Op::Record { id: 2, side: 1 },
                Op::Free { id: 2 }
            ]
        );
        // 103 at the start (5 held back until `c 5`); 113 with handle 2 live.
        assert_eq!(p.peak_in_use(), 113);
    }
}

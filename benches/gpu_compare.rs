//! The Rust side of the side-by-side GPU benchmark (docs/GPU_BENCH.md): every `cachalot ops v1`
//! program given (written by `cachalot replay --ops-out`, or by `scripts/synthetic_ops.py`) runs
//! through cachalot's three allocators, CUDA's stream-ordered pool and plain `cuMemAlloc`, and
//! each (allocator, trace) is written as one `cachalot gpu-bench v1` JSON object under
//! `OUT/runs/`; then the hot loops (1 MiB alloc+free pairs from 1, 2, 4 and 8 threads).
//!
//! ```text
//! gpu_compare --out DIR [--backend cuda|sim] [--passes N] [--malloc-prefix LINES]
//!             [--only ALLOC,...] [--hot-pairs N] [--no-hot] [--no-traces] OPS...
//! ```
//!
//! On a GPU machine: `cargo run --release --example gpu_compare -- --out bench
//! /tmp/bert_infer.ops`. `--backend sim` runs cachalot's three allocators on the simulated
//! device instead (no GPU needed; the pool and `cuMemAlloc` are skipped), which is what CI runs.
//!
//! The one rule: one interpreter ([`State::step`]) runs every allocator, through the small
//! [`Target`] trait, with the semantics of docs/GPU_BENCH.md's table; the allocators differ only
//! behind it. cachalot's allocators are the thread-safe front end (`Allocator<B>`) over the
//! device `cachalot replay --backend cuda` replays on (`cachalot_tools::replay::HeldBackDevice`):
//! the trace's streams mapped to real streams, a held-back free's event complete only once the
//! trace has reached its `c` line.
//!
//! This file is also compiled into tests (`tests/bench_compare_sim.rs`,
//! `tests/bench_agreement.rs`) through `#[path]`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier};
use std::time::Instant;

use cachalot::baselines::{BaselineError, DriverBlock, DriverMalloc, PoolBlock, StreamOrderedPool};
use cachalot::cuda::cudarc::driver::{CudaContext, CudaStream};
use cachalot::cuda::{CudaAllocator, CudaBackend, device_count, stream_id};
use cachalot::{Allocator, Backend, CachingCore, Error, Settings, SimDevice, StreamId};
use cachalot_tools::replay::{HeldBackDevice, side_stream};
use serde::Serialize;

/// The result files' schema.
const SCHEMA: &str = "cachalot gpu-bench v1";
/// The simulated device of `--backend sim`: an H200's 141 GiB.
const SIM_CAPACITY: u64 = 141 << 30;
/// The hot loops' allocation size.
const HOT_SIZE: usize = 1 << 20;
/// The hot loops' thread counts.
const HOT_THREADS: [usize; 4] = [1, 2, 4, 8];
/// The timeline's most points.
const TIMELINE_POINTS: usize = 1000;

/// The allocators, in the order they run.
const ALLOCATORS: [&str; 5] = [
    "cachalot-pytorch",
    "cachalot-expandable",
    "cachalot",
    "cuda-pool",
    "cumemalloc",
];

const USAGE: &str = "usage: gpu_compare --out DIR [--backend cuda|sim] [--passes N] \
[--malloc-prefix LINES] [--only ALLOC,...] [--hot-pairs N] [--no-hot] [--no-traces] \
[--cachalot-config CONF] OPS...
  --out DIR             where the results go (DIR/runs/*.json)
  --backend cuda|sim    the GPU (default) or cachalot's simulated device (pool and cuMemAlloc skipped)
  --passes N            timed passes over each trace (default 3; the first is the fresh allocator's)
  --malloc-prefix LINES cuMemAlloc runs the first LINES lines after `s` only (default 4000)
  --only ALLOC,...      only these of cachalot-pytorch, cachalot-expandable, cachalot, cuda-pool, cumemalloc
  --hot-pairs N         alloc+free pairs of a hot loop, all threads together (default 2000000;
                        cuMemAlloc does N/1000)
  --no-hot              no hot loops
  --no-traces           no trace runs (then no OPS needed)
  --cachalot-config CONF  settings over cachalot's policy for the `cachalot` allocator
                        (e.g. reclaim_headroom:0.1), written into each run's notes";

/// Why the program stops.
#[derive(Debug)]
pub enum Failure {
    /// `--help`: the usage, exit code 0.
    Help,
    /// A bad command line (exit code 2, with the usage).
    Usage(String),
    /// A bad ops file (exit code 2).
    Input(String),
    /// A failure while running: a driver or allocator error other than out of memory, or
    /// writing the results (exit code 1).
    Run(String),
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Help => f.write_str(USAGE),
            Failure::Usage(m) => write!(f, "{m}\n{USAGE}"),
            Failure::Input(m) | Failure::Run(m) => f.write_str(m),
        }
    }
}

fn run_err(what: impl std::fmt::Display) -> Failure {
    Failure::Run(what.to_string())
}

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(Failure::Help) => {
            println!("{USAGE}");
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("gpu_compare: {e}");
            std::process::ExitCode::from(match e {
                Failure::Help | Failure::Usage(_) | Failure::Input(_) => 2,
                Failure::Run(_) => 1,
            })
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The command line.

/// Where the allocators run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// The first CUDA device.
    Cuda,
    /// cachalot's simulated device.
    Sim,
}

/// The parsed command line.
#[derive(Debug)]
pub struct Options {
    /// The results' directory.
    pub out: PathBuf,
    /// Where to run.
    pub backend: BackendKind,
    /// Timed passes per (allocator, trace).
    pub passes: usize,
    /// Lines after `s` that cuMemAlloc runs.
    pub malloc_prefix: usize,
    /// The allocators to run.
    pub only: Vec<&'static str>,
    /// Pairs of a hot loop, all threads together.
    pub hot_pairs: u64,
    /// Run the hot loops.
    pub hot: bool,
    /// Run the traces.
    pub traces: bool,
    /// The ops files.
    pub ops: Vec<PathBuf>,
    /// Settings applied over `Settings::cachalot()` for the `cachalot` allocator.
    pub cachalot_config: Option<String>,
}

fn parse_number(option: &str, value: Option<&String>, min: u64) -> Result<u64, Failure> {
    let value = value.ok_or_else(|| Failure::Usage(format!("{option} needs a value")))?;
    let n: u64 = value.parse().map_err(|_| {
        Failure::Usage(format!(
            "{option} {value:?}: not a whole number of at least {min}"
        ))
    })?;
    if n < min {
        return Err(Failure::Usage(format!(
            "{option} {n}: must be at least {min}"
        )));
    }
    Ok(n)
}

/// Parses the arguments (without the program's name).
pub fn parse_options(args: &[String]) -> Result<Options, Failure> {
    let mut o = Options {
        out: PathBuf::new(),
        backend: BackendKind::Cuda,
        passes: 3,
        malloc_prefix: 4000,
        only: ALLOCATORS.to_vec(),
        hot_pairs: 2_000_000,
        hot: true,
        traces: true,
        ops: Vec::new(),
        cachalot_config: None,
    };
    let mut out = None;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--out" => {
                let dir = it
                    .next()
                    .ok_or_else(|| Failure::Usage("--out needs a directory".into()))?;
                out = Some(PathBuf::from(dir));
            }
            "--backend" => {
                o.backend = match it.next().map(String::as_str) {
                    Some("cuda") => BackendKind::Cuda,
                    Some("sim") => BackendKind::Sim,
                    other => {
                        return Err(Failure::Usage(format!(
                            "--backend {}: must be cuda or sim",
                            other.unwrap_or("(nothing)")
                        )));
                    }
                }
            }
            "--passes" => o.passes = parse_number("--passes", it.next(), 1)? as usize,
            "--malloc-prefix" => {
                o.malloc_prefix = parse_number("--malloc-prefix", it.next(), 1)? as usize
            }
            "--hot-pairs" => o.hot_pairs = parse_number("--hot-pairs", it.next(), 8)?,
            "--cachalot-config" => {
                let conf = it
                    .next()
                    .ok_or_else(|| Failure::Usage("--cachalot-config needs settings".into()))?;
                Settings::cachalot()
                    .apply(conf)
                    .map_err(|e| Failure::Usage(format!("--cachalot-config {conf:?}: {e}")))?;
                o.cachalot_config = Some(conf.clone());
            }
            "--only" => {
                let list = it
                    .next()
                    .ok_or_else(|| Failure::Usage("--only needs a list of allocators".into()))?;
                let mut only = Vec::new();
                for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
                    let known = ALLOCATORS.iter().find(|&&k| k == name).ok_or_else(|| {
                        Failure::Usage(format!(
                            "--only: unknown allocator {name:?} (known: {})",
                            ALLOCATORS.join(", ")
                        ))
                    })?;
                    if !only.contains(known) {
                        only.push(*known);
                    }
                }
                if only.is_empty() {
                    return Err(Failure::Usage("--only: no allocator named".into()));
                }
                // Keep the run order.
                o.only = ALLOCATORS
                    .iter()
                    .copied()
                    .filter(|k| only.contains(k))
                    .collect();
            }
            "--no-hot" => o.hot = false,
            "--no-traces" => o.traces = false,
            "-h" | "--help" => return Err(Failure::Help),
            flag if flag.starts_with("--") => {
                return Err(Failure::Usage(format!("unknown option {flag}")));
            }
            file => o.ops.push(PathBuf::from(file)),
        }
    }
    o.out = out.ok_or_else(|| Failure::Usage("--out DIR is required".into()))?;
    if o.traces && o.ops.is_empty() {
        return Err(Failure::Usage(
            "no ops files given (pass --no-traces to run the hot loops only)".into(),
        ));
    }
    Ok(o)
}

// ---------------------------------------------------------------------------------------------
// `cachalot ops v1` programs.

/// One operation line, with handles, streams and side streams as dense indices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// `a ID SIZE STREAM`.
    Alloc {
        /// The handle.
        id: u32,
        /// Bytes asked for.
        size: u64,
        /// The stream (index into [`Program::streams`]).
        stream: u32,
    },
    /// `r ID SIDE` (always directly before `f ID`).
    Record {
        /// The handle.
        id: u32,
        /// The side stream (index into [`Program::sides`]).
        side: u32,
    },
    /// `f ID`.
    Free {
        /// The handle.
        id: u32,
    },
    /// `c SIDE`.
    Complete {
        /// The side stream (index into [`Program::sides`]).
        side: u32,
    },
    /// `e`.
    EmptyCache,
}

/// A parsed ops file.
#[derive(Debug)]
pub struct Program {
    /// The trace's name: the file's stem.
    pub name: String,
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
    /// The header's `settings` line, if any.
    pub settings: Option<String>,
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

/// Parses the text of an ops file; `file` names it in errors.
pub fn parse_program(name: &str, file: &str, text: &str) -> Result<Program, Failure> {
    let mut lines = text.lines().enumerate();
    let bad = |line: usize, what: String| Failure::Input(format!("{file}:{}: {what}", line + 1));
    match lines.next() {
        Some((_, first)) if first.trim_end() == "# cachalot ops v1" => {}
        _ => {
            return Err(bad(
                0,
                "not a `cachalot ops v1` file (its first line must be `# cachalot ops v1`)".into(),
            ));
        }
    }
    let (mut handles, mut streams, mut sides) =
        (Dense::default(), Dense::default(), Dense::default());
    let mut start = Vec::new();
    let mut trace = Vec::new();
    let mut seen_s = false;
    let mut settings = None;
    // Per handle: live (allocated and not freed) as the file reads, failures aside.
    let mut live: Vec<bool> = Vec::new();
    // A `r ID` waiting for its `f ID`: (line, handle).
    let mut recorded: Option<(usize, u32)> = None;
    for (n, raw) in lines {
        let line = raw.trim_end();
        if let Some(comment) = line.strip_prefix('#') {
            if let Some(v) = comment.trim_start().strip_prefix("settings:") {
                settings = Some(v.trim().to_string());
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
                    format!("unknown operation {other:?} (the operations are a, r, f, c, e, s)"),
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
        if let Some((at, id)) = recorded
            && !(kind == "f" && handles.get(nums[0]) == id)
        {
            return Err(bad(
                at,
                format!(
                    "`r {} ...` must be followed directly by `f {}` (the free it holds back)",
                    handles.values[id as usize], handles.values[id as usize]
                ),
            ));
        }
        let mut handle = |id: u64, live: &mut Vec<bool>| {
            let h = handles.get(id);
            if live.len() <= h as usize {
                live.push(false);
            }
            h
        };
        let op = match kind {
            "a" => {
                let id = handle(nums[0], &mut live);
                if live[id as usize] {
                    return Err(bad(
                        n,
                        format!("handle {} is allocated again while live", nums[0]),
                    ));
                }
                live[id as usize] = true;
                Op::Alloc {
                    id,
                    size: nums[1],
                    stream: streams.get(nums[2]),
                }
            }
            "r" => {
                let id = handle(nums[0], &mut live);
                recorded = Some((n, id));
                Op::Record {
                    id,
                    side: sides.get(nums[1]),
                }
            }
            "f" => {
                let id = handle(nums[0], &mut live);
                live[id as usize] = false;
                recorded = None;
                Op::Free { id }
            }
            "c" => Op::Complete {
                side: sides.get(nums[0]),
            },
            "e" => Op::EmptyCache,
            _ => {
                if seen_s {
                    return Err(bad(n, "a second `s` line (there is one per file)".into()));
                }
                seen_s = true;
                continue;
            }
        };
        if seen_s {
            trace.push(op);
        } else {
            start.push(op);
        }
    }
    if let Some((at, id)) = recorded {
        return Err(bad(
            at,
            format!(
                "`r {} ...` must be followed directly by `f {}` (the free it holds back)",
                handles.values[id as usize], handles.values[id as usize]
            ),
        ));
    }
    if !seen_s {
        return Err(Failure::Input(format!(
            "{file}: no `s` line (every ops file has one, where the trace begins)"
        )));
    }
    Ok(Program {
        name: name.to_string(),
        start,
        trace,
        handles: handles.values,
        streams: streams.values,
        sides: sides.values,
        settings,
    })
}

/// Reads and parses an ops file; the trace's name is the file's stem.
pub fn read_program(path: &Path) -> Result<Program, Failure> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Failure::Input(format!("{}: cannot read: {e}", path.display())))?;
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .map(|n| n.strip_suffix(".ops").unwrap_or(n))
        .filter(|n| !n.is_empty())
        .ok_or_else(|| Failure::Input(format!("{}: no usable file name", path.display())))?;
    parse_program(name, &path.display().to_string(), &text)
}

// ---------------------------------------------------------------------------------------------
// The allocators, behind one trait.

/// What an allocator reports after a line of the observed pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct Reading {
    /// Reserved bytes.
    pub reserved: u64,
    /// Allocated bytes, where the allocator tells.
    pub allocated: Option<u64>,
    /// Device allocations (or map steps) so far, as the allocator counts them.
    pub device_allocs: u64,
}

/// An allocator as the interpreter drives it. `stream` is an index into [`Program::streams`];
/// `side` a side stream's number as the file writes it.
pub trait Target {
    /// One allocation.
    type Block;
    /// Allocates; `Ok(None)` for out of memory.
    fn alloc(&mut self, size: u64, stream: usize) -> Result<Option<Self::Block>, Failure>;
    /// Frees (after [`Target::record`], held back until [`Target::complete`] of its side).
    fn free(&mut self, block: Self::Block, stream: usize) -> Result<(), Failure>;
    /// Records a use of `block` on side stream `side`, still running.
    fn record(&mut self, block: &Self::Block, side: u64) -> Result<(), Failure>;
    /// Side stream `side`'s work has completed.
    fn complete(&mut self, side: u64) -> Result<(), Failure>;
    /// `e`.
    fn empty_cache(&mut self) -> Result<(), Failure>;
    /// The allocator's figures now.
    fn observe(&mut self) -> Result<Reading, Failure>;
    /// Memory calls so far as the allocator counts them, and what they were; `None` if it
    /// does not count them.
    fn driver_calls(&mut self) -> Option<(u64, String)>;
}

/// One of cachalot's allocators: the front end over a [`HeldBackDevice`].
pub struct CachalotTarget<B: Backend> {
    alloc: Allocator<HeldBackDevice<B>>,
    /// Stream index → the trace's stream handle, as the allocator names streams.
    streams: Vec<StreamId>,
}

impl<B: Backend> CachalotTarget<B> {
    /// The allocator with `settings` over `device`, for `program`'s streams.
    pub fn new(
        device: HeldBackDevice<B>,
        settings: Settings,
        program: &Program,
    ) -> Result<Self, Failure> {
        let core = CachingCore::new(device, settings)
            .map_err(|e| run_err(format!("cannot build the allocator: {e}")))?;
        Ok(CachalotTarget {
            alloc: Allocator::from_core(core),
            streams: program.streams.iter().map(|&s| StreamId(s)).collect(),
        })
    }
}

fn fail(what: &str, e: impl std::fmt::Display) -> Failure {
    run_err(format!("{what}: {e}"))
}

impl<B: Backend> Target for CachalotTarget<B> {
    type Block = u64;

    #[inline]
    fn alloc(&mut self, size: u64, stream: usize) -> Result<Option<u64>, Failure> {
        match self.alloc.malloc(size, self.streams[stream]) {
            Ok(p) => Ok(Some(p)),
            Err(e) if e.is_out_of_memory() || matches!(e, Error::TooLarge { .. }) => Ok(None),
            Err(e) => Err(fail(&format!("malloc({size})"), e)),
        }
    }

    #[inline]
    fn free(&mut self, block: u64, _stream: usize) -> Result<(), Failure> {
        // A zero-byte allocation is address 0 and holds nothing.
        if block == 0 {
            return Ok(());
        }
        self.alloc
            .free(block)
            .map_err(|e| fail(&format!("free({block:#x})"), e))
    }

    fn record(&mut self, block: &u64, side: u64) -> Result<(), Failure> {
        if *block == 0 {
            return Ok(());
        }
        self.alloc
            .record_stream(*block, side_stream(side as usize))
            .map_err(|e| fail(&format!("record_stream({block:#x})"), e))
    }

    fn complete(&mut self, side: u64) -> Result<(), Failure> {
        self.alloc
            .with_backend(|d| d.complete(side_stream(side as usize)));
        Ok(())
    }

    fn empty_cache(&mut self) -> Result<(), Failure> {
        self.alloc.empty_cache().map_err(|e| fail("empty_cache", e))
    }

    fn observe(&mut self) -> Result<Reading, Failure> {
        let s = self.alloc.stats();
        Ok(Reading {
            reserved: s.reserved_bytes.all.current as u64,
            allocated: Some(s.allocated_bytes.all.current as u64),
            device_allocs: s.num_device_alloc,
        })
    }

    fn driver_calls(&mut self) -> Option<(u64, String)> {
        let s = self.alloc.stats();
        let c = self.alloc.with_backend(|d| d.calls());
        Some((
            s.num_device_alloc + s.num_device_free,
            format!(
                "device allocs {}, frees {}, map steps {}, unmaps {}",
                c.allocs, c.frees, c.maps, c.unmaps
            ),
        ))
    }
}

/// Frees held back until their side stream completes, for the baselines (which have no
/// `record_stream`).
struct Deferred<T> {
    /// Address → the side stream its free waits for.
    recorded: HashMap<u64, u64>,
    /// Side stream → the frees waiting for it.
    waiting: HashMap<u64, Vec<(T, usize)>>,
}

impl<T> Deferred<T> {
    fn new() -> Self {
        Deferred {
            recorded: HashMap::new(),
            waiting: HashMap::new(),
        }
    }

    fn record(&mut self, address: u64, side: u64) {
        if address != 0 {
            self.recorded.insert(address, side);
        }
    }

    /// The block back if it is to be freed now, `None` if it waits for its side stream.
    #[inline]
    fn free(&mut self, address: u64, block: T, stream: usize) -> Option<T> {
        if self.recorded.is_empty() {
            return Some(block);
        }
        match self.recorded.remove(&address) {
            Some(side) => {
                self.waiting.entry(side).or_default().push((block, stream));
                None
            }
            None => Some(block),
        }
    }

    fn complete(&mut self, side: u64) -> Vec<(T, usize)> {
        self.waiting.remove(&side).unwrap_or_default()
    }
}

/// CUDA's stream-ordered pool.
pub struct PoolTarget {
    pool: StreamOrderedPool,
    streams: Vec<Arc<CudaStream>>,
    deferred: Deferred<PoolBlock>,
}

fn baseline(what: &str, e: BaselineError) -> Failure {
    fail(what, e)
}

impl Target for PoolTarget {
    type Block = PoolBlock;

    #[inline]
    fn alloc(&mut self, size: u64, stream: usize) -> Result<Option<PoolBlock>, Failure> {
        let bytes = usize::try_from(size).unwrap_or(usize::MAX);
        match self.pool.alloc(bytes, &self.streams[stream]) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.is_out_of_memory() => Ok(None),
            Err(e) => Err(baseline("the pool's alloc", e)),
        }
    }

    #[inline]
    fn free(&mut self, block: PoolBlock, stream: usize) -> Result<(), Failure> {
        match self.deferred.free(block.address(), block, stream) {
            Some(block) => self
                .pool
                .free(block, &self.streams[stream])
                .map_err(|e| baseline("the pool's free", e)),
            None => Ok(()),
        }
    }

    fn record(&mut self, block: &PoolBlock, side: u64) -> Result<(), Failure> {
        self.deferred.record(block.address(), side);
        Ok(())
    }

    fn complete(&mut self, side: u64) -> Result<(), Failure> {
        for (block, stream) in self.deferred.complete(side) {
            self.pool
                .free(block, &self.streams[stream])
                .map_err(|e| baseline("the pool's free", e))?;
        }
        Ok(())
    }

    fn empty_cache(&mut self) -> Result<(), Failure> {
        self.pool
            .context()
            .synchronize()
            .map_err(|e| fail("cuCtxSynchronize", e))?;
        self.pool
            .trim(0)
            .map_err(|e| baseline("cuMemPoolTrimTo", e))
    }

    fn observe(&mut self) -> Result<Reading, Failure> {
        Ok(Reading {
            reserved: self
                .pool
                .reserved_current()
                .map_err(|e| baseline("reading the pool", e))?,
            allocated: Some(
                self.pool
                    .used_current()
                    .map_err(|e| baseline("reading the pool", e))?,
            ),
            device_allocs: 0,
        })
    }

    fn driver_calls(&mut self) -> Option<(u64, String)> {
        None
    }
}

/// Plain `cuMemAlloc` / `cuMemFree`.
pub struct MallocTarget {
    malloc: DriverMalloc,
    /// The device's used memory when the target was made.
    base: u64,
    deferred: Deferred<DriverBlock>,
    allocs: u64,
    frees: u64,
}

impl MallocTarget {
    fn release(&mut self, block: DriverBlock) -> Result<(), Failure> {
        let real = block.address() != 0;
        self.malloc
            .free(block)
            .map_err(|e| baseline("cuMemFree", e))?;
        self.frees += u64::from(real);
        Ok(())
    }
}

impl Target for MallocTarget {
    type Block = DriverBlock;

    fn alloc(&mut self, size: u64, _stream: usize) -> Result<Option<DriverBlock>, Failure> {
        let bytes = usize::try_from(size).unwrap_or(usize::MAX);
        match self.malloc.alloc(bytes) {
            Ok(b) => {
                self.allocs += u64::from(b.address() != 0);
                Ok(Some(b))
            }
            Err(e) if e.is_out_of_memory() => Ok(None),
            Err(e) => Err(baseline("cuMemAlloc", e)),
        }
    }

    fn free(&mut self, block: DriverBlock, stream: usize) -> Result<(), Failure> {
        match self.deferred.free(block.address(), block, stream) {
            Some(block) => self.release(block),
            None => Ok(()),
        }
    }

    fn record(&mut self, block: &DriverBlock, side: u64) -> Result<(), Failure> {
        self.deferred.record(block.address(), side);
        Ok(())
    }

    fn complete(&mut self, side: u64) -> Result<(), Failure> {
        for (block, _) in self.deferred.complete(side) {
            self.release(block)?;
        }
        Ok(())
    }

    fn empty_cache(&mut self) -> Result<(), Failure> {
        Ok(())
    }

    fn observe(&mut self) -> Result<Reading, Failure> {
        let used = self
            .malloc
            .device_used_bytes()
            .map_err(|e| baseline("cuMemGetInfo", e))?;
        Ok(Reading {
            reserved: used.saturating_sub(self.base),
            allocated: None,
            device_allocs: self.allocs,
        })
    }

    fn driver_calls(&mut self) -> Option<(u64, String)> {
        Some((
            self.allocs + self.frees,
            format!("cuMemAlloc {}, cuMemFree {}", self.allocs, self.frees),
        ))
    }
}

// ---------------------------------------------------------------------------------------------
// The interpreter.

/// What one line did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Executed {
    Allocated,
    AllocationFailed,
    Other,
}

/// One pass's program state: which handle holds which block, which side streams have a
/// held-back free pending, and the live requested bytes.
struct State<K> {
    /// Per handle: its block, requested size and stream.
    slots: Vec<Option<(K, u64, u32)>>,
    /// Per side stream: a held-back free waits for it.
    pending: Vec<bool>,
    /// The side stream of the `r` line just run, for the `f` that follows it.
    recording: Option<u32>,
    requested: u64,
    /// Handles in id order, side streams in number order (for [`State::release_all`]).
    handle_order: Vec<u32>,
    side_order: Vec<u32>,
}

impl<K> State<K> {
    fn new(program: &Program) -> State<K> {
        let order = |values: &[u64]| {
            let mut o: Vec<u32> = (0..values.len() as u32).collect();
            o.sort_by_key(|&i| values[i as usize]);
            o
        };
        State {
            slots: (0..program.handles.len()).map(|_| None).collect(),
            pending: vec![false; program.sides.len()],
            recording: None,
            requested: 0,
            handle_order: order(&program.handles),
            side_order: order(&program.sides),
        }
    }

    /// Runs one line.
    #[inline]
    fn step<T: Target<Block = K>>(
        &mut self,
        target: &mut T,
        program: &Program,
        op: Op,
    ) -> Result<Executed, Failure> {
        match op {
            Op::Alloc { id, size, stream } => {
                // The parser refuses a second allocation of a live handle; after a failed one
                // the slot is empty.
                match target.alloc(size, stream as usize)? {
                    Some(block) => {
                        self.slots[id as usize] = Some((block, size, stream));
                        self.requested += size;
                        Ok(Executed::Allocated)
                    }
                    None => Ok(Executed::AllocationFailed),
                }
            }
            Op::Record { id, side } => {
                if let Some((block, _, _)) = &self.slots[id as usize] {
                    target.record(block, program.sides[side as usize])?;
                    self.recording = Some(side);
                }
                Ok(Executed::Other)
            }
            Op::Free { id } => {
                let recording = self.recording.take();
                if let Some((block, size, stream)) = self.slots[id as usize].take() {
                    self.requested -= size;
                    target.free(block, stream as usize)?;
                    if let Some(side) = recording {
                        self.pending[side as usize] = true;
                    }
                }
                Ok(Executed::Other)
            }
            Op::Complete { side } => {
                if std::mem::take(&mut self.pending[side as usize]) {
                    target.complete(program.sides[side as usize])?;
                }
                Ok(Executed::Other)
            }
            Op::EmptyCache => {
                target.empty_cache()?;
                Ok(Executed::Other)
            }
        }
    }

    /// Frees every live handle in id order and completes every pending side stream, so the
    /// next pass starts from the same program state.
    fn release_all<T: Target<Block = K>>(
        &mut self,
        target: &mut T,
        program: &Program,
    ) -> Result<(), Failure> {
        for &h in &self.handle_order {
            if let Some((block, size, stream)) = self.slots[h as usize].take() {
                self.requested -= size;
                target.free(block, stream as usize)?;
            }
        }
        for &s in &self.side_order {
            if std::mem::take(&mut self.pending[s as usize]) {
                target.complete(program.sides[s as usize])?;
            }
        }
        self.recording = None;
        Ok(())
    }
}

/// What the observed pass measured.
#[derive(Debug, Default)]
pub struct Observed {
    /// `a` lines after `s`.
    pub allocs: usize,
    /// Failed allocations (the start's included).
    pub ooms: u64,
    /// Peak live requested bytes.
    pub peak_requested: u64,
    /// Peak reserved bytes.
    pub peak_reserved: u64,
    /// Peak allocated bytes, where the allocator tells.
    pub peak_allocated: Option<u64>,
    /// Memory calls and what they were.
    pub driver_calls: Option<(u64, String)>,
    /// Lines after which reserved memory differs from before.
    pub reserved_changes: usize,
    /// Allocations after which reserved memory did not grow and no device allocation was
    /// counted.
    pub cache_hits: usize,
    /// After `s` (line 0) and after each line: (line, requested, reserved).
    pub timeline: Vec<(usize, u64, u64)>,
}

/// The observed pass: the start, then `lines` lines after `s`, reading the allocator after
/// each; then everything is released.
pub fn observed_pass<T: Target>(
    target: &mut T,
    program: &Program,
    lines: usize,
) -> Result<Observed, Failure> {
    let mut st = State::new(program);
    let mut o = Observed::default();
    for &op in &program.start {
        if st.step(target, program, op)? == Executed::AllocationFailed {
            o.ooms += 1;
        }
    }
    let mut prev = target.observe()?;
    o.timeline.reserve(lines + 1);
    let note = |o: &mut Observed, line: usize, requested: u64, r: &Reading| {
        o.timeline.push((line, requested, r.reserved));
        o.peak_requested = o.peak_requested.max(requested);
        o.peak_reserved = o.peak_reserved.max(r.reserved);
        if let Some(a) = r.allocated {
            o.peak_allocated = Some(o.peak_allocated.unwrap_or(0).max(a));
        }
    };
    note(&mut o, 0, st.requested, &prev);
    for (i, &op) in program.trace[..lines].iter().enumerate() {
        let done = st.step(target, program, op)?;
        let now = target.observe()?;
        match done {
            Executed::Allocated => {
                o.allocs += 1;
                if now.reserved <= prev.reserved && now.device_allocs == prev.device_allocs {
                    o.cache_hits += 1;
                }
            }
            Executed::AllocationFailed => {
                o.allocs += 1;
                o.ooms += 1;
            }
            Executed::Other => {}
        }
        if now.reserved != prev.reserved {
            o.reserved_changes += 1;
        }
        note(&mut o, i + 1, st.requested, &now);
        prev = now;
    }
    o.driver_calls = target.driver_calls();
    st.release_all(target, program)?;
    Ok(o)
}

/// The timed passes: the start (untimed), `lines` lines after `s` on the fresh allocator, then
/// `passes - 1` more times, each after releasing everything (untimed). Nanoseconds per line:
/// the first pass, and the mean of the others (`None` with one pass); and the driver calls
/// per pass after the first (`None` with one pass, or where the allocator does not count).
pub fn timed_passes<T: Target>(
    target: &mut T,
    program: &Program,
    lines: usize,
    passes: usize,
) -> Result<(f64, Option<f64>, Option<f64>), Failure> {
    let mut st = State::new(program);
    for &op in &program.start {
        st.step(target, program, op)?;
    }
    let ops = &program.trace[..lines];
    let per_line = lines.max(1) as f64;
    let t = Instant::now();
    for &op in ops {
        st.step(target, program, op)?;
    }
    let first = t.elapsed().as_nanos() as f64 / per_line;
    st.release_all(target, program)?;
    let calls_before = target.driver_calls().map(|(n, _)| n);
    let mut steady_ns = 0u128;
    for _ in 1..passes {
        let t = Instant::now();
        for &op in ops {
            st.step(target, program, op)?;
        }
        steady_ns += t.elapsed().as_nanos();
        st.release_all(target, program)?;
    }
    let steady = (passes > 1).then(|| steady_ns as f64 / (per_line * (passes - 1) as f64));
    // Driver calls per steady pass (the releases between passes included: they are frees,
    // which unmap nothing without empty_cache).
    let calls = match (calls_before, target.driver_calls()) {
        (Some(before), Some((after, _))) if passes > 1 => {
            Some(after.saturating_sub(before) as f64 / (passes - 1) as f64)
        }
        _ => None,
    };
    Ok((first, steady, calls))
}

// ---------------------------------------------------------------------------------------------
// Results.

/// The memory timeline of a trace run.
#[derive(Debug, Serialize, serde::Deserialize, PartialEq)]
pub struct Timeline {
    /// Lines after `s` run (0: right after `s`).
    pub line: Vec<usize>,
    /// Live requested bytes.
    pub requested: Vec<u64>,
    /// Reserved bytes.
    pub reserved: Vec<u64>,
}

/// At most [`TIMELINE_POINTS`] points: consecutive points in buckets of equal size (the last
/// may be shorter), each bucket giving its first line and its largest requested and reserved.
pub fn downsample(points: &[(usize, u64, u64)]) -> Timeline {
    let per = points.len().div_ceil(TIMELINE_POINTS).max(1);
    let mut t = Timeline {
        line: Vec::new(),
        requested: Vec::new(),
        reserved: Vec::new(),
    };
    for bucket in points.chunks(per) {
        t.line.push(bucket[0].0);
        t.requested
            .push(bucket.iter().map(|p| p.1).max().unwrap_or(0));
        t.reserved
            .push(bucket.iter().map(|p| p.2).max().unwrap_or(0));
    }
    t
}

/// One (allocator, trace) run, as docs/GPU_BENCH.md writes it.
#[derive(Debug, Serialize, serde::Deserialize)]
pub struct TraceRun {
    /// [`SCHEMA`].
    pub schema: String,
    /// `"trace"`.
    pub kind: String,
    /// The allocator's key.
    pub allocator: String,
    /// The trace's name.
    pub trace: String,
    /// Lines after `s` run in each pass.
    pub lines: usize,
    /// Lines after `s` in the file.
    pub total_lines: usize,
    /// `a` lines in one pass.
    pub allocs: usize,
    /// Failed allocations, observed pass.
    pub ooms: u64,
    /// Peak live requested bytes.
    pub peak_requested: u64,
    /// Peak reserved bytes.
    pub peak_reserved: u64,
    /// Peak allocated bytes, or null.
    pub peak_allocated: Option<u64>,
    /// peak_reserved / peak_requested (null when nothing was requested).
    pub ratio: Option<f64>,
    /// Memory calls as the allocator counts them, or null.
    pub driver_calls: Option<u64>,
    /// What they were, or null.
    pub driver_calls_detail: Option<String>,
    /// Driver calls per timed pass after the first (steady state), or null.
    pub driver_calls_steady: Option<f64>,
    /// Lines after which reserved memory changed.
    pub reserved_changes: usize,
    /// Allocations served without growing reserved memory or a device allocation.
    pub cache_hits: usize,
    /// cache_hits / allocs (null without allocations).
    pub hit_rate: Option<f64>,
    /// Timed passes.
    pub passes: usize,
    /// The first timed pass, ns per line.
    pub ns_per_op_first: f64,
    /// The mean of the other passes, ns per line (null with one pass).
    pub ns_per_op_steady: Option<f64>,
    /// The observed pass's memory.
    pub timeline: Timeline,
    /// What the reader must know.
    pub notes: String,
}

/// One hot loop, as docs/GPU_BENCH.md writes it.
#[derive(Debug, Serialize, serde::Deserialize)]
pub struct HotRun {
    /// [`SCHEMA`].
    pub schema: String,
    /// `"hot_loop"`.
    pub kind: String,
    /// The allocator's key.
    pub allocator: String,
    /// `allocator`, `buffer` or `raw`.
    pub path: String,
    /// Bytes per allocation.
    pub size: usize,
    /// Thread counts.
    pub threads: Vec<usize>,
    /// Pairs each thread ran.
    pub pairs_per_thread: Vec<u64>,
    /// Wall time / all threads' pairs.
    pub wall_ns_per_pair: Vec<f64>,
    /// Wall time / one thread's pairs.
    pub ns_per_pair_per_thread: Vec<f64>,
}

fn write_json(out: &Path, file: &str, value: &impl Serialize) -> Result<(), Failure> {
    let dir = out.join("runs");
    std::fs::create_dir_all(&dir).map_err(|e| fail(&format!("creating {}", dir.display()), e))?;
    let path = dir.join(file);
    let text = serde_json::to_string_pretty(value).map_err(|e| fail("writing JSON", e))?;
    std::fs::write(&path, text + "\n").map_err(|e| fail(&format!("writing {}", path.display()), e))
}

fn mib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / (1u64 << 20) as f64)
}

/// Runs one (allocator, trace): the observed pass on one fresh target, the timed passes on
/// another; writes the result and prints its line.
fn run_trace<T: Target>(
    o: &Options,
    key: &str,
    program: &Program,
    lines: usize,
    notes: String,
    make: &mut dyn FnMut() -> Result<T, Failure>,
) -> Result<TraceRun, Failure> {
    let observed = {
        let mut target = make()?;
        observed_pass(&mut target, program, lines)?
    };
    let (first, steady, steady_calls) = {
        let mut target = make()?;
        timed_passes(&mut target, program, lines, o.passes)?
    };
    let (driver_calls, detail) = match observed.driver_calls {
        Some((n, d)) => (Some(n), Some(d)),
        None => (None, None),
    };
    let run = TraceRun {
        schema: SCHEMA.into(),
        kind: "trace".into(),
        allocator: key.into(),
        trace: program.name.clone(),
        lines,
        total_lines: program.trace.len(),
        allocs: observed.allocs,
        ooms: observed.ooms,
        peak_requested: observed.peak_requested,
        peak_reserved: observed.peak_reserved,
        peak_allocated: observed.peak_allocated,
        ratio: (observed.peak_requested > 0)
            .then(|| observed.peak_reserved as f64 / observed.peak_requested as f64),
        driver_calls,
        driver_calls_detail: detail,
        driver_calls_steady: steady_calls,
        reserved_changes: observed.reserved_changes,
        cache_hits: observed.cache_hits,
        hit_rate: (observed.allocs > 0)
            .then(|| observed.cache_hits as f64 / observed.allocs as f64),
        passes: o.passes,
        ns_per_op_first: first,
        ns_per_op_steady: steady,
        timeline: downsample(&observed.timeline),
        notes,
    };
    write_json(&o.out, &format!("{key}__{}.json", program.name), &run)?;
    println!(
        "{:<22} {:<20} {:>10} {:>7} {:>8} {:>7} {:>9} {:>9}{}",
        program.name,
        key,
        mib(run.peak_reserved),
        run.ratio.map_or("-".into(), |r| format!("{r:.3}")),
        run.driver_calls.map_or("-".into(), |n| n.to_string()),
        run.hit_rate
            .map_or("-".into(), |h| format!("{:.1}%", h * 100.0)),
        format!("{:.0}", run.ns_per_op_first),
        run.ns_per_op_steady
            .map_or("-".into(), |s| format!("{s:.0}")),
        if run.ooms > 0 {
            format!("  ({} ooms)", run.ooms)
        } else {
            String::new()
        },
    );
    Ok(run)
}

/// cachalot's settings for an allocator key (`None` for the baselines).
fn cachalot_settings(o: &Options, key: &str) -> Option<Settings> {
    match key {
        "cachalot-pytorch" => Some(Settings::pytorch()),
        "cachalot-expandable" => Some(
            Settings::pytorch()
                .apply("expandable_segments:True")
                .expect("a valid setting"),
        ),
        "cachalot" => Some(match &o.cachalot_config {
            // Checked when the options were read.
            Some(conf) => Settings::cachalot().apply(conf).ok()?,
            None => Settings::cachalot(),
        }),
        _ => None,
    }
}

/// The GPU's context, or why not.
fn cuda_context() -> Result<Arc<CudaContext>, Failure> {
    let n = device_count().map_err(|e| run_err(format!("--backend cuda: {e}")))?;
    if n == 0 {
        return Err(run_err("--backend cuda: no CUDA device"));
    }
    CudaContext::new(0).map_err(|e| fail("creating the CUDA context", e))
}

/// Real streams for `program`'s stream handles: 0 the context's default stream, every other a
/// stream of its own.
fn real_streams(
    ctx: &Arc<CudaContext>,
    program: &Program,
) -> Result<Vec<Arc<CudaStream>>, Failure> {
    program
        .streams
        .iter()
        .map(|&h| {
            if h == 0 {
                Ok(ctx.default_stream())
            } else {
                ctx.new_stream()
                    .map_err(|e| fail("creating a CUDA stream", e))
            }
        })
        .collect()
}

/// cachalot's allocator with `settings` on the GPU, for `program`.
fn cuda_cachalot(
    ctx: &Arc<CudaContext>,
    settings: Settings,
    program: &Program,
) -> Result<CachalotTarget<CudaBackend>, Failure> {
    let mut inner = CudaBackend::new(Arc::clone(ctx)).map_err(|e| fail("the CUDA backend", e))?;
    let side = ctx
        .new_stream()
        .map_err(|e| fail("creating a CUDA stream", e))?;
    inner.retain_stream(&side);
    let real = real_streams(ctx, program)?;
    let mut map = HashMap::new();
    for (s, &h) in real.iter().zip(&program.streams) {
        inner.retain_stream(s);
        map.insert(h, stream_id(s));
    }
    let mut settings = settings;
    // As `CudaAllocator::new` does: cachalot's defaults on a GPU without virtual memory use
    // segments.
    if settings == Settings::cachalot() && !inner.virtual_memory() {
        settings.expandable_segments = false;
    }
    // The backend keeps the streams it retained alive.
    let device = HeldBackDevice::new(inner, map, Some(stream_id(&side)), |_, _| {});
    CachalotTarget::new(device, settings, program)
}

/// cachalot's allocator with `settings` on the simulated device.
pub fn sim_cachalot(
    settings: Settings,
    program: &Program,
) -> Result<CachalotTarget<SimDevice>, Failure> {
    let device = HeldBackDevice::new(
        SimDevice::new(SIM_CAPACITY),
        HashMap::new(),
        None,
        SimDevice::complete_stream,
    );
    CachalotTarget::new(device, settings, program)
}

fn run_traces(
    o: &Options,
    programs: &[Program],
    ctx: Option<&Arc<CudaContext>>,
) -> Result<(), Failure> {
    println!(
        "{:<22} {:<20} {:>10} {:>7} {:>8} {:>7} {:>9} {:>9}",
        "trace", "allocator", "peak MiB", "ratio", "drv calls", "hits", "ns first", "ns steady"
    );
    for program in programs {
        for &key in &o.only {
            let full = program.trace.len();
            match (key, ctx) {
                (_, None) if cachalot_settings(o, key).is_some() => {
                    let settings = cachalot_settings(o, key).unwrap_or_else(Settings::pytorch);
                    let mut notes =
                        format!("simulated device ({} GiB), not a GPU", SIM_CAPACITY >> 30);
                    if let (Some(conf), "cachalot") = (&o.cachalot_config, key) {
                        notes.push_str(&format!("; --cachalot-config {conf}"));
                    }
                    run_trace(o, key, program, full, notes, &mut || {
                        sim_cachalot(settings.clone(), program)
                    })?;
                }
                (_, None) => {}
                (_, Some(ctx)) if cachalot_settings(o, key).is_some() => {
                    let settings = cachalot_settings(o, key).unwrap_or_else(Settings::pytorch);
                    let mut notes = String::new();
                    if settings == Settings::cachalot() {
                        let probe = CudaBackend::new(Arc::clone(ctx))
                            .map_err(|e| fail("the CUDA backend", e))?;
                        if !probe.virtual_memory() {
                            notes = "no virtual memory on this GPU: segments instead of \
                                     expandable segments"
                                .into();
                        }
                    }
                    if let (Some(conf), "cachalot") = (&o.cachalot_config, key) {
                        notes.push_str(&format!("--cachalot-config {conf}"));
                    }
                    run_trace(o, key, program, full, notes, &mut || {
                        cuda_cachalot(ctx, settings.clone(), program)
                    })?;
                }
                ("cuda-pool", Some(ctx)) => {
                    run_trace(o, key, program, full, String::new(), &mut || {
                        Ok(PoolTarget {
                            pool: StreamOrderedPool::new(Arc::clone(ctx))
                                .map_err(|e| baseline("cuMemPoolCreate", e))?,
                            streams: real_streams(ctx, program)?,
                            deferred: Deferred::new(),
                        })
                    })?;
                }
                (_, Some(ctx)) => {
                    let lines = full.min(o.malloc_prefix);
                    let notes = if lines < full {
                        format!(
                            "cuMemAlloc on a prefix: the first {lines} of {full} lines after `s` \
                             (--malloc-prefix); handles still live after it are freed untimed"
                        )
                    } else {
                        String::new()
                    };
                    run_trace(o, key, program, lines, notes, &mut || {
                        let malloc = DriverMalloc::new(Arc::clone(ctx))
                            .map_err(|e| baseline("cuMemAlloc", e))?;
                        let base = malloc
                            .device_used_bytes()
                            .map_err(|e| baseline("cuMemGetInfo", e))?;
                        Ok(MallocTarget {
                            malloc,
                            base,
                            deferred: Deferred::new(),
                            allocs: 0,
                            frees: 0,
                        })
                    })?;
                }
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Hot loops.

/// Wall time per pair for `threads` threads, each doing `per_thread` pairs (`pair(t)` on
/// thread `t`) after `warmup` pairs, from the moment all start to the moment the last ends.
fn wall_per_pair<P>(pair: &P, threads: usize, per_thread: u64, warmup: u64) -> Result<f64, Failure>
where
    P: Fn(usize) -> Result<(), Failure> + Sync,
{
    let start = Barrier::new(threads + 1);
    let end = Barrier::new(threads + 1);
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let (start, end) = (&start, &end);
                s.spawn(move || {
                    let warm = (0..warmup).try_for_each(|_| pair(t));
                    start.wait();
                    let timed = match warm {
                        Ok(()) => (0..per_thread).try_for_each(|_| pair(std::hint::black_box(t))),
                        Err(e) => Err(e),
                    };
                    end.wait();
                    timed
                })
            })
            .collect();
        start.wait();
        let t = Instant::now();
        end.wait();
        let wall = t.elapsed().as_nanos() as f64;
        for w in workers {
            w.join()
                .map_err(|_| run_err("a hot-loop thread panicked"))??;
        }
        Ok(wall / (per_thread * threads as u64) as f64)
    })
}

/// Runs one hot loop at every thread count, writes it and prints its line.
fn hot_loop<P>(
    o: &Options,
    key: &str,
    path: &str,
    total_pairs: u64,
    warmup: u64,
    pair: &P,
) -> Result<(), Failure>
where
    P: Fn(usize) -> Result<(), Failure> + Sync,
{
    let mut run = HotRun {
        schema: SCHEMA.into(),
        kind: "hot_loop".into(),
        allocator: key.into(),
        path: path.into(),
        size: HOT_SIZE,
        threads: HOT_THREADS.to_vec(),
        pairs_per_thread: Vec::new(),
        wall_ns_per_pair: Vec::new(),
        ns_per_pair_per_thread: Vec::new(),
    };
    for threads in HOT_THREADS {
        let per_thread = (total_pairs / threads as u64).max(1);
        let wall = wall_per_pair(pair, threads, per_thread, warmup)?;
        run.pairs_per_thread.push(per_thread);
        run.wall_ns_per_pair.push(wall);
        run.ns_per_pair_per_thread.push(wall * threads as f64);
    }
    write_json(&o.out, &format!("{key}__hot__{path}.json"), &run)?;
    let cells: Vec<String> = run
        .wall_ns_per_pair
        .iter()
        .map(|ns| format!("{ns:>9.1}"))
        .collect();
    println!("{key:<20} {path:<10} {}", cells.join(" "));
    Ok(())
}

/// A hot loop through `Allocator::malloc/free`, each thread on stream `streams[t]`.
fn hot_allocator<B: Backend + Send>(
    o: &Options,
    key: &str,
    alloc: &Allocator<B>,
    streams: &[StreamId],
) -> Result<(), Failure> {
    hot_loop(o, key, "allocator", o.hot_pairs, 1000, &|t: usize| {
        let p = alloc
            .malloc(std::hint::black_box(HOT_SIZE as u64), streams[t])
            .map_err(|e| fail("malloc", e))?;
        alloc
            .free(std::hint::black_box(p))
            .map_err(|e| fail("free", e))
    })
}

fn run_hot(o: &Options, ctx: Option<&Arc<CudaContext>>) -> Result<(), Failure> {
    let heads: Vec<String> = HOT_THREADS
        .iter()
        .map(|t| format!("{:>9}", format!("{t} thr")))
        .collect();
    println!(
        "\nhot loops, {} KiB alloc+free, wall ns per pair\n{:<20} {:<10} {}",
        HOT_SIZE >> 10,
        "allocator",
        "path",
        heads.join(" ")
    );
    let Some(ctx) = ctx else {
        let ids: Vec<StreamId> = (1..=HOT_THREADS[3] as u64).map(StreamId).collect();
        for &key in &o.only {
            if let Some(settings) = cachalot_settings(o, key) {
                let alloc = Allocator::new(SimDevice::new(SIM_CAPACITY), settings)
                    .map_err(|e| fail("cannot build the allocator", e))?;
                hot_allocator(o, key, &alloc, &ids)?;
            }
        }
        return Ok(());
    };
    let streams: Vec<Arc<CudaStream>> = (0..HOT_THREADS[3])
        .map(|_| ctx.new_stream())
        .collect::<Result<_, _>>()
        .map_err(|e| fail("creating a CUDA stream", e))?;
    let ids: Vec<StreamId> = streams.iter().map(|s| stream_id(s)).collect();
    for &key in &o.only {
        if let Some(settings) = cachalot_settings(o, key) {
            {
                let mut backend =
                    CudaBackend::new(Arc::clone(ctx)).map_err(|e| fail("the CUDA backend", e))?;
                for s in &streams {
                    backend.retain_stream(s);
                }
                let mut settings = settings.clone();
                if settings == Settings::cachalot() && !backend.virtual_memory() {
                    settings.expandable_segments = false;
                }
                let alloc = Allocator::new(backend, settings)
                    .map_err(|e| fail("cannot build the allocator", e))?;
                hot_allocator(o, key, &alloc, &ids)?;
            }
            let alloc = CudaAllocator::new(Arc::clone(ctx), settings)
                .map_err(|e| fail("cannot build the CUDA allocator", e))?;
            hot_loop(o, key, "buffer", o.hot_pairs, 1000, &|t: usize| {
                let buf = alloc
                    .alloc_buffer::<u8>(std::hint::black_box(HOT_SIZE), &streams[t])
                    .map_err(|e| fail("alloc_buffer", e))?;
                drop(std::hint::black_box(buf));
                Ok(())
            })?;
        } else if key == "cuda-pool" {
            let pool = StreamOrderedPool::new(Arc::clone(ctx))
                .map_err(|e| baseline("cuMemPoolCreate", e))?;
            hot_loop(o, key, "raw", o.hot_pairs, 1000, &|t: usize| {
                let b = pool
                    .alloc(std::hint::black_box(HOT_SIZE), &streams[t])
                    .map_err(|e| baseline("cuMemAllocFromPoolAsync", e))?;
                pool.free(b, &streams[t])
                    .map_err(|e| baseline("cuMemFreeAsync", e))
            })?;
        } else {
            let malloc =
                DriverMalloc::new(Arc::clone(ctx)).map_err(|e| baseline("cuMemAlloc", e))?;
            let pairs = (o.hot_pairs / 1000).max(HOT_THREADS[3] as u64);
            hot_loop(o, key, "raw", pairs, 10, &|_t: usize| {
                let b = malloc
                    .alloc(std::hint::black_box(HOT_SIZE))
                    .map_err(|e| baseline("cuMemAlloc", e))?;
                malloc.free(b).map_err(|e| baseline("cuMemFree", e))
            })?;
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------

/// Runs the program on its arguments (without the program's name).
pub fn run(args: &[String]) -> Result<(), Failure> {
    let o = parse_options(args)?;
    // Every file is read and checked before anything runs.
    let mut programs: Vec<Program> = Vec::new();
    if o.traces {
        for path in &o.ops {
            let p = read_program(path)?;
            if programs.iter().any(|q| q.name == p.name) {
                return Err(Failure::Input(format!(
                    "{}: a second trace named {:?} (results are named by the file's stem)",
                    path.display(),
                    p.name
                )));
            }
            programs.push(p);
        }
    }
    std::fs::create_dir_all(o.out.join("runs"))
        .map_err(|e| fail(&format!("creating {}", o.out.display()), e))?;
    let ctx = match o.backend {
        BackendKind::Cuda => {
            let ctx = cuda_context()?;
            println!(
                "GPU: {}",
                ctx.name().unwrap_or_else(|_| "unknown GPU".into())
            );
            Some(ctx)
        }
        BackendKind::Sim => {
            let skipped: Vec<&str> = o
                .only
                .iter()
                .copied()
                .filter(|k| cachalot_settings(&o, k).is_none())
                .collect();
            println!(
                "simulated device ({} GiB){}",
                SIM_CAPACITY >> 30,
                if skipped.is_empty() {
                    String::new()
                } else {
                    format!("; skipped (they need a GPU): {}", skipped.join(", "))
                }
            );
            None
        }
    };
    if o.traces {
        run_traces(&o, &programs, ctx.as_ref())?;
    }
    if o.hot {
        run_hot(&o, ctx.as_ref())?;
    }
    Ok(())
}

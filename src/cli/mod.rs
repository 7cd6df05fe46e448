//! The `cachalot` command line: argument parsing, and the error type that decides the exit
//! code.
//!
//! The one rule: bad input (a file that is not a snapshot, a configuration string that does
//! not parse) is the user's to fix and exits with code 2 and a message naming the file or the
//! key; a failure while running (the device, writing an output) exits with code 1. Nothing
//! the user gives makes the program panic.

mod bench_report;
mod compare;
mod cuda;
mod explain;
mod fit;
mod input;
mod ops;
mod plot;
mod replay;
mod units;

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

/// Replay real PyTorch memory traces through cachalot's caching allocator: predict a job's GPU
/// memory without a GPU, byte-exact, and try allocator settings on it.
#[derive(Debug, Parser)]
#[command(name = "cachalot", version)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Replay one PyTorch memory snapshot and report peak memory, fragmentation and speed.
    Replay(ReplayArgs),
    /// Replay traces under several settings and print one table.
    Compare(CompareArgs),
    /// The smallest GPU a trace runs on without running out of memory, under each policy;
    /// with --device-memory, whether it fits on that one (exit code 3 when it does not).
    Fit(fit::FitArgs),
    /// What holds the memory at the peak (or any operation): live tensors by allocation
    /// stack, what empty_cache() would give back, what is stranded, and replayed advice.
    Explain(explain::ExplainArgs),
    /// Turn a side-by-side GPU benchmark's run files (docs/GPU_BENCH.md) into a results
    /// file, a CSV, Markdown tables with the targets, and SVG plots.
    BenchReport(bench_report::BenchReportArgs),
}

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
    /// The CUDA device to replay on with --backend cuda.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub gpu: usize,
    /// What the replay of a trace recorded mid-run starts from.
    #[arg(long, value_enum, default_value_t = StartArg::Auto)]
    pub start: StartArg,
    /// Write the program the replay runs, one operation a line (`a ID SIZE STREAM`, `f ID`,
    /// `r ID SIDE`, `c SIDE`, `e`, `s`; format in src/cli/ops.rs), for replaying the same
    /// operations through another allocator (scripts/pytorch_replay.py). A trace recorded
    /// mid-run needs `--start live-tensors`: PyTorch's cached layout is no sequence of
    /// operations.
    #[arg(long, value_name = "FILE")]
    pub ops_out: Option<PathBuf>,
}

/// `cachalot compare`.
#[derive(Debug, clap::Args)]
pub struct CompareArgs {
    /// The snapshots to replay.
    #[arg(required = true)]
    pub traces: Vec<PathBuf>,
    /// Settings to compare, in PYTORCH_CUDA_ALLOC_CONF syntax (repeat the option for more).
    /// The first column is always the baseline: PyTorch's defaults plus the settings each
    /// trace was recorded with. Without any, the columns are the baseline, PyTorch with
    /// expandable segments, and cachalot's own policy. "driver calls" counts device
    /// allocations and frees, or page map and unmap steps under expandable segments.
    #[arg(long, value_name = "CONF")]
    pub config: Vec<String>,
    /// Apply each --config over PyTorch's defaults instead of cachalot's.
    #[arg(long)]
    pub pytorch: bool,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Draw the fragmentation of every trace under every setting as grouped bars (SVG).
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
    /// Passes over each trace (passes after the first measure steady-state speed).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub repeat: u32,
}

/// A failure that ends the program, with its exit code.
#[derive(Debug)]
pub struct CliError {
    /// 2 for bad input, 1 for failures while running, 3 for `cachalot fit`'s "does not fit".
    pub code: u8,
    /// What to print (after `cachalot: `).
    pub message: String,
}

impl CliError {
    /// Bad input: exit code 2.
    pub fn input(message: impl Into<String>) -> CliError {
        CliError {
            code: 2,
            message: message.into(),
        }
    }

    /// A failure while running: exit code 1.
    pub fn run(message: impl Into<String>) -> CliError {
        CliError {
            code: 1,
            message: message.into(),
        }
    }
}

/// Runs the program on `args` (the program's name first, as `std::env::args_os` gives it) and
/// returns its exit code. Bad arguments, `--help` and `--version` print what clap prints and
/// return its code (2, 0, 0) instead of ending the process, so a host program (the Python
/// package's `cachalot` command) can call it.
pub fn run<I, T>(args: I) -> u8
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return u8::try_from(e.exit_code()).unwrap_or(2);
        }
    };
    let result = match &cli.command {
        Command::Replay(args) => replay::run(args),
        Command::Compare(args) => compare::run(args),
        Command::Fit(args) => fit::run(args),
        Command::Explain(args) => explain::run(args),
        Command::BenchReport(args) => bench_report::run(args),
    };
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("cachalot: {}", e.message);
            e.code
        }
    }
}

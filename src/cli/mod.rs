//! The `cachalot` command line: the subcommands (each subcommand's arguments live with it, the
//! error type that decides the exit code in `error.rs`).
//!
//! The one rule: bad input (a file that is not a snapshot, a configuration string that does
//! not parse) is the user's to fix and exits with code 2 and a message naming the file or the
//! key; a failure while running (the device, writing an output) exits with code 1. Nothing
//! the user gives makes the program panic.

mod bench_report;
mod compare;
mod cuda;
mod error;
mod explain;
mod fit;
mod input;
mod ops;
mod plot;
mod replay;
mod replay_report;
mod units;

use clap::{Parser, Subcommand};

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
    Replay(replay::ReplayArgs),
    /// Replay traces under several settings and print one table.
    Compare(compare::CompareArgs),
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

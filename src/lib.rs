//! `cachalot-tools`: the `cachalot` command-line program and the library behind it — PyTorch
//! memory snapshot reading and writing, the reconstruction of the state when recording began,
//! the replay engine, its self-check against the dumped state, the export of a replay as a
//! snapshot and as a `cachalot ops v1` program, and the side-by-side GPU benchmark.
//!
//! The test harness (operations, scenarios, and the driver that runs the allocator and its
//! reference model side by side) is the separate, unpublished `cachalot-harness` crate
//! (`harness/`); this crate depends on no test crate.

pub mod bench;
// The command line (`cli/`) is compiled into the library, so that another program — the Python
// package's `cachalot` command — runs the whole CLI through [`run_cli`]; its modules name this
// crate `cachalot_tools`, as they did from the binary.
extern crate self as cachalot_tools;

mod cli;
pub mod explain;
pub mod export;
pub mod find_fraction;
pub mod find_settings;
pub mod fit;
pub mod ops;
pub mod replay;
pub mod selfcheck;
pub mod snapshot;
pub mod units;

/// Runs the `cachalot` command line on `args` (the program's name first, as
/// `std::env::args_os` gives it) and returns its exit code: 0 on success, 2 for bad input
/// (arguments, a file that is not a snapshot, a configuration that does not parse), 1 for a
/// failure while running, 3 for `cachalot fit`'s "does not fit". `--help` and bad arguments
/// print clap's text and return its code without ending the process.
pub fn run_cli<I, T>(args: I) -> u8
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    cli::run(args)
}

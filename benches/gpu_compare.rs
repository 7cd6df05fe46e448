//! The Rust side of the side-by-side GPU benchmark (docs/GPU_BENCH.md): every `cachalot ops v1`
//! program given (written by `cachalot replay --ops-out`, or by `scripts/synthetic_ops.py`) runs
//! through cachalot's three allocators, CUDA's stream-ordered pool and plain `cuMemAlloc`, and
//! each (allocator, trace) is written as one `cachalot gpu-bench v1` JSON object under
//! `OUT/runs/`; then the hot loops (1 MiB alloc+free pairs from 1, 2, 4 and 8 threads).
//!
//! ```text
//! gpu_compare --out DIR [--backend cuda|sim] [--passes N] [--malloc-prefix LINES]
//!             [--only ALLOC,...] [--hot-pairs N] [--no-hot] [--no-traces]
//!             [--cachalot-config CONF] OPS...
//! ```
//!
//! On a GPU machine: `cargo run --release --example gpu_compare -- --out bench
//! /tmp/bert_infer.ops`. `--backend sim` runs cachalot's three allocators on the simulated
//! device instead (no GPU needed; the pool and `cuMemAlloc` are skipped), which is what CI runs.
//!
//! The program lives in the tools library (`cachalot_tools::bench`): this is its `main`.

use std::process::ExitCode;

use cachalot_tools::bench::gpu_compare::run;
use cachalot_tools::bench::options::Options;
use clap::Parser;

fn main() -> ExitCode {
    // A bad command line: the usage, exit code 2; --help: the usage, exit code 0.
    let options = Options::parse();
    match run(&options) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpu_compare: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}

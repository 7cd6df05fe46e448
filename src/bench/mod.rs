//! The side-by-side GPU benchmark (`docs/GPU_BENCH.md`): the program `gpu_compare`
//! (`benches/gpu_compare.rs`, a short `main` over [`gpu_compare::run`]) that runs every
//! `cachalot ops v1` program through cachalot's three allocators, CUDA's stream-ordered pool
//! and plain `cuMemAlloc`, its result records, and `cachalot bench-report`'s reading of them
//! into one results file, a CSV, Markdown tables and the targets.
//!
//! The one rule: one interpreter ([`interpret`]) runs every allocator, through the small
//! [`allocators::BenchTarget`] trait, with the semantics of docs/GPU_BENCH.md's table; the
//! allocators differ only behind it. The report computes nothing about an allocator that its
//! run did not measure.
//!
//! The program:
//!
//! - [`options`]: the command line;
//! - [`gpu_compare`]: the run — every ops file read first, then the traces, then the hot loops;
//! - [`traces`]: one (allocator, trace) run, observed and timed;
//! - [`hot`]: the hot loops;
//! - [`interpret`]: the interpreter of ops programs, its observed and timed passes;
//! - [`allocators`]: [`allocators::BenchTarget`], and cachalot's allocators through the front
//!   end (on the GPU or the simulated device);
//! - [`baselines`]: CUDA's pool and `cuMemAlloc` (on the GPU only);
//! - [`error`]: why it stops.
//!
//! The results:
//!
//! - [`record`]: the `cachalot gpu-bench v1` run files, one set of types for the writers
//!   (`gpu_compare`, `scripts/pytorch_bench.py`) and the reader;
//! - [`report`]: a run's directory read into [`report::Results`];
//! - [`targets`]: the targets on the results;
//! - [`tables`]: `results.md`, `results.csv`, `results.json`.

pub mod allocators;
pub mod baselines;
pub mod error;
pub mod gpu_compare;
pub mod hot;
pub mod interpret;
pub mod options;
pub mod record;
pub mod report;
pub mod tables;
pub mod targets;
pub mod traces;

//! `cachalot-tools`: the `cachalot` command-line program and the library behind it — PyTorch
//! memory snapshot reading and writing, the reconstruction of the state when recording began,
//! the replay engine, its self-check against the dumped state, the export of a replay as a
//! snapshot and as a `cachalot ops v1` program, and the side-by-side GPU benchmark.
//!
//! The test harness (operations, scenarios, and the driver that runs the allocator and its
//! reference model side by side) is the separate, unpublished `cachalot-harness` crate
//! (`harness/`); this crate depends on no test crate.

pub mod bench;
pub mod explain;
pub mod export;
pub mod fit;
pub mod ops;
pub mod replay;
pub mod selfcheck;
pub mod snapshot;
pub mod units;

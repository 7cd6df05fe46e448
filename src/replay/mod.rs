//! The replay: a PyTorch trace through cachalot's allocator on a device.
//!
//! The one rule: the replay reproduces the program's requests exactly — sizes, streams, the
//! order of allocations and frees, cross-stream frees held back until PyTorch released them,
//! explicit cache releases — and the device hands out the trace's own segment addresses where
//! it can, so best fit's address tie-break sees what PyTorch saw.
//!
//! - `program`: a device trace turned into a [`ReplayProgram`] ([`replay_ops_from`],
//!   [`SnapshotExt::replay_programs`]);
//! - `start`: the state when recording began, reconstructed from the dump
//!   ([`reconstruct_start`], [`SnapshotExt::start_of`]), and what a replay starts from
//!   ([`StartMode`]);
//! - `recorded`: the settings the trace was recorded under ([`Recorded`]);
//! - `interpret`: the one interpretation of a program as calls on an allocator
//!   ([`Interpreter`], [`ReplayTarget`]);
//! - `engine`: the timed replay on `CachingCore` ([`replay`], [`ReplayOutcome`]);
//! - `step`: the same replay one operation at a time ([`Stepper`]);
//! - `held`: the device a program replays on through another backend, held-back frees
//!   completed when the program says so ([`HeldBackDevice`]).

pub(crate) mod engine;
pub(crate) mod held;
pub(crate) mod interpret;
pub(crate) mod program;
pub(crate) mod recorded;
pub(crate) mod start;
pub(crate) mod step;

pub use engine::{
    H200_MEMORY, OfferAddress, ReplayConfig, ReplayError, ReplayOutcome, Sample, replay, replay_on,
    replay_on_full, replay_on_with_progress, replay_with_progress,
};
pub use held::{DeviceCalls, HeldBackDevice};
pub use interpret::{
    Executed, Interpreter, ReplayTarget, StartFailure, is_side_stream, side_stream,
};
pub use program::{
    InferredPool, InitialHandle, ReplayOp, ReplayOptions, ReplayProgram, ReplayReport,
    RuntimeSettings, SnapshotExt, private_stream, recorded_stream, replay_ops, replay_ops_from,
    replay_ops_with,
};
pub use recorded::{Recorded, RecordedError};
pub use start::{
    PYTORCH_LARGE_PAGE, PrivateSegment, StartBlock, StartError, StartMode, StartSegment,
    StartState, private_segments, reconstruct_start, reconstruct_start_changed,
    reconstruct_start_paged,
};
pub use step::Stepper;

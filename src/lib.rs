//! `cachalot-tools`: the meeting point of the allocator (`cachalot`) and its reference model
//! (`cachalot-model`): the operation type, the differential harness, PyTorch snapshot reading and
//! writing, and the replay engine behind the `cachalot` command-line program.

pub mod differential;
pub mod export;
pub mod fuzzing;
pub mod op;
pub mod replay;
pub mod scenario;
pub mod selfcheck;
pub mod snapshot;
pub mod threaded;

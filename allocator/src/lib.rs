//! # cachalot
//!
//! A CUDA caching allocator for Rust with PyTorch's policy — best fit per stream, block
//! splitting and coalescing, small and large pools, `max_split_size`, garbage collection, memory
//! fractions — whose every decision is checked against an executable reference model
//! (`cachalot-model`) by property tests and fuzzing.
//!
//! The policy core, [`CachingCore`], runs over any [`Backend`]; [`SimDevice`] simulates a GPU so
//! the whole allocator runs, and is tested, without one.
//!
//! ```
//! use cachalot::{CachingCore, Settings, SimDevice, StreamId};
//!
//! let mut core = CachingCore::new(SimDevice::new(8 << 30), Settings::pytorch()).unwrap();
//! let a = core.malloc(1 << 30, StreamId(0)).unwrap();
//! core.free(a).unwrap();
//! // The freed gigabyte stays cached: the next request of that size reuses it.
//! assert_eq!(core.malloc(1 << 30, StreamId(0)).unwrap(), a);
//! assert_eq!(core.stats().reserved_bytes.all.current, 1 << 30);
//! assert_eq!(core.stats().num_device_alloc, 1);
//! ```
//!
//! # Features
//!
//! - `cuda` (default): the CUDA backend over cudarc 0.19, `cuda::CudaAllocator`. It chooses
//!   neither how cudarc links the driver nor the CUDA version: exactly one linking feature and
//!   a version must be on somewhere in the program (on cachalot or on the program's own
//!   cudarc), or cudarc's build script stops and names what is missing.
//! - Linking, passed to cudarc: `dynamic-loading` (default; builds with no CUDA installed),
//!   `dynamic-linking` (as candle), `static-linking`. cudarc refuses two at once, so next to a
//!   cudarc with `dynamic-linking` use `default-features = false, features = ["cuda"]`.
//! - CUDA version, passed to cudarc: `cuda-version-from-build-system` (`nvcc --version`) or one
//!   of `cuda-11040` … `cuda-13040` (`cuda-12080` by default; with several, cudarc takes the
//!   highest).
//!
//! - `snapshot` (default): [`snapshot`], PyTorch's memory-snapshot format — the types, the
//!   writer, and the snapshot of an allocator's recorded history (`Allocator::dump_snapshot`,
//!   `CudaAllocator::dump_snapshot`), readable by `python -m torch.cuda._memory_viz` and
//!   `cachalot replay`.
//!
//! - `baselines` (off; needs `cuda`): [`baselines`], CUDA's stream-ordered pool and plain
//!   `cuMemAlloc` as safe owned-handle wrappers — the allocators cachalot is measured against
//!   in the side-by-side benchmark. Not needed to use cachalot.
//!
//! cachalot never turns on cudarc's `nvrtc`; a program that compiles kernels asks its own
//! cudarc for it. `docs/CUDA.md` has the dependency lines.

pub mod backend;
#[cfg(feature = "baselines")]
pub mod baselines;
mod block;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod error;
mod frontend;
pub mod history;
mod invariants;
pub mod policy;
pub mod settings;
pub mod sizes;
#[cfg(feature = "snapshot")]
pub mod snapshot;
pub mod stats;
mod sync;
mod thread_cache;

pub use backend::sim::{Faults, SimDevice};
pub use backend::{Backend, BackendError, EventId, MemInfo, StreamId};
pub use block::BlockState;
#[cfg(feature = "cuda")]
pub use cuda::{CudaAllocator, CudaError, DeviceBlock, DeviceBuffer};
pub use error::{Error, OutOfMemory};
pub use frontend::Allocator;
pub use history::{HistoryOptions, RecordedEvent, TraceAction, TraceEvent};
pub use invariants::InvariantViolation;
pub use policy::{AdoptedBlock, AdoptedSegment, AdoptedState, BlockInfo, CachingCore, SegmentInfo};
pub use settings::{Settings, SettingsError};
pub use stats::{Stat, StatArray, Stats};

/// Whether this build of cachalot runs on loom's primitives (`RUSTFLAGS="--cfg loom"`, for the
/// loom models): an [`Allocator`] then works inside a loom model only, so the documentation's
/// examples that make one skip themselves (rustdoc does not see `RUSTFLAGS`' `--cfg loom`).
#[doc(hidden)]
pub const LOOM_BUILD: bool = cfg!(loom);

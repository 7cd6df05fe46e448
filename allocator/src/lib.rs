//! # cachalot
//!
//! A CUDA caching allocator for Rust with PyTorch's policy — best fit per stream, block
//! splitting and coalescing, small and large pools, `max_split_size`, garbage collection, memory
//! fractions, expandable segments — whose every decision is checked against an executable
//! reference model (`cachalot-model`) by property tests and fuzzing.
//!
//! # Which type do I use?
//!
//! | you are writing | use | what it is |
//! |---|---|---|
//! | a cudarc program on a GPU: buffers, streams | [`cuda::CudaAllocator`] (feature `cuda`) | the allocator over the CUDA driver, handing out owned [`DeviceBuffer`](cuda::DeviceBuffer)s that go back to the cache when dropped |
//! | code shared by threads, on any [`Backend`] (e.g. the simulated device, [`SimDevice`], in tests) | [`Allocator<B>`](Allocator) | thread-safe (`Send + Sync`, cheap to clone), with per-thread caches; addresses in, addresses out |
//! | a replay, an experiment, a model check | [`CachingCore<B>`](CachingCore) | the single-threaded policy core (`&mut self`, no locks), which both of the others wrap |
//!
//! Each is the one above it minus a layer: a `CudaAllocator` is an `Allocator` over the CUDA
//! backend plus buffers, streams and data ordering; an `Allocator` is a `CachingCore` behind a
//! lock plus thread caches. All three take the same [`Settings`] (PyTorch's
//! `PYTORCH_CUDA_ALLOC_CONF` language, or cachalot's own defaults) and report the same
//! [`Stats`] (PyTorch's `memory_stats()` names) and layout ([`SegmentInfo`]).
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
//! # What else is here
//!
//! - At the root, the vocabulary of all three: [`Settings`], [`Error`], [`Stats`], the layout
//!   ([`SegmentInfo`], [`BlockInfo`], [`BlockPhase`], [`Pool`]), streams ([`StreamId`]), the
//!   [`Backend`] trait a device implements (with [`MemInfo`], [`EventId`], [`BackendError`])
//!   and the simulated device ([`SimDevice`], [`Faults`]), the memory history
//!   ([`HistoryOptions`], [`TraceEvent`]), the invariant checker's answer
//!   ([`InvariantViolation`]) and the segments a core adopts ([`AdoptedSegment`]).
//! - [`cuda`]: everything for the GPU — the allocator, buffers and views, kernel launches,
//!   errors, the CUDA backend for driving a `CachingCore` by hand.
//! - [`snapshot`]: PyTorch's memory-snapshot format.
//! - `baselines` (feature `baselines`, off by default): the allocators cachalot is measured
//!   against.
//!
//! # Features
//!
//! - `cuda` (default): the CUDA backend over cudarc 0.19, [`cuda`]. It chooses
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
//! - `f16`: `half::f16` and `half::bf16` buffers.
//! - `baselines` (off; needs `cuda`): `cachalot::baselines`, CUDA's stream-ordered pool and
//!   plain `cuMemAlloc` as safe owned-handle wrappers — the allocators cachalot is measured
//!   against in the side-by-side benchmark. Not needed to use cachalot.
//!
//! cachalot never turns on cudarc's `nvrtc`; a program that compiles kernels asks its own
//! cudarc for it. `docs/CUDA.md` has the dependency lines.

mod backend;
#[cfg(feature = "baselines")]
pub mod baselines;
mod block;
#[cfg(feature = "cuda")]
pub mod cuda;
mod error;
mod free_set;
mod frontend;
mod history;
mod invariants;
mod policy;
mod settings;
// The sizes and rounding of PyTorch's policy: the tools and the harness rebuild a trace's
// start state and check a replay with them; not part of the documented API ([`Pool`] is).
#[doc(hidden)]
pub mod sizes;
#[cfg(feature = "snapshot")]
pub mod snapshot;
mod stats;
mod sync;
mod thread_cache;

// The entry types (the third, `cuda::CudaAllocator`, is in `cuda`) and their settings.
pub use frontend::Allocator;
pub use policy::CachingCore;
pub use settings::{AllocatorBackend, Settings, SettingsError};

// What they answer: errors, statistics, the layout of segments and blocks, the invariants.
pub use block::BlockPhase;
pub use error::{Error, OutOfMemory};
pub use invariants::InvariantViolation;
pub use policy::{BlockInfo, SegmentInfo};
pub use sizes::Pool;
pub use stats::{Stat, StatArray, Stats};

// The memory history (`record_history`, `history`), and segments adopted at the start of a
// replay (rule 18).
pub use history::{HistoryOptions, RecordedEvent, TraceAction, TraceEvent};
pub use policy::adopt::{AdoptedBlock, AdoptedRange, AdoptedSegment, AdoptedState};

// Devices: streams, the trait a device implements, and the simulated device.
pub use backend::sim::{Faults, PageId, PhysicalOverlap, STREAM_WAIT_LOG, SimDevice};
pub use backend::{Backend, BackendError, EventId, MemInfo, StreamId};

/// Whether this build of cachalot runs on loom's primitives (`RUSTFLAGS="--cfg loom"`, for the
/// loom models): an [`Allocator`] then works inside a loom model only, so the documentation's
/// examples that make one skip themselves (rustdoc does not see `RUSTFLAGS`' `--cfg loom`).
#[doc(hidden)]
pub const LOOM_BUILD: bool = cfg!(loom);

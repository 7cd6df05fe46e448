//! The CUDA caching allocator: PyTorch's policy over real device memory, for Rust programs on
//! [cudarc](https://docs.rs/cudarc).
//!
//! The one rule: this module adds devices, not policy. Every decision is made by the same
//! [`CachingCore`] the reference model checks; [`CudaBackend`] turns those
//! decisions into driver calls, and [`DeviceBlock`] and [`DeviceBuffer`] give the memory to the
//! user as owned values that return to the cache on drop.
//!
//! Without a CUDA driver the module still builds; [`CudaAllocator::for_device`] and
//! [`device_count`] then return [`CudaError::NoDriver`] (never a panic).
//!
//! # Which calls record cross-stream uses
//!
//! A block is cached per stream: freed, it is reused only by allocations on the stream it was
//! allocated on, in that stream's order. Work on *other* streams that may still touch it must
//! be recorded, so that the block waits for that work before being reused (PyTorch's
//! `record_stream`). cachalot records automatically:
//!
//! - every [`DevicePtr::device_ptr`](cudarc::driver::DevicePtr::device_ptr) /
//!   [`DevicePtrMut::device_ptr_mut`](cudarc::driver::DevicePtrMut::device_ptr_mut) call with a
//!   stream other than the buffer's: that covers cudarc's `memcpy_htod`, `memcpy_dtoh`,
//!   `memcpy_dtod`, `clone_dtoh`, `memset_zeros` and any other API that takes a `DevicePtr`;
//! - every buffer passed to a kernel through [`Launch::arg`].
//!
//! Not recorded: a buffer pushed straight into cudarc's `LaunchArgs` with `.arg(&buf)` (cudarc
//! does not reveal the launch stream), and raw addresses. For those, call
//! [`DeviceBuffer::record_stream`] (or [`CudaAllocator::record_stream`] for raw pointers), or
//! take the address through `buf.device_ptr(&stream)`, which records. Uses on the buffer's
//! own stream never need recording.
//!
//! # Data ordering between streams
//!
//! The same calls also keep the other half of cudarc's contract, as `CudaSlice` does: the
//! using stream first waits for the buffer's last write on any other stream (and, to write,
//! for its last reads), with events, so a buffer written on stream A and read on stream B needs
//! no `b.join(&a)`. Uses on the buffer's own stream make no driver call for this. A raw
//! `.arg(&buf)` on another stream is ordered by nothing: join the streams yourself, or use
//! [`Launch`]. [`CudaAllocator::set_data_ordering`] switches it off (as cudarc's
//! `disable_event_tracking` does), leaving the ordering to the program as in PyTorch.
//!
//! ```no_run
//! use cachalot::cuda::CudaAllocator;
//!
//! let alloc = CudaAllocator::for_device(0)?; // settings from CACHALOT_ALLOC_CONF
//! let stream = alloc.context().new_stream()?;
//! let host = vec![1.5f32; 1 << 20];
//! let mut buf = alloc.alloc_zeros::<f32>(host.len(), &stream)?;
//! stream.memcpy_htod(&host, &mut buf)?;
//! assert_eq!(stream.clone_dtoh(&buf)?, host);
//! drop(buf); // cached: the next 4 MiB request on `stream` reuses it
//! println!("{}", alloc.memory_summary());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod anchor;
mod block;
mod buffer;
pub(crate) mod error;
mod foreign;
mod launch;
mod ordering;
pub(crate) mod streams;
mod summary;
mod view;

use crate::sync::real::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, Weak};
use crate::sync::real::{AtomicBool, AtomicU64, Ordering};

use rustc_hash::FxHashSet;

pub use cudarc;
use cudarc::driver::{CudaContext, CudaStream, DeviceRepr, ValidAsZeroBits};

pub use crate::backend::cuda::CudaBackend;
pub use block::DeviceBlock;
pub use buffer::{DeviceBuffer, Plain};
pub use error::CudaError;
pub use foreign::{CurrentContext, stream_is_capturing};
pub use launch::{KernelArg, Launch};
pub use streams::stream_id;
pub use summary::memory_summary;
pub use view::{DeviceView, DeviceViewMut};

use crate::backend::{MemInfo, StreamId};
use crate::error::Error;
use crate::frontend::Allocator;
use crate::history::HistoryOptions;
use crate::invariants::InvariantViolation;
use crate::policy::{CachingCore, SegmentInfo};
use streams::StreamRegistry;

use crate::settings::Settings;
use crate::stats::Stats;

/// The environment variable [`CudaAllocator::for_device`] reads its settings from, in
/// `PYTORCH_CUDA_ALLOC_CONF` syntax (for example `max_split_size_mb:128,garbage_collection_threshold:0.6`).
pub const ALLOC_CONF_ENV: &str = "CACHALOT_ALLOC_CONF";

/// The number of CUDA devices, or [`CudaError::NoDriver`] when the driver library cannot be
/// loaded or initialised. Never panics, on any machine.
///
/// ```
/// match cachalot::cuda::device_count() {
///     Ok(n) => println!("{n} CUDA devices"),
///     Err(e) => println!("no GPU here: {e}"),
/// }
/// ```
pub fn device_count() -> Result<usize, CudaError> {
    if !crate::backend::cuda::driver_library_present() {
        return Err(CudaError::NoDriver {
            reason: "the CUDA driver library (libcuda) could not be loaded".into(),
        });
    }
    let count = CudaContext::device_count().map_err(|e| CudaError::NoDriver {
        reason: format!("the CUDA driver failed to initialise: {e}"),
    })?;
    Ok(usize::try_from(count).unwrap_or(0))
}

/// Drops the error of a free no one can be told of, off the hot path.
#[cold]
#[inline(never)]
fn dropped_error(e: Error) {
    drop(e);
}

/// Allocator numbers, for [`Shared::id`].
static NEXT_ALLOCATOR_ID: AtomicU64 = AtomicU64::new(1);

std::thread_local! {
    /// The last `(allocator, stream generation, stream)` this thread retained a stream for.
    static LAST_RETAINED: std::cell::Cell<(u64, u64, u64)> = const { std::cell::Cell::new((0, 0, 0)) };
}

struct Shared {
    ctx: Arc<CudaContext>,
    /// This allocator's number, unique in the process: the key of the per-thread record of
    /// streams already retained.
    id: u64,
    /// The streams the backend may record events on and keeps alive, shared with it: the
    /// allocator shows it streams without taking the core's lock. Its generation moves
    /// whenever it may forget streams (`empty_cache`), so per-thread records of retained
    /// streams made before that are not trusted.
    streams: Arc<StreamRegistry>,
    auto_record: AtomicBool,
    /// Whether buffers order their data between streams (cudarc's `DevicePtr` contract; see
    /// [`CudaAllocator::set_data_ordering`]).
    data_ordering: AtomicBool,
    /// Set when the program's last handle is dropped (see `anchor`): frees then give empty
    /// segments straight back to the driver.
    closed: AtomicBool,
    /// The program's handles, for [`DeviceBuffer::allocator`]; set once, at construction.
    owner: OnceLock<Weak<anchor::Owner>>,
    /// Addresses handed out by `malloc_raw` and not yet freed: `free_raw` takes only these,
    /// so it can never free a block a `DeviceBlock` owns.
    raw: Mutex<FxHashSet<u64>>,
}

/// A caching allocator for one CUDA device: `Send + Sync`, and cheap to clone (clones share the
/// cache, the statistics and the settings).
///
/// Allocations return owned [`DeviceBlock`]s and [`DeviceBuffer`]s that go back to the cache
/// when dropped. Each keeps the allocator alive (through a per-thread anchor, not a clone: see
/// BENCHMARKS.md), so dropping the allocator while buffers are alive is safe. When the
/// program drops its last clone, the allocator closes: its cache and its raw allocations go
/// back to the driver at once, and each live buffer's memory goes back when it is dropped.
///
/// ```no_run
/// use cachalot::cuda::CudaAllocator;
///
/// let alloc = CudaAllocator::for_device(0)?;
/// let stream = alloc.context().new_stream()?;
/// let a = alloc.alloc(3 << 20, &stream)?;
/// let first = a.address();
/// drop(a);
/// // Same stream, same size class: the cached block comes back, with no driver call.
/// assert_eq!(alloc.alloc(3 << 20, &stream)?.address(), first);
/// assert_eq!(alloc.stats().num_device_alloc, 1);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct CudaAllocator {
    inner: Allocator<CudaBackend>,
    shared: Arc<Shared>,
    /// `Some` in every handle the program holds; `None` in the allocator's own references
    /// from buffers (see `anchor`), which keep it alive but do not keep it open. Held for its
    /// `Drop` only.
    #[allow(dead_code)]
    owner: Option<Arc<anchor::Owner>>,
}

impl std::fmt::Debug for CudaAllocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaAllocator")
            .field("device", &self.ordinal())
            .finish_non_exhaustive()
    }
}

impl CudaAllocator {
    /// An allocator for `ctx`'s device with `settings`.
    ///
    /// ```no_run
    /// use cachalot::Settings;
    /// use cachalot::cuda::CudaAllocator;
    /// use cudarc::driver::CudaContext;
    ///
    /// let ctx = CudaContext::new(0)?;
    /// let alloc = CudaAllocator::new(ctx, Settings::parse("max_split_size_mb:256")?)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// cachalot's defaults ([`Settings::cachalot`]) use expandable segments; on a GPU without
    /// virtual memory management they fall back to segments (rule 21), while an explicit
    /// `expandable_segments:True` among other settings is refused there.
    pub fn new(ctx: Arc<CudaContext>, settings: Settings) -> Result<Self, CudaError> {
        let ordinal = ctx.ordinal();
        let backend = CudaBackend::new(Arc::clone(&ctx))?;
        let settings = if settings == Settings::cachalot()
            && !crate::backend::Backend::virtual_memory(&backend)
        {
            Settings {
                expandable_segments: false,
                page_stitching: false,
                ..settings
            }
        } else {
            settings
        };
        let streams = backend.stream_registry();
        let core = CachingCore::new(backend, settings)?.with_device_index(ordinal);
        let internal = CudaAllocator {
            inner: Allocator::from_core(core),
            shared: Arc::new(Shared {
                ctx,
                id: NEXT_ALLOCATOR_ID.fetch_add(1, Ordering::Relaxed),
                streams,
                auto_record: AtomicBool::new(true),
                data_ordering: AtomicBool::new(true),
                closed: AtomicBool::new(false),
                owner: OnceLock::new(),
                raw: Mutex::new(FxHashSet::default()),
            }),
            owner: None,
        };
        Ok(internal.open())
    }

    /// An allocator for `ctx`'s device with the settings of [`ALLOC_CONF_ENV`]
    /// (`CACHALOT_ALLOC_CONF`); unset means the defaults.
    pub fn from_env(ctx: Arc<CudaContext>) -> Result<Self, CudaError> {
        let settings = Settings::from_env(ALLOC_CONF_ENV)?;
        CudaAllocator::new(ctx, settings)
    }

    /// A new allocator for device `ordinal` (its primary context), with the settings of
    /// `CACHALOT_ALLOC_CONF`. Each call makes a new allocator with its own cache: make one per
    /// device and clone it.
    ///
    /// Fails with [`CudaError::NoDriver`] on a machine without a CUDA driver and
    /// [`CudaError::NoSuchDevice`] when `ordinal` is too large.
    ///
    /// ```no_run
    /// let alloc = cachalot::cuda::CudaAllocator::for_device(0)?;
    /// # Ok::<(), cachalot::cuda::CudaError>(())
    /// ```
    pub fn for_device(ordinal: usize) -> Result<Self, CudaError> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(CudaError::NoSuchDevice { ordinal, count });
        }
        CudaAllocator::from_env(CudaContext::new(ordinal)?)
    }

    /// One new allocator per device of the machine, in ordinal order (see
    /// [`CudaAllocator::for_device`]).
    ///
    /// ```no_run
    /// let allocators = cachalot::cuda::CudaAllocator::all_devices()?;
    /// for a in &allocators {
    ///     println!("device {}: {} bytes reserved", a.ordinal(), a.stats().reserved_bytes.all.current);
    /// }
    /// # Ok::<(), cachalot::cuda::CudaError>(())
    /// ```
    pub fn all_devices() -> Result<Vec<Self>, CudaError> {
        (0..device_count()?)
            .map(CudaAllocator::for_device)
            .collect()
    }

    /// The CUDA context of the device.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.shared.ctx
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.shared.ctx.ordinal()
    }

    /// The settings in force.
    pub fn settings(&self) -> Settings {
        self.inner.settings()
    }

    fn check_stream(&self, stream: &CudaStream) -> Result<(), CudaError> {
        if stream.context().cu_ctx() != self.shared.ctx.cu_ctx() {
            return Err(CudaError::WrongDevice {
                allocator_device: self.ordinal(),
                stream_device: stream.context().ordinal(),
            });
        }
        Ok(())
    }

    /// Allocates for `stream` (its id `id`, already checked to be this device's).
    #[inline]
    fn malloc_on(
        &self,
        bytes: u64,
        stream: &Arc<CudaStream>,
        id: StreamId,
    ) -> Result<u64, CudaError> {
        // The registry keeps every allocation stream alive. Retaining takes the registry's
        // lock, shared by every thread, so each thread remembers the last (allocator,
        // generation, stream) it retained and skips the lock when nothing changed: the
        // allocation itself then goes through the front end's fast path (the thread caches of
        // rule 17), as frees already do.
        let registry = &self.shared.streams;
        let generation = registry.generation();
        if LAST_RETAINED.with(|last| last.get()) != (self.shared.id, generation, id.0) {
            let retained = registry.retain(id, stream);
            LAST_RETAINED.with(|last| last.set((self.shared.id, retained, id.0)));
        }
        let address = self.inner.malloc(bytes, id);
        // An `empty_cache` on another thread began pruning after this thread retained the
        // stream: its snapshot of the segments may miss one this allocation just made on the
        // stream, so retain it again (a prune keeps streams retained since it began).
        if registry.generation() != generation {
            let retained = registry.retain(id, stream);
            LAST_RETAINED.with(|last| last.set((self.shared.id, retained, id.0)));
        }
        Ok(address?)
    }

    /// Allocates `bytes` bytes for use on `stream`, as a block that returns to the cache when
    /// dropped. The contents are unspecified. A zero-byte request returns an empty block at
    /// address 0 and touches nothing.
    ///
    /// Out of memory (after releasing cached memory and retrying, as PyTorch does) is
    /// [`CudaError::Alloc`] with [`Error::OutOfMemory`]: the device's real capacity and free
    /// memory are in [`CudaError::out_of_memory`]; the allocator stays usable.
    ///
    /// ```no_run
    /// let alloc = cachalot::cuda::CudaAllocator::for_device(0)?;
    /// let stream = alloc.context().new_stream()?;
    /// match alloc.alloc(1 << 40, &stream) {
    ///     Err(e) if e.is_out_of_memory() => {
    ///         let oom = e.out_of_memory().unwrap();
    ///         println!("only {} of {} bytes free", oom.device_free, oom.capacity);
    ///     }
    ///     other => drop(other?),
    /// }
    /// let small = alloc.alloc(4096, &stream)?; // still usable
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[inline]
    pub fn alloc(&self, bytes: usize, stream: &Arc<CudaStream>) -> Result<DeviceBlock, CudaError> {
        self.check_stream(stream)?;
        let id = stream_id(stream);
        let address = self.malloc_on(bytes as u64, stream, id)?;
        // The block holds this thread's anchor for (allocator, stream), not a clone of the
        // allocator: no counter shared between threads is touched (see `anchor`).
        let anchor = self.anchor(stream, id.0);
        Ok(DeviceBlock::new(anchor, address, bytes))
    }

    #[inline]
    fn typed_block<T>(
        &self,
        len: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<DeviceBuffer<T>, CudaError> {
        // A `let else`, not `ok_or`: that builds (and drops) the error on every call.
        let Some(bytes) = len.checked_mul(std::mem::size_of::<T>()) else {
            return Err(Error::TooLarge {
                requested: u64::MAX,
            }
            .into());
        };
        Ok(DeviceBuffer::from_block(self.alloc(bytes, stream)?, len))
    }

    /// Allocates room for `len` values of `T` on `stream`, uninitialised: the values are
    /// whatever the memory held (every bit pattern is a valid `T`, see [`Plain`]).
    ///
    /// ```no_run
    /// let alloc = cachalot::cuda::CudaAllocator::for_device(0)?;
    /// let stream = alloc.context().new_stream()?;
    /// let mut buf = alloc.alloc_buffer::<u32>(256, &stream)?;
    /// stream.memcpy_htod(&[5u32; 256], &mut buf)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn alloc_buffer<T: Plain>(
        &self,
        len: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<DeviceBuffer<T>, CudaError> {
        self.typed_block(len, stream)
    }

    /// Allocates `len` values of `T` on `stream`, zeroed (a memset queued on `stream`).
    ///
    /// ```no_run
    /// let alloc = cachalot::cuda::CudaAllocator::for_device(0)?;
    /// let stream = alloc.context().new_stream()?;
    /// let buf = alloc.alloc_zeros::<f64>(100, &stream)?;
    /// assert_eq!(stream.clone_dtoh(&buf)?, vec![0.0; 100]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<DeviceBuffer<T>, CudaError> {
        let mut buf = self.typed_block::<T>(len, stream)?;
        if !buf.is_empty() {
            stream.memset_zeros(&mut buf)?;
        }
        Ok(buf)
    }

    /// Allocates a buffer on `stream` and copies `host` into it (queued on `stream`).
    ///
    /// ```no_run
    /// let alloc = cachalot::cuda::CudaAllocator::for_device(0)?;
    /// let stream = alloc.context().new_stream()?;
    /// let buf = alloc.clone_htod(&[1u16, 2, 3], &stream)?;
    /// assert_eq!(stream.clone_dtoh(&buf)?, [1, 2, 3]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn clone_htod<T: DeviceRepr>(
        &self,
        host: &[T],
        stream: &Arc<CudaStream>,
    ) -> Result<DeviceBuffer<T>, CudaError> {
        let mut buf = self.typed_block::<T>(host.len(), stream)?;
        if !buf.is_empty() {
            stream.memcpy_htod(host, &mut buf)?;
        }
        Ok(buf)
    }

    /// Allocates `bytes` bytes on `stream` and returns the raw device address, for callers that
    /// manage lifetimes themselves (foreign code, FFI). Free it with
    /// [`CudaAllocator::free_raw`]; an address never freed is returned to the driver when the
    /// allocator is dropped (so it must not be used after that). A zero-byte request returns 0.
    ///
    /// ```no_run
    /// let alloc = cachalot::cuda::CudaAllocator::for_device(0)?;
    /// let stream = alloc.context().new_stream()?;
    /// let p = alloc.malloc_raw(1 << 20, &stream)?;
    /// alloc.free_raw(p)?;
    /// assert!(alloc.free_raw(p).is_err()); // already freed: an error, never a crash
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn malloc_raw(&self, bytes: usize, stream: &Arc<CudaStream>) -> Result<u64, CudaError> {
        self.check_stream(stream)?;
        let address = self.malloc_on(bytes as u64, stream, stream_id(stream))?;
        if address != 0 {
            self.raw_set().insert(address);
        }
        Ok(address)
    }

    /// Frees an address from [`CudaAllocator::malloc_raw`] (0 is a no-op). An address that is
    /// not a live raw allocation of this allocator (never allocated, already freed, from
    /// another allocator, owned by a [`DeviceBlock`], or inside a block) is
    /// [`Error::UnknownPointer`] and changes nothing.
    pub fn free_raw(&self, address: u64) -> Result<(), CudaError> {
        if address == 0 {
            return Ok(());
        }
        if !self.raw_set().remove(&address) {
            return Err(Error::UnknownPointer { address }.into());
        }
        self.inner.free(address).map_err(|e| {
            // The core refused (a device failure while recording events): still raw and live.
            self.raw_set().insert(address);
            CudaError::from(e)
        })
    }

    fn raw_set(&self) -> MutexGuard<'_, FxHashSet<u64>> {
        self.shared
            .raw
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Returns a block's memory to the cache (the block is being dropped).
    pub(crate) fn free_block(&self, address: u64) -> Result<(), CudaError> {
        Ok(self.inner.free(address)?)
    }

    /// [`CudaAllocator::free_block`] for a block being dropped, which has no one to tell of a
    /// failure (the device failed while recording events: the block then stays allocated
    /// until the allocator itself is dropped).
    #[inline]
    pub(crate) fn drop_block(&self, address: u64) {
        if let Err(e) = self.inner.free(address) {
            dropped_error(e);
        }
    }

    /// Marks the live allocation at `address` as used on `stream`: when freed, it is not reused
    /// until the work queued on `stream` by then has completed. The allocator keeps `stream`
    /// alive until then. For raw addresses; buffers have [`DeviceBuffer::record_stream`].
    pub fn record_stream(&self, address: u64, stream: &Arc<CudaStream>) -> Result<(), CudaError> {
        self.record_raw_stream(address, stream)
    }

    pub(crate) fn record_raw_stream(
        &self,
        address: u64,
        stream: &Arc<CudaStream>,
    ) -> Result<(), CudaError> {
        self.check_stream(stream)?;
        let id = stream_id(stream);
        self.shared.streams.retain(id, stream);
        // Through the front end, so a block used on another stream is never kept in a
        // thread cache (rule 17).
        Ok(self.inner.record_stream(address, id)?)
    }

    /// Records a use seen through `device_ptr`, where only `&CudaStream` is known.
    pub(crate) fn record_use(&self, address: u64, stream: &CudaStream) -> Result<(), CudaError> {
        let id = stream_id(stream);
        self.shared.streams.note(id);
        Ok(self.inner.record_stream(address, id)?)
    }

    /// Whether uses on other streams are recorded automatically (on by default).
    pub fn auto_record_stream(&self) -> bool {
        self.shared.auto_record.load(Ordering::Relaxed)
    }

    /// Turns the automatic recording of cross-stream uses on or off, for every clone of this
    /// allocator and every buffer it has handed out.
    ///
    /// Off, a buffer freed while another stream still uses it may be handed out again at once
    /// (the bug PyTorch's `record_stream` exists to prevent): only for programs that
    /// synchronise their streams themselves before dropping buffers, and for tests that show
    /// the failure. Explicit `record_stream` calls still record.
    pub fn set_auto_record_stream(&self, on: bool) {
        self.shared.auto_record.store(on, Ordering::Relaxed);
    }

    /// Waits for the events of blocks freed while other streams used them, then gives every
    /// cached segment that holds no allocation back to the driver (`cuMemFree`), as
    /// `torch.cuda.empty_cache()` does. Segments with live blocks stay.
    ///
    /// ```no_run
    /// let alloc = cachalot::cuda::CudaAllocator::for_device(0)?;
    /// let stream = alloc.context().new_stream()?;
    /// drop(alloc.alloc(64 << 20, &stream)?);
    /// assert_eq!(alloc.stats().reserved_bytes.all.current, 64 << 20);
    /// alloc.empty_cache()?;
    /// assert_eq!(alloc.stats().reserved_bytes.all.current, 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn empty_cache(&self) -> Result<(), CudaError> {
        // Through the front end: it flushes every thread cache before releasing segments.
        self.inner.empty_cache()?;
        // Then forget the streams that no longer hold a segment (and that nobody else keeps
        // alive): the segments are read after the prune begins, see `StreamRegistry`.
        let registry = &self.shared.streams;
        let since = registry.begin_prune();
        registry.prune(&self.inner.segments(), since);
        Ok(())
    }

    /// Caps the memory this allocator reserves at `fraction` (in \[0, 1\]) of the device's
    /// capacity, as `torch.cuda.set_per_process_memory_fraction` does; requests beyond it fail
    /// with out-of-memory.
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<(), CudaError> {
        Ok(self.inner.set_memory_fraction(fraction)?)
    }

    /// Returns the blocks the calling thread's cache keeps to the shared pool (rule 17 of
    /// ARCHITECTURE.md: with cachalot's defaults each thread keeps up to
    /// `thread_cache_blocks` just-freed blocks for its next requests of the same size and
    /// stream; `Settings::pytorch()` keeps none). A thread's cache is also flushed when the
    /// thread exits, by [`CudaAllocator::empty_cache`], and before an out-of-memory error.
    pub fn flush_thread_cache(&self) {
        self.inner.flush_thread_cache()
    }

    /// How many freed blocks the calling thread's cache keeps. Kept blocks still count as
    /// allocated in [`CudaAllocator::stats`] until they are flushed or reused.
    pub fn thread_cached_blocks(&self) -> usize {
        self.inner.thread_cached_blocks()
    }

    /// A copy of the statistics (PyTorch's `memory_stats()`). With thread caches on
    /// (cachalot's defaults), blocks kept in them count as allocated: call
    /// [`CudaAllocator::flush_thread_cache`] first for the program's own figure.
    pub fn stats(&self) -> Stats {
        self.inner.stats()
    }

    /// Sets every peak statistic to its current value.
    pub fn reset_peak_stats(&self) {
        self.inner.reset_peak_stats()
    }

    /// A readable table of the statistics, in the manner of `torch.cuda.memory_summary()`.
    ///
    /// ```no_run
    /// let alloc = cachalot::cuda::CudaAllocator::for_device(0)?;
    /// println!("{}", alloc.memory_summary());
    /// # Ok::<(), cachalot::cuda::CudaError>(())
    /// ```
    pub fn memory_summary(&self) -> String {
        memory_summary(&self.stats(), &self.segments(), self.ordinal())
    }

    /// The segments and their blocks, by address.
    pub fn segments(&self) -> Vec<SegmentInfo> {
        self.inner.segments()
    }

    /// The device's free and total memory as the driver reports them now (`cuMemGetInfo`).
    pub fn mem_info(&self) -> Result<MemInfo, CudaError> {
        let (free, total) = self.shared.ctx.mem_get_info()?;
        Ok(MemInfo {
            free: free as u64,
            total: total as u64,
        })
    }

    /// Checks the policy core's invariants (see [`CachingCore::check_invariants`]).
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.inner.check_invariants()
    }

    /// Starts, resizes or stops recording the memory history, as PyTorch's
    /// `torch.cuda.memory._record_memory_history(max_entries=...)`: `Some(n)` keeps the last `n`
    /// entries in a ring (`usize::MAX`: everything), `None` or `Some(0)` stops and drops what
    /// was recorded. While recording, thread caches are bypassed so that every allocation and
    /// free is recorded as the program made it (see [`Allocator::record_history`]). Write the
    /// history with [`CudaAllocator::dump_snapshot`].
    ///
    /// ```no_run
    /// use cachalot::cuda::CudaAllocator;
    ///
    /// let alloc = CudaAllocator::for_device(0)?;
    /// alloc.record_history(Some(100_000));
    /// let stream = alloc.context().new_stream()?;
    /// let buf = alloc.alloc_zeros::<f32>(1 << 20, &stream)?;
    /// drop(buf);
    /// alloc.dump_snapshot("rust_live.pickle")?; // python -m torch.cuda._memory_viz trace_plot rust_live.pickle
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn record_history(&self, max_entries: Option<usize>) {
        self.inner.record_history(max_entries)
    }

    /// [`CudaAllocator::record_history`] with every option: Rust backtraces captured with each
    /// entry and written as its `frames` ([`crate::HistoryOptions::with_backtraces`]).
    pub fn record_history_with(&self, options: Option<HistoryOptions>) {
        self.inner.record_history_with(options)
    }

    /// How the history is being recorded, or `None` when it is not.
    pub fn history_options(&self) -> Option<HistoryOptions> {
        self.inner.history_options()
    }

    /// The recorded history and the state now as a PyTorch memory snapshot of this device
    /// (what `torch.cuda.memory._snapshot()` returns); see [`Allocator::snapshot`]. Streams are
    /// their `CUstream` handles, as PyTorch writes them.
    #[cfg(feature = "snapshot")]
    pub fn snapshot(&self) -> crate::snapshot::Snapshot {
        self.inner.snapshot()
    }

    /// Writes [`CudaAllocator::snapshot`] to `path` in PyTorch's pickle format, as
    /// `torch.cuda.memory._dump_snapshot(path)` does, for `python -m torch.cuda._memory_viz`
    /// and `cachalot replay`.
    #[cfg(feature = "snapshot")]
    pub fn dump_snapshot(&self, path: impl AsRef<std::path::Path>) -> std::io::Result<()> {
        self.inner.dump_snapshot(path)
    }
}

//! The CUDA device behind the policy core: segments from `cuMemAlloc`, events from
//! `cuEventCreate`, all through cudarc's driver bindings; the virtual memory of expandable
//! segments is in [`vmm`].
//!
//! The one rule: every `unsafe` block of cachalot that reaches the driver lives in this file,
//! in `vmm.rs` or, for the allocators cachalot is compared with, in `baselines.rs` (the rest of
//! the crate has only the kernel-argument impls of `cuda/launch.rs` and the `unsafe fn`s that
//! reinterpret a buffer's type), each with a `// SAFETY:` comment, and every handle that
//! reaches the driver was produced by the driver and checked here first. The [`Backend`] trait
//! is safe, so a caller may pass any address, stream id or event id: addresses are checked
//! against the segments this backend allocated, events against the ones it created, and
//! streams against the ones it was shown; anything else is refused (or, for an unknown stream,
//! handled by synchronising the device) without touching the driver.

pub(crate) mod vmm;

use crate::sync::real::Arc;

use cudarc::driver::sys::{self, CUevent_flags, CUresult};
use cudarc::driver::{CudaContext, CudaStream, DriverError, result};
use rustc_hash::FxHashMap;

use crate::backend::{Backend, BackendError, EventId, MemInfo, StreamId};
use crate::cuda::error::CudaError;
use crate::cuda::streams::{StreamRegistry, stream_id};
use crate::policy::SegmentInfo;
use vmm::{Vmm, probe_virtual_memory};

/// Spare events kept for reuse; more than this many are destroyed when released.
const EVENT_POOL_CAP: usize = 256;

/// Whether the CUDA driver library can be loaded, asked without letting cudarc panic.
///
/// With cudarc's `dynamic-loading`, cudarc loads `libcuda` lazily and panics at the first
/// driver call when it is absent; this asks its loader whether any of the names it would try
/// can be opened. With `dynamic-linking` or `static-linking` the driver is linked into the
/// program, which does not start without it. When the linking was chosen on the program's own
/// cudarc rather than on cachalot, cachalot cannot see which: it then tries the driver's usual
/// names itself (already open, when linked).
pub(crate) fn driver_library_present() -> bool {
    #[cfg(feature = "dynamic-loading")]
    {
        // SAFETY: loading the driver library runs its initialisers, which is what every driver
        // call through cudarc does first anyway; no symbol is called here.
        unsafe { sys::is_culib_present() }
    }
    #[cfg(all(
        not(feature = "dynamic-loading"),
        any(feature = "dynamic-linking", feature = "static-linking")
    ))]
    {
        true
    }
    #[cfg(not(any(
        feature = "dynamic-loading",
        feature = "dynamic-linking",
        feature = "static-linking"
    )))]
    {
        use std::env::consts::{DLL_PREFIX, DLL_SUFFIX};
        // The names cudarc's loader tries that name a driver of any version.
        ["cuda", "nvcuda"].iter().any(|name| {
            [
                format!("{DLL_PREFIX}{name}{DLL_SUFFIX}"),
                format!("{DLL_PREFIX}{name}{DLL_SUFFIX}.1"),
            ]
            .iter()
            // SAFETY: as above; the library is opened and closed, no symbol is called.
            .any(|file| unsafe { libloading::Library::new(file) }.is_ok())
        })
    }
}

fn device_error(operation: &'static str, e: DriverError) -> BackendError {
    if e.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        return BackendError::OutOfMemory;
    }
    BackendError::Device {
        operation,
        message: e.to_string(),
    }
}

/// A [`Backend`] over one CUDA context: device memory from `cuMemAlloc`/`cuMemFree`, events
/// created with `CU_EVENT_DISABLE_TIMING` and reused through a small pool.
///
/// Most programs use [`CudaAllocator`](crate::cuda::CudaAllocator), which wraps this backend
/// in the caching policy. Use it directly to drive a [`CachingCore`](crate::CachingCore) by
/// hand (trace replay, experiments); streams are named by [`stream_id`](crate::cuda::stream_id),
/// and a stream must be shown to the backend ([`CudaBackend::retain_stream`] or
/// [`CudaBackend::note_stream`]) before events are recorded on it.
///
/// The context is made current on the calling thread at every call that reaches the driver, so
/// the backend may be used from any thread. Dropping it waits for its outstanding events and
/// returns every segment it still holds to the driver.
///
/// ```no_run
/// use cachalot::cuda::{CudaBackend, stream_id};
/// use cachalot::{CachingCore, Settings};
/// use cudarc::driver::CudaContext;
///
/// let ctx = CudaContext::new(0)?;
/// let stream = ctx.new_stream()?;
/// let mut backend = CudaBackend::new(ctx)?;
/// backend.retain_stream(&stream);
/// let mut core = CachingCore::new(backend, Settings::default())?;
/// let p = core.malloc(1 << 20, stream_id(&stream))?;
/// core.free(p)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    /// Live segments: address → size.
    segments: FxHashMap<u64, u64>,
    /// Streams this backend may record events on, shared with the `CudaAllocator` over it.
    streams: Arc<StreamRegistry>,
    /// Outstanding events: id → `CUevent` handle.
    events: FxHashMap<u64, usize>,
    /// Spare events for reuse.
    spare: Vec<usize>,
    next_event: u64,
    /// Virtual memory for expandable segments (rule 19): reservations and their mapped pages.
    vmm: Vmm,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("device", &self.ctx.ordinal())
            .field("segments", &self.segments.len())
            .field("streams", &self.streams.len())
            .field("events", &self.events.len())
            .finish_non_exhaustive()
    }
}

impl CudaBackend {
    /// A backend over `ctx`'s device.
    pub fn new(ctx: Arc<CudaContext>) -> Result<CudaBackend, CudaError> {
        let mut backend = CudaBackend {
            ctx,
            segments: FxHashMap::default(),
            streams: Arc::new(StreamRegistry::new()),
            events: FxHashMap::default(),
            spare: Vec::new(),
            next_event: 1,
            vmm: Vmm::default(),
        };
        backend.bind().map_err(CudaError::from_backend)?;
        backend.vmm.granularity = probe_virtual_memory(&backend.ctx);
        Ok(backend)
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Shows the backend a stream and keeps it alive while the backend holds segments for it
    /// (a destroyed stream's handle may be given to a new stream, which must not inherit blocks
    /// whose last uses may still be running).
    pub fn retain_stream(&mut self, stream: &Arc<CudaStream>) {
        self.streams.retain(stream_id(stream), stream);
    }

    /// Shows the backend a stream without keeping it alive: events may be recorded on it until
    /// [`CudaBackend::prune_streams`] forgets it. The stream must stay alive until then (if it
    /// is destroyed first, recording on it fails and the backend falls back to synchronising
    /// the whole device, which is safe but slow).
    pub fn note_stream(&mut self, stream: &CudaStream) {
        self.streams.note(stream_id(stream));
    }

    /// Whether the backend knows this stream.
    pub fn knows_stream(&self, stream: StreamId) -> bool {
        self.streams.knows(stream)
    }

    /// Forgets the streams that hold no segment in `segments` (the core's segments now) and
    /// that nobody else keeps alive. Called after `empty_cache`.
    pub fn prune_streams(&mut self, segments: &[SegmentInfo]) {
        let since = self.streams.begin_prune();
        self.streams.prune(segments, since);
    }

    /// The registry of streams this backend records events on, for the `CudaAllocator` that
    /// shows it streams without going through the policy core.
    pub(crate) fn stream_registry(&self) -> Arc<StreamRegistry> {
        Arc::clone(&self.streams)
    }

    /// Number of device segments this backend holds.
    pub fn segment_count(&self) -> usize {
        self.segments.len()
    }

    /// Makes the context current on the calling thread (cheap when it already is).
    fn bind(&self) -> Result<(), BackendError> {
        let ctx = self.ctx.cu_ctx();
        let current = result::ctx::get_current().map_err(|e| device_error("cuCtxGetCurrent", e))?;
        if current != Some(ctx) {
            // SAFETY: `ctx` is the live context held by `self.ctx` (an `Arc`, so not released
            // while we hold it).
            unsafe { result::ctx::set_current(ctx) }
                .map_err(|e| device_error("cuCtxSetCurrent", e))?;
        }
        Ok(())
    }

    /// Waits for all work queued in the device's context.
    fn synchronize_all(&self) -> Result<(), BackendError> {
        self.bind()?;
        result::ctx::synchronize().map_err(|e| device_error("cuCtxSynchronize", e))
    }

    fn take_spare_event(&mut self) -> Result<usize, BackendError> {
        if let Some(e) = self.spare.pop() {
            return Ok(e);
        }
        let e = result::event::create(CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| device_error("cuEventCreate", e))?;
        Ok(e as usize)
    }

    fn release_event(&mut self, handle: usize) {
        if self.spare.len() < EVENT_POOL_CAP {
            self.spare.push(handle);
        } else {
            // SAFETY: `handle` came from `cuEventCreate` and is in neither `events` nor
            // `spare`, so it is destroyed exactly once; an event still pending is released by
            // the driver when it completes.
            let _ = unsafe { result::event::destroy(handle as sys::CUevent) };
        }
    }

    fn new_event_id(&mut self, handle: usize) -> EventId {
        let id = self.next_event;
        self.next_event += 1;
        self.events.insert(id, handle);
        EventId(id)
    }
}

impl Backend for CudaBackend {
    fn allocate(&mut self, size: u64) -> Result<u64, BackendError> {
        self.bind()?;
        let bytes = usize::try_from(size).map_err(|_| BackendError::OutOfMemory)?;
        // SAFETY: cuMemAlloc writes a device address; the memory is uninitialised, which is
        // fine for bytes that the allocator hands out as raw storage.
        let address =
            unsafe { result::malloc_sync(bytes) }.map_err(|e| device_error("cuMemAlloc", e))?;
        self.segments.insert(address, size);
        Ok(address)
    }

    fn free(&mut self, address: u64, size: u64) -> Result<(), BackendError> {
        match self.segments.get(&address) {
            Some(&s) if s == size => {}
            _ => {
                return Err(BackendError::Device {
                    operation: "cuMemFree",
                    message: format!(
                        "{address:#x} ({size} bytes) is not a segment this backend allocated"
                    ),
                });
            }
        }
        // Work queued on any stream may still use the segment (its blocks were reused on
        // their stream after earlier frees): wait for all of it before the memory goes back.
        self.synchronize_all()?;
        // SAFETY: `address` is a live segment from cuMemAlloc (checked above, and removed
        // below so it is freed once), and the context was synchronised, so no queued work
        // still accesses it.
        unsafe { result::free_sync(address) }.map_err(|e| device_error("cuMemFree", e))?;
        self.segments.remove(&address);
        Ok(())
    }

    fn mem_info(&mut self) -> Result<MemInfo, BackendError> {
        self.bind()?;
        let (free, total) = result::mem_get_info().map_err(|e| device_error("cuMemGetInfo", e))?;
        Ok(MemInfo {
            free: free as u64,
            total: total as u64,
        })
    }

    fn record_event(&mut self, stream: StreamId) -> Result<EventId, BackendError> {
        self.bind()?;
        let handle = self.take_spare_event()?;
        if self.knows_stream(stream) {
            // SAFETY: `handle` is a live event from cuEventCreate; the stream handle is one
            // the backend was shown through a `&CudaStream` of this context (or a built-in
            // stream), so it is a stream handle of this context. If its owner destroyed it
            // since, the driver reports an error, handled below.
            let recorded =
                unsafe { result::event::record(handle as sys::CUevent, stream.0 as sys::CUstream) };
            if recorded.is_ok() {
                return Ok(self.new_event_id(handle));
            }
        }
        // The stream is unknown or gone: wait for all the device's work instead, and return a
        // fresh event: one never recorded reports completion, which is then true.
        self.release_event(handle);
        self.synchronize_all()?;
        let fresh = result::event::create(CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| device_error("cuEventCreate", e))?;
        Ok(self.new_event_id(fresh as usize))
    }

    fn query_event(&mut self, event: EventId) -> Result<bool, BackendError> {
        let Some(&handle) = self.events.get(&event.0) else {
            return Ok(true);
        };
        self.bind()?;
        // SAFETY: `handle` is an outstanding event of this backend (not destroyed: it leaves
        // `events` before it is released).
        match unsafe { result::event::query(handle as sys::CUevent) } {
            Ok(()) => Ok(true),
            Err(DriverError(CUresult::CUDA_ERROR_NOT_READY)) => Ok(false),
            Err(e) => Err(device_error("cuEventQuery", e)),
        }
    }

    fn synchronize_event(&mut self, event: EventId) -> Result<(), BackendError> {
        let Some(&handle) = self.events.get(&event.0) else {
            return Ok(());
        };
        self.bind()?;
        // SAFETY: as in `query_event`.
        unsafe { result::event::synchronize(handle as sys::CUevent) }
            .map_err(|e| device_error("cuEventSynchronize", e))
    }

    fn destroy_event(&mut self, event: EventId) {
        if let Some(handle) = self.events.remove(&event.0)
            && self.bind().is_ok()
        {
            self.release_event(handle);
        }
    }

    /// True when the device supports virtual memory management
    /// (`CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`) and its allocation
    /// granularity divides 2 MiB, the smallest page rule 19 asks for.
    fn virtual_memory(&self) -> bool {
        self.vmm.granularity.is_some()
    }

    /// `cuMemAddressReserve`, aligned to the allocation granularity. Refused without a driver
    /// call unless `size` is a whole number of `page`s and `page` a multiple of 2 MiB and of
    /// the granularity.
    fn reserve(&mut self, size: u64, page: u64) -> Result<u64, BackendError> {
        self.vmm_reserve(size, page)
    }

    /// `cuMemAddressFree`. Refused without a driver call unless `address` and `size` are a
    /// reservation of this backend with nothing mapped.
    fn release_reservation(&mut self, address: u64, size: u64) -> Result<(), BackendError> {
        self.vmm_release_reservation(address, size)
    }

    /// `cuMemCreate` (pinned, on this device) and `cuMemMap` per page, then `cuMemSetAccess`
    /// (read and write for this device) over the span; on any failure the pages of this call
    /// are unmapped and released. Refused without a driver call unless the span is whole,
    /// unmapped pages of one reservation.
    fn map(&mut self, address: u64, size: u64) -> Result<(), BackendError> {
        self.vmm_map(address, size)
    }

    fn map_handle(&mut self, address: u64, size: u64) -> Result<(), BackendError> {
        self.vmm_map_handle(address, size)
    }

    /// Synchronises `stream` (the device, for a stream this backend does not know), then
    /// `cuMemUnmap` per page, and `cuMemRelease` of each handle whose last mapping that was
    /// (rule 22: a page mapped at several addresses stays until its last mapping goes). Refused without a driver call unless the span
    /// is whole, mapped pages of one reservation.
    fn unmap(&mut self, address: u64, size: u64, stream: StreamId) -> Result<(), BackendError> {
        self.vmm_unmap(address, size, stream)
    }

    /// Rule 22h: `cuMemMap` of the handles behind `source` at `address`, page by page, then
    /// `cuMemSetAccess` over the span; no memory is created. Refused without a driver call
    /// unless the target is whole unmapped pages and the source whole mapped pages, each of one
    /// reservation, with the same page.
    fn alias(&mut self, address: u64, source: u64, size: u64) -> Result<(), BackendError> {
        self.vmm_alias(address, source, size)
    }

    /// Rule 23k: an event of the spare pool recorded on `on` (`cuEventRecord`), `waiter` made
    /// to wait for it (`cuStreamWaitEvent`), the event back to the pool (the wait keeps the
    /// work it captured; reusing the event later records anew without touching the wait). A
    /// stream the backend does not know is ordered by synchronising the device instead.
    fn wait_stream(&mut self, waiter: StreamId, on: StreamId) -> Result<(), BackendError> {
        self.bind()?;
        if waiter == on {
            return Ok(());
        }
        if !self.knows_stream(waiter) || !self.knows_stream(on) {
            return self.synchronize_all();
        }
        let handle = self.take_spare_event()?;
        // SAFETY: `handle` is a live event from cuEventCreate (taken from the spare pool, so
        // no one else records on it now); both stream handles are ones the backend was shown
        // through a `&CudaStream` of this context (or built-in streams), so they are stream
        // handles of this context. If an owner destroyed one since, the driver reports an
        // error, handled below; cuStreamWaitEvent reads the event's recorded state when it is
        // called, so recording on the event again later does not change this wait.
        let waited = unsafe {
            result::event::record(handle as sys::CUevent, on.0 as sys::CUstream).and_then(|()| {
                result::stream::wait_event(
                    waiter.0 as sys::CUstream,
                    handle as sys::CUevent,
                    sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
            })
        };
        self.release_event(handle);
        match waited {
            Ok(()) => Ok(()),
            // A stream gone: order by waiting for all the device's work, which is safe.
            Err(_) => self.synchronize_all(),
        }
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        if self.bind().is_err() {
            return;
        }
        let _ = result::ctx::synchronize();
        for (_, handle) in self.events.drain() {
            // SAFETY: each outstanding event is destroyed once (drained from the map).
            let _ = unsafe { result::event::destroy(handle as sys::CUevent) };
        }
        for handle in self.spare.drain(..) {
            // SAFETY: each spare event is destroyed once (drained from the pool).
            let _ = unsafe { result::event::destroy(handle as sys::CUevent) };
        }
        // The context was synchronised above: no queued work still uses a mapped page.
        self.release_virtual_memory();
        for (address, _) in self.segments.drain() {
            // SAFETY: each live segment came from cuMemAlloc and is freed once (drained from
            // the map); the context was synchronised above, so no work still accesses it. No
            // block can be in use: every user-held block keeps the allocator, and with it this
            // backend, alive (through its anchor).
            let _ = unsafe { result::free_sync(address) };
        }
    }
}

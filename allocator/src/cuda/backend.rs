//! The CUDA device behind the policy core: segments from `cuMemAlloc`, events from
//! `cuEventCreate`, all through cudarc's driver bindings.
//!
//! The one rule: every `unsafe` block of cachalot that reaches the driver lives in this file
//! or, for the allocators cachalot is compared with, in `baselines.rs` (the rest of `cuda` has
//! only the `unsafe fn`s that reinterpret a buffer's type), each with a
//! `// SAFETY:` comment, and every handle that reaches the driver was produced by the driver and checked
//! here first. The [`Backend`] trait is safe, so a caller may pass any address, stream id or
//! event id: addresses are checked against the segments this backend allocated, events against
//! the ones it created, and streams against the ones it was shown; anything else is refused
//! (or, for an unknown stream, handled by synchronising the device) without touching the driver.

use crate::sync::real::Arc;

use cudarc::driver::sys::{self, CUevent_flags, CUresult};
use cudarc::driver::{CudaContext, CudaStream, DriverError, LaunchArgs, PushKernelArg, result};
use rustc_hash::FxHashMap;

use super::buffer::{DeviceBlock, DeviceBuffer};
use super::error::CudaError;
use super::streams::{StreamRegistry, stream_id};
use super::view::{DeviceView, DeviceViewMut};
use crate::backend::{Backend, BackendError, EventId, MemInfo, StreamId};
use crate::policy::SegmentInfo;

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
/// Most programs use [`CudaAllocator`](super::CudaAllocator), which wraps this backend in the
/// caching policy. Use it directly to drive a [`CachingCore`](crate::CachingCore) by hand (trace
/// replay, experiments); streams are named by [`stream_id`](super::stream_id), and a stream must be shown to the
/// backend ([`CudaBackend::retain_stream`] or [`CudaBackend::note_stream`]) before events are
/// recorded on it.
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

    /// Synchronises `stream` (the device, for a stream this backend does not know), then
    /// `cuMemUnmap` and `cuMemRelease` per page. Refused without a driver call unless the span
    /// is whole, mapped pages of one reservation.
    fn unmap(&mut self, address: u64, size: u64, stream: StreamId) -> Result<(), BackendError> {
        self.vmm_unmap(address, size, stream)
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

// Kernel arguments: a buffer or view goes to a kernel as its device address. These impls order
// and record nothing — cudarc's `LaunchArgs` does not reveal its stream — which is the raw
// hazard documented on `DeviceBuffer`; `super::Launch` does both.

/// A bare device address: **nothing is ordered or recorded** (cudarc does not reveal the launch
/// stream). Fine on the block's own stream; on another, use [`Launch`](super::Launch).
// SAFETY: the argument pushed is a reference to the block's `CUdeviceptr` (a `u64`, which is
// `DeviceRepr`), borrowed for `'b: 'a`, so it outlives the launch builder that reads it.
unsafe impl<'a, 'b: 'a> PushKernelArg<&'b DeviceBlock> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b DeviceBlock) -> &mut Self {
        self.arg(arg.address_ref())
    }
}

/// A bare device address: nothing is ordered or recorded; see `&DeviceBlock`.
// SAFETY: as for `&DeviceBlock`.
unsafe impl<'a, 'b: 'a> PushKernelArg<&'b mut DeviceBlock> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut DeviceBlock) -> &mut Self {
        let arg: &'b DeviceBlock = arg;
        self.arg(arg.address_ref())
    }
}

/// A bare device address: **nothing is ordered or recorded** (cudarc does not reveal the launch
/// stream). Fine on the buffer's own stream; on another, use [`Launch`](super::Launch).
// SAFETY: as for `&DeviceBlock`.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b DeviceBuffer<T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b DeviceBuffer<T>) -> &mut Self {
        self.arg(arg.block().address_ref())
    }
}

/// A bare device address: nothing is ordered or recorded; see `&DeviceBuffer`.
// SAFETY: as for `&DeviceBlock`.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b mut DeviceBuffer<T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut DeviceBuffer<T>) -> &mut Self {
        let arg: &'b DeviceBuffer<T> = arg;
        self.arg(arg.block().address_ref())
    }
}

/// The view's device address: nothing is ordered or recorded; see `&DeviceBuffer`.
// SAFETY: the argument pushed is a reference to the view's own address field (a `u64`),
// borrowed with the view for `'b: 'a`, so it outlives the launch builder; the view borrows its
// buffer, so the memory it points into outlives it too.
unsafe impl<'a, 'b: 'a, 'v, T> PushKernelArg<&'b DeviceView<'v, T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b DeviceView<'v, T>) -> &mut Self {
        self.arg(arg.address_ref())
    }
}

/// The view's device address: nothing is ordered or recorded; see `&DeviceBuffer`.
// SAFETY: as for `&DeviceView`.
unsafe impl<'a, 'b: 'a, 'v, T> PushKernelArg<&'b DeviceViewMut<'v, T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b DeviceViewMut<'v, T>) -> &mut Self {
        self.arg(arg.address_ref())
    }
}

/// The view's device address: nothing is ordered or recorded; see `&DeviceBuffer`.
// SAFETY: as for `&DeviceView`.
unsafe impl<'a, 'b: 'a, 'v, T> PushKernelArg<&'b mut DeviceViewMut<'v, T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut DeviceViewMut<'v, T>) -> &mut Self {
        let arg: &'b DeviceViewMut<'v, T> = arg;
        self.arg(arg.address_ref())
    }
}

// Virtual memory for expandable segments (rule 19 of ARCHITECTURE.md): address space from
// `cuMemAddressReserve`, backed page by page with `cuMemCreate` + `cuMemMap`, made accessible
// with `cuMemSetAccess`, given back with `cuMemUnmap` + `cuMemRelease` and `cuMemAddressFree`.
// Every address and size is checked against the reservations and pages recorded here before it
// reaches the driver; the driver sees only ranges it handed out, in the state it left them.

/// The smallest page rule 19 asks for (a small-pool range's page): the device's allocation
/// granularity must divide it.
const VMM_MIN_PAGE: u64 = 2 << 20;

/// One backend's virtual memory: what the device offers, and the reservations made.
#[derive(Debug, Default)]
struct Vmm {
    /// The device's allocation granularity for pinned memory, when it supports virtual memory
    /// management and the granularity divides [`VMM_MIN_PAGE`]; `None` otherwise.
    granularity: Option<u64>,
    /// Live reservations by first address.
    reservations: std::collections::BTreeMap<u64, Reservation>,
    /// Bytes mapped, over all reservations.
    mapped: u64,
}

/// A mapped page: its address and the `cuMemCreate` handle behind it.
type Page = (u64, sys::CUmemGenericAllocationHandle);

/// One `cuMemAddressReserve` range and its mapped pages.
#[derive(Debug)]
struct Reservation {
    size: u64,
    page: u64,
    /// Mapped pages: page address → the `cuMemCreate` handle behind it.
    pages: std::collections::BTreeMap<u64, sys::CUmemGenericAllocationHandle>,
}

impl Vmm {
    /// The first address of the reservation of which `size` bytes at `address` are whole
    /// pages, if there is one.
    fn span(&self, address: u64, size: u64) -> Option<u64> {
        let (&base, r) = self.reservations.range(..=address).next_back()?;
        let end = address.checked_add(size)?;
        (size > 0
            && end <= base.checked_add(r.size)?
            && (address - base).is_multiple_of(r.page)
            && size.is_multiple_of(r.page))
        .then_some(base)
    }

    /// For `size` bytes at `address` that are whole pages of a reservation: its first
    /// address, its page, and the pages of the span that are mapped, with their handles.
    fn pages_of(&self, address: u64, size: u64) -> Option<(u64, u64, Vec<Page>)> {
        let base = self.span(address, size)?;
        let r = self.reservations.get(&base)?;
        let pages = r
            .pages
            .range(address..address + size)
            .map(|(&a, &h)| (a, h))
            .collect();
        Some((base, r.page, pages))
    }
}

/// The device location of `ordinal`'s memory.
pub(super) fn device_location(ordinal: usize) -> sys::CUmemLocation {
    // Ordinals are small; one that does not fit is refused by the driver.
    let id = i32::try_from(ordinal).unwrap_or(i32::MAX);
    const { assert!(std::mem::offset_of!(sys::CUmemLocation, type_) == 0) };
    // SAFETY: in every CUDA version cudarc binds, `CUmemLocation` is `repr(C)`: the location
    // type (a `repr(u32)` enum) at offset 0 (asserted above) and, at offset 4, either the
    // `c_int` device id or (CUDA 13.2 and later) a 4-byte union whose `id` member is that
    // `c_int` — 8 bytes in all, which `transmute` checks at compile time. Its fields are named
    // differently across those versions, which is why it is built from its bytes. The first
    // value is `CU_MEM_LOCATION_TYPE_DEVICE`, a valid value of the enum, and every bit pattern
    // is a valid `c_int`.
    unsafe {
        std::mem::transmute::<[i32; 2], sys::CUmemLocation>([
            sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE as i32,
            id,
        ])
    }
}

/// Pinned device memory of device `ordinal`, as `cuMemCreate` is asked for it.
fn pinned_on(ordinal: usize) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
        location: device_location(ordinal),
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// Read and write access for device `ordinal`.
fn read_write_for(ordinal: usize) -> sys::CUmemAccessDesc {
    sys::CUmemAccessDesc {
        location: device_location(ordinal),
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

/// The allocation granularity of `ctx`'s device when it supports virtual memory management
/// (`CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`) and the granularity divides
/// 2 MiB; `None` otherwise, or when the driver cannot say.
fn probe_virtual_memory(ctx: &CudaContext) -> Option<u64> {
    let supported = ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)
        .ok()?;
    if supported == 0 {
        return None;
    }
    let prop = pinned_on(ctx.ordinal());
    let mut granularity: usize = 0;
    // SAFETY: both pointers are to live locals of the types the driver reads and writes;
    // `prop` is fully initialised.
    unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut granularity,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    }
    .result()
    .ok()?;
    let granularity = granularity as u64;
    (granularity > 0 && VMM_MIN_PAGE.is_multiple_of(granularity)).then_some(granularity)
}

/// A refusal made before any driver call: the arguments are not what this backend handed out.
fn vmm_refused(operation: &'static str, address: u64, size: u64, what: &str) -> BackendError {
    BackendError::Device {
        operation,
        message: format!("{address:#x} ({size} bytes) {what}"),
    }
}

/// Creates one page of `page` bytes (`prop`) and maps it at `address`; returns its handle. On
/// failure nothing is left created or mapped.
fn create_and_map(
    address: u64,
    page: usize,
    prop: &sys::CUmemAllocationProp,
) -> Result<sys::CUmemGenericAllocationHandle, BackendError> {
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: `handle` is a live local the driver writes; `prop` is a fully initialised
    // property (pinned memory on the backend's device) that outlives the call. Creating memory
    // touches no memory already in use.
    unsafe { sys::cuMemCreate(&mut handle, page, prop, 0) }
        .result()
        .map_err(|e| device_error("cuMemCreate", e))?;
    // SAFETY: `handle` was just created with exactly `page` bytes and is mapped nowhere yet.
    // `address` is page-aligned in a reservation of this backend and not mapped (the caller
    // checked it against the bookkeeping); the driver refuses a range that is not reserved or
    // already mapped rather than replacing a mapping.
    if let Err(e) = unsafe { sys::cuMemMap(address, page, 0, handle, 0) }.result() {
        // SAFETY: `handle` came from cuMemCreate above, is mapped nowhere, and is released
        // once, here.
        let _ = unsafe { sys::cuMemRelease(handle) };
        return Err(device_error("cuMemMap", e));
    }
    Ok(handle)
}

/// Unmaps and releases pages that [`create_and_map`] mapped (`(address, handle)`, each of
/// `page` bytes); errors are ignored (nothing more can be done about them).
///
/// # Safety
///
/// Each page must be mapped at its address with its handle by this backend, must leave the
/// bookkeeping (it is released exactly once), and no work queued on the device may still use
/// it.
unsafe fn unmap_and_release(pages: &[Page], page: usize) {
    for &(address, handle) in pages {
        // SAFETY: the caller's contract: mapped here with this handle, unused, released once.
        let _ = unsafe { sys::cuMemUnmap(address, page) };
        // SAFETY: as above; its only mapping is gone, so the memory goes back to the device.
        let _ = unsafe { sys::cuMemRelease(handle) };
    }
}

impl CudaBackend {
    /// The reservations of address space this backend holds for expandable segments (rule 19).
    pub fn reservation_count(&self) -> usize {
        self.vmm.reservations.len()
    }

    /// The bytes of device memory mapped into those reservations.
    pub fn mapped_bytes(&self) -> u64 {
        self.vmm.mapped
    }

    /// Waits for the work queued on `stream`, or on the whole device when the backend does not
    /// know the stream or the driver refuses it.
    fn synchronize_stream(&self, stream: StreamId) -> Result<(), BackendError> {
        self.bind()?;
        if self.knows_stream(stream) {
            // SAFETY: as in `record_event`: the handle is a built-in stream or one shown to
            // the backend through a `&CudaStream` of this context; if its owner destroyed it
            // since, the driver reports an error and the whole device is synchronised instead.
            if unsafe { result::stream::synchronize(stream.0 as sys::CUstream) }.is_ok() {
                return Ok(());
            }
        }
        self.synchronize_all()
    }

    fn vmm_reserve(&mut self, size: u64, page: u64) -> Result<u64, BackendError> {
        let Some(granularity) = self.vmm.granularity else {
            return Err(BackendError::Device {
                operation: "cuMemAddressReserve",
                message: format!(
                    "device {} offers no virtual memory management ({size} bytes asked)",
                    self.ctx.ordinal()
                ),
            });
        };
        let bytes = usize::try_from(size).ok().filter(|_| {
            size > 0
                && page > 0
                && page.is_multiple_of(VMM_MIN_PAGE)
                && page.is_multiple_of(granularity)
                && size.is_multiple_of(page)
        });
        let Some(bytes) = bytes else {
            return Err(vmm_refused(
                "cuMemAddressReserve",
                0,
                size,
                &format!(
                    "is not a whole number of {page}-byte pages, each a multiple of 2 MiB and of the device's {granularity}-byte granularity"
                ),
            ));
        };
        self.bind()?;
        let mut address: sys::CUdeviceptr = 0;
        // SAFETY: `address` is a live local the driver writes; no fixed address is asked for
        // (0), so the driver picks address space nothing uses; no memory is mapped yet.
        unsafe { sys::cuMemAddressReserve(&mut address, bytes, granularity as usize, 0, 0) }
            .result()
            .map_err(|e| device_error("cuMemAddressReserve", e))?;
        self.vmm.reservations.insert(
            address,
            Reservation {
                size,
                page,
                pages: std::collections::BTreeMap::new(),
            },
        );
        Ok(address)
    }

    fn vmm_release_reservation(&mut self, address: u64, size: u64) -> Result<(), BackendError> {
        match self.vmm.reservations.get(&address) {
            Some(r) if r.size == size && r.pages.is_empty() => {}
            _ => {
                return Err(vmm_refused(
                    "cuMemAddressFree",
                    address,
                    size,
                    "is not a reservation of this backend with nothing mapped",
                ));
            }
        }
        self.bind()?;
        // SAFETY: `address` and `size` are exactly a reservation cuMemAddressReserve made
        // (checked above, and removed below so it is freed once), with no page mapped in it.
        unsafe { sys::cuMemAddressFree(address, size as usize) }
            .result()
            .map_err(|e| device_error("cuMemAddressFree", e))?;
        self.vmm.reservations.remove(&address);
        Ok(())
    }

    fn vmm_map(&mut self, address: u64, size: u64) -> Result<(), BackendError> {
        let (base, page, _) = self
            .vmm
            .pages_of(address, size)
            .filter(|(_, _, pages)| pages.is_empty())
            .ok_or_else(|| {
                vmm_refused(
                    "cuMemMap",
                    address,
                    size,
                    "is not whole unmapped pages of one reservation of this backend",
                )
            })?;
        let page_bytes = page as usize;
        self.bind()?;
        let ordinal = self.ctx.ordinal();
        let prop = pinned_on(ordinal);
        let end = address + size;
        let mut made: Vec<Page> = Vec::with_capacity((size / page) as usize);
        let mut failure = None;
        let mut at = address;
        while at < end {
            match create_and_map(at, page_bytes, &prop) {
                Ok(handle) => made.push((at, handle)),
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
            at += page;
        }
        if failure.is_none() {
            let access = read_write_for(ordinal);
            // SAFETY: every page of [address, end) was just mapped (above); `access` is a live,
            // fully initialised descriptor, and the count is 1.
            if let Err(e) =
                unsafe { sys::cuMemSetAccess(address, size as usize, &access, 1) }.result()
            {
                failure = Some(device_error("cuMemSetAccess", e));
            }
        }
        if let Some(e) = failure {
            // SAFETY: these pages were mapped by this call with these handles, never entered
            // the bookkeeping, and nothing was handed out in them.
            unsafe { unmap_and_release(&made, page_bytes) };
            return Err(e);
        }
        if let Some(r) = self.vmm.reservations.get_mut(&base) {
            r.pages.extend(made);
        }
        self.vmm.mapped += size;
        Ok(())
    }

    fn vmm_unmap(&mut self, address: u64, size: u64, stream: StreamId) -> Result<(), BackendError> {
        let (base, page, pages) = self
            .vmm
            .pages_of(address, size)
            .filter(|(_, page, pages)| pages.len() as u64 == size / page)
            .ok_or_else(|| {
                vmm_refused(
                    "cuMemUnmap",
                    address,
                    size,
                    "is not whole mapped pages of one reservation of this backend",
                )
            })?;
        let page_bytes = page as usize;
        // The range's blocks are used on its stream only (uses on other streams were recorded
        // and waited for before the blocks came back free): wait for that stream.
        self.synchronize_stream(stream)?;
        for (i, &(at, _)) in pages.iter().enumerate() {
            // SAFETY: `at` is a page this backend mapped (checked against the bookkeeping
            // above), and the work queued on the range's stream is done.
            if let Err(e) = unsafe { sys::cuMemUnmap(at, page_bytes) }.result() {
                // Put back the pages already unmapped, so that nothing is unmapped.
                self.remap(&pages[..i], page_bytes);
                return Err(device_error("cuMemUnmap", e));
            }
        }
        for &(_, handle) in &pages {
            // SAFETY: each handle came from cuMemCreate for one of these pages; its only
            // mapping was removed above, and it leaves the bookkeeping below (released once).
            let _ = unsafe { sys::cuMemRelease(handle) };
        }
        if let Some(r) = self.vmm.reservations.get_mut(&base) {
            for (at, _) in &pages {
                r.pages.remove(at);
            }
        }
        self.vmm.mapped -= size;
        Ok(())
    }

    /// Maps again pages unmapped by a failing [`Backend::unmap`] (their handles still held),
    /// with access for this device. Best effort: the driver has already failed once.
    fn remap(&self, pages: &[Page], page: usize) {
        let access = read_write_for(self.ctx.ordinal());
        for &(at, handle) in pages {
            // SAFETY: `at` was mapped with `handle` (still live: not released) until just now,
            // so it is reserved, unmapped, and `handle` holds exactly `page` bytes.
            if unsafe { sys::cuMemMap(at, page, 0, handle, 0) }
                .result()
                .is_ok()
            {
                // SAFETY: the page was just mapped; `access` is a live descriptor, count 1.
                let _ = unsafe { sys::cuMemSetAccess(at, page, &access, 1) };
            }
        }
    }

    /// Unmaps and releases every page and gives back every reservation (the backend is
    /// dropped; the caller synchronised the context).
    fn release_virtual_memory(&mut self) {
        for (base, r) in std::mem::take(&mut self.vmm.reservations) {
            let pages: Vec<_> = r.pages.into_iter().collect();
            // SAFETY: every page is mapped with its handle by this backend and was drained
            // from the bookkeeping (released once); the context was synchronised and no block
            // can be in use (every user-held block keeps the allocator, and with it this
            // backend, alive).
            unsafe { unmap_and_release(&pages, r.page as usize) };
            // SAFETY: a reservation cuMemAddressReserve made, drained from the bookkeeping
            // (freed once), with nothing mapped in it any more.
            let _ = unsafe { sys::cuMemAddressFree(base, r.size as usize) };
        }
        self.vmm.mapped = 0;
    }
}

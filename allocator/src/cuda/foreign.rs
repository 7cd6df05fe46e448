//! Foreign callers: code that hands the allocator CUDA handles it did not make, and that
//! expects the calling thread's CUDA state untouched — PyTorch's pluggable allocator
//! (`torch.cuda.memory.CUDAPluggableAllocator`, the `cachalot` Python package's plug-in)
//! passes a `cudaStream_t` with every call and keeps its own idea of the current device.
//!
//! The one rule: a raw handle becomes a cudarc stream here and nowhere else, by
//! [`CudaAllocator::borrow_stream`], whose caller promises what cudarc's
//! `wrap_borrowed_stream` asks; everything else in this file is safe to call with any value.
//! A runtime API `cudaStream_t` is the driver's `CUstream` (the same handle), and the runtime
//! API's current device is the thread's current context, which [`CurrentContext`] puts back.

use cudarc::driver::sys::{self, CUstreamCaptureStatus};
use cudarc::driver::{CudaStream, result};

use super::CudaAllocator;
use super::error::CudaError;
use crate::sync::real::{Arc, OnceLock};

impl CudaAllocator {
    /// A cudarc stream for a `CUstream` (or runtime API `cudaStream_t`) handle that another
    /// library made and owns: dropping it never destroys the stream. The handles 0 (the legacy
    /// default stream), 1 (`CU_STREAM_LEGACY`) and 2 (`CU_STREAM_PER_THREAD`) are the built-in
    /// streams. Pass it to [`CudaAllocator::malloc_raw`] and [`CudaAllocator::record_stream`]
    /// like a stream of cudarc's own; its [`super::stream_id`] is `handle`.
    ///
    /// # Safety
    ///
    /// As for cudarc's `CudaContext::wrap_borrowed_stream`: `handle` must be a live stream of
    /// this allocator's context ([`CudaAllocator::context`]), or a built-in one, and its owner
    /// must keep it alive while the returned stream — or a block allocated on it, or a use
    /// recorded on it — may still be used. (A stream destroyed early is noticed when the
    /// allocator records an event on it: the backend then synchronises the whole device.)
    pub unsafe fn borrow_stream(&self, handle: usize) -> Arc<CudaStream> {
        // SAFETY: the caller promises that `handle` is a live stream of this context that its
        // owner keeps alive; the wrapper is marked borrowed, so dropping it destroys nothing.
        unsafe { self.context().wrap_borrowed_stream(handle as sys::CUstream) }
    }
}

/// Whether work queued on `stream` now would be captured into a CUDA graph
/// (`cuStreamIsCapturing`: a capture is active or was invalidated on it). An allocator must not
/// make driver calls that a capture forbids, nor hand memory to a graph from its ordinary
/// pools.
pub fn stream_is_capturing(stream: &CudaStream) -> Result<bool, CudaError> {
    let mut status = CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: `stream` is a live cudarc stream (its handle is valid while the borrow lasts:
    // owned streams live as long as their wrapper, borrowed ones by `borrow_stream`'s
    // contract), and `status` is a valid place for the driver to write one enum value.
    unsafe { sys::cuStreamIsCapturing(stream.cu_stream(), &mut status) }.result()?;
    Ok(status != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// The calling thread's current CUDA context, put back when this value is dropped.
///
/// The allocator makes its device's context current for its driver calls and leaves it so; a
/// foreign caller that tracks the current device itself (the CUDA runtime API: PyTorch frees a
/// tensor of device 1 while device 0 is current) keeps one of these across each call into the
/// allocator, so that its current device is unchanged afterwards.
///
/// ```no_run
/// let alloc = cachalot::cuda::CudaAllocator::for_device(0)?;
/// let _keep = cachalot::cuda::CurrentContext::save()?;
/// alloc.empty_cache()?; // the thread's current context is put back at the end of scope
/// # Ok::<(), cachalot::cuda::CudaError>(())
/// ```
#[derive(Debug)]
#[must_use = "the context is put back when this value is dropped"]
pub struct CurrentContext {
    /// The context current when saved; `None` when there was none.
    saved: Option<usize>,
}

impl CurrentContext {
    /// Reads the calling thread's current context (`cuCtxGetCurrent`: no device work, a
    /// thread-local read in the driver). Fails only without a usable driver
    /// ([`CudaError::NoDriver`], asked once per process: never a panic).
    pub fn save() -> Result<CurrentContext, CudaError> {
        static PRESENT: OnceLock<bool> = OnceLock::new();
        if !*PRESENT.get_or_init(crate::backend::cuda::driver_library_present) {
            return Err(CudaError::NoDriver {
                reason: "the CUDA driver library (libcuda) could not be loaded".into(),
            });
        }
        let saved = result::ctx::get_current()?.map(|c| c as usize);
        Ok(CurrentContext { saved })
    }
}

impl Drop for CurrentContext {
    fn drop(&mut self) {
        let Ok(now) = result::ctx::get_current() else {
            return;
        };
        let now = now.map(|c| c as usize);
        if now == self.saved {
            return;
        }
        let ctx = self
            .saved
            .map_or(std::ptr::null_mut(), |c| c as sys::CUcontext);
        // SAFETY: `ctx` was the thread's current context when saved (or null, which unbinds);
        // this value lives only across calls into the allocator, which never destroys a
        // context (it retains device primary contexts, which PyTorch retains too), so the
        // handle is still a live context.
        let _ = unsafe { result::ctx::set_current(ctx) };
    }
}

//! The C functions PyTorch calls: the FFI layer, and the only `unsafe` of the crate.
//!
//! `torch.cuda.memory.CUDAPluggableAllocator(path, "cachalot_torch_alloc",
//! "cachalot_torch_free")` loads this shared library (the Python extension module itself, so
//! PyTorch's calls and Python's reach the same allocators) and calls:
//!
//! | function | PyTorch's signature | when |
//! |---|---|---|
//! | [`cachalot_torch_alloc`] | `void* (size_t size, int device, cudaStream_t stream)` | every CUDA allocation |
//! | [`cachalot_torch_free`] | `void (void* ptr, size_t size, int device, cudaStream_t stream)` | every free, with the allocation's own stream |
//! | [`cachalot_torch_record_stream`] | `void (void* ptr, cudaStream_t stream)` | `tensor.record_stream(s)` (`set_record_stream_fn`) |
//! | [`cachalot_torch_empty_cache`] | `void ()` | `torch.cuda.empty_cache()` (`set_reset_fn`) |
//! | [`cachalot_torch_set_memory_fraction`] | `void (double fraction, int device)` | `torch.cuda.set_per_process_memory_fraction` (`set_memory_fraction_fn`) |
//! | `cachalot_torch_begin_allocate_to_pool` (C++, `shim/torch_shim.cpp`) | `void (int, MempoolId_t, std::function<bool(cudaStream_t)>)` | a CUDA graph capture begins (`set_begin_allocate_to_pool`): refused |
//!
//! The one rule: nothing unwinds out of Rust code here except a C++ exception thrown on
//! purpose. Every body runs inside `catch_unwind`; a failure (an error, or a panic turned into
//! one) is reported to PyTorch by throwing a C++ `std::runtime_error` from the shim, *after*
//! `catch_unwind` returned — which is how PyTorch's own allocator reports an out-of-memory
//! error, and which PyTorch's Python bindings turn into a `RuntimeError`. The functions that can
//! throw have the `"C-unwind"` ABI, so that a C++ exception passes through their frames. The
//! free never throws (PyTorch calls it from destructors): its errors are counted and printed.

use std::ffi::{CString, c_char, c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cachalot::cuda::cudarc::driver::CudaStream;
use cachalot::cuda::{CudaAllocator, CurrentContext};

use crate::plugin::{Device, plugin};

unsafe extern "C-unwind" {
    /// Throws `std::runtime_error(message)` (the shim copies the message first).
    fn cachalot_throw_runtime_error(message: *const c_char) -> !;
    /// The address of the shim's `cachalot_torch_begin_allocate_to_pool`, whose parameters
    /// (`std::pair`, `std::function`) only C++ can name.
    fn cachalot_begin_allocate_to_pool_address() -> *const c_void;
}

/// How often PyTorch called each hook (`record_stream`, `empty_cache`, `memory_fraction`), for
/// `cachalot._native.hook_calls()`: whether PyTorch reaches a hook at all.
static HOOK_CALLS: [AtomicU64; 3] = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];

/// Failures of frees (which cannot report to PyTorch), counted for `errors()`.
static FREE_ERRORS: AtomicU64 = AtomicU64::new(0);
/// How many free failures are printed before the rest are only counted.
const PRINTED_FREE_ERRORS: u64 = 10;

/// The text of a panic's payload.
fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".to_owned())
}

/// Runs `f`, turning a panic into an error message.
fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => Err(format!(
            "cachalot: internal error in {what}: {} (please report it)",
            panic_text(&*payload)
        )),
    }
}

/// Throws `message` as a C++ `std::runtime_error` to PyTorch's caller.
///
/// # Safety
///
/// Only from a `"C-unwind"` function called by C++ code that expects exceptions (PyTorch's
/// allocator paths do: its own allocator throws from the same places), and outside
/// `catch_unwind`.
unsafe fn throw(message: String) -> ! {
    let text = CString::new(message.replace('\0', " "))
        .unwrap_or_else(|_| CString::from(c"cachalot: error"));
    // SAFETY: `text` is a NUL-terminated string alive until the shim has copied it into the
    // exception object; the exception then unwinds through this "C-unwind" frame (dropping
    // `text`) into PyTorch's C++ frames, as the caller's contract requires.
    unsafe { cachalot_throw_runtime_error(text.as_ptr()) }
}

/// The allocator's stream for PyTorch's `cudaStream_t` on `device`.
fn stream_of(device: &Device, handle: *mut c_void) -> Arc<CudaStream> {
    device.stream_with(handle as usize, |alloc: &CudaAllocator| {
        // SAFETY: PyTorch passes, with a device index, a stream of that device (its current
        // stream there, or the allocation's own stream at a free), made by the CUDA runtime
        // in the device's primary context — the context `plugin().device()` made this
        // allocator on — and PyTorch's streams (its pools, the default stream, streams the
        // user made) are never destroyed while its tensors use them. An external stream the
        // user destroys too early is handled by the backend (it then synchronises the device).
        unsafe { alloc.borrow_stream(handle as usize) }
    })
}

fn alloc(size: usize, device: c_int, stream: *mut c_void) -> Result<*mut c_void, String> {
    if size == 0 {
        return Ok(std::ptr::null_mut());
    }
    let dev = plugin()
        .device(device)
        .map_err(|e| format!("cachalot: device {device}: {e}"))?;
    let _keep = CurrentContext::save().map_err(|e| format!("cachalot: {e}"))?;
    let s = stream_of(dev, stream);
    let address = dev.alloc.malloc_raw(size, &s).map_err(|e| {
        if e.is_out_of_memory() {
            format!("{e} (cachalot plug-in, device {device})")
        } else {
            format!("cachalot: allocating {size} bytes on device {device}: {e}")
        }
    })?;
    Ok(address as usize as *mut c_void)
}

/// PyTorch's allocation: `size` bytes on `device`, for use on `stream`. Zero bytes give the
/// null pointer. A failure — out of memory after the cache was released and the request
/// retried, as PyTorch does, or a device error — throws a C++ `std::runtime_error` whose
/// message starts as PyTorch's does ("CUDA out of memory. Tried to allocate ..."): Python sees
/// a `RuntimeError`.
///
/// # Safety
///
/// Called by PyTorch's `CUDAPluggableAllocator` (or C++ code keeping its contract): `stream`
/// is a live stream of `device`'s primary context.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn cachalot_torch_alloc(
    size: usize,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    match guarded("alloc", || alloc(size, device, stream)) {
        Ok(p) => p,
        // SAFETY: PyTorch's allocation paths expect exceptions; outside `catch_unwind`.
        Err(message) => unsafe { throw(message) },
    }
}

fn free(ptr: *mut c_void, device: c_int) -> Result<(), String> {
    if ptr.is_null() {
        return Ok(());
    }
    let dev = plugin().device(device)?;
    let _keep = CurrentContext::save().map_err(|e| e.to_string())?;
    dev.alloc
        .free_raw(ptr as usize as u64)
        .map_err(|e| e.to_string())
}

/// PyTorch's free of `ptr` (allocated with `size` bytes on `device` and `stream`). The block
/// returns to the cache of the stream it was allocated on, in that stream's order; if other
/// streams were recorded as using it, it is reused only once their work queued so far is done.
/// Never throws: a failure is printed (the first few) and counted.
///
/// # Safety
///
/// Called by PyTorch's `CUDAPluggableAllocator` with a pointer from [`cachalot_torch_alloc`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cachalot_torch_free(
    ptr: *mut c_void,
    size: usize,
    device: c_int,
    stream: *mut c_void,
) {
    let _ = (size, stream);
    if let Err(e) = guarded("free", || free(ptr, device)) {
        let n = FREE_ERRORS.fetch_add(1, Ordering::Relaxed) + 1;
        if n <= PRINTED_FREE_ERRORS {
            eprintln!("cachalot: freeing {ptr:p} on device {device}: {e}");
        }
    }
}

fn record_stream(ptr: *mut c_void, stream: *mut c_void) -> Result<(), String> {
    if ptr.is_null() {
        return Ok(());
    }
    let address = ptr as usize as u64;
    // The pointer's device is not passed: the allocator holding it is the one that takes it
    // (the others refuse an unknown pointer and change nothing).
    let mut last = None;
    let mut keep = None;
    for (_, dev) in plugin().devices() {
        if keep.is_none() {
            keep = Some(CurrentContext::save().map_err(|e| e.to_string())?);
        }
        let s = stream_of(dev, stream);
        match dev.alloc.record_stream(address, &s) {
            Ok(()) => return Ok(()),
            Err(e) => last = Some(e),
        }
    }
    Err(match last {
        Some(e) => format!("cachalot: record_stream({ptr:p}): {e}"),
        None => format!("cachalot: record_stream({ptr:p}): no allocation was made yet"),
    })
}

/// `tensor.record_stream(stream)`: the tensor's block is not reused after its free until the
/// work queued on `stream` by then has completed (an event recorded at the free, PyTorch's
/// rule). A pointer that is not a live allocation throws.
///
/// # Safety
///
/// Called by PyTorch with a tensor's data pointer and a live stream of the tensor's device.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn cachalot_torch_record_stream(
    ptr: *mut c_void,
    stream: *mut c_void,
) {
    HOOK_CALLS[0].fetch_add(1, Ordering::Relaxed);
    if let Err(message) = guarded("record_stream", || record_stream(ptr, stream)) {
        // SAFETY: called from `recordStream`, a PyTorch operator, which expects exceptions.
        unsafe { throw(message) }
    }
}

/// [`cachalot_torch_record_stream`] called from Python (`cachalot.torch`'s `Tensor.record_stream`,
/// which does not rely on PyTorch reaching the hook): the same effect, an error as a message.
pub fn record_stream_from_python(ptr: usize, stream: usize) -> Result<(), String> {
    guarded("record_stream", || {
        record_stream(ptr as *mut c_void, stream as *mut c_void)
    })
}

/// `torch.cuda.empty_cache()`: waits for the events of blocks freed while other streams used
/// them, then gives every device's cached memory that holds no allocation back to the driver.
/// A device failure throws.
///
/// # Safety
///
/// Called by PyTorch's `emptyCache` (C++ that expects exceptions).
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn cachalot_torch_empty_cache() {
    HOOK_CALLS[1].fetch_add(1, Ordering::Relaxed);
    if let Err(message) = guarded("empty_cache", || plugin().empty_cache()) {
        // SAFETY: called from PyTorch's `emptyCache`, which expects exceptions.
        unsafe { throw(format!("cachalot: empty_cache: {message}")) }
    }
}

fn set_memory_fraction(fraction: f64, device: c_int) -> Result<(), String> {
    let dev = plugin().device(device)?;
    let _keep = CurrentContext::save().map_err(|e| e.to_string())?;
    dev.alloc
        .set_memory_fraction(fraction)
        .map_err(|e| e.to_string())
}

/// `torch.cuda.set_per_process_memory_fraction(fraction, device)`: caps the bytes the device's
/// allocator reserves at `fraction` of the device's memory (requests beyond it fail with out
/// of memory, after the cache is released and the request retried). Throws for a fraction
/// outside \[0, 1\] or a device that cannot be used.
///
/// # Safety
///
/// Called by PyTorch's `setMemoryFraction` (C++ that expects exceptions).
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn cachalot_torch_set_memory_fraction(fraction: f64, device: c_int) {
    HOOK_CALLS[2].fetch_add(1, Ordering::Relaxed);
    if let Err(message) = guarded("set_memory_fraction", || {
        set_memory_fraction(fraction, device)
    }) {
        // SAFETY: called from PyTorch's `setMemoryFraction`, which expects exceptions.
        unsafe {
            throw(format!(
                "cachalot: set_per_process_memory_fraction({fraction}, device={device}): {message}"
            ))
        }
    }
}

/// The addresses PyTorch's setters take (`CUDAPluggableAllocator.allocator().set_*_fn(int)`),
/// by setter name, and the allocation and free functions, for the Python package.
pub fn entry_points() -> Vec<(&'static str, usize)> {
    // SAFETY: the shim's function takes no arguments and returns a function's address.
    let begin = unsafe { cachalot_begin_allocate_to_pool_address() } as usize;
    vec![
        ("alloc", cachalot_torch_alloc as *const () as usize),
        ("free", cachalot_torch_free as *const () as usize),
        (
            "set_record_stream_fn",
            cachalot_torch_record_stream as *const () as usize,
        ),
        (
            "set_reset_fn",
            cachalot_torch_empty_cache as *const () as usize,
        ),
        (
            "set_memory_fraction_fn",
            cachalot_torch_set_memory_fraction as *const () as usize,
        ),
        ("set_begin_allocate_to_pool", begin),
    ]
}

/// How many frees failed since the process started.
pub fn free_errors() -> u64 {
    FREE_ERRORS.load(Ordering::Relaxed)
}

/// How often PyTorch called the `record_stream`, `empty_cache` and memory-fraction hooks.
pub fn hook_calls() -> [(&'static str, u64); 3] {
    [
        ("record_stream", HOOK_CALLS[0].load(Ordering::Relaxed)),
        ("empty_cache", HOOK_CALLS[1].load(Ordering::Relaxed)),
        ("memory_fraction", HOOK_CALLS[2].load(Ordering::Relaxed)),
    ]
}

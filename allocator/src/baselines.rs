//! The allocators cachalot is measured against (feature `baselines`): CUDA's stream-ordered
//! memory pool ([`StreamOrderedPool`], `cuMemAllocFromPoolAsync` / `cuMemFreeAsync`) and plain
//! `cuMemAlloc` / `cuMemFree` ([`DriverMalloc`]), as safe owned-handle wrappers, for the
//! side-by-side benchmark (`benches/gpu_compare.rs`, docs/GPU_BENCH.md) that runs them next to
//! cachalot. Nothing here is needed to use cachalot: its allocator is
//! [`CudaAllocator`](crate::cuda::CudaAllocator).
//!
//! The one rule: these are the driver's allocators as they are, with no policy of cachalot's
//! added — each call is one driver call (plus making the context current) — behind safe
//! wrappers. Besides the CUDA backend (`backend/cuda.rs` and `backend/cuda/vmm.rs`), this is
//! the only file of cachalot with `unsafe` blocks that reach the driver, each with a
//! `// SAFETY:` comment. An allocation is an owned handle ([`PoolBlock`], [`DriverBlock`]) that
//! only the allocator that made it takes back, so a safe caller can never free memory it does
//! not own; errors are values (out of memory told apart by
//! [`BaselineError::is_out_of_memory`]), never panics.
//!
//! ```no_run
//! use cachalot::baselines::StreamOrderedPool;
//! use cudarc::driver::CudaContext;
//!
//! let ctx = CudaContext::new(0)?;
//! let stream = ctx.new_stream()?;
//! let pool = StreamOrderedPool::new(ctx)?;
//! let block = pool.alloc(1 << 20, &stream)?;
//! pool.free(block, &stream)?;
//! // The freed MiB stays in the pool (release threshold u64::MAX): reused, not reserved again.
//! let again = pool.alloc(1 << 20, &stream)?;
//! assert_eq!(pool.reserved_high()?, pool.reserved_current()?);
//! pool.free(again, &stream)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::ffi::c_void;

use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::{CudaContext, CudaStream, DriverError, result};

use crate::backend::cuda::vmm::device_location;
use crate::sync::real::{Arc, AtomicU64, Ordering};

/// What the baselines' calls fail with.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BaselineError {
    /// The device has no room for the request (`CUDA_ERROR_OUT_OF_MEMORY`): free memory and
    /// retry.
    #[error("{operation}: out of memory ({bytes} bytes asked)")]
    OutOfMemory {
        /// The driver call.
        operation: &'static str,
        /// The bytes asked for.
        bytes: u64,
    },
    /// Any other driver error; the operation did not happen.
    #[error("{operation} failed: {error}")]
    Driver {
        /// The driver call.
        operation: &'static str,
        /// The driver's error.
        error: DriverError,
    },
    /// An allocation handed to an allocator other than the one that made it (refused without a
    /// driver call; the handle is dropped and its memory stays allocated).
    #[error("{address:#x} was not allocated by this {allocator}")]
    NotMine {
        /// The allocation's address.
        address: u64,
        /// Which kind of allocator refused it.
        allocator: &'static str,
    },
    /// A stream of another context than the allocator's (refused without a driver call).
    #[error("the stream belongs to another CUDA context than this {allocator}'s")]
    WrongContext {
        /// Which kind of allocator refused it.
        allocator: &'static str,
    },
}

impl BaselineError {
    /// True for out-of-memory: the request may succeed after memory is freed.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, BaselineError::OutOfMemory { .. })
    }

    fn from_driver(operation: &'static str, bytes: u64, error: DriverError) -> BaselineError {
        if error.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            BaselineError::OutOfMemory { operation, bytes }
        } else {
            BaselineError::Driver { operation, error }
        }
    }
}

/// Numbers for the allocators of this module, so each knows its own handles.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn bind(ctx: &CudaContext) -> Result<(), BaselineError> {
    ctx.bind_to_thread().map_err(|error| BaselineError::Driver {
        operation: "cuCtxSetCurrent",
        error,
    })
}

/// An allocation from a [`StreamOrderedPool`]: its address and size. Give it back with
/// [`StreamOrderedPool::free`]; dropped instead, its memory stays allocated in the pool until
/// the pool is destroyed and the process ends.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a pool block that is dropped is never freed"]
pub struct PoolBlock {
    address: u64,
    size: u64,
    pool: u64,
}

impl PoolBlock {
    /// The device address (0 for a zero-byte allocation).
    pub fn address(&self) -> u64 {
        self.address
    }

    /// The bytes asked for.
    pub fn size(&self) -> u64 {
        self.size
    }
}

/// CUDA's stream-ordered allocator on a pool of its own (`cuMemPoolCreate`: pinned memory of the
/// context's device, no export handle) whose release threshold is `u64::MAX`, so memory freed
/// into it stays reserved until [`StreamOrderedPool::trim`] — the most favourable setting for
/// reuse, and the one a caching allocator is compared with.
///
/// `Send + Sync`: the driver's pool calls are thread-safe, and each call makes the context
/// current on the calling thread. Dropping the pool synchronises the context and destroys it.
pub struct StreamOrderedPool {
    ctx: Arc<CudaContext>,
    pool: sys::CUmemoryPool,
    id: u64,
}

// SAFETY: `pool` is an opaque driver handle, not memory this process reads or writes; the
// driver's memory-pool calls may be made from any thread, concurrently, and every call here
// makes the pool's context current on the calling thread first. The handle is destroyed only
// in `Drop`, which takes `&mut self`.
unsafe impl Send for StreamOrderedPool {}
// SAFETY: as for `Send`: no method mutates Rust-side state, and the driver synchronises
// concurrent calls on one pool itself.
unsafe impl Sync for StreamOrderedPool {}

impl std::fmt::Debug for StreamOrderedPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamOrderedPool")
            .field("device", &self.ctx.ordinal())
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl StreamOrderedPool {
    /// A new pool on `ctx`'s device, release threshold `u64::MAX`.
    pub fn new(ctx: Arc<CudaContext>) -> Result<StreamOrderedPool, BaselineError> {
        bind(&ctx)?;
        // SAFETY: every field of `CUmemPoolProps` (in each CUDA version cudarc binds) is an
        // integer, a `repr(u32)` enum or newtype whose value 0 is a declared variant
        // (`..._INVALID` / `CU_MEM_HANDLE_TYPE_NONE`), a raw pointer (null), or an array or
        // union of those: all zeroes is a valid value, and what the driver reads as "not set".
        let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
        props.location = device_location(ctx.ordinal());
        // SAFETY: `props` is a fully initialised local that outlives the call.
        let pool = unsafe { result::mem_pool::create(&props) }
            .map_err(|e| BaselineError::from_driver("cuMemPoolCreate", 0, e))?;
        let made = StreamOrderedPool {
            ctx,
            pool,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        };
        let mut threshold: u64 = u64::MAX;
        // SAFETY: `pool` is the live pool just created; the release threshold is a `cuuint64_t`
        // and the pointer is to a live `u64` local.
        unsafe {
            result::mem_pool::set_attribute(
                made.pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast::<c_void>(),
            )
        }
        .map_err(|e| BaselineError::from_driver("cuMemPoolSetAttribute", 0, e))?;
        Ok(made)
    }

    /// The context of the pool's device.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    fn check_stream(&self, stream: &CudaStream) -> Result<(), BaselineError> {
        if stream.context().cu_ctx() != self.ctx.cu_ctx() {
            return Err(BaselineError::WrongContext { allocator: "pool" });
        }
        Ok(())
    }

    /// `cuMemAllocFromPoolAsync`: `size` bytes, ordered on `stream`. The contents are
    /// unspecified. A zero-byte request returns a block at address 0 without a driver call.
    pub fn alloc(&self, size: usize, stream: &CudaStream) -> Result<PoolBlock, BaselineError> {
        self.check_stream(stream)?;
        let block = |address| PoolBlock {
            address,
            size: size as u64,
            pool: self.id,
        };
        if size == 0 {
            return Ok(block(0));
        }
        bind(&self.ctx)?;
        // SAFETY: `self.pool` is live until `Drop`; the stream is a live stream of the pool's
        // context (checked above; `&CudaStream` keeps it alive for the call). The memory is
        // uninitialised, which is fine: only its address is handed out.
        let address = unsafe { result::mem_pool::alloc_async(self.pool, size, stream.cu_stream()) }
            .map_err(|e| BaselineError::from_driver("cuMemAllocFromPoolAsync", size as u64, e))?;
        Ok(block(address))
    }

    /// `cuMemFreeAsync` on `stream`: the memory goes back to the pool, reusable by work ordered
    /// after this point of `stream`. A block of another pool is refused
    /// ([`BaselineError::NotMine`]).
    pub fn free(&self, block: PoolBlock, stream: &CudaStream) -> Result<(), BaselineError> {
        if block.pool != self.id {
            return Err(BaselineError::NotMine {
                address: block.address,
                allocator: "pool",
            });
        }
        self.check_stream(stream)?;
        if block.address == 0 {
            return Ok(());
        }
        bind(&self.ctx)?;
        // SAFETY: `block` was allocated from this pool (its id says so) and is consumed here, so
        // it is freed once; the stream is a live stream of the pool's context. Work that used the
        // address was queued by callers who held the raw address (using it needs `unsafe`) and
        // who order it before this point of `stream`, as the driver asks.
        unsafe { result::free_async(block.address, stream.cu_stream()) }
            .map_err(|e| BaselineError::from_driver("cuMemFreeAsync", 0, e))
    }

    /// `cuMemPoolTrimTo`: gives memory back to the device until the pool reserves at most
    /// `keep` bytes, as far as it can (memory behind frees still pending on their streams
    /// stays: synchronise them first).
    pub fn trim(&self, keep: u64) -> Result<(), BaselineError> {
        bind(&self.ctx)?;
        let keep = usize::try_from(keep).unwrap_or(usize::MAX);
        // SAFETY: `self.pool` is live until `Drop`.
        unsafe { result::mem_pool::trim_to(self.pool, keep) }
            .map_err(|e| BaselineError::from_driver("cuMemPoolTrimTo", 0, e))
    }

    fn attribute(
        &self,
        attribute: sys::CUmemPool_attribute,
        operation: &'static str,
    ) -> Result<u64, BaselineError> {
        bind(&self.ctx)?;
        let mut value: u64 = 0;
        // SAFETY: `self.pool` is live until `Drop`; the attributes read here are
        // `cuuint64_t`s, and the pointer is to a live `u64` local.
        unsafe {
            result::mem_pool::get_attribute(
                self.pool,
                attribute,
                (&mut value as *mut u64).cast::<c_void>(),
            )
        }
        .map_err(|e| BaselineError::from_driver(operation, 0, e))?;
        Ok(value)
    }

    /// Bytes of device memory the pool holds now (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`).
    pub fn reserved_current(&self) -> Result<u64, BaselineError> {
        self.attribute(
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
            "cuMemPoolGetAttribute(RESERVED_MEM_CURRENT)",
        )
    }

    /// The most bytes the pool has held (`CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH`).
    pub fn reserved_high(&self) -> Result<u64, BaselineError> {
        self.attribute(
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
            "cuMemPoolGetAttribute(RESERVED_MEM_HIGH)",
        )
    }

    /// Bytes allocated from the pool and not yet freed (`CU_MEMPOOL_ATTR_USED_MEM_CURRENT`).
    pub fn used_current(&self) -> Result<u64, BaselineError> {
        self.attribute(
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
            "cuMemPoolGetAttribute(USED_MEM_CURRENT)",
        )
    }

    /// The most bytes allocated from the pool at once (`CU_MEMPOOL_ATTR_USED_MEM_HIGH`).
    pub fn used_high(&self) -> Result<u64, BaselineError> {
        self.attribute(
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            "cuMemPoolGetAttribute(USED_MEM_HIGH)",
        )
    }
}

impl Drop for StreamOrderedPool {
    fn drop(&mut self) {
        if self.ctx.synchronize().is_err() {
            // The context is unusable; destroying the pool could only fail too.
            return;
        }
        // SAFETY: the pool is live and destroyed once (here, with `&mut self`); the context was
        // synchronised, so no allocation or free queued on it is pending. For blocks callers
        // still hold, the driver keeps the pool's memory until they are freed (which no pool
        // can do any more: they stay allocated until the context ends).
        let _ = unsafe { result::mem_pool::destroy(self.pool) };
    }
}

/// An allocation from [`DriverMalloc`]: its address and size. Give it back with
/// [`DriverMalloc::free`]; dropped instead, its memory stays allocated until the context ends.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a driver block that is dropped is never freed"]
pub struct DriverBlock {
    address: u64,
    size: u64,
    owner: u64,
}

impl DriverBlock {
    /// The device address (0 for a zero-byte allocation).
    pub fn address(&self) -> u64 {
        self.address
    }

    /// The bytes asked for.
    pub fn size(&self) -> u64 {
        self.size
    }
}

/// Plain `cuMemAlloc` / `cuMemFree` on one context: no caching at all. `Send + Sync`.
#[derive(Debug)]
pub struct DriverMalloc {
    ctx: Arc<CudaContext>,
    id: u64,
}

impl DriverMalloc {
    /// `cuMemAlloc` and `cuMemFree` on `ctx`.
    pub fn new(ctx: Arc<CudaContext>) -> Result<DriverMalloc, BaselineError> {
        bind(&ctx)?;
        Ok(DriverMalloc {
            ctx,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// `cuMemAlloc`: `size` bytes, uninitialised. A zero-byte request returns a block at
    /// address 0 without a driver call.
    pub fn alloc(&self, size: usize) -> Result<DriverBlock, BaselineError> {
        let block = |address| DriverBlock {
            address,
            size: size as u64,
            owner: self.id,
        };
        if size == 0 {
            return Ok(block(0));
        }
        bind(&self.ctx)?;
        // SAFETY: cuMemAlloc writes a device address; the memory is uninitialised, which is
        // fine: only its address is handed out.
        let address = unsafe { result::malloc_sync(size) }
            .map_err(|e| BaselineError::from_driver("cuMemAlloc", size as u64, e))?;
        Ok(block(address))
    }

    /// `cuMemFree`. A block of another `DriverMalloc` is refused ([`BaselineError::NotMine`]).
    pub fn free(&self, block: DriverBlock) -> Result<(), BaselineError> {
        if block.owner != self.id {
            return Err(BaselineError::NotMine {
                address: block.address,
                allocator: "DriverMalloc",
            });
        }
        if block.address == 0 {
            return Ok(());
        }
        bind(&self.ctx)?;
        // SAFETY: `block` came from cuMemAlloc through this allocator (its owner id says so)
        // and is consumed here, so it is freed once. Work that used the address was queued by
        // callers who held the raw address (using it needs `unsafe`); cuMemFree waits for the
        // device's work before the memory is reused.
        unsafe { result::free_sync(block.address) }
            .map_err(|e| BaselineError::from_driver("cuMemFree", 0, e))
    }

    /// The device's memory in use, by anyone: total − free as `cuMemGetInfo` reports them.
    pub fn device_used_bytes(&self) -> Result<u64, BaselineError> {
        let (free, total) = self
            .ctx
            .mem_get_info()
            .map_err(|error| BaselineError::Driver {
                operation: "cuMemGetInfo",
                error,
            })?;
        Ok(total.saturating_sub(free) as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first device's context, or `None` after printing why not (a missing GPU is a
    /// failure with `CACHALOT_REQUIRE_GPU=1`).
    fn gpu(test: &str) -> Option<Arc<CudaContext>> {
        match crate::cuda::device_count() {
            Ok(n) if n > 0 => Some(CudaContext::new(0).expect("context 0")),
            other => {
                let reason = match other {
                    Ok(_) => "no CUDA device".to_string(),
                    Err(e) => e.to_string(),
                };
                assert!(
                    std::env::var("CACHALOT_REQUIRE_GPU").as_deref() != Ok("1"),
                    "{test}: a GPU run was required (CACHALOT_REQUIRE_GPU=1) but {reason}"
                );
                eprintln!("skipping {test}: {reason}");
                None
            }
        }
    }

    #[test]
    fn only_the_drivers_out_of_memory_is_out_of_memory() {
        let oom = BaselineError::from_driver(
            "cuMemAlloc",
            7,
            DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY),
        );
        assert!(oom.is_out_of_memory());
        assert!(matches!(
            oom,
            BaselineError::OutOfMemory {
                operation: "cuMemAlloc",
                bytes: 7
            }
        ));
        let other = BaselineError::from_driver(
            "cuMemAlloc",
            7,
            DriverError(CUresult::CUDA_ERROR_INVALID_VALUE),
        );
        assert!(!other.is_out_of_memory());
        assert!(matches!(other, BaselineError::Driver { .. }));
    }

    #[test]
    fn a_pool_takes_back_only_its_own_blocks() {
        let Some(ctx) = gpu("a_pool_takes_back_only_its_own_blocks") else {
            return;
        };
        let stream = ctx.new_stream().unwrap();
        let a = StreamOrderedPool::new(ctx.clone()).unwrap();
        let b = StreamOrderedPool::new(ctx.clone()).unwrap();
        let block = a.alloc(4096, &stream).unwrap();
        assert_ne!(block.address(), 0);
        assert_eq!(a.used_current().unwrap(), 4096);
        let err = b.free(block, &stream).unwrap_err();
        assert!(matches!(err, BaselineError::NotMine { .. }), "{err}");
        // The refused block stays allocated in `a`.
        assert_eq!(a.used_current().unwrap(), 4096);
        let empty = a.alloc(0, &stream).unwrap();
        assert_eq!(empty.address(), 0);
        a.free(empty, &stream).unwrap();
    }

    #[test]
    fn a_driver_malloc_takes_back_only_its_own_blocks() {
        let Some(ctx) = gpu("a_driver_malloc_takes_back_only_its_own_blocks") else {
            return;
        };
        let a = DriverMalloc::new(ctx.clone()).unwrap();
        let b = DriverMalloc::new(ctx).unwrap();
        let block = a.alloc(1 << 20).unwrap();
        let address = block.address();
        assert_ne!(address, 0);
        let err = b.free(block).unwrap_err();
        assert!(
            matches!(err, BaselineError::NotMine { address: x, .. } if x == address),
            "{err}"
        );
    }
}

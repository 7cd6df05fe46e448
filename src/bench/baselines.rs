//! The baselines on the GPU: CUDA's stream-ordered pool and plain `cuMemAlloc`, as
//! [`BenchTarget`]s for the traces and as pairs for the hot loops. The one module that uses
//! `cachalot`'s baseline wrappers.

use std::collections::HashMap;
use std::sync::Arc;

use cachalot::baselines::{BaselineError, DriverBlock, DriverMalloc, PoolBlock, StreamOrderedPool};
use cachalot::cuda::cudarc::driver::{CudaContext, CudaStream};

use super::allocators::{BenchTarget, Reading, real_streams};
use super::error::{Failure, fail};
use crate::ops::OpsProgram;

fn baseline(what: &str, e: BaselineError) -> Failure {
    fail(what, e)
}

/// Frees held back until their side stream completes, for the baselines (which have no
/// `record_stream`).
struct Deferred<T> {
    /// Address → the side stream its free waits for.
    recorded: HashMap<u64, u64>,
    /// Side stream → the frees waiting for it.
    waiting: HashMap<u64, Vec<(T, usize)>>,
}

impl<T> Deferred<T> {
    fn new() -> Self {
        Deferred {
            recorded: HashMap::new(),
            waiting: HashMap::new(),
        }
    }

    fn record(&mut self, address: u64, side: u64) {
        if address != 0 {
            self.recorded.insert(address, side);
        }
    }

    /// The block back if it is to be freed now, `None` if it waits for its side stream.
    #[inline]
    fn free(&mut self, address: u64, block: T, stream: usize) -> Option<T> {
        if self.recorded.is_empty() {
            return Some(block);
        }
        match self.recorded.remove(&address) {
            Some(side) => {
                self.waiting.entry(side).or_default().push((block, stream));
                None
            }
            None => Some(block),
        }
    }

    fn complete(&mut self, side: u64) -> Vec<(T, usize)> {
        self.waiting.remove(&side).unwrap_or_default()
    }
}

/// CUDA's stream-ordered pool.
pub struct PoolTarget {
    pool: StreamOrderedPool,
    streams: Vec<Arc<CudaStream>>,
    deferred: Deferred<PoolBlock>,
}

impl PoolTarget {
    /// A fresh pool on `ctx`, with real streams for `program`'s.
    pub fn new(ctx: &Arc<CudaContext>, program: &OpsProgram) -> Result<Self, Failure> {
        Ok(PoolTarget {
            pool: StreamOrderedPool::new(Arc::clone(ctx))
                .map_err(|e| baseline("cuMemPoolCreate", e))?,
            streams: real_streams(ctx, program)?,
            deferred: Deferred::new(),
        })
    }
}

impl BenchTarget for PoolTarget {
    type Block = PoolBlock;

    #[inline]
    fn alloc(&mut self, size: u64, stream: usize) -> Result<Option<PoolBlock>, Failure> {
        let bytes = usize::try_from(size).unwrap_or(usize::MAX);
        match self.pool.alloc(bytes, &self.streams[stream]) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.is_out_of_memory() => Ok(None),
            Err(e) => Err(baseline("the pool's alloc", e)),
        }
    }

    #[inline]
    fn free(&mut self, block: PoolBlock, stream: usize) -> Result<(), Failure> {
        match self.deferred.free(block.address(), block, stream) {
            Some(block) => self
                .pool
                .free(block, &self.streams[stream])
                .map_err(|e| baseline("the pool's free", e)),
            None => Ok(()),
        }
    }

    fn record(&mut self, block: &PoolBlock, side: u64) -> Result<(), Failure> {
        self.deferred.record(block.address(), side);
        Ok(())
    }

    fn complete(&mut self, side: u64) -> Result<(), Failure> {
        for (block, stream) in self.deferred.complete(side) {
            self.pool
                .free(block, &self.streams[stream])
                .map_err(|e| baseline("the pool's free", e))?;
        }
        Ok(())
    }

    fn empty_cache(&mut self) -> Result<(), Failure> {
        self.pool
            .context()
            .synchronize()
            .map_err(|e| fail("cuCtxSynchronize", e))?;
        self.pool
            .trim(0)
            .map_err(|e| baseline("cuMemPoolTrimTo", e))
    }

    fn observe(&mut self) -> Result<Reading, Failure> {
        Ok(Reading {
            reserved: self
                .pool
                .reserved_current()
                .map_err(|e| baseline("reading the pool", e))?,
            allocated: Some(
                self.pool
                    .used_current()
                    .map_err(|e| baseline("reading the pool", e))?,
            ),
            device_allocs: 0,
        })
    }

    fn driver_calls(&mut self) -> Option<(u64, String)> {
        None
    }
}

/// Plain `cuMemAlloc` / `cuMemFree`.
pub struct MallocTarget {
    malloc: DriverMalloc,
    /// The device's used memory when the target was made.
    base: u64,
    deferred: Deferred<DriverBlock>,
    allocs: u64,
    frees: u64,
}

impl MallocTarget {
    /// `cuMemAlloc` on `ctx`, its figures counted from the device's use now.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self, Failure> {
        let malloc = DriverMalloc::new(Arc::clone(ctx)).map_err(|e| baseline("cuMemAlloc", e))?;
        let base = malloc
            .device_used_bytes()
            .map_err(|e| baseline("cuMemGetInfo", e))?;
        Ok(MallocTarget {
            malloc,
            base,
            deferred: Deferred::new(),
            allocs: 0,
            frees: 0,
        })
    }

    fn release(&mut self, block: DriverBlock) -> Result<(), Failure> {
        let real = block.address() != 0;
        self.malloc
            .free(block)
            .map_err(|e| baseline("cuMemFree", e))?;
        self.frees += u64::from(real);
        Ok(())
    }
}

impl BenchTarget for MallocTarget {
    type Block = DriverBlock;

    fn alloc(&mut self, size: u64, _stream: usize) -> Result<Option<DriverBlock>, Failure> {
        let bytes = usize::try_from(size).unwrap_or(usize::MAX);
        match self.malloc.alloc(bytes) {
            Ok(b) => {
                self.allocs += u64::from(b.address() != 0);
                Ok(Some(b))
            }
            Err(e) if e.is_out_of_memory() => Ok(None),
            Err(e) => Err(baseline("cuMemAlloc", e)),
        }
    }

    fn free(&mut self, block: DriverBlock, stream: usize) -> Result<(), Failure> {
        match self.deferred.free(block.address(), block, stream) {
            Some(block) => self.release(block),
            None => Ok(()),
        }
    }

    fn record(&mut self, block: &DriverBlock, side: u64) -> Result<(), Failure> {
        self.deferred.record(block.address(), side);
        Ok(())
    }

    fn complete(&mut self, side: u64) -> Result<(), Failure> {
        for (block, _) in self.deferred.complete(side) {
            self.release(block)?;
        }
        Ok(())
    }

    fn empty_cache(&mut self) -> Result<(), Failure> {
        Ok(())
    }

    fn observe(&mut self) -> Result<Reading, Failure> {
        let used = self
            .malloc
            .device_used_bytes()
            .map_err(|e| baseline("cuMemGetInfo", e))?;
        Ok(Reading {
            reserved: used.saturating_sub(self.base),
            allocated: None,
            device_allocs: self.allocs,
        })
    }

    fn driver_calls(&mut self) -> Option<(u64, String)> {
        Some((
            self.allocs + self.frees,
            format!("cuMemAlloc {}, cuMemFree {}", self.allocs, self.frees),
        ))
    }
}

/// The pool's hot loop: one alloc+free pair of `size` bytes on a stream.
pub struct PoolPairs(StreamOrderedPool);

impl PoolPairs {
    /// A fresh pool on `ctx`.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self, Failure> {
        StreamOrderedPool::new(Arc::clone(ctx))
            .map(PoolPairs)
            .map_err(|e| baseline("cuMemPoolCreate", e))
    }

    /// One pair on `stream`.
    #[inline]
    pub fn pair(&self, size: usize, stream: &CudaStream) -> Result<(), Failure> {
        let b = self
            .0
            .alloc(std::hint::black_box(size), stream)
            .map_err(|e| baseline("cuMemAllocFromPoolAsync", e))?;
        self.0
            .free(b, stream)
            .map_err(|e| baseline("cuMemFreeAsync", e))
    }
}

/// `cuMemAlloc`'s hot loop: one `cuMemAlloc` + `cuMemFree` pair of `size` bytes.
pub struct MallocPairs(DriverMalloc);

impl MallocPairs {
    /// `cuMemAlloc` on `ctx`.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self, Failure> {
        DriverMalloc::new(Arc::clone(ctx))
            .map(MallocPairs)
            .map_err(|e| baseline("cuMemAlloc", e))
    }

    /// One pair.
    #[inline]
    pub fn pair(&self, size: usize) -> Result<(), Failure> {
        let b = self
            .0
            .alloc(std::hint::black_box(size))
            .map_err(|e| baseline("cuMemAlloc", e))?;
        self.0.free(b).map_err(|e| baseline("cuMemFree", e))
    }
}

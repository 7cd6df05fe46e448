//! The allocators as the benchmark's interpreter drives them ([`BenchTarget`]), and cachalot's
//! three through the thread-safe front end (`Allocator<B>`) over the device `cachalot replay
//! --backend cuda` replays on ([`HeldBackDevice`]): the trace's streams mapped to real streams,
//! a held-back free's event complete only once the trace has reached its `c` line. The
//! baselines (CUDA's pool, `cuMemAlloc`) are in [`super::baselines`].

use std::collections::HashMap;
use std::sync::Arc;

use cachalot::cuda::cudarc::driver::{CudaContext, CudaStream};
use cachalot::cuda::{CudaBackend, device_count, stream_id};
use cachalot::{Allocator, Backend, CachingCore, Error, Settings, SimDevice, StreamId};

use super::error::{Failure, fail, run_err};
use crate::ops::OpsProgram;
use crate::replay::held::HeldBackDevice;
use crate::replay::interpret::side_stream;

/// The simulated device of `--backend sim`: an H200's 141 GiB.
pub const SIM_CAPACITY: u64 = 141 << 30;

/// What an allocator reports after a line of the observed pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct Reading {
    /// Reserved bytes.
    pub reserved: u64,
    /// Allocated bytes, where the allocator tells.
    pub allocated: Option<u64>,
    /// Device allocations (or map steps) so far, as the allocator counts them.
    pub device_allocs: u64,
}

/// An allocator as the benchmark's interpreter ([`super::interpret`]) drives it. `stream` is
/// an index into [`OpsProgram::streams`]; `side` a side stream's number as the file writes it.
///
/// Not a [`ReplayTarget`](crate::replay::ReplayTarget): the baselines hand out blocks they own
/// (freed on a stream, not by address), and an ops program's side streams are the file's
/// numbers, shared by any handles the file puts on them, not one per handle.
pub trait BenchTarget {
    /// One allocation.
    type Block;
    /// Allocates; `Ok(None)` for out of memory.
    fn alloc(&mut self, size: u64, stream: usize) -> Result<Option<Self::Block>, Failure>;
    /// Frees (after [`BenchTarget::record`], held back until [`BenchTarget::complete`] of its
    /// side).
    fn free(&mut self, block: Self::Block, stream: usize) -> Result<(), Failure>;
    /// Records a use of `block` on side stream `side`, still running.
    fn record(&mut self, block: &Self::Block, side: u64) -> Result<(), Failure>;
    /// Side stream `side`'s work has completed.
    fn complete(&mut self, side: u64) -> Result<(), Failure>;
    /// `e`.
    fn empty_cache(&mut self) -> Result<(), Failure>;
    /// The allocator's figures now.
    fn observe(&mut self) -> Result<Reading, Failure>;
    /// Memory calls so far as the allocator counts them, and what they were; `None` if it
    /// does not count them.
    fn driver_calls(&mut self) -> Option<(u64, String)>;
}

/// One of cachalot's allocators: the front end over a [`HeldBackDevice`].
pub struct CachalotTarget<B: Backend> {
    alloc: Allocator<HeldBackDevice<B>>,
    /// Stream index → the trace's stream handle, as the allocator names streams.
    streams: Vec<StreamId>,
}

impl<B: Backend> CachalotTarget<B> {
    /// The allocator with `settings` over `device`, for `program`'s streams.
    pub fn new(
        device: HeldBackDevice<B>,
        settings: Settings,
        program: &OpsProgram,
    ) -> Result<Self, Failure> {
        let core = CachingCore::new(device, settings)
            .map_err(|e| run_err(format!("cannot build the allocator: {e}")))?;
        Ok(CachalotTarget {
            alloc: Allocator::from_core(core),
            streams: program.streams.iter().map(|&s| StreamId(s)).collect(),
        })
    }
}

impl<B: Backend> BenchTarget for CachalotTarget<B> {
    type Block = u64;

    #[inline]
    fn alloc(&mut self, size: u64, stream: usize) -> Result<Option<u64>, Failure> {
        match self.alloc.malloc(size, self.streams[stream]) {
            Ok(p) => Ok(Some(p)),
            Err(e) if e.is_out_of_memory() || matches!(e, Error::TooLarge { .. }) => Ok(None),
            Err(e) => Err(fail(&format!("malloc({size})"), e)),
        }
    }

    #[inline]
    fn free(&mut self, block: u64, _stream: usize) -> Result<(), Failure> {
        // A zero-byte allocation is address 0 and holds nothing.
        if block == 0 {
            return Ok(());
        }
        self.alloc
            .free(block)
            .map_err(|e| fail(&format!("free({block:#x})"), e))
    }

    fn record(&mut self, block: &u64, side: u64) -> Result<(), Failure> {
        if *block == 0 {
            return Ok(());
        }
        self.alloc
            .record_stream(*block, side_stream(side as usize))
            .map_err(|e| fail(&format!("record_stream({block:#x})"), e))
    }

    fn complete(&mut self, side: u64) -> Result<(), Failure> {
        self.alloc
            .with_backend(|d| d.complete(side_stream(side as usize)));
        Ok(())
    }

    fn empty_cache(&mut self) -> Result<(), Failure> {
        self.alloc.empty_cache().map_err(|e| fail("empty_cache", e))
    }

    fn observe(&mut self) -> Result<Reading, Failure> {
        let s = self.alloc.stats();
        Ok(Reading {
            reserved: s.reserved_bytes.all.current as u64,
            allocated: Some(s.allocated_bytes.all.current as u64),
            device_allocs: s.num_device_alloc,
        })
    }

    fn driver_calls(&mut self) -> Option<(u64, String)> {
        let s = self.alloc.stats();
        let c = self.alloc.with_backend(|d| d.calls());
        Some((
            s.num_device_alloc + s.num_device_free,
            format!(
                "device allocs {}, frees {}, map steps {} ({} handles, {} pages mapped again), \
                 unmaps {} ({} pages), reservations {} made, {} freed",
                c.allocs,
                c.frees,
                c.maps,
                c.handles,
                c.alias_pages,
                c.unmaps,
                c.unmapped_pages,
                c.reserves,
                c.reservation_frees
            ),
        ))
    }
}

/// The GPU's context, or why not.
pub fn cuda_context() -> Result<Arc<CudaContext>, Failure> {
    let n = device_count().map_err(|e| run_err(format!("--backend cuda: {e}")))?;
    if n == 0 {
        return Err(run_err("--backend cuda: no CUDA device"));
    }
    CudaContext::new(0).map_err(|e| fail("creating the CUDA context", e))
}

/// Real streams for `program`'s stream handles: 0 the context's default stream, every other a
/// stream of its own.
pub fn real_streams(
    ctx: &Arc<CudaContext>,
    program: &OpsProgram,
) -> Result<Vec<Arc<CudaStream>>, Failure> {
    program
        .streams
        .iter()
        .map(|&h| {
            if h == 0 {
                Ok(ctx.default_stream())
            } else {
                ctx.new_stream()
                    .map_err(|e| fail("creating a CUDA stream", e))
            }
        })
        .collect()
}

/// cachalot's allocator with `settings` on the GPU, for `program`.
pub fn cuda_cachalot(
    ctx: &Arc<CudaContext>,
    settings: Settings,
    program: &OpsProgram,
) -> Result<CachalotTarget<CudaBackend>, Failure> {
    let mut inner = CudaBackend::new(Arc::clone(ctx)).map_err(|e| fail("the CUDA backend", e))?;
    let side = ctx
        .new_stream()
        .map_err(|e| fail("creating a CUDA stream", e))?;
    inner.retain_stream(&side);
    let real = real_streams(ctx, program)?;
    let mut map = HashMap::new();
    for (s, &h) in real.iter().zip(&program.streams) {
        inner.retain_stream(s);
        map.insert(h, stream_id(s));
    }
    let mut settings = settings;
    // As `CudaAllocator::new` does: cachalot's defaults on a GPU without virtual memory use
    // segments.
    if settings == Settings::cachalot() && !inner.virtual_memory() {
        settings.expandable_segments = false;
    }
    // The backend keeps the streams it retained alive.
    let device = HeldBackDevice::new(inner, map, Some(stream_id(&side)), |_, _| {});
    CachalotTarget::new(device, settings, program)
}

/// cachalot's allocator with `settings` on the simulated device.
pub fn sim_cachalot(
    settings: Settings,
    program: &OpsProgram,
) -> Result<CachalotTarget<SimDevice>, Failure> {
    let device = HeldBackDevice::new(
        SimDevice::new(SIM_CAPACITY),
        HashMap::new(),
        None,
        SimDevice::complete_stream,
    );
    CachalotTarget::new(device, settings, program)
}

//! `--backend cuda`: the replay on a real GPU, through cachalot's cudarc backend.
//!
//! The one rule: the GPU replay runs the same program with the same semantics as the
//! simulated one — only the device differs. Segments come from `cuMemAlloc`; every event is a
//! real CUDA event recorded on a real stream. The replayer's side streams (one per
//! cross-stream free, ids with the top bit set) all map to one real side stream, and the
//! trace's stream handles to real streams created per distinct handle (handle 0 to the
//! context's default stream). A held-back free's event is reported complete only once it has
//! completed on the GPU *and* the trace has reached its `free_completed` (or the allocator
//! waited for it), which is when the simulated device completes it too; so the GPU replay
//! holds blocks back exactly as long as PyTorch did.
//!
//! Inside the allocator the trace's stream handles stay the streams' names, so the history
//! (and a snapshot written with `--snapshot-out`) speaks of the trace's streams and replays
//! on the simulated device like the original trace, with the GPU's own segment addresses.

use std::collections::HashMap;
use std::sync::Arc;

use cachalot::cuda::cudarc::driver::{CudaContext, CudaStream};
use cachalot::cuda::{CudaBackend, device_count, stream_id};
use cachalot::{Backend, BackendError, CachingCore, EventId, MemInfo, StreamId};
use cachalot_tools::replay::{
    ReplayConfig, ReplayOutcome, is_side_stream, replay_on_with_progress,
};
use cachalot_tools::snapshot::{ReplayOp, ReplayProgram};

use super::CliError;

/// What the GPU was.
pub struct GpuInfo {
    /// The device's name (`cuDeviceGetName`).
    pub name: String,
    /// Its total memory in bytes (`cuMemGetInfo`).
    pub total_memory: u64,
}

/// Replays `program` on CUDA device `ordinal`.
pub fn replay(
    program: &ReplayProgram,
    config: &ReplayConfig,
    ordinal: usize,
    device_index: usize,
    progress: &mut dyn FnMut(usize),
) -> Result<(ReplayOutcome, GpuInfo), CliError> {
    let count = device_count().map_err(|e| CliError::run(format!("--backend cuda: {e}")))?;
    if ordinal >= count {
        return Err(CliError::input(format!(
            "--gpu {ordinal}: this machine has {count} CUDA device(s)"
        )));
    }
    let cuda = |what: &str, e: &dyn std::fmt::Display| CliError::run(format!("{what}: {e}"));
    let ctx = CudaContext::new(ordinal).map_err(|e| cuda("creating the CUDA context", &e))?;
    let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
    let mut device = GpuReplayDevice::new(ctx, program)?;
    let total_memory = device
        .mem_info()
        .map_err(|e| cuda("cuMemGetInfo", &e))?
        .total;
    let core = CachingCore::new(device, config.settings.clone())
        .map_err(|e| CliError::input(format!("settings: {e}")))?
        .with_device_index(device_index);
    let outcome = replay_on_with_progress(
        core,
        program,
        config,
        |d: &mut GpuReplayDevice, s| d.complete(s),
        progress,
    )
    .map_err(|e| CliError::run(format!("the GPU replay failed: {e}")))?;
    Ok((outcome, GpuInfo { name, total_memory }))
}

/// The CUDA backend with the replayer's stream mapping and held-back events.
struct GpuReplayDevice {
    inner: CudaBackend,
    /// The one real stream every side stream maps to.
    side: Arc<CudaStream>,
    /// Trace stream handle → the real stream standing for it.
    streams: HashMap<u64, Arc<CudaStream>>,
    /// Events recorded for side streams: event id → the side stream.
    held: HashMap<u64, StreamId>,
    /// Side streams with an outstanding event → whether the trace has completed their work.
    outstanding: HashMap<StreamId, bool>,
}

impl GpuReplayDevice {
    fn new(ctx: Arc<CudaContext>, program: &ReplayProgram) -> Result<GpuReplayDevice, CliError> {
        let err = |e: &dyn std::fmt::Display| CliError::run(format!("creating a CUDA stream: {e}"));
        let mut inner =
            CudaBackend::new(Arc::clone(&ctx)).map_err(|e| CliError::run(format!("{e}")))?;
        let side = ctx.new_stream().map_err(|e| err(&e))?;
        inner.retain_stream(&side);
        let mut streams = HashMap::new();
        for op in &program.ops {
            if let ReplayOp::Alloc { stream, .. } = *op
                && !streams.contains_key(&stream)
            {
                let real = if stream == 0 {
                    ctx.default_stream()
                } else {
                    ctx.new_stream().map_err(|e| err(&e))?
                };
                inner.retain_stream(&real);
                streams.insert(stream, real);
            }
        }
        Ok(GpuReplayDevice {
            inner,
            side,
            streams,
            held: HashMap::new(),
            outstanding: HashMap::new(),
        })
    }

    /// The trace has reached the `free_completed` of the held-back free on `side`.
    /// (A side stream with no outstanding event is left alone, so a later event on it is
    /// not taken as complete: the simulated device behaves the same.)
    fn complete(&mut self, side: StreamId) {
        if let Some(done) = self.outstanding.get_mut(&side) {
            *done = true;
        }
    }

    fn real_stream(&self, stream: StreamId) -> StreamId {
        if is_side_stream(stream) {
            return stream_id(&self.side);
        }
        // A handle not seen among the trace's allocations: the backend waits for the whole
        // device instead of recording on it, which is safe.
        self.streams.get(&stream.0).map_or(stream, |s| stream_id(s))
    }
}

impl Backend for GpuReplayDevice {
    fn allocate(&mut self, size: u64) -> Result<u64, BackendError> {
        self.inner.allocate(size)
    }

    fn free(&mut self, address: u64, size: u64) -> Result<(), BackendError> {
        self.inner.free(address, size)
    }

    fn mem_info(&mut self) -> Result<MemInfo, BackendError> {
        self.inner.mem_info()
    }

    fn record_event(&mut self, stream: StreamId) -> Result<EventId, BackendError> {
        let event = self.inner.record_event(self.real_stream(stream))?;
        if is_side_stream(stream) {
            self.held.insert(event.0, stream);
            self.outstanding.insert(stream, false);
        }
        Ok(event)
    }

    fn query_event(&mut self, event: EventId) -> Result<bool, BackendError> {
        if let Some(side) = self.held.get(&event.0)
            && self.outstanding.get(side) == Some(&false)
        {
            return Ok(false);
        }
        self.inner.query_event(event)
    }

    fn synchronize_event(&mut self, event: EventId) -> Result<(), BackendError> {
        self.inner.synchronize_event(event)?;
        // Waiting for the event is the side stream reaching it, as on the simulated device.
        if let Some(side) = self.held.get(&event.0) {
            self.outstanding.insert(*side, true);
        }
        Ok(())
    }

    fn destroy_event(&mut self, event: EventId) {
        if let Some(side) = self.held.remove(&event.0) {
            self.outstanding.remove(&side);
        }
        self.inner.destroy_event(event);
    }

    // Expandable segments (rule 19): the CUDA backend's virtual memory, with the trace's
    // stream handles turned into the replay's real streams for the synchronisation of unmap.
    fn virtual_memory(&self) -> bool {
        self.inner.virtual_memory()
    }

    fn reserve(&mut self, size: u64, page: u64) -> Result<u64, BackendError> {
        self.inner.reserve(size, page)
    }

    fn release_reservation(&mut self, address: u64, size: u64) -> Result<(), BackendError> {
        self.inner.release_reservation(address, size)
    }

    fn map(&mut self, address: u64, size: u64) -> Result<(), BackendError> {
        self.inner.map(address, size)
    }

    fn unmap(&mut self, address: u64, size: u64, stream: StreamId) -> Result<(), BackendError> {
        let real = self.real_stream(stream);
        self.inner.unmap(address, size, real)
    }
}

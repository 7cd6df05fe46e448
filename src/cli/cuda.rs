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

use cachalot::cuda::cudarc::driver::CudaContext;
use cachalot::cuda::{CudaBackend, device_count, stream_id};
use cachalot::{Backend, CachingCore};
use cachalot_tools::replay::{
    HeldBackDevice, ReplayConfig, ReplayOp, ReplayOutcome, ReplayProgram, replay_on_with_progress,
};

use super::error::CliError;

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
    let mut device = gpu_replay_device(ctx, program)?;
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
        |d: &mut HeldBackDevice<CudaBackend>, s| d.complete(s),
        progress,
    )
    .map_err(|e| CliError::run(format!("the GPU replay failed: {e}")))?;
    Ok((outcome, GpuInfo { name, total_memory }))
}

/// The CUDA backend with the replayer's stream mapping and held-back events: one real side
/// stream for every side stream, and per distinct trace stream handle a real stream (handle 0
/// the context's default stream), each retained by the backend, which keeps it alive.
fn gpu_replay_device(
    ctx: Arc<CudaContext>,
    program: &ReplayProgram,
) -> Result<HeldBackDevice<CudaBackend>, CliError> {
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
            streams.insert(stream, stream_id(&real));
        }
    }
    Ok(HeldBackDevice::new(
        inner,
        streams,
        Some(stream_id(&side)),
        |_, _| {},
    ))
}

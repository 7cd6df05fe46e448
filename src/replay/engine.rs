//! The timed replay: a program through `CachingCore` on a device, measured — peaks,
//! driver calls, cache hits, the memory at the peak, ns per operation over one or more passes.
//!
//! The one rule: the replay reproduces the program's requests exactly — sizes, streams, the
//! order of allocations and frees, cross-stream frees held back until PyTorch released them,
//! explicit cache releases — and the device hands out the trace's own segment addresses where
//! it can, so best fit's address tie-break sees what PyTorch saw.

use std::time::Instant;

use cachalot::{
    AdoptedRange, AdoptedSegment, Backend, CachingCore, Error, SegmentInfo, Settings, SimDevice,
    Stats, StreamId, TraceEvent,
};
use serde::Serialize;

use super::interpret::{Executed, Interpreter, ReplayTarget, StartFailure};
use super::program::{ReplayProgram, RuntimeSettings};
use super::start::StartMode;

/// Operations between two progress reports.
const PROGRESS_EVERY: usize = 1 << 14;

/// The memory of an H200 as CUDA reports it: the default device size of a replay.
pub const H200_MEMORY: u64 = 150_109_880_320;

/// Offers a backend the trace's segment address for the operation about to run (`Some`), or
/// withdraws it (`None`); see [`replay_on_full`].
pub type OfferAddress<'a, B> = &'a mut dyn FnMut(&mut B, Option<u64>);

/// How to replay.
#[derive(Clone, Debug)]
pub struct ReplayConfig {
    /// Allocator settings.
    pub settings: Settings,
    /// Simulated device memory in bytes.
    pub capacity: u64,
    /// Hand out the trace's recorded segment addresses (the default); otherwise invent them.
    pub trace_addresses: bool,
    /// Passes over the trace; passes after the first measure steady-state speed.
    pub repeat: usize,
    /// Keep a per-operation timeline of requested, allocated and reserved bytes.
    pub timeline: bool,
    /// Record the allocator's history (PyTorch's trace vocabulary) during the first pass, for
    /// [`ReplayOutcome::history`] (and a snapshot of the replay, `crate::export`).
    pub record_history: bool,
    /// What the replay starts from.
    pub start: StartMode,
}

impl ReplayConfig {
    /// PyTorch's defaults on an H200-sized simulated device.
    pub fn pytorch() -> ReplayConfig {
        ReplayConfig {
            settings: Settings::pytorch(),
            capacity: H200_MEMORY,
            trace_addresses: true,
            repeat: 1,
            timeline: false,
            record_history: false,
            start: StartMode::Exact,
        }
    }
}

/// One point of the memory timeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Sample {
    /// Live requested bytes (what the program holds).
    pub requested: u64,
    /// Allocated bytes (after rounding).
    pub allocated: u64,
    /// Reserved device bytes.
    pub reserved: u64,
}

/// What a replay measured.
#[derive(Clone, Debug, Serialize)]
pub struct ReplayOutcome {
    /// Operations in one pass.
    pub ops: usize,
    /// Allocations in one pass.
    pub allocs: usize,
    /// Frees in one pass.
    pub frees: usize,
    /// Peak of live requested bytes: the least memory any allocator could have used.
    pub peak_requested_bytes: u64,
    /// Peak allocated bytes.
    pub peak_allocated_bytes: u64,
    /// Peak reserved bytes (PyTorch's `max_memory_reserved`).
    pub peak_reserved_bytes: u64,
    /// Peak number of segments.
    pub peak_segments: u64,
    /// Allocations that needed a device allocation.
    pub device_allocs: u64,
    /// Segments given back to the device.
    pub device_frees: u64,
    /// Share of allocations served from the cache, without a device call.
    pub cache_hit_rate: f64,
    /// Allocations that failed for lack of memory.
    pub ooms: u64,
    /// At the moment of peak reserved: bytes in wholly free segments (what `empty_cache` would
    /// have given back then).
    pub empty_cache_at_peak_bytes: u64,
    /// At the moment of peak reserved: free bytes stranded in split segments.
    pub stranded_at_peak_bytes: u64,
    /// Allocator nanoseconds per operation: the mean over passes after the first when
    /// `repeat > 1` (steady state), else over the single pass.
    pub ns_per_op: f64,
    /// Allocator nanoseconds per operation of the first pass.
    pub first_pass_ns_per_op: f64,
    /// Device calls (`num_device_alloc` + `num_device_free`) of each pass after the first,
    /// when `repeat > 1` (the steady state's price; empty otherwise).
    pub steady_pass_device_calls: Vec<u64>,
    /// Statistics at the end of the first pass.
    pub stats: Stats,
    /// Segments and blocks at the end of the first pass.
    #[serde(skip)]
    pub final_layout: Vec<SegmentInfo>,
    /// Requested / allocated / reserved after each operation of the first pass (when asked for).
    #[serde(skip)]
    pub timeline: Vec<Sample>,
    /// The allocator's history over the first pass, when [`ReplayConfig::record_history`] is on.
    #[serde(skip)]
    pub history: Vec<TraceEvent>,
}

impl ReplayOutcome {
    /// Peak reserved over peak requested (1.0 is the physical limit).
    pub fn fragmentation(&self) -> f64 {
        if self.peak_requested_bytes == 0 {
            1.0
        } else {
            self.peak_reserved_bytes as f64 / self.peak_requested_bytes as f64
        }
    }
}

/// A failure that stops a replay (out-of-memory does not: it is counted and the replay goes on).
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The allocator could not be built with these settings.
    #[error("cannot build the allocator: {0}")]
    Setup(Error),
    /// The state at the start of the trace could not be set up.
    #[error("cannot set up the state when recording began: {0}")]
    Start(Error),
    /// The device failed.
    #[error("device error at operation {op}: {error}")]
    Device {
        /// The operation's index.
        op: usize,
        /// The error.
        error: Error,
    },
}

/// Replays `program` on the simulated device.
pub fn replay(
    program: &ReplayProgram,
    config: &ReplayConfig,
) -> Result<ReplayOutcome, ReplayError> {
    replay_with_progress(program, config, &mut |_| {})
}

/// [`replay`] that reports its progress: `progress(done)` is called every few thousand
/// operations with the operations done so far, over all passes (`ops × repeat` in all).
pub fn replay_with_progress(
    program: &ReplayProgram,
    config: &ReplayConfig,
    progress: &mut dyn FnMut(usize),
) -> Result<ReplayOutcome, ReplayError> {
    let device = SimDevice::new(config.capacity);
    let core = CachingCore::new(device, config.settings.clone()).map_err(ReplayError::Setup)?;
    let mut offer = |d: &mut SimDevice, a: Option<u64>| d.set_next_address(a);
    let offer: Option<OfferAddress<'_, SimDevice>> = if config.trace_addresses {
        Some(&mut offer)
    } else {
        None
    };
    replay_on_full(
        core,
        program,
        config,
        |d, s| d.complete_stream(s),
        offer,
        progress,
    )
}

/// Replays `program` on an allocator core over any backend. `complete` tells the backend that a
/// held-back block's side stream has finished (for a real device, a no-op: the event recorded
/// on an idle stream completes by itself).
pub fn replay_on<B: Backend>(
    core: CachingCore<B>,
    program: &ReplayProgram,
    config: &ReplayConfig,
    complete: impl FnMut(&mut B, StreamId),
) -> Result<ReplayOutcome, ReplayError> {
    replay_on_with_progress(core, program, config, complete, &mut |_| {})
}

/// [`replay_on`] that reports its progress as [`replay_with_progress`] does.
pub fn replay_on_with_progress<B: Backend>(
    core: CachingCore<B>,
    program: &ReplayProgram,
    config: &ReplayConfig,
    complete: impl FnMut(&mut B, StreamId),
    progress: &mut dyn FnMut(usize),
) -> Result<ReplayOutcome, ReplayError> {
    replay_on_full(core, program, config, complete, None, progress)
}

/// [`replay_on_with_progress`] with a way to offer the backend the trace's segment address
/// for the operation about to run: `offer(backend, Some(address))` before an operation during
/// which the trace made a device allocation at `address`, `offer(backend, None)` after it
/// ([`ReplayProgram::segment_at`]).
pub fn replay_on_full<B: Backend>(
    mut core: CachingCore<B>,
    program: &ReplayProgram,
    config: &ReplayConfig,
    mut complete: impl FnMut(&mut B, StreamId),
    offer: Option<OfferAddress<'_, B>>,
    progress: &mut dyn FnMut(usize),
) -> Result<ReplayOutcome, ReplayError> {
    if config.record_history {
        core.record_history(Some(usize::MAX));
    }
    let mut pass = Pass::new(program, config.timeline);
    pass.set_up_start(&mut core, &mut complete, program, config.start)?;
    let mut offer = offer;
    let start = Instant::now();
    pass.run(
        &mut core,
        program,
        true,
        &mut complete,
        &mut offer,
        0,
        progress,
    )?;
    let first_ns = start.elapsed().as_nanos() as f64;
    let stats = core.stats().clone();
    let final_layout = core.segments();
    let history = if config.record_history {
        let history = core.history();
        core.record_history(None);
        history
    } else {
        Vec::new()
    };
    let ops = program.ops.len().max(1);
    let first_pass_ns_per_op = first_ns / ops as f64;
    let mut ns_per_op = first_pass_ns_per_op;
    let mut steady_pass_device_calls = Vec::new();
    if config.repeat > 1 {
        pass.release_all(&mut core, &mut complete)?;
        let mut steady = Pass::new(program, false);
        let calls = |s: &Stats| s.num_device_alloc + s.num_device_free;
        let mut before = calls(core.stats());
        let mut timed = std::time::Duration::ZERO;
        for p in 1..config.repeat {
            let start = Instant::now();
            steady.run(
                &mut core,
                program,
                false,
                &mut complete,
                &mut None,
                p * program.ops.len(),
                progress,
            )?;
            steady.release_all(&mut core, &mut complete)?;
            timed += start.elapsed();
            // Counted between passes, outside the timed span.
            let after = calls(core.stats());
            steady_pass_device_calls.push(after - before);
            before = after;
        }
        ns_per_op = timed.as_nanos() as f64 / (ops * (config.repeat - 1)) as f64;
    }
    let allocs = pass.allocs;
    Ok(ReplayOutcome {
        ops: program.ops.len(),
        allocs,
        frees: pass.frees,
        peak_requested_bytes: pass.peak_requested,
        peak_allocated_bytes: stats.allocated_bytes.all.peak as u64,
        peak_reserved_bytes: stats.reserved_bytes.all.peak as u64,
        peak_segments: stats.segment.all.peak as u64,
        device_allocs: stats.num_device_alloc,
        device_frees: stats.num_device_free,
        cache_hit_rate: if allocs == 0 {
            1.0
        } else {
            pass.hits as f64 / allocs as f64
        },
        ooms: stats.num_ooms,
        empty_cache_at_peak_bytes: pass.whole_free_at_peak,
        stranded_at_peak_bytes: pass.stranded_at_peak,
        ns_per_op,
        first_pass_ns_per_op,
        steady_pass_device_calls,
        stats,
        final_layout,
        timeline: pass.timeline,
        history,
    })
}

/// A core and the backend hooks of a replay, as a [`ReplayTarget`].
pub(super) struct CoreTarget<'a, 'o, B: Backend, C> {
    pub(super) core: &'a mut CachingCore<B>,
    pub(super) complete: &'a mut C,
    pub(super) offer: &'a mut Option<OfferAddress<'o, B>>,
}

impl<B: Backend, C: FnMut(&mut B, StreamId)> ReplayTarget for CoreTarget<'_, '_, B, C> {
    type Error = Error;

    #[inline]
    fn is_out_of_memory(error: &Error) -> bool {
        matches!(error, Error::OutOfMemory(_))
    }

    #[inline]
    fn malloc(&mut self, size: u64, stream: StreamId) -> Result<u64, Error> {
        self.core.malloc(size, stream)
    }

    #[inline]
    fn free(&mut self, address: u64) -> Result<(), Error> {
        self.core.free(address)
    }

    #[inline]
    fn record_stream(&mut self, address: u64, stream: StreamId) -> Result<(), Error> {
        self.core.record_stream(address, stream)
    }

    fn empty_cache(&mut self) -> Result<(), Error> {
        self.core.empty_cache()
    }

    fn set_runtime_settings(&mut self, change: &RuntimeSettings) -> Result<(), Error> {
        let settings = change.applied_to(self.core.settings());
        self.core.set_runtime_settings(settings)
    }

    fn release_stream_cache(&mut self, stream: StreamId) -> Result<(), Error> {
        self.core.release_stream_cache(stream)
    }

    fn adopt_segment(&mut self, segment: AdoptedSegment) -> Result<(), Error> {
        self.core.adopt_segment(segment)
    }

    fn adopt_range(&mut self, range: AdoptedRange) -> Result<(), Error> {
        self.core.adopt_range(range)
    }

    fn complete_stream(&mut self, stream: StreamId) -> Result<(), Error> {
        (self.complete)(self.core.backend_mut(), stream);
        Ok(())
    }

    fn offer_address(&mut self, address: Option<u64>) -> Result<(), Error> {
        if let Some(offer) = self.offer.as_mut() {
            offer(self.core.backend_mut(), address);
        }
        Ok(())
    }
}

/// One pass over a program: the interpreter, and what the replay measures along the way.
struct Pass {
    interpreter: Interpreter,
    peak_requested: u64,
    peak_reserved: i64,
    whole_free_at_peak: u64,
    stranded_at_peak: u64,
    allocs: usize,
    frees: usize,
    hits: usize,
    timeline: Vec<Sample>,
    keep_timeline: bool,
}

impl Pass {
    fn new(program: &ReplayProgram, keep_timeline: bool) -> Pass {
        Pass {
            interpreter: Interpreter::new(program),
            peak_requested: 0,
            peak_reserved: 0,
            whole_free_at_peak: 0,
            stranded_at_peak: 0,
            allocs: 0,
            frees: 0,
            hits: 0,
            timeline: if keep_timeline {
                Vec::with_capacity(program.ops.len())
            } else {
                Vec::new()
            },
            keep_timeline,
        }
    }

    /// Puts the allocator in the state the trace's recording began in.
    fn set_up_start<B: Backend, C: FnMut(&mut B, StreamId)>(
        &mut self,
        core: &mut CachingCore<B>,
        complete: &mut C,
        program: &ReplayProgram,
        mode: StartMode,
    ) -> Result<(), ReplayError> {
        if mode == StartMode::Empty
            || (program.initial.is_empty() && program.start.segments.is_empty())
        {
            return Ok(());
        }
        let mut target = CoreTarget {
            core: &mut *core,
            complete,
            offer: &mut None,
        };
        self.interpreter
            .set_up_start(&mut target, program, mode)
            .map_err(|e| {
                ReplayError::Start(match e {
                    StartFailure::Target(e) => e,
                    StartFailure::Inconsistent => Error::InvalidAdoption {
                        reason: "the program's start handles do not match its start layout".into(),
                    },
                })
            })?;
        self.observe(core.stats());
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn run<B: Backend>(
        &mut self,
        core: &mut CachingCore<B>,
        program: &ReplayProgram,
        observe: bool,
        complete: &mut impl FnMut(&mut B, StreamId),
        offer: &mut Option<OfferAddress<'_, B>>,
        done_before: usize,
        progress: &mut dyn FnMut(usize),
    ) -> Result<(), ReplayError> {
        let offer_addresses = offer.is_some();
        for i in 0..program.ops.len() {
            if i % PROGRESS_EVERY == 0 && i > 0 {
                progress(done_before + i);
            }
            let before = if observe {
                core.stats().num_device_alloc
            } else {
                0
            };
            let mut target = CoreTarget {
                core: &mut *core,
                complete: &mut *complete,
                offer: &mut *offer,
            };
            match self
                .interpreter
                .step(&mut target, program, i, offer_addresses)
                .map_err(|error| ReplayError::Device { op: i, error })?
            {
                Executed::Allocated => {
                    self.allocs += 1;
                    if observe && core.stats().num_device_alloc == before {
                        self.hits += 1;
                    }
                }
                Executed::AllocationFailed => self.allocs += 1,
                Executed::Freed => self.frees += 1,
                Executed::Other => {}
            }
            if observe {
                self.observe(core.stats());
            }
        }
        progress(done_before + program.ops.len());
        Ok(())
    }

    fn observe(&mut self, stats: &Stats) {
        let requested = self.interpreter.requested();
        self.peak_requested = self.peak_requested.max(requested);
        let reserved = stats.reserved_bytes.all.current;
        if reserved > self.peak_reserved {
            self.peak_reserved = reserved;
            // reserved = active + inactive split + wholly free segments.
            let stranded = stats.inactive_split_bytes.all.current;
            self.stranded_at_peak = stranded as u64;
            self.whole_free_at_peak = (reserved - stats.active_bytes.all.current - stranded) as u64;
        }
        if self.keep_timeline {
            self.timeline.push(Sample {
                requested,
                allocated: stats.allocated_bytes.all.current as u64,
                reserved: reserved as u64,
            });
        }
    }

    /// Frees whatever the trace left live and completes held-back frees, so the next pass
    /// starts from the same program state.
    fn release_all<B: Backend>(
        &mut self,
        core: &mut CachingCore<B>,
        complete: &mut impl FnMut(&mut B, StreamId),
    ) -> Result<(), ReplayError> {
        let mut target = CoreTarget {
            core,
            complete,
            offer: &mut None,
        };
        self.interpreter
            .release_all(&mut target)
            .map_err(|error| ReplayError::Device {
                op: usize::MAX,
                error,
            })
    }
}

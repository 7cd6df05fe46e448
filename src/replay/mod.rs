//! The replay engine: a PyTorch trace through cachalot's allocator on a device.
//!
//! The one rule: the replay reproduces the program's requests exactly — sizes, streams, the
//! order of allocations and frees, cross-stream frees held back until PyTorch released them,
//! explicit cache releases — and the device hands out the trace's own segment addresses where
//! it can, so best fit's address tie-break sees what PyTorch saw.

use std::time::Instant;

use cachalot::sizes::Pool;
use cachalot::{
    AdoptedBlock, AdoptedSegment, AdoptedState, Backend, CachingCore, Error, SegmentInfo, Settings,
    SimDevice, Stats, StreamId, TraceEvent,
};
use serde::Serialize;

use crate::snapshot::{BlockStatus, ReplayOp, ReplayProgram, SegmentType};

/// The stream ids the replayer uses for cross-stream frees: one per held-back block, above
/// any real stream handle's range.
const SIDE_STREAM_BASE: u64 = 1 << 63;

/// Operations between two progress reports.
const PROGRESS_EVERY: usize = 1 << 14;

/// Whether a stream id is one of the replayer's side streams (a held-back cross-stream free's),
/// rather than one of the trace's stream handles. A backend that must map stream ids to real
/// streams (the CUDA replay) uses this.
pub fn is_side_stream(stream: StreamId) -> bool {
    stream.0 & SIDE_STREAM_BASE != 0
}

/// The memory of an H200 as CUDA reports it: the default device size of a replay.
pub const H200_MEMORY: u64 = 150_109_880_320;

/// Offers a backend the trace's segment address for the operation about to run (`Some`), or
/// withdraws it (`None`); see [`replay_on_full`].
pub type OfferAddress<'a, B> = &'a mut dyn FnMut(&mut B, Option<u64>);

/// What a replay starts from when the trace's recording began in the middle of a process
/// ([`ReplayProgram::start`] not empty).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StartMode {
    /// The state PyTorch held, block for block: its segments, the tensors live in them, the
    /// cross-stream frees in flight and the cached free blocks (rule 18). Right when the
    /// replayed policy is the one that made that state.
    #[default]
    Exact,
    /// Only the tensors live at the start, allocated in address order through the replayed
    /// policy before the trace runs (pending ones freed on a side stream at once): what a
    /// different policy would have held for the same program, without PyTorch's cache.
    LiveTensors,
    /// Nothing: the replay starts empty and the trace's frees of blocks allocated before
    /// recording are dropped (the figures miss what the process held then).
    Empty,
}

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
        core.record_history(true);
    }
    let mut pass = Pass::new(program, config.timeline);
    pass.set_up_start(&mut core, program, config.start)?;
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
        let history = core.history().to_vec();
        core.record_history(false);
        history
    } else {
        Vec::new()
    };
    let ops = program.ops.len().max(1);
    let mut ns_per_op = first_ns / ops as f64;
    if config.repeat > 1 {
        pass.release_all(&mut core, &mut complete)?;
        let mut steady = Pass::new(program, false);
        let start = Instant::now();
        for p in 1..config.repeat {
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
        }
        ns_per_op = start.elapsed().as_nanos() as f64 / (ops * (config.repeat - 1)) as f64;
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
        stats,
        final_layout,
        timeline: pass.timeline,
        history,
    })
}

/// The state of one pass over a program.
struct Pass {
    /// Per handle: its address (0 when not live).
    live: Vec<u64>,
    /// Per handle: its requested size.
    sizes: Vec<u64>,
    held_back: Vec<bool>,
    requested: u64,
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
        let n = program.num_handles();
        Pass {
            live: vec![0; n],
            sizes: vec![0; n],
            held_back: vec![false; n],
            requested: 0,
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
    fn set_up_start<B: Backend>(
        &mut self,
        core: &mut CachingCore<B>,
        program: &ReplayProgram,
        mode: StartMode,
    ) -> Result<(), ReplayError> {
        if program.initial.is_empty() && program.start.segments.is_empty() {
            return Ok(());
        }
        match mode {
            StartMode::Empty => return Ok(()),
            StartMode::Exact => {
                let mut handles = program.initial.iter();
                for seg in &program.start.segments {
                    let mut blocks = Vec::with_capacity(seg.blocks.len());
                    for b in &seg.blocks {
                        let state = match b.state {
                            BlockStatus::Inactive => AdoptedState::Free,
                            live => {
                                let h = handles.next().filter(|h| h.address == b.address).ok_or(
                                    ReplayError::Start(Error::InvalidAdoption {
                                        reason: "the program's start handles do not match its \
                                                 start layout"
                                            .into(),
                                    }),
                                )?;
                                if live == BlockStatus::ActivePendingFree {
                                    self.held_back[h.id] = true;
                                    AdoptedState::Pending {
                                        requested: b.requested,
                                        streams: vec![side_stream(h.id)],
                                    }
                                } else {
                                    self.live[h.id] = b.address;
                                    self.sizes[h.id] = h.requested;
                                    self.requested += h.requested;
                                    AdoptedState::Allocated {
                                        requested: b.requested,
                                    }
                                }
                            }
                        };
                        blocks.push(AdoptedBlock {
                            size: b.size,
                            state,
                        });
                    }
                    core.adopt_segment(AdoptedSegment {
                        address: seg.address,
                        size: seg.size,
                        stream: StreamId(seg.stream),
                        pool: match seg.pool {
                            SegmentType::Small => Pool::Small,
                            SegmentType::Large => Pool::Large,
                        },
                        blocks,
                    })
                    .map_err(ReplayError::Start)?;
                }
            }
            StartMode::LiveTensors => {
                for h in &program.initial {
                    let address = match core.malloc(h.requested, StreamId(h.stream)) {
                        Ok(a) => a,
                        Err(Error::OutOfMemory(_)) => continue,
                        Err(e) => return Err(ReplayError::Start(e)),
                    };
                    if h.pending {
                        core.record_stream(address, side_stream(h.id))
                            .and_then(|()| core.free(address))
                            .map_err(ReplayError::Start)?;
                        self.held_back[h.id] = true;
                    } else {
                        self.live[h.id] = address;
                        self.sizes[h.id] = h.requested;
                        self.requested += h.requested;
                    }
                }
            }
        }
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
        let ops = &program.ops;
        let mut next_segment = program.segment_at.iter().peekable();
        for (i, op) in ops.iter().enumerate() {
            if i % PROGRESS_EVERY == 0 && i > 0 {
                progress(done_before + i);
            }
            let mut offered = false;
            if let Some(offer) = offer.as_mut() {
                while next_segment.peek().is_some_and(|&&(at, _)| at < i) {
                    next_segment.next();
                }
                if let Some(&&(at, address)) = next_segment.peek()
                    && at == i
                {
                    offer(core.backend_mut(), Some(address));
                    offered = true;
                }
            }
            match *op {
                ReplayOp::Alloc { id, size, stream } => {
                    let Some(slot) = self.live.get_mut(id) else {
                        continue;
                    };
                    let before = if observe {
                        core.stats().num_device_alloc
                    } else {
                        0
                    };
                    match core.malloc(size, StreamId(stream)) {
                        Ok(address) => {
                            *slot = address;
                            self.sizes[id] = size;
                            self.requested += size;
                            self.allocs += 1;
                            if observe && core.stats().num_device_alloc == before {
                                self.hits += 1;
                            }
                        }
                        Err(Error::OutOfMemory(_)) => self.allocs += 1,
                        Err(error) => return Err(ReplayError::Device { op: i, error }),
                    }
                }
                ReplayOp::FreeRequested { id } => {
                    let Some(&address) = self.live.get(id) else {
                        continue;
                    };
                    if address == 0 {
                        continue;
                    }
                    // A free not directly followed by its completion was held back by PyTorch
                    // for other streams' work: record a use on a side stream of its own, which
                    // completes at the matching FreeCompleted.
                    let deferred = !matches!(ops.get(i + 1), Some(ReplayOp::FreeCompleted { id: next }) if *next == id);
                    let result = if deferred {
                        self.held_back[id] = true;
                        core.record_stream(address, side_stream(id))
                            .and_then(|()| core.free(address))
                    } else {
                        core.free(address)
                    };
                    result.map_err(|error| ReplayError::Device { op: i, error })?;
                    self.live[id] = 0;
                    self.requested -= self.sizes[id];
                    self.frees += 1;
                }
                ReplayOp::FreeCompleted { id } => {
                    if self.held_back.get(id) == Some(&true) {
                        self.held_back[id] = false;
                        complete(core.backend_mut(), side_stream(id));
                    }
                }
                ReplayOp::EmptyCache => {
                    core.empty_cache()
                        .map_err(|error| ReplayError::Device { op: i, error })?;
                }
            }
            if offered && let Some(offer) = offer.as_mut() {
                offer(core.backend_mut(), None);
            }
            if observe {
                self.observe(core.stats());
            }
        }
        progress(done_before + ops.len());
        Ok(())
    }

    fn observe(&mut self, stats: &Stats) {
        self.peak_requested = self.peak_requested.max(self.requested);
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
                requested: self.requested,
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
        for id in 0..self.live.len() {
            if self.live[id] != 0 {
                core.free(self.live[id])
                    .map_err(|error| ReplayError::Device {
                        op: usize::MAX,
                        error,
                    })?;
                self.live[id] = 0;
            }
            if self.held_back[id] {
                self.held_back[id] = false;
                complete(core.backend_mut(), side_stream(id));
            }
        }
        self.requested = 0;
        Ok(())
    }
}

fn side_stream(id: usize) -> StreamId {
    StreamId(SIDE_STREAM_BASE | id as u64)
}

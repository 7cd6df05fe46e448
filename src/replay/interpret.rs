//! How a replay program becomes calls on an allocator: the one interpretation of
//! [`ReplayOp`]s, shared by the replay engine (which times it on `CachingCore`) and the test
//! harness (which runs it on the allocator and the reference model side by side).
//!
//! The one rule: the interpreter keeps the program's state (which handle holds which address,
//! which frees are held back, which segment address the trace made during which operation) and
//! reaches the allocator only through [`ReplayTarget`]; it measures nothing.

use cachalot::sizes::Pool;
use cachalot::snapshot::{BlockStatus, SegmentType};
use cachalot::{AdoptedBlock, AdoptedRange, AdoptedSegment, AdoptedState, StreamId};

use super::program::{ReplayOp, ReplayProgram, RuntimeSettings};
use super::start::StartMode;

/// The stream ids the replayer uses for cross-stream frees: one per held-back block, above
/// any real stream handle's range.
const SIDE_STREAM_BASE: u64 = 1 << 63;

/// Whether a stream id is one of the replayer's side streams (a held-back cross-stream free's),
/// rather than one of the trace's stream handles. A backend that must map stream ids to real
/// streams (the CUDA replay) uses this.
pub fn is_side_stream(stream: StreamId) -> bool {
    stream.0 & SIDE_STREAM_BASE != 0
}

/// The side stream of handle `id`: the stream a held-back free of that handle waits for.
pub fn side_stream(id: usize) -> StreamId {
    StreamId(SIDE_STREAM_BASE | id as u64)
}

/// An allocator as a replay drives it: every call a replay program's operations become.
///
/// Every call may fail with [`ReplayTarget::Error`]; an out-of-memory failure of
/// [`malloc`](ReplayTarget::malloc) (as [`ReplayTarget::is_out_of_memory`] tells) is part of
/// the program (PyTorch failed too, or the replayed settings need more memory) and the replay
/// goes on; any other failure stops it.
pub trait ReplayTarget {
    /// What a call fails with.
    type Error;

    /// Whether `error` is an out-of-memory failure of an allocation.
    fn is_out_of_memory(error: &Self::Error) -> bool;

    /// Allocates `size` bytes on `stream`.
    fn malloc(&mut self, size: u64, stream: StreamId) -> Result<u64, Self::Error>;

    /// Frees the allocation at `address`.
    fn free(&mut self, address: u64) -> Result<(), Self::Error>;

    /// Records that `stream` uses the allocation at `address`.
    fn record_stream(&mut self, address: u64, stream: StreamId) -> Result<(), Self::Error>;

    /// Releases every cached segment that is entirely free.
    fn empty_cache(&mut self) -> Result<(), Self::Error>;

    /// Takes over a segment the device already holds (rule 18).
    fn adopt_segment(&mut self, segment: AdoptedSegment) -> Result<(), Self::Error>;

    /// Takes over a range of expandable segments the device already holds (rule 18f).
    fn adopt_range(&mut self, range: AdoptedRange) -> Result<(), Self::Error>;

    /// The work queued on `stream` (a side stream, [`side_stream`]) so far has completed.
    fn complete_stream(&mut self, stream: StreamId) -> Result<(), Self::Error>;

    /// Offers the device the trace's segment address for the operation about to run
    /// (`Some`), or withdraws it (`None`).
    fn offer_address(&mut self, address: Option<u64>) -> Result<(), Self::Error>;

    /// Puts run-time settings in force (rule 24: `torch.cuda.memory._set_allocator_settings`).
    fn set_runtime_settings(&mut self, change: &RuntimeSettings) -> Result<(), Self::Error>;

    /// Gives back the free whole segments of `stream` (rule 25: a private pool's release).
    fn release_stream_cache(&mut self, stream: StreamId) -> Result<(), Self::Error>;
}

/// What one operation did, for the replay engine's counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Executed {
    /// An allocation was served.
    Allocated,
    /// An allocation failed for lack of memory.
    AllocationFailed,
    /// A live handle was freed (at once or held back for its side stream).
    Freed,
    /// Anything else: a completion, a cache release, or an operation on a handle that is not
    /// live (its allocation failed, or it was allocated before an empty start).
    Other,
}

/// Why setting up the start failed.
#[derive(Debug)]
pub enum StartFailure<E> {
    /// The program's start handles do not match its start layout.
    Inconsistent,
    /// The target refused a call.
    Target(E),
}

/// What the interpreter knows of one handle.
#[derive(Clone, Copy, Debug, Default)]
struct Handle {
    /// Its address (0 when not live).
    address: u64,
    /// Its requested size.
    size: u64,
    /// Freed and waiting for its side stream.
    held_back: bool,
}

/// One pass of a program over a [`ReplayTarget`]: which handle holds which address, which
/// frees are held back for their side streams, and the program's live requested bytes.
#[derive(Clone, Debug)]
pub struct Interpreter {
    /// Per handle: its state (one vector, so that an operation looks its handle up once).
    handles: Vec<Handle>,
    /// Bytes the program holds live (requested sizes).
    requested: u64,
    /// The next entry of [`ReplayProgram::segment_at`] not yet passed.
    next_segment: usize,
}

impl Interpreter {
    /// A pass over `program`, nothing live yet.
    pub fn new(program: &ReplayProgram) -> Interpreter {
        let n = program.num_handles();
        Interpreter {
            handles: vec![Handle::default(); n],
            requested: 0,
            next_segment: 0,
        }
    }

    /// Bytes the program holds live (the requested sizes of its live handles).
    pub fn requested(&self) -> u64 {
        self.requested
    }

    /// The addresses of the handles live now, by handle.
    pub fn live_addresses(&self) -> impl Iterator<Item = u64> + '_ {
        self.handles.iter().map(|h| h.address).filter(|&a| a != 0)
    }

    /// The handles live now, as `(handle, address)`, by handle.
    pub fn live_handles(&self) -> impl Iterator<Item = (usize, u64)> + '_ {
        self.handles
            .iter()
            .enumerate()
            .filter(|(_, h)| h.address != 0)
            .map(|(id, h)| (id, h.address))
    }

    /// Puts `target` in the state the program's recording began in
    /// ([`ReplayProgram::start`], [`ReplayProgram::initial`]), as `mode` says.
    pub fn set_up_start<T: ReplayTarget>(
        &mut self,
        target: &mut T,
        program: &ReplayProgram,
        mode: StartMode,
    ) -> Result<(), StartFailure<T::Error>> {
        if program.initial.is_empty() && program.start.segments.is_empty() {
            return Ok(());
        }
        match mode {
            StartMode::Empty => {}
            StartMode::Exact => {
                let mut handles = program.initial.iter();
                // The runs of one range (rule 19) are adopted together, as one range (rule
                // 18f): unmapped between them and after the last.
                let mut range: Option<(u64, AdoptedRange)> = None;
                for seg in &program.start.segments {
                    if let Some((_, r)) = range.take_if(|(base, _)| seg.range != Some(*base)) {
                        target.adopt_range(r).map_err(StartFailure::Target)?;
                    }
                    let mut blocks = Vec::with_capacity(seg.blocks.len());
                    for b in &seg.blocks {
                        let state = match b.state {
                            BlockStatus::Inactive => AdoptedState::Free,
                            live => {
                                let h = handles
                                    .next()
                                    .filter(|h| h.address == b.address)
                                    .ok_or(StartFailure::Inconsistent)?;
                                if live == BlockStatus::ActivePendingFree {
                                    self.handles[h.id].held_back = true;
                                    AdoptedState::Pending {
                                        requested: b.requested,
                                        streams: vec![side_stream(h.id)],
                                    }
                                } else {
                                    self.handles[h.id].address = b.address;
                                    self.handles[h.id].size = h.requested;
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
                    let pool = match seg.pool {
                        SegmentType::Small => Pool::Small,
                        SegmentType::Large => Pool::Large,
                    };
                    if let Some(base) = seg.range {
                        let (_, r) = range.get_or_insert_with(|| {
                            (
                                base,
                                AdoptedRange {
                                    address: base,
                                    stream: StreamId(seg.stream),
                                    pool,
                                    blocks: Vec::new(),
                                },
                            )
                        });
                        let covered: u64 = base + r.blocks.iter().map(|b| b.size).sum::<u64>();
                        if seg.address < covered {
                            return Err(StartFailure::Inconsistent);
                        }
                        if seg.address > covered {
                            r.blocks.push(AdoptedBlock {
                                size: seg.address - covered,
                                state: AdoptedState::Unmapped,
                            });
                        }
                        r.blocks.extend(blocks);
                        continue;
                    }
                    target
                        .adopt_segment(AdoptedSegment {
                            address: seg.address,
                            size: seg.size,
                            stream: StreamId(seg.stream),
                            pool: match seg.pool {
                                SegmentType::Small => Pool::Small,
                                SegmentType::Large => Pool::Large,
                            },
                            blocks,
                        })
                        .map_err(StartFailure::Target)?;
                }
                if let Some((_, r)) = range {
                    target.adopt_range(r).map_err(StartFailure::Target)?;
                }
            }
            StartMode::LiveTensors => {
                for h in &program.initial {
                    let address = match target.malloc(h.requested, StreamId(h.stream)) {
                        Ok(a) => a,
                        Err(e) if T::is_out_of_memory(&e) => continue,
                        Err(e) => return Err(StartFailure::Target(e)),
                    };
                    if h.pending {
                        target
                            .record_stream(address, side_stream(h.id))
                            .and_then(|()| target.free(address))
                            .map_err(StartFailure::Target)?;
                        self.handles[h.id].held_back = true;
                    } else {
                        self.handles[h.id].address = address;
                        self.handles[h.id].size = h.requested;
                        self.requested += h.requested;
                    }
                }
            }
        }
        Ok(())
    }

    /// Runs `program.ops[i]` on `target`. With `offer_addresses`, the segment address the
    /// trace made during this operation ([`ReplayProgram::segment_at`]) is offered to the
    /// device before it and withdrawn after it. Operations must be run in order.
    #[inline]
    pub fn step<T: ReplayTarget>(
        &mut self,
        target: &mut T,
        program: &ReplayProgram,
        i: usize,
        offer_addresses: bool,
    ) -> Result<Executed, T::Error> {
        let ops = &program.ops;
        let mut offered = false;
        if offer_addresses {
            let at = &program.segment_at;
            while at.get(self.next_segment).is_some_and(|&(op, _)| op < i) {
                self.next_segment += 1;
            }
            if let Some(&(op, address)) = at.get(self.next_segment)
                && op == i
            {
                target.offer_address(Some(address))?;
                offered = true;
            }
        }
        let done = match ops[i] {
            ReplayOp::SetSettings { change } => {
                if let Some(c) = program.settings_changes.get(change) {
                    target.set_runtime_settings(c)?;
                }
                Executed::Other
            }
            _ => self.run(target, ops, i)?,
        };
        if offered {
            target.offer_address(None)?;
        }
        Ok(done)
    }

    // Inlined into `step`: one call per operation (the replay's loop) instead of two.
    #[inline(always)]
    fn run<T: ReplayTarget>(
        &mut self,
        target: &mut T,
        ops: &[ReplayOp],
        i: usize,
    ) -> Result<Executed, T::Error> {
        Ok(match ops[i] {
            ReplayOp::Alloc { id, size, stream } => {
                let Some(handle) = self.handles.get_mut(id) else {
                    return Ok(Executed::Other);
                };
                match target.malloc(size, StreamId(stream)) {
                    Ok(address) => {
                        handle.address = address;
                        handle.size = size;
                        self.requested += size;
                        Executed::Allocated
                    }
                    Err(e) if T::is_out_of_memory(&e) => Executed::AllocationFailed,
                    Err(e) => return Err(e),
                }
            }
            ReplayOp::FreeRequested { id } => {
                let Some(handle) = self.handles.get_mut(id) else {
                    return Ok(Executed::Other);
                };
                let address = handle.address;
                if address == 0 {
                    return Ok(Executed::Other);
                }
                // A free not directly followed by its completion was held back by PyTorch
                // for other streams' work: record a use on a side stream of its own, which
                // completes at the matching FreeCompleted.
                let deferred = !matches!(ops.get(i + 1), Some(ReplayOp::FreeCompleted { id: next }) if *next == id);
                if deferred {
                    handle.held_back = true;
                    target.record_stream(address, side_stream(id))?;
                }
                target.free(address)?;
                handle.address = 0;
                self.requested -= handle.size;
                Executed::Freed
            }
            ReplayOp::FreeCompleted { id } => {
                if let Some(handle) = self.handles.get_mut(id)
                    && handle.held_back
                {
                    handle.held_back = false;
                    target.complete_stream(side_stream(id))?;
                }
                Executed::Other
            }
            ReplayOp::EmptyCache => {
                target.empty_cache()?;
                Executed::Other
            }
            ReplayOp::ReleaseStream { stream } => {
                target.release_stream_cache(StreamId(stream))?;
                Executed::Other
            }
            // Run by `step`, which has the program's settings.
            ReplayOp::SetSettings { .. } => Executed::Other,
        })
    }

    /// Frees whatever the program left live and completes held-back frees, so that the next
    /// pass starts from the same program state.
    pub fn release_all<T: ReplayTarget>(&mut self, target: &mut T) -> Result<(), T::Error> {
        for (id, handle) in self.handles.iter_mut().enumerate() {
            if handle.address != 0 {
                target.free(handle.address)?;
                handle.address = 0;
            }
            if handle.held_back {
                handle.held_back = false;
                target.complete_stream(side_stream(id))?;
            }
        }
        self.requested = 0;
        self.next_segment = 0;
        Ok(())
    }
}

//! The replay's start: the allocator's state when recording began, reconstructed from the
//! dump, and what a replay starts from ([`StartMode`]).
//!
//! A snapshot holds the allocator's segments *at the dump* and the trace of what happened
//! before it. Users start recording after a warm-up, or let the ring buffer wrap, so at the
//! trace's first entry the process already held segments, live tensors, cross-stream frees in
//! flight and cached free blocks. Walking the trace backwards from the dumped layout, undoing
//! each entry, gives that state (PyTorch's memory_viz rebuilds its plots the same way):
//!
//! - `segment_alloc` undone: the segment (wholly free by then) disappears;
//!   `segment_free` undone: a wholly free segment of that size and stream appears (2 MiB
//!   segments are the small pool: large segments are at least 10 MiB, rule 4);
//! - `alloc` undone: the block becomes free and merges with free neighbours (free blocks are
//!   always merged, rule 10, and the remainder of a split is the free neighbour);
//! - `free_requested` undone: the pending block is allocated again;
//! - `free_completed` undone: the block is carved back out of the free block that holds its
//!   address, as pending. Its size is the request rounded by rule 2, or — when what is left of
//!   the free block up to its end is a remainder rule 13 would not have split off (at most
//!   1 MiB in the large pool; free large blocks are always larger than that) — the whole rest.
//!
//! Under expandable segments (rule 19) the dump lists one segment per run of mapped blocks of a
//! range; the walk takes the runs of one pool and stream as one range (from the lowest run on,
//! unmapped between runs and after the last), undoes `alloc` and `free_completed` in it as
//! above (a `free_completed` block is always its request rounded: rule 19c splits whatever
//! remains), a `segment_map` by unmapping its pages and a `segment_unmap` by mapping them
//! again as a free block ([`StartSegment::range`]).
//!
//! Whatever is inconsistent (an address no block holds, a block in the wrong state, a segment
//! freed while in use, a range given back during the trace) stops the walk with a [`StartError`]
//! that names the entry: the trace did not come from this dump, from this PyTorch version, or
//! from a policy the walk does not model.

use std::collections::{BTreeMap, BTreeSet};

use cachalot::sizes::{MAX_ALLOC_SIZE, SMALL_BUFFER, SMALL_SIZE, round_size};
use cachalot::snapshot::{Action, BlockStatus, DeviceTrace, SegmentState, SegmentType};
use serde::Serialize;

/// What a replay starts from when the trace's recording began in the middle of a process
/// ([`ReplayProgram::start`](super::program::ReplayProgram::start) not empty).
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

/// A block of a [`StartSegment`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StartBlock {
    /// The block's address.
    pub address: u64,
    /// Its size in bytes.
    pub size: u64,
    /// The size the program asked for (0 for a free block).
    pub requested: u64,
    /// Allocated, pending (freed by the program, in use on another stream) or free.
    pub state: BlockStatus,
}

/// A segment the process held when recording began.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartSegment {
    /// The segment's address.
    pub address: u64,
    /// Its size in bytes.
    pub size: u64,
    /// Its stream.
    pub stream: u64,
    /// Its pool.
    pub pool: SegmentType,
    /// Its blocks in address order.
    pub blocks: Vec<StartBlock>,
    /// For a run of mapped blocks of a range of expandable segments (rule 19: the dump lists
    /// one segment per run, `size` its mapped bytes), the range's first address; `None` for a
    /// segment (rule 8).
    pub range: Option<u64>,
}

/// The allocator's state at a trace's first entry.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StartState {
    /// The segments held then, by address; empty for a process recorded from its start.
    pub segments: Vec<StartSegment>,
    /// The dump's segments of private pools (CUDA graphs', `torch.cuda.MemPool`'s), by
    /// address: what the replay needs to put the trace's allocations in them into pools of
    /// their own (see [`crate::replay::replay_ops_from`]).
    pub private_segments: Vec<PrivateSegment>,
}

/// A segment of a private pool in the dump (`segment_pool_id` other than `(0, 0)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrivateSegment {
    /// The segment's address.
    pub address: u64,
    /// Its size in bytes.
    pub size: u64,
    /// Its pool's index among the device's private pools in the dump, in pool-id order.
    pub pool: usize,
}

/// The dump's private-pool segments of `device`, with the pools numbered in id order.
pub fn private_segments(segments: &[SegmentState], device: usize) -> Vec<PrivateSegment> {
    let mut pools: Vec<(u64, u64)> = segments
        .iter()
        .filter(|s| s.device == device && s.pool_id != (0, 0))
        .map(|s| s.pool_id)
        .collect();
    pools.sort_unstable();
    pools.dedup();
    let mut out: Vec<PrivateSegment> = segments
        .iter()
        .filter(|s| s.device == device && s.pool_id != (0, 0))
        .map(|s| PrivateSegment {
            address: s.address,
            size: s.total_size,
            pool: pools.binary_search(&s.pool_id).unwrap_or(0),
        })
        .collect();
    out.sort_by_key(|s| s.address);
    out
}

impl StartState {
    /// Whether nothing was held (the recording began with the process, or with an empty cache).
    pub fn is_fresh(&self) -> bool {
        self.segments.is_empty()
    }

    /// Reserved bytes at the start.
    pub fn reserved_bytes(&self) -> u64 {
        self.segments.iter().map(|s| s.size).sum()
    }

    /// The blocks live at the start (allocated or pending), by address.
    pub fn live_blocks(&self) -> impl Iterator<Item = (&StartSegment, &StartBlock)> {
        self.segments.iter().flat_map(|s| {
            s.blocks
                .iter()
                .filter(|b| b.state != BlockStatus::Inactive)
                .map(move |b| (s, b))
        })
    }

    /// Requested bytes of the blocks live at the start.
    pub fn live_requested_bytes(&self) -> u64 {
        self.live_blocks().map(|(_, b)| b.requested).sum()
    }
}

/// Why the start could not be reconstructed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("trace entry {entry} ({action}): {reason}")]
pub struct StartError {
    /// The trace entry where the walk stopped (its index in the device trace).
    pub entry: usize,
    /// Its action.
    pub action: String,
    /// What was inconsistent.
    pub reason: String,
}

#[derive(Debug, Clone)]
struct Seg {
    size: u64,
    stream: u64,
    pool: SegmentType,
    /// Blocks by address: (size, requested, state).
    blocks: BTreeMap<u64, (u64, u64, BlockStatus)>,
    /// The addresses of blocks whose size the walk inferred (carved back out at an undone
    /// `free_completed`) rather than read off the dump.
    inferred: BTreeSet<u64>,
}

/// Reconstructs the state at the first entry of `trace` from the dumped `segments` (all
/// devices; those of `trace.device` are used), walking the trace backwards. `divisions` is
/// the recorded `roundup_power2_divisions` (rule 2), for the sizes of blocks freed in the trace.
pub fn reconstruct_start(
    trace: &DeviceTrace,
    segments: &[SegmentState],
    divisions: &[u64; 16],
) -> Result<StartState, StartError> {
    reconstruct_start_paged(trace, segments, divisions, PYTORCH_LARGE_PAGE)
}

/// PyTorch's page of a large-pool range of expandable segments (rule 19): 20 MiB.
pub const PYTORCH_LARGE_PAGE: u64 = 20 << 20;

/// [`reconstruct_start`] for a trace whose large-pool ranges of expandable segments (rule 19)
/// had pages of `large_page` bytes (the small pool's are 2 MiB): every page the walk maps or
/// unmaps again must be whole pages of its range.
pub fn reconstruct_start_paged(
    trace: &DeviceTrace,
    segments: &[SegmentState],
    divisions: &[u64; 16],
    large_page: u64,
) -> Result<StartState, StartError> {
    walk(trace, segments, &|_| *divisions, large_page)
}

/// [`reconstruct_start_paged`] for a trace whose program changed its settings at trace entry
/// `change` (`torch.cuda.memory._set_allocator_settings`, rule 24): a block the trace
/// allocated before that entry (or before recording began) was rounded by `before`, a later
/// one by `after`.
pub fn reconstruct_start_changed(
    trace: &DeviceTrace,
    segments: &[SegmentState],
    before: &[u64; 16],
    after: &[u64; 16],
    change: usize,
    large_page: u64,
) -> Result<StartState, StartError> {
    // The entry of the allocation behind each free_completed.
    let mut last_alloc: BTreeMap<u64, usize> = BTreeMap::new();
    let mut allocated_at = vec![usize::MAX; trace.entries.len()];
    for (i, e) in trace.entries.iter().enumerate() {
        match e.action {
            Action::Alloc => {
                last_alloc.insert(e.addr, i);
            }
            Action::FreeCompleted => {
                if let Some(a) = last_alloc.remove(&e.addr) {
                    allocated_at[i] = a;
                }
            }
            _ => {}
        }
    }
    let at = |i: usize| {
        let a = allocated_at.get(i).copied().unwrap_or(usize::MAX);
        if a == usize::MAX || a < change {
            *before
        } else {
            *after
        }
    };
    walk(trace, segments, &at, large_page)
}

/// The backward walk, with the `roundup_power2_divisions` of the block each entry names.
fn walk(
    trace: &DeviceTrace,
    segments: &[SegmentState],
    divisions_at: &dyn Fn(usize) -> [u64; 16],
    large_page: u64,
) -> Result<StartState, StartError> {
    let mine = || segments.iter().filter(|s| s.device == trace.device);
    if mine().any(|s| s.is_expandable) {
        // A range the walk cannot follow (one given back during the trace) is no obstacle
        // when nothing was held before the trace: the empty start.
        return expandable_walk(trace, segments, divisions_at, large_page)
            .or_else(|walk| expandable_start(trace, segments).map_err(|_| walk));
    }
    let mut state: BTreeMap<u64, Seg> = BTreeMap::new();
    for s in mine() {
        let blocks = s
            .blocks
            .iter()
            .map(|b| {
                let requested = if b.state == BlockStatus::Inactive {
                    0
                } else {
                    b.requested_size
                };
                (b.address, (b.size, requested, b.state))
            })
            .collect();
        if s.is_expandable {
            return Err(StartError {
                entry: trace.entries.len(),
                action: "dump".into(),
                reason: format!(
                    "segment {:#x} is an expandable segment, which the walk does not model",
                    s.address
                ),
            });
        }
        state.insert(
            s.address,
            Seg {
                size: s.total_size,
                stream: s.stream,
                pool: s.segment_type,
                blocks,
                inferred: BTreeSet::new(),
            },
        );
    }
    for (i, e) in trace.entries.iter().enumerate().rev() {
        let fail = |reason: String| StartError {
            entry: i,
            action: e.action.name().to_string(),
            reason,
        };
        match e.action {
            Action::SegmentAlloc => {
                let seg = state
                    .get(&e.addr)
                    .ok_or_else(|| fail(format!("no segment at {:#x}", e.addr)))?;
                let whole_free = seg.blocks.len() == 1
                    && seg
                        .blocks
                        .values()
                        .all(|&(_, _, st)| st == BlockStatus::Inactive);
                if seg.size != e.size || !whole_free {
                    return Err(fail(format!(
                        "segment {:#x} is not one free block of {} bytes before it was made",
                        e.addr, e.size
                    )));
                }
                state.remove(&e.addr);
            }
            Action::SegmentFree => {
                let end = e
                    .addr
                    .checked_add(e.size)
                    .ok_or_else(|| fail("overflow".into()))?;
                let overlaps = state
                    .range(..end)
                    .next_back()
                    .is_some_and(|(&a, s)| a + s.size > e.addr);
                if overlaps || e.size == 0 {
                    return Err(fail(format!(
                        "segment {:#x} overlaps one held after it was freed",
                        e.addr
                    )));
                }
                let pool = if e.size == SMALL_BUFFER {
                    SegmentType::Small
                } else {
                    SegmentType::Large
                };
                let mut blocks = BTreeMap::new();
                blocks.insert(e.addr, (e.size, 0, BlockStatus::Inactive));
                state.insert(
                    e.addr,
                    Seg {
                        size: e.size,
                        stream: e.stream,
                        pool,
                        blocks,
                        inferred: BTreeSet::new(),
                    },
                );
            }
            Action::Alloc => {
                let seg = segment_of(&mut state, e.addr)
                    .ok_or_else(|| fail(format!("no segment holds {:#x}", e.addr)))?;
                match seg.blocks.get(&e.addr) {
                    Some(&(_, _, BlockStatus::ActiveAllocated)) => {}
                    _ => {
                        return Err(fail(format!(
                            "no allocated block at {:#x} after it was allocated",
                            e.addr
                        )));
                    }
                }
                set_free_and_merge(seg, e.addr);
            }
            Action::FreeRequested => {
                let seg = segment_of(&mut state, e.addr)
                    .ok_or_else(|| fail(format!("no segment holds {:#x}", e.addr)))?;
                match seg.blocks.get_mut(&e.addr) {
                    Some(b) if b.2 == BlockStatus::ActivePendingFree => {
                        b.2 = BlockStatus::ActiveAllocated
                    }
                    _ => {
                        return Err(fail(format!(
                            "no pending block at {:#x} after it was freed",
                            e.addr
                        )));
                    }
                }
            }
            Action::FreeCompleted => {
                let seg = segment_of(&mut state, e.addr)
                    .ok_or_else(|| fail(format!("no segment holds {:#x}", e.addr)))?;
                let (&fs, &(fsize, _, fstate)) = seg
                    .blocks
                    .range(..=e.addr)
                    .next_back()
                    .ok_or_else(|| fail(format!("no block holds {:#x}", e.addr)))?;
                let fe = fs + fsize;
                if fstate != BlockStatus::Inactive || e.addr >= fe {
                    return Err(fail(format!(
                        "{:#x} is not in a free block after its free completed",
                        e.addr
                    )));
                }
                let rounded = round_size(e.size.min(MAX_ALLOC_SIZE), &divisions_at(i));
                let rest = fe - e.addr;
                if rounded > rest {
                    return Err(fail(format!(
                        "a {rounded}-byte block at {:#x} does not fit its free block",
                        e.addr
                    )));
                }
                let remainder = rest - rounded;
                let size = match seg.pool {
                    SegmentType::Small => rounded,
                    // The large pool leaves a remainder of at most 1 MiB unsplit (rule 13).
                    SegmentType::Large if remainder <= SMALL_SIZE => rest,
                    SegmentType::Large => rounded,
                };
                // What lies before the block in its free block. In the large pool a free block
                // is larger than 1 MiB (rule 13 splits off only more than that; merging only
                // grows blocks), so a front part of at most 1 MiB was no free block: it is the
                // unsplit remainder of the block before it, a block whose free the walk undid
                // earlier (it was freed later) with its size inferred from its request alone.
                let front = e.addr - fs;
                let mut front_free = front > 0;
                if seg.pool == SegmentType::Large && front > 0 && front <= SMALL_SIZE {
                    let before = seg
                        .blocks
                        .range(..fs)
                        .next_back()
                        .map(|(&a, &(size, _, state))| (a, size, state));
                    match before {
                        Some((a, size, state))
                            if a + size == fs
                                && state != BlockStatus::Inactive
                                && seg.inferred.contains(&a) =>
                        {
                            if let Some(b) = seg.blocks.get_mut(&a) {
                                b.0 += front;
                            }
                            front_free = false;
                        }
                        _ => {
                            return Err(fail(format!(
                                "a {rounded}-byte block at {:#x} would leave a free block of \
                                 {front} bytes before it in a large-pool segment",
                                e.addr
                            )));
                        }
                    }
                }
                seg.blocks.remove(&fs);
                if front_free {
                    seg.blocks.insert(fs, (front, 0, BlockStatus::Inactive));
                }
                seg.blocks
                    .insert(e.addr, (size, e.size, BlockStatus::ActivePendingFree));
                seg.inferred.insert(e.addr);
                if e.addr + size < fe {
                    seg.blocks.insert(
                        e.addr + size,
                        (fe - e.addr - size, 0, BlockStatus::Inactive),
                    );
                }
            }
            Action::SegmentMap | Action::SegmentUnmap => {
                return Err(fail(
                    "pages of an expandable segment: the walk does not model them".into(),
                ));
            }
            _ => {}
        }
    }
    Ok(StartState {
        private_segments: private_segments(segments, trace.device),
        segments: state
            .into_iter()
            .map(|(address, s)| StartSegment {
                address,
                size: s.size,
                stream: s.stream,
                pool: s.pool,
                range: None,
                blocks: s
                    .blocks
                    .into_iter()
                    .map(|(a, (size, requested, state))| StartBlock {
                        address: a,
                        size,
                        requested,
                        state,
                    })
                    .collect(),
            })
            .collect(),
    })
}

fn segment_of(state: &mut BTreeMap<u64, Seg>, addr: u64) -> Option<&mut Seg> {
    let (&a, seg) = state.range_mut(..=addr).next_back()?;
    (addr < a + seg.size).then_some(seg)
}

/// Frees the block at `addr` and merges it with free neighbours.
fn set_free_and_merge(seg: &mut Seg, addr: u64) {
    let Some((block_size, _, _)) = seg.blocks.remove(&addr) else {
        return;
    };
    seg.inferred.remove(&addr);
    let end = addr + block_size;
    let mut start = addr;
    let mut size = block_size;
    if let Some((&p, &(psize, _, pstate))) = seg.blocks.range(..addr).next_back()
        && pstate == BlockStatus::Inactive
        && p + psize == addr
    {
        seg.blocks.remove(&p);
        start = p;
        size += psize;
    }
    if let Some(&(nsize, _, nstate)) = seg.blocks.get(&end)
        && nstate == BlockStatus::Inactive
    {
        seg.blocks.remove(&end);
        size += nsize;
    }
    seg.blocks.insert(start, (size, 0, BlockStatus::Inactive));
}

/// One range of expandable segments as the walk keeps it (rule 19).
#[derive(Debug, Clone)]
struct WalkRange {
    stream: u64,
    pool: SegmentType,
    /// Blocks by address from the range's first address: (size, requested, state, mapped).
    /// Everything after the last one is unmapped; the last one is always mapped.
    blocks: BTreeMap<u64, (u64, u64, BlockStatus, bool)>,
}

impl WalkRange {
    /// The block holding `addr`, as `(address, size, requested, state, mapped)`.
    fn holding(&self, addr: u64) -> Option<(u64, u64, u64, BlockStatus, bool)> {
        let (&a, &(size, requested, state, mapped)) = self.blocks.range(..=addr).next_back()?;
        (addr - a < size).then_some((a, size, requested, state, mapped))
    }

    /// The end of the last block (mapped): everything from there on is unmapped.
    fn end(&self) -> u64 {
        self.blocks
            .iter()
            .next_back()
            .map_or(0, |(&a, &(size, ..))| a + size)
    }

    /// Inserts a block of `size` bytes at `addr` (free and `mapped`, or unmapped) and merges
    /// it with neighbours of its kind (free mapped blocks with free mapped, unmapped with
    /// unmapped); trailing unmapped blocks are dropped (the range's rest is unmapped anyway).
    fn insert_merged(&mut self, addr: u64, size: u64, mapped: bool) {
        let same = |&(_, _, state, m): &(u64, u64, BlockStatus, bool)| {
            state == BlockStatus::Inactive && m == mapped
        };
        let (mut start, mut size) = (addr, size);
        if let Some((&p, &b)) = self.blocks.range(..addr).next_back()
            && p + b.0 == addr
            && same(&b)
        {
            self.blocks.remove(&p);
            start = p;
            size += b.0;
        }
        if let Some(&b) = self.blocks.get(&(start + size))
            && same(&b)
        {
            self.blocks.remove(&(start + size));
            size += b.0;
        }
        self.blocks
            .insert(start, (size, 0, BlockStatus::Inactive, mapped));
        while let Some((&a, &(_, _, _, m))) = self.blocks.iter().next_back()
            && !m
        {
            self.blocks.remove(&a);
        }
    }
}

/// The backward walk under expandable segments (rule 19): the ranges held at the trace's first
/// entry, rebuilt from the dump's runs (see the module's documentation).
fn expandable_walk(
    trace: &DeviceTrace,
    segments: &[SegmentState],
    divisions_at: &dyn Fn(usize) -> [u64; 16],
    large_page: u64,
) -> Result<StartState, StartError> {
    let page_of = |pool: SegmentType| match pool {
        SegmentType::Small => SMALL_BUFFER,
        SegmentType::Large => large_page.max(1),
    };
    // Whole pages of the range at `base`: what a map step maps and a release unmaps.
    let whole = |pool: SegmentType, base: u64, addr: u64, size: u64| {
        let page = page_of(pool);
        addr >= base && (addr - base).is_multiple_of(page) && size.is_multiple_of(page)
    };
    let dump_error = |reason: String| StartError {
        entry: trace.entries.len(),
        action: "dump".into(),
        reason,
    };
    let mut runs: Vec<&SegmentState> = segments
        .iter()
        .filter(|s| s.device == trace.device)
        .collect();
    if let Some(s) = runs.iter().find(|s| !s.is_expandable) {
        return Err(dump_error(format!(
            "segment {:#x} is not expandable beside expandable ones (settings changed at run \
             time): the walk does not model the mix",
            s.address
        )));
    }
    if let Some(s) = runs.iter().find(|s| s.pool_id != (0, 0)) {
        return Err(dump_error(format!(
            "segment {:#x} is an expandable segment of a private pool, which the walk does not \
             model",
            s.address
        )));
    }
    if let Some(s) = runs.iter().find(|s| {
        s.address.checked_add(s.total_size).is_none()
            || s.blocks
                .iter()
                .any(|b| b.address.checked_add(b.size).is_none())
    }) {
        return Err(dump_error(format!(
            "expandable segment {:#x} overflows the address space",
            s.address
        )));
    }
    runs.sort_by_key(|s| s.address);
    // One range per pool and stream, from its lowest run.
    let mut ranges: BTreeMap<u64, WalkRange> = BTreeMap::new();
    let mut base_of: BTreeMap<(u64, bool), u64> = BTreeMap::new();
    for s in runs {
        let key = (s.stream, s.segment_type == SegmentType::Small);
        let base = *base_of.entry(key).or_insert(s.address);
        let range = ranges.entry(base).or_insert_with(|| WalkRange {
            stream: s.stream,
            pool: s.segment_type,
            blocks: BTreeMap::new(),
        });
        if !whole(s.segment_type, base, s.address, s.total_size) {
            return Err(dump_error(format!(
                "expandable segment {:#x} ({} bytes) is not whole pages of the range at {base:#x}",
                s.address, s.total_size
            )));
        }
        let end = range.end().max(base);
        if s.address < end {
            return Err(dump_error(format!(
                "expandable segment {:#x} overlaps another of its range",
                s.address
            )));
        }
        if s.address > end {
            range
                .blocks
                .insert(end, (s.address - end, 0, BlockStatus::Inactive, false));
        }
        let mut at = s.address;
        for b in &s.blocks {
            if b.address != at || b.size == 0 {
                return Err(dump_error(format!(
                    "the blocks of expandable segment {:#x} do not tile it",
                    s.address
                )));
            }
            let requested = if b.state == BlockStatus::Inactive {
                0
            } else {
                b.requested_size
            };
            range.blocks.insert(at, (b.size, requested, b.state, true));
            at += b.size;
        }
        if at != s.address + s.total_size {
            return Err(dump_error(format!(
                "the blocks of expandable segment {:#x} do not tile it",
                s.address
            )));
        }
    }
    // A range's first address is greater than every address of the ranges below it, so the
    // range of an address is the one with the greatest first address at or below it.
    fn range_of(ranges: &mut BTreeMap<u64, WalkRange>, addr: u64) -> Option<(u64, &mut WalkRange)> {
        ranges
            .range_mut(..=addr)
            .next_back()
            .map(|(&base, r)| (base, r))
    }
    for (i, e) in trace.entries.iter().enumerate().rev() {
        let fail = |reason: String| StartError {
            entry: i,
            action: e.action.name().to_string(),
            reason,
        };
        match e.action {
            Action::Alloc | Action::FreeRequested | Action::FreeCompleted => {
                let (_, range) = range_of(&mut ranges, e.addr)
                    .ok_or_else(|| fail(format!("no range holds {:#x}", e.addr)))?;
                let block = range.holding(e.addr);
                match (&e.action, block) {
                    (Action::Alloc, Some((a, size, _, BlockStatus::ActiveAllocated, true)))
                        if a == e.addr =>
                    {
                        range.blocks.remove(&a);
                        range.insert_merged(a, size, true);
                    }
                    (Action::Alloc, _) => {
                        return Err(fail(format!(
                            "no allocated block at {:#x} after it was allocated",
                            e.addr
                        )));
                    }
                    (Action::FreeRequested, Some((a, _, _, BlockStatus::ActivePendingFree, _)))
                        if a == e.addr =>
                    {
                        if let Some(b) = range.blocks.get_mut(&a) {
                            b.2 = BlockStatus::ActiveAllocated;
                        }
                    }
                    (Action::FreeRequested, _) => {
                        return Err(fail(format!(
                            "no pending block at {:#x} after it was freed",
                            e.addr
                        )));
                    }
                    (_, Some((fs, fsize, _, BlockStatus::Inactive, true))) => {
                        let rounded = round_size(e.size.min(MAX_ALLOC_SIZE), &divisions_at(i));
                        let fe = fs + fsize;
                        if rounded > fe - e.addr {
                            return Err(fail(format!(
                                "a {rounded}-byte block at {:#x} does not fit its free block",
                                e.addr
                            )));
                        }
                        range.blocks.remove(&fs);
                        if e.addr > fs {
                            range
                                .blocks
                                .insert(fs, (e.addr - fs, 0, BlockStatus::Inactive, true));
                        }
                        range.blocks.insert(
                            e.addr,
                            (rounded, e.size, BlockStatus::ActivePendingFree, true),
                        );
                        if e.addr + rounded < fe {
                            range.blocks.insert(
                                e.addr + rounded,
                                (fe - e.addr - rounded, 0, BlockStatus::Inactive, true),
                            );
                        }
                    }
                    _ => {
                        return Err(fail(format!(
                            "{:#x} is not in a free block after its free completed",
                            e.addr
                        )));
                    }
                }
            }
            Action::SegmentMap => {
                let (base, range) = range_of(&mut ranges, e.addr)
                    .ok_or_else(|| fail(format!("no range holds {:#x}", e.addr)))?;
                if !whole(range.pool, base, e.addr, e.size) {
                    return Err(fail(format!(
                        "{} bytes at {:#x} are not whole pages of the range at {base:#x}",
                        e.size, e.addr
                    )));
                }
                let end = e.addr.checked_add(e.size).filter(|_| e.size > 0);
                let Some((fs, fsize, _, BlockStatus::Inactive, true)) = range.holding(e.addr)
                else {
                    return Err(fail(format!(
                        "the pages at {:#x} are not in a free block after they were mapped",
                        e.addr
                    )));
                };
                let fe = fs + fsize;
                if end.is_none_or(|end| end > fe) {
                    return Err(fail(format!(
                        "{} bytes at {:#x} are not in one free block after they were mapped",
                        e.size, e.addr
                    )));
                }
                range.blocks.remove(&fs);
                if e.addr > fs {
                    range
                        .blocks
                        .insert(fs, (e.addr - fs, 0, BlockStatus::Inactive, true));
                }
                if e.addr + e.size < fe {
                    range.blocks.insert(
                        e.addr + e.size,
                        (fe - e.addr - e.size, 0, BlockStatus::Inactive, true),
                    );
                }
                range.insert_merged(e.addr, e.size, false);
                // A range with nothing mapped before this map was reserved for it.
                if range.blocks.values().all(|b| !b.3) {
                    ranges.remove(&base);
                }
            }
            Action::SegmentUnmap => {
                let held = ranges
                    .range(..=e.addr)
                    .rev()
                    .find(|(_, r)| r.stream == e.stream)
                    .map(|(&base, _)| base);
                let Some(base) = held else {
                    return Err(fail(format!(
                        "no range of stream {} holds {:#x}: a range given back during the \
                         trace, whose first address the trace does not record",
                        e.stream, e.addr
                    )));
                };
                let range = ranges.get_mut(&base).expect("found above");
                // Whole pages of the range, or the pages belong to another (a range given
                // back during the trace, above this one).
                if !whole(range.pool, base, e.addr, e.size) {
                    return Err(fail(format!(
                        "{} bytes at {:#x} are not whole pages of the range of stream {} at \
                         {base:#x}: a range given back during the trace, whose first address \
                         the trace does not record",
                        e.size, e.addr, e.stream
                    )));
                }
                let end = range.end();
                let fits = e.size > 0
                    && e.addr.checked_add(e.size).is_some()
                    && if e.addr >= end {
                        true
                    } else {
                        matches!(range.holding(e.addr), Some((a, size, _, _, false))
                            if e.addr + e.size <= a + size)
                    };
                if !fits {
                    return Err(fail(format!(
                        "{} bytes at {:#x} are not unmapped after they were unmapped",
                        e.size, e.addr
                    )));
                }
                if e.addr >= end {
                    if e.addr > end {
                        range
                            .blocks
                            .insert(end, (e.addr - end, 0, BlockStatus::Inactive, false));
                    }
                } else if let Some((a, size, ..)) = range.holding(e.addr) {
                    range.blocks.remove(&a);
                    if e.addr > a {
                        range
                            .blocks
                            .insert(a, (e.addr - a, 0, BlockStatus::Inactive, false));
                    }
                    if e.addr + e.size < a + size {
                        range.blocks.insert(
                            e.addr + e.size,
                            (a + size - e.addr - e.size, 0, BlockStatus::Inactive, false),
                        );
                    }
                }
                range.insert_merged(e.addr, e.size, true);
            }
            Action::SegmentAlloc | Action::SegmentFree => {
                return Err(fail(
                    "a segment of rule 8 in a trace of expandable segments: the walk does not \
                     model the mix"
                        .into(),
                ));
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    for (base, range) in ranges {
        let mut run: Option<StartSegment> = None;
        for (address, (size, requested, state, mapped)) in range.blocks {
            if !mapped {
                out.extend(run.take());
                continue;
            }
            let seg = run.get_or_insert_with(|| StartSegment {
                address,
                size: 0,
                stream: range.stream,
                pool: range.pool,
                blocks: Vec::new(),
                range: Some(base),
            });
            seg.size += size;
            seg.blocks.push(StartBlock {
                address,
                size,
                requested,
                state,
            });
        }
        out.extend(run);
    }
    out.sort_by_key(|s| s.address);
    Ok(StartState {
        private_segments: private_segments(segments, trace.device),
        segments: out,
    })
}

/// The start of a trace recorded under expandable segments (rule 19) when the walk could not
/// follow its ranges: the empty allocator when every byte mapped at the dump was mapped during
/// the trace and the process held nothing else — the case of a process recorded from its
/// start. Anything else is refused, naming what was held before.
fn expandable_start(
    trace: &DeviceTrace,
    segments: &[SegmentState],
) -> Result<StartState, StartError> {
    let dumped: i128 = segments
        .iter()
        .filter(|s| s.device == trace.device)
        .map(|s| i128::from(s.total_size))
        .sum();
    let mut during: i128 = 0;
    for e in &trace.entries {
        match e.action {
            Action::SegmentAlloc | Action::SegmentMap => during += i128::from(e.size),
            Action::SegmentFree | Action::SegmentUnmap => during -= i128::from(e.size),
            _ => {}
        }
    }
    // Allocations live at the first entry would be freed in the trace without being made in it.
    let mut made = std::collections::HashSet::new();
    let freed_unmade = trace.entries.iter().any(|e| match e.action {
        Action::Alloc => {
            made.insert(e.addr);
            false
        }
        Action::FreeRequested | Action::FreeCompleted => !made.contains(&e.addr),
        _ => false,
    });
    if dumped == during && !freed_unmade {
        return Ok(StartState {
            private_segments: private_segments(segments, trace.device),
            ..StartState::default()
        });
    }
    Err(StartError {
        entry: trace.entries.len(),
        action: "dump".into(),
        reason: format!(
            "expandable segments held {} bytes when recording began{}; the walk does not model \
             expandable segments block by block",
            dumped - during,
            if freed_unmade {
                ", and tensors allocated before it are freed in the trace"
            } else {
                ""
            }
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use cachalot::snapshot::{BlockState, StackId, TraceEntry};

    const MIB: u64 = 1 << 20;

    fn entry(action: Action, addr: u64, size: u64) -> TraceEntry {
        TraceEntry {
            action,
            addr,
            size,
            stream: 0,
            time_us: 0,
            stack: StackId::EMPTY,
        }
    }

    fn segment(address: u64, total: u64, blocks: &[(u64, u64, BlockStatus)]) -> SegmentState {
        let mut at = address;
        SegmentState {
            device: 0,
            address,
            total_size: total,
            allocated_size: 0,
            active_size: 0,
            requested_size: 0,
            stream: 0,
            segment_type: if total == SMALL_BUFFER {
                SegmentType::Small
            } else {
                SegmentType::Large
            },
            is_expandable: false,
            pool_id: (0, 0),
            stack: StackId::EMPTY,
            blocks: blocks
                .iter()
                .map(|&(size, requested, state)| {
                    let b = BlockState {
                        address: at,
                        size,
                        requested_size: requested,
                        state,
                        stack: StackId::EMPTY,
                    };
                    at = at.wrapping_add(size);
                    b
                })
                .collect(),
        }
    }

    #[test]
    fn a_fresh_trace_starts_empty() {
        let base = 0x7000_0000;
        let trace = DeviceTrace {
            device: 0,
            entries: vec![
                entry(Action::SegmentAlloc, base, 20 * MIB),
                entry(Action::Alloc, base, 4 * MIB),
            ],
        };
        let dump = [segment(
            base,
            20 * MIB,
            &[
                (4 * MIB, 4 * MIB, BlockStatus::ActiveAllocated),
                (16 * MIB, 0, BlockStatus::Inactive),
            ],
        )];
        let start = reconstruct_start(&trace, &dump, &[0; 16]).unwrap();
        assert!(start.is_fresh(), "{start:?}");
    }

    #[test]
    fn blocks_freed_in_the_trace_were_live_at_the_start() {
        // Before recording: [A 4 MiB][B 6 MiB][free 10 MiB]. The trace frees B, allocates C
        // of 3 MiB where B was, and frees A.
        let base = 0x7000_0000;
        let trace = DeviceTrace {
            device: 0,
            entries: vec![
                entry(Action::FreeRequested, base + 4 * MIB, 6 * MIB),
                entry(Action::FreeCompleted, base + 4 * MIB, 6 * MIB),
                entry(Action::Alloc, base + 4 * MIB, 3 * MIB),
                entry(Action::FreeRequested, base, 4 * MIB - 100),
                entry(Action::FreeCompleted, base, 4 * MIB - 100),
            ],
        };
        let dump = [segment(
            base,
            20 * MIB,
            &[
                (4 * MIB, 0, BlockStatus::Inactive),
                (3 * MIB, 3 * MIB, BlockStatus::ActiveAllocated),
                (13 * MIB, 0, BlockStatus::Inactive),
            ],
        )];
        let start = reconstruct_start(&trace, &dump, &[0; 16]).unwrap();
        let blocks = &start.segments[0].blocks;
        let sizes: Vec<_> = blocks
            .iter()
            .map(|b| (b.size, b.requested, b.state))
            .collect();
        assert_eq!(
            sizes,
            vec![
                (4 * MIB, 4 * MIB - 100, BlockStatus::ActiveAllocated),
                (6 * MIB, 6 * MIB, BlockStatus::ActiveAllocated),
                (10 * MIB, 0, BlockStatus::Inactive),
            ]
        );
        assert_eq!(start.live_requested_bytes(), 10 * MIB - 100);
    }

    #[test]
    fn an_unsplit_remainder_belongs_to_the_block() {
        // A block of 5.5 MiB at the end of a segment was freed: rounding gives 5 MiB, but the
        // 0.5 MiB after it cannot be a free block of the large pool, so it was the block's.
        let base = 0x7000_0000;
        let trace = DeviceTrace {
            device: 0,
            entries: vec![entry(
                Action::FreeCompleted,
                base + 14 * MIB + MIB / 2,
                5 * MIB,
            )],
        };
        let dump = [segment(
            base,
            20 * MIB,
            &[
                (14 * MIB + MIB / 2, 1, BlockStatus::ActiveAllocated),
                (5 * MIB + MIB / 2, 0, BlockStatus::Inactive),
            ],
        )];
        let start = reconstruct_start(&trace, &dump, &[0; 16]).unwrap();
        let b = start.segments[0].blocks[1];
        assert_eq!(
            (b.size, b.state),
            (5 * MIB + MIB / 2, BlockStatus::ActivePendingFree)
        );
    }

    #[test]
    fn an_unsplit_remainder_before_a_block_freed_earlier_belongs_to_the_block_before() {
        // Before recording: [A 12 MiB][B 6 MiB + 768 KiB][C 1.25 MiB]: B was served
        // from a free block 768 KiB larger than it needed (rule 13 left the rest unsplit).
        // The trace frees C, then B, then A. Walking back, B's free is undone before C's,
        // with B's size inferred from its request (6 MiB); C's then shows that the 768 KiB
        // before it, no free block of the large pool, were B's.
        let base = 0x7000_0000;
        let (b, c) = (base + 12 * MIB, base + 18 * MIB + 768 * 1024);
        let trace = DeviceTrace {
            device: 0,
            entries: vec![
                entry(Action::FreeRequested, c, 5 * MIB / 4),
                entry(Action::FreeCompleted, c, 5 * MIB / 4),
                entry(Action::FreeRequested, b, 6 * MIB),
                entry(Action::FreeCompleted, b, 6 * MIB),
                entry(Action::FreeRequested, base, 12 * MIB),
                entry(Action::FreeCompleted, base, 12 * MIB),
            ],
        };
        let dump = [segment(
            base,
            20 * MIB,
            &[(20 * MIB, 0, BlockStatus::Inactive)],
        )];
        let start = reconstruct_start(&trace, &dump, &[0; 16]).unwrap();
        let sizes: Vec<_> = start.segments[0]
            .blocks
            .iter()
            .map(|b| (b.size, b.state))
            .collect();
        assert_eq!(
            sizes,
            vec![
                (12 * MIB, BlockStatus::ActiveAllocated),
                (6 * MIB + 768 * 1024, BlockStatus::ActiveAllocated),
                (5 * MIB / 4, BlockStatus::ActiveAllocated),
            ],
            "{start:?}"
        );
    }

    #[test]
    fn segments_freed_in_the_trace_existed_at_the_start_and_made_ones_did_not() {
        let trace = DeviceTrace {
            device: 0,
            entries: vec![
                entry(Action::SegmentFree, 0x1000_0000, 2 * MIB),
                entry(Action::SegmentAlloc, 0x2000_0000, 20 * MIB),
            ],
        };
        let dump = [segment(
            0x2000_0000,
            20 * MIB,
            &[(20 * MIB, 0, BlockStatus::Inactive)],
        )];
        let start = reconstruct_start(&trace, &dump, &[0; 16]).unwrap();
        assert_eq!(start.segments.len(), 1);
        assert_eq!(start.segments[0].address, 0x1000_0000);
        assert_eq!(start.segments[0].pool, SegmentType::Small);
    }

    /// A run of a range of expandable segments in the dump (rule 19h).
    fn run(address: u64, small: bool, blocks: &[(u64, u64, BlockStatus)]) -> SegmentState {
        let total = blocks.iter().map(|b| b.0).sum();
        SegmentState {
            is_expandable: true,
            segment_type: if small {
                SegmentType::Small
            } else {
                SegmentType::Large
            },
            ..segment(address, total, blocks)
        }
    }

    /// A rebuilt run: its address, its range, its blocks as (size, requested, state).
    type Run = (u64, Option<u64>, Vec<(u64, u64, BlockStatus)>);

    fn layout(start: &StartState) -> Vec<Run> {
        start
            .segments
            .iter()
            .map(|s| {
                (
                    s.address,
                    s.range,
                    s.blocks
                        .iter()
                        .map(|b| (b.size, b.requested, b.state))
                        .collect(),
                )
            })
            .collect()
    }

    #[test]
    fn a_range_held_before_the_trace_is_rebuilt_from_its_runs_and_maps() {
        use BlockStatus::*;
        // The dump: one large range at `base` with 60 MiB mapped in two runs, 20 MiB unmapped
        // between them. The trace mapped the last 20 MiB (a second run), allocated 12 MiB at
        // its start, and freed a 4 MiB tensor of the first run held before it began.
        let base = 0x3_0200_0000;
        let trace = DeviceTrace {
            device: 0,
            entries: vec![
                entry(Action::FreeRequested, base + 8 * MIB, 4 * MIB - 1000),
                entry(Action::FreeCompleted, base + 8 * MIB, 4 * MIB - 1000),
                entry(Action::SegmentMap, base + 60 * MIB, 20 * MIB),
                entry(Action::Alloc, base + 60 * MIB, 12 * MIB),
            ],
        };
        let dump = [
            run(
                base,
                false,
                &[(8 * MIB, 8 * MIB, ActiveAllocated), (32 * MIB, 0, Inactive)],
            ),
            run(
                base + 60 * MIB,
                false,
                &[
                    (12 * MIB, 12 * MIB, ActiveAllocated),
                    (8 * MIB, 0, Inactive),
                ],
            ),
        ];
        let start = reconstruct_start(&trace, &dump, &[0; 16]).unwrap();
        // The map undone: its pages are unmapped again, the rest of the range; the free undone:
        // the tensor is carved back out of the free block, its request rounded (rule 19c
        // splits off the rest however small).
        assert_eq!(
            layout(&start),
            vec![(
                base,
                Some(base),
                vec![
                    (8 * MIB, 8 * MIB, ActiveAllocated),
                    (4 * MIB - 512, 4 * MIB - 1000, ActiveAllocated),
                    (28 * MIB + 512, 0, Inactive),
                ]
            )]
        );
        assert_eq!(start.reserved_bytes(), 40 * MIB);
    }

    #[test]
    fn an_unmap_is_undone_by_mapping_its_pages_again_and_the_first_map_removes_a_range() {
        use BlockStatus::*;
        // A small range whose 2 MiB page at +2 MiB was unmapped by the trace (empty_cache), and
        // a large range the trace made (its first map at its first address).
        let small = 0x2a_5600_0000;
        let large = 0x7_0000_0000;
        let trace = DeviceTrace {
            device: 0,
            entries: vec![
                entry(Action::SegmentUnmap, small + 2 * MIB, 2 * MIB),
                entry(Action::SegmentMap, large, 20 * MIB),
                entry(Action::Alloc, large, 20 * MIB),
            ],
        };
        let dump = [
            run(
                small,
                true,
                &[(512, 512, ActiveAllocated), (2 * MIB - 512, 0, Inactive)],
            ),
            run(large, false, &[(20 * MIB, 20 * MIB, ActiveAllocated)]),
        ];
        let start = reconstruct_start(&trace, &dump, &[0; 16]).unwrap();
        assert_eq!(
            layout(&start),
            vec![(
                small,
                Some(small),
                vec![(512, 512, ActiveAllocated), (4 * MIB - 512, 0, Inactive)]
            )]
        );
    }

    #[test]
    fn runs_of_one_range_are_kept_apart_by_their_unmapped_gap() {
        use BlockStatus::*;
        let base = 0x3_0000_0000;
        let trace = DeviceTrace {
            device: 0,
            entries: vec![entry(Action::Alloc, base, 512)],
        };
        let dump = [
            run(
                base,
                true,
                &[(512, 512, ActiveAllocated), (2 * MIB - 512, 0, Inactive)],
            ),
            run(base + 4 * MIB, true, &[(2 * MIB, 0, Inactive)]),
        ];
        let start = reconstruct_start(&trace, &dump, &[0; 16]).unwrap();
        assert_eq!(
            layout(&start),
            vec![
                (base, Some(base), vec![(2 * MIB, 0, Inactive)]),
                (base + 4 * MIB, Some(base), vec![(2 * MIB, 0, Inactive)]),
            ]
        );
    }

    #[test]
    fn a_range_given_back_during_the_trace_is_refused_with_the_entry() {
        use BlockStatus::*;
        // Allocated before the trace, in a range whose pages the trace unmapped after freeing
        // it: the range is in no dump, and where it began is not recorded.
        let base = 0x3_0000_0000;
        let trace = DeviceTrace {
            device: 0,
            entries: vec![
                entry(Action::FreeRequested, base, 4 * MIB),
                entry(Action::FreeCompleted, base, 4 * MIB),
                entry(Action::SegmentUnmap, base, 20 * MIB),
                entry(Action::Alloc, 0x2a_5600_0000, 512),
            ],
        };
        let dump = [run(
            0x2a_5600_0000,
            true,
            &[(512, 512, ActiveAllocated), (2 * MIB - 512, 0, Inactive)],
        )];
        let err = reconstruct_start(&trace, &dump, &[0; 16]).unwrap_err();
        assert_eq!(err.entry, 2, "{err}");
        assert!(err.reason.contains("given back"), "{err}");
    }

    #[test]
    fn pages_of_a_range_given_back_above_another_range_are_not_taken_for_its_own() {
        use BlockStatus::*;
        // A large range at `large` (20 MiB pages) is in the dump; the trace gave back a small
        // range above it (its last 2 MiB page unmapped): those pages are no whole pages of the
        // large range, so the walk refuses rather than stretch the large range over them.
        let large = 0x3_0200_0000;
        let small = 0x2a_5600_0000;
        let trace = DeviceTrace {
            device: 0,
            entries: vec![
                entry(Action::FreeRequested, small, 512),
                entry(Action::FreeCompleted, small, 512),
                entry(Action::SegmentUnmap, small, 2 * MIB),
            ],
        };
        let dump = [run(large, false, &[(20 * MIB, 0, Inactive)])];
        let err = reconstruct_start(&trace, &dump, &[0; 16]).unwrap_err();
        assert_eq!(err.entry, 2, "{err}");
        assert!(err.reason.contains("given back"), "{err}");
    }

    #[test]
    fn a_hostile_dump_of_expandable_segments_is_refused_not_a_panic() {
        use BlockStatus::*;
        let trace = DeviceTrace {
            device: 0,
            entries: vec![entry(Action::SegmentUnmap, u64::MAX - 511, 1 << 40)],
        };
        let top = u64::MAX - MIB + 1;
        for dump in [
            vec![run(top, true, &[(2 * MIB, 0, Inactive)])],
            vec![run(0x3_0000_0000, true, &[(2 * MIB, 0, Inactive)])],
            vec![
                run(0x3_0000_0000, true, &[(2 * MIB, 0, Inactive)]),
                run(0x3_0000_0000 + MIB, true, &[(2 * MIB, 0, Inactive)]),
            ],
        ] {
            assert!(reconstruct_start(&trace, &dump, &[0; 16]).is_err());
        }
    }

    #[test]
    fn a_trace_that_does_not_match_the_dump_is_refused_with_the_entry() {
        let trace = DeviceTrace {
            device: 0,
            entries: vec![entry(Action::Alloc, 0x5000_0000, 4 * MIB)],
        };
        let err = reconstruct_start(&trace, &[], &[0; 16]).unwrap_err();
        assert_eq!(err.entry, 0);
        assert!(err.reason.contains("no segment holds"), "{err}");
    }
}

//! Turning a device trace into a replay program: the operations a replayer runs, the trace's
//! segment addresses, and the blocks live when recording began as the program's first handles.

use std::collections::{BTreeMap, HashMap};

use cachalot::snapshot::{
    Action, AllocatorSettings, BlockStatus, DeviceTrace, Snapshot, TraceEntry,
};

use super::recorded::Recorded;
use super::start::{StartError, StartState, reconstruct_start_paged};

/// One operation of a [`ReplayProgram`].
///
/// How a replayer runs them:
///
/// - `Alloc { id, size, stream }`: allocate `size` bytes (the size the program asked for) on
///   `stream` and keep the result as handle `id`. Ids are dense: the `n`-th `Alloc` of a
///   program has id `n`, so a `Vec` indexed by id holds the live handles.
/// - `FreeRequested { id }`: the program dropped the tensor. When the next op is
///   `FreeCompleted` with the same id (always the case for a block used only on its own
///   stream) the pair is a plain free. Otherwise the block was used on other streams
///   (`record_stream`) and PyTorch kept it back until those streams' events completed: the
///   replayer frees it here as a cross-stream free (for instance after recording its use on a
///   side stream), so that it stays pending, not reusable, until the matching `FreeCompleted`.
/// - `FreeCompleted { id }`: the block went back to the pool; a replayer that made it pending
///   completes the side stream's work here.
/// - `EmptyCache`: the program called `torch.cuda.empty_cache()` (or PyTorch gave its cache back
///   while failing an allocation; see [`replay_ops_with`]).
/// - `SetSettings { change }`: the program changed the allocator's settings (rule 24).
/// - `ReleaseStream { stream }`: a private pool was released (rule 25).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReplayOp {
    /// Allocate `size` requested bytes on `stream`, as handle `id`.
    Alloc {
        /// The handle: the number of `Alloc`s before this one.
        id: usize,
        /// The size the program asked for (before PyTorch's rounding).
        size: u64,
        /// The stream, as recorded (PyTorch's `cudaStream_t` as an integer; 0 is the default).
        stream: u64,
    },
    /// The program freed handle `id`.
    FreeRequested {
        /// The handle.
        id: usize,
    },
    /// Handle `id`'s block went back to the pool.
    FreeCompleted {
        /// The handle.
        id: usize,
    },
    /// Release every cached segment that is entirely free.
    EmptyCache,
    /// The program changed the allocator's settings (`torch.cuda.memory._set_allocator_settings`,
    /// rule 24): [`ReplayProgram::settings_changes`]`[change]` is in force from here on. No
    /// trace entry records it: `cachalot replay` finds where it happened, or is told.
    SetSettings {
        /// Index into [`ReplayProgram::settings_changes`].
        change: usize,
    },
    /// A private pool was released (a `torch.cuda.MemPool` deleted, rule 25): the free whole
    /// segments of replay stream `stream` (a [`private_stream`]) go back to the device.
    ReleaseStream {
        /// The replay stream.
        stream: u64,
    },
}

/// Settings a program put in force while it ran (rule 24), as
/// `torch.cuda.memory._set_allocator_settings(conf)` does in PyTorch 2.11: `max_split_size`,
/// `roundup_power2_divisions` and `garbage_collection_threshold` go back to their defaults
/// unless `conf` names them; `max_non_split_rounding_size` is `conf`'s or the default.
#[derive(Debug, Clone, PartialEq)]
pub struct RuntimeSettings {
    /// The configuration string the program passed.
    pub conf: String,
    /// `max_split_size` in bytes (`u64::MAX`: none).
    pub max_split_size: u64,
    /// `max_non_split_rounding_size` in bytes.
    pub max_non_split_rounding_size: u64,
    /// `garbage_collection_threshold` (0: off).
    pub garbage_collection_threshold: f64,
    /// `roundup_power2_divisions`, per interval.
    pub roundup_power2_divisions: [u64; 16],
}

// The threshold is validated by the settings' parser (0, or within (0, 1)): never NaN.
impl Eq for RuntimeSettings {}

impl RuntimeSettings {
    /// The run-time values of `conf` parsed over PyTorch's defaults. Keys other than the four
    /// run-time ones may appear (PyTorch ignores a change of most); they are not applied.
    pub fn from_conf(conf: &str) -> Result<RuntimeSettings, cachalot::SettingsError> {
        let s = cachalot::Settings::pytorch().apply(conf)?;
        Ok(RuntimeSettings {
            conf: conf.to_string(),
            max_split_size: s.max_split_size,
            max_non_split_rounding_size: s.max_non_split_rounding_size,
            garbage_collection_threshold: s.garbage_collection_threshold,
            roundup_power2_divisions: s.roundup_power2_divisions,
        })
    }

    /// `settings` with these run-time values in force.
    pub fn applied_to(&self, settings: &cachalot::Settings) -> cachalot::Settings {
        let mut s = settings.clone();
        s.max_split_size = self.max_split_size;
        s.max_non_split_rounding_size = self.max_non_split_rounding_size;
        s.garbage_collection_threshold = self.garbage_collection_threshold;
        s.roundup_power2_divisions = self.roundup_power2_divisions;
        s
    }
}

/// A private pool released before the dump (a `torch.cuda.MemPool` deleted), inferred from the
/// trace: its segments are in no dump.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct InferredPool {
    /// The trace entry of the release (its first `segment_free`).
    pub entry: usize,
    /// The private pool's index: one of the dump's private pools when the pool's allocations
    /// interleave with that pool's (one `use_mem_pool` context), else one after them.
    pub pool: usize,
    /// The segments released then.
    pub segments: usize,
    /// Their bytes.
    pub bytes: u64,
    /// The trace's allocations served from them.
    pub allocations: usize,
}

/// What a replayer runs to reproduce one device's trace.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplayProgram {
    /// The operations, in trace order.
    pub ops: Vec<ReplayOp>,
    /// The addresses of the trace's `segment_alloc` entries, in trace order.
    pub segment_addresses: Vec<u64>,
    /// Where each `segment_alloc` happened: `(op, address)` means the trace made a device
    /// allocation at `address` while serving `ops[op]`. A replayer offers that address to
    /// the device for that operation only, so an allocation the replay makes where PyTorch
    /// made none (or the reverse) shifts no later address.
    pub segment_at: Vec<(usize, u64)>,
    /// The allocator's state when recording began (empty for a process recorded from its
    /// start, or when it could not be reconstructed).
    pub start: StartState,
    /// The blocks live at the start, as handles `0..initial.len()` (the trace's `Alloc`s
    /// follow): the frees the trace records for them refer to these handles.
    pub initial: Vec<InitialHandle>,
    /// Per operation, the index of the trace entry it came from (for an `EmptyCache`, the
    /// first `segment_free` of its run): nondecreasing, as long as `ops` when the program was
    /// converted from a trace (empty for a program built by hand).
    pub op_entries: Vec<usize>,
    /// The settings each [`ReplayOp::SetSettings`] puts in force.
    pub settings_changes: Vec<RuntimeSettings>,
    /// Private pools released before the dump, inferred from the trace (their allocations are
    /// replayed in pools of their own, released by [`ReplayOp::ReleaseStream`]).
    pub inferred_pools: Vec<InferredPool>,
}

/// A block live when recording began, as a handle of a [`ReplayProgram`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InitialHandle {
    /// The handle.
    pub id: usize,
    /// The block's address at the start.
    pub address: u64,
    /// The size the program asked for.
    pub requested: u64,
    /// The block's stream (its segment's).
    pub stream: u64,
    /// Freed by the program before recording began but still in use on another stream: it
    /// returns to the pool at its `FreeCompleted`.
    pub pending: bool,
}

impl ReplayProgram {
    /// This program with `change` put in force just before the first operation from trace
    /// entry `entry` on (at the end when there is none): a [`ReplayOp::SetSettings`] inserted,
    /// the later operations' segment offers shifted with them.
    pub fn with_settings_change(&self, entry: usize, change: RuntimeSettings) -> ReplayProgram {
        let mut p = self.clone();
        let at = p
            .op_entries
            .partition_point(|&e| e < entry)
            .min(p.ops.len());
        p.settings_changes.push(change);
        p.ops.insert(
            at,
            ReplayOp::SetSettings {
                change: p.settings_changes.len() - 1,
            },
        );
        if at <= p.op_entries.len() && !p.op_entries.is_empty() {
            p.op_entries.insert(at, entry);
        }
        for s in &mut p.segment_at {
            if s.0 >= at {
                s.0 += 1;
            }
        }
        p
    }

    /// The number of handles (`Alloc` ops) in the program.
    pub fn num_handles(&self) -> usize {
        self.initial.len()
            + self
                .ops
                .iter()
                .filter(|op| matches!(op, ReplayOp::Alloc { .. }))
                .count()
    }
}

/// Settings the conversion needs to recognise the allocator's own cache releases.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplayOptions {
    /// The allocator's `max_split_size` in bytes, if one was set (a cached block at least this
    /// large never serves a smaller request).
    pub max_split_size: Option<u64>,
    /// Whether the allocator reclaims before growing (cachalot's rule 20: expandable segments
    /// with `reclaim_headroom`): then a run of page unmaps directly followed by page maps and
    /// an allocation is that allocation's own reclaim, which the replayed allocator makes by
    /// itself, not the program's `empty_cache()`.
    pub reclaims: bool,
}

impl ReplayOptions {
    /// The options matching a snapshot's recorded allocator settings (defaults when `None`).
    /// Reclaiming is read off the recorded configuration string, applied over PyTorch's
    /// defaults (cachalot writes its own keys there; PyTorch's strings never name them).
    pub fn from_settings(settings: Option<&AllocatorSettings>) -> ReplayOptions {
        let reclaims = Recorded::new(settings, None)
            .settings()
            .is_ok_and(|c| c.expandable_segments && c.reclaim_headroom.is_some());
        ReplayOptions {
            max_split_size: settings.and_then(|s| s.max_split_size),
            reclaims,
        }
    }
}

/// Counts of what the conversion did, for checks and diagnostics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplayReport {
    /// `Alloc` ops emitted (one per `alloc` entry).
    pub allocs: usize,
    /// `FreeRequested` ops emitted.
    pub frees_requested: usize,
    /// `FreeCompleted` ops emitted.
    pub frees_completed: usize,
    /// `FreeCompleted` ops not directly after their `FreeRequested` (cross-stream frees).
    pub deferred_frees: usize,
    /// `free_requested`/`free_completed` entries dropped: their address had no live allocation
    /// (allocated before recording began, or a repeated free).
    pub unmatched_frees: usize,
    /// `EmptyCache` ops emitted (runs of `segment_free` entries).
    pub empty_caches: usize,
    /// Runs of `segment_free` entries recognised as the allocator's own release inside an
    /// allocation, and so not emitted.
    pub internal_releases: usize,
    /// `alloc` entries at an address whose previous allocation was never freed in the trace
    /// (the earlier handle stays live forever).
    pub reused_live_addresses: usize,
    /// Handles never completed by the end of the trace.
    pub live_at_end: usize,
    /// `oom` entries replayed as allocations that fail again.
    pub failed_allocs: usize,
    /// Runs of `segment_free` entries taken for a private pool's release (a
    /// `torch.cuda.MemPool` deleted, see [`ReplayProgram::inferred_pools`]).
    pub pool_releases: usize,
    /// Entries with no replay meaning (`snapshot`, `segment_map`, `user_defined`, unknown
    /// actions).
    pub ignored_entries: usize,
}

/// [`replay_ops_with`] with default options (no `max_split_size`).
pub fn replay_ops(trace: &DeviceTrace) -> ReplayProgram {
    replay_ops_with(trace, &ReplayOptions::default()).0
}

/// The bit that marks a replay stream standing for a private pool's blocks on a recorded
/// stream (see [`private_stream`]).
const PRIVATE_STREAM_BIT: u64 = 1 << 62;
/// The recorded stream's bits in a private pool's replay stream.
const PRIVATE_STREAM_MASK: u64 = (1 << 48) - 1;

/// The stream a replay allocates on for a request the trace served from private pool `pool`
/// (its index among the dump's private pools, see
/// [`private_segments`](super::private_segments)) on recorded stream `stream`. PyTorch keeps a
/// private pool's blocks (a CUDA graph's, a `torch.cuda.MemPool`'s) apart from every other
/// pool and reuses them only for requests made into that pool on the same stream; an
/// allocator that keys its cached blocks by stream does exactly that when each (pool,
/// stream) is a stream of its own. (Recorded streams are `cudaStream_t` pointers, below
/// 2^48.)
pub fn private_stream(pool: usize, stream: u64) -> u64 {
    PRIVATE_STREAM_BIT | ((pool as u64 + 1) << 48) | (stream & PRIVATE_STREAM_MASK)
}

/// The recorded stream and private pool index behind a replay stream: `(stream, None)` for a
/// stream of the default pools.
pub fn recorded_stream(stream: u64) -> (u64, Option<usize>) {
    if stream & PRIVATE_STREAM_BIT != 0 && stream & (1 << 63) == 0 {
        let pool = ((stream >> 48) & 0x3fff) as usize;
        (stream & PRIVATE_STREAM_MASK, Some(pool.saturating_sub(1)))
    } else {
        (stream, None)
    }
}

const SMALL_SEGMENT: u64 = 2 << 20;
const SMALL_REQUEST: u64 = 1 << 20;

/// Converts one device's trace into a replay program, and reports what it did.
///
/// - Every `alloc` becomes an `Alloc` with the next id; frees are matched to allocations by
///   address. A free of an address with no live allocation (allocated before recording began)
///   is dropped; allocations never freed stay live. `free_requested` becomes `FreeRequested`
///   and `free_completed` becomes `FreeCompleted`, both always emitted (see [`ReplayOp`]).
/// - Every `segment_alloc` address goes to [`ReplayProgram::segment_addresses`].
/// - A run of consecutive `segment_free` entries (and `segment_unmap`, an expandable segment's
///   pages given back) is one release of the cache. PyTorch releases
///   its cache in two situations: when the program calls `empty_cache()`, and inside an
///   allocation that found no cached block and whose device allocation failed (the device or
///   the memory fraction is full: it then frees cached segments and retries). The first kind
///   becomes one `EmptyCache`; the second is left out, since the replayed allocator does the
///   same by itself when its device is as full.
///
/// A run is taken to be an allocation's own release when all of these hold:
///
/// 1. it is directly followed by a `segment_alloc` and then an `alloc` inside that new
///    segment (the allocation the retry served);
/// 2. none of the released segments could have served that allocation before being released:
///    none is on the allocation's stream, in its pool (2 MiB segments are the small pool,
///    requests up to 1 MiB after rounding to 512 bytes go there), at least as large as the
///    request rounded to 512 bytes and, with `max_split_size` set, not an oversize block
///    refused to a smaller request. (Had one fitted, PyTorch would have used it instead of
///    releasing anything, so the release was the program's `empty_cache()`.)
/// 3. the device was full: the bytes reserved just before the run plus the new segment exceed
///    the most bytes reserved at any point of the trace. (Had they fitted under that peak, the
///    device allocation would have succeeded without releasing anything, as the same device
///    once held that much. Reserved bytes are counted from the start of the trace, so the
///    segments held before recording began shift both sides equally.)
///
/// Under cachalot's rule 20 ([`ReplayOptions::reclaims`]) a run of `segment_unmap` entries
/// alone, directly followed by `segment_map` entries and an `alloc`, is that allocation's
/// reclaim and is left out too (an `empty_cache()` called right before such an allocation would
/// be taken for one).
///
/// A run followed by an `oom` entry is PyTorch releasing its cache before failing an
/// allocation: it is left out, and the failed allocation is replayed as an `Alloc` (which
/// fails again, releasing the same cache by itself). Not recognised: releases by the garbage collector
/// (`garbage_collection_threshold` with a memory fraction), which look like an explicit
/// `empty_cache()` that frees only some segments, and the rounding of
/// `roundup_power2_divisions` in rule 2 (a request that PyTorch rounds up beyond a released
/// segment's size is still counted as servable by it). An explicit `empty_cache()` that a
/// program calls right before an allocation that needs a new segment beyond the trace's peak
/// is taken for an internal release; a replayer whose device capacity equals PyTorch's peak
/// reserved bytes then releases the same segments by itself.
pub fn replay_ops_with(
    trace: &DeviceTrace,
    options: &ReplayOptions,
) -> (ReplayProgram, ReplayReport) {
    replay_ops_from(trace, options, &StartState::default())
}

/// The dump's private segments and, for each address, the trace's last `segment_alloc` and
/// `segment_free` there: a segment is one of the dump's private pools' when the dump holds a
/// private segment at its address and size and the trace does not free it after making it
/// (the dump's segment is that one).
struct DumpedPools {
    /// Address → (size, pool index) of the dump's private segments.
    private: HashMap<u64, (u64, usize)>,
    last_alloc_of: HashMap<u64, usize>,
    last_free_of: HashMap<u64, usize>,
}

impl DumpedPools {
    fn new(entries: &[TraceEntry], start: &StartState) -> DumpedPools {
        let private = start
            .private_segments
            .iter()
            .map(|s| (s.address, (s.size, s.pool)))
            .collect();
        let mut last_alloc_of = HashMap::new();
        let mut last_free_of = HashMap::new();
        for (i, e) in entries.iter().enumerate() {
            match e.action {
                Action::SegmentAlloc => {
                    last_alloc_of.insert(e.addr, i);
                }
                Action::SegmentFree => {
                    last_free_of.insert(e.addr, i);
                }
                _ => {}
            }
        }
        DumpedPools {
            private,
            last_alloc_of,
            last_free_of,
        }
    }

    /// The dumped pool of a segment held when recording began: the dump's, if the trace never
    /// makes a segment there.
    fn of_start_segment(&self, address: u64, size: u64) -> Option<usize> {
        self.private
            .get(&address)
            .filter(|&&(s, _)| s == size && !self.last_alloc_of.contains_key(&address))
            .map(|&(_, p)| p)
    }

    /// The dumped pool of the segment trace entry `i` (`e`, a `segment_alloc`) makes: the
    /// dump's, if this is the trace's last segment made there and none is freed there after.
    fn of_segment_alloc(&self, e: &TraceEntry, i: usize) -> Option<usize> {
        self.private
            .get(&e.addr)
            .filter(|&&(size, _)| {
                size == e.size
                    && self.last_alloc_of.get(&e.addr) == Some(&i)
                    && self.last_free_of.get(&e.addr).is_none_or(|&f| f < i)
            })
            .map(|&(_, p)| p)
    }

    /// How many private pools the dump names (their indexes are below it).
    fn count(&self) -> usize {
        self.private
            .values()
            .map(|&(_, p)| p + 1)
            .max()
            .unwrap_or(0)
    }
}

/// The private pools released before the dump that [`infer_pool_releases`] finds.
#[derive(Default)]
struct InferredReleases {
    /// Per run of `segment_free` entries (its first entry) taken for a pool's release: the pool.
    runs: HashMap<usize, usize>,
    /// Per segment of such a pool — its address and the entry of its `segment_alloc`
    /// (`usize::MAX` for one held at the start) — the pool.
    segments: HashMap<(u64, usize), usize>,
    /// What the report says about each.
    pools: Vec<InferredPool>,
}

/// Finds the private pools released before the dump (a `torch.cuda.MemPool` deleted:
/// PyTorch's `emptyCache(pool)` then gives back that pool's free whole segments and no
/// other). A run of `segment_free` entries is taken for one when it is not followed by a
/// `segment_alloc` or an `oom` (no allocation's own release) and, at that point, a segment of
/// the default pools holds no live block and is not released (an `empty_cache()`, PyTorch's
/// release on out-of-memory, would have given it back too; the garbage collector and rule 11
/// release before a `segment_alloc`). The run's segments form the pool; it is one of the
/// dump's private pools when an allocation into that pool falls between the first and the last
/// allocation served from the run's segments (one `use_mem_pool` context), else a pool of its
/// own. Recording that starts inside the pool's life (its segments made before) is handled
/// alike: segments held at the start count as made then.
fn infer_pool_releases(
    entries: &[TraceEntry],
    start: &StartState,
    dumped: &DumpedPools,
) -> InferredReleases {
    // Segments live: address -> (size, key, dumped private pool).
    let mut segs: BTreeMap<u64, (u64, usize, Option<usize>)> = BTreeMap::new();
    for s in &start.segments {
        if s.range.is_some() {
            return InferredReleases::default();
        }
        let pool = dumped.of_start_segment(s.address, s.size);
        segs.insert(s.address, (s.size, usize::MAX, pool));
    }
    let mut live: std::collections::BTreeSet<u64> =
        start.live_blocks().map(|(_, b)| b.address).collect();
    // The allocations served from each segment (by key), and those into dumped pools.
    let mut served: HashMap<(u64, usize), Vec<usize>> = HashMap::new();
    let mut into_dumped: Vec<(usize, usize)> = Vec::new();
    // Per run taken for a release: its first entry and its segments (address, key, size).
    type Released = Vec<(u64, usize, u64)>;
    let mut runs: Vec<(usize, Released)> = Vec::new();
    let n = entries.len();
    let mut i = 0;
    while i < n {
        let e = &entries[i];
        match e.action {
            Action::SegmentMap | Action::SegmentUnmap => return InferredReleases::default(),
            Action::SegmentAlloc => {
                let pool = dumped.of_segment_alloc(e, i);
                segs.insert(e.addr, (e.size, i, pool));
            }
            Action::Alloc => {
                live.insert(e.addr);
                if let Some((&a, &(size, key, pool))) = segs.range(..=e.addr).next_back()
                    && e.addr < a.saturating_add(size)
                {
                    served.entry((a, key)).or_default().push(i);
                    if let Some(p) = pool {
                        into_dumped.push((i, p));
                    }
                }
            }
            Action::FreeCompleted => {
                live.remove(&e.addr);
            }
            Action::SegmentFree => {
                let mut end = i;
                let mut released = Vec::new();
                while end < n && entries[end].action == Action::SegmentFree {
                    if let Some((size, key, _)) = segs.remove(&entries[end].addr) {
                        released.push((entries[end].addr, key, size));
                    }
                    end += 1;
                }
                let retry = entries
                    .get(end)
                    .is_some_and(|x| matches!(x.action, Action::SegmentAlloc | Action::Oom));
                let idle_default = segs.iter().any(|(&a, &(size, _, pool))| {
                    pool.is_none() && live.range(a..a.saturating_add(size)).next().is_none()
                });
                if !retry && idle_default && !released.is_empty() {
                    runs.push((i, released));
                }
                i = end;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    let dumped_pools = dumped.count();
    let mut out = InferredReleases::default();
    for (j, (entry, released)) in runs.into_iter().enumerate() {
        let times: Vec<usize> = released
            .iter()
            .flat_map(|&(a, key, _)| served.get(&(a, key)).cloned().unwrap_or_default())
            .collect();
        let window = times.iter().min().zip(times.iter().max());
        let joined = window.and_then(|(&lo, &hi)| {
            into_dumped
                .iter()
                .find(|&&(t, _)| lo <= t && t <= hi)
                .map(|&(_, p)| p)
        });
        let pool = joined.unwrap_or(dumped_pools + j);
        for &(a, key, _) in &released {
            out.segments.insert((a, key), pool);
        }
        out.runs.insert(entry, pool);
        out.pools.push(InferredPool {
            entry,
            pool,
            segments: released.len(),
            bytes: released.iter().map(|r| r.2).sum(),
            allocations: times.len(),
        });
    }
    out
}

/// [`replay_ops_with`] for a trace whose recording began in state `start` (see
/// [`reconstruct_start`](super::start::reconstruct_start)): the blocks live then become the program's
/// first handles ([`ReplayProgram::initial`]), so the trace's frees of them are replayed.
pub fn replay_ops_from(
    trace: &DeviceTrace,
    options: &ReplayOptions,
    start: &StartState,
) -> (ReplayProgram, ReplayReport) {
    let entries = &trace.entries;
    let n = entries.len();

    // Reserved bytes before each entry, counted from the start of the trace, and their peak.
    let mut reserved_before = Vec::with_capacity(n);
    let mut reserved: i128 = i128::from(start.reserved_bytes());
    let mut peak: i128 = reserved;
    for e in entries {
        reserved_before.push(reserved);
        match e.action {
            Action::SegmentAlloc | Action::SegmentMap => reserved += i128::from(e.size),
            Action::SegmentFree | Action::SegmentUnmap => reserved -= i128::from(e.size),
            _ => {}
        }
        peak = peak.max(reserved);
    }

    struct Live {
        id: usize,
        requested: bool,
    }
    // Private pools (CUDA graphs, MemPool): the segments live at each point of the trace, by
    // address, with their private pool if the dump names one.
    let dumped = DumpedPools::new(entries, start);
    let inferred = infer_pool_releases(entries, start, &dumped);
    let mut segments: BTreeMap<u64, (u64, Option<usize>)> = BTreeMap::new();
    let mut start = start.clone();
    for s in &mut start.segments {
        let pool = dumped
            .of_start_segment(s.address, s.size)
            .or_else(|| inferred.segments.get(&(s.address, usize::MAX)).copied());
        if let Some(p) = pool {
            s.stream = private_stream(p, s.stream);
        }
        segments.insert(s.address, (s.size, pool));
    }
    let start = &start;
    let pool_of = |segments: &BTreeMap<u64, (u64, Option<usize>)>, addr: u64| {
        segments
            .range(..=addr)
            .next_back()
            .filter(|&(&a, &(size, _))| addr < a + size)
            .and_then(|(_, &(_, pool))| pool)
    };
    let mut live: HashMap<u64, Live> = HashMap::new();
    let mut program = ReplayProgram {
        start: start.clone(),
        inferred_pools: inferred.pools.clone(),
        ..ReplayProgram::default()
    };
    let mut report = ReplayReport::default();
    let mut next_id = 0usize;
    for (seg, block) in start.live_blocks() {
        let pending = block.state == BlockStatus::ActivePendingFree;
        live.insert(
            block.address,
            Live {
                id: next_id,
                requested: pending,
            },
        );
        program.initial.push(InitialHandle {
            id: next_id,
            address: block.address,
            requested: block.requested,
            stream: seg.stream,
            pending,
        });
        next_id += 1;
    }
    let mut pending_segment: Option<u64> = None;
    // Expandable segments (rule 19): the ranges live at this point of the trace, keyed by
    // (stream, small pool?), with their first address and the bytes mapped in them.
    let mut ranges: HashMap<(u64, bool), (u64, u64)> = HashMap::new();
    // The ranges held at the start (rule 18f), with their mapped bytes.
    for s in &start.segments {
        if let Some(base) = s.range {
            let small = s.pool == cachalot::snapshot::SegmentType::Small;
            ranges.entry((s.stream, small)).or_insert((base, 0)).1 += s.size;
        }
    }

    let mut i = 0;
    while i < n {
        let e = &entries[i];
        match e.action {
            Action::Alloc => {
                let id = next_id;
                next_id += 1;
                let stream = match pool_of(&segments, e.addr) {
                    Some(p) => private_stream(p, e.stream),
                    None => e.stream,
                };
                if live
                    .insert(
                        e.addr,
                        Live {
                            id,
                            requested: false,
                        },
                    )
                    .is_some()
                {
                    report.reused_live_addresses += 1;
                }
                if let Some(address) = pending_segment.take() {
                    program.segment_at.push((program.ops.len(), address));
                }
                program.ops.push(ReplayOp::Alloc {
                    id,
                    size: e.size,
                    stream,
                });
                program.op_entries.push(i);
                report.allocs += 1;
            }
            Action::FreeRequested => match live.get_mut(&e.addr) {
                Some(l) if !l.requested => {
                    l.requested = true;
                    program.ops.push(ReplayOp::FreeRequested { id: l.id });
                    program.op_entries.push(i);
                    report.frees_requested += 1;
                }
                _ => report.unmatched_frees += 1,
            },
            Action::FreeCompleted => match live.remove(&e.addr) {
                Some(l) => {
                    if !l.requested {
                        program.ops.push(ReplayOp::FreeRequested { id: l.id });
                        program.op_entries.push(i);
                        report.frees_requested += 1;
                    } else if program.ops.last() != Some(&ReplayOp::FreeRequested { id: l.id }) {
                        report.deferred_frees += 1;
                    }
                    program.ops.push(ReplayOp::FreeCompleted { id: l.id });
                    program.op_entries.push(i);
                    report.frees_completed += 1;
                }
                None => report.unmatched_frees += 1,
            },
            Action::SegmentAlloc => {
                program.segment_addresses.push(e.addr);
                pending_segment = Some(e.addr);
                let pool = dumped
                    .of_segment_alloc(e, i)
                    .or_else(|| inferred.segments.get(&(e.addr, i)).copied());
                segments.insert(e.addr, (e.size, pool));
            }
            Action::SegmentMap => {
                // The pool is the one of the allocation the map serves (the next `alloc` or
                // `oom`); the first map of a range is at the range's first address, which is
                // offered to the device for the operation that reserves it.
                let small = entries[i + 1..]
                    .iter()
                    .find(|x| matches!(x.action, Action::Alloc | Action::Oom))
                    .is_some_and(|x| x.size.max(1).div_ceil(512) * 512 <= SMALL_REQUEST);
                match ranges.get_mut(&(e.stream, small)) {
                    Some((_, mapped)) => *mapped += e.size,
                    None => {
                        ranges.insert((e.stream, small), (e.addr, e.size));
                        pending_segment = Some(e.addr);
                    }
                }
                report.ignored_entries += 1;
            }
            Action::Oom => {
                // The allocation PyTorch failed: replayed, it fails the same way (its own cache
                // release included), so it counts in `num_ooms` as PyTorch's did. Its recorded
                // size is already rounded, and rounding is idempotent.
                program.ops.push(ReplayOp::Alloc {
                    id: next_id,
                    size: e.size,
                    stream: e.stream,
                });
                program.op_entries.push(i);
                next_id += 1;
                report.failed_allocs += 1;
            }
            Action::SegmentFree | Action::SegmentUnmap => {
                // Under expandable segments the cache's release unmaps pages instead of
                // freeing segments (`segment_unmap`), mixed with `segment_free`s of the
                // segments that are not expandable.
                let mut end = i;
                while end < n
                    && matches!(
                        entries[end].action,
                        Action::SegmentFree | Action::SegmentUnmap
                    )
                {
                    if entries[end].action == Action::SegmentUnmap {
                        unmap_from_range(&mut ranges, &entries[end]);
                    } else {
                        segments.remove(&entries[end].addr);
                    }
                    end += 1;
                }
                let before_oom = entries.get(end).is_some_and(|e| e.action == Action::Oom);
                if let Some(&pool) = inferred.runs.get(&i) {
                    // A private pool's release: its free whole segments, stream by stream.
                    let mut streams: Vec<u64> = Vec::new();
                    for x in &entries[i..end] {
                        if !streams.contains(&x.stream) {
                            streams.push(x.stream);
                        }
                    }
                    for s in streams {
                        program.ops.push(ReplayOp::ReleaseStream {
                            stream: private_stream(pool, s),
                        });
                        program.op_entries.push(i);
                    }
                    report.pool_releases += 1;
                } else if before_oom
                    || is_internal_release(trace, i, end, &reserved_before, peak, options)
                {
                    report.internal_releases += 1;
                } else {
                    program.ops.push(ReplayOp::EmptyCache);
                    program.op_entries.push(i);
                    report.empty_caches += 1;
                }
                i = end;
                continue;
            }
            _ => report.ignored_entries += 1,
        }
        i += 1;
    }
    report.live_at_end = live.len();
    (program, report)
}

/// Takes an unmap out of the bytes mapped in the range of its stream that holds it (the one
/// with the highest first address at or below it); a range with nothing mapped left is gone
/// (rule 19e gives its address space back).
fn unmap_from_range(ranges: &mut HashMap<(u64, bool), (u64, u64)>, e: &TraceEntry) {
    let key = ranges
        .iter()
        .filter(|&(&(stream, _), &(base, _))| stream == e.stream && base <= e.addr)
        .max_by_key(|&(_, &(base, _))| base)
        .map(|(&k, _)| k);
    if let Some(k) = key
        && let Some((_, mapped)) = ranges.get_mut(&k)
    {
        *mapped = mapped.saturating_sub(e.size);
        if *mapped == 0 {
            ranges.remove(&k);
        }
    }
}

/// Whether the `segment_free` run `entries[start..end]` is the allocator's own release (see
/// [`replay_ops_with`]).
fn is_internal_release(
    trace: &DeviceTrace,
    start: usize,
    end: usize,
    reserved_before: &[i128],
    peak: i128,
    options: &ReplayOptions,
) -> bool {
    let entries = &trace.entries;
    // Under expandable segments (rule 19) the retry maps pages (one or more `segment_map`)
    // and then allocates; whether a released page could have served it is not asked (pages
    // are not blocks): the device being full decides — or, under cachalot's rule 20, a run of
    // unmaps alone is the allocation's reclaim.
    if entries
        .get(end)
        .is_some_and(|e| e.action == Action::SegmentMap)
    {
        let mut j = end;
        let mut mapped: i128 = 0;
        while let Some(m) = entries.get(j).filter(|m| m.action == Action::SegmentMap) {
            mapped += i128::from(m.size);
            j += 1;
        }
        let reclaim = options.reclaims
            && entries[start..end]
                .iter()
                .all(|e| e.action == Action::SegmentUnmap);
        return entries.get(j).is_some_and(|a| a.action == Action::Alloc)
            && (reclaim || reserved_before[start] + mapped > peak);
    }
    let (Some(seg), Some(alloc)) = (entries.get(end), entries.get(end + 1)) else {
        return false;
    };
    if seg.action != Action::SegmentAlloc || alloc.action != Action::Alloc {
        return false;
    }
    let inside = alloc.addr >= seg.addr && alloc.addr - seg.addr < seg.size;
    if !inside {
        return false;
    }
    let need = alloc.size.max(1).div_ceil(512).saturating_mul(512);
    let small = need <= SMALL_REQUEST;
    let servable = entries[start..end].iter().any(|freed| {
        let oversize_refused = options
            .max_split_size
            .is_some_and(|max| need < max && freed.size >= max);
        freed.stream == alloc.stream
            && (freed.size == SMALL_SEGMENT) == small
            && freed.size >= need
            && !oversize_refused
    });
    if servable {
        return false;
    }
    reserved_before[start] + i128::from(seg.size) > peak
}

/// What this crate adds to a [`Snapshot`]: where its recording began, and its replay programs.
pub trait SnapshotExt {
    /// The replay program of every device whose trace is not empty, as `(device, program)`,
    /// with [`ReplayOptions`] taken from the snapshot's allocator settings.
    ///
    /// Each program starts from the state reconstructed by [`SnapshotExt::start_of`], or from
    /// an empty allocator where that fails.
    fn replay_programs(&self) -> Vec<(usize, ReplayProgram)>;

    /// The allocator's state on `device` when recording began, reconstructed from the dumped
    /// segments by walking that device's trace backwards
    /// ([`reconstruct_start`](super::start::reconstruct_start)).
    fn start_of(&self, device: usize) -> Result<StartState, StartError>;
}

impl SnapshotExt for Snapshot {
    fn replay_programs(&self) -> Vec<(usize, ReplayProgram)> {
        let options = ReplayOptions::from_settings(self.allocator_settings.as_ref());
        self.traces
            .iter()
            .filter(|t| !t.entries.is_empty())
            .map(|t| {
                let start = self.start_of(t.device).unwrap_or_else(|_| StartState {
                    private_segments: super::start::private_segments(&self.segments, t.device),
                    ..StartState::default()
                });
                (t.device, replay_ops_from(t, &options, &start).0)
            })
            .collect()
    }

    fn start_of(&self, device: usize) -> Result<StartState, StartError> {
        let empty = DeviceTrace {
            device,
            entries: Vec::new(),
        };
        let trace = self.traces.get(device).unwrap_or(&empty);
        let divisions = self
            .allocator_settings
            .as_ref()
            .map(AllocatorSettings::divisions)
            .unwrap_or([0; 16]);
        // Rule 19's large-pool page as recorded (PyTorch's 20 MiB unless cachalot's own
        // `expandable_page_mb` says otherwise).
        let large_page = self
            .allocator_settings
            .as_ref()
            .and_then(|s| cachalot::Settings::pytorch().apply(&s.alloc_conf).ok())
            .map_or(cachalot::Settings::pytorch().expandable_page_size, |s| {
                s.expandable_page_size
            });
        reconstruct_start_paged(trace, &self.segments, &divisions, large_page)
    }
}

//! The invariant checker: every structural and statistical invariant of the core, recomputed
//! from scratch, and the typed answer when one is broken ([`InvariantViolation`]).
//!
//! The one rule: nothing here trusts an incremental counter; each is compared against a value
//! rebuilt from the blocks themselves. The checker reads the core through [`CoreParts`], a
//! read-only view the core hands it, so it depends on the blocks and not on the policy.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use rustc_hash::FxHashMap;

use crate::backend::{EventId, StreamId};
use crate::block::{Backing, BlockId, BlockPhase, FreeKey, Range, Slab, UnmappedKey};
use crate::free_set::FreeSet;
use crate::policy::alias::{NO_PAGE, PageTable};
use crate::policy::views::Views;
use crate::sizes::{MIN_BLOCK_SIZE, Pool, SMALL_BUFFER};
use crate::stats::{StatArray, Stats};

/// The first invariant found broken by [`crate::CachingCore::check_invariants`] or
/// [`crate::Allocator::check_invariants`]. Each variant names the block, segment, statistic or
/// thread cache at fault; its message is the one a test failure prints.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvariantViolation {
    /// A block's link to its previous neighbour does not point back at the block before it.
    #[error("block {address:#x}: prev link broken")]
    BrokenLink {
        /// The block's address.
        address: u64,
    },
    /// A block does not start where the block before it in its segment ends.
    #[error("block {address:#x}: segment has a gap or overlap at {expected:#x}")]
    GapOrOverlap {
        /// The block's address.
        address: u64,
        /// Where the previous block ends.
        expected: u64,
    },
    /// A block whose address or size is not a multiple of 512 (or smaller than 512).
    #[error("block {address:#x}+{size}: not 512-aligned")]
    Misaligned {
        /// The block's address.
        address: u64,
        /// Its size.
        size: u64,
    },
    /// A range, or an unmapped block, breaks rule 19's tiling.
    #[error("{address:#x}: {what} (rule 19, expandable segments)")]
    Range {
        /// The block or range.
        address: u64,
        /// What is wrong with it.
        what: &'static str,
    },
    /// A range's blocks do not cover it exactly.
    #[error("range {address:#x}: blocks cover {covered} of {size} bytes")]
    RangeCoverage {
        /// The range.
        address: u64,
        /// Bytes its blocks cover.
        covered: u64,
        /// Its size.
        size: u64,
    },
    /// Ranges and unmapped blocks do not match their indexes.
    #[error(
        "{ranges} ranges, {heads} tiled by blocks; {unmapped} unmapped blocks, {indexed} in the unmapped sets"
    )]
    RangeCount {
        /// Ranges the core holds.
        ranges: usize,
        /// Ranges with a head block.
        heads: usize,
        /// Unmapped blocks in the slab.
        unmapped: usize,
        /// Entries of the unmapped sets.
        indexed: usize,
    },
    /// A lent block (rule 22a) outside a range, in the wrong state or index, not page-aligned,
    /// next to another lent block, or present while page aliasing does not act.
    #[error("lent block {address:#x}: {what} (rule 22, page aliasing)")]
    LentBlock {
        /// The block's address.
        address: u64,
        /// What is wrong with it.
        what: &'static str,
    },
    /// A slot of a range whose entry in the page table is wrong for the block it lies in
    /// (rule 22a: a mapped or lent slot maps one page, an unmapped slot none), or a range
    /// without its page table.
    #[error("slot {address:#x}: {what} (rule 22, page aliasing)")]
    PageSlot {
        /// The slot's address.
        address: u64,
        /// What is wrong with it.
        what: &'static str,
    },
    /// A page without exactly one home in a mapped block, or whose recorded home is not that
    /// slot (rule 22a).
    #[error("page {page}: {homes} homes in mapped blocks, recorded at {recorded:#x}")]
    PageHomes {
        /// The allocator's page id.
        page: u32,
        /// Slots of mapped blocks that map it.
        homes: usize,
        /// The home the page table records.
        recorded: u64,
    },
    /// A page whose count of lent mappings differs from the lent slots that map it.
    #[error("page {page}: {counted} lent slots map it, the table says {recorded}")]
    PageLent {
        /// The allocator's page id.
        page: u32,
        /// Lent slots found mapping it.
        counted: u32,
        /// Its recorded count.
        recorded: u32,
    },
    /// A lent slot whose page's home lies in a range of another pool or stream (rule 22a).
    #[error("lent slot {address:#x}: its page's home is in a range of another pool or stream")]
    LentAcross {
        /// The lent slot's address.
        address: u64,
    },
    /// A slot whose busy count differs from the allocated and pending blocks overlapping it
    /// (rule 22b).
    #[error("slot {address:#x}: busy count {have}, {want} allocated or pending blocks over it")]
    BusyCount {
        /// The slot's address.
        address: u64,
        /// The count kept.
        have: u32,
        /// The count recomputed.
        want: u32,
    },
    /// A stitched view, a view's allocation, a held piece or one of rule 23's indexes that
    /// breaks rule 23j.
    #[error("{address:#x}: {what} (rule 23, stitched views)")]
    View {
        /// The view, block or slot at fault (0 for an index as a whole).
        address: u64,
        /// What is wrong with it.
        what: &'static str,
    },
    /// A block whose pool, stream or range is not its segment's.
    #[error("block {address:#x}: pool or stream differs from its segment")]
    SegmentMismatch {
        /// The block's address.
        address: u64,
    },
    /// A free block missing from its pool's free set, or present in the live map.
    #[error("free block {address:#x}: free-set membership wrong")]
    FreeSetMembership {
        /// The block's address.
        address: u64,
    },
    /// Two free blocks next to each other in a segment (rule 10 merges them).
    #[error("free block {address:#x}: unmerged free neighbour")]
    UnmergedFree {
        /// The address of the second of the two.
        address: u64,
    },
    /// An allocated block missing from the live map, or present in a free set.
    #[error("allocated block {address:#x}: index membership wrong")]
    AllocatedIndex {
        /// The block's address.
        address: u64,
    },
    /// A pending block present in the live map or a free set.
    #[error("pending block {address:#x}: index membership wrong")]
    PendingIndex {
        /// The block's address.
        address: u64,
    },
    /// A pending block whose count of outstanding events differs from the events queued for it.
    #[error("pending block {address:#x}: waits for {waits} events, {queued} queued")]
    PendingEvents {
        /// The block's address.
        address: u64,
        /// The events it waits for.
        waits: u32,
        /// The events queued for it.
        queued: u32,
    },
    /// A small-pool segment that is not 2 MiB.
    #[error("small segment {address:#x} is {size} bytes")]
    SmallSegmentSize {
        /// The segment's address.
        address: u64,
        /// Its size.
        size: u64,
    },
    /// Blocks in the slab that no segment reaches.
    #[error("{slab} blocks in the slab, {reachable} reachable from segment heads")]
    Unreachable {
        /// Blocks in the slab.
        slab: usize,
        /// Blocks reached from segment heads.
        reachable: usize,
    },
    /// The live map holds more entries than there are allocated blocks.
    #[error("live map holds blocks that are not allocated")]
    LiveMap,
    /// The free sets hold more entries than there are free blocks.
    #[error("free sets hold blocks that are not free")]
    FreeSets,
    /// Two segments share addresses.
    #[error("segments {first:#x} and {second:#x} overlap")]
    SegmentsOverlap {
        /// The lower segment's address.
        first: u64,
        /// The higher segment's address.
        second: u64,
    },
    /// A statistic's current values differ from the values recomputed from the blocks.
    #[error("{name}: counters say {have:?} (all, small, large), blocks add up to {want:?}")]
    Statistic {
        /// The statistic's name, as in [`Stats`].
        name: &'static str,
        /// Its current values: all, small pool, large pool.
        have: [i64; 3],
        /// The values the blocks add up to.
        want: [i64; 3],
    },
    /// `oversize_allocations` or `oversize_segments` differs from the blocks.
    #[error("oversize counters do not match the blocks")]
    Oversize,
    /// The reserved-bytes total differs from the sum of the segments.
    #[error("reserved is {reserved} but segments add up to {segments}")]
    Reserved {
        /// The core's total.
        reserved: u64,
        /// The segments' sum.
        segments: i64,
    },
    /// A thread cache keeps more blocks than `thread_cache_blocks` (rule 17).
    #[error("thread {thread} keeps {kept} blocks, more than {capacity}")]
    ThreadCacheOverfull {
        /// The thread's place in the registration order.
        thread: usize,
        /// Blocks it keeps.
        kept: usize,
        /// Its capacity.
        capacity: usize,
    },
    /// A thread holds (live or parked) a block that is not allocated in the core.
    #[error("thread {thread} holds {address:#x}, not allocated in the core")]
    ThreadHoldsUnallocated {
        /// The thread's place in the registration order.
        thread: usize,
        /// The block's address.
        address: u64,
    },
    /// A thread holds a block the front end's owner map gives to another thread, or knows
    /// otherwise (another stream, size or use).
    #[error("thread {thread} holds {address:#x}, owned by another or known otherwise")]
    ThreadHoldsOthers {
        /// The thread's place in the registration order.
        thread: usize,
        /// The block's address.
        address: u64,
    },
    /// A block both recent (live) and parked in one thread's cache.
    #[error("thread {thread} has {address:#x} both live and parked")]
    LiveAndParked {
        /// The thread's place in the registration order.
        thread: usize,
        /// The block's address.
        address: u64,
    },
    /// The front end's owner map holds blocks of threads that are not registered.
    #[error("{owned} owned blocks, {held} held by registered threads")]
    OwnerCount {
        /// Entries in the owner map.
        owned: usize,
        /// Blocks the threads hold.
        held: usize,
    },
}

/// Read-only access to the core's structures, for the checker.
pub(crate) struct CoreParts<'a> {
    pub blocks: &'a Slab,
    pub free: &'a [FreeSet; 2],
    pub unmapped: &'a [BTreeSet<UnmappedKey>; 2],
    pub lent: &'a [BTreeSet<FreeKey>; 2],
    pub lent_at: &'a [BTreeSet<UnmappedKey>; 2],
    pub pages: Option<&'a PageTable>,
    pub views: Option<&'a Views>,
    pub ranges: &'a BTreeMap<u64, Range>,
    pub live: &'a FxHashMap<u64, BlockId>,
    pub events: &'a BTreeMap<StreamId, VecDeque<(EventId, BlockId)>>,
    pub stats: &'a Stats,
    pub reserved: u64,
    pub max_split: u64,
}

#[derive(Default)]
struct Tally {
    allocation: [i64; 2],
    allocated_bytes: [i64; 2],
    active: [i64; 2],
    active_bytes: [i64; 2],
    requested: [i64; 2],
    segment: [i64; 2],
    reserved: [i64; 2],
    inactive_split: [i64; 2],
    inactive_split_bytes: [i64; 2],
    oversize_allocations: i64,
    oversize_segments: i64,
}

fn check_array(
    name: &'static str,
    stat: &StatArray,
    per_pool: [i64; 2],
) -> Result<(), InvariantViolation> {
    let want = [per_pool[0] + per_pool[1], per_pool[0], per_pool[1]];
    let have = [
        stat.all.current,
        stat.small_pool.current,
        stat.large_pool.current,
    ];
    if want != have {
        return Err(InvariantViolation::Statistic { name, have, want });
    }
    Ok(())
}

/// Checks every invariant of the core whose structures `parts` shows.
pub(crate) fn check(parts: CoreParts<'_>) -> Result<(), InvariantViolation> {
    let blocks = parts.blocks;
    let mut t = Tally::default();
    let mut seen = 0usize;
    let mut segments: Vec<(u64, u64)> = Vec::new();
    let mut pending_events: HashMap<BlockId, u32> = HashMap::new();
    for q in parts.events.values() {
        for &(_, id) in q {
            *pending_events.entry(id).or_default() += 1;
        }
    }
    // Rule 23d: a view's allocation is a block of no segment; it counts like any allocation.
    for (id, b) in blocks.iter().filter(|(_, b)| b.backing == Backing::View) {
        let p = b.pool.index();
        seen += 1;
        let view = |what| InvariantViolation::View {
            address: b.address,
            what,
        };
        let in_free = parts.free[p].contains(&(b.stream, b.size, b.address, id));
        let in_live = parts.live.get(&b.address) == Some(&id);
        if b.prev.is_some() || b.next.is_some() || b.range.is_some() || b.pool != Pool::Large {
            return Err(view(
                "a view allocation with neighbours, a range or the small pool",
            ));
        }
        if parts
            .views
            .is_none_or(|v| !v.by_allocation.contains_key(&id))
        {
            return Err(view("a view allocation of no view in use"));
        }
        match b.state {
            BlockPhase::Allocated if in_live && !in_free => {
                t.allocation[p] += 1;
                t.allocated_bytes[p] += b.size as i64;
                if b.size >= parts.max_split {
                    t.oversize_allocations += 1;
                }
            }
            BlockPhase::Pending if !in_live && !in_free => {
                let queued = pending_events.get(&id).copied().unwrap_or(0);
                if queued == 0 || queued != b.event_count {
                    return Err(InvariantViolation::PendingEvents {
                        address: b.address,
                        waits: b.event_count,
                        queued,
                    });
                }
            }
            _ => return Err(view("a view allocation in the wrong state or index")),
        }
        t.active[p] += 1;
        t.active_bytes[p] += b.size as i64;
        t.requested[p] += b.requested as i64;
    }
    let mut held: Vec<BlockId> = Vec::new();
    for (head, hb) in blocks
        .iter()
        .filter(|(_, b)| b.prev.is_none() && b.backing != Backing::View)
    {
        let p = hb.pool.index();
        let (start, mut end) = (hb.address, hb.address);
        let mut cur = Some(head);
        let mut prev: Option<BlockId> = None;
        let mut prev_free = false;
        let mut prev_unmapped = false;
        let mut prev_lent = false;
        let mut mapped_bytes = 0u64;
        let split = hb.next.is_some();
        let range = hb.range.map(|base| (base, parts.ranges.get(&base)));
        if let Some((base, r)) = range
            && (r.is_none() || base != hb.address)
        {
            {
                return Err(InvariantViolation::Range {
                    address: base,
                    what: "not a range, or its head is elsewhere",
                });
            }
        }
        while let Some(id) = cur {
            let b = blocks.get(id);
            seen += 1;
            if b.prev != prev {
                return Err(InvariantViolation::BrokenLink { address: b.address });
            }
            if b.address != end {
                return Err(InvariantViolation::GapOrOverlap {
                    address: b.address,
                    expected: end,
                });
            }
            if !b.address.is_multiple_of(MIN_BLOCK_SIZE)
                || b.size < MIN_BLOCK_SIZE
                || !b.size.is_multiple_of(MIN_BLOCK_SIZE)
            {
                return Err(InvariantViolation::Misaligned {
                    address: b.address,
                    size: b.size,
                });
            }
            if b.pool != hb.pool || b.stream != hb.stream || b.range != hb.range {
                return Err(InvariantViolation::SegmentMismatch { address: b.address });
            }
            let in_free = parts.free[p].contains(&(b.stream, b.size, b.address, id));
            let in_live = parts.live.get(&b.address) == Some(&id);
            let in_unmapped = parts.unmapped[p].contains(&(b.stream, b.address, id));
            let in_lent = parts.lent[p].contains(&(b.stream, b.size, b.address, id));
            let in_lent_at = parts.lent_at[p].contains(&(b.stream, b.address, id));
            if b.backing == Backing::Lent {
                // Rule 22a: a lent block is free, page-aligned at both ends, in the lent sets
                // only, never next to another lent block, and exists only while aliasing acts.
                let lent = |what| InvariantViolation::LentBlock {
                    address: b.address,
                    what,
                };
                let Some((base, Some(r))) = range else {
                    return Err(lent("outside a range"));
                };
                if parts.pages.is_none() {
                    return Err(lent("while page aliasing does not act"));
                }
                if b.state != BlockPhase::Free
                    || in_free
                    || in_live
                    || in_unmapped
                    || !in_lent
                    || !in_lent_at
                {
                    return Err(lent("in the wrong state or index"));
                }
                if !(b.address - base).is_multiple_of(r.page) || !b.size.is_multiple_of(r.page) {
                    return Err(lent("not page-aligned"));
                }
                if prev_lent {
                    return Err(lent("unmerged lent neighbour"));
                }
                prev_lent = true;
                prev_unmapped = false;
                prev_free = false;
                end = b.address + b.size;
                prev = Some(id);
                cur = b.next;
                continue;
            }
            prev_lent = false;
            if in_lent || in_lent_at {
                return Err(InvariantViolation::LentBlock {
                    address: b.address,
                    what: "a block that is not lent in the lent sets",
                });
            }
            if b.backing == Backing::Unmapped {
                // Rule 19: an unmapped block is free, page-aligned at both ends, in the
                // unmapped set only, and never next to another unmapped block.
                let Some((base, Some(r))) = range else {
                    return Err(InvariantViolation::Range {
                        address: b.address,
                        what: "unmapped outside a range",
                    });
                };
                if b.state != BlockPhase::Free || in_free || in_live || !in_unmapped {
                    return Err(InvariantViolation::Range {
                        address: b.address,
                        what: "unmapped block in the wrong state or index",
                    });
                }
                if !(b.address - base).is_multiple_of(r.page) || !b.size.is_multiple_of(r.page) {
                    return Err(InvariantViolation::Range {
                        address: b.address,
                        what: "unmapped block not page-aligned",
                    });
                }
                if prev_unmapped {
                    return Err(InvariantViolation::Range {
                        address: b.address,
                        what: "unmerged unmapped neighbour",
                    });
                }
                prev_unmapped = true;
                prev_free = false;
                end = b.address + b.size;
                prev = Some(id);
                cur = b.next;
                continue;
            }
            if in_unmapped {
                return Err(InvariantViolation::Range {
                    address: b.address,
                    what: "mapped block in the unmapped set",
                });
            }
            mapped_bytes += b.size;
            prev_unmapped = false;
            match b.state {
                BlockPhase::Free => {
                    if !in_free || in_live {
                        return Err(InvariantViolation::FreeSetMembership { address: b.address });
                    }
                    if prev_free {
                        return Err(InvariantViolation::UnmergedFree { address: b.address });
                    }
                    if split && range.is_none() {
                        t.inactive_split[p] += 1;
                        t.inactive_split_bytes[p] += b.size as i64;
                    }
                }
                BlockPhase::Allocated => {
                    if in_free || !in_live {
                        return Err(InvariantViolation::AllocatedIndex { address: b.address });
                    }
                    t.allocation[p] += 1;
                    t.allocated_bytes[p] += b.size as i64;
                    if b.size >= parts.max_split {
                        t.oversize_allocations += 1;
                    }
                }
                BlockPhase::Held => {
                    // Rule 23b: a held piece is a block of a range in no index, counted in no
                    // statistic of its own.
                    if in_free || in_live || range.is_none() || parts.views.is_none() {
                        return Err(InvariantViolation::View {
                            address: b.address,
                            what: "a held piece outside a range, or in an index",
                        });
                    }
                    held.push(id);
                }
                BlockPhase::Pending => {
                    if in_free || in_live {
                        return Err(InvariantViolation::PendingIndex { address: b.address });
                    }
                    let queued = pending_events.get(&id).copied().unwrap_or(0);
                    if queued == 0 || queued != b.event_count {
                        return Err(InvariantViolation::PendingEvents {
                            address: b.address,
                            waits: b.event_count,
                            queued,
                        });
                    }
                }
            }
            if matches!(b.state, BlockPhase::Allocated | BlockPhase::Pending) {
                t.active[p] += 1;
                t.active_bytes[p] += b.size as i64;
                t.requested[p] += b.requested as i64;
            }
            prev_free = b.state == BlockPhase::Free;
            end = b.address + b.size;
            prev = Some(id);
            cur = b.next;
        }
        let size = end - start;
        if let Some((_, Some(r))) = range {
            if size != r.size {
                return Err(InvariantViolation::RangeCoverage {
                    address: start,
                    covered: size,
                    size: r.size,
                });
            }
            t.reserved[p] += mapped_bytes as i64;
            segments.push((start, size));
            continue;
        }
        if hb.pool == Pool::Small && size != SMALL_BUFFER {
            return Err(InvariantViolation::SmallSegmentSize {
                address: start,
                size,
            });
        }
        t.segment[p] += 1;
        t.reserved[p] += size as i64;
        if size >= parts.max_split {
            t.oversize_segments += 1;
        }
        segments.push((start, size));
    }
    if seen != blocks.len() {
        return Err(InvariantViolation::Unreachable {
            slab: blocks.len(),
            reachable: seen,
        });
    }
    if parts.live.len() as i64 != t.allocation[0] + t.allocation[1] {
        return Err(InvariantViolation::LiveMap);
    }
    if parts.free[0].len() + parts.free[1].len()
        != blocks.iter().filter(|(_, b)| b.free_mapped()).count()
    {
        return Err(InvariantViolation::FreeSets);
    }
    let unmapped = blocks
        .iter()
        .filter(|(_, b)| b.backing == Backing::Unmapped)
        .count();
    let indexed = parts.unmapped[0].len() + parts.unmapped[1].len();
    let heads = blocks
        .iter()
        .filter(|(_, b)| b.prev.is_none() && b.range.is_some())
        .count();
    if unmapped != indexed || heads != parts.ranges.len() {
        return Err(InvariantViolation::RangeCount {
            ranges: parts.ranges.len(),
            heads,
            unmapped,
            indexed,
        });
    }
    let lent = blocks
        .iter()
        .filter(|(_, b)| b.backing == Backing::Lent)
        .count();
    if lent != parts.lent[0].len() + parts.lent[1].len()
        || lent != parts.lent_at[0].len() + parts.lent_at[1].len()
    {
        return Err(InvariantViolation::LentBlock {
            address: 0,
            what: "the lent sets hold blocks that are not lent",
        });
    }
    if let Some(table) = parts.pages {
        check_pages(&parts, table)?;
    }
    if let Some(views) = parts.views {
        check_views(&parts, views, &mut held)?;
    }
    segments.sort_unstable();
    for w in segments.windows(2) {
        if w[0].0 + w[0].1 > w[1].0 {
            return Err(InvariantViolation::SegmentsOverlap {
                first: w[0].0,
                second: w[1].0,
            });
        }
    }
    let s = parts.stats;
    check_array("allocation", &s.allocation, t.allocation)?;
    check_array("allocated_bytes", &s.allocated_bytes, t.allocated_bytes)?;
    check_array("active", &s.active, t.active)?;
    check_array("active_bytes", &s.active_bytes, t.active_bytes)?;
    check_array("requested_bytes", &s.requested_bytes, t.requested)?;
    check_array("segment", &s.segment, t.segment)?;
    check_array("reserved_bytes", &s.reserved_bytes, t.reserved)?;
    check_array("inactive_split", &s.inactive_split, t.inactive_split)?;
    check_array(
        "inactive_split_bytes",
        &s.inactive_split_bytes,
        t.inactive_split_bytes,
    )?;
    if s.oversize_allocations.current != t.oversize_allocations
        || s.oversize_segments.current != t.oversize_segments
    {
        return Err(InvariantViolation::Oversize);
    }
    if parts.reserved as i64 != t.reserved[0] + t.reserved[1] {
        return Err(InvariantViolation::Reserved {
            reserved: parts.reserved,
            segments: t.reserved[0] + t.reserved[1],
        });
    }
    Ok(())
}

/// Rule 22i, recomputed from the blocks: every mapped slot maps one page; every page has
/// exactly one home, in a mapped block, where the table says; every other slot mapping it is
/// in a lent block of a range of the same pool and stream, as many as the table counts; each
/// slot's busy count is the number of allocated and pending blocks over it. So no page lies
/// under two live blocks, whatever addresses map it.
fn check_pages(parts: &CoreParts<'_>, table: &PageTable) -> Result<(), InvariantViolation> {
    let blocks = parts.blocks;
    let slot_err =
        |address: u64, what: &'static str| InvariantViolation::PageSlot { address, what };
    if table.ranges.len() != parts.ranges.len() {
        return Err(slot_err(
            0,
            "the page table's ranges are not the allocator's",
        ));
    }
    // Per range: its pool and stream (from its head block).
    let owner: HashMap<u64, (Pool, StreamId)> = blocks
        .iter()
        .filter(|(_, b)| b.prev.is_none())
        .filter_map(|(_, b)| b.range.map(|base| (base, (b.pool, b.stream))))
        .collect();
    let mut homes: HashMap<u32, Vec<u64>> = HashMap::new();
    let mut lent: HashMap<u32, Vec<(u64, u64)>> = HashMap::new();
    let mut busy: HashMap<u64, Vec<u32>> = HashMap::new();
    for (&base, range) in parts.ranges {
        let Some(pages) = table.ranges.get(&base) else {
            return Err(slot_err(base, "a range without its page table"));
        };
        let slots = (range.size / range.page) as usize;
        if pages.page != range.page
            || pages.slots.len() > slots
            || pages.busy.len() != pages.slots.len()
        {
            return Err(slot_err(base, "the range's page table has the wrong shape"));
        }
        busy.insert(base, vec![0; pages.slots.len()]);
    }
    for (_, b) in blocks.iter() {
        let Some(base) = b.range else { continue };
        let pages = &table.ranges[&base];
        let page = pages.page;
        let first = ((b.address - base) / page) as usize;
        let last = ((b.address + b.size - 1 - base) / page) as usize;
        if b.state != BlockPhase::Free {
            let counts = busy.get_mut(&base).expect("filled above");
            for i in first..=last {
                match counts.get_mut(i) {
                    Some(c) => *c += 1,
                    None => return Err(slot_err(base + i as u64 * page, "live but unmapped")),
                }
            }
        }
        for i in first..=last {
            let slot = base + i as u64 * page;
            let id = pages.page_of(i);
            match b.backing {
                Backing::Unmapped if id != NO_PAGE => {
                    return Err(slot_err(slot, "an unmapped slot maps a page"));
                }
                Backing::Unmapped => {}
                _ if id == NO_PAGE || table.pages.get(id as usize).is_none_or(|p| p.is_none()) => {
                    return Err(slot_err(slot, "a mapped or lent slot maps no page"));
                }
                Backing::Mapped => {
                    let seen = homes.entry(id).or_default();
                    // A slot holds several small blocks: count each slot once.
                    if seen.last() != Some(&slot) {
                        seen.push(slot);
                    }
                }
                Backing::Lent => lent.entry(id).or_default().push((slot, base)),
                Backing::View => return Err(slot_err(slot, "a view allocation in a range")),
            }
        }
    }
    for (id, info) in table.pages.iter().enumerate() {
        let Some(info) = info else { continue };
        let id = id as u32;
        let found = homes.get(&id).map_or(&[][..], Vec::as_slice);
        if found != [info.home] || !parts.ranges.contains_key(&info.home_range) {
            return Err(InvariantViolation::PageHomes {
                page: id,
                homes: found.len(),
                recorded: info.home,
            });
        }
        let found = lent.get(&id).map_or(&[][..], Vec::as_slice);
        if found.len() as u32 != info.lent {
            return Err(InvariantViolation::PageLent {
                page: id,
                counted: found.len() as u32,
                recorded: info.lent,
            });
        }
        for &(slot, base) in found {
            if owner.get(&base) != owner.get(&info.home_range) {
                return Err(InvariantViolation::LentAcross { address: slot });
            }
        }
    }
    for (base, want) in &busy {
        let pages = &table.ranges[base];
        for (i, (&have, &want)) in pages.busy.iter().zip(want).enumerate() {
            if have != want {
                return Err(InvariantViolation::BusyCount {
                    address: base + i as u64 * pages.page,
                    have,
                    want,
                });
            }
        }
    }
    Ok(())
}

/// Rule 23j, recomputed from the blocks: every view's slots map distinct pages whose homes are
/// slots of mapped blocks of ranges of its stream (the large pool's, or the small pool's with
/// the same page); a view in use holds exactly the pieces of rule 23b, a free view none; every
/// held piece belongs to exactly one view in use; the views' bytes are their sum and within
/// the cap; and every index of rule 23 holds exactly what it should.
fn check_views(
    parts: &CoreParts<'_>,
    views: &Views,
    held: &mut [BlockId],
) -> Result<(), InvariantViolation> {
    let blocks = parts.blocks;
    let err = |address: u64, what: &'static str| InvariantViolation::View { address, what };
    let page = views.page;
    // The blocks of ranges by address, and each range's pool and stream.
    let mut at: BTreeMap<u64, BlockId> = BTreeMap::new();
    let mut owner: HashMap<u64, (Pool, StreamId)> = HashMap::new();
    for (id, b) in blocks.iter() {
        if let Some(base) = b.range {
            at.insert(b.address, id);
            if b.prev.is_none() {
                owner.insert(base, (b.pool, b.stream));
            }
        }
    }
    let mut bytes = 0u64;
    let mut homes_total = 0usize;
    let mut pieces: Vec<BlockId> = Vec::new();
    for (&seq, view) in &views.views {
        let n = view.homes.len();
        if n == 0 {
            return Err(err(view.address, "a view of no slot"));
        }
        bytes += n as u64 * page;
        homes_total += n;
        let mut distinct: Vec<u64> = view.homes.iter().map(|h| h.1).collect();
        distinct.sort_unstable();
        if distinct.windows(2).any(|w| w[0] == w[1]) {
            return Err(err(view.address, "a view maps one home twice"));
        }
        let mut foreign: Vec<StreamId> = Vec::new();
        for &(base, home) in &view.homes {
            let Some(range) = parts.ranges.get(&base) else {
                return Err(err(home, "a view's home in no range"));
            };
            let (pool, stream) = owner
                .get(&base)
                .copied()
                .unwrap_or((Pool::Small, view.stream));
            // Rule 23k: a range of any stream; the others are the view's foreign streams.
            if stream != view.stream {
                foreign.push(stream);
            }
            if range.page != page
                || (pool == Pool::Small && range.page != SMALL_BUFFER)
                || home < base
                || !(home - base).is_multiple_of(page)
                || home + page > base + range.size
            {
                return Err(err(home, "a view's home is not a slot of a range"));
            }
            // Every block over the home slot is mapped (its own memory).
            let mut cur = at.range(..=home).next_back().map(|(_, &id)| id);
            while let Some(id) = cur {
                let b = blocks.get(id);
                if b.address >= home + page {
                    break;
                }
                if !b.mapped() {
                    return Err(err(home, "a view's home slot is not mapped"));
                }
                cur = b.next;
            }
            if !views.by_home.contains(&(home, seq)) {
                return Err(err(home, "a view's home missing from the home index"));
            }
        }
        foreign.sort_unstable();
        foreign.dedup();
        if foreign != view.foreign {
            return Err(err(
                view.address,
                "a view's foreign streams are not its homes' (rule 23k)",
            ));
        }
        let in_free_index = views.free_by_size.contains(&(view.stream, n as u64, seq))
            && views.lru.contains(&(view.stamp, seq));
        match &view.in_use {
            None => {
                if !in_free_index {
                    return Err(err(
                        view.address,
                        "a free view missing from the free indexes",
                    ));
                }
            }
            Some(u) => {
                if in_free_index || views.by_allocation.get(&u.allocation) != Some(&seq) {
                    return Err(err(view.address, "a view in use indexed wrongly"));
                }
                let a = blocks.get(u.allocation);
                let r = a.size;
                if a.backing != Backing::View
                    || a.address != view.address
                    || a.stream != view.stream
                    || r.div_ceil(page) != n as u64
                {
                    return Err(err(
                        view.address,
                        "a view in use and its allocation disagree",
                    ));
                }
                // Rule 23b: one held piece per maximal run of slots whose homes are
                // consecutive in one range; the held bytes are the first `r` of the slots.
                let mut want: Vec<(u64, u64)> = Vec::new();
                for (i, &(base, home)) in view.homes.iter().enumerate() {
                    let bytes = if i + 1 < n {
                        page
                    } else {
                        r - (n as u64 - 1) * page
                    };
                    let joins = i > 0 && {
                        let (pb, ph) = view.homes[i - 1];
                        pb == base && ph + page == home
                    };
                    match want.last_mut() {
                        Some(last) if joins => last.1 += bytes,
                        _ => want.push((home, bytes)),
                    }
                }
                if u.pieces.len() != want.len() || view.runs.len() != want.len() {
                    return Err(err(view.address, "a view in use holds the wrong pieces"));
                }
                for (&pid, &(home, bytes)) in u.pieces.iter().zip(&want) {
                    let b = blocks.get(pid);
                    if b.state != BlockPhase::Held || b.address != home || b.size != bytes {
                        return Err(err(home, "a view in use does not hold its piece"));
                    }
                    pieces.push(pid);
                }
            }
        }
    }
    if bytes != views.bytes || (bytes > 0 && bytes > views.cap) {
        return Err(err(
            0,
            "the views' bytes are not their sum, or pass the cap",
        ));
    }
    // The home slots by range: per slot, the views mapping it, and its bit.
    let mut counts: std::collections::BTreeMap<(u64, usize), u32> = Default::default();
    for view in views.views.values() {
        for &(base, home) in &view.homes {
            *counts
                .entry((base, ((home - base) / page) as usize))
                .or_default() += 1;
        }
    }
    let slots_listed: usize = views
        .home_slots
        .values()
        .map(|h| h.counts.iter().filter(|&&c| c > 0).count())
        .sum();
    let slots_agree = slots_listed == counts.len()
        && counts.iter().all(|(&(base, i), &n)| {
            views.home_slots.get(&base).is_some_and(|h| {
                h.counts.get(i) == Some(&n)
                    && h.bits.get(i / 64).is_some_and(|w| w >> (i % 64) & 1 == 1)
            })
        })
        && views.home_slots.values().all(|h| {
            !h.is_empty()
                && h.total == h.counts.iter().map(|&c| u64::from(c)).sum::<u64>()
                && h.bits
                    .iter()
                    .map(|w| w.count_ones() as usize)
                    .sum::<usize>()
                    == h.counts.iter().filter(|&&c| c > 0).count()
        });
    if views.by_home.len() != homes_total
        || !slots_agree
        || views.free_by_size.len() + views.by_allocation.len() != views.views.len()
        || views.lru.len() != views.free_by_size.len()
    {
        return Err(err(0, "rule 23's indexes hold views that are not there"));
    }
    pieces.sort_unstable();
    held.sort_unstable();
    if pieces.windows(2).any(|w| w[0] == w[1]) || pieces != held {
        return Err(err(
            0,
            "held pieces and the views in use do not match one to one",
        ));
    }
    // The address index keeps every free block that holds a view's home (where a piece can
    // lie) under its end address, and nothing but free blocks of the free sets (a deferred
    // removal's entry aside); a block is marked indexed exactly when it is listed.
    let in_free_set = |id: BlockId, end: u64| {
        blocks.try_get(id).is_some_and(|b| {
            b.address + b.size == end
                && parts.free[b.pool.index()].contains(&(b.stream, b.size, b.address, id))
        })
    };
    let listed = |end: u64, id: BlockId| {
        views.free_at.get(end) == Some(id) && views.deferred != Some((end, id))
    };
    let marked = |id: BlockId| views.indexed.get(id as usize).copied().unwrap_or(false);
    let missing = parts.free[0]
        .iter()
        .chain(parts.free[1].iter())
        .any(|(_, size, address, id)| {
            views
                .by_home
                .range((address, 0)..(address + size, 0))
                .next()
                .is_some()
                && !listed(address + size, id)
        });
    let mut live_entries = 0usize;
    let stray = views.indexed_blocks().any(|(end, id)| {
        live_entries += 1;
        !in_free_set(id, end) || !marked(id)
    });
    let marks = views.indexed.iter().filter(|&&m| m).count();
    if missing || stray || marks != live_entries {
        return Err(err(
            0,
            "the free blocks' address index is not the free sets",
        ));
    }
    Ok(())
}

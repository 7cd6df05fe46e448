//! The invariant checker: every structural and statistical invariant of the core, recomputed
//! from scratch.
//!
//! The one rule: nothing here trusts an incremental counter; each is compared against a value
//! rebuilt from the blocks themselves.

use std::collections::HashMap;

use crate::backend::Backend;
use crate::block::{BlockId, BlockState};
use crate::policy::CachingCore;
use crate::sizes::{MIN_BLOCK_SIZE, Pool, SMALL_BUFFER};
use crate::stats::StatArray;

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

fn check_array(name: &str, stat: &StatArray, per_pool: [i64; 2]) -> Result<(), String> {
    let want = [per_pool[0] + per_pool[1], per_pool[0], per_pool[1]];
    let have = [
        stat.all.current,
        stat.small_pool.current,
        stat.large_pool.current,
    ];
    if want != have {
        return Err(format!(
            "{name}: counters say {have:?} (all, small, large), blocks add up to {want:?}"
        ));
    }
    Ok(())
}

pub(crate) fn check<B: Backend>(core: &CachingCore<B>) -> Result<(), String> {
    let parts = core.parts();
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
    for (head, hb) in blocks.iter().filter(|(_, b)| b.prev.is_none()) {
        let p = hb.pool.index();
        let (start, mut end) = (hb.address, hb.address);
        let mut cur = Some(head);
        let mut prev: Option<BlockId> = None;
        let mut prev_free = false;
        let mut prev_unmapped = false;
        let mut mapped_bytes = 0u64;
        let split = hb.next.is_some();
        let range = hb.range.map(|base| (base, parts.ranges.get(&base)));
        if let Some((base, r)) = range {
            if r.is_none() || base != hb.address {
                return Err(format!(
                    "range {base:#x}: not a range, or its head is elsewhere"
                ));
            }
        }
        while let Some(id) = cur {
            let b = blocks.get(id);
            seen += 1;
            if b.prev != prev {
                return Err(format!("block {:#x}: prev link broken", b.address));
            }
            if b.address != end {
                return Err(format!(
                    "block {:#x}: segment has a gap or overlap at {end:#x}",
                    b.address
                ));
            }
            if !b.address.is_multiple_of(MIN_BLOCK_SIZE)
                || b.size < MIN_BLOCK_SIZE
                || !b.size.is_multiple_of(MIN_BLOCK_SIZE)
            {
                return Err(format!(
                    "block {:#x}+{}: not 512-aligned",
                    b.address, b.size
                ));
            }
            if b.pool != hb.pool || b.stream != hb.stream || b.range != hb.range {
                return Err(format!(
                    "block {:#x}: pool or stream differs from its segment",
                    b.address
                ));
            }
            let in_free = parts.free[p].contains(&(b.stream, b.size, b.address, id));
            let in_live = parts.live.get(&b.address) == Some(&id);
            let in_unmapped = parts.unmapped[p].contains(&(b.stream, b.address, id));
            if !b.mapped {
                // Rule 19: an unmapped block is free, page-aligned at both ends, in the
                // unmapped set only, and never next to another unmapped block.
                let Some((base, Some(r))) = range else {
                    return Err(format!("block {:#x}: unmapped outside a range", b.address));
                };
                if b.state != BlockState::Free || in_free || in_live || !in_unmapped {
                    return Err(format!(
                        "unmapped block {:#x}: state or index wrong",
                        b.address
                    ));
                }
                if !(b.address - base).is_multiple_of(r.page) || !b.size.is_multiple_of(r.page) {
                    return Err(format!("unmapped block {:#x}: not page-aligned", b.address));
                }
                if prev_unmapped {
                    return Err(format!(
                        "unmapped block {:#x}: unmerged unmapped neighbour",
                        b.address
                    ));
                }
                prev_unmapped = true;
                prev_free = false;
                end = b.address + b.size;
                prev = Some(id);
                cur = b.next;
                continue;
            }
            if in_unmapped {
                return Err(format!(
                    "mapped block {:#x}: in the unmapped set",
                    b.address
                ));
            }
            mapped_bytes += b.size;
            prev_unmapped = false;
            match b.state {
                BlockState::Free => {
                    if !in_free || in_live {
                        return Err(format!(
                            "free block {:#x}: free-set membership wrong",
                            b.address
                        ));
                    }
                    if prev_free {
                        return Err(format!(
                            "free block {:#x}: unmerged free neighbour",
                            b.address
                        ));
                    }
                    if split && range.is_none() {
                        t.inactive_split[p] += 1;
                        t.inactive_split_bytes[p] += b.size as i64;
                    }
                }
                BlockState::Allocated => {
                    if in_free || !in_live {
                        return Err(format!(
                            "allocated block {:#x}: index membership wrong",
                            b.address
                        ));
                    }
                    t.allocation[p] += 1;
                    t.allocated_bytes[p] += b.size as i64;
                    if b.size >= parts.max_split {
                        t.oversize_allocations += 1;
                    }
                }
                BlockState::Pending => {
                    if in_free || in_live {
                        return Err(format!(
                            "pending block {:#x}: index membership wrong",
                            b.address
                        ));
                    }
                    let queued = pending_events.get(&id).copied().unwrap_or(0);
                    if queued == 0 || queued != b.event_count {
                        return Err(format!(
                            "pending block {:#x}: waits for {} events, {queued} queued",
                            b.address, b.event_count
                        ));
                    }
                }
            }
            if b.state != BlockState::Free {
                t.active[p] += 1;
                t.active_bytes[p] += b.size as i64;
                t.requested[p] += b.requested as i64;
            }
            prev_free = b.state == BlockState::Free;
            end = b.address + b.size;
            prev = Some(id);
            cur = b.next;
        }
        let size = end - start;
        if let Some((_, Some(r))) = range {
            if size != r.size {
                return Err(format!(
                    "range {start:#x}: blocks cover {size} of {} bytes",
                    r.size
                ));
            }
            t.reserved[p] += mapped_bytes as i64;
            segments.push((start, size));
            continue;
        }
        if hb.pool == Pool::Small && size != SMALL_BUFFER {
            return Err(format!("small segment {start:#x} is {size} bytes"));
        }
        t.segment[p] += 1;
        t.reserved[p] += size as i64;
        if size >= parts.max_split {
            t.oversize_segments += 1;
        }
        segments.push((start, size));
    }
    if seen != blocks.len() {
        return Err(format!(
            "{} blocks in the slab, {seen} reachable from segment heads",
            blocks.len()
        ));
    }
    if parts.live.len() as i64 != t.allocation[0] + t.allocation[1] {
        return Err("live map holds blocks that are not allocated".into());
    }
    if parts.free[0].len() + parts.free[1].len()
        != blocks
            .iter()
            .filter(|(_, b)| b.state == BlockState::Free && b.mapped)
            .count()
    {
        return Err("free sets hold blocks that are not free".into());
    }
    if parts.unmapped[0].len() + parts.unmapped[1].len()
        != blocks.iter().filter(|(_, b)| !b.mapped).count()
    {
        return Err("unmapped sets hold blocks that are not unmapped".into());
    }
    let heads = blocks
        .iter()
        .filter(|(_, b)| b.prev.is_none() && b.range.is_some())
        .count();
    if heads != parts.ranges.len() {
        return Err(format!(
            "{} ranges, {heads} tiled by blocks",
            parts.ranges.len()
        ));
    }
    segments.sort_unstable();
    for w in segments.windows(2) {
        if w[0].0 + w[0].1 > w[1].0 {
            return Err(format!("segments {:#x} and {:#x} overlap", w[0].0, w[1].0));
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
        return Err("oversize counters do not match the blocks".into());
    }
    if parts.reserved as i64 != t.reserved[0] + t.reserved[1] {
        return Err(format!(
            "reserved is {} but segments add up to {}",
            parts.reserved,
            t.reserved[0] + t.reserved[1]
        ));
    }
    Ok(())
}

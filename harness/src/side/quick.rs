//! The driver's quick comparison of the allocator core with the model after a step: the same
//! question as building both [`Observation`](super::Observation)s and comparing them
//! ([`super::compare_observations`]), answered without building them.
//!
//! The one rule: [`same_observed`] is true exactly when the two observations would be equal.
//! It compares every part an observation holds, converted by the very functions the
//! observations are built with (`segment_head`, `block_view` of `side/core.rs` and
//! `side/model.rs`), and every statistic field by field: the statistics are read straight
//! from both crates' `Stats` (each field named once, in `same_fields!`, and both structs
//! destructured without `..`, so a field added to either crate's statistics and not compared
//! here is a compile error). What it saves (fuzz/README.md, "Speed"): flattening ~200
//! statistics per side through `Serialize` into fresh buffers, and copying both layouts into
//! the common form, after every step. When it finds a difference, the driver builds both
//! observations and compares them as before, for the message.

use cachalot as a;
use cachalot_model as b;

use super::{CoreSide, ModelSide, STREAM_WAITS_TAIL, core, model};

/// Whether the allocator core and the model would give equal observations now: every
/// statistic, the layout (every segment and block), the device's memory, the stream waits
/// (their count and the latest [`STREAM_WAITS_TAIL`]) and the thread caches.
pub fn same_observed(c: &CoreSide, m: &ModelSide) -> bool {
    let (core, model) = (c.core(), m.model());
    // The cheap numbers first, then the statistics, then the layouts (which both crates build).
    if core.backend().used() != model.device_used() || model.thread_cached_blocks() != 0 {
        return false;
    }
    let waits = model.stream_waits();
    if core.backend().stream_wait_count() as usize != waits.len() {
        return false;
    }
    let core_waits = core.backend().stream_waits();
    let (ta, tb) = (tail(&core_waits), tail(waits));
    if ta.len() != tb.len() || !ta.iter().zip(tb).all(|(x, y)| (x.0.0, x.1.0) == *y) {
        return false;
    }
    if !core.stats().same(&model.stats()) {
        return false;
    }
    let (sa, sb) = (core.segments(), model.layout());
    sa.len() == sb.len()
        && sa.iter().zip(&sb).all(|(x, y)| {
            core::segment_head(x) == model::segment_head(y)
                && x.blocks.len() == y.blocks.len()
                && x.blocks
                    .iter()
                    .zip(&y.blocks)
                    .all(|(p, q)| core::block_view(p) == model::block_view(q))
        })
}

/// The latest [`STREAM_WAITS_TAIL`] entries of a log, as [`super::stream_waits_observed`]
/// keeps them.
fn tail<T>(log: &[T]) -> &[T] {
    &log[log.len().saturating_sub(STREAM_WAITS_TAIL)..]
}

/// A statistic of the allocator compared with the model's: the same number (as flattening
/// compares them: as `i128`), or the same numbers under the same field names.
trait Same<Rhs> {
    fn same(&self, other: &Rhs) -> bool;
}

impl Same<u64> for u64 {
    fn same(&self, other: &u64) -> bool {
        self == other
    }
}

impl Same<i64> for i64 {
    fn same(&self, other: &i64) -> bool {
        self == other
    }
}

/// `$x` and `$y`, of types `$ta` and `$tb`, agree field by field on the listed fields; both
/// types are destructured with exactly these fields and no `..`, so a field either crate adds
/// (or removes) without this list following is a compile error, and each field is named once
/// for both sides.
macro_rules! same_fields {
    ($ta:path, $tb:path, $($f:ident),+ $(,)?) => {
        impl Same<$tb> for $ta {
            fn same(&self, other: &$tb) -> bool {
                let $ta { $($f: _),+ } = self;
                let $tb { $($f: _),+ } = other;
                // `&`, not `&&`: no branch per field (fewer edges for libFuzzer to collect).
                true $(& Same::same(&self.$f, &other.$f))+
            }
        }
    };
}

same_fields!(a::Stat, b::Stat, current, peak, allocated, freed);
same_fields!(a::StatArray, b::StatArray, all, small_pool, large_pool);
same_fields!(
    a::Stats,
    b::Stats,
    allocation,
    segment,
    active,
    inactive_split,
    allocated_bytes,
    reserved_bytes,
    active_bytes,
    inactive_split_bytes,
    requested_bytes,
    oversize_allocations,
    oversize_segments,
    num_alloc_retries,
    num_ooms,
    num_sync_all_streams,
    num_device_alloc,
    num_device_free,
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::side::{Side, flatten_stats, same_stats};

    /// The typed comparison of statistics agrees with the flattened one on equal statistics and
    /// on each single field changed.
    #[test]
    fn typed_statistics_agree_with_flattened_ones() {
        let mut x = a::Stats::default();
        x.allocation.all.current = 3;
        x.reserved_bytes.large_pool.peak = 1 << 30;
        x.num_device_free = 7;
        let mut y = b::Stats::default();
        y.allocation.all.current = 3;
        y.reserved_bytes.large_pool.peak = 1 << 30;
        y.num_device_free = 7;
        let flat = |p: &a::Stats, q: &b::Stats| {
            same_stats(&flatten_stats(p).unwrap(), &flatten_stats(q).unwrap())
        };
        assert!(x.same(&y) && flat(&x, &y));
        // Every number changed alone: both comparisons see each change.
        let mut k = 0;
        loop {
            let mut z = y.clone();
            if !bump(&mut z, k) {
                break;
            }
            assert!(!flat(&x, &z), "number {k}");
            assert!(!x.same(&z), "number {k} missed by the typed comparison");
            k += 1;
        }
        assert_eq!(k, 9 * 12 + 2 * 4 + 5, "every number changed once");
        assert_eq!(flatten_stats(&y).unwrap().len(), 1 + 9 * 20 + 2 * 6 + 5 + 1);
    }

    /// Adds one to the `k`-th number of `s` (false: there are not so many).
    fn bump(s: &mut b::Stats, k: usize) -> bool {
        let mut ints: Vec<&mut i64> = Vec::new();
        let mut stats: Vec<&mut b::Stat> = Vec::new();
        for arr in [
            &mut s.allocation,
            &mut s.segment,
            &mut s.active,
            &mut s.inactive_split,
            &mut s.allocated_bytes,
            &mut s.reserved_bytes,
            &mut s.active_bytes,
            &mut s.inactive_split_bytes,
            &mut s.requested_bytes,
        ] {
            stats.extend([&mut arr.all, &mut arr.small_pool, &mut arr.large_pool]);
        }
        stats.extend([&mut s.oversize_allocations, &mut s.oversize_segments]);
        for st in stats {
            ints.extend([
                &mut st.current,
                &mut st.peak,
                &mut st.allocated,
                &mut st.freed,
            ]);
        }
        let uints = [
            &mut s.num_alloc_retries,
            &mut s.num_ooms,
            &mut s.num_sync_all_streams,
            &mut s.num_device_alloc,
            &mut s.num_device_free,
        ];
        let n = ints.len();
        if k < n {
            *ints[k] += 1;
        } else if k - n < uints.len() {
            *uints[k - n] += 1;
        } else {
            return false;
        }
        true
    }

    /// On real sides, the quick comparison gives what comparing the observations gives.
    #[test]
    fn quick_comparison_agrees_with_the_observations() {
        let knobs = crate::scenario::Knobs::pytorch(1 << 30);
        let (mut c, mut m) = (CoreSide::new(&knobs).unwrap(), ModelSide::new(&knobs));
        let same = |c: &CoreSide, m: &ModelSide| c.observe().unwrap() == m.observe().unwrap();
        assert!(same_observed(&c, &m) && same(&c, &m));
        let call = crate::side::Call::Malloc {
            thread: 0,
            size: 4096,
            stream: 0,
        };
        c.call(&call);
        assert!(!same_observed(&c, &m) && !same(&c, &m));
        m.call(&call);
        assert!(same_observed(&c, &m) && same(&c, &m));
    }
}

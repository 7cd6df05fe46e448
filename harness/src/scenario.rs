//! Scenarios: a device, settings, and a sequence of operations.
//!
//! The one rule: a scenario describes settings once, in plain numbers ([`Knobs`]); each side
//! turns them into its own crate's configuration ([`crate::side`]), and the two crates never
//! see each other's types. A new setting is a field here, a table in [`tables`] and a line
//! in [`Knobs::arbitrary`], and one line in each side's conversion.

use arbitrary::{Arbitrary, Unstructured};
use proptest::prelude::*;

use crate::draw::{Weighted, strategy, weighted};
use crate::op::{Op, ThreadOp};

const MIB: u64 = 1 << 20;

/// The policy knobs a scenario varies, in plain numbers.
#[derive(Clone, Debug, PartialEq)]
pub struct Knobs {
    /// Simulated device capacity in bytes.
    pub capacity: u64,
    /// `max_split_size` in bytes (`u64::MAX` for unlimited).
    pub max_split_size: u64,
    /// `max_non_split_rounding_size` in bytes.
    pub max_non_split_rounding_size: u64,
    /// `garbage_collection_threshold` (0 = off).
    pub garbage_collection_threshold: f64,
    /// `roundup_power2_divisions`, one entry per interval.
    pub roundup_power2_divisions: [u64; 16],
    /// A memory fraction set at the start.
    pub memory_fraction: Option<f64>,
    /// Blocks each thread's cache keeps (rule 17; 0: none, PyTorch's front end). Only the
    /// front end has thread caches: the core runs with 0.
    pub thread_cache_blocks: u32,
    /// Segment addresses the simulated devices hand out first, in order (a recorded trace's).
    pub address_script: Vec<u64>,
    /// `expandable_segments` (rule 19).
    pub expandable_segments: bool,
    /// The large pool's page under expandable segments, in bytes (rule 19's
    /// `expandable_page_mb`).
    pub expandable_page: u64,
    /// `reclaim_headroom` (rule 20; `None`: no reclaim).
    pub reclaim_headroom: Option<f64>,
    /// `page_aliasing` (rule 22): pages a reclaim would unmap are mapped a second time where
    /// the range grows. Drawn only with expandable segments and a reclaim headroom (without
    /// them it never acts).
    pub page_aliasing: bool,
    /// `page_stitching` (rule 23): a large request over rule 20's limit is served from a
    /// stitched view of free pages, kept for the next time. Drawn only where it can act
    /// (expandable segments with a reclaim headroom, page aliasing off).
    pub page_stitching: bool,
    /// `expandable_handle_mb` (rule 19j) in bytes: map steps of at least this many bytes are
    /// one handle (`None`: a handle per page). Drawn only with expandable segments and without
    /// page aliasing (refused beside it).
    pub expandable_handle: Option<u64>,
}

impl Knobs {
    /// PyTorch's defaults on a device of `capacity` bytes.
    pub fn pytorch(capacity: u64) -> Knobs {
        Knobs {
            capacity,
            max_split_size: u64::MAX,
            max_non_split_rounding_size: 20 * MIB,
            garbage_collection_threshold: 0.0,
            roundup_power2_divisions: [0; 16],
            memory_fraction: None,
            thread_cache_blocks: 0,
            address_script: Vec::new(),
            expandable_segments: false,
            expandable_page: 20 * MIB,
            reclaim_headroom: None,
            page_aliasing: false,
            page_stitching: false,
            expandable_handle: None,
        }
    }
}

/// `roundup_power2_divisions` mixed per interval: 1 below 2 MiB, 2 below 4 MiB, 8 above.
const MIXED_DIVISIONS: [u64; 16] = {
    let mut d = [8u64; 16];
    d[0] = 1;
    d[1] = 2;
    d
};

/// The knob tables: small capped devices so out-of-memory and its retry path are common, and
/// every setting varied. The only place their values and weights are written.
pub mod tables {
    use super::*;

    /// Device capacities.
    pub const CAPACITIES: &Weighted<u64> =
        &[(1, 48 * MIB), (1, 96 * MIB), (1, 200 * MIB), (1, 1 << 30)];
    /// `max_split_size`.
    pub const MAX_SPLIT_SIZES: &Weighted<u64> =
        &[(3, u64::MAX), (1, 20 * MIB), (1, 40 * MIB), (1, 64 * MIB)];
    /// `max_non_split_rounding_size`.
    pub const MAX_NON_SPLIT_ROUNDING_SIZES: &Weighted<u64> = &[(3, 20 * MIB), (1, 40 * MIB)];
    /// `garbage_collection_threshold`.
    pub const GC_THRESHOLDS: &Weighted<f64> = &[(3, 0.0), (1, 0.5), (1, 0.8)];
    /// `roundup_power2_divisions`.
    pub const DIVISIONS: &Weighted<[u64; 16]> = &[
        (3, [0; 16]),
        (1, [4; 16]),
        (1, [2; 16]),
        (1, MIXED_DIVISIONS),
    ];
    /// A memory fraction set at the start.
    pub const MEMORY_FRACTIONS: &Weighted<Option<f64>> =
        &[(3, None), (1, Some(0.5)), (1, Some(0.8))];
    /// Thread caches' capacity, for threaded scenarios (the core's scenarios keep 0).
    pub const THREAD_CACHE_BLOCKS: &Weighted<u32> = &[(1, 0), (1, 1), (1, 2), (2, 8)];
    /// `expandable_segments` (rule 19): on in a third of the scenarios.
    pub const EXPANDABLE: &Weighted<bool> = &[(2, false), (1, true)];
    /// How many addresses the device's address script holds (mostly none).
    pub const SCRIPT_LENGTHS: &Weighted<usize> = &[(6, 0), (1, 1), (1, 3)];
    /// The large pool's page under expandable segments (rule 19): PyTorch's 20 MiB twice as
    /// often as cachalot's 2 MiB (rule 21).
    pub const EXPANDABLE_PAGES: &Weighted<u64> = &[(2, 20 * MIB), (1, 2 * MIB)];
    /// `reclaim_headroom` (rule 20): off twice as often as each headroom; 2.5 % is rule 21's.
    pub const RECLAIM_HEADROOMS: &Weighted<Option<f64>> =
        &[(2, None), (1, Some(0.0)), (1, Some(0.025)), (1, Some(0.25))];
    /// `page_aliasing` (rule 22), drawn only where it can act (expandable segments with a
    /// reclaim headroom): on in half of those scenarios. Exhausted bytes draw `false`, the old
    /// behaviour.
    pub const PAGE_ALIASING: &Weighted<bool> = &[(1, false), (1, true)];
    /// `page_stitching` (rule 23), drawn only where it can act (expandable segments with a
    /// reclaim headroom) and page aliasing is off: on in half of those scenarios. Exhausted
    /// bytes draw `false`, the old behaviour.
    pub const PAGE_STITCHING: &Weighted<bool> = &[(1, false), (1, true)];
    /// `expandable_handle_mb` (rule 19j), drawn only under expandable segments without page
    /// aliasing: off as often as both thresholds together. Exhausted bytes draw `None`, the
    /// old behaviour.
    pub const EXPANDABLE_HANDLES: &Weighted<Option<u64>> =
        &[(2, None), (1, Some(2 * MIB)), (1, Some(8 * MIB))];
}

impl<'a> Arbitrary<'a> for Knobs {
    /// Knobs drawn from [`tables`], with no thread caches. New knobs are drawn last, so that
    /// an input drawn before they existed keeps its meaning (exhausted bytes draw each
    /// table's first entry, the old behaviour).
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Knobs> {
        use tables::*;
        let capacity = weighted(u, CAPACITIES)?;
        let max_split_size = weighted(u, MAX_SPLIT_SIZES)?;
        let max_non_split_rounding_size = weighted(u, MAX_NON_SPLIT_ROUNDING_SIZES)?;
        let garbage_collection_threshold = weighted(u, GC_THRESHOLDS)?;
        let roundup_power2_divisions = weighted(u, DIVISIONS)?;
        let memory_fraction = weighted(u, MEMORY_FRACTIONS)?;
        let expandable_segments = weighted(u, EXPANDABLE)?;
        let script_length = weighted(u, SCRIPT_LENGTHS)?;
        let mut address_script = Vec::with_capacity(script_length);
        for _ in 0..script_length {
            address_script.extend(crate::draw::draw(u, crate::op::NEXT_ADDRESSES)?);
        }
        // Rules 19 and 20's knobs, after every older draw.
        let expandable_page = weighted(u, EXPANDABLE_PAGES)?;
        let reclaim_headroom = weighted(u, RECLAIM_HEADROOMS)?;
        // Rule 22's, after those, and drawn (a byte taken) only where it can act, so that an
        // older input without expandable segments and reclaim draws the same operations too.
        let page_aliasing = if expandable_segments && reclaim_headroom.is_some() {
            weighted(u, PAGE_ALIASING)?
        } else {
            false
        };
        // Rule 23's, last, under the same condition (and never beside rule 22's).
        let page_stitching = if expandable_segments && reclaim_headroom.is_some() && !page_aliasing
        {
            weighted(u, PAGE_STITCHING)?
        } else {
            false
        };
        // Rule 19j's, after rule 23's, under expandable segments without page aliasing.
        let expandable_handle = if expandable_segments && !page_aliasing {
            weighted(u, EXPANDABLE_HANDLES)?
        } else {
            None
        };
        Ok(Knobs {
            capacity,
            max_split_size,
            max_non_split_rounding_size,
            garbage_collection_threshold,
            roundup_power2_divisions,
            memory_fraction,
            thread_cache_blocks: 0,
            address_script,
            expandable_segments,
            expandable_page,
            reclaim_headroom,
            page_aliasing,
            page_stitching,
            expandable_handle,
        })
    }
}

/// A scenario: knobs and operations.
#[derive(Clone, Debug)]
pub struct Scenario {
    /// The settings and device.
    pub knobs: Knobs,
    /// The operations, in order.
    pub ops: Vec<Op>,
}

/// A threaded scenario: knobs (with thread caches) and operations on named threads.
#[derive(Clone, Debug)]
pub struct ThreadScenario {
    /// The settings and device, `thread_cache_blocks` included.
    pub knobs: Knobs,
    /// The operations, in order.
    pub ops: Vec<ThreadOp>,
}

/// Knobs for property tests, drawn as the fuzzer draws them.
pub fn knobs_strategy() -> impl Strategy<Value = Knobs> {
    strategy::<Knobs>()
}

/// Scenarios of `len` operations.
pub fn scenario_strategy(len: std::ops::RangeInclusive<usize>) -> impl Strategy<Value = Scenario> {
    (
        knobs_strategy(),
        proptest::collection::vec(strategy::<Op>(), len),
    )
        .prop_map(|(knobs, ops)| Scenario { knobs, ops })
}

/// Threaded scenarios of `len` operations, with thread caches of 0 (PyTorch), 1, 2 or 8 blocks.
pub fn thread_scenario_strategy(
    len: std::ops::RangeInclusive<usize>,
) -> impl Strategy<Value = ThreadScenario> {
    (
        knobs_strategy(),
        strategy::<ThreadCacheBlocks>(),
        proptest::collection::vec(strategy::<ThreadOp>(), len),
    )
        .prop_map(|(knobs, blocks, ops)| ThreadScenario {
            knobs: Knobs {
                thread_cache_blocks: blocks.0,
                ..knobs
            },
            ops,
        })
}

/// A thread cache capacity drawn from [`tables::THREAD_CACHE_BLOCKS`].
#[derive(Clone, Copy, Debug)]
pub struct ThreadCacheBlocks(pub u32);

impl<'a> Arbitrary<'a> for ThreadCacheBlocks {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<ThreadCacheBlocks> {
        Ok(ThreadCacheBlocks(weighted(u, tables::THREAD_CACHE_BLOCKS)?))
    }
}

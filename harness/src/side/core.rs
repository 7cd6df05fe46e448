//! The allocator's policy core (`CachingCore` on the simulated device) as a [`Side`], and the
//! conversions between the harness's plain numbers and `cachalot`'s types.

use cachalot::sizes::Pool;
use cachalot::{
    AdoptedBlock, AdoptedRange, AdoptedSegment, AdoptedState, BackendError, BlockInfo, BlockPhase,
    CachingCore, Error, Faults, SegmentInfo, Settings, SimDevice, StreamId,
};

use super::{
    Adoption, AdoptionBlock, AdoptionState, BlockKind, BlockView, Call, Observation, Outcome,
    SegmentView, Side, flatten_stats,
};
use crate::scenario::Knobs;

/// The allocator's settings for `knobs`.
pub fn settings(knobs: &Knobs) -> Settings {
    let mut s = Settings::pytorch();
    s.max_split_size = knobs.max_split_size;
    s.max_non_split_rounding_size = knobs.max_non_split_rounding_size;
    s.garbage_collection_threshold = knobs.garbage_collection_threshold;
    s.roundup_power2_divisions = knobs.roundup_power2_divisions;
    s.per_process_memory_fraction = knobs.memory_fraction;
    s.thread_cache_blocks = knobs.thread_cache_blocks;
    s.expandable_segments = knobs.expandable_segments;
    s.expandable_page_size = knobs.expandable_page;
    s.reclaim_headroom = knobs.reclaim_headroom;
    s.page_aliasing = knobs.page_aliasing;
    s.page_stitching = knobs.page_stitching;
    s.expandable_handle_size = knobs.expandable_handle;
    s
}

/// The allocator's simulated device for `knobs`.
pub fn device(knobs: &Knobs) -> SimDevice {
    SimDevice::new(knobs.capacity).with_address_script(knobs.address_script.iter().copied())
}

impl Knobs {
    /// The knobs of `settings` on a device of `capacity` bytes, or an error naming what the
    /// knobs cannot express (and so the model cannot be given).
    pub fn from_settings(settings: &Settings, capacity: u64) -> Result<Knobs, String> {
        let knobs = Knobs {
            capacity,
            max_split_size: settings.max_split_size,
            max_non_split_rounding_size: settings.max_non_split_rounding_size,
            garbage_collection_threshold: settings.garbage_collection_threshold,
            roundup_power2_divisions: settings.roundup_power2_divisions,
            memory_fraction: settings.per_process_memory_fraction,
            thread_cache_blocks: settings.thread_cache_blocks,
            address_script: Vec::new(),
            expandable_segments: settings.expandable_segments,
            expandable_page: settings.expandable_page_size,
            reclaim_headroom: settings.reclaim_headroom,
            page_aliasing: settings.page_aliasing,
            page_stitching: settings.page_stitching,
            expandable_handle: settings.expandable_handle_size,
        };
        let back = self::settings(&knobs);
        if back != *settings {
            return Err(format!(
                "settings the harness cannot give the model: {settings} (as knobs: {back})"
            ));
        }
        Ok(knobs)
    }
}

/// The blocks of an adoption as the allocator takes them.
fn allocator_blocks(a: &Adoption) -> Vec<AdoptedBlock> {
    a.blocks
        .iter()
        .map(|b| AdoptedBlock {
            size: b.size,
            state: match &b.state {
                AdoptionState::Free => AdoptedState::Free,
                AdoptionState::Unmapped => AdoptedState::Unmapped,
                AdoptionState::Allocated { requested } => AdoptedState::Allocated {
                    requested: *requested,
                },
                AdoptionState::Pending { requested, streams } => AdoptedState::Pending {
                    requested: *requested,
                    streams: streams.iter().map(|&s| StreamId(s)).collect(),
                },
            },
        })
        .collect()
}

/// A range to adopt as the allocator takes it (rule 18f).
pub fn to_allocator_range(a: &Adoption) -> AdoptedRange {
    AdoptedRange {
        address: a.address,
        stream: StreamId(a.stream),
        pool: if a.small { Pool::Small } else { Pool::Large },
        blocks: allocator_blocks(a),
    }
}

/// The allocator's range to adopt in plain numbers (what a replay program asks for).
pub fn adoption_from_allocator_range(r: &AdoptedRange) -> Adoption {
    Adoption {
        range: true,
        size: 0,
        ..adoption_from_allocator(&AdoptedSegment {
            address: r.address,
            size: 0,
            stream: r.stream,
            pool: r.pool,
            blocks: r.blocks.clone(),
        })
    }
}

/// A segment to adopt as the allocator takes it.
pub fn to_allocator(a: &Adoption) -> AdoptedSegment {
    AdoptedSegment {
        address: a.address,
        size: a.size,
        stream: StreamId(a.stream),
        pool: if a.small { Pool::Small } else { Pool::Large },
        blocks: allocator_blocks(a),
    }
}

/// The allocator's segment to adopt in plain numbers (what a replay program asks for).
pub fn adoption_from_allocator(s: &AdoptedSegment) -> Adoption {
    Adoption {
        address: s.address,
        size: s.size,
        stream: s.stream.0,
        small: s.pool == Pool::Small,
        blocks: s
            .blocks
            .iter()
            .map(|b| AdoptionBlock {
                size: b.size,
                state: match &b.state {
                    AdoptedState::Free => AdoptionState::Free,
                    AdoptedState::Unmapped => AdoptionState::Unmapped,
                    AdoptedState::Allocated { requested } => AdoptionState::Allocated {
                        requested: *requested,
                    },
                    AdoptedState::Pending { requested, streams } => AdoptionState::Pending {
                        requested: *requested,
                        streams: streams.iter().map(|s| s.0).collect(),
                    },
                },
            })
            .collect(),
        range: false,
    }
}

/// Whether `e` is a failure the simulated device was told to inject.
fn injected(e: &Error) -> bool {
    matches!(e, Error::Backend(BackendError::Injected { .. }))
}

/// The allocator's result as an [`Outcome`], with `value` giving the number to compare.
pub(super) fn outcome<T>(r: Result<T, Error>, value: impl Fn(T) -> u64) -> Outcome {
    match r {
        Ok(v) => Outcome::Ok(value(v)),
        Err(Error::OutOfMemory(o)) => Outcome::OutOfMemory {
            alloc_size: o.alloc_size,
            capacity: o.capacity,
            device_free: o.device_free,
            allowed: o.allowed,
            allocated: o.allocated,
            reserved_unallocated: o.reserved_unallocated,
        },
        Err(Error::TooLarge { .. }) => Outcome::TooLarge,
        Err(Error::UnknownPointer { .. }) => Outcome::UnknownPointer,
        Err(Error::InvalidFraction { .. }) => Outcome::InvalidFraction,
        Err(Error::InvalidAdoption { .. }) => Outcome::InvalidAdoption,
        Err(Error::Unsupported { .. }) => Outcome::Unsupported,
        Err(Error::Backend(BackendError::OutOfMemory)) => Outcome::AdoptionOutOfMemory,
        Err(e) if injected(&e) => Outcome::InjectedFault,
        Err(e) => Outcome::Other(e.to_string()),
    }
}

/// The allocator's layout in the common form.
pub(super) fn layout(segments: Vec<SegmentInfo>) -> Vec<SegmentView> {
    segments
        .iter()
        .map(|s| SegmentView {
            blocks: s.blocks.iter().map(block_view).collect(),
            ..segment_head(s)
        })
        .collect()
}

/// One of the allocator's segments in the common form, without its blocks (an empty `Vec`,
/// which allocates nothing): [`layout`] and the driver's quick comparison
/// ([`super::quick`]) convert through this one function.
pub(super) fn segment_head(s: &SegmentInfo) -> SegmentView {
    SegmentView {
        address: s.address,
        size: s.size,
        stream: s.stream.0,
        small: s.pool == Pool::Small,
        expandable: s.expandable,
        blocks: Vec::new(),
    }
}

/// One of the allocator's blocks in the common form ([`layout`] and [`super::quick`]).
pub(super) fn block_view(b: &BlockInfo) -> BlockView {
    let kind = match b.state {
        BlockPhase::Free => BlockKind::Free,
        BlockPhase::Allocated => BlockKind::Allocated,
        BlockPhase::Pending => BlockKind::Pending,
        BlockPhase::Held => BlockKind::Held,
    };
    BlockView {
        address: b.address,
        size: b.size,
        requested: if kind == BlockKind::Free {
            0
        } else {
            b.requested
        },
        kind,
    }
}

/// A device call the fault harness can make fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq, arbitrary::Arbitrary)]
pub enum FaultKind {
    /// Device allocation reports out-of-memory.
    AllocOom,
    /// Device allocation reports another device error.
    AllocError,
    /// Freeing a segment fails (the memory stays allocated).
    FreeError,
    /// Recording an event fails.
    RecordError,
    /// Querying an event fails.
    QueryError,
    /// Waiting for an event fails.
    SyncError,
}

/// The allocator's policy core on the simulated device.
pub struct CoreSide {
    core: CachingCore<SimDevice>,
}

impl CoreSide {
    /// The core configured by `knobs`, which must not ask for thread caches (the core has
    /// none: they are the front end's).
    pub fn new(knobs: &Knobs) -> Result<CoreSide, String> {
        if knobs.thread_cache_blocks != 0 {
            return Err("the core has no thread caches: drive the front end for those".into());
        }
        let core = CachingCore::new(device(knobs), settings(knobs)).map_err(|e| e.to_string())?;
        Ok(CoreSide { core })
    }

    /// The next `n` device calls of this kind fail.
    pub fn inject(&mut self, kind: FaultKind, n: u32) {
        let mut f = Faults::default();
        match kind {
            FaultKind::AllocOom => f.alloc_oom = n,
            FaultKind::AllocError => f.alloc_error = n,
            FaultKind::FreeError => f.free_error = n,
            FaultKind::RecordError => f.record_error = n,
            FaultKind::QueryError => f.query_error = n,
            FaultKind::SyncError => f.sync_error = n,
        }
        self.core.backend_mut().inject(f);
    }

    /// Drops every pending fault.
    pub fn clear_faults(&mut self) {
        self.core.backend_mut().clear_faults();
    }

    /// Live allocations the core holds.
    pub fn live_allocations(&self) -> usize {
        self.core.live_allocations()
    }

    /// Events the device holds.
    pub fn live_events(&self) -> usize {
        self.core.backend().live_events()
    }

    /// The device's live ranges `(address, size)` by address.
    pub fn device_allocations(&self) -> Vec<(u64, u64)> {
        self.core.backend().allocations().collect()
    }

    /// Rule 23: the live allocations made through stitched views `(address, bytes)` that are
    /// allocated (not pending), by address; `segments()` does not list them.
    pub fn view_allocations(&self) -> Vec<(u64, u64)> {
        self.core
            .view_allocations()
            .into_iter()
            .filter(|v| v.2 == cachalot::BlockPhase::Allocated)
            .map(|v| (v.0, v.1))
            .collect()
    }

    /// The layout alone (what [`Side::observe`] reports of it), without the statistics.
    pub fn layout(&self) -> Vec<SegmentView> {
        layout(self.core.segments())
    }

    /// Bytes the device has handed out (what [`Side::observe`] reports as `device_used`).
    pub fn device_used(&self) -> u64 {
        self.core.backend().used()
    }

    /// [`Side::check_invariants`] given the layout as [`CoreSide::layout`] reports it now (so
    /// that a caller holding it does not make it twice): the core's own checks, and rules 22i
    /// and 23i's on the device's page table.
    pub fn check_invariants_on(&self, layout: &[SegmentView]) -> Result<(), String> {
        self.core.check_invariants().map_err(|e| e.to_string())?;
        disjoint_bytes_under_live_allocations(
            layout,
            &self.core.view_allocations(),
            self.core.backend(),
        )
    }

    /// The allocator core itself (the driver's quick comparison reads it directly).
    pub(super) fn core(&self) -> &CachingCore<SimDevice> {
        &self.core
    }

    /// Reserved bytes by the core's statistics.
    pub fn reserved_bytes(&self) -> i64 {
        self.core.stats().reserved_bytes.all.current
    }
}

impl Side for CoreSide {
    fn name(&self) -> &'static str {
        "allocator"
    }

    fn call(&mut self, call: &Call) -> Outcome {
        let c = &mut self.core;
        match *call {
            Call::Malloc { size, stream, .. } => outcome(c.malloc(size, StreamId(stream)), |a| a),
            Call::Free { address, .. } => outcome(c.free(address), |()| 0),
            Call::RecordStream {
                address, stream, ..
            } => outcome(c.record_stream(address, StreamId(stream)), |()| 0),
            Call::CompleteStream { stream } => {
                c.backend_mut().complete_stream(StreamId(stream));
                Outcome::Ok(0)
            }
            Call::EmptyCache { .. } => outcome(c.empty_cache(), |()| 0),
            Call::SetFraction { fraction, .. } => outcome(c.set_memory_fraction(fraction), |()| 0),
            Call::SetRuntimeSettings {
                max_split_size,
                max_non_split_rounding_size,
                garbage_collection_threshold,
                roundup_power2_divisions,
            } => {
                let mut settings = c.settings().clone();
                settings.max_split_size = max_split_size;
                settings.max_non_split_rounding_size = max_non_split_rounding_size;
                settings.garbage_collection_threshold = garbage_collection_threshold;
                settings.roundup_power2_divisions = roundup_power2_divisions;
                outcome(c.set_runtime_settings(settings), |()| 0)
            }
            Call::ReleaseStream { stream } => {
                outcome(c.release_stream_cache(StreamId(stream)), |()| 0)
            }
            Call::FailDeviceAllocs { n } => {
                c.backend_mut().fail_next_allocs(n);
                Outcome::Ok(0)
            }
            Call::Adopt { ref segment } if segment.range => {
                outcome(c.adopt_range(to_allocator_range(segment)), |()| 0)
            }
            Call::Adopt { ref segment } => outcome(c.adopt_segment(to_allocator(segment)), |()| 0),
            Call::SetNextAddress { address } => {
                c.backend_mut().set_next_address(address);
                Outcome::Ok(0)
            }
            // No thread caches: nothing to flush, nothing a thread leaves behind.
            Call::FlushThread { .. } | Call::RetireThread { .. } => Outcome::Ok(0),
        }
    }

    fn observe(&self) -> Result<Observation, String> {
        Ok(Observation {
            stats: flatten_stats(self.core.stats())?,
            layout: layout(self.core.segments()),
            device_used: self.core.backend().used(),
            thread_cached_blocks: 0,
            stream_waits: super::stream_waits_observed(
                self.core.backend().stream_wait_count() as usize,
                self.core
                    .backend()
                    .stream_waits()
                    .iter()
                    .map(|&(w, o)| (w.0, o.0)),
            ),
        })
    }

    fn check_invariants(&self) -> Result<(), String> {
        self.check_invariants_on(&self.layout())
    }

    fn as_core(&self) -> Option<&CoreSide> {
        Some(self)
    }
}

/// Rules 22i and 23i on the device's own page table: the physical bytes under the allocator's
/// live allocations — its allocated or pending blocks of expandable segments, at their homes,
/// and its allocations through stitched views (`views`: address, bytes), through the view's
/// own slots — are pairwise disjoint, as `(page, byte range within the page)` sets, whatever
/// addresses map the pages. Byte-precise: a view's allocation may use the first `t` bytes of
/// a page whose other bytes are under another live block. (Held pieces, rule 23b, are the
/// homes of a view allocation's bytes, not allocations of their own.)
pub(super) fn disjoint_bytes_under_live_allocations(
    segments: &[SegmentView],
    views: &[(u64, u64, BlockPhase)],
    device: &SimDevice,
) -> Result<(), String> {
    let mut live: Vec<(u64, u64)> = Vec::new();
    for s in segments.iter().filter(|s| s.expandable) {
        live.extend(
            s.blocks
                .iter()
                .filter(|b| matches!(b.kind, BlockKind::Allocated | BlockKind::Pending))
                .map(|b| (b.address, b.size)),
        );
    }
    live.extend(views.iter().map(|&(address, size, _)| (address, size)));
    match device.physical_overlap(live) {
        Ok(()) => {}
        Err(cachalot::PhysicalOverlap::Unmapped { address, at }) => {
            return Err(format!(
                "rules 22i, 23i: live allocation {address:#x} has nothing mapped at {at:#x}"
            ));
        }
        Err(cachalot::PhysicalOverlap::Shared {
            page,
            bytes,
            first,
            second,
        }) => {
            return Err(format!(
                "rules 22i, 23i: bytes [{:#x}, {:#x}) of page {page:?} lie under live allocations \
                 {first:#x} and {second:#x} (device page table)",
                bytes.0, bytes.1
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use arbitrary::{Arbitrary, Unstructured};

    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn cachalots_own_settings_become_knobs_and_back() {
        let own = Settings::cachalot();
        let knobs = Knobs::from_settings(&own, 1 << 30).unwrap();
        assert!(knobs.expandable_segments);
        assert_eq!(knobs.expandable_page, 2 * MIB);
        assert_eq!(knobs.reclaim_headroom, Some(0.025));
        assert!(
            !knobs.page_aliasing,
            "page aliasing is not part of cachalot's policy"
        );
        assert_eq!(settings(&knobs), own);
    }

    #[test]
    fn page_aliasing_becomes_a_knob_and_is_drawn_only_where_it_can_act() {
        let parsed = Settings::pytorch()
            .apply("expandable_segments:True,reclaim_headroom:0.25,page_aliasing:True")
            .unwrap();
        let knobs = Knobs::from_settings(&parsed, 1 << 30).unwrap();
        assert!(knobs.page_aliasing);
        assert_eq!(settings(&knobs), parsed);
        let mut drawn = [0u32; 2];
        for seed in 0..2000u32 {
            let bytes: Vec<u8> = (0..64u32)
                .map(|i| (seed.wrapping_mul(2_654_435_761) ^ i.wrapping_mul(40_503)) as u8)
                .collect();
            let knobs = Knobs::arbitrary(&mut Unstructured::new(&bytes)).unwrap();
            if knobs.page_aliasing {
                assert!(knobs.expandable_segments && knobs.reclaim_headroom.is_some());
            }
            if knobs.expandable_segments && knobs.reclaim_headroom.is_some() {
                drawn[usize::from(knobs.page_aliasing)] += 1;
            }
        }
        assert!(drawn[0] > 0 && drawn[1] > 0, "{drawn:?}");
        // Exhausted bytes draw no aliasing (the old behaviour).
        assert!(
            !Knobs::arbitrary(&mut Unstructured::new(&[]))
                .unwrap()
                .page_aliasing
        );
    }

    #[test]
    fn the_page_and_headroom_keys_become_knobs() {
        let parsed = Settings::pytorch()
            .apply("expandable_segments:True,expandable_page_mb:6,reclaim_headroom:0.25")
            .unwrap();
        let knobs = Knobs::from_settings(&parsed, 1 << 30).unwrap();
        assert_eq!(knobs.expandable_page, 6 * MIB);
        assert_eq!(knobs.reclaim_headroom, Some(0.25));
        assert_eq!(settings(&knobs), parsed);
        let plain = Knobs::from_settings(&Settings::pytorch(), 1 << 30).unwrap();
        assert_eq!(plain, Knobs::pytorch(1 << 30));
    }

    #[test]
    fn drawn_knobs_round_trip_through_settings() {
        let mut seen_pages = std::collections::BTreeSet::new();
        let mut seen_headrooms = Vec::new();
        for seed in 0..2000u32 {
            let bytes: Vec<u8> = (0..64u32)
                .map(|i| (seed.wrapping_mul(2_654_435_761) ^ i.wrapping_mul(40_503)) as u8)
                .map(|b| b.rotate_left(seed % 8))
                .collect();
            let mut knobs = Knobs::arbitrary(&mut Unstructured::new(&bytes)).unwrap();
            // The address script is the device's, not a setting.
            knobs.address_script.clear();
            let back = Knobs::from_settings(&settings(&knobs), knobs.capacity).unwrap();
            assert_eq!(back, knobs, "seed {seed}");
            seen_pages.insert(knobs.expandable_page);
            if !seen_headrooms.contains(&knobs.reclaim_headroom) {
                seen_headrooms.push(knobs.reclaim_headroom);
            }
        }
        assert_eq!(seen_pages.len(), 2);
        assert_eq!(seen_headrooms.len(), 4);
    }

    #[test]
    fn page_stitching_becomes_a_knob_and_is_drawn_only_where_it_can_act() {
        let parsed = Settings::pytorch()
            .apply("expandable_segments:True,reclaim_headroom:0.25,page_stitching:True")
            .unwrap();
        let knobs = Knobs::from_settings(&parsed, 1 << 30).unwrap();
        assert!(knobs.page_stitching && !knobs.page_aliasing);
        assert_eq!(settings(&knobs), parsed);
        assert!(!Knobs::pytorch(1 << 30).page_stitching);
        let mut drawn = [0u32; 2];
        for seed in 0..2000u32 {
            // xorshift bytes: the multiplicative pattern of the test above alternates its low
            // bit from byte to byte, and rule 23's byte follows rule 22's.
            let mut x = u64::from(seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            let bytes: Vec<u8> = (0..64)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x >> 24) as u8
                })
                .collect();
            let knobs = Knobs::arbitrary(&mut Unstructured::new(&bytes)).unwrap();
            if knobs.page_stitching {
                assert!(knobs.expandable_segments && knobs.reclaim_headroom.is_some());
                assert!(!knobs.page_aliasing, "never beside rule 22");
            }
            if knobs.expandable_segments && knobs.reclaim_headroom.is_some() && !knobs.page_aliasing
            {
                drawn[usize::from(knobs.page_stitching)] += 1;
            }
        }
        assert!(drawn[0] > 0 && drawn[1] > 0, "{drawn:?}");
        assert!(
            !Knobs::arbitrary(&mut Unstructured::new(&[]))
                .unwrap()
                .page_stitching
        );
    }

    #[test]
    fn the_device_check_is_byte_precise_over_views_and_homes() {
        // Rule 23's holes: A 4, X 2, B 4, Y 2 MiB, A and B freed; a 5 MiB view allocation
        // holds 1 MiB of the page at 6 MiB, whose other bytes a 1.5 MiB block then takes.
        let knobs = Knobs {
            expandable_segments: true,
            expandable_page: 2 * MIB,
            reclaim_headroom: Some(0.0),
            page_stitching: true,
            ..Knobs::pytorch(1 << 30)
        };
        let mut core = CachingCore::new(device(&knobs), settings(&knobs)).unwrap();
        let s = StreamId(0);
        let a = core.malloc(4 * MIB, s).unwrap();
        let _x = core.malloc(2 * MIB, s).unwrap();
        let b = core.malloc(4 * MIB, s).unwrap();
        let _y = core.malloc(2 * MIB, s).unwrap();
        core.free(a).unwrap();
        core.free(b).unwrap();
        let v = core.malloc(5 * MIB, s).unwrap();
        let small = core.malloc(3 * MIB / 2, s).unwrap();
        assert_eq!(small, b + MIB, "the rest of the view's last page");
        let views = core.view_allocations();
        assert_eq!(views.len(), 1);
        let segments = layout(core.segments());
        disjoint_bytes_under_live_allocations(&segments, &views, core.backend()).unwrap();
        // A view allocation one byte-range too long would overlap the block beside its piece.
        let mut wrong = views.clone();
        wrong[0].1 += 512;
        let err =
            disjoint_bytes_under_live_allocations(&segments, &wrong, core.backend()).unwrap_err();
        assert!(err.contains("rules 22i, 23i"), "{err}");
        // The same page counted whole (as the old check did) would have refused the layout.
        assert_eq!(
            core.backend().page_at(v + 4 * MIB),
            core.backend().page_at(small)
        );
    }
}

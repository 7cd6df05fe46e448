//! Scenarios through the public API, each checking the model's invariants after every step.

use cachalot_model::{BlockState, Model, ModelConfig, ModelError};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const BASE: u64 = 0x7f00_0000_0000;

/// A model that checks its invariants after every operation.
struct Checked(Model);

impl Checked {
    fn new(config: ModelConfig) -> Checked {
        Checked(Model::new(config))
    }
    fn defaults(capacity: u64) -> Checked {
        Checked::new(ModelConfig::pytorch_defaults(capacity))
    }
    fn check(&self) {
        if let Err(error) = self.0.check_invariants() {
            panic!("invariant broken: {error}\n{:#?}", self.0.layout());
        }
    }
    fn malloc(&mut self, size: u64, stream: u64) -> Result<u64, ModelError> {
        let result = self.0.malloc(size, stream);
        self.check();
        result
    }
    fn alloc(&mut self, size: u64, stream: u64) -> u64 {
        self.malloc(size, stream).expect("malloc")
    }
    fn free(&mut self, address: u64) {
        self.0.free(address).expect("free");
        self.check();
    }
    fn record_stream(&mut self, address: u64, stream: u64) {
        self.0
            .record_stream(address, stream)
            .expect("record_stream");
        self.check();
    }
    fn empty_cache(&mut self) {
        self.0.empty_cache();
        self.check();
    }
    /// (allocated_bytes, reserved_bytes) current, all pools.
    fn allocated_reserved(&self) -> (i64, i64) {
        let stats = self.0.stats();
        (
            stats.allocated_bytes.all.current,
            stats.reserved_bytes.all.current,
        )
    }
    fn block_state(&self, address: u64) -> Option<BlockState> {
        self.0
            .layout()
            .iter()
            .flat_map(|s| s.blocks.iter())
            .find(|b| b.address == address)
            .map(|b| b.state)
    }
}

#[test]
fn the_first_seeds_experiment_reuses_freed_gigabyte_blocks() {
    let mut m = Checked::defaults(64 * GIB);
    let g = GIB as i64;
    let a = m.alloc(GIB, 0);
    assert_eq!(m.allocated_reserved(), (g, g));
    let b = m.alloc(GIB, 0);
    assert_eq!(m.allocated_reserved(), (2 * g, 2 * g));
    m.free(b);
    assert_eq!(m.allocated_reserved(), (g, 2 * g));
    let c = m.alloc(GIB, 0);
    assert_eq!(c, b, "the cached block is reused");
    assert_eq!(m.allocated_reserved(), (2 * g, 2 * g));
    let _c2 = m.alloc(GIB, 0);
    assert_eq!(m.allocated_reserved(), (3 * g, 3 * g));
    m.free(c);
    assert_eq!(m.allocated_reserved(), (2 * g, 3 * g));
    let d = m.alloc(GIB, 0);
    assert_eq!(m.allocated_reserved(), (3 * g, 3 * g));
    m.free(d);
    assert_eq!(m.allocated_reserved(), (2 * g, 3 * g));
    let _e = m.alloc(GIB, 0);
    assert_eq!(m.allocated_reserved(), (3 * g, 3 * g));
    let stats = m.0.stats();
    assert_eq!(stats.num_device_alloc, 3);
    assert_eq!(stats.reserved_bytes.all.peak, 3 * g);
    assert_eq!(stats.allocated_bytes.all.allocated, 6 * g);
    assert_eq!(stats.allocated_bytes.all.freed, 3 * g);
    assert_eq!(a, BASE);
}

#[test]
fn segments_are_sized_by_pool_and_request() {
    let mut m = Checked::defaults(GIB);
    m.alloc(100, 0);
    m.alloc(5 * MIB, 0);
    m.alloc(11 * MIB, 1); // another stream: the 15 MiB remainder is not reused
    let sizes: Vec<(u64, bool)> = m.0.layout().iter().map(|s| (s.size, s.small)).collect();
    assert_eq!(
        sizes,
        vec![(2 * MIB, true), (20 * MIB, false), (12 * MIB, false)]
    );
    assert_eq!(m.0.device_used(), 34 * MIB);
}

#[test]
fn a_large_block_splits_only_when_more_than_one_mebibyte_remains() {
    let mut m = Checked::defaults(GIB);
    let a = m.alloc(19 * MIB, 0);
    let layout = m.0.layout();
    assert_eq!(layout[0].blocks.len(), 1, "1 MiB remaining: no split");
    assert_eq!(layout[0].blocks[0].size, 20 * MIB);
    assert_eq!(layout[0].blocks[0].requested, 19 * MIB);
    assert_eq!(m.0.stats().requested_bytes.all.current, 19 * MIB as i64);
    assert_eq!(m.0.stats().allocated_bytes.all.current, 20 * MIB as i64);
    m.free(a);
    m.alloc(18 * MIB, 0);
    let layout = m.0.layout();
    assert_eq!(layout[0].blocks.len(), 2);
    assert_eq!(layout[0].blocks[1].size, 2 * MIB);
    assert_eq!(layout[0].blocks[1].state, BlockState::Free);
    let stats = m.0.stats();
    assert_eq!(stats.inactive_split.large_pool.current, 1);
    assert_eq!(
        stats.inactive_split_bytes.large_pool.current,
        2 * MIB as i64
    );
}

#[test]
fn small_blocks_split_and_coalesce_back_to_one_block() {
    let mut m = Checked::defaults(GIB);
    let a = m.alloc(1000, 0);
    let b = m.alloc(512, 0);
    let c = m.alloc(4096, 0);
    assert_eq!((b - a, c - b), (1024, 512));
    assert_eq!(m.0.layout()[0].blocks.len(), 4);
    m.free(b);
    // Free b sits between allocated a and c: a second inactive split block.
    assert_eq!(m.0.stats().inactive_split.small_pool.current, 2);
    m.free(a);
    assert_eq!(m.0.layout()[0].blocks.len(), 3, "a merged with b");
    m.free(c);
    let layout = m.0.layout();
    assert_eq!(layout[0].blocks.len(), 1, "everything merged back");
    assert_eq!(layout[0].blocks[0].size, 2 * MIB);
    let stats = m.0.stats();
    assert_eq!(stats.inactive_split.small_pool.current, 0);
    assert_eq!(stats.inactive_split.small_pool.peak, 2);
    assert_eq!(stats.inactive_split_bytes.small_pool.current, 0);
    assert_eq!(stats.active.all.current, 0);
    assert_eq!(stats.segment.small_pool.current, 1);
}

#[test]
fn a_freed_block_is_not_reused_by_another_stream() {
    let mut m = Checked::defaults(GIB);
    let a = m.alloc(4096, 1);
    m.free(a);
    let b = m.alloc(4096, 2);
    assert_ne!(a, b);
    assert_eq!(m.0.layout().len(), 2);
    let c = m.alloc(4096, 1);
    assert_eq!(c, a, "the same stream reuses it");
}

#[test]
fn events_hold_a_block_until_its_stream_completes_and_the_next_malloc() {
    let mut m = Checked::defaults(GIB);
    let a = m.alloc(20 * MIB, 0);
    m.record_stream(a, 7);
    m.record_stream(a, 0); // its own stream: nothing
    m.free(a);
    assert_eq!(m.block_state(a), Some(BlockState::Pending));
    let stats = m.0.stats();
    assert_eq!(stats.allocation.all.current, 0);
    assert_eq!(stats.active.all.current, 1);
    assert_eq!(stats.requested_bytes.all.current, 20 * MIB as i64);
    // Not complete yet: the next malloc cannot use it.
    let b = m.alloc(20 * MIB, 0);
    assert_ne!(b, a);
    m.free(b);
    m.0.complete_stream(7);
    m.check();
    assert_eq!(
        m.block_state(a),
        Some(BlockState::Pending),
        "not returned by itself"
    );
    // The next malloc returns it first; of the two free blocks, a has the lower address.
    let c = m.alloc(20 * MIB, 0);
    assert_eq!(c, a);
    let stats = m.0.stats();
    assert_eq!(stats.active.all.current, 1);
    assert_eq!(stats.requested_bytes.all.current, 20 * MIB as i64);
    assert_eq!(stats.active.all.freed, 2);
}

#[test]
fn events_recorded_after_a_completion_are_not_complete() {
    let mut m = Checked::defaults(GIB);
    let a = m.alloc(512, 0);
    let b = m.alloc(512, 0);
    m.record_stream(a, 3);
    m.record_stream(a, 4);
    m.free(a);
    m.0.complete_stream(3);
    m.record_stream(b, 3);
    m.free(b);
    m.alloc(512, 9); // processes events: a still waits for stream 4; b for stream 3
    assert_eq!(m.block_state(a), Some(BlockState::Pending));
    assert_eq!(m.block_state(b), Some(BlockState::Pending));
    m.0.complete_stream(4);
    m.alloc(512, 9);
    assert_eq!(m.block_state(a), Some(BlockState::Free));
    assert_eq!(m.block_state(b), Some(BlockState::Pending));
}

#[test]
fn empty_cache_waits_for_events_and_releases_whole_free_segments() {
    let mut m = Checked::defaults(GIB);
    let a = m.alloc(3 * MIB, 0);
    let b = m.alloc(512, 0);
    let _c = m.alloc(512, 0);
    m.record_stream(a, 1);
    m.free(a);
    m.free(b);
    m.empty_cache();
    let stats = m.0.stats();
    assert_eq!(stats.num_sync_all_streams, 1);
    assert_eq!(stats.num_device_free, 1, "only a's segment was whole");
    assert_eq!(stats.segment.large_pool.current, 0);
    assert_eq!(stats.segment.small_pool.current, 1);
    assert_eq!(stats.active.all.current, 1);
    assert_eq!(m.0.device_used(), 2 * MIB);
}

#[test]
fn a_tiny_device_retries_after_releasing_the_cache_then_runs_out_of_memory() {
    let mut m = Checked::defaults(24 * MIB);
    let small = m.alloc(512, 0);
    m.free(small);
    // 23 MiB needs a 24 MiB segment; the cached small segment is in the way.
    let big = m.alloc(23 * MIB, 0);
    let stats = m.0.stats();
    assert_eq!(stats.num_alloc_retries, 1);
    assert_eq!(stats.num_sync_all_streams, 1);
    assert_eq!(stats.num_device_free, 1);
    assert_eq!(stats.reserved_bytes.all.allocated, 26 * MIB as i64);
    assert_eq!(stats.reserved_bytes.all.freed, 2 * MIB as i64);
    assert_eq!(stats.reserved_bytes.all.peak, 24 * MIB as i64);
    // Nothing is left to release.
    let error = m.malloc(1, 0).unwrap_err();
    assert_eq!(
        error,
        ModelError::OutOfMemory {
            alloc_size: 2 * MIB,
            capacity: 24 * MIB,
            device_free: 0,
            allowed: None,
            allocated: 24 * MIB,
            reserved_unallocated: 0,
        }
    );
    let stats = m.0.stats();
    assert_eq!((stats.num_ooms, stats.num_alloc_retries), (1, 2));
    m.free(big);
    assert_eq!(m.0.stats().reserved_bytes.all.current, 24 * MIB as i64);
}

#[test]
fn told_device_failures_lead_to_a_retry_or_an_out_of_memory_error() {
    let mut m = Checked::defaults(GIB);
    m.0.fail_next_device_allocs(1);
    m.alloc(512, 0);
    assert_eq!(m.0.stats().num_alloc_retries, 1);
    assert_eq!(m.0.stats().num_ooms, 0);
    m.0.fail_next_device_allocs(2);
    let error = m.malloc(2 * MIB, 0).unwrap_err();
    assert!(
        matches!(error, ModelError::OutOfMemory { alloc_size, device_free, .. }
        if alloc_size == 20 * MIB && device_free == GIB - 2 * MIB)
    );
    assert_eq!(m.0.stats().num_ooms, 1);
}

#[test]
fn a_memory_fraction_caps_reserved_bytes_without_asking_the_device() {
    let mut config = ModelConfig::pytorch_defaults(GIB);
    config.memory_fraction = Some(0.05);
    let mut m = Checked::new(config);
    let allowed = (0.05 * GIB as f64) as u64;
    m.alloc(40 * MIB, 0);
    m.0.fail_next_device_allocs(1);
    let error = m.malloc(2 * MIB, 0).unwrap_err();
    assert!(matches!(error, ModelError::OutOfMemory { allowed: Some(a), .. } if a == allowed));
    // The told failure was not spent by the refused attempts.
    m.0.set_memory_fraction(1.0).unwrap();
    assert!(
        m.malloc(2 * MIB, 0).is_ok(),
        "retried after the told failure"
    );
    assert_eq!(m.0.stats().num_alloc_retries, 2);
}

#[test]
fn oversize_blocks_are_not_split_nor_given_to_small_requests() {
    let mut config = ModelConfig::pytorch_defaults(GIB);
    config.max_split_size = 30 * MIB;
    let mut m = Checked::new(config);
    let a = m.alloc(70 * MIB, 0);
    m.free(a);
    assert_eq!(m.0.stats().oversize_segments.current, 1);
    // Below max split: not served by the oversize block.
    let b = m.alloc(5 * MIB, 0);
    assert_ne!(b, a);
    // 55 MiB + 20 MiB > 70 MiB: the whole oversize block, not split.
    let c = m.alloc(55 * MIB, 0);
    assert_eq!(c, a);
    let stats = m.0.stats();
    assert_eq!(stats.oversize_allocations.current, 1);
    assert_eq!(stats.allocated_bytes.large_pool.current, 75 * MIB as i64);
    m.free(c);
    // 40 MiB + 20 MiB ≤ 70 MiB: too wasteful, a new segment.
    let d = m.alloc(40 * MIB, 0);
    assert_ne!(d, a);
}

#[test]
fn releasing_one_oversize_block_makes_room() {
    let mut config = ModelConfig::pytorch_defaults(100 * MIB);
    config.max_split_size = 30 * MIB;
    let mut m = Checked::new(config);
    let a = m.alloc(70 * MIB, 0);
    m.free(a);
    // No fit (rounding allowance), no room: rule 11 releases the 70 MiB block.
    m.alloc(40 * MIB, 0);
    let stats = m.0.stats();
    assert_eq!((stats.num_device_free, stats.num_alloc_retries), (1, 0));
    assert_eq!(stats.oversize_segments.current, 1);
    assert_eq!(stats.oversize_segments.freed, 1);
}

#[test]
fn releasing_several_oversize_blocks_largest_first_makes_room() {
    let mut config = ModelConfig::pytorch_defaults(100 * MIB);
    config.max_split_size = 30 * MIB;
    let mut m = Checked::new(config);
    let a = m.alloc(40 * MIB, 0);
    let b = m.alloc(40 * MIB, 0);
    m.free(a);
    m.free(b);
    m.alloc(60 * MIB, 0);
    let stats = m.0.stats();
    assert_eq!((stats.num_device_free, stats.num_alloc_retries), (2, 0));
    assert_eq!(m.0.device_used(), 60 * MIB);
}

#[test]
fn rule_11_stops_releasing_oversize_blocks_once_exactly_the_key_is_released() {
    // Three free 30 MiB oversize segments, 30 MiB of the device free: a 60 MiB request
    // releases two of them (30 + 30 = the key, 60 MiB) and keeps the third.
    let mut config = ModelConfig::pytorch_defaults(120 * MIB);
    config.max_split_size = 30 * MIB;
    let mut m = Checked::new(config);
    let blocks = [
        m.alloc(30 * MIB, 0),
        m.alloc(30 * MIB, 0),
        m.alloc(30 * MIB, 0),
    ];
    for b in blocks {
        m.free(b);
    }
    m.alloc(60 * MIB, 0);
    let stats = m.0.stats();
    assert_eq!((stats.num_device_free, stats.num_alloc_retries), (2, 0));
    assert_eq!(m.0.device_used(), 90 * MIB);
}

#[test]
fn too_few_oversize_bytes_fall_through_to_releasing_everything() {
    let mut config = ModelConfig::pytorch_defaults(80 * MIB);
    config.max_split_size = 30 * MIB;
    let mut m = Checked::new(config);
    let a = m.alloc(40 * MIB, 0);
    m.free(a);
    m.alloc(50 * MIB, 0);
    let stats = m.0.stats();
    assert_eq!((stats.num_device_free, stats.num_alloc_retries), (1, 1));
}

#[test]
fn garbage_collection_releases_the_older_cached_segments() {
    let mut config = ModelConfig::pytorch_defaults(GIB);
    config.memory_fraction = Some(0.2);
    config.garbage_collection_threshold = 0.4; // ⌊0.4 × ⌊0.2 GiB⌋⌋ ≈ 81.9 MiB
    let mut m = Checked::new(config);
    let a = m.alloc(40 * MIB, 0); // search 1
    let b = m.alloc(40 * MIB, 0); // search 2
    m.free(a); // a enters the free set at 2
    let d = m.alloc(2 * MIB, 1); // search 3; 80 MiB reserved: no collection
    m.free(b); // b enters the free set at 3
    assert_eq!(m.0.stats().num_device_free, 0);
    m.free(d);
    m.alloc(4 * MIB, 1); // search 4, found in d's segment
    // Search 5 finds nothing on stream 2; 100 MiB reserved is above the threshold: ages are
    // a: 3, b: 2, mean 2.5, so only a goes, which reclaims enough.
    m.alloc(30 * MIB, 2);
    let segments: Vec<(u64, u64, u64)> =
        m.0.layout()
            .iter()
            .map(|s| (s.address, s.size, s.stream))
            .collect();
    // a's range now holds the new 30 MiB segment of stream 2.
    assert_eq!(segments[0], (a, 30 * MIB, 2));
    assert_eq!(segments[1], (b, 40 * MIB, 0));
    assert_eq!(m.0.stats().num_device_free, 1);
    assert_eq!(m.0.stats().num_alloc_retries, 0);
}

#[test]
fn garbage_collection_stops_once_exactly_the_target_is_reclaimed() {
    // Rule 12's loop runs while less than the target is reclaimed: a first round that reclaims
    // exactly the target is the last. 1,000 MiB allowed, collected above 500; blocks of 21 MiB
    // or more are not split for smaller requests, so the 12 MiB requests make segments of their
    // own and leave the old free segment whole.
    let mut config = ModelConfig::pytorch_defaults(1000 * MIB);
    config.memory_fraction = Some(1.0);
    config.garbage_collection_threshold = 0.5;
    config.max_split_size = 21 * MIB;
    let mut m = Checked::new(config);
    let old = m.alloc(40 * MIB, 0);
    let young = m.alloc(20 * MIB, 0);
    m.free(old);
    // Three searches age the old free segment; the young one is freed after them.
    for _ in 0..3 {
        m.alloc(12 * MIB, 0);
    }
    m.free(young);
    // 40 + 20 + 3 × 12 + 444 = 540 MiB reserved: 40 above the threshold.
    m.alloc(444 * MIB, 0);
    assert_eq!(m.allocated_reserved().1, 540 * MIB as i64);
    // No cached block fits 60 MiB: the first round releases the old segment (40 MiB, at least
    // as old as the mean), which is exactly the target, so the young one stays cached.
    m.alloc(60 * MIB, 0);
    let left: Vec<u64> = m.0.layout().iter().map(|s| s.address).collect();
    assert!(!left.contains(&old), "the old free segment is collected");
    assert!(
        left.contains(&young),
        "a round past the target collected the young segment too"
    );
    assert_eq!(m.allocated_reserved().1, 560 * MIB as i64);
}

#[test]
fn garbage_collection_needs_a_memory_fraction() {
    let mut config = ModelConfig::pytorch_defaults(GIB);
    config.garbage_collection_threshold = 0.01;
    let mut m = Checked::new(config);
    let a = m.alloc(40 * MIB, 0);
    m.free(a);
    m.alloc(60 * MIB, 1);
    assert_eq!(m.0.stats().num_device_free, 0);
}

#[test]
fn script_addresses_come_first() {
    let mut config = ModelConfig::pytorch_defaults(GIB);
    config.address_script = vec![0x1_0000_0000];
    let mut m = Checked::new(config);
    assert_eq!(m.alloc(512, 0), 0x1_0000_0000);
    assert_eq!(m.alloc(512, 1), BASE);
}

/// Rule 21's policy with rule 22: expandable segments, 2 MiB pages in both pools, reclaim at
/// 2.5 %, page aliasing, on a large device.
fn aliasing(capacity: u64) -> Checked {
    let mut config = ModelConfig::pytorch_defaults(capacity);
    config.expandable_segments = true;
    config.expandable_page = 2 * MIB;
    config.reclaim_headroom = Some(0.025);
    config.page_aliasing = true;
    Checked::new(config)
}

/// (num_device_alloc, num_device_free).
fn device_calls(m: &Checked) -> (u64, u64) {
    let stats = m.0.stats();
    (stats.num_device_alloc, stats.num_device_free)
}

#[test]
fn a_loop_whose_allocations_repeat_makes_no_device_call_after_its_first_pass_under_page_aliasing() {
    let mut m = aliasing(64 * GIB);
    let pass = |m: &mut Checked| {
        let a = m.alloc(10 * MIB, 0);
        let b = m.alloc(4 * MIB, 0);
        m.free(a);
        let c = m.alloc(12 * MIB, 0);
        m.free(b);
        m.free(c);
        (a, b, c)
    };
    let first = pass(&mut m);
    assert_eq!(first, (BASE, BASE + 10 * MIB, BASE + 14 * MIB));
    // A map for A, one for B; for C an alias of A's five freed pages and one new page.
    assert_eq!(device_calls(&m), (4, 0));
    let layout = m.0.layout();
    // The lent block (A's old place) is not listed: one expandable segment of B and C.
    assert_eq!(layout.len(), 1);
    assert_eq!(
        (layout[0].address, layout[0].size),
        (BASE + 10 * MIB, 16 * MIB)
    );
    assert_eq!(m.allocated_reserved(), (0, (16 * MIB) as i64));
    assert_eq!(m.0.device_used(), 16 * MIB);
    for _ in 0..4 {
        assert_eq!(pass(&mut m), first);
        assert_eq!(device_calls(&m), (4, 0));
        assert_eq!(m.0.layout(), layout);
    }
    // Releasing: the lent block's mappings, then the 16 MiB of pages.
    m.empty_cache();
    assert_eq!(device_calls(&m), (4, 2));
    assert_eq!(m.0.device_used(), 0);
}

#[test]
fn page_aliasing_keeps_memory_counted_once_however_many_places_map_it() {
    let mut m = aliasing(GIB);
    let a = m.alloc(10 * MIB, 0);
    let b = m.alloc(4 * MIB, 0);
    m.free(a);
    // C's first 10 MiB are A's pages, mapped a second time: reserved and the device's
    // used memory count them once.
    let c = m.alloc(12 * MIB, 0);
    assert_eq!(
        m.allocated_reserved(),
        ((16 * MIB) as i64, (16 * MIB) as i64)
    );
    assert_eq!(m.0.device_used(), 16 * MIB);
    assert_eq!(m.block_state(a), None, "A's old place is lent: not listed");
    m.free(b);
    m.free(c);
}

#[test]
fn rule_22c_rehoming_a_lent_block_whose_page_has_its_home_just_before_it_keeps_the_layout() {
    // The model's twin of the allocator's test of the same name (offsets in MiB, 2 MiB pages):
    // the lent [12, 14) maps Z's page, at home in the slot [10, 12) just before it inside the
    // free [6, 12); a 2 MiB request re-homes it, carving [10, 12) (which merges with it) and
    // taking [12, 14) out of the merged lent block's middle.
    let mut m = aliasing(64 * GIB);
    let [w, x, h, z] = [4, 2, 6, 2].map(|mb| m.alloc(mb * MIB, 0));
    assert_eq!([w, x, h, z].map(|a| (a - BASE) / MIB), [0, 4, 6, 12]);
    m.free(h);
    // G borrows H's three pages (one alias) and maps one new page; H's place is lent.
    let g = m.alloc(8 * MIB, 0);
    assert_eq!(g, BASE + 14 * MIB);
    assert_eq!(device_calls(&m), (6, 0));
    // Rule 22g: the lent [6, 12) is unmapped, a hole between X and Z; G keeps its pages.
    m.empty_cache();
    assert_eq!(device_calls(&m), (6, 1));
    assert_eq!(
        m.allocated_reserved(),
        ((16 * MIB) as i64, (16 * MIB) as i64)
    );
    m.free(w);
    m.free(z);
    // R grows into the hole borrowing W's two pages, then Z's one into [10, 12).
    let r = m.alloc(6 * MIB, 0);
    assert_eq!(r, BASE + 6 * MIB);
    assert_eq!(device_calls(&m), (8, 1));
    m.free(r);
    // The lent [12, 14) is smaller than the free [6, 12): re-homed, no device call.
    let y = m.alloc(2 * MIB, 0);
    assert_eq!(y, BASE + 12 * MIB);
    assert_eq!(device_calls(&m), (8, 1));
    assert_eq!(
        m.allocated_reserved(),
        ((12 * MIB) as i64, (16 * MIB) as i64)
    );
    assert_eq!(m.0.device_used(), 16 * MIB);
    // Runs of mapped blocks (rule 19h): X and the free [6, 10), ended by the lent [10, 12);
    // then Y and G.
    let runs: Vec<(u64, Vec<(u64, BlockState)>)> =
        m.0.layout()
            .iter()
            .map(|s| {
                (
                    (s.address - BASE) / MIB,
                    s.blocks.iter().map(|b| (b.size / MIB, b.state)).collect(),
                )
            })
            .collect();
    assert_eq!(
        runs,
        [
            (4, vec![(2, BlockState::Allocated), (4, BlockState::Free)]),
            (
                12,
                vec![(2, BlockState::Allocated), (8, BlockState::Allocated)]
            ),
        ]
    );
    for a in [y, x, g] {
        m.free(a);
    }
    m.empty_cache();
    assert_eq!(m.0.device_used(), 0);
    assert_eq!(m.allocated_reserved(), (0, 0));
}

#[test]
fn rule_19j_a_handle_size_is_unset_or_whole_mib_from_2_mib_to_2_to_the_20_mib_and_not_beside_aliasing()
 {
    let mut c = ModelConfig::pytorch_defaults(GIB);
    assert!(c.expandable_handle_is_valid(), "unset");
    for (handle, valid) in [
        (2 * MIB, true),
        (3 * MIB, true),
        ((1 << 20) * MIB, true),
        (MIB, false),
        (0, false),
        (2 * MIB + 512, false),
        ((1 << 20) * MIB + MIB, false),
    ] {
        c.expandable_handle = Some(handle);
        assert_eq!(c.expandable_handle_is_valid(), valid, "{handle}");
    }
    c.expandable_handle = Some(4 * MIB);
    c.page_aliasing = true;
    assert!(!c.expandable_handle_is_valid(), "beside page aliasing");
    c.expandable_handle = None;
    assert!(
        c.expandable_handle_is_valid(),
        "unset, beside page aliasing"
    );
}

#[test]
fn rule_17a_a_request_of_exactly_the_largest_size_frees_parked_blocks_before_it_fails() {
    // The model's twin of the front end's test: 2^60 bytes is admitted by rule 1, so it is a
    // request like any other and parked blocks are freed before the device refuses it.
    let mut config = ModelConfig::pytorch_defaults(GIB);
    config.thread_cache_blocks = 8;
    let mut m = Model::new(config);
    let a = m.malloc_on(1, 4096, 0).unwrap();
    m.free_on(1, a).unwrap();
    assert_eq!(m.stats().allocated_bytes.all.current, 4096, "parked");
    assert!(m.malloc_on(1, 1 << 60, 0).is_err());
    assert_eq!(
        m.stats().allocated_bytes.all.current,
        0,
        "freed before the refusal"
    );
}

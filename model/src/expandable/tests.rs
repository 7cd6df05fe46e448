//! Unit tests of `expandable.rs`.
use super::*;
use crate::device::DEVICE_BASE;
use crate::{AdoptedBlock, AdoptedSegment, AdoptedState, ModelBlock, ModelConfig, ModelError};

const MIB: u64 = 1 << 20;
const BASE: u64 = DEVICE_BASE;

fn config(capacity: u64) -> ModelConfig {
    let mut config = ModelConfig::pytorch_defaults(capacity);
    config.expandable_segments = true;
    config
}

fn model(capacity: u64) -> Model {
    Model::new(config(capacity))
}

/// Every range's blocks as `(offset from the range's base, size, state)`, ranges in
/// address order; the state is "alloc", "free", "pending" or "unmapped".
fn ranges(m: &Model) -> Vec<Vec<(u64, u64, &'static str)>> {
    m.segments
        .iter()
        .filter(|s| s.expandable)
        .map(|range| {
            range
                .blocks
                .iter()
                .map(|b| {
                    let state = match (b.mapped, b.state) {
                        (false, _) => "unmapped",
                        (true, BlockState::Free) => "free",
                        (true, BlockState::Allocated) => "alloc",
                        (true, BlockState::Pending) => "pending",
                        (true, BlockState::Held) => "held",
                    };
                    (b.address - range.address, b.size, state)
                })
                .collect()
        })
        .collect()
}

/// Every step keeps the invariants.
fn malloc(m: &mut Model, size: u64, stream: u64) -> Result<u64, ModelError> {
    let result = m.malloc(size, stream);
    m.check_invariants().unwrap();
    result
}

fn free(m: &mut Model, address: u64) {
    m.free(address).unwrap();
    m.check_invariants().unwrap();
}

fn empty_cache(m: &mut Model) {
    m.empty_cache();
    m.check_invariants().unwrap();
}

#[test]
fn ranges_are_sized_from_the_capacity_in_whole_pages() {
    // 1 GiB + 128 MiB = 1152 MiB: 57.6 large pages → 58, 576 small pages.
    assert_eq!(range_size(20 * MIB, 1 << 30), Some(1160 * MIB));
    assert_eq!(range_size(SMALL_PAGE, 1 << 30), Some(1152 * MIB));
    // 70 MiB + 8.75 MiB → 4 large pages of 20 MiB, 40 of 2 MiB.
    assert_eq!(range_size(20 * MIB, 70 * MIB), Some(80 * MIB));
    assert_eq!(range_size(2 * MIB, 70 * MIB), Some(80 * MIB));
    // 96 MiB + 12 MiB → 6 pages of 20 MiB, 54 of 2 MiB.
    assert_eq!(range_size(20 * MIB, 96 * MIB), Some(120 * MIB));
    assert_eq!(range_size(2 * MIB, 96 * MIB), Some(108 * MIB));
    assert_eq!(range_size(20 * MIB, 0), None);
}

#[test]
fn a_first_request_maps_one_page_at_the_range_base_and_is_handed_its_start() {
    let mut m = model(1 << 30);
    assert_eq!(malloc(&mut m, 3 * MIB, 0), Ok(BASE));
    assert_eq!(
        ranges(&m),
        vec![vec![
            (0, 3 * MIB, "alloc"),
            (3 * MIB, 17 * MIB, "free"),
            (20 * MIB, 1140 * MIB, "unmapped"),
        ]]
    );
    let st = m.stats();
    assert_eq!(st.reserved_bytes.all.current, (20 * MIB) as i64);
    assert_eq!(st.reserved_bytes.large_pool.current, (20 * MIB) as i64);
    assert_eq!(st.num_device_alloc, 1);
    assert_eq!(st.segment.all.current, 0);
    assert_eq!(st.segment.all.allocated, 0);
    assert_eq!(st.allocation.all.current, 1);
    assert_eq!(m.device_used(), 20 * MIB);
    assert_eq!(
        m.layout(),
        vec![ModelSegment {
            address: BASE,
            size: 20 * MIB,
            stream: 0,
            small: false,
            blocks: vec![
                ModelBlock {
                    address: BASE,
                    size: 3 * MIB,
                    requested: 3 * MIB,
                    state: BlockState::Allocated,
                },
                ModelBlock {
                    address: BASE + 3 * MIB,
                    size: 17 * MIB,
                    requested: 0,
                    state: BlockState::Free,
                },
            ],
            expandable: true,
        }]
    );
}

#[test]
fn a_second_request_goes_right_after_the_first_without_mapping() {
    let mut m = model(1 << 30);
    malloc(&mut m, 3 * MIB, 0).unwrap();
    assert_eq!(malloc(&mut m, 3 * MIB, 0), Ok(BASE + 3 * MIB));
    assert_eq!(m.stats().num_device_alloc, 1);
    assert_eq!(m.device_used(), 20 * MIB);
    assert_eq!(
        ranges(&m)[0],
        vec![
            (0, 3 * MIB, "alloc"),
            (3 * MIB, 3 * MIB, "alloc"),
            (6 * MIB, 14 * MIB, "free"),
            (20 * MIB, 1140 * MIB, "unmapped"),
        ]
    );
}

#[test]
fn a_larger_request_maps_pages_after_the_free_tail_so_that_it_reaches_the_request() {
    let mut m = model(1 << 30);
    malloc(&mut m, 3 * MIB, 0).unwrap();
    malloc(&mut m, 3 * MIB, 0).unwrap();
    // The free 14 MiB at 6 MiB plus the unmapped space after it reach 30 MiB: one page
    // (16 MiB rounded up to 20) is mapped and merges with the tail.
    assert_eq!(malloc(&mut m, 30 * MIB, 0), Ok(BASE + 6 * MIB));
    assert_eq!(
        ranges(&m)[0],
        vec![
            (0, 3 * MIB, "alloc"),
            (3 * MIB, 3 * MIB, "alloc"),
            (6 * MIB, 30 * MIB, "alloc"),
            (36 * MIB, 4 * MIB, "free"),
            (40 * MIB, 1120 * MIB, "unmapped"),
        ]
    );
    let st = m.stats();
    assert_eq!(st.num_device_alloc, 2);
    assert_eq!(st.reserved_bytes.all.current, (40 * MIB) as i64);
    assert_eq!(m.layout().len(), 1);
    assert_eq!(m.layout()[0].size, 40 * MIB);
}

#[test]
fn freeing_everything_and_emptying_the_cache_unmaps_it_all_and_releases_the_range() {
    let mut m = model(1 << 30);
    let a = malloc(&mut m, 3 * MIB, 0).unwrap();
    let b = malloc(&mut m, 3 * MIB, 0).unwrap();
    let c = malloc(&mut m, 30 * MIB, 0).unwrap();
    for address in [a, b, c] {
        free(&mut m, address);
    }
    assert_eq!(
        ranges(&m)[0],
        vec![(0, 40 * MIB, "free"), (40 * MIB, 1120 * MIB, "unmapped")]
    );
    empty_cache(&mut m);
    let st = m.stats();
    assert_eq!(st.num_device_free, 1);
    assert_eq!(st.num_device_alloc, 2);
    assert_eq!(st.reserved_bytes.all.current, 0);
    assert_eq!(st.reserved_bytes.all.freed, (40 * MIB) as i64);
    assert_eq!(st.reserved_bytes.all.peak, (40 * MIB) as i64);
    assert!(m.layout().is_empty());
    assert!(m.segments.is_empty());
    assert!(m.device.reservations().is_empty());
    assert_eq!(m.device_used(), 0);
}

#[test]
fn unmapping_keeps_the_parts_of_a_free_block_outside_whole_pages() {
    let mut m = model(1 << 30);
    malloc(&mut m, 3 * MIB, 0).unwrap();
    let b = malloc(&mut m, 17 * MIB, 0).unwrap();
    let c = malloc(&mut m, 20 * MIB, 0).unwrap();
    assert_eq!(c, BASE + 20 * MIB);
    free(&mut m, b);
    free(&mut m, c);
    // Free [3, 40) MiB: only the page [20, 40) lies wholly inside it.
    empty_cache(&mut m);
    assert_eq!(
        ranges(&m)[0],
        vec![
            (0, 3 * MIB, "alloc"),
            (3 * MIB, 17 * MIB, "free"),
            (20 * MIB, 1140 * MIB, "unmapped"),
        ]
    );
    assert_eq!(m.stats().num_device_free, 1);
    assert_eq!(m.stats().reserved_bytes.all.current, (20 * MIB) as i64);
    // Nothing whole is left to unmap.
    empty_cache(&mut m);
    assert_eq!(m.stats().num_device_free, 1);
}

/// A range on 1 GiB of [A 20][unmapped 20][free 20][unmapped 1100] (MiB), A allocated.
fn range_with_a_hole(m: &mut Model) {
    let a = malloc(m, 20 * MIB, 0).unwrap();
    let b = malloc(m, 20 * MIB, 0).unwrap();
    let c = malloc(m, 20 * MIB, 0).unwrap();
    assert_eq!((a, b, c), (BASE, BASE + 20 * MIB, BASE + 40 * MIB));
    free(m, b);
    empty_cache(m);
    // The layout lists one expandable segment per run of mapped blocks.
    let layout = m.layout();
    let runs: Vec<(u64, u64, bool)> = layout
        .iter()
        .map(|s| (s.address, s.size, s.expandable))
        .collect();
    assert_eq!(
        runs,
        vec![(BASE, 20 * MIB, true), (BASE + 40 * MIB, 20 * MIB, true)]
    );
    free(m, c);
}

#[test]
fn rule_19b_a_hole_too_small_for_the_request_is_passed_over_for_the_tail() {
    // A, B, C mapped; B freed and its page unmapped: a 20 MiB hole between two allocated
    // blocks. A 40 MiB request cannot start there (its run ends at C after 20 MiB): it
    // starts at the unmapped tail after C.
    let mut m = model(1 << 30);
    let a = malloc(&mut m, 20 * MIB, 0).unwrap();
    let b = malloc(&mut m, 20 * MIB, 0).unwrap();
    let c = malloc(&mut m, 20 * MIB, 0).unwrap();
    free(&mut m, b);
    empty_cache(&mut m);
    assert_eq!(
        ranges(&m)[0][..3],
        [
            (0, 20 * MIB, "alloc"),
            (20 * MIB, 20 * MIB, "unmapped"),
            (40 * MIB, 20 * MIB, "alloc"),
        ]
    );
    assert_eq!(malloc(&mut m, 40 * MIB, 0), Ok(BASE + 60 * MIB));
    assert_eq!((a, c), (BASE, BASE + 40 * MIB));
}

#[test]
fn one_request_may_take_two_map_steps_through_an_unmapped_hole() {
    let mut m = model(1 << 30);
    range_with_a_hole(&mut m);
    assert_eq!(
        ranges(&m)[0],
        vec![
            (0, 20 * MIB, "alloc"),
            (20 * MIB, 20 * MIB, "unmapped"),
            (40 * MIB, 20 * MIB, "free"),
            (60 * MIB, 1100 * MIB, "unmapped"),
        ]
    );
    assert_eq!(m.stats().num_device_alloc, 3);
    // The hole is the start (A before it is allocated): its page is mapped and merges
    // with the free block after it (40 MiB), then one page of the tail (10 MiB → 20).
    assert_eq!(malloc(&mut m, 50 * MIB, 0), Ok(BASE + 20 * MIB));
    assert_eq!(
        ranges(&m)[0],
        vec![
            (0, 20 * MIB, "alloc"),
            (20 * MIB, 50 * MIB, "alloc"),
            (70 * MIB, 10 * MIB, "free"),
            (80 * MIB, 1080 * MIB, "unmapped"),
        ]
    );
    assert_eq!(m.stats().num_device_alloc, 5);
    assert_eq!(m.stats().reserved_bytes.all.current, (80 * MIB) as i64);
    assert_eq!(m.layout().len(), 1);
}

#[test]
fn a_map_step_that_does_not_fit_fails_and_earlier_steps_stay_mapped_until_released() {
    // 70 MiB: ranges of 80 MiB, four large pages.
    let mut m = model(70 * MIB);
    let a = malloc(&mut m, 20 * MIB, 0).unwrap();
    let b = malloc(&mut m, 20 * MIB, 0).unwrap();
    let c = malloc(&mut m, 20 * MIB, 0).unwrap();
    free(&mut m, b);
    empty_cache(&mut m);
    free(&mut m, c);
    assert_eq!(
        ranges(&m)[0],
        vec![
            (0, 20 * MIB, "alloc"),
            (20 * MIB, 20 * MIB, "unmapped"),
            (40 * MIB, 20 * MIB, "free"),
            (60 * MIB, 20 * MIB, "unmapped"),
        ]
    );
    // 50 MiB: the hole's page maps (60 MiB used), the tail's does not (80 > 70); rule 7d
    // unmaps the 40 MiB free block the first step made, and the retry's 60 MiB (three
    // pages) does not fit either.
    let error = malloc(&mut m, 50 * MIB, 0).unwrap_err();
    assert_eq!(
        error,
        ModelError::OutOfMemory {
            alloc_size: 50 * MIB,
            capacity: 70 * MIB,
            device_free: 50 * MIB,
            allowed: None,
            allocated: 20 * MIB,
            reserved_unallocated: 0,
        }
    );
    let st = m.stats();
    assert_eq!(st.num_device_alloc, 4);
    assert_eq!(st.num_device_free, 2);
    assert_eq!(st.num_alloc_retries, 1);
    assert_eq!(st.num_ooms, 1);
    // Mapped: 20 + 20 + 20 + 20 (the first step); unmapped: 20, then 40 at once.
    assert_eq!(st.reserved_bytes.all.allocated, (80 * MIB) as i64);
    assert_eq!(st.reserved_bytes.all.freed, (60 * MIB) as i64);
    assert_eq!(st.reserved_bytes.all.peak, (60 * MIB) as i64);
    assert_eq!(
        ranges(&m)[0],
        vec![(0, 20 * MIB, "alloc"), (20 * MIB, 60 * MIB, "unmapped")]
    );
    assert_eq!(a, BASE);
}

#[test]
fn the_out_of_memory_path_unmaps_free_pages_and_grows_again() {
    let mut m = model(70 * MIB);
    let x = malloc(&mut m, 20 * MIB, 1).unwrap();
    free(&mut m, x);
    // Stream 0 reserves its own range after stream 1's; its 60 MiB do not fit next to
    // stream 1's cached page, so rule 7d unmaps that page (stream 1's range is then
    // released) and the retry maps in the range already reserved.
    assert_eq!(malloc(&mut m, 60 * MIB, 0), Ok(BASE + 80 * MIB));
    let st = m.stats();
    assert_eq!(st.num_device_alloc, 2);
    assert_eq!(st.num_device_free, 1);
    assert_eq!(st.num_alloc_retries, 1);
    assert_eq!(st.num_ooms, 0);
    let bases: Vec<u64> = m.device.reservations().iter().map(|r| r.base).collect();
    assert_eq!(bases, vec![BASE + 80 * MIB]);
    assert_eq!(
        ranges(&m),
        vec![vec![
            (0, 60 * MIB, "alloc"),
            (60 * MIB, 20 * MIB, "unmapped")
        ]]
    );
}

#[test]
fn an_injected_failure_is_spent_by_one_map_step_and_the_retry_reuses_the_range() {
    let mut m = model(1 << 30);
    m.fail_next_device_allocs(1);
    assert_eq!(malloc(&mut m, 3 * MIB, 0), Ok(BASE));
    let st = m.stats();
    assert_eq!(st.num_device_alloc, 1);
    assert_eq!(st.num_device_free, 0);
    assert_eq!(st.num_alloc_retries, 1);
    assert_eq!(st.num_ooms, 0);
    assert_eq!(m.device.reservations().len(), 1);
}

#[test]
fn best_fit_prefers_a_hole_over_the_growable_tail_block() {
    let mut m = model(1 << 30);
    malloc(&mut m, 4 * MIB, 0).unwrap();
    let b = malloc(&mut m, 8 * MIB, 0).unwrap();
    malloc(&mut m, 2 * MIB, 0).unwrap();
    free(&mut m, b);
    assert_eq!(
        ranges(&m)[0],
        vec![
            (0, 4 * MIB, "alloc"),
            (4 * MIB, 8 * MIB, "free"),
            (12 * MIB, 2 * MIB, "alloc"),
            (14 * MIB, 6 * MIB, "free"),
            (20 * MIB, 1140 * MIB, "unmapped"),
        ]
    );
    // Rule 6 alone takes the 6 MiB tail (reach 6 + 1140 MiB); the 8 MiB hole's reach is
    // smaller, so it is taken.
    assert_eq!(malloc(&mut m, 5 * MIB, 0), Ok(BASE + 4 * MIB));
    assert_eq!(ranges(&m)[0][2], (9 * MIB, 3 * MIB, "free"));
    assert_eq!(m.stats().num_device_alloc, 1);
}

#[test]
fn the_small_pool_uses_two_mebibyte_pages_in_its_own_range() {
    let mut m = model(1 << 30);
    assert_eq!(malloc(&mut m, 1000, 0), Ok(BASE));
    assert_eq!(
        ranges(&m),
        vec![vec![
            (0, 1024, "alloc"),
            (1024, 2 * MIB - 1024, "free"),
            (2 * MIB, 1150 * MIB, "unmapped"),
        ]]
    );
    assert_eq!(
        m.stats().reserved_bytes.small_pool.current,
        (2 * MIB) as i64
    );
    // A large request reserves a large-pool range after the small one.
    assert_eq!(malloc(&mut m, 3 * MIB, 0), Ok(BASE + 1152 * MIB));
    // 1 MiB fits the small tail (2 MiB − 1 KiB); the next 1 MiB fits what is left of it
    // (1 MiB − 1 KiB) only with one more page.
    assert_eq!(malloc(&mut m, MIB, 0), Ok(BASE + 1024));
    assert_eq!(
        m.stats().reserved_bytes.small_pool.current,
        (2 * MIB) as i64
    );
    assert_eq!(malloc(&mut m, MIB, 0), Ok(BASE + MIB + 1024));
    let st = m.stats();
    assert_eq!(st.reserved_bytes.small_pool.current, (4 * MIB) as i64);
    assert_eq!(st.reserved_bytes.large_pool.current, (20 * MIB) as i64);
    assert_eq!(st.num_device_alloc, 3);
    let layout = m.layout();
    assert_eq!(layout.len(), 2);
    assert!(layout[0].small && layout[0].expandable && layout[0].size == 4 * MIB);
    assert!(!layout[1].small && layout[1].expandable && layout[1].size == 20 * MIB);
}

#[test]
fn each_stream_grows_its_own_range() {
    let mut m = model(1 << 30);
    assert_eq!(malloc(&mut m, 3 * MIB, 0), Ok(BASE));
    assert_eq!(malloc(&mut m, 3 * MIB, 1), Ok(BASE + 1160 * MIB));
    let streams: Vec<u64> = m.layout().iter().map(|s| s.stream).collect();
    assert_eq!(streams, vec![0, 1]);
    assert_eq!(m.stats().num_device_alloc, 2);
}

#[test]
fn found_blocks_split_whenever_512_bytes_remain_whatever_max_split_size_says() {
    let mut c = config(1 << 30);
    c.max_split_size = 20 * MIB;
    let mut m = Model::new(c);
    // At max_split_size: rule 13 would not split; rule 19c does (10 MiB remain).
    assert_eq!(malloc(&mut m, 30 * MIB, 0), Ok(BASE));
    // 512 B remain: rule 13 would keep them in the block (not more than 1 MiB).
    assert_eq!(malloc(&mut m, 10 * MIB - 512, 0), Ok(BASE + 30 * MIB));
    assert_eq!(
        ranges(&m)[0],
        vec![
            (0, 30 * MIB, "alloc"),
            (30 * MIB, 10 * MIB - 512, "alloc"),
            (40 * MIB - 512, 512, "free"),
            (40 * MIB, 1120 * MIB, "unmapped"),
        ]
    );
}

#[test]
fn growing_may_hand_out_a_cached_block_that_best_fit_refused() {
    // max_split_size 20 MiB: a 10 MiB request may not take the cached 60 MiB block, but
    // that block begins the start's run, is already large enough, and no page is mapped.
    let mut c = config(100 * MIB);
    c.max_split_size = 20 * MIB;
    let mut m = Model::new(c);
    let a = malloc(&mut m, 60 * MIB, 0).unwrap();
    free(&mut m, a);
    assert_eq!(malloc(&mut m, 10 * MIB, 0), Ok(BASE));
    assert_eq!(m.stats().num_device_alloc, 1);
    assert_eq!(
        ranges(&m)[0],
        vec![
            (0, 10 * MIB, "alloc"),
            (10 * MIB, 50 * MIB, "free"),
            (60 * MIB, 60 * MIB, "unmapped"),
        ]
    );
}

#[test]
fn blocks_of_a_range_never_count_as_inactive_split() {
    let mut m = model(1 << 30);
    let a = malloc(&mut m, 3 * MIB, 0).unwrap();
    let b = malloc(&mut m, 3 * MIB, 0).unwrap();
    let c = malloc(&mut m, 1000, 0).unwrap();
    malloc(&mut m, 3 * MIB, 0).unwrap();
    free(&mut m, b);
    free(&mut m, c);
    free(&mut m, a);
    let st = m.stats();
    for stat in [st.inactive_split, st.inactive_split_bytes] {
        assert_eq!(stat.all.current, 0);
        assert_eq!(stat.all.allocated, 0);
    }
}

#[test]
fn the_memory_fraction_check_uses_rule_4s_segment_size() {
    let mut c = config(1 << 30);
    // Exactly 45 MiB allowed.
    c.memory_fraction = Some(45.0 / 1024.0);
    let mut m = Model::new(c);
    malloc(&mut m, 3 * MIB, 0).unwrap();
    // One more page would reserve 40 MiB, but 20 + 30 (rule 4's size) > 45: refused
    // without asking the device, twice (rule 7d unmaps nothing whole).
    let error = malloc(&mut m, 30 * MIB, 0).unwrap_err();
    assert_eq!(
        error,
        ModelError::OutOfMemory {
            alloc_size: 30 * MIB,
            capacity: 1 << 30,
            device_free: 1004 * MIB,
            allowed: Some(45 * MIB),
            allocated: 3 * MIB,
            reserved_unallocated: 17 * MIB,
        }
    );
    assert_eq!(m.stats().num_device_alloc, 1);
    assert_eq!(m.stats().num_alloc_retries, 1);
    // 20 + 24 ≤ 45: the same page is mapped.
    assert_eq!(malloc(&mut m, 24 * MIB, 0), Ok(BASE + 3 * MIB));
    assert_eq!(m.stats().reserved_bytes.all.current, (40 * MIB) as i64);
}

#[test]
fn a_segment_overlapping_a_range_cannot_be_adopted() {
    let mut m = model(1 << 30);
    malloc(&mut m, 3 * MIB, 0).unwrap();
    // Inside the range's unmapped address space.
    let inside = AdoptedSegment {
        address: BASE + 100 * MIB,
        size: 20 * MIB,
        stream: 0,
        small: false,
        blocks: vec![AdoptedBlock {
            size: 20 * MIB,
            state: AdoptedState::Free,
        }],
    };
    assert!(matches!(
        m.adopt_segment(inside),
        Err(ModelError::InvalidAdoption { .. })
    ));
    m.check_invariants().unwrap();
}

#[test]
fn a_device_without_memory_reserves_no_range() {
    let mut m = model(0);
    assert!(matches!(
        malloc(&mut m, 3 * MIB, 0),
        Err(ModelError::OutOfMemory { .. })
    ));
    assert!(m.device.reservations().is_empty());
    assert_eq!(m.stats().num_device_alloc, 0);
}

#[test]
fn pending_blocks_are_neither_merged_nor_part_of_the_start() {
    let mut m = model(1 << 30);
    malloc(&mut m, 3 * MIB, 0).unwrap();
    let b = malloc(&mut m, 17 * MIB, 0).unwrap();
    m.record_stream(b, 1).unwrap();
    free(&mut m, b);
    // [A 3][B 17 pending][unmapped]: 18 MiB starts at the unmapped block.
    assert_eq!(malloc(&mut m, 18 * MIB, 0), Ok(BASE + 20 * MIB));
    m.complete_stream(1);
    malloc(&mut m, 512, 0).unwrap();
    assert_eq!(
        ranges(&m)[0][..3],
        [
            (0, 3 * MIB, "alloc"),
            (3 * MIB, 17 * MIB, "free"),
            (20 * MIB, 18 * MIB, "alloc"),
        ]
    );
}

#[test]
fn a_corrupted_range_is_reported() {
    let mut m = model(1 << 30);
    malloc(&mut m, 3 * MIB, 0).unwrap();
    let good = m.clone();
    // Cut the unmapped tail in two at a page boundary.
    let blocks = &mut m.segments[0].blocks;
    let tail = blocks.pop().unwrap();
    blocks.push(Block::unmapped(tail.address, 20 * MIB));
    blocks.push(Block::unmapped(
        tail.address + 20 * MIB,
        tail.size - 20 * MIB,
    ));
    let error = m.check_invariants().unwrap_err();
    assert!(
        error.to_string().contains("two adjacent unmapped blocks"),
        "{error}"
    );
    // Move the tail's start off the page.
    let mut m = good.clone();
    let blocks = &mut m.segments[0].blocks;
    blocks[1].size -= 512;
    blocks[2].address -= 512;
    blocks[2].size += 512;
    let error = m.check_invariants().unwrap_err();
    assert!(
        error.to_string().contains("not aligned to the page"),
        "{error}"
    );
    // A mapped block the device does not know of.
    let mut m = good;
    let blocks = &mut m.segments[0].blocks;
    blocks[1].size += 20 * MIB;
    blocks[2].address += 20 * MIB;
    blocks[2].size -= 20 * MIB;
    assert!(m.check_invariants().is_err());
}

#[test]
fn rule_19_an_unmapped_block_holds_nothing() {
    fn unmapped(m: &mut Model) -> &mut crate::state::Block {
        m.segments[0]
            .blocks
            .iter_mut()
            .find(|b| !b.mapped && !b.lent)
            .expect("the range's unmapped rest")
    }
    let mut m = model(1 << 30);
    let a = malloc(&mut m, 3 * MIB, 0).unwrap();
    free(&mut m, a);
    let good = m.clone();
    // Corrupt: the unmapped (free) block counts requested bytes.
    unmapped(&mut m).requested = 512;
    let error = m.check_invariants().unwrap_err();
    assert!(
        error.to_string().contains("unmapped block holds state"),
        "{error}"
    );
    // Corrupt: it lists a stream that used it.
    let mut m = good;
    unmapped(&mut m).stream_uses.push(1);
    let error = m.check_invariants().unwrap_err();
    assert!(
        error.to_string().contains("unmapped block holds state"),
        "{error}"
    );
}

#[test]
fn rule_19_a_free_block_of_a_range_holds_nothing() {
    let mut m = model(1 << 30);
    let a = malloc(&mut m, 3 * MIB, 0).unwrap();
    free(&mut m, a);
    let good = m.clone();
    // Corrupt: the free mapped block still counts requested bytes.
    let block = m.segments[0]
        .blocks
        .iter_mut()
        .find(|b| b.mapped && b.state == BlockState::Free)
        .expect("a free mapped block");
    block.requested = 512;
    let error = m.check_invariants().unwrap_err();
    assert!(
        error.to_string().contains("inconsistent Free block"),
        "{error}"
    );
    // Corrupt: it still lists a stream that used it.
    let mut m = good;
    let block = m.segments[0]
        .blocks
        .iter_mut()
        .find(|b| b.mapped && b.state == BlockState::Free)
        .expect("a free mapped block");
    block.stream_uses.push(1);
    let error = m.check_invariants().unwrap_err();
    assert!(
        error.to_string().contains("inconsistent Free block"),
        "{error}"
    );
}

#[test]
fn rule_19_an_allocated_block_of_a_range_holds_no_event() {
    let mut m = model(1 << 30);
    let a = malloc(&mut m, 3 * MIB, 0).unwrap();
    // Corrupt: an event of stream 1 names the allocated block, as if it were pending.
    m.events.push(crate::state::Event {
        stream: 1,
        block: a,
        complete: false,
    });
    let error = m.check_invariants().unwrap_err();
    assert!(
        error.to_string().contains("inconsistent Allocated block"),
        "{error}"
    );
}

/// Rule 19j's settings: 2 MiB pages, map steps of at least `threshold` MiB one handle.
fn handles_model(threshold: u64) -> Model {
    let mut c = config(1 << 30);
    c.expandable_page = 2 * MIB;
    c.expandable_handle = Some(threshold * MIB);
    Model::new(c)
}

#[test]
fn a_map_step_of_the_threshold_or_more_is_one_handle_and_a_smaller_one_a_handle_per_page() {
    let mut m = handles_model(8);
    malloc(&mut m, 10 * MIB, 0).unwrap();
    assert_eq!(m.handles_made(), 1, "10 MiB: one handle of five pages");
    malloc(&mut m, 6 * MIB, 0).unwrap();
    assert_eq!(
        m.handles_made(),
        4,
        "6 MiB, under the threshold: three one-page handles"
    );
    // The statistics count map steps, whatever their handles.
    assert_eq!(m.stats().num_device_alloc, 2);
    // Without the key, a handle per page.
    let mut per_page = model(1 << 30);
    per_page.config.expandable_page = 2 * MIB;
    malloc(&mut per_page, 10 * MIB, 0).unwrap();
    assert_eq!(per_page.handles_made(), 5);
}

#[test]
fn a_handle_of_several_pages_is_unmapped_only_whole() {
    let mut m = handles_model(8);
    let big = malloc(&mut m, 10 * MIB, 0).unwrap();
    free(&mut m, big);
    // A 3 MiB block now splits the handle's first page: the free rest [3, 10) MiB holds whole
    // pages but no whole handle, so a release unmaps nothing.
    let small = malloc(&mut m, 3 * MIB, 0).unwrap();
    assert_eq!(small, BASE);
    empty_cache(&mut m);
    assert_eq!(m.stats().reserved_bytes.all.current, (10 * MIB) as i64);
    assert_eq!(m.stats().num_device_free, 0);
    // With a handle per page the same release gives back the three whole pages of [4, 10).
    let mut per_page = model(1 << 30);
    per_page.config.expandable_page = 2 * MIB;
    let big = malloc(&mut per_page, 10 * MIB, 0).unwrap();
    free(&mut per_page, big);
    malloc(&mut per_page, 3 * MIB, 0).unwrap();
    empty_cache(&mut per_page);
    assert_eq!(
        per_page.stats().reserved_bytes.all.current,
        (4 * MIB) as i64
    );
    // Once the handle is wholly free it goes, in one unmap.
    free(&mut m, small);
    empty_cache(&mut m);
    assert_eq!(m.stats().reserved_bytes.all.current, 0);
    assert_eq!(m.stats().num_device_free, 1);
    assert!(
        ranges(&m).is_empty(),
        "the range gave its address space back"
    );
}

#[test]
fn the_whole_handles_of_a_free_block_run_from_the_first_inside_to_the_end_of_the_last() {
    let mut m = handles_model(4);
    // Handles: [0, 2) one page (a 2 MiB step), [2, 8) six MiB, [8, 10) one page, [10, 16).
    let a = malloc(&mut m, 2 * MIB, 0).unwrap();
    let b = malloc(&mut m, 6 * MIB, 0).unwrap();
    let c = malloc(&mut m, 2 * MIB, 0).unwrap();
    let d = malloc(&mut m, 6 * MIB, 0).unwrap();
    assert_eq!(m.handles_made(), 4);
    let _keep = malloc(&mut m, 1 << 20, 0).unwrap();
    free(&mut m, b);
    free(&mut m, c);
    free(&mut m, d);
    // One free block [2, 16): the handles [2, 8), [8, 10), [10, 16) lie inside it.
    let range = &m
        .segments
        .iter()
        .find(|s| s.expandable && s.pool == rules::Pool::Large);
    let base = range.expect("a large range").address;
    assert_eq!(
        m.whole_handles(base, 2 * MIB, base + 2 * MIB, base + 16 * MIB),
        Some((base + 2 * MIB, base + 16 * MIB))
    );
    // [3, 15) cuts the first and the last: only [8, 10) lies inside.
    assert_eq!(
        m.whole_handles(base, 2 * MIB, base + 3 * MIB, base + 15 * MIB),
        Some((base + 8 * MIB, base + 10 * MIB))
    );
    // [3, 7) lies inside one handle: none.
    assert_eq!(
        m.whole_handles(base, 2 * MIB, base + 3 * MIB, base + 7 * MIB),
        None
    );
    empty_cache(&mut m);
    assert_eq!(
        m.stats().reserved_bytes.large_pool.current,
        (2 * MIB) as i64
    );
    free(&mut m, a);
}

/// The adopted-range tests' device and range: (capacity, page, range size, address).
fn large_range_facts() -> (u64, u64, u64, u64) {
    let (capacity, page) = (64 * MIB, 20 * MIB);
    (capacity, page, range_size(page, capacity).unwrap(), 1 << 40)
}

/// A large-pool range of stream 0 at `address` with `blocks`, to adopt.
fn large_range(address: u64, blocks: Vec<AdoptedBlock>) -> crate::AdoptedRange {
    crate::AdoptedRange {
        address,
        stream: 0,
        small: false,
        blocks,
    }
}

#[test]
fn an_adopted_range_may_end_with_an_unmapped_block_reaching_its_end_but_none_before_an_unmapped_rest()
 {
    let (capacity, page, size, address) = large_range_facts();
    let range = |unmapped: u64| {
        large_range(
            address,
            vec![
                AdoptedBlock {
                    size: page,
                    state: AdoptedState::Allocated { requested: page },
                },
                AdoptedBlock {
                    size: unmapped,
                    state: AdoptedState::Unmapped,
                },
            ],
        )
    };
    // The blocks cover the whole range: no rest follows the unmapped block.
    let mut m = model(capacity);
    m.adopt_range(range(size - page)).unwrap();
    free(&mut m, address);
    m.check_invariants().unwrap();
    assert_eq!(ranges(&m)[0].len(), 2, "{:?}", ranges(&m));
    // The unmapped block stops short of the end: it lies next to the unmapped rest.
    let mut m = model(capacity);
    assert!(matches!(
        m.adopt_range(range(size - 2 * page)),
        Err(ModelError::InvalidAdoption { .. })
    ));
    assert!(m.device.reservations().is_empty());
}

#[test]
fn rule_18f_a_range_the_device_cannot_hold_reports_its_mapped_bytes_and_the_bytes_still_free() {
    // A 64 MiB device with one 20 MiB page mapped has 44 MiB free: a range whose first three
    // pages are mapped (60 MiB) does not fit, and the error gives the mapped bytes and the
    // device's free bytes.
    let (capacity, page, size, address) = large_range_facts();
    assert!(size >= 3 * page);
    let mut m = model(capacity);
    m.malloc(page, 0).unwrap();
    assert_eq!(m.device.used(), page);
    let range = large_range(
        address,
        vec![
            AdoptedBlock {
                size: 2 * page,
                state: AdoptedState::Free,
            },
            AdoptedBlock {
                size: page,
                state: AdoptedState::Allocated { requested: page },
            },
        ],
    );
    assert_eq!(
        m.adopt_range(range),
        Err(ModelError::AdoptionOutOfMemory {
            size: 3 * page,
            device_free: capacity - page,
        })
    );
    assert_eq!(ranges(&m).len(), 1);
}

#[test]
fn an_adopted_range_refuses_a_block_of_no_bytes_or_not_a_multiple_of_512() {
    // Rule 18a's block sizes, for a range (rule 18f): every block a nonzero multiple of 512,
    // even where the blocks still tile the range exactly.
    let (capacity, page, size, address) = large_range_facts();
    let range = |first: u64| {
        large_range(
            address,
            vec![
                AdoptedBlock {
                    size: first,
                    state: AdoptedState::Free,
                },
                AdoptedBlock {
                    size: page - first,
                    state: AdoptedState::Allocated {
                        requested: page - first,
                    },
                },
                AdoptedBlock {
                    size: size - page,
                    state: AdoptedState::Unmapped,
                },
            ],
        )
    };
    for first in [0, 100] {
        let mut m = model(capacity);
        let err = m.adopt_range(range(first)).unwrap_err();
        assert!(
            matches!(err, ModelError::InvalidAdoption { .. })
                && err.to_string().contains("nonzero multiple of 512"),
            "{first}: {err}"
        );
        assert!(m.device.reservations().is_empty());
    }
    // The same range with a first block of 512 bytes is adopted.
    let mut m = model(capacity);
    m.adopt_range(range(512)).unwrap();
    m.check_invariants().unwrap();
}

#[test]
fn rule_19s_page_is_an_even_number_of_mebibytes_from_2_to_1024() {
    let mut c = config(64 * MIB);
    for (page, valid) in [
        (0, false),
        (MIB, false),
        (2 * MIB, true),
        (3 * MIB, false),
        (20 * MIB, true),
        (1024 * MIB, true),
        (1026 * MIB, false),
    ] {
        c.expandable_page = page;
        assert_eq!(c.expandable_page_is_valid(), valid, "{page}");
    }
}

#[test]
fn the_checker_catches_segments_out_of_address_order() {
    // Two streams, two ranges, in address order; swapped, the invariant checks
    // (`check_segments`) refuse them.
    let mut m = model(64 * MIB);
    malloc(&mut m, 4 * MIB, 0).unwrap();
    malloc(&mut m, 4 * MIB, 1).unwrap();
    m.check_invariants().unwrap();
    assert_eq!(m.segments.len(), 2);
    m.segments.swap(0, 1);
    assert!(matches!(
        m.check_invariants(),
        Err(crate::invariants::InvariantViolation::SegmentsOutOfOrder { .. })
    ));
}

#[test]
fn rule_1s_limit_admits_a_request_of_exactly_2_to_the_60_bytes() {
    // Sizes in (0, 2^60] are requests (then out of memory on this device); above, too large.
    for expandable in [false, true] {
        let mut c = ModelConfig::pytorch_defaults(64 * MIB);
        c.expandable_segments = expandable;
        let mut m = Model::new(c);
        assert!(
            matches!(
                m.malloc(crate::MAX_ALLOC_SIZE, 0),
                Err(ModelError::OutOfMemory { .. })
            ),
            "{expandable}"
        );
        assert!(matches!(
            m.malloc(crate::MAX_ALLOC_SIZE + 1, 0),
            Err(ModelError::TooLarge { .. })
        ));
        m.check_invariants().unwrap();
    }
}

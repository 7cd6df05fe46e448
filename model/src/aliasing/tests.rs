//! Unit tests of `aliasing.rs`.
use crate::device::DEVICE_BASE;
use crate::{InvariantViolation, Model, ModelConfig};

const MIB: u64 = 1 << 20;
const BASE: u64 = DEVICE_BASE;

/// Rule 21's policy with page aliasing on or off: expandable segments, 2 MiB pages in
/// both pools, reclaim at 2.5 %, on 8 GiB.
fn config(aliasing: bool) -> ModelConfig {
    let mut c = ModelConfig::pytorch_defaults(8 << 30);
    c.expandable_segments = true;
    c.expandable_page = 2 * MIB;
    c.reclaim_headroom = Some(0.025);
    c.page_aliasing = aliasing;
    c
}

fn model() -> Model {
    Model::new(config(true))
}

fn check(m: &Model) {
    if let Err(e) = m.check_invariants() {
        panic!("{e}\n{:?}", blocks(m, 0));
    }
}

fn malloc(m: &mut Model, size: u64) -> u64 {
    let address = m.malloc(size, 0).unwrap();
    check(m);
    address
}

fn free(m: &mut Model, address: u64) {
    m.free(address).unwrap();
    check(m);
}

/// The blocks of range `r` as (offset MiB, size MiB, kind), the unmapped tail left out.
fn blocks(m: &Model, r: usize) -> Vec<(u64, u64, &'static str)> {
    let range = &m.segments[r];
    let mut out: Vec<(u64, u64, &'static str)> = range
        .blocks
        .iter()
        .map(|b| {
            let kind = match (b.mapped, b.lent, b.state) {
                (false, true, _) => "lent",
                (false, false, _) => "unmapped",
                (true, _, crate::BlockState::Free) => "free",
                (true, _, crate::BlockState::Allocated) => "alloc",
                (true, _, crate::BlockState::Pending) => "pending",
                (true, _, crate::BlockState::Held) => "held",
            };
            ((b.address - range.address) / MIB, b.size / MIB, kind)
        })
        .collect();
    if out.last().is_some_and(|b| b.2 == "unmapped") {
        out.pop();
    }
    out
}

fn calls(m: &Model) -> (u64, u64) {
    let st = m.stats();
    (st.num_device_alloc, st.num_device_free)
}

fn reserved(m: &Model) -> u64 {
    m.stats().reserved_bytes.all.current as u64
}

/// The brief's pass: A 10 MiB, B 4 MiB, free A, C 12 MiB, free B, free C.
fn pass(m: &mut Model) -> [u64; 3] {
    let a = malloc(m, 10 * MIB);
    let b = malloc(m, 4 * MIB);
    free(m, a);
    let c = malloc(m, 12 * MIB);
    free(m, b);
    free(m, c);
    [a, b, c]
}

#[test]
fn the_first_pass_aliases_the_freed_pages_of_a_for_c_and_maps_one_new_page() {
    let mut m = model();
    let a = malloc(&mut m, 10 * MIB);
    let b = malloc(&mut m, 4 * MIB);
    assert_eq!((a, b), (BASE, BASE + 10 * MIB));
    assert_eq!(calls(&m), (2, 0));
    free(&mut m, a);
    // w = max(14, 4 + 12) = 16, limit 16 MiB + 409.6 KiB; 14 + 12 > limit: borrow
    // min(6, ⌈9.6 / 2⌉) = 5 pages, all of A's freed block, in one alias call; then one
    // new page.
    let c = malloc(&mut m, 12 * MIB);
    assert_eq!(c, BASE + 14 * MIB);
    assert_eq!(
        blocks(&m, 0),
        vec![(0, 10, "lent"), (10, 4, "alloc"), (14, 12, "alloc")]
    );
    assert_eq!(calls(&m), (4, 0));
    assert_eq!(reserved(&m), 16 * MIB);
    assert_eq!(m.device_used(), 16 * MIB);
    let st = m.stats();
    assert_eq!(st.reserved_bytes.all.allocated, (16 * MIB) as i64);
    assert_eq!(st.reserved_bytes.all.freed, 0);
    // Lent blocks are not listed and end a run: one segment, B and C.
    let layout = m.layout();
    assert_eq!(layout.len(), 1);
    assert_eq!(
        (layout[0].address, layout[0].size),
        (BASE + 10 * MIB, 16 * MIB)
    );
    free(&mut m, b);
    free(&mut m, c);
    assert_eq!(blocks(&m, 0), vec![(0, 10, "lent"), (10, 16, "free")]);
}

#[test]
fn later_passes_re_home_the_lent_block_without_a_device_call_and_end_as_the_first() {
    let mut m = model();
    let first = pass(&mut m);
    let layout = m.layout();
    let ranges = blocks(&m, 0);
    assert_eq!(calls(&m), (4, 0));
    for _ in 0..4 {
        let a = malloc(&mut m, 10 * MIB);
        // A re-homes the lent block (smaller than the free 16 MiB): its homes are
        // carved out of the free block, which keeps 4 MiB before and 2 MiB after them.
        assert_eq!(
            blocks(&m, 0),
            vec![
                (0, 10, "alloc"),
                (10, 4, "free"),
                (14, 10, "lent"),
                (24, 2, "free")
            ]
        );
        // B: the lent block's pages are busy now (their homes are under A).
        let b = malloc(&mut m, 4 * MIB);
        free(&mut m, a);
        // C: growth starts at the lent block (usable again) and runs over the free
        // 2 MiB after it; the homes (A's free block) lie outside the run.
        let c = malloc(&mut m, 12 * MIB);
        assert_eq!([a, b, c], first);
        free(&mut m, b);
        free(&mut m, c);
        assert_eq!(calls(&m), (4, 0));
        assert_eq!(m.layout(), layout);
        assert_eq!(blocks(&m, 0), ranges);
        assert_eq!(reserved(&m), 16 * MIB);
    }
}

#[test]
fn without_aliasing_rule_20_unmaps_and_maps_again_before_its_layout_settles() {
    let mut m = Model::new(config(false));
    pass(&mut m);
    // Rule 20 unmaps A's free pages for C.
    assert_eq!(calls(&m), (3, 1));
    // The second pass unmaps twice and maps once more; then the layout serves the pass.
    pass(&mut m);
    assert_eq!(calls(&m), (4, 3));
    assert_eq!(
        blocks(&m, 0),
        vec![(0, 12, "free"), (12, 8, "unmapped"), (20, 4, "free")]
    );
    pass(&mut m);
    assert_eq!(calls(&m), (4, 3));
}

#[test]
fn page_aliasing_is_off_unless_set_and_needs_a_headroom_and_expandable_segments() {
    assert!(!ModelConfig::pytorch_defaults(1 << 30).page_aliasing);
    // No headroom: the same as without aliasing.
    let (mut on, mut off) = (config(true), config(false));
    on.reclaim_headroom = None;
    off.reclaim_headroom = None;
    let (mut on, mut off) = (Model::new(on), Model::new(off));
    pass(&mut on);
    pass(&mut off);
    assert_eq!(on.stats(), off.stats());
    assert_eq!(on.layout(), off.layout());
    // No expandable segments: the same as PyTorch's segments.
    let mut c = config(true);
    c.expandable_segments = false;
    let mut plain = config(false);
    plain.expandable_segments = false;
    let (mut on, mut off) = (Model::new(c), Model::new(plain));
    pass(&mut on);
    pass(&mut off);
    assert_eq!(on.stats(), off.stats());
    assert_eq!(on.layout(), off.layout());
}

#[test]
fn a_lent_candidate_smaller_than_rule_19as_is_handed_out_and_its_remainder_merges_after() {
    let mut m = model();
    pass(&mut m);
    // 9 MiB: rule 19a's candidate is the free 16 MiB; the lent 10 MiB block is smaller
    // and its first ⌈9 / 2⌉ = 5 slots are usable. Re-homed: 10 MiB, split at 9; the
    // remainder merges with the free 4 MiB carving left after it.
    assert_eq!(malloc(&mut m, 9 * MIB), BASE);
    assert_eq!(
        blocks(&m, 0),
        vec![
            (0, 9, "alloc"),
            (9, 5, "free"),
            (14, 10, "lent"),
            (24, 2, "free")
        ]
    );
    assert_eq!(calls(&m), (4, 0));
}

#[test]
fn only_the_first_slots_a_request_needs_are_re_homed() {
    let mut m = model();
    pass(&mut m);
    // 3 MiB: two slots of the lent block; the rest of it stays lent.
    assert_eq!(malloc(&mut m, 3 * MIB), BASE);
    assert_eq!(
        blocks(&m, 0),
        vec![
            (0, 3, "alloc"),
            (3, 1, "free"),
            (4, 6, "lent"),
            (10, 4, "free"),
            (14, 4, "lent"),
            (18, 8, "free"),
        ]
    );
    assert_eq!(reserved(&m), 16 * MIB);
}

/// [A 10][B 4][C 12] after the first pass's C, set up so that a later growth meets a
/// lent block: the homes of the lent block's pages are C's.
#[test]
fn a_run_holding_the_home_of_one_of_its_lent_slots_is_not_taken() {
    let mut m = model();
    pass(&mut m);
    // 26 MiB: no cached block. The lent block begins a run of 10 + 16 MiB, but its pages'
    // homes lie inside that run: not taken. The free 16 MiB before the unmapped tail is
    // the start; w = 26, limit 26.65 MiB; 16 + 10 ≤ limit: new pages, no borrowing.
    assert_eq!(malloc(&mut m, 26 * MIB), BASE + 10 * MIB);
    assert_eq!(blocks(&m, 0), vec![(0, 10, "lent"), (10, 26, "alloc")]);
    assert_eq!(calls(&m), (5, 0));
    assert_eq!(reserved(&m), 26 * MIB);
}

#[test]
fn a_failed_alias_changes_nothing_and_fails_the_map_step() {
    let mut m = model();
    let a = malloc(&mut m, 10 * MIB);
    let b = malloc(&mut m, 4 * MIB);
    free(&mut m, a);
    m.fail_next_device_allocs(1);
    // The alias fails: rule 7d releases A's free pages (one unmap) and the retry maps
    // six new pages after B (reserved 4 + 12 ≤ the limit: no borrowing).
    let c = malloc(&mut m, 12 * MIB);
    assert_eq!(c, BASE + 14 * MIB);
    assert_eq!(calls(&m), (3, 1));
    let st = m.stats();
    assert_eq!(st.num_alloc_retries, 1);
    assert_eq!(st.num_ooms, 0);
    assert_eq!(
        blocks(&m, 0),
        vec![(0, 10, "unmapped"), (10, 4, "alloc"), (14, 12, "alloc")]
    );
    free(&mut m, b);
    free(&mut m, c);
}

#[test]
fn releasing_unmaps_lent_blocks_first_then_the_free_pages_whose_memory_goes_back() {
    let mut m = model();
    pass(&mut m);
    assert_eq!(m.device.pages().len(), 8);
    m.empty_cache();
    check(&m);
    // One unmap for the lent block (no reserved bytes change), one for the free 16 MiB;
    // the range is left wholly unmapped and given back.
    assert_eq!(calls(&m), (4, 2));
    let st = m.stats();
    assert_eq!(st.reserved_bytes.all.freed, (16 * MIB) as i64);
    assert_eq!(m.device_used(), 0);
    assert!(m.device.reservations().is_empty());
    assert!(m.segments.is_empty() && m.pages.is_empty() && m.page_of.is_empty());
}

#[test]
fn only_free_blocks_of_the_requests_pool_and_stream_are_borrowed() {
    let mut m = model();
    // Stream 1 caches 10 MiB; stream 0's growth over the limit borrows nothing (rule 20
    // would have unmapped stream 1's block) and maps new pages.
    let x = m.malloc(10 * MIB, 1).unwrap();
    m.free(x).unwrap();
    let y = m.malloc(12 * MIB, 0).unwrap();
    check(&m);
    assert_eq!(calls(&m), (2, 0));
    assert_eq!(reserved(&m), 22 * MIB);
    assert!(m.segments.iter().all(|r| r.blocks.iter().all(|b| !b.lent)));
    m.free(y).unwrap();
}

/// Two holes of 4 MiB are borrowed by one 8 MiB request (two alias calls), then re-homed
/// back and forth until an 8 MiB lent block's pages have their homes in two free 4 MiB
/// blocks: [free 4][B 2][free 4][D 2][lent 8].
fn lent_block_over_two_holes(m: &mut Model) {
    let a = malloc(m, 4 * MIB);
    malloc(m, 2 * MIB);
    let c = malloc(m, 4 * MIB);
    malloc(m, 2 * MIB);
    free(m, a);
    free(m, c);
    // w = 12, limit 12.3 MiB; 8 + 8 > limit: 4 pages borrowed, 2 from each hole.
    let e = malloc(m, 8 * MIB);
    assert_eq!(e, BASE + 12 * MIB);
    assert_eq!(calls(m), (6, 0));
    assert_eq!(
        blocks(m, 0),
        vec![
            (0, 4, "lent"),
            (4, 2, "alloc"),
            (6, 4, "lent"),
            (10, 2, "alloc"),
            (12, 8, "alloc")
        ]
    );
    free(m, e);
    let f = malloc(m, 4 * MIB);
    let g = malloc(m, 4 * MIB);
    assert_eq!((f, g), (BASE, BASE + 6 * MIB));
    free(m, f);
    free(m, g);
    assert_eq!(
        blocks(m, 0),
        vec![
            (0, 4, "free"),
            (4, 2, "alloc"),
            (6, 4, "free"),
            (10, 2, "alloc"),
            (12, 8, "lent")
        ]
    );
    assert_eq!(calls(m), (6, 0));
}

#[test]
fn a_lent_block_serves_a_request_no_free_block_can() {
    let mut m = model();
    lent_block_over_two_holes(&mut m);
    assert_eq!(malloc(&mut m, 8 * MIB), BASE + 12 * MIB);
    assert_eq!(
        blocks(&m, 0),
        vec![
            (0, 4, "lent"),
            (4, 2, "alloc"),
            (6, 4, "lent"),
            (10, 2, "alloc"),
            (12, 8, "alloc")
        ]
    );
    assert_eq!(calls(&m), (6, 0));
}

#[test]
fn parked_blocks_stay_parked_when_a_usable_lent_block_serves_the_request() {
    let mut c = config(true);
    c.thread_cache_blocks = 8;
    let mut m = Model::new(c);
    lent_block_over_two_holes(&mut m);
    let x = m.malloc_on(1, 512, 0).unwrap();
    m.free_on(1, x).unwrap();
    assert_eq!(m.thread_cached_blocks(), 1);
    // Rule 17a's search finds the lent block: nothing is flushed.
    assert_eq!(m.malloc_on(1, 8 * MIB, 0), Ok(BASE + 12 * MIB));
    assert_eq!(m.thread_cached_blocks(), 1);
    check(&m);
}

#[test]
fn pages_are_lent_across_ranges_of_one_pool_and_stream() {
    // 20 MiB device: ranges of 24 MiB. C does not fit after B in the first range, so a
    // second is reserved; its first slots alias A's pages, which are in the first.
    let mut c = config(true);
    c.capacity = 20 * MIB;
    let mut m = Model::new(c);
    let first = pass(&mut m);
    let second = BASE + 24 * MIB;
    assert_eq!(first, [BASE, BASE + 10 * MIB, second]);
    assert_eq!(blocks(&m, 0), vec![(0, 10, "lent"), (10, 4, "free")]);
    assert_eq!(blocks(&m, 1), vec![(0, 12, "free")]);
    assert_eq!(calls(&m), (4, 0));
    assert_eq!(m.device_used(), 16 * MIB);
    // The second pass re-homes across the ranges too, without a device call.
    assert_eq!(pass(&mut m), first);
    assert_eq!(calls(&m), (4, 0));
    assert_eq!(blocks(&m, 0), vec![(0, 10, "lent"), (10, 4, "free")]);
    // Releasing: the lent block, then each range's free pages; both ranges go back.
    m.empty_cache();
    check(&m);
    assert_eq!(calls(&m), (4, 3));
    assert_eq!(m.device_used(), 0);
    assert!(m.device.reservations().is_empty());
}

#[test]
fn a_borrowed_page_lent_inside_the_run_is_not_taken_so_the_growth_ends() {
    // Found by a random search (1 GiB, 2 MiB pages, headroom 0), then shrunk. Before the
    // last request the range begins [free 3 (the home of page p)][6][5][unmapped 2]
    // [lent 2 (p)][unmapped 2][free 1]..., 48 MiB reserved, 40 requested, W 46. The
    // 7 MiB request's run starts at the unmapped 2 MiB and sums it, the lent block and
    // what follows. As written, its first map step borrows p from the free 3 MiB (the
    // only lender with a whole page): p's home moves into the start, and the step on the
    // lent block then carves it out again; the start never grows. The model's reading
    // passes over such a lender: the step maps a new page, and the growth ends.
    let mut c = ModelConfig::pytorch_defaults(1 << 30);
    c.expandable_segments = true;
    c.expandable_page = 2 * MIB;
    c.reclaim_headroom = Some(0.0);
    c.page_aliasing = true;
    let mut m = Model::new(c);
    let mut handles = std::collections::BTreeMap::new();
    // (handle, MiB) allocates; (handle, 0) frees; (0, 0) empties the cache.
    let ops: [(u32, u64); 42] = [
        (64, 2),
        (65, 8),
        (66, 8),
        (64, 0),
        (65, 0),
        (70, 3),
        (71, 6),
        (73, 7),
        (75, 5),
        (78, 4),
        (81, 7),
        (83, 5),
        (73, 0),
        (87, 3),
        (0, 0),
        (81, 0),
        (96, 3),
        (98, 4),
        (102, 2),
        (103, 3),
        (70, 0),
        (66, 0),
        (109, 2),
        (102, 0),
        (83, 0),
        (112, 4),
        (0, 0),
        (114, 5),
        (75, 0),
        (96, 0),
        (137, 4),
        (138, 4),
        (138, 0),
        (173, 2),
        (179, 2),
        (87, 0),
        (189, 2),
        (198, 4),
        (0, 0),
        (189, 0),
        (210, 3),
        (210, 0),
    ];
    for (handle, mib) in ops {
        match (handle, mib) {
            (0, 0) => m.empty_cache(),
            (h, 0) => m.free(handles.remove(&h).unwrap()).unwrap(),
            (h, mib) => {
                handles.insert(h, m.malloc(mib * MIB, 0).unwrap());
            }
        }
        check(&m);
    }
    assert_eq!(reserved(&m), 48 * MIB);
    assert_eq!(m.stats().requested_bytes.all.current, (40 * MIB) as i64);
    assert_eq!(
        blocks(&m, 0)[..7],
        [
            (0, 3, "free"),
            (3, 6, "alloc"),
            (9, 5, "alloc"),
            (14, 2, "unmapped"),
            (16, 2, "lent"),
            (18, 2, "unmapped"),
            (20, 1, "free"),
        ]
    );
    let (allocs, frees) = calls(&m);
    assert_eq!(malloc(&mut m, 7 * MIB), BASE + 14 * MIB);
    // A new page for the hole, p re-homed into the lent block (its old home carved: now
    // lent), a new page for the next hole; the free 1 MiB after it merges.
    assert_eq!(calls(&m), (allocs + 2, frees));
    assert_eq!(
        blocks(&m, 0)[..5],
        [
            (0, 2, "lent"),
            (2, 1, "free"),
            (3, 6, "alloc"),
            (9, 5, "alloc"),
            (14, 7, "alloc"),
        ]
    );
}

#[test]
fn a_corrupted_page_table_is_reported_by_part() {
    let mut m = model();
    let a = malloc(&mut m, 10 * MIB);
    let b = malloc(&mut m, 4 * MIB);
    free(&mut m, a);
    malloc(&mut m, 12 * MIB);
    let good = m.clone();
    // A mapped slot that maps no page.
    let mut bad = good.clone();
    bad.page_of.remove(&(BASE + 10 * MIB));
    assert!(matches!(
        bad.check_invariants(),
        Err(InvariantViolation::SlotWithoutPage { slot }) if slot == BASE + 10 * MIB
    ));
    // A page whose home is moved into the lent block.
    let mut bad = good.clone();
    let number = bad.page_of[&(BASE + 14 * MIB)];
    let page = bad.pages.get_mut(&number).unwrap();
    page.lent.retain(|&l| l != BASE);
    page.lent.push(BASE + 14 * MIB);
    page.home = BASE;
    assert!(matches!(
        bad.check_invariants(),
        Err(InvariantViolation::HomeNotMapped { .. })
    ));
    // A lent block cut in two.
    let mut bad = good.clone();
    let blocks = &mut bad.segments[0].blocks;
    blocks[0].size = 4 * MIB;
    blocks.insert(1, crate::state::Block::lent(BASE + 4 * MIB, 6 * MIB));
    assert!(matches!(
        bad.check_invariants(),
        Err(InvariantViolation::AdjacentLentBlocks { .. })
    ));
    // A lent block off the page.
    let mut bad = good.clone();
    let blocks = &mut bad.segments[0].blocks;
    blocks[0].size -= MIB;
    blocks.insert(1, crate::state::Block::unmapped(BASE + 9 * MIB, MIB));
    assert!(matches!(
        bad.check_invariants(),
        Err(InvariantViolation::LentBlockUnaligned { .. }) | Err(InvariantViolation::Range { .. })
    ));
    // The device maps a lent slot at a new page: more device memory than the model's pages.
    let mut bad = good.clone();
    bad.device.unmap(BASE, 2 * MIB);
    assert!(bad.device.map(BASE, 2 * MIB));
    let err = bad.check_invariants();
    assert!(
        matches!(err, Err(InvariantViolation::DeviceUsed { .. })),
        "{err:?}"
    );
    // The device maps a lent slot at the next slot's page: the same memory, other mappings.
    let mut bad = good.clone();
    bad.device.unmap(BASE, 2 * MIB);
    assert!(bad.device.alias(BASE, BASE + 2 * MIB, 2 * MIB));
    let err = bad.check_invariants();
    assert!(
        matches!(err, Err(InvariantViolation::DevicePageTable { .. })),
        "{err:?}"
    );
    // A page known at a slot no mapped block covers (past the last mapped slot).
    let mut bad = good.clone();
    let past = *bad.page_of.keys().last().unwrap() + 2 * MIB;
    bad.page_of.insert(past, bad.page_of[&BASE]);
    assert!(matches!(
        bad.check_invariants(),
        Err(InvariantViolation::PageOnUnmappedSlot { slot, .. }) if slot == past
    ));
    // A slot whose page does not list it: the first such slot is named.
    let mut bad = good.clone();
    let other = bad.page_of[&(BASE + 12 * MIB)];
    *bad.page_of.get_mut(&(BASE + 10 * MIB)).unwrap() = other;
    assert!(matches!(
        bad.check_invariants(),
        Err(InvariantViolation::PageTableInconsistent { slot, page })
            if slot == BASE + 10 * MIB && page == other
    ));
    // A page listing a slot twice.
    let mut bad = good.clone();
    let number = bad.page_of[&BASE];
    let page = bad.pages.get_mut(&number).unwrap();
    let again = page.lent[0];
    page.lent.push(again);
    assert!(matches!(
        bad.check_invariants(),
        Err(InvariantViolation::PageTableInconsistent { page, .. }) if page == number
    ));
    // B's page mapped under C too, on the device's table: two live blocks share it. The
    // model's own table is right, so the device's check is what names the two slots.
    let mut bad = good;
    bad.device.unmap(BASE + 14 * MIB, 2 * MIB);
    assert!(bad.device.alias(BASE + 14 * MIB, b, 2 * MIB));
    let err = bad.check_invariants();
    assert!(
        matches!(
            err,
            Err(InvariantViolation::DevicePageTable { .. })
                | Err(InvariantViolation::PageUnderTwoLiveBlocks { .. })
        ),
        "{err:?}"
    );
}

#[test]
fn two_live_blocks_over_one_device_page_are_named_by_the_lowest_second_slot() {
    let mut m = model();
    let a = malloc(&mut m, 4 * MIB);
    let b = malloc(&mut m, 4 * MIB);
    let c = malloc(&mut m, 4 * MIB);
    check(&m);
    // Both tables agree that c's first slot maps b's first page and c's second slot a's
    // first page (c's own pages gone): two pairs of live slots over one page each.
    let mut bad = m.clone();
    for (slot, source) in [(c, b), (c + 2 * MIB, a)] {
        let own = bad.page_of[&slot];
        bad.pages.remove(&own);
        let shared = bad.page_of[&source];
        bad.pages.get_mut(&shared).unwrap().lent.push(slot);
        bad.device.unmap(slot, 2 * MIB);
        assert!(bad.device.alias(slot, source, 2 * MIB));
    }
    // In address order, c is the first slot whose page was met before (at b).
    assert!(
        matches!(
            bad.check_device_pages(),
            Err(InvariantViolation::PageUnderTwoLiveBlocks { first, second })
                if first == b && second == c
        ),
        "{:?}",
        bad.check_device_pages()
    );
    assert!(m.check_device_pages().is_ok());
}

//! Rule 20: reclaim before growing (cachalot's own policy, `reclaim_headroom:H`).
//!
//! The one rule: when rule 19b is about to grow a range and reserved memory would then exceed
//! the *limit* — the requested high-water plus `H` of it — free mapped blocks of ranges first
//! unmap their whole pages (as rule 19e does), largest first, until it would not — all but
//! the free block rule 19b would grow from. Holes left
//! between live blocks are handed back before new memory is asked for.
//!
//! The model's reading of the rule where its text leaves a choice (each also named in the
//! comments below):
//! - rule 20 runs in every rule 19b call (rules 7b, 7c, 7d) that passes rule 19b's
//!   memory-fraction check (checked on the reserved bytes before reclaiming), whether or not
//!   rule 19b will then map anything;
//! - "largest first, then by address" is by ascending address among equal page bytes;
//! - the excluded start is found as rule 19b finds it, from the state before reclaiming,
//!   once, and whatever rule 19b's memory-fraction check would say;
//! - the stop test is made before each unmap (the first one already failed), and the list is
//!   made once, before any unmap, from the state at that moment.

use crate::Model;
use crate::rules::Pool;
use crate::state;

/// One block rule 20 may unmap: the bytes of the whole pages inside it and its address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Candidate {
    /// Bytes of the whole pages of its range inside the block.
    pub(crate) page_bytes: u64,
    /// The block's first byte.
    pub(crate) address: u64,
}

impl Model {
    /// Rule 20: before rule 19b grows for a request of `requested` bytes rounded to `rounded`
    /// in `pool` on `stream`, reclaim free pages of ranges while reserved memory plus what the
    /// growth may map exceeds the limit. Nothing when `reclaim_headroom` is unset.
    pub(crate) fn reclaim_before_growing(
        &mut self,
        pool: Pool,
        stream: u64,
        rounded: u64,
        requested: u64,
    ) {
        let Some(headroom) = self.config.reclaim_headroom else {
            return;
        };
        let limit = self.reclaim_limit(headroom, requested);
        // need = ⌈r / page⌉ × page, with the request's pool's page.
        let page = self.page_size(pool);
        let need = u128::from(rounded.div_ceil(page)) * u128::from(page);
        let over = |model: &Model| u128::from(model.reserved()) + need > limit;
        if !over(self) {
            return;
        }
        // Listed once, before any change.
        for candidate in self.reclaim_candidates(pool, stream, rounded) {
            // Stop as soon as reserved_bytes + need ≤ limit (else when the list is done).
            if !over(self) {
                break;
            }
            // As in rule 19e: the whole pages inside it; the statistics and a range left
            // wholly unmapped are handled there.
            self.unmap_whole_pages(candidate.address);
        }
    }

    /// Rule 20: `limit = w + ⌊w × H⌋` with `w = max(W, requested_bytes + size)`, the product
    /// in `f64`, floored.
    pub(crate) fn reclaim_limit(&self, headroom: f64, requested: u64) -> u128 {
        let requested_now = self.stats.requested_bytes.all.current as u64;
        let w = self
            .requested_high_water
            .max(requested_now.saturating_add(requested));
        let extra = (w as f64 * headroom).floor() as u64;
        u128::from(w) + u128::from(extra)
    }

    /// Rule 20's candidates for a growth of `rounded` bytes in `pool` on `stream`: the free
    /// mapped blocks of every range (both pools, every stream) holding at least one whole page
    /// of their range, except rule 19b's start for this request when it is a free block
    /// (found as rule 19b finds it, before reclaiming: unmapping it would only have the growth
    /// map it again); ordered by their whole-page bytes, largest first, then by address.
    pub(crate) fn reclaim_candidates(
        &self,
        pool: Pool,
        stream: u64,
        rounded: u64,
    ) -> Vec<Candidate> {
        // The start is an unmapped block, a free block, or none (a new range): only a free
        // one is excluded.
        let start = self.find_start(pool, stream, rounded).filter(|&address| {
            let (s, b) = state::find_block(&self.segments, address).expect("the start exists");
            self.segments[s].blocks[b].in_free_set()
        });
        let mut candidates = Vec::new();
        // Rule 23f: while stitching is on, only the request's pool (every stream; for a
        // small-pool request, its own stream's ranges).
        let own_pool_only = self.stitching();
        for range in self.segments.iter().filter(|s| s.expandable) {
            if own_pool_only && range.pool != pool {
                continue;
            }
            if own_pool_only && pool == Pool::Small && range.stream != stream {
                continue;
            }
            let page = self.page_size(range.pool);
            for block in &range.blocks {
                // Allocated and pending blocks are not free; unmapped ones hold nothing.
                if !block.in_free_set() || Some(block.address) == start {
                    continue;
                }
                let end = block.address + block.size;
                if let Some((first, last)) =
                    self.whole_handles(range.address, page, block.address, end)
                {
                    candidates.push(Candidate {
                        page_bytes: last - first,
                        address: block.address,
                    });
                }
            }
        }
        candidates.sort_by_key(|c| (std::cmp::Reverse(c.page_bytes), c.address));
        candidates
    }

    /// Rule 20's requested high-water `W`: the highest `requested_bytes.all` so far, which
    /// resetting the peak statistics does not lower.
    pub fn requested_high_water(&self) -> u64 {
        self.requested_high_water
    }
}

#[cfg(test)]
mod tests {
    use crate::device::DEVICE_BASE;
    use crate::rules::Pool;
    use crate::{Model, ModelConfig};

    const MIB: u64 = 1 << 20;
    const BASE: u64 = DEVICE_BASE;

    /// Expandable segments with 2 MiB pages in both pools on 1 GiB, reclaim with `headroom`.
    fn model(headroom: Option<f64>) -> Model {
        let mut c = ModelConfig::pytorch_defaults(1 << 30);
        c.expandable_segments = true;
        c.expandable_page = 2 * MIB;
        c.reclaim_headroom = headroom;
        Model::new(c)
    }

    fn malloc(m: &mut Model, size: u64, stream: u64) -> u64 {
        let address = m.malloc(size, stream).unwrap();
        m.check_invariants().unwrap();
        address
    }

    fn free(m: &mut Model, address: u64) {
        m.free(address).unwrap();
        m.check_invariants().unwrap();
    }

    /// The first range's blocks as (offset from BASE in MiB·2, size in MiB·2, kind) — half
    /// MiB units, so 1.5 MiB blocks read plainly.
    fn blocks(m: &Model, range: usize) -> Vec<(u64, u64, &'static str)> {
        let half = MIB / 2;
        m.segments[range]
            .blocks
            .iter()
            .map(|b| {
                let kind = match (b.mapped, b.state) {
                    (false, _) => "unmapped",
                    (true, crate::BlockState::Free) => "free",
                    (true, crate::BlockState::Allocated) => "alloc",
                    (true, crate::BlockState::Pending) => "pending",
                    (true, crate::BlockState::Held) => "held",
                };
                (
                    (b.address - m.segments[range].address) / half,
                    b.size / half,
                    kind,
                )
            })
            .collect()
    }

    fn reserved(m: &Model) -> u64 {
        m.stats().reserved_bytes.all.current as u64
    }

    /// [A 4][B 4 free][C 4][unmapped] (MiB): a hole between live blocks; 8 MiB requested,
    /// 12 MiB reserved, the high-water 12 MiB.
    fn hole_between_live_blocks(m: &mut Model) {
        malloc(m, 4 * MIB, 0);
        let b = malloc(m, 4 * MIB, 0);
        malloc(m, 4 * MIB, 0);
        free(m, b);
        assert_eq!(reserved(m), 12 * MIB);
        assert_eq!(m.requested_high_water(), 12 * MIB);
    }

    #[test]
    fn a_hole_between_live_blocks_is_unmapped_before_the_range_grows() {
        let mut m = model(Some(0.0));
        hole_between_live_blocks(&mut m);
        // w = max(12, 8 + 6) = 14 = limit; 12 + 6 > 14: the hole's two pages go (8 + 6 ≤ 14).
        assert_eq!(malloc(&mut m, 6 * MIB, 0), BASE + 12 * MIB);
        assert_eq!(
            blocks(&m, 0),
            vec![
                (0, 8, "alloc"),
                (8, 8, "unmapped"),
                (16, 8, "alloc"),
                (24, 12, "alloc"),
                (36, 2268, "unmapped"),
            ]
        );
        let st = m.stats();
        assert_eq!(st.reserved_bytes.all.current, (14 * MIB) as i64);
        assert_eq!(st.num_device_free, 1);
        assert_eq!(st.num_device_alloc, 4);
        assert_eq!(st.num_alloc_retries, 0);
    }

    #[test]
    fn with_stitching_a_small_pool_request_reclaims_only_its_own_streams_pages() {
        // Rule 23f: a small-pool request's candidates are its stream's small ranges; a
        // large-pool request's, the large pool's of every stream.
        let mut m = model(None);
        m.config.page_stitching = true;
        // Stream 0 and stream 1 each hold a small range with one free whole page: a 1 MiB
        // block at the start, the rest free ([A 1][free 3] MiB of two 2 MiB pages).
        for stream in [0, 1] {
            malloc(&mut m, MIB, stream);
            let t = malloc(&mut m, MIB, stream);
            let u = malloc(&mut m, MIB, stream);
            let v = malloc(&mut m, MIB, stream);
            free(&mut m, t);
            free(&mut m, u);
            free(&mut m, v);
        }
        m.config.reclaim_headroom = Some(0.0);
        let small_candidates = |m: &Model, stream: u64| -> Vec<u64> {
            m.reclaim_candidates(Pool::Small, stream, MIB)
                .iter()
                .map(|c| c.address)
                .collect()
        };
        // Stream 2 holds nothing: with stitching, no other stream's small page is its
        // candidate (streams 0 and 1 would map theirs again next pass).
        assert!(small_candidates(&m, 2).is_empty());
        // A large-pool request still takes the large pool's pages of every stream: none here.
        assert!(m.reclaim_candidates(Pool::Large, 2, 4 * MIB).is_empty());
        // Without stitching (rule 20 as written), both streams' free small pages are.
        m.config.page_stitching = false;
        assert_eq!(small_candidates(&m, 2).len(), 2);
        assert_eq!(m.reclaim_candidates(Pool::Large, 2, 4 * MIB).len(), 2);
    }

    #[test]
    fn reclaim_is_off_unless_a_headroom_is_set() {
        let mut m = model(None);
        hole_between_live_blocks(&mut m);
        assert_eq!(malloc(&mut m, 6 * MIB, 0), BASE + 12 * MIB);
        let st = m.stats();
        assert_eq!(st.reserved_bytes.all.current, (18 * MIB) as i64);
        assert_eq!(st.num_device_free, 0);
        assert_eq!(blocks(&m, 0)[1], (8, 8, "free"));
    }

    #[test]
    fn reclaim_changes_nothing_without_expandable_segments() {
        let mut c = ModelConfig::pytorch_defaults(1 << 30);
        c.reclaim_headroom = Some(0.0);
        let mut m = Model::new(c);
        let mut plain = Model::new(ModelConfig::pytorch_defaults(1 << 30));
        for m in [&mut m, &mut plain] {
            let a = malloc(m, 4 * MIB, 0);
            malloc(m, 4 * MIB, 0);
            free(m, a);
            malloc(m, 30 * MIB, 0);
        }
        assert_eq!(m.stats(), plain.stats());
        assert_eq!(m.layout(), plain.layout());
        assert_eq!(m.stats().num_device_free, 0);
    }

    #[test]
    fn the_free_block_where_growth_starts_is_not_reclaimed() {
        let mut m = model(Some(0.0));
        malloc(&mut m, 4 * MIB, 0);
        let b = malloc(&mut m, 4 * MIB, 0);
        free(&mut m, b);
        // [A 4][free 4][unmapped]: w = max(8, 4 + 6) = 10; 8 + 6 > 10, but the free block
        // is of this pool and stream and unmapped space follows it: growth starts there and
        // maps one page.
        assert_eq!(malloc(&mut m, 6 * MIB, 0), BASE + 4 * MIB);
        let st = m.stats();
        assert_eq!(st.num_device_free, 0);
        assert_eq!(st.num_device_alloc, 3);
        assert_eq!(st.reserved_bytes.all.current, (10 * MIB) as i64);
    }

    #[test]
    fn blocks_of_other_streams_and_of_the_other_pool_are_candidates() {
        // Set up without reclaim, then turn it on.
        let mut m = model(None);
        // Stream 1: [X 4][free 4][unmapped] — unmapped after it, but another stream's.
        malloc(&mut m, 4 * MIB, 1);
        let y = malloc(&mut m, 4 * MIB, 1);
        free(&mut m, y);
        // Stream 0, small pool: [s 512 B][free 4 MiB − 512][unmapped] once t and u are freed:
        // unmapped after it too, but in the other pool.
        malloc(&mut m, 512, 0);
        let t = malloc(&mut m, MIB, 0);
        let u = malloc(&mut m, MIB, 0);
        free(&mut m, t);
        free(&mut m, u);
        let small = m
            .segments
            .iter()
            .position(|s| s.pool == Pool::Small)
            .unwrap();
        let sizes: Vec<u64> = m.segments[small].blocks.iter().map(|b| b.size).collect();
        assert_eq!(sizes, vec![512, 4 * MIB - 512, 1148 * MIB]);
        assert_eq!(reserved(&m), 12 * MIB);
        m.config.reclaim_headroom = Some(0.0);
        // Candidates for stream 0's large pool: stream 1's 4 MiB (two pages) first, then
        // the small pool's block (one whole page, 2..4 MiB).
        let candidates: Vec<(u64, u64)> = m
            .reclaim_candidates(Pool::Large, 0, 8 * MIB)
            .iter()
            .map(|c| (c.page_bytes, c.address - BASE))
            .collect();
        assert_eq!(
            candidates,
            vec![(4 * MIB, 4 * MIB), (2 * MIB, 1152 * MIB + 512)]
        );
        // For stream 1's large pool, its own block is where growth starts: excluded.
        assert_eq!(m.reclaim_candidates(Pool::Large, 1, 8 * MIB).len(), 1);
        // W = 8 MiB, requested 4 MiB + 512: for 8 MiB more, w = limit = 12 MiB + 512;
        // 12 + 8 > limit; after both (6 + 8) still above: the list runs out, growth goes on.
        malloc(&mut m, 8 * MIB, 0);
        let st = m.stats();
        assert_eq!(st.num_device_free, 2);
        assert_eq!(st.reserved_bytes.small_pool.current, (2 * MIB) as i64);
        assert_eq!(st.reserved_bytes.all.current, (14 * MIB) as i64);
        // Stream 1's range keeps X; its unmapped part merged with the tail.
        let stream1 = m.segments.iter().find(|s| s.stream == 1).unwrap();
        assert_eq!(stream1.blocks.len(), 2);
    }

    /// [A 2][F 4 free][U 2 unmapped][C 2][unmapped] (MiB), set up without reclaim: F is
    /// followed by unmapped space but holds a run of only 6 MiB; then reclaim at 0 %.
    fn free_block_before_a_small_unmapped_hole() -> Model {
        let mut m = model(None);
        let mut live = Vec::new();
        for _ in 0..5 {
            live.push(malloc(&mut m, 2 * MIB, 0));
        }
        free(&mut m, live[3]);
        m.empty_cache();
        free(&mut m, live[1]);
        free(&mut m, live[2]);
        assert_eq!(
            blocks(&m, 0),
            vec![
                (0, 4, "alloc"),
                (4, 8, "free"),
                (12, 4, "unmapped"),
                (16, 4, "alloc"),
                (20, 2284, "unmapped"),
            ]
        );
        assert_eq!(m.stats().num_device_free, 1);
        m.config.reclaim_headroom = Some(0.0);
        m
    }

    #[test]
    fn a_free_block_before_unmapped_space_is_reclaimed_when_growth_starts_elsewhere() {
        let mut m = free_block_before_a_small_unmapped_hole();
        // 8 MiB: F's run (4 + 2) is too short, the start is the unmapped tail. w = max(10,
        // 4 + 8) = 12; 8 + 8 > 12: F goes (4 + 8 ≤ 12) and merges with the hole.
        assert_eq!(malloc(&mut m, 8 * MIB, 0), BASE + 10 * MIB);
        assert_eq!(
            blocks(&m, 0)[..4],
            [
                (0, 4, "alloc"),
                (4, 12, "unmapped"),
                (16, 4, "alloc"),
                (20, 16, "alloc")
            ]
        );
        assert_eq!(m.stats().num_device_free, 2);
        assert_eq!(reserved(&m), 12 * MIB);
    }

    #[test]
    fn the_free_block_growth_starts_from_is_kept_even_before_a_small_hole() {
        let mut m = free_block_before_a_small_unmapped_hole();
        // 5 MiB: F's run (4 + 2) is long enough, F is the start and is kept; the hole is
        // mapped. w = max(10, 4 + 5) = 10; 8 + 6 > 10, but nothing else is free.
        assert_eq!(malloc(&mut m, 5 * MIB, 0), BASE + 2 * MIB);
        assert_eq!(m.stats().num_device_free, 1);
        assert_eq!(reserved(&m), 10 * MIB);
    }

    #[test]
    fn candidates_go_largest_whole_pages_first_then_by_address_until_within_the_limit() {
        // 25 % headroom.
        let mut m = model(Some(0.25));
        let sizes = [2, 2, 2, 6, 2, 6, 2];
        let mut addresses = Vec::new();
        for size in sizes {
            addresses.push(malloc(&mut m, size * MIB, 0));
        }
        for hole in [1, 3, 5] {
            free(&mut m, addresses[hole]);
        }
        assert_eq!(reserved(&m), 22 * MIB);
        // W = 22, requested 8; w = 22, limit 22 + ⌊5.5⌋ = 27; 22 + 8 > 27. The first 6 MiB
        // hole (lower address) goes and 16 + 8 ≤ 27: the second 6 MiB hole and the 2 MiB
        // hole stay.
        assert_eq!(malloc(&mut m, 8 * MIB, 0), BASE + 22 * MIB);
        assert_eq!(
            blocks(&m, 0)[..7],
            [
                (0, 4, "alloc"),
                (4, 4, "free"),
                (8, 4, "alloc"),
                (12, 12, "unmapped"),
                (24, 4, "alloc"),
                (28, 12, "free"),
                (40, 4, "alloc"),
            ]
        );
        assert_eq!(m.stats().num_device_free, 1);
        assert_eq!(reserved(&m), 24 * MIB);
    }

    #[test]
    fn only_whole_pages_are_reclaimed_and_growth_goes_on_when_the_list_runs_out() {
        let mut m = model(Some(0.0));
        let half = MIB / 2;
        malloc(&mut m, 3 * half, 0);
        let h = malloc(&mut m, 6 * half, 0);
        malloc(&mut m, 3 * half, 0);
        free(&mut m, h);
        assert_eq!(
            blocks(&m, 0),
            vec![
                (0, 3, "alloc"),
                (3, 6, "free"),
                (9, 3, "alloc"),
                (12, 2292, "unmapped")
            ]
        );
        // w = max(6, 3 + 4) = 7 MiB; 6 + 4 > 7. The hole holds one whole page (2..4 MiB):
        // it goes, its ends stay free and mapped; 4 + 4 > 7 still, but the list is done.
        assert_eq!(malloc(&mut m, 4 * MIB, 0), BASE + 6 * MIB);
        assert_eq!(
            blocks(&m, 0),
            vec![
                (0, 3, "alloc"),
                (3, 1, "free"),
                (4, 4, "unmapped"),
                (8, 1, "free"),
                (9, 3, "alloc"),
                (12, 8, "alloc"),
                (20, 2284, "unmapped")
            ]
        );
        let st = m.stats();
        assert_eq!(st.num_device_free, 1);
        assert_eq!(st.reserved_bytes.all.current, (8 * MIB) as i64);
        assert_eq!(st.reserved_bytes.all.freed, (2 * MIB) as i64);
    }

    #[test]
    fn pending_blocks_are_not_reclaimed_and_no_event_is_waited_for() {
        let mut m = model(Some(0.0));
        malloc(&mut m, 4 * MIB, 0);
        let b = malloc(&mut m, 4 * MIB, 0);
        let c = malloc(&mut m, 4 * MIB, 0);
        m.record_stream(b, 1).unwrap();
        free(&mut m, b);
        free(&mut m, c);
        // [A 4][B 4 pending][free 4][unmapped], requested 8 (A, B), W 12. For 10 MiB more:
        // w = 18; 12 + 10 > 18, but B is pending and the free block is where growth starts.
        assert_eq!(malloc(&mut m, 10 * MIB, 0), BASE + 8 * MIB);
        let st = m.stats();
        assert_eq!(st.num_device_free, 0);
        assert_eq!(st.num_sync_all_streams, 0);
        assert_eq!(blocks(&m, 0)[1], (8, 8, "pending"));
        assert_eq!(reserved(&m), 18 * MIB);
    }

    #[test]
    fn the_high_water_keeps_the_most_ever_requested() {
        // 25 % headroom: with W, limit = 20 + 5 = 25 and 20 + 4 fits; with only what is
        // requested now (10 + 4 = 14, limit 17) the hole would go.
        let mut m = model(Some(0.25));
        let a = malloc(&mut m, 10 * MIB, 0);
        malloc(&mut m, 10 * MIB, 0);
        free(&mut m, a);
        assert_eq!(m.requested_high_water(), 20 * MIB);
        m.reset_peak_stats();
        assert_eq!(m.stats().requested_bytes.all.peak, (10 * MIB) as i64);
        assert_eq!(m.requested_high_water(), 20 * MIB);
        // Stream 1 grows its own range; stream 0's hole is a candidate but is kept.
        malloc(&mut m, 4 * MIB, 1);
        let st = m.stats();
        assert_eq!(st.num_device_free, 0);
        assert_eq!(reserved(&m), 24 * MIB);
    }

    #[test]
    fn a_range_left_wholly_unmapped_gives_its_address_space_back() {
        let mut m = model(Some(0.0));
        // Stream 1's range, fully free once X is freed: [free 4][unmapped] — a candidate for
        // stream 0 (another stream).
        let x = malloc(&mut m, 4 * MIB, 1);
        free(&mut m, x);
        assert_eq!(m.device.reservations().len(), 1);
        malloc(&mut m, 4 * MIB, 0);
        assert_eq!(m.stats().num_device_free, 1);
        // Only stream 0's range is left, reserved where stream 1's was.
        let ranges: Vec<u64> = m.device.reservations().iter().map(|r| r.base).collect();
        assert_eq!(ranges.len(), 1);
        assert!(m.segments.iter().all(|s| s.stream == 0));
        assert_eq!(reserved(&m), 4 * MIB);
    }

    #[test]
    fn the_large_page_is_the_configured_one() {
        let mut m = model(None);
        malloc(&mut m, 3 * MIB, 0);
        assert_eq!(reserved(&m), 4 * MIB);
        let mut c = ModelConfig::pytorch_defaults(1 << 30);
        c.expandable_segments = true;
        let mut m = Model::new(c);
        malloc(&mut m, 3 * MIB, 0);
        assert_eq!(reserved(&m), 20 * MIB);
    }

    #[test]
    #[should_panic(expected = "expandable_page")]
    fn an_odd_page_is_refused() {
        let mut c = ModelConfig::pytorch_defaults(1 << 30);
        c.expandable_page = 3 * MIB;
        Model::new(c);
    }

    #[test]
    #[should_panic(expected = "reclaim_headroom")]
    fn a_headroom_above_one_is_refused() {
        let mut c = ModelConfig::pytorch_defaults(1 << 30);
        c.reclaim_headroom = Some(1.5);
        Model::new(c);
    }
}

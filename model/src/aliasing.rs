//! Rule 22: page aliasing (cachalot's own policy, `page_aliasing:True`).
//!
//! A physical page of a range can be mapped at several slots at once. The model keeps its own
//! page table, apart from the device's: every mapped slot of every range (in `page_of`: slot
//! address → page number) and every page (in `pages`: its *home* slot, the one through which
//! its memory may be handed out, and its *lent* slots, which lie in lent blocks). Busy and
//! usable are computed by scanning the blocks every time they are asked.
//!
//! This file holds: the pages made by map steps and dropped by unmapping (22a), busy and
//! usable (22b), carving and re-homing (22c), the lent candidate of best fit (22d), the run
//! checks of growth (22e), borrowing (22f), the release of lent blocks (22g) and the
//! invariant (22i). Where the rules use these: `policy.rs` (best fit, hand-out),
//! `expandable.rs` (growth and map steps), `release.rs` (release).
//!
//! The model's reading of the rule where its text leaves a choice (each also named below):
//! - a map step's `bytes` in rule 22f are its bytes rounded up to whole pages (rule 19b's
//!   "each rounded up to whole pages of the range"), so `bytes / page` is exact;
//! - "once per request": the limit is computed at the request's first growth (rule 7b, 7c or
//!   7d, whichever is first) and kept for its later ones; each `malloc` is a request;
//! - a lent candidate's size, for rule 6's oversize checks, is the lent block's size;
//! - the free blocks "inside the growth's run" are those starting inside it;
//! - borrowing (22f) also passes over the free blocks holding the home of a page that a lent
//!   slot of the growth's run maps: the text as written lets borrowing move such a home into
//!   the run, and the run's later re-homing step then carves it out of the start, which then
//!   never grows (found by a random search; `a_borrowed_page_lent_inside_the_run...` below);
//! - the parts of a free block left by carving keep the time they entered the free set.

use std::collections::{BTreeMap, BTreeSet};

use crate::device::overlaps;
use crate::expandable::whole_pages;
use crate::rules::Pool;
use crate::state::{self, Block, BlockState, Segment};
use crate::{InvariantViolation, Model};

/// Rule 22a: one physical page of a range, as the model sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Page {
    /// The one slot through which its memory may be handed out; it lies in mapped blocks.
    pub(crate) home: u64,
    /// Every other slot that maps it; each lies in a lent block.
    pub(crate) lent: Vec<u64>,
}

/// Rule 22f: one free block borrowing may take pages from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Lender {
    /// Bytes of the whole pages of its range inside it.
    page_bytes: u64,
    /// The block's first byte.
    address: u64,
    /// Its first whole page.
    first: u64,
}

impl Model {
    /// Rule 22: whether page aliasing is on (it acts only in ranges, rule 19).
    pub(crate) fn aliasing(&self) -> bool {
        self.config.page_aliasing && self.config.expandable_segments
    }

    /// The range holding the byte at `address`, by index.
    fn range_holding(&self, address: u64) -> Option<usize> {
        self.segments
            .iter()
            .position(|r| r.expandable && r.address <= address && address - r.address < r.size)
    }

    /// Rule 22a: the `bytes` at `address` were just mapped with new pages: each slot is the
    /// home of its own page.
    pub(crate) fn create_pages(&mut self, address: u64, bytes: u64, page: u64) {
        for slot in (0..bytes / page).map(|i| address + i * page) {
            let number = self.next_page;
            self.next_page += 1;
            self.pages.insert(
                number,
                Page {
                    home: slot,
                    lent: Vec::new(),
                },
            );
            self.page_of.insert(slot, number);
        }
    }

    /// Rule 19e: the home slots in the `bytes` at `address` were just unmapped; their pages
    /// had no other mapping, so they are gone.
    pub(crate) fn drop_pages(&mut self, address: u64, bytes: u64, page: u64) {
        for slot in (0..bytes / page).map(|i| address + i * page) {
            let number = self
                .page_of
                .remove(&slot)
                .expect("an unmapped slot mapped a page");
            let gone = self.pages.remove(&number).expect("the page exists");
            assert!(
                gone.home == slot && gone.lent.is_empty(),
                "unmapping the home of a page still lent: {gone:?}"
            );
        }
    }

    /// Rule 22b: whether the page `number` is busy: its home slot overlaps an allocated or
    /// pending block (a parked block is allocated).
    fn busy(&self, number: u64) -> bool {
        let home = self.pages[&number].home;
        let r = self.range_holding(home).expect("a home lies in a range");
        let page = self.page_size(self.segments[r].pool);
        self.segments[r]
            .blocks
            .iter()
            .any(|b| b.state != BlockState::Free && overlaps(b.address, b.size, home, page))
    }

    /// Rule 22b: whether the first `k` slots (all of them for `None`) of the lent block at
    /// `address` are usable: they map `k` distinct pages, none of them busy.
    pub(crate) fn usable(&self, address: u64, k: Option<u64>) -> bool {
        let (s, b) = state::find_block(&self.segments, address).expect("the lent block exists");
        let block = &self.segments[s].blocks[b];
        assert!(block.lent, "only lent blocks have usable slots");
        let page = self.page_size(self.segments[s].pool);
        let k = k.unwrap_or(block.size / page);
        assert!(k * page <= block.size);
        let mut seen = BTreeSet::new();
        (0..k).all(|i| {
            let number = self.page_of[&(address + i * page)];
            seen.insert(number) && !self.busy(number)
        })
    }

    /// Rule 22e: whether a start whose run `run` is made of `blocks` may be taken: its lent
    /// slots map no page twice, and none maps a page whose home lies inside the run.
    pub(crate) fn run_is_takeable(&self, blocks: &[Block], run: (u64, u64)) -> bool {
        let (s, _) = state::block_holding(&self.segments, run.0).expect("the run's range");
        let page = self.page_size(self.segments[s].pool);
        let mut seen = BTreeSet::new();
        for block in blocks.iter().filter(|b| b.lent) {
            for slot in (0..block.size / page).map(|i| block.address + i * page) {
                let number = self.page_of[&slot];
                let home = self.pages[&number].home;
                if !seen.insert(number) || overlaps(home, page, run.0, run.1 - run.0) {
                    return false;
                }
            }
        }
        true
    }

    /// Rule 22c: carves the home slot at `slot` out of the free block it lies in: the block
    /// leaves the free set, the parts before and after the slot (those of nonzero size) stay
    /// free blocks, and the slot becomes lent, merging with lent neighbours. The page table
    /// is the caller's.
    fn carve(&mut self, slot: u64) {
        let (s, b) = state::block_holding(&self.segments, slot).expect("the home's block");
        let page = self.page_size(self.segments[s].pool);
        let blocks = &mut self.segments[s].blocks;
        let block = blocks[b].clone();
        let end = block.address + block.size;
        assert!(
            block.in_free_set() && slot + page <= end,
            "a carved home lies wholly inside a free block"
        );
        let mut pieces = Vec::new();
        if block.address < slot {
            pieces.push(Block::free(
                block.address,
                slot - block.address,
                block.free_since,
            ));
        }
        let mut l = b + pieces.len();
        pieces.push(Block::lent(slot, page));
        if slot + page < end {
            pieces.push(Block::free(
                slot + page,
                end - slot - page,
                block.free_since,
            ));
        }
        blocks.splice(b..=b, pieces);
        // The slot merges with lent neighbours.
        if l > 0 && blocks[l - 1].lent {
            let this = blocks.remove(l);
            l -= 1;
            blocks[l].size += this.size;
        }
        if l + 1 < blocks.len() && blocks[l + 1].lent {
            let next = blocks.remove(l + 1);
            blocks[l].size += next.size;
        }
    }

    /// Rule 22c: re-homes the first `k` slots of the lent block starting at `first` (their
    /// pages usable): each page's home slot, in slot order, is carved out of its free block
    /// (and becomes lent); then the `k` slots become the pages' homes, leaving the lent block
    /// as one free mapped block, which merges with free mapped neighbours when `merge` says
    /// so (rule 22e) and else stays as it is (rule 22d: the caller hands it out). No device
    /// call; no statistic changes (each page's reserved bytes move within one pool).
    pub(crate) fn rehome(&mut self, first: u64, k: u64, merge: bool) {
        let (s, _) = state::find_block(&self.segments, first).expect("the lent block exists");
        let page = self.page_size(self.segments[s].pool);
        let targets: Vec<u64> = (0..k).map(|i| first + i * page).collect();
        let numbers: Vec<u64> = targets.iter().map(|t| self.page_of[t]).collect();
        for &number in &numbers {
            let home = self.pages[&number].home;
            self.carve(home);
            self.pages
                .get_mut(&number)
                .expect("the page exists")
                .lent
                .push(home);
        }
        // The targets leave the lent block (which carving may have grown before them); the
        // rest of it stays lent.
        let (s, b) = state::block_holding(&self.segments, first).expect("the targets' block");
        let now = self.search_counter(self.segments[s].pool);
        let blocks = &mut self.segments[s].blocks;
        let lent = blocks[b].clone();
        let (end, home_end) = (lent.address + lent.size, first + k * page);
        assert!(lent.lent && home_end <= end, "re-homed slots are lent");
        let mut pieces = Vec::new();
        if lent.address < first {
            pieces.push(Block::lent(lent.address, first - lent.address));
        }
        let f = b + pieces.len();
        pieces.push(Block::free(first, k * page, now));
        if home_end < end {
            pieces.push(Block::lent(home_end, end - home_end));
        }
        blocks.splice(b..=b, pieces);
        for (&slot, &number) in targets.iter().zip(&numbers) {
            let p = self.pages.get_mut(&number).expect("the page exists");
            p.lent.retain(|&l| l != slot);
            p.home = slot;
        }
        if merge {
            self.merge_free_neighbours(s, f);
        }
        self.settle_stats();
    }

    /// Rule 22d: the smallest `(size, address)` lent block of `pool`'s ranges of `stream`
    /// with at least `rounded` bytes whose first `⌈rounded / page⌉` slots are usable: its
    /// size, address and that number of slots.
    pub(crate) fn lent_candidate(
        &self,
        pool: Pool,
        stream: u64,
        rounded: u64,
    ) -> Option<(u64, u64, u64)> {
        let k = rounded.div_ceil(self.page_size(pool));
        let mut best: Option<(u64, u64, u64)> = None;
        for range in &self.segments {
            if !range.expandable || range.pool != pool || range.stream != stream {
                continue;
            }
            for block in &range.blocks {
                if block.lent
                    && block.size >= rounded
                    && best.is_none_or(|(size, address, _)| {
                        (block.size, block.address) < (size, address)
                    })
                    && self.usable(block.address, Some(k))
                {
                    best = Some((block.size, block.address, k));
                }
            }
        }
        best
    }

    /// Rule 22f: borrows up to `n` pages for a map step into the unmapped block at `target`,
    /// for a growth whose run is `run`: the free mapped blocks of the pool's ranges of the
    /// stream holding a whole page, outside the run, largest whole-page bytes first (then by
    /// address), give their whole pages in address order; one alias call per block, each a
    /// step of its own. The pages taken, or `None` when an alias failed (earlier ones stay).
    pub(crate) fn borrow(&mut self, target: u64, n: u64, run: (u64, u64)) -> Option<u64> {
        let (s, _) = state::find_block(&self.segments, target).expect("the unmapped block");
        let (pool, stream) = (self.segments[s].pool, self.segments[s].stream);
        let page = self.page_size(pool);
        // The model's reading (the text as written loops): the homes of the pages that lent
        // slots of the run map. Borrowing one would move its home into the run, and the
        // run's step on that lent slot would then carve it out of the start (rule 22e's run
        // check, which forbids such a home when the start is taken, made before borrowing).
        let mut run_homes = Vec::new();
        for (&slot, &number) in self.page_of.range(run.0..run.1) {
            let (s, b) = state::block_holding(&self.segments, slot).expect("a mapped slot");
            if self.segments[s].blocks[b].lent {
                run_homes.push(self.pages[&number].home);
            }
        }
        // Listed once, before any change.
        let mut lenders = Vec::new();
        for range in &self.segments {
            if !range.expandable || range.pool != pool || range.stream != stream {
                continue;
            }
            for block in range.blocks.iter().filter(|b| b.in_free_set()) {
                if run.0 <= block.address && block.address < run.1 {
                    continue;
                }
                if run_homes
                    .iter()
                    .any(|&home| overlaps(home, page, block.address, block.size))
                {
                    continue;
                }
                let end = block.address + block.size;
                if let Some((first, last)) = whole_pages(range.address, page, block.address, end) {
                    lenders.push(Lender {
                        page_bytes: last - first,
                        address: block.address,
                        first,
                    });
                }
            }
        }
        lenders.sort_by_key(|l| (std::cmp::Reverse(l.page_bytes), l.address));
        let mut taken = 0;
        let mut next = target;
        for lender in lenders {
            if taken == n {
                break;
            }
            let (s, b) =
                state::find_block(&self.segments, lender.address).expect("a lender exists");
            assert!(self.segments[s].blocks[b].in_free_set(), "a lender is free");
            let m = (n - taken).min(lender.page_bytes / page);
            let (source, bytes) = (lender.first, m * page);
            if !self.device.alias(next, source, bytes) {
                return None;
            }
            // The taken slots are carved out of the lender into lent blocks, and the target
            // slots become their pages' homes.
            for i in 0..m {
                let (from, to) = (source + i * page, next + i * page);
                let number = self.page_of[&from];
                self.carve(from);
                self.page_of.insert(to, number);
                let p = self.pages.get_mut(&number).expect("the page exists");
                p.lent.push(from);
                p.home = to;
            }
            let (s, b) = state::find_block(&self.segments, next).expect("the target exists");
            self.install_free_block(s, b, bytes);
            // One device call; reserved bytes unchanged (settled from the state).
            self.stats.num_device_alloc += 1;
            self.settle_stats();
            next += bytes;
            taken += m;
        }
        Some(taken)
    }

    /// Rule 22g: every lent block of `pool`'s ranges, in `(stream, address)` order, is
    /// unmapped: one device call each, no reserved bytes change (each page stays mapped at
    /// its home); the slots become unmapped and merge with unmapped neighbours; a range left
    /// wholly unmapped gives its address space back.
    pub(crate) fn unmap_lent_blocks(&mut self, pool: Pool) {
        let mut listed: Vec<(u64, u64)> = Vec::new();
        for range in self
            .segments
            .iter()
            .filter(|r| r.expandable && r.pool == pool)
        {
            for block in range.blocks.iter().filter(|b| b.lent) {
                listed.push((range.stream, block.address));
            }
        }
        listed.sort_unstable();
        for (_, address) in listed {
            let (s, b) = state::find_block(&self.segments, address).expect("a listed block");
            let (base, page) = (self.segments[s].address, self.page_size(pool));
            let size = self.segments[s].blocks[b].size;
            assert!(self.segments[s].blocks[b].lent);
            self.device.unmap(address, size);
            for slot in (0..size / page).map(|i| address + i * page) {
                let number = self.page_of.remove(&slot).expect("a lent slot maps a page");
                let p = self.pages.get_mut(&number).expect("the page exists");
                p.lent.retain(|&l| l != slot);
            }
            let blocks = &mut self.segments[s].blocks;
            blocks[b] = Block::unmapped(address, size);
            let mut u = b;
            if u > 0 && blocks[u - 1].is_unmapped() {
                let this = blocks.remove(u);
                u -= 1;
                blocks[u].size += this.size;
            }
            if u + 1 < blocks.len() && blocks[u + 1].is_unmapped() {
                let next = blocks.remove(u + 1);
                blocks[u].size += next.size;
            }
            self.stats.num_device_free += 1;
            if blocks.len() == 1 {
                self.segments.remove(s);
                self.device.release_reservation(base);
            }
            self.settle_stats();
        }
    }

    /// Rule 22i (and 22a's lent blocks): every mapped slot maps one page; every page has
    /// exactly one home, in mapped blocks; every other slot mapping it is in a lent block of
    /// a range of the same pool and stream; the device's page table maps the same slots to
    /// the same pages; the pages under live blocks are pairwise distinct on the device.
    pub(crate) fn check_pages(&self) -> Result<(), InvariantViolation> {
        // Rule 22a: lent blocks are page-aligned, never adjacent, hold nothing.
        let mut covered = Vec::new();
        for range in self.segments.iter().filter(|r| r.expandable) {
            let page = self.page_size(range.pool);
            for (i, block) in range.blocks.iter().enumerate() {
                let at = (range.address, block.address);
                if block.lent {
                    let offset = block.address - range.address;
                    if !offset.is_multiple_of(page) || !block.size.is_multiple_of(page) {
                        return Err(InvariantViolation::LentBlockUnaligned {
                            range: at.0,
                            block: at.1,
                        });
                    }
                    if range.blocks.get(i + 1).is_some_and(|n| n.lent) {
                        return Err(InvariantViolation::AdjacentLentBlocks {
                            range: at.0,
                            block: at.1,
                        });
                    }
                    let empty = block.state == BlockState::Free
                        && block.requested == 0
                        && block.stream_uses.is_empty()
                        && block.pending_events == 0
                        && !self.events.iter().any(|e| e.block == block.address);
                    if !empty {
                        return Err(InvariantViolation::LentBlockHoldsState {
                            range: at.0,
                            block: at.1,
                        });
                    }
                }
                if block.is_unmapped() {
                    continue;
                }
                // The slots under mapped and lent blocks are the mapped slots.
                let first = (block.address - range.address) / page;
                let end = (block.address + block.size - range.address).div_ceil(page);
                covered.extend((first..end).map(|i| range.address + i * page));
            }
        }
        covered.sort_unstable();
        covered.dedup();
        // The usual case, by two sorted walks: the covered slots are page_of's slots, and
        // page_of's (slot, page) pairs are exactly the pages' own homes and lent slots.
        let mut listed: Vec<(u64, u64)> = Vec::with_capacity(self.page_of.len());
        for (&number, page) in &self.pages {
            listed.push((page.home, number));
            listed.extend(page.lent.iter().map(|&slot| (slot, number)));
        }
        listed.sort_unstable();
        let agree = covered.iter().eq(self.page_of.keys())
            && listed
                .iter()
                .copied()
                .eq(self.page_of.iter().map(|(&slot, &page)| (slot, page)));
        if !agree {
            // Find and name the first disagreement, one slot and one page at a time.
            self.check_page_table_slowly(&covered)?;
        }
        for (&number, page) in &self.pages {
            self.check_page(number, page)?;
        }
        self.check_device_pages()
    }

    /// Rule 22i's page table, slot by slot and page by page: the first slot covered by a
    /// mapped block without a page, mapped slot outside them, or page and slot disagreeing,
    /// with rule 22i's checks of each page in between, in the order they were always made.
    fn check_page_table_slowly(&self, covered: &[u64]) -> Result<(), InvariantViolation> {
        for &slot in covered {
            if !self.page_of.contains_key(&slot) {
                return Err(InvariantViolation::SlotWithoutPage { slot });
            }
        }
        for (&slot, &page) in &self.page_of {
            if covered.binary_search(&slot).is_err() {
                return Err(InvariantViolation::PageOnUnmappedSlot { slot, page });
            }
            let known = self
                .pages
                .get(&page)
                .is_some_and(|p| p.home == slot || p.lent.contains(&slot));
            if !known {
                return Err(InvariantViolation::PageTableInconsistent { slot, page });
            }
        }
        for (&number, page) in &self.pages {
            let consistent = if page.lent.is_empty() {
                self.page_of.get(&page.home) == Some(&number)
            } else {
                let mut slots = page.lent.clone();
                slots.push(page.home);
                let n = slots.len();
                slots.sort_unstable();
                slots.dedup();
                slots.len() == n && slots.iter().all(|s| self.page_of.get(s) == Some(&number))
            };
            if !consistent {
                return Err(InvariantViolation::PageTableInconsistent {
                    slot: page.home,
                    page: number,
                });
            }
            self.check_page(number, page)?;
        }
        Ok(())
    }

    /// Rule 22i for one page: its home lies in mapped blocks; each lent slot lies in a lent
    /// block of a range of the home's pool and stream.
    fn check_page(&self, number: u64, page: &Page) -> Result<(), InvariantViolation> {
        let home_range = sorted_segment_holding(&self.segments, page.home)
            .map(|s| &self.segments[s])
            .filter(|r| r.expandable)
            .ok_or(InvariantViolation::HomeNotMapped {
                page: number,
                home: page.home,
            })?;
        let bytes = self.page_size(home_range.pool);
        // The blocks tile the range in address order (checked before): those overlapping the
        // home's page are the run from the first that ends after the home.
        let first = home_range
            .blocks
            .partition_point(|b| b.address + b.size <= page.home);
        let in_mapped = home_range.blocks[first..]
            .iter()
            .take_while(|b| overlaps(b.address, b.size, page.home, bytes))
            .all(|b| b.mapped);
        if !in_mapped {
            return Err(InvariantViolation::HomeNotMapped {
                page: number,
                home: page.home,
            });
        }
        for &slot in &page.lent {
            let fault = InvariantViolation::LentSlotNotInLentBlock { page: number, slot };
            let s = sorted_segment_holding(&self.segments, slot).ok_or(fault.clone())?;
            let range = &self.segments[s];
            let b = range.blocks.partition_point(|b| b.address <= slot) - 1;
            let block = &range.blocks[b];
            if !range.expandable || !block.lent || slot + bytes > block.address + block.size {
                return Err(fault);
            }
            if range.pool != home_range.pool || range.stream != home_range.stream {
                return Err(InvariantViolation::LentSlotOfOtherPoolOrStream { page: number, slot });
            }
        }
        Ok(())
    }

    /// Rule 22i on the device's own page table: it has the model's pages, each mapped at
    /// exactly the model's slots; and the pages under live blocks (allocated or pending) are
    /// pairwise distinct.
    fn check_device_pages(&self) -> Result<(), InvariantViolation> {
        let device = self.device.pages();
        // Rule 23a: the view slots mapping each home.
        let mut view_slots: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
        for (home, slot) in self.view_mappings() {
            view_slots.entry(home).or_default().push(slot);
        }
        if device.len() != self.pages.len() {
            return Err(InvariantViolation::DevicePageCount {
                device: device.len(),
                model: self.pages.len(),
            });
        }
        for page in self.pages.values() {
            let views = view_slots.get(&page.home).map_or(&[][..], Vec::as_slice);
            let mapped = self
                .device
                .page_at(page.home)
                .and_then(|d| device.get(&d))
                .map_or(&[][..], |d| d.mappings.as_slice());
            let agree = if page.lent.is_empty() && views.is_empty() {
                // The common page: mapped at its home only (no list to build).
                mapped == [page.home]
            } else {
                let mut slots = page.lent.clone();
                slots.push(page.home);
                slots.extend_from_slice(views);
                slots.sort_unstable();
                let mut mapped = mapped.to_vec();
                mapped.sort_unstable();
                mapped == slots
            };
            if !agree {
                return Err(InvariantViolation::DevicePageTable { slot: page.home });
            }
        }
        // The slots under live blocks, each once, and the device's page behind each.
        let mut under_live: Vec<(u64, u64)> = Vec::new();
        for range in self.segments.iter().filter(|r| r.expandable) {
            let page = self.page_size(range.pool);
            for block in range.blocks.iter().filter(|b| b.state != BlockState::Free) {
                let first = (block.address - range.address) / page;
                let end = (block.address + block.size - range.address).div_ceil(page);
                for slot in (first..end).map(|i| range.address + i * page) {
                    let device_page = self
                        .device
                        .page_at(slot)
                        .ok_or(InvariantViolation::DevicePageTable { slot })?;
                    under_live.push((device_page, slot));
                }
            }
        }
        // Two blocks sharing a slot share its page: that slot counts once. Of the device
        // pages under two slots or more, the one whose second slot is lowest is reported.
        under_live.sort_unstable();
        under_live.dedup();
        let twice = under_live
            .windows(2)
            .filter(|w| w[0].0 == w[1].0)
            .map(|w| (w[0].1, w[1].1))
            .min_by_key(|&(_, second)| second);
        if let Some((first, second)) = twice {
            return Err(InvariantViolation::PageUnderTwoLiveBlocks { first, second });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;

/// The segment holding `address`, found by bisection. Only for the invariant checks, which run
/// it after `check_segments` and the segments' own checks have found the segments sorted and
/// apart and each one's blocks tiling it in address order; the operations keep their linear
/// scans ([`state::block_holding`]).
fn sorted_segment_holding(segments: &[Segment], address: u64) -> Option<usize> {
    let s = segments
        .partition_point(|r| r.address <= address)
        .checked_sub(1)?;
    (address - segments[s].address < segments[s].size).then_some(s)
}

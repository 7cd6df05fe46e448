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
use crate::state::{self, Block, BlockState};
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
        let mut covered = BTreeSet::new();
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
        for &slot in &covered {
            if !self.page_of.contains_key(&slot) {
                return Err(InvariantViolation::SlotWithoutPage { slot });
            }
        }
        for (&slot, &page) in &self.page_of {
            if !covered.contains(&slot) {
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
            let mut slots = page.lent.clone();
            slots.push(page.home);
            let n = slots.len();
            slots.sort_unstable();
            slots.dedup();
            let consistent =
                slots.len() == n && slots.iter().all(|s| self.page_of.get(s) == Some(&number));
            if !consistent {
                return Err(InvariantViolation::PageTableInconsistent {
                    slot: page.home,
                    page: number,
                });
            }
            self.check_page(number, page)?;
        }
        self.check_device_pages()
    }

    /// Rule 22i for one page: its home lies in mapped blocks; each lent slot lies in a lent
    /// block of a range of the home's pool and stream.
    fn check_page(&self, number: u64, page: &Page) -> Result<(), InvariantViolation> {
        let home_range = self
            .range_holding(page.home)
            .map(|r| &self.segments[r])
            .ok_or(InvariantViolation::HomeNotMapped {
                page: number,
                home: page.home,
            })?;
        let bytes = self.page_size(home_range.pool);
        let in_mapped = home_range
            .blocks
            .iter()
            .filter(|b| overlaps(b.address, b.size, page.home, bytes))
            .all(|b| b.mapped);
        if !in_mapped {
            return Err(InvariantViolation::HomeNotMapped {
                page: number,
                home: page.home,
            });
        }
        for &slot in &page.lent {
            let fault = InvariantViolation::LentSlotNotInLentBlock { page: number, slot };
            let (s, b) = state::block_holding(&self.segments, slot).ok_or(fault.clone())?;
            let (range, block) = (&self.segments[s], &self.segments[s].blocks[b]);
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
        if device.len() != self.pages.len() {
            return Err(InvariantViolation::DevicePageCount {
                device: device.len(),
                model: self.pages.len(),
            });
        }
        for page in self.pages.values() {
            let mut slots = page.lent.clone();
            slots.push(page.home);
            slots.sort_unstable();
            let mut mapped = self
                .device
                .page_at(page.home)
                .and_then(|d| device.get(&d))
                .map(|d| d.mappings.clone())
                .unwrap_or_default();
            mapped.sort_unstable();
            if mapped != slots {
                return Err(InvariantViolation::DevicePageTable { slot: page.home });
            }
        }
        // The slots under live blocks, each once, and the device's page behind each.
        let mut under_live: BTreeMap<u64, u64> = BTreeMap::new();
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
                    under_live.insert(slot, device_page);
                }
            }
        }
        let mut seen: BTreeMap<u64, u64> = BTreeMap::new();
        for (&slot, &device_page) in &under_live {
            if let Some(&first) = seen.get(&device_page) {
                return Err(InvariantViolation::PageUnderTwoLiveBlocks {
                    first,
                    second: slot,
                });
            }
            seen.insert(device_page, slot);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
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
            Err(InvariantViolation::LentBlockUnaligned { .. })
                | Err(InvariantViolation::Range { .. })
        ));
        // The device maps a lent slot at another page.
        let mut bad = good.clone();
        bad.device.unmap(BASE, 2 * MIB);
        assert!(bad.device.map(BASE, 2 * MIB));
        assert!(bad.check_invariants().is_err());
        // B's page mapped under C too, on the device's table: two live blocks share it.
        let mut bad = good;
        bad.device.unmap(BASE + 14 * MIB, 2 * MIB);
        assert!(bad.device.alias(BASE + 14 * MIB, b, 2 * MIB));
        assert!(bad.check_invariants().is_err());
    }
}

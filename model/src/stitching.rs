//! Rule 23: stitched views (cachalot's own policy, `page_stitching:True`).
//!
//! Pages keep their homes. At rule 20's over-limit point a large request gets a *view*: a
//! reservation of its own whose slots map, a second time, free pages of the ranges of any
//! stream where they lie (rule 23k: the request's stream's first; a page of another stream's
//! range orders the streams with a wait at the hand-out and at the free). The view is kept, mapped, and handed out again to a later request of the
//! same number of pages whenever the pieces it would hold are free. The model keeps the views
//! in a `Vec` in the order they were made, each with the home slots its slots map and, while
//! in use, its allocation (rounded and requested size, the streams that used it, its pending
//! events). Held pieces (23b) are blocks of their ranges in state [`BlockState::Held`];
//! everything else is found by scanning the blocks when asked.
//!
//! This file holds: the views and their allocations (23a), held pieces (23b), usable (23c),
//! the hand-out (23d), the return (23e), making a view (23f), the cap (23g), destroying views
//! (23h), the invariant (23j) and the waits of views across streams (23k). Where the rules use these: `lib.rs` (the hand-out after
//! best fit, free, record_stream), `policy.rs` (events, rule 17a's search, the statistics),
//! `expandable.rs` (rule 20's point in growth, destroying before an unmap), `release.rs`
//! (rule 9), `threads.rs` (parking).
//!
//! The model's reading of the rule where its text leaves a choice (each also named below):
//! - "`P` is the large pool's page" and the small pool's ranges take part only when their page
//!   (2 MiB) equals `P`; a view reservation is cut into slots of `P`;
//! - a view's allocation is a large-pool allocation (rule 3: its rounded size is large): it
//!   counts in the large pool's statistics even when its pieces are held in the small pool's
//!   ranges; so 23b's "held bytes of a pool's ranges plus its allocated and pending blocks'
//!   bytes are its allocated-or-pending bytes" holds for all pools together, not per pool
//!   when pieces lie in the small pool (the invariant below checks it for all pools);
//! - the hand-out from a view (23d) is looked for only when rule 6's search found nothing; a
//!   view is never compared with rule 6's candidate;
//! - rule 23f runs wherever the model runs rule 20 (every rule 19b call of rules 7b, 7c and
//!   7d that passes the memory-fraction check), for large-pool requests only, and with the
//!   limit and `need` of rule 20 as written (`need` with the large page);
//! - a made view's pieces are carved by 23d's hand-out, after all its aliases succeeded;
//! - "each maximal run of taken slots that are consecutive in one block": the slots of one
//!   block are taken in address order with none skipped, so each block gives one run;
//! - the cap's "least recently handed out (or made)": each view keeps the tick of its last
//!   hand-out or its making, and the smallest tick among the free views goes first;
//! - the cap compares with `2 × capacity` in 128 bits (no overflow);
//! - a failed alias is out-of-memory (the model's device has no other fault): the view's
//!   aliases so far are unmapped, its reservation given back, and rule 20 goes on as written;
//! - destroying the views that map a home slot rule 19e or rule 20 is about to unmap happens
//!   once per unmap call, before it, over all the slots that call unmaps, in the order made;
//! - rule 9's destruction of every free view comes after the events are waited for (so that
//!   views whose allocations were pending are free by then) and before the first pool's
//!   whole segments are given back;
//! - the parts of a free block left by carving a piece keep the time they entered the free
//!   set (as 23d says); a returned piece enters it now (rule 10);
//! - rule 23k's foreign streams are found afresh from the homes (the streams of the ranges
//!   holding them, other than the view's), ascending; the waits are the model's device log,
//!   [`Model::stream_waits`]; the model's device never fails a wait.

use std::collections::BTreeSet;

use crate::device::overlaps;
use crate::expandable::{SMALL_PAGE, whole_pages};
use crate::rules::Pool;
use crate::state::{self, Block, BlockState, Event};
use crate::stats::Gauges;
use crate::{InvariantViolation, Model};

/// Rule 23a: one view.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct View {
    /// Its number: views are numbered in the order they are made.
    pub(crate) number: u64,
    /// The reservation's first byte (and the address of its allocation while in use).
    pub(crate) address: u64,
    /// The stream it is for.
    pub(crate) stream: u64,
    /// `h_i`: the home slot whose page slot `i` maps. Never changes while the view lives.
    pub(crate) homes: Vec<u64>,
    /// Rule 23g: the tick of its last hand-out, or of its making.
    pub(crate) last_used: u64,
    /// While in use: its allocation.
    pub(crate) allocation: Option<ViewAllocation>,
}

/// The allocation a view is in use by.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ViewAllocation {
    /// `r`, the request's rounded size.
    pub(crate) rounded: u64,
    /// The user's size.
    pub(crate) requested: u64,
    /// `Allocated`, or `Pending` once freed while other streams' events are outstanding.
    pub(crate) state: BlockState,
    /// While allocated: the streams other than the view's that used it, ascending, each once.
    pub(crate) stream_uses: Vec<u64>,
    /// While pending: how many of its events are outstanding.
    pub(crate) pending_events: usize,
}

/// Rule 23f: one free block that gives pages to a new view.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Giver {
    /// Rule 23k: whether it lies in a range of another stream than the request's.
    foreign: bool,
    /// Rule 23f: whether it lies in a range of the small pool (after the large pool's).
    small: bool,
    /// Bytes of the slots of its range lying wholly inside it (rule 19j: of one-page handles).
    page_bytes: u64,
    /// The block's first byte.
    address: u64,
    /// Those slots, in address order.
    slots: Vec<u64>,
}

impl Model {
    /// Rule 23: whether page stitching is on (it acts only in ranges, rule 19).
    pub(crate) fn stitching(&self) -> bool {
        self.config.page_stitching && self.config.expandable_segments
    }

    /// Rule 23: `P`, the large pool's page.
    fn view_page(&self) -> u64 {
        self.page_size(Pool::Large)
    }

    /// Rule 23a: whether ranges of `pool` give pages to views: the large pool, and the small
    /// pool when its page is also `P`.
    fn pool_stitches(&self, pool: Pool) -> bool {
        pool == Pool::Large || SMALL_PAGE == self.view_page()
    }

    /// Rule 23b: the pieces a view of `n` slots with homes `homes` holds for an allocation of
    /// rounded size `rounded`, in slot order. The held bytes are the whole slot `h_i` for
    /// `i < n − 1` and the first `t = r − (n − 1) × P` bytes of `h_{n−1}`; those of each
    /// maximal run of slots whose homes are consecutive in one range (`h_{m+1} = h_m + P`)
    /// are one piece.
    fn pieces(&self, homes: &[u64], rounded: u64) -> Vec<(u64, u64)> {
        let page = self.view_page();
        let n = homes.len() as u64;
        let t = rounded - (n - 1) * page;
        let range_of = |address: u64| state::block_holding(&self.segments, address).map(|x| x.0);
        let mut pieces: Vec<(u64, u64)> = Vec::new();
        for (i, &h) in homes.iter().enumerate() {
            let held = if i + 1 < homes.len() { page } else { t };
            let joins = i > 0 && homes[i - 1] + page == h && range_of(homes[i - 1]) == range_of(h);
            match pieces.last_mut() {
                Some(last) if joins => last.1 += held,
                _ => pieces.push((h, held)),
            }
        }
        pieces
    }

    /// Whether `[address, address + size)` lies wholly inside one free block (in the free
    /// set).
    fn inside_free_block(&self, address: u64, size: u64) -> bool {
        state::block_holding(&self.segments, address).is_some_and(|(s, b)| {
            let block = &self.segments[s].blocks[b];
            block.in_free_set() && address + size <= block.address + block.size
        })
    }

    /// Rule 23c: whether the view at index `v` is usable for a request of rounded size
    /// `rounded`: free, `⌈r / P⌉ = n`, and each piece it would hold lies wholly inside one
    /// free block.
    fn view_usable(&self, v: usize, rounded: u64) -> bool {
        let view = &self.views[v];
        view.allocation.is_none()
            && rounded.div_ceil(self.view_page()) == view.homes.len() as u64
            && self
                .pieces(&view.homes, rounded)
                .iter()
                .all(|&(address, size)| self.inside_free_block(address, size))
    }

    /// Rule 23d's search: the index of the usable view of `stream` made first, for a
    /// large-pool request of rounded size `rounded`. Nothing changes.
    pub(crate) fn view_candidate(&self, pool: Pool, stream: u64, rounded: u64) -> Option<usize> {
        if !self.stitching() || pool != Pool::Large {
            return None;
        }
        // The Vec is in the order made.
        (0..self.views.len())
            .find(|&v| self.views[v].stream == stream && self.view_usable(v, rounded))
    }

    /// Rule 23d: hands out the usable view at index `v` for a request of `requested` bytes
    /// rounded to `rounded`: its pieces are carved out of their free blocks in slot order and
    /// held, the view is in use, and the allocation is its first byte. No split; no device
    /// call. The address.
    pub(crate) fn hand_out_view(&mut self, v: usize, rounded: u64, requested: u64) -> u64 {
        assert!(self.view_usable(v, rounded), "a handed-out view is usable");
        // Rule 23k: the view's stream waits for each foreign stream's work so far.
        let stream = self.views[v].stream;
        for t in self.foreign_streams(v) {
            self.stream_waits.push((stream, t));
        }
        for (address, size) in self.pieces(&self.views[v].homes.clone(), rounded) {
            self.carve_piece(address, size);
        }
        self.view_tick += 1;
        let view = &mut self.views[v];
        view.last_used = self.view_tick;
        view.allocation = Some(ViewAllocation {
            rounded,
            requested,
            state: BlockState::Allocated,
            stream_uses: Vec::new(),
            pending_events: 0,
        });
        // Rule 14: the allocation's statistics rise by r (settled from the state).
        self.settle_stats();
        self.views[v].address
    }

    /// Rule 23d: carves the piece `[address, address + size)` out of the free block it lies
    /// in: the parts before and after it (those of nonzero size) stay free blocks and keep
    /// the time they entered the free set; the piece becomes a held block.
    fn carve_piece(&mut self, address: u64, size: u64) {
        let (s, b) = state::block_holding(&self.segments, address).expect("the piece's block");
        let blocks = &mut self.segments[s].blocks;
        let block = blocks[b].clone();
        let end = block.address + block.size;
        assert!(
            block.in_free_set() && address + size <= end,
            "a held piece lies wholly inside a free block"
        );
        let mut pieces = Vec::new();
        if block.address < address {
            pieces.push(Block::free(
                block.address,
                address - block.address,
                block.free_since,
            ));
        }
        pieces.push(Block::held(address, size));
        if address + size < end {
            pieces.push(Block::free(
                address + size,
                end - address - size,
                block.free_since,
            ));
        }
        blocks.splice(b..=b, pieces);
    }

    /// Rule 23k: the foreign streams of the view at index `v`: the streams other than its own
    /// of the ranges its homes lie in, ascending, each once.
    fn foreign_streams(&self, v: usize) -> Vec<u64> {
        let view = &self.views[v];
        let streams: BTreeSet<u64> = view
            .homes
            .iter()
            .map(|&h| {
                self.segments
                    .iter()
                    .find(|r| r.expandable && r.address <= h && h - r.address < r.size)
                    .expect("a home lies in a range")
                    .stream
            })
            .filter(|&t| t != view.stream)
            .collect();
        streams.into_iter().collect()
    }

    /// Rule 23k: the device's log of stream waits, `(waiter, on)`, in the order made.
    pub fn stream_waits(&self) -> &[(u64, u64)] {
        &self.stream_waits
    }

    /// The index of the view in use whose allocation is at `address`, if any.
    pub(crate) fn view_in_use_at(&self, address: u64) -> Option<usize> {
        self.views
            .iter()
            .position(|v| v.address == address && v.allocation.is_some())
    }

    /// The allocation of the view at index `v`, which is in use.
    pub(crate) fn view_allocation(&mut self, v: usize) -> &mut ViewAllocation {
        self.views[v]
            .allocation
            .as_mut()
            .expect("the view is in use")
    }

    /// Rules 15, 23e: the user frees the allocation of the view at index `v`. It stops being
    /// an allocation at once; then it waits for one event per other stream that used it, or
    /// returns now.
    pub(crate) fn free_view_allocation(&mut self, v: usize) {
        // Rule 23k: each foreign stream waits for the view's stream's work so far.
        let stream = self.views[v].stream;
        for t in self.foreign_streams(v) {
            self.stream_waits.push((t, stream));
        }
        let address = self.views[v].address;
        let allocation = self.view_allocation(v);
        allocation.state = BlockState::Pending;
        let streams = std::mem::take(&mut allocation.stream_uses);
        allocation.pending_events = streams.len();
        self.settle_stats();
        if streams.is_empty() {
            self.return_view(v);
        } else {
            for stream in streams {
                self.events.push(Event {
                    stream,
                    block: address,
                    complete: false,
                });
            }
        }
    }

    /// Rules 5, 9: one event of the pending allocation of the view at index `v` is done; the
    /// last one returns it (23e).
    pub(crate) fn view_event_done(&mut self, v: usize) {
        let allocation = self.view_allocation(v);
        allocation.pending_events -= 1;
        if allocation.pending_events == 0 {
            self.return_view(v);
        }
    }

    /// Rule 23e: the allocation of the view at index `v` returns: its statistics fall (`r`
    /// bytes), then each held piece, in slot order, returns to the pool as a free block
    /// (merging with free neighbours, entering the free set now, rule 10); the view is free.
    fn return_view(&mut self, v: usize) {
        let allocation = self.views[v]
            .allocation
            .take()
            .expect("a returned view is in use");
        self.settle_stats();
        for (address, _) in self.pieces(&self.views[v].homes.clone(), allocation.rounded) {
            let (s, b) = state::find_block(&self.segments, address).expect("a held piece");
            assert_eq!(self.segments[s].blocks[b].state, BlockState::Held);
            self.return_to_pool(s, b);
        }
    }

    /// Rule 23b: the statistics of the views' allocations, added to `gauges` (large pool).
    pub(crate) fn add_view_gauges(&self, gauges: &mut Gauges) {
        let max_split = self.config.max_split_size;
        for allocation in self.views.iter().filter_map(|v| v.allocation.as_ref()) {
            let pool = &mut gauges.large;
            if allocation.state == BlockState::Allocated {
                pool.allocation += 1;
                pool.allocated_bytes += allocation.rounded;
                if allocation.rounded >= max_split {
                    gauges.oversize_allocations += 1;
                }
            }
            pool.active += 1;
            pool.active_bytes += allocation.rounded;
            pool.requested_bytes += allocation.requested;
        }
    }

    /// Rule 20's test, for rule 23f: whether `reserved_bytes + need > limit` for a request of
    /// `requested` bytes rounded to `rounded` in `pool`. False without a headroom.
    fn over_reclaim_limit(&self, pool: Pool, rounded: u64, requested: u64) -> bool {
        let Some(headroom) = self.config.reclaim_headroom else {
            return false;
        };
        let limit = self.reclaim_limit(headroom, requested);
        let page = self.page_size(pool);
        let need = u128::from(rounded.div_ceil(page)) * u128::from(page);
        u128::from(self.reserved()) + need > limit
    }

    /// Rule 23f: at rule 20's point for a request of `requested` bytes rounded to `rounded`
    /// in `pool` on `stream`: when over the limit in the large pool with at least
    /// `k = ⌈r / P⌉` free pages, a view of `k` pages is made (after the cap, 23g) and handed
    /// out (23d). The allocation's address, or `None` (rule 20 goes on as written).
    pub(crate) fn view_before_reclaim(
        &mut self,
        pool: Pool,
        stream: u64,
        rounded: u64,
        requested: u64,
    ) -> Option<u64> {
        if !self.stitching() || pool != Pool::Large {
            return None;
        }
        if !self.over_reclaim_limit(pool, rounded, requested) {
            return None;
        }
        let page = self.view_page();
        let k = rounded.div_ceil(page);
        // The free pages, by giver: listed once; the large pool's before the small pool's,
        // then largest first, then by address.
        // Rule 23k: the ranges of every stream, the request's stream's blocks first.
        let mut givers = Vec::new();
        for range in &self.segments {
            if !range.expandable || !self.pool_stitches(range.pool) {
                continue;
            }
            for block in range.blocks.iter().filter(|b| b.in_free_set()) {
                let end = block.address + block.size;
                if let Some((first, last)) = whole_pages(range.address, page, block.address, end) {
                    // Rule 19j: only the slots of one-page handles.
                    let slots: Vec<u64> = (0..(last - first) / page)
                        .map(|i| first + i * page)
                        .filter(|&slot| self.one_page_handle(slot, page))
                        .collect();
                    if !slots.is_empty() {
                        givers.push(Giver {
                            foreign: range.stream != stream,
                            small: range.pool == Pool::Small,
                            page_bytes: slots.len() as u64 * page,
                            address: block.address,
                            slots,
                        });
                    }
                }
            }
        }
        let free_pages: u64 = givers.iter().map(|g| g.page_bytes / page).sum();
        if free_pages < k {
            return None;
        }
        givers.sort_by_key(|g| {
            (
                g.foreign,
                g.small,
                std::cmp::Reverse(g.page_bytes),
                g.address,
            )
        });
        // The runs taken, in the order taken: (first slot, slots).
        let mut runs: Vec<(u64, u64)> = Vec::new();
        let mut taken = 0;
        for giver in givers {
            if taken == k {
                break;
            }
            let m = (k - taken).min(giver.page_bytes / page);
            // Each maximal run of taken slots consecutive in the block is one alias: a run
            // never reaches into the next block, even where that one's slots come next (the
            // next range's, say, reserved right after this one).
            let block_runs = runs.len();
            for &slot in &giver.slots[..m as usize] {
                match runs[block_runs..].last_mut() {
                    Some((first, n)) if *first + *n * page == slot => *n += 1,
                    _ => runs.push((slot, 1)),
                }
                taken += 1;
            }
        }
        // Rule 23g: the cap.
        if !self.make_room_for_view(k * page) {
            return None;
        }
        let address = self.device.reserve(k * page, page);
        let mut mapped = 0;
        for &(first, slots) in &runs {
            if !self.device.alias(address + mapped, first, slots * page) {
                // Out-of-memory: the aliases made so far go, one unmap over them, and the
                // reservation is given back.
                if mapped > 0 {
                    self.device.unmap(address, mapped);
                    self.stats.num_device_free += 1;
                }
                self.device.release_reservation(address);
                return None;
            }
            self.stats.num_device_alloc += 1;
            mapped += slots * page;
        }
        let homes: Vec<u64> = runs
            .iter()
            .flat_map(|&(first, slots)| (0..slots).map(move |i| first + i * page))
            .collect();
        self.views.push(View {
            number: self.next_view,
            address,
            stream,
            homes,
            // Stamped by `hand_out_view` below, as every hand-out is.
            last_used: 0,
            allocation: None,
        });
        self.next_view += 1;
        let v = self.views.len() - 1;
        Some(self.hand_out_view(v, rounded, requested))
    }

    /// The bytes of address space all views hold together.
    fn view_bytes(&self) -> u128 {
        let page = u128::from(self.view_page());
        self.views
            .iter()
            .map(|v| v.homes.len() as u128 * page)
            .sum()
    }

    /// Rule 23g: the cap, `2 × capacity` bytes of address space for all views.
    fn view_cap(&self) -> u128 {
        2 * u128::from(self.device.capacity())
    }

    /// Rule 23g: while the views' bytes plus `bytes` would pass the cap, the free view handed
    /// out (or made) least recently is destroyed. Whether the new view fits then.
    fn make_room_for_view(&mut self, bytes: u64) -> bool {
        while self.view_bytes() + u128::from(bytes) > self.view_cap() {
            let oldest = (0..self.views.len())
                .filter(|&v| self.views[v].allocation.is_none())
                .min_by_key(|&v| self.views[v].last_used);
            match oldest {
                Some(v) => self.destroy_view(v),
                None => return false,
            }
        }
        true
    }

    /// Rule 23h: destroys the free view at index `v`: one unmap of its whole reservation, the
    /// reservation given back, `num_device_free` += 1; its pages stay mapped at their homes.
    fn destroy_view(&mut self, v: usize) {
        let view = self.views.remove(v);
        assert!(view.allocation.is_none(), "only a free view is destroyed");
        let bytes = view.homes.len() as u64 * self.view_page();
        self.device.unmap(view.address, bytes);
        self.device.release_reservation(view.address);
        self.stats.num_device_free += 1;
    }

    /// Rule 23h: rule 19e or rule 20 is about to unmap the home slots in `[first, last)`:
    /// every view mapping one of them (free, since a view in use holds a part of every page
    /// it maps) is destroyed first, in the order made.
    pub(crate) fn destroy_views_mapping(&mut self, first: u64, last: u64) {
        while let Some(v) = self.views.iter().position(|view| {
            view.homes
                .iter()
                .any(|&h| overlaps(h, self.view_page(), first, last - first))
        }) {
            self.destroy_view(v);
        }
    }

    /// Rule 23h, for rule 9: every free view, in the order made.
    pub(crate) fn destroy_free_views(&mut self) {
        while let Some(v) = self.views.iter().position(|view| view.allocation.is_none()) {
            self.destroy_view(v);
        }
    }

    /// The views, in the order made, as `(address, bytes, in use)`.
    pub fn views(&self) -> Vec<(u64, u64, bool)> {
        let page = self.view_page();
        self.views
            .iter()
            .map(|v| {
                (
                    v.address,
                    v.homes.len() as u64 * page,
                    v.allocation.is_some(),
                )
            })
            .collect()
    }

    /// Whether the device reservation at `base` is a view's.
    pub(crate) fn is_view(&self, base: u64) -> bool {
        self.views.iter().any(|v| v.address == base)
    }

    /// The home slots views map, each with the view slot mapping it, as `(home, slot)`.
    pub(crate) fn view_mappings(&self) -> Vec<(u64, u64)> {
        let page = self.view_page();
        let mut out = Vec::new();
        for view in &self.views {
            for (i, &h) in view.homes.iter().enumerate() {
                out.push((h, view.address + i as u64 * page));
            }
        }
        out
    }

    /// Rule 23j: every view's slots map distinct pages whose homes are mapped slots of
    /// ranges of any stream (rule 23k; of the pools of 23a), on the device too; a view in use holds
    /// exactly the pieces of 23b and a free view none; every held piece belongs to exactly
    /// one view in use; the views' bytes are within the cap; numbers rise in the order made.
    pub(crate) fn check_views(&self) -> Result<(), InvariantViolation> {
        let fault = |detail: String| Err(InvariantViolation::View { detail });
        if !self.stitching() && !self.views.is_empty() {
            return fault("views exist while page stitching is off".into());
        }
        let page = self.view_page();
        let mut expected_pieces: Vec<(u64, u64)> = Vec::new();
        let mut held_by_views: u64 = 0;
        for (i, view) in self.views.iter().enumerate() {
            // Built only when a message prints it (this check runs after every operation).
            let name =
                std::fmt::from_fn(|f| write!(f, "view {} at {:#x}", view.number, view.address));
            if i > 0 && self.views[i - 1].number >= view.number {
                return fault(format!("{name}: out of the order made"));
            }
            let n = view.homes.len();
            let distinct: BTreeSet<u64> = view.homes.iter().copied().collect();
            if n == 0 || distinct.len() != n {
                return fault(format!(
                    "{name}: {n} slots, {} distinct homes",
                    distinct.len()
                ));
            }
            let Some(reservation) = self
                .device
                .reservations()
                .iter()
                .find(|r| r.base == view.address)
            else {
                return fault(format!("{name}: no device reservation"));
            };
            if reservation.size != n as u64 * page || reservation.slots.len() != n {
                return fault(format!(
                    "{name}: the reservation is not n whole mapped slots"
                ));
            }
            for (slot, &home) in view.homes.iter().enumerate() {
                let Some(s) = self
                    .segments
                    .iter()
                    .position(|r| r.expandable && r.address <= home && home - r.address < r.size)
                else {
                    return fault(format!("{name}: home {home:#x} lies in no range"));
                };
                let range = &self.segments[s];
                // Rule 23k: a range of any stream.
                if !self.pool_stitches(range.pool) || !(home - range.address).is_multiple_of(page) {
                    return fault(format!(
                        "{name}: home {home:#x} is not a slot of its ranges"
                    ));
                }
                let mapped = range
                    .blocks
                    .iter()
                    .filter(|b| overlaps(b.address, b.size, home, page))
                    .all(|b| b.mapped);
                let device_page = self.device.page_at(home);
                if !mapped || device_page.is_none() {
                    return fault(format!("{name}: home {home:#x} is not mapped"));
                }
                let at = view.address + slot as u64 * page;
                if reservation.slots.get(&at).copied() != device_page {
                    return fault(format!("{name}: slot {at:#x} does not map home {home:#x}"));
                }
            }
            if let Some(allocation) = &view.allocation {
                let r = allocation.rounded;
                let fine = r > (n as u64 - 1) * page
                    && r <= n as u64 * page
                    && allocation.requested > 0
                    && allocation.requested <= r
                    && match allocation.state {
                        BlockState::Allocated => {
                            allocation.pending_events == 0
                                && allocation.stream_uses.windows(2).all(|w| w[0] < w[1])
                                && !allocation.stream_uses.contains(&view.stream)
                        }
                        BlockState::Pending => {
                            allocation.stream_uses.is_empty()
                                && allocation.pending_events > 0
                                && allocation.pending_events
                                    == self
                                        .events
                                        .iter()
                                        .filter(|e| e.block == view.address)
                                        .count()
                        }
                        BlockState::Free | BlockState::Held => false,
                    };
                if !fine {
                    return fault(format!("{name}: inconsistent allocation {allocation:?}"));
                }
                expected_pieces.extend(self.pieces(&view.homes, r));
                held_by_views += r;
            }
        }
        let mut held: Vec<(u64, u64)> = Vec::new();
        for range in self.segments.iter().filter(|r| r.expandable) {
            for block in range.blocks.iter().filter(|b| b.state == BlockState::Held) {
                if !block.mapped || block.requested != 0 || !block.stream_uses.is_empty() {
                    return fault(format!("held piece {:#x} holds state", block.address));
                }
                held.push((block.address, block.size));
            }
        }
        for segment in self.segments.iter().filter(|s| !s.expandable) {
            if segment.blocks.iter().any(|b| b.state == BlockState::Held) {
                return fault(format!("segment {:#x} holds a piece", segment.address));
            }
        }
        held.sort_unstable();
        expected_pieces.sort_unstable();
        if held != expected_pieces {
            return fault(format!(
                "held pieces {held:x?} are not the views' pieces {expected_pieces:x?}"
            ));
        }
        if held.iter().map(|&(_, size)| size).sum::<u64>() != held_by_views {
            return fault("held bytes differ from the views' allocations".into());
        }
        if self.view_bytes() > self.view_cap() {
            return fault(format!(
                "views hold {} bytes, over the cap",
                self.view_bytes()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;

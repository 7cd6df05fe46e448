//! The simulated device: memory bookkeeping and stream events without a GPU.
//!
//! The one rule: every choice it makes is deterministic and written in ARCHITECTURE.md ("The
//! simulated device"), because the reference model simulates the same device in its own code
//! and the two must hand out the same addresses.

use std::collections::{BTreeMap, HashMap, VecDeque};

use super::{Backend, BackendError, EventId, MemInfo, StreamId};

/// The lowest address the simulated device hands out when it has no script.
pub(crate) const SIM_BASE_ADDRESS: u64 = 0x7f00_0000_0000;
/// Addresses the simulated device invents are aligned to this (2 MiB).
pub(crate) const SIM_ALIGNMENT: u64 = 2 << 20;

/// Faults to inject into a [`SimDevice`]: each counter makes that many upcoming calls fail.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    /// Allocations that report out-of-memory.
    pub alloc_oom: u32,
    /// Allocations that report a device error other than out-of-memory.
    pub alloc_error: u32,
    /// Frees that report a device error (the memory stays allocated).
    pub free_error: u32,
    /// Event recordings that fail (a stream wait, rule 23k, records one: it counts).
    pub record_error: u32,
    /// Event queries that fail.
    pub query_error: u32,
    /// Event synchronisations that fail.
    pub sync_error: u32,
}

/// A device of fixed capacity that hands out addresses, records events, and fails on request.
#[derive(Debug, Clone)]
pub struct SimDevice {
    capacity: u64,
    used: u64,
    segments: BTreeMap<u64, u64>,
    script: VecDeque<u64>,
    next_address: Option<u64>,
    faults: Faults,
    /// Per stream: events recorded so far, and how many of them have completed.
    streams: HashMap<StreamId, (u64, u64)>,
    events: HashMap<EventId, (StreamId, u64)>,
    next_event: u64,
    device_allocs: u64,
    device_frees: u64,
    /// Address space reserved for expandable segments (rule 19): first address → reservation.
    reservations: BTreeMap<u64, Reservation>,
    /// The page table's other half (rule 22h): by page id, every page that exists with its
    /// mappings (`None`: an id free for reuse, in `vacant`).
    pages: Vec<Option<Page>>,
    vacant: Vec<u32>,
    /// Rule 19j: the home mappings of handles of several pages ([`Backend::map_handle`]), by
    /// first address: their bytes. Unmapped only whole, never aliased.
    handles: BTreeMap<u64, u64>,
    /// Handles created so far: one per page by [`Backend::map`], one per
    /// [`Backend::map_handle`] call (each a `cuMemCreate` on a GPU; adopted pages are not).
    handles_created: u64,
    /// Rule 23k: the latest stream waits made ([`Backend::wait_stream`]), `(waiter, on)`, in
    /// order, at most [`STREAM_WAIT_LOG`] of them (a long replay's device stays small)…
    stream_waits: VecDeque<(StreamId, StreamId)>,
    /// …and how many were made in all.
    stream_wait_count: u64,
}

/// How many of the latest stream waits a [`SimDevice`] keeps ([`SimDevice::stream_waits`]).
pub const STREAM_WAIT_LOG: usize = 1024;

/// A slot that maps no page.
const NO_PAGE: u32 = u32::MAX;

/// A physical page of the simulated device (rule 22h): one `cuMemCreate` handle, mapped at one
/// address or more ([`Backend::alias`]). An id is reused only once its page is gone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PageId(pub u64);

/// What [`SimDevice::physical_overlap`] found wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PhysicalOverlap {
    /// Bytes of one page lie under two live allocations.
    Shared {
        /// The page.
        page: PageId,
        /// The shared bytes, as offsets within the page: `[start, end)`.
        bytes: (u64, u64),
        /// One allocation's address.
        first: u64,
        /// The other's.
        second: u64,
    },
    /// A byte of a live allocation that nothing maps.
    Unmapped {
        /// The allocation's address.
        address: u64,
        /// The byte.
        at: u64,
    },
}

/// One reservation of address space and what is mapped in it.
#[derive(Debug, Clone)]
struct Reservation {
    size: u64,
    page: u64,
    /// The page table (rule 22h): per slot (`page` bytes, in address order) the id of the page
    /// it maps, or [`NO_PAGE`]; grown on demand (slots past its end map nothing).
    slots: Vec<u32>,
    /// Slots that map a page.
    mapped: u64,
}

impl Reservation {
    /// The page slot `i` maps, or [`NO_PAGE`].
    fn page_of(&self, i: usize) -> u32 {
        self.slots.get(i).copied().unwrap_or(NO_PAGE)
    }

    fn set(&mut self, i: usize, id: u32) {
        if i >= self.slots.len() {
            self.slots.resize(i + 1, NO_PAGE);
        }
        self.slots[i] = id;
    }
}

/// A page and where it is mapped.
#[derive(Debug, Clone)]
struct Page {
    /// Its size: the page of the reservation it was created in.
    size: u64,
    /// The slot that mapped it first, while it is mapped there…
    first: Option<u64>,
    /// …and its other mappings. The page's memory goes back when both are empty.
    more: Vec<u64>,
}

impl Page {
    fn mappings(&self) -> impl Iterator<Item = u64> + '_ {
        self.first.into_iter().chain(self.more.iter().copied())
    }

    /// Forgets the mapping at `slot`; true when it was the last one.
    fn unmap(&mut self, slot: u64) -> bool {
        if self.first == Some(slot) {
            self.first = None;
        } else if let Some(i) = self.more.iter().position(|&m| m == slot) {
            self.more.swap_remove(i);
        }
        self.first.is_none() && self.more.is_empty()
    }
}

impl SimDevice {
    /// A device with `capacity` bytes of memory.
    pub fn new(capacity: u64) -> SimDevice {
        SimDevice {
            capacity,
            used: 0,
            segments: BTreeMap::new(),
            script: VecDeque::new(),
            next_address: None,
            faults: Faults::default(),
            streams: HashMap::new(),
            events: HashMap::new(),
            next_event: 1,
            device_allocs: 0,
            device_frees: 0,
            reservations: BTreeMap::new(),
            pages: Vec::new(),
            vacant: Vec::new(),
            handles: BTreeMap::new(),
            handles_created: 0,
            stream_waits: VecDeque::new(),
            stream_wait_count: 0,
        }
    }

    /// Hands out these addresses first, in order (a recorded trace's segment addresses). A
    /// script address that is not usable (0, not a multiple of 512, overflowing, or whose range
    /// overlaps a live allocation) is skipped: consumed, not used.
    pub fn with_address_script(mut self, addresses: impl IntoIterator<Item = u64>) -> SimDevice {
        self.script = addresses.into_iter().collect();
        self
    }

    /// The next successful allocation takes `address` if it is usable (nonzero, a multiple of
    /// 512, not overflowing, overlapping no live allocation); else the device picks as usual
    /// (the script, then the lowest free address). A successful allocation clears it, used or
    /// not; a failed one leaves it set; `None` clears it. A usable next address does not
    /// consume a script address.
    pub fn set_next_address(&mut self, address: Option<u64>) {
        self.next_address = address;
    }

    /// Makes upcoming calls fail (adds to the faults already pending).
    pub fn inject(&mut self, faults: Faults) {
        let f = &mut self.faults;
        f.alloc_oom = f.alloc_oom.saturating_add(faults.alloc_oom);
        f.alloc_error = f.alloc_error.saturating_add(faults.alloc_error);
        f.free_error = f.free_error.saturating_add(faults.free_error);
        f.record_error = f.record_error.saturating_add(faults.record_error);
        f.query_error = f.query_error.saturating_add(faults.query_error);
        f.sync_error = f.sync_error.saturating_add(faults.sync_error);
    }

    /// The next `n` allocations report out-of-memory, whatever the capacity.
    pub fn fail_next_allocs(&mut self, n: u32) {
        self.inject(Faults {
            alloc_oom: n,
            ..Faults::default()
        });
    }

    /// Clears all pending faults.
    pub fn clear_faults(&mut self) {
        self.faults = Faults::default();
    }

    /// Rule 23k: the latest stream waits the allocator made, `(waiter, on)`, in the order made
    /// — all of them while there are at most [`STREAM_WAIT_LOG`].
    pub fn stream_waits(&self) -> Vec<(StreamId, StreamId)> {
        self.stream_waits.iter().copied().collect()
    }

    /// Rule 23k: how many stream waits the allocator made in all.
    pub fn stream_wait_count(&self) -> u64 {
        self.stream_wait_count
    }

    /// Completes the work queued on `stream` so far: every event recorded on it until now.
    pub fn complete_stream(&mut self, stream: StreamId) {
        if let Some((recorded, done)) = self.streams.get_mut(&stream) {
            *done = *recorded;
        }
    }

    /// Bytes handed out and not yet freed.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// The device's capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Live allocations as `(address, size)`, by address.
    pub fn allocations(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.segments.iter().map(|(&a, &s)| (a, s))
    }

    /// Events recorded and not yet destroyed.
    pub fn live_events(&self) -> usize {
        self.events.len()
    }

    /// Successful allocations and frees so far: allocations count [`Backend::allocate`],
    /// [`Backend::map`] and [`Backend::alias`] calls, frees count [`Backend::free`] and
    /// [`Backend::unmap`] calls.
    pub fn call_counts(&self) -> (u64, u64) {
        (self.device_allocs, self.device_frees)
    }

    /// Handles created so far (rule 19j): one per page mapped by [`Backend::map`], one per
    /// [`Backend::map_handle`] call — what a GPU would spend a `cuMemCreate`, a `cuMemMap` and
    /// a `cuMemSetAccess` on, whatever the call counts say.
    pub fn handles_created(&self) -> u64 {
        self.handles_created
    }

    /// Rule 19j: the handles of several pages that share a byte with `[address, address +
    /// size)`, as `(first address, bytes)`.
    fn handles_touching(&self, address: u64, size: u64) -> Vec<(u64, u64)> {
        crate::backend::extents_touching(&self.handles, address, size)
    }

    fn overlaps(&self, address: u64, size: u64) -> bool {
        let end = address.saturating_add(size);
        // The last range starting below `end` is the only one of each map that can overlap.
        self.segments
            .range(..end)
            .next_back()
            .is_some_and(|(&a, &s)| a.saturating_add(s) > address)
            || self
                .reservations
                .range(..end)
                .next_back()
                .is_some_and(|(&a, r)| a.saturating_add(r.size) > address)
    }

    /// Every live allocation and reservation as `(address, size)`, by address.
    fn occupied(&self) -> Vec<(u64, u64)> {
        let mut all: Vec<(u64, u64)> = self.allocations().collect();
        all.extend(self.reservations.iter().map(|(&a, r)| (a, r.size)));
        all.sort_unstable();
        all
    }

    /// Reservations and what is mapped in them: `(address, size, mapped bytes)`, by address
    /// (a page mapped at several addresses counts at each).
    pub fn reservations(&self) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        self.reservations
            .iter()
            .map(|(&a, r)| (a, r.size, r.mapped * r.page))
    }

    /// A new physical page of `size` bytes, first mapped at `slot` (a vacant id reused first).
    fn create_page(&mut self, size: u64, slot: u64) -> u32 {
        let created = Page {
            size,
            first: Some(slot),
            more: Vec::new(),
        };
        match self.vacant.pop() {
            Some(id) => {
                self.pages[id as usize] = Some(created);
                id
            }
            None => {
                self.pages.push(Some(created));
                (self.pages.len() - 1) as u32
            }
        }
    }

    /// The page mapped at `address` (any address inside a mapped slot of a reservation), or
    /// `None` where nothing is mapped (rule 22h's page table, for tests and the harness).
    pub fn page_at(&self, address: u64) -> Option<PageId> {
        let (&base, r) = self.reservations.range(..=address).next_back()?;
        if address - base >= r.size {
            return None;
        }
        let id = r.page_of(((address - base) / r.page) as usize);
        (id != NO_PAGE).then_some(PageId(u64::from(id)))
    }

    /// The slot of a reservation that holds `address`: its first address and size (the
    /// reservation's page), mapped or not; `None` outside every reservation.
    pub fn slot_at(&self, address: u64) -> Option<(u64, u64)> {
        let (&base, r) = self.reservations.range(..=address).next_back()?;
        (address - base < r.size).then(|| (base + (address - base) / r.page * r.page, r.page))
    }

    /// Rules 22i and 23i, on this device's page tables: whether the physical bytes under
    /// `live` (each an allocation's address and bytes, through whatever addresses map its
    /// pages) are pairwise disjoint, byte for byte — a view's allocation may use the first
    /// bytes of a page whose others lie under another block. The first overlap found, or the
    /// first byte of an allocation that nothing maps. For tests and the harness.
    pub fn physical_overlap(
        &self,
        live: impl IntoIterator<Item = (u64, u64)>,
    ) -> Result<(), PhysicalOverlap> {
        // (page, first byte, end byte within the page, the allocation's address)
        let mut pieces: Vec<(PageId, u64, u64, u64)> = Vec::new();
        for (address, size) in live {
            let mut at = address;
            while at < address.saturating_add(size) {
                let found = self
                    .slot_at(at)
                    .and_then(|(slot, page)| Some((slot, page, self.page_at(slot)?)));
                let Some((slot, page, id)) = found else {
                    return Err(PhysicalOverlap::Unmapped { address, at });
                };
                let end = (address + size).min(slot + page);
                pieces.push((id, at - slot, end - slot, address));
                at = end;
            }
        }
        pieces.sort_unstable();
        for w in pieces.windows(2) {
            if w[0].0 == w[1].0 && w[0].2 > w[1].1 {
                return Err(PhysicalOverlap::Shared {
                    page: w[0].0,
                    bytes: (w[1].1, w[0].2.min(w[1].2)),
                    first: w[0].3,
                    second: w[1].3,
                });
            }
        }
        Ok(())
    }

    /// The slots where `page` is mapped, by address (empty for a page that no longer exists).
    pub fn mappings(&self, page: PageId) -> Vec<u64> {
        let mut out: Vec<u64> = usize::try_from(page.0)
            .ok()
            .and_then(|i| self.pages.get(i))
            .and_then(Option::as_ref)
            .map(|p| p.mappings().collect())
            .unwrap_or_default();
        out.sort_unstable();
        out
    }

    /// How many pages exist (each counted once against capacity, however often it is mapped).
    pub fn page_count(&self) -> usize {
        self.pages.len() - self.vacant.len()
    }

    /// The reservation holding `[address, address + size)` as whole pages of its page size:
    /// its first address and page, or `None`.
    fn whole_pages(&self, address: u64, size: u64) -> Option<(u64, u64)> {
        let (&base, r) = self.reservations.range(..=address).next_back()?;
        let end = address.checked_add(size)?;
        (size != 0
            && end <= base + r.size
            && (address - base).is_multiple_of(r.page)
            && size.is_multiple_of(r.page))
        .then_some((base, r.page))
    }

    /// Whether every slot of `[address, address + size)` in the reservation at `base` is
    /// mapped (`true`) or none is (`false`); `None` when it is a mix.
    fn all_mapped(&self, base: u64, address: u64, size: u64) -> Option<bool> {
        let r = &self.reservations[&base];
        let first = ((address - base) / r.page) as usize;
        let n = (first..first + (size / r.page) as usize)
            .filter(|&i| r.page_of(i) != NO_PAGE)
            .count() as u64;
        if n == 0 {
            Some(false)
        } else if n * r.page == size {
            Some(true)
        } else {
            None
        }
    }

    fn usable(&self, address: u64, size: u64) -> bool {
        address != 0
            && address.is_multiple_of(512)
            && address.checked_add(size).is_some()
            && !self.overlaps(address, size)
    }

    fn place(&mut self, size: u64) -> Option<u64> {
        if let Some(a) = self.next_address
            && self.usable(a, size)
        {
            return Some(a);
        }
        while let Some(a) = self.script.pop_front() {
            if self.usable(a, size) {
                return Some(a);
            }
        }
        self.lowest_free(size)
    }

    /// The lowest address at or above [`SIM_BASE_ADDRESS`], aligned to [`SIM_ALIGNMENT`], where
    /// `size` bytes overlap no live allocation or reservation.
    fn lowest_free(&self, size: u64) -> Option<u64> {
        let mut candidate = SIM_BASE_ADDRESS;
        let occupied = if self.reservations.is_empty() {
            self.allocations().collect()
        } else {
            self.occupied()
        };
        // From the last range starting below the base (it may reach past it) onwards.
        let from = occupied.partition_point(|&(a, _)| a < SIM_BASE_ADDRESS);
        for &(a, s) in &occupied[from.saturating_sub(1)..] {
            let end = a.checked_add(s)?;
            if end <= candidate {
                continue;
            }
            if candidate.checked_add(size)? <= a {
                return Some(candidate);
            }
            candidate = end.checked_next_multiple_of(SIM_ALIGNMENT)?;
        }
        candidate.checked_add(size).map(|_| candidate)
    }
}

fn take(counter: &mut u32) -> bool {
    if *counter > 0 {
        *counter -= 1;
        true
    } else {
        false
    }
}

/// The error an injected fault reports.
fn device_error(operation: &'static str) -> BackendError {
    BackendError::Injected { operation }
}

impl Backend for SimDevice {
    fn allocate(&mut self, size: u64) -> Result<u64, BackendError> {
        if take(&mut self.faults.alloc_error) {
            return Err(device_error("allocate"));
        }
        if take(&mut self.faults.alloc_oom) {
            return Err(BackendError::OutOfMemory);
        }
        if size == 0 || self.used.saturating_add(size) > self.capacity {
            return Err(BackendError::OutOfMemory);
        }
        let address = self.place(size).ok_or(BackendError::OutOfMemory)?;
        self.next_address = None;
        self.segments.insert(address, size);
        self.used += size;
        self.device_allocs += 1;
        Ok(address)
    }

    fn free(&mut self, address: u64, size: u64) -> Result<(), BackendError> {
        if take(&mut self.faults.free_error) {
            return Err(device_error("free"));
        }
        match self.segments.get(&address) {
            Some(&s) if s == size => {
                self.segments.remove(&address);
                self.used -= size;
                self.device_frees += 1;
                Ok(())
            }
            _ => Err(BackendError::Device {
                operation: "free",
                message: format!("{address:#x} (+{size}) is not a live allocation"),
            }),
        }
    }

    fn mem_info(&mut self) -> Result<MemInfo, BackendError> {
        Ok(MemInfo {
            free: self.capacity - self.used,
            total: self.capacity,
        })
    }

    fn record_event(&mut self, stream: StreamId) -> Result<EventId, BackendError> {
        if take(&mut self.faults.record_error) {
            return Err(device_error("record_event"));
        }
        let entry = self.streams.entry(stream).or_insert((0, 0));
        entry.0 += 1;
        let id = EventId(self.next_event);
        self.next_event += 1;
        self.events.insert(id, (stream, entry.0));
        Ok(id)
    }

    fn query_event(&mut self, event: EventId) -> Result<bool, BackendError> {
        if take(&mut self.faults.query_error) {
            return Err(device_error("query_event"));
        }
        let (stream, seq) = self
            .events
            .get(&event)
            .copied()
            .ok_or_else(|| unknown(event))?;
        Ok(self
            .streams
            .get(&stream)
            .is_some_and(|&(_, done)| done >= seq))
    }

    fn synchronize_event(&mut self, event: EventId) -> Result<(), BackendError> {
        if take(&mut self.faults.sync_error) {
            return Err(device_error("synchronize_event"));
        }
        let (stream, seq) = self
            .events
            .get(&event)
            .copied()
            .ok_or_else(|| unknown(event))?;
        // Waiting for an event means the stream has reached it, and so every earlier event.
        if let Some((_, done)) = self.streams.get_mut(&stream) {
            *done = (*done).max(seq);
        }
        Ok(())
    }

    fn destroy_event(&mut self, event: EventId) {
        self.events.remove(&event);
    }

    /// Rule 18: the range counts as used from now on. Refused with out-of-memory when it does
    /// not fit the capacity left, and with a device error when it is empty, overflows or
    /// overlaps a live allocation. Injected faults do not apply, and it is not counted as an
    /// allocation in [`SimDevice::call_counts`].
    fn adopt(&mut self, address: u64, size: u64) -> Result<(), BackendError> {
        if size == 0 || address.checked_add(size).is_none() || self.overlaps(address, size) {
            return Err(BackendError::Device {
                operation: "adopt",
                message: format!(
                    "{address:#x} (+{size}) is empty, overflows or overlaps a live allocation"
                ),
            });
        }
        if self.used.saturating_add(size) > self.capacity {
            return Err(BackendError::OutOfMemory);
        }
        self.segments.insert(address, size);
        self.used += size;
        Ok(())
    }

    /// Rule 18f: reserves `size` bytes at `address` and creates a page for every slot of the
    /// `mapped` runs, counted against capacity. Refused with a device error when the range is
    /// empty, not whole pages, overflows or overlaps a live allocation or reservation, or a run
    /// is not whole pages inside it (in address order, not overlapping); with out-of-memory
    /// when the mapped bytes do not fit the capacity left. Injected faults do not apply, and it
    /// is not counted as an allocation in [`SimDevice::call_counts`].
    fn adopt_range(
        &mut self,
        address: u64,
        size: u64,
        page: u64,
        mapped: &[(u64, u64)],
    ) -> Result<(), BackendError> {
        let refuse = |why: &str| BackendError::Device {
            operation: "adopt_range",
            message: format!("{address:#x} (+{size}): {why}"),
        };
        if size == 0 || page == 0 || !size.is_multiple_of(page) {
            return Err(refuse("not a whole number of pages"));
        }
        if address == 0 || address.checked_add(size).is_none() || self.overlaps(address, size) {
            return Err(refuse(
                "empty, overflows or overlaps a live allocation or reservation",
            ));
        }
        let mut at = address;
        let mut bytes: u64 = 0;
        for &(a, n) in mapped {
            let inside = a >= at && n > 0 && a - address <= size && n <= size - (a - address);
            if !inside || !(a - address).is_multiple_of(page) || !n.is_multiple_of(page) {
                return Err(refuse(
                    "a mapped run is not whole pages inside it, in order",
                ));
            }
            at = a + n;
            bytes += n;
        }
        if self.used.saturating_add(bytes) > self.capacity {
            return Err(BackendError::OutOfMemory);
        }
        let mut r = Reservation {
            size,
            page,
            slots: Vec::new(),
            mapped: 0,
        };
        for &(a, n) in mapped {
            for slot in (a..a + n).step_by(page as usize) {
                let id = self.create_page(page, slot);
                r.set(((slot - address) / page) as usize, id);
            }
            r.mapped += n / page;
        }
        self.reservations.insert(address, r);
        self.used += bytes;
        Ok(())
    }

    fn virtual_memory(&self) -> bool {
        true
    }

    /// Rule 23k: logged, in order ([`SimDevice::stream_waits`]). A wait records an event, so
    /// an injected recording fault ([`Faults::record_error`]) fails it, with nothing logged.
    fn wait_stream(&mut self, waiter: StreamId, on: StreamId) -> Result<(), BackendError> {
        if take(&mut self.faults.record_error) {
            return Err(device_error("wait_stream"));
        }
        if self.stream_waits.len() == STREAM_WAIT_LOG {
            self.stream_waits.pop_front();
        }
        self.stream_waits.push_back((waiter, on));
        self.stream_wait_count += 1;
        Ok(())
    }

    /// Rule 19: the next address when set and usable for `size` (cleared by the success), else
    /// the lowest free one; never the address script, never counted against capacity.
    fn reserve(&mut self, size: u64, page: u64) -> Result<u64, BackendError> {
        if size == 0 || page == 0 || !size.is_multiple_of(page) {
            return Err(BackendError::Device {
                operation: "reserve",
                message: format!("{size} bytes is not a whole number of {page}-byte pages"),
            });
        }
        let address = match self.next_address {
            Some(a) if self.usable(a, size) => a,
            _ => self.lowest_free(size).ok_or(BackendError::OutOfMemory)?,
        };
        self.next_address = None;
        self.reservations.insert(
            address,
            Reservation {
                size,
                page,
                slots: Vec::new(),
                mapped: 0,
            },
        );
        Ok(address)
    }

    fn release_reservation(&mut self, address: u64, size: u64) -> Result<(), BackendError> {
        match self.reservations.get(&address) {
            Some(r) if r.size == size && r.mapped == 0 => {
                self.reservations.remove(&address);
                Ok(())
            }
            _ => Err(BackendError::Device {
                operation: "release_reservation",
                message: format!("{address:#x} (+{size}) is not a reservation with nothing mapped"),
            }),
        }
    }

    /// Creates one page per slot (rule 22h's page table) and counts them against capacity like
    /// an allocation; takes injected allocation faults and [`SimDevice::fail_next_allocs`] the
    /// same way; counted as an allocation in [`SimDevice::call_counts`].
    fn map(&mut self, address: u64, size: u64) -> Result<(), BackendError> {
        let Some((base, page)) = self.whole_pages(address, size) else {
            return Err(not_mappable("map", address, size));
        };
        if self.all_mapped(base, address, size) != Some(false) {
            return Err(not_mappable("map", address, size));
        }
        if take(&mut self.faults.alloc_error) {
            return Err(device_error("map"));
        }
        if take(&mut self.faults.alloc_oom) || self.used.saturating_add(size) > self.capacity {
            return Err(BackendError::OutOfMemory);
        }
        let created: Vec<(u64, u32)> = (address..address + size)
            .step_by(page as usize)
            .map(|slot| (slot, self.create_page(page, slot)))
            .collect();
        let r = self.reservations.get_mut(&base).expect("found above");
        for (slot, id) in created {
            r.set(((slot - base) / page) as usize, id);
        }
        r.mapped += size / page;
        self.used += size;
        self.device_allocs += 1;
        self.handles_created += size / page;
        Ok(())
    }

    /// Rule 19j: maps as [`Backend::map`] does, but as one handle of all `size` bytes (more
    /// than one page): its mapping is unmapped only whole and never aliased. One handle
    /// created; counted as an allocation in [`SimDevice::call_counts`].
    fn map_handle(&mut self, address: u64, size: u64) -> Result<(), BackendError> {
        match self.whole_pages(address, size) {
            Some((_, page)) if size > page => {}
            _ => return Err(not_mappable("map_handle", address, size)),
        }
        let created = self.handles_created;
        self.map(address, size)?;
        self.handles_created = created + 1;
        self.handles.insert(address, size);
        Ok(())
    }

    /// Unmaps the mappings of whole mapped slots (any run of them, across maps and aliases):
    /// only those mappings go, and a page's memory is given back when its last one does
    /// (rule 22h). Takes injected free faults; counted as a free in
    /// [`SimDevice::call_counts`].
    fn unmap(&mut self, address: u64, size: u64, _stream: StreamId) -> Result<(), BackendError> {
        let Some((base, page)) = self.whole_pages(address, size) else {
            return Err(not_mappable("unmap", address, size));
        };
        if self.all_mapped(base, address, size) != Some(true) {
            return Err(not_mappable("unmap", address, size));
        }
        // Rule 19j: a handle's mapping goes only whole (CUDA_ERROR_INVALID_VALUE on a GPU).
        let touched = self.handles_touching(address, size);
        if touched
            .iter()
            .any(|&(a, b)| a < address || a + b > address + size)
        {
            return Err(BackendError::Device {
                operation: "unmap",
                message: format!(
                    "{address:#x} (+{size}) cuts the mapping of a handle of several pages"
                ),
            });
        }
        if take(&mut self.faults.free_error) {
            return Err(device_error("unmap"));
        }
        for (a, _) in touched {
            self.handles.remove(&a);
        }
        let r = self.reservations.get_mut(&base).expect("found above");
        for slot in (address..address + size).step_by(page as usize) {
            let i = ((slot - base) / page) as usize;
            let id = r.slots[i];
            r.slots[i] = NO_PAGE;
            let entry = &mut self.pages[id as usize];
            let p = entry.as_mut().expect("a mapped page exists");
            if p.unmap(slot) {
                self.used -= p.size;
                *entry = None;
                self.vacant.push(id);
            }
        }
        r.mapped -= size / page;
        self.device_frees += 1;
        Ok(())
    }

    /// Maps the pages at `source` again at `address` (rule 22h): the target must be unmapped
    /// whole slots of one reservation, the source mapped whole slots of one reservation with
    /// the same page size, the two apart. No memory is created (nothing counts against
    /// capacity); takes injected allocation faults and [`SimDevice::fail_next_allocs`] as a
    /// map does; counted as an allocation in [`SimDevice::call_counts`].
    fn alias(&mut self, address: u64, source: u64, size: u64) -> Result<(), BackendError> {
        let refuse = || not_mappable("alias", address, size);
        let (Some((base, page)), Some((source_base, source_page))) = (
            self.whole_pages(address, size),
            self.whole_pages(source, size),
        ) else {
            return Err(refuse());
        };
        let apart =
            address.saturating_add(size) <= source || source.saturating_add(size) <= address;
        if page != source_page
            || !apart
            || !self.handles_touching(source, size).is_empty()
            || self.all_mapped(base, address, size) != Some(false)
            || self.all_mapped(source_base, source, size) != Some(true)
        {
            return Err(refuse());
        }
        if take(&mut self.faults.alloc_error) {
            return Err(device_error("alias"));
        }
        if take(&mut self.faults.alloc_oom) {
            return Err(BackendError::OutOfMemory);
        }
        let taken: Vec<u32> = {
            let r = &self.reservations[&source_base];
            let first = ((source - source_base) / page) as usize;
            r.slots[first..first + (size / page) as usize].to_vec()
        };
        let r = self.reservations.get_mut(&base).expect("found above");
        r.mapped += size / page;
        for (slot, id) in (address..address + size).step_by(page as usize).zip(taken) {
            r.set(((slot - base) / page) as usize, id);
            let p = self.pages[id as usize]
                .as_mut()
                .expect("a mapped page exists");
            if p.first.is_none() {
                p.first = Some(slot);
            } else {
                p.more.push(slot);
            }
        }
        self.device_allocs += 1;
        Ok(())
    }
}

fn not_mappable(operation: &'static str, address: u64, size: u64) -> BackendError {
    BackendError::Device {
        operation,
        message: format!(
            "{address:#x} (+{size}) is not whole pages of one reservation in the right state"
        ),
    }
}

fn unknown(event: EventId) -> BackendError {
    BackendError::Device {
        operation: "event",
        message: format!("unknown event {}", event.0),
    }
}

#[cfg(test)]
mod tests;

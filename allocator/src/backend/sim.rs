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
    /// Event recordings that fail.
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
}

/// One reservation of address space and what is mapped in it.
#[derive(Debug, Clone)]
struct Reservation {
    size: u64,
    page: u64,
    /// Mapped spans: address → bytes (whole pages).
    mapped: BTreeMap<u64, u64>,
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

    /// Successful allocations and frees so far.
    pub fn call_counts(&self) -> (u64, u64) {
        (self.device_allocs, self.device_frees)
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

    /// Reservations and what is mapped in them: `(address, size, mapped bytes)`, by address.
    pub fn reservations(&self) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        self.reservations
            .iter()
            .map(|(&a, r)| (a, r.size, r.mapped.values().sum()))
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

    fn virtual_memory(&self) -> bool {
        true
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
                mapped: BTreeMap::new(),
            },
        );
        Ok(address)
    }

    fn release_reservation(&mut self, address: u64, size: u64) -> Result<(), BackendError> {
        match self.reservations.get(&address) {
            Some(r) if r.size == size && r.mapped.is_empty() => {
                self.reservations.remove(&address);
                Ok(())
            }
            _ => Err(BackendError::Device {
                operation: "release_reservation",
                message: format!("{address:#x} (+{size}) is not a reservation with nothing mapped"),
            }),
        }
    }

    /// Counts against capacity like an allocation, and takes injected allocation faults and
    /// [`SimDevice::fail_next_allocs`] the same way; counted as an allocation in
    /// [`SimDevice::call_counts`].
    fn map(&mut self, address: u64, size: u64) -> Result<(), BackendError> {
        let (&base, r) = self
            .reservations
            .range(..=address)
            .next_back()
            .ok_or_else(|| not_mappable(address, size))?;
        let end = address
            .checked_add(size)
            .ok_or_else(|| not_mappable(address, size))?;
        let overlaps_mapped = r
            .mapped
            .range(..end)
            .next_back()
            .is_some_and(|(&a, &n)| a + n > address);
        if size == 0
            || end > base + r.size
            || !(address - base).is_multiple_of(r.page)
            || !size.is_multiple_of(r.page)
            || overlaps_mapped
        {
            return Err(not_mappable(address, size));
        }
        if take(&mut self.faults.alloc_error) {
            return Err(device_error("map"));
        }
        if take(&mut self.faults.alloc_oom) || self.used.saturating_add(size) > self.capacity {
            return Err(BackendError::OutOfMemory);
        }
        if let Some(r) = self.reservations.get_mut(&base) {
            r.mapped.insert(address, size);
        }
        self.used += size;
        self.device_allocs += 1;
        Ok(())
    }

    /// Unmaps whole pages of what [`Backend::map`] mapped (any run of them, across maps);
    /// takes injected free faults; counted as a free in [`SimDevice::call_counts`].
    fn unmap(&mut self, address: u64, size: u64, _stream: StreamId) -> Result<(), BackendError> {
        let end = address
            .checked_add(size)
            .ok_or_else(|| not_mappable(address, size))?;
        let Some((&base, r)) = self.reservations.range(..=address).next_back() else {
            return Err(not_mappable(address, size));
        };
        // Every page of [address, end) must be mapped.
        let mut covered = address;
        for (&a, &n) in r.mapped.range(..end) {
            if a + n <= covered {
                continue;
            }
            if a > covered {
                break;
            }
            covered = a + n;
        }
        if size == 0
            || covered < end
            || end > base + r.size
            || !(address - base).is_multiple_of(r.page)
            || !size.is_multiple_of(r.page)
        {
            return Err(not_mappable(address, size));
        }
        if take(&mut self.faults.free_error) {
            return Err(device_error("unmap"));
        }
        let r = self.reservations.get_mut(&base).expect("found above");
        let spans: Vec<(u64, u64)> = r
            .mapped
            .range(..end)
            .filter(|&(&a, &n)| a + n > address)
            .map(|(&a, &n)| (a, n))
            .collect();
        for (a, n) in spans {
            r.mapped.remove(&a);
            if a < address {
                r.mapped.insert(a, address - a);
            }
            if a + n > end {
                r.mapped.insert(end, a + n - end);
            }
        }
        self.used -= size;
        self.device_frees += 1;
        Ok(())
    }
}

fn not_mappable(address: u64, size: u64) -> BackendError {
    BackendError::Device {
        operation: "map",
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
mod tests {
    use super::*;

    #[test]
    fn addresses_are_first_fit_and_aligned() {
        let mut d = SimDevice::new(1 << 30);
        let a = d.allocate(20 << 20).unwrap();
        let b = d.allocate(2 << 20).unwrap();
        assert_eq!(a, SIM_BASE_ADDRESS);
        assert_eq!(b, SIM_BASE_ADDRESS + (20 << 20));
        d.free(a, 20 << 20).unwrap();
        assert_eq!(d.allocate(4 << 20).unwrap(), SIM_BASE_ADDRESS);
    }

    #[test]
    fn injected_faults_are_typed_and_read_as_before() {
        let mut d = SimDevice::new(1 << 30);
        d.inject(Faults {
            alloc_error: 1,
            record_error: 1,
            ..Faults::default()
        });
        let e = d.allocate(2 << 20).unwrap_err();
        assert_eq!(
            e,
            BackendError::Injected {
                operation: "allocate"
            }
        );
        assert_eq!(e.to_string(), "device error in allocate: injected fault");
        assert!(matches!(
            d.record_event(StreamId(1)),
            Err(BackendError::Injected {
                operation: "record_event"
            })
        ));
        // A real error of the device is not an injected one.
        assert!(matches!(
            d.free(0x1000, 512),
            Err(BackendError::Device { .. })
        ));
    }

    #[test]
    fn capacity_is_enforced_and_faults_fire_once() {
        let mut d = SimDevice::new(4 << 20);
        assert_eq!(d.allocate(6 << 20), Err(BackendError::OutOfMemory));
        d.fail_next_allocs(1);
        assert_eq!(d.allocate(2 << 20), Err(BackendError::OutOfMemory));
        assert!(d.allocate(2 << 20).is_ok());
    }

    #[test]
    fn script_addresses_come_first_unless_taken() {
        let mut d = SimDevice::new(1 << 30).with_address_script([0x1000_0000, 0x1000_0000]);
        assert_eq!(d.allocate(2 << 20).unwrap(), 0x1000_0000);
        // The second script entry overlaps the first allocation: skipped.
        assert_eq!(d.allocate(2 << 20).unwrap(), SIM_BASE_ADDRESS);
    }

    #[test]
    fn unusable_script_addresses_are_skipped() {
        let mut d = SimDevice::new(1 << 30).with_address_script([
            0x1000_0000,
            0,
            0x1000_0200,
            0x1000_0100,
            u64::MAX - 511,
        ]);
        assert_eq!(d.allocate(2 << 20).unwrap(), 0x1000_0000);
        // Zero, overlapping, unaligned and overflowing entries are consumed without being used.
        assert_eq!(d.allocate(2 << 20).unwrap(), SIM_BASE_ADDRESS);
        assert!(d.script.is_empty());
    }

    #[test]
    fn the_next_address_wins_once_and_only_when_usable() {
        let mut d = SimDevice::new(1 << 30).with_address_script([0x4000_0000]);
        d.set_next_address(Some(0x2000_0000));
        assert_eq!(d.allocate(2 << 20).unwrap(), 0x2000_0000);
        // Cleared by the success; the script was not consumed.
        assert_eq!(d.allocate(2 << 20).unwrap(), 0x4000_0000);
        // Overlapping: the device picks as usual, and the next address is cleared.
        d.set_next_address(Some(0x2000_0000));
        assert_eq!(d.allocate(2 << 20).unwrap(), SIM_BASE_ADDRESS);
        assert_eq!(d.next_address, None);
        // A failed attempt keeps it; None clears it.
        d.set_next_address(Some(0x6000_0000));
        d.fail_next_allocs(1);
        assert!(d.allocate(2 << 20).is_err());
        assert_eq!(d.next_address, Some(0x6000_0000));
        d.set_next_address(None);
        assert_eq!(d.allocate(2 << 20).unwrap(), SIM_BASE_ADDRESS + (2 << 20));
        for bad in [0, 0x6000_0100, u64::MAX - 511] {
            d.set_next_address(Some(bad));
            assert_ne!(d.allocate(512).unwrap(), bad);
        }
    }

    #[test]
    fn adopted_ranges_are_live_and_must_fit() {
        let mut d = SimDevice::new(10 << 20);
        d.adopt(SIM_BASE_ADDRESS, 4 << 20).unwrap();
        assert!(matches!(
            d.adopt(SIM_BASE_ADDRESS + (2 << 20), 2 << 20),
            Err(BackendError::Device { .. })
        ));
        assert_eq!(
            d.adopt(0x1000_0000, 8 << 20),
            Err(BackendError::OutOfMemory)
        );
        assert_eq!(d.used(), 4 << 20);
        assert_eq!(d.call_counts(), (0, 0));
        // The device places new allocations around the adopted range and frees it as usual.
        assert_eq!(d.allocate(2 << 20).unwrap(), SIM_BASE_ADDRESS + (4 << 20));
        d.free(SIM_BASE_ADDRESS, 4 << 20).unwrap();
        assert_eq!(d.used(), 2 << 20);
    }

    #[test]
    fn a_range_below_the_base_that_reaches_past_it_is_avoided() {
        let mut d = SimDevice::new(1 << 42);
        d.adopt(SIM_BASE_ADDRESS - (1 << 41), (1 << 41) + (2 << 20))
            .unwrap();
        assert_eq!(d.allocate(2 << 20).unwrap(), SIM_BASE_ADDRESS + (2 << 20));
    }

    #[test]
    fn events_complete_when_their_stream_does() {
        let mut d = SimDevice::new(1 << 30);
        let s = StreamId(3);
        let e1 = d.record_event(s).unwrap();
        assert!(!d.query_event(e1).unwrap());
        d.complete_stream(s);
        let e2 = d.record_event(s).unwrap();
        assert!(d.query_event(e1).unwrap());
        assert!(!d.query_event(e2).unwrap());
        d.synchronize_event(e2).unwrap();
        assert!(d.query_event(e2).unwrap());
    }

    #[test]
    fn freeing_a_foreign_range_is_an_error() {
        let mut d = SimDevice::new(1 << 30);
        let a = d.allocate(2 << 20).unwrap();
        assert!(d.free(a + 512, 2 << 20).is_err());
        assert!(d.free(a, 4 << 20).is_err());
        assert!(d.free(a, 2 << 20).is_ok());
        assert_eq!(d.used(), 0);
    }

    #[test]
    fn a_zero_size_allocation_fails_as_out_of_memory() {
        let mut d = SimDevice::new(10 << 20).with_address_script([0x1000_0000]);
        assert_eq!(d.allocate(0), Err(BackendError::OutOfMemory));
        assert_eq!(d.used(), 0);
        // The script was not consumed.
        assert_eq!(d.allocate(1 << 20).unwrap(), 0x1000_0000);
    }

    #[test]
    fn no_usable_address_left_is_out_of_memory_and_keeps_the_next_address() {
        let mut d = SimDevice::new(u64::MAX);
        // A live range from the base to the top of the address space: nothing fits above it.
        d.adopt(SIM_BASE_ADDRESS, u64::MAX - SIM_BASE_ADDRESS)
            .unwrap();
        d.set_next_address(Some(SIM_BASE_ADDRESS));
        assert_eq!(d.allocate(2 << 20), Err(BackendError::OutOfMemory));
        assert_eq!(d.next_address, Some(SIM_BASE_ADDRESS));
        // Below the base is never chosen by the device itself, but a usable next address is.
        d.set_next_address(Some(0x1000_0000));
        assert_eq!(d.allocate(2 << 20).unwrap(), 0x1000_0000);
        assert_eq!(d.next_address, None);
    }

    #[test]
    fn an_unusable_range_is_refused_before_the_capacity_is_looked_at() {
        let mut d = SimDevice::new(4 << 20);
        d.adopt(SIM_BASE_ADDRESS, 4 << 20).unwrap();
        // Both overlapping and beyond the capacity: refused as unusable (a device error).
        for (address, size) in [
            (SIM_BASE_ADDRESS, 8 << 20),
            (0x1000_0000, 0),
            (u64::MAX - 511, 2 << 20),
        ] {
            assert!(
                matches!(d.adopt(address, size), Err(BackendError::Device { .. })),
                "{address:#x} +{size}"
            );
        }
        assert_eq!(
            d.adopt(0x1000_0000, 2 << 20),
            Err(BackendError::OutOfMemory)
        );
    }

    #[test]
    fn reservations_take_address_space_but_no_capacity_and_maps_count() {
        let mut d = SimDevice::new(64 << 20);
        let r = d.reserve(80 << 20, 20 << 20).unwrap();
        assert_eq!(r, SIM_BASE_ADDRESS);
        assert_eq!(d.used(), 0);
        // Allocations go around the reservation.
        assert_eq!(d.allocate(2 << 20).unwrap(), SIM_BASE_ADDRESS + (80 << 20));
        d.map(r, 40 << 20).unwrap();
        assert_eq!(d.used(), 42 << 20);
        // Not page-aligned, overlapping, or beyond capacity: refused, nothing changes.
        assert!(d.map(r + (2 << 20), 20 << 20).is_err());
        assert!(d.map(r, 20 << 20).is_err());
        assert_eq!(
            d.map(r + (40 << 20), 40 << 20),
            Err(BackendError::OutOfMemory)
        );
        d.fail_next_allocs(1);
        assert_eq!(
            d.map(r + (40 << 20), 20 << 20),
            Err(BackendError::OutOfMemory)
        );
        assert_eq!(d.used(), 42 << 20);
        // A reservation with pages mapped cannot be released; any run of pages can be unmapped.
        assert!(d.release_reservation(r, 80 << 20).is_err());
        d.unmap(r + (20 << 20), 20 << 20, StreamId(0)).unwrap();
        assert!(d.unmap(r + (20 << 20), 20 << 20, StreamId(0)).is_err());
        d.unmap(r, 20 << 20, StreamId(0)).unwrap();
        assert_eq!(d.used(), 2 << 20);
        d.release_reservation(r, 80 << 20).unwrap();
        assert_eq!(d.reservations().count(), 0);
        assert_eq!(d.call_counts(), (2, 2));
    }

    #[test]
    fn a_reservation_takes_the_next_address_but_never_the_script() {
        let mut d = SimDevice::new(1 << 30).with_address_script([0x4000_0000]);
        d.set_next_address(Some(0x2000_0000));
        assert_eq!(d.reserve(40 << 20, 20 << 20).unwrap(), 0x2000_0000);
        assert_eq!(d.reserve(40 << 20, 20 << 20).unwrap(), SIM_BASE_ADDRESS);
        assert_eq!(d.allocate(2 << 20).unwrap(), 0x4000_0000);
    }
}

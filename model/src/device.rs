//! The simulated device (ARCHITECTURE.md, "The simulated device").
//!
//! A capacity in bytes; an allocation succeeds when it is not told to fail, its size is
//! nonzero, `used + size ≤ capacity`, and an address is found: the next address when one is
//! set and usable, else the next usable one of the address script (unusable ones are consumed
//! and skipped), else the lowest address at or above [`DEVICE_BASE`], aligned to 2 MiB, that
//! is usable. Usable: nonzero, a multiple of 512, no overflow, overlapping no live range. A
//! success clears the next address; a failure leaves it set. Adopted ranges (rule 18) are
//! live like allocated ones. The device keeps its own list of live allocations, so that the
//! invariant checker can compare it with the model's segments.
//!
//! Reservations of address space, the mapping of pages inside them (rule 19, expandable
//! segments) and the page table with its aliases (rule 22h) are in `device/reservations.rs`.

mod reservations;

pub(crate) use reservations::{DevicePage, Reservation};

/// The lowest address the device hands out when no script address is left.
pub(crate) const DEVICE_BASE: u64 = 0x7f00_0000_0000;
/// The alignment of addresses the device picks itself (2 MiB).
pub(crate) const DEVICE_ALIGNMENT: u64 = 2 << 20;

/// Why the device refused to adopt a range (rule 18b).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AdoptRefusal {
    /// The range is empty, overflows, or overlaps a live range (checked first).
    Unusable,
    /// The range does not fit the capacity left.
    OutOfMemory,
}

/// The simulated device.
#[derive(Clone, Debug)]
pub(crate) struct Device {
    capacity: u64,
    /// The script addresses not yet handed out, in order.
    script: Vec<u64>,
    /// The address the next successful allocation takes, if usable (`set_next_address`).
    next: Option<u64>,
    /// How many of the next allocation attempts must report out-of-memory.
    failures_ahead: u32,
    /// Live allocations as `(address, size)`, in allocation order.
    live: Vec<(u64, u64)>,
    /// Rule 19: reserved address ranges, in reservation order.
    reservations: Vec<Reservation>,
    /// Rules 19, 22h: the pages mapped in reservations, by page number; each counts once
    /// against capacity, however many slots map it.
    pages: std::collections::BTreeMap<u64, DevicePage>,
    /// The number the next page created gets.
    next_page: u64,
    /// Rule 19j: the home mappings of handles of more than one page, by first byte: their
    /// bytes. Such a mapping is unmapped only whole and never mapped again elsewhere.
    handles: std::collections::BTreeMap<u64, u64>,
}

/// Whether `[a, a + a_size)` and `[b, b + b_size)` share a byte.
pub(crate) fn overlaps(a: u64, a_size: u64, b: u64, b_size: u64) -> bool {
    let (a, a_end) = (u128::from(a), u128::from(a) + u128::from(a_size));
    let (b, b_end) = (u128::from(b), u128::from(b) + u128::from(b_size));
    a < b_end && b < a_end
}

impl Device {
    /// A device of `capacity` bytes that hands out `script` first.
    pub(crate) fn new(capacity: u64, script: Vec<u64>) -> Device {
        Device {
            capacity,
            script,
            next: None,
            failures_ahead: 0,
            live: Vec::new(),
            reservations: Vec::new(),
            pages: std::collections::BTreeMap::new(),
            next_page: 0,
            handles: std::collections::BTreeMap::new(),
        }
    }

    /// The device's capacity in bytes.
    pub(crate) fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes handed out and not freed, and the bytes of the pages mapped in reservations, each
    /// page once (rules 19, 22h).
    pub(crate) fn used(&self) -> u64 {
        self.live.iter().map(|&(_, size)| size).sum::<u64>() + self.mapped_bytes()
    }

    /// The live allocations as `(address, size)`.
    pub(crate) fn live(&self) -> &[(u64, u64)] {
        &self.live
    }

    /// Makes the next `n` allocation attempts report out-of-memory.
    pub(crate) fn fail_next(&mut self, n: u32) {
        self.failures_ahead = self.failures_ahead.saturating_add(n);
    }

    /// Allocates `size` bytes: the address, or `None` for out-of-memory (told to fail, a
    /// zero size, no room, or no usable address left).
    pub(crate) fn allocate(&mut self, size: u64) -> Option<u64> {
        if self.failures_ahead > 0 {
            self.failures_ahead -= 1;
            return None;
        }
        if size == 0 || size > self.capacity - self.used() {
            return None;
        }
        let address = match self.next {
            Some(next) if self.usable(next, size) => next,
            _ => self.scripted_or_lowest(size)?,
        };
        self.next = None;
        self.live.push((address, size));
        Some(address)
    }

    /// The next usable script address (consuming the unusable ones before it), else the
    /// lowest usable one, if any.
    fn scripted_or_lowest(&mut self, size: u64) -> Option<u64> {
        while !self.script.is_empty() {
            let candidate = self.script.remove(0);
            if self.usable(candidate, size) {
                return Some(candidate);
            }
        }
        self.lowest_unused_address(size)
    }

    /// Whether `size` bytes at `address` may be handed out: nonzero, a multiple of 512, no
    /// overflow, overlapping no live allocation.
    fn usable(&self, address: u64, size: u64) -> bool {
        address != 0
            && address.is_multiple_of(512)
            && address.checked_add(size).is_some()
            && self
                .live
                .iter()
                .all(|&(a, s)| !overlaps(address, size, a, s))
    }

    /// Sets (or, with `None`, clears) the address the next successful allocation takes when
    /// it is usable; any successful allocation clears it.
    pub(crate) fn set_next_address(&mut self, address: Option<u64>) {
        self.next = address;
    }

    /// Rule 18: `size` bytes at `address` are already allocated; they count as used from now
    /// on. Refused (nothing changes) when the range is empty, overflows or overlaps a live
    /// range, else when it does not fit the capacity left.
    pub(crate) fn adopt(&mut self, address: u64, size: u64) -> Result<(), AdoptRefusal> {
        if size == 0
            || address.checked_add(size).is_none()
            || self
                .live
                .iter()
                .any(|&(a, s)| overlaps(address, size, a, s))
        {
            return Err(AdoptRefusal::Unusable);
        }
        if size > self.capacity - self.used() {
            return Err(AdoptRefusal::OutOfMemory);
        }
        self.live.push((address, size));
        Ok(())
    }

    /// Frees the allocation at `address`.
    ///
    /// # Panics
    /// If `address` is not a live allocation (the model never does this).
    pub(crate) fn free(&mut self, address: u64) {
        let index = self
            .live
            .iter()
            .position(|&(a, _)| a == address)
            .expect("device free of an address that is not live");
        self.live.remove(index);
    }

    /// The lowest 2 MiB-aligned address at or above [`DEVICE_BASE`] where `size` bytes fit
    /// below 2^64 and overlap no live allocation, if any. That address is either the base
    /// itself or the end of some live allocation rounded up to 2 MiB, so only those
    /// candidates are tried.
    fn lowest_unused_address(&self, size: u64) -> Option<u64> {
        let mut candidates = vec![DEVICE_BASE];
        for &(address, live_size) in &self.live {
            let aligned = address
                .checked_add(live_size)
                .and_then(|end| end.checked_next_multiple_of(DEVICE_ALIGNMENT));
            if let Some(aligned) = aligned.filter(|&a| a >= DEVICE_BASE) {
                candidates.push(aligned);
            }
        }
        candidates.sort_unstable();
        candidates.into_iter().find(|&candidate| {
            candidate.checked_add(size).is_some()
                && self
                    .live
                    .iter()
                    .all(|&(address, live_size)| !overlaps(candidate, size, address, live_size))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn addresses_start_at_the_base_and_pack_in_two_mebibyte_steps() {
        let mut device = Device::new(1 << 30, Vec::new());
        assert_eq!(device.allocate(20 * MIB), Some(DEVICE_BASE));
        assert_eq!(device.allocate(3 * MIB), Some(DEVICE_BASE + 20 * MIB));
        assert_eq!(device.allocate(2 * MIB), Some(DEVICE_BASE + 24 * MIB));
        assert_eq!(device.used(), 25 * MIB);
    }

    #[test]
    fn a_freed_range_is_reused_when_the_request_fits() {
        let mut device = Device::new(1 << 30, Vec::new());
        let a = device.allocate(4 * MIB).unwrap();
        let _b = device.allocate(4 * MIB).unwrap();
        device.free(a);
        assert_eq!(device.allocate(6 * MIB), Some(DEVICE_BASE + 8 * MIB));
        assert_eq!(device.allocate(2 * MIB), Some(DEVICE_BASE));
    }

    #[test]
    fn script_addresses_come_first_in_order() {
        let mut device = Device::new(1 << 30, vec![0x1000_0000, 0x2000_0000]);
        assert_eq!(device.allocate(MIB), Some(0x1000_0000));
        assert_eq!(device.allocate(MIB), Some(0x2000_0000));
        assert_eq!(device.allocate(MIB), Some(DEVICE_BASE));
    }

    #[test]
    fn allocation_fails_beyond_capacity() {
        let mut device = Device::new(10 * MIB, Vec::new());
        assert!(device.allocate(6 * MIB).is_some());
        assert_eq!(device.allocate(6 * MIB), None);
        assert!(device.allocate(4 * MIB).is_some());
        assert_eq!(device.used(), 10 * MIB);
    }

    #[test]
    fn told_failures_are_spent_one_per_attempt() {
        let mut device = Device::new(10 * MIB, vec![0x4000_0000]);
        device.fail_next(2);
        assert_eq!(device.allocate(MIB), None);
        assert_eq!(device.allocate(MIB), None);
        // A failed attempt does not use up a script address.
        assert_eq!(device.allocate(MIB), Some(0x4000_0000));
    }

    #[test]
    fn unusable_script_addresses_are_skipped() {
        let mut device = Device::new(1 << 30, vec![0x1000_0000, 0, 0x1000_0200, 0x1000_0100]);
        assert_eq!(device.allocate(2 * MIB), Some(0x1000_0000));
        // Zero, overlapping and unaligned entries are consumed without being used.
        assert_eq!(device.allocate(2 * MIB), Some(DEVICE_BASE));
        assert!(device.script.is_empty());
        let mut device = Device::new(1 << 30, vec![u64::MAX - 511]);
        assert_eq!(device.allocate(MIB), Some(DEVICE_BASE));
    }

    #[test]
    fn the_next_address_wins_once_and_only_when_usable() {
        let mut device = Device::new(1 << 30, vec![0x4000_0000]);
        device.set_next_address(Some(0x2000_0000));
        assert_eq!(device.allocate(2 * MIB), Some(0x2000_0000));
        // Cleared by the success; the script was not consumed.
        assert_eq!(device.allocate(2 * MIB), Some(0x4000_0000));
        // Overlapping: the device picks as usual, and the next address is cleared.
        device.set_next_address(Some(0x2000_0000));
        assert_eq!(device.allocate(2 * MIB), Some(DEVICE_BASE));
        assert_eq!(device.next, None);
        // A failed attempt keeps it; None clears it.
        device.set_next_address(Some(0x6000_0000));
        device.fail_next(1);
        assert_eq!(device.allocate(2 * MIB), None);
        assert_eq!(device.next, Some(0x6000_0000));
        device.set_next_address(None);
        assert_eq!(device.allocate(2 * MIB), Some(DEVICE_BASE + 2 * MIB));
        for bad in [0, 0x6000_0100, u64::MAX - 511] {
            device.set_next_address(Some(bad));
            assert_ne!(device.allocate(512), Some(bad));
        }
    }

    #[test]
    fn adopted_ranges_are_live_and_must_fit() {
        let mut device = Device::new(10 * MIB, Vec::new());
        assert_eq!(device.adopt(DEVICE_BASE, 4 * MIB), Ok(()));
        assert_eq!(
            device.adopt(DEVICE_BASE + 2 * MIB, 2 * MIB),
            Err(AdoptRefusal::Unusable)
        );
        assert_eq!(
            device.adopt(0x1000_0000, 8 * MIB),
            Err(AdoptRefusal::OutOfMemory)
        );
        assert_eq!(device.used(), 4 * MIB);
        assert_eq!(device.allocate(2 * MIB), Some(DEVICE_BASE + 4 * MIB));
        device.free(DEVICE_BASE);
        assert_eq!(device.used(), 2 * MIB);
    }

    #[test]
    fn a_zero_size_allocation_fails_as_out_of_memory() {
        let mut device = Device::new(10 * MIB, vec![0x1000_0000]);
        assert_eq!(device.allocate(0), None);
        assert_eq!(device.used(), 0);
        // The script was not consumed.
        assert_eq!(device.allocate(MIB), Some(0x1000_0000));
    }

    #[test]
    fn no_usable_address_left_is_out_of_memory_and_keeps_the_next_address() {
        let mut device = Device::new(u64::MAX, Vec::new());
        // A live range from the base to the top of the address space: nothing fits above it.
        assert_eq!(device.adopt(DEVICE_BASE, u64::MAX - DEVICE_BASE), Ok(()));
        device.set_next_address(Some(DEVICE_BASE));
        assert_eq!(device.allocate(2 * MIB), None);
        assert_eq!(device.next, Some(DEVICE_BASE));
        // Below the base is never chosen by the device itself, but a usable next address is.
        device.set_next_address(Some(0x1000_0000));
        assert_eq!(device.allocate(2 * MIB), Some(0x1000_0000));
        assert_eq!(device.next, None);
    }

    #[test]
    fn an_unusable_range_is_refused_before_the_capacity_is_looked_at() {
        let mut device = Device::new(4 * MIB, Vec::new());
        assert_eq!(device.adopt(DEVICE_BASE, 4 * MIB), Ok(()));
        // Both overlapping and beyond the capacity: refused as unusable.
        assert_eq!(
            device.adopt(DEVICE_BASE, 8 * MIB),
            Err(AdoptRefusal::Unusable)
        );
        assert_eq!(device.adopt(0x1000_0000, 0), Err(AdoptRefusal::Unusable));
        assert_eq!(
            device.adopt(u64::MAX - 511, 2 * MIB),
            Err(AdoptRefusal::Unusable)
        );
        assert_eq!(
            device.adopt(0x1000_0000, 2 * MIB),
            Err(AdoptRefusal::OutOfMemory)
        );
    }
}

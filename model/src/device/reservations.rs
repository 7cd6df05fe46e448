//! The simulated device's address-space reservations (ARCHITECTURE.md, "The simulated
//! device", for rule 19: expandable segments).
//!
//! A reservation takes the next address when one is set and usable for its size (and clears
//! it, used or not), else the lowest 2 MiB-aligned address at or above [`DEVICE_BASE`] where
//! the range overlaps no live allocation and no other reservation. It never consumes the
//! address script and never counts against capacity. Mapping `n` bytes inside a reservation
//! counts `n` against capacity and fails with out-of-memory when `used + n > capacity`, or
//! when the device was told to fail (one told failure per map step, as per allocation);
//! unmapping gives them back; releasing a reservation requires that nothing in it is mapped.
//!
//! The model never makes a classic device allocation while it holds ranges (rule 19 replaces
//! rule 8), and refuses to adopt a segment overlapping one (rule 18a), so allocation and
//! adoption need not look at reservations.

use super::{DEVICE_ALIGNMENT, DEVICE_BASE, Device, overlaps};

/// One reserved address range and the bytes mapped inside it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Reservation {
    /// The range's first byte.
    pub(crate) base: u64,
    /// The range's size in bytes.
    pub(crate) size: u64,
    /// The mapped parts as `(address, bytes)`, disjoint, in no particular order.
    pub(crate) mapped: Vec<(u64, u64)>,
}

impl Reservation {
    /// Bytes mapped in the range.
    fn mapped_bytes(&self) -> u64 {
        self.mapped.iter().map(|&(_, bytes)| bytes).sum()
    }

    /// Whether `[address, address + bytes)` lies inside the range.
    fn contains(&self, address: u64, bytes: u64) -> bool {
        address >= self.base
            && u128::from(address) + u128::from(bytes)
                <= u128::from(self.base) + u128::from(self.size)
    }

    /// The mapped parts merged where they touch, sorted by address.
    pub(crate) fn mapped_runs(&self) -> Vec<(u64, u64)> {
        let mut parts = self.mapped.clone();
        parts.sort_unstable();
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for (address, bytes) in parts {
            match runs.last_mut() {
                Some(last) if last.0 + last.1 == address => last.1 += bytes,
                _ => runs.push((address, bytes)),
            }
        }
        runs
    }
}

impl Device {
    /// The reservations, in reservation order.
    pub(crate) fn reservations(&self) -> &[Reservation] {
        &self.reservations
    }

    /// Bytes mapped in all reservations.
    pub(crate) fn mapped_bytes(&self) -> u64 {
        self.reservations
            .iter()
            .map(Reservation::mapped_bytes)
            .sum()
    }

    /// Reserves `size` bytes of address space: its base. Counts nothing against capacity and
    /// never fails.
    ///
    /// # Panics
    /// If no range of `size` bytes is left above [`DEVICE_BASE`].
    pub(crate) fn reserve(&mut self, size: u64) -> u64 {
        let base = match self.next.take() {
            Some(next) if self.reservable(next, size) => next,
            _ => self.lowest_reservable_address(size),
        };
        self.reservations.push(Reservation {
            base,
            size,
            mapped: Vec::new(),
        });
        base
    }

    /// Whether `size` bytes at `address` may be reserved: nonzero, a multiple of 512, no
    /// overflow, overlapping no live allocation and no reservation.
    fn reservable(&self, address: u64, size: u64) -> bool {
        address != 0
            && address.is_multiple_of(512)
            && address.checked_add(size).is_some()
            && self.is_unused(address, size)
    }

    /// Whether `[address, address + size)` overlaps no live allocation and no reservation.
    fn is_unused(&self, address: u64, size: u64) -> bool {
        self.live
            .iter()
            .all(|&(a, s)| !overlaps(address, size, a, s))
            && self
                .reservations
                .iter()
                .all(|r| !overlaps(address, size, r.base, r.size))
    }

    /// The lowest 2 MiB-aligned address at or above [`DEVICE_BASE`] where `size` bytes
    /// overlap no live allocation and no reservation: the base itself or the end of one of
    /// those rounded up to 2 MiB.
    fn lowest_reservable_address(&self, size: u64) -> u64 {
        let mut ends: Vec<u64> = self
            .live
            .iter()
            .map(|&(a, s)| a.saturating_add(s))
            .collect();
        ends.extend(
            self.reservations
                .iter()
                .map(|r| r.base.saturating_add(r.size)),
        );
        let mut candidates = vec![DEVICE_BASE];
        for end in ends {
            let aligned = end
                .div_ceil(DEVICE_ALIGNMENT)
                .saturating_mul(DEVICE_ALIGNMENT);
            if aligned >= DEVICE_BASE {
                candidates.push(aligned);
            }
        }
        candidates.sort_unstable();
        candidates
            .into_iter()
            .find(|&c| c.checked_add(size).is_some() && self.is_unused(c, size))
            .expect("the address space is exhausted")
    }

    /// Maps `bytes` at `address`, inside a reservation: false for out-of-memory (a told
    /// failure is spent, or `used + bytes > capacity`), and then nothing is mapped.
    ///
    /// # Panics
    /// If the bytes are not inside one reservation or are already mapped (the model never
    /// does this).
    pub(crate) fn map(&mut self, address: u64, bytes: u64) -> bool {
        let index = self.reservation_holding(address, bytes);
        assert!(
            self.reservations[index]
                .mapped
                .iter()
                .all(|&(a, n)| !overlaps(address, bytes, a, n)),
            "device map of bytes already mapped"
        );
        if self.failures_ahead > 0 {
            self.failures_ahead -= 1;
            return false;
        }
        if bytes > self.capacity - self.used() {
            return false;
        }
        self.reservations[index].mapped.push((address, bytes));
        true
    }

    /// Unmaps `bytes` at `address`, all of them mapped in one reservation.
    ///
    /// # Panics
    /// If some of the bytes are not mapped (the model never does this).
    pub(crate) fn unmap(&mut self, address: u64, bytes: u64) {
        let index = self.reservation_holding(address, bytes);
        let end = address + bytes;
        let mut kept = Vec::new();
        let mut unmapped = 0;
        for &(a, n) in &self.reservations[index].mapped {
            let a_end = a + n;
            if !overlaps(address, bytes, a, n) {
                kept.push((a, n));
                continue;
            }
            // The parts of this mapping before and after the unmapped bytes stay mapped.
            if a < address {
                kept.push((a, address - a));
            }
            if a_end > end {
                kept.push((end, a_end - end));
            }
            unmapped += a_end.min(end) - a.max(address);
        }
        assert_eq!(unmapped, bytes, "device unmap of bytes not mapped");
        self.reservations[index].mapped = kept;
    }

    /// Gives back the reservation at `base`, nothing of which is mapped.
    ///
    /// # Panics
    /// If there is no such reservation or something in it is mapped.
    pub(crate) fn release_reservation(&mut self, base: u64) {
        let index = self
            .reservations
            .iter()
            .position(|r| r.base == base)
            .expect("release of an address that is not reserved");
        assert!(
            self.reservations[index].mapped.is_empty(),
            "release of a reservation with mapped bytes"
        );
        self.reservations.remove(index);
    }

    /// The index of the reservation holding `[address, address + bytes)`.
    fn reservation_holding(&self, address: u64, bytes: u64) -> usize {
        self.reservations
            .iter()
            .position(|r| r.contains(address, bytes))
            .expect("device map or unmap outside every reservation")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn reservations_pack_from_the_base_and_count_nothing() {
        let mut device = Device::new(100 * MIB, vec![0x1000_0000]);
        assert_eq!(device.reserve(120 * MIB), DEVICE_BASE);
        assert_eq!(device.reserve(3 * MIB), DEVICE_BASE + 120 * MIB);
        assert_eq!(device.reserve(2 * MIB), DEVICE_BASE + 124 * MIB);
        assert_eq!(device.used(), 0);
        // The address script is for allocations only.
        assert_eq!(device.script, vec![0x1000_0000]);
        // A released range is reused when the new one fits in it.
        device.release_reservation(DEVICE_BASE + 120 * MIB);
        assert_eq!(device.reserve(6 * MIB), DEVICE_BASE + 126 * MIB);
        assert_eq!(device.reserve(4 * MIB), DEVICE_BASE + 120 * MIB);
    }

    #[test]
    fn a_reservation_avoids_live_allocations() {
        let mut device = Device::new(100 * MIB, Vec::new());
        assert_eq!(device.allocate(3 * MIB), Some(DEVICE_BASE));
        assert_eq!(device.reserve(20 * MIB), DEVICE_BASE + 4 * MIB);
    }

    #[test]
    fn the_next_address_is_taken_when_usable_and_cleared_either_way() {
        let mut device = Device::new(100 * MIB, Vec::new());
        device.set_next_address(Some(0x2000_0000));
        assert_eq!(device.reserve(20 * MIB), 0x2000_0000);
        assert_eq!(device.next, None);
        // Overlapping the first reservation: not used, but cleared.
        device.set_next_address(Some(0x2000_0000 + 2 * MIB));
        assert_eq!(device.reserve(20 * MIB), DEVICE_BASE);
        assert_eq!(device.next, None);
        for bad in [0, 0x3000_0100, u64::MAX - 511] {
            device.set_next_address(Some(bad));
            assert_ne!(device.reserve(2 * MIB), bad);
        }
    }

    #[test]
    fn mapping_counts_against_capacity_and_fails_beyond_it() {
        let mut device = Device::new(50 * MIB, Vec::new());
        let base = device.reserve(60 * MIB);
        assert!(device.map(base, 20 * MIB));
        assert!(device.map(base + 20 * MIB, 20 * MIB));
        assert_eq!(device.used(), 40 * MIB);
        // 40 + 20 > 50.
        assert!(!device.map(base + 40 * MIB, 20 * MIB));
        assert_eq!(device.used(), 40 * MIB);
        // A classic allocation sees the mapped bytes as used.
        assert_eq!(device.allocate(12 * MIB), None);
        assert!(device.allocate(10 * MIB).is_some());
    }

    #[test]
    fn a_told_failure_is_spent_by_one_map_step() {
        let mut device = Device::new(50 * MIB, Vec::new());
        let base = device.reserve(60 * MIB);
        device.fail_next(1);
        assert!(!device.map(base, 20 * MIB));
        assert_eq!(device.used(), 0);
        assert!(device.map(base, 20 * MIB));
    }

    #[test]
    fn unmapping_may_cut_across_map_steps() {
        let mut device = Device::new(100 * MIB, Vec::new());
        let base = device.reserve(80 * MIB);
        assert!(device.map(base, 20 * MIB));
        assert!(device.map(base + 20 * MIB, 40 * MIB));
        assert_eq!(
            device.reservations()[0].mapped_runs(),
            vec![(base, 60 * MIB)]
        );
        device.unmap(base + 10 * MIB, 20 * MIB);
        assert_eq!(
            device.reservations()[0].mapped_runs(),
            vec![(base, 10 * MIB), (base + 30 * MIB, 30 * MIB)]
        );
        assert_eq!(device.used(), 40 * MIB);
        device.unmap(base, 10 * MIB);
        device.unmap(base + 30 * MIB, 30 * MIB);
        assert_eq!(device.used(), 0);
        device.release_reservation(base);
        assert!(device.reservations().is_empty());
    }

    #[test]
    #[should_panic(expected = "mapped bytes")]
    fn a_reservation_with_mapped_bytes_cannot_be_released() {
        let mut device = Device::new(100 * MIB, Vec::new());
        let base = device.reserve(40 * MIB);
        assert!(device.map(base, 20 * MIB));
        device.release_reservation(base);
    }
}

//! The simulated device's address-space reservations and its page table (ARCHITECTURE.md,
//! "The simulated device", for rule 19: expandable segments, and rule 22h: page aliasing).
//!
//! A reservation takes the next address when one is set and usable for its size (and clears
//! it, used or not), else the lowest 2 MiB-aligned address at or above [`DEVICE_BASE`] where
//! the range overlaps no live allocation and no other reservation. It never consumes the
//! address script and never counts against capacity. It is cut into *slots* of its page.
//! Mapping `n` bytes of whole slots creates `n / page` *pages* (physical handles), one mapped
//! at each slot; it counts `n` against capacity and fails with out-of-memory when
//! `used + n > capacity`, or when the device was told to fail (one told failure per map step,
//! as per allocation). *Aliasing* (rule 22h) maps, at unmapped slots, the pages already
//! mapped at other slots: no page is created, nothing more counts against capacity, and it
//! fails only when told to (a told failure per alias call). Unmapping a slot unmaps that
//! mapping only; a page's memory goes back when its last mapping is unmapped. Releasing a
//! reservation requires that nothing in it is mapped.
//!
//! The page table is kept the device's way, apart from the model's: each reservation maps
//! its slots to page numbers, and each page lists its mappings.
//!
//! The model never makes a classic device allocation while it holds ranges (rule 19 replaces
//! rule 8), and refuses to adopt a segment overlapping one (rule 18a), so allocation and
//! adoption need not look at reservations.

use std::collections::BTreeMap;

use super::{DEVICE_ALIGNMENT, DEVICE_BASE, Device, overlaps};

/// One reserved address range and what is mapped at its slots.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Reservation {
    /// The range's first byte.
    pub(crate) base: u64,
    /// The range's size in bytes.
    pub(crate) size: u64,
    /// The size of its slots (and of the pages mapped at them).
    pub(crate) page: u64,
    /// The mapped slots: slot address → the device's page number.
    pub(crate) slots: BTreeMap<u64, u64>,
}

/// One physical page of the device (rule 22h): its size and the slots that map it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct DevicePage {
    /// Its bytes (its reservation's page).
    pub(crate) bytes: u64,
    /// The slot addresses mapping it, in the order they were mapped.
    pub(crate) mappings: Vec<u64>,
}

impl Reservation {
    /// Whether `[address, address + bytes)` lies inside the range.
    fn contains(&self, address: u64, bytes: u64) -> bool {
        address >= self.base
            && u128::from(address) + u128::from(bytes)
                <= u128::from(self.base) + u128::from(self.size)
    }

    /// The slot addresses of `[address, address + bytes)`, which must be whole slots.
    fn slots_of(&self, address: u64, bytes: u64) -> Vec<u64> {
        assert!(
            (address - self.base).is_multiple_of(self.page) && bytes.is_multiple_of(self.page),
            "device map, alias or unmap of bytes that are not whole pages"
        );
        (0..bytes / self.page)
            .map(|i| address + i * self.page)
            .collect()
    }

    /// The mapped slots merged where they touch, as `(address, bytes)`, sorted by address.
    pub(crate) fn mapped_runs(&self) -> Vec<(u64, u64)> {
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for &slot in self.slots.keys() {
            match runs.last_mut() {
                Some(last) if last.0 + last.1 == slot => last.1 += self.page,
                _ => runs.push((slot, self.page)),
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

    /// The pages, by page number.
    pub(crate) fn pages(&self) -> &BTreeMap<u64, DevicePage> {
        &self.pages
    }

    /// The page mapped at the slot starting at `slot`, if any.
    pub(crate) fn page_at(&self, slot: u64) -> Option<u64> {
        // Reservations never overlap and a slot lies in its own, so one map is asked.
        self.reservations
            .iter()
            .find(|r| r.contains(slot, 1))
            .and_then(|r| r.slots.get(&slot).copied())
    }

    /// Bytes of all pages, each counted once however many slots map it.
    pub(crate) fn mapped_bytes(&self) -> u64 {
        self.pages.values().map(|p| p.bytes).sum()
    }

    /// Reserves `size` bytes of address space cut into slots of `page` bytes: its base.
    /// Counts nothing against capacity and never fails.
    ///
    /// # Panics
    /// If no range of `size` bytes is left above [`DEVICE_BASE`].
    pub(crate) fn reserve(&mut self, size: u64, page: u64) -> u64 {
        let base = match self.next.take() {
            Some(next) if self.reservable(next, size) => next,
            _ => self.lowest_reservable_address(size),
        };
        self.reservations.push(Reservation {
            base,
            size,
            page,
            slots: BTreeMap::new(),
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

    /// Maps `bytes` of whole slots at `address`, inside a reservation, each at a new page:
    /// false for out-of-memory (a told failure is spent, or `used + bytes > capacity`), and
    /// then nothing is mapped.
    ///
    /// # Panics
    /// If the bytes are not whole slots of one reservation or are already mapped (the model
    /// never does this).
    pub(crate) fn map(&mut self, address: u64, bytes: u64) -> bool {
        let index = self.reservation_holding(address, bytes);
        let slots = self.reservations[index].slots_of(address, bytes);
        assert!(
            slots
                .iter()
                .all(|s| !self.reservations[index].slots.contains_key(s)),
            "device map of bytes already mapped"
        );
        if self.failures_ahead > 0 {
            self.failures_ahead -= 1;
            return false;
        }
        if bytes > self.capacity - self.used() {
            return false;
        }
        let page = self.reservations[index].page;
        for slot in slots {
            let number = self.next_page;
            self.next_page += 1;
            self.pages.insert(
                number,
                DevicePage {
                    bytes: page,
                    mappings: vec![slot],
                },
            );
            self.reservations[index].slots.insert(slot, number);
        }
        true
    }

    /// Rule 19j: maps `bytes` of whole slots at `address` as [`Device::map`] does, backed by
    /// one handle: the mapping is then unmapped only whole and never aliased.
    pub(crate) fn map_handle(&mut self, address: u64, bytes: u64) -> bool {
        if !self.map(address, bytes) {
            return false;
        }
        self.handles.insert(address, bytes);
        true
    }

    /// Rule 19j: the handle mappings of several pages that share a byte with
    /// `[address, address + bytes)`, as `(first byte, bytes)`.
    fn handles_touching(&self, address: u64, bytes: u64) -> Vec<(u64, u64)> {
        let before = self
            .handles
            .range(..address)
            .next_back()
            .map(|(&a, &b)| (a, b));
        before
            .into_iter()
            .chain(
                self.handles
                    .range(address..address.saturating_add(bytes))
                    .map(|(&a, &b)| (a, b)),
            )
            .filter(|&(a, b)| overlaps(a, b, address, bytes))
            .collect()
    }

    /// Rule 22h: maps at the `bytes` of unmapped whole slots at `address` the pages mapped at
    /// the `bytes` at `source` (whole mapped slots of one reservation, of the same page, not
    /// overlapping the target), in order. No page is created. False for out-of-memory when
    /// told to fail (a told failure is spent), and then nothing is mapped.
    ///
    /// # Panics
    /// If the target is not unmapped whole slots of one reservation, the source not mapped
    /// whole slots of one, or they overlap (the model never does this).
    pub(crate) fn alias(&mut self, address: u64, source: u64, bytes: u64) -> bool {
        assert!(
            !overlaps(address, bytes, source, bytes),
            "device alias onto its own source"
        );
        assert!(
            self.handles_touching(source, bytes).is_empty(),
            "device alias of a part of a handle of several pages (rule 19j)"
        );
        let target = self.reservation_holding(address, bytes);
        let from = self.reservation_holding(source, bytes);
        assert_eq!(
            self.reservations[target].page, self.reservations[from].page,
            "device alias between reservations of different pages"
        );
        let targets = self.reservations[target].slots_of(address, bytes);
        let sources = self.reservations[from].slots_of(source, bytes);
        assert!(
            targets
                .iter()
                .all(|s| !self.reservations[target].slots.contains_key(s)),
            "device alias onto bytes already mapped"
        );
        let numbers: Vec<u64> = sources
            .iter()
            .map(|s| {
                *self.reservations[from]
                    .slots
                    .get(s)
                    .expect("device alias of bytes not mapped")
            })
            .collect();
        if self.failures_ahead > 0 {
            self.failures_ahead -= 1;
            return false;
        }
        for (slot, number) in targets.into_iter().zip(numbers) {
            self.reservations[target].slots.insert(slot, number);
            self.pages
                .get_mut(&number)
                .expect("a mapped slot's page exists")
                .mappings
                .push(slot);
        }
        true
    }

    /// Unmaps the `bytes` of whole slots at `address`, all of them mapped in one
    /// reservation: each slot's mapping only; a page whose last mapping this was is gone (its
    /// memory back).
    ///
    /// # Panics
    /// If some of the slots are not mapped (the model never does this).
    pub(crate) fn unmap(&mut self, address: u64, bytes: u64) {
        // Rule 19j: a handle's mapping goes only whole.
        for (a, b) in self.handles_touching(address, bytes) {
            assert!(
                a >= address && a + b <= address + bytes,
                "device unmap of a part of the handle at {a:#x} (+{b})"
            );
            self.handles.remove(&a);
        }
        let index = self.reservation_holding(address, bytes);
        for slot in self.reservations[index].slots_of(address, bytes) {
            let number = self.reservations[index]
                .slots
                .remove(&slot)
                .expect("device unmap of bytes not mapped");
            let page = self
                .pages
                .get_mut(&number)
                .expect("a mapped slot's page exists");
            page.mappings.retain(|&m| m != slot);
            if page.mappings.is_empty() {
                self.pages.remove(&number);
            }
        }
    }

    /// Rule 18f: a reservation of `size` bytes at `base`, cut into slots of `page` bytes,
    /// already exists, with a new page mapped at every slot of the `mapped` runs
    /// (`(address, bytes)`); the pages count against capacity. Refused (nothing changes) as
    /// unusable when the range is empty, overflows or overlaps a live allocation or another
    /// reservation, or a run is not whole slots inside it; else as out-of-memory when the
    /// mapped bytes do not fit the capacity left. Told failures do not apply.
    pub(crate) fn adopt_range(
        &mut self,
        base: u64,
        size: u64,
        page: u64,
        mapped: &[(u64, u64)],
    ) -> Result<(), super::AdoptRefusal> {
        use super::AdoptRefusal;
        if size == 0
            || page == 0
            || base == 0
            || base.checked_add(size).is_none()
            || !self.is_unused(base, size)
        {
            return Err(AdoptRefusal::Unusable);
        }
        let mut reservation = Reservation {
            base,
            size,
            page,
            slots: BTreeMap::new(),
        };
        let mut total: u128 = 0;
        for &(address, bytes) in mapped {
            let whole = address >= base
                && (address - base).is_multiple_of(page)
                && bytes.is_multiple_of(page)
                && reservation.contains(address, bytes);
            if !whole {
                return Err(AdoptRefusal::Unusable);
            }
            total += u128::from(bytes);
        }
        if total > u128::from(self.capacity - self.used()) {
            return Err(AdoptRefusal::OutOfMemory);
        }
        for &(address, bytes) in mapped {
            for slot in reservation.slots_of(address, bytes) {
                if reservation.slots.contains_key(&slot) {
                    return Err(AdoptRefusal::Unusable);
                }
                reservation.slots.insert(slot, u64::MAX);
            }
        }
        // Pages are numbered in address order, as the model numbers a map step's.
        let slots: Vec<u64> = reservation.slots.keys().copied().collect();
        for slot in slots {
            let number = self.next_page;
            self.next_page += 1;
            self.pages.insert(
                number,
                DevicePage {
                    bytes: page,
                    mappings: vec![slot],
                },
            );
            reservation.slots.insert(slot, number);
        }
        self.reservations.push(reservation);
        Ok(())
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
            self.reservations[index].slots.is_empty(),
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
        assert_eq!(device.reserve(120 * MIB, MIB), DEVICE_BASE);
        assert_eq!(device.reserve(3 * MIB, MIB), DEVICE_BASE + 120 * MIB);
        assert_eq!(device.reserve(2 * MIB, MIB), DEVICE_BASE + 124 * MIB);
        assert_eq!(device.used(), 0);
        // The address script is for allocations only.
        assert_eq!(device.script, vec![0x1000_0000]);
        // A released range is reused when the new one fits in it.
        device.release_reservation(DEVICE_BASE + 120 * MIB);
        assert_eq!(device.reserve(6 * MIB, MIB), DEVICE_BASE + 126 * MIB);
        assert_eq!(device.reserve(4 * MIB, MIB), DEVICE_BASE + 120 * MIB);
    }

    #[test]
    fn a_reservation_avoids_live_allocations() {
        let mut device = Device::new(100 * MIB, Vec::new());
        assert_eq!(device.allocate(3 * MIB), Some(DEVICE_BASE));
        assert_eq!(device.reserve(20 * MIB, MIB), DEVICE_BASE + 4 * MIB);
    }

    #[test]
    fn the_next_address_is_taken_when_usable_and_cleared_either_way() {
        let mut device = Device::new(100 * MIB, Vec::new());
        device.set_next_address(Some(0x2000_0000));
        assert_eq!(device.reserve(20 * MIB, MIB), 0x2000_0000);
        assert_eq!(device.next, None);
        // Overlapping the first reservation: not used, but cleared.
        device.set_next_address(Some(0x2000_0000 + 2 * MIB));
        assert_eq!(device.reserve(20 * MIB, MIB), DEVICE_BASE);
        assert_eq!(device.next, None);
        for bad in [0, 0x3000_0100, u64::MAX - 511] {
            device.set_next_address(Some(bad));
            assert_ne!(device.reserve(2 * MIB, MIB), bad);
        }
    }

    #[test]
    fn mapping_counts_against_capacity_and_fails_beyond_it() {
        let mut device = Device::new(50 * MIB, Vec::new());
        let base = device.reserve(60 * MIB, 10 * MIB);
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
        let base = device.reserve(60 * MIB, 10 * MIB);
        device.fail_next(1);
        assert!(!device.map(base, 20 * MIB));
        assert_eq!(device.used(), 0);
        assert!(device.map(base, 20 * MIB));
    }

    #[test]
    fn unmapping_may_cut_across_map_steps() {
        let mut device = Device::new(100 * MIB, Vec::new());
        let base = device.reserve(80 * MIB, 10 * MIB);
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
        let base = device.reserve(40 * MIB, 10 * MIB);
        assert!(device.map(base, 20 * MIB));
        device.release_reservation(base);
    }

    #[test]
    fn an_alias_maps_the_same_pages_again_without_counting_them_twice() {
        let mut device = Device::new(100 * MIB, Vec::new());
        let base = device.reserve(80 * MIB, 10 * MIB);
        assert!(device.map(base, 20 * MIB));
        assert_eq!(device.used(), 20 * MIB);
        assert!(device.alias(base + 40 * MIB, base, 20 * MIB));
        assert_eq!(device.used(), 20 * MIB);
        assert_eq!(device.pages().len(), 2);
        assert_eq!(device.page_at(base + 40 * MIB), device.page_at(base));
        assert_eq!(
            device.page_at(base + 50 * MIB),
            device.page_at(base + 10 * MIB)
        );
        assert_eq!(
            device.reservations()[0].mapped_runs(),
            vec![(base, 20 * MIB), (base + 40 * MIB, 20 * MIB)]
        );
        // Unmapping one mapping keeps the page behind the other.
        device.unmap(base, 20 * MIB);
        assert_eq!(device.used(), 20 * MIB);
        assert_eq!(device.page_at(base), None);
        // The last mapping gives the memory back.
        device.unmap(base + 40 * MIB, 10 * MIB);
        assert_eq!(device.used(), 10 * MIB);
        device.unmap(base + 50 * MIB, 10 * MIB);
        assert_eq!(device.used(), 0);
        assert!(device.pages().is_empty());
        device.release_reservation(base);
    }

    #[test]
    fn an_alias_may_map_pages_of_another_reservation_and_a_told_failure_stops_it() {
        let mut device = Device::new(100 * MIB, Vec::new());
        let a = device.reserve(40 * MIB, 10 * MIB);
        let b = device.reserve(40 * MIB, 10 * MIB);
        assert!(device.map(a, 10 * MIB));
        device.fail_next(1);
        assert!(!device.alias(b, a, 10 * MIB));
        assert_eq!(device.page_at(b), None);
        assert!(device.alias(b, a, 10 * MIB));
        assert_eq!(device.page_at(b), device.page_at(a));
        // Capacity is not asked: the page exists already.
        assert!(device.map(a + 10 * MIB, 30 * MIB));
        assert!(device.map(b + 10 * MIB, 30 * MIB));
        assert_eq!(device.used(), 70 * MIB);
    }

    #[test]
    fn rule_18f_an_adopted_run_must_be_whole_slots_inside_the_range() {
        use crate::device::AdoptRefusal;
        let mut device = Device::new(100 * MIB, Vec::new());
        let base = DEVICE_BASE;
        // A 40 MiB range of 10 MiB slots: a run off a slot boundary, one not a whole number
        // of slots, one before the range and one past its end are each refused, and the
        // device is left as it was.
        for run in [
            (base + 5 * MIB, 10 * MIB),
            (base, 15 * MIB),
            (base - 10 * MIB, 10 * MIB),
            (base + 30 * MIB, 20 * MIB),
        ] {
            assert_eq!(
                device.adopt_range(base, 40 * MIB, 10 * MIB, &[run]),
                Err(AdoptRefusal::Unusable),
                "{run:x?}"
            );
            assert!(device.reservations().is_empty());
            assert_eq!(device.used(), 0);
        }
        // Whole slots inside it are taken: a new page at every slot.
        let runs = [(base, 20 * MIB), (base + 30 * MIB, 10 * MIB)];
        assert_eq!(device.adopt_range(base, 40 * MIB, 10 * MIB, &runs), Ok(()));
        assert_eq!(device.used(), 30 * MIB);
        assert_eq!(device.reservations()[0].mapped_runs(), runs.to_vec());
    }

    #[test]
    #[should_panic(expected = "part of the handle")]
    fn rule_19j_a_handle_mapping_is_unmapped_only_whole() {
        // cuMemUnmap takes a mapping whole: a handle of two pages cannot lose one.
        let mut device = Device::new(100 * MIB, Vec::new());
        let base = device.reserve(40 * MIB, 10 * MIB);
        assert!(device.map_handle(base, 20 * MIB));
        device.unmap(base + 10 * MIB, 10 * MIB);
    }

    #[test]
    #[should_panic(expected = "part of a handle")]
    fn rule_19j_a_handle_of_several_pages_is_never_aliased() {
        let mut device = Device::new(100 * MIB, Vec::new());
        let base = device.reserve(40 * MIB, 10 * MIB);
        assert!(device.map_handle(base, 20 * MIB));
        device.alias(base + 20 * MIB, base, 10 * MIB);
    }

    #[test]
    fn rule_19j_a_handle_unmapped_whole_leaves_its_slots_to_pages() {
        // Once the handle's mapping is gone, its slots map one-page handles again, and those
        // may be aliased.
        let mut device = Device::new(100 * MIB, Vec::new());
        let base = device.reserve(40 * MIB, 10 * MIB);
        assert!(device.map_handle(base, 20 * MIB));
        device.unmap(base, 20 * MIB);
        assert_eq!(device.used(), 0);
        assert!(device.map(base, 20 * MIB));
        assert!(device.alias(base + 20 * MIB, base, 10 * MIB));
        assert_eq!(device.page_at(base + 20 * MIB), device.page_at(base));
        device.unmap(base + 10 * MIB, 10 * MIB);
        assert_eq!(device.used(), 10 * MIB);
    }
}

//! Unit tests of the simulated device.
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

const MIB: u64 = 1 << 20;

#[test]
fn an_alias_maps_the_same_pages_again_and_counts_them_once() {
    let mut d = SimDevice::new(64 * MIB);
    let r = d.reserve(40 * MIB, 2 * MIB).unwrap();
    d.map(r, 4 * MIB).unwrap();
    let (p0, p1) = (d.page_at(r).unwrap(), d.page_at(r + 2 * MIB + 512).unwrap());
    assert_ne!(p0, p1);
    assert_eq!(d.page_at(r + 4 * MIB), None);
    assert_eq!(d.slot_at(r + 3 * MIB), Some((r + 2 * MIB, 2 * MIB)));
    assert_eq!(d.slot_at(r + 40 * MIB), None);
    // The two pages at a second place (another reservation would do too): no memory made.
    d.alias(r + 10 * MIB, r, 4 * MIB).unwrap();
    assert_eq!(d.page_at(r + 10 * MIB), Some(p0));
    assert_eq!(d.page_at(r + 12 * MIB), Some(p1));
    assert_eq!(d.mappings(p0), [r, r + 10 * MIB]);
    assert_eq!(d.used(), 4 * MIB);
    assert_eq!(d.page_count(), 2);
    assert_eq!(d.call_counts(), (2, 0));
    // The reservation shows both mappings.
    assert_eq!(d.reservations().next(), Some((r, 40 * MIB, 8 * MIB)));
    // An alias of an alias is the same page.
    let other = d.reserve(40 * MIB, 2 * MIB).unwrap();
    d.alias(other, r + 12 * MIB, 2 * MIB).unwrap();
    assert_eq!(d.page_at(other), Some(p1));
    assert_eq!(d.mappings(p1), [r + 2 * MIB, r + 12 * MIB, other]);
    assert_eq!(d.used(), 4 * MIB);
}

#[test]
fn a_page_goes_back_with_its_last_mapping_and_unmap_unmaps_that_mapping_only() {
    let mut d = SimDevice::new(64 * MIB);
    let r = d.reserve(40 * MIB, 2 * MIB).unwrap();
    d.map(r, 4 * MIB).unwrap();
    let p0 = d.page_at(r).unwrap();
    d.alias(r + 20 * MIB, r, 4 * MIB).unwrap();
    // Unmapping the first mapping leaves the pages where they are also mapped.
    d.unmap(r, 4 * MIB, StreamId(0)).unwrap();
    assert_eq!(d.page_at(r), None);
    assert_eq!(d.page_at(r + 20 * MIB), Some(p0));
    assert_eq!(d.used(), 4 * MIB);
    // The slots can be mapped anew (new pages) while the old ones live on elsewhere.
    d.map(r, 2 * MIB).unwrap();
    assert_ne!(d.page_at(r), Some(p0));
    assert_eq!(d.used(), 6 * MIB);
    // One page's last mapping goes: 2 MiB back; then the other.
    d.unmap(r + 20 * MIB, 2 * MIB, StreamId(0)).unwrap();
    assert_eq!(d.used(), 4 * MIB);
    assert!(d.mappings(p0).is_empty());
    d.unmap(r + 22 * MIB, 2 * MIB, StreamId(0)).unwrap();
    d.unmap(r, 2 * MIB, StreamId(0)).unwrap();
    assert_eq!((d.used(), d.page_count()), (0, 0));
    d.release_reservation(r, 40 * MIB).unwrap();
    assert_eq!(d.call_counts(), (3, 4));
}

#[test]
fn an_alias_refuses_what_the_gpu_would_and_changes_nothing() {
    let mut d = SimDevice::new(1 << 30);
    let r = d.reserve(40 * MIB, 2 * MIB).unwrap();
    let big = d.reserve(80 * MIB, 20 * MIB).unwrap();
    d.map(r, 8 * MIB).unwrap();
    d.map(big, 20 * MIB).unwrap();
    let before = (d.used(), d.page_count(), d.call_counts());
    for (what, target, source, size) in [
        ("target mapped", r + 6 * MIB, r, 2 * MIB),
        ("target partly mapped", r + 6 * MIB, r, 4 * MIB),
        ("source not mapped", r + 20 * MIB, r + 8 * MIB, 2 * MIB),
        ("source partly mapped", r + 20 * MIB, r + 6 * MIB, 4 * MIB),
        ("overlapping", r + 8 * MIB, r + 6 * MIB, 4 * MIB),
        ("target not page-aligned", r + 21 * MIB, r, 2 * MIB),
        ("source not page-aligned", r + 20 * MIB, r + MIB, 2 * MIB),
        ("not whole pages", r + 20 * MIB, r, MIB),
        ("empty", r + 20 * MIB, r, 0),
        ("past the reservation", r + 38 * MIB, r, 4 * MIB),
        ("outside any reservation", 0x1000_0000, r, 2 * MIB),
        ("pages of another size", big + 20 * MIB, r, 20 * MIB),
    ] {
        assert!(
            matches!(
                d.alias(target, source, size),
                Err(BackendError::Device {
                    operation: "alias",
                    ..
                })
            ),
            "{what}"
        );
    }
    assert_eq!((d.used(), d.page_count(), d.call_counts()), before);
    assert_eq!(d.page_at(r + 20 * MIB), None);
}

#[test]
fn an_alias_takes_allocation_faults_as_a_map_does() {
    let mut d = SimDevice::new(8 * MIB);
    let r = d.reserve(20 * MIB, 2 * MIB).unwrap();
    d.map(r, 8 * MIB).unwrap();
    // The device is full, yet an alias makes no memory: it succeeds.
    d.alias(r + 8 * MIB, r, 2 * MIB).unwrap();
    d.fail_next_allocs(1);
    assert_eq!(
        d.alias(r + 10 * MIB, r + 2 * MIB, 2 * MIB),
        Err(BackendError::OutOfMemory)
    );
    d.inject(Faults {
        alloc_error: 1,
        ..Faults::default()
    });
    assert_eq!(
        d.alias(r + 10 * MIB, r + 2 * MIB, 2 * MIB),
        Err(BackendError::Injected { operation: "alias" })
    );
    assert_eq!(d.page_at(r + 10 * MIB), None);
    d.alias(r + 10 * MIB, r + 2 * MIB, 2 * MIB).unwrap();
    assert_eq!(d.call_counts(), (3, 0));
}

#[test]
fn a_reservation_takes_the_next_address_but_never_the_script() {
    let mut d = SimDevice::new(1 << 30).with_address_script([0x4000_0000]);
    d.set_next_address(Some(0x2000_0000));
    assert_eq!(d.reserve(40 << 20, 20 << 20).unwrap(), 0x2000_0000);
    assert_eq!(d.reserve(40 << 20, 20 << 20).unwrap(), SIM_BASE_ADDRESS);
    assert_eq!(d.allocate(2 << 20).unwrap(), 0x4000_0000);
}

#[test]
fn a_handle_of_several_pages_unmaps_only_whole_and_is_never_aliased() {
    use crate::backend::StreamId;
    const MIB: u64 = 1 << 20;
    let mut d = SimDevice::new(1 << 30);
    let base = d.reserve(64 * MIB, 2 * MIB).unwrap();
    d.map_handle(base, 8 * MIB).unwrap();
    assert_eq!(d.handles_created(), 1);
    assert_eq!(d.used(), 8 * MIB);
    // One page is not a handle of several.
    assert!(d.map_handle(base + 8 * MIB, 2 * MIB).is_err());
    // A part of the mapping: refused, nothing unmapped.
    assert!(d.unmap(base + 2 * MIB, 2 * MIB, StreamId(0)).is_err());
    assert!(d.unmap(base, 6 * MIB, StreamId(0)).is_err());
    assert_eq!(d.used(), 8 * MIB);
    // An alias of one of its pages: refused (a GPU maps a handle only whole).
    assert!(d.alias(base + 32 * MIB, base + 2 * MIB, 2 * MIB).is_err());
    // Beside a page of its own, one unmap over both goes.
    d.map(base + 8 * MIB, 2 * MIB).unwrap();
    assert_eq!(d.handles_created(), 2);
    d.unmap(base, 10 * MIB, StreamId(0)).unwrap();
    assert_eq!(d.used(), 0);
    d.release_reservation(base, 64 * MIB).unwrap();
}

#[test]
fn the_stream_wait_log_keeps_the_latest_waits_and_counts_them_all() {
    use crate::backend::StreamId;
    let mut d = SimDevice::new(1 << 30);
    let n = STREAM_WAIT_LOG as u64 + 10;
    for i in 0..n {
        d.wait_stream(StreamId(i), StreamId(i + 1)).unwrap();
    }
    assert_eq!(d.stream_wait_count(), n);
    let kept = d.stream_waits();
    assert_eq!(kept.len(), STREAM_WAIT_LOG);
    assert_eq!(kept[0], (StreamId(10), StreamId(11)));
    assert_eq!(kept.last(), Some(&(StreamId(n - 1), StreamId(n))));
}

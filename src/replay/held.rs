//! A device for replaying a program on another backend (a GPU, or the simulated device behind
//! the thread-safe front end): the program's stream handles mapped to the backend's streams,
//! and held-back frees completed when the program says so.
//!
//! The one rule: an event recorded on one of the replayer's side streams (a cross-stream free
//! held back, [`side_stream`](super::side_stream)) is reported complete only once the backend
//! has completed it *and* the program has reached its completion ([`HeldBackDevice::complete`]),
//! or the allocator waited for it — which is when the simulated replay completes it too. So a
//! replay on a real GPU holds blocks back exactly as long as PyTorch did.
//! `cachalot replay --backend cuda` and the side-by-side benchmark (`benches/gpu_compare.rs`)
//! both replay through it.

use std::collections::HashMap;

use cachalot::{Backend, BackendError, EventId, MemInfo, StreamId};

use super::interpret::is_side_stream;

/// Successful device calls through a [`HeldBackDevice`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceCalls {
    /// `allocate` (a segment).
    pub allocs: u64,
    /// `free` (a segment).
    pub frees: u64,
    /// `map` steps (expandable segments), `alias` calls (page aliasing, rule 22) included.
    pub maps: u64,
    /// `unmap` steps.
    pub unmaps: u64,
    /// Handles the map steps created (rule 19j): one per page of a `map`, one per
    /// `map_handle` — on a GPU each is a `cuMemCreate`, a `cuMemMap` and a `cuMemSetAccess`,
    /// whatever the step counts say.
    pub handles: u64,
    /// Pages the `alias` calls mapped a second time (rule 22h, and rule 23's views): on a GPU
    /// each is a `cuMemMap` of an existing handle and its share of a `cuMemSetAccess`.
    pub alias_pages: u64,
    /// Pages the `unmap` steps unmapped: on a GPU each is a `cuMemUnmap`, and a
    /// `cuMemRelease` when it was the handle's last mapping.
    pub unmapped_pages: u64,
    /// Address ranges reserved (`cuMemAddressReserve`).
    pub reserves: u64,
    /// Address ranges given back (`cuMemAddressFree`).
    pub reservation_frees: u64,
}

/// `B` with the program's streams mapped to `B`'s and held-back frees completed by the program.
pub struct HeldBackDevice<B> {
    inner: B,
    /// Program stream handle → the backend's stream (a handle not in it stays itself).
    streams: HashMap<u64, StreamId>,
    /// The one backend stream every side stream maps to (`None`: side streams stay themselves).
    side: Option<StreamId>,
    /// What a side stream's completion tells `inner` (the simulated device completes the
    /// stream; a GPU needs nothing).
    on_complete: fn(&mut B, StreamId),
    /// Events recorded for side streams: event → the side stream.
    held: HashMap<u64, StreamId>,
    /// Side streams with an outstanding event → whether the program has completed their work.
    outstanding: HashMap<StreamId, bool>,
    calls: DeviceCalls,
    /// Reservations made through this device: first address → (size, page), to count the
    /// handles of a `map`.
    reservations: std::collections::BTreeMap<u64, (u64, u64)>,
}

impl<B: Backend> HeldBackDevice<B> {
    /// `inner` with program streams mapped by `streams` and every side stream on `side`.
    pub fn new(
        inner: B,
        streams: HashMap<u64, StreamId>,
        side: Option<StreamId>,
        on_complete: fn(&mut B, StreamId),
    ) -> HeldBackDevice<B> {
        HeldBackDevice {
            inner,
            streams,
            side,
            on_complete,
            held: HashMap::new(),
            outstanding: HashMap::new(),
            calls: DeviceCalls::default(),
            reservations: std::collections::BTreeMap::new(),
        }
    }

    /// The program has reached the completion of side stream `side`'s work (a side stream with
    /// no outstanding event is left alone, so a later event on it is not taken as complete:
    /// the simulated device behaves the same).
    pub fn complete(&mut self, side: StreamId) {
        if let Some(done) = self.outstanding.get_mut(&side) {
            *done = true;
        }
        let real = self.real_stream(side);
        (self.on_complete)(&mut self.inner, real);
    }

    /// The successful device calls so far.
    pub fn calls(&self) -> DeviceCalls {
        self.calls
    }

    /// The page of the reservation holding `address` (`size` itself for an address outside
    /// every reservation this device made, so that it counts as one page).
    fn page_at(&self, address: u64, size: u64) -> u64 {
        self.reservations
            .range(..=address)
            .next_back()
            .map_or(size, |(_, &(_, page))| page)
            .max(1)
    }

    fn real_stream(&self, stream: StreamId) -> StreamId {
        if is_side_stream(stream) {
            return self.side.unwrap_or(stream);
        }
        // A handle not among the program's: the backend waits for the whole device instead of
        // recording on it, which is safe.
        self.streams.get(&stream.0).copied().unwrap_or(stream)
    }
}

impl<B: Backend> Backend for HeldBackDevice<B> {
    fn allocate(&mut self, size: u64) -> Result<u64, BackendError> {
        let r = self.inner.allocate(size);
        self.calls.allocs += u64::from(r.is_ok());
        r
    }

    fn free(&mut self, address: u64, size: u64) -> Result<(), BackendError> {
        let r = self.inner.free(address, size);
        self.calls.frees += u64::from(r.is_ok());
        r
    }

    fn mem_info(&mut self) -> Result<MemInfo, BackendError> {
        self.inner.mem_info()
    }

    fn record_event(&mut self, stream: StreamId) -> Result<EventId, BackendError> {
        let event = self.inner.record_event(self.real_stream(stream))?;
        if is_side_stream(stream) {
            self.held.insert(event.0, stream);
            self.outstanding.insert(stream, false);
        }
        Ok(event)
    }

    fn query_event(&mut self, event: EventId) -> Result<bool, BackendError> {
        if let Some(side) = self.held.get(&event.0)
            && self.outstanding.get(side) == Some(&false)
        {
            return Ok(false);
        }
        self.inner.query_event(event)
    }

    fn synchronize_event(&mut self, event: EventId) -> Result<(), BackendError> {
        self.inner.synchronize_event(event)?;
        // Waiting for the event is the side stream reaching it, as on the simulated device.
        if let Some(side) = self.held.get(&event.0) {
            self.outstanding.insert(*side, true);
        }
        Ok(())
    }

    fn destroy_event(&mut self, event: EventId) {
        if let Some(side) = self.held.remove(&event.0) {
            self.outstanding.remove(&side);
        }
        self.inner.destroy_event(event);
    }

    // Expandable segments (rule 19): `B`'s virtual memory, with the program's stream handles
    // turned into `B`'s streams for the synchronisation of unmap.
    fn virtual_memory(&self) -> bool {
        self.inner.virtual_memory()
    }

    fn reserve(&mut self, size: u64, page: u64) -> Result<u64, BackendError> {
        let address = self.inner.reserve(size, page)?;
        self.reservations.insert(address, (size, page));
        self.calls.reserves += 1;
        Ok(address)
    }

    fn release_reservation(&mut self, address: u64, size: u64) -> Result<(), BackendError> {
        self.inner.release_reservation(address, size)?;
        self.reservations.remove(&address);
        self.calls.reservation_frees += 1;
        Ok(())
    }

    /// One handle per page (counted by the reservation's page).
    fn map(&mut self, address: u64, size: u64) -> Result<(), BackendError> {
        let r = self.inner.map(address, size);
        if r.is_ok() {
            self.calls.maps += 1;
            self.calls.handles += size.div_ceil(self.page_at(address, size));
        }
        r
    }

    /// Rule 19j: `B`'s one handle for a map step, counted as a map step.
    fn map_handle(&mut self, address: u64, size: u64) -> Result<(), BackendError> {
        let r = self.inner.map_handle(address, size);
        if r.is_ok() {
            self.calls.maps += 1;
            self.calls.handles += 1;
        }
        r
    }

    fn unmap(&mut self, address: u64, size: u64, stream: StreamId) -> Result<(), BackendError> {
        let r = self.inner.unmap(address, size, self.real_stream(stream));
        if r.is_ok() {
            self.calls.unmaps += 1;
            self.calls.unmapped_pages += size.div_ceil(self.page_at(address, size));
        }
        r
    }

    /// Page aliasing (rule 22h): `B`'s, counted as a map step.
    fn alias(&mut self, address: u64, source: u64, size: u64) -> Result<(), BackendError> {
        let r = self.inner.alias(address, source, size);
        if r.is_ok() {
            self.calls.maps += 1;
            self.calls.alias_pages += size.div_ceil(self.page_at(address, size));
        }
        r
    }

    /// Rule 23k: `B`'s, on the streams the program's stand for; not a memory call, so not
    /// counted.
    fn wait_stream(&mut self, waiter: StreamId, on: StreamId) -> Result<(), BackendError> {
        let (waiter, on) = (self.real_stream(waiter), self.real_stream(on));
        self.inner.wait_stream(waiter, on)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cachalot::SimDevice;

    const PAGE: u64 = 2 << 20;

    /// Every kind of mapping work is counted by its pages, as the GPU pays for it: new
    /// handles, pages mapped a second time, pages unmapped, and address ranges.
    #[test]
    fn the_counts_name_every_page_mapped_again_and_unmapped() {
        let mut d = HeldBackDevice::new(
            SimDevice::new(1 << 30),
            HashMap::new(),
            None,
            SimDevice::complete_stream,
        );
        let home = d.reserve(8 * PAGE, PAGE).unwrap();
        d.map(home, 3 * PAGE).unwrap();
        let view = d.reserve(4 * PAGE, PAGE).unwrap();
        d.alias(view, home + PAGE, 2 * PAGE).unwrap();
        // A refused call counts nothing: the view's pages are mapped already.
        assert!(d.alias(view, home, PAGE).is_err());
        d.unmap(view, 2 * PAGE, StreamId(0)).unwrap();
        d.unmap(home, 3 * PAGE, StreamId(0)).unwrap();
        d.release_reservation(view, 4 * PAGE).unwrap();
        assert_eq!(
            d.calls(),
            DeviceCalls {
                allocs: 0,
                frees: 0,
                maps: 2,
                unmaps: 2,
                handles: 3,
                alias_pages: 2,
                unmapped_pages: 5,
                reserves: 2,
                reservation_frees: 1,
            }
        );
    }
}

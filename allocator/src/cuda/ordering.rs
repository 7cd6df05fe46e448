//! Data ordering between streams: the half of cudarc's stream contract that `CudaSlice` keeps
//! with events: a stream that uses a buffer first waits for the buffer's last write, and a
//! stream that writes it first waits for its last reads, wherever those ran.
//!
//! The one rule: the buffer's own stream pays nothing. Uses on the stream a buffer was
//! allocated on are in that stream's order already, so they are not tracked; a use on another
//! stream (the rare case) makes that stream wait for the owner's work so far (an event recorded
//! on the owner *now* covers every earlier use there, seen or not: a raw kernel launch
//! included), and leaves an event behind for later uses. A buffer never used on another stream
//! never makes a driver call for ordering, and never allocates the state below.
//!
//! The state is one [`Tracking`] per buffer, made at its first use on another stream: up to
//! [`SLOTS`] other streams, each with the events of its last write and its last read there,
//! and the bits of those not yet waited for by the owner. Each use's guard (cudarc's
//! [`SyncOnDrop`]) records the event once the use is queued, as cudarc's own slices do. Uses
//! whose guards are dropped in order (every cudarc API drops them before returning) are
//! ordered exactly; a stream beyond the [`SLOTS`] others, or a context that does not manage
//! events (cudarc's event tracking off, or no stream created yet), is handled by synchronising
//! the using stream once its use is queued instead — slower, never wrong.

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, SyncOnDrop};

use crate::sync::real::{Arc, AtomicU32, AtomicU64, OnceLock, Ordering};

use super::CudaAllocator;
use super::streams::stream_id;

/// Other streams tracked per buffer at once (a slot is reused once the owner has waited for
/// its stream's uses).
pub(crate) const SLOTS: usize = 4;

/// A slot with no stream.
const EMPTY: u64 = u64::MAX;

/// How a use touches the buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Access {
    /// Reads only (cudarc's `DevicePtr`).
    Read,
    /// May write (cudarc's `DevicePtrMut`).
    Write,
}

/// One other stream's last uses.
struct Slot {
    stream: AtomicU64,
    write: OnceLock<CudaEvent>,
    read: OnceLock<CudaEvent>,
}

/// The ordering state of one buffer that was used on another stream than its own.
pub(crate) struct Tracking {
    /// Recorded on the owner stream at each use on another stream, which then waits for it.
    owner: OnceLock<CudaEvent>,
    slots: [Slot; SLOTS],
    /// Bit `2i`: slot `i`'s stream wrote, and the owner has not waited for it yet; bit
    /// `2i + 1`: likewise for a read.
    pending: AtomicU32,
    /// Driver calls made for ordering (event records and waits, synchronisations).
    calls: AtomicU64,
}

fn write_bit(i: usize) -> u32 {
    1 << (2 * i)
}

fn read_bit(i: usize) -> u32 {
    1 << (2 * i + 1)
}

/// Every write bit.
const WRITES: u32 = 0x5555_5555;

impl Tracking {
    pub(crate) fn new() -> Tracking {
        Tracking {
            owner: OnceLock::new(),
            slots: std::array::from_fn(|_| Slot {
                stream: AtomicU64::new(EMPTY),
                write: OnceLock::new(),
                read: OnceLock::new(),
            }),
            pending: AtomicU32::new(0),
            calls: AtomicU64::new(0),
        }
    }

    /// Driver calls made for ordering so far.
    pub(crate) fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    fn count(&self, n: u64) {
        self.calls.fetch_add(n, Ordering::Relaxed);
    }

    /// Makes `stream` wait for `event`; if the driver refuses, waits on the host instead.
    fn wait(&self, stream: &CudaStream, event: &CudaEvent) {
        self.count(1);
        if stream.wait(event).is_err() {
            self.count(1);
            stream.context().record_err(event.synchronize());
        }
    }

    /// A use on the owner stream: waits for the other streams' writes (and, for a write,
    /// reads) that the owner has not waited for yet. Nothing pending: no driver call.
    pub(crate) fn owner_use(&self, owner: &CudaStream, access: Access) {
        let pending = self.pending.load(Ordering::Acquire);
        let mask = match access {
            Access::Read => WRITES,
            Access::Write => u32::MAX,
        };
        let due = pending & mask;
        if due == 0 {
            return;
        }
        for (i, slot) in self.slots.iter().enumerate() {
            if due & write_bit(i) != 0
                && let Some(e) = slot.write.get()
            {
                self.wait(owner, e);
            }
            if due & read_bit(i) != 0
                && let Some(e) = slot.read.get()
            {
                self.wait(owner, e);
            }
        }
        // Later uses anywhere are ordered after these waits: through the owner's stream order,
        // or, on another stream, through the owner's event recorded at that use.
        self.pending.fetch_and(!due, Ordering::AcqRel);
    }

    /// The slot of `id`: its own, a free one, or one whose uses the owner has waited for.
    fn slot_for(&self, id: u64) -> Option<usize> {
        if let Some(i) = self
            .slots
            .iter()
            .position(|s| s.stream.load(Ordering::Acquire) == id)
        {
            return Some(i);
        }
        for (i, slot) in self.slots.iter().enumerate() {
            let current = slot.stream.load(Ordering::Acquire);
            let idle = self.pending.load(Ordering::Acquire) & (write_bit(i) | read_bit(i)) == 0;
            if (current == EMPTY || idle)
                && slot
                    .stream
                    .compare_exchange(current, id, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            {
                return Some(i);
            }
        }
        None
    }

    /// A use on `stream`, another stream of the owner's context: `stream` waits for the
    /// owner's work so far and for the other streams' uses it conflicts with; the guard records
    /// this use once it is queued (or synchronises `stream` where no event can carry it).
    pub(crate) fn foreign_use<'a>(
        &'a self,
        owner: &CudaStream,
        stream: &'a CudaStream,
        access: Access,
    ) -> SyncOnDrop<'a> {
        let ctx = owner.context();
        // The owner's work so far: the allocation's, and every use there since.
        match event(&self.owner, ctx) {
            Some(e) if e.record(owner).is_ok() => {
                self.count(1);
                self.wait(stream, e);
            }
            _ => {
                self.count(1);
                ctx.record_err(owner.synchronize());
            }
        }
        let id = stream_id(stream).0;
        let mine = self.slot_for(id);
        let pending = self.pending.load(Ordering::Acquire);
        for (i, slot) in self.slots.iter().enumerate() {
            if Some(i) == mine {
                continue; // the stream's own earlier uses are in its order
            }
            if pending & write_bit(i) != 0
                && let Some(e) = slot.write.get()
            {
                self.wait(stream, e);
            }
            if access == Access::Write
                && pending & read_bit(i) != 0
                && let Some(e) = slot.read.get()
            {
                self.wait(stream, e);
            }
        }
        let Some(i) = mine else {
            self.count(1);
            return SyncOnDrop::Sync(Some(stream));
        };
        let (cell, bit) = match access {
            Access::Read => (&self.slots[i].read, read_bit(i)),
            Access::Write => (&self.slots[i].write, write_bit(i)),
        };
        match event(cell, ctx) {
            // cudarc's guard records only where the context manages stream synchronisation.
            Some(e) if ctx.is_managing_stream_synchronization() => {
                self.count(1);
                self.pending.fetch_or(bit, Ordering::AcqRel);
                SyncOnDrop::Record(Some((e, stream)))
            }
            _ => {
                self.count(1);
                SyncOnDrop::Sync(Some(stream))
            }
        }
    }

    /// A use on a stream of another device: events cannot order it, so the host waits for
    /// everything this buffer depends on first; the guard then synchronises `stream`.
    pub(crate) fn other_device_use(&self, owner: &CudaStream) {
        self.count(1);
        owner.context().record_err(owner.synchronize());
        let pending = self.pending.swap(0, Ordering::AcqRel);
        for (i, slot) in self.slots.iter().enumerate() {
            for (bit, cell) in [(write_bit(i), &slot.write), (read_bit(i), &slot.read)] {
                if pending & bit != 0
                    && let Some(e) = cell.get()
                {
                    self.count(1);
                    owner.context().record_err(e.synchronize());
                }
            }
        }
    }
}

/// The event in `cell`, created on first use; `None` if the driver cannot create one.
fn event<'a>(cell: &'a OnceLock<CudaEvent>, ctx: &Arc<CudaContext>) -> Option<&'a CudaEvent> {
    if let Some(e) = cell.get() {
        return Some(e);
    }
    let fresh = ctx.new_event(None).ok()?;
    // Another thread may have set one first: either is fine, the loser is destroyed.
    let _ = cell.set(fresh);
    cell.get()
}

impl CudaAllocator {
    /// Whether buffers order their data between streams (on by default); see
    /// [`CudaAllocator::set_data_ordering`].
    pub fn data_ordering(&self) -> bool {
        self.shared.data_ordering.load(Ordering::Relaxed)
    }

    /// Turns data ordering between streams on or off, for every clone of this allocator and
    /// every buffer it has handed out — cachalot's counterpart of cudarc's
    /// `CudaContext::disable_event_tracking`.
    ///
    /// On (the default), buffers keep cudarc's [`DevicePtr`](cudarc::driver::DevicePtr)
    /// contract as `CudaSlice` does: a stream that uses a buffer through `device_ptr` /
    /// `device_ptr_mut` (every cudarc copy, memset, cuBLAS call) or through
    /// [`Launch`](super::Launch) waits for the buffer's last write — and, to write, for its last
    /// reads — on every other stream, with no manual `join`. Uses on the buffer's own stream
    /// make no driver call for this; a use on another stream costs a few event records and
    /// waits.
    ///
    /// Off, ordering the data between streams is the program's job (`b.join(&a)`), as in
    /// PyTorch; that includes waiting for the buffer's allocation on its own stream before a
    /// first use elsewhere (a block from the cache may still be in use there by its previous
    /// owner's work). Reuse safety ([`CudaAllocator::set_auto_record_stream`]) is separate.
    pub fn set_data_ordering(&self, on: bool) {
        self.shared.data_ordering.store(on, Ordering::Relaxed);
    }
}

//! What keeps an allocator alive under the buffers it handed out, without a counter that every
//! thread touches: per-thread anchors, and the program's handles as owners.
//!
//! The one rule: a buffer holds an [`Anchor`], not a clone of the allocator. An anchor belongs
//! to one (thread, allocator, stream): the thread that allocates keeps its last few anchors,
//! and each buffer it allocates clones one of them, so the reference count a buffer moves on
//! allocation and on drop is that thread's own (a buffer dropped on another thread moves it
//! from there; nothing else is shared). An anchor holds the allocator and the stream, so a
//! buffer can never outlive the device memory it points into, nor its stream.
//!
//! Anchors kept by threads would keep an allocator alive after the program dropped it, with
//! its cached memory. So the program's handles ([`CudaAllocator`]s) also hold an [`Owner`]:
//! when the last one is dropped, the allocator *closes*: raw allocations are freed, the thread
//! caches are flushed and every cached segment goes back to the driver; from then on every
//! buffer dropped gives its segment back as soon as it is empty. The allocator's own small
//! state (its backend, streams and spare events) goes when the last anchor does: at each
//! thread's next allocation through any allocator, or when the thread exits.
//!
//! A hit pair moves no reference count at all: a buffer dropped on the thread that allocated it
//! gives its clone of the anchor back to that thread's slot (a few spare clones per anchor),
//! and the thread's next buffer there takes a spare instead of cloning. The spares are clones
//! like any other, dropped with the slot, so they keep the anchor exactly as long as the
//! slot's own reference does.
//!
//! Why not a lifetime (`DeviceBuffer<'alloc, T>`)? It would be free at run time, but a cudarc
//! program keeps its `CudaSlice`s in structs, caches and channels with no lifetime; a buffer
//! that borrows its allocator could not stand in for one. Why not leak the allocator when the
//! program drops it while buffers live? Its cache would never go back. Anchors cost one
//! uncontended reference count per buffer and keep both properties.

use std::cell::RefCell;

use crate::sync::real::{Arc, Ordering};
use cudarc::driver::CudaStream;

use super::CudaAllocator;

/// How many anchors a thread keeps (one per allocator and stream it allocated on lately).
const ANCHORS_PER_THREAD: usize = 4;

/// How many spare clones of one anchor a thread keeps for its next buffers.
const SPARES_PER_ANCHOR: usize = 16;

/// One thread's reference to an allocator and a stream, shared by the buffers it allocated
/// there.
pub(crate) struct Anchor {
    /// The allocator (an internal handle: it keeps the allocator alive, not open).
    pub(crate) alloc: CudaAllocator,
    /// The stream the buffers were allocated on.
    pub(crate) stream: Arc<CudaStream>,
    /// `stream`'s id.
    pub(crate) stream_id: u64,
}

/// The program's share of an allocator: every [`CudaAllocator`] the program holds clones one
/// `Arc<Owner>`; dropping the last closes the allocator.
pub(crate) struct Owner {
    alloc: CudaAllocator,
}

impl Drop for Owner {
    fn drop(&mut self) {
        self.alloc.close();
    }
}

/// One of a thread's anchors, with the spare clones its dropped buffers gave back.
struct Slot {
    anchor: Arc<Anchor>,
    /// Clones of `anchor`, handed to the thread's next buffers there (so that a buffer
    /// allocated and dropped on this thread moves no reference count).
    spares: Vec<Arc<Anchor>>,
}

std::thread_local! {
    /// This thread's anchors, most recently used first.
    static ANCHORS: RefCell<Vec<Slot>> = const { RefCell::new(Vec::new()) };
}

/// A buffer's anchor, back from a buffer dropped on this thread: kept as a spare of this
/// thread's slot for it, if the thread has that slot and room, else dropped (outside the
/// thread's borrow of its anchors: the last anchor of a closed allocator drops its backend,
/// which calls the driver).
#[inline]
pub(crate) fn give_back(anchor: Arc<Anchor>) {
    let left = ANCHORS.try_with(|cell| {
        let Ok(mut slots) = cell.try_borrow_mut() else {
            return Some(anchor);
        };
        match slots.iter_mut().find(|s| Arc::ptr_eq(&s.anchor, &anchor)) {
            Some(slot) if slot.spares.len() < SPARES_PER_ANCHOR => {
                slot.spares.push(anchor);
                None
            }
            _ => Some(anchor),
        }
    });
    drop(left);
}

impl CudaAllocator {
    /// The first handle of a new allocator (`self` is an internal one): it owns the allocator.
    pub(crate) fn open(self) -> CudaAllocator {
        let owner = Arc::new(Owner {
            alloc: self.clone(),
        });
        let _ = self.shared.owner.set(Arc::downgrade(&owner));
        CudaAllocator {
            owner: Some(owner),
            ..self
        }
    }

    /// A handle that keeps the allocator alive but not open (for anchors and owners).
    fn internal(&self) -> CudaAllocator {
        CudaAllocator {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
            owner: None,
        }
    }

    /// A handle for the program, if the program still holds one (then this is a clone of it).
    pub(crate) fn upgrade(&self) -> Option<CudaAllocator> {
        let owner = self.shared.owner.get()?.upgrade()?;
        Some(CudaAllocator {
            owner: Some(owner),
            ..self.internal()
        })
    }

    /// Whether the program has dropped its last handle.
    pub(crate) fn is_closed(&self) -> bool {
        self.shared.closed.load(Ordering::Acquire)
    }

    /// The program dropped its last handle: raw allocations are freed (they live as long as
    /// the allocator), then the cache goes back to the driver. Live buffers keep their memory.
    fn close(&self) {
        self.shared.closed.store(true, Ordering::Release);
        let raw: Vec<u64> = self.raw_set().drain().collect();
        for address in raw {
            let _ = self.free_block(address);
        }
        self.release_cache();
    }

    /// After a buffer is dropped from a closed allocator: gives every empty segment back.
    pub(crate) fn release_cache(&self) {
        // Fails only when the device fails; the segments then stay until the allocator goes.
        let _ = self.empty_cache();
    }

    /// This thread's anchor for `stream` (whose id is `id`) in this allocator, made on first
    /// use. Looking it up and taking a spare clone (or cloning it) touch only this thread's
    /// memory (the anchor's count is this thread's).
    #[inline]
    pub(crate) fn anchor(&self, stream: &Arc<CudaStream>, id: u64) -> Arc<Anchor> {
        let hit = ANCHORS.try_with(|cell| {
            let mut slots = cell.try_borrow_mut().ok()?;
            let i = slots.iter().position(|s| {
                s.anchor.stream_id == id && Arc::ptr_eq(&s.anchor.alloc.shared, &self.shared)
            })?;
            if i > 0 {
                slots[..=i].rotate_right(1);
            }
            let slot = &mut slots[0];
            Some(
                slot.spares
                    .pop()
                    .unwrap_or_else(|| Arc::clone(&slot.anchor)),
            )
        });
        match hit {
            Ok(Some(anchor)) => anchor,
            _ => self.anchor_slow(stream, id),
        }
    }

    /// [`CudaAllocator::anchor`] when this thread has none for `stream` here: a new one,
    /// kept first; the anchors of closed allocators and the least recently used one are
    /// forgotten.
    #[cold]
    fn anchor_slow(&self, stream: &Arc<CudaStream>, id: u64) -> Arc<Anchor> {
        let made = ANCHORS.try_with(|cell| {
            let Ok(mut slots) = cell.try_borrow_mut() else {
                return None;
            };
            // Dropped below, outside the borrow: the last anchor of a closed allocator drops
            // its backend, which calls the driver.
            let mut gone = Vec::new();
            let mut i = 0;
            while i < slots.len() {
                if slots[i].anchor.alloc.is_closed() {
                    gone.push(slots.remove(i));
                } else {
                    i += 1;
                }
            }
            let anchor = Arc::new(self.new_anchor(stream, id));
            slots.insert(
                0,
                Slot {
                    anchor: Arc::clone(&anchor),
                    spares: Vec::with_capacity(SPARES_PER_ANCHOR),
                },
            );
            if slots.len() > ANCHORS_PER_THREAD {
                gone.extend(slots.pop());
            }
            Some((anchor, gone))
        });
        match made {
            Ok(Some((anchor, gone))) => {
                drop(gone);
                anchor
            }
            // The thread's storage is being torn down (or is in use further up the stack): an
            // anchor of the buffer's own.
            _ => Arc::new(self.new_anchor(stream, id)),
        }
    }

    fn new_anchor(&self, stream: &Arc<CudaStream>, id: u64) -> Anchor {
        Anchor {
            alloc: self.internal(),
            stream: Arc::clone(stream),
            stream_id: id,
        }
    }
}

//! The untyped memory users hold: [`DeviceBlock`], an owned allocation that goes back to the
//! cache when dropped — the block under every [`DeviceBuffer`](super::DeviceBuffer) and every
//! view.
//!
//! The one rule: a block keeps both halves of cudarc's stream contract on every use it can
//! see. *Reuse*: a use on a stream other than its own is recorded, so the allocator never
//! hands its memory out while that stream may still touch it. *Data*: a stream that uses it
//! first waits for its last write, and one that writes it for its last reads, on any stream
//! ([`super::ordering`]). cudarc reveals the stream to [`DevicePtr::device_ptr`] and
//! [`DevicePtrMut::device_ptr_mut`], so copies, memsets, cuBLAS and anything else built on
//! those traits are covered; a kernel launch is covered through [`Launch`](super::Launch)
//! (cudarc's `LaunchArgs` keeps its stream to itself: a block pushed straight into it is a
//! raw address, see [`DeviceBlock`]). Uses on the block's own stream cost nothing. Buffers and
//! views are their block, typed or narrowed: every use of theirs is the block's `use_on`.

use crate::sync::real::{Arc, AtomicU64, OnceLock, Ordering};

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};

use super::CudaAllocator;
use super::anchor::Anchor;
use super::error::CudaError;
use super::ordering::{Access, Tracking};
use super::streams::stream_id;

/// No stream recorded yet.
const NO_STREAM: u64 = u64::MAX;

/// An owned allocation of device memory from a [`CudaAllocator`]: returned to the allocator's
/// cache when dropped, and reused from there by later allocations on the same stream.
///
/// It works with cudarc like a `CudaSlice<u8>`: `stream.memcpy_htod(&bytes, &mut block)`,
/// `stream.memcpy_dtoh(&block, &mut bytes)`, `stream.memset_zeros(&mut block)`, and as a kernel
/// argument (its device address). The memory's contents are unspecified when allocated (they
/// may hold a previous buffer's data).
///
/// **Streams.** The block belongs to the stream it was allocated on. Using it on another
/// stream through [`DevicePtr`]/[`DevicePtrMut`] (every cudarc copy, memset and cuBLAS call)
/// or [`Launch`](super::Launch) is ordered after its last write (and, to write, its last
/// reads) wherever they ran, and recorded, so that when the block is dropped its memory is not
/// reused until the work queued on that stream by then has completed.
///
/// **The raw hazard.** A block pushed straight into cudarc's `LaunchArgs`
/// (`stream.launch_builder(&f).arg(&block)`) is passed as a bare address: cudarc does not tell
/// cachalot the launch stream, so nothing is ordered or recorded. On the block's own stream
/// that is all fine. On another stream, use [`Launch`](super::Launch) instead — or join the
/// streams yourself *and* call [`DeviceBlock::record_stream`] before the block is dropped, or
/// its memory may be handed out again while the kernel still runs.
///
/// ```no_run
/// use cachalot::cuda::CudaAllocator;
///
/// let alloc = CudaAllocator::for_device(0)?;
/// let stream = alloc.context().new_stream()?;
/// let mut block = alloc.alloc(1024, &stream)?;
/// stream.memcpy_htod(&[7u8; 1024], &mut block)?;
/// let back = stream.clone_dtoh(&block)?;
/// assert_eq!(back, vec![7u8; 1024]);
/// drop(block); // back to the cache, not to the driver
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct DeviceBlock {
    /// The allocator and the stream, through this thread's anchor (see `anchor`). `None` only
    /// while the block is being dropped (its anchor goes back to the thread's spares).
    anchor: Option<Arc<Anchor>>,
    address: CUdeviceptr,
    bytes: usize,
    /// The stream whose use was recorded last with the allocator, to skip recording it again.
    last_use: AtomicU64,
    /// Data ordering, made at the first use on another stream.
    tracking: OnceLock<Box<Tracking>>,
}

impl std::fmt::Debug for DeviceBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBlock")
            .field("address", &format_args!("{:#x}", self.address))
            .field("bytes", &self.bytes)
            .field("stream", &self.anchor().stream_id)
            .finish()
    }
}

impl DeviceBlock {
    pub(crate) fn new(anchor: Arc<Anchor>, address: u64, bytes: usize) -> Self {
        DeviceBlock {
            anchor: Some(anchor),
            address,
            bytes,
            last_use: AtomicU64::new(NO_STREAM),
            tracking: OnceLock::new(),
        }
    }

    /// The allocator and the stream.
    #[inline]
    fn anchor(&self) -> &Anchor {
        self.anchor
            .as_deref()
            .expect("a block has its anchor until it is dropped")
    }

    /// The block's size in bytes, as asked for (the allocator may have reserved more).
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Whether the block is empty (a zero-byte allocation, whose address is 0).
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// The device address (`CUdeviceptr`).
    pub fn address(&self) -> u64 {
        self.address
    }

    /// The stream the block was allocated on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.anchor().stream
    }

    /// A handle to the allocator it came from, while the program still holds one (`None`
    /// once the program dropped its last handle: the allocator then lives on only for its
    /// remaining buffers, and gives their memory back as they are dropped).
    pub fn allocator(&self) -> Option<CudaAllocator> {
        self.anchor().alloc.upgrade()
    }

    /// Driver calls made so far to order this block's data between streams (event records and
    /// waits). Zero for a block used on its own stream only: that path makes none.
    pub fn ordering_calls(&self) -> u64 {
        self.tracking.get().map_or(0, |t| t.calls())
    }

    /// Marks the block as used on `stream`, as PyTorch's `Tensor.record_stream` does: when the
    /// block is dropped, its memory is not reused until the work queued on `stream` by then
    /// has completed. The allocator keeps `stream` alive until then.
    ///
    /// Copies and [`Launch`](super::Launch) do this automatically; call it for uses cachalot
    /// cannot see, such as a raw launch through cudarc's `LaunchArgs` on another stream.
    /// Recording the block's own stream, or an empty block, does nothing.
    pub fn record_stream(&self, stream: &Arc<CudaStream>) -> Result<(), CudaError> {
        if self.address == 0
            || (stream_id(stream).0 == self.anchor().stream_id && self.same_context(stream))
        {
            return Ok(());
        }
        self.anchor().alloc.record_raw_stream(self.address, stream)
    }

    pub(crate) fn address_ref(&self) -> &u64 {
        &self.address
    }

    fn same_context(&self, stream: &CudaStream) -> bool {
        stream.context().cu_ctx() == self.anchor().stream.context().cu_ctx()
    }

    fn tracking(&self) -> &Tracking {
        self.tracking.get_or_init(|| Box::new(Tracking::new()))
    }

    /// A use of the block on `stream`, about to be queued: orders it after the uses it
    /// depends on and records it with the allocator if `stream` is another stream; the
    /// returned guard, dropped once the use is queued, finishes the job (cudarc's contract).
    pub(crate) fn use_on<'a>(&'a self, stream: &'a CudaStream, access: Access) -> SyncOnDrop<'a> {
        if self.address == 0 {
            return SyncOnDrop::Record(None);
        }
        let alloc = &self.anchor().alloc;
        let id = stream_id(stream).0;
        if id == self.anchor().stream_id && self.same_context(stream) {
            // The owner's stream: nothing to do unless another stream used the block.
            if let Some(t) = self.tracking.get()
                && alloc.data_ordering()
            {
                t.owner_use(&self.anchor().stream, access);
            }
            return SyncOnDrop::Record(None);
        }
        if !self.same_context(stream) {
            // Another device's stream: no event of this device can order or track it. The
            // host waits for this block's work first, and for the use after it is queued.
            if alloc.data_ordering() {
                self.tracking().other_device_use(&self.anchor().stream);
            }
            return SyncOnDrop::Sync(Some(stream));
        }
        let guard = if alloc.data_ordering() {
            self.tracking()
                .foreign_use(&self.anchor().stream, stream, access)
        } else {
            SyncOnDrop::Record(None)
        };
        if self.last_use.load(Ordering::Relaxed) == id || !alloc.auto_record_stream() {
            return guard;
        }
        if alloc.record_use(self.address, stream).is_ok() {
            self.last_use.store(id, Ordering::Relaxed);
            guard
        } else {
            // Could not record (the device failed): make the use complete before going on.
            drop(guard);
            SyncOnDrop::Sync(Some(stream))
        }
    }
}

impl Drop for DeviceBlock {
    fn drop(&mut self) {
        let Some(anchor) = self.anchor.take() else {
            return;
        };
        let alloc = &anchor.alloc;
        // Freeing a live block fails only if the device fails while recording events; the
        // block then stays allocated until the allocator itself is dropped.
        alloc.drop_block(self.address);
        // The program dropped the allocator: what this block leaves empty goes back now
        // (checked after the free, so a concurrent close either sees this block or is seen),
        // and its anchor goes with the block. Otherwise the anchor goes back to this thread's
        // spares, for its next buffer (no reference count moved).
        if alloc.is_closed() {
            alloc.release_cache();
        } else {
            super::anchor::give_back(anchor);
        }
    }
}

impl DeviceSlice<u8> for DeviceBlock {
    fn len(&self) -> usize {
        self.bytes
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.anchor().stream
    }
}

impl DevicePtr<u8> for DeviceBlock {
    /// The device address; `stream` is ordered after the block's last write and the use is
    /// recorded (see [`DeviceBlock`]).
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.address, self.use_on(stream, Access::Read))
    }
}

impl DevicePtrMut<u8> for DeviceBlock {
    /// The device address; `stream` is ordered after the block's last uses and the write is
    /// recorded (see [`DeviceBlock`]).
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.address, self.use_on(stream, Access::Write))
    }
}

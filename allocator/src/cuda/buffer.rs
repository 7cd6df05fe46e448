//! The memory users hold: [`DeviceBlock`] (bytes) and [`DeviceBuffer<T>`] (typed), each an owned
//! allocation that goes back to the cache when dropped.
//!
//! The one rule: a buffer keeps both halves of cudarc's stream contract on every use it can
//! see. *Reuse*: a use on a stream other than its own is recorded, so the allocator never
//! hands its memory out while that stream may still touch it. *Data*: a stream that uses it
//! first waits for its last write, and one that writes it for its last reads, on any stream
//! ([`super::ordering`]). cudarc reveals the stream to [`DevicePtr::device_ptr`] and
//! [`DevicePtrMut::device_ptr_mut`], so copies, memsets, cuBLAS and anything else built on
//! those traits are covered; a kernel launch is covered through [`Launch`](super::Launch)
//! (cudarc's `LaunchArgs` keeps its stream to itself: a buffer pushed straight into it is a
//! raw address, see [`DeviceBuffer`]). Uses on the buffer's own stream cost nothing.

use crate::sync::real::{Arc, AtomicU64, OnceLock, Ordering};
use std::marker::PhantomData;
use std::ops::RangeBounds;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice, SyncOnDrop};

use super::CudaAllocator;
use super::anchor::Anchor;
use super::error::CudaError;
use super::ordering::{Access, Tracking};
use super::streams::stream_id;
use super::view::{DeviceView, DeviceViewMut, offset, to_range};

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
    /// The allocator and the stream, through this thread's anchor (see `anchor`).
    anchor: Arc<Anchor>,
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
            .field("stream", &self.anchor.stream_id)
            .finish()
    }
}

impl DeviceBlock {
    pub(crate) fn new(anchor: Arc<Anchor>, address: u64, bytes: usize) -> Self {
        DeviceBlock {
            anchor,
            address,
            bytes,
            last_use: AtomicU64::new(NO_STREAM),
            tracking: OnceLock::new(),
        }
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
        &self.anchor.stream
    }

    /// A handle to the allocator it came from, while the program still holds one (`None`
    /// once the program dropped its last handle: the allocator then lives on only for its
    /// remaining buffers, and gives their memory back as they are dropped).
    pub fn allocator(&self) -> Option<CudaAllocator> {
        self.anchor.alloc.upgrade()
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
            || (stream_id(stream).0 == self.anchor.stream_id && self.same_context(stream))
        {
            return Ok(());
        }
        self.anchor.alloc.record_raw_stream(self.address, stream)
    }

    pub(crate) fn address_ref(&self) -> &u64 {
        &self.address
    }

    fn same_context(&self, stream: &CudaStream) -> bool {
        stream.context().cu_ctx() == self.anchor.stream.context().cu_ctx()
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
        let alloc = &self.anchor.alloc;
        let id = stream_id(stream).0;
        if id == self.anchor.stream_id && self.same_context(stream) {
            // The owner's stream: nothing to do unless another stream used the block.
            if let Some(t) = self.tracking.get()
                && alloc.data_ordering()
            {
                t.owner_use(&self.anchor.stream, access);
            }
            return SyncOnDrop::Record(None);
        }
        if !self.same_context(stream) {
            // Another device's stream: no event of this device can order or track it. The
            // host waits for this block's work first, and for the use after it is queued.
            if alloc.data_ordering() {
                self.tracking().other_device_use(&self.anchor.stream);
            }
            return SyncOnDrop::Sync(Some(stream));
        }
        let guard = if alloc.data_ordering() {
            self.tracking()
                .foreign_use(&self.anchor.stream, stream, access)
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
        let alloc = &self.anchor.alloc;
        // Freeing a live block fails only if the device fails while recording events; the
        // block then stays allocated until the allocator itself is dropped.
        let _ = alloc.free_block(self.address);
        // The program dropped the allocator: what this block leaves empty goes back now
        // (checked after the free, so a concurrent close either sees this block or is seen).
        if alloc.is_closed() {
            alloc.release_cache();
        }
    }
}

impl DeviceSlice<u8> for DeviceBlock {
    fn len(&self) -> usize {
        self.bytes
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.anchor.stream
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

mod sealed {
    pub trait Sealed {}
}

/// Types every bit pattern of which is a valid value (integers, floats, arrays of them), so a
/// buffer of them may be allocated without initialising it ([`CudaAllocator::alloc_buffer`]).
///
/// Sealed: implemented by cachalot for the primitive number types, `half::f16` and
/// `half::bf16` with the `f16` feature, and arrays of them.
pub trait Plain: DeviceRepr + sealed::Sealed {}

macro_rules! plain {
    ($($t:ty),*) => {$(
        impl sealed::Sealed for $t {}
        impl Plain for $t {}
    )*};
}
plain!(
    u8, u16, u32, u64, u128, usize, i8, i16, i32, i64, i128, isize, f32, f64
);
#[cfg(feature = "f16")]
plain!(half::f16, half::bf16);
impl<T: Plain, const N: usize> sealed::Sealed for [T; N] {}
impl<T: Plain, const N: usize> Plain for [T; N] {}

/// A typed owned allocation: `len` values of `T` in device memory from a [`CudaAllocator`],
/// returned to the cache when dropped.
///
/// It stands in for cudarc's `CudaSlice<T>`: it implements [`DeviceSlice`], [`DevicePtr`],
/// [`DevicePtrMut`] and cudarc's `PushKernelArg`, so `stream.memcpy_htod`, `memcpy_dtoh`,
/// `clone_dtoh`, `memset_zeros`, cuBLAS calls and kernel launches take it; its parts are
/// views ([`DeviceBuffer::slice`], [`DeviceBuffer::slice_mut`],
/// [`DeviceBuffer::split_at_mut`], [`DeviceBuffer::transmute`]) that do the same.
///
/// **Streams**, as for [`DeviceBlock`]: a use on another stream than the buffer's own,
/// through any of those or through [`Launch`](super::Launch), waits for the buffer's last
/// write (and, to write, its last reads) and is recorded, so the buffer's memory is not reused
/// before that stream is done with it. Uses on its own stream cost nothing.
///
/// **The raw hazard**: pushed straight into cudarc's `LaunchArgs`
/// (`stream.launch_builder(&f).arg(&buf)`), a buffer is a bare address — cudarc does not say
/// which stream the kernel runs on, so on another stream than the buffer's nothing orders or
/// records that kernel: use [`Launch`](super::Launch), or `join` the streams and call
/// [`DeviceBuffer::record_stream`] yourself.
///
/// ```no_run
/// use cachalot::cuda::CudaAllocator;
///
/// let alloc = CudaAllocator::for_device(0)?;
/// let (a, b) = (alloc.context().new_stream()?, alloc.context().new_stream()?);
/// let host: Vec<f32> = (0..1000).map(|i| i as f32).collect();
/// let buf = alloc.clone_htod(&host, &a)?; // written on `a`
/// assert_eq!(b.clone_dtoh(&buf)?, host); // read on `b`: waits for the copy on `a`
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct DeviceBuffer<T> {
    block: DeviceBlock,
    len: usize,
    marker: PhantomData<fn() -> T>,
}

impl<T> std::fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("type", &std::any::type_name::<T>())
            .field("len", &self.len)
            .field("block", &self.block)
            .finish()
    }
}

impl<T> DeviceBuffer<T> {
    pub(crate) fn from_block(block: DeviceBlock, len: usize) -> Self {
        DeviceBuffer {
            block,
            len,
            marker: PhantomData,
        }
    }

    /// The number of values.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no value.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The size in bytes: `len() * size_of::<T>()`.
    pub fn num_bytes(&self) -> usize {
        self.block.len()
    }

    /// The device address of the first value (`CUdeviceptr`).
    pub fn address(&self) -> u64 {
        self.block.address()
    }

    /// The stream the buffer was allocated on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        self.block.stream()
    }

    /// A handle to the allocator it came from, while the program holds one; see
    /// [`DeviceBlock::allocator`].
    pub fn allocator(&self) -> Option<CudaAllocator> {
        self.block.allocator()
    }

    /// The untyped block underneath.
    pub fn block(&self) -> &DeviceBlock {
        &self.block
    }

    /// Marks the buffer as used on `stream`; see [`DeviceBlock::record_stream`].
    pub fn record_stream(&self, stream: &Arc<CudaStream>) -> Result<(), CudaError> {
        self.block.record_stream(stream)
    }

    /// Driver calls made so far to order this buffer's data between streams; see
    /// [`DeviceBlock::ordering_calls`].
    pub fn ordering_calls(&self) -> u64 {
        self.block.ordering_calls()
    }

    /// The whole buffer as a read-only view.
    pub fn as_view(&self) -> DeviceView<'_, T> {
        DeviceView::new(&self.block, self.block.address, self.len)
    }

    /// The whole buffer as a writable view.
    pub fn as_view_mut(&mut self) -> DeviceViewMut<'_, T> {
        DeviceViewMut::new(&self.block, self.block.address, self.len)
    }

    /// A read-only view of the values in `range`, usable wherever the buffer is (copies,
    /// cuBLAS, kernel arguments, [`Launch`](super::Launch)).
    ///
    /// # Panics
    ///
    /// If `range` is not within `0..len()`, as slicing a Rust slice does; see
    /// [`DeviceBuffer::try_slice`].
    pub fn slice(&self, range: impl RangeBounds<usize>) -> DeviceView<'_, T> {
        let len = self.len;
        self.try_slice(range)
            .unwrap_or_else(|| panic!("view range out of bounds of a buffer of {len} values"))
    }

    /// A read-only view of the values in `range`, or `None` if `range` is not within
    /// `0..len()`.
    pub fn try_slice(&self, range: impl RangeBounds<usize>) -> Option<DeviceView<'_, T>> {
        self.as_view().try_slice(range)
    }

    /// A writable view of the values in `range`.
    ///
    /// # Panics
    ///
    /// If `range` is not within `0..len()`; see [`DeviceBuffer::try_slice_mut`].
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> DeviceViewMut<'_, T> {
        let len = self.len;
        self.try_slice_mut(range)
            .unwrap_or_else(|| panic!("view range out of bounds of a buffer of {len} values"))
    }

    /// A writable view of the values in `range`, or `None` if `range` is not within
    /// `0..len()`.
    pub fn try_slice_mut(
        &mut self,
        range: impl RangeBounds<usize>,
    ) -> Option<DeviceViewMut<'_, T>> {
        let (start, end) = to_range(range, self.len)?;
        Some(DeviceViewMut::new(
            &self.block,
            offset::<T>(self.block.address, start),
            end - start,
        ))
    }

    /// Two read-only views: values `0..mid` and `mid..len()`.
    ///
    /// # Panics
    ///
    /// If `mid > len()`; see [`DeviceBuffer::try_split_at`].
    pub fn split_at(&self, mid: usize) -> (DeviceView<'_, T>, DeviceView<'_, T>) {
        self.as_view().split_at(mid)
    }

    /// Two read-only views at `mid`, or `None` if `mid > len()`.
    pub fn try_split_at(&self, mid: usize) -> Option<(DeviceView<'_, T>, DeviceView<'_, T>)> {
        self.as_view().try_split_at(mid)
    }

    /// Two writable views that do not overlap: values `0..mid` and `mid..len()`, for handing
    /// the parts of one buffer to different kernels, streams or cuBLAS calls.
    ///
    /// # Panics
    ///
    /// If `mid > len()`; see [`DeviceBuffer::try_split_at_mut`].
    pub fn split_at_mut(&mut self, mid: usize) -> (DeviceViewMut<'_, T>, DeviceViewMut<'_, T>) {
        let len = self.len;
        self.try_split_at_mut(mid)
            .unwrap_or_else(|| panic!("split at {mid} out of bounds of a buffer of {len} values"))
    }

    /// Two writable views at `mid`, or `None` if `mid > len()`.
    pub fn try_split_at_mut(
        &mut self,
        mid: usize,
    ) -> Option<(DeviceViewMut<'_, T>, DeviceViewMut<'_, T>)> {
        self.as_view_mut().into_split_at_mut(mid)
    }

    /// The buffer's memory read as `len` values of `U`: `None` if they need more bytes than
    /// the buffer has, or if the address is not aligned for `U`.
    ///
    /// # Safety
    ///
    /// The bytes must be valid values of `U` wherever the view is read as `U` (on the host
    /// after a copy, or by a kernel), as for [`std::mem::transmute`].
    pub unsafe fn transmute<U>(&self, len: usize) -> Option<DeviceView<'_, U>> {
        // SAFETY: passed on to the caller.
        unsafe { self.as_view().transmute(len) }
    }

    /// The buffer's memory as `len` writable values of `U`: `None` if they need more bytes
    /// than the buffer has, or if the address is not aligned for `U`.
    ///
    /// # Safety
    ///
    /// As for [`DeviceBuffer::transmute`]; and values written as `U` must be valid `T`s where
    /// the buffer is read as `T` again.
    pub unsafe fn transmute_mut<U>(&mut self, len: usize) -> Option<DeviceViewMut<'_, U>> {
        // SAFETY: passed on to the caller.
        unsafe { self.as_view_mut().into_transmute(len) }
    }
}

impl<T> DeviceSlice<T> for DeviceBuffer<T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.block.stream()
    }
}

impl<T> DevicePtr<T> for DeviceBuffer<T> {
    /// The device address; `stream` is ordered after the buffer's last write and the use is
    /// recorded (see [`DeviceBuffer`]).
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.block.address, self.block.use_on(stream, Access::Read))
    }
}

impl<T> DevicePtrMut<T> for DeviceBuffer<T> {
    /// The device address; `stream` is ordered after the buffer's last uses and the write is
    /// recorded (see [`DeviceBuffer`]).
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.block.address, self.block.use_on(stream, Access::Write))
    }
}

//! Typed memory: [`DeviceBuffer<T>`], an owned allocation of `len` values of `T` that goes
//! back to the cache when dropped, and [`Plain`], the types a buffer may hold uninitialised.
//!
//! The one rule: a buffer is its [`DeviceBlock`], typed. Every use of a buffer, or of a view
//! of it, is a use of that block (its `use_on`), so it keeps cudarc's stream
//! contract exactly as the block does (see [`super::block`]).

use crate::sync::real::Arc;
use std::marker::PhantomData;
use std::ops::RangeBounds;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice, SyncOnDrop};

use super::CudaAllocator;
use super::block::DeviceBlock;
use super::error::CudaError;
use super::ordering::Access;
use super::view::{DeviceView, DeviceViewMut, offset, to_range};

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
        DeviceView::new(&self.block, self.block.address(), self.len)
    }

    /// The whole buffer as a writable view.
    pub fn as_view_mut(&mut self) -> DeviceViewMut<'_, T> {
        DeviceViewMut::new(&self.block, self.block.address(), self.len)
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
            offset::<T>(self.block.address(), start),
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
        (
            self.block.address(),
            self.block.use_on(stream, Access::Read),
        )
    }
}

impl<T> DevicePtrMut<T> for DeviceBuffer<T> {
    /// The device address; `stream` is ordered after the buffer's last uses and the write is
    /// recorded (see [`DeviceBuffer`]).
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (
            self.block.address(),
            self.block.use_on(stream, Access::Write),
        )
    }
}

//! Views: parts of a [`DeviceBuffer`](super::DeviceBuffer), borrowed, for handing a buffer in
//! pieces to cuBLAS, a kernel or a copy — cudarc's `CudaView` and `CudaViewMut` for cachalot's
//! buffers.
//!
//! The one rule: a view is its buffer, narrowed. It borrows the buffer's block, so every use
//! through it is ordered and recorded exactly as a use of the whole buffer (the block's stream
//! state is the buffer's, not the view's), and the borrow checker keeps the buffer alive, and
//! its writable views disjoint, for as long as the view lives.

use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};

use super::block::DeviceBlock;
use super::ordering::Access;
use crate::sync::real::Arc;

/// `start..end` from `range` over `0..len`, if it lies within it.
pub(crate) fn to_range(range: impl RangeBounds<usize>, len: usize) -> Option<(usize, usize)> {
    let start = match range.start_bound() {
        Bound::Included(&n) => n,
        Bound::Excluded(&n) => n.checked_add(1)?,
        Bound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        Bound::Included(&n) => n.checked_add(1)?,
        Bound::Excluded(&n) => n,
        Bound::Unbounded => len,
    };
    (start <= end && end <= len).then_some((start, end))
}

/// The address `offset` values of `T` after `base`.
pub(super) fn offset<T>(base: u64, offset: usize) -> u64 {
    base + (offset * std::mem::size_of::<T>()) as u64
}

/// `len` values of `U` from `address`, if they fit in `bytes` and `address` is aligned for `U`.
fn fits<U>(address: u64, bytes: usize, len: usize) -> bool {
    len.checked_mul(std::mem::size_of::<U>())
        .is_some_and(|need| need <= bytes)
        && address.is_multiple_of(std::mem::align_of::<U>() as u64)
}

/// A read-only part of a [`DeviceBuffer`](super::DeviceBuffer): `&[T]` in device memory, as
/// cudarc's `CudaView`.
///
/// It implements [`DeviceSlice`] and [`DevicePtr`] (so cudarc's copies and cuBLAS read it),
/// cudarc's `PushKernelArg` (a bare address, see the raw hazard on
/// [`DeviceBuffer`](super::DeviceBuffer)) and [`KernelArg`](super::KernelArg) for
/// [`Launch`](super::Launch). Uses on another stream than the buffer's are ordered and
/// recorded as the buffer's.
///
/// ```no_run
/// use cachalot::cuda::CudaAllocator;
///
/// let alloc = CudaAllocator::for_device(0)?;
/// let stream = alloc.context().new_stream()?;
/// let buf = alloc.clone_htod(&[1u32, 2, 3, 4, 5], &stream)?;
/// assert_eq!(stream.clone_dtoh(&buf.slice(1..4))?, [2, 3, 4]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct DeviceView<'a, T> {
    block: &'a DeviceBlock,
    address: CUdeviceptr,
    len: usize,
    marker: PhantomData<&'a [T]>,
}

/// A writable part of a [`DeviceBuffer`](super::DeviceBuffer): `&mut [T]` in device memory,
/// as cudarc's `CudaViewMut`. Two writable views of one buffer never overlap
/// ([`DeviceBuffer::split_at_mut`](super::DeviceBuffer::split_at_mut)).
///
/// It implements [`DeviceSlice`], [`DevicePtr`] and [`DevicePtrMut`] (cudarc's copies,
/// memsets and cuBLAS write it), cudarc's `PushKernelArg` and
/// [`KernelArg`](super::KernelArg).
///
/// ```no_run
/// use cachalot::cuda::CudaAllocator;
///
/// let alloc = CudaAllocator::for_device(0)?;
/// let stream = alloc.context().new_stream()?;
/// let mut buf = alloc.alloc_zeros::<u32>(6, &stream)?;
/// let (mut left, mut right) = buf.split_at_mut(3);
/// stream.memcpy_htod(&[1u32, 1, 1], &mut left)?;
/// stream.memcpy_htod(&[2u32, 2, 2], &mut right)?;
/// assert_eq!(stream.clone_dtoh(&buf)?, [1, 1, 1, 2, 2, 2]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct DeviceViewMut<'a, T> {
    block: &'a DeviceBlock,
    address: CUdeviceptr,
    len: usize,
    marker: PhantomData<&'a mut [T]>,
}

macro_rules! view_common {
    ($view:ident) => {
        impl<T> std::fmt::Debug for $view<'_, T> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($view))
                    .field("type", &std::any::type_name::<T>())
                    .field("address", &format_args!("{:#x}", self.address))
                    .field("len", &self.len)
                    .finish()
            }
        }

        impl<'a, T> $view<'a, T> {
            pub(crate) fn new(block: &'a DeviceBlock, address: u64, len: usize) -> Self {
                $view {
                    block,
                    address,
                    len,
                    marker: PhantomData,
                }
            }

            /// The number of values.
            pub fn len(&self) -> usize {
                self.len
            }

            /// Whether the view holds no value.
            pub fn is_empty(&self) -> bool {
                self.len == 0
            }

            /// The size in bytes: `len() * size_of::<T>()`.
            pub fn num_bytes(&self) -> usize {
                self.len * std::mem::size_of::<T>()
            }

            /// The device address of the view's first value.
            pub fn address(&self) -> u64 {
                self.address
            }

            /// The stream of the buffer the view is part of.
            pub fn stream(&self) -> &Arc<CudaStream> {
                self.block.stream()
            }

            /// The block of the buffer the view is part of.
            pub fn block(&self) -> &DeviceBlock {
                self.block
            }
        }

        impl<T> DeviceSlice<T> for $view<'_, T> {
            fn len(&self) -> usize {
                self.len
            }
            fn stream(&self) -> &Arc<CudaStream> {
                self.block.stream()
            }
        }

        impl<T> DevicePtr<T> for $view<'_, T> {
            /// The view's device address; `stream` is ordered after the buffer's last write
            /// and the use is recorded, as for the whole buffer.
            fn device_ptr<'b>(&'b self, stream: &'b CudaStream) -> (CUdeviceptr, SyncOnDrop<'b>) {
                (self.address, self.block.use_on(stream, Access::Read))
            }
        }
    };
}

view_common!(DeviceView);
view_common!(DeviceViewMut);

impl<'a, T> DeviceView<'a, T> {
    /// A read-only view of the values in `range` of this view.
    ///
    /// # Panics
    ///
    /// If `range` is not within `0..len()`; see [`DeviceView::try_slice`].
    pub fn slice(&self, range: impl RangeBounds<usize>) -> DeviceView<'a, T> {
        let len = self.len;
        self.try_slice(range)
            .unwrap_or_else(|| panic!("view range out of bounds of a view of {len} values"))
    }

    /// A read-only view of the values in `range` of this view, or `None` if `range` is not
    /// within `0..len()`.
    pub fn try_slice(&self, range: impl RangeBounds<usize>) -> Option<DeviceView<'a, T>> {
        let (start, end) = to_range(range, self.len)?;
        Some(DeviceView::new(
            self.block,
            offset::<T>(self.address, start),
            end - start,
        ))
    }

    /// Two read-only views: values `0..mid` and `mid..len()` of this view.
    ///
    /// # Panics
    ///
    /// If `mid > len()`; see [`DeviceView::try_split_at`].
    pub fn split_at(&self, mid: usize) -> (DeviceView<'a, T>, DeviceView<'a, T>) {
        let len = self.len;
        self.try_split_at(mid)
            .unwrap_or_else(|| panic!("split at {mid} out of bounds of a view of {len} values"))
    }

    /// Two read-only views at `mid`, or `None` if `mid > len()`.
    pub fn try_split_at(&self, mid: usize) -> Option<(DeviceView<'a, T>, DeviceView<'a, T>)> {
        (mid <= self.len).then(|| {
            (
                DeviceView::new(self.block, self.address, mid),
                DeviceView::new(self.block, offset::<T>(self.address, mid), self.len - mid),
            )
        })
    }

    /// This view's memory read as `len` values of `U`: `None` if they need more bytes than
    /// the view has, or if its address is not aligned for `U`.
    ///
    /// # Safety
    ///
    /// The bytes must be valid values of `U` wherever they are read as `U`.
    pub unsafe fn transmute<U>(&self, len: usize) -> Option<DeviceView<'a, U>> {
        fits::<U>(self.address, self.num_bytes(), len)
            .then(|| DeviceView::new(self.block, self.address, len))
    }
}

impl<'a, T> DeviceViewMut<'a, T> {
    /// This view, read-only, for as long as it is borrowed.
    pub fn as_view(&self) -> DeviceView<'_, T> {
        DeviceView::new(self.block, self.address, self.len)
    }

    /// A read-only view of the values in `range` of this view.
    ///
    /// # Panics
    ///
    /// If `range` is not within `0..len()`; see [`DeviceViewMut::try_slice`].
    pub fn slice(&self, range: impl RangeBounds<usize>) -> DeviceView<'_, T> {
        self.as_view().slice(range)
    }

    /// A read-only view of the values in `range` of this view, or `None` if `range` is not
    /// within `0..len()`.
    pub fn try_slice(&self, range: impl RangeBounds<usize>) -> Option<DeviceView<'_, T>> {
        self.as_view().try_slice(range)
    }

    /// This view, read-only, for the rest of its life.
    pub fn into_view(self) -> DeviceView<'a, T> {
        DeviceView::new(self.block, self.address, self.len)
    }

    /// A writable view of the values in `range` of this view.
    ///
    /// # Panics
    ///
    /// If `range` is not within `0..len()`; see [`DeviceViewMut::try_slice_mut`].
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> DeviceViewMut<'_, T> {
        let len = self.len;
        self.try_slice_mut(range)
            .unwrap_or_else(|| panic!("view range out of bounds of a view of {len} values"))
    }

    /// A writable view of the values in `range` of this view, or `None` if `range` is not
    /// within `0..len()`.
    pub fn try_slice_mut(
        &mut self,
        range: impl RangeBounds<usize>,
    ) -> Option<DeviceViewMut<'_, T>> {
        let (start, end) = to_range(range, self.len)?;
        Some(DeviceViewMut::new(
            self.block,
            offset::<T>(self.address, start),
            end - start,
        ))
    }

    /// Two writable views that do not overlap: values `0..mid` and `mid..len()` of this view.
    ///
    /// # Panics
    ///
    /// If `mid > len()`; see [`DeviceViewMut::try_split_at_mut`].
    pub fn split_at_mut(&mut self, mid: usize) -> (DeviceViewMut<'_, T>, DeviceViewMut<'_, T>) {
        let len = self.len;
        self.try_split_at_mut(mid)
            .unwrap_or_else(|| panic!("split at {mid} out of bounds of a view of {len} values"))
    }

    /// Two writable views at `mid`, or `None` if `mid > len()`.
    pub fn try_split_at_mut(
        &mut self,
        mid: usize,
    ) -> Option<(DeviceViewMut<'_, T>, DeviceViewMut<'_, T>)> {
        (mid <= self.len).then(|| {
            (
                DeviceViewMut::new(self.block, self.address, mid),
                DeviceViewMut::new(self.block, offset::<T>(self.address, mid), self.len - mid),
            )
        })
    }

    /// [`DeviceViewMut::try_split_at_mut`], consuming the view (its parts keep its lifetime).
    pub(crate) fn into_split_at_mut(
        self,
        mid: usize,
    ) -> Option<(DeviceViewMut<'a, T>, DeviceViewMut<'a, T>)> {
        (mid <= self.len).then(|| {
            (
                DeviceViewMut::new(self.block, self.address, mid),
                DeviceViewMut::new(self.block, offset::<T>(self.address, mid), self.len - mid),
            )
        })
    }

    /// This view's memory as `len` writable values of `U`: `None` if they need more bytes
    /// than the view has, or if its address is not aligned for `U`.
    ///
    /// # Safety
    ///
    /// The bytes must be valid values of `U` wherever they are read as `U`, and values
    /// written as `U` valid `T`s wherever they are read as `T` again.
    pub unsafe fn transmute_mut<U>(&mut self, len: usize) -> Option<DeviceViewMut<'_, U>> {
        fits::<U>(self.address, self.num_bytes(), len)
            .then(|| DeviceViewMut::new(self.block, self.address, len))
    }

    /// [`DeviceViewMut::transmute_mut`], consuming the view.
    ///
    /// # Safety
    ///
    /// As for [`DeviceViewMut::transmute_mut`].
    pub(crate) unsafe fn into_transmute<U>(self, len: usize) -> Option<DeviceViewMut<'a, U>> {
        fits::<U>(self.address, self.num_bytes(), len)
            .then(|| DeviceViewMut::new(self.block, self.address, len))
    }
}

impl<T> DevicePtrMut<T> for DeviceViewMut<'_, T> {
    /// The view's device address; `stream` is ordered after the buffer's last uses and the
    /// write is recorded, as for the whole buffer.
    fn device_ptr_mut<'b>(&'b mut self, stream: &'b CudaStream) -> (CUdeviceptr, SyncOnDrop<'b>) {
        (self.address, self.block.use_on(stream, Access::Write))
    }
}

// Crate-internal access for the kernel-argument impls (`backend`, `launch`).
impl<'a, T> DeviceView<'a, T> {
    pub(crate) fn address_ref(&self) -> &u64 {
        &self.address
    }
    pub(crate) fn block_ref(&self) -> &'a DeviceBlock {
        self.block
    }
}

impl<'a, T> DeviceViewMut<'a, T> {
    pub(crate) fn address_ref(&self) -> &u64 {
        &self.address
    }
    pub(crate) fn block_ref(&self) -> &'a DeviceBlock {
        self.block
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_within_the_length_are_kept_and_others_refused() {
        assert_eq!(to_range(.., 10), Some((0, 10)));
        assert_eq!(to_range(2..5, 10), Some((2, 5)));
        assert_eq!(to_range(2..=5, 10), Some((2, 6)));
        assert_eq!(to_range(10.., 10), Some((10, 10)));
        assert_eq!(to_range(..=9, 10), Some((0, 10)));
        assert_eq!(to_range((Bound::Included(5), Bound::Excluded(4)), 10), None);
        assert_eq!(to_range(0..11, 10), None);
        assert_eq!(to_range(..=usize::MAX, 10), None);
        assert_eq!(
            to_range((Bound::Excluded(usize::MAX), Bound::Unbounded), 10),
            None
        );
    }

    #[test]
    fn a_transmuted_view_must_fit_and_be_aligned() {
        assert!(fits::<u32>(0x1000, 16, 4));
        assert!(!fits::<u32>(0x1000, 16, 5));
        assert!(!fits::<u32>(0x1002, 16, 1));
        assert!(fits::<u16>(0x1002, 16, 8));
        assert!(!fits::<u64>(0x1000, 16, usize::MAX));
    }
}

//! [`Launch`]: a kernel launch through cudarc's builder that keeps cudarc's stream contract for
//! cachalot's buffers, which cudarc's `LaunchArgs` alone cannot (it keeps its stream private).
//!
//! The one rule: every buffer, block or view passed through [`Launch::arg`] is used on the
//! launch's stream exactly as through `device_ptr` (read) or `device_ptr_mut` (`&mut`: write):
//! the stream first waits for the buffer's last write (and, to write, its last reads) on other
//! streams, and the use is recorded so the buffer's memory is not reused before the kernel
//! ends. The guards that record the kernel's uses run when the `Launch` is dropped, after the
//! kernel is queued.
//!
//! Beside it, at the end of this file, cudarc's `PushKernelArg` for the same types: a buffer
//! pushed straight into cudarc's `LaunchArgs` goes to the kernel as its bare device address,
//! ordered and recorded by nothing (the raw hazard documented on [`DeviceBuffer`]).

use cudarc::driver::{CudaFunction, CudaStream, DeviceRepr, LaunchArgs, PushKernelArg, SyncOnDrop};

use super::block::DeviceBlock;
use super::buffer::DeviceBuffer;
use super::ordering::Access;
use super::streams::stream_id;
use super::view::{DeviceView, DeviceViewMut};
use crate::sync::real::Arc;

/// A kernel argument that [`Launch`] can push, ordering and recording the use of a buffer on
/// the launch's stream.
///
/// Implemented for references to [`DeviceBuffer`], [`DeviceBlock`], [`DeviceView`] and
/// [`DeviceViewMut`] (a shared reference is a read, `&mut` a write) and to any cudarc
/// `DeviceRepr` value such as `u32`, `f32` or `u64` (copied as they are).
pub trait KernelArg<'a> {
    /// Pushes the argument onto the launch (through [`Launch::builder`]), ordering and
    /// recording what it needs to on [`Launch::stream`].
    fn push(self, launch: &mut Launch<'a>);
}

impl<'a, T: DeviceRepr> KernelArg<'a> for &'a T {
    fn push(self, launch: &mut Launch<'a>) {
        launch.args.arg(self);
    }
}

impl<'a> Launch<'a> {
    /// Orders and records a use of `block` on the launch's stream, then pushes `address`.
    fn push_use(&mut self, block: &'a DeviceBlock, address: &'a u64, access: Access) {
        let stream: &'a CudaStream = self.stream;
        match block.use_on(stream, access) {
            SyncOnDrop::Record(None) => {}
            guard => self.guards.push(guard),
        }
        self.args.arg(address);
    }
}

impl<'a> KernelArg<'a> for &'a DeviceBlock {
    fn push(self, launch: &mut Launch<'a>) {
        launch.push_use(self, self.address_ref(), Access::Read);
    }
}

impl<'a> KernelArg<'a> for &'a mut DeviceBlock {
    fn push(self, launch: &mut Launch<'a>) {
        let this: &'a DeviceBlock = self;
        launch.push_use(this, this.address_ref(), Access::Write);
    }
}

impl<'a, T> KernelArg<'a> for &'a DeviceBuffer<T> {
    fn push(self, launch: &mut Launch<'a>) {
        launch.push_use(self.block(), self.block().address_ref(), Access::Read);
    }
}

impl<'a, T> KernelArg<'a> for &'a mut DeviceBuffer<T> {
    fn push(self, launch: &mut Launch<'a>) {
        let this: &'a DeviceBuffer<T> = self;
        launch.push_use(this.block(), this.block().address_ref(), Access::Write);
    }
}

impl<'a, 'b: 'a, T> KernelArg<'a> for &'a DeviceView<'b, T> {
    fn push(self, launch: &mut Launch<'a>) {
        launch.push_use(self.block_ref(), self.address_ref(), Access::Read);
    }
}

impl<'a, 'b: 'a, T> KernelArg<'a> for &'a DeviceViewMut<'b, T> {
    fn push(self, launch: &mut Launch<'a>) {
        launch.push_use(self.block_ref(), self.address_ref(), Access::Read);
    }
}

impl<'a, 'b: 'a, T> KernelArg<'a> for &'a mut DeviceViewMut<'b, T> {
    fn push(self, launch: &mut Launch<'a>) {
        let this: &'a DeviceViewMut<'b, T> = self;
        launch.push_use(this.block_ref(), this.address_ref(), Access::Write);
    }
}

/// A kernel launch that keeps cudarc's stream contract for the buffers it is given: the one
/// safe way to pass a [`DeviceBuffer`] (or a view of one) to a kernel on another stream than
/// its own.
///
/// Build it with [`Launch::new`], add arguments in the kernel's order with [`Launch::arg`]
/// (`&buf` for a buffer the kernel reads, `&mut buf` for one it writes), then launch through
/// cudarc's builder: `unsafe { launch.builder().launch(cfg) }` (unsafe because the arguments
/// must match the kernel's parameters, as in cudarc). Each buffer's stream is waited for as
/// its data requires before the kernel runs, and the kernel's uses are recorded when the
/// `Launch` is dropped, so a buffer dropped after that is not reused before the kernel ends.
///
/// Pushed straight into cudarc's `LaunchArgs` instead (`stream.launch_builder(&f).arg(&buf)`),
/// a buffer is a bare address: fine on the buffer's own stream, a hazard on any other (see
/// [`DeviceBuffer`]).
///
/// ```no_run
/// use cachalot::cuda::{CudaAllocator, Launch};
/// use cudarc::driver::LaunchConfig;
///
/// let alloc = CudaAllocator::for_device(0)?;
/// let ctx = alloc.context().clone();
/// let ptx = cudarc::nvrtc::compile_ptx(
///     r#"extern "C" __global__ void fill(float* out, unsigned int n, float v) {
///         unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
///         if (i < n) out[i] = v;
///     }"#,
/// )?;
/// let fill = ctx.load_module(ptx)?.load_function("fill")?;
/// let (a, b) = (ctx.new_stream()?, ctx.new_stream()?);
/// let mut buf = alloc.alloc_zeros::<f32>(1000, &a)?;
/// let n = 1000u32;
/// let mut launch = Launch::new(&b, &fill);
/// launch.arg(&mut buf).arg(&n).arg(&2.0f32); // b waits for the zeros written on a
/// unsafe { launch.builder().launch(LaunchConfig::for_num_elems(n)) }?;
/// drop(launch); // records the kernel's write of `buf` on b
/// assert_eq!(a.clone_dtoh(&buf)?, vec![2.0; 1000]); // a waits for the kernel on b
/// drop(buf); // not reused until `fill` on b is done
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Launch<'a> {
    stream: &'a Arc<CudaStream>,
    args: LaunchArgs<'a>,
    /// What finishes each buffer's use once the kernel is queued (events recorded on the
    /// launch's stream, or a synchronisation where no event can), run when the `Launch` is
    /// dropped.
    guards: Vec<SyncOnDrop<'a>>,
}

impl std::fmt::Debug for Launch<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Launch")
            .field("stream", &stream_id(self.stream))
            .finish_non_exhaustive()
    }
}

impl<'a> Launch<'a> {
    /// A launch of `func` on `stream`, with no arguments yet.
    pub fn new(stream: &'a Arc<CudaStream>, func: &'a CudaFunction) -> Self {
        Launch {
            stream,
            args: stream.launch_builder(func),
            guards: Vec::new(),
        }
    }

    /// Adds the next kernel argument; a buffer, block or view is ordered and recorded on the
    /// launch's stream (a shared reference as a read, `&mut` as a write).
    pub fn arg<A: KernelArg<'a>>(&mut self, arg: A) -> &mut Self {
        arg.push(self);
        self
    }

    /// The stream the kernel will run on.
    pub fn stream(&self) -> &'a Arc<CudaStream> {
        self.stream
    }

    /// cudarc's launch builder, holding the arguments so far: launch with
    /// `unsafe { launch.builder().launch(cfg) }`, or push arguments that need no ordering
    /// (cudarc's own slices order themselves) with `launch.builder().arg(..)`.
    pub fn builder(&mut self) -> &mut LaunchArgs<'a> {
        &mut self.args
    }
}

// Kernel arguments: a buffer or view goes to a kernel as its device address. These impls order
// and record nothing — cudarc's `LaunchArgs` does not reveal its stream — which is the raw
// hazard documented on `DeviceBuffer`; `Launch` does both.

/// A bare device address: **nothing is ordered or recorded** (cudarc does not reveal the launch
/// stream). Fine on the block's own stream; on another, use [`Launch`].
// SAFETY: the argument pushed is a reference to the block's `CUdeviceptr` (a `u64`, which is
// `DeviceRepr`), borrowed for `'b: 'a`, so it outlives the launch builder that reads it.
unsafe impl<'a, 'b: 'a> PushKernelArg<&'b DeviceBlock> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b DeviceBlock) -> &mut Self {
        self.arg(arg.address_ref())
    }
}

/// A bare device address: nothing is ordered or recorded; see `&DeviceBlock`.
// SAFETY: as for `&DeviceBlock`.
unsafe impl<'a, 'b: 'a> PushKernelArg<&'b mut DeviceBlock> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut DeviceBlock) -> &mut Self {
        let arg: &'b DeviceBlock = arg;
        self.arg(arg.address_ref())
    }
}

/// A bare device address: **nothing is ordered or recorded** (cudarc does not reveal the launch
/// stream). Fine on the buffer's own stream; on another, use [`Launch`].
// SAFETY: as for `&DeviceBlock`.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b DeviceBuffer<T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b DeviceBuffer<T>) -> &mut Self {
        self.arg(arg.block().address_ref())
    }
}

/// A bare device address: nothing is ordered or recorded; see `&DeviceBuffer`.
// SAFETY: as for `&DeviceBlock`.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b mut DeviceBuffer<T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut DeviceBuffer<T>) -> &mut Self {
        let arg: &'b DeviceBuffer<T> = arg;
        self.arg(arg.block().address_ref())
    }
}

/// The view's device address: nothing is ordered or recorded; see `&DeviceBuffer`.
// SAFETY: the argument pushed is a reference to the view's own address field (a `u64`),
// borrowed with the view for `'b: 'a`, so it outlives the launch builder; the view borrows its
// buffer, so the memory it points into outlives it too.
unsafe impl<'a, 'b: 'a, 'v, T> PushKernelArg<&'b DeviceView<'v, T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b DeviceView<'v, T>) -> &mut Self {
        self.arg(arg.address_ref())
    }
}

/// The view's device address: nothing is ordered or recorded; see `&DeviceBuffer`.
// SAFETY: as for `&DeviceView`.
unsafe impl<'a, 'b: 'a, 'v, T> PushKernelArg<&'b DeviceViewMut<'v, T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b DeviceViewMut<'v, T>) -> &mut Self {
        self.arg(arg.address_ref())
    }
}

/// The view's device address: nothing is ordered or recorded; see `&DeviceBuffer`.
// SAFETY: as for `&DeviceView`.
unsafe impl<'a, 'b: 'a, 'v, T> PushKernelArg<&'b mut DeviceViewMut<'v, T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut DeviceViewMut<'v, T>) -> &mut Self {
        let arg: &'b DeviceViewMut<'v, T> = arg;
        self.arg(arg.address_ref())
    }
}

//! The memory users hold: [`DeviceBlock`] (bytes) and [`DeviceBuffer<T>`] (typed), each an owned
//! allocation that goes back to the cache when dropped, and [`Launch`], a kernel launch that
//! records the buffers it passes.
//!
//! The one rule: a buffer records every use on a stream other than its own, so the allocator
//! never hands its memory out while that stream may still touch it. cudarc reveals the stream
//! to [`DevicePtr::device_ptr`] and [`DevicePtrMut::device_ptr_mut`], so copies, memsets and
//! anything else built on those traits record on their own; a kernel launch records through
//! [`Launch`] (cudarc's `LaunchArgs` keeps its stream to itself).

use crate::sync::real::Arc;
use crate::sync::real::{AtomicU64, Ordering};
use std::marker::PhantomData;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{
    CudaFunction, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice, LaunchArgs,
    PushKernelArg, SyncOnDrop,
};

use super::CudaAllocator;
use super::error::CudaError;
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
/// stream through [`DevicePtr`]/[`DevicePtrMut`] (every cudarc copy and memset) or [`Launch`]
/// records that use, so that when the block is dropped its memory is not reused until the work
/// queued on that stream by then has completed. A kernel argument pushed straight into
/// cudarc's `LaunchArgs` records nothing: on another stream, use [`Launch`] or
/// [`DeviceBlock::record_stream`]. Streams a block was used on should outlive the block.
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
    alloc: CudaAllocator,
    stream: Arc<CudaStream>,
    address: CUdeviceptr,
    bytes: usize,
    /// The stream whose use was recorded last, to skip recording it again.
    last_use: AtomicU64,
}

impl std::fmt::Debug for DeviceBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBlock")
            .field("address", &format_args!("{:#x}", self.address))
            .field("bytes", &self.bytes)
            .field("stream", &stream_id(&self.stream))
            .finish()
    }
}

impl DeviceBlock {
    pub(crate) fn new(
        alloc: CudaAllocator,
        stream: Arc<CudaStream>,
        address: u64,
        bytes: usize,
    ) -> Self {
        DeviceBlock {
            alloc,
            stream,
            address,
            bytes,
            last_use: AtomicU64::new(NO_STREAM),
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
        &self.stream
    }

    /// The allocator it came from.
    pub fn allocator(&self) -> &CudaAllocator {
        &self.alloc
    }

    /// Marks the block as used on `stream`, as PyTorch's `Tensor.record_stream` does: when the
    /// block is dropped, its memory is not reused until the work queued on `stream` by then
    /// has completed. The allocator keeps `stream` alive until then.
    ///
    /// Copies and [`Launch`] do this automatically; call it for uses cachalot cannot see, such
    /// as a raw launch through cudarc's `LaunchArgs` on another stream. Recording the block's
    /// own stream, or an empty block, does nothing.
    pub fn record_stream(&self, stream: &Arc<CudaStream>) -> Result<(), CudaError> {
        if self.address == 0
            || (stream_id(stream) == stream_id(&self.stream) && self.same_context(stream))
        {
            return Ok(());
        }
        self.alloc.record_raw_stream(self.address, stream)
    }

    pub(crate) fn address_ref(&self) -> &u64 {
        &self.address
    }

    fn same_context(&self, stream: &CudaStream) -> bool {
        stream.context().cu_ctx() == self.stream.context().cu_ctx()
    }

    /// Records a use on `stream` if it is another stream and automatic recording is on; the
    /// returned guard synchronises a stream of another device after the use is queued (its
    /// work cannot be tracked by this device's events).
    fn use_on<'a>(&self, stream: &'a CudaStream) -> SyncOnDrop<'a> {
        if self.address == 0 {
            return SyncOnDrop::Record(None);
        }
        if !self.same_context(stream) {
            return SyncOnDrop::Sync(Some(stream));
        }
        let id = stream_id(stream).0;
        if id == stream_id(&self.stream).0
            || self.last_use.load(Ordering::Relaxed) == id
            || !self.alloc.auto_record_stream()
        {
            return SyncOnDrop::Record(None);
        }
        if self.alloc.record_use(self.address, stream).is_ok() {
            self.last_use.store(id, Ordering::Relaxed);
            SyncOnDrop::Record(None)
        } else {
            // Could not record (the device failed): make the use complete before going on.
            SyncOnDrop::Sync(Some(stream))
        }
    }
}

impl Drop for DeviceBlock {
    fn drop(&mut self) {
        // Freeing a live block fails only if the device fails while recording events; the
        // block then stays allocated until the allocator itself is dropped.
        let _ = self.alloc.free_block(self.address);
    }
}

impl DeviceSlice<u8> for DeviceBlock {
    fn len(&self) -> usize {
        self.bytes
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl DevicePtr<u8> for DeviceBlock {
    /// The device address; a use on another stream than the block's is recorded (see
    /// [`DeviceBlock`]).
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.address, self.use_on(stream))
    }
}

impl DevicePtrMut<u8> for DeviceBlock {
    /// The device address; a use on another stream than the block's is recorded (see
    /// [`DeviceBlock`]).
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.address, self.use_on(stream))
    }
}

mod sealed {
    pub trait Sealed {}
}

/// Types every bit pattern of which is a valid value (integers, floats, arrays of them), so a
/// buffer of them may be allocated without initialising it ([`CudaAllocator::alloc_buffer`]).
///
/// Sealed: implemented by cachalot for the primitive number types and arrays of them.
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
impl<T: Plain, const N: usize> sealed::Sealed for [T; N] {}
impl<T: Plain, const N: usize> Plain for [T; N] {}

/// A typed owned allocation: `len` values of `T` in device memory from a [`CudaAllocator`],
/// returned to the cache when dropped.
///
/// It stands in for cudarc's `CudaSlice<T>`: it implements [`DeviceSlice`], [`DevicePtr`],
/// [`DevicePtrMut`] and cudarc's `PushKernelArg`, so `stream.memcpy_htod`, `memcpy_dtoh`,
/// `clone_dtoh`, `memset_zeros` and kernel launches take it. Cross-stream uses are recorded as
/// for [`DeviceBlock`]: automatically through copies, memsets and [`Launch`]; by hand with
/// [`DeviceBuffer::record_stream`] for anything else.
///
/// ```no_run
/// use cachalot::cuda::CudaAllocator;
///
/// let alloc = CudaAllocator::for_device(0)?;
/// let stream = alloc.context().new_stream()?;
/// let host: Vec<f32> = (0..1000).map(|i| i as f32).collect();
/// let buf = alloc.clone_htod(&host, &stream)?;
/// assert_eq!(buf.len(), 1000);
/// assert_eq!(stream.clone_dtoh(&buf)?, host);
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

    /// The allocator it came from.
    pub fn allocator(&self) -> &CudaAllocator {
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
    /// The device address; a use on another stream than the buffer's is recorded.
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.block.address, self.block.use_on(stream))
    }
}

impl<T> DevicePtrMut<T> for DeviceBuffer<T> {
    /// The device address; a use on another stream than the buffer's is recorded.
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.block.address, self.block.use_on(stream))
    }
}

/// A kernel argument that [`Launch`] can push, recording the use of a buffer on the launch's
/// stream.
///
/// Implemented for references to [`DeviceBuffer`] and [`DeviceBlock`] (which record) and to
/// any cudarc `DeviceRepr` value such as `u32`, `f32` or `u64` (which are copied as they are).
pub trait KernelArg<'a> {
    /// Pushes the argument onto the launch (through [`Launch::builder`]), recording what it
    /// needs to on [`Launch::stream`].
    fn push(self, launch: &mut Launch<'a>);
}

impl<'a, T: DeviceRepr> KernelArg<'a> for &'a T {
    fn push(self, launch: &mut Launch<'a>) {
        launch.args.arg(self);
    }
}

impl<'a> KernelArg<'a> for &'a DeviceBlock {
    fn push(self, launch: &mut Launch<'a>) {
        let stream: &'a CudaStream = launch.stream;
        match self.use_on(stream) {
            SyncOnDrop::Record(None) => {}
            guard => launch.guards.push(guard),
        }
        launch.args.arg(self);
    }
}

impl<'a> KernelArg<'a> for &'a mut DeviceBlock {
    fn push(self, launch: &mut Launch<'a>) {
        let this: &'a DeviceBlock = self;
        this.push(launch);
    }
}

impl<'a, T> KernelArg<'a> for &'a DeviceBuffer<T> {
    fn push(self, launch: &mut Launch<'a>) {
        self.block.push(launch);
    }
}

impl<'a, T> KernelArg<'a> for &'a mut DeviceBuffer<T> {
    fn push(self, launch: &mut Launch<'a>) {
        let this: &'a DeviceBuffer<T> = self;
        this.block.push(launch);
    }
}

/// A kernel launch that records the buffers it is given as used on its stream: the one way to
/// pass a [`DeviceBuffer`] to a kernel on another stream than its own without calling
/// [`DeviceBuffer::record_stream`].
///
/// Build it with [`Launch::new`], add arguments in the kernel's order with [`Launch::arg`],
/// then launch through cudarc's builder: `unsafe { launch.builder().launch(cfg) }` (unsafe
/// because the arguments must match the kernel's parameters, as in cudarc).
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
/// b.join(&a)?; // b sees the zeros
/// let n = 1000u32;
/// let mut launch = Launch::new(&b, &fill);
/// launch.arg(&mut buf).arg(&n).arg(&2.0f32); // records `buf` as used on `b`
/// unsafe { launch.builder().launch(LaunchConfig::for_num_elems(n)) }?;
/// drop(launch); // the launch borrows `buf` until it is dropped
/// drop(buf); // not reused until `fill` on `b` is done
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Launch<'a> {
    stream: &'a Arc<CudaStream>,
    args: LaunchArgs<'a>,
    /// Synchronisations to run once the kernel is queued (uses that events cannot track: a
    /// stream of another device), run when the `Launch` is dropped.
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

    /// Adds the next kernel argument; a buffer or block is recorded as used on the launch's
    /// stream (when that is not its own).
    pub fn arg<A: KernelArg<'a>>(&mut self, arg: A) -> &mut Self {
        arg.push(self);
        self
    }

    /// The stream the kernel will run on.
    pub fn stream(&self) -> &'a Arc<CudaStream> {
        self.stream
    }

    /// cudarc's launch builder, holding the arguments so far: launch with
    /// `unsafe { launch.builder().launch(cfg) }`, or push arguments that need no recording
    /// (cudarc's own slices) with `launch.builder().arg(..)`.
    pub fn builder(&mut self) -> &mut LaunchArgs<'a> {
        &mut self.args
    }
}

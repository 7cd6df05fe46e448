//! The device behind the allocator: where segments come from and where events live.
//!
//! The one rule: the policy core never names a CUDA type. It sees streams and events as opaque
//! ids and device memory as addresses; a [`Backend`] turns those into driver calls (the CUDA
//! backend, [`cuda`] with its virtual memory in `cuda/vmm.rs`, public as
//! `cachalot::cuda::CudaBackend`) or into bookkeeping (the [`sim`] device, public as
//! `cachalot::SimDevice`).

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
pub mod sim;

/// A stream, as the backend identifies it (for CUDA, the `CUstream` handle's value).
///
/// Blocks are cached per stream: a block freed on one stream is only reused on that stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default, serde::Serialize)]
pub struct StreamId(pub u64);

/// An event recorded on a stream, as the backend identifies it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EventId(pub u64);

/// The device's memory as the driver reports it (`cuMemGetInfo`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct MemInfo {
    /// Bytes free on the device, for anyone.
    pub free: u64,
    /// The device's total memory.
    pub total: u64,
}

/// A failure reported by the device.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BackendError {
    /// The device has no room for the allocation. The allocator recovers from this by releasing
    /// cached memory and retrying.
    #[error("the device is out of memory")]
    OutOfMemory,
    /// Any other driver error: the operation did not happen and the allocator's state is
    /// unchanged.
    #[error("device error in {operation}: {message}")]
    Device {
        /// The driver call that failed.
        operation: &'static str,
        /// The driver's description of the error.
        message: String,
    },
    /// A fault injected into the simulated device ([`sim::SimDevice::inject`]): it stands for
    /// a driver error other than out-of-memory, and tests and fuzzers tell it from a real one
    /// by this variant. The operation did not happen and the allocator's state is unchanged.
    #[error("device error in {operation}: injected fault")]
    Injected {
        /// The device call that was made to fail.
        operation: &'static str,
    },
}

/// What the allocator needs from a device: memory, and events for cross-stream safety.
///
/// Shaped after the CUDA driver API (`cuMemAlloc`, `cuMemFree`, `cuMemGetInfo`,
/// `cuEventRecord`, `cuEventQuery`, `cuEventSynchronize`, `cuEventDestroy`).
pub trait Backend {
    /// Allocates `size` bytes of device memory and returns its address (never 0).
    fn allocate(&mut self, size: u64) -> Result<u64, BackendError>;
    /// Returns the memory at `address` (which [`Backend::allocate`] returned with `size`).
    fn free(&mut self, address: u64, size: u64) -> Result<(), BackendError>;
    /// The device's free and total memory.
    fn mem_info(&mut self) -> Result<MemInfo, BackendError>;
    /// Records an event on `stream`: it completes when the work queued on `stream` so far is done.
    fn record_event(&mut self, stream: StreamId) -> Result<EventId, BackendError>;
    /// Whether the event has completed.
    fn query_event(&mut self, event: EventId) -> Result<bool, BackendError>;
    /// Waits until the event has completed.
    fn synchronize_event(&mut self, event: EventId) -> Result<(), BackendError>;
    /// Forgets an event the allocator no longer needs.
    fn destroy_event(&mut self, event: EventId);
    /// Takes note that `size` bytes at `address` are already allocated on the device (rule 18:
    /// a segment the process held before the allocator was told of it); from now on they are
    /// freed with [`Backend::free`] like memory [`Backend::allocate`] returned.
    ///
    /// The default refuses: a backend that cannot vouch for such a range (the CUDA backend)
    /// fails with [`BackendError::Device`] and nothing changes.
    fn adopt(&mut self, address: u64, size: u64) -> Result<(), BackendError> {
        Err(BackendError::Device {
            operation: "adopt",
            message: format!(
                "adopting an existing segment ({address:#x}, {size} bytes) is not supported by this backend"
            ),
        })
    }

    /// Takes note that a reservation of `size` bytes at `address`, of `page`-byte pages,
    /// already exists with new pages mapped at the `(address, bytes)` runs of `mapped` (whole
    /// pages inside it, in address order, not overlapping; rule 18f: a range of expandable
    /// segments the process held before the allocator was told of it); from now on it is
    /// mapped, unmapped and released like a reservation [`Backend::reserve`] made.
    ///
    /// The default refuses, as [`Backend::adopt`] does: a backend that cannot vouch for such
    /// a range (the CUDA backend) fails with [`BackendError::Device`] and nothing changes.
    fn adopt_range(
        &mut self,
        address: u64,
        size: u64,
        page: u64,
        mapped: &[(u64, u64)],
    ) -> Result<(), BackendError> {
        let _ = (page, mapped);
        Err(BackendError::Device {
            operation: "adopt_range",
            message: format!(
                "adopting an existing range ({address:#x}, {size} bytes) is not supported by this backend"
            ),
        })
    }

    /// Whether the backend offers virtual memory — [`Backend::reserve`], [`Backend::map`],
    /// [`Backend::unmap`] and [`Backend::release_reservation`], and [`Backend::alias`] for page
    /// aliasing (rule 22) — which expandable segments (rule 19) need. The default is `false`,
    /// and the allocator then refuses `expandable_segments:True` when it is made.
    fn virtual_memory(&self) -> bool {
        false
    }

    /// Reserves `size` bytes of device address space (no memory behind it yet; counted against
    /// nothing) whose pages will be `page` bytes, and returns its first address (never 0).
    /// Both are multiples of 2 MiB. Shaped after `cuMemAddressReserve`.
    fn reserve(&mut self, size: u64, page: u64) -> Result<u64, BackendError> {
        let _ = page;
        Err(no_virtual_memory("reserve", size))
    }

    /// Gives back a reservation [`Backend::reserve`] made (`address`, `size` as returned and
    /// asked). Nothing in it may be mapped. Shaped after `cuMemAddressFree`.
    fn release_reservation(&mut self, address: u64, size: u64) -> Result<(), BackendError> {
        let _ = address;
        Err(no_virtual_memory("release_reservation", size))
    }

    /// Backs `size` bytes at `address` — whole pages of one reservation, none mapped yet — with
    /// new device memory: creates each page (`cuMemCreate`), maps it (`cuMemMap`) and gives
    /// the device read and write access (`cuMemSetAccess`). All or nothing: when a page cannot
    /// be created the pages created so far are released and the call fails
    /// ([`BackendError::OutOfMemory`] when the device has no room).
    fn map(&mut self, address: u64, size: u64) -> Result<(), BackendError> {
        let _ = address;
        Err(no_virtual_memory("map", size))
    }

    /// Rule 19j: backs `size` bytes at `address` — whole pages of one reservation, none mapped
    /// yet, more than one page — with **one** new handle of all the bytes (`cuMemCreate` of
    /// `size`, one `cuMemMap`, one `cuMemSetAccess`). All or nothing, as [`Backend::map`]. The
    /// handle's mapping is then unmapped only whole ([`Backend::unmap`] refuses bytes that cut
    /// it) and never aliased ([`Backend::alias`] refuses a source inside it).
    ///
    /// The default refuses, as the other virtual-memory calls do: the allocator calls it only
    /// when `expandable_handle_mb` is set.
    fn map_handle(&mut self, address: u64, size: u64) -> Result<(), BackendError> {
        let _ = address;
        Err(no_virtual_memory("map_handle", size))
    }

    /// Unmaps the mappings of `size` bytes at `address` (whole mapped pages of one
    /// reservation, mapped by [`Backend::map`] or [`Backend::alias`]), after the work queued on
    /// `stream` — the range's stream — is done (`cuMemUnmap`). Only these mappings go: a page
    /// mapped at other addresses too (rule 22) stays mapped there, and its memory goes back
    /// (`cuMemRelease`) when its last mapping is unmapped. On failure nothing is unmapped.
    fn unmap(&mut self, address: u64, size: u64, stream: StreamId) -> Result<(), BackendError> {
        let _ = (address, stream);
        Err(no_virtual_memory("unmap", size))
    }

    /// Page aliasing (rule 22h): maps, at the `size` bytes of unmapped whole pages at `address`
    /// (one reservation), the pages mapped at `source` (`size` bytes of whole mapped pages of
    /// one reservation, with pages of the same size, not overlapping the target), in order.
    /// No memory is created: each page is then mapped at both places, and its memory goes back
    /// only when its last mapping is unmapped ([`Backend::unmap`]). Shaped after `cuMemMap` of
    /// the handles behind `source` again, and `cuMemSetAccess`. All or nothing: on failure
    /// nothing is mapped ([`BackendError::OutOfMemory`] when the device says so).
    ///
    /// The default refuses, as the other virtual-memory calls do: a backend without it never
    /// sees the call unless the allocator is set to alias pages (`page_aliasing:True`).
    fn alias(&mut self, address: u64, source: u64, size: u64) -> Result<(), BackendError> {
        let _ = (address, source);
        Err(no_virtual_memory("alias", size))
    }

    /// Rule 23k: makes the work queued on `waiter` from now on wait for the work queued on
    /// `on` so far, without the host waiting (`cuEventRecord` on `on`, `cuStreamWaitEvent` on
    /// `waiter`). Not a memory call: it counts in no statistic. A stitched view that holds
    /// pages of another stream's range orders the two streams with it.
    ///
    /// The default refuses, as the virtual-memory calls do: only stitched views (rule 23,
    /// which needs virtual memory) make it, so a backend without virtual memory never sees it,
    /// and a wrapper that forgets to forward it fails loudly instead of leaving work unordered.
    fn wait_stream(&mut self, waiter: StreamId, on: StreamId) -> Result<(), BackendError> {
        let _ = (waiter, on);
        Err(no_virtual_memory("wait_stream", 0))
    }
}

/// Rule 19j, for the backends' bookkeeping of handles of several pages (first address → bytes):
/// the extents that share a byte with `[address, address + size)`, as `(first address, bytes)`
/// in address order.
pub(crate) fn extents_touching(
    extents: &std::collections::BTreeMap<u64, u64>,
    address: u64,
    size: u64,
) -> Vec<(u64, u64)> {
    let end = address.saturating_add(size);
    let before = extents
        .range(..address)
        .next_back()
        .map(|(&a, &b)| (a, b))
        .filter(|&(a, b)| a.saturating_add(b) > address);
    before
        .into_iter()
        .chain(extents.range(address..end).map(|(&a, &b)| (a, b)))
        .collect()
}

fn no_virtual_memory(operation: &'static str, size: u64) -> BackendError {
    BackendError::Device {
        operation,
        message: format!("this backend has no virtual memory ({size} bytes asked)"),
    }
}

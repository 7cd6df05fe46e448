//! Virtual memory for expandable segments (rule 19 of ARCHITECTURE.md), the half of
//! [`CudaBackend`] behind [`Backend::reserve`](crate::backend::Backend::reserve),
//! [`map`](crate::backend::Backend::map), [`unmap`](crate::backend::Backend::unmap) and
//! [`release_reservation`](crate::backend::Backend::release_reservation): address space from
//! `cuMemAddressReserve`, backed page by page with `cuMemCreate` + `cuMemMap`, made accessible
//! with `cuMemSetAccess`, given back with `cuMemUnmap` + `cuMemRelease` and `cuMemAddressFree`.
//! A page can be mapped at several addresses at once (rule 22, page aliasing:
//! [`alias`](crate::backend::Backend::alias) maps the handle behind one address again at
//! another); a handle is released when its last mapping is unmapped.
//!
//! The one rule: every address and size is checked against the reservations and pages
//! recorded here before it reaches the driver; the driver sees only ranges it handed out, in
//! the state it left them. Every `unsafe` block has its `// SAFETY:` comment.

use cudarc::driver::sys;
use cudarc::driver::{CudaContext, result};

use super::{CudaBackend, device_error};
use crate::backend::{BackendError, StreamId};

/// The smallest page rule 19 asks for (a small-pool range's page): the device's allocation
/// granularity must divide it.
const VMM_MIN_PAGE: u64 = 2 << 20;

/// One backend's virtual memory: what the device offers, and the reservations made.
#[derive(Debug, Default)]
pub(super) struct Vmm {
    /// The device's allocation granularity for pinned memory, when it supports virtual memory
    /// management and the granularity divides [`VMM_MIN_PAGE`]; `None` otherwise.
    pub(super) granularity: Option<u64>,
    /// Live reservations by first address.
    reservations: std::collections::BTreeMap<u64, Reservation>,
    /// Physical bytes held: each live handle's page counted once, however many addresses map
    /// it.
    mapped: u64,
    /// How many addresses map each live handle (rule 22: one, or more when aliased).
    mappings: std::collections::HashMap<sys::CUmemGenericAllocationHandle, u32>,
    /// Rule 19j: the home mappings of handles of several pages, by first address: their
    /// bytes. The driver unmaps such a mapping only whole and maps a handle only whole (no
    /// offset), so these are unmapped in one call and never aliased. Their slots are in the
    /// reservation's `pages` too, each with the one handle.
    big: std::collections::BTreeMap<u64, u64>,
}

/// A mapped page: its address and the `cuMemCreate` handle behind it.
type Page = (u64, sys::CUmemGenericAllocationHandle);

/// One `cuMemAddressReserve` range and its mapped pages.
#[derive(Debug)]
struct Reservation {
    size: u64,
    page: u64,
    /// Mapped pages: page address → the `cuMemCreate` handle behind it.
    pages: std::collections::BTreeMap<u64, sys::CUmemGenericAllocationHandle>,
}

impl Vmm {
    /// The first address of the reservation of which `size` bytes at `address` are whole
    /// pages, if there is one.
    fn span(&self, address: u64, size: u64) -> Option<u64> {
        let (&base, r) = self.reservations.range(..=address).next_back()?;
        let end = address.checked_add(size)?;
        (size > 0
            && end <= base.checked_add(r.size)?
            && (address - base).is_multiple_of(r.page)
            && size.is_multiple_of(r.page))
        .then_some(base)
    }

    /// Rule 19j: the handles of several pages that share a byte with `[address, address +
    /// size)`, as `(first address, bytes)`.
    fn big_touching(&self, address: u64, size: u64) -> Vec<(u64, u64)> {
        crate::backend::extents_touching(&self.big, address, size)
    }

    /// The mappings behind `pages` (whole mapped pages, in address order) as
    /// `(address, bytes, handle)`: one per page, but one per handle of several pages.
    fn mappings_of(
        &self,
        pages: &[Page],
        page: u64,
    ) -> Vec<(u64, u64, sys::CUmemGenericAllocationHandle)> {
        let mut out = Vec::with_capacity(pages.len());
        let mut skip_to = 0u64;
        for &(at, handle) in pages {
            if at < skip_to {
                continue;
            }
            match self.big.get(&at) {
                Some(&bytes) => {
                    out.push((at, bytes, handle));
                    skip_to = at + bytes;
                }
                None => out.push((at, page, handle)),
            }
        }
        out
    }

    /// For `size` bytes at `address` that are whole pages of a reservation: its first
    /// address, its page, and the pages of the span that are mapped, with their handles.
    fn pages_of(&self, address: u64, size: u64) -> Option<(u64, u64, Vec<Page>)> {
        let base = self.span(address, size)?;
        let r = self.reservations.get(&base)?;
        let pages = r
            .pages
            .range(address..address + size)
            .map(|(&a, &h)| (a, h))
            .collect();
        Some((base, r.page, pages))
    }
}

/// The device location of `ordinal`'s memory.
pub(crate) fn device_location(ordinal: usize) -> sys::CUmemLocation {
    // Ordinals are small; one that does not fit is refused by the driver.
    let id = i32::try_from(ordinal).unwrap_or(i32::MAX);
    const { assert!(std::mem::offset_of!(sys::CUmemLocation, type_) == 0) };
    // SAFETY: in every CUDA version cudarc binds, `CUmemLocation` is `repr(C)`: the location
    // type (a `repr(u32)` enum) at offset 0 (asserted above) and, at offset 4, either the
    // `c_int` device id or (CUDA 13.2 and later) a 4-byte union whose `id` member is that
    // `c_int` — 8 bytes in all, which `transmute` checks at compile time. Its fields are named
    // differently across those versions, which is why it is built from its bytes. The first
    // value is `CU_MEM_LOCATION_TYPE_DEVICE`, a valid value of the enum, and every bit pattern
    // is a valid `c_int`.
    unsafe {
        std::mem::transmute::<[i32; 2], sys::CUmemLocation>([
            sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE as i32,
            id,
        ])
    }
}

/// Pinned device memory of device `ordinal`, as `cuMemCreate` is asked for it.
fn pinned_on(ordinal: usize) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
        location: device_location(ordinal),
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// Read and write access for device `ordinal`.
fn read_write_for(ordinal: usize) -> sys::CUmemAccessDesc {
    sys::CUmemAccessDesc {
        location: device_location(ordinal),
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

/// The allocation granularity of `ctx`'s device when it supports virtual memory management
/// (`CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`) and the granularity divides
/// 2 MiB; `None` otherwise, or when the driver cannot say.
pub(super) fn probe_virtual_memory(ctx: &CudaContext) -> Option<u64> {
    let supported = ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)
        .ok()?;
    if supported == 0 {
        return None;
    }
    let prop = pinned_on(ctx.ordinal());
    let mut granularity: usize = 0;
    // SAFETY: both pointers are to live locals of the types the driver reads and writes;
    // `prop` is fully initialised.
    unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut granularity,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    }
    .result()
    .ok()?;
    let granularity = granularity as u64;
    (granularity > 0 && VMM_MIN_PAGE.is_multiple_of(granularity)).then_some(granularity)
}

/// A refusal made before any driver call: the arguments are not what this backend handed out.
fn vmm_refused(operation: &'static str, address: u64, size: u64, what: &str) -> BackendError {
    BackendError::Device {
        operation,
        message: format!("{address:#x} ({size} bytes) {what}"),
    }
}

/// Creates one page of `page` bytes (`prop`) and maps it at `address`; returns its handle. On
/// failure nothing is left created or mapped.
fn create_and_map(
    address: u64,
    page: usize,
    prop: &sys::CUmemAllocationProp,
) -> Result<sys::CUmemGenericAllocationHandle, BackendError> {
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: `handle` is a live local the driver writes; `prop` is a fully initialised
    // property (pinned memory on the backend's device) that outlives the call. Creating memory
    // touches no memory already in use.
    unsafe { sys::cuMemCreate(&mut handle, page, prop, 0) }
        .result()
        .map_err(|e| device_error("cuMemCreate", e))?;
    // SAFETY: `handle` was just created with exactly `page` bytes and is mapped nowhere yet.
    // `address` is page-aligned in a reservation of this backend and not mapped (the caller
    // checked it against the bookkeeping); the driver refuses a range that is not reserved or
    // already mapped rather than replacing a mapping.
    if let Err(e) = unsafe { sys::cuMemMap(address, page, 0, handle, 0) }.result() {
        // SAFETY: `handle` came from cuMemCreate above, is mapped nowhere, and is released
        // once, here.
        let _ = unsafe { sys::cuMemRelease(handle) };
        return Err(device_error("cuMemMap", e));
    }
    Ok(handle)
}

/// Unmaps and releases pages that [`create_and_map`] mapped (`(address, handle)`, each of
/// `page` bytes); errors are ignored (nothing more can be done about them).
///
/// # Safety
///
/// Each page must be mapped at its address with its handle by this backend, must leave the
/// bookkeeping (it is released exactly once), and no work queued on the device may still use
/// it.
unsafe fn unmap_and_release(pages: &[Page], page: usize) {
    for &(address, handle) in pages {
        // SAFETY: the caller's contract: mapped here with this handle, unused, released once.
        let _ = unsafe { sys::cuMemUnmap(address, page) };
        // SAFETY: as above; its only mapping is gone, so the memory goes back to the device.
        let _ = unsafe { sys::cuMemRelease(handle) };
    }
}

impl CudaBackend {
    /// The reservations of address space this backend holds for expandable segments (rule 19).
    pub fn reservation_count(&self) -> usize {
        self.vmm.reservations.len()
    }

    /// The physical bytes of device memory mapped into those reservations (each page once,
    /// however many addresses map it: rule 22).
    pub fn mapped_bytes(&self) -> u64 {
        self.vmm.mapped
    }

    /// Waits for the work queued on `stream`, or on the whole device when the backend does not
    /// know the stream or the driver refuses it.
    fn synchronize_stream(&self, stream: StreamId) -> Result<(), BackendError> {
        self.bind()?;
        if self.knows_stream(stream) {
            // SAFETY: as in `record_event`: the handle is a built-in stream or one shown to
            // the backend through a `&CudaStream` of this context; if its owner destroyed it
            // since, the driver reports an error and the whole device is synchronised instead.
            if unsafe { result::stream::synchronize(stream.0 as sys::CUstream) }.is_ok() {
                return Ok(());
            }
        }
        self.synchronize_all()
    }

    pub(super) fn vmm_reserve(&mut self, size: u64, page: u64) -> Result<u64, BackendError> {
        let Some(granularity) = self.vmm.granularity else {
            return Err(BackendError::Device {
                operation: "cuMemAddressReserve",
                message: format!(
                    "device {} offers no virtual memory management ({size} bytes asked)",
                    self.ctx.ordinal()
                ),
            });
        };
        let bytes = usize::try_from(size).ok().filter(|_| {
            size > 0
                && page > 0
                && page.is_multiple_of(VMM_MIN_PAGE)
                && page.is_multiple_of(granularity)
                && size.is_multiple_of(page)
        });
        let Some(bytes) = bytes else {
            return Err(vmm_refused(
                "cuMemAddressReserve",
                0,
                size,
                &format!(
                    "is not a whole number of {page}-byte pages, each a multiple of 2 MiB and of the device's {granularity}-byte granularity"
                ),
            ));
        };
        self.bind()?;
        let mut address: sys::CUdeviceptr = 0;
        // SAFETY: `address` is a live local the driver writes; no fixed address is asked for
        // (0), so the driver picks address space nothing uses; no memory is mapped yet.
        unsafe { sys::cuMemAddressReserve(&mut address, bytes, granularity as usize, 0, 0) }
            .result()
            .map_err(|e| device_error("cuMemAddressReserve", e))?;
        self.vmm.reservations.insert(
            address,
            Reservation {
                size,
                page,
                pages: std::collections::BTreeMap::new(),
            },
        );
        Ok(address)
    }

    pub(super) fn vmm_release_reservation(
        &mut self,
        address: u64,
        size: u64,
    ) -> Result<(), BackendError> {
        match self.vmm.reservations.get(&address) {
            Some(r) if r.size == size && r.pages.is_empty() => {}
            _ => {
                return Err(vmm_refused(
                    "cuMemAddressFree",
                    address,
                    size,
                    "is not a reservation of this backend with nothing mapped",
                ));
            }
        }
        self.bind()?;
        // SAFETY: `address` and `size` are exactly a reservation cuMemAddressReserve made
        // (checked above, and removed below so it is freed once), with no page mapped in it.
        unsafe { sys::cuMemAddressFree(address, size as usize) }
            .result()
            .map_err(|e| device_error("cuMemAddressFree", e))?;
        self.vmm.reservations.remove(&address);
        Ok(())
    }

    pub(super) fn vmm_map(&mut self, address: u64, size: u64) -> Result<(), BackendError> {
        let (base, page, _) = self
            .vmm
            .pages_of(address, size)
            .filter(|(_, _, pages)| pages.is_empty())
            .ok_or_else(|| {
                vmm_refused(
                    "cuMemMap",
                    address,
                    size,
                    "is not whole unmapped pages of one reservation of this backend",
                )
            })?;
        let page_bytes = page as usize;
        self.bind()?;
        let ordinal = self.ctx.ordinal();
        let prop = pinned_on(ordinal);
        let end = address + size;
        let mut made: Vec<Page> = Vec::with_capacity((size / page) as usize);
        let mut failure = None;
        let mut at = address;
        while at < end {
            match create_and_map(at, page_bytes, &prop) {
                Ok(handle) => made.push((at, handle)),
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
            at += page;
        }
        if failure.is_none() {
            let access = read_write_for(ordinal);
            // SAFETY: every page of [address, end) was just mapped (above); `access` is a live,
            // fully initialised descriptor, and the count is 1.
            if let Err(e) =
                unsafe { sys::cuMemSetAccess(address, size as usize, &access, 1) }.result()
            {
                failure = Some(device_error("cuMemSetAccess", e));
            }
        }
        if let Some(e) = failure {
            // SAFETY: these pages were mapped by this call with these handles, never entered
            // the bookkeeping, and nothing was handed out in them.
            unsafe { unmap_and_release(&made, page_bytes) };
            return Err(e);
        }
        for &(_, handle) in &made {
            self.vmm.mappings.insert(handle, 1);
        }
        if let Some(r) = self.vmm.reservations.get_mut(&base) {
            r.pages.extend(made);
        }
        self.vmm.mapped += size;
        Ok(())
    }

    /// Rule 19j: backs `size` bytes of unmapped whole pages at `address` (more than one page)
    /// with one handle: one `cuMemCreate` of `size`, one `cuMemMap`, one `cuMemSetAccess`. All
    /// or nothing.
    pub(super) fn vmm_map_handle(&mut self, address: u64, size: u64) -> Result<(), BackendError> {
        let (base, page, _) = self
            .vmm
            .pages_of(address, size)
            .filter(|(_, page, pages)| pages.is_empty() && size > *page)
            .ok_or_else(|| {
                vmm_refused(
                    "cuMemMap",
                    address,
                    size,
                    "is not more than one whole unmapped page of one reservation of this backend",
                )
            })?;
        let bytes = usize::try_from(size).map_err(|_| {
            vmm_refused(
                "cuMemCreate",
                address,
                size,
                "does not fit the host's size type",
            )
        })?;
        self.bind()?;
        let ordinal = self.ctx.ordinal();
        let prop = pinned_on(ordinal);
        let handle = create_and_map(address, bytes, &prop)?;
        let access = read_write_for(ordinal);
        // SAFETY: [address, address + size) was just mapped with `handle` (above); `access` is
        // a live, fully initialised descriptor, and the count is 1.
        if let Err(e) = unsafe { sys::cuMemSetAccess(address, bytes, &access, 1) }.result() {
            // SAFETY: mapped by this call with this handle, never entered the bookkeeping,
            // nothing handed out in it; its one mapping is undone and it is released once.
            unsafe { unmap_and_release(&[(address, handle)], bytes) };
            return Err(device_error("cuMemSetAccess", e));
        }
        self.vmm.mappings.insert(handle, 1);
        self.vmm.big.insert(address, size);
        if let Some(r) = self.vmm.reservations.get_mut(&base) {
            r.pages
                .extend((0..size / page).map(|i| (address + i * page, handle)));
        }
        self.vmm.mapped += size;
        Ok(())
    }

    /// Rule 22h: maps, at `size` bytes of unmapped whole pages at `address`, the handles mapped
    /// at `source` (whole mapped pages of a reservation with the same page), with
    /// `cuMemMap` per page and one `cuMemSetAccess`. No memory is created. All or nothing: on
    /// failure the mappings made by this call are undone.
    pub(super) fn vmm_alias(
        &mut self,
        address: u64,
        source: u64,
        size: u64,
    ) -> Result<(), BackendError> {
        let target = self
            .vmm
            .pages_of(address, size)
            .filter(|(_, _, pages)| pages.is_empty());
        let from = self
            .vmm
            .pages_of(source, size)
            .filter(|(_, page, pages)| pages.len() as u64 == size / page);
        let (Some((base, page, _)), Some((_, source_page, handles))) = (target, from) else {
            return Err(vmm_refused(
                "cuMemMap",
                address,
                size,
                "is not whole unmapped pages of one reservation, aliasing whole mapped pages of one reservation of this backend",
            ));
        };
        if source_page != page {
            return Err(vmm_refused(
                "cuMemMap",
                address,
                size,
                "has another page size than the pages it would alias",
            ));
        }
        if !self.vmm.big_touching(source, size).is_empty() {
            // Rule 19j: the driver maps a handle only whole (CUDA_ERROR_NOT_SUPPORTED for an
            // offset into it).
            return Err(vmm_refused(
                "cuMemMap",
                source,
                size,
                "lies in a handle of several pages, which maps only whole",
            ));
        }
        let page_bytes = page as usize;
        self.bind()?;
        let mut made: Vec<Page> = Vec::with_capacity(handles.len());
        let mut failure = None;
        for (i, &(_, handle)) in handles.iter().enumerate() {
            let at = address + i as u64 * page;
            // SAFETY: `handle` is a live handle of this backend (it is mapped at `source`, so
            // not released), of exactly `page` bytes; `at` is a page-aligned, unmapped page of
            // a reservation of this backend (checked against the bookkeeping above). Mapping a
            // handle a second time is allowed by the driver and leaves the first mapping as
            // it is.
            if let Err(e) = unsafe { sys::cuMemMap(at, page_bytes, 0, handle, 0) }.result() {
                failure = Some(device_error("cuMemMap", e));
                break;
            }
            made.push((at, handle));
        }
        if failure.is_none() {
            let access = read_write_for(self.ctx.ordinal());
            // SAFETY: every page of [address, address + size) was just mapped (above);
            // `access` is a live, fully initialised descriptor, and the count is 1.
            if let Err(e) =
                unsafe { sys::cuMemSetAccess(address, size as usize, &access, 1) }.result()
            {
                failure = Some(device_error("cuMemSetAccess", e));
            }
        }
        if let Some(e) = failure {
            for &(at, _) in &made {
                // SAFETY: mapped by this call just now, never entered the bookkeeping, and
                // nothing was handed out in it; the handle stays mapped at `source`, so it is
                // not released.
                let _ = unsafe { sys::cuMemUnmap(at, page_bytes) };
            }
            return Err(e);
        }
        for &(_, handle) in &made {
            *self.vmm.mappings.entry(handle).or_insert(0) += 1;
        }
        if let Some(r) = self.vmm.reservations.get_mut(&base) {
            r.pages.extend(made);
        }
        Ok(())
    }

    pub(super) fn vmm_unmap(
        &mut self,
        address: u64,
        size: u64,
        stream: StreamId,
    ) -> Result<(), BackendError> {
        let (base, page, pages) = self
            .vmm
            .pages_of(address, size)
            .filter(|(_, page, pages)| pages.len() as u64 == size / page)
            .ok_or_else(|| {
                vmm_refused(
                    "cuMemUnmap",
                    address,
                    size,
                    "is not whole mapped pages of one reservation of this backend",
                )
            })?;
        if self
            .vmm
            .big_touching(address, size)
            .iter()
            .any(|&(a, b)| a < address || a + b > address + size)
        {
            // Rule 19j: the driver unmaps a mapping only whole (CUDA_ERROR_INVALID_VALUE).
            return Err(vmm_refused(
                "cuMemUnmap",
                address,
                size,
                "cuts the mapping of a handle of several pages",
            ));
        }
        let mappings = self.vmm.mappings_of(&pages, page);
        // The range's blocks are used on its stream only (uses on other streams were recorded
        // and waited for before the blocks came back free): wait for that stream.
        self.synchronize_stream(stream)?;
        for (i, &(at, bytes, _)) in mappings.iter().enumerate() {
            // SAFETY: `at` and `bytes` are exactly one mapping this backend made (checked
            // against the bookkeeping above: a page, or a whole handle of several pages), and
            // the work queued on the range's stream is done.
            if let Err(e) = unsafe { sys::cuMemUnmap(at, bytes as usize) }.result() {
                // Put back the mappings already unmapped, so that nothing is unmapped.
                self.remap(&mappings[..i]);
                return Err(device_error("cuMemUnmap", e));
            }
        }
        for &(at, bytes, handle) in &mappings {
            let left = match self.vmm.mappings.get_mut(&handle) {
                Some(n) => {
                    *n = n.saturating_sub(1);
                    *n
                }
                None => 0,
            };
            self.vmm.big.remove(&at);
            if left == 0 {
                self.vmm.mappings.remove(&handle);
                // SAFETY: each handle came from cuMemCreate for one of these mappings; its
                // last mapping was removed above, and it leaves the bookkeeping here (released
                // once), so its memory goes back to the device.
                let _ = unsafe { sys::cuMemRelease(handle) };
                self.vmm.mapped -= bytes;
            }
        }
        if let Some(r) = self.vmm.reservations.get_mut(&base) {
            for (at, _) in &pages {
                r.pages.remove(at);
            }
        }
        Ok(())
    }

    /// Maps again pages unmapped by a failing [`Backend::unmap`](crate::backend::Backend::unmap)
    /// (their handles still held), with access for this device. Best effort: the driver has
    /// already failed once.
    fn remap(&self, mappings: &[(u64, u64, sys::CUmemGenericAllocationHandle)]) {
        let access = read_write_for(self.ctx.ordinal());
        for &(at, bytes, handle) in mappings {
            let bytes = bytes as usize;
            // SAFETY: `at` was mapped with `handle` (still live: not released) until just now,
            // so it is reserved, unmapped, and `handle` holds exactly `bytes` bytes.
            if unsafe { sys::cuMemMap(at, bytes, 0, handle, 0) }
                .result()
                .is_ok()
            {
                // SAFETY: the range was just mapped; `access` is a live descriptor, count 1.
                let _ = unsafe { sys::cuMemSetAccess(at, bytes, &access, 1) };
            }
        }
    }

    /// Unmaps and releases every page and gives back every reservation (the backend is
    /// dropped; the caller synchronised the context).
    pub(super) fn release_virtual_memory(&mut self) {
        let reservations = std::mem::take(&mut self.vmm.reservations);
        let big = std::mem::take(&mut self.vmm.big);
        for r in reservations.values() {
            let mut skip_to = 0u64;
            for &at in r.pages.keys() {
                if at < skip_to {
                    continue;
                }
                // Rule 19j: a handle of several pages is one mapping, unmapped whole.
                let bytes = big.get(&at).copied().unwrap_or(r.page);
                skip_to = at + bytes;
                // SAFETY: every mapping is this backend's (its bookkeeping was drained above,
                // so each is unmapped once, whole); the context was synchronised and no block
                // can be in use (every user-held block keeps the allocator, and with it this
                // backend, alive).
                let _ = unsafe { sys::cuMemUnmap(at, bytes as usize) };
            }
        }
        for (handle, _) in std::mem::take(&mut self.vmm.mappings) {
            // SAFETY: each live handle once (drained from the bookkeeping), all its mappings
            // unmapped above, so its memory goes back to the device.
            let _ = unsafe { sys::cuMemRelease(handle) };
        }
        for (base, r) in reservations {
            // SAFETY: a reservation cuMemAddressReserve made, drained from the bookkeeping
            // (freed once), with nothing mapped in it any more.
            let _ = unsafe { sys::cuMemAddressFree(base, r.size as usize) };
        }
        self.vmm.mapped = 0;
    }
}

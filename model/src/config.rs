//! The model's settings and its errors.

use thiserror::Error;

/// Requests above this many bytes fail with [`ModelError::TooLarge`] (rule 1).
pub const MAX_ALLOC_SIZE: u64 = 1 << 60;

const MIB: u64 = 1 << 20;

/// Rule 19: the large pool's page unless `expandable_page_mb` is set (20 MiB, PyTorch's).
pub const DEFAULT_EXPANDABLE_PAGE: u64 = 20 * MIB;

/// The settings of a [`Model`](crate::Model) and of its simulated device.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// The simulated device's capacity in bytes.
    pub capacity: u64,
    /// Blocks of at least this size are never split and are not handed out for smaller
    /// requests; `u64::MAX` means unlimited (PyTorch's default). PyTorch only accepts values
    /// above 20 MiB.
    pub max_split_size: u64,
    /// How much larger than a request of at least `max_split_size` a cached block may be and
    /// still be handed out (rule 6). PyTorch's default is 20 MiB.
    pub max_non_split_rounding_size: u64,
    /// The fraction of the allowed maximum above which garbage collection runs (rule 12);
    /// `0.0` turns it off. It only runs while a memory fraction is set.
    pub garbage_collection_threshold: f64,
    /// Power-of-two divisions for rounding (rule 2): entry `i` covers sizes in
    /// `[2^(20+i), 2^(21+i))`, the first and last entries also below and above. All zero
    /// turns it off.
    pub roundup_power2_divisions: [u64; 16],
    /// A memory fraction set at start, as by [`Model::set_memory_fraction`](crate::Model::set_memory_fraction).
    pub memory_fraction: Option<f64>,
    /// Addresses the simulated device hands out first, in order, one per successful device
    /// allocation.
    pub address_script: Vec<u64>,
    /// How many freed blocks each thread keeps for itself (rule 17, cachalot's own policy);
    /// `0`, PyTorch's behaviour, turns thread caches off.
    pub thread_cache_blocks: u32,
    /// Rule 19: memory comes from expandable segments — address-space ranges, one per pool
    /// and stream, whose pages are mapped and unmapped as needed — instead of one device
    /// allocation per segment. PyTorch's `expandable_segments:True`; off by default.
    pub expandable_segments: bool,
    /// Rule 19: the page of a large-pool range, in bytes (the small pool's is always 2 MiB).
    /// cachalot's `expandable_page_mb`: an even number of MiB in \[2, 1024\]; 20 MiB,
    /// PyTorch's page, by default.
    pub expandable_page: u64,
    /// Rule 20 (cachalot's own policy): reclaim before growing, keeping reserved bytes within
    /// this fraction of the requested high-water mark. A decimal in \[0, 1\]; `None` (the
    /// default) turns reclaim off. It acts only under expandable segments.
    pub reclaim_headroom: Option<f64>,
    /// Rule 22 (cachalot's own policy): pages move between places of a range by being mapped
    /// a second time (lent blocks, re-homing, borrowing instead of rule 20's unmapping).
    /// `page_aliasing:True`; off by default. It acts only under expandable segments with a
    /// `reclaim_headroom` set.
    pub page_aliasing: bool,
    /// Rule 23 (cachalot's own policy): stitched views — at rule 20's over-limit point a large
    /// request gets a view, a reservation of its own mapping free pages where they are, kept
    /// and reused when the same request comes again. `page_stitching:True`; off by default.
    /// It acts only under expandable segments with a `reclaim_headroom` set, and is refused
    /// beside `page_aliasing`.
    pub page_stitching: bool,
    /// Rule 19j (cachalot's own policy): a map step of at least this many bytes is backed by
    /// one handle of all its bytes, a smaller one by one handle per page; `None` (the default,
    /// PyTorch's way): one handle per page always. cachalot's `expandable_handle_mb`: an
    /// integer number of MiB in \[2, 1048576\], refused beside `page_aliasing`.
    pub expandable_handle: Option<u64>,
}

impl ModelConfig {
    /// PyTorch's default settings on a device of `capacity` bytes: no split limit, 20 MiB
    /// non-split rounding, no garbage collection, no power-of-two rounding, no memory
    /// fraction, no address script, no thread caches, no expandable segments (and, should
    /// they be turned on, PyTorch's 20 MiB large page, no reclaim, no page aliasing and no
    /// page stitching).
    pub fn pytorch_defaults(capacity: u64) -> Self {
        ModelConfig {
            capacity,
            max_split_size: u64::MAX,
            max_non_split_rounding_size: 20 << 20,
            garbage_collection_threshold: 0.0,
            roundup_power2_divisions: [0; 16],
            memory_fraction: None,
            address_script: Vec::new(),
            thread_cache_blocks: 0,
            expandable_segments: false,
            expandable_page: DEFAULT_EXPANDABLE_PAGE,
            reclaim_headroom: None,
            page_aliasing: false,
            page_stitching: false,
            expandable_handle: None,
        }
    }

    /// Whether `expandable_page` is one rule 19 allows: an even number of MiB in
    /// \[2 MiB, 1024 MiB\].
    pub fn expandable_page_is_valid(&self) -> bool {
        (2 * MIB..=1024 * MIB).contains(&self.expandable_page)
            && self.expandable_page.is_multiple_of(2 * MIB)
    }

    /// Whether rules 22 and 23 are not asked for together: rule 23 refuses `page_aliasing`
    /// beside `page_stitching`.
    pub fn stitching_is_valid(&self) -> bool {
        !(self.page_stitching && self.page_aliasing)
    }

    /// Whether `expandable_handle` is one rule 19j allows: unset, or a whole number of MiB in
    /// \[2 MiB, 2^20 MiB\], and not beside `page_aliasing`.
    pub fn expandable_handle_is_valid(&self) -> bool {
        self.expandable_handle.is_none_or(|t| {
            (2 * MIB..=(1 << 20) * MIB).contains(&t) && t.is_multiple_of(MIB) && !self.page_aliasing
        })
    }

    /// Whether `reclaim_headroom` is one rule 20 allows: unset, or within \[0, 1\] (not NaN).
    pub fn reclaim_headroom_is_valid(&self) -> bool {
        self.reclaim_headroom
            .is_none_or(|h| (0.0..=1.0).contains(&h))
    }
}

/// Why an operation of the model failed. A failed operation may still have changed the state
/// (an out-of-memory malloc has released cached segments on its way).
#[derive(Clone, Debug, PartialEq, Error)]
pub enum ModelError {
    /// No block could be found or made for the request (rule 7).
    #[error(
        "out of memory: tried to allocate {alloc_size} bytes; device capacity {capacity} bytes, \
         {device_free} bytes free; {allowed:?} bytes allowed; {allocated} bytes allocated; \
         {reserved_unallocated} bytes reserved but unallocated"
    )]
    OutOfMemory {
        /// The size of the segment the allocator tried to allocate (rule 4).
        alloc_size: u64,
        /// The device's capacity.
        capacity: u64,
        /// The device's free memory at the time of the error: capacity − used.
        device_free: u64,
        /// `⌊fraction × capacity⌋` when a memory fraction is set.
        allowed: Option<u64>,
        /// `allocated_bytes.all.current`.
        allocated: u64,
        /// `reserved_bytes.all.current − allocated_bytes.all.current`.
        reserved_unallocated: u64,
    },
    /// The request is above [`MAX_ALLOC_SIZE`] (rule 1).
    #[error("request of {requested} bytes exceeds the largest allocation (2^60 bytes)")]
    TooLarge {
        /// The requested size.
        requested: u64,
    },
    /// The address is not that of a live allocation (rule 15, `record_stream`).
    #[error("address {address:#x} is not a live allocation")]
    UnknownAddress {
        /// The address given.
        address: u64,
    },
    /// A memory fraction outside `[0, 1]`, or NaN (rule 16).
    #[error("invalid memory fraction {fraction}: must be within [0, 1]")]
    InvalidFraction {
        /// The fraction given.
        fraction: f64,
    },
    /// A segment to adopt that the policy could not have made, or that overlaps a segment
    /// held (rule 18a). Nothing changed.
    #[error("invalid adoption: {reason}")]
    InvalidAdoption {
        /// Which check failed.
        reason: String,
    },
    /// A run-time settings change (rule 24) that changes more than the four run-time values.
    /// Nothing changed.
    #[error(
        "only max_split_size, max_non_split_rounding_size, garbage_collection_threshold and roundup_power2_divisions change at run time"
    )]
    UnsupportedChange,
    /// The device has no room for a segment to adopt (rule 18b). Nothing changed.
    #[error("cannot adopt {size} bytes: the device has {device_free} bytes free")]
    AdoptionOutOfMemory {
        /// The segment's size.
        size: u64,
        /// The device's free memory.
        device_free: u64,
    },
}

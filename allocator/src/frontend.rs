//! The thread-safe front end: one allocator per device, shared by every thread.
//!
//! The one rule: the front end adds sharing, never policy. Every decision is made by the
//! [`CachingCore`] behind it, so the reference model checks the front end's decisions too.

use crate::backend::{Backend, StreamId};
use crate::error::Error;
use crate::policy::{CachingCore, SegmentInfo};
use crate::settings::Settings;
use crate::stats::Stats;
use crate::sync::{Arc, Mutex, lock};

/// A caching allocator for one device: `Send + Sync`, and cheap to clone (clones share the
/// cache).
///
/// ```
/// use cachalot::{Allocator, Settings, SimDevice, StreamId};
///
/// let alloc = Allocator::new(SimDevice::new(1 << 30), Settings::default()).unwrap();
/// let worker = alloc.clone();
/// std::thread::spawn(move || {
///     let p = worker.malloc(4096, StreamId(0)).unwrap();
///     worker.free(p).unwrap();
/// })
/// .join()
/// .unwrap();
/// assert_eq!(alloc.stats().allocation.all.allocated, 1);
/// ```
pub struct Allocator<B: Backend> {
    shared: Arc<Mutex<CachingCore<B>>>,
}

impl<B: Backend> Clone for Allocator<B> {
    fn clone(&self) -> Self {
        Allocator {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<B: Backend> std::fmt::Debug for Allocator<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Allocator").finish_non_exhaustive()
    }
}

impl<B: Backend> Allocator<B> {
    /// An allocator over `backend` with `settings`.
    pub fn new(backend: B, settings: Settings) -> Result<Self, Error> {
        Ok(Self::from_core(CachingCore::new(backend, settings)?))
    }

    /// Wraps an existing core.
    pub fn from_core(core: CachingCore<B>) -> Self {
        Allocator {
            shared: Arc::new(Mutex::new(core)),
        }
    }

    /// Allocates `size` bytes for use on `stream`; see [`CachingCore::malloc`].
    pub fn malloc(&self, size: u64, stream: StreamId) -> Result<u64, Error> {
        lock(&self.shared).malloc(size, stream)
    }

    /// Frees the allocation at `address`; see [`CachingCore::free`].
    pub fn free(&self, address: u64) -> Result<(), Error> {
        lock(&self.shared).free(address)
    }

    /// Marks the allocation at `address` as used on `stream`; see
    /// [`CachingCore::record_stream`].
    pub fn record_stream(&self, address: u64, stream: StreamId) -> Result<(), Error> {
        lock(&self.shared).record_stream(address, stream)
    }

    /// Gives every whole free segment back to the device.
    pub fn empty_cache(&self) -> Result<(), Error> {
        lock(&self.shared).empty_cache()
    }

    /// Caps reserved memory at `fraction` of the device's capacity.
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<(), Error> {
        lock(&self.shared).set_memory_fraction(fraction)
    }

    /// A copy of the statistics.
    pub fn stats(&self) -> Stats {
        lock(&self.shared).stats().clone()
    }

    /// Sets every peak statistic to its current value.
    pub fn reset_peak_stats(&self) {
        lock(&self.shared).reset_peak_stats()
    }

    /// The segments and their blocks.
    pub fn segments(&self) -> Vec<SegmentInfo> {
        lock(&self.shared).segments()
    }

    /// Checks the core's invariants.
    pub fn check_invariants(&self) -> Result<(), String> {
        lock(&self.shared).check_invariants()
    }

    /// Runs `f` with exclusive access to the core (and through it, the backend).
    pub fn with_core<R>(&self, f: impl FnOnce(&mut CachingCore<B>) -> R) -> R {
        f(&mut lock(&self.shared))
    }
}

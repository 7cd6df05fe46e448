//! Synchronisation primitives: the only module that names `std::sync`.
//!
//! The one rule: everything concurrent in cachalot goes through these re-exports, which become
//! loom's instrumented types under `cfg(loom)`, so the loom models explore the real code. The
//! thread-local storage of the thread caches goes through here too: loom's `thread_local!`
//! gives each modelled thread its own value and drops it when the thread ends.

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::{Arc, Mutex, MutexGuard};
#[cfg(not(loom))]
pub(crate) use std::thread_local;

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::{Arc, Mutex, MutexGuard};
#[cfg(loom)]
pub(crate) use loom::thread_local;

/// One turn of a wait for a flag another thread holds briefly (a thread cache's, see
/// `thread_cache::Local::hold`): a spin hint and a yield, so that a holder that was
/// descheduled gets the core back (the flag is rarely wanted by two threads at once). Under loom, a yield: the model then runs another
/// thread.
#[inline]
pub(crate) fn spin_wait() {
    #[cfg(not(loom))]
    {
        std::hint::spin_loop();
        std::thread::yield_now();
    }
    #[cfg(loom)]
    loom::thread::yield_now();
}

/// A setting read once per call on the front end's fast paths and changed only under the
/// shared lock, by calls the loom models never make (history recording switching thread caches
/// off and on): the standard library's atomic under loom too, so the models explore exactly
/// the interleavings of the allocator's own synchronisation, no more.
pub(crate) type SettingCell = std::sync::atomic::AtomicUsize;

/// A backtrace recorded in the history, shared (never changed) between the history and the
/// snapshots taken of it, so symbols are resolved outside the allocator's lock. The standard
/// library's `Arc` under loom too: it only counts references to immutable data.
pub(crate) type SharedBacktrace = std::sync::Arc<std::backtrace::Backtrace>;

/// Locks a mutex, carrying on through poisoning: the core's state is updated in sub-steps that
/// each leave it consistent, so a panic in another thread never leaves it half-changed.
#[inline]
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    #[cfg(not(loom))]
    {
        m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
    #[cfg(loom)]
    {
        m.lock().unwrap()
    }
}

/// The standard library's own types, for the CUDA layer: cudarc hands out `std::sync::Arc`s,
/// and code that talks to the driver runs on real threads only (loom models the front end and
/// the policy over the simulated device, never the driver).
#[cfg(feature = "cuda")]
pub(crate) mod real {
    pub(crate) use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
    pub(crate) use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, Weak};
}

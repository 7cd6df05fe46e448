//! Synchronisation primitives: the only module that names `std::sync`.
//!
//! The one rule: everything concurrent in cachalot goes through these re-exports, which become
//! loom's instrumented types under `cfg(loom)`, so the loom models explore the real code.

#[cfg(not(loom))]
pub(crate) use std::sync::{Arc, Mutex, MutexGuard};

#[cfg(loom)]
pub(crate) use loom::sync::{Arc, Mutex, MutexGuard};

/// Locks a mutex, carrying on through poisoning: the core's state is updated in sub-steps that
/// each leave it consistent, so a panic in another thread never leaves it half-changed.
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

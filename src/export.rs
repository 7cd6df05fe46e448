//! Export: the allocator's state and history as a PyTorch memory snapshot.
//!
//! The one rule: there is one snapshot builder and one writer, in the allocator crate
//! ([`cachalot::snapshot`]), shared by `cachalot replay --snapshot-out` and by Rust programs
//! that dump their own allocator's history; this module names them where the tools used to
//! have them.
//!
//! ```
//! use cachalot::{CachingCore, Settings, SimDevice, StreamId};
//! use cachalot_tools::export::snapshot_of;
//!
//! let mut core = CachingCore::new(SimDevice::new(1 << 30), Settings::pytorch()).unwrap();
//! core.record_history(Some(usize::MAX));
//! let a = core.malloc(4096, StreamId(0)).unwrap();
//! core.free(a).unwrap();
//! let snap = snapshot_of(&core.segments(), &core.history(), core.settings(), 0);
//! assert_eq!(snap.segments.len(), 1);
//! assert_eq!(snap.traces[0].entries.len(), 4); // segment_alloc, alloc, free_requested, free_completed
//! ```

pub use cachalot::snapshot::{
    allocator_settings, block_status, live_snapshot, segment_states, snapshot_of, trace_entries,
};

//! The streams the CUDA layer has been shown: which handles events may be recorded on, and
//! which streams are kept alive while the allocator may still hold blocks for them.
//!
//! The one rule: the registry is shared (an `Arc`) between the [`CudaBackend`](super::CudaBackend),
//! which asks it before recording an event, and the [`CudaAllocator`](super::CudaAllocator), which
//! shows it each allocation and use stream, so that the allocator keeps streams alive without
//! reaching into the policy core. Its lock is taken on its own or inside the core's lock (when
//! the core records an event), never the other way round.

use cudarc::driver::CudaStream;
use rustc_hash::{FxHashMap, FxHashSet};

use crate::backend::StreamId;
use crate::policy::SegmentInfo;
use crate::sync::real::{Arc, AtomicU64, Mutex, MutexGuard, Ordering, PoisonError};

/// The legacy default stream's handle (`CU_STREAM_LEGACY` is 0x1; cudarc's default stream is
/// the null handle) and the per-thread default stream's (`CU_STREAM_PER_THREAD`). These are
/// valid in every context and never destroyed.
const BUILTIN_STREAMS: [u64; 3] = [0x0, 0x1, 0x2];

/// The [`StreamId`] a cudarc stream has in cachalot: its `CUstream` handle's value.
pub fn stream_id(stream: &CudaStream) -> StreamId {
    StreamId(stream.cu_stream() as usize as u64)
}

/// One known stream.
struct Entry<S> {
    /// `Some` keeps the stream alive (it was allocated on, or recorded explicitly); `None`
    /// only lets events be recorded on it while its owner keeps it alive.
    stream: Option<Arc<S>>,
    /// The registry's generation when the stream was last retained or noted.
    seen_at: u64,
}

/// The streams of one device's allocator (`S` is cudarc's stream; the unit tests use another
/// type, as they run without a GPU).
///
/// A prune ([`StreamRegistry::begin_prune`], then [`StreamRegistry::prune`] with the segments
/// read after it) forgets the streams that hold no segment and that nobody else keeps alive,
/// except those retained since the prune began: a thread that retained a stream and then
/// allocated a segment the prune's snapshot missed either retained it after the prune began
/// (kept), or sees the generation move and retains it again after its allocation.
pub(crate) struct StreamRegistry<S = CudaStream> {
    /// Bumped by every prune.
    generation: AtomicU64,
    streams: Mutex<FxHashMap<u64, Entry<S>>>,
}

impl<S> StreamRegistry<S> {
    /// An empty registry.
    pub(crate) fn new() -> StreamRegistry<S> {
        StreamRegistry {
            generation: AtomicU64::new(0),
            streams: Mutex::new(FxHashMap::default()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, FxHashMap<u64, Entry<S>>> {
        self.streams.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The current generation: it changes whenever a prune begins.
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Knows `stream`, whose id is `id`, and keeps it alive until a prune finds it unused;
    /// returns the generation it was retained in.
    pub(crate) fn retain(&self, id: StreamId, stream: &Arc<S>) -> u64 {
        let mut streams = self.lock();
        let now = self.generation();
        let entry = streams.entry(id.0).or_insert(Entry {
            stream: None,
            seen_at: now,
        });
        if entry.stream.is_none() {
            entry.stream = Some(Arc::clone(stream));
        }
        entry.seen_at = now;
        now
    }

    /// Knows the stream `id` without keeping it alive: events may be recorded on it until a
    /// prune forgets it.
    pub(crate) fn note(&self, id: StreamId) {
        let mut streams = self.lock();
        let now = self.generation();
        streams
            .entry(id.0)
            .or_insert(Entry {
                stream: None,
                seen_at: now,
            })
            .seen_at = now;
    }

    /// Whether events may be recorded on `stream`: a built-in stream or one shown to the
    /// registry and not forgotten since.
    pub(crate) fn knows(&self, stream: StreamId) -> bool {
        BUILTIN_STREAMS.contains(&stream.0) || self.lock().contains_key(&stream.0)
    }

    /// Starts a prune: a new generation, returned for [`StreamRegistry::prune`].
    pub(crate) fn begin_prune(&self) -> u64 {
        let _streams = self.lock();
        self.generation.fetch_add(1, Ordering::AcqRel) + 1
    }

    /// Forgets the streams that hold no segment in `segments` (read after
    /// [`StreamRegistry::begin_prune`] returned `since`), that nobody else keeps alive, and
    /// that were not retained or noted in generation `since` or later.
    pub(crate) fn prune(&self, segments: &[SegmentInfo], since: u64) {
        let used: FxHashSet<u64> = segments.iter().map(|s| s.stream.0).collect();
        self.lock().retain(|id, e| {
            used.contains(id)
                || e.seen_at >= since
                || e.stream.as_ref().is_some_and(|s| Arc::strong_count(s) > 1)
        });
    }

    /// How many streams are known (built-in ones aside).
    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn segment_on(stream: u64) -> SegmentInfo {
        SegmentInfo {
            address: 0x1000_0000,
            size: 2 << 20,
            stream: StreamId(stream),
            pool: crate::sizes::Pool::Small,
            expandable: false,
            blocks: Vec::new(),
        }
    }

    #[test]
    fn built_in_streams_are_known_and_others_once_shown() {
        let r: StreamRegistry<u32> = StreamRegistry::new();
        assert!(r.knows(StreamId(0)) && r.knows(StreamId(1)) && r.knows(StreamId(2)));
        assert!(!r.knows(StreamId(7)));
        r.note(StreamId(7));
        assert!(r.knows(StreamId(7)));
        r.retain(StreamId(9), &Arc::new(9));
        assert!(r.knows(StreamId(9)));
        assert_eq!(r.len(), 2);
    }

    #[test]
    fn a_prune_forgets_unused_streams_nobody_holds_and_keeps_the_rest() {
        let r: StreamRegistry<u32> = StreamRegistry::new();
        let held = Arc::new(13);
        r.retain(StreamId(11), &Arc::new(11)); // only the registry holds it, no segment: forgotten
        r.retain(StreamId(12), &Arc::new(12)); // holds a segment: kept
        r.retain(StreamId(13), &held); // its owner still holds it: kept
        r.note(StreamId(14)); // noted, unused: forgotten
        let since = r.begin_prune();
        r.prune(&[segment_on(12)], since);
        assert!(!r.knows(StreamId(11)));
        assert!(r.knows(StreamId(12)));
        assert!(r.knows(StreamId(13)));
        assert!(!r.knows(StreamId(14)));
    }

    #[test]
    fn a_stream_retained_while_a_prune_runs_survives_it() {
        let r: StreamRegistry<u32> = StreamRegistry::new();
        let before = r.generation();
        r.retain(StreamId(5), &Arc::new(5));
        // Another thread's empty_cache begins its prune and reads the segments...
        let since = r.begin_prune();
        assert_ne!(r.generation(), before);
        // ...while this thread, seeing the generation move after its allocation, retains the
        // stream again: the prune's snapshot, which missed the new segment, keeps it.
        assert_eq!(r.retain(StreamId(5), &Arc::new(5)), since);
        r.prune(&[], since);
        assert!(r.knows(StreamId(5)));
        // The next prune, with nothing retained since, forgets it.
        let since = r.begin_prune();
        r.prune(&[], since);
        assert!(!r.knows(StreamId(5)));
    }
}

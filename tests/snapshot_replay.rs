//! Trace → replay program conversion on hand-built traces.

use cachalot_tools::replay::{ReplayOp, ReplayOptions, replay_ops, replay_ops_with};
use cachalot_tools::snapshot::{Action, DeviceTrace, StackId, TraceEntry};

const MIB: u64 = 1 << 20;

fn e(action: Action, addr: u64, size: u64, stream: u64) -> TraceEntry {
    TraceEntry {
        action,
        addr,
        size,
        stream,
        time_us: 0,
        stack: StackId::EMPTY,
    }
}

fn trace(entries: Vec<TraceEntry>) -> DeviceTrace {
    DeviceTrace { device: 0, entries }
}

use Action::*;
use ReplayOp::{Alloc as A, EmptyCache, FreeCompleted as FC, FreeRequested as FR};

#[test]
fn frees_match_allocations_by_address() {
    let t = trace(vec![
        e(SegmentAlloc, 0x1000_0000, 2 * MIB, 0),
        e(Alloc, 0x1000_0000, 100, 0),
        e(Alloc, 0x1000_0200, 700, 0),
        e(FreeRequested, 0x1000_0000, 100, 0),
        e(FreeCompleted, 0x1000_0000, 100, 0),
        e(FreeRequested, 0x0dea_d000, 64, 0), // allocated before recording began
        e(FreeCompleted, 0x0dea_d000, 64, 0),
        e(Alloc, 0x1000_0000, 50, 0),
    ]);
    let (p, r) = replay_ops_with(&t, &ReplayOptions::default());
    assert_eq!(
        p.ops,
        vec![
            A {
                id: 0,
                size: 100,
                stream: 0
            },
            A {
                id: 1,
                size: 700,
                stream: 0
            },
            FR { id: 0 },
            FC { id: 0 },
            A {
                id: 2,
                size: 50,
                stream: 0
            },
        ]
    );
    assert_eq!(p.segment_addresses, vec![0x1000_0000]);
    assert_eq!(r.unmatched_frees, 2);
    assert_eq!(r.live_at_end, 2);
    assert_eq!(r.deferred_frees, 0);
}

#[test]
fn cross_stream_frees_complete_later() {
    let side = 0x55;
    let t = trace(vec![
        e(SegmentAlloc, 0x2000_0000, 2 * MIB, side),
        e(Alloc, 0x2000_0000, 4096, side),
        e(FreeRequested, 0x2000_0000, 4096, side),
        e(Alloc, 0x2000_1000, 4096, side),
        e(FreeCompleted, 0x2000_0000, 4096, side),
        e(FreeRequested, 0x2000_1000, 4096, side),
        e(FreeCompleted, 0x2000_1000, 4096, side),
        e(Snapshot, 0, 0, 0),
    ]);
    let (p, r) = replay_ops_with(&t, &ReplayOptions::default());
    assert_eq!(
        p.ops,
        vec![
            A {
                id: 0,
                size: 4096,
                stream: side
            },
            FR { id: 0 },
            A {
                id: 1,
                size: 4096,
                stream: side
            },
            FC { id: 0 },
            FR { id: 1 },
            FC { id: 1 },
        ]
    );
    assert_eq!(r.deferred_frees, 1);
    assert_eq!(r.ignored_entries, 1);
    assert_eq!(r.live_at_end, 0);
}

#[test]
fn a_run_of_segment_frees_is_one_empty_cache() {
    let t = trace(vec![
        e(SegmentAlloc, 0x1000_0000, 2 * MIB, 0),
        e(SegmentAlloc, 0x3000_0000, 20 * MIB, 0),
        e(SegmentFree, 0x1000_0000, 2 * MIB, 0),
        e(SegmentFree, 0x3000_0000, 20 * MIB, 0),
        e(SegmentAlloc, 0x1000_0000, 2 * MIB, 0),
        e(Alloc, 0x1000_0000, 512, 0),
        e(SegmentFree, 0x1000_0000, 2 * MIB, 0),
    ]);
    let p = replay_ops(&t);
    // The first run could have served the 512-byte request from its free 2 MiB small segment,
    // so PyTorch would not have released it to make room: it was the program's empty_cache().
    assert_eq!(
        p.ops,
        vec![
            EmptyCache,
            A {
                id: 0,
                size: 512,
                stream: 0
            },
            EmptyCache
        ]
    );
    assert_eq!(
        p.segment_addresses,
        vec![0x1000_0000, 0x3000_0000, 0x1000_0000]
    );
}

/// segment_alloc 100 MiB ×2 (both freed, cached), then a 300 MiB request that does not fit
/// beside them; `later_peak` adds a later, larger reservation.
fn retry_trace(later_peak: bool) -> DeviceTrace {
    let mut v = vec![
        e(SegmentAlloc, 0x1_0000_0000, 100 * MIB, 0),
        e(Alloc, 0x1_0000_0000, 100 * MIB, 0),
        e(SegmentAlloc, 0x2_0000_0000, 100 * MIB, 0),
        e(Alloc, 0x2_0000_0000, 100 * MIB, 0),
        e(FreeRequested, 0x1_0000_0000, 100 * MIB, 0),
        e(FreeCompleted, 0x1_0000_0000, 100 * MIB, 0),
        e(FreeRequested, 0x2_0000_0000, 100 * MIB, 0),
        e(FreeCompleted, 0x2_0000_0000, 100 * MIB, 0),
        e(SegmentFree, 0x1_0000_0000, 100 * MIB, 0),
        e(SegmentFree, 0x2_0000_0000, 100 * MIB, 0),
        e(SegmentAlloc, 0x3_0000_0000, 300 * MIB, 0),
        e(Alloc, 0x3_0000_0000, 300 * MIB, 0),
    ];
    if later_peak {
        v.push(e(SegmentAlloc, 0x4_0000_0000, 1024 * MIB, 0));
        v.push(e(Alloc, 0x4_0000_0000, 1024 * MIB, 0));
    }
    trace(v)
}

#[test]
fn a_release_that_made_room_for_the_next_allocation_is_the_allocators_own() {
    // 200 MiB held + 300 MiB > the 300 MiB peak: the device was full, PyTorch released its
    // cache inside the allocation and retried.
    let (p, r) = replay_ops_with(&retry_trace(false), &ReplayOptions::default());
    assert_eq!((r.internal_releases, r.empty_caches), (1, 0));
    assert!(!p.ops.contains(&EmptyCache));
    assert_eq!(p.segment_addresses.len(), 3);
}

#[test]
fn a_release_when_the_device_had_room_is_an_empty_cache() {
    // The same, but the process later held 1.3 GiB: 200 + 300 MiB would have fit, so nothing
    // forced the release.
    let (p, r) = replay_ops_with(&retry_trace(true), &ReplayOptions::default());
    assert_eq!((r.internal_releases, r.empty_caches), (0, 1));
    assert_eq!(p.ops.iter().filter(|op| **op == EmptyCache).count(), 1);
}

#[test]
fn a_release_of_a_segment_that_could_serve_the_request_is_an_empty_cache() {
    let mut t = retry_trace(false);
    // the request now fits in a released 100 MiB segment
    let last = t.entries.len() - 1;
    t.entries[last].size = 80 * MIB;
    let (_, r) = replay_ops_with(&t, &ReplayOptions::default());
    assert_eq!((r.internal_releases, r.empty_caches), (0, 1));
    // ... unless that segment was on another stream
    for entry in &mut t.entries[..10] {
        entry.stream = 7;
    }
    let (_, r) = replay_ops_with(&t, &ReplayOptions::default());
    assert_eq!((r.internal_releases, r.empty_caches), (1, 0));
    // ... or an oversize block refused to a request below max_split_size
    for entry in &mut t.entries[..10] {
        entry.stream = 0;
    }
    let options = ReplayOptions {
        max_split_size: Some(96 * MIB),
        reclaims: false,
    };
    let (_, r) = replay_ops_with(&t, &options);
    assert_eq!((r.internal_releases, r.empty_caches), (1, 0));
}

#[test]
fn a_release_before_an_oom_is_left_to_the_failing_allocation() {
    let mut t = retry_trace(false);
    t.entries.truncate(10);
    t.entries.push(e(Oom, 12345, 300 * MIB, 0));
    let (p, r) = replay_ops_with(&t, &ReplayOptions::default());
    // The release is PyTorch's own, inside the allocation that then failed: the failing
    // allocation is replayed and releases the cache by itself.
    assert_eq!(
        (
            r.internal_releases,
            r.empty_caches,
            r.failed_allocs,
            r.ignored_entries
        ),
        (1, 0, 1, 0)
    );
    assert!(matches!(p.ops.last(), Some(&A { size, stream: 0, .. }) if size == 300 * MIB));
}

/// A run of segment frees that leaves a default segment with no live block cached is no
/// `empty_cache()` (which would have given that one back too) and no allocation's own release
/// (no device allocation follows): a private pool's release (a `torch.cuda.MemPool` deleted).
/// Its segments' allocations go to a pool of their own, released there; a run that gives back
/// every idle segment stays an `empty_cache()`.
#[test]
fn a_release_that_leaves_an_idle_default_segment_is_a_private_pools() {
    let (pool_seg, default_seg) = (0x2000_0000, 0x3000_0000);
    let t = trace(vec![
        e(SegmentAlloc, default_seg, 2 * MIB, 0),
        e(Alloc, default_seg, 4096, 0),
        e(SegmentAlloc, pool_seg, 2 * MIB, 0),
        e(Alloc, pool_seg, 4096, 0),
        e(FreeRequested, default_seg, 4096, 0),
        e(FreeCompleted, default_seg, 4096, 0),
        e(FreeRequested, pool_seg, 4096, 0),
        e(FreeCompleted, pool_seg, 4096, 0),
        e(SegmentFree, pool_seg, 2 * MIB, 0),
        e(Alloc, default_seg, 4096, 0),
    ]);
    let (p, r) = replay_ops_with(&t, &ReplayOptions::default());
    assert_eq!(r.pool_releases, 1);
    assert_eq!(r.empty_caches, 0);
    assert_eq!(p.inferred_pools.len(), 1);
    assert_eq!(p.inferred_pools[0].entry, 8);
    assert_eq!(p.inferred_pools[0].allocations, 1);
    let pool_stream = cachalot_tools::replay::private_stream(p.inferred_pools[0].pool, 0);
    assert!(p.ops.contains(&A {
        id: 1,
        size: 4096,
        stream: pool_stream
    }));
    assert!(p.ops.contains(&ReplayOp::ReleaseStream {
        stream: pool_stream
    }));
    // Both idle segments given back: an empty_cache().
    let mut all = t.entries.clone();
    all.insert(9, e(SegmentFree, default_seg, 2 * MIB, 0));
    all.pop();
    let (p, r) = replay_ops_with(&trace(all), &ReplayOptions::default());
    assert_eq!((r.pool_releases, r.empty_caches), (0, 1));
    assert!(p.inferred_pools.is_empty() && p.ops.contains(&EmptyCache));
}

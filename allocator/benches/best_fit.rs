//! Best fit as the cache grows: one allocation that best fit serves from the free set, and its
//! free, with 10 to 10⁵ cached free blocks of many sizes on the request's stream
//! (`CachingCore`, PyTorch's settings, the simulated device). BENCHMARKS.md records the curve:
//! the free set is ordered by `(stream, size, address)`, so the cost should grow at most with
//! the logarithm of the number of free blocks.
//!
//! `cargo bench -p cachalot --bench best_fit`.

use std::hint::black_box;
use std::time::Duration;

use cachalot::{CachingCore, Settings, SimDevice, StreamId};
use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};

/// A core holding `n` free blocks of the small pool, each between two live 512 B guards (so
/// none merges with a neighbour), of sizes 1–1000 × 512 B, and the size to ask for: one of the
/// free blocks' sizes near the middle, which best fit then serves without a split.
fn core_with_free_blocks(n: usize) -> (CachingCore<SimDevice>, u64) {
    let mut core = CachingCore::new(SimDevice::new(1 << 40), Settings::pytorch()).unwrap();
    let mut holes = Vec::with_capacity(n);
    for i in 0..n {
        let size = 512 * (1 + (i as u64 * 7919) % 1000);
        holes.push(core.malloc(size, StreamId(0)).unwrap());
        core.malloc(512, StreamId(0)).unwrap();
    }
    for h in holes {
        core.free(h).unwrap();
    }
    (core, 512 * 500)
}

fn best_fit(c: &mut Criterion) {
    let mut g = c.benchmark_group("best_fit_pair");
    for n in [10usize, 100, 1_000, 10_000, 100_000] {
        let (mut core, size) = core_with_free_blocks(n);
        let before = core.stats().segment.all.current;
        g.bench_function(BenchmarkId::from_parameter(n), |b| {
            b.iter(|| {
                let p = core.malloc(black_box(size), StreamId(0)).unwrap();
                core.free(black_box(p)).unwrap();
            })
        });
        // Every allocation was served from the cache.
        assert_eq!(core.stats().segment.all.current, before);
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = best_fit
}
criterion_main!(benches);

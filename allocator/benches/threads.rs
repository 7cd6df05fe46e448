//! Cache-hit alloc+free pairs on the simulated device, per size class (512 B, 64 KiB, 2 MiB,
//! 64 MiB), on one thread and at 1, 2 and 4 threads, with
//! PyTorch's settings (one shared lock, every pair through the core) and cachalot's defaults
//! (thread caches, rule 17). BENCHMARKS.md records the figures.
//!
//! Every figure is **wall time per pair**: the threads start together, each does the same
//! number of pairs, and the wall time until the last one finishes is divided by the total
//! number of pairs. With one thread this is the time per pair; with more threads it falls as
//! the allocator scales and rises under contention (the anchor: PyTorch's 2.6–3.2 µs at 8).
//!
//! `cargo bench -p cachalot --bench threads`; add `-- --quick` for a short run.

use std::hint::black_box;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use cachalot::{Allocator, Settings, SimDevice, StreamId};
use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};

const MIB: u64 = 1 << 20;

fn allocator(settings: &Settings) -> Allocator<SimDevice> {
    Allocator::new(SimDevice::new(64 << 30), settings.clone()).unwrap()
}

/// One pair: a cache hit (after the first) and its free.
#[inline]
fn pair(a: &Allocator<SimDevice>, size: u64) {
    let p = a.malloc(black_box(size), StreamId(0)).unwrap();
    a.free(black_box(p)).unwrap();
}

/// Wall time for `threads` threads doing `iters` pairs each, divided by `threads`, so that
/// criterion's time per iteration is the wall time per pair.
fn run_threads(a: &Allocator<SimDevice>, threads: usize, iters: u64, size: u64) -> Duration {
    let start = Barrier::new(threads + 1);
    let end = Barrier::new(threads + 1);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                pair(a, size); // warm: the thread's first pair takes the slow path
                start.wait();
                for _ in 0..iters {
                    pair(a, size);
                }
                end.wait();
            });
        }
        start.wait();
        let t = Instant::now();
        end.wait();
        t.elapsed() / threads as u32
    })
}

fn settings() -> [(&'static str, Settings); 2] {
    [
        ("pytorch", Settings::pytorch()),
        ("cachalot", Settings::cachalot()),
    ]
}

/// The size classes of issue 25: a small-pool block, a larger small-pool one, a block of a
/// large segment, and a whole large segment.
const SIZES: [(&str, u64); 4] = [
    ("512B", 512),
    ("64KiB", 64 << 10),
    ("2MiB", 2 * MIB),
    ("64MiB", 64 * MIB),
];

fn one_thread(c: &mut Criterion) {
    let mut g = c.benchmark_group("pair_one_thread");
    for (name, s) in settings() {
        let a = allocator(&s);
        for (label, size) in SIZES {
            pair(&a, size);
            g.bench_function(BenchmarkId::new(name, label), |b| b.iter(|| pair(&a, size)));
        }
    }
    g.finish();
}

/// Wall time per pair at 1, 2 and 4 threads, each size class (this 2-core machine: more
/// threads than that measure oversubscription; 8 and 16 threads are the GPU host's figures).
fn many_threads(c: &mut Criterion) {
    for (label, size) in SIZES {
        let mut g = c.benchmark_group(format!("pair_wall_{label}"));
        for (name, s) in settings() {
            let a = allocator(&s);
            for threads in [1usize, 2, 4] {
                g.bench_function(BenchmarkId::new(name, threads), |b| {
                    b.iter_custom(|iters| run_threads(&a, threads, iters, size))
                });
            }
        }
        g.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = one_thread, many_threads
}
criterion_main!(benches);

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
//! The same one-thread pair through [`DeviceBuffer`](cachalot::cuda::DeviceBuffer) (the
//! cudarc-facing type: `alloc_buffer`, then drop) is `pair_one_thread/{settings}-buffer`, when a
//! CUDA driver is found: a GPU's, or, on a machine without one, the stand-in driver of
//! `benches/fake_driver/` (one made-up device that counts its calls: a hit pair makes none), so
//! the buffer layer's own cost is measured without a GPU.
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
    buffers(&mut g);
    g.finish();
}

/// The sizes of the buffer pairs: two small-pool blocks (the thread caches' sizes) and the
/// side-by-side GPU benchmark's hot-loop size.
const BUFFER_SIZES: [(&str, usize); 3] = [("512B", 512), ("64KiB", 64 << 10), ("1MiB", 1 << 20)];

/// One-thread pairs through `DeviceBuffer` (`alloc_buffer`, drop), on device 0 when a driver
/// is found.
#[cfg(feature = "cuda")]
fn buffers(g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>) {
    use cachalot::cuda::CudaAllocator;
    use cachalot::cuda::cudarc::driver::CudaContext;

    if let Err(e) = cachalot::cuda::device_count() {
        eprintln!("pair_one_thread/*-buffer skipped: {e}");
        return;
    }
    let ctx = CudaContext::new(0).expect("device 0");
    for (name, s) in settings() {
        let alloc = CudaAllocator::new(ctx.clone(), s).expect("the CUDA allocator");
        let stream = ctx.new_stream().expect("a stream");
        for (label, size) in BUFFER_SIZES {
            let pair = || {
                let buf = alloc.alloc_buffer::<u8>(black_box(size), &stream).unwrap();
                drop(black_box(buf));
            };
            pair();
            let calls = alloc.stats().num_device_alloc;
            g.bench_function(BenchmarkId::new(format!("{name}-buffer"), label), |b| {
                b.iter(pair)
            });
            // A cache hit never reaches the device (nor, with a driver's counters, the driver).
            assert_eq!(
                alloc.stats().num_device_alloc,
                calls,
                "a pair missed the cache"
            );
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn buffers(_: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>) {
    eprintln!("pair_one_thread/*-buffer skipped: built without the cuda feature");
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

//! Times an allocation and free through cachalot's cache against the driver's own calls.
//!
//! `cargo run --release -p cachalot --example bench_alloc` on a GPU machine. For each size it
//! prints the mean time of one allocate + free pair:
//! - `cachalot hit`: `CudaAllocator::alloc` + drop, the block coming from the cache;
//! - `cachalot raw hit`: `malloc_raw` + `free_raw`;
//! - `cuMemAlloc+cuMemFree`: the driver's synchronous calls (what every request would cost
//!   without a cache);
//! - `cudarc alloc`: cudarc's own `CudaStream::alloc` + drop (`cuMemAllocAsync` /
//!   `cuMemFreeAsync` from the device's default memory pool), what a cudarc program pays today.
//!
//! Then `DeviceBuffer` alloc + drop pairs (cache hits) from 1, 2, 4 and 8 threads at once: the
//! wall time per pair (the wall time until the last thread finishes, over all pairs) and each
//! thread's own time per pair, with one stream per thread and with one stream shared by all.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use cachalot::Settings;
use cachalot::cuda::CudaAllocator;
use cachalot::cuda::cudarc::driver::{CudaContext, result};

fn per_op(iterations: u32, mut f: impl FnMut()) -> Duration {
    for _ in 0..iterations.min(100) {
        f(); // warm up
    }
    let start = Instant::now();
    for _ in 0..iterations {
        f();
    }
    start.elapsed() / iterations
}

/// Pairs per thread count (split between the threads).
const PAIRS: u64 = 4_000_000;

/// `DeviceBuffer` alloc + drop pairs from `threads` threads at once, each on its own stream
/// or all on one: (wall ns per pair, mean ns per pair of one thread).
fn buffer_pairs(
    alloc: &CudaAllocator,
    ctx: &Arc<CudaContext>,
    threads: usize,
    one_stream: bool,
) -> Result<(f64, f64), Box<dyn std::error::Error>> {
    let first = ctx.new_stream()?;
    let streams: Vec<_> = (0..threads)
        .map(|_| {
            if one_stream {
                Ok(first.clone())
            } else {
                ctx.new_stream()
            }
        })
        .collect::<Result<_, _>>()?;
    let per_thread = PAIRS / threads as u64;
    let start = Barrier::new(threads + 1);
    let end = Barrier::new(threads + 1);
    let (wall, own) = std::thread::scope(|sc| {
        let handles: Vec<_> = streams
            .iter()
            .map(|s| {
                let (start, end) = (&start, &end);
                sc.spawn(move || {
                    for _ in 0..1000 {
                        drop(alloc.alloc_buffer::<f32>(16 << 10, s).unwrap());
                    }
                    start.wait();
                    let t = Instant::now();
                    for _ in 0..per_thread {
                        drop(std::hint::black_box(
                            alloc.alloc_buffer::<f32>(16 << 10, s).unwrap(),
                        ));
                    }
                    let own = t.elapsed();
                    end.wait();
                    own
                })
            })
            .collect();
        start.wait();
        let t = Instant::now();
        end.wait();
        let wall = t.elapsed();
        let own: Duration = handles.into_iter().map(|h| h.join().unwrap()).sum();
        (wall, own / threads as u32)
    });
    let pairs = (per_thread * threads as u64) as f64;
    Ok((
        wall.as_secs_f64() * 1e9 / pairs,
        own.as_secs_f64() * 1e9 / per_thread as f64,
    ))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if let Err(e) = cachalot::cuda::device_count() {
        eprintln!("bench_alloc needs a CUDA GPU: {e}");
        return Ok(());
    }
    let ctx = CudaContext::new(0)?;
    let alloc = CudaAllocator::new(ctx.clone(), Settings::default())?;
    let stream = ctx.new_stream()?;
    println!(
        "{:>10} | {:>14} | {:>16} | {:>20} | {:>14}",
        "size", "cachalot hit", "cachalot raw hit", "cuMemAlloc+cuMemFree", "cudarc alloc"
    );
    for &size in &[512usize, 64 << 10, 1 << 20, 16 << 20, 256 << 20] {
        let hit = per_op(200_000, || drop(alloc.alloc(size, &stream).unwrap()));
        let raw = per_op(200_000, || {
            let p = alloc.malloc_raw(size, &stream).unwrap();
            alloc.free_raw(p).unwrap();
        });
        ctx.bind_to_thread()?;
        let driver = per_op(300, || {
            // SAFETY: the memory is freed at once and never accessed; the context is current.
            let p = unsafe { result::malloc_sync(size) }.unwrap();
            // SAFETY: `p` came from cuMemAlloc just above and nothing uses it.
            unsafe { result::free_sync(p) }.unwrap();
        });
        let cudarc = per_op(3_000, || {
            // SAFETY: the slice is dropped at once and its (uninitialised) memory never read.
            drop(unsafe { stream.alloc::<u8>(size) }.unwrap());
        });
        stream.synchronize()?;
        println!(
            "{:>10} | {:>11.0} ns | {:>13.0} ns | {:>17.0} ns | {:>11.0} ns",
            size,
            hit.as_nanos(),
            raw.as_nanos(),
            driver.as_nanos(),
            cudarc.as_nanos()
        );
    }
    println!();
    println!(
        "DeviceBuffer<f32> alloc + drop, 64 KiB, cache hit, all threads at once \
         (targets: <= 60 ns on 1 thread, <= 100 ns wall per pair at 8):"
    );
    println!(
        "{:>8} | {:>22} | {:>22} | {:>22}",
        "threads", "wall/pair, own streams", "per thread, own", "wall/pair, one stream"
    );
    for threads in [1usize, 2, 4, 8] {
        let own = buffer_pairs(&alloc, &ctx, threads, false)?;
        let shared = buffer_pairs(&alloc, &ctx, threads, true)?;
        println!(
            "{threads:>8} | {:>19.1} ns | {:>19.1} ns | {:>19.1} ns",
            own.0, own.1, shared.0
        );
    }
    println!();
    println!("{}", alloc.memory_summary());
    Ok(())
}

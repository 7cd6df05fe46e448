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
//! Then the cache-hit pair from 1, 2, 4 and 8 threads at once (one stream each).

use std::sync::Arc;
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
    println!("cache-hit alloc + free of 64 KiB, one stream per thread, all threads at once:");
    for threads in [1usize, 2, 4, 8] {
        let streams: Vec<_> = (0..threads)
            .map(|_| ctx.new_stream())
            .collect::<Result<_, _>>()?;
        let start = Arc::new(std::sync::Barrier::new(threads));
        let handles: Vec<_> = streams
            .into_iter()
            .map(|s| {
                let (alloc, start) = (alloc.clone(), Arc::clone(&start));
                std::thread::spawn(move || {
                    drop(alloc.alloc(64 << 10, &s).unwrap());
                    start.wait();
                    per_op(200_000, || drop(alloc.alloc(64 << 10, &s).unwrap()))
                })
            })
            .collect();
        let times: Vec<Duration> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let mean = times.iter().sum::<Duration>() / threads as u32;
        println!(
            "  {threads} thread(s): {:.0} ns per pair per thread, {:.1} M pairs/s in all",
            mean.as_nanos(),
            threads as f64 * 1e3 / mean.as_nanos() as f64
        );
    }
    println!();
    println!("{}", alloc.memory_summary());
    Ok(())
}

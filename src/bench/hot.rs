//! The hot loops: 1 MiB alloc+free pairs from 1, 2, 4 and 8 threads through each allocator,
//! each written as a [`HotLoop`] and printed as one line.

use std::sync::{Arc, Barrier};
use std::time::Instant;

use cachalot::cuda::cudarc::driver::{CudaContext, CudaStream};
use cachalot::cuda::{CudaAllocator, CudaBackend, stream_id};
use cachalot::{Allocator, Backend, Settings, SimDevice, StreamId};

use super::allocators::SIM_CAPACITY;
use super::baselines::{MallocPairs, PoolPairs};
use super::error::{Failure, fail, run_err};
use super::options::Options;
use super::record::{HotLoop, RunFile};

/// The hot loops' allocation size.
pub const HOT_SIZE: usize = 1 << 20;
/// The hot loops' thread counts.
pub const HOT_THREADS: [usize; 4] = [1, 2, 4, 8];

/// Wall time per pair for `threads` threads, each doing `per_thread` pairs (`pair(t)` on
/// thread `t`) after `warmup` pairs, from the moment all start to the moment the last ends.
fn wall_per_pair<P>(pair: &P, threads: usize, per_thread: u64, warmup: u64) -> Result<f64, Failure>
where
    P: Fn(usize) -> Result<(), Failure> + Sync,
{
    let start = Barrier::new(threads + 1);
    let end = Barrier::new(threads + 1);
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let (start, end) = (&start, &end);
                s.spawn(move || {
                    let warm = (0..warmup).try_for_each(|_| pair(t));
                    start.wait();
                    let timed = match warm {
                        Ok(()) => (0..per_thread).try_for_each(|_| pair(std::hint::black_box(t))),
                        Err(e) => Err(e),
                    };
                    end.wait();
                    timed
                })
            })
            .collect();
        start.wait();
        let t = Instant::now();
        end.wait();
        let wall = t.elapsed().as_nanos() as f64;
        for w in workers {
            w.join()
                .map_err(|_| run_err("a hot-loop thread panicked"))??;
        }
        Ok(wall / (per_thread * threads as u64) as f64)
    })
}

/// Runs one hot loop at every thread count, writes it and prints its line.
fn hot_loop<P>(
    o: &Options,
    key: &str,
    path: &str,
    total_pairs: u64,
    warmup: u64,
    pair: &P,
) -> Result<(), Failure>
where
    P: Fn(usize) -> Result<(), Failure> + Sync,
{
    let mut run = HotLoop {
        allocator: key.into(),
        path: path.into(),
        size: HOT_SIZE as u64,
        threads: HOT_THREADS.iter().map(|&t| t as u64).collect(),
        ..HotLoop::default()
    };
    for threads in HOT_THREADS {
        let per_thread = (total_pairs / threads as u64).max(1);
        let wall = wall_per_pair(pair, threads, per_thread, warmup)?;
        run.pairs_per_thread.push(per_thread);
        run.wall_ns_per_pair.push(wall);
        run.ns_per_pair_per_thread.push(wall * threads as f64);
    }
    RunFile::hot_loop(&run)
        .write(&o.out, &format!("{key}__hot__{path}.json"))
        .map_err(run_err)?;
    let cells: Vec<String> = run
        .wall_ns_per_pair
        .iter()
        .map(|ns| format!("{ns:>9.1}"))
        .collect();
    println!("{key:<20} {path:<10} {}", cells.join(" "));
    Ok(())
}

/// A hot loop through `Allocator::malloc/free`, each thread on stream `streams[t]`.
fn hot_allocator<B: Backend + Send>(
    o: &Options,
    key: &str,
    alloc: &Allocator<B>,
    streams: &[StreamId],
) -> Result<(), Failure> {
    hot_loop(o, key, "allocator", o.hot_pairs, 1000, &|t: usize| {
        let p = alloc
            .malloc(std::hint::black_box(HOT_SIZE as u64), streams[t])
            .map_err(|e| fail("malloc", e))?;
        alloc
            .free(std::hint::black_box(p))
            .map_err(|e| fail("free", e))
    })
}

/// Runs the hot loops of every allocator of `o.only`: on the GPU (`ctx`), or cachalot's three
/// on the simulated device.
pub fn run_hot(o: &Options, ctx: Option<&Arc<CudaContext>>) -> Result<(), Failure> {
    let heads: Vec<String> = HOT_THREADS
        .iter()
        .map(|t| format!("{:>9}", format!("{t} thr")))
        .collect();
    println!(
        "\nhot loops, {} KiB alloc+free, wall ns per pair\n{:<20} {:<10} {}",
        HOT_SIZE >> 10,
        "allocator",
        "path",
        heads.join(" ")
    );
    let Some(ctx) = ctx else {
        let ids: Vec<StreamId> = (1..=HOT_THREADS[3] as u64).map(StreamId).collect();
        for &key in &o.only.0 {
            if let Some(settings) = o.cachalot_settings(key) {
                let alloc = Allocator::new(SimDevice::new(SIM_CAPACITY), settings)
                    .map_err(|e| fail("cannot build the allocator", e))?;
                hot_allocator(o, key, &alloc, &ids)?;
            }
        }
        return Ok(());
    };
    let streams: Vec<Arc<CudaStream>> = (0..HOT_THREADS[3])
        .map(|_| ctx.new_stream())
        .collect::<Result<_, _>>()
        .map_err(|e| fail("creating a CUDA stream", e))?;
    let ids: Vec<StreamId> = streams.iter().map(|s| stream_id(s)).collect();
    for &key in &o.only.0 {
        if let Some(settings) = o.cachalot_settings(key) {
            {
                let mut backend =
                    CudaBackend::new(Arc::clone(ctx)).map_err(|e| fail("the CUDA backend", e))?;
                for s in &streams {
                    backend.retain_stream(s);
                }
                let mut settings = settings.clone();
                if settings == Settings::cachalot() && !backend.virtual_memory() {
                    settings.expandable_segments = false;
                }
                let alloc = Allocator::new(backend, settings)
                    .map_err(|e| fail("cannot build the allocator", e))?;
                hot_allocator(o, key, &alloc, &ids)?;
            }
            let alloc = CudaAllocator::new(Arc::clone(ctx), settings)
                .map_err(|e| fail("cannot build the CUDA allocator", e))?;
            hot_loop(o, key, "buffer", o.hot_pairs, 1000, &|t: usize| {
                let buf = alloc
                    .alloc_buffer::<u8>(std::hint::black_box(HOT_SIZE), &streams[t])
                    .map_err(|e| fail("alloc_buffer", e))?;
                drop(std::hint::black_box(buf));
                Ok(())
            })?;
        } else if key == "cuda-pool" {
            let pool = PoolPairs::new(ctx)?;
            hot_loop(o, key, "raw", o.hot_pairs, 1000, &|t: usize| {
                pool.pair(HOT_SIZE, &streams[t])
            })?;
        } else {
            let malloc = MallocPairs::new(ctx)?;
            let pairs = (o.hot_pairs / 1000).max(HOT_THREADS[3] as u64);
            hot_loop(o, key, "raw", pairs, 10, &|_t: usize| malloc.pair(HOT_SIZE))?;
        }
    }
    Ok(())
}

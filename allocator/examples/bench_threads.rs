//! The thread-safe front end on the GPU: cache-hit alloc+free pairs from 1, 2, 4 and 8
//! threads through `Allocator<CudaBackend>`, with PyTorch's settings (one shared lock) and
//! cachalot's defaults (thread caches, rule 17), next to the same on the simulated device.
//!
//! `cargo run --release -p cachalot --example bench_threads` on a GPU machine (without one it
//! prints the simulated-device half only). Each cell is the **wall time per pair**: the
//! threads start together, each does the same number of pairs on its own stream, and the wall
//! time until the last one finishes is divided by the total number of pairs. The targets
//! (BENCHMARKS.md): 1 thread ≤ 50 ns, 8 threads ≤ 100 ns; PyTorch's C++ allocator on an H200
//! host: 0.55–1.6 / 0.8–2.5 / 2.2–2.7 / 2.6–3.2 µs at 1 / 2 / 4 / 8 threads (1 MiB).

use std::sync::Barrier;
use std::time::Instant;

use cachalot::{Allocator, Backend, Settings, SimDevice, StreamId};

const THREADS: [usize; 4] = [1, 2, 4, 8];
const PAIRS: u64 = 2_000_000;
const SIZES: [(u64, &str); 3] = [(512, "512 B"), (1 << 20, "1 MiB"), (64 << 20, "64 MiB")];

/// Wall time per pair in nanoseconds for `threads` threads, each on its own stream.
fn wall_per_pair<B: Backend + Send>(
    a: &Allocator<B>,
    streams: &[StreamId],
    threads: usize,
    size: u64,
) -> f64 {
    let start = Barrier::new(threads + 1);
    let end = Barrier::new(threads + 1);
    let per_thread = PAIRS / threads as u64;
    std::thread::scope(|s| {
        for &stream in &streams[..threads] {
            let (a, start, end) = (a, &start, &end);
            s.spawn(move || {
                for _ in 0..1000 {
                    let p = a.malloc(size, stream).unwrap();
                    a.free(p).unwrap();
                }
                start.wait();
                for _ in 0..per_thread {
                    let p = a.malloc(std::hint::black_box(size), stream).unwrap();
                    a.free(std::hint::black_box(p)).unwrap();
                }
                end.wait();
            });
        }
        start.wait();
        let t = Instant::now();
        end.wait();
        t.elapsed().as_secs_f64() * 1e9 / (per_thread * threads as u64) as f64
    })
}

fn table<B: Backend + Send>(
    title: &str,
    make: &mut dyn FnMut(Settings) -> Allocator<B>,
    streams: &[StreamId],
) {
    println!("\n{title}: wall time per cache-hit alloc+free pair");
    print!("{:>9} | {:>8}", "size", "settings");
    for t in THREADS {
        print!(" | {:>9}", format!("{t} thr"));
    }
    println!();
    for (size, label) in SIZES {
        for (name, settings) in [
            ("pytorch", Settings::pytorch()),
            ("cachalot", Settings::cachalot()),
        ] {
            let a = make(settings);
            print!("{label:>9} | {name:>8}");
            for t in THREADS {
                let ns = wall_per_pair(&a, streams, t, size);
                print!(" | {ns:>6.1} ns");
            }
            println!();
        }
    }
}

/// What a buffer holds to keep its allocator alive, on the simulated device: wall time per
/// cache-hit pair (512 B, cachalot's settings) with nothing, with a clone of one `Arc` shared
/// by every thread (how `DeviceBlock` held its allocator before: two such clones per block),
/// and with a clone of an `Arc` of the thread's own (the per-thread anchor it holds now).
fn handles(streams: &[StreamId]) {
    println!("\nsimulated device, 512 B, cachalot settings: what each block holds");
    print!("{:>22}", "handle per block");
    for t in THREADS {
        print!(" | {:>9}", format!("{t} thr"));
    }
    println!();
    let a = Allocator::new(SimDevice::new(64 << 30), Settings::cachalot()).unwrap();
    let shared = std::sync::Arc::new(0u64);
    for (name, kind) in [
        ("none", 0),
        ("2 shared Arc clones", 2),
        ("1 per-thread Arc", 1),
    ] {
        print!("{name:>22}");
        for &threads in &THREADS {
            let start = Barrier::new(threads + 1);
            let end = Barrier::new(threads + 1);
            let per_thread = PAIRS / threads as u64;
            let ns = std::thread::scope(|s| {
                for &stream in &streams[..threads] {
                    let (a, start, end, shared) = (&a, &start, &end, &shared);
                    s.spawn(move || {
                        let mine = std::sync::Arc::new(0u64);
                        start.wait();
                        for _ in 0..per_thread {
                            let p = a.malloc(std::hint::black_box(512), stream).unwrap();
                            let held = match kind {
                                2 => (Some(shared.clone()), Some(shared.clone())),
                                1 => (Some(mine.clone()), None),
                                _ => (None, None),
                            };
                            std::hint::black_box(&held);
                            a.free(std::hint::black_box(p)).unwrap();
                            drop(held);
                        }
                        end.wait();
                    });
                }
                start.wait();
                let t = Instant::now();
                end.wait();
                t.elapsed().as_secs_f64() * 1e9 / (per_thread * threads as u64) as f64
            });
            print!(" | {ns:>6.1} ns");
        }
        println!();
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let sim_streams: Vec<StreamId> = (0..8).map(StreamId).collect();
    table(
        "simulated device",
        &mut |s| Allocator::new(SimDevice::new(64 << 30), s).unwrap(),
        &sim_streams,
    );
    handles(&sim_streams);
    gpu()
}

#[cfg(feature = "cuda")]
fn gpu() -> Result<(), Box<dyn std::error::Error>> {
    use cachalot::CachingCore;
    use cachalot::cuda::cudarc::driver::CudaContext;
    use cachalot::cuda::{CudaBackend, stream_id};

    if let Err(e) = cachalot::cuda::device_count() {
        eprintln!("\nno GPU half: {e}");
        return Ok(());
    }
    let ctx = CudaContext::new(0)?;
    let streams: Vec<_> = (0..8).map(|_| ctx.new_stream()).collect::<Result<_, _>>()?;
    let ids: Vec<StreamId> = streams.iter().map(|s| stream_id(s)).collect();
    let name = ctx.name().unwrap_or_else(|_| "GPU 0".into());
    table(
        &format!("CUDA backend, {name}"),
        &mut |settings| {
            let mut backend = CudaBackend::new(ctx.clone()).unwrap();
            for s in &streams {
                backend.retain_stream(s);
            }
            Allocator::from_core(CachingCore::new(backend, settings).unwrap())
        },
        &ids,
    );
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn gpu() -> Result<(), Box<dyn std::error::Error>> {
    eprintln!("\nno GPU half: built without the cuda feature");
    Ok(())
}

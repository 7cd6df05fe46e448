//! A live memory snapshot from a Rust program on a GPU: record the allocator's history, run a
//! small workload on two streams, dump it in PyTorch's format, and print the program's own
//! figures as JSON — so `python -m torch.cuda._memory_viz` can draw it and `cachalot replay`
//! can be checked against it.
//!
//! ```sh
//! cargo run --release -p cachalot --example live_snapshot -- [OUT.pickle] [--no-backtraces]
//! cachalot replay OUT.pickle --pytorch --json     # peaks equal the printed figures
//! python -m torch.cuda._memory_viz trace_plot OUT.pickle -o trace.html
//! ```
//!
//! The snapshot goes to the path given, else `$OUT/rust_live.pickle`, else `rust_live.pickle`.
//! Without a GPU it says so and exits with 0 (with 1 when `CACHALOT_REQUIRE_GPU=1`).
//! Backtraces are captured with every entry unless `--no-backtraces` is given; their
//! function names need the binary's symbols (a stripped binary shows `<unknown>` frames).
//!
//! Recording starts mid-run, as users record. The allocator runs cachalot's policy on
//! segments (`expandable_segments:False`): `cachalot replay` rebuilds the state a mid-run
//! recording began in block for block for segments, but not yet for expandable segments'
//! ranges (it then starts from the live tensors only, and its peaks can differ).

use std::path::PathBuf;
use std::sync::Arc;

use cachalot::HistoryOptions;
use cachalot::cuda::CudaAllocator;
use cachalot::cuda::cudarc::driver::CudaStream;

const MIB: usize = 1 << 20;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let backtraces = !args.iter().any(|a| a == "--no-backtraces");
    let path = args
        .iter()
        .find(|a| !a.starts_with("--"))
        .map(PathBuf::from)
        .unwrap_or_else(|| match std::env::var_os("OUT") {
            Some(dir) => PathBuf::from(dir).join("rust_live.pickle"),
            None => PathBuf::from("rust_live.pickle"),
        });

    let settings = cachalot::Settings::parse("expandable_segments:False")?;
    let made = cachalot::cuda::cudarc::driver::CudaContext::new(0)
        .map_err(|e| e.to_string())
        .and_then(|ctx| CudaAllocator::new(ctx, settings).map_err(|e| e.to_string()));
    let alloc = match made {
        Ok(a) => a,
        Err(e) => {
            eprintln!("live_snapshot needs a CUDA GPU: {e}");
            let required = std::env::var("CACHALOT_REQUIRE_GPU").is_ok_and(|v| v == "1");
            std::process::exit(if required { 1 } else { 0 });
        }
    };
    let ctx = alloc.context().clone();
    let compute = ctx.new_stream()?;
    let copies = ctx.new_stream()?;

    // Before recording: the process already holds memory (as after a warm-up step).
    let weights = alloc.alloc_zeros::<f32>(16 * MIB / 4, &compute)?;
    drop(alloc.alloc_zeros::<u8>(40 * MIB, &compute)?);

    // Record from here on, with the peaks reset (as users record after a warm-up).
    alloc.record_history_with(Some(
        HistoryOptions::new(100_000).with_backtraces(backtraces),
    ));
    alloc.reset_peak_stats();

    workload(&alloc, &compute, &copies)?;
    compute.synchronize()?;
    copies.synchronize()?;
    drop(weights);

    let stats = alloc.stats();
    let segments = alloc.segments();
    let snapshot = alloc.snapshot();
    cachalot::snapshot::write_snapshot(&snapshot, std::fs::File::create(&path)?)?;
    let entries = snapshot.traces.last().map_or(0, |t| t.entries.len());
    let blocks: usize = segments.iter().map(|s| s.blocks.len()).sum();
    // The program's own figures, in the names `cachalot replay --json` and PyTorch use.
    println!(
        "{{\"snapshot\": {:?}, \"device\": {}, \"entries\": {}, \"backtraces\": {}, \
         \"max_memory_reserved\": {}, \"max_memory_allocated\": {}, \
         \"memory_reserved\": {}, \"memory_allocated\": {}, \"segments\": {}, \"blocks\": {}, \
         \"num_device_alloc\": {}, \"num_device_free\": {}}}",
        path.display().to_string(),
        alloc.ordinal(),
        entries,
        backtraces,
        stats.reserved_bytes.all.peak,
        stats.allocated_bytes.all.peak,
        stats.reserved_bytes.all.current,
        stats.allocated_bytes.all.current,
        segments.len(),
        blocks,
        stats.num_device_alloc,
        stats.num_device_free,
    );
    Ok(())
}

/// A few "training steps": activations allocated and freed on the compute stream, a copy of
/// each step's output made on the copy stream (a cross-stream use: its free waits for that
/// stream), a release of the cache half-way, and a last step larger than the others.
fn workload(
    alloc: &CudaAllocator,
    compute: &Arc<CudaStream>,
    copies: &Arc<CudaStream>,
) -> Result<(), Box<dyn std::error::Error>> {
    let mut kept = Vec::new();
    for step in 0..8usize {
        let scale = if step == 7 { 6 } else { 1 + step % 3 };
        let mut activations = Vec::new();
        for layer in 0..6usize {
            let len = (layer + 1) * scale * MIB / 4 + 1000 * step;
            let host = vec![step as f32 + layer as f32; len];
            activations.push(alloc.clone_htod(&host, compute)?);
        }
        // Small tensors (the small pool).
        let small: Vec<_> = (0..20)
            .map(|i| alloc.alloc_zeros::<u16>(100 + 300 * i, compute))
            .collect::<Result<_, _>>()?;
        // The step's output, copied on the other stream: a use recorded on `copies`.
        let out = activations.pop().ok_or("no activations")?;
        let mut copy = alloc.alloc_buffer::<f32>(out.len(), copies)?;
        copies.join(compute)?; // the data: `copies` waits for the writes queued on `compute`
        copies.memcpy_dtod(&out, &mut copy)?;
        let back = copies.clone_dtoh(&copy)?;
        if back[0] != step as f32 + 5.0 {
            return Err(format!("step {step}: read {} back", back[0]).into());
        }
        drop(out);
        drop(small);
        drop(activations);
        if step % 3 == 0 {
            kept.push(copy);
        }
        if step == 4 {
            compute.synchronize()?;
            copies.synchronize()?;
            alloc.empty_cache()?;
        }
    }
    Ok(())
}

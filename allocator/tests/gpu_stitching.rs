//! GPU tests of stitched views (rule 23 of ARCHITECTURE.md) on the CUDA backend: under
//! cachalot's policy with `page_stitching:True`, a large request that would take reserved
//! memory past rule 20's limit is served from a view — its own reservation, whose slots map
//! free pages of the ranges a second time — and the view is kept for the next time the request
//! comes. A loop whose allocations repeat then reaches passes with no driver call; data written
//! through a view's allocation is never seen through another live buffer (each buffer keeps
//! the bytes written into it while the others are written); and the device's own count of
//! memory agrees with what the allocator reports (a view creates no memory). They skip
//! (printing why) without a GPU, and fail then under `CACHALOT_REQUIRE_GPU=1`; see
//! `gpu_common`.

mod gpu_common;

use std::sync::Arc;

use cachalot::Settings;
use cachalot::cuda::cudarc::driver::{CudaContext, CudaStream};
use cachalot::cuda::{CudaAllocator, DeviceBuffer};
use gpu_common::{MIB, exclusive, free_memory, gpu, pattern};

/// Driver memory that may come and go outside the allocator (context bookkeeping, page tables).
const TOLERANCE: u64 = 8 << 20;

/// Warms the driver's virtual memory up once, so that free memory measured afterwards is
/// stable.
fn warm_up(ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>) {
    let warm = CudaAllocator::new(ctx.clone(), Settings::cachalot()).unwrap();
    let blocks = [1000, 3 * MIB, 30 * MIB].map(|n| warm.alloc(n, stream).unwrap());
    drop(blocks);
    warm.empty_cache().unwrap();
}

/// Fills a new buffer of `n` bytes with its own pattern and checks every live buffer: bytes
/// shared by two live buffers (through a view and a home, or two views) would show the other's
/// pattern.
fn make(
    alloc: &CudaAllocator,
    stream: &Arc<CudaStream>,
    live: &mut Vec<(DeviceBuffer<u8>, Vec<u8>)>,
    n: usize,
    seed: u64,
) {
    let host = pattern(seed, n);
    let mut b = alloc.alloc_buffer::<u8>(n, stream).unwrap();
    stream.memcpy_htod(&host, &mut b).unwrap();
    live.push((b, host));
    for (b, want) in live.iter() {
        assert!(
            stream.clone_dtoh(b).unwrap() == *want,
            "seed {seed}: a live buffer of {} bytes at {:#x} lost its bytes",
            want.len(),
            b.address()
        );
    }
}

/// Rule 23's example: A (4 MiB), X (2 MiB), B (4 MiB), Y (2 MiB); free A and B; C (5 MiB),
/// which fits neither hole and is served from a view of their pages; a write into every
/// buffer, each checked against the others; then everything freed.
fn example_pass(alloc: &CudaAllocator, stream: &Arc<CudaStream>, pass: u64) {
    let mut live = Vec::new();
    make(alloc, stream, &mut live, 4 * MIB, pass * 1000 + 1);
    make(alloc, stream, &mut live, 2 * MIB, pass * 1000 + 2);
    make(alloc, stream, &mut live, 4 * MIB, pass * 1000 + 3);
    make(alloc, stream, &mut live, 2 * MIB, pass * 1000 + 4);
    live.remove(2);
    live.remove(0);
    make(alloc, stream, &mut live, 5 * MIB, pass * 1000 + 5);
    // A small buffer beside the view's last piece (the rest of its page).
    make(alloc, stream, &mut live, 3 * MIB / 2, pass * 1000 + 6);
    drop(live);
    stream.synchronize().unwrap();
}

/// A seeded mix of sizes (the same every pass), kept alive four or five at a time.
fn mixed_pass(alloc: &CudaAllocator, stream: &Arc<CudaStream>, pass: u64) {
    let mut live = Vec::new();
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    for i in 0..48u64 {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let n = (1 + (x % 24) as usize) * MIB + (x % 4096) as usize;
        make(alloc, stream, &mut live, n, pass * 1000 + 10 + i);
        if live.len() > 4 {
            live.remove((x % 5) as usize);
        }
    }
    drop(live);
    stream.synchronize().unwrap();
}

fn calls(s: &cachalot::Stats) -> u64 {
    s.num_device_alloc + s.num_device_free
}

#[test]
fn with_page_stitching_repeats_make_no_driver_call_and_views_never_share_bytes_with_live_buffers() {
    let Some(ctx) = gpu(
        "with_page_stitching_repeats_make_no_driver_call_and_views_never_share_bytes_with_live_buffers",
    ) else {
        return;
    };
    let _device = exclusive();
    let stream = ctx.new_stream().unwrap();
    warm_up(&ctx, &stream);
    let before = free_memory(&ctx);
    let settings = Settings::cachalot().apply("page_stitching:True").unwrap();
    let alloc = CudaAllocator::new(ctx.clone(), settings).unwrap();
    assert!(alloc.settings().page_stitching);

    // The example: pass 1 maps the four blocks and makes the view (aliases); the next passes
    // find the same holes and the same view.
    example_pass(&alloc, &stream, 1);
    let first = alloc.stats();
    assert!(first.num_device_alloc >= 4, "{first:?}");
    let mut example = Vec::new();
    for pass in 2..=6 {
        let before_pass = calls(&alloc.stats());
        example_pass(&alloc, &stream, pass);
        example.push(calls(&alloc.stats()) - before_pass);
        alloc.check_invariants().unwrap();
    }
    assert_eq!(
        example[example.len() - 3..],
        [0, 0, 0],
        "the example's driver calls per pass after the first: {example:?}"
    );

    // A mix of sizes: every live buffer keeps its bytes; the device agrees with the allocator
    // (views create no memory).
    let mut per_pass = Vec::new();
    for pass in 1..=6 {
        let before_pass = calls(&alloc.stats());
        mixed_pass(&alloc, &stream, 100 + pass);
        let after = alloc.stats();
        per_pass.push(calls(&after) - before_pass);
        let held = before.saturating_sub(free_memory(&ctx));
        let reserved = after.reserved_bytes.all.current as u64;
        assert!(
            held.abs_diff(reserved) <= TOLERANCE,
            "pass {pass}: the device holds {} MiB, the allocator reports {} MiB",
            held >> 20,
            reserved >> 20
        );
        alloc.check_invariants().unwrap();
    }
    eprintln!(
        "example: {} device allocations in pass 1, then calls per pass {example:?}; the mix's \
         driver calls per pass: {per_pass:?}; reserved {} MiB",
        first.num_device_alloc,
        alloc.stats().reserved_bytes.all.current >> 20
    );

    // empty_cache destroys the views and gives every page back.
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.stats().reserved_bytes.all.current, 0);
    let held = before.saturating_sub(free_memory(&ctx));
    assert!(
        held <= TOLERANCE,
        "{} MiB still held after empty_cache",
        held >> 20
    );
}

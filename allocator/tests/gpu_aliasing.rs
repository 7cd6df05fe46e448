//! GPU tests of page aliasing (rule 22 of ARCHITECTURE.md) on the CUDA backend: a physical
//! page mapped at two addresses is one page of device memory (as `cuMemGetInfo` sees it) and
//! both addresses read the same bytes; unmapping one mapping leaves the other, and the memory
//! goes back with the last; and under cachalot's policy with page aliasing on — where pages move
//! between places by being mapped a second time — no two live buffers ever share a page (each keeps
//! the bytes written into it while the others are written), a loop whose allocations repeat
//! makes no driver call after its first pass, and the device's own count agrees with the
//! memory the allocator reports. They skip (printing why) without a GPU; see `gpu_common`.

mod gpu_common;

use std::sync::Arc;

use cachalot::cuda::cudarc::driver::{CudaContext, CudaStream, result};
use cachalot::cuda::{CudaAllocator, CudaBackend, DeviceBuffer, stream_id};
use cachalot::{Backend, Settings};
use gpu_common::{MIB, exclusive, free_memory, gpu, pattern};

/// Driver memory that may come and go outside the allocator (context bookkeeping, page tables).
const TOLERANCE: u64 = 8 << 20;

/// cachalot's pages (rule 21: 2 MiB in both pools).
const PAGE: u64 = 2 << 20;

/// Copies `bytes` to the device address `at` and waits.
fn write_raw(ctx: &Arc<CudaContext>, at: u64, bytes: &[u8]) {
    ctx.bind_to_thread().unwrap();
    // SAFETY: `at` starts at least `bytes.len()` mapped, accessible bytes of this context (the
    // test mapped them through the backend just before), and the copy is synchronous.
    unsafe { result::memcpy_htod_sync(at, bytes) }.unwrap();
}

/// Reads `len` bytes at the device address `at`.
fn read_raw(ctx: &Arc<CudaContext>, at: u64, len: usize) -> Vec<u8> {
    ctx.bind_to_thread().unwrap();
    let mut out = vec![0u8; len];
    // SAFETY: as in `write_raw`: `len` mapped, accessible bytes at `at`; synchronous copy.
    unsafe { result::memcpy_dtoh_sync(&mut out, at) }.unwrap();
    out
}

/// Warms the driver's virtual memory up once, so that free memory measured afterwards is
/// stable.
fn warm_up(ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>) {
    let warm = CudaAllocator::new(ctx.clone(), Settings::cachalot()).unwrap();
    let blocks = [1000, 3 * MIB, 30 * MIB].map(|n| warm.alloc(n, stream).unwrap());
    drop(blocks);
    warm.empty_cache().unwrap();
}

#[test]
fn a_page_mapped_at_two_addresses_is_one_page_and_both_read_the_same_bytes() {
    let Some(ctx) = gpu("a_page_mapped_at_two_addresses_is_one_page_and_both_read_the_same_bytes")
    else {
        return;
    };
    let _device = exclusive();
    let stream = ctx.new_stream().unwrap();
    warm_up(&ctx, &stream);
    let mut backend = CudaBackend::new(ctx.clone()).unwrap();
    backend.retain_stream(&stream);
    let s = stream_id(&stream);
    let before = free_memory(&ctx);
    let r = backend.reserve(64 * PAGE, PAGE).unwrap();
    backend.map(r, 4 * PAGE).unwrap();
    let len = (2 * PAGE) as usize;
    let original = pattern(1, len);
    write_raw(&ctx, r, &original);

    // Refused: a target that is mapped, a source that is not, partial pages.
    assert!(backend.alias(r + PAGE, r, PAGE).is_err(), "target mapped");
    assert!(
        backend.alias(r + 8 * PAGE, r + 20 * PAGE, PAGE).is_err(),
        "source unmapped"
    );
    assert!(
        backend.alias(r + 8 * PAGE, r, PAGE / 2).is_err(),
        "half a page"
    );
    assert_eq!(backend.mapped_bytes(), 4 * PAGE);

    // The first two pages mapped again at r + 8 pages: no new memory, the same bytes.
    backend.alias(r + 8 * PAGE, r, 2 * PAGE).unwrap();
    assert_eq!(
        backend.mapped_bytes(),
        4 * PAGE,
        "an alias creates no memory"
    );
    let held = before.saturating_sub(free_memory(&ctx));
    assert!(
        held.abs_diff(4 * PAGE) <= TOLERANCE,
        "the device holds {} MiB for 4 pages mapped at 6 places",
        held >> 20
    );
    assert_eq!(read_raw(&ctx, r + 8 * PAGE, len), original);
    // A write through the alias is read through the first mapping.
    let through_alias = pattern(2, len);
    write_raw(&ctx, r + 8 * PAGE, &through_alias);
    assert_eq!(read_raw(&ctx, r, len), through_alias);

    // Unmapping the first mapping keeps the pages: the alias still reads them.
    backend.unmap(r, 2 * PAGE, s).unwrap();
    assert_eq!(backend.mapped_bytes(), 4 * PAGE);
    assert_eq!(read_raw(&ctx, r + 8 * PAGE, len), through_alias);
    // The last mapping gone, the memory goes back.
    backend.unmap(r + 8 * PAGE, 2 * PAGE, s).unwrap();
    assert_eq!(backend.mapped_bytes(), 2 * PAGE);
    backend.unmap(r + 2 * PAGE, 2 * PAGE, s).unwrap();
    assert_eq!(backend.mapped_bytes(), 0);
    backend.release_reservation(r, 64 * PAGE).unwrap();
    let held = before.saturating_sub(free_memory(&ctx));
    assert!(held <= TOLERANCE, "{} MiB still held", held >> 20);

    // An alias still mapped when the backend is dropped is unmapped, and its page released
    // once.
    let r = backend.reserve(16 * PAGE, PAGE).unwrap();
    backend.map(r, 2 * PAGE).unwrap();
    backend.alias(r + 4 * PAGE, r, 2 * PAGE).unwrap();
    drop(backend);
    let held = before.saturating_sub(free_memory(&ctx));
    assert!(
        held <= TOLERANCE,
        "{} MiB still held after drop",
        held >> 20
    );
}

/// Fills a new buffer of `n` bytes with its own pattern and checks every live buffer: a page
/// shared by two live buffers would show the other's bytes.
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

/// Rule 22's example: A (10 MiB), B (4 MiB), free A, C (12 MiB), free B, free C.
fn example_pass(alloc: &CudaAllocator, stream: &Arc<CudaStream>, pass: u64) {
    let mut live = Vec::new();
    make(alloc, stream, &mut live, 10 * MIB, pass * 1000 + 1);
    make(alloc, stream, &mut live, 4 * MIB, pass * 1000 + 2);
    live.remove(0);
    make(alloc, stream, &mut live, 12 * MIB, pass * 1000 + 3);
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
fn with_page_aliasing_live_buffers_never_share_a_page_and_repeats_make_no_driver_call() {
    let Some(ctx) =
        gpu("with_page_aliasing_live_buffers_never_share_a_page_and_repeats_make_no_driver_call")
    else {
        return;
    };
    let _device = exclusive();
    let stream = ctx.new_stream().unwrap();
    warm_up(&ctx, &stream);
    let before = free_memory(&ctx);
    let settings = Settings::cachalot().apply("page_aliasing:True").unwrap();
    let alloc = CudaAllocator::new(ctx.clone(), settings).unwrap();
    assert!(alloc.settings().page_aliasing);

    // Rule 22's example: pass 1 maps A and B and aliases A's pages for C; later passes re-home.
    example_pass(&alloc, &stream, 1);
    let first = alloc.stats();
    assert!(first.num_device_alloc >= 3, "{first:?}");
    for pass in 2..=5 {
        let before_pass = calls(&alloc.stats());
        example_pass(&alloc, &stream, pass);
        assert_eq!(
            calls(&alloc.stats()),
            before_pass,
            "pass {pass} of the example made a driver call"
        );
    }

    // A mix of sizes: every live buffer keeps its bytes; the device agrees with the allocator.
    let mut per_pass = Vec::new();
    for pass in 1..=5 {
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
        "example: {} maps in pass 1, none after; the mix's driver calls per pass: {per_pass:?}; \
         reserved {} MiB",
        first.num_device_alloc,
        alloc.stats().reserved_bytes.all.current >> 20
    );

    alloc.empty_cache().unwrap();
    assert_eq!(alloc.stats().reserved_bytes.all.current, 0);
    let held = before.saturating_sub(free_memory(&ctx));
    assert!(
        held <= TOLERANCE,
        "{} MiB still held after empty_cache",
        held >> 20
    );
}

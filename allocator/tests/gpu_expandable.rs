//! GPU tests of expandable segments (rule 19 of ARCHITECTURE.md) on the CUDA backend: ranges
//! reserved with `cuMemAddressReserve` and grown page by page with `cuMemCreate` + `cuMemMap`
//! hold real memory that copies and kernels read and write; a range grows in place, so its
//! blocks are contiguous across pages; `empty_cache` unmaps the pages and gives the memory back
//! to the driver (as `cuMemGetInfo` sees it); out-of-memory, under a memory fraction and from
//! the device itself, fails cleanly, leaks no page and leaves the allocator usable; and the
//! backend refuses any span that is not whole pages of its reservations, in the right state.
//! They skip (printing why) without a GPU; see `gpu_common`.

mod gpu_common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use cachalot::cuda::cudarc::driver::{
    CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg,
};
use cachalot::cuda::{CudaAllocator, CudaBackend, DeviceBuffer, stream_id};
use cachalot::{Backend, BackendError, BlockPhase, Settings, StreamId};
use gpu_common::{MIB, exclusive, free_memory, function, gpu, kernels, pattern};

/// Driver memory that may come and go outside the allocator (context bookkeeping, page tables).
const TOLERANCE: u64 = 8 << 20;

/// A large-pool range's page (rule 19).
const LARGE_PAGE: u64 = 20 << 20;

fn expandable(base: Settings) -> Settings {
    base.apply("expandable_segments:True").unwrap()
}

fn close(a: u64, b: u64, tolerance: u64) -> bool {
    a.abs_diff(b) <= tolerance
}

/// `out[i] = in[i] + 1` on `stream`, through the test kernel.
fn add_one(
    add_one: &CudaFunction,
    stream: &Arc<CudaStream>,
    output: &mut DeviceBuffer<u8>,
    input: &DeviceBuffer<u8>,
) {
    let n = input.len() as u64;
    assert!(output.len() as u64 >= n);
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(256).min(4096) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = stream.launch_builder(add_one);
    launch.arg(output).arg(input).arg(&n);
    // SAFETY: add_one(unsigned char* out, const unsigned char* in, unsigned long long n), and
    // both buffers hold at least n bytes.
    unsafe { launch.launch(cfg) }.unwrap();
}

/// Warms the driver's virtual memory up once (its first reservations and mappings set up
/// bookkeeping it keeps), so that free memory measured afterwards is stable.
fn warm_up(ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>) {
    let warm = CudaAllocator::new(ctx.clone(), expandable(Settings::pytorch())).unwrap();
    let blocks = [1000, 3 * MIB, 30 * MIB].map(|n| warm.alloc(n, stream).unwrap());
    drop(blocks);
    warm.empty_cache().unwrap();
    drop(warm);
    ctx.synchronize().unwrap();
}

#[test]
fn expandable_segments_hold_real_memory_and_give_it_back() {
    let Some(ctx) = gpu("expandable_segments_hold_real_memory_and_give_it_back") else {
        return;
    };
    let _device = exclusive();
    let stream = ctx.new_stream().unwrap();
    let module = kernels(&ctx);
    let kernel = function(&module, "add_one");
    warm_up(&ctx, &stream);
    let before = free_memory(&ctx);
    // PyTorch's pages (20 MiB in the large pool), with cachalot's thread caches.
    let mut settings = expandable(Settings::pytorch());
    settings.thread_cache_blocks = Settings::default().thread_cache_blocks;
    let alloc = CudaAllocator::new(ctx.clone(), settings).unwrap();
    assert!(alloc.settings().expandable_segments);

    // Small requests that need a second 2 MiB page, and large ones over many 20 MiB pages.
    let sizes = [
        512,
        1000,
        4096,
        700 * 1024,
        MIB,
        MIB,
        MIB,
        3 * MIB,
        10 * MIB + 1,
        25 * MIB,
        64 * MIB + 3,
        300 * MIB,
    ];
    let started = Instant::now();
    // All buffers live at once, each with its own pattern: an overlap would corrupt one.
    let inputs: Vec<DeviceBuffer<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| alloc.clone_htod(&pattern(i as u64, n), &stream).unwrap())
        .collect();
    let mut outputs: Vec<DeviceBuffer<u8>> = sizes
        .iter()
        .map(|&n| alloc.alloc_buffer::<u8>(n, &stream).unwrap())
        .collect();
    let grown = started.elapsed();
    for (input, output) in inputs.iter().zip(outputs.iter_mut()) {
        add_one(&kernel, &stream, output, input);
    }
    for (i, (input, output)) in inputs.iter().zip(&outputs).enumerate() {
        let want = pattern(i as u64, sizes[i]);
        assert_eq!(
            stream.clone_dtoh(input).unwrap(),
            want,
            "{} bytes",
            sizes[i]
        );
        let plus_one: Vec<u8> = want.iter().map(|b| b.wrapping_add(1)).collect();
        assert_eq!(
            stream.clone_dtoh(output).unwrap(),
            plus_one,
            "kernel output"
        );
    }

    // Every segment is a run of mapped pages of a range.
    let stats = alloc.stats();
    let segments = alloc.segments();
    let reserved = stats.reserved_bytes.all.current as u64;
    assert!(segments.iter().all(|s| s.expandable), "{segments:?}");
    assert_eq!(segments.iter().map(|s| s.size).sum::<u64>(), reserved);
    let small = stats.reserved_bytes.small_pool.current as u64;
    let large = stats.reserved_bytes.large_pool.current as u64;
    assert!(
        small >= 4 * MIB as u64,
        "the small pool needed a second page"
    );
    assert!(small.is_multiple_of(2 * MIB as u64));
    assert!(large.is_multiple_of(LARGE_PAGE));
    assert_eq!(
        stats.segment.all.current, 0,
        "ranges are not rule-8 segments"
    );
    assert!(
        stats.num_device_alloc >= 3,
        "map steps: {}",
        stats.num_device_alloc
    );
    let held = before.saturating_sub(free_memory(&ctx));
    assert!(
        held >= reserved,
        "the device holds {} MiB, {} MiB reserved",
        held >> 20,
        reserved >> 20
    );
    alloc.check_invariants().unwrap();

    drop((inputs, outputs));
    ctx.synchronize().unwrap();
    let cached = free_memory(&ctx);
    assert!(before - cached >= reserved, "freed blocks stay mapped");
    let started = Instant::now();
    alloc.empty_cache().unwrap();
    let emptied = started.elapsed();
    let after = free_memory(&ctx);
    let stats = alloc.stats();
    println!(
        "expandable: {} MiB reserved ({} MiB small, {} MiB large) in {} map steps ({grown:?} to \
         allocate, copies included), {} unmaps ({emptied:?}); free memory {} MiB before, {} MiB \
         cached, {} MiB after empty_cache",
        reserved >> 20,
        small >> 20,
        large >> 20,
        stats.num_device_alloc,
        stats.num_device_free,
        before >> 20,
        cached >> 20,
        after >> 20
    );
    assert_eq!(stats.reserved_bytes.all.current, 0);
    assert!(alloc.segments().is_empty());
    assert!(stats.num_device_free >= 2);
    assert!(
        close(after, before, TOLERANCE),
        "{} MiB before, {} MiB after",
        before >> 20,
        after >> 20
    );

    // Usable again: new ranges are reserved and mapped.
    let again = alloc.clone_htod(&pattern(99, 5 * MIB), &stream).unwrap();
    assert_eq!(stream.clone_dtoh(&again).unwrap(), pattern(99, 5 * MIB));
    drop(again);
    drop(alloc); // the backend unmaps and gives back what is still mapped and reserved
    ctx.synchronize().unwrap();
    assert!(close(free_memory(&ctx), before, TOLERANCE));
}

#[test]
fn a_range_grows_in_place_so_its_blocks_are_contiguous_across_pages() {
    let Some(ctx) = gpu("a_range_grows_in_place_so_its_blocks_are_contiguous_across_pages") else {
        return;
    };
    let _device = exclusive();
    let stream = ctx.new_stream().unwrap();
    let module = kernels(&ctx);
    let kernel = function(&module, "add_one");
    let alloc = CudaAllocator::new(ctx.clone(), expandable(Settings::pytorch())).unwrap();
    let mib = MIB as u64;

    let a = alloc.alloc(3 * MIB, &stream).unwrap();
    let b = alloc.alloc(3 * MIB, &stream).unwrap();
    assert_eq!(
        b.address(),
        a.address() + 3 * mib,
        "the second 3 MiB follows the first"
    );
    // 30 MiB: the free 14 MiB after b plus one more page mapped after it.
    let mut c = alloc.alloc_buffer::<u8>(30 * MIB, &stream).unwrap();
    assert_eq!(
        c.address(),
        a.address() + 6 * mib,
        "the range grew in place"
    );
    let segments = alloc.segments();
    assert_eq!(segments.len(), 1, "{segments:?}");
    assert_eq!(
        (segments[0].address, segments[0].size),
        (a.address(), 40 * mib)
    );
    assert!(segments[0].expandable);
    assert_eq!(alloc.stats().num_device_alloc, 2);

    // c spans the two pages (created apart, mapped side by side): copies and a kernel see one
    // buffer.
    let host = pattern(7, 30 * MIB);
    stream.memcpy_htod(&host, &mut c).unwrap();
    let mut d = alloc.alloc_buffer::<u8>(30 * MIB, &stream).unwrap();
    add_one(&kernel, &stream, &mut d, &c);
    assert_eq!(stream.clone_dtoh(&c).unwrap(), host);
    let plus_one: Vec<u8> = host.iter().map(|b| b.wrapping_add(1)).collect();
    assert_eq!(stream.clone_dtoh(&d).unwrap(), plus_one);
    assert_eq!(d.address(), c.address() + 30 * mib);

    // Freed and emptied: the whole range goes back. A block still allocated keeps its pages.
    drop((a, c, d));
    alloc.empty_cache().unwrap();
    let segments = alloc.segments();
    assert_eq!(segments.len(), 1);
    assert_eq!(
        (segments[0].address, segments[0].size),
        (b.address() - 3 * mib, 20 * mib),
        "only the page holding b stays mapped"
    );
    assert_eq!(
        segments[0]
            .blocks
            .iter()
            .filter(|x| x.state == BlockPhase::Allocated)
            .count(),
        1
    );
    drop(b);
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.stats().reserved_bytes.all.current, 0);
    alloc.check_invariants().unwrap();
}

#[test]
fn out_of_memory_under_a_memory_fraction_is_clean_and_the_allocator_carries_on() {
    let Some(ctx) =
        gpu("out_of_memory_under_a_memory_fraction_is_clean_and_the_allocator_carries_on")
    else {
        return;
    };
    let _device = exclusive();
    let stream = ctx.new_stream().unwrap();
    let alloc = CudaAllocator::new(ctx.clone(), expandable(Settings::pytorch())).unwrap();
    alloc.set_memory_fraction(0.01).unwrap();
    let total = alloc.mem_info().unwrap().total;
    let allowed = (0.01 * total as f64) as u64;
    let size = 100 * MIB;

    let mut held = Vec::new();
    let err = loop {
        match alloc.alloc(size, &stream) {
            Ok(b) => held.push(b),
            Err(e) => break e,
        }
        assert!(held.len() < 10_000, "the memory fraction does not bind");
    };
    println!("{err}");
    let oom = err
        .out_of_memory()
        .unwrap_or_else(|| panic!("not an out-of-memory error: {err:?}"));
    let fit = (allowed / size as u64) as usize;
    assert_eq!(held.len(), fit);
    assert_eq!(oom.allowed, Some(allowed));
    assert_eq!(oom.allocated, (fit * size) as u64);
    let stats = alloc.stats();
    assert_eq!(stats.num_ooms, 1);
    assert_eq!(stats.reserved_bytes.all.current as u64, (fit * size) as u64);

    // Usable afterwards: a freed block is reused without a map step.
    let maps = stats.num_device_alloc;
    held.pop();
    let again = alloc.clone_htod(&pattern(3, size), &stream).unwrap();
    assert_eq!(alloc.stats().num_device_alloc, maps);
    assert_eq!(stream.clone_dtoh(&again).unwrap(), pattern(3, size));
    drop((again, held));
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.stats().reserved_bytes.all.current, 0);
    alloc.check_invariants().unwrap();
}

#[test]
fn a_request_beyond_the_device_fails_in_cu_mem_create_and_leaks_no_page() {
    let Some(ctx) = gpu("a_request_beyond_the_device_fails_in_cu_mem_create_and_leaks_no_page")
    else {
        return;
    };
    let _device = exclusive();
    let stream = ctx.new_stream().unwrap();
    warm_up(&ctx, &stream);
    let before = free_memory(&ctx);
    let alloc = CudaAllocator::new(ctx.clone(), expandable(Settings::pytorch())).unwrap();
    let keep = alloc.clone_htod(&pattern(1, 3 * MIB), &stream).unwrap();
    let total = alloc.mem_info().unwrap().total;

    // Beyond the device but within a range (9/8 of the capacity): the map step creates pages
    // until the device has no room, releases them, and the allocation fails; then rule 7 frees
    // the cache and tries once more, with the same outcome.
    let request = (total + total / 16) as usize;
    let started = Instant::now();
    let err = alloc.alloc(request, &stream).unwrap_err();
    let failed_after = started.elapsed();
    println!("{err} (after {failed_after:?})");
    let oom = err.out_of_memory().expect("out of memory");
    assert_eq!(oom.capacity, total);
    assert_eq!(oom.allowed, None);
    assert!(err.to_string().contains("CUDA out of memory"));
    let stats = alloc.stats();
    assert_eq!((stats.num_ooms, stats.num_alloc_retries), (1, 1));
    ctx.synchronize().unwrap();
    let held = before.saturating_sub(free_memory(&ctx));
    assert!(
        held <= stats.reserved_bytes.all.current as u64 + TOLERANCE,
        "pages of the failed map steps leaked: {} MiB held, {} MiB reserved",
        held >> 20,
        stats.reserved_bytes.all.current >> 20
    );

    // Carries on: the block kept is intact, and new requests in both pools work.
    assert_eq!(stream.clone_dtoh(&keep).unwrap(), pattern(1, 3 * MIB));
    let small = alloc.clone_htod(&[9u8; 4096], &stream).unwrap();
    let large = alloc.clone_htod(&pattern(2, 50 * MIB), &stream).unwrap();
    assert_eq!(stream.clone_dtoh(&small).unwrap(), vec![9u8; 4096]);
    assert_eq!(stream.clone_dtoh(&large).unwrap(), pattern(2, 50 * MIB));
    drop((keep, small, large));
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.stats().reserved_bytes.all.current, 0);
    alloc.check_invariants().unwrap();
    drop(alloc);
    ctx.synchronize().unwrap();
    let after = free_memory(&ctx);
    assert!(
        close(after, before, TOLERANCE),
        "{} MiB before, {} MiB after",
        before >> 20,
        after >> 20
    );
}

fn is_refusal(r: Result<impl std::fmt::Debug, BackendError>) -> bool {
    matches!(r, Err(BackendError::Device { .. }))
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

#[test]
fn the_backend_maps_whole_pages_of_its_reservations_only_and_drop_gives_all_back() {
    let Some(ctx) =
        gpu("the_backend_maps_whole_pages_of_its_reservations_only_and_drop_gives_all_back")
    else {
        return;
    };
    let _device = exclusive();
    let stream = ctx.new_stream().unwrap();
    warm_up(&ctx, &stream);
    let before = free_memory(&ctx);
    let mut backend = CudaBackend::new(ctx.clone()).unwrap();
    backend.retain_stream(&stream);
    let s = stream_id(&stream);
    assert!(backend.virtual_memory());
    let page = LARGE_PAGE;
    let pages = 80u64;

    // Reservations must be whole pages of multiples of 2 MiB.
    assert!(is_refusal(backend.reserve(0, page)));
    assert!(is_refusal(backend.reserve(30 << 20, page)));
    assert!(is_refusal(backend.reserve(3 << 20, 3 << 20)));
    assert!(is_refusal(backend.reserve(page, 0)));
    let r = backend.reserve(pages * page, page).unwrap();
    assert_ne!(r, 0);
    assert_eq!(backend.reservation_count(), 1);

    // Only whole, unmapped pages of a reservation are mapped.
    for (address, size) in [
        (0x1000, page),
        (r + (2 << 20), page),
        (r, 10 << 20),
        (r, 0),
        (r + (pages - 1) * page, 2 * page),
        (u64::MAX - page + 1, page),
        (r, u64::MAX - r + 1),
    ] {
        assert!(
            is_refusal(backend.map(address, size)),
            "{address:#x} {size}"
        );
    }
    assert!(is_refusal(backend.unmap(r, page, s)), "nothing mapped yet");

    // One page at a time, timed.
    let mut map_times = Vec::new();
    for i in 0..20 {
        let started = Instant::now();
        backend.map(r + i * page, page).unwrap();
        map_times.push(started.elapsed());
    }
    assert_eq!(backend.mapped_bytes(), 20 * page);
    // Many pages in one call.
    let started = Instant::now();
    backend.map(r + 20 * page, 50 * page).unwrap();
    let map_50 = started.elapsed();
    assert_eq!(backend.mapped_bytes(), 70 * page);
    let held = before.saturating_sub(free_memory(&ctx));
    assert!(held >= 70 * page, "{} MiB held", held >> 20);

    // Mapped already, overlapping mapped pages, or partly unmapped: refused.
    assert!(is_refusal(backend.map(r, page)));
    assert!(is_refusal(backend.map(r + 69 * page, 2 * page)));
    assert!(is_refusal(backend.unmap(r + 69 * page, 2 * page, s)));
    assert!(is_refusal(backend.unmap(r + (2 << 20), page, s)));
    assert!(is_refusal(backend.release_reservation(r, pages * page)));
    assert!(is_refusal(backend.release_reservation(r + page, page)));

    // Any run of mapped pages unmaps, across the maps that made them.
    let mut unmap_times = Vec::new();
    for i in 0..10 {
        let started = Instant::now();
        backend.unmap(r + i * page, page, s).unwrap();
        unmap_times.push(started.elapsed());
    }
    backend.unmap(r + 15 * page, 10 * page, s).unwrap();
    // A stream the backend does not know: the whole device is synchronised instead.
    backend
        .unmap(r + 10 * page, 5 * page, StreamId(0xdead_beef))
        .unwrap();
    assert!(is_refusal(backend.unmap(r, page, s)), "unmapped already");
    assert_eq!(backend.mapped_bytes(), 45 * page);
    // Unmapped pages map again.
    backend.map(r, 2 * page).unwrap();
    assert_eq!(backend.mapped_bytes(), 47 * page);

    // A second reservation with nothing mapped is given back; the first, mapped, stays.
    let r2 = backend.reserve(10 * page, page).unwrap();
    assert!(is_refusal(backend.release_reservation(r2, 5 * page)));
    backend.release_reservation(r2, 10 * page).unwrap();
    assert!(is_refusal(backend.release_reservation(r2, 10 * page)));
    assert!(
        is_refusal(backend.map(r2, page)),
        "a released reservation is forgotten"
    );
    assert_eq!(backend.reservation_count(), 1);

    println!(
        "20 MiB pages: map {:.0} µs (median of 20 single-page maps), {:.0} µs a page in a \
         50-page map; unmap {:.0} µs (median of 10)",
        median(map_times).as_secs_f64() * 1e6,
        map_50.as_secs_f64() * 1e6 / 50.0,
        median(unmap_times).as_secs_f64() * 1e6,
    );

    // Dropped with 47 pages mapped and a reservation held: all of it goes back.
    drop(backend);
    ctx.synchronize().unwrap();
    let after = free_memory(&ctx);
    assert!(
        close(after, before, TOLERANCE),
        "{} MiB before, {} MiB after",
        before >> 20,
        after >> 20
    );
}

/// Rule 19j on the GPU: with `expandable_handle_mb` set, a large map step is one handle (one
/// `cuMemCreate`) that copies and kernels use across its pages; its pages are never put into a
/// stitched view (the driver refuses `cuMemMap` at an offset); a part of it is never unmapped
/// (the driver refuses); once wholly free it goes back to the driver in one unmap, as
/// `cuMemGetInfo` sees; dropping the allocator gives everything back.
#[test]
fn a_handle_of_several_pages_holds_real_memory_and_goes_back_only_whole() {
    let Some(ctx) = gpu("a_handle_of_several_pages_holds_real_memory_and_goes_back_only_whole")
    else {
        return;
    };
    let _device = exclusive();
    let stream = ctx.new_stream().unwrap();
    let module = kernels(&ctx);
    let kernel = function(&module, "add_one");
    warm_up(&ctx, &stream);
    let before = free_memory(&ctx);
    let settings = Settings::cachalot()
        .apply("expandable_handle_mb:8")
        .unwrap();
    let alloc = CudaAllocator::new(ctx.clone(), settings).unwrap();
    let mib = MIB as u64;

    // 64 MiB: one map step of 32 pages, one handle.
    let mut big = alloc.alloc_buffer::<u8>(64 * MIB, &stream).unwrap();
    assert_eq!(alloc.stats().num_device_alloc, 1);
    let host = pattern(11, 64 * MIB);
    stream.memcpy_htod(&host, &mut big).unwrap();
    let mut out = alloc.alloc_buffer::<u8>(64 * MIB, &stream).unwrap();
    add_one(&kernel, &stream, &mut out, &big);
    let plus_one: Vec<u8> = host.iter().map(|b| b.wrapping_add(1)).collect();
    assert_eq!(
        stream.clone_dtoh(&out).unwrap(),
        plus_one,
        "across the handle's pages"
    );
    assert_eq!(stream.clone_dtoh(&big).unwrap(), host);
    let reserved = alloc.stats().reserved_bytes.all.current as u64;
    let held = before.saturating_sub(free_memory(&ctx));
    assert!(
        held >= reserved,
        "{} MiB held, {} MiB reserved",
        held >> 20,
        reserved >> 20
    );

    // A 3 MiB block reuses the first handle's first bytes: the rest of it is free, holds
    // whole pages but no whole handle, so empty_cache unmaps nothing of it.
    let big_at = big.address();
    drop(big);
    let pin = alloc.clone_htod(&pattern(12, 3 * MIB), &stream).unwrap();
    assert_eq!(pin.address(), big_at);
    alloc.empty_cache().unwrap();
    assert_eq!(
        alloc.stats().reserved_bytes.large_pool.current as u64,
        128 * mib,
        "the pinned handle stays whole"
    );
    assert_eq!(stream.clone_dtoh(&pin).unwrap(), pattern(12, 3 * MIB));
    assert_eq!(stream.clone_dtoh(&out).unwrap(), plus_one);

    // Over the reclaim limit, a large request is served from the free handle pages? Never: a
    // view maps one-page handles only, so a request that would need one grows or reclaims.
    let again = alloc.clone_htod(&pattern(13, 40 * MIB), &stream).unwrap();
    assert_eq!(stream.clone_dtoh(&again).unwrap(), pattern(13, 40 * MIB));
    assert_eq!(stream.clone_dtoh(&pin).unwrap(), pattern(12, 3 * MIB));
    alloc.check_invariants().unwrap();

    drop((pin, out, again));
    ctx.synchronize().unwrap();
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.stats().reserved_bytes.all.current, 0);
    ctx.synchronize().unwrap();
    let after = free_memory(&ctx);
    assert!(
        close(after, before, TOLERANCE),
        "{} MiB before, {} MiB after empty_cache",
        before >> 20,
        after >> 20
    );
    drop(alloc);
    ctx.synchronize().unwrap();
    assert!(close(free_memory(&ctx), before, TOLERANCE));
}

/// The CUDA backend's half of rule 19j: `map_handle` makes one mapping that `unmap` takes only
/// whole and `alias` never takes from.
#[test]
fn the_backend_maps_a_handle_whole_and_refuses_to_cut_or_alias_it() {
    let Some(ctx) = gpu("the_backend_maps_a_handle_whole_and_refuses_to_cut_or_alias_it") else {
        return;
    };
    let _device = exclusive();
    let stream = ctx.new_stream().unwrap();
    warm_up(&ctx, &stream);
    let before = free_memory(&ctx);
    let mut backend = CudaBackend::new(ctx.clone()).unwrap();
    backend.retain_stream(&stream);
    let s = stream_id(&stream);
    let page = 2 * MIB as u64;
    let base = backend.reserve(64 * page, page).unwrap();
    backend.map_handle(base, 8 * page).unwrap();
    assert_eq!(backend.mapped_bytes(), 8 * page);
    assert!(
        is_refusal(backend.map_handle(base + 8 * page, page)),
        "one page"
    );
    assert!(is_refusal(backend.unmap(base + page, page, s)), "a part");
    assert!(is_refusal(backend.unmap(base, 4 * page, s)), "a part");
    assert!(
        is_refusal(backend.alias(base + 32 * page, base, page)),
        "an alias"
    );
    assert_eq!(backend.mapped_bytes(), 8 * page, "nothing changed");
    backend.map(base + 8 * page, page).unwrap();
    // One unmap over the handle and the page after it: two driver unmaps, both released.
    backend.unmap(base, 9 * page, s).unwrap();
    assert_eq!(backend.mapped_bytes(), 0);
    // Dropped with a handle still mapped: everything goes back.
    backend.map_handle(base, 4 * page).unwrap();
    drop(backend);
    ctx.synchronize().unwrap();
    assert!(close(free_memory(&ctx), before, TOLERANCE));
}

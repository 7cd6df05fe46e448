//! GPU tests: data written through cachalot's buffers comes back intact, through copies and
//! through a kernel, in every size class; freed blocks are reused; the raw-pointer API refuses
//! bad frees. They skip (printing why) without a GPU; see `gpu_common`.
#![cfg(not(loom))]

mod gpu_common;

use std::sync::Arc;

use cachalot::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
use cachalot::cuda::{CudaAllocator, CudaError, DeviceBuffer, Launch};
use cachalot::{BlockPhase, Error, Settings};
use gpu_common::{MIB, exclusive, function, gpu, kernels};

/// Every size class: tiny, the 512 B minimum block, around the 1 MiB small/large boundary,
/// the 2 MiB small segment, around the 10 MiB large-segment threshold, the 20 MiB large buffer,
/// and a large request of its own.
const SIZES: [usize; 13] = [
    1,
    100,
    512,
    MIB - 1,
    MIB,
    MIB + 1,
    2 * MIB,
    10 * MIB - 1,
    10 * MIB,
    10 * MIB + 1,
    20 * MIB,
    100 * MIB,
    3 * MIB + 512 + 7,
];

fn pattern(seed: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((i * 31 + seed * 17 + 7) % 251) as u8)
        .collect()
}

#[test]
fn data_survives_copies_and_a_kernel_in_every_size_class() {
    let Some(ctx) = gpu("data_survives_copies_and_a_kernel_in_every_size_class") else {
        return;
    };
    let _device = exclusive();
    let module = kernels(&ctx);
    let add_one = function(&module, "add_one");
    let alloc = CudaAllocator::new(ctx.clone(), Settings::default()).unwrap();
    let stream = ctx.new_stream().unwrap();

    // All buffers live at once, each with its own pattern: an overlap would corrupt one.
    let inputs: Vec<DeviceBuffer<u8>> = SIZES
        .iter()
        .enumerate()
        .map(|(seed, &n)| alloc.clone_htod(&pattern(seed, n), &stream).unwrap())
        .collect();
    let mut outputs: Vec<DeviceBuffer<u8>> = SIZES
        .iter()
        .map(|&n| alloc.alloc_buffer::<u8>(n, &stream).unwrap())
        .collect();
    for (input, output) in inputs.iter().zip(outputs.iter_mut()) {
        let n = input.len() as u64;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(256).min(4096) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = stream.launch_builder(&add_one);
        launch.arg(output).arg(input).arg(&n);
        // SAFETY: add_one(unsigned char* out, const unsigned char* in, unsigned long long n),
        // and both buffers hold n bytes.
        unsafe { launch.launch(cfg) }.unwrap();
    }
    for (seed, (input, output)) in inputs.iter().zip(&outputs).enumerate() {
        let want = pattern(seed, SIZES[seed]);
        assert_eq!(
            stream.clone_dtoh(input).unwrap(),
            want,
            "copy of {} bytes",
            SIZES[seed]
        );
        let plus_one: Vec<u8> = want.iter().map(|b| b.wrapping_add(1)).collect();
        assert!(
            stream.clone_dtoh(output).unwrap() == plus_one,
            "kernel output of {} bytes",
            SIZES[seed]
        );
    }
    // No two live blocks overlap, and the policy's invariants hold.
    let mut ranges: Vec<(u64, u64)> = inputs
        .iter()
        .map(|b| (b.address(), b.num_bytes() as u64))
        .chain(outputs.iter().map(|b| (b.address(), b.num_bytes() as u64)))
        .collect();
    ranges.sort();
    for w in ranges.windows(2) {
        assert!(w[0].0 + w[0].1 <= w[1].0, "blocks overlap: {w:?}");
    }
    alloc.check_invariants().unwrap();
    let stats = alloc.stats();
    assert_eq!(stats.allocation.all.current, 2 * SIZES.len() as i64);
    assert!(stats.allocation.small_pool.current > 0 && stats.allocation.large_pool.current > 0);
}

#[test]
fn typed_buffers_zero_copy_and_launch() {
    let Some(ctx) = gpu("typed_buffers_zero_copy_and_launch") else {
        return;
    };
    let _device = exclusive();
    let alloc = CudaAllocator::new(ctx.clone(), Settings::default()).unwrap();
    let stream = ctx.new_stream().unwrap();
    let zeros = alloc.alloc_zeros::<f64>(12345, &stream).unwrap();
    assert_eq!(stream.clone_dtoh(&zeros).unwrap(), vec![0.0; 12345]);
    let host: Vec<u32> = (0..100_000).collect();
    let mut buf = alloc.alloc_buffer::<u32>(host.len(), &stream).unwrap();
    stream.memcpy_htod(&host, &mut buf).unwrap();
    assert_eq!(stream.clone_dtoh(&buf).unwrap(), host);
    stream.memset_zeros(&mut buf).unwrap();
    assert_eq!(stream.clone_dtoh(&buf).unwrap(), vec![0; host.len()]);

    // A kernel through the recording launch helper, on the buffer's own stream.
    let module = kernels(&ctx);
    let add_one = function(&module, "add_one");
    let input = alloc.clone_htod(&[1u8, 2, 3, 254], &stream).unwrap();
    let mut output = alloc.alloc_zeros::<u8>(4, &stream).unwrap();
    let n = 4u64;
    {
        let mut launch = Launch::new(&stream, &add_one);
        launch.arg(&mut output).arg(&input).arg(&n);
        // SAFETY: add_one(out, in, n) with 4-byte buffers.
        unsafe { launch.builder().launch(LaunchConfig::for_num_elems(4)) }.unwrap();
    }
    assert_eq!(stream.clone_dtoh(&output).unwrap(), [2, 3, 4, 255]);
}

#[test]
fn a_freed_block_comes_back_at_the_same_address() {
    let Some(ctx) = gpu("a_freed_block_comes_back_at_the_same_address") else {
        return;
    };
    let _device = exclusive();
    // Segments (rule 8): under cachalot's default policy rule 20 would move the cached
    // block's memory to the other stream instead of reserving more, which is the point of it.
    let segments = Settings::parse("expandable_segments:False").unwrap();
    let alloc = CudaAllocator::new(ctx.clone(), segments).unwrap();
    let stream = ctx.new_stream().unwrap();
    for &n in &SIZES {
        let first = alloc.alloc(n, &stream).unwrap();
        let address = first.address();
        let device_allocs = alloc.stats().num_device_alloc;
        drop(first);
        let again = alloc.alloc(n, &stream).unwrap();
        assert_eq!(again.address(), address, "{n} bytes");
        assert_eq!(
            alloc.stats().num_device_alloc,
            device_allocs,
            "{n} bytes: no new segment"
        );
    }
    // Another stream does not take this stream's cached blocks.
    let other = ctx.new_stream().unwrap();
    let cached = alloc.stats().reserved_bytes.all.current;
    let b = alloc.alloc(MIB, &other).unwrap();
    assert!(alloc.stats().reserved_bytes.all.current > cached);
    drop(b);
    alloc.check_invariants().unwrap();
}

#[test]
fn raw_pointers_free_once_and_bad_frees_are_errors() {
    let Some(ctx) = gpu("raw_pointers_free_once_and_bad_frees_are_errors") else {
        return;
    };
    let _device = exclusive();
    let alloc = CudaAllocator::new(ctx.clone(), Settings::default()).unwrap();
    let stream = ctx.new_stream().unwrap();
    let p = alloc.malloc_raw(5000, &stream).unwrap();
    assert_ne!(p, 0);
    alloc.free_raw(p).unwrap();
    let unknown = |r: Result<(), CudaError>, address: u64| {
        assert!(
            matches!(r, Err(CudaError::Alloc(Error::UnknownPointer { address: a })) if a == address),
            "{r:?}"
        );
    };
    unknown(alloc.free_raw(p), p); // double free
    unknown(alloc.free_raw(0x1234), 0x1234); // never allocated
    let q = alloc.malloc_raw(5000, &stream).unwrap();
    unknown(alloc.free_raw(q + 512), q + 512); // inside a block
    // A block owned by a DeviceBlock is not the raw API's to free.
    let block = alloc.alloc(4096, &stream).unwrap();
    unknown(alloc.free_raw(block.address()), block.address());
    let seen = stream.clone_dtoh(&block).unwrap();
    assert_eq!(seen.len(), 4096);
    drop(block);
    alloc.free_raw(q).unwrap();
    alloc.free_raw(0).unwrap(); // the null address: nothing to do
    assert_eq!(alloc.malloc_raw(0, &stream).unwrap(), 0);
    // With cachalot's defaults this thread's cache keeps the freed blocks (rule 17): they
    // still count as allocated until flushed.
    assert_eq!(
        alloc.stats().allocation.all.current as usize,
        alloc.thread_cached_blocks()
    );
    alloc.flush_thread_cache();
    assert_eq!(alloc.thread_cached_blocks(), 0);
    assert_eq!(alloc.stats().allocation.all.current, 0);
    alloc.check_invariants().unwrap();
}

#[test]
fn zero_sized_requests_touch_nothing() {
    let Some(ctx) = gpu("zero_sized_requests_touch_nothing") else {
        return;
    };
    let _device = exclusive();
    let alloc = CudaAllocator::new(ctx.clone(), Settings::default()).unwrap();
    let stream = ctx.new_stream().unwrap();
    let before = alloc.stats();
    let b = alloc.alloc(0, &stream).unwrap();
    assert!(b.is_empty());
    assert_eq!(b.address(), 0);
    let z = alloc.alloc_zeros::<f32>(0, &stream).unwrap();
    let c = alloc.clone_htod::<u8>(&[], &stream).unwrap();
    assert!(z.is_empty() && c.is_empty());
    drop((b, z, c));
    assert_eq!(alloc.stats(), before);
    // An element count whose byte size overflows is refused, not wrapped.
    let e = alloc
        .alloc_buffer::<u64>(usize::MAX / 2, &stream)
        .unwrap_err();
    assert!(
        matches!(e, CudaError::Alloc(Error::TooLarge { .. })),
        "{e:?}"
    );
}

#[test]
fn the_summary_and_settings_read_like_pytorchs() {
    let Some(ctx) = gpu("the_summary_and_settings_read_like_pytorchs") else {
        return;
    };
    let _device = exclusive();
    let settings = Settings::parse(
        "max_split_size_mb:40,garbage_collection_threshold:0.5,expandable_segments:False",
    )
    .unwrap();
    let alloc = CudaAllocator::new(ctx.clone(), settings.clone()).unwrap();
    assert_eq!(alloc.settings(), settings);
    let stream = ctx.new_stream().unwrap();
    let a = alloc.alloc(3 * MIB, &stream).unwrap();
    let b = alloc.alloc(1000, &stream).unwrap();
    let text = alloc.memory_summary();
    println!("{text}");
    assert!(text.contains("cachalot CUDA memory summary, device ID 0"));
    assert!(text.contains("| Allocated memory      |"));
    assert!(text.contains("|       from large pool |   3072 KiB |"));
    assert!(text.contains("| GPU reserved memory   |  22528 KiB |"));
    drop((a, b));
    alloc.flush_thread_cache();
    let segments = alloc.segments();
    assert_eq!(segments.len(), 2);
    assert!(
        segments
            .iter()
            .all(|s| s.blocks.iter().all(|b| b.state == BlockPhase::Free))
    );
}

#[test]
fn buffers_keep_the_allocator_alive() {
    let Some(ctx) = gpu("buffers_keep_the_allocator_alive") else {
        return;
    };
    let _device = exclusive();
    let stream = ctx.new_stream().unwrap();
    let alloc = CudaAllocator::new(ctx.clone(), Settings::default()).unwrap();
    let buf = alloc.clone_htod(&pattern(3, 5 * MIB), &stream).unwrap();
    let clone = alloc.clone();
    drop(alloc);
    drop(clone);
    // The allocator is gone from the program's hands; the buffer still works.
    assert_eq!(stream.clone_dtoh(&buf).unwrap(), pattern(3, 5 * MIB));
    let weak = Arc::downgrade(buf.stream());
    drop(buf);
    assert!(weak.upgrade().is_some(), "our stream is still ours");
}

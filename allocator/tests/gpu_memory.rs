//! GPU tests of the device's memory: out-of-memory under a memory fraction and on the real
//! device, with the device's real figures and recovery afterwards; `empty_cache` giving memory
//! back to the driver (as `cuMemGetInfo` sees it); and no leak once the last owner is gone.
#![cfg(not(loom))]

mod gpu_common;

use std::sync::Arc;

use cachalot::cuda::cudarc::driver::CudaStream;
use cachalot::cuda::{CudaAllocator, DeviceBlock};
use cachalot::{MemInfo, Settings};
use gpu_common::{MIB, exclusive, free_memory, gpu};

/// Driver memory that may come and go outside the allocator (context bookkeeping).
const TOLERANCE: u64 = 4 << 20;

fn close(a: u64, b: u64, tolerance: u64) -> bool {
    a.abs_diff(b) <= tolerance
}

#[test]
fn out_of_memory_under_a_memory_fraction_reports_real_figures_and_recovers() {
    let Some(ctx) = gpu("out_of_memory_under_a_memory_fraction_reports_real_figures_and_recovers")
    else {
        return;
    };
    let _device = exclusive();
    let alloc = CudaAllocator::new(ctx.clone(), Settings::default()).unwrap();
    alloc.set_memory_fraction(0.01).unwrap();
    let stream = ctx.new_stream().unwrap();
    let MemInfo { total, .. } = alloc.mem_info().unwrap();
    let allowed = (0.01 * total as f64) as u64;
    let size = 100 * MIB;

    let mut held: Vec<DeviceBlock> = Vec::new();
    let err = loop {
        match alloc.alloc(size, &stream) {
            Ok(b) => held.push(b),
            Err(e) => break e,
        }
        assert!(held.len() < 10_000, "the memory fraction does not bind");
    };
    let oom = err
        .out_of_memory()
        .unwrap_or_else(|| panic!("not an OOM: {err:?}"));
    println!("{err}");
    let fit = (allowed / size as u64) as usize;
    assert_eq!(held.len(), fit);
    assert_eq!(oom.device, 0);
    assert_eq!(oom.requested, size as u64);
    assert_eq!(oom.alloc_size, size as u64);
    assert_eq!(oom.capacity, total);
    assert_eq!(oom.allowed, Some(allowed));
    assert_eq!(oom.allocated, (fit * size) as u64);
    assert_eq!(oom.reserved_unallocated, 0);
    // The device's free memory, asked of the driver at the failure.
    assert!(close(oom.device_free, free_memory(&ctx), 64 << 20));
    assert_eq!(alloc.stats().num_ooms, 1);

    // Usable afterwards: free one and the same request succeeds, from the cache.
    let device_allocs = alloc.stats().num_device_alloc;
    held.pop();
    let again = alloc.alloc(size, &stream).unwrap();
    assert_eq!(alloc.stats().num_device_alloc, device_allocs);
    drop(again);
    // Free all: a request larger than any cached block releases the cache and retries.
    held.clear();
    let big = alloc.alloc(allowed as usize - 2 * MIB, &stream).unwrap();
    assert!(alloc.stats().num_alloc_retries >= 1);
    drop(big);
    alloc.check_invariants().unwrap();
}

#[test]
fn a_request_beyond_the_device_fails_cleanly_and_the_allocator_carries_on() {
    let Some(ctx) = gpu("a_request_beyond_the_device_fails_cleanly_and_the_allocator_carries_on")
    else {
        return;
    };
    let _device = exclusive();
    let alloc = CudaAllocator::new(ctx.clone(), Settings::default()).unwrap();
    let stream = ctx.new_stream().unwrap();
    let keep = alloc.alloc(MIB, &stream).unwrap();
    let total = alloc.mem_info().unwrap().total;
    let err = alloc.alloc(total as usize * 2, &stream).unwrap_err();
    println!("{err}");
    let oom = err.out_of_memory().expect("out of memory");
    assert_eq!(oom.capacity, total);
    assert_eq!(oom.allowed, None);
    assert_eq!(oom.allocated, MIB as u64);
    assert!(oom.device_free <= total);
    assert!(err.to_string().contains("CUDA out of memory"));
    let stats = alloc.stats();
    assert_eq!((stats.num_ooms, stats.num_alloc_retries), (1, 1));
    // Carries on: a small request and the block kept are fine.
    let small = alloc.clone_htod(&[9u8; 4096], &stream).unwrap();
    assert_eq!(stream.clone_dtoh(&small).unwrap(), vec![9u8; 4096]);
    drop((small, keep));
    alloc.check_invariants().unwrap();
}

#[test]
fn empty_cache_returns_memory_to_the_driver() {
    let Some(ctx) = gpu("empty_cache_returns_memory_to_the_driver") else {
        return;
    };
    let _device = exclusive();
    let stream = ctx.new_stream().unwrap();
    let alloc = CudaAllocator::new(ctx.clone(), Settings::default()).unwrap();
    let before = free_memory(&ctx);
    let blocks: Vec<DeviceBlock> = [1 << 30, 300 * MIB, 3 * MIB, 1000, 512 * 1024]
        .iter()
        .map(|&n| alloc.alloc(n, &stream).unwrap())
        .collect();
    let reserved = alloc.stats().reserved_bytes.all.current as u64;
    drop(blocks);
    let cached = free_memory(&ctx);
    assert!(
        before - cached >= reserved,
        "freed blocks stay cached: {} MiB fewer free, {} MiB reserved",
        (before - cached) >> 20,
        reserved >> 20
    );
    alloc.empty_cache().unwrap();
    let after = free_memory(&ctx);
    println!(
        "free memory: {} MiB before, {} MiB with {} MiB cached, {} MiB after empty_cache",
        before >> 20,
        cached >> 20,
        reserved >> 20,
        after >> 20
    );
    assert!(close(after, before, TOLERANCE), "{before} vs {after}");
    let stats = alloc.stats();
    assert_eq!(stats.reserved_bytes.all.current, 0);
    // Under cachalot's default policy memory comes in map steps and goes in unmaps, which need
    // not pair; segments pair one free with each allocation.
    assert!(stats.num_device_free >= 1);
    if !alloc.settings().expandable_segments {
        assert_eq!(stats.num_device_free, stats.num_device_alloc);
    }
}

/// A workload over two streams, with blocks pending on the other stream, in every size class.
fn workload(alloc: &CudaAllocator, a: &Arc<CudaStream>, b: &Arc<CudaStream>) {
    let mut live = Vec::new();
    for (i, &n) in [1usize, 512, MIB, 2 * MIB, 10 * MIB + 1, 20 * MIB, 100 * MIB]
        .iter()
        .cycle()
        .take(40)
        .enumerate()
    {
        let mut block = alloc.alloc(n, if i % 3 == 0 { b } else { a }).unwrap();
        if i % 4 == 0 {
            b.memset_zeros(&mut block).unwrap(); // recorded on b when allocated on a
        }
        if i % 2 == 0 {
            live.push(block);
        }
    }
    let raw = alloc.malloc_raw(3 * MIB, a).unwrap();
    alloc.record_stream(raw, b).unwrap();
    alloc.free_raw(raw).unwrap();
    let _never_freed = alloc.malloc_raw(5000, a).unwrap(); // returned when the allocator goes
}

#[test]
fn nothing_leaks_when_the_last_owner_goes() {
    let Some(ctx) = gpu("nothing_leaks_when_the_last_owner_goes") else {
        return;
    };
    let _device = exclusive();
    let a = ctx.new_stream().unwrap();
    let b = ctx.new_stream().unwrap();
    // Warm the driver up once (its first allocations set up bookkeeping it keeps).
    {
        let warm = CudaAllocator::new(ctx.clone(), Settings::default()).unwrap();
        workload(&warm, &a, &b);
    }
    ctx.synchronize().unwrap();
    let before = free_memory(&ctx);
    let alloc = CudaAllocator::new(ctx.clone(), Settings::default()).unwrap();
    workload(&alloc, &a, &b);
    let buffer = alloc.clone_htod(&[1u64; 1000], &a).unwrap();
    let reserved = alloc.stats().reserved_bytes.all.current as u64;
    assert!(before - free_memory(&ctx) >= reserved);
    drop(alloc); // the last handle: the cache and the raw allocations go back at once...
    let held = before - free_memory(&ctx);
    assert!(
        held < reserved && held >= 2 * MIB as u64,
        "{held} bytes held after the last handle, {reserved} reserved before"
    );
    drop(buffer); // ...and the last buffer's segment with it: every segment is back
    let after = free_memory(&ctx);
    println!(
        "free memory: {} MiB before, {} MiB held at peak, {} MiB after",
        before >> 20,
        reserved >> 20,
        after >> 20
    );
    assert!(
        close(after, before, TOLERANCE),
        "leaked {} bytes",
        before as i64 - after as i64
    );
}

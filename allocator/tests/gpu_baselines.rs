//! GPU tests of the allocators cachalot is compared with (`cachalot::baselines`): the
//! stream-ordered pool reuses what was freed on the same stream and gives it back on a trim;
//! `cuMemAlloc` memory shows in the device's used memory until it is freed, and a request
//! beyond the device is refused as out of memory, with the allocator still usable.
#![cfg(not(loom))]

mod gpu_common;

use cachalot::baselines::{DriverMalloc, StreamOrderedPool};
use gpu_common::{MIB, exclusive, gpu};

/// Far beyond any GPU's memory.
const HUGE: usize = 1 << 50;

#[test]
fn the_pool_reuses_a_block_freed_on_the_same_stream() {
    let Some(ctx) = gpu("the_pool_reuses_a_block_freed_on_the_same_stream") else {
        return;
    };
    let _device = exclusive();
    let stream = ctx.new_stream().unwrap();
    let pool = StreamOrderedPool::new(ctx).unwrap();
    assert_eq!(pool.reserved_current().unwrap(), 0);
    let size = 64 * MIB;
    let first = pool.alloc(size, &stream).unwrap();
    assert_eq!(pool.used_current().unwrap(), size as u64);
    let reserved = pool.reserved_high().unwrap();
    assert!(reserved >= size as u64, "{reserved} reserved for {size}");
    pool.free(first, &stream).unwrap();
    assert_eq!(pool.used_current().unwrap(), 0);
    // Release threshold u64::MAX: the memory stays in the pool.
    assert_eq!(pool.reserved_current().unwrap(), reserved);
    for _ in 0..10 {
        let again = pool.alloc(size, &stream).unwrap();
        pool.free(again, &stream).unwrap();
    }
    assert_eq!(pool.reserved_high().unwrap(), reserved, "the pool grew");
    assert_eq!(pool.used_high().unwrap(), size as u64);
    stream.synchronize().unwrap();
}

#[test]
fn trimming_the_pool_gives_its_free_memory_back() {
    let Some(ctx) = gpu("trimming_the_pool_gives_its_free_memory_back") else {
        return;
    };
    let _device = exclusive();
    let stream = ctx.new_stream().unwrap();
    let pool = StreamOrderedPool::new(ctx).unwrap();
    let kept = pool.alloc(8 * MIB, &stream).unwrap();
    let freed = pool.alloc(256 * MIB, &stream).unwrap();
    pool.free(freed, &stream).unwrap();
    stream.synchronize().unwrap();
    let before = pool.reserved_current().unwrap();
    assert!(before >= 264 * MIB as u64, "{before}");
    pool.trim(0).unwrap();
    let after = pool.reserved_current().unwrap();
    // What backs the live block stays; the freed 256 MiB goes.
    assert!(after >= 8 * MIB as u64, "{after}");
    assert!(after <= before - 256 * MIB as u64, "{before} -> {after}");
    pool.free(kept, &stream).unwrap();
    stream.synchronize().unwrap();
    pool.trim(0).unwrap();
    assert_eq!(pool.reserved_current().unwrap(), 0);
}

#[test]
fn the_pool_refuses_a_huge_request_as_out_of_memory_and_stays_usable() {
    let Some(ctx) = gpu("the_pool_refuses_a_huge_request_as_out_of_memory_and_stays_usable") else {
        return;
    };
    let _device = exclusive();
    let stream = ctx.new_stream().unwrap();
    let pool = StreamOrderedPool::new(ctx).unwrap();
    let err = pool.alloc(HUGE, &stream).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    let block = pool.alloc(MIB, &stream).unwrap();
    pool.free(block, &stream).unwrap();
    stream.synchronize().unwrap();
}

#[test]
fn driver_malloc_memory_is_used_until_freed() {
    let Some(ctx) = gpu("driver_malloc_memory_is_used_until_freed") else {
        return;
    };
    let _device = exclusive();
    let malloc = DriverMalloc::new(ctx).unwrap();
    let size = 512 * MIB;
    // Driver bookkeeping may move the figure by a few MiB.
    let tolerance = 16 * MIB as u64;
    let start = malloc.device_used_bytes().unwrap();
    let block = malloc.alloc(size).unwrap();
    assert_ne!(block.address(), 0);
    assert_eq!(block.size(), size as u64);
    let during = malloc.device_used_bytes().unwrap();
    assert!(
        during >= start + size as u64 - tolerance,
        "{start} -> {during} for {size}"
    );
    malloc.free(block).unwrap();
    let after = malloc.device_used_bytes().unwrap();
    assert!(
        after <= start + tolerance,
        "{start} -> {after} after the free"
    );
}

#[test]
fn driver_malloc_refuses_a_huge_request_as_out_of_memory_and_stays_usable() {
    let Some(ctx) = gpu("driver_malloc_refuses_a_huge_request_as_out_of_memory_and_stays_usable")
    else {
        return;
    };
    let _device = exclusive();
    let malloc = DriverMalloc::new(ctx).unwrap();
    let err = malloc.alloc(HUGE).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    let block = malloc.alloc(MIB).unwrap();
    malloc.free(block).unwrap();
}

//! GPU tests of the cross-stream rule: a buffer freed on stream A while stream B still reads
//! it is not handed out again until B is done — recorded automatically by copies and
//! `Launch`, by hand with `record_stream` — and, with automatic recording off, the failure the
//! rule prevents: the same memory handed out at once and overwritten under B's feet.
#![cfg(not(loom))]

mod gpu_common;

use std::sync::Arc;
use std::time::Instant;

use cachalot::cuda::cudarc::driver::{
    CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg,
};
use cachalot::cuda::{CudaAllocator, DeviceBuffer, Launch};
use cachalot::{BlockPhase, Settings};
use gpu_common::{exclusive, function, gpu, kernels};

/// 4 Mi values (16 MiB): a large-pool block.
const N: usize = 4 << 20;
const VALUE: u32 = 7;
/// How long the reading kernel spins: long enough for the host to free, reallocate and queue
/// an overwrite while it runs.
const SPIN_NS: u64 = 100_000_000;

struct Setup {
    ctx: Arc<CudaContext>,
    alloc: CudaAllocator,
    a: Arc<CudaStream>,
    b: Arc<CudaStream>,
    spin: CudaFunction,
}

fn setup(name: &str) -> Option<Setup> {
    let ctx = gpu(name)?;
    let module = kernels(&ctx);
    let spin = function(&module, "spin_check");
    let alloc = CudaAllocator::new(ctx.clone(), Settings::default()).unwrap();
    let a = ctx.new_stream().unwrap();
    let b = ctx.new_stream().unwrap();
    Some(Setup {
        ctx,
        alloc,
        a,
        b,
        spin,
    })
}

fn spin_config() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (4, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A buffer of `VALUE`s on stream A, visible to stream B.
fn filled(s: &Setup) -> DeviceBuffer<u32> {
    let buf = s.alloc.clone_htod(&vec![VALUE; N], &s.a).unwrap();
    s.b.join(&s.a).unwrap();
    buf
}

/// Launches the spinning reader of `buf` on B through `Launch` (which records the use unless
/// automatic recording is off); returns the counter of bad values it sees.
fn spin_on_b(s: &Setup, buf: &DeviceBuffer<u32>) -> DeviceBuffer<u32> {
    let mut bad = s.alloc.alloc_zeros::<u32>(1, &s.b).unwrap();
    let (n, expect, ns) = (N as u64, VALUE, SPIN_NS);
    let mut launch = Launch::new(&s.b, &s.spin);
    launch.arg(buf).arg(&n).arg(&expect).arg(&ns).arg(&mut bad);
    // SAFETY: spin_check(const volatile unsigned* buf, unsigned long long n, unsigned expect,
    // unsigned long long duration_ns, unsigned* bad); `buf` holds n values, `bad` one.
    unsafe { launch.builder().launch(spin_config()) }.unwrap();
    drop(launch);
    bad
}

fn bad_count(s: &Setup, bad: &DeviceBuffer<u32>) -> u32 {
    s.b.synchronize().unwrap();
    s.b.clone_dtoh(bad).unwrap()[0]
}

#[test]
fn a_buffer_freed_while_another_stream_reads_it_waits_for_that_stream() {
    let Some(s) = setup("a_buffer_freed_while_another_stream_reads_it_waits_for_that_stream")
    else {
        return;
    };
    let _device = exclusive();
    let buf = filled(&s);
    let address = buf.address();
    let bad = spin_on_b(&s, &buf);
    let started = Instant::now();
    drop(buf); // freed on A while B's kernel reads it

    // Allocate the same size on A at once and overwrite it there.
    let mut next = s.alloc.alloc_buffer::<u32>(N, &s.a).unwrap();
    assert_ne!(
        next.address(),
        address,
        "handed out while stream B still reads it"
    );
    s.a.memset_zeros(&mut next).unwrap();
    let pending: Vec<_> = s
        .alloc
        .segments()
        .into_iter()
        .flat_map(|seg| seg.blocks)
        .filter(|b| b.state == BlockPhase::Pending)
        .collect();
    // The decision was taken at the allocation, while B's kernel ran (it runs for 100 ms and
    // was just launched); a new segment had to come from the driver.
    println!(
        "freed, reallocated and overwrote in {:?}",
        started.elapsed()
    );
    assert_eq!(pending.len(), 1, "the freed block waits for B: {pending:?}");
    assert_eq!(pending[0].address, address);

    assert_eq!(bad_count(&s, &bad), 0, "B read overwritten memory");
    // B is done: the next allocation processes the event and gets the block back.
    let again = s.alloc.alloc_buffer::<u32>(N, &s.a).unwrap();
    assert_eq!(again.address(), address);
    s.alloc.check_invariants().unwrap();
}

#[test]
fn without_the_rule_the_block_is_reused_at_once_and_overwritten_under_the_reader() {
    let Some(s) =
        setup("without_the_rule_the_block_is_reused_at_once_and_overwritten_under_the_reader")
    else {
        return;
    };
    let _device = exclusive();
    s.alloc.set_auto_record_stream(false);
    let buf = filled(&s);
    let address = buf.address();
    let bad = spin_on_b(&s, &buf);
    let started = Instant::now();
    drop(buf);
    let mut next = s.alloc.alloc_buffer::<u32>(N, &s.a).unwrap();
    assert_eq!(
        next.address(),
        address,
        "without recording, the block is reused at once"
    );
    s.a.memset_zeros(&mut next).unwrap();
    let queued_in = started.elapsed();
    let seen = bad_count(&s, &bad);
    println!("overwrite queued {queued_in:?} after the free; B counted {seen} bad reads");
    assert!(queued_in.as_nanos() < SPIN_NS as u128 / 2);
    assert!(
        seen > 0,
        "the overwrite on A should have been seen by B's reader"
    );
}

#[test]
fn copies_on_another_stream_record_themselves() {
    let Some(s) = setup("copies_on_another_stream_record_themselves") else {
        return;
    };
    let _device = exclusive();
    // Keep B busy with an unrelated buffer, then queue a memset of `buf` on B behind it.
    let busy = filled(&s);
    let bad = spin_on_b(&s, &busy);
    let mut buf = s.alloc.alloc_buffer::<u32>(N, &s.a).unwrap();
    let address = buf.address();
    s.b.memset_zeros(&mut buf).unwrap(); // cudarc asks for device_ptr_mut(&b): recorded
    drop(buf);
    let next = s.alloc.alloc_buffer::<u32>(N, &s.a).unwrap();
    assert_ne!(next.address(), address, "the memset on B was not recorded");
    assert_eq!(bad_count(&s, &bad), 0);
    // `next` stays live, so the only free block of that size is the one B was using.
    let again = s.alloc.alloc_buffer::<u32>(N, &s.a).unwrap();
    assert_eq!(
        again.address(),
        address,
        "after B is done the block is reused"
    );
    drop(next);
}

#[test]
fn record_stream_covers_a_launch_cachalot_cannot_see() {
    let Some(s) = setup("record_stream_covers_a_launch_cachalot_cannot_see") else {
        return;
    };
    let _device = exclusive();
    let buf = filled(&s);
    let address = buf.address();
    let mut bad = s.alloc.alloc_zeros::<u32>(1, &s.b).unwrap();
    let (n, expect, ns) = (N as u64, VALUE, SPIN_NS);
    // Straight through cudarc's builder: cachalot cannot see the stream...
    let mut launch = s.b.launch_builder(&s.spin);
    launch.arg(&buf).arg(&n).arg(&expect).arg(&ns).arg(&mut bad);
    // SAFETY: as in spin_on_b.
    unsafe { launch.launch(spin_config()) }.unwrap();
    // ...so the program records the use itself.
    buf.record_stream(&s.b).unwrap();
    drop(buf);
    let mut next = s.alloc.alloc_buffer::<u32>(N, &s.a).unwrap();
    assert_ne!(next.address(), address);
    s.a.memset_zeros(&mut next).unwrap();
    assert_eq!(bad_count(&s, &bad), 0);
}

#[test]
fn empty_cache_waits_for_pending_blocks_then_releases_them() {
    let Some(s) = setup("empty_cache_waits_for_pending_blocks_then_releases_them") else {
        return;
    };
    let _device = exclusive();
    let buf = filled(&s);
    let bad = spin_on_b(&s, &buf);
    drop(buf);
    let pending = |alloc: &CudaAllocator| {
        alloc
            .segments()
            .iter()
            .flat_map(|seg| seg.blocks.iter())
            .filter(|b| b.state == BlockPhase::Pending)
            .count()
    };
    assert_eq!(pending(&s.alloc), 1);
    let before = s.alloc.stats().reserved_bytes.all.current;
    s.alloc.empty_cache().unwrap(); // waits for B's kernel
    assert_eq!(pending(&s.alloc), 0);
    let after = s.alloc.stats();
    assert!(after.reserved_bytes.all.current < before);
    assert_eq!(after.num_sync_all_streams, 1);
    assert_eq!(bad_count(&s, &bad), 0);
    drop(bad);
    s.alloc.empty_cache().unwrap();
    assert_eq!(s.alloc.stats().reserved_bytes.all.current, 0);
    let _ = &s.ctx;
}

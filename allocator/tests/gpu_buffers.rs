//! GPU tests of cudarc's stream contract, views and ownership for cachalot's buffers:
//! - data ordering: a write on one stream is seen by a read on another with no manual sync,
//!   both ways, and the buffer's own stream makes no driver call for it — with the control
//!   that, switched off, the same read sees stale data;
//! - reuse: a kernel on a side stream through `Launch`, then a drop, never has its memory
//!   handed out before the kernel ends (control: with recording off, it is);
//! - views as kernel arguments (raw and through `Launch`) and in a cuBLAS call;
//! - `f16`/`bf16` buffers (feature `f16`);
//! - buffers dropped on other threads, many streams per thread, and the allocator closing when
//!   the program drops its last handle.
//!
//! They skip (printing why) without a GPU; see `gpu_common`.
#![cfg(not(loom))]

mod gpu_common;

use std::sync::Arc;

use cachalot::Settings;
use cachalot::cuda::cudarc::driver::{
    CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg,
};
use cachalot::cuda::{CudaAllocator, DeviceBuffer, Launch};
use gpu_common::{MIB, exclusive, function, gpu, kernels};

/// 1 Mi values (4 MiB).
const N: usize = 1 << 20;
const VALUE: u32 = 0xC0FFEE;
/// How long the slow writer waits before writing: far longer than the host takes to queue
/// the read that follows it.
const DELAY_NS: u64 = 200_000_000;

struct Setup {
    ctx: Arc<CudaContext>,
    alloc: CudaAllocator,
    a: Arc<CudaStream>,
    b: Arc<CudaStream>,
    slow_fill: CudaFunction,
    spin: CudaFunction,
    add_one: CudaFunction,
}

fn setup(name: &str) -> Option<Setup> {
    let ctx = gpu(name)?;
    let module = kernels(&ctx);
    let alloc = CudaAllocator::new(ctx.clone(), Settings::default()).unwrap();
    let a = ctx.new_stream().unwrap();
    let b = ctx.new_stream().unwrap();
    Some(Setup {
        slow_fill: function(&module, "slow_fill"),
        spin: function(&module, "spin_check"),
        add_one: function(&module, "add_one"),
        ctx,
        alloc,
        a,
        b,
    })
}

fn config() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (8, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Zeros on A, finished (so the test starts from known contents).
fn zeros(s: &Setup) -> DeviceBuffer<u32> {
    let buf = s.alloc.alloc_zeros::<u32>(N, &s.a).unwrap();
    s.a.synchronize().unwrap();
    buf
}

/// Queues the slow writer of `VALUE` into `buf` on `stream`, through `Launch`.
fn slow_fill_on(s: &Setup, stream: &Arc<CudaStream>, buf: &mut DeviceBuffer<u32>) {
    let (n, value, delay) = (N as u64, VALUE, DELAY_NS);
    let mut launch = Launch::new(stream, &s.slow_fill);
    launch.arg(buf).arg(&n).arg(&value).arg(&delay);
    // SAFETY: slow_fill(unsigned* out, unsigned long long n, unsigned value,
    // unsigned long long delay_ns); `buf` holds n values.
    unsafe { launch.builder().launch(config()) }.unwrap();
}

fn count(values: &[u32], v: u32) -> usize {
    values.iter().filter(|&&x| x == v).count()
}

#[test]
fn a_write_on_stream_a_is_seen_by_a_read_on_stream_b_with_no_manual_sync() {
    let Some(s) = setup("a_write_on_stream_a_is_seen_by_a_read_on_stream_b_with_no_manual_sync")
    else {
        return;
    };
    let _device = exclusive();
    let mut buf = zeros(&s);
    slow_fill_on(&s, &s.a, &mut buf); // the buffer's own stream: nothing to order yet
    assert_eq!(buf.ordering_calls(), 0);
    let seen = s.b.clone_dtoh(&buf).unwrap(); // B waits for A's write
    assert_eq!(count(&seen, VALUE), N, "B read before A's write landed");
    assert!(buf.ordering_calls() > 0);
}

#[test]
fn without_data_ordering_the_same_read_sees_stale_data() {
    let Some(s) = setup("without_data_ordering_the_same_read_sees_stale_data") else {
        return;
    };
    let _device = exclusive();
    s.alloc.set_data_ordering(false);
    assert!(!s.alloc.data_ordering());
    let mut buf = zeros(&s);
    slow_fill_on(&s, &s.a, &mut buf);
    let seen = s.b.clone_dtoh(&buf).unwrap();
    println!(
        "without ordering, B saw {} of {N} values written",
        count(&seen, VALUE)
    );
    assert_eq!(count(&seen, 0), N, "B waited for A after all");
    assert_eq!(buf.ordering_calls(), 0);
    s.a.synchronize().unwrap();
}

#[test]
fn a_write_on_another_stream_is_seen_back_on_the_buffers_own_stream() {
    let Some(s) = setup("a_write_on_another_stream_is_seen_back_on_the_buffers_own_stream") else {
        return;
    };
    let _device = exclusive();
    let mut buf = zeros(&s);
    slow_fill_on(&s, &s.b, &mut buf); // B waits for A's zeros, then writes late
    let seen = s.a.clone_dtoh(&buf).unwrap(); // A waits for B's write
    assert_eq!(count(&seen, VALUE), N, "A read before B's write landed");
    // A waited once; from then on the buffer is A's again and costs nothing there.
    let calls = buf.ordering_calls();
    for _ in 0..10 {
        s.a.memset_zeros(&mut buf).unwrap();
        assert_eq!(count(&s.a.clone_dtoh(&buf).unwrap(), 0), N);
    }
    assert_eq!(
        buf.ordering_calls(),
        calls,
        "the owner's stream made ordering calls"
    );
}

#[test]
fn a_write_on_b_waits_for_a_read_on_c() {
    let Some(s) = setup("a_write_on_b_waits_for_a_read_on_c") else {
        return;
    };
    let _device = exclusive();
    let c = s.ctx.new_stream().unwrap();
    let mut buf = s.alloc.clone_htod(&vec![VALUE; N], &s.a).unwrap();
    // C reads for a long while (through Launch: a read), B then overwrites with zeros.
    let mut bad = s.alloc.alloc_zeros::<u32>(1, &c).unwrap();
    let (n, expect, ns) = (N as u64, VALUE, DELAY_NS);
    let mut launch = Launch::new(&c, &s.spin);
    launch.arg(&buf).arg(&n).arg(&expect).arg(&ns).arg(&mut bad);
    // SAFETY: spin_check(const volatile unsigned* buf, unsigned long long n, unsigned expect,
    // unsigned long long duration_ns, unsigned* bad); `buf` holds n values, `bad` one.
    unsafe { launch.builder().launch(config()) }.unwrap();
    drop(launch);
    s.b.memset_zeros(&mut buf).unwrap(); // must wait for C's read
    assert_eq!(c.clone_dtoh(&bad).unwrap()[0], 0, "C read B's zeros");
    assert_eq!(count(&s.a.clone_dtoh(&buf).unwrap(), 0), N);
}

#[test]
fn the_buffers_own_stream_makes_no_ordering_call() {
    let Some(s) = setup("the_buffers_own_stream_makes_no_ordering_call") else {
        return;
    };
    let _device = exclusive();
    let mut buf = s.alloc.alloc_zeros::<u32>(N, &s.a).unwrap();
    let mut other = s.alloc.alloc_zeros::<u32>(N, &s.a).unwrap();
    for _ in 0..20 {
        s.a.memcpy_htod(&vec![3u32; N], &mut buf).unwrap();
        s.a.memcpy_dtod(&buf, &mut other).unwrap();
        slow_fill_on(&s, &s.a, &mut other);
        let mut view = other.slice_mut(10..20);
        s.a.memset_zeros(&mut view).unwrap();
        let _ = s.a.clone_dtoh(&buf.slice(..5)).unwrap();
    }
    s.a.synchronize().unwrap();
    assert_eq!(buf.ordering_calls(), 0);
    assert_eq!(other.ordering_calls(), 0);
    let _ = s.b.clone_dtoh(&buf).unwrap();
    assert!(buf.ordering_calls() > 0, "a use on B was not ordered");
}

#[test]
fn a_kernel_on_a_side_stream_then_a_drop_never_has_its_memory_reused_before_it_ends() {
    let Some(s) =
        setup("a_kernel_on_a_side_stream_then_a_drop_never_has_its_memory_reused_before_it_ends")
    else {
        return;
    };
    let _device = exclusive();
    let mut buf = zeros(&s);
    let address = buf.address();
    slow_fill_on(&s, &s.b, &mut buf); // writes VALUE ~200 ms from now, on B
    drop(buf);
    // The same size on the owning stream, at once, overwritten there with zeros.
    let mut next = s.alloc.alloc_buffer::<u32>(N, &s.a).unwrap();
    s.a.memset_zeros(&mut next).unwrap();
    s.ctx.synchronize().unwrap();
    assert_ne!(next.address(), address, "handed out while B's kernel ran");
    assert_eq!(
        count(&s.a.clone_dtoh(&next).unwrap(), 0),
        N,
        "B's late write landed in the new buffer"
    );
}

#[test]
fn without_recording_the_side_streams_late_write_lands_in_the_next_buffer() {
    let Some(s) = setup("without_recording_the_side_streams_late_write_lands_in_the_next_buffer")
    else {
        return;
    };
    let _device = exclusive();
    s.alloc.set_auto_record_stream(false);
    let mut buf = zeros(&s);
    let address = buf.address();
    slow_fill_on(&s, &s.b, &mut buf);
    drop(buf);
    let mut next = s.alloc.alloc_buffer::<u32>(N, &s.a).unwrap();
    s.a.memset_zeros(&mut next).unwrap();
    s.ctx.synchronize().unwrap();
    assert_eq!(next.address(), address, "not reused at once");
    assert_eq!(count(&s.a.clone_dtoh(&next).unwrap(), VALUE), N);
}

#[test]
fn views_are_kernel_arguments_raw_and_through_launch() {
    let Some(s) = setup("views_are_kernel_arguments_raw_and_through_launch") else {
        return;
    };
    let _device = exclusive();
    let host: Vec<u8> = (0..2 * MIB).map(|i| (i % 250) as u8).collect();
    let mut buf = s.alloc.clone_htod(&host, &s.a).unwrap();
    let half = MIB;
    {
        // Raw, on the buffer's own stream: right half := left half + 1.
        let (left, mut right) = buf.split_at_mut(half);
        let left = left.into_view();
        let n = half as u64;
        let mut args = s.a.launch_builder(&s.add_one);
        args.arg(&mut right).arg(&left).arg(&n);
        // SAFETY: add_one(unsigned char* out, const unsigned char* in, unsigned long long n);
        // both views hold n bytes.
        unsafe { args.launch(config()) }.unwrap();
    }
    {
        // Through Launch, on B: bytes 100..200 := bytes 0..100 + 1 (after the kernel above).
        let (left, mut right) = buf.split_at_mut(100);
        let mut out = right.slice_mut(..100);
        let n = 100u64;
        let mut launch = Launch::new(&s.b, &s.add_one);
        launch.arg(&mut out).arg(&left).arg(&n);
        // SAFETY: as above; both views hold 100 bytes.
        unsafe { launch.builder().launch(config()) }.unwrap();
    }
    let back = s.a.clone_dtoh(&buf).unwrap();
    let mut want = host.clone();
    for i in 0..half {
        want[half + i] = host[i].wrapping_add(1);
    }
    for i in 0..100 {
        want[100 + i] = host[i].wrapping_add(1);
    }
    assert_eq!(back, want);
    // A view's bounds are checked, never trusted.
    assert!(buf.try_slice(..2 * MIB + 1).is_none());
    assert!(buf.try_split_at_mut(2 * MIB + 1).is_none());
    // SAFETY: u32 from bytes: every bit pattern is a u32.
    let words = unsafe { buf.transmute::<u32>(MIB / 2) }.unwrap();
    assert_eq!(words.len(), MIB / 2);
    assert!(unsafe { buf.transmute::<u32>(MIB / 2 + 1) }.is_none());
    assert!(
        unsafe { buf.slice(1..).transmute::<u32>(1) }.is_none(),
        "misaligned"
    );
}

#[test]
fn views_go_to_cublas_on_another_stream() {
    use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, sys::cublasOperation_t};
    let Some(s) = setup("views_go_to_cublas_on_another_stream") else {
        return;
    };
    let _device = exclusive();
    // Column-major A (m×k), B (k×n) and C (m×n), all in one buffer.
    let (m, k, n) = (64usize, 48usize, 80usize);
    let a: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32 - 3.0).collect();
    let b: Vec<f32> = (0..k * n).map(|i| (i % 5) as f32 - 2.0).collect();
    let mut host = a.clone();
    host.extend(&b);
    host.extend(std::iter::repeat_n(-1.0f32, m * n));
    let mut buf = s.alloc.clone_htod(&host, &s.a).unwrap(); // written on A
    let blas = CudaBlas::new(s.b.clone()).unwrap(); // runs on B
    {
        let (ab, mut c) = buf.split_at_mut(m * k + k * n);
        let (av, bv) = (ab.slice(..m * k), ab.slice(m * k..));
        assert_eq!((av.len(), bv.len(), c.len()), (m * k, k * n, m * n));
        let cfg = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_N,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: m as i32,
            n: n as i32,
            k: k as i32,
            alpha: 1.0f32,
            lda: m as i32,
            ldb: k as i32,
            beta: 0.0f32,
            ldc: m as i32,
        };
        // SAFETY: the dimensions and leading dimensions match the views' lengths.
        unsafe { blas.gemm(cfg, &av, &bv, &mut c) }.unwrap();
    }
    let back = s.a.clone_dtoh(&buf.slice(m * k + k * n..)).unwrap(); // A waits for B
    for j in 0..n {
        for i in 0..m {
            let want: f32 = (0..k).map(|p| a[i + p * m] * b[p + j * k]).sum();
            assert_eq!(back[i + j * m], want, "C[{i},{j}]");
        }
    }
    assert_eq!(
        s.a.clone_dtoh(&buf.slice(..m * k)).unwrap(),
        a,
        "A was overwritten"
    );
}

#[cfg(feature = "f16")]
#[test]
fn half_precision_buffers_round_trip() {
    use half::{bf16, f16};
    let Some(s) = setup("half_precision_buffers_round_trip") else {
        return;
    };
    let _device = exclusive();
    let h: Vec<f16> = (0..1000).map(|i| f16::from_f32(i as f32 / 8.0)).collect();
    let buf = s.alloc.clone_htod(&h, &s.a).unwrap();
    assert_eq!(buf.num_bytes(), 2000);
    assert_eq!(s.b.clone_dtoh(&buf).unwrap(), h);
    let z = s.alloc.alloc_zeros::<bf16>(333, &s.a).unwrap();
    assert_eq!(s.a.clone_dtoh(&z).unwrap(), vec![bf16::ZERO; 333]);
    let mut u = s.alloc.alloc_buffer::<bf16>(4, &s.a).unwrap();
    s.a.memcpy_htod(&[bf16::ONE; 4], &mut u).unwrap();
    assert_eq!(s.a.clone_dtoh(&u).unwrap(), vec![bf16::ONE; 4]);
}

#[test]
fn buffers_dropped_on_other_threads_and_on_many_streams_go_back_to_the_cache() {
    let Some(s) =
        setup("buffers_dropped_on_other_threads_and_on_many_streams_go_back_to_the_cache")
    else {
        return;
    };
    let _device = exclusive();
    // More streams than a thread keeps anchors for, each with live buffers.
    let streams: Vec<_> = (0..9).map(|_| s.ctx.new_stream().unwrap()).collect();
    let mut bufs = Vec::new();
    for round in 0..3u32 {
        for st in &streams {
            bufs.push(s.alloc.clone_htod(&[round; 1000], st).unwrap());
        }
    }
    // Dropped on other threads, half of them after a check of their contents.
    let handles: Vec<_> = bufs
        .into_iter()
        .enumerate()
        .map(|(i, buf)| {
            std::thread::spawn(move || {
                if i % 2 == 0 {
                    let v = buf.stream().clone_dtoh(&buf).unwrap();
                    assert_eq!(v, vec![(i / 9) as u32; 1000]);
                }
                drop(buf);
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    s.alloc.flush_thread_cache();
    assert_eq!(s.alloc.stats().allocation.all.current, 0);
    s.alloc.check_invariants().unwrap();
}

#[test]
fn the_last_handle_closes_the_allocator_and_live_buffers_give_memory_back_as_they_go() {
    let Some(s) =
        setup("the_last_handle_closes_the_allocator_and_live_buffers_give_memory_back_as_they_go")
    else {
        return;
    };
    let _device = exclusive();
    let free = |ctx: &Arc<CudaContext>| ctx.mem_get_info().unwrap().0 as i64;
    let Setup { ctx, alloc, a, .. } = s;
    ctx.synchronize().unwrap();
    let before = free(&ctx);
    drop(alloc.alloc(256 * MIB, &a).unwrap()); // cached (parked in this thread's cache)
    // Another size: the parked block goes back and serves it (rule 17a), so 192 MiB of it
    // stay cached beside the live 64 MiB.
    let live = alloc.clone_htod(&vec![5u8; 64 * MIB], &a).unwrap();
    let clone = live.allocator().expect("the program holds the allocator");
    drop(clone);
    assert!(before - free(&ctx) >= (256 * MIB) as i64);
    drop(alloc); // the last handle: the cache goes back, the live buffer stays
    assert!(live.allocator().is_none());
    let held = before - free(&ctx);
    assert!(
        ((64 * MIB) as i64..(256 * MIB) as i64).contains(&held),
        "held {held} bytes after closing"
    );
    assert_eq!(a.clone_dtoh(&live).unwrap(), vec![5u8; 64 * MIB]);
    drop(live);
    let after = before - free(&ctx);
    assert!(
        after < (32 * MIB) as i64,
        "{after} bytes still held after the last buffer"
    );
}

/// Rule 23k's device call on the GPU: `Backend::wait_stream(b, a)` makes work queued on B after
/// it wait for the work queued on A before it (a 200 ms writer), with no host wait — B's next
/// event completes only once A's writer has, and the writer's values are there.
#[test]
fn wait_stream_orders_later_work_on_one_stream_after_the_other() {
    use cachalot::cuda::{CudaBackend, stream_id};
    use cachalot::{Backend, StreamId};
    let Some(s) = setup("wait_stream_orders_later_work_on_one_stream_after_the_other") else {
        return;
    };
    let _device = exclusive();
    let mut backend = CudaBackend::new(s.ctx.clone()).unwrap();
    backend.retain_stream(&s.a);
    backend.retain_stream(&s.b);
    let (a, b) = (stream_id(&s.a), stream_id(&s.b));
    let mut buf = zeros(&s);
    slow_fill_on(&s, &s.a, &mut buf);
    let started = std::time::Instant::now();
    backend.wait_stream(b, a).unwrap();
    assert!(
        started.elapsed() < std::time::Duration::from_millis(50),
        "wait_stream waited on the host"
    );
    let event = s.b.record_event(None).unwrap();
    event.synchronize().unwrap();
    let waited = started.elapsed();
    assert!(
        waited >= std::time::Duration::from_millis(150),
        "B's event completed after {waited:?}, before A's 200 ms writer"
    );
    s.a.synchronize().unwrap();
    assert_eq!(count(&s.a.clone_dtoh(&buf).unwrap(), VALUE), N);
    // A stream the backend was not shown: ordered by synchronising the device (still correct).
    slow_fill_on(&s, &s.a, &mut buf);
    backend.wait_stream(StreamId(0xdead_beef), a).unwrap();
    assert!(started.elapsed() >= waited + std::time::Duration::from_millis(150));
    // A stream waiting on itself: nothing to do.
    backend.wait_stream(a, a).unwrap();
}

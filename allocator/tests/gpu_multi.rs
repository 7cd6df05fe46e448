//! GPU test of two devices at once: one allocator per device, used from one thread per device
//! at the same time, each reserving on its own device only. Skips with a message on machines
//! with fewer than two GPUs unless `CACHALOT_REQUIRE_GPUS=2`.
#![cfg(not(loom))]

mod gpu_common;

use std::thread;

use cachalot::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
use cachalot::cuda::{CudaAllocator, CudaError};
use gpu_common::{MIB, exclusive, function, gpus, kernels};

#[test]
fn two_devices_allocate_at_once_each_on_its_own_memory() {
    let Some(ctxs) = gpus("two_devices_allocate_at_once_each_on_its_own_memory", 2) else {
        return;
    };
    let _device = exclusive();
    let allocators = CudaAllocator::all_devices().unwrap();
    assert!(allocators.len() >= 2);
    for (i, a) in allocators.iter().enumerate() {
        assert_eq!(a.ordinal(), i);
    }
    let free_before: Vec<u64> = ctxs
        .iter()
        .map(|c| c.mem_get_info().unwrap().0 as u64)
        .collect();

    let workers: Vec<_> = allocators
        .iter()
        .take(2)
        .cloned()
        .map(|alloc| {
            thread::spawn(move || {
                let ctx = alloc.context().clone();
                let module = kernels(&ctx);
                let add_one = function(&module, "add_one");
                let stream = ctx.new_stream().unwrap();
                let seed = alloc.ordinal() as u8;
                let mut held = Vec::new();
                for round in 0..50usize {
                    let n = [1000, 300_000, 3 * MIB, 25 * MIB][round % 4];
                    let host: Vec<u8> = (0..n).map(|i| (i as u8).wrapping_mul(seed + 3)).collect();
                    let input = alloc.clone_htod(&host, &stream).unwrap();
                    let mut output = alloc.alloc_buffer::<u8>(n, &stream).unwrap();
                    let len = n as u64;
                    let mut launch = stream.launch_builder(&add_one);
                    launch.arg(&mut output).arg(&input).arg(&len);
                    // SAFETY: add_one(out, in, n) with n-byte buffers.
                    unsafe { launch.launch(LaunchConfig::for_num_elems(n as u32)) }.unwrap();
                    let back = stream.clone_dtoh(&output).unwrap();
                    assert!(back.iter().zip(&host).all(|(b, h)| *b == h.wrapping_add(1)));
                    if round % 5 == 0 {
                        held.push(output);
                    }
                }
                let reserved = alloc.stats().reserved_bytes.all.current as u64;
                let free_now = ctx.mem_get_info().unwrap().0 as u64;
                (alloc.ordinal(), reserved, free_now, held)
            })
        })
        .collect();
    let results: Vec<_> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    for (ordinal, reserved, free_now, _held) in &results {
        println!(
            "device {ordinal}: {} MiB reserved, free memory down {} MiB",
            reserved >> 20,
            (free_before[*ordinal] - free_now) >> 20
        );
        assert!(free_before[*ordinal] - free_now >= *reserved);
    }

    // A stream of device 1 is refused by device 0's allocator.
    let stream1 = ctxs[1].new_stream().unwrap();
    let e = allocators[0].alloc(4096, &stream1).unwrap_err();
    assert!(
        matches!(
            e,
            CudaError::WrongDevice {
                allocator_device: 0,
                stream_device: 1
            }
        ),
        "{e:?}"
    );
    // Out-of-memory errors name their device.
    allocators[1].set_memory_fraction(0.0).unwrap();
    let oom = allocators[1].alloc(4096, &stream1).unwrap_err();
    assert_eq!(oom.out_of_memory().map(|o| o.device), Some(1));

    // Everything goes back to each driver when the allocators and blocks are gone (within
    // what the driver itself may keep after a device's first kernel launches; the exact leak
    // check is gpu_memory's).
    drop(results);
    drop(allocators);
    for (i, ctx) in ctxs.iter().enumerate() {
        let free = ctx.mem_get_info().unwrap().0 as u64;
        println!(
            "device {i}: free memory {} MiB before, {} MiB after",
            free_before[i] >> 20,
            free >> 20
        );
        assert!(
            free.abs_diff(free_before[i]) <= 64 << 20,
            "device {i}: {} MiB before, {} MiB after",
            free_before[i] >> 20,
            free >> 20
        );
    }
}

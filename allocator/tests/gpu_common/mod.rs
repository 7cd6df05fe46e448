//! What every GPU test shares: finding the GPUs (or skipping, with the reason printed), one
//! lock so tests that read the device's free memory never overlap, and the kernels.
//!
//! On a machine without a CUDA driver every GPU test prints why it skips and passes; with
//! `CACHALOT_REQUIRE_GPU=1` (one GPU) or `CACHALOT_REQUIRE_GPUS=n` (n GPUs) a missing device is
//! a failure, so a run on a GPU machine proves the tests ran.

#![allow(dead_code)]

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use cachalot::cuda::cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::compile_ptx;

/// The contexts of the first `needed` devices, or `None` (after printing why) when the
/// machine has fewer and the environment does not require them.
pub fn gpus(test: &str, needed: usize) -> Option<Vec<Arc<CudaContext>>> {
    let required = std::env::var("CACHALOT_REQUIRE_GPUS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .unwrap_or(0)
        .max(
            if std::env::var("CACHALOT_REQUIRE_GPU").as_deref() == Ok("1") {
                1
            } else {
                0
            },
        );
    let reason = match cachalot::cuda::device_count() {
        Ok(n) if n >= needed => {
            let ctxs = (0..needed)
                .map(|i| CudaContext::new(i).unwrap_or_else(|e| panic!("context {i}: {e}")))
                .collect();
            return Some(ctxs);
        }
        Ok(n) => format!("{n} CUDA device(s) found, this test needs {needed}"),
        Err(e) => e.to_string(),
    };
    if required >= needed {
        panic!("{test}: a GPU run was required (CACHALOT_REQUIRE_GPU/S) but {reason}");
    }
    eprintln!("skipping {test}: {reason}");
    None
}

/// The first device's context, or `None` after printing why not.
pub fn gpu(test: &str) -> Option<Arc<CudaContext>> {
    gpus(test, 1).map(|mut v| v.remove(0))
}

static DEVICE: Mutex<()> = Mutex::new(());

/// Serialises the GPU tests of one executable: they measure the device's free memory.
pub fn exclusive() -> MutexGuard<'static, ()> {
    DEVICE.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The test kernels, in CUDA C compiled at run time by NVRTC.
pub const KERNELS: &str = r#"
extern "C" __global__ void add_one(unsigned char* out, const unsigned char* in, unsigned long long n) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = (unsigned char)(in[i] + 1);
    }
}

__device__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Reads `buf` over and over for `duration_ns`, counting values that are not `expect`.
extern "C" __global__ void spin_check(const volatile unsigned int* buf, unsigned long long n,
                                      unsigned int expect, unsigned long long duration_ns,
                                      unsigned int* bad) {
    unsigned long long start = now_ns();
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned int errs = 0;
    do {
        for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n; i += stride) {
            if (buf[i] != expect) errs++;
        }
    } while (now_ns() - start < duration_ns);
    if (errs) atomicAdd(bad, errs);
}

// Waits `delay_ns`, then writes `value` to each of the `n` values of `out`: a write that lands
// long after it was queued, so a reader not ordered after it sees the old values.
extern "C" __global__ void slow_fill(unsigned int* out, unsigned long long n, unsigned int value,
                                     unsigned long long delay_ns) {
    unsigned long long start = now_ns();
    while (now_ns() - start < delay_ns) {}
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = value;
    }
}
"#;

/// Compiles [`KERNELS`] with NVRTC and loads them into `ctx`. NVRTC is loaded at run time: a
/// missing library is a test failure with a readable message (cudarc panics; caught here).
pub fn kernels(ctx: &Arc<CudaContext>) -> Arc<CudaModule> {
    let ptx = std::panic::catch_unwind(|| compile_ptx(KERNELS))
        .unwrap_or_else(|_| {
            panic!("NVRTC (libnvrtc) could not be loaded: put the CUDA toolkit's lib64 on LD_LIBRARY_PATH")
        })
        .unwrap_or_else(|e| panic!("NVRTC failed: {e}"));
    ctx.load_module(ptx).expect("load the test kernels")
}

/// One kernel of the module.
pub fn function(module: &Arc<CudaModule>, name: &str) -> CudaFunction {
    module
        .load_function(name)
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// Bytes in a mebibyte.
pub const MIB: usize = 1 << 20;

/// The device's free memory (`cuMemGetInfo`), in bytes.
pub fn free_memory(ctx: &Arc<CudaContext>) -> u64 {
    ctx.mem_get_info().unwrap().0 as u64
}

/// `len` pseudo-random bytes, different for each seed (xorshift64*).
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        out.extend_from_slice(&x.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
    }
    out.truncate(len);
    out
}

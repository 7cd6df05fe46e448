//! cachalot in five steps: allocate, copy, launch a kernel, free, print the memory summary.
//!
//! Run on a machine with an NVIDIA GPU: `cargo run --release -p cachalot --example quickstart`.
//! Settings come from `CACHALOT_ALLOC_CONF` (PyTorch's `PYTORCH_CUDA_ALLOC_CONF` syntax).
//! NVRTC comes from cachalot's dev-dependency on cudarc with `nvrtc`: a program of its own asks
//! its cudarc dependency for `nvrtc` (cachalot does not turn it on).

use cachalot::cuda::cudarc::driver::LaunchConfig;
use cachalot::cuda::{CudaAllocator, Launch};
use cudarc::nvrtc::compile_ptx;

const SAXPY: &str = r#"
extern "C" __global__ void saxpy(float* y, const float* x, float a, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"#;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // 1. One allocator per device (clone it freely: clones share the cache).
    let alloc = match CudaAllocator::for_device(0) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("quickstart needs a CUDA GPU: {e}");
            return Ok(());
        }
    };
    let ctx = alloc.context().clone();
    let stream = ctx.new_stream()?;
    println!("device 0: {}", ctx.name()?);

    // 2. Allocate and copy: buffers work with cudarc's copies like CudaSlices.
    let n: u32 = 1 << 20;
    let x_host: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let x = alloc.clone_htod(&x_host, &stream)?;
    let mut y = alloc.alloc_zeros::<f32>(n as usize, &stream)?;
    stream.memcpy_htod(&vec![1.0f32; n as usize], &mut y)?;

    // 3. Launch a kernel (compiled at run time by NVRTC). `Launch` records buffers used on
    //    other streams than their own; here everything runs on one stream.
    let saxpy = ctx
        .load_module(compile_ptx(SAXPY)?)?
        .load_function("saxpy")?;
    let a = 2.0f32;
    let mut launch = Launch::new(&stream, &saxpy);
    launch.arg(&mut y).arg(&x).arg(&a).arg(&n);
    // SAFETY: saxpy(float* y, const float* x, float a, unsigned n): y and x hold n floats.
    unsafe { launch.builder().launch(LaunchConfig::for_num_elems(n)) }?;
    drop(launch);
    let y_host = stream.clone_dtoh(&y)?;
    assert!(
        y_host
            .iter()
            .enumerate()
            .all(|(i, &v)| v == 2.0 * i as f32 + 1.0)
    );
    println!("saxpy on {n} floats: correct");

    // 4. Free: the memory goes back to cachalot's cache, and the next request of the same size
    //    on the same stream reuses it without a driver call.
    let address = y.address();
    drop(y);
    let again = alloc.alloc_buffer::<f32>(n as usize, &stream)?;
    assert_eq!(again.address(), address);
    println!(
        "reallocated 4 MiB at the same address {address:#x}; cuMemAlloc calls so far: {}",
        alloc.stats().num_device_alloc
    );
    drop((again, x));

    // 5. The summary, in the manner of torch.cuda.memory_summary(). With cachalot's defaults
    //    this thread keeps its just-freed blocks for its next requests (they count as
    //    allocated until then); flush them first so the summary shows the program's own use.
    alloc.flush_thread_cache();
    println!("{}", alloc.memory_summary());
    alloc.empty_cache()?;
    println!(
        "after empty_cache: {} bytes reserved",
        alloc.stats().reserved_bytes.all.current
    );
    Ok(())
}

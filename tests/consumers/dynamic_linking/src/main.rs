//! A candle-style consumer: its cudarc links the driver (`dynamic-linking`), and cachalot's
//! allocator works on that cudarc's contexts and streams.

use cachalot::Settings;
use cachalot::cuda::{CudaAllocator, CudaError, DeviceBuffer};
use cudarc::driver::CudaContext;

fn run() -> Result<(), Box<dyn std::error::Error>> {
    // The program's own cudarc context, shared with cachalot (one cudarc in the build).
    let ctx = CudaContext::new(0)?;
    let alloc = CudaAllocator::new(ctx, Settings::pytorch())?;
    let stream = alloc.context().new_stream()?;
    let host = vec![1.5f32; 1 << 20];
    let buf: DeviceBuffer<f32> = alloc.clone_htod(&host, &stream)?;
    assert_eq!(stream.clone_dtoh(&buf)?, host);
    drop(buf);
    println!("{}", alloc.memory_summary());
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        match e.downcast_ref::<CudaError>() {
            Some(CudaError::NoDriver { .. }) => eprintln!("no CUDA driver: {e}"),
            _ => eprintln!("error: {e}"),
        }
        std::process::exit(1);
    }
}

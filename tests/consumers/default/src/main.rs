//! A consumer with cachalot's default features: the driver is loaded at run time, so this
//! builds and runs (reporting that there is no driver) on a machine without CUDA.

use cachalot::cuda::{CudaAllocator, DeviceBuffer, device_count};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let alloc = match CudaAllocator::for_device(0) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("no GPU ({e}); devices: {:?}", device_count());
            return Ok(());
        }
    };
    let stream = alloc.context().new_stream()?;
    let buf: DeviceBuffer<f32> = alloc.alloc_zeros(1 << 20, &stream)?;
    assert_eq!(stream.clone_dtoh(&buf)?, vec![0.0f32; 1 << 20]);
    drop(buf);
    println!("{}", alloc.memory_summary());
    Ok(())
}

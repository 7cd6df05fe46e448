//! The device's own figure of memory in use, sampled from outside the allocator: a thread
//! that asks the driver (`cuMemGetInfo`, what `torch.cuda.mem_get_info()` asks) every few
//! hundred microseconds and keeps the highest reading. It holds no Python lock, so it measures
//! a PyTorch job without slowing its Python thread, whichever allocator serves the job.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cachalot::cuda::CudaError;
use cachalot::cuda::cudarc::driver::CudaContext;

/// What a sampler saw.
#[derive(Clone, Copy, Debug, Default)]
pub struct Readings {
    /// The highest `total − free` read, in bytes.
    pub peak_used: u64,
    /// The lowest `total − free` read (the context and other processes, before the job).
    pub min_used: u64,
    /// The last reading.
    pub last_used: u64,
    /// The device's total memory.
    pub total: u64,
    /// How many readings were taken.
    pub samples: u64,
    /// Seconds between the first reading and the last.
    pub seconds: f64,
}

/// A running sampler; [`Sampler::stop`] ends it and returns what it saw.
pub struct Sampler {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Result<Readings, String>>>,
}

impl Sampler {
    /// Starts sampling device `ordinal` every `interval`. Fails when the device cannot be
    /// opened (no driver, no such device); the first reading is taken before this returns.
    pub fn start(ordinal: usize, interval: Duration) -> Result<Sampler, String> {
        let count = cachalot::cuda::device_count().map_err(|e| e.to_string())?;
        if ordinal >= count {
            return Err(CudaError::NoSuchDevice { ordinal, count }.to_string());
        }
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(), String>>();
        let flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("cachalot-memory-sampler".into())
            .spawn(move || {
                let read = |ctx: &Arc<CudaContext>| {
                    ctx.mem_get_info()
                        .map(|(free, total)| (total.saturating_sub(free) as u64, total as u64))
                        .map_err(|e| CudaError::from(e).to_string())
                };
                let first = CudaContext::new(ordinal)
                    .map_err(|e| CudaError::from(e).to_string())
                    .and_then(|ctx| Ok((read(&ctx)?, ctx)));
                let ((used, total), ctx) = match first {
                    Ok(v) => {
                        let _ = ready_tx.send(Ok(()));
                        v
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.clone()));
                        return Err(e);
                    }
                };
                let started = Instant::now();
                let mut r = Readings {
                    peak_used: used,
                    min_used: used,
                    last_used: used,
                    total,
                    samples: 1,
                    seconds: 0.0,
                };
                while !flag.load(Ordering::Acquire) {
                    std::thread::sleep(interval);
                    let (used, _) = read(&ctx)?;
                    r.peak_used = r.peak_used.max(used);
                    r.min_used = r.min_used.min(used);
                    r.last_used = used;
                    r.samples += 1;
                }
                // One last reading after the stop was asked, so the end state is seen.
                let (used, _) = read(&ctx)?;
                r.peak_used = r.peak_used.max(used);
                r.last_used = used;
                r.samples += 1;
                r.seconds = started.elapsed().as_secs_f64();
                Ok(r)
            })
            .map_err(|e| format!("cannot start the sampler thread: {e}"))?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(Sampler {
                stop,
                thread: Some(thread),
            }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => Err("the sampler thread ended before its first reading".into()),
        }
    }

    /// Stops sampling and returns the readings (an error if a reading failed).
    pub fn stop(&mut self) -> Result<Readings, String> {
        self.stop.store(true, Ordering::Release);
        match self.thread.take() {
            None => Err("the sampler was stopped already".into()),
            Some(t) => t
                .join()
                .map_err(|_| "the sampler thread panicked".to_owned())?,
        }
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

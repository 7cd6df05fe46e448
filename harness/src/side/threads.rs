//! The thread-safe front end (`Allocator`, with its thread caches) driven from real threads,
//! as a [`Side`].
//!
//! Each call names the thread it runs on; the side runs it there (one worker thread per name,
//! one call at a time, so runs are deterministic). A thread exits for real
//! ([`Call::RetireThread`]): its worker is joined, its thread-local cache handed back, and a
//! fresh worker takes its name. Calls that are the device's, not a thread's (completing a
//! stream, injecting failures, adopting a segment, offering an address), go to the core
//! behind the front end's lock.

use std::sync::mpsc;
use std::thread::JoinHandle;

use cachalot::{Allocator, SimDevice, StreamId};

use super::core::{
    device, disjoint_bytes_under_live_allocations, layout, outcome, settings, to_allocator,
    to_allocator_range,
};
use super::{Call, Observation, Outcome, Side, flatten_stats};
use crate::op::THREADS;
use crate::scenario::Knobs;

type Job = Box<dyn FnOnce(&Allocator<SimDevice>) + Send>;

/// A thread that runs jobs on its own clone of the allocator.
struct Worker {
    tx: Option<mpsc::Sender<Job>>,
    handle: Option<JoinHandle<()>>,
}

impl Worker {
    fn spawn(alloc: &Allocator<SimDevice>) -> Worker {
        let (tx, rx) = mpsc::channel::<Job>();
        let alloc = alloc.clone();
        let handle = std::thread::spawn(move || {
            for job in rx {
                job(&alloc);
            }
        });
        Worker {
            tx: Some(tx),
            handle: Some(handle),
        }
    }

    fn run<R: Send + 'static>(
        &self,
        f: impl FnOnce(&Allocator<SimDevice>) -> R + Send + 'static,
    ) -> R {
        let (rtx, rrx) = mpsc::channel();
        let job: Job = Box::new(move |a| {
            let _ = rtx.send(f(a));
        });
        self.tx
            .as_ref()
            .expect("worker alive")
            .send(job)
            .expect("worker alive");
        rrx.recv().expect("the worker answers")
    }

    /// Ends the thread and waits for it (and its thread-local destructors).
    fn join(&mut self) {
        self.tx.take();
        if let Some(h) = self.handle.take() {
            h.join().expect("the worker thread panicked");
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// The front end on [`THREADS`] worker threads.
pub struct ThreadedSide {
    alloc: Allocator<SimDevice>,
    workers: Vec<Worker>,
}

impl ThreadedSide {
    /// The front end configured by `knobs`, thread caches included.
    pub fn new(knobs: &Knobs) -> Result<ThreadedSide, String> {
        let alloc = Allocator::new(device(knobs), settings(knobs)).map_err(|e| e.to_string())?;
        let workers = (0..THREADS).map(|_| Worker::spawn(&alloc)).collect();
        Ok(ThreadedSide { alloc, workers })
    }

    fn worker(&self, thread: u8) -> &Worker {
        &self.workers[usize::from(thread % THREADS)]
    }
}

impl Side for ThreadedSide {
    fn name(&self) -> &'static str {
        "front end"
    }

    fn call(&mut self, call: &Call) -> Outcome {
        match *call {
            Call::Malloc {
                thread,
                size,
                stream,
            } => outcome(
                self.worker(thread)
                    .run(move |a| a.malloc(size, StreamId(stream))),
                |a| a,
            ),
            Call::Free { thread, address } => {
                outcome(self.worker(thread).run(move |a| a.free(address)), |()| 0)
            }
            Call::RecordStream {
                thread,
                address,
                stream,
            } => outcome(
                self.worker(thread)
                    .run(move |a| a.record_stream(address, StreamId(stream))),
                |()| 0,
            ),
            Call::EmptyCache { thread } => {
                outcome(self.worker(thread).run(|a| a.empty_cache()), |()| 0)
            }
            Call::SetFraction { thread, fraction } => outcome(
                self.worker(thread)
                    .run(move |a| a.set_memory_fraction(fraction)),
                |()| 0,
            ),
            // Rules 24 and 25 are the core's alone: the threaded scenarios never draw them.
            Call::SetRuntimeSettings { .. } | Call::ReleaseStream { .. } => {
                Outcome::Other("not offered by the front end".to_string())
            }
            Call::FlushThread { thread } => {
                self.worker(thread).run(|a| a.flush_thread_cache());
                Outcome::Ok(0)
            }
            Call::RetireThread { thread } => {
                let t = usize::from(thread % THREADS);
                self.workers[t].join();
                self.workers[t] = Worker::spawn(&self.alloc);
                Outcome::Ok(0)
            }
            Call::CompleteStream { stream } => {
                self.alloc
                    .with_backend(|d| d.complete_stream(StreamId(stream)));
                Outcome::Ok(0)
            }
            Call::FailDeviceAllocs { n } => {
                self.alloc.with_backend(|d| d.fail_next_allocs(n));
                Outcome::Ok(0)
            }
            Call::Adopt { ref segment } if segment.range => {
                outcome(self.alloc.adopt_range(to_allocator_range(segment)), |()| 0)
            }
            Call::Adopt { ref segment } => {
                outcome(self.alloc.adopt_segment(to_allocator(segment)), |()| 0)
            }
            Call::SetNextAddress { address } => {
                self.alloc.with_backend(|d| d.set_next_address(address));
                Outcome::Ok(0)
            }
        }
    }

    fn observe(&self) -> Result<Observation, String> {
        Ok(Observation {
            stats: flatten_stats(&self.alloc.stats())?,
            layout: layout(self.alloc.segments()),
            device_used: self.alloc.with_backend(|d| d.used()),
            thread_cached_blocks: self.alloc.thread_cached_blocks(),
            stream_waits: self.alloc.with_backend(|d| {
                super::stream_waits_observed(
                    d.stream_wait_count() as usize,
                    d.stream_waits().iter().map(|&(w, o)| (w.0, o.0)),
                )
            }),
        })
    }

    fn check_invariants(&self) -> Result<(), String> {
        self.alloc.check_invariants().map_err(|e| e.to_string())?;
        let segments = layout(self.alloc.segments());
        let views = self.alloc.view_allocations();
        self.alloc
            .with_backend(|d| disjoint_bytes_under_live_allocations(&segments, &views, d))
    }
}

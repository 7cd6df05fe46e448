//! The threaded differential harness: the thread-safe front end ([`Allocator`], with its
//! thread caches) driven from real threads, against the model's rule 17.
//!
//! The one rule: each operation names the thread it runs on; the harness runs it there (one
//! worker thread per name, one operation at a time, so the run is deterministic) and runs the
//! same operation for the same thread in the model, then compares everything observable, as
//! [`crate::differential`] does for the core. A thread exits for real (`Retire`): its worker is
//! joined, its thread-local cache handed back, and a fresh worker takes its name.

use std::sync::mpsc;
use std::thread::JoinHandle;

use cachalot::{Allocator, SimDevice, StreamId};
use cachalot_model::Model;
use proptest::prelude::*;

use crate::differential::{
    Outcome, compare_stats, foreign_address, from_alloc, from_model, model_layout, segments_layout,
};
use crate::op::{Op, STREAMS, op_strategy};
use crate::scenario::{Knobs, knobs_strategy};

/// Threads the harness uses.
pub const THREADS: u8 = 3;

/// The owner recorded for a live block that belongs to no thread (an adopted one).
const NO_THREAD: u8 = u8::MAX;

/// One step of a threaded scenario.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ThreadOp {
    /// `op` on thread `thread % THREADS`.
    On {
        /// Thread index.
        thread: u8,
        /// The operation.
        op: Op,
    },
    /// Thread `thread % THREADS` frees a block it allocated itself (number `pick` modulo their
    /// count; with none, any live block, as `Op::Free`): the frees thread caches keep.
    FreeOwn {
        /// Thread index.
        thread: u8,
        /// Index into the thread's live blocks, modulo their count.
        pick: u16,
    },
    /// Thread `thread % THREADS` frees the blocks its cache keeps.
    Flush {
        /// Thread index.
        thread: u8,
    },
    /// Thread `thread % THREADS` exits; a fresh thread takes its index.
    Retire {
        /// Thread index.
        thread: u8,
    },
}

/// Knobs, the thread caches' capacity, and operations.
#[derive(Clone, Debug)]
pub struct ThreadScenario {
    /// The settings and device.
    pub knobs: Knobs,
    /// `thread_cache_blocks` (0: PyTorch's front end).
    pub thread_cache_blocks: u32,
    /// The operations, in order.
    pub ops: Vec<ThreadOp>,
}

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

/// The front end on worker threads and the model, driven together.
pub struct ThreadedDifferential {
    /// The front end under test, on the simulated device.
    pub alloc: Allocator<SimDevice>,
    /// The reference model.
    pub model: Model,
    workers: Vec<Worker>,
    /// Live blocks and the thread whose request was served with each.
    live: Vec<(u64, u8)>,
    freed: Vec<u64>,
    step: usize,
}

impl ThreadedDifferential {
    /// Both sides, configured by `knobs` with `thread_cache_blocks`.
    pub fn new(knobs: &Knobs, thread_cache_blocks: u32) -> Result<ThreadedDifferential, String> {
        let mut settings = knobs.settings();
        settings.thread_cache_blocks = thread_cache_blocks;
        let alloc =
            Allocator::new(SimDevice::new(knobs.capacity), settings).map_err(|e| e.to_string())?;
        let mut config = knobs.model_config(Vec::new());
        config.thread_cache_blocks = thread_cache_blocks;
        let model = Model::new(config);
        let workers = (0..THREADS).map(|_| Worker::spawn(&alloc)).collect();
        Ok(ThreadedDifferential {
            alloc,
            model,
            workers,
            live: Vec::new(),
            freed: Vec::new(),
            step: 0,
        })
    }

    fn stream(i: u8) -> u64 {
        u64::from(i % STREAMS)
    }

    /// Applies one operation to both sides and compares everything observable.
    pub fn apply(&mut self, top: &ThreadOp) -> Result<(), String> {
        self.step += 1;
        let (a, m) = match *top {
            ThreadOp::On { thread, ref op } => self.apply_on(thread % THREADS, op),
            ThreadOp::FreeOwn { thread, pick } => {
                let t = thread % THREADS;
                let own: Vec<usize> = (0..self.live.len())
                    .filter(|&i| self.live[i].1 == t)
                    .collect();
                let pick = if own.is_empty() {
                    pick
                } else {
                    own[pick as usize % own.len()] as u16
                };
                self.apply_on(t, &Op::Free { pick })
            }
            ThreadOp::Flush { thread } => {
                let t = thread % THREADS;
                self.workers[t as usize].run(|a| a.flush_thread_cache());
                self.model.flush_thread(u32::from(t));
                (Outcome::Ok(0), Outcome::Ok(0))
            }
            ThreadOp::Retire { thread } => {
                let t = thread % THREADS;
                self.workers[t as usize].join();
                self.workers[t as usize] = Worker::spawn(&self.alloc);
                self.model.retire_thread(u32::from(t));
                (Outcome::Ok(0), Outcome::Ok(0))
            }
        };
        if a != m {
            return Err(format!(
                "step {}: {top:?}: allocator gave {a:?}, model gave {m:?}",
                self.step
            ));
        }
        self.compare()
            .map_err(|e| format!("step {}: after {top:?}: {e}", self.step))
    }

    fn apply_on(&mut self, t: u8, op: &Op) -> (Outcome, Outcome) {
        let w = &self.workers[t as usize];
        let thread = u32::from(t);
        match *op {
            Op::Malloc { size, stream } => {
                let s = Self::stream(stream);
                let a = from_alloc(w.run(move |a| a.malloc(size, StreamId(s))), |v| v);
                let m = from_model(self.model.malloc_on(thread, size, s), |v| v);
                if let (Outcome::Ok(addr), Outcome::Ok(_)) = (&a, &m)
                    && *addr != 0
                {
                    self.live.push((*addr, t));
                }
                (a, m)
            }
            Op::Free { pick } => {
                let addr = if self.live.is_empty() {
                    0xdead_0000
                } else {
                    let (addr, _) = self.live.remove(pick as usize % self.live.len());
                    self.freed.push(addr);
                    addr
                };
                (
                    from_alloc(w.run(move |a| a.free(addr)), |_| 0),
                    from_model(self.model.free_on(thread, addr), |_| 0),
                )
            }
            Op::RecordStream { pick, stream } => {
                let s = Self::stream(stream);
                let addr = if self.live.is_empty() {
                    0xdead_0000
                } else {
                    self.live[pick as usize % self.live.len()].0
                };
                (
                    from_alloc(w.run(move |a| a.record_stream(addr, StreamId(s))), |_| 0),
                    from_model(self.model.record_stream(addr, s), |_| 0),
                )
            }
            Op::CompleteStream { stream } => {
                let s = Self::stream(stream);
                self.alloc.with_backend(|d| d.complete_stream(StreamId(s)));
                self.model.complete_stream(s);
                (Outcome::Ok(0), Outcome::Ok(0))
            }
            Op::EmptyCache => {
                let a = from_alloc(w.run(|a| a.empty_cache()), |_| 0);
                self.model.empty_cache();
                (a, Outcome::Ok(0))
            }
            Op::SetFraction { per_mille } => {
                let f = f64::from(per_mille) / 1000.0;
                (
                    from_alloc(w.run(move |a| a.set_memory_fraction(f)), |_| 0),
                    from_model(self.model.set_memory_fraction(f), |_| 0),
                )
            }
            Op::FailDeviceAllocs { n } => {
                self.alloc
                    .with_backend(|d| d.fail_next_allocs(u32::from(n)));
                self.model.fail_next_device_allocs(u32::from(n));
                (Outcome::Ok(0), Outcome::Ok(0))
            }
            Op::FreeForeign { address } => {
                // A freed address (possibly kept in a thread cache: freeing it again is a double
                // free) or an arbitrary one; never a live one.
                let addr = foreign_address(address, &self.freed, |x| {
                    self.live.iter().any(|&(a, _)| a == x)
                });
                (
                    from_alloc(w.run(move |a| a.free(addr)), |_| 0),
                    from_model(self.model.free_on(thread, addr), |_| 0),
                )
            }
            Op::Adopt { ref segment } => {
                let seg = segment.to_allocator();
                let a = from_alloc(self.alloc.adopt_segment(seg), |_| 0);
                let m = from_model(self.model.adopt_segment(segment.to_model()), |_| 0);
                if (&a, &m) == (&Outcome::Ok(0), &Outcome::Ok(0)) {
                    // Adopted allocations belong to no thread (rule 18c).
                    self.live
                        .extend(segment.allocated().into_iter().map(|x| (x, NO_THREAD)));
                }
                (a, m)
            }
            Op::SetNextAddress { address } => {
                self.alloc.with_backend(|d| d.set_next_address(address));
                self.model.set_next_address(address);
                (Outcome::Ok(0), Outcome::Ok(0))
            }
            #[allow(unreachable_patterns)]
            ref other => (
                Outcome::Other(format!("{other:?} is not run by the threaded harness")),
                Outcome::Ok(0),
            ),
        }
    }

    /// Compares statistics, layout, device memory, thread-cache sizes and both invariant
    /// checks (the front end's covers the thread caches).
    pub fn compare(&self) -> Result<(), String> {
        compare_stats(&self.alloc.stats(), &self.model.stats())?;
        let la = segments_layout(self.alloc.segments());
        let lm = model_layout(&self.model);
        if la != lm {
            return Err(format!(
                "layouts differ:\n allocator {la:x?}\n model     {lm:x?}"
            ));
        }
        let (ua, um) = (
            self.alloc.with_backend(|d| d.used()),
            self.model.device_used(),
        );
        if ua != um {
            return Err(format!(
                "device memory differs: allocator's device {ua} vs model's {um}"
            ));
        }
        let (ca, cm) = (
            self.alloc.thread_cached_blocks(),
            self.model.thread_cached_blocks(),
        );
        if ca != cm {
            return Err(format!(
                "thread caches hold {ca} blocks in the allocator, {cm} in the model"
            ));
        }
        self.alloc
            .check_invariants()
            .map_err(|e| format!("allocator invariant: {e}"))?;
        self.model
            .check_invariants()
            .map_err(|e| format!("model invariant: {e}"))?;
        Ok(())
    }
}

/// Runs a whole threaded scenario, then frees everything, completes every stream and empties
/// the cache: both sides must come back to an empty device.
pub fn run_thread_scenario(scenario: &ThreadScenario) -> Result<(), String> {
    let mut d = ThreadedDifferential::new(&scenario.knobs, scenario.thread_cache_blocks)?;
    d.compare()?;
    for op in &scenario.ops {
        d.apply(op)?;
    }
    let mut t = 0u8;
    while !d.live.is_empty() {
        d.apply(&ThreadOp::On {
            thread: t,
            op: Op::Free { pick: 0 },
        })?;
        t = t.wrapping_add(1);
    }
    for s in 0..STREAMS {
        d.apply(&ThreadOp::On {
            thread: 0,
            op: Op::CompleteStream { stream: s },
        })?;
    }
    d.apply(&ThreadOp::On {
        thread: 1,
        op: Op::EmptyCache,
    })?;
    let used = d.alloc.with_backend(|d| d.used());
    if used != 0 {
        return Err(format!(
            "{used} bytes still held after freeing everything and emptying the cache"
        ));
    }
    Ok(())
}

/// Operations for the threaded harness: the core's operations on random threads, requests of
/// a few repeated sizes (so thread caches hit), flushes and thread exits.
pub fn thread_op_strategy() -> impl Strategy<Value = ThreadOp> {
    let repeated = (
        proptest::sample::select(vec![512u64, 4096, 1 << 20, 3 << 20, 24 << 20]),
        prop_oneof![3 => Just(0u8), 1 => 0..STREAMS],
    )
        .prop_map(|(size, stream)| Op::Malloc { size, stream });
    prop_oneof![
        10 => (0..THREADS, op_strategy()).prop_map(|(thread, op)| ThreadOp::On { thread, op }),
        8 => (0..THREADS, repeated).prop_map(|(thread, op)| ThreadOp::On { thread, op }),
        6 => (0..THREADS, any::<u16>()).prop_map(|(thread, pick)| ThreadOp::FreeOwn { thread, pick }),
        1 => (0..THREADS).prop_map(|thread| ThreadOp::Flush { thread }),
        1 => (0..THREADS).prop_map(|thread| ThreadOp::Retire { thread }),
    ]
}

/// Threaded scenarios of `len` operations, with thread caches of 0 (PyTorch), 1, 2 or 8 blocks.
pub fn thread_scenario_strategy(
    len: std::ops::RangeInclusive<usize>,
) -> impl Strategy<Value = ThreadScenario> {
    (
        knobs_strategy(),
        prop_oneof![1 => Just(0u32), 1 => Just(1u32), 1 => Just(2u32), 2 => Just(8u32)],
        proptest::collection::vec(thread_op_strategy(), len),
    )
        .prop_map(|(knobs, thread_cache_blocks, ops)| ThreadScenario {
            knobs,
            thread_cache_blocks,
            ops,
        })
}

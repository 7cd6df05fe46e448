//! The driver: one interpreter of operations, applying each to two [`Side`]s and comparing
//! them.
//!
//! The one rule: after every operation the two sides must agree on everything a user can
//! observe — success or the error and its figures, the address handed out, every statistic,
//! the layout of every segment, the device's memory, the thread caches — and both must pass
//! their own invariant checks.
//!
//! What an operation means in the current state (which address `Free { pick }` frees, which
//! address is foreign) is decided once, by [`Handles`], for every user of operations: the
//! property tests (core vs model, front end on threads vs model), the fuzz targets, and the
//! fault harness that drives the core alone. Replayed traces come in as concrete calls through
//! the product's own replay interpreter ([`ReplayTarget`]), which this driver implements.

use cachalot::{AdoptedRange, AdoptedSegment, StreamId};
use cachalot_tools::replay::{ReplayTarget, RuntimeSettings};

/// Rule 24's call for a replay's run-time settings.
pub fn runtime_call(change: &RuntimeSettings) -> Call {
    Call::SetRuntimeSettings {
        max_split_size: change.max_split_size,
        max_non_split_rounding_size: change.max_non_split_rounding_size,
        garbage_collection_threshold: change.garbage_collection_threshold,
        roundup_power2_divisions: change.roundup_power2_divisions,
    }
}

use crate::op::{
    Op, RUNTIME_DIVISIONS, RUNTIME_GC, RUNTIME_MAX_SPLIT_MB, STREAMS, THREADS, ThreadOp, fraction,
};
use crate::scenario::{Scenario, ThreadScenario};
use crate::side::{
    Call, CoreSide, ModelSide, Observation, Outcome, Side, ThreadedSide, adoption_from_allocator,
    adoption_from_allocator_range, compare_observations, quick,
};

/// The address used where an operation needs one that no side ever hands out (a free or a
/// `record_stream` with no live block): below every simulated device's placement region.
pub const FOREIGN: u64 = 0xdead_0000;

/// A live allocation the harness knows of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Live {
    /// Its address.
    pub address: u64,
    /// Bytes requested.
    pub requested: u64,
    /// The thread whose request was served with it (`None`: adopted, no thread's).
    pub thread: Option<u8>,
}

/// The user's view of the allocations: what operations name, and how they become calls.
#[derive(Clone, Debug, Default)]
pub struct Handles {
    live: Vec<Live>,
    freed: Vec<u64>,
}

impl Handles {
    /// Live allocations, in the order they were made.
    pub fn live(&self) -> &[Live] {
        &self.live
    }

    /// Whether `address` is a live allocation.
    pub fn is_live(&self, address: u64) -> bool {
        self.live.iter().any(|l| l.address == address)
    }

    fn pick(&self, pick: u16) -> u64 {
        if self.live.is_empty() {
            FOREIGN
        } else {
            self.live[usize::from(pick) % self.live.len()].address
        }
    }

    /// The address a `FreeForeign` or `RecordStreamForeign` op names: the null address for 0;
    /// else for a raw address ≡ 0 or 2 (mod 4), one freed earlier (a double free); ≡ 1, an
    /// address inside a live block; else the raw address itself — made odd when it is live.
    pub fn foreign(&self, raw: u64) -> u64 {
        if raw == 0 {
            return 0;
        }
        let address = match raw % 4 {
            0 | 2 if !self.freed.is_empty() => self.freed[(raw / 4) as usize % self.freed.len()],
            1 if !self.live.is_empty() => {
                self.live[(raw / 4) as usize % self.live.len()].address + 512
            }
            _ => raw,
        };
        if self.is_live(address) {
            address | 1
        } else {
            address
        }
    }

    /// The call `op` on `thread` makes in the current state.
    pub fn resolve(&self, thread: u8, op: &Op) -> Call {
        let stream = |s: u8| u64::from(s % STREAMS);
        match *op {
            Op::Malloc { size, stream: s } => Call::Malloc {
                thread,
                size,
                stream: stream(s),
            },
            Op::Free { pick } => Call::Free {
                thread,
                address: self.pick(pick),
            },
            Op::RecordStream { pick, stream: s } => Call::RecordStream {
                thread,
                address: self.pick(pick),
                stream: stream(s),
            },
            Op::CompleteStream { stream: s } => Call::CompleteStream { stream: stream(s) },
            Op::EmptyCache => Call::EmptyCache { thread },
            Op::SetFraction { per_mille } => Call::SetFraction {
                thread,
                fraction: fraction(per_mille),
            },
            Op::FailDeviceAllocs { n } => Call::FailDeviceAllocs { n: u32::from(n) },
            Op::FreeForeign { address } => Call::Free {
                thread,
                address: self.foreign(address),
            },
            Op::RecordStreamForeign { address, stream: s } => Call::RecordStream {
                thread,
                address: self.foreign(address),
                stream: stream(s),
            },
            Op::Adopt { ref segment } => Call::Adopt {
                segment: segment.resolve(),
            },
            Op::AdoptRange { ref range } => Call::Adopt {
                segment: range.resolve_range(),
            },
            Op::SetNextAddress { address } => Call::SetNextAddress { address },
            Op::SetRuntimeSettings {
                max_split,
                divisions,
                gc,
            } => {
                let pick = |table: &[u64], i: u8| table[usize::from(i) % table.len()];
                let mb = pick(RUNTIME_MAX_SPLIT_MB, max_split);
                Call::SetRuntimeSettings {
                    max_split_size: if mb == 0 { u64::MAX } else { mb << 20 },
                    max_non_split_rounding_size: 20 << 20,
                    garbage_collection_threshold: RUNTIME_GC[usize::from(gc) % RUNTIME_GC.len()],
                    roundup_power2_divisions: [pick(RUNTIME_DIVISIONS, divisions); 16],
                }
            }
            Op::ReleaseStream { stream: s } => Call::ReleaseStream { stream: stream(s) },
        }
    }

    /// The call a threaded step makes in the current state.
    pub fn resolve_step(&self, step: &ThreadOp) -> Call {
        match *step {
            ThreadOp::On { thread, ref op } => self.resolve(thread % THREADS, op),
            ThreadOp::FreeOwn { thread, pick } => {
                let t = thread % THREADS;
                let own: Vec<&Live> = self.live.iter().filter(|l| l.thread == Some(t)).collect();
                if own.is_empty() {
                    self.resolve(t, &Op::Free { pick })
                } else {
                    Call::Free {
                        thread: t,
                        address: own[usize::from(pick) % own.len()].address,
                    }
                }
            }
            ThreadOp::Flush { thread } => Call::FlushThread {
                thread: thread % THREADS,
            },
            ThreadOp::Retire { thread } => Call::RetireThread {
                thread: thread % THREADS,
            },
        }
    }

    /// Learns what `call` did: a served allocation is live, a freed one is not (unless the
    /// free failed by an injected fault: the block stays the user's), an adopted segment's
    /// allocated blocks are live and no thread's.
    pub fn learn(&mut self, call: &Call, outcome: &Outcome) {
        match (call, outcome) {
            (Call::Malloc { thread, size, .. }, Outcome::Ok(address)) if *address != 0 => {
                self.live.push(Live {
                    address: *address,
                    requested: *size,
                    thread: Some(*thread),
                });
            }
            (Call::Free { .. }, Outcome::InjectedFault) => {}
            (Call::Free { address, .. }, _) => {
                if let Some(i) = self.live.iter().position(|l| l.address == *address) {
                    self.live.remove(i);
                    self.freed.push(*address);
                }
            }
            (Call::Adopt { segment }, Outcome::Ok(_)) => {
                self.live
                    .extend(
                        segment
                            .allocated()
                            .into_iter()
                            .map(|(address, requested)| Live {
                                address,
                                requested,
                                thread: None,
                            }),
                    );
            }
            _ => {}
        }
    }
}

/// Two sides driven together.
pub struct Driver<A: Side, B: Side> {
    /// The side under test.
    pub a: A,
    /// The side it is compared with.
    pub b: B,
    handles: Handles,
    step: usize,
    check_every: usize,
}

impl<A: Side, B: Side> Driver<A, B> {
    /// Drives `a` and `b`, which must start in the same state.
    pub fn new(a: A, b: B) -> Driver<A, B> {
        Driver {
            a,
            b,
            handles: Handles::default(),
            step: 0,
            check_every: 1,
        }
    }

    /// Runs both sides' invariant checks after every `k`-th call only (and wherever
    /// [`Driver::check`] or [`Driver::compare`] is called: at the start, after the last
    /// operation and after the drain in [`run_scenario`]); everything observable is still
    /// compared after every step. The fuzz targets' trade (see [`crate::fuzzing`]): the checks
    /// are most of an execution's time. `k` = 1, the default, checks after every step.
    pub fn check_invariants_every(mut self, k: usize) -> Driver<A, B> {
        self.check_every = k.max(1);
        self
    }

    /// The user's view of the allocations.
    pub fn handles(&self) -> &Handles {
        &self.handles
    }

    /// Applies `op` on thread 0, then compares everything observable.
    pub fn apply(&mut self, op: &Op) -> Result<(), String> {
        self.apply_step(&ThreadOp::On {
            thread: 0,
            op: op.clone(),
        })
    }

    /// Applies one threaded step, then compares everything observable.
    pub fn apply_step(&mut self, step: &ThreadOp) -> Result<(), String> {
        let call = self.handles.resolve_step(step);
        self.call(&call)
            .and_then(|_| {
                self.compare_observed()?;
                if self.step.is_multiple_of(self.check_every) {
                    self.check()?;
                }
                Ok(())
            })
            .map_err(|e| format!("step {}: {step:?} ({call:?}): {e}", self.step))
    }

    /// Makes one call on both sides and compares the outcomes (not the state: see
    /// [`Driver::compare`]); the outcome both gave.
    pub fn call(&mut self, call: &Call) -> Result<Outcome, String> {
        self.step += 1;
        let oa = self.a.call(call);
        let ob = self.b.call(call);
        if oa != ob {
            return Err(format!(
                "{} gave {oa:?}, {} gave {ob:?}",
                self.a.name(),
                self.b.name()
            ));
        }
        self.handles.learn(call, &oa);
        Ok(oa)
    }

    /// Compares statistics, layout, device memory, stream waits, thread caches (both
    /// observations built and compared) and both invariant checks.
    pub fn compare(&self) -> Result<(), String> {
        self.compare_observations()?;
        self.check()
    }

    /// Compares statistics, layout, device memory, stream waits and thread caches: what
    /// [`Driver::compare_observations`] compares, after every step. With the allocator core
    /// against the model this is [`quick::same_observed`], which gives the same answer
    /// without building the observations; only when it finds a difference are the
    /// observations built, to say what differs.
    fn compare_observed(&self) -> Result<(), String> {
        let Some((c, m)) = self.a.as_core().zip(self.b.as_model()) else {
            return self.compare_observations();
        };
        if quick::same_observed(c, m) {
            return Ok(());
        }
        self.compare_observations()?;
        Err(format!(
            "harness bug: the quick comparison of {} and {} found a difference their \
             observations do not show",
            self.a.name(),
            self.b.name()
        ))
    }

    /// Builds both sides' observations and compares them.
    fn compare_observations(&self) -> Result<(), String> {
        let (oa, ob) = (self.a.observe()?, self.b.observe()?);
        compare_observations((self.a.name(), &oa), (self.b.name(), &ob))
    }

    /// Both sides' invariant checks.
    pub fn check(&self) -> Result<(), String> {
        self.a
            .check_invariants()
            .map_err(|e| format!("{} invariant: {e}", self.a.name()))?;
        self.b
            .check_invariants()
            .map_err(|e| format!("{} invariant: {e}", self.b.name()))
    }

    /// Frees every live allocation (round-robin over the threads), completes every stream and
    /// empties the cache, comparing after each step: both must come back to an empty device.
    pub fn drain(&mut self) -> Result<(), String> {
        let mut t = 0u8;
        while !self.handles.live.is_empty() {
            self.apply_step(&ThreadOp::On {
                thread: t,
                op: Op::Free { pick: 0 },
            })?;
            t = (t + 1) % THREADS;
        }
        for s in 0..STREAMS {
            self.apply(&Op::CompleteStream { stream: s })?;
        }
        self.apply_step(&ThreadOp::On {
            thread: 1,
            op: Op::EmptyCache,
        })?;
        self.check()
            .map_err(|e| format!("after the drain (step {}): {e}", self.step))?;
        let used = self.a.observe()?.device_used;
        if used != 0 {
            return Err(format!(
                "{used} bytes still held after freeing everything and emptying the cache"
            ));
        }
        Ok(())
    }

    /// Runs `steps`, then [`Driver::drain`]s; the error names the step and what differed.
    pub fn run<'s>(&mut self, steps: impl IntoIterator<Item = &'s ThreadOp>) -> Result<(), String> {
        self.compare()?;
        for step in steps {
            self.apply_step(step)?;
        }
        self.drain()
    }
}

/// Runs a scenario on the allocator core and the model (rules 1–16).
pub fn run_scenario(scenario: &Scenario) -> Result<(), String> {
    run_scenario_observed(scenario).map(|_| ())
}

/// [`run_scenario`] with both sides' invariant checks after every `k`-th step only
/// ([`Driver::check_invariants_every`]), and always at the start, after the last operation
/// and after the drain.
pub fn run_scenario_checked_every(scenario: &Scenario, k: usize) -> Result<(), String> {
    run_scenario_with(scenario, k).map(|_| ())
}

/// [`run_scenario`], returning what both sides observed after the last operation, before the
/// drain (they agree on it): for hand-made sequences that also assert on that state.
pub fn run_scenario_observed(scenario: &Scenario) -> Result<Observation, String> {
    run_scenario_with(scenario, 1)
}

fn run_scenario_with(scenario: &Scenario, check_every: usize) -> Result<Observation, String> {
    let steps: Vec<ThreadOp> = scenario
        .ops
        .iter()
        .map(|op| ThreadOp::On {
            thread: 0,
            op: op.clone(),
        })
        .collect();
    let mut driver = Driver::new(
        CoreSide::new(&scenario.knobs)?,
        ModelSide::new(&scenario.knobs),
    )
    .check_invariants_every(check_every);
    driver.compare()?;
    for step in &steps {
        driver.apply_step(step)?;
    }
    driver
        .check()
        .map_err(|e| format!("after the last operation (step {}): {e}", driver.step))?;
    let seen = driver.b.observe()?;
    driver.drain()?;
    Ok(seen)
}

/// Runs a threaded scenario on the front end, each operation on its worker thread, and on the
/// model with rule 17.
pub fn run_thread_scenario(scenario: &ThreadScenario) -> Result<(), String> {
    Driver::new(
        ThreadedSide::new(&scenario.knobs)?,
        ModelSide::threaded(&scenario.knobs),
    )
    .run(&scenario.ops)
}

/// Why a replayed call stopped: the sides agreed on a failure, or disagreed.
#[derive(Clone, Debug, PartialEq)]
pub enum ReplayStop {
    /// Both sides failed the call this way.
    Agreed(Outcome),
    /// The sides disagreed (the description says how).
    Diverged(String),
}

impl std::fmt::Display for ReplayStop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReplayStop::Agreed(o) => write!(f, "both sides failed: {o:?}"),
            ReplayStop::Diverged(e) => f.write_str(e),
        }
    }
}

impl<A: Side, B: Side> Driver<A, B> {
    fn replay_call(&mut self, call: Call) -> Result<u64, ReplayStop> {
        match self.call(&call) {
            Ok(Outcome::Ok(v)) => Ok(v),
            Ok(o) => Err(ReplayStop::Agreed(o)),
            Err(e) => Err(ReplayStop::Diverged(format!("{call:?}: {e}"))),
        }
    }
}

/// The product's replay interpreter drives both sides through this: each call is made on both
/// and the outcomes compared (the state is compared by the caller, after each operation).
impl<A: Side, B: Side> ReplayTarget for Driver<A, B> {
    type Error = ReplayStop;

    fn is_out_of_memory(error: &ReplayStop) -> bool {
        matches!(error, ReplayStop::Agreed(Outcome::OutOfMemory { .. }))
    }

    fn malloc(&mut self, size: u64, stream: StreamId) -> Result<u64, ReplayStop> {
        self.replay_call(Call::Malloc {
            thread: 0,
            size,
            stream: stream.0,
        })
    }

    fn free(&mut self, address: u64) -> Result<(), ReplayStop> {
        self.replay_call(Call::Free { thread: 0, address })
            .map(drop)
    }

    fn record_stream(&mut self, address: u64, stream: StreamId) -> Result<(), ReplayStop> {
        self.replay_call(Call::RecordStream {
            thread: 0,
            address,
            stream: stream.0,
        })
        .map(drop)
    }

    fn empty_cache(&mut self) -> Result<(), ReplayStop> {
        self.replay_call(Call::EmptyCache { thread: 0 }).map(drop)
    }

    fn adopt_segment(&mut self, segment: AdoptedSegment) -> Result<(), ReplayStop> {
        self.replay_call(Call::Adopt {
            segment: adoption_from_allocator(&segment),
        })
        .map(drop)
    }

    fn adopt_range(&mut self, range: AdoptedRange) -> Result<(), ReplayStop> {
        self.replay_call(Call::Adopt {
            segment: adoption_from_allocator_range(&range),
        })
        .map(drop)
    }

    fn complete_stream(&mut self, stream: StreamId) -> Result<(), ReplayStop> {
        self.replay_call(Call::CompleteStream { stream: stream.0 })
            .map(drop)
    }

    fn offer_address(&mut self, address: Option<u64>) -> Result<(), ReplayStop> {
        self.replay_call(Call::SetNextAddress { address }).map(drop)
    }

    fn set_runtime_settings(&mut self, change: &RuntimeSettings) -> Result<(), ReplayStop> {
        self.replay_call(runtime_call(change)).map(drop)
    }

    fn release_stream_cache(&mut self, stream: StreamId) -> Result<(), ReplayStop> {
        self.replay_call(Call::ReleaseStream { stream: stream.0 })
            .map(drop)
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;
    use crate::side::FlatStats;

    /// A side that answers every call with `Ok(0)`, is always observed the same, and whose
    /// invariant check fails once it has made `broken_from` calls (never for `usize::MAX`).
    struct Fake {
        calls: usize,
        broken_from: usize,
        checks: Cell<usize>,
    }

    fn fake(broken_from: usize) -> Fake {
        Fake {
            calls: 0,
            broken_from,
            checks: Cell::new(0),
        }
    }

    impl Side for Fake {
        fn name(&self) -> &'static str {
            "fake"
        }

        fn call(&mut self, _: &Call) -> Outcome {
            self.calls += 1;
            Outcome::Ok(0)
        }

        fn observe(&self) -> Result<Observation, String> {
            Ok(Observation {
                stats: FlatStats::from_pairs(&[("x", 1)]),
                layout: Vec::new(),
                device_used: 0,
                thread_cached_blocks: 0,
                stream_waits: (0, Vec::new()),
            })
        }

        fn check_invariants(&self) -> Result<(), String> {
            self.checks.set(self.checks.get() + 1);
            if self.calls >= self.broken_from {
                Err(format!("broken after {} calls", self.calls))
            } else {
                Ok(())
            }
        }
    }

    fn run(driver: &mut Driver<Fake, Fake>, steps: usize) -> Result<(), String> {
        (0..steps).try_for_each(|_| driver.apply(&Op::EmptyCache))
    }

    #[test]
    fn invariants_are_checked_after_every_step_by_default() {
        let mut d = Driver::new(fake(3), fake(usize::MAX));
        let e = run(&mut d, 10).unwrap_err();
        assert!(e.starts_with("step 3: ") && e.contains("fake invariant: broken after 3 calls"));
        assert_eq!(d.a.checks.get(), 3);
    }

    #[test]
    fn every_kth_step_the_invariants_are_checked_and_whenever_asked() {
        let mut d = Driver::new(fake(3), fake(usize::MAX)).check_invariants_every(8);
        run(&mut d, 5).unwrap();
        assert_eq!(d.a.checks.get(), 0, "steps 1 to 5 compare, not check");
        assert!(d.check().unwrap_err().contains("broken after 5 calls"));
        let e = run(&mut d, 5).unwrap_err();
        assert!(e.starts_with("step 8: "), "{e}");
        // Both sides are checked at a checked step.
        let mut d = Driver::new(fake(usize::MAX), fake(1)).check_invariants_every(2);
        let e = run(&mut d, 3).unwrap_err();
        assert!(e.starts_with("step 2: "), "{e}");
        assert_eq!((d.a.checks.get(), d.b.checks.get()), (1, 1));
    }

    #[test]
    fn a_scenario_shorter_than_k_runs_on_the_real_sides() {
        // Fewer steps than k: only the checks at the start, after the last operation and after
        // the drain run, and they pass on the allocator and the model as the checks after
        // every step do.
        let scenario = Scenario {
            knobs: crate::scenario::Knobs::pytorch(1 << 30),
            ops: vec![
                Op::Malloc {
                    size: 4096,
                    stream: 0,
                },
                Op::Malloc {
                    size: 3 << 20,
                    stream: 1,
                },
                Op::Free { pick: 0 },
            ],
        };
        run_scenario_checked_every(&scenario, 1000).unwrap();
        run_scenario_checked_every(&scenario, 1).unwrap();
    }
}

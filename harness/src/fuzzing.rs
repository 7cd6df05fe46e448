//! The fuzz harnesses: what each cargo-fuzz target of `fuzz/` runs, kept here so that
//! `cargo test` (harness/tests/fuzz_corpus.rs) replays the committed seeds and regression inputs
//! through the very same code on stable Rust.
//!
//! The one rule: every harness takes arbitrary bytes, turns them into a valid input (never
//! rejecting one as malformed), and returns `Err` with a paste-ready description exactly when
//! the code under test misbehaves; a fuzz target is the one line `panic!` on that `Err`.
//!
//! | target | harness | property |
//! |---|---|---|
//! | `differential` | [`differential`] | allocator and model agree after every step, both keep their invariants, and freeing everything leaves an empty device |
//! | `device_faults` | [`device_faults`] | under injected device failures the allocator reports errors cleanly and loses no block; once the faults stop it works normally and gives everything back |
//! | `snapshot_reader` | [`snapshot_reader`] | bytes give a snapshot or a clean error, within bounded memory; a snapshot that reads converts to replay programs and writes back to the same snapshot |
//! | `settings_parser` | [`settings_parser`] | a string gives settings or a clean error; settings print back to a string that parses to equal settings |

use std::collections::BTreeMap;

use arbitrary::{Arbitrary, Unstructured};
use cachalot::{CachingCore, Error, Settings, SimDevice, StreamId};
use cachalot_tools::replay::SnapshotExt;
use cachalot_tools::snapshot::{
    ReadLimits, parse_snapshot, parse_snapshot_with_limits, write_snapshot,
};

use crate::draw::{Draws, draw};
use crate::driver::{Handles, run_scenario_checked_every};
use crate::op::{Op, STREAMS};
use crate::scenario::{Knobs, Scenario};
use crate::side::{BlockKind, Call, CoreSide, FaultKind, Observation, Outcome, Side};

/// A harness: arbitrary bytes in, `Err` with a description when the code under test misbehaves.
pub type Harness = fn(&[u8]) -> Result<(), String>;

/// Every fuzz target by name (the name of its file in `fuzz/fuzz_targets/` and of its seed
/// folder `fuzz/seeds/<name>/`), with its harness.
pub const TARGETS: &[(&str, Harness)] = &[
    ("differential", differential),
    ("device_faults", device_faults),
    ("snapshot_reader", snapshot_reader),
    ("settings_parser", settings_parser),
];

/// Most operations one input runs, so that one execution stays well under a millisecond or so.
pub const MAX_OPS: usize = 256;

/// Knobs, then up to [`MAX_OPS`] values of `T` until the bytes run out. Every byte string
/// decodes (short ones to few values, and to PyTorch's defaults on 1 GiB when too short for
/// knobs).
fn decode<T: for<'a> Arbitrary<'a>>(data: &[u8]) -> (Knobs, Vec<T>) {
    let mut u = Unstructured::new(data);
    let knobs = Knobs::arbitrary(&mut u).unwrap_or_else(|_| Knobs::pytorch(1 << 30));
    let mut values = Vec::new();
    while values.len() < MAX_OPS && !u.is_empty() {
        match T::arbitrary(&mut u) {
            Ok(v) => values.push(v),
            Err(_) => break,
        }
    }
    (knobs, values)
}

/// How often `differential` runs both sides' invariant checks: after every `CHECK_EVERY`-th
/// step, and always at the start, after the last operation and after the drain
/// ([`crate::driver::run_scenario_checked_every`]). Everything else is compared after every
/// step: the outcome of every call, the statistics, the layout, the device's memory, the
/// stream waits and the thread caches. The property tests (`harness/tests/`) keep checking
/// the invariants after every step. (`device_faults` has its own, [`FAULT_CHECK_EVERY`].)
///
/// Why 32 (it was 8 until 2026-12-06; fuzz/README.md, "Speed"): once the observations are
/// compared without being built ([`crate::side::quick`]), the checks were again the largest
/// cost of an execution but for the operations themselves. What a check sees that the
/// comparison after every step does not is internal state (free sets, page tables' busy
/// counts, index entries) that no statistic, layout or outcome shows yet. Such a break
/// persists until an operation happens to rewrite that very state, so it is still found: at
/// the next checked step (at most 31 steps late), or by the checks after the last operation
/// and after the drain, which every execution runs; and once it shows in an outcome, a
/// statistic or the layout, by the comparison of that step. Planted by hand (a busy count
/// not lowered when a block returns to its pool, seen by no statistic or layout, only by the
/// allocator's check), the same 31 of the 149 committed seeds fail with 8 and with 32, and
/// libFuzzer with 32 finds it from an empty corpus in 0.65-1.0 s (7,508-11,564 executions)
/// in each of three runs, as with 8 on 2026-12-02 (0.30-0.76 s, 5,405-14,779).
pub const CHECK_EVERY: usize = 32;

/// How often `device_faults` runs the allocator's own invariant checks: after every
/// `FAULT_CHECK_EVERY`-th step, after the last step and in the recovery
/// ([`FaultHarness::apply`]); every outcome, the user's blocks against the allocator's, and the
/// device's allocations and bytes against the segments are checked after every step. A broken
/// invariant that lasts is found at most `FAULT_CHECK_EVERY - 1` steps late.
pub const FAULT_CHECK_EVERY: usize = 8;

/// Decodes bytes into a scenario: knobs, then up to [`MAX_OPS`] operations until the bytes run
/// out.
pub fn scenario_from_bytes(data: &[u8]) -> Scenario {
    let (knobs, ops) = decode(data);
    Scenario { knobs, ops }
}

/// Target `differential`: the scenario the bytes decode to, through
/// [`run_scenario_checked_every`] with invariant checks every [`CHECK_EVERY`] steps.
pub fn differential(data: &[u8]) -> Result<(), String> {
    let scenario = scenario_from_bytes(data);
    run_scenario_checked_every(&scenario, CHECK_EVERY).map_err(|e| {
        format!(
            "{e}\nknobs: {:?}\nops ({}): {:?}",
            scenario.knobs,
            scenario.ops.len(),
            scenario.ops
        )
    })
}

// ---------------------------------------------------------------------------------------------
// Device faults
// ---------------------------------------------------------------------------------------------

/// One step of a fault scenario.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FaultStep {
    /// An ordinary operation (its `FailDeviceAllocs` adds out-of-memory faults too).
    Op(Op),
    /// The next `n` calls of this kind fail.
    Inject(FaultKind, u8),
    /// Every pending fault is dropped.
    ClearFaults,
}

/// Fault steps: mostly operations, so that faults land in varied states.
pub const FAULT_STEPS: &Draws<FaultStep> = &[
    (3, |u| {
        Ok(FaultStep::Inject(
            FaultKind::arbitrary(u)?,
            u.int_in_range(1u8..=3)?,
        ))
    }),
    (1, |_| Ok(FaultStep::ClearFaults)),
    (12, |u| Ok(FaultStep::Op(Op::arbitrary(u)?))),
];

impl<'a> Arbitrary<'a> for FaultStep {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<FaultStep> {
        draw(u, FAULT_STEPS)
    }
}

/// Decodes bytes into knobs and up to [`MAX_OPS`] fault steps.
pub fn fault_scenario_from_bytes(data: &[u8]) -> (Knobs, Vec<FaultStep>) {
    decode(data)
}

/// The allocator alone on a simulated device that fails on request, with the user's view of
/// every allocation ([`Handles`], the driver's own).
pub struct FaultHarness {
    /// The allocator under test.
    pub side: CoreSide,
    handles: Handles,
    step: usize,
}

impl FaultHarness {
    /// The allocator configured by `knobs` on a fault-free device.
    pub fn new(knobs: &Knobs) -> Result<FaultHarness, String> {
        Ok(FaultHarness {
            side: CoreSide::new(knobs)?,
            handles: Handles::default(),
            step: 0,
        })
    }

    /// Runs one step and checks its outcome and the state after it (the allocator's own
    /// invariant checks after every [`FAULT_CHECK_EVERY`]-th step only: [`FaultHarness::check`]
    /// runs them all).
    pub fn apply(&mut self, step: &FaultStep) -> Result<(), String> {
        self.step += 1;
        let invariants = self.step.is_multiple_of(FAULT_CHECK_EVERY);
        self.run(step)
            .and_then(|()| self.check_with(invariants))
            .map_err(|e| format!("step {}: {step:?}: {e}", self.step))
    }

    fn observe(&self) -> Result<Observation, String> {
        self.side.observe()
    }

    fn run(&mut self, step: &FaultStep) -> Result<(), String> {
        let op = match step {
            FaultStep::Inject(kind, n) => {
                self.side.inject(*kind, u32::from(*n));
                return Ok(());
            }
            FaultStep::ClearFaults => {
                self.side.clear_faults();
                return Ok(());
            }
            FaultStep::Op(op) => op,
        };
        let call = self.handles.resolve(0, op);
        let before = match call {
            Call::Adopt { .. } => Some(self.observe()?),
            _ => None,
        };
        let allocations = self.side.live_allocations();
        let outcome = self.side.call(&call);
        let expected = match (&call, &outcome) {
            (Call::Malloc { size, .. }, Outcome::Ok(a)) => {
                if (*a == 0) != (*size == 0) {
                    return Err(format!("address {a:#x} for {size} bytes"));
                }
                if *a != 0 && self.handles.is_live(*a) {
                    return Err(format!("{a:#x} handed out twice"));
                }
                true
            }
            (Call::Malloc { size, .. }, o) => {
                let expected = match o {
                    Outcome::OutOfMemory { .. } | Outcome::InjectedFault => true,
                    Outcome::TooLarge => *size > cachalot::sizes::MAX_ALLOC_SIZE,
                    _ => false,
                };
                if expected && self.side.live_allocations() != allocations {
                    return Err(format!(
                        "a failed allocation changed the allocation count: {o:?}"
                    ));
                }
                expected
            }
            // The null address: freeing it is a no-op; both answers to `record_stream` are
            // left to the differential, which makes the two sides agree.
            (Call::Free { address: 0, .. }, o) => *o == Outcome::Ok(0),
            (Call::RecordStream { address: 0, .. }, o) => {
                matches!(o, Outcome::Ok(0) | Outcome::UnknownPointer)
            }
            // A live block: freed, or (injected fault) kept, and then the check after this step
            // makes sure the allocator keeps it too. `record_stream` makes no device call.
            (Call::Free { address, .. }, o) if self.handles.is_live(*address) => {
                matches!(o, Outcome::Ok(0) | Outcome::InjectedFault)
            }
            (Call::RecordStream { address, .. }, o) if self.handles.is_live(*address) => {
                *o == Outcome::Ok(0)
            }
            (Call::Free { .. } | Call::RecordStream { .. }, o) => *o == Outcome::UnknownPointer,
            (Call::EmptyCache { .. } | Call::ReleaseStream { .. }, o) => {
                matches!(o, Outcome::Ok(0) | Outcome::InjectedFault)
            }
            (Call::SetRuntimeSettings { .. }, o) => *o == Outcome::Ok(0),
            (Call::SetFraction { fraction, .. }, o) => {
                *o == if (0.0..=1.0).contains(fraction) {
                    Outcome::Ok(0)
                } else {
                    Outcome::InvalidFraction
                }
            }
            (Call::Adopt { .. }, Outcome::Ok(0)) => true,
            (Call::Adopt { .. }, o) => {
                let expected = matches!(
                    o,
                    Outcome::InvalidAdoption
                        | Outcome::AdoptionOutOfMemory
                        | Outcome::InjectedFault
                );
                if expected && Some(self.observe()?) != before {
                    return Err(format!("a refused adoption changed the state: {o:?}"));
                }
                expected
            }
            (
                Call::CompleteStream { .. }
                | Call::FailDeviceAllocs { .. }
                | Call::SetNextAddress { .. }
                | Call::FlushThread { .. }
                | Call::RetireThread { .. },
                o,
            ) => *o == Outcome::Ok(0),
        };
        if !expected {
            return Err(format!("{call:?} gave {outcome:?}"));
        }
        self.handles.learn(&call, &outcome);
        Ok(())
    }

    /// No block lost, none handed out twice, the device holds exactly the allocator's segments,
    /// and the allocator's own invariants hold.
    pub fn check(&self) -> Result<(), String> {
        self.check_with(true)
    }

    /// [`FaultHarness::check`], the allocator's own invariant checks (most of the time a check
    /// takes) only when `invariants`.
    fn check_with(&self, invariants: bool) -> Result<(), String> {
        // The layout and the device's bytes alone: the statistics are not checked here.
        let layout = self.side.layout();
        if invariants {
            self.side
                .check_invariants_on(&layout)
                .map_err(|e| format!("allocator invariant: {e}"))?;
        }
        let mut allocated: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
        let mut end = 0u64;
        for s in &layout {
            if s.address < end {
                return Err(format!(
                    "segment {:#x} overlaps the one before it",
                    s.address
                ));
            }
            end = s.address + s.size;
            for b in s.blocks.iter().filter(|b| b.kind == BlockKind::Allocated) {
                allocated.insert(b.address, (b.size, b.requested));
            }
        }
        // Rule 23: allocations through stitched views are in no segment; their requested size
        // is the user's (the handles'), checked below as `size >= requested`.
        let views: BTreeMap<u64, u64> = self.side.view_allocations().into_iter().collect();
        let live = self.handles.live();
        if allocated.len() + views.len() != live.len() {
            return Err(format!(
                "the allocator holds {} allocated blocks, the user {} (lost or phantom blocks)",
                allocated.len() + views.len(),
                live.len()
            ));
        }
        for l in live {
            let (a, requested) = (l.address, l.requested);
            if let Some(&size) = views.get(&a) {
                if size < requested {
                    return Err(format!(
                        "live view allocation {a:#x} of {requested} B has {size} B"
                    ));
                }
                continue;
            }
            match allocated.get(&a) {
                Some(&(size, r)) if r == requested && size >= requested => {}
                Some(b) => {
                    return Err(format!(
                        "live block {a:#x} of {requested} B reported as (size, requested) {b:?}"
                    ));
                }
                None => {
                    return Err(format!(
                        "live block {a:#x} of {requested} B is not allocated any more"
                    ));
                }
            }
        }
        let device = self.side.device_allocations();
        // Runs of mapped memory in expandable ranges (rule 19) are not device allocations:
        // they are checked with the device's used bytes below.
        let held: Vec<(u64, u64)> = layout
            .iter()
            .filter(|s| !s.expandable)
            .map(|s| (s.address, s.size))
            .collect();
        if device != held {
            return Err(format!(
                "device allocations {device:x?} differ from the allocator's segments {held:x?}"
            ));
        }
        let used = self.side.device_used();
        let reserved = self.side.reserved_bytes();
        if used as i64 != reserved {
            return Err(format!(
                "device holds {used} B, the allocator reserves {reserved} B"
            ));
        }
        Ok(())
    }

    fn must(&mut self, call: Call) -> Result<u64, String> {
        match self.side.call(&call) {
            Outcome::Ok(v) => {
                self.handles.learn(&call, &Outcome::Ok(v));
                Ok(v)
            }
            o => Err(format!("recovery: {call:?} gave {o:?}")),
        }
    }

    /// With the faults stopped: frees everything the user holds, completes every stream, empties
    /// the cache and checks the device is empty; then serves fresh requests as usual and gives
    /// them back.
    pub fn recover(&mut self) -> Result<(), String> {
        self.side.clear_faults();
        for l in self.handles.live().to_vec() {
            self.must(Call::Free {
                thread: 0,
                address: l.address,
            })?;
        }
        for s in 0..STREAMS {
            self.must(Call::CompleteStream {
                stream: u64::from(s),
            })?;
        }
        self.must(Call::EmptyCache { thread: 0 })?;
        self.check().map_err(|e| format!("recovery: {e}"))?;
        let used = self.observe()?.device_used;
        let (events, allocations) = (self.side.live_events(), self.side.live_allocations());
        if used != 0 || events != 0 || allocations != 0 {
            return Err(format!(
                "recovery: {used} B, {events} events and {allocations} allocations still held after freeing everything and emptying the cache"
            ));
        }
        // Working normally: requests in both pools, held together (at most 38 MiB of segments
        // after rounding, on devices of at least 48 MiB), are served and returned.
        self.must(Call::SetFraction {
            thread: 0,
            fraction: 1.0,
        })?;
        for size in [512, 1 << 20, 3 << 20, 12 << 20] {
            self.must(Call::Malloc {
                thread: 0,
                size,
                stream: 0,
            })?;
            self.check().map_err(|e| format!("recovery: {e}"))?;
        }
        for l in self.handles.live().to_vec() {
            self.must(Call::Free {
                thread: 0,
                address: l.address,
            })?;
        }
        self.must(Call::EmptyCache { thread: 0 })?;
        self.check().map_err(|e| format!("recovery: {e}"))?;
        let used = self.observe()?.device_used;
        if used != 0 {
            return Err(format!("recovery: {used} B still held at the end"));
        }
        Ok(())
    }
}

/// Target `device_faults`: the fault scenario the bytes decode to, then recovery.
pub fn device_faults(data: &[u8]) -> Result<(), String> {
    let (knobs, steps) = fault_scenario_from_bytes(data);
    let describe = |e: String| format!("{e}\nknobs: {knobs:?}\nsteps ({}): {steps:?}", steps.len());
    let mut h = FaultHarness::new(&knobs).map_err(describe)?;
    for step in &steps {
        h.apply(step).map_err(describe)?;
    }
    h.check()
        .map_err(|e| describe(format!("after the last step: {e}")))?;
    h.recover().map_err(describe)
}

// ---------------------------------------------------------------------------------------------
// Snapshot reader
// ---------------------------------------------------------------------------------------------

/// The limits the snapshot target reads under: the defaults, but at most 2^16 stored values,
/// so that a decoder that stored more than its count says (memo references are shared, never
/// copied) shows up as a memory or time failure of the fuzzer rather than going unnoticed in
/// gigabytes of headroom.
pub const FUZZ_READ_LIMITS: ReadLimits = ReadLimits {
    max_input_bytes: 1 << 30,
    max_values: 1 << 16,
    max_depth: 32,
    max_devices: 1024,
};

/// Target `snapshot_reader`: the bytes read as a snapshot, or a clean error naming the input.
/// A snapshot that reads converts to replay programs, and writes back to bytes that read as the
/// same snapshot.
pub fn snapshot_reader(data: &[u8]) -> Result<(), String> {
    let snapshot = match parse_snapshot_with_limits(data, &FUZZ_READ_LIMITS) {
        Ok(s) => s,
        Err(e) => {
            let message = e.to_string();
            return if message.starts_with("<bytes>: ") {
                Ok(())
            } else {
                Err(format!("error does not name the input: {message}"))
            };
        }
    };
    // Converting the traces must not panic either; what it gives is the replay tests' concern.
    let _ = snapshot.replay_programs();
    // The search of a settings change at run time (rule 24) on short traces: no panic either.
    if let Some(conf) = snapshot.allocator_settings.as_ref().map(|s| &s.alloc_conf)
        && let (Ok(before), Ok(after)) = (
            cachalot_tools::replay::RuntimeSettings::from_conf(""),
            cachalot_tools::replay::RuntimeSettings::from_conf(conf),
        )
    {
        for t in snapshot.traces.iter().filter(|t| t.entries.len() <= 256) {
            let _ = cachalot_tools::find_settings::find_change(
                &snapshot,
                t.device,
                &cachalot::Settings::pytorch(),
                1 << 34,
                &before,
                &after,
            );
        }
    }
    let mut written = Vec::new();
    write_snapshot(&snapshot, &mut written)
        .map_err(|e| format!("a snapshot that read does not write: {e}"))?;
    match parse_snapshot(&written) {
        // NaN is not equal to itself, and a snapshot may carry one (a NaN
        // garbage_collection_threshold reads as it is); `Debug` text tells NaN from a number.
        Ok(back) if back == snapshot || format!("{back:?}") == format!("{snapshot:?}") => Ok(()),
        Ok(back) => Err(format!(
            "written and read back, the snapshot differs:\nread    {snapshot:?}\nwritten {back:?}"
        )),
        Err(e) => Err(format!("a written snapshot does not read back: {e}")),
    }
}

// ---------------------------------------------------------------------------------------------
// Settings parser
// ---------------------------------------------------------------------------------------------

/// Target `settings_parser`: the bytes (as UTF-8, invalid sequences replaced) are a
/// configuration string; with a newline, the part before it is parsed first and the part
/// after it applied over the result. Each string gives settings or a clean error; settings
/// print to a canonical string that parses to equal settings and prints the same again; and
/// an allocator built with them serves a few requests with its invariants intact.
pub fn settings_parser(data: &[u8]) -> Result<(), String> {
    let text = String::from_utf8_lossy(data);
    let (first, second) = match text.split_once('\n') {
        Some((a, b)) => (a, Some(b)),
        None => (&text[..], None),
    };
    let Some(base) = settings_step(&Settings::default(), first)? else {
        return Ok(());
    };
    if let Some(second) = second {
        settings_step(&base, second)?;
    }
    Ok(())
}

fn settings_step(base: &Settings, s: &str) -> Result<Option<Settings>, String> {
    let settings = match base.apply(s) {
        Ok(x) => x,
        Err(e) => {
            return if e.to_string().is_empty() {
                Err(format!("{s:?}: empty error message ({e:?})"))
            } else {
                Ok(None)
            };
        }
    };
    let printed = settings.to_string();
    match Settings::parse(&printed) {
        Ok(back) if back == settings => {
            if back.to_string() != printed {
                return Err(format!(
                    "{s:?}: printed {printed:?}, which prints again as {:?}",
                    back.to_string()
                ));
            }
        }
        Ok(back) => {
            return Err(format!(
                "{s:?}: gave {settings:?}\nprinted {printed:?}, which parses to {back:?}"
            ));
        }
        Err(e) => {
            return Err(format!(
                "{s:?}: gave {settings:?}\nprinted {printed:?}, which does not parse: {e}"
            ));
        }
    }
    if let Ok(mut core) = CachingCore::new(SimDevice::new(1 << 30), settings.clone()) {
        for size in [1, 700 << 10, (1 << 20) + 1, 13 << 20, 300 << 20] {
            match core.malloc(size, StreamId(0)) {
                Ok(a) => core.free(a).map_err(|e| format!("{s:?}: free: {e}"))?,
                Err(Error::OutOfMemory(_)) => {}
                Err(e) => return Err(format!("{s:?}: malloc({size}) with {settings:?}: {e}")),
            }
            core.check_invariants()
                .map_err(|e| format!("{s:?}: malloc({size}) with {settings:?}: {e}"))?;
        }
    }
    Ok(Some(settings))
}

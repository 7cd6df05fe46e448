//! The fuzz harnesses: what each cargo-fuzz target of `fuzz/` runs, kept here so that
//! `cargo test` (tests/fuzz_corpus.rs) replays the committed seeds and regression inputs
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
use cachalot::{
    BackendError, BlockState, CachingCore, Error, Faults, Settings, SimDevice, StreamId,
};

use crate::differential::run_scenario;
use crate::op::{Op, STREAMS};
use crate::scenario::{Knobs, Scenario};
use crate::snapshot::{ReadLimits, parse_snapshot, parse_snapshot_with_limits, write_snapshot};

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

/// Decodes bytes into a scenario: knobs, then up to [`MAX_OPS`] operations until the bytes run
/// out. Every byte string decodes (short ones to few operations).
pub fn scenario_from_bytes(data: &[u8]) -> Scenario {
    let mut u = Unstructured::new(data);
    let knobs = Knobs::arbitrary(&mut u).unwrap_or_else(|_| Knobs::pytorch(1 << 30));
    let mut ops = Vec::new();
    while ops.len() < MAX_OPS && !u.is_empty() {
        match Op::arbitrary(&mut u) {
            Ok(op) => ops.push(op),
            Err(_) => break,
        }
    }
    Scenario { knobs, ops }
}

/// Target `differential`: the scenario the bytes decode to, through [`run_scenario`].
pub fn differential(data: &[u8]) -> Result<(), String> {
    let scenario = scenario_from_bytes(data);
    run_scenario(&scenario).map_err(|e| {
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

/// A device call that can be made to fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Arbitrary)]
pub enum FaultKind {
    /// Device allocation reports out-of-memory.
    AllocOom,
    /// Device allocation reports another device error.
    AllocError,
    /// Freeing a segment fails (the memory stays allocated).
    FreeError,
    /// Recording an event fails.
    RecordError,
    /// Querying an event fails.
    QueryError,
    /// Waiting for an event fails.
    SyncError,
}

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

impl<'a> Arbitrary<'a> for FaultStep {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<FaultStep> {
        // Mostly operations, so that faults land in varied states.
        Ok(match u.int_in_range(0u8..=15)? {
            0..=2 => FaultStep::Inject(FaultKind::arbitrary(u)?, u.int_in_range(1u8..=3)?),
            3 => FaultStep::ClearFaults,
            _ => FaultStep::Op(Op::arbitrary(u)?),
        })
    }
}

/// Decodes bytes into knobs and up to [`MAX_OPS`] fault steps.
pub fn fault_scenario_from_bytes(data: &[u8]) -> (Knobs, Vec<FaultStep>) {
    let mut u = Unstructured::new(data);
    let knobs = Knobs::arbitrary(&mut u).unwrap_or_else(|_| Knobs::pytorch(1 << 30));
    let mut steps = Vec::new();
    while steps.len() < MAX_OPS && !u.is_empty() {
        match FaultStep::arbitrary(&mut u) {
            Ok(s) => steps.push(s),
            Err(_) => break,
        }
    }
    (knobs, steps)
}

/// The allocator alone on a simulated device that fails on request, with a shadow map of
/// every allocation the user holds.
pub struct FaultHarness {
    /// The allocator under test.
    pub core: CachingCore<SimDevice>,
    /// Live allocations `(address, requested size)`, in the order they were made.
    live: Vec<(u64, u64)>,
    freed: Vec<u64>,
    step: usize,
}

fn injected(e: &Error) -> bool {
    matches!(e, Error::Backend(BackendError::Injected { .. }))
}

impl FaultHarness {
    /// The allocator configured by `knobs` on a fault-free device.
    pub fn new(knobs: &Knobs) -> Result<FaultHarness, String> {
        let core = CachingCore::new(SimDevice::new(knobs.capacity), knobs.settings())
            .map_err(|e| e.to_string())?;
        Ok(FaultHarness {
            core,
            live: Vec::new(),
            freed: Vec::new(),
            step: 0,
        })
    }

    /// Runs one step and checks its outcome and the state after it.
    pub fn apply(&mut self, step: &FaultStep) -> Result<(), String> {
        self.step += 1;
        self.run(step)
            .and_then(|()| self.check())
            .map_err(|e| format!("step {}: {step:?}: {e}", self.step))
    }

    fn run(&mut self, step: &FaultStep) -> Result<(), String> {
        let op = match step {
            FaultStep::Inject(kind, n) => {
                let n = u32::from(*n);
                let mut f = Faults::default();
                match kind {
                    FaultKind::AllocOom => f.alloc_oom = n,
                    FaultKind::AllocError => f.alloc_error = n,
                    FaultKind::FreeError => f.free_error = n,
                    FaultKind::RecordError => f.record_error = n,
                    FaultKind::QueryError => f.query_error = n,
                    FaultKind::SyncError => f.sync_error = n,
                }
                self.core.backend_mut().inject(f);
                return Ok(());
            }
            FaultStep::ClearFaults => {
                self.core.backend_mut().clear_faults();
                return Ok(());
            }
            FaultStep::Op(op) => op,
        };
        let stream = |s: u8| StreamId(u64::from(s % STREAMS));
        match *op {
            Op::Malloc { size, stream: s } => {
                let before = self.core.stats().allocation.all.current;
                match self.core.malloc(size, stream(s)) {
                    Ok(0) if size == 0 => {}
                    Ok(0) => return Err(format!("address 0 for {size} bytes")),
                    Ok(_) if size == 0 => return Err("a zero-size request got an address".into()),
                    Ok(a) => {
                        if self.live.iter().any(|&(x, _)| x == a) {
                            return Err(format!("{a:#x} handed out twice"));
                        }
                        self.live.push((a, size));
                    }
                    Err(e) => {
                        let expected = match &e {
                            Error::OutOfMemory(_) => true,
                            Error::TooLarge { .. } => size > cachalot::sizes::MAX_ALLOC_SIZE,
                            e => injected(e),
                        };
                        if !expected {
                            return Err(format!("unexpected error: {e}"));
                        }
                        if self.core.stats().allocation.all.current != before {
                            return Err(format!(
                                "a failed allocation changed the allocation count: {e}"
                            ));
                        }
                    }
                }
            }
            Op::Free { pick } => {
                if self.live.is_empty() {
                    expect_unknown(self.core.free(0xdead_0000))?;
                } else {
                    let i = pick as usize % self.live.len();
                    let (a, _) = self.live[i];
                    match self.core.free(a) {
                        Ok(()) => {
                            self.live.remove(i);
                            self.freed.push(a);
                        }
                        // The block stays allocated: the shadow map keeps it, and the check
                        // after this step makes sure the allocator does too.
                        Err(e) if injected(&e) => {}
                        Err(e) => {
                            return Err(format!("unexpected error freeing a live block: {e}"));
                        }
                    }
                }
            }
            Op::RecordStream { pick, stream: s } => {
                if self.live.is_empty() {
                    expect_unknown(self.core.record_stream(0xdead_0000, stream(s)))?;
                } else {
                    let (a, _) = self.live[pick as usize % self.live.len()];
                    self.core
                        .record_stream(a, stream(s))
                        .map_err(|e| format!("record_stream of a live block: {e}"))?;
                }
            }
            Op::CompleteStream { stream: s } => self.core.backend_mut().complete_stream(stream(s)),
            Op::EmptyCache => match self.core.empty_cache() {
                Ok(()) => {}
                Err(e) if injected(&e) => {}
                Err(e) => return Err(format!("unexpected error: {e}")),
            },
            Op::SetFraction { per_mille } => {
                let r = self.core.set_memory_fraction(f64::from(per_mille) / 1000.0);
                match (per_mille <= 1000, r) {
                    (true, Ok(())) | (false, Err(Error::InvalidFraction { .. })) => {}
                    (_, r) => return Err(format!("set_memory_fraction gave {r:?}")),
                }
            }
            Op::FailDeviceAllocs { n } => self.core.backend_mut().fail_next_allocs(u32::from(n)),
            Op::FreeForeign { address } => {
                let mut a = if address % 2 == 0 && !self.freed.is_empty() {
                    self.freed[(address / 2) as usize % self.freed.len()]
                } else {
                    address
                };
                if a == 0 || self.live.iter().any(|&(x, _)| x == a) {
                    a |= 1;
                }
                expect_unknown(self.core.free(a))?;
            }
            Op::Adopt { ref segment } => {
                let before = (self.core.segments(), self.core.stats().clone());
                match self.core.adopt_segment(segment.to_allocator()) {
                    Ok(()) => {
                        let mut address = segment.address;
                        for b in &segment.blocks {
                            if b.state == 1 {
                                self.live.push((address, b.requested));
                            }
                            address += b.size;
                        }
                    }
                    Err(e) => {
                        let expected = matches!(
                            e,
                            Error::InvalidAdoption { .. }
                                | Error::Backend(BackendError::OutOfMemory)
                        ) || injected(&e);
                        if !expected {
                            return Err(format!("unexpected error adopting a segment: {e}"));
                        }
                        if (self.core.segments(), self.core.stats().clone()) != before {
                            return Err(format!("a refused adoption changed the state: {e}"));
                        }
                    }
                }
            }
            Op::SetNextAddress { address } => self.core.backend_mut().set_next_address(address),
        }
        Ok(())
    }

    /// No block lost, none handed out twice, the device holds exactly the allocator's segments,
    /// and the allocator's own invariants hold.
    pub fn check(&self) -> Result<(), String> {
        self.core
            .check_invariants()
            .map_err(|e| format!("allocator invariant: {e}"))?;
        let segments = self.core.segments();
        let mut allocated: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
        let mut end = 0u64;
        for s in &segments {
            if s.address < end {
                return Err(format!(
                    "segment {:#x} overlaps the one before it",
                    s.address
                ));
            }
            end = s.address + s.size;
            for b in s.blocks.iter().filter(|b| b.state == BlockState::Allocated) {
                allocated.insert(b.address, (b.size, b.requested));
            }
        }
        if allocated.len() != self.live.len() {
            return Err(format!(
                "the allocator holds {} allocated blocks, the user {} (lost or phantom blocks)",
                allocated.len(),
                self.live.len()
            ));
        }
        for &(a, requested) in &self.live {
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
        let device: Vec<(u64, u64)> = self.core.backend().allocations().collect();
        let held: Vec<(u64, u64)> = segments.iter().map(|s| (s.address, s.size)).collect();
        if device != held {
            return Err(format!(
                "device allocations {device:x?} differ from the allocator's segments {held:x?}"
            ));
        }
        let reserved = self.core.stats().reserved_bytes.all.current;
        if self.core.backend().used() as i64 != reserved {
            return Err(format!(
                "device holds {} B, the allocator reserves {reserved} B",
                self.core.backend().used()
            ));
        }
        Ok(())
    }

    /// With the faults stopped: frees everything the user holds, completes every stream, empties
    /// the cache and checks the device is empty; then serves fresh requests as usual and gives
    /// them back.
    pub fn recover(&mut self) -> Result<(), String> {
        self.core.backend_mut().clear_faults();
        for (a, _) in std::mem::take(&mut self.live) {
            self.core
                .free(a)
                .map_err(|e| format!("recovery: free {a:#x}: {e}"))?;
        }
        for s in 0..STREAMS {
            self.core
                .backend_mut()
                .complete_stream(StreamId(u64::from(s)));
        }
        self.core
            .empty_cache()
            .map_err(|e| format!("recovery: empty_cache: {e}"))?;
        self.check().map_err(|e| format!("recovery: {e}"))?;
        let d = self.core.backend();
        if d.used() != 0 || d.live_events() != 0 || self.core.live_allocations() != 0 {
            return Err(format!(
                "recovery: {} B, {} events and {} allocations still held after freeing everything and emptying the cache",
                d.used(),
                d.live_events(),
                self.core.live_allocations()
            ));
        }
        // Working normally: requests in both pools, held together (at most 38 MiB of segments
        // after rounding, on devices of at least 48 MiB), are served and returned.
        self.core
            .set_memory_fraction(1.0)
            .map_err(|e| format!("recovery: {e}"))?;
        for size in [512, 1 << 20, 3 << 20, 12 << 20] {
            let a = self
                .core
                .malloc(size, StreamId(0))
                .map_err(|e| format!("recovery: malloc {size}: {e}"))?;
            self.live.push((a, size));
            self.check().map_err(|e| format!("recovery: {e}"))?;
        }
        for (a, _) in std::mem::take(&mut self.live) {
            self.core
                .free(a)
                .map_err(|e| format!("recovery: free {a:#x}: {e}"))?;
        }
        self.core
            .empty_cache()
            .map_err(|e| format!("recovery: empty_cache: {e}"))?;
        self.check().map_err(|e| format!("recovery: {e}"))?;
        if self.core.backend().used() != 0 {
            return Err(format!(
                "recovery: {} B still held at the end",
                self.core.backend().used()
            ));
        }
        Ok(())
    }
}

fn expect_unknown(r: Result<(), Error>) -> Result<(), String> {
    match r {
        Err(Error::UnknownPointer { .. }) => Ok(()),
        r => Err(format!(
            "an address that is not live gave {r:?}, not UnknownPointer"
        )),
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

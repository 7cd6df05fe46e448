//! Recorded traces through the model: a replay program run on the allocator core and the model
//! side by side.
//!
//! The one rule: the program is interpreted by the product's own replay interpreter
//! ([`Interpreter`], what `cachalot replay` times), with the start adopted and the trace's
//! segment addresses offered as the product offers them, and the [`Driver`] makes each call on
//! both sides; the state is compared after every operation. [`model_passes`] runs a program
//! several times in a row through the model alone, for measurements of its policy.

use cachalot::{AdoptedRange, AdoptedSegment, StreamId};
use cachalot_tools::replay::{
    Executed, Interpreter, ReplayProgram, ReplayTarget, StartFailure, StartMode,
};

use crate::driver::Driver;
use crate::scenario::Knobs;
use crate::side::{
    Call, CoreSide, ModelSide, Outcome, Side, adoption_from_allocator,
    adoption_from_allocator_range,
};

/// What a side-by-side replay ran.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Replayed {
    /// Segments adopted at the start.
    pub adopted: usize,
    /// Operations run.
    pub ops: usize,
    /// Allocations served.
    pub allocations: usize,
    /// Allocations that failed for lack of memory (on both sides).
    pub out_of_memory: usize,
}

/// Runs `program` on the allocator core and the model configured by `knobs`, from the start
/// `start` says, offering the trace's segment addresses; compares after the start and after
/// every operation, then frees what the program left live, completes its held-back frees and
/// empties the cache: both must give every byte back. The error names the operation and what
/// differed.
pub fn replay_side_by_side(
    program: &ReplayProgram,
    knobs: &Knobs,
    start: StartMode,
) -> Result<Replayed, String> {
    let mut driver = Driver::new(CoreSide::new(knobs)?, ModelSide::new(knobs));
    let mut interpreter = Interpreter::new(program);
    let mut done = Replayed::default();
    driver.compare()?;
    interpreter
        .set_up_start(&mut driver, program, start)
        .map_err(|e| match e {
            StartFailure::Inconsistent => "the program's start does not match its handles".into(),
            StartFailure::Target(e) => format!("setting up the start: {e}"),
        })?;
    if start == StartMode::Exact {
        done.adopted = program.start.segments.len();
    }
    driver
        .compare()
        .map_err(|e| format!("after the start: {e}"))?;
    for i in 0..program.ops.len() {
        let executed = interpreter
            .step(&mut driver, program, i, true)
            .map_err(|e| format!("op {i} ({:?}): {e}", program.ops[i]))?;
        driver
            .compare()
            .map_err(|e| format!("after op {i} ({:?}): {e}", program.ops[i]))?;
        match executed {
            Executed::Allocated => done.allocations += 1,
            Executed::AllocationFailed => done.out_of_memory += 1,
            Executed::Freed | Executed::Other => {}
        }
        done.ops += 1;
    }
    interpreter
        .release_all(&mut driver)
        .map_err(|e| format!("freeing what the program left: {e}"))?;
    driver
        .call(&crate::side::Call::EmptyCache { thread: 0 })
        .and_then(|_| driver.compare())
        .map_err(|e| format!("emptying the cache at the end: {e}"))?;
    let used = driver.a.observe()?.device_used;
    if used != 0 {
        return Err(format!(
            "{used} bytes still held after freeing everything and emptying the cache"
        ));
    }
    Ok(done)
}

/// What one pass of a program through one side alone did ([`passes`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pass {
    /// Device calls that made or mapped memory during the pass (`num_device_alloc`).
    pub device_allocs: u64,
    /// Device calls that gave memory back or unmapped it during the pass (`num_device_free`).
    pub device_frees: u64,
    /// Bytes of new memory reserved during the pass (the rise of `reserved_bytes.all.allocated`:
    /// pages created, not pages aliased or re-homed).
    pub new_bytes: u64,
    /// The highest `reserved_bytes` (all pools) since the side was made, at the pass's end.
    pub peak_reserved: u64,
    /// The highest `requested_bytes` (all pools) since the side was made, at the pass's end.
    pub peak_requested: u64,
    /// Allocations that failed for lack of memory.
    pub out_of_memory: usize,
    /// Operations run.
    pub ops: usize,
    /// Rule 23: the model's stitched views at the pass's end.
    pub views: usize,
    /// Rule 23: the bytes of address space those views hold.
    pub view_bytes: u64,
    /// Rule 19j: the handles map steps made during the pass (each a `cuMemCreate`, a
    /// `cuMemMap` and a `cuMemSetAccess` on a GPU: the price the call counts do not show).
    pub handles: u64,
    /// When asked for ([`model_passes_logged`]): each operation of the pass that made device
    /// calls, as `(operation index, num_device_alloc rise, num_device_free rise, views after
    /// it, reserved bytes after it)`.
    pub calls_at: Vec<(usize, u64, u64, usize, u64)>,
}

/// One side alone as a replay target: each call made through [`Side::call`], any outcome
/// other than success (or out-of-memory for an allocation) stopping the replay.
struct Solo<S: Side>(S);

impl<S: Side> Solo<S> {
    fn call(&mut self, call: Call) -> Result<u64, Outcome> {
        match self.0.call(&call) {
            Outcome::Ok(v) => Ok(v),
            other => Err(other),
        }
    }

    /// The statistic at the dotted `path`.
    fn stat(&self, path: &str) -> Result<u64, String> {
        let observed = self.0.observe()?;
        crate::side::stat_paths(&observed.stats)
            .into_iter()
            .find(|(p, _)| p == path)
            .map(|(_, v)| v as u64)
            .ok_or_else(|| format!("no statistic {path}"))
    }
}

impl<S: Side> ReplayTarget for Solo<S> {
    type Error = Outcome;

    fn is_out_of_memory(error: &Outcome) -> bool {
        matches!(error, Outcome::OutOfMemory { .. })
    }

    fn malloc(&mut self, size: u64, stream: StreamId) -> Result<u64, Outcome> {
        self.call(Call::Malloc {
            thread: 0,
            size,
            stream: stream.0,
        })
    }

    fn free(&mut self, address: u64) -> Result<(), Outcome> {
        self.call(Call::Free { thread: 0, address }).map(drop)
    }

    fn record_stream(&mut self, address: u64, stream: StreamId) -> Result<(), Outcome> {
        self.call(Call::RecordStream {
            thread: 0,
            address,
            stream: stream.0,
        })
        .map(drop)
    }

    fn empty_cache(&mut self) -> Result<(), Outcome> {
        self.call(Call::EmptyCache { thread: 0 }).map(drop)
    }

    fn adopt_segment(&mut self, segment: AdoptedSegment) -> Result<(), Outcome> {
        self.call(Call::Adopt {
            segment: adoption_from_allocator(&segment),
        })
        .map(drop)
    }

    fn adopt_range(&mut self, range: AdoptedRange) -> Result<(), Outcome> {
        self.call(Call::Adopt {
            segment: adoption_from_allocator_range(&range),
        })
        .map(drop)
    }

    fn complete_stream(&mut self, stream: StreamId) -> Result<(), Outcome> {
        self.call(Call::CompleteStream { stream: stream.0 })
            .map(drop)
    }

    fn offer_address(&mut self, address: Option<u64>) -> Result<(), Outcome> {
        self.call(Call::SetNextAddress { address }).map(drop)
    }

    fn set_runtime_settings(
        &mut self,
        change: &cachalot_tools::replay::RuntimeSettings,
    ) -> Result<(), Outcome> {
        self.call(crate::driver::runtime_call(change)).map(drop)
    }

    fn release_stream_cache(&mut self, stream: StreamId) -> Result<(), Outcome> {
        self.call(Call::ReleaseStream { stream: stream.0 })
            .map(drop)
    }
}

/// Runs `program` `passes` times in a row on the model configured by `knobs` alone (no
/// allocator side): each pass starts from the program's live tensors (allocated, not
/// adopted), runs every operation (no trace addresses offered), then frees what the program
/// left live and completes its held-back frees — without emptying the cache, so that a pass
/// meets what the earlier ones left cached. With `check`, the model's invariants are checked
/// after every operation (else at the end of each pass). Each pass's figures, in order.
pub fn model_passes(
    program: &ReplayProgram,
    knobs: &Knobs,
    passes: usize,
    check: bool,
) -> Result<Vec<Pass>, String> {
    model_passes_logged(program, knobs, passes, check, false)
}

/// [`model_passes`], and with `log` each pass's operations that made device calls
/// ([`Pass::calls_at`]).
pub fn model_passes_logged(
    program: &ReplayProgram,
    knobs: &Knobs,
    passes: usize,
    check: bool,
    log: bool,
) -> Result<Vec<Pass>, String> {
    model_passes_with_config(
        program,
        crate::side::model_config(knobs),
        passes,
        check,
        log,
    )
}

/// [`model_passes_logged`] on a model made from `config` itself (for settings the knobs do
/// not express, such as a measurement switch of the model's).
pub fn model_passes_with_config(
    program: &ReplayProgram,
    config: cachalot_model::ModelConfig,
    passes: usize,
    check: bool,
    log: bool,
) -> Result<Vec<Pass>, String> {
    let mut target = Solo(ModelSide::from_config(config));
    let mut out = Vec::with_capacity(passes);
    let (mut allocs, mut frees, mut reserved, mut handles) = (0, 0, 0, 0);
    for pass in 0..passes {
        let mut interpreter = Interpreter::new(program);
        let mut done = Pass::default();
        interpreter
            .set_up_start(&mut target, program, StartMode::LiveTensors)
            .map_err(|e| format!("pass {pass}: setting up the start: {e:?}"))?;
        for i in 0..program.ops.len() {
            let before = log.then(|| target.0.model().stats());
            match interpreter
                .step(&mut target, program, i, false)
                .map_err(|e| format!("pass {pass}, op {i}: {e:?}"))?
            {
                Executed::AllocationFailed => done.out_of_memory += 1,
                Executed::Allocated | Executed::Freed | Executed::Other => {}
            }
            done.ops += 1;
            if let Some(before) = before {
                let after = target.0.model().stats();
                let a = after.num_device_alloc - before.num_device_alloc;
                let f = after.num_device_free - before.num_device_free;
                if a + f > 0 {
                    let views = target.0.model().views().len();
                    let reserved = after.reserved_bytes.all.current as u64;
                    done.calls_at.push((i, a, f, views, reserved));
                }
            }
            if check {
                target
                    .0
                    .check_invariants()
                    .map_err(|e| format!("pass {pass}, after op {i}: {e}"))?;
            }
        }
        interpreter
            .release_all(&mut target)
            .map_err(|e| format!("pass {pass}: freeing what the program left: {e:?}"))?;
        target
            .0
            .check_invariants()
            .map_err(|e| format!("pass {pass}, at its end: {e}"))?;
        let (a, f) = (
            target.stat("num_device_alloc")?,
            target.stat("num_device_free")?,
        );
        done.device_allocs = a - allocs;
        done.device_frees = f - frees;
        (allocs, frees) = (a, f);
        let r = target.stat("reserved_bytes.all.allocated")?;
        done.new_bytes = r - reserved;
        reserved = r;
        done.peak_reserved = target.stat("reserved_bytes.all.peak")?;
        done.peak_requested = target.stat("requested_bytes.all.peak")?;
        let views = target.0.model().views();
        done.views = views.len();
        done.view_bytes = views.iter().map(|&(_, bytes, _)| bytes).sum();
        let h = target.0.model().handles_made();
        done.handles = h - handles;
        handles = h;
        out.push(done);
    }
    Ok(out)
}

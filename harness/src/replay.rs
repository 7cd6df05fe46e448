//! Recorded traces through the model: a replay program run on the allocator core and the model
//! side by side.
//!
//! The one rule: the program is interpreted by the product's own replay interpreter
//! ([`Interpreter`], what `cachalot replay` times), with the start adopted and the trace's
//! segment addresses offered as the product offers them, and the [`Driver`] makes each call on
//! both sides; the state is compared after every operation.

use cachalot_tools::replay::{Executed, Interpreter, ReplayProgram, StartFailure, StartMode};

use crate::driver::Driver;
use crate::scenario::Knobs;
use crate::side::{CoreSide, ModelSide, Side};

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

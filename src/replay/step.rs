//! A replay on the simulated device that runs one operation at a time and can be looked at
//! between operations: what `cachalot fit` and `cachalot explain` stand on.
//!
//! The one rule: a [`Stepper`] makes exactly the calls [`replay`](super::replay) makes — the
//! same start, the same interpreter, the trace's segment addresses offered the same way — so
//! the state it shows after operation `i` is the state the timed replay passed through.

use cachalot::{CachingCore, Settings, SimDevice, Stats, StreamId};

use super::engine::{CoreTarget, OfferAddress, ReplayError};
use super::interpret::{Executed, Interpreter, StartFailure};
use super::program::ReplayProgram;
use super::start::StartMode;

/// A replay of one program on a simulated device, one operation at a time.
pub struct Stepper<'p> {
    program: &'p ReplayProgram,
    core: CachingCore<SimDevice>,
    interpreter: Interpreter,
    next: usize,
}

impl<'p> Stepper<'p> {
    /// The allocator under `settings` on a simulated device of `capacity` bytes, in the state
    /// `start` says (see [`StartMode`]), before the program's first operation.
    pub fn new(
        program: &'p ReplayProgram,
        settings: Settings,
        capacity: u64,
        start: StartMode,
    ) -> Result<Stepper<'p>, ReplayError> {
        let core =
            CachingCore::new(SimDevice::new(capacity), settings).map_err(ReplayError::Setup)?;
        let mut stepper = Stepper {
            program,
            core,
            interpreter: Interpreter::new(program),
            next: 0,
        };
        if start != StartMode::Empty
            && !(program.initial.is_empty() && program.start.segments.is_empty())
        {
            let mut complete = |d: &mut SimDevice, s: StreamId| d.complete_stream(s);
            let mut target = CoreTarget {
                core: &mut stepper.core,
                complete: &mut complete,
                offer: &mut None,
            };
            stepper
                .interpreter
                .set_up_start(&mut target, program, start)
                .map_err(|e| {
                    ReplayError::Start(match e {
                        StartFailure::Target(e) => e,
                        StartFailure::Inconsistent => cachalot::Error::InvalidAdoption {
                            reason: "the program's start handles do not match its start layout"
                                .into(),
                        },
                    })
                })?;
        }
        Ok(stepper)
    }

    /// Runs the next operation; `None` when the program is done.
    pub fn step(&mut self) -> Result<Option<Executed>, ReplayError> {
        let i = self.next;
        if i >= self.program.ops.len() {
            return Ok(None);
        }
        let mut complete = |d: &mut SimDevice, s: StreamId| d.complete_stream(s);
        let mut give = |d: &mut SimDevice, a: Option<u64>| d.set_next_address(a);
        let mut offer: Option<OfferAddress<'_, SimDevice>> = Some(&mut give);
        let mut target = CoreTarget {
            core: &mut self.core,
            complete: &mut complete,
            offer: &mut offer,
        };
        let done = self
            .interpreter
            .step(&mut target, self.program, i, true)
            .map_err(|error| ReplayError::Device { op: i, error })?;
        self.next += 1;
        Ok(Some(done))
    }

    /// Runs operations until `done` of them have run (or the program ends).
    pub fn run_to(&mut self, done: usize) -> Result<(), ReplayError> {
        while self.next < done.min(self.program.ops.len()) {
            self.step()?;
        }
        Ok(())
    }

    /// How many operations have run: the next one to run is `ops[position()]`.
    pub fn position(&self) -> usize {
        self.next
    }

    /// The program being replayed.
    pub fn program(&self) -> &'p ReplayProgram {
        self.program
    }

    /// The allocator, to look at.
    pub fn core(&self) -> &CachingCore<SimDevice> {
        &self.core
    }

    /// The allocator, to act on (an `empty_cache` to see what it gives back, for instance);
    /// stepping on after changing it replays another program than the trace's.
    pub fn core_mut(&mut self) -> &mut CachingCore<SimDevice> {
        &mut self.core
    }

    /// The allocator's statistics now.
    pub fn stats(&self) -> &Stats {
        self.core.stats()
    }

    /// The program's handles live now, as `(handle, address)`.
    pub fn live_handles(&self) -> impl Iterator<Item = (usize, u64)> + '_ {
        self.interpreter.live_handles()
    }

    /// Bytes the program holds live now (requested sizes).
    pub fn requested(&self) -> u64 {
        self.interpreter.requested()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::engine::{ReplayConfig, replay};
    use crate::replay::program::ReplayOp;

    fn program() -> ReplayProgram {
        let mut ops = Vec::new();
        for id in 0..6 {
            ops.push(ReplayOp::Alloc {
                id,
                size: (id as u64 + 1) * (3 << 20),
                stream: 0,
            });
            if id % 2 == 1 {
                ops.push(ReplayOp::FreeRequested { id: id - 1 });
                ops.push(ReplayOp::FreeCompleted { id: id - 1 });
            }
        }
        ReplayProgram {
            ops,
            ..ReplayProgram::default()
        }
    }

    #[test]
    fn stepping_to_the_end_reaches_the_state_the_timed_replay_ends_in() {
        let program = program();
        let config = ReplayConfig::pytorch();
        let timed = replay(&program, &config).unwrap();
        let mut s = Stepper::new(
            &program,
            Settings::pytorch(),
            config.capacity,
            StartMode::Exact,
        )
        .unwrap();
        let mut steps = 0;
        while s.step().unwrap().is_some() {
            steps += 1;
        }
        assert_eq!(steps, program.ops.len());
        assert_eq!(s.core().segments(), timed.final_layout);
        assert_eq!(s.stats(), &timed.stats);
        assert_eq!(s.live_handles().count(), 3);
    }

    #[test]
    fn a_small_device_makes_allocations_fail_and_the_stepper_goes_on() {
        let program = program();
        let mut s =
            Stepper::new(&program, Settings::pytorch(), 20 << 20, StartMode::Exact).unwrap();
        let mut failed = 0;
        while let Some(e) = s.step().unwrap() {
            failed += usize::from(e == Executed::AllocationFailed);
        }
        assert!(failed > 0);
        assert_eq!(s.stats().num_ooms, failed as u64);
    }
}

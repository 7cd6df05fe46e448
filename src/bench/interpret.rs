//! The benchmark's one interpreter: a `cachalot ops v1` program run line by line on a
//! [`BenchTarget`], with the semantics of docs/GPU_BENCH.md's table — the observed pass, which
//! reads the allocator after every line, and the timed passes, which read nothing.
//!
//! The one rule: every allocator runs through one step function (`State::step`); the allocators differ only
//! behind [`BenchTarget`].

use std::time::Instant;

use super::allocators::{BenchTarget, Reading};
use super::error::Failure;
use crate::ops::{Op, OpsProgram};

/// What one line did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Executed {
    Allocated,
    AllocationFailed,
    Other,
}

/// One pass's program state: which handle holds which block, which side streams have a
/// held-back free pending, and the live requested bytes.
struct State<K> {
    /// Per handle: its block, requested size and stream.
    slots: Vec<Option<(K, u64, u32)>>,
    /// Per side stream: a held-back free waits for it.
    pending: Vec<bool>,
    /// The side stream of the `r` line just run, for the `f` that follows it.
    recording: Option<u32>,
    requested: u64,
    /// Handles in id order, side streams in number order (for [`State::release_all`]).
    handle_order: Vec<u32>,
    side_order: Vec<u32>,
}

impl<K> State<K> {
    fn new(program: &OpsProgram) -> State<K> {
        let order = |values: &[u64]| {
            let mut o: Vec<u32> = (0..values.len() as u32).collect();
            o.sort_by_key(|&i| values[i as usize]);
            o
        };
        State {
            slots: (0..program.handles.len()).map(|_| None).collect(),
            pending: vec![false; program.sides.len()],
            recording: None,
            requested: 0,
            handle_order: order(&program.handles),
            side_order: order(&program.sides),
        }
    }

    /// Runs one line.
    #[inline]
    fn step<T: BenchTarget<Block = K>>(
        &mut self,
        target: &mut T,
        program: &OpsProgram,
        op: Op,
    ) -> Result<Executed, Failure> {
        match op {
            Op::Alloc { id, size, stream } => {
                // The parser refuses a second allocation of a live handle; after a failed one
                // the slot is empty.
                match target.alloc(size, stream as usize)? {
                    Some(block) => {
                        self.slots[id as usize] = Some((block, size, stream));
                        self.requested += size;
                        Ok(Executed::Allocated)
                    }
                    None => Ok(Executed::AllocationFailed),
                }
            }
            Op::Record { id, side } => {
                if let Some((block, _, _)) = &self.slots[id as usize] {
                    target.record(block, program.sides[side as usize])?;
                    self.recording = Some(side);
                }
                Ok(Executed::Other)
            }
            Op::Free { id } => {
                let recording = self.recording.take();
                if let Some((block, size, stream)) = self.slots[id as usize].take() {
                    self.requested -= size;
                    target.free(block, stream as usize)?;
                    if let Some(side) = recording {
                        self.pending[side as usize] = true;
                    }
                }
                Ok(Executed::Other)
            }
            Op::Complete { side } => {
                if std::mem::take(&mut self.pending[side as usize]) {
                    target.complete(program.sides[side as usize])?;
                }
                Ok(Executed::Other)
            }
            Op::EmptyCache => {
                target.empty_cache()?;
                Ok(Executed::Other)
            }
        }
    }

    /// Frees every live handle in id order and completes every pending side stream, so the
    /// next pass starts from the same program state.
    fn release_all<T: BenchTarget<Block = K>>(
        &mut self,
        target: &mut T,
        program: &OpsProgram,
    ) -> Result<(), Failure> {
        for &h in &self.handle_order {
            if let Some((block, size, stream)) = self.slots[h as usize].take() {
                self.requested -= size;
                target.free(block, stream as usize)?;
            }
        }
        for &s in &self.side_order {
            if std::mem::take(&mut self.pending[s as usize]) {
                target.complete(program.sides[s as usize])?;
            }
        }
        self.recording = None;
        Ok(())
    }
}

/// What the observed pass measured.
#[derive(Debug, Default)]
pub struct Observed {
    /// `a` lines after `s`.
    pub allocs: u64,
    /// Failed allocations (the start's included).
    pub ooms: u64,
    /// Peak live requested bytes.
    pub peak_requested: u64,
    /// Peak reserved bytes.
    pub peak_reserved: u64,
    /// Peak allocated bytes, where the allocator tells.
    pub peak_allocated: Option<u64>,
    /// Memory calls and what they were.
    pub driver_calls: Option<(u64, String)>,
    /// Lines after which reserved memory differs from before.
    pub reserved_changes: u64,
    /// Allocations after which reserved memory did not grow and no device allocation was
    /// counted.
    pub cache_hits: u64,
    /// After `s` (line 0) and after each line: (line, requested, reserved).
    pub timeline: Vec<(u64, u64, u64)>,
}

/// The observed pass: the start, then `lines` lines after `s`, reading the allocator after
/// each; then everything is released.
pub fn observed_pass<T: BenchTarget>(
    target: &mut T,
    program: &OpsProgram,
    lines: usize,
) -> Result<Observed, Failure> {
    let mut st = State::new(program);
    let mut o = Observed::default();
    for &op in &program.start {
        if st.step(target, program, op)? == Executed::AllocationFailed {
            o.ooms += 1;
        }
    }
    let mut prev = target.observe()?;
    o.timeline.reserve(lines + 1);
    let note = |o: &mut Observed, line: u64, requested: u64, r: &Reading| {
        o.timeline.push((line, requested, r.reserved));
        o.peak_requested = o.peak_requested.max(requested);
        o.peak_reserved = o.peak_reserved.max(r.reserved);
        if let Some(a) = r.allocated {
            o.peak_allocated = Some(o.peak_allocated.unwrap_or(0).max(a));
        }
    };
    note(&mut o, 0, st.requested, &prev);
    for (i, &op) in program.trace[..lines].iter().enumerate() {
        let done = st.step(target, program, op)?;
        let now = target.observe()?;
        match done {
            Executed::Allocated => {
                o.allocs += 1;
                if now.reserved <= prev.reserved && now.device_allocs == prev.device_allocs {
                    o.cache_hits += 1;
                }
            }
            Executed::AllocationFailed => {
                o.allocs += 1;
                o.ooms += 1;
            }
            Executed::Other => {}
        }
        if now.reserved != prev.reserved {
            o.reserved_changes += 1;
        }
        note(&mut o, i as u64 + 1, st.requested, &now);
        prev = now;
    }
    o.driver_calls = target.driver_calls();
    st.release_all(target, program)?;
    Ok(o)
}

/// What the timed passes measured.
#[derive(Clone, Debug, PartialEq)]
pub struct Timed {
    /// Nanoseconds per line, the first pass (the fresh allocator's).
    pub first_ns: f64,
    /// Nanoseconds per line, the mean of the other passes (`None` with one pass).
    pub steady_ns: Option<f64>,
    /// Driver calls per pass after the first (`None` with one pass, or where the allocator
    /// does not count them).
    pub steady_calls: Option<f64>,
    /// Each pass after the first: its ns per line.
    pub passes_ns: Vec<f64>,
    /// Each pass after the first: its driver calls (`None` where not counted).
    pub passes_calls: Option<Vec<u64>>,
}

/// The timed passes: the start (untimed), `lines` lines after `s` on the fresh allocator, then
/// `passes - 1` more times, each after releasing everything (untimed). Never inlined: profiles
/// of the timed passes (callgrind's `--toggle-collect=*timed_passes*`, results/) find it by name.
#[inline(never)]
pub fn timed_passes<T: BenchTarget>(
    target: &mut T,
    program: &OpsProgram,
    lines: usize,
    passes: usize,
) -> Result<Timed, Failure> {
    let mut st = State::new(program);
    for &op in &program.start {
        st.step(target, program, op)?;
    }
    let ops = &program.trace[..lines];
    let per_line = lines.max(1) as f64;
    let t = Instant::now();
    for &op in ops {
        st.step(target, program, op)?;
    }
    let first = t.elapsed().as_nanos() as f64 / per_line;
    st.release_all(target, program)?;
    let calls_before = target.driver_calls().map(|(n, _)| n);
    let mut steady_ns = 0u128;
    let mut passes_ns = Vec::with_capacity(passes.saturating_sub(1));
    let mut passes_calls = calls_before.map(|_| Vec::with_capacity(passes.saturating_sub(1)));
    let mut last = calls_before;
    for _ in 1..passes {
        let t = Instant::now();
        for &op in ops {
            st.step(target, program, op)?;
        }
        let ns = t.elapsed().as_nanos();
        steady_ns += ns;
        passes_ns.push(ns as f64 / per_line);
        st.release_all(target, program)?;
        // This pass's calls, the release after it included (as the mean below counts them).
        let now = target.driver_calls().map(|(n, _)| n);
        if let (Some(v), Some(before), Some(after)) = (passes_calls.as_mut(), last, now) {
            v.push(after.saturating_sub(before));
        }
        last = now;
    }
    let steady = (passes > 1).then(|| steady_ns as f64 / (per_line * (passes - 1) as f64));
    // Driver calls per steady pass (the releases between passes included: they are frees,
    // which unmap nothing without empty_cache).
    let calls = match (calls_before, target.driver_calls()) {
        (Some(before), Some((after, _))) if passes > 1 => {
            Some(after.saturating_sub(before) as f64 / (passes - 1) as f64)
        }
        _ => None,
    };
    Ok(Timed {
        first_ns: first,
        steady_ns: steady,
        steady_calls: calls,
        passes_ns,
        passes_calls: passes_calls.filter(|_| passes > 1),
    })
}

//! Will a job fit on a GPU: the smallest device memory on which a trace replays without an
//! out-of-memory error, under each allocator policy, found by replaying it.
//!
//! The one rule: every answer is a replay. The capacity the allocator may reserve is searched by
//! bisection in steps of [`GRANULE`] (2 MiB: every segment PyTorch's allocator asks the device
//! for is a multiple of it, rule 4, so a capacity between two steps behaves as the step below
//! it); each probe replays the whole program on a simulated device of that capacity, through
//! the allocator's own out-of-memory path (free the cached blocks, retry — rule 7), and fits
//! when no allocation failed. The answer is checked at both ends: it fits at the capacity
//! found and fails one step below.
//!
//! # The device and what the allocator may use
//!
//! A card of `T` bytes does not give the allocator `T` bytes: the CUDA context and the
//! libraries (cuBLAS, cuDNN kernels and handles) live outside it — the *reserve*, measured on
//! an H200 for PyTorch and kept in `results/fit/reserve.json` ([`default_reserve`]). With a
//! memory fraction `f` (`torch.cuda.set_per_process_memory_fraction`) the allocator's reserved
//! bytes are also capped at `⌊f × T⌋`. The allocator may use `U = min(T − reserve, ⌊f × T⌋)`
//! ([`usable_bytes`]), and the smallest card is the smallest `T` whose `U` reaches the smallest
//! capacity found ([`min_device_bytes`]).
//!
//! Two [`Limit`]s model how `U` stops the allocator. On a card, a device allocation fails when
//! it does not fit in what is left ([`Limit::Device`]: a simulated device of `U` bytes). Under
//! a memory fraction, the allocator refuses a new segment when reserved bytes plus the
//! segment's size (rule 4's, also under expandable segments) would pass the cap, before asking
//! the device ([`Limit::Fraction`]: the fraction set on a simulated device of the full size,
//! what the GPU check runs). Under PyTorch's defaults the two are the same test; under
//! expandable segments the fraction's is the stricter, since a range maps pages, not whole
//! segments. When the trace's settings carry a memory fraction, the device model keeps a fraction
//! of 1.0 over `U` (garbage collection, rule 12, runs only when a fraction is set).
//!
//! # Policies
//!
//! [`POLICIES`] is the one table of the policies `cachalot fit` tries; a policy is a name, a
//! label, and the settings it makes from the trace's recorded ones. Adding one is one line.
//!
//! # Caveat
//!
//! Bisection assumes that a capacity that fits stays fitting when it grows. A caching
//! allocator can break that (a larger device keeps more cached blocks, places later ones
//! elsewhere and may split worse); the search reports the smallest capacity *it found* with a
//! failure one step below, not a proof that no smaller capacity fits.

use cachalot::{Settings, SettingsError};
use serde::Serialize;

use crate::replay::engine::ReplayError;
use crate::replay::interpret::Executed;
use crate::replay::program::ReplayProgram;
use crate::replay::start::StartMode;
use crate::replay::step::Stepper;

/// The step of the capacity search: 2 MiB, the granularity of every device allocation the
/// allocator makes (small segments are 2 MiB, large ones a multiple of 2 MiB, rule 4).
pub const GRANULE: u64 = 2 << 20;

/// The most memory a search tries when the trace's own device is not enough: 4 TiB.
pub const CEILING: u64 = 4 << 40;

/// A policy `cachalot fit` tries: its settings, made from the trace's recorded ones.
#[derive(Clone, Copy, Debug)]
pub struct Policy {
    /// A short name (`--policy NAME`, the JSON's `name`).
    pub name: &'static str,
    /// What it is, for people.
    pub label: &'static str,
    /// The settings, from the trace's recorded settings (PyTorch's defaults, the trace's
    /// PYTORCH_CUDA_ALLOC_CONF and memory fraction).
    pub settings: fn(&Settings) -> Result<Settings, SettingsError>,
}

/// The policies `cachalot fit` tries, in the order it prints them; the first is what the
/// recorded program ran under, and decides the exit code of a verdict.
pub const POLICIES: &[Policy] = &[
    Policy {
        name: "pytorch",
        label: "PyTorch's defaults (+ the trace's recorded settings)",
        settings: |recorded| Ok(recorded.clone()),
    },
    Policy {
        name: "expandable",
        label: "expandable segments (the recorded settings + expandable_segments:True)",
        settings: |recorded| recorded.apply("expandable_segments:True"),
    },
    Policy {
        name: "cachalot",
        label: "cachalot's policy (Settings::cachalot(); rules 20 and 21: expandable segments, 2 MiB pages, reclaim before growing)",
        settings: |recorded| {
            let mut s = Settings::cachalot();
            s.per_process_memory_fraction = recorded.per_process_memory_fraction;
            Ok(s)
        },
    },
];

/// The policy named `name`.
pub fn policy(name: &str) -> Option<&'static Policy> {
    POLICIES.iter().find(|p| p.name == name)
}

/// How the capacity searched for stops the allocator (see the module's documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Limit {
    /// A card whose free memory is the capacity: a device allocation that does not fit fails.
    Device,
    /// A memory fraction on a device of `total` bytes that lets the allocator reserve the
    /// capacity (`torch.cuda.set_per_process_memory_fraction`, rule 16).
    Fraction {
        /// The device's total memory.
        total: u64,
    },
}

/// One program to fit: what to replay and how.
#[derive(Clone, Debug)]
pub struct Problem<'a> {
    /// The program.
    pub program: &'a ReplayProgram,
    /// The settings, without a memory fraction (the fraction is part of the limit).
    pub settings: Settings,
    /// Whether the job sets a memory fraction (then garbage collection, rule 12, is on when its
    /// threshold is set, and the device model keeps a fraction of 1.0).
    pub fraction_set: bool,
    /// What the replay starts from.
    pub start: StartMode,
    /// How the capacity stops the allocator.
    pub limit: Limit,
}

impl Problem<'_> {
    /// The settings and simulated device size of a probe at `capacity`.
    fn probe(&self, capacity: u64) -> (Settings, u64) {
        let mut settings = self.settings.clone();
        match self.limit {
            Limit::Device => {
                settings.per_process_memory_fraction = self.fraction_set.then_some(1.0);
                (settings, capacity)
            }
            Limit::Fraction { total } => {
                settings.per_process_memory_fraction = Some(fraction_for(capacity, total));
                (settings, total)
            }
        }
    }
}

/// The memory fraction that caps reserved bytes at `capacity` on a device of `total` bytes:
/// the smallest `f` with `⌊f × total⌋ ≥ capacity` (computed in doubles, as PyTorch and the
/// allocator compute the cap), at most 1.
pub fn fraction_for(capacity: u64, total: u64) -> f64 {
    if total == 0 || capacity >= total {
        return 1.0;
    }
    let mut f = capacity as f64 / total as f64;
    while ((f * total as f64) as u64) < capacity && f < 1.0 {
        f = f.next_up();
    }
    while f > 0.0 && ((f.next_down() * total as f64) as u64) >= capacity {
        f = f.next_down();
    }
    f.min(1.0)
}

/// One replay at one capacity.
#[derive(Clone, Debug, Serialize)]
pub struct Attempt {
    /// The bytes the allocator could reserve.
    pub capacity: u64,
    /// No allocation failed.
    pub fits: bool,
    /// Allocations that failed (counted up to the first when the probe stopped there).
    pub ooms: u64,
    /// The operation index of the first allocation of the trace that failed.
    pub first_failure: Option<usize>,
    /// An allocation of the start failed: the tensors live when recording began did not fit
    /// (the start is set up before the trace's first operation).
    pub start_failed: bool,
    /// Peak reserved bytes (up to where the replay stopped).
    pub peak_reserved_bytes: u64,
    /// Peak allocated bytes (up to where the replay stopped).
    pub peak_allocated_bytes: u64,
}

/// Replays `problem` at `capacity`; with `stop_early` it stops at the first failed allocation.
pub fn attempt(problem: &Problem, capacity: u64, stop_early: bool) -> Result<Attempt, ReplayError> {
    let (settings, device) = problem.probe(capacity);
    let mut s = Stepper::new(problem.program, settings, device, problem.start)?;
    let start_failed = s.stats().num_ooms > 0;
    let mut first_failure = None;
    while !(start_failed && stop_early)
        && let Some(done) = s.step()?
    {
        if done == Executed::AllocationFailed && first_failure.is_none() {
            first_failure = Some(s.position() - 1);
            if stop_early {
                break;
            }
        }
    }
    let stats = s.stats();
    Ok(Attempt {
        capacity,
        fits: stats.num_ooms == 0,
        ooms: stats.num_ooms,
        first_failure,
        start_failed,
        peak_reserved_bytes: stats.reserved_bytes.all.peak as u64,
        peak_allocated_bytes: stats.allocated_bytes.all.peak as u64,
    })
}

/// What a capacity search found.
#[derive(Clone, Debug, Serialize)]
pub struct Search {
    /// The smallest capacity found on which the program runs without an out-of-memory error, a
    /// multiple of [`GRANULE`]; `None` when it fails even at [`CEILING`].
    pub min_capacity: Option<u64>,
    /// The replay without a tight limit (at the `roomy` capacity the search began with, or
    /// at [`CEILING`] when that failed).
    pub unconstrained: Attempt,
    /// The full replay at [`Search::min_capacity`].
    pub at_min: Option<Attempt>,
    /// The full replay one [`GRANULE`] below it (fails, by construction).
    pub below: Option<Attempt>,
    /// Replays the search made.
    pub replays: usize,
}

/// Finds the smallest capacity (a multiple of [`GRANULE`]) on which `problem` replays without
/// an out-of-memory error, starting from a `roomy` capacity (the recording GPU's memory).
pub fn search(problem: &Problem, roomy: u64) -> Result<Search, ReplayError> {
    let mut replays = 1;
    let mut unconstrained = attempt(problem, roomy, false)?;
    if !unconstrained.fits && roomy < CEILING {
        replays += 1;
        unconstrained = attempt(problem, CEILING, false)?;
    }
    if !unconstrained.fits {
        return Ok(Search {
            min_capacity: None,
            unconstrained,
            at_min: None,
            below: None,
            replays,
        });
    }
    // At its own peak the replay makes the same decisions as without a limit: every device
    // allocation it made fitted under that peak.
    let mut hi = unconstrained.peak_reserved_bytes.div_ceil(GRANULE) * GRANULE;
    let mut lo: Option<u64> = None;
    if hi > 0 {
        replays += 1;
        if !attempt(problem, hi, true)?.fits {
            // Not monotone at the top (a limit changed a decision): fall back to the roomy end.
            hi = unconstrained.capacity.div_ceil(GRANULE) * GRANULE;
        }
    }
    // Invariant: fits(hi); fails(lo) when lo is known (capacity 0 fails unless nothing is
    // ever reserved).
    loop {
        let low = lo.map_or(0, |l| l + GRANULE);
        if low >= hi {
            break;
        }
        let mid = low + (hi - low) / GRANULE / 2 * GRANULE;
        replays += 1;
        if attempt(problem, mid, true)?.fits {
            hi = mid;
        } else {
            lo = Some(mid);
        }
    }
    replays += 2;
    let at_min = attempt(problem, hi, false)?;
    let below = match hi.checked_sub(GRANULE) {
        Some(b) => Some(attempt(problem, b, false)?),
        None => None,
    };
    Ok(Search {
        min_capacity: Some(hi),
        unconstrained,
        at_min: Some(at_min),
        below,
        replays,
    })
}

/// The bytes the allocator may reserve on a device of `total` bytes with `reserve` bytes held
/// outside it, under an optional memory fraction: `min(total − reserve, ⌊f × total⌋)`.
pub fn usable_bytes(total: u64, reserve: u64, fraction: Option<f64>) -> u64 {
    let physical = total.saturating_sub(reserve);
    match fraction {
        Some(f) => physical.min((f * total as f64) as u64),
        None => physical,
    }
}

/// The smallest device total whose [`usable_bytes`] reach `capacity`; `None` when no device
/// can (a fraction of 0).
pub fn min_device_bytes(capacity: u64, reserve: u64, fraction: Option<f64>) -> Option<u64> {
    let mut total = capacity.checked_add(reserve)?;
    if let Some(f) = fraction {
        if f <= 0.0 {
            return (capacity == 0).then_some(total);
        }
        total = total.max((capacity as f64 / f).ceil() as u64);
        // The cap is computed in doubles: step over the last rounding.
        let mut steps = 0;
        while usable_bytes(total, reserve, fraction) < capacity {
            total = total.checked_add(1 + total / (1 << 40))?;
            steps += 1;
            if steps > 1 << 20 {
                return None;
            }
        }
    }
    Some(total)
}

/// How much device memory PyTorch holds outside its caching allocator, by default: the
/// `reserve` of `results/fit/reserve.json` (compiled in).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Reserve {
    /// Bytes.
    pub bytes: u64,
    /// Whether the figure is a provisional estimate rather than a measurement.
    pub provisional: bool,
    /// Where it comes from.
    pub source: String,
}

/// The file the default reserve is read from, compiled into the program.
const RESERVE_FILE: &str = include_str!("../results/fit/reserve.json");

/// The default reserve (see [`Reserve`]): the measured figure of `results/fit/reserve.json`,
/// or 1 GiB marked provisional if that file could not be read.
pub fn default_reserve() -> Reserve {
    #[derive(serde::Deserialize)]
    struct File {
        reserve: u64,
        #[serde(default)]
        provisional: bool,
        gpu_name: Option<String>,
        measured_utc: Option<String>,
    }
    match serde_json::from_str::<File>(RESERVE_FILE) {
        Ok(f) => Reserve {
            bytes: f.reserve,
            provisional: f.provisional,
            source: match (f.provisional, f.gpu_name, f.measured_utc) {
                (false, Some(gpu), Some(when)) => {
                    format!("measured on {gpu} ({when}), results/fit/reserve.json")
                }
                _ => "results/fit/reserve.json (provisional: not yet measured on the H200)"
                    .to_string(),
            },
        },
        Err(_) => Reserve {
            bytes: 1 << 30,
            provisional: true,
            source: "built-in estimate (results/fit/reserve.json unreadable)".to_string(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::program::ReplayOp;

    /// Three 30 MiB tensors live at once, then one 50 MiB after the first two are freed: the
    /// 50 MiB needs its own segment unless the cache is released (rule 7d).
    fn program() -> ReplayProgram {
        let mib = 1 << 20;
        let ops = vec![
            ReplayOp::Alloc {
                id: 0,
                size: 30 * mib,
                stream: 0,
            },
            ReplayOp::Alloc {
                id: 1,
                size: 30 * mib,
                stream: 0,
            },
            ReplayOp::Alloc {
                id: 2,
                size: 30 * mib,
                stream: 0,
            },
            ReplayOp::FreeRequested { id: 0 },
            ReplayOp::FreeCompleted { id: 0 },
            ReplayOp::FreeRequested { id: 1 },
            ReplayOp::FreeCompleted { id: 1 },
            ReplayOp::Alloc {
                id: 3,
                size: 50 * mib,
                stream: 0,
            },
        ];
        ReplayProgram {
            ops,
            ..ReplayProgram::default()
        }
    }

    fn problem(program: &ReplayProgram, limit: Limit) -> Problem<'_> {
        Problem {
            program,
            settings: Settings::pytorch(),
            fraction_set: false,
            start: StartMode::Exact,
            limit,
        }
    }

    #[test]
    fn the_smallest_capacity_is_what_the_retry_path_needs_and_one_step_less_fails() {
        let program = program();
        let p = problem(&program, Limit::Device);
        let found = search(&p, 1 << 30).unwrap();
        // Unconstrained: 3 × 30 MiB segments + a 50 MiB one = 140 MiB. Under a limit, the
        // 50 MiB request frees the two cached 30 MiB segments and retries (30 + 50 = 80 MiB),
        // so the three live 30 MiB tensors (90 MiB) are what the job needs.
        assert_eq!(found.unconstrained.peak_reserved_bytes, 140 << 20);
        assert_eq!(found.min_capacity, Some(90 << 20));
        let below = found.below.unwrap();
        assert!(!below.fits);
        assert_eq!(below.first_failure, Some(2));
        assert!(found.at_min.unwrap().fits);
    }

    #[test]
    fn a_memory_fraction_on_a_large_device_gives_the_same_capacity_under_pytorchs_defaults() {
        let program = program();
        let device = search(&problem(&program, Limit::Device), 1 << 30).unwrap();
        let fraction = search(
            &problem(
                &program,
                Limit::Fraction {
                    total: 150_109_880_320,
                },
            ),
            150_109_880_320,
        )
        .unwrap();
        assert_eq!(device.min_capacity, fraction.min_capacity);
    }

    #[test]
    fn the_fraction_for_a_capacity_caps_at_exactly_that_capacity() {
        let total = 150_109_880_320u64;
        for capacity in [2 << 20, 80 << 20, 411_041_792, 2_122_317_824, total - 1] {
            let f = fraction_for(capacity, total);
            assert_eq!((f * total as f64) as u64, capacity, "capacity {capacity}");
        }
        assert_eq!(fraction_for(total, total), 1.0);
    }

    #[test]
    fn the_device_needs_the_reserve_on_top_and_a_fraction_can_ask_for_more() {
        assert_eq!(min_device_bytes(100, 20, None), Some(120));
        assert_eq!(usable_bytes(120, 20, None), 100);
        // Half the device: 200 bytes give the allocator 100.
        let t = min_device_bytes(100, 20, Some(0.5)).unwrap();
        assert_eq!(t, 200);
        assert_eq!(usable_bytes(t, 20, Some(0.5)), 100);
        assert!(usable_bytes(t - 1, 20, Some(0.5)) < 100);
        assert_eq!(min_device_bytes(100, 20, Some(0.0)), None);
    }

    #[test]
    fn the_compiled_in_reserve_reads() {
        let r = default_reserve();
        assert!(r.bytes > 0);
        assert!(!r.source.contains("unreadable"), "{}", r.source);
    }

    #[test]
    fn every_policy_makes_settings_from_pytorchs_defaults() {
        assert_eq!(POLICIES[0].name, "pytorch");
        for p in POLICIES {
            assert!((p.settings)(&Settings::pytorch()).is_ok(), "{}", p.name);
        }
        assert!(
            (policy("expandable").unwrap().settings)(&Settings::pytorch())
                .unwrap()
                .expandable_segments
        );
    }
}

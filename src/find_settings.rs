//! Where a program changed its allocator settings (`torch.cuda.memory._set_allocator_settings`,
//! rule 24). No trace entry records the call and the snapshot holds only the settings in force
//! at the dump, so a trace whose walk back to the start fails under them is searched: for each
//! trace entry `K` where the change could have happened (before each `alloc`, and at the end),
//! the start is walked back with blocks allocated before `K` rounded by the settings before the
//! change and later ones by the recorded settings, and the trace is replayed under the first
//! with the change made at `K`. The entries whose replay gives the trace's device allocations
//! and frees and ends in the dump, block for block, are the answer.

use cachalot::Settings;

use crate::replay::engine::{ReplayConfig, replay};
use crate::replay::program::{ReplayOptions, ReplayProgram, RuntimeSettings, replay_ops_from};
use crate::replay::start::{
    PYTORCH_LARGE_PAGE, StartMode, StartState, private_segments, reconstruct_start_changed,
};
use crate::selfcheck::check_final_state;
use crate::snapshot::{Action, Snapshot};

/// The most candidate entries one search tries: beyond it they are sampled evenly.
pub const MAX_CANDIDATES: usize = 4000;
/// The most trace entries a search walks and replays in all (candidates × entries): a long
/// trace gets fewer candidates (at least [`MIN_CANDIDATES`]), so the search stays within
/// seconds.
pub const MAX_WORK: usize = 200_000_000;
/// The fewest candidates a long trace's search samples.
pub const MIN_CANDIDATES: usize = 50;

/// A settings change found in a trace.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct FoundChange {
    /// The first trace entry at which the change reproduces the trace and the dump.
    pub first_entry: usize,
    /// The last such entry of the same run of candidates: the change happened in
    /// `first_entry..=last_entry` (between the allocations before and after).
    pub last_entry: usize,
    /// The configuration in force before (the start's: PyTorch's defaults for the run-time
    /// keys, or what the program's environment set).
    pub from: String,
    /// The configuration in force after (the recorded one).
    pub to: String,
    /// Replays made.
    pub replays: usize,
    /// The start walked back under the change (at `first_entry`).
    #[serde(skip)]
    pub start: StartState,
    /// The program with the change at `first_entry`.
    #[serde(skip)]
    pub program: ReplayProgram,
}

/// Searches `snapshot`'s trace of `device` for the entry at which the settings changed from
/// `before` to `after` (`settings` is the replay's, with `before` in force). `None` when no
/// candidate reproduces the trace and the dump.
pub fn find_change(
    snapshot: &Snapshot,
    device: usize,
    settings: &Settings,
    capacity: u64,
    before: &RuntimeSettings,
    after: &RuntimeSettings,
) -> Option<FoundChange> {
    let trace = snapshot.traces.iter().find(|t| t.device == device)?;
    let entries = &trace.entries;
    let mut candidates: Vec<usize> = entries
        .iter()
        .enumerate()
        .filter(|(_, e)| e.action == Action::Alloc)
        .map(|(i, _)| i)
        .chain(std::iter::once(entries.len()))
        .collect();
    let most = MAX_CANDIDATES.min((MAX_WORK / entries.len().max(1)).max(MIN_CANDIDATES));
    if candidates.len() > most {
        let step = candidates.len().div_ceil(most);
        candidates = candidates.into_iter().step_by(step).collect();
    }
    search(
        snapshot,
        device,
        settings,
        capacity,
        before,
        after,
        &candidates,
    )
}

/// [`find_change`] for a change the user says happened at trace entry `entry` (`None` when it
/// does not reproduce the trace and the dump, or there is no such entry).
pub fn find_change_at(
    snapshot: &Snapshot,
    device: usize,
    settings: &Settings,
    capacity: u64,
    before: &RuntimeSettings,
    after: &RuntimeSettings,
    entry: usize,
) -> Option<FoundChange> {
    search(
        snapshot,
        device,
        settings,
        capacity,
        before,
        after,
        &[entry],
    )
}

fn search(
    snapshot: &Snapshot,
    device: usize,
    settings: &Settings,
    capacity: u64,
    before: &RuntimeSettings,
    after: &RuntimeSettings,
    candidates: &[usize],
) -> Option<FoundChange> {
    let trace = snapshot.traces.iter().find(|t| t.device == device)?;
    let entries = &trace.entries;
    let target_allocs = entries
        .iter()
        .filter(|e| matches!(e.action, Action::SegmentAlloc | Action::SegmentMap))
        .count() as u64;
    let target_frees = entries
        .iter()
        .filter(|e| matches!(e.action, Action::SegmentFree | Action::SegmentUnmap))
        .count() as u64;
    let options = ReplayOptions::from_settings(snapshot.allocator_settings.as_ref());
    let config = ReplayConfig {
        settings: before.applied_to(settings),
        capacity,
        trace_addresses: true,
        repeat: 1,
        timeline: false,
        record_history: false,
        start: StartMode::Exact,
    };
    let mut replays = 0usize;
    let mut found: Option<FoundChange> = None;
    for &k in candidates.iter().filter(|&&k| k <= entries.len()) {
        let attempt = (|| {
            let mut start = reconstruct_start_changed(
                trace,
                &snapshot.segments,
                &before.roundup_power2_divisions,
                &after.roundup_power2_divisions,
                k,
                PYTORCH_LARGE_PAGE,
            )
            .ok()?;
            start.private_segments = private_segments(&snapshot.segments, device);
            let (program, _) = replay_ops_from(trace, &options, &start);
            let program = program.with_settings_change(k, after.clone());
            replays += 1;
            let out = replay(&program, &config).ok()?;
            (out.device_allocs == target_allocs
                && out.device_frees == target_frees
                && check_final_state(&out.final_layout, snapshot, device).matches)
                .then_some((start, program))
        })();
        match (attempt, found.as_mut()) {
            (Some((start, program)), None) => {
                found = Some(FoundChange {
                    first_entry: k,
                    last_entry: k,
                    from: before.conf.clone(),
                    to: after.conf.clone(),
                    replays: 0,
                    start,
                    program,
                });
            }
            (Some(_), Some(f)) => f.last_entry = k,
            // The first run of candidates that reproduce the trace is the answer.
            (None, Some(_)) => break,
            (None, None) => {}
        }
    }
    found.map(|f| FoundChange { replays, ..f })
}

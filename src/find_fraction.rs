//! Finding the memory fraction a program set at run time.
//!
//! `torch.cuda.set_per_process_memory_fraction` is a call in the program, not a setting: a
//! snapshot records `PYTORCH_CUDA_ALLOC_CONF` but not the fraction. Under a fraction PyTorch
//! gives cached segments back by itself — the garbage collector above
//! `garbage_collection_threshold × cap` (rule 12), the release and retry at the cap (rule 7d)
//! — and those frees are in the trace with nothing in it to explain them. A replay without the
//! fraction keeps those segments and ends elsewhere.
//!
//! [`find_cap`] finds the cap back: the smallest number of bytes `C` such that the replay
//! capped at `C` (rule 16: a fraction `f` caps reserved bytes at `⌊f × total⌋`) gives back as
//! many segments as the trace and ends in the dumped state, block for block. The number of
//! segments given back falls as the cap grows (a larger cap collects later and retries less),
//! so a binary search over 2 MiB steps between the trace's peak reserved bytes (no smaller cap
//! holds them) and `peak / threshold` (above it the collector never runs; `peak × 4` without
//! a threshold) finds the first cap with no more frees than the trace's, and the caps from
//! there up are tried one by one, a bounded number of them, for one that also ends in the dump.

use cachalot::Settings;

use crate::replay::engine::{ReplayConfig, ReplayOutcome, replay};
use crate::replay::program::ReplayProgram;
use crate::selfcheck::check_final_state;
use crate::snapshot::Snapshot;

/// The granularity of the search: every segment is a multiple of 2 MiB.
const STEP: u64 = 2 << 20;
/// Caps tried one by one above the binary search's answer.
const SCAN: u64 = 48;

/// What [`find_cap`] found.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct FoundCap {
    /// The smallest cap (bytes) under which the replay reproduces the trace's segment frees
    /// and ends in the dump.
    pub cap_bytes: u64,
    /// The segments the trace gives back (and the replay under that cap).
    pub device_frees: u64,
    /// Replays made.
    pub replays: usize,
}

/// The trace's segment frees: `segment_free` and `segment_unmap` entries of `device`.
pub fn trace_device_frees(snapshot: &Snapshot, device: usize) -> u64 {
    snapshot
        .traces
        .iter()
        .filter(|t| t.device == device)
        .flat_map(|t| &t.entries)
        .filter(|e| {
            matches!(
                e.action,
                crate::snapshot::Action::SegmentFree | crate::snapshot::Action::SegmentUnmap
            )
        })
        .count() as u64
}

/// The most bytes the trace of `device` holds reserved, from `start` bytes at its first entry.
pub fn trace_peak_reserved(snapshot: &Snapshot, device: usize, start: u64) -> u64 {
    use crate::snapshot::Action;
    let mut reserved = i128::from(start);
    let mut peak = reserved;
    for e in snapshot
        .traces
        .iter()
        .filter(|t| t.device == device)
        .flat_map(|t| &t.entries)
    {
        match e.action {
            Action::SegmentAlloc | Action::SegmentMap => reserved += i128::from(e.size),
            Action::SegmentFree | Action::SegmentUnmap => reserved -= i128::from(e.size),
            _ => {}
        }
        peak = peak.max(reserved);
    }
    peak.max(0) as u64
}

/// Searches the cap (see the module's documentation) for `program` of `snapshot`'s `device`
/// replayed under `config` (its fraction is replaced; `config.capacity` is the device's total
/// memory). `None` when no cap in the range reproduces the trace.
pub fn find_cap(
    program: &ReplayProgram,
    snapshot: &Snapshot,
    device: usize,
    config: &ReplayConfig,
) -> Option<FoundCap> {
    let target = trace_device_frees(snapshot, device);
    let total = config.capacity.max(1);
    let mut replays = 0usize;
    let mut run = |cap: u64| -> Option<ReplayOutcome> {
        replays += 1;
        let mut settings: Settings = config.settings.clone();
        settings.per_process_memory_fraction = Some((cap as f64 / total as f64).min(1.0));
        // ⌊f × total⌋ must give `cap` back: nudge f up by the rounding it loses.
        let mut f = cap as f64 / total as f64;
        while ((f * total as f64) as u64) < cap && f < 1.0 {
            f = f64::from_bits(f.to_bits() + 1);
        }
        settings.per_process_memory_fraction = Some(f.min(1.0));
        let cfg = ReplayConfig {
            settings,
            timeline: false,
            record_history: false,
            repeat: 1,
            ..config.clone()
        };
        replay(program, &cfg).ok()
    };
    // The trace's peak reserved bytes, counted from the start it was replayed from.
    let peak = trace_peak_reserved(snapshot, device, program.start.reserved_bytes());
    let lo = peak.div_ceil(STEP) * STEP;
    let threshold = config.settings.garbage_collection_threshold;
    let hi = if threshold > 0.0 {
        ((peak as f64 / threshold) as u64).div_ceil(STEP) * STEP + STEP
    } else {
        peak.saturating_mul(4)
    }
    .min(total);
    if lo > hi {
        return None;
    }
    // The first cap (in STEPs from lo) whose replay gives back no more than the trace.
    let (mut a, mut b) = (0u64, (hi - lo) / STEP);
    while a < b {
        let m = a + (b - a) / 2;
        match run(lo + m * STEP) {
            Some(out) if out.device_frees <= target => b = m,
            _ => a = m + 1,
        }
    }
    for k in 0..SCAN {
        let cap = lo + (a + k) * STEP;
        if cap > hi {
            break;
        }
        let Some(out) = run(cap) else { continue };
        if out.device_frees < target {
            break;
        }
        if out.device_frees == target
            && check_final_state(&out.final_layout, snapshot, device).matches
        {
            return Some(FoundCap {
                cap_bytes: cap,
                device_frees: target,
                replays,
            });
        }
    }
    None
}

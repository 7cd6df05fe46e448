//! Every committed PyTorch trace runs through the reference model too: each device's replay
//! program (`tests/fixtures/traces/`, `derived/`, `user/`), interpreted by the product's own
//! replay interpreter — the start adopted when it can be rebuilt, each `segment_alloc` address
//! offered for the operation during which PyTorch made it — on the allocator core and the model
//! side by side, under the settings it was recorded with, compared after every operation, and
//! ending with both giving every byte back; and again under other settings on a device just
//! larger than PyTorch's peak, where splitting limits, rounding, garbage collection and
//! out-of-memory retries all act.

use std::path::{Path, PathBuf};

use cachalot::Settings;
use cachalot_harness::fixtures::recorded_settings;
use cachalot_harness::replay::{Replayed, replay_side_by_side};
use cachalot_harness::scenario::Knobs;
use cachalot_tools::replay::{SnapshotExt, StartMode};
use cachalot_tools::snapshot::{read_figures_for, read_snapshot};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

/// The files of `tests/fixtures/<dir>/` whose names end with `suffix`, sorted.
fn files(dir: &str, suffix: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(fixtures().join(dir))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(suffix))
        .collect();
    out.sort();
    out
}

/// The figures sidecar of a fixture: `NAME.json` beside it, or for a derived re-encoding
/// (`NAME.protoN.pickle`) the original trace's.
fn sidecar(pickle: &Path) -> Option<PathBuf> {
    let name = pickle.file_name()?.to_string_lossy().to_string();
    let stem = name.split('.').next()?;
    let beside = pickle.with_file_name(format!("{stem}.json"));
    let original = fixtures().join("traces").join(format!("{stem}.json"));
    [beside, original].into_iter().find(|p| p.is_file())
}

/// Replays every device of `pickle` side by side, under its recorded settings or, with
/// `squeeze`, under other ones on a device just larger than PyTorch's peak (then starting
/// from the live tensors, placed by that policy, as `cachalot replay --config` does).
fn replay_fixture_with(pickle: &Path, squeeze: Option<&str>) -> Result<Vec<Replayed>, String> {
    let snapshot = read_snapshot(pickle).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for (device, program) in snapshot.replay_programs() {
        let figures = sidecar(pickle).and_then(|p| read_figures_for(&p, device).ok());
        let (settings, capacity) = recorded_settings(&snapshot, figures.as_ref())?;
        let (knobs, start) = match squeeze {
            None => (Knobs::from_settings(&settings, capacity)?, StartMode::Exact),
            Some(conf) => {
                let mut settings = Settings::pytorch()
                    .apply(conf)
                    .map_err(|e| format!("settings {conf:?}: {e}"))?;
                settings.per_process_memory_fraction = Some(0.8);
                let peak = figures.as_ref().map_or(1 << 30, |f| f.max_memory_reserved);
                (
                    Knobs::from_settings(&settings, peak / 4 * 5)?,
                    StartMode::LiveTensors,
                )
            }
        };
        out.push(
            replay_side_by_side(&program, &knobs, start)
                .map_err(|e| format!("device {device}: {e}"))?,
        );
    }
    Ok(out)
}

fn replay_all(dir: &str, suffix: &str) -> Vec<Replayed> {
    replay_all_with(dir, suffix, None, |_| true)
}

fn replay_all_with(
    dir: &str,
    suffix: &str,
    squeeze: Option<&str>,
    keep: impl Fn(&Path) -> bool,
) -> Vec<Replayed> {
    let mut failures = Vec::new();
    let mut all = Vec::new();
    let paths = files(dir, suffix);
    assert!(!paths.is_empty(), "no fixtures in tests/fixtures/{dir}");
    for pickle in paths.iter().filter(|p| keep(p)) {
        match replay_fixture_with(pickle, squeeze) {
            Ok(r) => all.extend(r),
            Err(e) => failures.push(format!("{}: {e}", pickle.display())),
        }
    }
    assert!(
        failures.is_empty(),
        "{} fixtures disagree:\n{}",
        failures.len(),
        failures.join("\n")
    );
    all
}

#[test]
fn every_recorded_trace_agrees_with_the_model_after_every_operation() {
    let r = replay_all("traces", ".pickle");
    assert!(r.len() >= 10, "{} programs", r.len());
    assert!(r.iter().map(|r| r.ops).sum::<usize>() > 40_000);
    // fraction_oom_retry: the out-of-memory path runs on both sides.
    assert!(r.iter().any(|r| r.out_of_memory > 0), "no out-of-memory");
}

#[test]
fn every_derived_trace_agrees_with_the_model_after_every_operation() {
    let r = replay_all("derived", ".pickle");
    assert!(r.len() >= 9, "{} programs", r.len());
}

#[test]
fn every_user_snapshot_agrees_with_the_model_from_its_adopted_start() {
    let r = replay_all("user", ".pickle.gz");
    assert!(r.len() >= 6, "{} programs", r.len());
    // resnet50_warm, unet_wrapped and lstm_expandable_warm (ranges of expandable segments,
    // rule 18f) were recorded mid-run: they start from the state PyTorch held, adopted.
    let adopted = r.iter().filter(|r| r.adopted > 0).count();
    assert!(
        adopted >= 3,
        "{adopted} programs started from an adopted state"
    );
}

#[test]
fn every_expandable_recording_agrees_with_the_model_from_its_adopted_ranges() {
    let mut r = replay_all("expandable", ".pickle");
    r.extend(replay_all("expandable", ".pickle.gz"));
    assert!(r.len() >= 12, "{} programs", r.len());
    // resnet50_warm_expandable and unet_wrapped_expandable were recorded mid-run: they start
    // from the ranges PyTorch held, adopted (rule 18f).
    let adopted = r.iter().filter(|r| r.adopted > 0).count();
    assert!(
        adopted >= 2,
        "{adopted} programs started from adopted ranges"
    );
}

/// Other settings, on a device just larger than PyTorch's peak with a memory fraction of 0.8:
/// splitting limits, rounding and garbage collection all act, and allocations fail and retry.
const SQUEEZE: &str =
    "max_split_size_mb:64,roundup_power2_divisions:4,garbage_collection_threshold:0.6";

#[test]
fn recorded_traces_agree_with_the_model_under_other_settings_on_a_tight_device() {
    let mut r = replay_all_with("traces", ".pickle", Some(SQUEEZE), |_| true);
    // Mid-run snapshots start from their live tensors; the 39 MB one is left to the test above.
    r.extend(replay_all_with("user", ".pickle.gz", Some(SQUEEZE), |p| {
        !p.to_string_lossy().contains("gpt2_generate_large")
    }));
    assert!(r.iter().map(|r| r.ops).sum::<usize>() > 40_000);
    let failing = r.iter().filter(|r| r.out_of_memory > 0).count();
    assert!(failing >= 3, "{failing} programs ran out of memory");
}

//! The committed traces as the model-only measurements read them (`examples/stitching_passes`,
//! `examples/handle_passes`): each device's replay program of a snapshot under
//! `tests/fixtures/`, with the settings and device it was recorded with (its `NAME.json`
//! sidecar when there is one, else the snapshot's own allocator settings).

use std::path::{Path, PathBuf};

use cachalot::Settings;
use cachalot_tools::replay::{H200_MEMORY, ReplayProgram, SnapshotExt};
use cachalot_tools::snapshot::{Figures, Snapshot, read_figures_for, read_snapshot};

use crate::scenario::Knobs;

/// `tests/fixtures/` of the repository.
pub fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

/// The files of `tests/fixtures/<dir>/` whose names end with `suffix`, sorted.
pub fn fixture_files(dir: &str, suffix: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(fixtures_dir().join(dir))
        .expect("the fixtures directory")
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.to_string_lossy().ends_with(suffix))
        .collect();
    out.sort();
    out
}

/// Every committed snapshot (`traces/*.pickle`, `user/*.pickle.gz`) whose file name contains
/// one of `filters` (all of them when there is none).
pub fn committed_snapshots(filters: &[String]) -> Vec<PathBuf> {
    let mut paths = fixture_files("traces", ".pickle");
    paths.extend(fixture_files("user", ".pickle.gz"));
    paths.retain(|p| {
        let name = p.file_name().map(|n| n.to_string_lossy().to_string());
        filters.is_empty()
            || filters
                .iter()
                .any(|f| name.as_ref().is_some_and(|n| n.contains(f.as_str())))
    });
    paths
}

/// `NAME.json` beside `NAME.pickle` (or `NAME.pickle.gz`).
pub fn sidecar(pickle: &Path) -> Option<PathBuf> {
    let name = pickle.file_name()?.to_string_lossy().to_string();
    let stem = name.split('.').next()?;
    Some(pickle.with_file_name(format!("{stem}.json"))).filter(|p| p.is_file())
}

/// The settings a snapshot's device was recorded with and its memory: the sidecar's
/// `PYTORCH_CUDA_ALLOC_CONF`, memory fraction and device memory when there are `figures`, else
/// the snapshot's own allocator settings on an H200.
pub fn recorded_settings(
    snapshot: &Snapshot,
    figures: Option<&Figures>,
) -> Result<(Settings, u64), String> {
    let conf = match figures {
        Some(f) => f.pytorch_cuda_alloc_conf.clone().unwrap_or_default(),
        None => snapshot
            .allocator_settings
            .as_ref()
            .map(|s| s.alloc_conf.clone())
            .unwrap_or_default(),
    };
    let mut settings = Settings::pytorch()
        .apply(&conf)
        .map_err(|e| format!("settings {conf:?}: {e}"))?;
    settings.per_process_memory_fraction = figures.and_then(|f| f.memory_fraction);
    let capacity = figures.map_or(H200_MEMORY, |f| f.device_total_memory);
    Ok((settings, capacity))
}

/// One device's program of a snapshot, with what it was recorded under.
pub struct Recorded {
    /// The snapshot's stem, with the device when the snapshot has several.
    pub name: String,
    /// The program.
    pub program: ReplayProgram,
    /// The recorded settings, as knobs, on the recorded device's capacity.
    pub knobs: Knobs,
}

/// Every device's program of `pickle`, each with its recorded settings and device.
pub fn recorded_programs(pickle: &Path) -> Result<Vec<Recorded>, String> {
    let snapshot = read_snapshot(pickle).map_err(|e| e.to_string())?;
    let stem = pickle
        .file_name()
        .map(|n| {
            n.to_string_lossy()
                .split('.')
                .next()
                .unwrap_or("")
                .to_string()
        })
        .unwrap_or_default();
    let programs = snapshot.replay_programs();
    let several = programs.len() > 1;
    let mut out = Vec::new();
    for (device, program) in programs {
        let figures = sidecar(pickle).and_then(|p| read_figures_for(&p, device).ok());
        let (settings, capacity) = recorded_settings(&snapshot, figures.as_ref())?;
        let knobs = Knobs::from_settings(&settings, capacity)?;
        let name = if several {
            format!("{stem} (device {device})")
        } else {
            stem.clone()
        };
        out.push(Recorded {
            name,
            program,
            knobs,
        });
    }
    Ok(out)
}

//! Helpers shared by the integration tests of the root package.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use cachalot::Settings;
use cachalot_tools::replay::ReplayConfig;
use cachalot_tools::snapshot::Figures;

/// `tests/fixtures`, relative to the current directory when it is there (cargo runs tests from
/// the package root, and the GPU machine runs them from the repository root), else from the
/// manifest directory.
pub fn fixtures_root() -> PathBuf {
    let rel = Path::new("tests/fixtures");
    if rel.is_dir() {
        rel.to_path_buf()
    } else {
        Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
    }
}

/// `tests/fixtures/traces`: the committed PyTorch traces and their figures.
pub fn traces() -> PathBuf {
    fixtures_root().join("traces")
}

/// The replay configuration a trace was recorded with: PyTorch's defaults, the recorded
/// `PYTORCH_CUDA_ALLOC_CONF` and memory fraction, and the device's memory.
pub fn recorded_config(figures: &Figures) -> ReplayConfig {
    let mut settings = Settings::pytorch();
    if let Some(conf) = &figures.pytorch_cuda_alloc_conf {
        settings = settings.apply(conf).expect("recorded settings parse");
    }
    settings.per_process_memory_fraction = figures.memory_fraction;
    ReplayConfig {
        settings,
        capacity: figures.device_total_memory,
        ..ReplayConfig::pytorch()
    }
}

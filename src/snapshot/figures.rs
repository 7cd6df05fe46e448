//! The JSON sidecar `scripts/record_traces.py` writes next to each recorded snapshot.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::SnapshotError;

/// PyTorch's own figures for a recorded workload (`NAME.json` beside `NAME.pickle`), taken
/// right before the snapshot was dumped: what a replay of the snapshot's trace must reproduce.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Figures {
    /// The workload's name (the file stem).
    pub workload: String,
    /// What the workload did.
    #[serde(default)]
    pub description: String,
    /// The `PYTORCH_CUDA_ALLOC_CONF` the process ran under (`None` when unset).
    pub pytorch_cuda_alloc_conf: Option<String>,
    /// The per-process memory fraction the workload set, if any.
    #[serde(default)]
    pub memory_fraction: Option<f64>,
    /// `torch.__version__`.
    pub torch_version: String,
    /// `torch.version.cuda`.
    #[serde(default)]
    pub cuda_version: Option<String>,
    /// The GPU's name.
    pub gpu_name: String,
    /// The GPU's memory in bytes (`total_memory` of its properties).
    pub device_total_memory: u64,
    /// `torch.cuda.max_memory_allocated()`.
    pub max_memory_allocated: u64,
    /// `torch.cuda.max_memory_reserved()`.
    pub max_memory_reserved: u64,
    /// `torch.cuda.memory_allocated()` at the end.
    pub memory_allocated: u64,
    /// `torch.cuda.memory_reserved()` at the end.
    pub memory_reserved: u64,
    /// `torch.cuda.memory_stats()`, flat keys such as `"reserved_bytes.all.peak"`.
    pub memory_stats: BTreeMap<String, i64>,
    /// Trace entries per action, counted by the recording script from the pickle it wrote.
    #[serde(default)]
    pub trace_action_counts: BTreeMap<String, u64>,
    /// Whether a device trace reached the recording's `max_entries` (then it lacks its start).
    #[serde(default)]
    pub trace_may_be_truncated: bool,
}

impl Figures {
    /// One of [`Figures::memory_stats`], e.g. `stat("num_alloc_retries")`.
    pub fn stat(&self, key: &str) -> Option<i64> {
        self.memory_stats.get(key).copied()
    }
}

/// Reads a figures sidecar (JSON, at most 64 MiB); errors name the file.
pub fn read_figures(path: &Path) -> Result<Figures, SnapshotError> {
    const MAX: u64 = 64 << 20;
    let name = path.display().to_string();
    let io = |source| SnapshotError::Io {
        file: name.clone(),
        source,
    };
    let mut text = Vec::new();
    std::fs::File::open(path)
        .map_err(io)?
        .take(MAX + 1)
        .read_to_end(&mut text)
        .map_err(io)?;
    if text.len() as u64 > MAX {
        return Err(SnapshotError::TooLarge {
            file: name,
            reason: format!("a figures file larger than {MAX} bytes"),
        });
    }
    serde_json::from_slice(&text).map_err(|e| SnapshotError::Figures {
        file: name,
        reason: e.to_string(),
    })
}

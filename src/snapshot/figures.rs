//! The JSON sidecar `scripts/record_traces.py` writes next to each recorded snapshot.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::error::SnapshotError;

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
    /// How the history was recorded (`scripts/record_user_snapshots.py`), when the sidecar
    /// says.
    /// (`scripts/record_traces.py` writes its arguments as a map and always records from the
    /// process's start.)
    #[serde(default)]
    pub record_memory_history: Option<serde_json::Value>,
    /// The last trace entry before PyTorch's peaks were reset, when they were reset in the
    /// middle of the recorded trace (then `max_memory_*` cover only the entries after it).
    #[serde(default)]
    pub reset_after: Option<serde_json::Value>,
}

/// A sidecar of `scripts/record_user_snapshots.py`: the run's facts, then per device.
#[derive(Deserialize)]
struct PerDevice {
    workload: String,
    #[serde(default)]
    description: String,
    pytorch_cuda_alloc_conf: Option<String>,
    #[serde(default)]
    memory_fraction: Option<f64>,
    torch_version: String,
    #[serde(default)]
    cuda_version: Option<String>,
    gpu_name: String,
    device_total_memory: u64,
    record_memory_history: Option<String>,
    #[serde(default)]
    reset_after: Option<Vec<serde_json::Value>>,
    #[serde(default)]
    trace_action_counts: BTreeMap<String, u64>,
    devices: Vec<DeviceFigures>,
}

#[derive(Deserialize)]
struct DeviceFigures {
    device: usize,
    max_memory_allocated: u64,
    max_memory_reserved: u64,
    memory_allocated: u64,
    memory_reserved: u64,
    memory_stats: BTreeMap<String, i64>,
}

impl Figures {
    /// One of [`Figures::memory_stats`], e.g. `stat("num_alloc_retries")`.
    pub fn stat(&self, key: &str) -> Option<i64> {
        self.memory_stats.get(key).copied()
    }
}

impl Figures {
    /// Whether the recording began before the process's first allocation, so that PyTorch's
    /// cumulative counters (`num_device_alloc`, …) cover exactly the trace.
    pub fn recorded_from_the_start(&self) -> bool {
        match &self.record_memory_history {
            Some(serde_json::Value::String(how)) => how.contains("before the first allocation"),
            _ => true,
        }
    }
}

/// Reads a figures sidecar (JSON, at most 64 MiB) for device 0; errors name the file.
pub fn read_figures(path: &Path) -> Result<Figures, SnapshotError> {
    read_figures_for(path, 0)
}

/// Reads a figures sidecar for `device`: the single-device format of
/// `scripts/record_traces.py`, or the per-device one of `scripts/record_user_snapshots.py`.
pub fn read_figures_for(path: &Path, device: usize) -> Result<Figures, SnapshotError> {
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
    let bad = |reason: String| SnapshotError::Figures {
        file: name.clone(),
        reason,
    };
    let value: serde_json::Value = serde_json::from_slice(&text).map_err(|e| bad(e.to_string()))?;
    if value.get("devices").is_none() {
        return serde_json::from_value(value).map_err(|e| bad(e.to_string()));
    }
    let per: PerDevice = serde_json::from_value(value).map_err(|e| bad(e.to_string()))?;
    let d = per
        .devices
        .into_iter()
        .find(|d| d.device == device)
        .ok_or_else(|| bad(format!("no figures for device {device}")))?;
    Ok(Figures {
        workload: per.workload,
        description: per.description,
        pytorch_cuda_alloc_conf: per.pytorch_cuda_alloc_conf,
        memory_fraction: per.memory_fraction,
        torch_version: per.torch_version,
        cuda_version: per.cuda_version,
        gpu_name: per.gpu_name,
        device_total_memory: per.device_total_memory,
        max_memory_allocated: d.max_memory_allocated,
        max_memory_reserved: d.max_memory_reserved,
        memory_allocated: d.memory_allocated,
        memory_reserved: d.memory_reserved,
        memory_stats: d.memory_stats,
        trace_action_counts: per.trace_action_counts,
        trace_may_be_truncated: false,
        record_memory_history: per.record_memory_history.map(serde_json::Value::String),
        reset_after: per
            .reset_after
            .and_then(|r| r.into_iter().nth(device))
            .filter(|v| !v.is_null()),
    })
}

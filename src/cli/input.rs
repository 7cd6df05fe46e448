//! Loading a trace for the command line: the snapshot, the device to replay, PyTorch's
//! figures from the NAME.json sidecar, and the settings a replay runs under.
//!
//! The one rule: every failure names the file (or the option) and says what is wrong, and
//! is bad input (exit code 2).

use std::path::{Path, PathBuf};

use cachalot::Settings;
use cachalot_tools::find_settings::{FoundChange, find_change};
use cachalot_tools::replay::{
    H200_MEMORY, Recorded, RecordedError, ReplayOptions, ReplayProgram, ReplayReport, SnapshotExt,
    StartError, StartState, private_segments, replay_ops_from,
};
use cachalot_tools::replay::{PYTORCH_LARGE_PAGE, RuntimeSettings, reconstruct_start_changed};
use cachalot_tools::snapshot::{Figures, Snapshot, read_figures_for, read_snapshot};

use super::error::CliError;

/// A snapshot ready to replay.
pub struct Trace {
    /// The file, as given.
    pub path: PathBuf,
    /// The snapshot as read (its `segments` are the allocator's state at the dump).
    pub snapshot: Snapshot,
    /// The device whose trace is replayed.
    pub device: usize,
    /// The replay program of that device's trace.
    pub program: ReplayProgram,
    /// What the conversion of the trace into the program did.
    pub conversion: ReplayReport,
    /// The allocator's state when recording began, or why it could not be reconstructed.
    pub start: Result<StartState, StartError>,
    /// PyTorch's own figures, from NAME.json beside the snapshot.
    pub figures: Option<Figures>,
    /// The memory fraction the program set, as given on the command line
    /// (`--memory-fraction`); it wins over the sidecar's.
    pub fraction: Option<f64>,
    /// Set when the trace fits other allocator settings than the recorded ones (settings
    /// changed at run time): what the report says about it.
    pub settings_hint: Option<String>,
    /// Where the settings changed at run time, when found (the program and the start are
    /// then the change's).
    pub settings_change: Option<FoundChange>,
}

impl Trace {
    /// The file's name for messages.
    pub fn name(&self) -> String {
        self.path.display().to_string()
    }

    /// What the snapshot and its sidecar say about the settings the trace was recorded under.
    /// A memory fraction given on the command line is the recorded program's.
    pub fn recorded(&self) -> Recorded<'_> {
        let mut recorded = Recorded::of(&self.snapshot, self.figures.as_ref());
        if self.fraction.is_some() {
            recorded.memory_fraction = self.fraction;
        }
        recorded
    }

    /// The device memory to simulate: `explicit`, else the recording GPU's, else an H200's.
    pub fn capacity(&self, explicit: Option<u64>) -> u64 {
        explicit
            .or_else(|| self.figures.as_ref().map(|f| f.device_total_memory))
            .filter(|&c| c > 0)
            .unwrap_or(H200_MEMORY)
    }

    /// The settings a replay runs under: PyTorch's defaults (`pytorch`) or cachalot's; then
    /// the PYTORCH_CUDA_ALLOC_CONF the trace was recorded with (`recorded`); then the recorded
    /// memory fraction (unless the settings have one by then); then `config` on top.
    pub fn settings(
        &self,
        pytorch: bool,
        recorded: bool,
        config: Option<&str>,
    ) -> Result<Settings, CliError> {
        let mut settings = if pytorch {
            Settings::pytorch()
        } else {
            Settings::cachalot()
        };
        let rec = self.recorded();
        if recorded {
            settings = rec
                .apply_conf(settings)
                .map_err(|e| self.recorded_error(e))?;
            // Settings changed at run time: the replay starts under the earlier ones.
            if let Some(c) = &self.settings_change {
                let before = RuntimeSettings::from_conf(&c.from)
                    .map_err(|e| CliError::input(format!("{}: {e}", self.name())))?;
                settings = before.applied_to(&settings);
            }
        }
        settings = rec
            .apply_fraction(settings)
            .map_err(|e| self.recorded_error(e))?;
        if let Some(conf) = config {
            settings = apply_config(&settings, conf)?;
        }
        Ok(settings)
    }

    /// The settings PyTorch ran under when recording began: the recorded ones, or, when the
    /// program changed them at run time, those before the change.
    pub fn recorded_start_settings(&self) -> Option<Settings> {
        let s = self.recorded().settings().ok()?;
        match &self.settings_change {
            Some(c) => Some(RuntimeSettings::from_conf(&c.from).ok()?.applied_to(&s)),
            None => Some(s),
        }
    }

    /// A recorded setting that is not usable, as bad input naming the file it came from.
    fn recorded_error(&self, e: RecordedError) -> CliError {
        let file = match e {
            RecordedError::Conf { .. } => self.name(),
            RecordedError::Fraction(_) => sidecar(&self.path).display().to_string(),
        };
        CliError::input(format!("{file}: {e}"))
    }
}

/// `settings` with a `--config` string applied; errors name the option and the key.
pub fn apply_config(settings: &Settings, conf: &str) -> Result<Settings, CliError> {
    settings
        .apply(conf)
        .map_err(|e| CliError::input(format!("--config \"{conf}\": {e}")))
}

/// Where the figures of a snapshot live: NAME.json beside NAME.pickle (NAME.pickle.gz too).
pub fn sidecar(path: &Path) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().to_string());
    match name.as_deref().and_then(|n| n.strip_suffix(".gz")) {
        Some(stem) => path.with_file_name(stem).with_extension("json"),
        None => path.with_extension("json"),
    }
}

/// Reads a snapshot and picks the device to replay (`device`, or the first whose trace has
/// entries).
pub fn load(path: &Path, device: Option<usize>) -> Result<Trace, CliError> {
    let snapshot = read_snapshot(path).map_err(|e| CliError::input(e.to_string()))?;
    let name = path.display();
    let with_entries: Vec<usize> = snapshot
        .traces
        .iter()
        .filter(|t| !t.entries.is_empty())
        .map(|t| t.device)
        .collect();
    let device = match device {
        Some(d) => {
            if !with_entries.contains(&d) {
                return Err(CliError::input(format!(
                    "{name}: no trace entries for device {d} (devices with entries: {})",
                    list(&with_entries)
                )));
            }
            d
        }
        None => *with_entries.first().ok_or_else(|| {
            CliError::input(format!(
                "{name}: the snapshot's device traces are empty: nothing to replay (was \
                 torch.cuda.memory._record_memory_history() on while the program ran?)"
            ))
        })?,
    };
    let Some(trace) = snapshot.traces.iter().find(|t| t.device == device) else {
        return Err(CliError::input(format!(
            "{name}: no trace for device {device}"
        )));
    };
    let options = ReplayOptions::from_settings(snapshot.allocator_settings.as_ref());
    let start = snapshot.start_of(device);
    let unknown = StartState {
        private_segments: private_segments(&snapshot.segments, device),
        ..StartState::default()
    };
    let (program, conversion) =
        replay_ops_from(trace, &options, start.as_ref().unwrap_or(&unknown));
    // Settings changed at run time (torch.cuda.memory._set_allocator_settings): the recorded
    // ones are the last in force, and the walk, which rounds freed blocks by them, fails where
    // PyTorch's defaults' rounding does not.
    let settings_hint = match &start {
        Err(e)
            if snapshot
                .allocator_settings
                .as_ref()
                .is_some_and(|s| s.divisions() != [0; 16]) =>
        {
            let mut plain = snapshot.clone();
            if let Some(s) = plain.allocator_settings.as_mut() {
                s.roundup_power2_divisions = Default::default();
            }
            plain.start_of(device).is_ok().then(|| {
                format!(
                    "settings changed at run time: the trace's blocks fit PyTorch's default \
                     rounding, not the recorded roundup_power2_divisions (\"{}\", the settings \
                     in force at the dump), which the walk back to the start failed under ({e}) \
                     — was torch.cuda.memory._set_allocator_settings called?",
                    snapshot
                        .allocator_settings
                        .as_ref()
                        .map(|s| s.alloc_conf.as_str())
                        .unwrap_or("")
                )
            })
        }
        _ => None,
    };
    let side = sidecar(path);
    let figures = if side.is_file() {
        match read_figures_for(&side, device) {
            Ok(f) => Some(f),
            Err(e) => {
                eprintln!("cachalot: ignoring the figures beside the trace: {e}");
                None
            }
        }
    } else {
        None
    };
    let mut trace = Trace {
        path: path.to_path_buf(),
        snapshot,
        device,
        program,
        conversion,
        start,
        figures,
        fraction: None,
        settings_hint,
        settings_change: None,
    };
    if trace.settings_hint.is_some() {
        trace.look_for_a_settings_change();
    }
    Ok(trace)
}

impl Trace {
    /// Searches where the settings changed from PyTorch's defaults to the recorded ones
    /// ([`find_change`]); when found, the trace's start and program become the change's.
    pub fn look_for_a_settings_change(&mut self) {
        let Ok(before) = RuntimeSettings::from_conf("") else {
            return;
        };
        let Some(conf) = self
            .snapshot
            .allocator_settings
            .as_ref()
            .map(|s| s.alloc_conf.clone())
        else {
            return;
        };
        let Ok(after) = RuntimeSettings::from_conf(&conf) else {
            return;
        };
        let Ok(settings) = self.recorded().settings() else {
            return;
        };
        let capacity = self.capacity(None);
        let found = find_change(
            &self.snapshot,
            self.device,
            &settings,
            capacity,
            &before,
            &after,
        );
        if let Some(found) = found {
            self.start = Ok(found.start.clone());
            self.program = found.program.clone();
            self.settings_hint = None;
            self.settings_change = Some(found);
        }
    }

    /// The user's word (`--settings-at ENTRY:CONF`): the program put `conf` in force just
    /// before trace entry `entry`, PyTorch's defaults before. The start is walked back and the
    /// program built with that change, whether or not it reproduces the trace (the self-check
    /// says); an entry beyond the trace is bad input.
    pub fn settings_changed_at(&mut self, entry: usize, conf: &str) -> Result<(), CliError> {
        let bad = |e: String| CliError::input(format!("--settings-at {entry}:{conf}: {e}"));
        let after = RuntimeSettings::from_conf(conf).map_err(|e| bad(e.to_string()))?;
        let before = RuntimeSettings::from_conf("").map_err(|e| bad(e.to_string()))?;
        let Some(t) = self
            .snapshot
            .traces
            .iter()
            .find(|t| t.device == self.device)
        else {
            return Err(bad(format!("no trace for device {}", self.device)));
        };
        if entry > t.entries.len() {
            return Err(bad(format!(
                "the trace of device {} has {} entries (ENTRY is at most that)",
                self.device,
                t.entries.len()
            )));
        }
        let start = reconstruct_start_changed(
            t,
            &self.snapshot.segments,
            &before.roundup_power2_divisions,
            &after.roundup_power2_divisions,
            entry,
            PYTORCH_LARGE_PAGE,
        )
        .map(|mut s| {
            s.private_segments = private_segments(&self.snapshot.segments, self.device);
            s
        });
        let unknown = StartState {
            private_segments: private_segments(&self.snapshot.segments, self.device),
            ..StartState::default()
        };
        let options = ReplayOptions::from_settings(self.snapshot.allocator_settings.as_ref());
        let (program, conversion) =
            replay_ops_from(t, &options, start.as_ref().unwrap_or(&unknown));
        self.program = program.with_settings_change(entry, after.clone());
        self.conversion = conversion;
        self.start = start.clone();
        self.settings_hint = None;
        self.settings_change = Some(FoundChange {
            first_entry: entry,
            last_entry: entry,
            from: before.conf,
            to: after.conf,
            replays: 0,
            start: start.unwrap_or_default(),
            program: self.program.clone(),
        });
        Ok(())
    }
}

/// `--settings-at ENTRY:CONF`: a trace entry and a configuration string in
/// PYTORCH_CUDA_ALLOC_CONF syntax (checked here, so a bad one exits 2 before anything runs).
pub fn parse_settings_at(s: &str) -> Result<(usize, String), String> {
    let (entry, conf) = s
        .split_once(':')
        .ok_or_else(|| format!("{s:?} is not ENTRY:CONF (e.g. 300:max_split_size_mb:32)"))?;
    let entry: usize = entry
        .trim()
        .parse()
        .map_err(|_| format!("{entry:?} is not a trace entry (a whole number)"))?;
    RuntimeSettings::from_conf(conf).map_err(|e| format!("{conf:?}: {e}"))?;
    Ok((entry, conf.to_string()))
}

fn list(devices: &[usize]) -> String {
    if devices.is_empty() {
        return "none".into();
    }
    devices
        .iter()
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sidecar_sits_beside_plain_and_compressed_snapshots() {
        assert_eq!(sidecar(Path::new("a/x.pickle")), Path::new("a/x.json"));
        assert_eq!(sidecar(Path::new("a/x.pickle.gz")), Path::new("a/x.json"));
        assert_eq!(sidecar(Path::new("x")), Path::new("x.json"));
    }
}

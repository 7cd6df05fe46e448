//! The settings a trace was recorded under, as its snapshot and the sidecar beside it tell
//! them: the one place they are worked out, for the replay's settings (`cachalot replay
//! --pytorch`, `compare`'s baseline, `fit`, `explain`), the choice of the exact start, the ops
//! file's header, and the conversion of the trace ([`ReplayOptions`](super::program::ReplayOptions)).

use cachalot::snapshot::{AllocatorSettings, Snapshot};
use cachalot::{Settings, SettingsError};

use crate::snapshot::figures::Figures;

/// What a trace says about the allocator settings it was recorded under.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Recorded<'a> {
    /// The `PYTORCH_CUDA_ALLOC_CONF` it was recorded with: the snapshot's
    /// `allocator_settings` when it has them, else the sidecar's; `None` when neither says.
    pub conf: Option<&'a str>,
    /// The memory fraction the recorded program set (the sidecar's).
    pub memory_fraction: Option<f64>,
}

/// Why the recorded settings are not usable.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum RecordedError {
    /// The recorded `PYTORCH_CUDA_ALLOC_CONF` does not parse.
    #[error("the recorded PYTORCH_CUDA_ALLOC_CONF \"{conf}\" is not usable: {error}")]
    Conf {
        /// The string.
        conf: String,
        /// Why.
        error: SettingsError,
    },
    /// The recorded memory fraction is out of range.
    #[error("the recorded memory fraction: {0}")]
    Fraction(SettingsError),
}

impl<'a> Recorded<'a> {
    /// What `allocator_settings` (a snapshot's) and `figures` (its sidecar's) say.
    pub fn new(
        allocator_settings: Option<&'a AllocatorSettings>,
        figures: Option<&'a Figures>,
    ) -> Recorded<'a> {
        Recorded {
            conf: match allocator_settings {
                Some(s) => Some(&s.alloc_conf),
                None => figures.and_then(|f| f.pytorch_cuda_alloc_conf.as_deref()),
            },
            memory_fraction: figures.and_then(|f| f.memory_fraction),
        }
    }

    /// What `snapshot` and its sidecar's `figures` say.
    pub fn of(snapshot: &'a Snapshot, figures: Option<&'a Figures>) -> Recorded<'a> {
        Recorded::new(snapshot.allocator_settings.as_ref(), figures)
    }

    /// `settings` with the recorded `PYTORCH_CUDA_ALLOC_CONF` applied (unchanged when none).
    pub fn apply_conf(&self, settings: Settings) -> Result<Settings, RecordedError> {
        match self.conf {
            Some(conf) => settings.apply(conf).map_err(|error| RecordedError::Conf {
                conf: conf.to_string(),
                error,
            }),
            None => Ok(settings),
        }
    }

    /// `settings` with the recorded memory fraction, unless they have one.
    pub fn apply_fraction(&self, mut settings: Settings) -> Result<Settings, RecordedError> {
        if settings.per_process_memory_fraction.is_none()
            && let Some(f) = self.memory_fraction
        {
            settings
                .set_per_process_memory_fraction(f)
                .map_err(RecordedError::Fraction)?;
        }
        Ok(settings)
    }

    /// The settings the trace was recorded under: PyTorch's defaults, then the recorded
    /// `PYTORCH_CUDA_ALLOC_CONF`, then the recorded memory fraction.
    pub fn settings(&self) -> Result<Settings, RecordedError> {
        self.apply_fraction(self.apply_conf(Settings::pytorch())?)
    }
}

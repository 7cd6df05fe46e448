//! The plug-in's state, in safe Rust: one [`CudaAllocator`] per device, made at the device's
//! first request, the settings they are made with, and the streams PyTorch has passed.
//!
//! The one rule: every call PyTorch makes through the C functions of `ffi.rs` (allocate,
//! free, record a use on a stream, empty the cache, set the memory fraction) and every call
//! from Python (`lib.rs`) lands here, on the same per-device allocators, so the statistics and
//! snapshots Python reads are those of the memory PyTorch's tensors hold. Nothing here panics
//! on any input; `ffi.rs` still catches panics at the C boundary.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use cachalot::HistoryOptions;
use cachalot::cuda::cudarc::driver::{CudaContext, CudaStream};
use cachalot::cuda::{CudaAllocator, CudaError, CurrentContext};
use cachalot::{Settings, SettingsError};

/// The most devices the plug-in serves (PyTorch's own limit, `C10_COMPILE_TIME_MAX_GPUS`, is
/// 120).
pub const MAX_DEVICES: usize = 128;

/// The environment variable read for the settings when Python did not configure the plug-in
/// (the shared library loaded by PyTorch directly): the CUDA allocator's own.
pub const ALLOC_CONF_ENV: &str = cachalot::cuda::ALLOC_CONF_ENV;

/// One device's allocator and the wrappers of the streams PyTorch passed for it.
pub struct Device {
    /// The allocator.
    pub alloc: CudaAllocator,
    /// Borrowed wrappers of PyTorch's streams, by handle: made once each, and kept (PyTorch's
    /// streams live as long as the process; see `Plugin::stream`).
    streams: Mutex<HashMap<usize, Arc<CudaStream>>>,
}

/// What the plug-in was configured with.
#[derive(Clone, Debug, PartialEq)]
struct Config {
    /// The settings every device's allocator is made with.
    settings: Settings,
    /// The configuration string as given (for messages).
    text: String,
    /// Whether the base was PyTorch's defaults.
    pytorch: bool,
}

/// The plug-in: settings, devices, history options.
pub struct Plugin {
    config: Mutex<Option<Config>>,
    /// Set once any device's allocator exists: the settings can no longer change.
    started: OnceLock<()>,
    devices: [OnceLock<Result<Device, String>>; MAX_DEVICES],
    /// Applied to each device's allocator when it is made (and to those made already).
    history: Mutex<Option<HistoryOptions>>,
}

/// The process's plug-in.
pub fn plugin() -> &'static Plugin {
    static PLUGIN: OnceLock<Plugin> = OnceLock::new();
    PLUGIN.get_or_init(|| Plugin {
        config: Mutex::new(None),
        started: OnceLock::new(),
        devices: std::array::from_fn(|_| OnceLock::new()),
        history: Mutex::new(None),
    })
}

/// Why a configuration was refused.
#[derive(Debug)]
pub enum ConfigError {
    /// The string does not parse (the parser's message names the key).
    Parse(SettingsError),
    /// Allocators exist already, made with other settings.
    Started {
        /// The settings in force, as a configuration string over their base.
        running: String,
    },
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConfigError::Parse(e) => write!(f, "invalid configuration: {e}"),
            ConfigError::Started { running } => write!(
                f,
                "the plug-in is already serving allocations with other settings ({running}); \
                 settings are fixed at the first CUDA allocation"
            ),
        }
    }
}

/// The settings a configuration string gives: over PyTorch's defaults (`pytorch`) or
/// cachalot's, as `cachalot replay --pytorch --config ...` reads them.
pub fn parse_settings(text: &str, pytorch: bool) -> Result<Settings, SettingsError> {
    let base = if pytorch {
        Settings::pytorch()
    } else {
        Settings::cachalot()
    };
    base.apply(text)
}

/// The settings as a configuration string over the base they were given on.
pub fn describe(settings: &Settings, pytorch: bool) -> String {
    let base = if pytorch {
        Settings::pytorch()
    } else {
        Settings::cachalot()
    };
    let over = settings.config_over(&base);
    let name = if pytorch { "PyTorch" } else { "cachalot" };
    if over.is_empty() {
        format!("{name}'s defaults")
    } else {
        format!("{name}'s defaults with {over}")
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Plugin {
    /// Sets the settings every device's allocator will be made with. Once an allocator exists
    /// the same settings are accepted (a second `install()`), others refused.
    pub fn configure(&self, text: &str, pytorch: bool) -> Result<String, ConfigError> {
        let settings = parse_settings(text, pytorch).map_err(ConfigError::Parse)?;
        let mut config = lock(&self.config);
        if self.started.get().is_some()
            && let Some(running) = config.as_ref()
            && running.settings != settings
        {
            return Err(ConfigError::Started {
                running: describe(&running.settings, running.pytorch),
            });
        }
        let described = describe(&settings, pytorch);
        *config = Some(Config {
            settings,
            text: text.to_owned(),
            pytorch,
        });
        Ok(described)
    }

    /// The settings in force (or that will be), described; the configuration string given;
    /// whether over PyTorch's defaults.
    pub fn settings(&self) -> Result<(String, String, bool), ConfigError> {
        let config = self.config_or_env()?;
        Ok((
            describe(&config.settings, config.pytorch),
            config.text,
            config.pytorch,
        ))
    }

    /// The settings in force (or that will be), the configuration string given, and whether
    /// over PyTorch's defaults.
    pub fn current_settings(&self) -> Result<(Settings, String, bool), ConfigError> {
        let config = self.config_or_env()?;
        Ok((config.settings, config.text, config.pytorch))
    }

    /// The configuration, or, when Python never configured the plug-in, the environment's
    /// (`CACHALOT_ALLOC_CONF` over cachalot's defaults), which is then fixed.
    fn config_or_env(&self) -> Result<Config, ConfigError> {
        let mut config = lock(&self.config);
        if let Some(c) = config.as_ref() {
            return Ok(c.clone());
        }
        let text = std::env::var(ALLOC_CONF_ENV).unwrap_or_default();
        let settings = parse_settings(&text, false).map_err(ConfigError::Parse)?;
        let c = Config {
            settings,
            text,
            pytorch: false,
        };
        *config = Some(c.clone());
        Ok(c)
    }

    /// The allocator of `device`, made at the first call with the configured settings. An
    /// error (no driver, no such device, settings the device refuses) is kept: every later
    /// call for the device gets it again.
    pub fn device(&self, device: i32) -> Result<&Device, String> {
        let slot = usize::try_from(device)
            .ok()
            .and_then(|d| self.devices.get(d))
            .ok_or_else(|| format!("device index {device} is out of range"))?;
        slot.get_or_init(|| self.make_device(device as usize))
            .as_ref()
            .map_err(Clone::clone)
    }

    /// The allocators made so far, with their device index.
    pub fn devices(&self) -> impl Iterator<Item = (usize, &Device)> {
        self.devices
            .iter()
            .enumerate()
            .filter_map(|(i, d)| Some((i, d.get()?.as_ref().ok()?)))
    }

    fn make_device(&self, ordinal: usize) -> Result<Device, String> {
        let config = self.config_or_env().map_err(|e| e.to_string())?;
        let _ = self.started.set(());
        let count = cachalot::cuda::device_count().map_err(|e| e.to_string())?;
        if ordinal >= count {
            return Err(CudaError::NoSuchDevice { ordinal, count }.to_string());
        }
        // cudarc makes the device's primary context (PyTorch's, through the runtime API)
        // current on this thread; the caller's context is put back.
        let _keep = CurrentContext::save().map_err(|e| e.to_string())?;
        let ctx = CudaContext::new(ordinal).map_err(|e| CudaError::from(e).to_string())?;
        let alloc = CudaAllocator::new(ctx, config.settings).map_err(|e| e.to_string())?;
        if let Some(options) = *lock(&self.history) {
            alloc.record_history_with(Some(options));
        }
        Ok(Device {
            alloc,
            streams: Mutex::new(HashMap::new()),
        })
    }

    /// Starts, resizes or stops (`None`) recording the history on every device, now and for
    /// devices made later.
    pub fn record_history(&self, options: Option<HistoryOptions>) {
        *lock(&self.history) = options;
        for (_, d) in self.devices() {
            d.alloc.record_history_with(options);
        }
    }

    /// `torch.cuda.empty_cache()`: every device's cached memory back to the driver.
    pub fn empty_cache(&self) -> Result<(), String> {
        if self.devices().next().is_none() {
            return Ok(());
        }
        let _keep = CurrentContext::save().map_err(|e| e.to_string())?;
        let mut first_error = None;
        for (i, d) in self.devices() {
            if let Err(e) = d.alloc.empty_cache() {
                first_error.get_or_insert(format!("device {i}: {e}"));
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

impl Device {
    /// The allocator's stream for PyTorch's stream `handle` (a `cudaStream_t`): the one kept
    /// for it, or `make()`'s, kept from now on. PyTorch's streams live as long as the process,
    /// so the wrappers are never dropped; `make` is where the raw handle becomes a stream
    /// (`ffi.rs`, with the promise `CudaAllocator::borrow_stream` asks for).
    pub fn stream_with(
        &self,
        handle: usize,
        make: impl FnOnce(&CudaAllocator) -> Arc<CudaStream>,
    ) -> Arc<CudaStream> {
        let mut streams = lock(&self.streams);
        Arc::clone(streams.entry(handle).or_insert_with(|| make(&self.alloc)))
    }
}

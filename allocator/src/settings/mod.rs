//! Allocator settings and the `PYTORCH_CUDA_ALLOC_CONF` language.
//!
//! [`Settings`] holds every knob of the caching allocator. A value starts from PyTorch's
//! defaults ([`Settings::pytorch`]) or cachalot's ([`Settings::cachalot`], which is also the
//! [`Default`]) and is changed by a configuration string written exactly as for PyTorch's
//! `PYTORCH_CUDA_ALLOC_CONF` (or `PYTORCH_ALLOC_CONF`) environment variable:
//!
//! ```text
//! max_split_size_mb:128,roundup_power2_divisions:[256:1,512:2,1024:4,>:8],expandable_segments:True
//! ```
//!
//! # Syntax
//!
//! The string is cut into tokens as PyTorch's `ConfigTokenizer` does: each of `,` `:` `[` `]`
//! is a token of its own, ASCII white space is dropped (also *inside* a word, so `2 0` reads as
//! `20`), and each run of other characters is a word. The tokens must then form `key:value`
//! pairs separated by single commas. An empty string, or one of white space only, changes
//! nothing. A key may appear more than once; the later occurrence is applied over the earlier.
//!
//! | key | value | stored as |
//! |---|---|---|
//! | `max_split_size_mb` | integer ≥ 20 | [`Settings::max_split_size`] = N MiB (N clamped to `u64::MAX / MiB`) |
//! | `max_non_split_rounding_mb` | integer ≥ 20 | [`Settings::max_non_split_rounding_size`] = N MiB (same clamp) |
//! | `garbage_collection_threshold` | decimal in (0, 1) | [`Settings::garbage_collection_threshold`] |
//! | `roundup_power2_divisions` | power of two, or a list (below) | [`Settings::roundup_power2_divisions`] |
//! | `expandable_segments` | `True` / `False` | [`Settings::expandable_segments`] |
//! | `per_process_memory_fraction` | decimal in \[0, 1\] | [`Settings::per_process_memory_fraction`] |
//! | `release_lock_on_cudamalloc` | `True` / `False` | [`Settings::release_lock_on_cudamalloc`] |
//! | `pinned_use_cuda_host_register` | `True` / `False` | [`Settings::pinned_use_cuda_host_register`] |
//! | `pinned_num_register_threads` | power of two ≤ 128 | [`Settings::pinned_num_register_threads`] |
//! | `pinned_use_background_threads` | `True` / `False` | [`Settings::pinned_use_background_threads`] |
//! | `backend` | `native` / `cudaMallocAsync` | [`Settings::backend`] |
//! | `thread_cache_blocks` | integer ≤ 1024 (cachalot's own key) | [`Settings::thread_cache_blocks`] |
//!
//! The list form of `roundup_power2_divisions` is `[K:D,K:D,...]`. Each `K` is a size in MB
//! that is a power of two and names the interval `clamp(log2 K, 0, 15)`; each `D` is `0` or a
//! power of two. Entries are applied left to right over the current table:
//!
//! * the first numeric entry also fills every interval below its own;
//! * `>:D` fills every interval *after* the one named by the last numeric entry seen so far
//!   (after interval 0 when there was none), as PyTorch ≥ 2.10 does;
//! * intervals that no entry reaches keep their previous value (zero when parsing from the
//!   defaults) — they do *not* inherit the value of the interval before them.
//!
//! So `[256:1,512:2,1024:4,>:8]` gives intervals 0..=8 one division, 9 two, 10 four and
//! 11..=15 eight.
//!
//! # Stricter than PyTorch
//!
//! Where PyTorch would crash, read past the end of its token list, or silently accept
//! garbage, this parser returns a [`SettingsError`] instead: numbers must be plain digits
//! (`12abc`, `+5`, `-1` and `0x10` are refused, where `std::stoull` would take a prefix or
//! wrap a negative), integers that overflow 64 bits are refused, decimals must be finite
//! decimal numbers (no `nan`, `inf` or hexadecimal floats), a `:` after each key and a `,`
//! between pairs are required (PyTorch ≥ 2.9 does not check them), and an empty value, a
//! trailing comma, an empty list and unbalanced brackets are all errors. Keys PyTorch knows
//! but cachalot does not (`large_segment_size_mb`, `pinned_reserve_segment_size_mb`,
//! `graph_capture_record_stream_reuse`, the `*_hip*` spellings, ...) are unrecognized here.

use std::fmt;

/// One mebibyte; the unit of the `*_mb` keys.
const MIB: u64 = 1 << 20;
/// The smallest value accepted by `max_split_size_mb` and `max_non_split_rounding_mb`
/// (PyTorch's `kLargeBuffer / kMB`).
const MIN_SIZE_MB: u64 = 20;
/// The largest `*_mb` value that still fits in bytes; larger values are clamped to it.
const MAX_SIZE_MB: u64 = u64::MAX / MIB;
/// The number of power-of-two intervals of `roundup_power2_divisions`.
const INTERVALS: usize = 16;
/// The largest value of `pinned_num_register_threads`.
const MAX_REGISTER_THREADS: u64 = 128;
/// The interval index of a 1 MiB size: interval 0 starts at 2^20 bytes.
const FIRST_INTERVAL_LOG2: u32 = 20;

/// The device allocator behind the caching layer (`backend:` in the configuration string).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum AllocatorBackend {
    /// The caching allocator itself (`backend:native`), PyTorch's default.
    #[default]
    Native,
    /// CUDA's stream-ordered allocator (`backend:cudaMallocAsync`). With this backend PyTorch
    /// ignores `max_split_size_mb`, `roundup_power2_divisions` and
    /// `garbage_collection_threshold`.
    CudaMallocAsync,
}

impl AllocatorBackend {
    /// The spelling of this backend in a configuration string.
    pub fn as_str(self) -> &'static str {
        match self {
            AllocatorBackend::Native => "native",
            AllocatorBackend::CudaMallocAsync => "cudaMallocAsync",
        }
    }
}

impl fmt::Display for AllocatorBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Every knob of the caching allocator, with PyTorch's meaning.
///
/// Build one with [`Settings::pytorch`], [`Settings::cachalot`] / [`Default`],
/// [`Settings::parse`] or [`Settings::from_env`]; change it with [`Settings::apply`] or the
/// validating setters. The fields are public for reading; code that assigns them directly
/// is responsible for keeping them in the ranges the parser enforces (otherwise the
/// [`Display`](fmt::Display) form may not parse back).
///
/// ```
/// use cachalot::Settings;
///
/// let s = Settings::parse("max_split_size_mb:128, garbage_collection_threshold:0.6")?;
/// assert_eq!(s.max_split_size, 128 << 20);
/// assert_eq!(s.garbage_collection_threshold, 0.6);
/// assert_eq!(s.to_string(), "max_split_size_mb:128,garbage_collection_threshold:0.6");
/// assert_eq!(Settings::parse(&s.to_string())?, s);
/// # Ok::<(), cachalot::SettingsError>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct Settings {
    /// Blocks at least this large (bytes) are never split, and requests at least this large
    /// do not take a split of a larger block. `u64::MAX` (the default) means unlimited.
    pub max_split_size: u64,
    /// A request of at least `max_split_size` may be served by a cached block at most this
    /// many bytes larger. Default 20 MiB.
    pub max_non_split_rounding_size: u64,
    /// Fraction of the allowed memory above which cached blocks are reclaimed ahead of time;
    /// `0.0` (the default) turns this garbage collection off. Otherwise in (0, 1).
    pub garbage_collection_threshold: f64,
    /// How many power-of-two divisions a request is rounded up to, per size interval:
    /// index `i` covers sizes in `[2^(20+i), 2^(21+i))` bytes, index 0 also every smaller size
    /// and index 15 every larger one. `0` or `1` turns rounding off for that interval.
    /// See [`Settings::roundup_divisions_for`].
    pub roundup_power2_divisions: [u64; 16],
    /// Grow segments with virtual-memory mappings instead of allocating one per request.
    pub expandable_segments: bool,
    /// Cap on reserved memory as a fraction of device capacity, in \[0, 1\]; `None` (the
    /// default) means no cap.
    pub per_process_memory_fraction: Option<f64>,
    /// Release the allocator's lock while calling `cudaMalloc`.
    pub release_lock_on_cudamalloc: bool,
    /// Pinned host memory: allocate with `malloc` and register with `cudaHostRegister`
    /// instead of calling `cudaHostAlloc`.
    pub pinned_use_cuda_host_register: bool,
    /// Pinned host memory: threads used to map pages before `cudaHostRegister`; a power of
    /// two, at most 128. Default 1.
    pub pinned_num_register_threads: u64,
    /// Pinned host memory: process events on a background thread.
    pub pinned_use_background_threads: bool,
    /// The device allocator behind the cache.
    pub backend: AllocatorBackend,
    /// cachalot's own policy, not PyTorch's: how many freed blocks each thread keeps for
    /// itself in front of the shared cache ([`crate::Allocator`]'s thread caches, rule 17 of
    /// ARCHITECTURE.md). `0` (PyTorch's behaviour, [`Settings::pytorch`]) turns them off;
    /// cachalot's default is [`THREAD_CACHE_BLOCKS`].
    pub thread_cache_blocks: u32,
}

/// cachalot's default for [`Settings::thread_cache_blocks`].
pub const THREAD_CACHE_BLOCKS: u32 = 8;

/// The largest accepted [`Settings::thread_cache_blocks`]: a thread cache is scanned linearly.
pub const MAX_THREAD_CACHE_BLOCKS: u32 = 1024;

/// Why a configuration string, or a value given to a setter, was refused.
///
/// Every variant names the key it concerns when there is one.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SettingsError {
    /// A word in key position that is not an option cachalot knows.
    #[error("unrecognized option \"{key}\"")]
    UnknownKey {
        /// The word as written (white space removed).
        key: String,
    },
    /// A key followed by `:` and then nothing (the end of the string or a `,`).
    #[error("missing value for {key}")]
    MissingValue {
        /// The key whose value is missing.
        key: String,
    },
    /// A value that is well formed as a token but not acceptable for its key.
    #[error("invalid value \"{value}\" for {key}: {reason}")]
    InvalidValue {
        /// The key the value was given for.
        key: String,
        /// The offending value (for a list entry, the entry's part at fault).
        value: String,
        /// Why it was refused, e.g. `must be in (0.0, 1.0)`.
        reason: String,
    },
    /// Tokens in an order the grammar does not allow.
    #[error("syntax error{} near {near}: {reason}", in_key(key))]
    Syntax {
        /// The key whose pair the error is in, when the error is after a known key.
        key: Option<String>,
        /// Where: the token found (and its byte offset in the string), or `end of input`.
        near: String,
        /// What was expected.
        reason: String,
    },
    /// A setting that parses but that the allocator does not support (yet); never returned by
    /// the parser, but by whoever consumes the settings (e.g. `expandable_segments:True`).
    #[error("unsupported setting {key}: {reason}")]
    Unsupported {
        /// The key of the unsupported setting.
        key: String,
        /// Why it cannot be honoured.
        reason: String,
    },
    /// [`Settings::from_env`]: the variable is set but its value is not valid UTF-8.
    #[error("environment variable {var} is not valid UTF-8")]
    NotUnicode {
        /// The variable's name.
        var: String,
    },
}

/// The ` in KEY` part of a syntax error's message.
fn in_key(key: &Option<String>) -> String {
    match key {
        Some(k) => format!(" in {k}"),
        None => String::new(),
    }
}

impl Default for Settings {
    /// cachalot's defaults: [`Settings::cachalot`].
    fn default() -> Self {
        Settings::cachalot()
    }
}

impl Settings {
    /// PyTorch 2.x's defaults: unlimited split size, 20 MiB non-split rounding, no garbage
    /// collection, no power-of-two rounding, no expandable segments, no memory cap, the native
    /// backend, one pinned-memory register thread and every other switch off.
    pub fn pytorch() -> Settings {
        Settings {
            max_split_size: u64::MAX,
            max_non_split_rounding_size: MIN_SIZE_MB * MIB,
            garbage_collection_threshold: 0.0,
            roundup_power2_divisions: [0; INTERVALS],
            expandable_segments: false,
            per_process_memory_fraction: None,
            release_lock_on_cudamalloc: false,
            pinned_use_cuda_host_register: false,
            pinned_num_register_threads: 1,
            pinned_use_background_threads: false,
            backend: AllocatorBackend::Native,
            thread_cache_blocks: 0,
        }
    }

    /// cachalot's own defaults, also [`Default`]. They start from PyTorch's
    /// ([`Settings::pytorch`]) and depart from them in one way, documented here:
    ///
    /// * `thread_cache_blocks` is [`THREAD_CACHE_BLOCKS`]: each thread keeps up to that many
    ///   of the blocks it freed, and hands them straight back to its own requests of the same
    ///   size on the same stream (rule 17 of ARCHITECTURE.md, checked against the model).
    pub fn cachalot() -> Settings {
        Settings {
            thread_cache_blocks: THREAD_CACHE_BLOCKS,
            ..Settings::pytorch()
        }
    }

    /// Parses a configuration string over the defaults: `Settings::default().apply(s)`.
    ///
    /// An empty string (or one of white space only) gives the defaults.
    pub fn parse(s: &str) -> Result<Settings, SettingsError> {
        Settings::default().apply(s)
    }

    /// Applies a configuration string over these settings and returns the result; keys the
    /// string does not mention keep their value here (the list form of
    /// `roundup_power2_divisions` is applied over the current table, entry by entry). On error
    /// nothing is applied.
    ///
    /// Unlike PyTorch's `parseArgs`, nothing is reset first: PyTorch resets
    /// `max_split_size_mb`, `roundup_power2_divisions` and `garbage_collection_threshold` to
    /// their defaults at every call, and keeps the other keys.
    pub fn apply(&self, s: &str) -> Result<Settings, SettingsError> {
        let tokens = lex(s);
        let mut cursor = Cursor {
            tokens: &tokens,
            at: 0,
        };
        let mut out = self.clone();
        if cursor.peek().is_none() {
            return Ok(out);
        }
        loop {
            let Some(name) = cursor.word() else {
                let reason = if cursor.peek().is_none() {
                    "expected an option name after ','"
                } else {
                    "expected an option name"
                };
                return Err(syntax(None, &cursor, reason));
            };
            let key = Key::from_name(name).ok_or_else(|| SettingsError::UnknownKey {
                key: name.to_owned(),
            })?;
            if !cursor.eat(&Tok::Colon) {
                return Err(syntax(
                    Some(key),
                    &cursor,
                    "expected ':' after the option name",
                ));
            }
            out.apply_value(key, &mut cursor)?;
            match cursor.peek_tok() {
                None => return Ok(out),
                Some(Tok::Comma) => cursor.advance(),
                Some(_) => {
                    return Err(syntax(
                        Some(key),
                        &cursor,
                        "expected ',' or the end of the string after the value",
                    ));
                }
            }
        }
    }

    /// Reads the configuration string from the environment variable `var` and parses it over
    /// the defaults. An unset or empty variable gives the defaults; so does a name that no
    /// variable can have (empty, or containing `=` or NUL).
    ///
    /// PyTorch reads `PYTORCH_ALLOC_CONF` and the older `PYTORCH_CUDA_ALLOC_CONF` (which one
    /// wins has changed between versions); this reads exactly the variable named.
    pub fn from_env(var: &str) -> Result<Settings, SettingsError> {
        if var.is_empty() || var.contains(['=', '\0']) {
            return Ok(Settings::default());
        }
        from_env_value(var, std::env::var_os(var))
    }

    /// Sets [`Settings::max_split_size`] to `mb` MiB, as `max_split_size_mb:mb` would: `mb`
    /// must be at least 20, and is clamped to `u64::MAX / MiB`.
    pub fn set_max_split_size_mb(&mut self, mb: u64) -> Result<(), SettingsError> {
        self.max_split_size = check_size_mb(mb).map_err(|r| invalid(Key::MaxSplitSize, mb, r))?;
        Ok(())
    }

    /// Sets [`Settings::garbage_collection_threshold`], as `garbage_collection_threshold:x`
    /// would: `x` must be in the open interval (0, 1).
    pub fn set_garbage_collection_threshold(&mut self, x: f64) -> Result<(), SettingsError> {
        self.garbage_collection_threshold =
            check_gc_threshold(x).map_err(|r| invalid(Key::GcThreshold, x, r))?;
        Ok(())
    }

    /// Sets [`Settings::per_process_memory_fraction`] to `Some(x)`, as
    /// `per_process_memory_fraction:x` would: `x` must be in \[0, 1\].
    pub fn set_per_process_memory_fraction(&mut self, x: f64) -> Result<(), SettingsError> {
        let x = check_fraction(x).map_err(|r| invalid(Key::MemoryFraction, x, r))?;
        self.per_process_memory_fraction = Some(x);
        Ok(())
    }

    /// Sets every interval of [`Settings::roundup_power2_divisions`] to `divisions`, as
    /// `roundup_power2_divisions:divisions` would: it must be a power of two (so not 0; to
    /// turn rounding off, assign `[0; 16]` or use the list form).
    pub fn set_roundup_power2_divisions(&mut self, divisions: u64) -> Result<(), SettingsError> {
        let d = check_uniform_divisions(divisions)
            .map_err(|r| invalid(Key::RoundupDivisions, divisions, r))?;
        self.roundup_power2_divisions = [d; INTERVALS];
        Ok(())
    }

    /// The number of divisions for a request of `size` bytes: the entry of
    /// [`Settings::roundup_power2_divisions`] at index `clamp(floor(log2 size) − 20, 0, 15)`
    /// (index 0 for size 0).
    pub fn roundup_divisions_for(&self, size: u64) -> u64 {
        let log2 = size.checked_ilog2().unwrap_or(0);
        let index = log2.saturating_sub(FIRST_INTERVAL_LOG2) as usize;
        let index = index.min(INTERVALS - 1);
        self.roundup_power2_divisions
            .get(index)
            .copied()
            .unwrap_or(0)
    }

    /// Parses the value of `key` at the cursor into `self`.
    fn apply_value(&mut self, key: Key, cursor: &mut Cursor<'_>) -> Result<(), SettingsError> {
        match key {
            Key::MaxSplitSize => {
                let v = scalar(cursor, key)?;
                self.max_split_size =
                    check_size_mb(parse_u64(key, v)?).map_err(|r| invalid(key, v, r))?;
            }
            Key::MaxNonSplitRounding => {
                let v = scalar(cursor, key)?;
                self.max_non_split_rounding_size =
                    check_size_mb(parse_u64(key, v)?).map_err(|r| invalid(key, v, r))?;
            }
            Key::GcThreshold => {
                let v = scalar(cursor, key)?;
                self.garbage_collection_threshold =
                    check_gc_threshold(parse_f64(key, v)?).map_err(|r| invalid(key, v, r))?;
            }
            Key::RoundupDivisions => parse_divisions(cursor, &mut self.roundup_power2_divisions)?,
            Key::ExpandableSegments => self.expandable_segments = parse_bool(cursor, key)?,
            Key::MemoryFraction => {
                let v = scalar(cursor, key)?;
                let x = check_fraction(parse_f64(key, v)?).map_err(|r| invalid(key, v, r))?;
                self.per_process_memory_fraction = Some(x);
            }
            Key::ReleaseLock => self.release_lock_on_cudamalloc = parse_bool(cursor, key)?,
            Key::PinnedHostRegister => {
                self.pinned_use_cuda_host_register = parse_bool(cursor, key)?;
            }
            Key::PinnedThreads => {
                let v = scalar(cursor, key)?;
                self.pinned_num_register_threads =
                    check_register_threads(parse_u64(key, v)?).map_err(|r| invalid(key, v, r))?;
            }
            Key::PinnedBackground => self.pinned_use_background_threads = parse_bool(cursor, key)?,
            Key::ThreadCacheBlocks => {
                let v = scalar(cursor, key)?;
                let n = parse_u64(key, v)?;
                if n > u64::from(MAX_THREAD_CACHE_BLOCKS) {
                    return Err(invalid(key, v, "too large, must be <= 1024"));
                }
                self.thread_cache_blocks = n as u32;
            }
            Key::Backend => {
                let v = scalar(cursor, key)?;
                self.backend = match v {
                    "native" => AllocatorBackend::Native,
                    "cudaMallocAsync" => AllocatorBackend::CudaMallocAsync,
                    _ => return Err(invalid(key, v, "expected native or cudaMallocAsync")),
                };
            }
        }
        Ok(())
    }
}

/// [`Settings::from_env`] once the variable has been read.
fn from_env_value(var: &str, value: Option<std::ffi::OsString>) -> Result<Settings, SettingsError> {
    match value {
        None => Ok(Settings::default()),
        Some(v) => match v.to_str() {
            Some(s) => Settings::parse(s),
            None => Err(SettingsError::NotUnicode {
                var: var.to_owned(),
            }),
        },
    }
}

impl fmt::Display for Settings {
    /// The canonical configuration string: the keys whose value differs from PyTorch's
    /// defaults, in a fixed order, comma-separated without spaces (the empty string for the
    /// defaults). For any settings produced by [`Settings::parse`] (or the setters),
    /// `Settings::parse(&s.to_string()) == Ok(s)`. `roundup_power2_divisions` is printed in
    /// the compact form when all intervals hold the same power of two, else as a list that
    /// sets every interval explicitly.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = Settings::pytorch();
        let mut parts: Vec<String> = Vec::new();
        if self.max_split_size != d.max_split_size {
            parts.push(format!(
                "{}:{}",
                Key::MaxSplitSize.name(),
                self.max_split_size / MIB
            ));
        }
        if self.max_non_split_rounding_size != d.max_non_split_rounding_size {
            parts.push(format!(
                "{}:{}",
                Key::MaxNonSplitRounding.name(),
                self.max_non_split_rounding_size / MIB
            ));
        }
        if self.garbage_collection_threshold != d.garbage_collection_threshold {
            parts.push(format!(
                "{}:{}",
                Key::GcThreshold.name(),
                self.garbage_collection_threshold
            ));
        }
        if self.roundup_power2_divisions != d.roundup_power2_divisions {
            parts.push(format!(
                "{}:{}",
                Key::RoundupDivisions.name(),
                format_divisions(&self.roundup_power2_divisions)
            ));
        }
        let flags = [
            (
                Key::ExpandableSegments,
                self.expandable_segments,
                d.expandable_segments,
            ),
            (
                Key::ReleaseLock,
                self.release_lock_on_cudamalloc,
                d.release_lock_on_cudamalloc,
            ),
            (
                Key::PinnedHostRegister,
                self.pinned_use_cuda_host_register,
                d.pinned_use_cuda_host_register,
            ),
        ];
        for (key, value, default) in flags {
            if value != default {
                parts.push(format!("{}:{}", key.name(), bool_word(value)));
            }
        }
        if self.pinned_num_register_threads != d.pinned_num_register_threads {
            parts.push(format!(
                "{}:{}",
                Key::PinnedThreads.name(),
                self.pinned_num_register_threads
            ));
        }
        if self.pinned_use_background_threads != d.pinned_use_background_threads {
            parts.push(format!(
                "{}:{}",
                Key::PinnedBackground.name(),
                bool_word(self.pinned_use_background_threads)
            ));
        }
        if let Some(x) = self.per_process_memory_fraction {
            parts.push(format!("{}:{}", Key::MemoryFraction.name(), x));
        }
        if self.backend != d.backend {
            parts.push(format!("{}:{}", Key::Backend.name(), self.backend));
        }
        // cachalot's own key: omitted when equal to the default that `parse` starts from, so
        // that the defaults display as the empty string and every value round-trips.
        if self.thread_cache_blocks != THREAD_CACHE_BLOCKS {
            parts.push(format!(
                "{}:{}",
                Key::ThreadCacheBlocks.name(),
                self.thread_cache_blocks
            ));
        }
        f.write_str(&parts.join(","))
    }
}

/// `True` or `False`, as the configuration string spells them.
fn bool_word(b: bool) -> &'static str {
    if b { "True" } else { "False" }
}

/// The value of `roundup_power2_divisions` for a table: `N` when every interval holds the
/// same power of two `N`, else a list that sets every interval regardless of the table it is
/// applied over: the first entry ends the first run of equal values (and fills the intervals
/// below it), each interval after it up to the last run is written out, and `>` fills the last
/// run.
fn format_divisions(table: &[u64; INTERVALS]) -> String {
    let first = table[0];
    let last = table[INTERVALS - 1];
    // Index of the last interval of the first run of equal values.
    let first_end = table
        .iter()
        .position(|&d| d != first)
        .map_or(INTERVALS - 1, |p| p - 1);
    if first_end == INTERVALS - 1 && first.is_power_of_two() {
        return first.to_string();
    }
    let mut entries = vec![format!("{}:{}", 1u64 << first_end, first)];
    if first_end < INTERVALS - 1 {
        // Start of the last run of equal values; it lies after the first run.
        let last_start = table
            .iter()
            .rposition(|&d| d != last)
            .map_or(0, |p| p + 1)
            .max(first_end + 1);
        for (i, d) in table
            .iter()
            .enumerate()
            .take(last_start)
            .skip(first_end + 1)
        {
            entries.push(format!("{}:{}", 1u64 << i, d));
        }
        entries.push(format!(">:{last}"));
    }
    format!("[{}]", entries.join(","))
}

// ---------------------------------------------------------------------------------------------
// Keys and value checks
// ---------------------------------------------------------------------------------------------

/// The options of the configuration string.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Key {
    MaxSplitSize,
    MaxNonSplitRounding,
    GcThreshold,
    RoundupDivisions,
    ExpandableSegments,
    MemoryFraction,
    ReleaseLock,
    PinnedHostRegister,
    PinnedThreads,
    PinnedBackground,
    Backend,
    ThreadCacheBlocks,
}

impl Key {
    /// Every key.
    const ALL: [Key; 12] = [
        Key::MaxSplitSize,
        Key::MaxNonSplitRounding,
        Key::GcThreshold,
        Key::RoundupDivisions,
        Key::ExpandableSegments,
        Key::MemoryFraction,
        Key::ReleaseLock,
        Key::PinnedHostRegister,
        Key::PinnedThreads,
        Key::PinnedBackground,
        Key::Backend,
        Key::ThreadCacheBlocks,
    ];

    /// The key as written in a configuration string.
    fn name(self) -> &'static str {
        match self {
            Key::MaxSplitSize => "max_split_size_mb",
            Key::MaxNonSplitRounding => "max_non_split_rounding_mb",
            Key::GcThreshold => "garbage_collection_threshold",
            Key::RoundupDivisions => "roundup_power2_divisions",
            Key::ExpandableSegments => "expandable_segments",
            Key::MemoryFraction => "per_process_memory_fraction",
            Key::ReleaseLock => "release_lock_on_cudamalloc",
            Key::PinnedHostRegister => "pinned_use_cuda_host_register",
            Key::PinnedThreads => "pinned_num_register_threads",
            Key::PinnedBackground => "pinned_use_background_threads",
            Key::Backend => "backend",
            Key::ThreadCacheBlocks => "thread_cache_blocks",
        }
    }

    /// The key written `name`, if any.
    fn from_name(name: &str) -> Option<Key> {
        Key::ALL.into_iter().find(|k| k.name() == name)
    }
}

/// An [`SettingsError::InvalidValue`] for `key`.
fn invalid(key: Key, value: impl fmt::Display, reason: &str) -> SettingsError {
    SettingsError::InvalidValue {
        key: key.name().to_owned(),
        value: value.to_string(),
        reason: reason.to_owned(),
    }
}

/// A [`SettingsError::Syntax`] at the cursor's position.
fn syntax(key: Option<Key>, cursor: &Cursor<'_>, reason: &str) -> SettingsError {
    SettingsError::Syntax {
        key: key.map(|k| k.name().to_owned()),
        near: cursor.near(),
        reason: reason.to_owned(),
    }
}

/// `*_mb` sizes: at least 20, clamped so that the byte count fits; returns bytes.
fn check_size_mb(mb: u64) -> Result<u64, &'static str> {
    if mb < MIN_SIZE_MB {
        return Err("too small, must be >= 20");
    }
    Ok(mb.min(MAX_SIZE_MB) * MIB)
}

/// `garbage_collection_threshold`: the open interval (0, 1); NaN fails.
fn check_gc_threshold(x: f64) -> Result<f64, &'static str> {
    if x > 0.0 && x < 1.0 {
        Ok(x)
    } else {
        Err("must be in (0.0, 1.0)")
    }
}

/// `per_process_memory_fraction`: the closed interval [0, 1]; NaN fails; −0 becomes 0.
fn check_fraction(x: f64) -> Result<f64, &'static str> {
    if (0.0..=1.0).contains(&x) {
        Ok(x + 0.0)
    } else {
        Err("must be in [0.0, 1.0]")
    }
}

/// The compact form of `roundup_power2_divisions`: a power of two.
fn check_uniform_divisions(d: u64) -> Result<u64, &'static str> {
    if d.is_power_of_two() {
        Ok(d)
    } else {
        Err("must be a power of two")
    }
}

/// `pinned_num_register_threads`: a power of two, at most 128.
fn check_register_threads(n: u64) -> Result<u64, &'static str> {
    if !n.is_power_of_two() {
        Err("must be a power of two")
    } else if n > MAX_REGISTER_THREADS {
        Err("must be <= 128")
    } else {
        Ok(n)
    }
}

// ---------------------------------------------------------------------------------------------
// Lexing and parsing
// ---------------------------------------------------------------------------------------------

/// A token's kind.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Tok {
    Comma,
    Colon,
    Open,
    Close,
    /// A run of other characters, white space removed.
    Word(String),
}

/// A token and the byte offset of its first character in the string.
#[derive(Clone, Debug)]
struct Token {
    tok: Tok,
    pos: usize,
}

impl Token {
    /// The token as text.
    fn text(&self) -> &str {
        match &self.tok {
            Tok::Comma => ",",
            Tok::Colon => ":",
            Tok::Open => "[",
            Tok::Close => "]",
            Tok::Word(w) => w,
        }
    }
}

/// Cuts `s` into tokens as PyTorch's `ConfigTokenizer` does: `,` `:` `[` `]` are tokens of
/// their own, the characters C's `isspace` accepts are dropped, everything else builds words.
fn lex(s: &str) -> Vec<Token> {
    let mut tokens = Vec::new();
    let mut word = String::new();
    let mut word_pos = 0;
    for (pos, c) in s.char_indices() {
        let delimiter = match c {
            ',' => Some(Tok::Comma),
            ':' => Some(Tok::Colon),
            '[' => Some(Tok::Open),
            ']' => Some(Tok::Close),
            _ => None,
        };
        if let Some(tok) = delimiter {
            if !word.is_empty() {
                tokens.push(Token {
                    tok: Tok::Word(std::mem::take(&mut word)),
                    pos: word_pos,
                });
            }
            tokens.push(Token { tok, pos });
        } else if !matches!(c, ' ' | '\t' | '\n' | '\x0B' | '\x0C' | '\r') {
            if word.is_empty() {
                word_pos = pos;
            }
            word.push(c);
        }
    }
    if !word.is_empty() {
        tokens.push(Token {
            tok: Tok::Word(word),
            pos: word_pos,
        });
    }
    tokens
}

/// A position in a token list.
struct Cursor<'a> {
    tokens: &'a [Token],
    at: usize,
}

impl<'a> Cursor<'a> {
    /// The token at the position, if any.
    fn peek(&self) -> Option<&'a Token> {
        self.tokens.get(self.at)
    }

    /// The kind of the token at the position, if any.
    fn peek_tok(&self) -> Option<&'a Tok> {
        self.peek().map(|t| &t.tok)
    }

    /// Moves past the current token.
    fn advance(&mut self) {
        self.at = self.at.saturating_add(1).min(self.tokens.len());
    }

    /// Takes the current token if it is `tok`.
    fn eat(&mut self, tok: &Tok) -> bool {
        let found = self.peek_tok() == Some(tok);
        if found {
            self.advance();
        }
        found
    }

    /// Takes the current token if it is a word.
    fn word(&mut self) -> Option<&'a str> {
        match self.peek_tok() {
            Some(Tok::Word(w)) => {
                self.advance();
                Some(w)
            }
            _ => None,
        }
    }

    /// The current position, for error messages.
    fn near(&self) -> String {
        match self.peek() {
            Some(t) => format!("\"{}\" at byte {}", t.text(), t.pos),
            None => "end of input".to_owned(),
        }
    }
}

/// The single-word value of `key`.
fn scalar<'a>(cursor: &mut Cursor<'a>, key: Key) -> Result<&'a str, SettingsError> {
    match cursor.peek_tok() {
        Some(Tok::Word(w)) => {
            cursor.advance();
            Ok(w)
        }
        Some(Tok::Open) => Err(invalid(
            key,
            "[",
            "a list is only accepted by roundup_power2_divisions",
        )),
        None | Some(Tok::Comma) => Err(SettingsError::MissingValue {
            key: key.name().to_owned(),
        }),
        Some(_) => Err(syntax(Some(key), cursor, "expected a value")),
    }
}

/// `True` or `False` (PyTorch's spelling exactly).
fn parse_bool(cursor: &mut Cursor<'_>, key: Key) -> Result<bool, SettingsError> {
    let v = scalar(cursor, key)?;
    match v {
        "True" => Ok(true),
        "False" => Ok(false),
        _ => Err(invalid(key, v, "expected True or False")),
    }
}

/// A non-negative decimal integer written with digits only, fitting in 64 bits.
fn parse_u64(key: Key, text: &str) -> Result<u64, SettingsError> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(invalid(key, text, "expected a non-negative integer"));
    }
    text.parse::<u64>()
        .map_err(|_| invalid(key, text, "too large, does not fit in 64 bits"))
}

/// A finite decimal number: optional sign, digits with an optional fraction, optional
/// exponent. No `inf`, `nan` or hexadecimal forms.
fn parse_f64(key: Key, text: &str) -> Result<f64, SettingsError> {
    if !is_decimal(text) {
        return Err(invalid(key, text, "expected a decimal number"));
    }
    match text.parse::<f64>() {
        Ok(x) if x.is_finite() => Ok(x),
        Ok(_) => Err(invalid(key, text, "out of range")),
        Err(_) => Err(invalid(key, text, "expected a decimal number")),
    }
}

/// Whether `s` is `[+-]? (digits [. digits?] | . digits) ([eE] [+-]? digits)?`.
fn is_decimal(s: &str) -> bool {
    let mut rest = s.strip_prefix(['+', '-']).unwrap_or(s);
    let take_digits = |r: &mut &str| {
        let n = r.bytes().take_while(u8::is_ascii_digit).count();
        *r = r.get(n..).unwrap_or("");
        n
    };
    let mut digits = take_digits(&mut rest);
    if let Some(r) = rest.strip_prefix('.') {
        rest = r;
        digits += take_digits(&mut rest);
    }
    if digits == 0 {
        return false;
    }
    if let Some(r) = rest.strip_prefix(['e', 'E']) {
        rest = r.strip_prefix(['+', '-']).unwrap_or(r);
        if take_digits(&mut rest) == 0 {
            return false;
        }
    }
    rest.is_empty()
}

/// The value of `roundup_power2_divisions`: a power of two for every interval, or a list.
fn parse_divisions(
    cursor: &mut Cursor<'_>,
    table: &mut [u64; INTERVALS],
) -> Result<(), SettingsError> {
    let key = Key::RoundupDivisions;
    if cursor.eat(&Tok::Open) {
        return parse_division_list(cursor, table);
    }
    let v = scalar(cursor, key)?;
    let d = check_uniform_divisions(parse_u64(key, v)?).map_err(|r| invalid(key, v, r))?;
    *table = [d; INTERVALS];
    Ok(())
}

/// The list form of `roundup_power2_divisions`, after its `[`; see the module documentation.
fn parse_division_list(
    cursor: &mut Cursor<'_>,
    table: &mut [u64; INTERVALS],
) -> Result<(), SettingsError> {
    let key = Key::RoundupDivisions;
    if cursor.peek_tok() == Some(&Tok::Close) {
        return Err(invalid(key, "[]", "the list is empty"));
    }
    let unclosed = "unclosed '[': expected ']'";
    let mut first_value = true;
    let mut last_index = 0usize;
    loop {
        let Some(interval) = cursor.word() else {
            let reason = if cursor.peek().is_none() {
                unclosed
            } else {
                "expected an interval size in MB or '>'"
            };
            return Err(syntax(Some(key), cursor, reason));
        };
        if !cursor.eat(&Tok::Colon) {
            return Err(syntax(
                Some(key),
                cursor,
                "expected ':' after the interval size",
            ));
        }
        let Some(value) = cursor.word() else {
            return Err(syntax(
                Some(key),
                cursor,
                "expected the number of divisions after ':'",
            ));
        };
        let divisions = parse_u64(key, value)?;
        if divisions != 0 && !divisions.is_power_of_two() {
            return Err(invalid(
                key,
                value,
                "the number of divisions must be 0 or a power of two",
            ));
        }
        if interval == ">" {
            for d in table.iter_mut().skip(last_index.saturating_add(1)) {
                *d = divisions;
            }
        } else {
            if interval.is_empty() || !interval.bytes().all(|b| b.is_ascii_digit()) {
                return Err(invalid(
                    key,
                    interval,
                    "an interval must be a size in MB or '>'",
                ));
            }
            let Ok(size_mb) = interval.parse::<u64>() else {
                return Err(invalid(key, interval, "too large, does not fit in 64 bits"));
            };
            if !size_mb.is_power_of_two() {
                return Err(invalid(
                    key,
                    interval,
                    "an interval size (in MB) must be a power of two",
                ));
            }
            let index = (size_mb.ilog2() as usize).min(INTERVALS - 1);
            if first_value {
                for d in table.iter_mut().take(index) {
                    *d = divisions;
                }
                first_value = false;
            }
            if let Some(d) = table.get_mut(index) {
                *d = divisions;
            }
            last_index = index;
        }
        match cursor.peek_tok() {
            Some(Tok::Comma) => {
                cursor.advance();
                if cursor.peek_tok() == Some(&Tok::Close) {
                    return Err(syntax(Some(key), cursor, "trailing ',' in the list"));
                }
            }
            Some(Tok::Close) => {
                cursor.advance();
                return Ok(());
            }
            None => return Err(syntax(Some(key), cursor, unclosed)),
            Some(_) => {
                return Err(syntax(
                    Some(key),
                    cursor,
                    "expected ',' or ']' after a list entry",
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MB: u64 = 1 << 20;

    fn parse(s: &str) -> Settings {
        match Settings::parse(s) {
            Ok(settings) => settings,
            Err(e) => panic!("{s:?} should parse, got: {e}"),
        }
    }

    fn err(s: &str) -> SettingsError {
        match Settings::parse(s) {
            Ok(settings) => panic!("{s:?} should be refused, parsed to {settings:?}"),
            Err(e) => e,
        }
    }

    /// Asserts that `s` is refused as an invalid value for `key` with `reason`.
    #[track_caller]
    fn assert_invalid(s: &str, key: &str, value: &str, reason: &str) {
        assert_eq!(
            err(s),
            SettingsError::InvalidValue {
                key: key.into(),
                value: value.into(),
                reason: reason.into()
            },
            "for {s:?}"
        );
    }

    /// Asserts that `s` is refused as a syntax error in `key` whose reason contains `reason`.
    #[track_caller]
    fn assert_syntax(s: &str, key: Option<&str>, reason: &str) {
        match err(s) {
            SettingsError::Syntax {
                key: k, reason: r, ..
            } => {
                assert_eq!(k.as_deref(), key, "key for {s:?}");
                assert!(r.contains(reason), "reason {r:?} for {s:?}");
            }
            e => panic!("{s:?}: expected a syntax error, got {e:?}"),
        }
    }

    fn divisions(entries: &[(std::ops::RangeInclusive<usize>, u64)]) -> [u64; 16] {
        let mut t = [0; 16];
        for (range, d) in entries {
            for i in range.clone() {
                t[i] = *d;
            }
        }
        t
    }

    // --- defaults -----------------------------------------------------------------------------

    #[test]
    fn pytorch_defaults_are_those_of_pytorch_2() {
        let d = Settings::pytorch();
        assert_eq!(d.max_split_size, u64::MAX);
        assert_eq!(d.max_non_split_rounding_size, 20 * MB);
        assert_eq!(d.garbage_collection_threshold, 0.0);
        assert_eq!(d.roundup_power2_divisions, [0; 16]);
        assert!(!d.expandable_segments);
        assert_eq!(d.per_process_memory_fraction, None);
        assert!(!d.release_lock_on_cudamalloc);
        assert!(!d.pinned_use_cuda_host_register);
        assert_eq!(d.pinned_num_register_threads, 1);
        assert!(!d.pinned_use_background_threads);
        assert_eq!(d.backend, AllocatorBackend::Native);
    }

    #[test]
    fn cachalot_defaults_differ_from_pytorchs_only_in_the_thread_caches() {
        // Display omits keys equal to PyTorch's defaults while parse starts from cachalot's:
        // the one key where they differ, thread_cache_blocks, is compared with cachalot's.
        assert_eq!(Settings::default(), Settings::cachalot());
        assert_eq!(
            Settings::cachalot(),
            Settings {
                thread_cache_blocks: THREAD_CACHE_BLOCKS,
                ..Settings::pytorch()
            }
        );
        assert_eq!(Settings::pytorch().thread_cache_blocks, 0);
    }

    #[test]
    fn empty_and_blank_strings_give_the_defaults() {
        for s in ["", " ", "   ", "\t\n \r"] {
            assert_eq!(parse(s), Settings::default(), "for {s:?}");
        }
    }

    // --- PyTorch's documented examples ------------------------------------------------------

    #[test]
    fn max_split_size_mb_is_stored_in_bytes() {
        assert_eq!(parse("max_split_size_mb:128").max_split_size, 128 * MB);
        assert_eq!(parse("max_split_size_mb:20").max_split_size, 20 * MB);
    }

    #[test]
    fn the_tuning_guide_example_sets_both_keys() {
        let s = parse("garbage_collection_threshold:0.6,max_split_size_mb:128");
        assert_eq!(s.garbage_collection_threshold, 0.6);
        assert_eq!(s.max_split_size, 128 * MB);
        assert_eq!(
            s,
            Settings {
                garbage_collection_threshold: 0.6,
                max_split_size: 128 * MB,
                ..Settings::cachalot()
            }
        );
    }

    #[test]
    fn max_non_split_rounding_mb_is_stored_in_bytes() {
        assert_eq!(
            parse("max_non_split_rounding_mb:1024").max_non_split_rounding_size,
            1024 * MB
        );
    }

    #[test]
    fn a_single_division_count_applies_to_every_interval() {
        assert_eq!(
            parse("roundup_power2_divisions:4").roundup_power2_divisions,
            [4; 16]
        );
    }

    #[test]
    fn the_documented_division_list_fills_below_the_first_entry_and_after_the_last() {
        // 0..=8 (sizes below 512 MiB) get 1, 9 gets 2, 10 gets 4 and '>' fills 11..=15.
        let s = parse("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]");
        assert_eq!(
            s.roundup_power2_divisions,
            divisions(&[(0..=8, 1), (9..=9, 2), (10..=10, 4), (11..=15, 8)])
        );
        assert_eq!(s.roundup_divisions_for(100 * MB), 1);
        assert_eq!(s.roundup_divisions_for(300 * MB), 1);
        assert_eq!(s.roundup_divisions_for(600 * MB), 2);
        assert_eq!(s.roundup_divisions_for(1024 * MB), 4);
        assert_eq!(s.roundup_divisions_for(2048 * MB), 8);
    }

    #[test]
    fn pytorchs_own_unit_test_lists_give_its_expected_divisions() {
        // c10/test/core/AllocatorConfig_test.cpp
        let s = parse("roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1]");
        for (mb, d) in [
            (32, 8),
            (64, 8),
            (128, 2),
            (256, 4),
            (512, 2),
            (1024, 4),
            (2048, 1),
            (4096, 1),
            (8192, 1),
        ] {
            assert_eq!(s.roundup_divisions_for(mb * MB), d, "{mb} MB");
        }
        // An interval no entry reaches keeps its previous value (here 0), not its neighbour's.
        let s = parse("roundup_power2_divisions:[128:8,256:16,512:1,2048:8,>:2]");
        for (mb, d) in [
            (64, 8),
            (128, 8),
            (256, 16),
            (512, 1),
            (1024, 0),
            (2048, 8),
            (4096, 2),
        ] {
            assert_eq!(s.roundup_divisions_for(mb * MB), d, "{mb} MB");
        }
    }

    #[test]
    fn division_list_keys_are_clamped_to_the_sixteen_intervals() {
        // 1 MB is interval 0; 2^20 MB (beyond 64 GiB) clamps to 15.
        let s = parse("roundup_power2_divisions:[1:2,1048576:4]");
        assert_eq!(
            s.roundup_power2_divisions,
            divisions(&[(0..=0, 2), (15..=15, 4)])
        );
    }

    #[test]
    fn a_leading_greater_than_entry_fills_after_interval_zero_only() {
        let s = parse("roundup_power2_divisions:[>:8]");
        assert_eq!(s.roundup_power2_divisions, divisions(&[(1..=15, 8)]));
        // '>' does not count as the first value: a later numeric entry still fills below.
        let s = parse("roundup_power2_divisions:[>:8,256:1]");
        assert_eq!(
            s.roundup_power2_divisions,
            divisions(&[(0..=8, 1), (9..=15, 8)])
        );
    }

    #[test]
    fn zero_divisions_are_allowed_in_the_list_form() {
        let s = parse("roundup_power2_divisions:[256:0,>:4]");
        assert_eq!(s.roundup_power2_divisions, divisions(&[(9..=15, 4)]));
    }

    #[test]
    fn boolean_keys_and_the_backend_are_read() {
        let s = parse(
            "expandable_segments:True,release_lock_on_cudamalloc:True,\
             pinned_use_cuda_host_register:True,pinned_num_register_threads:8,\
             pinned_use_background_threads:True,backend:cudaMallocAsync",
        );
        assert!(s.expandable_segments);
        assert!(s.release_lock_on_cudamalloc);
        assert!(s.pinned_use_cuda_host_register);
        assert_eq!(s.pinned_num_register_threads, 8);
        assert!(s.pinned_use_background_threads);
        assert_eq!(s.backend, AllocatorBackend::CudaMallocAsync);
        let s = s
            .apply("expandable_segments:False,backend:native")
            .expect("valid");
        assert!(!s.expandable_segments);
        assert_eq!(s.backend, AllocatorBackend::Native);
    }

    #[test]
    fn per_process_memory_fraction_accepts_both_ends() {
        assert_eq!(
            parse("per_process_memory_fraction:0").per_process_memory_fraction,
            Some(0.0)
        );
        assert_eq!(
            parse("per_process_memory_fraction:1").per_process_memory_fraction,
            Some(1.0)
        );
        assert_eq!(
            parse("per_process_memory_fraction:0.92").per_process_memory_fraction,
            Some(0.92)
        );
    }

    #[test]
    fn white_space_is_dropped_even_inside_words() {
        let s = parse(" max_split_size_mb : 2 0 ,\texpandable_segments:\nTrue ");
        assert_eq!(s.max_split_size, 20 * MB);
        assert!(s.expandable_segments);
    }

    #[test]
    fn a_repeated_key_takes_its_last_value() {
        assert_eq!(
            parse("max_split_size_mb:100,max_split_size_mb:200").max_split_size,
            200 * MB
        );
    }

    #[test]
    fn huge_split_sizes_are_clamped_to_the_largest_whole_mebibyte_count() {
        let s = parse("max_split_size_mb:18446744073709551615");
        assert_eq!(s.max_split_size, (u64::MAX / MB) * MB);
        assert_ne!(s.max_split_size, u64::MAX);
    }

    #[test]
    fn decimal_forms_with_exponents_and_bare_points_are_accepted() {
        assert_eq!(
            parse("garbage_collection_threshold:5e-1").garbage_collection_threshold,
            0.5
        );
        assert_eq!(
            parse("garbage_collection_threshold:.25").garbage_collection_threshold,
            0.25
        );
        assert_eq!(
            parse("per_process_memory_fraction:1.").per_process_memory_fraction,
            Some(1.0)
        );
    }

    // --- apply -----------------------------------------------------------------------------

    #[test]
    fn apply_keeps_what_the_string_does_not_mention() {
        let base = parse("max_split_size_mb:64,roundup_power2_divisions:4");
        let s = base.apply("expandable_segments:True").expect("valid");
        assert_eq!(s.max_split_size, 64 * MB);
        assert_eq!(s.roundup_power2_divisions, [4; 16]);
        assert!(s.expandable_segments);
        // The list form is layered over the current table.
        let s = base
            .apply("roundup_power2_divisions:[256:1]")
            .expect("valid");
        assert_eq!(
            s.roundup_power2_divisions,
            divisions(&[(0..=8, 1), (9..=15, 4)])
        );
        // Nothing is applied when the string is refused.
        assert!(base.apply("expandable_segments:True,bogus:1").is_err());
        assert!(!base.expandable_segments);
    }

    // --- errors: values ---------------------------------------------------------------------

    #[test]
    fn split_sizes_below_twenty_megabytes_are_refused() {
        for key in ["max_split_size_mb", "max_non_split_rounding_mb"] {
            assert_invalid(&format!("{key}:19"), key, "19", "too small, must be >= 20");
            assert_invalid(&format!("{key}:0"), key, "0", "too small, must be >= 20");
        }
    }

    #[test]
    fn integers_must_be_plain_digits_that_fit_in_64_bits() {
        let key = "max_split_size_mb";
        for bad in ["12abc", "-1", "+30", "0x20", "1e3", "30.0", "abc"] {
            assert_invalid(
                &format!("{key}:{bad}"),
                key,
                bad,
                "expected a non-negative integer",
            );
        }
        assert_invalid(
            "max_split_size_mb:18446744073709551616",
            key,
            "18446744073709551616",
            "too large, does not fit in 64 bits",
        );
        assert_invalid(
            "pinned_num_register_threads:4x",
            "pinned_num_register_threads",
            "4x",
            "expected a non-negative integer",
        );
    }

    #[test]
    fn garbage_collection_threshold_must_be_strictly_between_zero_and_one() {
        let key = "garbage_collection_threshold";
        for bad in ["0.0", "0", "1.0", "1", "1.5", "-0.1", "1e999"] {
            let reason = if bad == "1e999" {
                "out of range"
            } else {
                "must be in (0.0, 1.0)"
            };
            assert_invalid(&format!("{key}:{bad}"), key, bad, reason);
        }
        for bad in [
            "nan", "NaN", "inf", "-inf", "infinity", "0x1p-1", "0.5abc", "e5", ".", "5e",
        ] {
            assert_invalid(
                &format!("{key}:{bad}"),
                key,
                bad,
                "expected a decimal number",
            );
        }
    }

    #[test]
    fn per_process_memory_fraction_must_be_within_zero_and_one() {
        let key = "per_process_memory_fraction";
        for bad in ["1.01", "-0.01", "2"] {
            assert_invalid(&format!("{key}:{bad}"), key, bad, "must be in [0.0, 1.0]");
        }
        assert_invalid(
            &format!("{key}:nan"),
            key,
            "nan",
            "expected a decimal number",
        );
    }

    #[test]
    fn a_single_division_count_must_be_a_power_of_two() {
        let key = "roundup_power2_divisions";
        for bad in ["0", "3", "6"] {
            assert_invalid(&format!("{key}:{bad}"), key, bad, "must be a power of two");
        }
    }

    #[test]
    fn division_list_entries_are_checked() {
        let key = "roundup_power2_divisions";
        assert_invalid(
            "roundup_power2_divisions:[3:1]",
            key,
            "3",
            "an interval size (in MB) must be a power of two",
        );
        assert_invalid(
            "roundup_power2_divisions:[0:1]",
            key,
            "0",
            "an interval size (in MB) must be a power of two",
        );
        assert_invalid(
            "roundup_power2_divisions:[abc:1]",
            key,
            "abc",
            "an interval must be a size in MB or '>'",
        );
        assert_invalid(
            "roundup_power2_divisions:[>>:1]",
            key,
            ">>",
            "an interval must be a size in MB or '>'",
        );
        assert_invalid(
            "roundup_power2_divisions:[256:3]",
            key,
            "3",
            "the number of divisions must be 0 or a power of two",
        );
        assert_invalid(
            "roundup_power2_divisions:[256:1x]",
            key,
            "1x",
            "expected a non-negative integer",
        );
        assert_invalid(
            "roundup_power2_divisions:[99999999999999999999:1]",
            key,
            "99999999999999999999",
            "too large, does not fit in 64 bits",
        );
        assert_invalid(
            "roundup_power2_divisions:[]",
            key,
            "[]",
            "the list is empty",
        );
    }

    #[test]
    fn booleans_are_spelled_exactly_true_or_false() {
        for key in [
            "expandable_segments",
            "release_lock_on_cudamalloc",
            "pinned_use_cuda_host_register",
            "pinned_use_background_threads",
        ] {
            for bad in ["true", "1", "yes", "FALSE"] {
                assert_invalid(&format!("{key}:{bad}"), key, bad, "expected True or False");
            }
        }
    }

    #[test]
    fn register_threads_must_be_a_power_of_two_up_to_128() {
        let key = "pinned_num_register_threads";
        assert_invalid(&format!("{key}:3"), key, "3", "must be a power of two");
        assert_invalid(&format!("{key}:0"), key, "0", "must be a power of two");
        assert_invalid(&format!("{key}:256"), key, "256", "must be <= 128");
        assert_eq!(
            parse("pinned_num_register_threads:128").pinned_num_register_threads,
            128
        );
    }

    #[test]
    fn the_backend_is_native_or_cuda_malloc_async() {
        for bad in ["cudamallocasync", "hipMallocAsync", "async", "Native"] {
            assert_invalid(
                &format!("backend:{bad}"),
                "backend",
                bad,
                "expected native or cudaMallocAsync",
            );
        }
    }

    #[test]
    fn a_list_is_refused_for_keys_other_than_the_divisions() {
        assert_invalid(
            "max_split_size_mb:[20]",
            "max_split_size_mb",
            "[",
            "a list is only accepted by roundup_power2_divisions",
        );
    }

    // --- errors: keys and syntax ----------------------------------------------------------

    #[test]
    fn unknown_keys_are_refused_by_name() {
        for key in [
            "foo",
            "max_split_size",
            "Max_split_size_mb",
            "release_lock_on_hipmalloc",
            "large_segment_size_mb",
            "max_split_size_mb20",
        ] {
            assert_eq!(
                err(&format!("{key}:1")),
                SettingsError::UnknownKey { key: key.into() }
            );
        }
        // "max_split_size_mb 20" lexes as one word.
        assert_eq!(
            err("max_split_size_mb 20"),
            SettingsError::UnknownKey {
                key: "max_split_size_mb20".into()
            }
        );
        // A later unknown key is found after valid ones.
        assert_eq!(
            err("max_split_size_mb:20,garbage:1"),
            SettingsError::UnknownKey {
                key: "garbage".into()
            }
        );
    }

    #[test]
    fn empty_values_are_refused_as_missing() {
        for s in [
            "max_split_size_mb:",
            "max_split_size_mb:,expandable_segments:True",
            "expandable_segments:",
            "roundup_power2_divisions:",
            "backend: ",
        ] {
            let key = s.split(':').next().unwrap_or_default();
            assert_eq!(
                err(s),
                SettingsError::MissingValue { key: key.into() },
                "for {s:?}"
            );
        }
    }

    #[test]
    fn a_key_without_a_colon_is_a_syntax_error() {
        assert_syntax(
            "max_split_size_mb",
            Some("max_split_size_mb"),
            "expected ':'",
        );
        assert_syntax(
            "expandable_segments,True",
            Some("expandable_segments"),
            "expected ':'",
        );
        assert_syntax("backend[native]", Some("backend"), "expected ':'");
        assert_syntax(
            "max_split_size_mb::20",
            Some("max_split_size_mb"),
            "expected a value",
        );
    }

    #[test]
    fn stray_commas_are_syntax_errors() {
        assert_syntax(
            "max_split_size_mb:20,",
            None,
            "expected an option name after ','",
        );
        assert_syntax(",max_split_size_mb:20", None, "expected an option name");
        assert_syntax(
            "max_split_size_mb:20,,expandable_segments:True",
            None,
            "expected an option name",
        );
        assert_syntax(",", None, "expected an option name");
        assert_syntax(":", None, "expected an option name");
        assert_syntax("]", None, "expected an option name");
    }

    #[test]
    fn a_value_must_be_followed_by_a_comma_or_the_end() {
        assert_syntax(
            "max_split_size_mb:20:30",
            Some("max_split_size_mb"),
            "expected ','",
        );
        assert_syntax(
            "roundup_power2_divisions:[256:1]]",
            Some("roundup_power2_divisions"),
            "expected ','",
        );
        assert_syntax(
            "roundup_power2_divisions:4[",
            Some("roundup_power2_divisions"),
            "expected ','",
        );
    }

    #[test]
    fn malformed_division_lists_are_syntax_errors() {
        let key = Some("roundup_power2_divisions");
        for (s, reason) in [
            ("roundup_power2_divisions:[", "unclosed '['"),
            ("roundup_power2_divisions:[256:1", "unclosed '['"),
            ("roundup_power2_divisions:[256:1,", "unclosed '['"),
            ("roundup_power2_divisions:[256:1,]", "trailing ','"),
            ("roundup_power2_divisions:[256]", "expected ':'"),
            (
                "roundup_power2_divisions:[256:]",
                "expected the number of divisions",
            ),
            ("roundup_power2_divisions:[256:1:2]", "expected ',' or ']'"),
            (
                "roundup_power2_divisions:[[256:1]]",
                "expected an interval size",
            ),
            (
                "roundup_power2_divisions:[,256:1]",
                "expected an interval size",
            ),
            (
                "roundup_power2_divisions:[256:[1]]",
                "expected the number of divisions",
            ),
        ] {
            assert_syntax(s, key, reason);
        }
    }

    #[test]
    fn a_missing_comma_in_a_list_glues_the_words_together_as_in_pytorch() {
        // White space is dropped inside words, so "1 512" is the word "1512".
        assert_invalid(
            "roundup_power2_divisions:[256:1 512:2]",
            "roundup_power2_divisions",
            "1512",
            "the number of divisions must be 0 or a power of two",
        );
    }

    #[test]
    fn syntax_errors_say_where_they_are() {
        match err("max_split_size_mb:20;x") {
            SettingsError::UnknownKey { .. } | SettingsError::InvalidValue { .. } => {}
            e => panic!("unexpected {e:?}"),
        }
        match err("max_split_size_mb:20 ,") {
            SettingsError::Syntax { near, .. } => assert_eq!(near, "end of input"),
            e => panic!("unexpected {e:?}"),
        }
        match err("max_split_size_mb:20,]") {
            SettingsError::Syntax { near, .. } => assert_eq!(near, "\"]\" at byte 21"),
            e => panic!("unexpected {e:?}"),
        }
    }

    #[test]
    fn error_messages_name_the_key_and_the_reason() {
        assert_eq!(
            err("garbage_collection_threshold:0.0").to_string(),
            "invalid value \"0.0\" for garbage_collection_threshold: must be in (0.0, 1.0)"
        );
        assert_eq!(err("foo:1").to_string(), "unrecognized option \"foo\"");
        assert_eq!(err("backend:").to_string(), "missing value for backend");
        assert_eq!(
            err("max_split_size_mb").to_string(),
            "syntax error in max_split_size_mb near end of input: \
             expected ':' after the option name"
        );
        assert_eq!(
            err(",").to_string(),
            "syntax error near \",\" at byte 0: expected an option name"
        );
    }

    // --- setters ---------------------------------------------------------------------------

    #[test]
    fn setters_accept_what_the_string_form_accepts() {
        let mut s = Settings::default();
        s.set_max_split_size_mb(64).expect("valid");
        s.set_garbage_collection_threshold(0.8).expect("valid");
        s.set_per_process_memory_fraction(0.5).expect("valid");
        s.set_roundup_power2_divisions(8).expect("valid");
        assert_eq!(
            s,
            parse(
                "max_split_size_mb:64,garbage_collection_threshold:0.8,\
                 per_process_memory_fraction:0.5,roundup_power2_divisions:8"
            )
        );
        s.set_max_split_size_mb(u64::MAX).expect("valid");
        assert_eq!(s.max_split_size, (u64::MAX / MB) * MB);
    }

    #[test]
    fn setters_refuse_what_the_string_form_refuses_and_change_nothing() {
        let mut s = Settings::default();
        assert_eq!(
            s.set_max_split_size_mb(19),
            Err(SettingsError::InvalidValue {
                key: "max_split_size_mb".into(),
                value: "19".into(),
                reason: "too small, must be >= 20".into()
            })
        );
        for x in [0.0, 1.0, -0.5, f64::NAN, f64::INFINITY] {
            assert!(
                matches!(s.set_garbage_collection_threshold(x),
                    Err(SettingsError::InvalidValue { ref key, .. }) if key == "garbage_collection_threshold"),
                "{x}"
            );
        }
        for x in [-0.01, 1.01, f64::NAN] {
            assert!(
                matches!(s.set_per_process_memory_fraction(x),
                    Err(SettingsError::InvalidValue { ref key, .. }) if key == "per_process_memory_fraction"),
                "{x}"
            );
        }
        for d in [0, 3, 12] {
            assert_eq!(
                s.set_roundup_power2_divisions(d),
                Err(SettingsError::InvalidValue {
                    key: "roundup_power2_divisions".into(),
                    value: d.to_string(),
                    reason: "must be a power of two".into()
                })
            );
        }
        assert_eq!(s, Settings::default());
    }

    #[test]
    fn negative_zero_fraction_is_stored_as_zero() {
        let mut s = Settings::default();
        s.set_per_process_memory_fraction(-0.0).expect("valid");
        assert!(
            s.per_process_memory_fraction
                .is_some_and(|x| x.is_sign_positive())
        );
    }

    // --- roundup_divisions_for ---------------------------------------------------------------

    #[test]
    fn divisions_for_a_size_use_its_power_of_two_interval() {
        let mut s = Settings::default();
        for (i, d) in s.roundup_power2_divisions.iter_mut().enumerate() {
            *d = i as u64 + 100;
        }
        for (size, index) in [
            (0, 0),
            (1, 0),
            (MB - 1, 0),
            (MB, 0),
            (2 * MB - 1, 0),
            (2 * MB, 1),
            (256 * MB, 8),
            (512 * MB - 1, 8),
            (32 << 30, 15),
            ((64 << 30) - 1, 15),
            (64 << 30, 15),
            (u64::MAX, 15),
        ] {
            assert_eq!(s.roundup_divisions_for(size), index + 100, "size {size}");
        }
    }

    // --- from_env --------------------------------------------------------------------------

    #[test]
    fn from_env_gives_the_defaults_for_an_unset_or_impossible_variable() {
        assert_eq!(
            Settings::from_env("CACHALOT_SETTINGS_TEST_SURELY_UNSET_5f1c"),
            Ok(Settings::default())
        );
        for name in ["", "A=B", "A\0B"] {
            assert_eq!(Settings::from_env(name), Ok(Settings::default()));
        }
    }

    #[test]
    fn from_env_parses_the_value_and_refuses_non_unicode() {
        use std::ffi::OsString;
        assert_eq!(
            from_env_value("V", Some(OsString::new())),
            Ok(Settings::default())
        );
        assert_eq!(
            from_env_value("V", Some("expandable_segments:True".into())),
            Ok(parse("expandable_segments:True"))
        );
        assert_eq!(
            from_env_value("V", Some("nope:1".into())),
            Err(SettingsError::UnknownKey { key: "nope".into() })
        );
        #[cfg(unix)]
        {
            use std::os::unix::ffi::OsStringExt;
            assert_eq!(
                from_env_value("V", Some(OsString::from_vec(vec![0xff, 0xfe]))),
                Err(SettingsError::NotUnicode { var: "V".into() })
            );
        }
    }

    // --- Display ---------------------------------------------------------------------------

    #[test]
    fn the_defaults_display_as_the_empty_string() {
        assert_eq!(Settings::default().to_string(), "");
        // PyTorch's settings differ from cachalot's in the thread caches only.
        assert_eq!(Settings::pytorch().to_string(), "thread_cache_blocks:0");
        assert_eq!(
            Settings::parse("thread_cache_blocks:0"),
            Ok(Settings::pytorch())
        );
        assert_eq!(
            Settings::parse("thread_cache_blocks:1025").unwrap_err(),
            SettingsError::InvalidValue {
                key: "thread_cache_blocks".into(),
                value: "1025".into(),
                reason: "too large, must be <= 1024".into()
            }
        );
    }

    #[test]
    fn hand_written_settings_display_canonically_and_parse_back() {
        for (input, canonical) in [
            ("max_split_size_mb:128", "max_split_size_mb:128"),
            (
                " garbage_collection_threshold : 0.60 , max_split_size_mb : 0128 ",
                "max_split_size_mb:128,garbage_collection_threshold:0.6",
            ),
            ("roundup_power2_divisions:4", "roundup_power2_divisions:4"),
            (
                "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]",
                "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]",
            ),
            (
                "roundup_power2_divisions:[32768:2]",
                "roundup_power2_divisions:2",
            ),
            (
                "roundup_power2_divisions:[128:8,256:16,512:1,2048:8,>:2]",
                "roundup_power2_divisions:[128:8,256:16,512:1,1024:0,2048:8,>:2]",
            ),
            (
                "roundup_power2_divisions:[>:8]",
                "roundup_power2_divisions:[1:0,>:8]",
            ),
            (
                "roundup_power2_divisions:[16384:4,>:1]",
                "roundup_power2_divisions:[16384:4,>:1]",
            ),
            (
                "roundup_power2_divisions:[1:1,2:0]",
                "roundup_power2_divisions:[1:1,>:0]",
            ),
            (
                "backend:cudaMallocAsync,expandable_segments:True,per_process_memory_fraction:1",
                "expandable_segments:True,per_process_memory_fraction:1,backend:cudaMallocAsync",
            ),
            (
                "pinned_num_register_threads:8,pinned_use_cuda_host_register:True,\
                 pinned_use_background_threads:True,release_lock_on_cudamalloc:True,\
                 max_non_split_rounding_mb:1024",
                "max_non_split_rounding_mb:1024,release_lock_on_cudamalloc:True,\
                 pinned_use_cuda_host_register:True,pinned_num_register_threads:8,\
                 pinned_use_background_threads:True",
            ),
            (
                "per_process_memory_fraction:0",
                "per_process_memory_fraction:0",
            ),
            ("expandable_segments:False", ""),
            (
                "max_split_size_mb:99999999999999999",
                "max_split_size_mb:17592186044415",
            ),
        ] {
            let s = parse(input);
            assert_eq!(s.to_string(), canonical, "display of {input:?}");
            assert_eq!(parse(canonical), s, "parse of {canonical:?}");
        }
    }

    #[test]
    fn displayed_lists_do_not_depend_on_the_table_they_are_applied_over() {
        let s = parse("roundup_power2_divisions:[128:8,256:16,512:1,2048:8,>:2]");
        let base = parse("roundup_power2_divisions:64");
        assert_eq!(base.apply(&s.to_string()), Ok(s.clone()));
    }

    // --- properties ------------------------------------------------------------------------

    /// Words and punctuation of the language, glued at random.
    fn token_soup() -> impl Strategy<Value = String> {
        let atoms = prop::sample::select(vec![
            "max_split_size_mb",
            "max_non_split_rounding_mb",
            "roundup_power2_divisions",
            "garbage_collection_threshold",
            "expandable_segments",
            "per_process_memory_fraction",
            "release_lock_on_cudamalloc",
            "pinned_use_cuda_host_register",
            "pinned_num_register_threads",
            "pinned_use_background_threads",
            "backend",
            "native",
            "cudaMallocAsync",
            "[",
            "]",
            ":",
            ",",
            ">",
            " ",
            "0",
            "1",
            "2",
            "8",
            "20",
            "256",
            "65536",
            "0.5",
            "1e-3",
            "-1",
            "nan",
            "True",
            "False",
            "18446744073709551616",
            "é",
        ]);
        prop::collection::vec(atoms, 0..24).prop_map(|v| v.concat())
    }

    /// Keys and values of the alphabet in `key:value,` shape, separators mostly right, so that
    /// a good share parse to something other than the defaults.
    fn near_miss() -> impl Strategy<Value = String> {
        let keys = prop::sample::select(Key::ALL.map(Key::name).to_vec());
        let colon = prop::sample::select(vec![":", ":", ":", ":", ",", "", "[", " : "]);
        let values = prop::sample::select(vec![
            "20",
            "256",
            "0",
            "1",
            "8",
            "0.5",
            "1e-3",
            "True",
            "False",
            "native",
            "cudaMallocAsync",
            "[256:1,512:2,1024:4,>:8]",
            "[>:2]",
            "[1:1,2:0]",
            "[256:1,]",
            "[256:1",
            "[]",
        ]);
        let comma = prop::sample::select(vec![",", ",", ",", ",", ":", "]", "", ", "]);
        prop::collection::vec((keys, colon, values, comma), 0..6).prop_map(|v| {
            let mut s: String = v
                .iter()
                .map(|(k, c, x, m)| format!("{k}{c}{x}{m}"))
                .collect();
            if s.ends_with(',') {
                s.pop();
            }
            s
        })
    }

    fn pow2_or_zero(max_log2: u32) -> impl Strategy<Value = u64> {
        prop_oneof![Just(0u64), (0..=max_log2).prop_map(|k| 1u64 << k)]
    }

    /// Configuration strings that are mostly valid.
    fn config_string() -> impl Strategy<Value = String> {
        let bool_word = || any::<bool>().prop_map(|b| if b { "True" } else { "False" });
        let entry = prop_oneof![
            3 => ((0u32..20), pow2_or_zero(10)).prop_map(|(k, d)| format!("{}:{d}", 1u64 << k)),
            1 => pow2_or_zero(10).prop_map(|d| format!(">:{d}")),
        ];
        let list = prop::collection::vec(entry, 1..6).prop_map(|v| format!("[{}]", v.join(",")));
        let pair = prop_oneof![
            (0u64..100_000).prop_map(|n| format!("max_split_size_mb:{n}")),
            (0u64..5_000).prop_map(|n| format!("max_non_split_rounding_mb:{n}")),
            (0.0f64..1.0).prop_map(|x| format!("garbage_collection_threshold:{x}")),
            pow2_or_zero(12).prop_map(|d| format!("roundup_power2_divisions:{d}")),
            list.prop_map(|l| format!("roundup_power2_divisions:{l}")),
            bool_word().prop_map(|b| format!("expandable_segments:{b}")),
            (0.0f64..=1.0).prop_map(|x| format!("per_process_memory_fraction:{x}")),
            bool_word().prop_map(|b| format!("release_lock_on_cudamalloc:{b}")),
            bool_word().prop_map(|b| format!("pinned_use_cuda_host_register:{b}")),
            pow2_or_zero(8).prop_map(|n| format!("pinned_num_register_threads:{n}")),
            bool_word().prop_map(|b| format!("pinned_use_background_threads:{b}")),
            prop::sample::select(vec!["native", "cudaMallocAsync"])
                .prop_map(|b| format!("backend:{b}")),
            (0u64..1100).prop_map(|n| format!("thread_cache_blocks:{n}")),
        ];
        prop::collection::vec(pair, 0..8).prop_map(|v| v.join(","))
    }

    /// Settings within the ranges the parser enforces, built directly.
    fn valid_settings() -> impl Strategy<Value = Settings> {
        let size =
            |default: u64| prop_oneof![Just(default), (20u64..=MAX_SIZE_MB).prop_map(|mb| mb * MB)];
        let division = || pow2_or_zero(63);
        let table = prop_oneof![
            Just([0u64; 16]),
            division().prop_map(|d| [d; 16]),
            prop::array::uniform16(division()),
            (division(), division(), division(), 0usize..16, 0usize..16).prop_map(
                |(a, b, c, i, j)| {
                    let (i, j) = (i.min(j), i.max(j));
                    let mut t = [b; 16];
                    t[..i].fill(a);
                    t[j..].fill(c);
                    t
                }
            ),
        ];
        (
            size(u64::MAX),
            size(20 * MB),
            prop_oneof![Just(0.0), f64::MIN_POSITIVE..1.0],
            table,
            any::<bool>(),
            prop::option::of(0.0f64..=1.0),
            any::<bool>(),
            any::<bool>(),
            (0u32..=7).prop_map(|k| 1u64 << k),
            any::<bool>(),
            prop_oneof![
                Just(AllocatorBackend::Native),
                Just(AllocatorBackend::CudaMallocAsync)
            ],
        )
            .prop_map(
                |(msz, nsr, gc, table, exp, frac, rel, reg, threads, bg, backend)| Settings {
                    max_split_size: msz,
                    max_non_split_rounding_size: nsr,
                    garbage_collection_threshold: gc,
                    roundup_power2_divisions: table,
                    expandable_segments: exp,
                    per_process_memory_fraction: frac,
                    release_lock_on_cudamalloc: rel,
                    pinned_use_cuda_host_register: reg,
                    pinned_num_register_threads: threads,
                    pinned_use_background_threads: bg,
                    backend,
                    thread_cache_blocks: (msz % 4) as u32 * 7,
                },
            )
    }

    /// parse(display(parse(s))) == parse(s) whenever s parses.
    fn check_round_trip(s: &str) -> Result<(), TestCaseError> {
        if let Ok(settings) = Settings::parse(s) {
            let shown = settings.to_string();
            prop_assert_eq!(
                Settings::parse(&shown),
                Ok(settings),
                "{:?} displayed as {:?}",
                s,
                shown
            );
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2048))]

        #[test]
        fn arbitrary_strings_never_panic(s in any::<String>()) {
            let _ = Settings::parse(&s);
            let _ = Settings::pytorch().apply(&s);
        }

        #[test]
        fn token_soup_never_panics_and_round_trips_when_it_parses(
            s in prop_oneof![token_soup(), near_miss()]
        ) {
            check_round_trip(&s)?;
        }

        #[test]
        fn generated_config_strings_round_trip_when_they_parse(s in config_string()) {
            check_round_trip(&s)?;
        }

        #[test]
        fn valid_settings_display_as_a_string_that_parses_back_to_them(s in valid_settings()) {
            let shown = s.to_string();
            prop_assert_eq!(Settings::parse(&shown), Ok(s), "displayed as {:?}", shown);
        }
    }
}

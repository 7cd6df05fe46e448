//! Allocator settings and the `PYTORCH_CUDA_ALLOC_CONF` language: [`Settings`] in this file
//! (its documentation is the language's), the parser in `parse.rs`, the printer in
//! `display.rs`, the tests in `tests.rs`.
//!
//! The one rule: a configuration string means here what it means to PyTorch, or it is refused
//! with a [`SettingsError`] that says why.

use std::fmt;

use parse::{
    Key, check_fraction, check_gc_threshold, check_size_mb, check_uniform_divisions, invalid,
};

/// One mebibyte; the unit of the `*_mb` keys.
const MIB: u64 = 1 << 20;
/// The smallest value accepted by `max_split_size_mb` and `max_non_split_rounding_mb`
/// (PyTorch's `kLargeBuffer / kMB`).
const MIN_SIZE_MB: u64 = 20;
/// The largest `*_mb` value that still fits in bytes; larger values are clamped to it.
const MAX_SIZE_MB: u64 = u64::MAX / MIB;
/// The number of power-of-two intervals of `roundup_power2_divisions`.
const INTERVALS: usize = 16;
/// The largest `expandable_page_mb`.
const MAX_PAGE_MB: u64 = 1024;
/// PyTorch's large-pool page of expandable segments (`kLargeBuffer`), 20 MiB.
pub(crate) const PYTORCH_EXPANDABLE_PAGE: u64 = 20 * MIB;
/// cachalot's large-pool page of expandable segments (rule 21), 2 MiB.
pub(crate) const CACHALOT_EXPANDABLE_PAGE: u64 = 2 * MIB;
/// cachalot's default for [`Settings::reclaim_headroom`] (rule 21): 2.5 %.
pub(crate) const RECLAIM_HEADROOM: f64 = 0.025;
/// The largest value of `pinned_num_register_threads`.
const MAX_REGISTER_THREADS: u64 = 128;

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
///
/// # The configuration string
///
/// A value starts from PyTorch's defaults ([`Settings::pytorch`]) or cachalot's
/// ([`Settings::cachalot`], which is also the [`Default`]) and is changed by a configuration
/// string written exactly as for PyTorch's `PYTORCH_CUDA_ALLOC_CONF` (or `PYTORCH_ALLOC_CONF`)
/// environment variable:
///
/// ```text
/// max_split_size_mb:128,roundup_power2_divisions:[256:1,512:2,1024:4,>:8],expandable_segments:True
/// ```
///
/// ## Syntax
///
/// The string is cut into tokens as PyTorch's `ConfigTokenizer` does: each of `,` `:` `[` `]`
/// is a token of its own, ASCII white space is dropped (also *inside* a word, so `2 0` reads as
/// `20`), and each run of other characters is a word. The tokens must then form `key:value`
/// pairs separated by single commas. An empty string, or one of white space only, changes
/// nothing. A key may appear more than once; the later occurrence is applied over the earlier.
///
/// | key | value | stored as |
/// |---|---|---|
/// | `max_split_size_mb` | integer ≥ 20 | [`Settings::max_split_size`] = N MiB (N clamped to `u64::MAX / MiB`) |
/// | `max_non_split_rounding_mb` | integer ≥ 20 | [`Settings::max_non_split_rounding_size`] = N MiB (same clamp) |
/// | `garbage_collection_threshold` | decimal in (0, 1) | [`Settings::garbage_collection_threshold`] |
/// | `roundup_power2_divisions` | power of two, or a list (below) | [`Settings::roundup_power2_divisions`] |
/// | `expandable_segments` | `True` / `False` | [`Settings::expandable_segments`] |
/// | `per_process_memory_fraction` | decimal in \[0, 1\] | [`Settings::per_process_memory_fraction`] |
/// | `backend` | `native` / `cudaMallocAsync` | [`Settings::backend`] |
/// | `thread_cache_blocks` | integer ≤ 1024 (cachalot's own key) | [`Settings::thread_cache_blocks`] |
/// | `expandable_page_mb` | even integer in \[2, 1024\] (cachalot's own key) | [`Settings::expandable_page_size`] = N MiB |
/// | `reclaim_headroom` | decimal in \[0, 1\], or `off` (cachalot's own key) | [`Settings::reclaim_headroom`] |
/// | `page_aliasing` | `True` / `False` (cachalot's own key; `True` needs `expandable_segments:True`) | [`Settings::page_aliasing`] |
/// | `page_stitching` | `True` / `False` (cachalot's own key; `True` needs `expandable_segments:True` and refuses `page_aliasing:True`) | [`Settings::page_stitching`] |
/// | `expandable_handle_mb` | integer in \[2, 1048576\], or `off` (cachalot's own key; refuses `page_aliasing:True`) | [`Settings::expandable_handle_size`] = N MiB |
/// | `release_lock_on_cudamalloc` | `True` / `False` | nothing: only `False` is accepted (below) |
/// | `pinned_use_cuda_host_register` | `True` / `False` | nothing: only `False` is accepted (below) |
/// | `pinned_num_register_threads` | power of two ≤ 128 | nothing: only `1` is accepted (below) |
/// | `pinned_use_background_threads` | `True` / `False` | nothing: only `False` is accepted (below) |
///
/// ## Keys cachalot refuses
///
/// Four keys are PyTorch's but mean nothing for cachalot. They are read and checked as PyTorch
/// checks them, their default value (PyTorch's, which changes nothing) is accepted so that a
/// configuration written for PyTorch that spells it out still parses, and any other valid
/// value is [`SettingsError::Unsupported`], whose message says what the key does in PyTorch:
///
/// * `release_lock_on_cudamalloc:True` would release the allocator's lock around `cudaMalloc`.
///   cachalot makes every decision under one lock, so that each run is a sequence of core
///   operations the reference model can check, and its thread caches already keep the common
///   paths off that lock.
/// * `pinned_use_cuda_host_register`, `pinned_num_register_threads` and
///   `pinned_use_background_threads` configure PyTorch's *pinned host-memory* allocator
///   (`CachingHostAllocator`). cachalot allocates device memory only: pinned host memory is not
///   its business.
///
/// The list form of `roundup_power2_divisions` is `[K:D,K:D,...]`. Each `K` is a size in MB
/// that is a power of two and names the interval `clamp(log2 K, 0, 15)`; each `D` is `0` or a
/// power of two. Entries are applied left to right over the current table:
///
/// * the first numeric entry also fills every interval below its own;
/// * `>:D` fills every interval *after* the one named by the last numeric entry seen so far
///   (after interval 0 when there was none), as PyTorch ≥ 2.10 does;
/// * intervals that no entry reaches keep their previous value (zero when parsing from the
///   defaults) — they do *not* inherit the value of the interval before them.
///
/// So `[256:1,512:2,1024:4,>:8]` gives intervals 0..=8 one division, 9 two, 10 four and
/// 11..=15 eight.
///
/// ## Stricter than PyTorch
///
/// Where PyTorch would crash, read past the end of its token list, or silently accept
/// garbage, this parser returns a [`SettingsError`] instead: numbers must be plain digits
/// (`12abc`, `+5`, `-1` and `0x10` are refused, where `std::stoull` would take a prefix or
/// wrap a negative), integers that overflow 64 bits are refused, decimals must be finite
/// decimal numbers (no `nan`, `inf` or hexadecimal floats), a `:` after each key and a `,`
/// between pairs are required (PyTorch ≥ 2.9 does not check them), and an empty value, a
/// trailing comma, an empty list and unbalanced brackets are all errors. Keys PyTorch knows
/// but cachalot does not (`large_segment_size_mb`, `pinned_reserve_segment_size_mb`,
/// `graph_capture_record_stream_reuse`, the `*_hip*` spellings, ...) are unrecognized here.
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
    /// The device allocator behind the cache.
    pub backend: AllocatorBackend,
    /// cachalot's own policy, not PyTorch's: how many freed small-pool blocks (requests of at
    /// most 1 MiB) each thread keeps for itself in front of the shared cache ([`crate::Allocator`]'s thread caches, rule 17 of
    /// ARCHITECTURE.md). `0` (PyTorch's behaviour, [`Settings::pytorch`]) turns them off;
    /// cachalot's default is 8.
    pub thread_cache_blocks: u32,
    /// cachalot's own knob: the large pool's page of expandable segments, in bytes (rule 19;
    /// `expandable_page_mb`). PyTorch's is 20 MiB, cachalot's 2 MiB (less memory past the end
    /// of the last block, more map calls). The small pool's page is always 2 MiB.
    pub expandable_page_size: u64,
    /// cachalot's own policy: reclaim before growing (rule 20; `reclaim_headroom`). With
    /// `Some(h)`, before an expandable range grows past `(1 + h)` times the most bytes the
    /// program has ever asked for at once, free pages left in holes between live blocks are
    /// unmapped first. `None` (PyTorch's behaviour) turns it off; cachalot's default is
    /// 0.025 (2.5 %). Acts only with [`Settings::expandable_segments`].
    pub reclaim_headroom: Option<f64>,
    /// cachalot's own policy: page aliasing (rule 22; `page_aliasing`). With it, the pages a
    /// reclaim would unmap are instead mapped a second time where the range grows (no memory
    /// is given back and created again). Off by default, in cachalot's policy too: measured
    /// over the committed traces (results/aliasing-2026-12-01/) it cuts the steady state's
    /// driver calls by about 60 % but holds up to 1.15× the bytes in use, and in a loop whose
    /// placement does not repeat its second mappings keep growing until `empty_cache`. It needs [`Settings::expandable_segments`] (the parser refuses
    /// `page_aliasing:True` without it, and a string that turns expandable segments off turns
    /// it off too unless it names it) and acts only with [`Settings::reclaim_headroom`].
    pub page_aliasing: bool,
    /// cachalot's own policy: stitched views (rule 23; `page_stitching`). With it, a large
    /// request that would take reserved memory past rule 20's limit is served from a *view*: a
    /// reservation of its own whose slots map free pages of the stream's ranges a second time,
    /// kept for the next time the same request comes, so that a loop whose allocations repeat
    /// reaches a steady state with no driver call. Off by default, in cachalot's policy too
    /// (for now). It needs [`Settings::expandable_segments`] (the parser refuses
    /// `page_stitching:True` without it, and a string that turns expandable segments off turns
    /// it off too unless it names it), cannot be on with [`Settings::page_aliasing`] (the
    /// parser refuses the two together) and acts only with [`Settings::reclaim_headroom`].
    pub page_stitching: bool,
    /// cachalot's own knob: handles of several pages (rule 19j; `expandable_handle_mb`). With
    /// `Some(t)`, a map step of expandable segments of at least `t` bytes is backed by one
    /// device handle of all its bytes (one `cuMemCreate`, `cuMemMap` and `cuMemSetAccess`,
    /// about 45 µs on an H200 whatever its size) instead of one per page; such a handle is
    /// unmapped only whole and never put into a stitched view. `None` (PyTorch's way): a
    /// handle per page. Refused beside [`Settings::page_aliasing`].
    pub expandable_handle_size: Option<u64>,
}

/// cachalot's default for [`Settings::thread_cache_blocks`].
pub(crate) const THREAD_CACHE_BLOCKS: u32 = 8;

/// The largest accepted [`Settings::thread_cache_blocks`]: a thread cache is scanned linearly.
pub(crate) const MAX_THREAD_CACHE_BLOCKS: u32 = 1024;

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
    /// A well-formed setting that cachalot does not honour. The parser returns it for
    /// PyTorch's keys that mean nothing here, given a value other than their default
    /// (`release_lock_on_cudamalloc:True`, any `pinned_*` value that would change PyTorch's
    /// pinned host-memory allocator; see "Keys cachalot refuses" in the module documentation).
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
    /// backend, no thread caches.
    pub fn pytorch() -> Settings {
        Settings {
            max_split_size: u64::MAX,
            max_non_split_rounding_size: MIN_SIZE_MB * MIB,
            garbage_collection_threshold: 0.0,
            roundup_power2_divisions: [0; INTERVALS],
            expandable_segments: false,
            per_process_memory_fraction: None,
            backend: AllocatorBackend::Native,
            thread_cache_blocks: 0,
            expandable_page_size: PYTORCH_EXPANDABLE_PAGE,
            reclaim_headroom: None,
            page_aliasing: false,
            page_stitching: false,
            expandable_handle_size: None,
        }
    }

    /// cachalot's own defaults, also [`Default`] (rule 21 of ARCHITECTURE.md). They start from
    /// PyTorch's ([`Settings::pytorch`]) and depart from them in these ways:
    ///
    /// * `thread_cache_blocks` is 8: each thread keeps up to that many of the small-pool
    ///   blocks it freed, and hands them straight back to its own requests of the same size on the same stream
    ///   (rule 17, checked against the model).
    /// * `expandable_segments` is on, with 2 MiB pages in the large pool too (rule 19), and
    ///   `reclaim_headroom` is 0.025 (rule 20): reserved memory stays close to the most the
    ///   program ever asked for. This needs a backend with virtual memory
    ///   ([`Backend::virtual_memory`](crate::backend::Backend::virtual_memory)); the CUDA
    ///   allocator given exactly these defaults on a GPU without it uses segments instead.
    /// * `page_stitching` is on (rule 23): a large request that would otherwise have reclaim
    ///   move pages gets a *view* of free pages mapped where they are, kept for the next time
    ///   the same request comes, so a loop whose allocations repeat stops making driver calls
    ///   after its first passes.
    pub fn cachalot() -> Settings {
        Settings {
            thread_cache_blocks: THREAD_CACHE_BLOCKS,
            expandable_segments: true,
            expandable_page_size: CACHALOT_EXPANDABLE_PAGE,
            reclaim_headroom: Some(RECLAIM_HEADROOM),
            page_stitching: true,
            // `page_aliasing` stays off, as in PyTorch's settings.
            ..Settings::pytorch()
        }
    }

    /// Parses a configuration string over the defaults: `Settings::default().apply(s)`.
    ///
    /// An empty string (or one of white space only) gives the defaults.
    pub fn parse(s: &str) -> Result<Settings, SettingsError> {
        Settings::default().apply(s)
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
    /// (index 0 for size 0): [`crate::sizes::division_index`], the index the rounding uses.
    pub fn roundup_divisions_for(&self, size: u64) -> u64 {
        self.roundup_power2_divisions
            .get(crate::sizes::division_index(size))
            .copied()
            .unwrap_or(0)
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

mod display;
mod parse;
#[cfg(test)]
mod tests;

//! The parser of the configuration string: tokens as PyTorch's `ConfigTokenizer` cuts them,
//! the keys, and each key's value checks.

use std::fmt;

use super::*;

impl Settings {
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
        // Whether the string itself asks for `page_aliasing:True` (its last occurrence), which
        // needs expandable segments (rule 22), checked once the whole string is applied.
        let mut asks_aliasing = false;
        // The same for `page_stitching:True` (rule 23).
        let mut asks_stitching = false;
        // The same for `expandable_handle_mb` set to a size (rule 19j).
        let mut asks_handle = false;
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
            if key == Key::PageAliasing {
                asks_aliasing = out.page_aliasing;
            }
            if key == Key::PageStitching {
                asks_stitching = out.page_stitching;
            }
            if key == Key::ExpandableHandle {
                asks_handle = out.expandable_handle_size.is_some();
            }
            match cursor.peek_tok() {
                None => return out.finish(asks_aliasing, asks_stitching, asks_handle),
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

    /// The checks between keys, once a whole string is applied: `page_aliasing` and
    /// `page_stitching` need `expandable_segments:True` (rules 22, 23). A string that asks for
    /// one (`asked`, `asked_stitching`) without expandable segments is refused; one that turns
    /// expandable segments off without naming it turns what it inherited off too. The two
    /// cannot be on together (rule 23): a string that asks for page aliasing turns an inherited
    /// stitching off; one that asks for both (or for stitching over inherited aliasing) is
    /// refused. Handles of several pages (rule 19j) cannot be on beside page aliasing either,
    /// and are settled the same way against it.
    fn finish(
        mut self,
        asked: bool,
        asked_stitching: bool,
        asked_handle: bool,
    ) -> Result<Settings, SettingsError> {
        if self.page_stitching && !self.expandable_segments {
            if asked_stitching {
                return Err(invalid(
                    Key::PageStitching,
                    "True",
                    "stitched views need expandable_segments:True (a view maps pages of \
                     expandable segments' ranges a second time)",
                ));
            }
            self.page_stitching = false;
        }
        if self.page_aliasing && !self.expandable_segments {
            if asked {
                return Err(invalid(
                    Key::PageAliasing,
                    "True",
                    "page aliasing needs expandable_segments:True (it maps pages of expandable \
                     segments' ranges a second time)",
                ));
            }
            self.page_aliasing = false;
        }
        // A string that asks for page aliasing over settings that only inherited stitching
        // (cachalot's policy has it, rule 21) chooses aliasing instead.
        if self.page_stitching && self.page_aliasing && asked && !asked_stitching {
            self.page_stitching = false;
        }
        if self.page_stitching && self.page_aliasing {
            return Err(invalid(
                Key::PageStitching,
                "True",
                "page_stitching cannot be on together with page_aliasing:True (rule 23 keeps \
                 every page at its home; rule 22 moves homes)",
            ));
        }
        if self.expandable_handle_size.is_some() && self.page_aliasing && asked && !asked_handle {
            self.expandable_handle_size = None;
        }
        if let Some(size) = self.expandable_handle_size
            && self.page_aliasing
        {
            return Err(invalid(
                Key::ExpandableHandle,
                (size / MIB).to_string(),
                "expandable_handle_mb cannot be set together with page_aliasing:True (rule 22 \
                 moves single pages, and a handle of several pages maps only whole)",
            ));
        }
        Ok(self)
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
            Key::PageAliasing => self.page_aliasing = parse_bool(cursor, key)?,
            Key::PageStitching => self.page_stitching = parse_bool(cursor, key)?,
            Key::MemoryFraction => {
                let v = scalar(cursor, key)?;
                let x = check_fraction(parse_f64(key, v)?).map_err(|r| invalid(key, v, r))?;
                self.per_process_memory_fraction = Some(x);
            }
            Key::ReleaseLock | Key::PinnedHostRegister | Key::PinnedBackground => {
                if parse_bool(cursor, key)? {
                    return Err(unsupported(key, "True"));
                }
            }
            Key::PinnedThreads => {
                let v = scalar(cursor, key)?;
                let n =
                    check_register_threads(parse_u64(key, v)?).map_err(|r| invalid(key, v, r))?;
                if n != 1 {
                    return Err(unsupported(key, v));
                }
            }
            Key::ThreadCacheBlocks => {
                let v = scalar(cursor, key)?;
                let n = parse_u64(key, v)?;
                if n > u64::from(MAX_THREAD_CACHE_BLOCKS) {
                    return Err(invalid(key, v, "too large, must be <= 1024"));
                }
                self.thread_cache_blocks = n as u32;
            }
            Key::ExpandablePage => {
                let v = scalar(cursor, key)?;
                self.expandable_page_size =
                    check_page_mb(parse_u64(key, v)?).map_err(|r| invalid(key, v, r))? * MIB;
            }
            Key::ExpandableHandle => {
                let v = scalar(cursor, key)?;
                self.expandable_handle_size = if v == "off" {
                    None
                } else {
                    Some(check_handle_mb(parse_u64(key, v)?).map_err(|r| invalid(key, v, r))? * MIB)
                };
            }
            Key::ReclaimHeadroom => {
                let v = scalar(cursor, key)?;
                self.reclaim_headroom = if v == "off" {
                    None
                } else {
                    Some(check_fraction(parse_f64(key, v)?).map_err(|r| invalid(key, v, r))?)
                };
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

// ---------------------------------------------------------------------------------------------
// Keys and value checks
// ---------------------------------------------------------------------------------------------

/// The options of the configuration string.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Key {
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
    ExpandablePage,
    ReclaimHeadroom,
    PageAliasing,
    PageStitching,
    ExpandableHandle,
}

impl Key {
    /// Every key.
    pub(super) const ALL: [Key; 17] = [
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
        Key::ExpandablePage,
        Key::ReclaimHeadroom,
        Key::PageAliasing,
        Key::PageStitching,
        Key::ExpandableHandle,
    ];

    /// The key as written in a configuration string.
    pub(super) fn name(self) -> &'static str {
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
            Key::ExpandablePage => "expandable_page_mb",
            Key::ReclaimHeadroom => "reclaim_headroom",
            Key::PageAliasing => "page_aliasing",
            Key::PageStitching => "page_stitching",
            Key::ExpandableHandle => "expandable_handle_mb",
        }
    }

    /// The key written `name`, if any.
    fn from_name(name: &str) -> Option<Key> {
        Key::ALL.into_iter().find(|k| k.name() == name)
    }
}

/// An [`SettingsError::InvalidValue`] for `key`.
pub(super) fn invalid(key: Key, value: impl fmt::Display, reason: &str) -> SettingsError {
    SettingsError::InvalidValue {
        key: key.name().to_owned(),
        value: value.to_string(),
        reason: reason.to_owned(),
    }
}

/// A [`SettingsError::Unsupported`] for a key cachalot refuses, given `value` (a valid value
/// other than the key's default): what the key does in PyTorch, and why cachalot has no use
/// for it.
fn unsupported(key: Key, value: &str) -> SettingsError {
    const PINNED: &str = "cachalot allocates device memory only: pinned host memory is not \
                          its business";
    let reason = match key {
        Key::ReleaseLock => format!(
            "{value} would make PyTorch release the allocator's lock around each cudaMalloc so \
             that other threads may allocate meanwhile; cachalot makes every decision under one \
             lock, so that each run is a sequence of operations the reference model checks, and \
             its thread caches keep the common paths off that lock. Only False (the default) is \
             accepted"
        ),
        Key::PinnedHostRegister => format!(
            "{value} would make PyTorch's pinned host-memory allocator allocate with malloc and \
             cudaHostRegister instead of cudaHostAlloc; {PINNED}. Only False (the default) is \
             accepted"
        ),
        Key::PinnedThreads => format!(
            "{value} would make PyTorch's pinned host-memory allocator map pages with {value} \
             threads before cudaHostRegister; {PINNED}. Only 1 (the default) is accepted"
        ),
        Key::PinnedBackground => format!(
            "{value} would make PyTorch's pinned host-memory allocator process its events on a \
             background thread; {PINNED}. Only False (the default) is accepted"
        ),
        _ => format!("{value} is not supported"),
    };
    SettingsError::Unsupported {
        key: key.name().to_owned(),
        reason,
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
pub(super) fn check_size_mb(mb: u64) -> Result<u64, &'static str> {
    if mb < MIN_SIZE_MB {
        return Err("too small, must be >= 20");
    }
    Ok(mb.min(MAX_SIZE_MB) * MIB)
}

/// `garbage_collection_threshold`: the open interval (0, 1); NaN fails.
pub(super) fn check_gc_threshold(x: f64) -> Result<f64, &'static str> {
    if x > 0.0 && x < 1.0 {
        Ok(x)
    } else {
        Err("must be in (0.0, 1.0)")
    }
}

/// `per_process_memory_fraction`: the closed interval [0, 1]; NaN fails; −0 becomes 0.
pub(super) fn check_fraction(x: f64) -> Result<f64, &'static str> {
    if (0.0..=1.0).contains(&x) {
        Ok(x + 0.0)
    } else {
        Err("must be in [0.0, 1.0]")
    }
}

/// `expandable_page_mb` (rule 19's large-pool page): an even number of MiB in [2, 1024].
pub(super) fn check_page_mb(mb: u64) -> Result<u64, &'static str> {
    if (2..=MAX_PAGE_MB).contains(&mb) && mb.is_multiple_of(2) {
        Ok(mb)
    } else {
        Err("must be an even number in [2, 1024]")
    }
}

/// `expandable_handle_mb` (rule 19j: map steps of at least this many MiB are one handle): an
/// integer in [2, 1048576].
pub(super) fn check_handle_mb(mb: u64) -> Result<u64, &'static str> {
    if (2..=MAX_HANDLE_MB).contains(&mb) {
        Ok(mb)
    } else {
        Err("must be an integer in [2, 1048576], or off")
    }
}

/// The largest `expandable_handle_mb`: 1 TiB.
const MAX_HANDLE_MB: u64 = 1 << 20;

/// The compact form of `roundup_power2_divisions`: a power of two.
pub(super) fn check_uniform_divisions(d: u64) -> Result<u64, &'static str> {
    if d.is_power_of_two() {
        Ok(d)
    } else {
        Err("must be a power of two")
    }
}

/// `pinned_num_register_threads`: a power of two, at most 128.
pub(super) fn check_register_threads(n: u64) -> Result<u64, &'static str> {
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

//! What the reader accepts: the bounds that keep a hostile or corrupt file's cost bounded,
//! used by the pickle decoder (input bytes, values stored, depth) and by the conversion into a
//! snapshot (devices, sizes).

/// Largest size or address component a snapshot may carry: PyTorch refuses requests above
/// 2^60 bytes, so a larger size can only come from a corrupt or hostile file.
pub const MAX_SIZE: u64 = 1 << 60;

/// Bounds on what the reader accepts, so that a hostile or corrupt file costs bounded memory
/// and time (decoding is one linear pass over the input).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadLimits {
    /// Largest input in bytes, after gzip decompression (default 1 GiB).
    pub max_input_bytes: u64,
    /// Most values the decoder may hold at once (default 2^24): nodes (strings, lists, tuples,
    /// dicts), container items, memo slots and pickle-stack items. Memo references share the
    /// value they refer to, so this counts what is stored, not what the references would
    /// expand to. A container item or memo slot costs 16 bytes, a node about 60 (its entry,
    /// bookkeeping and allocation) plus the bytes of a string, which the input size bounds:
    /// the default bounds the decoder to about 1 GB at worst. A trace entry with stack frames
    /// stores about 22 values (its frames list is shared with every entry of the same stack),
    /// so the default takes snapshots of over 700,000 entries; the 128,897-entry
    /// `gpt2_generate_large` fixture (39 MB) stores 2.9 million.
    pub max_values: u64,
    /// Deepest nesting of values (default 32; a snapshot nests 7 deep, a scalar counting 1).
    pub max_depth: u32,
    /// Most devices (`device_traces` entries, `device` of a segment) accepted (default 1024).
    pub max_devices: usize,
}

impl Default for ReadLimits {
    fn default() -> Self {
        ReadLimits {
            max_input_bytes: 1 << 30,
            max_values: 1 << 24,
            max_depth: 32,
            max_devices: 1024,
        }
    }
}

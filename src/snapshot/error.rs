//! The error type of snapshot reading and writing.

/// Why a snapshot (or its figures sidecar) could not be read, or a snapshot not written.
///
/// Every reading error names the input (`file`: the path, or `<bytes>` for
/// [`parse_snapshot`](super::parse_snapshot)).
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// The file could not be opened or read.
    #[error("{file}: cannot read: {source}")]
    Io {
        /// The input's name.
        file: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The input is not a pickle, or uses pickle features no memory snapshot uses.
    #[error("{file}: not a pickle: {reason}")]
    NotPickle {
        /// The input's name.
        file: String,
        /// What is wrong.
        reason: String,
    },
    /// The input ends before the pickle (or its gzip wrapper) is complete.
    #[error("{file}: truncated: {reason}")]
    Truncated {
        /// The input's name.
        file: String,
        /// Where it ends.
        reason: String,
    },
    /// A well-formed pickle that does not hold a PyTorch memory snapshot.
    #[error("{file}: not a PyTorch memory snapshot: {reason}")]
    NotSnapshot {
        /// The input's name.
        file: String,
        /// What is missing or of the wrong type, with its path in the snapshot.
        reason: String,
    },
    /// A value no real snapshot holds: a negative size or address, a size above 2^60, more
    /// devices than [`ReadLimits::max_devices`](super::ReadLimits::max_devices), blocks that do
    /// not tile their segment.
    #[error("{file}: absurd value at {at}: {reason}")]
    Absurd {
        /// The input's name.
        file: String,
        /// Where in the snapshot, e.g. `device_traces[0][12].size`.
        at: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The input is over one of the reader's [`ReadLimits`](super::ReadLimits).
    #[error("{file}: over the reader's limits: {reason}")]
    TooLarge {
        /// The input's name.
        file: String,
        /// Which limit, and by how much.
        reason: String,
    },
    /// A figures sidecar (JSON) could not be parsed.
    #[error("{file}: not a figures file: {reason}")]
    Figures {
        /// The input's name.
        file: String,
        /// What is wrong.
        reason: String,
    },
    /// Writing a snapshot failed.
    #[error("cannot write snapshot: {reason}")]
    Write {
        /// What failed.
        reason: String,
    },
}

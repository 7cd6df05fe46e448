//! The allocator's one error type.
//!
//! The one rule: each variant says what the caller can do next. Out-of-memory is transient
//! (free something, retry); `TooLarge` and bad settings are permanent; backend errors mean the
//! device failed and the operation did not happen.

use crate::backend::BackendError;
use crate::settings::SettingsError;
use crate::sizes::format_size;

/// Everything an allocator operation can fail with.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No memory for the request, after releasing every cached segment and retrying. Free
    /// buffers (or lower the memory fraction's pressure) and try again.
    #[error(transparent)]
    OutOfMemory(Box<OutOfMemory>),
    /// The request can never be served (above 2^60 bytes).
    #[error(
        "cannot allocate {requested} bytes: above the largest request cachalot serves (2^60 bytes)"
    )]
    TooLarge {
        /// The size asked for.
        requested: u64,
    },
    /// The address is not a live allocation of this allocator (never allocated, already freed,
    /// or from another allocator). Nothing was changed.
    #[error("{address:#x} is not a live allocation of this allocator")]
    UnknownPointer {
        /// The address passed in.
        address: u64,
    },
    /// A memory fraction outside `[0, 1]`.
    #[error("invalid memory fraction {fraction}: must be within [0, 1]")]
    InvalidFraction {
        /// The fraction passed in.
        fraction: f64,
    },
    /// A setting that parses but that cachalot does not implement.
    #[error("unsupported setting {key}: {reason}")]
    Unsupported {
        /// The setting's key.
        key: &'static str,
        /// Why it is not supported.
        reason: &'static str,
    },
    /// The settings are invalid.
    #[error(transparent)]
    Settings(#[from] SettingsError),
    /// A segment to adopt (`CachingCore::adopt_segment`, rule 18) that the policy could not
    /// have made, or that overlaps a segment the allocator holds. Nothing was changed.
    #[error("invalid adoption: {reason}")]
    InvalidAdoption {
        /// Which check failed.
        reason: String,
    },
    /// The device failed; the operation did not happen.
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// The facts of an out-of-memory failure, formatted in the manner of PyTorch's message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutOfMemory {
    /// The device's index.
    pub device: usize,
    /// The bytes asked for by the caller.
    pub requested: u64,
    /// The segment size the allocator tried to get from the device.
    pub alloc_size: u64,
    /// The device's total memory.
    pub capacity: u64,
    /// The device's free memory at the time of the failure.
    pub device_free: u64,
    /// The memory-fraction limit on reserved bytes, if one is set.
    pub allowed: Option<u64>,
    /// Bytes allocated to the program by this allocator.
    pub allocated: u64,
    /// Bytes reserved by this allocator but not allocated (cached, or stranded in split
    /// segments).
    pub reserved_unallocated: u64,
}

impl std::fmt::Display for OutOfMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CUDA out of memory. Tried to allocate {}. GPU {} has a total capacity of {} of which {} is free. ",
            format_size(self.alloc_size),
            self.device,
            format_size(self.capacity),
            format_size(self.device_free),
        )?;
        if let Some(allowed) = self.allowed {
            write!(f, "{} allowed; ", format_size(allowed))?;
        }
        write!(
            f,
            "Of the allocated memory {} is allocated by cachalot, and {} is reserved by cachalot but unallocated.",
            format_size(self.allocated),
            format_size(self.reserved_unallocated),
        )?;
        if self.reserved_unallocated > (256 << 20) && self.reserved_unallocated > self.allocated / 4
        {
            write!(
                f,
                " Reserved but unallocated memory is large: empty_cache() returns whole free segments; memory stranded in split segments stays until its neighbours are freed."
            )?;
        }
        Ok(())
    }
}

impl std::error::Error for OutOfMemory {}

impl Error {
    /// True for out-of-memory: the request may succeed after memory is freed.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, Error::OutOfMemory(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oom_message_names_every_figure() {
        let e = Error::OutOfMemory(Box::new(OutOfMemory {
            device: 0,
            requested: 3 << 20,
            alloc_size: 20 << 20,
            capacity: 80 << 30,
            device_free: 10 << 20,
            allowed: Some(40 << 30),
            allocated: 30 << 30,
            reserved_unallocated: 9 << 30,
        }));
        let text = e.to_string();
        for part in [
            "Tried to allocate 20.00 MiB",
            "total capacity of 80.00 GiB",
            "of which 10.00 MiB is free",
            "40.00 GiB allowed",
            "30.00 GiB is allocated",
            "9.00 GiB is reserved by cachalot but unallocated",
        ] {
            assert!(text.contains(part), "{part:?} missing from {text:?}");
        }
        assert!(e.is_out_of_memory());
    }
}

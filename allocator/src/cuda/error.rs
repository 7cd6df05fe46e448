//! The CUDA layer's error type.
//!
//! The one rule, as for [`crate::Error`]: each variant says what the caller can do next. The
//! allocator's own refusals (out of memory, unknown pointer, bad settings) stay the core's typed
//! [`crate::Error`], wrapped whole, so an out-of-memory error carries the same figures here as in
//! the simulated allocator.

use cudarc::driver::DriverError;

use crate::backend::BackendError;
use crate::error::{Error, OutOfMemory};

/// Everything the CUDA allocator's operations can fail with.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// No usable CUDA driver: the driver library could not be loaded, or it reports no device.
    /// Run on a machine with an NVIDIA GPU and driver.
    #[error("no CUDA driver: {reason}")]
    NoDriver {
        /// What was missing.
        reason: String,
    },
    /// The device ordinal is not below the number of devices.
    #[error("no CUDA device {ordinal}: the machine has {count}")]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// The number of devices.
        count: usize,
    },
    /// A stream of another device's context was given to this device's allocator. Allocate
    /// with the allocator of the stream's device ([`crate::cuda::CudaAllocator::all_devices`]).
    #[error(
        "the stream belongs to CUDA device {stream_device}, the allocator to device {allocator_device}"
    )]
    WrongDevice {
        /// The allocator's device.
        allocator_device: usize,
        /// The stream's device.
        stream_device: usize,
    },
    /// A CUDA driver call made outside the allocator's policy failed (creating a context,
    /// zeroing or copying a new buffer). The operation did not happen.
    #[error("CUDA driver error: {0}")]
    Driver(#[from] DriverError),
    /// The allocator refused: out of memory (transient: free buffers or call
    /// `empty_cache`, then retry), an unknown pointer, a request too large, invalid settings, or
    /// a device failure inside the allocator. See [`crate::Error`].
    #[error(transparent)]
    Alloc(#[from] Error),
}

impl CudaError {
    /// True for out-of-memory: the request may succeed after memory is freed.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, CudaError::Alloc(e) if e.is_out_of_memory())
    }

    /// The facts of an out-of-memory failure (requested and segment sizes, the device's real
    /// capacity and free memory, the memory-fraction limit), if this is one.
    pub fn out_of_memory(&self) -> Option<&OutOfMemory> {
        match self {
            CudaError::Alloc(Error::OutOfMemory(oom)) => Some(oom),
            _ => None,
        }
    }

    pub(crate) fn from_backend(e: BackendError) -> CudaError {
        CudaError::Alloc(Error::Backend(e))
    }
}

impl From<crate::settings::SettingsError> for CudaError {
    fn from(e: crate::settings::SettingsError) -> Self {
        CudaError::Alloc(Error::Settings(e))
    }
}

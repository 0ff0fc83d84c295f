//! [`GpuError`]: a gpupool status with the message the library left for it.
use std::ffi::CStr;
use std::fmt;

use crate::sys;

/// What kind of failure a gpupool call reported (the C `gpupool_status`, without `GPUPOOL_OK`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// An argument is wrong: the message names it.
    InvalidInput,
    /// The device could not provide the bytes.
    OutOfMemory,
    /// The pool's own hard limit for the device would be passed.
    PoolLimitExceeded,
    /// No such device, or a build without its backend.
    DeviceUnavailable,
    /// A CUDA error other than out-of-memory.
    Cuda,
    /// Not for this device or build.
    Unsupported,
    /// Valid, but not now: a foreign or double free.
    InvalidState,
    /// A bug in gpupool (or a status this crate does not know): please report the message.
    Internal,
}

impl ErrorKind {
    /// The kind of a C status; `None` for `GPUPOOL_OK`. Statuses from a newer library that this
    /// crate does not know are reported as [`ErrorKind::Internal`].
    pub fn from_status(status: sys::gpupool_status) -> Option<ErrorKind> {
        Some(match status {
            sys::GPUPOOL_OK => return None,
            sys::GPUPOOL_INVALID_INPUT => ErrorKind::InvalidInput,
            sys::GPUPOOL_OUT_OF_MEMORY => ErrorKind::OutOfMemory,
            sys::GPUPOOL_POOL_LIMIT_EXCEEDED => ErrorKind::PoolLimitExceeded,
            sys::GPUPOOL_DEVICE_UNAVAILABLE => ErrorKind::DeviceUnavailable,
            sys::GPUPOOL_CUDA_ERROR => ErrorKind::Cuda,
            sys::GPUPOOL_UNSUPPORTED => ErrorKind::Unsupported,
            sys::GPUPOOL_INVALID_STATE => ErrorKind::InvalidState,
            _ => ErrorKind::Internal,
        })
    }

    /// The C status of this kind.
    pub fn status(self) -> sys::gpupool_status {
        match self {
            ErrorKind::InvalidInput => sys::GPUPOOL_INVALID_INPUT,
            ErrorKind::OutOfMemory => sys::GPUPOOL_OUT_OF_MEMORY,
            ErrorKind::PoolLimitExceeded => sys::GPUPOOL_POOL_LIMIT_EXCEEDED,
            ErrorKind::DeviceUnavailable => sys::GPUPOOL_DEVICE_UNAVAILABLE,
            ErrorKind::Cuda => sys::GPUPOOL_CUDA_ERROR,
            ErrorKind::Unsupported => sys::GPUPOOL_UNSUPPORTED,
            ErrorKind::InvalidState => sys::GPUPOOL_INVALID_STATE,
            ErrorKind::Internal => sys::GPUPOOL_INTERNAL_ERROR,
        }
    }
}

impl fmt::Display for ErrorKind {
    /// The library's own name of the status ("pool limit exceeded", ...).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // SAFETY: gpupool_status_name accepts any value and returns a static NUL-terminated
        // string (never NULL).
        let name = unsafe { CStr::from_ptr(sys::gpupool_status_name(self.status())) };
        f.write_str(&name.to_string_lossy())
    }
}

/// A failed gpupool call: its [`ErrorKind`] and the message that says what to do about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuError {
    kind: ErrorKind,
    message: String,
}

/// The result of every fallible call of this crate.
pub type Result<T> = std::result::Result<T, GpuError>;

impl GpuError {
    /// An error made on the Rust side of the boundary, with the same kinds the library uses.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> GpuError {
        GpuError {
            kind,
            message: message.into(),
        }
    }

    /// What kind of failure this is.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The library's message (names the argument or state at fault).
    pub fn message(&self) -> &str {
        &self.message
    }

    /// This error with `context` put in front of its message (`"{context}: {message}"`), the kind
    /// unchanged.
    pub(crate) fn with_context(self, context: impl fmt::Display) -> GpuError {
        GpuError::new(self.kind, format!("{context}: {}", self.message))
    }

    /// The error of a failed call that returned `kind`, with this thread's last gpupool message.
    /// Must run right after that call, on its thread: the next gpupool call replaces the message.
    fn from_last_call(kind: ErrorKind) -> GpuError {
        // SAFETY: gpupool_last_error returns this thread's NUL-terminated message, never NULL,
        // valid until this thread's next gpupool call; it is copied out before any other call.
        let message = unsafe { CStr::from_ptr(sys::gpupool_last_error()) };
        GpuError::new(kind, message.to_string_lossy().into_owned())
    }
}

impl fmt::Display for GpuError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "gpupool: {}: {}", self.kind, self.message)
    }
}

impl std::error::Error for GpuError {}

/// `Ok(())` for `GPUPOOL_OK`, else the error with this thread's last gpupool message. Call it on
/// a status straight from the library, before any other gpupool call.
pub(crate) fn check(status: sys::gpupool_status) -> Result<()> {
    match ErrorKind::from_status(status) {
        None => Ok(()),
        Some(kind) => Err(GpuError::from_last_call(kind)),
    }
}

//! [`Device`]: a CUDA ordinal or a simulated device, as the C ABI names devices.
use std::ffi::{c_int, CString};
use std::ptr;

use crate::error::{check, ErrorKind, GpuError, Result};
use crate::sys;

/// A device the pool can allocate on: a CUDA ordinal (0, 1, ...) or the id (100 and up) of a
/// simulated device whose memory is host memory.
///
/// A `Device` is only a number: it is `Copy`, and opening one again (for CUDA) names the same
/// device. Simulated devices stay open for the rest of the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Device {
    id: c_int,
}

impl Device {
    /// Opens a device from a spec: `"cuda"`, `"cuda:N"`, `"sim"`, `"sim:SIZE"` (e.g.
    /// `"sim:64MiB"`) or `"auto"`. Every call with a `sim` spec opens a new simulated device.
    ///
    /// Fails with [`ErrorKind::InvalidInput`] for a malformed spec (or one holding a NUL byte),
    /// [`ErrorKind::DeviceUnavailable`] when the device does not exist in this build or machine.
    pub fn open(spec: &str) -> Result<Device> {
        let spec = CString::new(spec).map_err(|_| {
            GpuError::new(
                ErrorKind::InvalidInput,
                format!("device spec {spec:?} holds a NUL byte"),
            )
        })?;
        Self::open_spec(spec.as_ptr())
    }

    /// Opens the device named by the `GPUPOOL_DEVICE` environment variable (else `"auto"`).
    pub fn from_environment() -> Result<Device> {
        Self::open_spec(ptr::null())
    }

    fn open_spec(spec: *const std::ffi::c_char) -> Result<Device> {
        let mut id: c_int = 0;
        // SAFETY: `spec` is NULL or a NUL-terminated string that outlives the call; `id` is a
        // valid out-pointer.
        check(unsafe { sys::gpupool_device_open(spec, &mut id) })?;
        Ok(Device { id })
    }

    /// The CUDA device `ordinal`. Nothing is checked here: calls that use the device report
    /// [`ErrorKind::DeviceUnavailable`] if it does not exist.
    pub fn cuda(ordinal: i32) -> Device {
        Device { id: ordinal }
    }

    /// The device with the C ABI's id `id` (an ordinal, or an id [`Device::open`] returned, for
    /// example one C code handed over). Checked only when used.
    pub fn from_id(id: i32) -> Device {
        Device { id }
    }

    /// The id the C ABI knows this device by.
    pub fn id(self) -> i32 {
        self.id
    }

    /// The device's `(free, total)` memory in bytes, as the device (not the pool) sees it.
    pub fn memory(self) -> Result<(usize, usize)> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: both out-pointers are valid for the call.
        check(unsafe { sys::gpupool_device_memory(self.id, &mut free, &mut total) })?;
        Ok((free, total))
    }
}

//! [`Stream`]: the stream an allocation is ordered on, owned by gpupool or borrowed from its maker.
use std::ffi::c_void;
use std::fmt;
use std::ptr;
use std::sync::Arc;

use crate::device::Device;
use crate::error::{check, Result};
use crate::sys;

/// A stream of one device. Cloning is cheap and shares the stream.
///
/// A stream made by [`Stream::new`] is destroyed when its last clone drops. Allocations hold a
/// clone of each stream they are ordered on or will be freed on, so a stream cannot be destroyed
/// while memory on it is still allocated.
#[derive(Clone)]
pub struct Stream {
    shared: Arc<StreamHandle>,
}

struct StreamHandle {
    device: Device,
    raw: *mut c_void,
    /// Made by gpupool_stream_create, so ours to destroy; borrowed streams belong to their maker.
    owned: bool,
}

// SAFETY: the handle is an opaque token (a cudaStream_t or a simulated stream) that the C ABI
// accepts from any thread; gpupool's stream registry is locked internally.
unsafe impl Send for StreamHandle {}
// SAFETY: as for Send: the handle is never dereferenced on the Rust side, only passed to the C
// ABI, whose calls are thread-safe.
unsafe impl Sync for StreamHandle {}

impl Stream {
    /// Makes a stream of `device` that gpupool owns (`gpupool_stream_create`); it is destroyed
    /// when the last clone drops. The way to get streams for simulated devices.
    pub fn new(device: Device) -> Result<Stream> {
        let mut raw: *mut c_void = ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer.
        check(unsafe { sys::gpupool_stream_create(device.id(), &mut raw) })?;
        Ok(Self::wrap(device, raw, true))
    }

    /// The default stream of `device` (the C ABI's NULL stream).
    pub fn default_for(device: Device) -> Stream {
        Self::wrap(device, ptr::null_mut(), false)
    }

    /// Borrows a stream gpupool did not make: a `cudaStream_t` from another library, or a
    /// stream another owner made with `gpupool_stream_create`. It is never destroyed by this
    /// crate.
    ///
    /// # Safety
    /// `raw` must be NULL or a live stream of `device`, and stay alive as long as this `Stream`,
    /// its clones, and every allocation ordered on or freed on it (until the work queued on it
    /// before such a free has finished).
    pub unsafe fn from_raw(device: Device, raw: *mut c_void) -> Stream {
        Self::wrap(device, raw, false)
    }

    fn wrap(device: Device, raw: *mut c_void, owned: bool) -> Stream {
        Stream {
            shared: Arc::new(StreamHandle { device, raw, owned }),
        }
    }

    /// The native handle to pass to C code or kernels (NULL for a default stream).
    pub fn as_raw(&self) -> *mut c_void {
        self.shared.raw
    }

    /// The device this stream belongs to.
    pub fn device(&self) -> Device {
        self.shared.device
    }

    /// Whether gpupool made this stream (and this crate will destroy it).
    pub fn is_owned(&self) -> bool {
        self.shared.owned
    }

    /// Blocks until the work queued on this stream so far has finished.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: the stream is live while `self` exists (owned, or promised by from_raw).
        check(unsafe { sys::gpupool_stream_synchronize(self.device().id(), self.as_raw()) })
    }
}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stream")
            .field("device", &self.shared.device)
            .field("raw", &self.shared.raw)
            .field("owned", &self.shared.owned)
            .finish()
    }
}

impl PartialEq for Stream {
    /// The same native stream of the same device.
    fn eq(&self, other: &Stream) -> bool {
        self.device() == other.device() && self.as_raw() == other.as_raw()
    }
}

impl Eq for Stream {}

impl Drop for StreamHandle {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        // SAFETY: the stream was made by gpupool_stream_create for this device and this is its
        // last handle. A failure cannot be reported from Drop; the stream then stays in
        // gpupool's registry, which is only a leak.
        let _ = unsafe { sys::gpupool_stream_destroy(self.device.id(), self.raw) };
    }
}

//! [`ManagedBuffer`]: a block of device memory from a [`GpuMemoryPool`] that returns itself to the
//! pool when dropped.
use std::ffi::c_void;
use std::fmt;
use std::ptr::{self, NonNull};

use crate::device::Device;
use crate::error::{check, ErrorKind, GpuError, Result};
use crate::pool::GpuMemoryPool;
use crate::precision::Precision;
use crate::stream::Stream;
use crate::sys;

/// A live allocation: `len()` bytes at `as_ptr()` on `device()` — `element_count()` elements of
/// `precision()` — owned by this handle.
///
/// Dropping it returns the memory to its pool (gpupool's stream-ordered free,
/// `gpupool_deallocate`), ordered on its free stream: the stream it was allocated on, unless
/// [`ManagedBuffer::free_on`] changed it.
///
/// - On the allocation's own stream, the block is reusable at once by work ordered after the
///   free on that stream (and by other streams once that work has finished).
/// - On another stream, the block waits until the work queued on that stream before the free has
///   finished, then returns to the cache of the allocation's stream. It is not reusable on the
///   free stream in the meantime.
///
/// [`ManagedBuffer::free`] does the same and reports errors, which a drop can only ignore.
///
/// The handle keeps its pool, its free stream and the streams given to
/// [`ManagedBuffer::record_stream`] alive until the memory is freed.
pub struct ManagedBuffer {
    pool: GpuMemoryPool,
    /// NULL once freed or given away by `into_raw`.
    ptr: *mut c_void,
    len: usize,
    precision: Precision,
    device: Device,
    free_stream: Stream,
    /// Streams whose queued work uses the memory: kept alive until it is freed.
    recorded_streams: Vec<Stream>,
}

// SAFETY: the handle owns its allocation exclusively; freeing it (or any other gpupool call on
// it) from another thread is thread-safe in the C library.
unsafe impl Send for ManagedBuffer {}
// SAFETY: `&self` methods only read fields; the memory itself is reached only through raw
// pointers, whose use is the caller's (unsafe) responsibility.
unsafe impl Sync for ManagedBuffer {}

impl ManagedBuffer {
    /// Wraps a live allocation.
    ///
    /// # Safety
    /// `ptr` must be a live allocation of `pool` of `len` bytes on `device` that no other handle
    /// owns, and `free_stream` a stream of `device`. `len` should be a multiple of
    /// `precision.size_bytes()` (else `element_count()` rounds down).
    pub(crate) unsafe fn adopt(
        pool: GpuMemoryPool,
        ptr: NonNull<c_void>,
        len: usize,
        precision: Precision,
        device: Device,
        free_stream: Stream,
    ) -> ManagedBuffer {
        ManagedBuffer {
            pool,
            ptr: ptr.as_ptr(),
            len,
            precision,
            device,
            free_stream,
            recorded_streams: Vec::new(),
        }
    }

    /// Takes ownership again of a pointer that [`ManagedBuffer::into_raw`] gave away (or that C code
    /// allocated from `pool`), to be freed on `free_stream`. Its size and device are looked up;
    /// its precision is [`Precision::Bytes`] (the library does not keep precisions).
    ///
    /// Fails with [`ErrorKind::InvalidState`] if `ptr` is not a live allocation of `pool`
    /// (foreign, or already freed), [`ErrorKind::InvalidInput`] if `free_stream` belongs to
    /// another device.
    ///
    /// # Safety
    /// No other [`ManagedBuffer`] (or C code) may own `ptr`: two owners would free it twice, and if
    /// its address was reused in between, the second free would release another owner's memory.
    pub unsafe fn from_raw(
        pool: &GpuMemoryPool,
        ptr: *mut c_void,
        free_stream: &Stream,
    ) -> Result<ManagedBuffer> {
        let (len, device) = pool.allocation_info(ptr)?;
        check_stream_device(free_stream, device)?;
        let ptr = NonNull::new(ptr).expect("allocation_info accepted a NULL pointer");
        // SAFETY: `ptr` is a live allocation of `pool` (just looked up) of `len` bytes on
        // `device`; the caller guarantees nothing else owns it.
        Ok(unsafe {
            ManagedBuffer::adopt(
                pool.clone(),
                ptr,
                len,
                Precision::Bytes,
                device,
                free_stream.clone(),
            )
        })
    }

    /// Gives the memory away without freeing it: it stays allocated in the pool until
    /// [`ManagedBuffer::from_raw`] takes it back (or, if never, until the C pool is destroyed).
    pub fn into_raw(mut self) -> *mut c_void {
        // `self` still drops: its pool and stream handles are released, the memory is not freed.
        std::mem::replace(&mut self.ptr, ptr::null_mut())
    }

    /// The device address of the memory, aligned to at least [`ALIGNMENT`](crate::ALIGNMENT).
    /// On a simulated device it is host memory the caller may read and write (unsafely) for
    /// `len()` bytes while this handle lives.
    pub fn as_ptr(&self) -> *mut c_void {
        self.ptr
    }

    /// The bytes that were asked for (`element_count() * precision().size_bytes()`).
    pub fn len(&self) -> usize {
        self.len
    }

    /// The element type the buffer was asked for with ([`Precision::Bytes`] for
    /// [`GpuMemoryPool::allocate`]).
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// The elements of [`ManagedBuffer::precision`] the buffer holds (`len()` for
    /// [`Precision::Bytes`]).
    pub fn element_count(&self) -> usize {
        self.len / self.precision.size_bytes()
    }

    /// Always `false`: gpupool refuses 0-byte allocations.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device the memory is on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The pool the memory belongs to.
    pub fn pool(&self) -> &GpuMemoryPool {
        &self.pool
    }

    /// The stream the memory will be freed on.
    pub fn free_stream(&self) -> &Stream {
        &self.free_stream
    }

    /// Frees the memory on `stream` instead of the allocation's stream (when it drops or on
    /// [`ManagedBuffer::free`]). Freed on a stream other than the allocation's, the block waits
    /// until the work queued on `stream` before the free has finished, then returns to the cache
    /// of the allocation's stream; it is not reused on `stream` in the meantime.
    /// [`ErrorKind::InvalidInput`] if `stream` belongs to another device.
    pub fn free_on(&mut self, stream: &Stream) -> Result<()> {
        check_stream_device(stream, self.device)?;
        self.free_stream = stream.clone();
        Ok(())
    }

    /// Declares that work on `stream` also uses the memory: when it is freed, no stream reuses it
    /// before the work queued on `stream` until then has finished. The stream is kept alive until
    /// the memory is freed.
    pub fn record_stream(&mut self, stream: &Stream) -> Result<()> {
        // SAFETY: the pool is live (held by `self`), `ptr` is its live allocation, and `stream`
        // is live (Stream's invariant).
        check(unsafe { sys::gpupool_record_stream(self.pool.as_raw(), self.ptr, stream.as_raw()) })?;
        if !self.recorded_streams.contains(stream) {
            self.recorded_streams.push(stream.clone());
        }
        Ok(())
    }

    /// Returns the memory to the pool now (ordered on the free stream, as a drop does),
    /// reporting what a drop would ignore. Whatever the result, the handle no longer owns the
    /// memory.
    pub fn free(mut self) -> Result<()> {
        self.deallocate()
    }

    /// Frees the memory if this handle still owns it.
    fn deallocate(&mut self) -> Result<()> {
        let ptr = std::mem::replace(&mut self.ptr, ptr::null_mut());
        if ptr.is_null() {
            return Ok(());
        }
        // SAFETY: the pool is live (held by `self`); `ptr` is its live allocation, owned only by
        // this handle; the free stream is live and of the allocation's device.
        check(unsafe { sys::gpupool_deallocate(self.pool.as_raw(), ptr, self.free_stream.as_raw()) })
    }
}

/// Streams of other devices are refused before they reach a free, which cannot report errors
/// from a drop.
fn check_stream_device(stream: &Stream, device: Device) -> Result<()> {
    if stream.device() == device {
        return Ok(());
    }
    Err(GpuError::new(
        ErrorKind::InvalidInput,
        format!(
            "the stream belongs to device {}, the allocation to device {}: expected a stream of the allocation's device",
            stream.device().id(),
            device.id()
        ),
    ))
}

impl Drop for ManagedBuffer {
    fn drop(&mut self) {
        // A failed free cannot be reported from a drop; the block then stays in the pool's
        // table until the pool is destroyed. `free()` reports it.
        let _ = self.deallocate();
    }
}

impl fmt::Debug for ManagedBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ManagedBuffer")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("precision", &self.precision)
            .field("device", &self.device)
            .field("free_stream", &self.free_stream)
            .finish()
    }
}

//! [`GpuMemoryPool`]: a shared handle to a gpupool pool and its per-device figures and controls.
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::fmt;
use std::ptr::{self, NonNull};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::batch::{BufferBatch, BufferRequest};
use crate::buffer::ManagedBuffer;
use crate::config::Config;
use crate::device::Device;
use crate::error::{check, ErrorKind, GpuError, Result};
use crate::observer::{self, ObserverId, PressureObserver, Token};
use crate::precision::Precision;
use crate::stats::Stats;
use crate::stream::Stream;
use crate::sys;

/// A caching pool of device memory. Cloning is cheap and shares the pool; it is `Send + Sync`,
/// and every method takes `&self`, so threads can share one pool (the C library locks inside).
///
/// All clones of a `GpuMemoryPool` hold one reference of the C pool together
/// (`gpupool_pool_retain` when the first is made, `gpupool_pool_release` when the last drops),
/// together with the pressure observers added through them. Every [`ManagedBuffer`] holds a
/// clone, so memory can outlive the handle it was allocated from.
#[derive(Clone)]
pub struct GpuMemoryPool {
    shared: Arc<PoolHandle>,
}

/// The state all clones of a `GpuMemoryPool` share: one reference to the C pool, and the observers
/// added through them (removed from the C pool before the reference is released).
struct PoolHandle {
    raw: NonNull<sys::gpupool_pool>,
    observers: Mutex<HashMap<ObserverId, Token>>,
}

// SAFETY: the C pool is reference-counted atomically and every gpupool call on it is
// thread-safe (its allocation table and pool state are locked internally).
unsafe impl Send for PoolHandle {}
// SAFETY: as for Send: only `&self` access, through thread-safe C calls and a Mutex.
unsafe impl Sync for PoolHandle {}

impl GpuMemoryPool {
    /// Makes a pool with `config`. Fails with [`ErrorKind::InvalidInput`] naming a wrong value
    /// (e.g. `critical_pressure` outside (0, 1], `max_pool_size` 0).
    pub fn new(config: &Config) -> Result<GpuMemoryPool> {
        Self::create(|out| {
            // SAFETY: the config struct is initialized with struct_size set and outlives the
            // call; `out` is a valid out-pointer.
            unsafe { sys::gpupool_pool_create(config.as_raw(), out) }
        })
    }

    /// Makes a pool from `GPUPOOL_MEMORY_LIMIT`, `GPUPOOL_CACHE_LIMIT` and `GPUPOOL_POOL`
    /// (percentages of `GPUPOOL_DEVICE`'s device; see docs/pool.md).
    pub fn from_environment() -> Result<GpuMemoryPool> {
        Self::create(|out| {
            // SAFETY: `out` is a valid out-pointer.
            unsafe { sys::gpupool_pool_create_from_environment(out) }
        })
    }

    /// The process pool: the one pool per process that framework allocator hooks
    /// (`gpupool_torch_malloc`, ...) use, made from the environment at first use. It is never
    /// destroyed; this handle takes its own reference so that dropping it is balanced.
    pub fn process() -> Result<GpuMemoryPool> {
        let mut raw: *mut sys::gpupool_pool = ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer.
        check(unsafe { sys::gpupool_process_pool(&mut raw) })?;
        // SAFETY: on success the process pool is a live pool that lives as long as the process.
        Ok(unsafe { GpuMemoryPool::from_borrowed_raw(raw) })
    }

    /// Wraps a pool that C code holds, taking a reference of its own (`gpupool_pool_retain`).
    ///
    /// # Safety
    /// `raw` must be a live, non-NULL pool made by libgpupool_c, alive for the duration of this
    /// call.
    pub unsafe fn from_borrowed_raw(raw: *mut sys::gpupool_pool) -> GpuMemoryPool {
        // SAFETY: the caller guarantees `raw` is a live pool; retaining it makes the reference
        // this handle releases on drop.
        let retained = unsafe { sys::gpupool_pool_retain(raw) };
        Self::adopt(NonNull::new(retained).expect("from_borrowed_raw: the pool is NULL"))
    }

    /// The C pool, to hand to C code. It stays alive as long as any clone of this
    /// `GpuMemoryPool` (or longer if the C code retains it).
    pub fn as_raw(&self) -> *mut sys::gpupool_pool {
        self.shared.raw.as_ptr()
    }

    /// Runs a C constructor that stores a new pool (holding one reference) into its argument.
    fn create(
        make: impl FnOnce(*mut *mut sys::gpupool_pool) -> sys::gpupool_status,
    ) -> Result<GpuMemoryPool> {
        let mut raw: *mut sys::gpupool_pool = ptr::null_mut();
        check(make(&mut raw))?;
        let raw = NonNull::new(raw)
            .ok_or_else(|| GpuError::new(ErrorKind::Internal, "gpupool returned success but no pool"))?;
        Ok(Self::adopt(raw))
    }

    /// Takes ownership of one reference of `raw`.
    fn adopt(raw: NonNull<sys::gpupool_pool>) -> GpuMemoryPool {
        GpuMemoryPool {
            shared: Arc::new(PoolHandle {
                raw,
                observers: Mutex::default(),
            }),
        }
    }

    // ---- memory -------------------------------------------------------------------------------

    /// Allocates `bytes` (at least 1) on `device`, ordered on `stream`: usable at once by work on
    /// that stream, by other streams after synchronizing with it. The block is aligned to
    /// [`ALIGNMENT`](crate::ALIGNMENT) bytes; the returned [`ManagedBuffer`] (of
    /// [`Precision::Bytes`]) returns it to the pool, ordered on `stream`, when it drops.
    ///
    /// Fails with [`ErrorKind::InvalidInput`] for 0 bytes, an unknown device or a stream of
    /// another device, [`ErrorKind::PoolLimitExceeded`] past the pool's limit,
    /// [`ErrorKind::OutOfMemory`] when the device has no more.
    pub fn allocate(&self, device: Device, bytes: usize, stream: &Stream) -> Result<ManagedBuffer> {
        self.allocate_as(device, bytes, Precision::Bytes, stream)
    }

    /// The seed API's entry: `elements` of `precision` on `device`, ordered on `stream` —
    /// `elements * precision.size_bytes()` bytes, otherwise as [`GpuMemoryPool::allocate`]. The
    /// [`ManagedBuffer`] reports its [`precision`](ManagedBuffer::precision) and
    /// [`element_count`](ManagedBuffer::element_count), and returns itself to the pool when it
    /// drops.
    ///
    /// Fails with [`ErrorKind::InvalidInput`] for 0 elements (the library refuses 0 bytes) or a
    /// byte count that overflows `usize`; otherwise as [`GpuMemoryPool::allocate`].
    pub fn get_managed_buffer(
        &self,
        device: Device,
        elements: usize,
        precision: Precision,
        stream: &Stream,
    ) -> Result<ManagedBuffer> {
        let bytes = elements.checked_mul(precision.size_bytes()).ok_or_else(|| {
            GpuError::new(
                ErrorKind::InvalidInput,
                format!(
                    "{elements} {precision} elements overflow usize: expected at most {} elements",
                    usize::MAX / precision.size_bytes()
                ),
            )
        })?;
        self.allocate_as(device, bytes, precision, stream)
    }

    fn allocate_as(
        &self,
        device: Device,
        bytes: usize,
        precision: Precision,
        stream: &Stream,
    ) -> Result<ManagedBuffer> {
        let mut ptr: *mut c_void = ptr::null_mut();
        // SAFETY: the pool is live; `stream` is a live stream (Stream's invariant); `ptr` is a
        // valid out-pointer.
        check(unsafe {
            sys::gpupool_allocate(self.as_raw(), device.id(), bytes, stream.as_raw(), &mut ptr)
        })?;
        Ok(self.adopt_allocation(ptr, bytes, precision, device, stream))
    }

    /// As [`GpuMemoryPool::allocate`], with a required alignment: a power of two, at most
    /// [`ALIGNMENT`](crate::ALIGNMENT) ([`ErrorKind::Unsupported`] above it,
    /// [`ErrorKind::InvalidInput`] if not a power of two).
    pub fn allocate_aligned(
        &self,
        device: Device,
        bytes: usize,
        alignment: usize,
        stream: &Stream,
    ) -> Result<ManagedBuffer> {
        let mut ptr: *mut c_void = ptr::null_mut();
        // SAFETY: as in allocate_as.
        check(unsafe {
            sys::gpupool_allocate_aligned(
                self.as_raw(),
                device.id(),
                bytes,
                alignment,
                stream.as_raw(),
                &mut ptr,
            )
        })?;
        Ok(self.adopt_allocation(ptr, bytes, Precision::Bytes, device, stream))
    }

    fn adopt_allocation(
        &self,
        ptr: *mut c_void,
        bytes: usize,
        precision: Precision,
        device: Device,
        stream: &Stream,
    ) -> ManagedBuffer {
        let ptr = NonNull::new(ptr).expect("gpupool returned success but a NULL allocation");
        // SAFETY: `ptr` is a live allocation of this pool of `bytes` bytes on `device` that
        // nothing else owns; `bytes` is a multiple of the precision's size (elements * size).
        unsafe { ManagedBuffer::adopt(self.clone(), ptr, bytes, precision, device, stream.clone()) }
    }

    /// All or nothing: one buffer per request, in order, on `device` and ordered on `stream`
    /// (each as [`GpuMemoryPool::get_managed_buffer`]). If a request fails, the buffers already
    /// made are returned to the pool and the error — of the failed request's kind — says which:
    /// its message starts with `"buffer batch request {i} of {n}: "` (`i` counted from 0).
    ///
    /// ```
    /// use gpupool::{BufferRequest, Config, Device, GpuMemoryPool, Precision, Stream};
    /// # fn main() -> gpupool::Result<()> {
    /// let device = Device::open("sim:64MiB")?;
    /// let stream = Stream::new(device)?;
    /// let pool = GpuMemoryPool::new(&Config::new())?;
    /// let batch = pool.create_buffer_batch(
    ///     device,
    ///     &[BufferRequest::new(256, Precision::Fp32), BufferRequest::bytes(100)],
    ///     &stream,
    /// )?;
    /// assert_eq!((batch.len(), batch.total_bytes()), (2, 1124));
    /// # Ok(())
    /// # }
    /// ```
    pub fn create_buffer_batch(
        &self,
        device: Device,
        requests: &[BufferRequest],
        stream: &Stream,
    ) -> Result<BufferBatch> {
        let mut batch = BufferBatch::with_capacity(requests.len());
        for (index, request) in requests.iter().enumerate() {
            match self.get_managed_buffer(device, request.elements, request.precision, stream) {
                Ok(buffer) => batch.push(buffer),
                Err(error) => {
                    // Return what the batch holds before the error leaves: all or nothing.
                    drop(batch);
                    return Err(
                        error.with_context(format!("buffer batch request {index} of {}", requests.len()))
                    );
                }
            }
        }
        Ok(batch)
    }

    /// The `(bytes, device)` of a live allocation of this pool; [`ErrorKind::InvalidState`] if
    /// `ptr` is not one (foreign, or already freed).
    // The library only looks `ptr` up in its table and never dereferences it, so any pointer is
    // safe to pass: the function need not be unsafe.
    #[allow(clippy::not_unsafe_ptr_arg_deref)]
    pub fn allocation_info(&self, ptr: *const c_void) -> Result<(usize, Device)> {
        let (mut bytes, mut device): (usize, c_int) = (0, 0);
        // SAFETY: the pool is live; the library only looks `ptr` up, it does not dereference it;
        // the out-pointers are valid.
        check(unsafe { sys::gpupool_allocation_info(self.as_raw(), ptr, &mut bytes, &mut device) })?;
        Ok((bytes, Device::from_id(device)))
    }

    // ---- figures ------------------------------------------------------------------------------

    /// The pool's figures for `device`.
    pub fn stats(&self, device: Device) -> Result<Stats> {
        self.stats_of(device.id())
    }

    /// The pool's figures summed over every device it has used.
    pub fn total_stats(&self) -> Result<Stats> {
        self.stats_of(sys::GPUPOOL_ALL_DEVICES)
    }

    fn stats_of(&self, device: c_int) -> Result<Stats> {
        let mut raw = Stats::raw_for_query();
        // SAFETY: the pool is live; `raw` has struct_size set to its own size.
        check(unsafe { sys::gpupool_get_stats(self.as_raw(), device, &mut raw) })?;
        Ok(Stats::from(raw))
    }

    /// Resets `device`'s peak figures to their current values.
    pub fn reset_peaks(&self, device: Device) -> Result<()> {
        // SAFETY: the pool is live.
        check(unsafe { sys::gpupool_reset_peaks(self.as_raw(), device.id()) })
    }

    /// The memory report of `device` as JSON (docs/pool.md): a `"devices"` array with each
    /// device's memory, limit, pressure, pool figures, fragmentation and recommendations.
    pub fn report_json(&self, device: Device) -> Result<String> {
        let mut capacity = self.report_size(device)?;
        loop {
            let mut buffer = vec![0 as c_char; capacity];
            let mut needed = 0usize;
            // SAFETY: the pool is live; `buffer` has `capacity` writable bytes; `needed` is a
            // valid out-pointer.
            let status = unsafe {
                sys::gpupool_report_json(
                    self.as_raw(),
                    device.id(),
                    buffer.as_mut_ptr(),
                    capacity,
                    &mut needed,
                )
            };
            // Other threads' allocations may have grown the report since the size query: the
            // library then refuses the buffer and says how much it takes now.
            if status == sys::GPUPOOL_INVALID_INPUT && needed > capacity {
                capacity = needed;
                continue;
            }
            check(status)?;
            // SAFETY: on success the library wrote a NUL-terminated string into `buffer`.
            let json = unsafe { CStr::from_ptr(buffer.as_ptr()) };
            return Ok(json.to_string_lossy().into_owned());
        }
    }

    /// The bytes (with the NUL) the report of `device` takes now.
    fn report_size(&self, device: Device) -> Result<usize> {
        let mut needed = 0usize;
        // SAFETY: the pool is live; capacity 0 is the size query, which writes only `needed`.
        check(unsafe {
            sys::gpupool_report_json(self.as_raw(), device.id(), ptr::null_mut(), 0, &mut needed)
        })?;
        Ok(needed)
    }

    // ---- control ------------------------------------------------------------------------------

    /// Gives cached blocks of `device` back until at most `keep_bytes` stay cached; returns the
    /// bytes given back.
    pub fn trim(&self, device: Device, keep_bytes: usize) -> Result<usize> {
        let mut released = 0usize;
        // SAFETY: the pool is live; `released` is a valid out-pointer.
        check(unsafe { sys::gpupool_trim(self.as_raw(), device.id(), keep_bytes, &mut released) })?;
        Ok(released)
    }

    /// Waits for `device`'s pending frees (blocks freed on another stream than their own), then
    /// gives every cached block back to the device; returns the bytes given back. Live buffers
    /// are never touched.
    pub fn emergency_cleanup(&self, device: Device) -> Result<usize> {
        self.cleanup_of(device.id())
    }

    /// [`GpuMemoryPool::emergency_cleanup`] on every device the pool has used.
    pub fn emergency_cleanup_all(&self) -> Result<usize> {
        self.cleanup_of(sys::GPUPOOL_ALL_DEVICES)
    }

    fn cleanup_of(&self, device: c_int) -> Result<usize> {
        let mut released = 0usize;
        // SAFETY: the pool is live; `released` is a valid out-pointer.
        check(unsafe { sys::gpupool_cleanup(self.as_raw(), device, &mut released) })?;
        Ok(released)
    }

    /// Sets the pool's hard limit for `device` in bytes ([`NO_LIMIT`](crate::NO_LIMIT): the
    /// device's memory). Allocations that would pass it fail with
    /// [`ErrorKind::PoolLimitExceeded`]. A limit below what is in use is allowed: allocations then
    /// fail until enough is freed. 0 is [`ErrorKind::InvalidInput`].
    pub fn set_max_pool_size(&self, device: Device, bytes: usize) -> Result<()> {
        // SAFETY: the pool is live.
        check(unsafe { sys::gpupool_set_limit(self.as_raw(), device.id(), bytes) })
    }

    /// The pool's hard limit for `device` in bytes; [`NO_LIMIT`](crate::NO_LIMIT) when none was
    /// set (the device's memory bounds it).
    pub fn max_pool_size(&self, device: Device) -> Result<usize> {
        let mut bytes = 0usize;
        // SAFETY: the pool is live; `bytes` is a valid out-pointer.
        check(unsafe { sys::gpupool_get_limit(self.as_raw(), device.id(), &mut bytes) })?;
        Ok(bytes)
    }

    /// Sets the soft cap on cached bytes for `device` ([`NO_LIMIT`](crate::NO_LIMIT): none).
    pub fn set_max_cached_bytes(&self, device: Device, bytes: usize) -> Result<()> {
        // SAFETY: the pool is live.
        check(unsafe { sys::gpupool_set_cache_limit(self.as_raw(), device.id(), bytes) })
    }

    /// `device`'s memory pressure: reserved bytes (in use + cached) / the hard limit (else the
    /// device's memory), in [0, 1].
    pub fn memory_pressure(&self, device: Device) -> Result<f64> {
        let mut pressure = 0.0;
        // SAFETY: the pool is live; `pressure` is a valid out-pointer.
        check(unsafe { sys::gpupool_pressure(self.as_raw(), device.id(), &mut pressure) })?;
        Ok(pressure)
    }

    // ---- pressure observers -------------------------------------------------------------------

    /// Calls `observer(device_id, pressure)` whenever a device's pressure crosses `threshold`
    /// (in (0, 1]) upwards, on the thread whose allocation crossed it. The closure is kept until
    /// [`GpuMemoryPool::remove_pressure_observer`] or until the last clone of this
    /// `GpuMemoryPool` drops. A panic in it is caught (the panic hook reports it) so that it
    /// cannot unwind into the library.
    pub fn add_pressure_observer(&self, threshold: f64, observer: PressureObserver) -> Result<ObserverId> {
        let token = observer::register(observer);
        let mut id = 0u64;
        // SAFETY: the pool is live; the trampoline only uses `user_data` as a table key; `id` is
        // a valid out-pointer.
        let status = unsafe {
            sys::gpupool_add_pressure_observer(
                self.as_raw(),
                threshold,
                Some(observer::trampoline),
                token.as_user_data(),
                &mut id,
            )
        };
        if let Err(error) = check(status) {
            observer::unregister(token);
            return Err(error);
        }
        self.observers().insert(ObserverId(id), token);
        Ok(ObserverId(id))
    }

    /// Removes an observer added through this pool (or a clone), and drops its closure once any
    /// call of it running on another thread has returned. [`ErrorKind::InvalidInput`] for an id
    /// this pool's handles did not add or already removed.
    pub fn remove_pressure_observer(&self, id: ObserverId) -> Result<()> {
        let token = self.observers().remove(&id).ok_or_else(|| {
            GpuError::new(
                ErrorKind::InvalidInput,
                format!(
                    "pressure observer {} was not added through this pool, or was already removed",
                    id.0
                ),
            )
        })?;
        self.shared.remove_observer(id, token)
    }

    fn observers(&self) -> MutexGuard<'_, HashMap<ObserverId, Token>> {
        // The map stays consistent even if a holder panicked: each operation is one call.
        self.shared
            .observers
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl PoolHandle {
    /// Unregisters `id` from the C pool, then drops its closure from the table.
    fn remove_observer(&self, id: ObserverId, token: Token) -> Result<()> {
        // SAFETY: the pool is live while `self` exists.
        let removed = check(unsafe { sys::gpupool_remove_pressure_observer(self.raw.as_ptr(), id.0) });
        // Even if the C call failed, later calls of the trampoline find no closure: safe.
        observer::unregister(token);
        removed
    }
}

impl Drop for PoolHandle {
    fn drop(&mut self) {
        // Other owners of the C pool (C code, allocator hooks) may keep it alive: its observers
        // must not outlive the closures this handle keeps.
        let observers = std::mem::take(self.observers.get_mut().unwrap_or_else(|p| p.into_inner()));
        for (id, token) in observers {
            let _ = self.remove_observer(id, token);
        }
        // SAFETY: this handle owns one reference of the pool, released exactly once here.
        unsafe { sys::gpupool_pool_release(self.raw.as_ptr()) };
    }
}

impl fmt::Debug for GpuMemoryPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuMemoryPool")
            .field("raw", &self.shared.raw)
            .finish()
    }
}

impl PartialEq for GpuMemoryPool {
    /// Handles to the same C pool.
    fn eq(&self, other: &GpuMemoryPool) -> bool {
        self.shared.raw == other.shared.raw
    }
}

impl Eq for GpuMemoryPool {}

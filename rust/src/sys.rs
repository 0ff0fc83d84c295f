//! Raw declarations of `include/gpupool/gpupool.h`, written by hand to match it field for field.
//!
//! Everything here is `unsafe` to call and follows the C conventions: a [`gpupool_status`] per
//! call, the message in [`gpupool_last_error`] on the calling thread, caller-owned out-pointers.
//! The safe API of this crate is built on these; use them only to hand pools or pointers to
//! other C code.
#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_double, c_int, c_void};

/// `gpupool_status`. Kept as a plain `c_int` rather than a Rust enum: a value this crate does not
/// know (from a newer library) must not be undefined behaviour.
pub type gpupool_status = c_int;

/// Success.
pub const GPUPOOL_OK: gpupool_status = 0;
/// An argument is wrong: the message names it.
pub const GPUPOOL_INVALID_INPUT: gpupool_status = 1;
/// The device could not provide the bytes.
pub const GPUPOOL_OUT_OF_MEMORY: gpupool_status = 2;
/// The pool's own hard limit for the device would be passed.
pub const GPUPOOL_POOL_LIMIT_EXCEEDED: gpupool_status = 3;
/// No such device, or a build without its backend.
pub const GPUPOOL_DEVICE_UNAVAILABLE: gpupool_status = 4;
/// A CUDA error other than out-of-memory.
pub const GPUPOOL_CUDA_ERROR: gpupool_status = 5;
/// Not for this device or build.
pub const GPUPOOL_UNSUPPORTED: gpupool_status = 6;
/// Valid, but not now: a foreign or double free.
pub const GPUPOOL_INVALID_STATE: gpupool_status = 7;
/// A bug in gpupool.
pub const GPUPOOL_INTERNAL_ERROR: gpupool_status = 8;

/// `GPUPOOL_ALL_DEVICES`: every device a call may span.
pub const GPUPOOL_ALL_DEVICES: c_int = -1;
/// `GPUPOOL_NO_LIMIT` (`SIZE_MAX`).
pub const GPUPOOL_NO_LIMIT: usize = usize::MAX;
/// `GPUPOOL_ALIGNMENT`: every block is aligned to this many bytes.
pub const GPUPOOL_ALIGNMENT: usize = 256;

/// The opaque, reference-counted pool.
#[repr(C)]
pub struct gpupool_pool {
    _opaque: [u8; 0],
    // Not Send, Sync or Unpin by itself: only the safe wrapper decides what is shareable.
    _marker: std::marker::PhantomData<(*mut u8, std::marker::PhantomPinned)>,
}

/// `gpupool_config`: fill with [`gpupool_config_init`] before changing fields.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct gpupool_config {
    /// `sizeof(gpupool_config)`.
    pub struct_size: usize,
    /// Hard limit per device, bytes; `GPUPOOL_NO_LIMIT` = the device's memory.
    pub max_pool_size: usize,
    /// Soft cap on cached bytes per device; `GPUPOOL_NO_LIMIT` = none.
    pub max_cached_bytes: usize,
    /// Bytes reserved on each device at its first use.
    pub initial_reservation: usize,
    /// 0: pass-through, every free goes back to the device.
    pub caching: c_int,
    /// Reserved / limit at which the cache is trimmed, in (0, 1].
    pub critical_pressure: c_double,
    /// Where large blocks come from: `GPUPOOL_SEGMENTS_*` (0 device, above 64 KiB; 1 virtual, above
    /// 4 KiB; 2 none).
    pub segments: c_int,
}

/// `gpupool_stats`: set `struct_size` before passing it to [`gpupool_get_stats`].
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct gpupool_stats {
    /// `sizeof(gpupool_stats)`.
    pub struct_size: usize,
    /// Blocks of live allocations.
    pub in_use_bytes: usize,
    /// What live allocations asked for.
    pub requested_bytes: usize,
    /// Freed blocks kept for reuse.
    pub cached_bytes: usize,
    /// In use + cached: what the pool holds from the device.
    pub reserved_bytes: usize,
    /// Highest `in_use_bytes` since creation or the last peak reset.
    pub peak_in_use_bytes: usize,
    /// Highest `reserved_bytes` since creation or the last peak reset.
    pub peak_reserved_bytes: usize,
    /// Cached, but in segments live blocks still use.
    pub stranded_bytes: usize,
    /// Allocations served.
    pub allocations: u64,
    /// Frees.
    pub frees: u64,
    /// Allocations served from the cache.
    pub cache_hits: u64,
    /// Allocations asked of the device.
    pub device_allocations: u64,
    /// Blocks given back to the device.
    pub device_frees: u64,
    /// Allocations that failed for lack of memory.
    pub out_of_memory_errors: u64,
    /// Allocations not yet freed.
    pub live_allocations: u64,
}

/// `gpupool_pressure_callback`: called on the allocating thread when a device's pressure crosses
/// the observer's threshold upwards.
pub type gpupool_pressure_callback =
    Option<unsafe extern "C" fn(device: c_int, pressure: c_double, user_data: *mut c_void)>;

extern "C" {
    /// The message of this thread's last failed call ("" after a successful one); valid until
    /// this thread's next gpupool call.
    pub fn gpupool_last_error() -> *const c_char;
    /// A static name of `status`.
    pub fn gpupool_status_name(status: gpupool_status) -> *const c_char;

    /// Opens `"cuda"`, `"cuda:N"`, `"sim"`, `"sim:SIZE"` or `"auto"` (NULL: `GPUPOOL_DEVICE`, else
    /// `"auto"`) and stores its id.
    pub fn gpupool_device_open(spec: *const c_char, device: *mut c_int) -> gpupool_status;
    /// The device's free and total bytes.
    pub fn gpupool_device_memory(
        device: c_int,
        free_bytes: *mut usize,
        total_bytes: *mut usize,
    ) -> gpupool_status;
    /// A stream of `device` that gpupool makes and owns.
    pub fn gpupool_stream_create(device: c_int, stream: *mut *mut c_void) -> gpupool_status;
    /// Destroys a stream made by [`gpupool_stream_create`].
    pub fn gpupool_stream_destroy(device: c_int, stream: *mut c_void) -> gpupool_status;
    /// Waits for the work queued on `stream`.
    pub fn gpupool_stream_synchronize(device: c_int, stream: *mut c_void) -> gpupool_status;

    /// Fills `config` with the defaults, `struct_size` set.
    pub fn gpupool_config_init(config: *mut gpupool_config);
    /// Makes a pool (one reference) from `config` (NULL: defaults).
    pub fn gpupool_pool_create(config: *const gpupool_config, pool: *mut *mut gpupool_pool)
        -> gpupool_status;
    /// Makes a pool (one reference) from `GPUPOOL_MEMORY_LIMIT`, `GPUPOOL_CACHE_LIMIT`, `GPUPOOL_POOL`.
    pub fn gpupool_pool_create_from_environment(pool: *mut *mut gpupool_pool) -> gpupool_status;
    /// Adds a reference; returns `pool`.
    pub fn gpupool_pool_retain(pool: *mut gpupool_pool) -> *mut gpupool_pool;
    /// Drops a reference; the last one destroys the pool.
    pub fn gpupool_pool_release(pool: *mut gpupool_pool);

    /// `bytes` (at least 1) on `device`, ordered on `stream`.
    pub fn gpupool_allocate(
        pool: *mut gpupool_pool,
        device: c_int,
        bytes: usize,
        stream: *mut c_void,
        ptr: *mut *mut c_void,
    ) -> gpupool_status;
    /// As [`gpupool_allocate`], refusing alignments above [`GPUPOOL_ALIGNMENT`] or not a power of two.
    pub fn gpupool_allocate_aligned(
        pool: *mut gpupool_pool,
        device: c_int,
        bytes: usize,
        alignment: usize,
        stream: *mut c_void,
        ptr: *mut *mut c_void,
    ) -> gpupool_status;
    /// Frees `ptr` (from this pool), ordered on `stream`. On the allocation's own stream the block
    /// is reusable at once by work ordered after the free on that stream (and by other streams
    /// once that work has finished). On another stream the block waits until the work queued on
    /// `stream` before the free has finished, then returns to the allocation stream's cache.
    /// NULL `ptr` is a no-op.
    pub fn gpupool_deallocate(
        pool: *mut gpupool_pool,
        ptr: *mut c_void,
        stream: *mut c_void,
    ) -> gpupool_status;
    /// Declares that `ptr` is also used by work on `stream`.
    pub fn gpupool_record_stream(
        pool: *mut gpupool_pool,
        ptr: *mut c_void,
        stream: *mut c_void,
    ) -> gpupool_status;
    /// The bytes `ptr` was allocated with and its device.
    pub fn gpupool_allocation_info(
        pool: *mut gpupool_pool,
        ptr: *const c_void,
        bytes: *mut usize,
        device: *mut c_int,
    ) -> gpupool_status;

    /// One device's figures, or [`GPUPOOL_ALL_DEVICES`] for the sums; `stats->struct_size` must be set.
    pub fn gpupool_get_stats(
        pool: *mut gpupool_pool,
        device: c_int,
        stats: *mut gpupool_stats,
    ) -> gpupool_status;
    /// Resets the device's peak figures.
    pub fn gpupool_reset_peaks(pool: *mut gpupool_pool, device: c_int) -> gpupool_status;
    /// The memory report as JSON into `buffer`; `*needed` gets its size with the NUL; capacity 0
    /// is the size query.
    pub fn gpupool_report_json(
        pool: *mut gpupool_pool,
        device: c_int,
        buffer: *mut c_char,
        capacity: usize,
        needed: *mut usize,
    ) -> gpupool_status;
    /// Gives cached blocks back until at most `keep_bytes` stay cached; `released` may be NULL.
    pub fn gpupool_trim(
        pool: *mut gpupool_pool,
        device: c_int,
        keep_bytes: usize,
        released: *mut usize,
    ) -> gpupool_status;
    /// Waits for pending frees, then gives every cached block back.
    pub fn gpupool_cleanup(pool: *mut gpupool_pool, device: c_int, released: *mut usize) -> gpupool_status;
    /// Sets the device's hard limit ([`GPUPOOL_NO_LIMIT`]: the device's memory).
    pub fn gpupool_set_limit(pool: *mut gpupool_pool, device: c_int, bytes: usize) -> gpupool_status;
    /// The device's hard limit ([`GPUPOOL_NO_LIMIT`] if unset).
    pub fn gpupool_get_limit(pool: *mut gpupool_pool, device: c_int, bytes: *mut usize) -> gpupool_status;
    /// Sets the device's soft cap on cached bytes ([`GPUPOOL_NO_LIMIT`]: none).
    pub fn gpupool_set_cache_limit(pool: *mut gpupool_pool, device: c_int, bytes: usize) -> gpupool_status;
    /// The device's reserved bytes / limit.
    pub fn gpupool_pressure(
        pool: *mut gpupool_pool,
        device: c_int,
        pressure: *mut c_double,
    ) -> gpupool_status;
    /// Registers `callback(device, pressure, user_data)` for upward crossings of `threshold`.
    pub fn gpupool_add_pressure_observer(
        pool: *mut gpupool_pool,
        threshold: c_double,
        callback: gpupool_pressure_callback,
        user_data: *mut c_void,
        id: *mut u64,
    ) -> gpupool_status;
    /// Unregisters an observer (a call already running may still finish).
    pub fn gpupool_remove_pressure_observer(pool: *mut gpupool_pool, id: u64) -> gpupool_status;

    /// The process pool, borrowed: do not release it.
    pub fn gpupool_process_pool(pool: *mut *mut gpupool_pool) -> gpupool_status;

    /// PyTorch's pluggable-allocator malloc over the process pool (NULL on failure).
    pub fn gpupool_torch_malloc(bytes: usize, device: c_int, stream: *mut c_void) -> *mut c_void;
    /// PyTorch's pluggable-allocator free over the process pool.
    pub fn gpupool_torch_free(ptr: *mut c_void, bytes: usize, device: c_int, stream: *mut c_void);
}

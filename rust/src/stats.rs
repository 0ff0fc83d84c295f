//! [`Stats`]: a pool's figures for one device or for all of them.
use crate::sys;

/// A snapshot of a pool's figures (`gpupool_stats`): bytes, counts and peaks, for one device or
/// summed over all devices the pool has used.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Bytes of the blocks of live allocations (each request rounded up to its block).
    pub in_use_bytes: usize,
    /// Bytes live allocations asked for.
    pub requested_bytes: usize,
    /// Bytes of freed blocks kept for reuse.
    pub cached_bytes: usize,
    /// In use + cached: what the pool holds from the device.
    pub reserved_bytes: usize,
    /// Highest `in_use_bytes` since the pool was made or its peaks reset.
    pub peak_in_use_bytes: usize,
    /// Highest `reserved_bytes` since the pool was made or its peaks reset.
    pub peak_reserved_bytes: usize,
    /// Cached bytes in segments that live blocks still use (cannot go back to the device).
    pub stranded_bytes: usize,
    /// Allocations served, ever.
    pub allocations: u64,
    /// Frees, ever.
    pub frees: u64,
    /// Allocations served from the cache.
    pub cache_hits: u64,
    /// Allocations the pool asked the device for.
    pub device_allocations: u64,
    /// Blocks the pool gave back to the device.
    pub device_frees: u64,
    /// Allocations that failed for lack of memory.
    pub out_of_memory_errors: u64,
    /// Allocations not yet freed.
    pub live_allocations: u64,
}

impl Stats {
    /// An empty C struct with `struct_size` set, to be filled by `gpupool_get_stats`.
    pub(crate) fn raw_for_query() -> sys::gpupool_stats {
        sys::gpupool_stats {
            struct_size: std::mem::size_of::<sys::gpupool_stats>(),
            ..Default::default()
        }
    }
}

impl From<sys::gpupool_stats> for Stats {
    fn from(raw: sys::gpupool_stats) -> Stats {
        Stats {
            in_use_bytes: raw.in_use_bytes,
            requested_bytes: raw.requested_bytes,
            cached_bytes: raw.cached_bytes,
            reserved_bytes: raw.reserved_bytes,
            peak_in_use_bytes: raw.peak_in_use_bytes,
            peak_reserved_bytes: raw.peak_reserved_bytes,
            stranded_bytes: raw.stranded_bytes,
            allocations: raw.allocations,
            frees: raw.frees,
            cache_hits: raw.cache_hits,
            device_allocations: raw.device_allocations,
            device_frees: raw.device_frees,
            out_of_memory_errors: raw.out_of_memory_errors,
            live_allocations: raw.live_allocations,
        }
    }
}

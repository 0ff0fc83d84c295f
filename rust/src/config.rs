//! [`Config`]: how a new [`GpuMemoryPool`](crate::GpuMemoryPool) caches and limits memory.
use std::ffi::c_int;
use std::mem::MaybeUninit;

use crate::sys;

/// The settings of a new pool: a builder over `gpupool_config`, starting from the library's
/// defaults (`gpupool_config_init`). Values are checked when the pool is made
/// ([`GpuMemoryPool::new`](crate::GpuMemoryPool::new)), which names the wrong one.
///
/// ```
/// use gpupool::{Config, NO_LIMIT};
/// let config = Config::new().max_pool_size(1 << 30).max_cached_bytes(NO_LIMIT).caching(true);
/// assert_eq!(config.as_raw().max_pool_size, 1 << 30);
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Config {
    raw: sys::gpupool_config,
}

impl Config {
    /// The library's defaults: no limits but the device's memory, caching on.
    pub fn new() -> Config {
        let mut raw = MaybeUninit::<sys::gpupool_config>::uninit();
        // SAFETY: gpupool_config_init writes every field of the struct (it assigns a whole
        // zeroed struct first), so it is initialized afterwards.
        let raw = unsafe {
            sys::gpupool_config_init(raw.as_mut_ptr());
            raw.assume_init()
        };
        Config { raw }
    }

    /// Hard limit per device in bytes; [`NO_LIMIT`](crate::NO_LIMIT) means the device's memory.
    pub fn max_pool_size(mut self, bytes: usize) -> Config {
        self.raw.max_pool_size = bytes;
        self
    }

    /// Soft cap on the cached (freed, kept for reuse) bytes per device;
    /// [`NO_LIMIT`](crate::NO_LIMIT) means none.
    pub fn max_cached_bytes(mut self, bytes: usize) -> Config {
        self.raw.max_cached_bytes = bytes;
        self
    }

    /// Bytes reserved on each device at its first use.
    pub fn initial_reservation(mut self, bytes: usize) -> Config {
        self.raw.initial_reservation = bytes;
        self
    }

    /// Whether freed blocks are kept for reuse; `false` makes the pool a pass-through in which
    /// every free goes back to the device.
    pub fn caching(mut self, enabled: bool) -> Config {
        self.raw.caching = c_int::from(enabled);
        self
    }

    /// The pressure (reserved / limit, in (0, 1]) at which the pool trims its cache.
    pub fn critical_pressure(mut self, fraction: f64) -> Config {
        self.raw.critical_pressure = fraction;
        self
    }

    /// Blocks above 4 KiB from virtual segments (pages mapped as blocks touch them, given back
    /// from anywhere in free space) instead of device segments.
    pub fn virtual_segments(mut self, enabled: bool) -> Config {
        self.raw.segments = if enabled { 1 } else { 0 };
        self
    }

    /// The C struct, `struct_size` set, for `gpupool_pool_create`.
    pub fn as_raw(&self) -> &sys::gpupool_config {
        &self.raw
    }
}

impl Default for Config {
    /// Same as [`Config::new`].
    fn default() -> Config {
        Config::new()
    }
}
